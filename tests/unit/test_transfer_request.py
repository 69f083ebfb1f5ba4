"""The typed request (ckptctl/transfer/request.py): each cross-flag rule refuses with its one
error line and exit code, and what the flags resolve to is typed, printing as the flags' words."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckptctl.errors import CkptctlError, ExitCode
from ckptctl.settings import P2P, ROUND_TRIP, VERIFY, RegisterMode, Setting, UpdateMethod, Verify
from ckptctl.transfer.request import (
    check_join_p2p,
    check_update_flags,
    p2p_for_update,
    resolve,
    verify_ways,
)

SERVER = (None, None, None, "sglang", 1)
UPDATE = {
    "checkpoint_path": "/ckpt",
    "load_metas_file": None,
    "save_metas_file": None,
    "dry_run": False,
    "verify": False,
    "round_trip": False,
    "reset_confirmed": False,
    "engine": "sglang",
    "world_size": None,
    "nproc_per_node": None,
    "under_torchrun": True,
}


def refused(call: Any, code: ExitCode, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(CkptctlError) as info:
        call(*args, **kwargs)
    assert info.value.exit_code == code
    return str(info.value)


def ways(**kw: Any) -> Any:
    return verify_ways(**{"verify": False, "round_trip": False, "reset_confirmed": False,
                          "engine": "sglang", **kw})  # fmt: skip


def update_flags(**kw: Any) -> Any:
    return check_update_flags(**{**UPDATE, **kw})


def test_reset_served_weights_needs_the_round_trip() -> None:
    line = refused(ways, ExitCode.USAGE, verify=True, reset_confirmed=True)
    assert line == "--reset-served-weights only goes with --verify-round-trip"


def test_verify_and_the_round_trip_are_one_or_the_other() -> None:
    line = refused(ways, ExitCode.USAGE, verify=True, round_trip=True, reset_confirmed=True)
    assert line == "give one of --verify and --verify-round-trip, not both"


def test_verify_needs_sglang() -> None:
    line = refused(ways, ExitCode.USAGE, verify=True, engine="vllm")
    assert line.startswith("--verify needs --engine sglang: vLLM has no released weights checker")


def test_the_round_trip_must_be_confirmed() -> None:
    line = refused(ways, ExitCode.USAGE, round_trip=True)
    assert line.startswith("--verify-round-trip overwrites the served weights")
    assert line.endswith("confirm with --reset-served-weights")


def test_the_verify_flags_resolve_to_the_ways_they_accept() -> None:
    assert ways() == ()
    assert ways(verify=True) == VERIFY == (Verify.checksum, Verify.per_server)
    assert ways(round_trip=True, reset_confirmed=True) == ROUND_TRIP


def test_a_join_goes_with_neither_a_dry_run_nor_save_metas() -> None:
    for extra in ({"dry_run": True}, {"save_metas_file": "/m.json"}):
        line = refused(update_flags, ExitCode.USAGE, load_metas_file="/m.json", **extra)
        assert line == "--load-metas-file (join) goes with neither --dry-run nor --save-metas-file"


def test_update_needs_a_checkpoint_or_a_metas_file() -> None:
    line = refused(update_flags, ExitCode.USAGE, checkpoint_path=None)
    assert line == "--checkpoint-path is required (or --load-metas-file, to join)"


def test_verify_goes_with_an_update_not_a_dry_run() -> None:
    line = refused(update_flags, ExitCode.USAGE, verify=True, dry_run=True)
    assert line == "--verify and --verify-round-trip go with an update, not --dry-run"


def test_the_round_trip_goes_with_files_not_a_join() -> None:
    line = refused(
        update_flags,
        ExitCode.USAGE,
        checkpoint_path=None,
        load_metas_file="/m.json",
        round_trip=True,
        reset_confirmed=True,
    )
    assert line == "--verify-round-trip goes with an update from files, not a join"


def test_dry_run_flags_outside_torchrun_only_with_a_dry_run() -> None:
    for flag, kw in (
        ("--world-size", {"world_size": 2}),
        ("--nproc-per-node", {"nproc_per_node": 2}),
    ):
        line = refused(update_flags, ExitCode.USAGE, under_torchrun=False, **kw)
        assert line == f"{flag} only goes with --dry-run: start one rank per GPU with torchrun"
    assert update_flags(under_torchrun=False, world_size=2, dry_run=True) == ()


def test_weight_version_needs_sglang() -> None:
    line = refused(resolve, ExitCode.USAGE, (None, None, None, "vllm", 1), weight_version="v1")
    assert line == "--weight-version needs --engine sglang: vLLM records no weight version"


def test_consume_takes_files_in_dev_shm_only() -> None:
    line = refused(resolve, ExitCode.USAGE, SERVER, checkpoint_path="/tmp/ckpt", consume=True)
    assert line.startswith("--consume-shm-files pins and deletes files under /dev/shm only; ")


def test_consume_takes_whole_files() -> None:
    line = refused(
        resolve,
        ExitCode.USAGE,
        SERVER,
        checkpoint_path="/dev/shm/ckptctl-request-test",
        consume=True,
        split="tensors",
    )
    assert line == "--consume-shm-files registers whole files: use --split files (or auto)"


def test_consume_is_a_register_mode_split_by_files() -> None:
    req = resolve(SERVER, checkpoint_path="/dev/shm/ckptctl-request-test", consume=True)
    assert req.register_mode is RegisterMode.consume and req.split == "files"
    req = resolve(SERVER, checkpoint_path="/tmp/ckpt", register_mode=RegisterMode.ce_copy)
    assert req.register_mode is RegisterMode.ce_copy and req.split == "auto"


def test_drop_page_cache_needs_direct_registration() -> None:
    line = refused(
        resolve, ExitCode.USAGE, SERVER, register_mode=RegisterMode.ce_copy, drop_page_cache=True
    )
    assert line.startswith("--drop-page-cache needs --register-mode direct")


def test_a_p2p_update_method_needs_the_p2p_store() -> None:
    for method in (UpdateMethod.p2p, UpdateMethod.all):
        line = refused(
            p2p_for_update, ExitCode.INVALID_INPUT, method=method, save_metas=False, missing="no"
        )
        assert line == (
            f"--update-method {method.value} needs checkpoint-engine's p2p store: no; "
            "use --update-method broadcast"
        )


def test_the_p2p_store_is_required_optional_or_off() -> None:
    assert p2p_for_update(UpdateMethod.all, save_metas=False, missing=None) is P2P.required
    # broadcast: only metas being saved make it worth starting, and only where it can start
    assert p2p_for_update(UpdateMethod.broadcast, save_metas=True, missing=None) is P2P.optional
    assert p2p_for_update(UpdateMethod.broadcast, save_metas=True, missing="no") is P2P.off
    assert p2p_for_update(UpdateMethod.broadcast, save_metas=False, missing=None) is P2P.off


def test_join_needs_the_p2p_store() -> None:
    line = refused(check_join_p2p, ExitCode.INVALID_INPUT, missing="no RDMA device")
    assert line == "join pulls weights over p2p, which cannot start here: no RDMA device"
    check_join_p2p(None)


def test_a_serve_push_takes_its_own_checkpoint_and_flags() -> None:
    job = resolve(SERVER, weight_version=None, timeout=60, timeout_setting=Setting.push_timeout)
    flags = {"weight_version": "v2", "consume": True, "verify": True}
    push = job.for_push("/dev/shm/ckptctl-request-test", "push-3", **flags)
    assert push.register_mode is RegisterMode.consume and push.split == "files"
    assert push.servers.weight_version == "v2" and push.verify == VERIFY
    assert push.checkpoint_name == "push-3" and push.timeout_setting is Setting.push_timeout
    assert job.servers.weight_version is None and job.register_mode is RegisterMode.direct
    with pytest.raises(CkptctlError) as info:
        job.for_push("/tmp/ckpt", "push-4", **flags)
    assert info.value.exit_code == ExitCode.USAGE


def test_the_enums_print_and_serialise_as_the_flags_words() -> None:
    assert (
        f"{UpdateMethod.all} {RegisterMode.consume} {Verify.per_server}" == "all consume per-engine"
    )
    assert json.loads(json.dumps({"how": Verify.round_trip})) == {"how": "round-trip"}
    assert UpdateMethod.all.broadcasts and UpdateMethod.all.uses_p2p
    assert not UpdateMethod.p2p.broadcasts and not UpdateMethod.broadcast.uses_p2p
