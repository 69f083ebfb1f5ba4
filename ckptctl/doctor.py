"""`ckptctl doctor`: what a first run needs, checked one item at a time, each with its fix.

Which checks fail (exit 1) and which only warn is `ckptctl doctor --help`'s (the command's
docstring, ckptctl/cli/doctor.py): a check fails where `update`, `serve` or `join` cannot run
without it.

torch and checkpoint-engine are imported inside the checks that need them; the server checks
reuse the readiness probe (readiness.py) and --verify's capability probe (weights_checker.py), each
server's questions bounded together by one deadline.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptctl.errors import redact
from ckptctl.settings import ServerKind

if TYPE_CHECKING:  # (httpx stays out of the import until a server is asked about)
    from ckptctl.inference_server import ServerAddress

Status = Literal["ok", "warn", "fail"]

GIB = 1 << 30
MIB = 1 << 20
# Below this many open files a job with a large checkpoint (hundreds of shards per node, ZMQ
# and NCCL sockets, the serve job's control connections) can run out.
OPEN_FILES_WANTED = 4096
OPEN_FILES_ASKED = 65536  # what the fix line asks for, where the hard limit allows it
# NCCL between the ranks of a node keeps its buffers in /dev/shm; docker gives 64 MiB.
SHM_WANTED = 1 * GIB
INFINIBAND = "/sys/class/infiniband"
RDMA_SHOWN = 16  # devices named in one line
RDMA_ENV = ("PS_P2P_STORE_RDMA_DEVICES", "NCCL_IB_HCA")  # what checkpoint-engine reads


@dataclass(frozen=True)
class Check:
    """One line of the report. `fix` says what to do where the status is not ok."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    needed: bool = True  # a failure of it fails the command (else it only warns)
    extra: dict[str, Any] = field(default_factory=dict)  # for --json: uuid, endpoint...

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "needed": self.needed,
            "detail": redact(self.detail),
            "fix": redact(self.fix) if self.fix else None,
        }
        doc.update(self.extra)
        return doc


def ok(name: str, detail: str, *, needed: bool = True, **extra: Any) -> Check:
    return Check(name, "ok", detail, None, needed, extra)


def problem(name: str, detail: str, fix: str, *, needed: bool = True, **extra: Any) -> Check:
    """A check that did not pass: "fail" where it is needed, else "warn"."""
    return Check(name, "fail" if needed else "warn", detail, fix, needed, extra)


@dataclass(frozen=True)
class Report:
    checks: list[Check]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def summary(self) -> str:
        warned = len(self.warnings)
        warnings = f"{warned} warning" + ("" if warned == 1 else "s")
        if not self.failed:
            return f"every needed check passed ({warnings})"
        names = ", ".join(dict.fromkeys(c.name for c in self.failed))
        n = len(self.failed)
        return f"{n} needed check{'' if n == 1 else 's'} failed ({names}); {warnings}"

    def as_json(self) -> dict[str, Any]:
        return {
            "checks": [c.as_json() for c in self.checks],
            "failed": [c.name for c in self.failed],
            "warnings": [c.name for c in self.warnings],
        }


def size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


# -- this machine ----------------------------------------------------------------------------


