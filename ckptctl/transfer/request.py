"""What a transfer was asked to do, resolved once from the flags, with every rule that ties
flags together (before anything starts). The pipeline reads typed fields, never the flags'
strings; the enums are str-valued, so a JSON result shows the same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME
from ckptctl.errors import InvalidInput, UsageError
from ckptctl.settings import (
    P2P,
    PAUSE_MODES,
    ROUND_TRIP,
    VERIFY,
    PauseMode,
    RegisterMode,
    ServerKind,
    Setting,
    SplitMode,
    UpdateMethod,
    Verify,
)

if TYPE_CHECKING:
    from ckptctl.job.groups import ServerTargets


@dataclass(frozen=True)
class TransferRequest:
    """One transfer into the inference servers, as the flags asked for it."""

    servers: ServerTargets
    checkpoint_path: str | None = None  # None: join (the weights come from a metas file)
    checkpoint_name: str = DEFAULT_CHECKPOINT_NAME
    split: SplitMode = SplitMode.auto
    register_mode: RegisterMode = RegisterMode.direct
    read_threads: int | None = None  # direct registration's reader threads (None: from cores)
    update_method: UpdateMethod = UpdateMethod.broadcast
    verify: tuple[Verify, ...] = ()  # the ways the flags accept; () for none
    timeout: float = 600.0
    timeout_setting: Setting = Setting.timeout  # what an error tells to raise (serve: per push)
    pause: PauseMode = PauseMode.none  # the servers' generation around the push (pausing.py)

    def for_push(
        self,
        path: str,
        name: str,
        *,
        weight_version: str | None,
        consume: bool,
        verify: bool,
        pause: PauseMode | None = None,
    ) -> TransferRequest:
        """A serve push: this job's request with the push's checkpoint and flags (pause: the
        push's own --pause, else the job's)."""
        mode = RegisterMode.consume if consume else self.register_mode
        mode, split = registration(path, mode, self.split)
        servers = self.servers
        if weight_version is not None:
            servers = replace(servers, weight_version=weight_version)
        return replace(
            self,
            servers=servers,
            checkpoint_path=path,
            checkpoint_name=name,
            split=split,
            register_mode=mode,
            verify=VERIFY if verify else (),
            pause=pause or self.pause,
        )


# The server flags every command has: --endpoint, --uds, --api-key, --engine and
# --inference-parallel-size.
ServerFlags = tuple[Sequence[str] | None, Sequence[str] | None, str | None, ServerKind, int]


def resolve(
    server: ServerFlags,
    *,
    weight_version: str | None = None,
    consume: bool = False,
    drop_page_cache: bool = False,
    **fields: Any,
) -> TransferRequest:
    """The request the flags of update, join or serve make (`fields`: TransferRequest's); a
    usage error (exit 2) for flags that cannot go together."""
    from ckptctl.job.groups import ServerTargets

    if (
        drop_page_cache
        and fields.get("register_mode", RegisterMode.direct) is not RegisterMode.direct
    ):
        raise UsageError(
            "--drop-page-cache needs --register-mode direct (checkpoint-engine's copy reads "
            "through the file mapping)"
        )
    check_pause(fields.get("pause", PauseMode.none), server[3])
    req = TransferRequest(ServerTargets.from_flags(*server, weight_version), **fields)
    if consume:
        req = replace(req, register_mode=RegisterMode.consume)
    if req.checkpoint_path is None:
        return req
    mode, split = registration(req.checkpoint_path, req.register_mode, req.split)
    return replace(req, register_mode=mode, split=split)


def check_pause(mode: PauseMode, engine: ServerKind | None, flag: str = "--pause") -> None:
    """A usage error (exit 2, before anything is sent) for a mode the server's kind lacks."""
    modes = PAUSE_MODES[engine] if engine is not None else (PauseMode.none,)
    if mode not in modes:
        raise UsageError(
            f"{flag} {mode} is not one of {engine or 'this job'}'s pause modes: "
            f"{', '.join(m.value for m in modes)}"
        )


def registration(path: str, mode: RegisterMode, split: SplitMode) -> tuple[RegisterMode, SplitMode]:
    """--consume-shm-files takes only files under /dev/shm, whole files per rank."""
    if mode is not RegisterMode.consume:
        return mode, split
    from ckptctl.checkpoint.consume import check_consume

    check_consume(path, split)
    return mode, SplitMode.files


def verify_ways(
    *, verify: bool, round_trip: bool, reset_confirmed: bool, engine: ServerKind
) -> tuple[Verify, ...]:
    """What --verify / --verify-round-trip ask for; a usage error for what cannot work."""
    if reset_confirmed and not round_trip:
        raise UsageError("--reset-served-weights only goes with --verify-round-trip")
    if not (verify or round_trip):
        return ()
    if verify and round_trip:
        raise UsageError("give one of --verify and --verify-round-trip, not both")
    if engine != "sglang":
        raise UsageError(
            "--verify needs --engine sglang: vLLM has no released weights checker "
            "(vllm-project/vllm#52689 proposes one)"
        )
    if round_trip and not reset_confirmed:
        raise UsageError(
            "--verify-round-trip overwrites the served weights with random values before the "
            "update (SGLang's reset_tensors), so the server answers garbage until the update "
            "lands, and keeps doing so if it fails. Use it only on a server started from this "
            "checkpoint, and confirm with --reset-served-weights"
        )
    return ROUND_TRIP if round_trip else VERIFY


def check_update_flags(
    *,
    checkpoint_path: object | None,
    load_metas_file: object | None,
    save_metas_file: object | None,
    dry_run: bool,
    verify: bool,
    round_trip: bool,
    reset_confirmed: bool,
    engine: ServerKind,
    world_size: int | None,
    nproc_per_node: int | None,
    under_torchrun: bool,
) -> tuple[Verify, ...]:
    """`update`'s own rules (a join with --load-metas-file, a dry run); the --verify ways."""
    if load_metas_file is not None and (dry_run or save_metas_file is not None):
        raise UsageError(
            "--load-metas-file (join) goes with neither --dry-run nor --save-metas-file"
        )
    if load_metas_file is None and checkpoint_path is None:
        raise UsageError("--checkpoint-path is required (or --load-metas-file, to join)")
    ways = verify_ways(
        verify=verify, round_trip=round_trip, reset_confirmed=reset_confirmed, engine=engine
    )
    if ways and dry_run:
        raise UsageError("--verify and --verify-round-trip go with an update, not --dry-run")
    if ways == ROUND_TRIP and load_metas_file is not None:
        raise UsageError("--verify-round-trip goes with an update from files, not a join")
    if load_metas_file is None and not dry_run and not under_torchrun:
        for flag, value in (("--world-size", world_size), ("--nproc-per-node", nproc_per_node)):
            if value is not None:
                raise UsageError(
                    f"{flag} only goes with --dry-run: start one rank per GPU with torchrun"
                )
    return ways


def p2p_for_update(method: UpdateMethod, *, save_metas: bool, missing: str | None) -> P2P:
    """Whether an update's parameter server starts the p2p store (`missing`: why it cannot
    work here, ce/p2p.p2p_missing). Broadcast never touches it, unless the metas
    being saved should be joinable."""
    if method.uses_p2p:
        if missing:
            raise InvalidInput(
                f"--update-method {method} needs checkpoint-engine's p2p store: "
                f"{missing}; use --update-method broadcast"
            )
        return P2P.required
    return P2P.optional if save_metas and missing is None else P2P.off


def check_join_p2p(missing: str | None) -> None:
    if missing:
        raise InvalidInput(f"join pulls weights over p2p, which cannot start here: {missing}")
