"""Shared fixtures: real fake servers, and running the CLI in-process or as the installed script.

The helper modules (tests/support: fake_server, cpu_ps_rank, ...; bench/_support, shared with the
benchmarks: ckpt_factory, model_shapes, torchrun_launch) are imported by their own names, in the
tests and in the scripts the tests start: their folders go on sys.path here and on PYTHONPATH for
every process the tests start."""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
HELPER_DIRS = [str(_ROOT / "tests" / "support"), str(_ROOT / "bench" / "_support")]
sys.path[:0] = [d for d in HELPER_DIRS if d not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [*HELPER_DIRS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)

import pytest  # noqa: E402
from cli_run import ckptctl_script, invoke, run_script  # noqa: E402, F401 - tests import them from here
from fake_server import Behaviour, FakeServer, job_of_ranks, reserved_port  # noqa: E402
from locations import CPU_PS_RANK  # noqa: E402

from ckptctl.defaults import SOCKET_DIR_ENV  # noqa: E402

# A suite started in the background of a non-interactive shell (`make test &`, some CI
# runners) inherits SIGINT ignored, and every process it starts would inherit that too: the
# tests that press Ctrl-C on a command would see nothing happen, and wait out their timeouts.
# exec() keeps an ignored signal ignored but resets a handled one to its default, so handling
# it here gives the commands the tests start a terminal's SIGINT.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _own_environment() -> Iterator[None]:
    """Each test gets the environment it started with back: an in-process `update` sets
    RANK, WORLD_SIZE, MASTER_PORT... (prepare_environment), and under pytest-xdist the tests
    that would inherit them change from run to run."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def _suite_socket_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sockets")  # (short: a socket's path stays under ~100 bytes)


@pytest.fixture(autouse=True)
def socket_dir(_suite_socket_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where this test's serve jobs put their control sockets and its clients look for them: a
    directory of its own under pytest's, never $XDG_RUNTIME_DIR/ckptctl/ or /tmp/ckptctl-UID/,
    where the user's own serve jobs are. In the environment, so every process the test starts
    looks there too (test_serve_control.py checks that the suite sees no job of the user's)."""
    path = Path(tempfile.mkdtemp(prefix="t", dir=_suite_socket_root))  # 0700
    monkeypatch.setenv(SOCKET_DIR_ENV, str(path))
    return path


# What makes a process a torchrun rank, or gives the CLI its flags from the environment.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
FLAG_VARS = (
    "CKPTCTL_ENDPOINT",
    "CKPTCTL_UDS",
    "CKPTCTL_ENGINE",
    "CKPTCTL_API_KEY",
    "CKPTCTL_DEBUG",
)


@pytest.fixture
def plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain process, not a torchrun rank, with no flags from the environment, whatever the
    environment running the tests says (in-process calls and the processes they start alike):
    `pytestmark = pytest.mark.usefixtures("plain_process")`."""
    for name in (*TORCHRUN_VARS, *FLAG_VARS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def mixed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of two shards holding every dtype, 0-dim and empty tensors too
    (ckpt_factory.mixed_shards), written once for the session: tests only read it."""
    from ckpt_factory import mixed_shards, write_real_checkpoint

    return write_real_checkpoint(tmp_path_factory.mktemp("mixed"), mixed_shards(seed=9))


@pytest.fixture
def server() -> Iterator[FakeServer]:
    """An SGLang 0.5.23-like server on a loopback port, waiting for its first weights."""
    with FakeServer(Behaviour()) as s:
        yield s


@pytest.fixture
def refused_endpoint() -> Iterator[str]:
    """An http://127.0.0.1:PORT URL that refuses connections for the whole test: its port is
    held, not listening, so no test running beside this one can open a server there."""
    with reserved_port() as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    """`python -m http.server` serving an empty folder, on loopback: a foreign server, which
    answers 404 (with an HTML page) on every path SGLang and vLLM answer, 501 to every POST."""
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: Unix socket paths must stay under ~100 bytes."""
    d = tempfile.mkdtemp(prefix="ck", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def cpu_serve_job(
    endpoint: str,
    *flags: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    ranks: int = 2,
) -> AbstractContextManager[subprocess.Popen[str]]:
    """A 2-rank `ckptctl serve` job under a real torchrun, feeding the TP2 server at
    `endpoint`, with only checkpoint-engine's ParameterServer stood in (cpu_ps_rank.py);
    `port`: torchrun's master port (its store), else a free one. `ranks=1`: one process
    feeding a TP1 server, for tests whose subject is not the ranks (fake_server.job_of_ranks)."""
    assert ranks in (1, 2), ranks
    return job_of_ranks(
        ranks, CPU_PS_RANK, "serve", "--inference-parallel-size", str(ranks),
        "--endpoint", endpoint, *flags, env=env, port=port,
    )  # fmt: skip


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA and checkpoint-engine's ParameterServer: skip them on CPU.
    Where they run, they run one at a time (one pytest-xdist worker: `--dist loadgroup`), as
    they share the machine's GPUs."""
    if _cuda_available():  # these check what a machine without CUDA says
        skip_here = pytest.mark.skip(reason="expects a machine without CUDA (no_cuda)")
        for item in items:
            if item.get_closest_marker("no_cuda"):
                item.add_marker(skip_here)
    # (By marker, not keyword: every test under tests/gpu/ has the keyword "gpu", its folder.)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    for item in gpu:
        item.add_marker(pytest.mark.xdist_group("gpu"))
    if gpu and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (run on a GPU node: python -m pytest -m gpu)")
        for item in gpu:
            item.add_marker(skip)


def assert_failure_document(stdout: str, code: int) -> dict:
    """With --json a failed command still writes exactly one JSON document: the failure."""
    import json

    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON document on stdout, got {stdout!r}"
    doc = json.loads(lines[0])
    assert doc["ok"] is False and doc["exit_code"] == code and doc["error"]
    return doc


def wait_until(condition: Callable[[], object], timeout: float = 60, what: str = "") -> None:
    """Wait for `condition()` to be true, polling; fail the test (naming `what`) at the
    deadline. The deadline is a safety net for a broken product, never the expected path."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what or condition}")
        time.sleep(0.02)


def wait_for_path(path: str, timeout: float = 60) -> bool:
    """Wait until `path` exists (a job's control socket, a file it writes)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


def raw_exchange(path: str, request: bytes, *, timeout: float = 30) -> bytes:
    """Send `request` as is over the Unix socket at `path` and read the answer to its end
    (a control socket answers once and closes): for requests no HTTP client would send."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 60) -> str:  # type: ignore[type-arg]
    """Read the process's stderr (a pipe) until `needle` appears; what was read. Later output
    stays in the pipe for `communicate`. Fails the test at the deadline or when the process
    ends first."""
    assert proc.stderr is not None
    fd, seen = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while needle.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {needle!r} on stderr within {timeout:g}s: {seen!r}")
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the process ended before {needle!r}: {seen!r}")
            seen += chunk
    return seen.decode(errors="replace")