def check_cuda() -> list[Check]:
    """torch, CUDA, and one line per GPU torch sees (with its UUID, as nvidia-smi writes it)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install says anything
        return [
            problem(
                "cuda",
                f"torch cannot be imported: {type(exc).__name__}: {exc}",
                "install ckptctl with its dependencies (pip install ckptctl) in this Python "
                f"({sys.executable})",
            )
        ]
    built = torch.version.cuda
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if built is None:
        return [
            problem(
                "cuda",
                f"torch {torch.__version__} is a build without CUDA",
                "install a CUDA build of torch (the wheel for your driver's CUDA version) on a "
                "machine with an NVIDIA GPU; update --dry-run works without one",
            )
        ]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return [
            problem(
                "cuda",
                f"torch {torch.__version__} (CUDA {built}) sees no GPU{hidden}",
                "check the driver with nvidia-smi; in a container, start it with the GPUs "
                "(docker run --gpus all)" + ("; check CUDA_VISIBLE_DEVICES" if hidden else ""),
            )
        ]
    checks = [ok("cuda", f"torch {torch.__version__}, CUDA {built}, {count} GPU(s)", gpus=count)]
    for i in range(count):
        try:
            props = torch.cuda.get_device_properties(i)
        except Exception as exc:  # noqa: BLE001 - a GPU in a bad state
            checks.append(
                problem(
                    f"gpu{i}",
                    f"cannot be queried: {type(exc).__name__}: {exc}",
                    "check it with nvidia-smi (a GPU that fell off the bus needs a reset)",
                    index=i,
                )
            )
            continue
        uuid = getattr(props, "uuid", None)
        uuid_text = f"GPU-{uuid}" if uuid is not None else None
        checks.append(
            ok(
                f"gpu{i}",
                f"{props.name}, {size(props.total_memory)}, {uuid_text or 'UUID not reported'}",
                index=i,
                uuid=uuid_text,
                gpu_name=props.name,
                memory_bytes=int(props.total_memory),
            )
        )
    return checks


def check_checkpoint_engine() -> Check:
    """Installed, in the range ckptctl was written for, and importable."""
    from ckptctl.ce.internals import WRITTEN_FOR, installed_version, version_problem

    name = "checkpoint-engine"
    fix = f"pip install 'checkpoint-engine{WRITTEN_FOR}'"
    version = installed_version()
    wanted: dict[str, Any] = {"version": version, "written_for": WRITTEN_FOR}
    if version is None:
        return problem(name, "not installed", fix, **wanted)
    trouble = version_problem()
    if trouble is not None:
        return problem(name, trouble, fix, **wanted)
    try:
        import checkpoint_engine.ps  # noqa: F401 - whether it imports at all
    except Exception as exc:  # noqa: BLE001 - a missing dependency, a broken build
        return problem(
            name,
            f"{version} is installed but cannot be imported: {type(exc).__name__}: {exc}",
            f"reinstall it: pip install --force-reinstall 'checkpoint-engine{WRITTEN_FOR}'",
            **wanted,
        )
    return ok(name, f"{version} (ckptctl was written for {WRITTEN_FOR})", **wanted)


def _interpreter_of(script: str) -> str | None:
    """The interpreter a console script's #! line names (None for `env python` and the like)."""
    try:
        with open(script, "rb") as f:
            first = f.read(512).split(b"\n", 1)[0]
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words or os.path.basename(words[0]) == "env":
        return None
    return words[0]


def check_torchrun(which: Callable[[str], str | None] = shutil.which) -> Check:
    """torch's launcher: importable here, and a `torchrun` on PATH that runs this Python."""
    name = "torchrun"
    try:
        found = importlib.util.find_spec("torch.distributed.run") is not None
    except Exception:  # noqa: BLE001 - no torch at all (the cuda check says why)
        found = False
    if not found:
        return problem(
            name,
            "torch.distributed.run cannot be imported",
            "install torch (a CUDA build) in this Python: ckptctl runs its ranks under torchrun",
        )
    python_dir = os.path.dirname(sys.executable)
    script = which("torchrun")
    by_module = f"{sys.executable} -m torch.distributed.run"
    if script is None:
        return problem(
            name,
            "torch.distributed.run imports, but no torchrun on PATH",
            f"activate the environment ({python_dir} on PATH), or launch with {by_module}",
            needed=False,
        )
    interpreter = _interpreter_of(script)
    # Folders compared, not binaries: a venv's python links to the one it was made from.
    here = os.path.realpath(python_dir)
    if interpreter is not None and os.path.realpath(os.path.dirname(interpreter)) != here:
        return problem(
            name,
            f"torchrun on PATH ({script}) runs {interpreter}, not this Python "
            f"({sys.executable}): its ranks may import another torch and ckptctl",
            f"put {python_dir} first on PATH, or launch with {by_module}",
            needed=False,
            path=script,
        )
    return ok(name, f"{script} (torch.distributed.run importable)", path=script)


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


def check_memlock() -> Check:
    """`ulimit -l`: RDMA registers the pinned buffers, within this limit (p2p only)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return ok(
            "memlock", "ulimit -l unlimited", needed=False, soft_bytes=None, hard_bytes=_raw(hard)
        )
    shown = f"ulimit -l {soft // 1024}"  # (the shell counts KiB)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else size(hard)
    raise_hard = (
        ""
        if hard == resource.RLIM_INFINITY
        else " (the hard limit too: --ulimit memlock=-1 in docker, LimitMEMLOCK=infinity "
        "under systemd, memlock in /etc/security/limits.conf)"
    )
    return problem(
        "memlock",
        f"{shown} ({size(soft)}; hard limit {hard_text}): p2p's RDMA registers the pinned "
        "checkpoint within it; broadcast updates do not need it",
        f"for join/p2p: ulimit -l unlimited before torchrun{raise_hard}",
        needed=False,
        soft_bytes=soft,
        hard_bytes=_raw(hard),
    )


def _raw(n: int) -> int | None:
    return None if n == resource.RLIM_INFINITY else n


def check_open_files() -> Check:
    """`ulimit -n`: checkpoint shards, sockets, the serve job's connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits: dict[str, Any] = {"soft_limit": _raw(soft), "hard_limit": _raw(hard)}
    if soft == resource.RLIM_INFINITY or soft >= OPEN_FILES_WANTED:
        return ok("open-files", f"ulimit -n {_limit(soft)}", needed=False, **limits)
    can = hard == resource.RLIM_INFINITY or hard >= OPEN_FILES_WANTED
    target = OPEN_FILES_ASKED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_ASKED)
    fix = (
        f"ulimit -n {target} in the shell that starts torchrun and the server"
        if can
        else f"raise the hard limit ({_limit(hard)}): nofile in /etc/security/limits.conf, "
        f"--ulimit nofile={OPEN_FILES_ASKED}:{OPEN_FILES_ASKED} in docker, LimitNOFILE "
        "under systemd"
    )
    return problem(
        "open-files",
        f"ulimit -n {soft} (hard limit {_limit(hard)}): under {OPEN_FILES_WANTED}, a checkpoint "
        "of many shards or many clients of a serve job can run out of file descriptors",
        fix,
        needed=False,
        **limits,
    )


def check_shm(path: str = "/dev/shm") -> Check:
    """/dev/shm: NCCL's buffers between the ranks of a node; --consume-shm-files' checkpoints."""
    fix = "docker run --shm-size=16g (or --ipc=host); in Kubernetes an emptyDir of medium Memory"
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return problem(
            "dev-shm",
            f"{path} cannot be read ({exc.strerror}): NCCL keeps its buffers between the ranks "
            "of a node there",
            fix,
            needed=False,
        )
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    sizes: dict[str, Any] = {"bytes": total, "free_bytes": free}
    detail = f"{path} {size(total)}, {size(free)} free"
    if total < SHM_WANTED:
        return problem(
            "dev-shm",
            f"{detail}: under {size(SHM_WANTED)} (docker's default is 64 MiB), NCCL between the "
            "ranks of a node fails",
            fix,
            needed=False,
            **sizes,
        )
    if free < SHM_WANTED:
        return problem(
            "dev-shm",
            f"{detail}: nearly full",
            f"free {path} (old checkpoints left there?), or make it larger: {fix}",
            needed=False,
            **sizes,
        )
    return ok("dev-shm", detail, needed=False, **sizes)


def _read_small(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(256).decode(errors="replace").strip()
    except OSError:
        return ""


def check_rdma(root: str = INFINIBAND) -> Check:
    """RDMA devices and mooncake's transfer engine: what p2p (`join`) runs on."""
    try:
        mooncake = importlib.util.find_spec("mooncake") is not None
    except Exception:  # noqa: BLE001 - a broken package counts as none
        mooncake = False
    engine = "" if mooncake else "; mooncake-transfer-engine is not installed"
    install = "pip install 'ckptctl[p2p]' (mooncake-transfer-engine)"
    chosen = {k: os.environ[k] for k in RDMA_ENV if os.environ.get(k)}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    if not names:
        return problem(
            "rdma",
            f"no RDMA devices ({root}){engine}: p2p (join) cannot run here; broadcast updates "
            "do not need them",
            "only for p2p: a node with InfiniBand/RoCE NICs and their drivers (rdma-core)"
            + ("" if mooncake else f", and {install}"),
            needed=False,
            devices=[],
            mooncake=mooncake,
        )
    devices = []
    for dev in names[:256]:
        ports = Path(root, dev, "ports")
        try:
            port_names = sorted(os.listdir(ports))[:16]
        except OSError:
            port_names = []
        states = [_read_small(ports / p / "state").split(":")[-1].strip() for p in port_names]
        devices.append({"name": dev, "active": "ACTIVE" in states})
    shown = ", ".join(
        f"{d['name']}" + ("" if d["active"] else " (no active port)") for d in devices[:RDMA_SHOWN]
    )
    more = f" and {len(devices) - RDMA_SHOWN} more" if len(devices) > RDMA_SHOWN else ""
    picked = "".join(f"; {k}={v}" for k, v in chosen.items())
    detail = f"{len(devices)} device(s): {shown}{more}{picked}{engine}"
    active = [d for d in devices if d["active"]]
    if not mooncake:
        return problem("rdma", detail, f"for p2p: {install}", needed=False, devices=devices)
    if not active:
        return problem(
            "rdma",
            detail,
            "for p2p: bring a port up (ibstat shows its state; check the cable and the subnet "
            "manager)",
            needed=False,
            devices=devices,
        )
    return ok("rdma", detail, needed=False, devices=devices, mooncake=True)


def machine_checks() -> list[Check]:
    return [
        *check_cuda(),
        check_checkpoint_engine(),
        check_torchrun(),
        check_memlock(),
        check_open_files(),
        check_shm(),
        check_rdma(),
    ]


# -- the inference servers -------------------------------------------------------------------


def server_addresses(
    endpoints: Sequence[str] | None, uds: Sequence[str] | None, api_key: str | None
) -> list[ServerAddress]:
    """The servers asked about: one per --endpoint (or --uds), paired in order as update pairs
    them; a usage error (exit 2) for a URL that is none or lists that do not pair."""
    from ckptctl.defaults import DEFAULT_ENDPOINT
    from ckptctl.errors import UsageError
    from ckptctl.inference_server import check_endpoint
    from ckptctl.job.groups import nth_server

    endpoints, uds = list(endpoints or []), list(uds or [])
    if not endpoints and not uds:
        return []
    if len(endpoints) > 1 and len(uds) > 1 and len(endpoints) != len(uds):
        raise UsageError(
            f"--endpoint was given {len(endpoints)} times and --uds {len(uds)} times: give "
            "each once, or both once per server in the same order"
        )
    endpoints = [check_endpoint(e) for e in endpoints] or [DEFAULT_ENDPOINT]
    return [nth_server(i, endpoints, uds, api_key) for i in range(max(len(endpoints), len(uds)))]


@dataclass(frozen=True)
class Identity:
    """What a server answered as: engine None where it is down or neither."""

    engine: ServerKind | None
    check: Check


def identify(address: ServerAddress, timeout: float) -> Identity:
    """Whether the server answers like SGLang (its model-info routes) or like vLLM (/health and
    the dev-mode /collective_rpc that checkpoint-engine's updates go through)."""
    import httpx

    from ckptctl.bounded_http import deadline
    from ckptctl.defaults import API_KEY_ENV
    from ckptctl.inference_server import (
        CONTRACTS,
        VLLM_DEV_MODE_HINT,
        auth_headers,
        describe_failure,
        make_client,
    )
    from ckptctl.readiness import Prober, read_weight_version

    where = address.describe()
    extra: dict[str, Any] = {"endpoint": redact(address.endpoint), "uds": address.uds}

    def fail(detail: str, fix: str) -> Identity:
        return Identity(None, problem("server", f"{where}: {detail}", fix, **extra))

    key_fix = f"pass --api-key or set {API_KEY_ENV}"
    start = time.monotonic()
    prober = Prober(address)
    try:
        ping = prober.probe(timeout)
    finally:
        prober.close()
    if ping.http_status is None:
        return fail(
            ping.status,
            "start the server, or check --endpoint/--uds (ckptctl wait-ready waits for one "
            "that is starting)",
        )
    left = max(timeout - (time.monotonic() - start), 0.05)
    headers = auth_headers(address)
    try:
        with deadline(left), make_client(address, timeout=left, send_key=False) as client:
            version, status = read_weight_version(client, CONTRACTS[ServerKind.sglang], headers)
            if version is not None or not status.startswith("no weight-version"):
                if " HTTP 401" in status or " HTTP 403" in status:
                    return fail(f"refused the API key ({status})", key_fix)
                waiting = " (it waits for its first weights)" if ping.http_status == 503 else ""
                if version is None:  # SGLang's routes, but not its answer
                    return Identity(
                        ServerKind.sglang,
                        problem(
                            "server",
                            f"{where} answers like SGLang, but {status}",
                            "see the server's log",
                            engine="sglang",
                            **extra,
                        ),
                    )
                said = f"{where} answers like SGLang: {status}{waiting}"  # (bounded, one line)
                return Identity(ServerKind.sglang, ok("server", said, engine="sglang", **extra))
            health = client.get("/health").status_code
            rpc = client.post("/collective_rpc", json={}, headers=headers).status_code
    except httpx.HTTPError as exc:
        return fail(describe_failure(exc, address, timeout), "check the server's log")
    if rpc in (401, 403):
        return fail(f"refused the API key on /collective_rpc (HTTP {rpc})", key_fix)
    if health != 404 and rpc != 404:
        return Identity(
            ServerKind.vllm,
            ok(
                "server",
                f"{where} answers like vLLM (/health HTTP {health}, /collective_rpc in dev "
                "mode): give update and serve --engine vllm",
                engine="vllm",
                **extra,
            ),
        )
    if health != 404:
        return fail(
            f"answers /health (HTTP {health}) but neither SGLang's model info nor vLLM's "
            "/collective_rpc (HTTP 404)",
            f"if it is vLLM, {VLLM_DEV_MODE_HINT}; else check --endpoint",
        )
    return fail(
        f"answers HTTP {ping.http_status} on /ping and 404 on /health: neither SGLang nor vLLM",
        "check --endpoint: the server's own root URL and port",
    )


def check_weights_checker(address: ServerAddress, engine: ServerKind, timeout: float) -> Check:
    """Which of --verify's actions the server's weights checker offers (weights_checker.probe)."""
    from ckptctl.errors import CkptctlError
    from ckptctl.weights_checker import CHECKER_PATH, CHECKSUM, COMPARE_CHECKSUM, Checker, probe

    name, where = "weights-checker", address.describe()
    extra: dict[str, Any] = {"endpoint": redact(address.endpoint)}
    if engine != "sglang":
        return problem(
            name,
            f"{where}: vLLM has no released weights checker",
            "only --verify needs one (SGLang >= 0.5.12); updates work without it",
            needed=False,
            actions=[],
            **extra,
        )
    try:
        actions = probe(Checker(address, time.monotonic() + timeout))
    except CkptctlError as exc:
        return problem(
            name, str(exc), "only --verify needs it; see the server's log", needed=False, **extra
        )
    listed: dict[str, Any] = {"actions": actions, **extra}
    if not actions:
        return problem(
            name,
            f"{where}: none (HTTP 404 on {CHECKER_PATH}; SGLang has it from 0.5.6)",
            "only --verify needs it: upgrade SGLang to >= 0.5.12",
            needed=False,
            **listed,
        )
    if CHECKSUM not in actions:
        return problem(
            name,
            f"{where}: snapshot/reset_tensors/compare only (SGLang 0.5.6-0.5.11)",
            "--verify and --verify-round-trip need its checksum: upgrade SGLang to >= 0.5.12",
            needed=False,
            **listed,
        )
    how = (
        "--verify compares every tensor's SHA-256"
        if COMPARE_CHECKSUM in actions
        else "--verify compares servers fed the same checkpoint (two or more), "
        "--verify-round-trip a server started from it"
    )
    return ok(name, f"{where}: {', '.join(actions)}: {how}", needed=False, **listed)


def server_checks(
    addresses: Sequence[ServerAddress], timeout: float, pause: str | None = None
) -> list[Check]:
    """Each server's checks, one after another, all within `timeout` seconds: a server that
    does not answer uses up its part of it (an equal share of what is left), never the rest's.
    With `pause`, whether each offers that pause mode (in its share too)."""
    from ckptctl.unix_peers import UntrustedSocket

    checks = []
    deadline = time.monotonic() + timeout
    for i, address in enumerate(addresses):
        start = time.monotonic()
        share = max((deadline - start) / (len(addresses) - i), 0.05)
        try:
            found = identify(address, share)
        except UntrustedSocket as exc:  # (a failed check of its own: the report goes on)
            fix = "point --uds at your server's own socket, in a folder only you can write to"
            endpoint = redact(address.endpoint)
            found = Identity(
                None, problem("server", str(exc), fix, endpoint=endpoint, uds=address.uds)
            )
        checks.append(found.check)
        if found.engine is not None:
            left = max(share - (time.monotonic() - start), 0.05)
            checks.append(check_weights_checker(address, found.engine, left))
            if pause is not None:
                left = max(share - (time.monotonic() - start), 0.05)
                checks.append(check_pause(address, found.engine, pause, left))
    return checks


def check_pause(address: ServerAddress, engine: ServerKind, mode: str, timeout: float) -> Check:
    """doctor --pause MODE: whether the server offers what the mode needs (its version, its
    routes), asked without pausing it (server_pause.probe_routes)."""
    import httpx

    from ckptctl.errors import CkptctlError
    from ckptctl.inference_server import describe_failure
    from ckptctl.server_pause import probe_routes
    from ckptctl.settings import PAUSE_MODES, PauseMode

    extra: dict[str, Any] = {"endpoint": redact(address.endpoint), "mode": mode}
    modes = [m.value for m in PAUSE_MODES[engine]]
    if mode not in modes:
        return problem(
            "pause",
            f"{address.describe()} is {engine}, whose pause modes are {', '.join(modes)}",
            f"pass --pause with one of them (and --engine {engine})",
            **extra,
        )
    if mode == PauseMode.none:
        return ok("pause", f"{address.describe()}: --pause none sends no pause", **extra)
    try:
        return ok("pause", probe_routes(address, engine, PauseMode(mode), timeout), **extra)
    except CkptctlError as exc:
        return problem(
            "pause", str(exc), f"upgrade the server, or pick another of {modes}", **extra
        )
    except httpx.HTTPError as exc:
        return problem(
            "pause",
            f"{address.describe()}: {describe_failure(exc, address, timeout)}",
            "check the server's log",
            **extra,
        )


def run(
    addresses: Sequence[ServerAddress] = (), *, timeout: float = 30.0, pause: str | None = None
) -> Report:
    """Every check: this machine's, then each server's (all of them within `timeout` s); with
    `pause`, whether each server offers that pause mode."""
    return Report([*machine_checks(), *server_checks(addresses, timeout, pause)])
