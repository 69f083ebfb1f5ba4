"""torchrun's launcher without its torch import: the tests' torchrun jobs start warm.

The suite is CPU-bound on 2 cores, and every `python -m torch.distributed.run` spends about
1.5 s of CPU importing torch before it launches a rank. Here one process per pytest worker, the
*zygote*, imports torch's launcher once; each job's launcher is a fork of it that runs
`torch.distributed.run` exactly as `python -m` would (runpy), with the job's own argv,
environment, working folder, umask, resource limits and standard streams. Only the launcher is
forked: the ranks it starts are fresh interpreters (`sys.executable`), as under a cold
torchrun, and everything the tests check happens in them.

What the test holds is a small *stub* process (no torch), `python warm_launch.py SOCKET -m
torch.distributed.run ARGS`, which stands for the launcher the way the real command would:
  - it hands the zygote its stdin, stdout and stderr (SCM_RIGHTS): the launcher and its ranks
    write straight into the test's pipes;
  - the limits a test's `preexec_fn` set on it (`ulimit -n`) are the launcher's too;
  - it passes on every signal a test sends it (SIGINT, SIGTERM, ...) to the launcher;
  - it ends as the launcher ended: the same exit code, or killed by the same signal;
  - killed outright (SIGKILL), it takes the launcher with it: the zygote kills it when the
    stub's connection closes, as the kernel would end a process killed that way.
A test that needs the launcher's own pid (its children are the ranks) asks `launcher_pid`.
A job whose environment differs from the zygote's in what Python or the launcher reads at start
(`_start_settings`: PYTHON*, TORCH*, LOGLEVEL, the locale) is launched cold by its own stub.

`CKPTCTL_TESTS_COLD_TORCHRUN=1` makes every job a plain `python -m torch.distributed.run`
again, for comparison. The benchmarks and the GPU tests always launch it cold.

    python warm_launch.py serve DIR      the zygote (started by `torchrun_cmd`, one per worker)
    python warm_launch.py SOCKET -m MODULE ARGS...   the stub
"""

from __future__ import annotations

import array
import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

COLD_ENV = "CKPTCTL_TESTS_COLD_TORCHRUN"
HERE = os.path.abspath(__file__)
# What a warm launcher imports before the first fork: torchrun and what its main() loads.
WARM_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
)
# The limits a stub passes on (what a test's preexec_fn may have lowered).
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_CORE")
# The signals a stub passes on to its launcher (what tests and terminals send).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip
READY_TIMEOUT_S = 120  # a busy 2-core machine can take this long to import torch
MAX_REQUEST = 1 << 20
MAX_SOCKET_PATH = 100  # (sun_path holds 108 bytes)
# Settings a Python process or torch's launcher reads once, at start (or at import): a job whose
# environment differs from the zygote's in one of them is launched cold by its stub.
_COLD_PREFIXES = ("PYTHON", "TORCH", "LC_")
_COLD_NAMES = ("LANG", "LANGUAGE", "LOGLEVEL")


def _start_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_COLD_PREFIXES) or k in _COLD_NAMES}


# --- in the test's process: the zygote of this pytest worker ---------------------------------

_zygote: subprocess.Popen[bytes] | None = None
_zygote_dir = ""
_zygote_lock = threading.Lock()


def torchrun_cmd(*program: str, **torchrun: Any) -> list[str]:
    """`torchrun_launch.torchrun_cmd(*program, **torchrun)`, launched warm (the stub) unless
    CKPTCTL_TESTS_COLD_TORCHRUN is set."""
    from torchrun_launch import torchrun_cmd as cold_cmd

    cmd = cold_cmd(*program, **torchrun)
    if os.environ.get(COLD_ENV):
        return cmd
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    return warm_cmd(*cmd[1:])


def warm_cmd(*python_args: str) -> list[str]:
    """`python -m MODULE ARGS` (`python_args`), run by a fork of this worker's zygote (cold
    where a socket cannot be made: a TMPDIR too long for one)."""
    assert python_args[0] == "-m", python_args
    sock = _zygote_socket()
    if len(sock.encode()) >= MAX_SOCKET_PATH:
        return [sys.executable, *python_args]
    return [sys.executable, HERE, sock, *python_args]


def is_warm(cmd: list[str]) -> bool:
    return len(cmd) > 1 and cmd[1] == HERE


def launcher_pid(proc: subprocess.Popen[Any], timeout: float = 60) -> int:
    """The pid of the torchrun launcher behind `proc`: `proc.pid` for a cold one (and for a stub
    that exec'd one, `_start_settings`); for a warm one, the pid the zygote wrote beside its
    socket for this stub while its launcher runs."""
    if not is_warm(list(proc.args)):  # type: ignore[arg-type]
        return proc.pid
    path = os.path.join(_zygote_dir, f"launcher-of-{proc.pid}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError), open(path) as fh:
            return int(fh.read())
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            if HERE.encode() not in fh.read():  # it exec'd the launcher itself
                return proc.pid
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before its launcher ran")
        time.sleep(0.02)
    raise AssertionError(f"no launcher pid for the stub {proc.pid} within {timeout}s")


def _zygote_socket() -> str:
    """The socket of this process's zygote, started on first use: it imports torch while the
    test goes on, and the stub waits for it to listen."""
    global _zygote, _zygote_dir
    with _zygote_lock:
        if _zygote is None or _zygote.poll() is not None:
            _zygote_dir = tempfile.mkdtemp(prefix="ckwarm")  # 0700: ours alone
            log = open(os.path.join(_zygote_dir, "zygote.log"), "wb")  # noqa: SIM115
            # stdin stays a pipe from this process: when it closes (this worker ended, however),
            # the zygote kills what it launched and ends.
            # (numpy's OpenBLAS starts a thread pool on import unless told not to: a fork of a
            # process with threads may inherit a lock held by one of them and hang.) A session
            # of its own: a terminal's Ctrl-C reaches each launcher once, through its stub.
            _zygote = subprocess.Popen(
                [sys.executable, HERE, "serve", _zygote_dir],
                stdin=subprocess.PIPE, stdout=log, stderr=log, close_fds=True,
                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, start_new_session=True,
            )  # fmt: skip
            log.close()
            with open(os.path.join(_zygote_dir, "zygote.pid"), "w") as fh:
                fh.write(f"{_zygote.pid}\n")
            atexit.register(_stop_zygote, _zygote, _zygote_dir)
        return os.path.join(_zygote_dir, "zygote.sock")


def _stop_zygote(zygote: subprocess.Popen[bytes], folder: str) -> None:
    """At this worker's end: the zygote sees its stdin close, kills what it launched, ends;
    its folder goes (also that of one that failed to start)."""
    import shutil

    zygote.stdin.close()  # type: ignore[union-attr]
    try:
        zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
        zygote.kill()
    shutil.rmtree(folder, ignore_errors=True)


# --- the stub: what the test runs --------------------------------------------------------------


def stub(sock_path: str, argv: list[str]) -> None:
    conn = _connect(sock_path)
    with open(os.path.join(os.path.dirname(sock_path), "zygote.env")) as fh:
        if json.load(fh) != _start_settings(os.environ):  # its own start differs: cold
            conn.close()
            os.execv(sys.executable, [sys.executable, *argv])
    ignored = [int(sig) for sig in FORWARDED if signal.getsignal(sig) == signal.SIG_IGN]
    request = {
        "argv": argv,
        "ignored": ignored,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": _umask(),
        "limits": {name: _limit(name) for name in LIMITS},
    }
    data = json.dumps(request).encode()
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    # Signals go to the launcher through the zygote (its parent: it signals no other process
    # that took the pid), as "sig N" lines after the request; those that come before the
    # request is out wait for it.
    pending: list[int] = []
    sent = False

    def forward(signum: int, _frame: object) -> None:
        if not sent:
            pending.append(signum)
            return
        with contextlib.suppress(OSError):
            conn.sendall(f"sig {signum}\n".encode())

    for sig in FORWARDED:
        if sig not in ignored:  # (one the test's shell ignores stays ignored, as it would)
            signal.signal(sig, forward)
    message = struct.pack("!I", len(data)) + bytes([*(fd in fds for fd in (0, 1, 2))]) + data
    try:
        done = conn.sendmsg(
            [message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        conn.sendall(message[done:])
        sent = True
        for signum in pending:
            conn.sendall(f"sig {signum}\n".encode())
    except OSError as exc:
        _die(f"warm_launch: the zygote took no request: {exc} ({_log_tail(sock_path)})")
    reader = conn.makefile("rb")
    first = reader.readline().split()
    if first[:1] != [b"pid"]:
        _die(f"warm_launch: the zygote did not launch it: {first!r} ({_log_tail(sock_path)})")
    end = reader.readline().split()
    if end[:1] == [b"exit"]:
        os._exit(int(end[1]))
    if end[:1] == [b"signal"]:
        signum = int(end[1])
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL has no handler to reset)
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    _die(f"warm_launch: the zygote went away before the launcher {int(first[1])} ended")


def _connect(sock_path: str) -> socket.socket:
    """Connected to the zygote, which may still be importing torch (a bounded wait)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(sock_path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if _zygote_ended(os.path.dirname(sock_path)):
                _die(f"warm_launch: the zygote at {sock_path} ended: {_log_tail(sock_path)}")
            if time.monotonic() > deadline:
                _die(f"warm_launch: no zygote at {sock_path} within {READY_TIMEOUT_S}s")
            time.sleep(0.05)


def _zygote_ended(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "zygote.pid")) as fh:
            pid = int(fh.read())
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, ValueError):  # (no pid file yet: still starting; no process: it ended)
        return os.path.exists(os.path.join(folder, "zygote.pid"))


def _log_tail(sock_path: str) -> str:
    try:
        with open(os.path.join(os.path.dirname(sock_path), "zygote.log"), "rb") as fh:
            return fh.read()[-2000:].decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"


def _die(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())
    os._exit(125)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _limit(name: str) -> list[int]:
    import resource

    return list(resource.getrlimit(getattr(resource, name)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


# --- the zygote --------------------------------------------------------------------------------


class _Launched:
    """A launcher the zygote forked: its stub's connection (None once the stub is gone), what
    the stub sent that is not read yet, and the file that names the launcher to the tests."""

    def __init__(self, conn: socket.socket, mark: str) -> None:
        self.conn: socket.socket | None = conn
        self.unread = b""
        self.mark = mark


def serve(folder: str) -> None:
    import ctypes  # noqa: F401 - (imported once here, not in each fork)
    import gc
    import importlib
    import resource  # noqa: F401
    import runpy  # noqa: F401
    import select
    import shutil
    import traceback  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (its launchers get SIGINT from their stubs)
    for name in WARM_MODULES:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) > 1:  # forks would inherit their locks, held or not: refuse, loudly
        raise SystemExit(
            f"warm_launch: importing torch's launcher started {len(threads) - 1} thread(s): "
            f"forking it is not safe; run with {COLD_ENV}=1"
        )
    gc.collect()
    gc.freeze()  # forks share these pages: the collector never writes to them
    with open(os.path.join(folder, "zygote.env"), "w") as fh:
        json.dump(_start_settings(os.environ), fh)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, "zygote.sock.tmp"))
    listener.listen(64)
    os.rename(os.path.join(folder, "zygote.sock.tmp"), os.path.join(folder, "zygote.sock"))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    launched: dict[int, _Launched] = {}
    try:
        while True:
            stubs = {job.conn: pid for pid, job in launched.items() if job.conn is not None}
            for ready in select.select([listener, 0, wake_r, *stubs], [], [])[0]:
                if ready is listener:
                    conn, _ = listener.accept()
                    _launch(conn, folder, launched, [listener, *stubs], (wake_r, wake_w))
                elif ready == 0:
                    if not os.read(0, 4096):  # the worker that started us is gone
                        return
                elif ready == wake_r:
                    os.read(wake_r, 4096)
                else:
                    _read_stub(stubs[ready], launched[stubs[ready]])
            _reap(launched)
    finally:  # however the zygote ends, no launcher of its outlives it, nor its folder
        for pid in launched:
            _kill(pid)
        shutil.rmtree(folder, ignore_errors=True)


def _launch(
    conn: socket.socket, folder: str, launched: dict[int, _Launched],
    others: list[socket.socket], pipe: tuple[int, int],
) -> None:  # fmt: skip
    """Fork a launcher for the request on `conn`, tell the stub its pid, and name it in a file
    after the stub's pid (`launcher_pid`)."""
    conn.settimeout(10)
    try:
        credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        stub_pid, _uid, _gid = struct.unpack("3i", credentials)
        head, fds, unread = _receive(conn)
        request = json.loads(head)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(f"refused {exc}\n".encode())
        conn.close()
        return
    # Blocked until the fork is its launcher: a signal the stub passes on meanwhile waits for
    # it, where Python's after-fork code would have dropped it.
    zygote = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                for other in (*others, conn):
                    other.close()
                for fd in pipe:
                    os.close(fd)
                _become_launcher(request, fds, zygote)
            finally:
                os._exit(70)  # (_become_launcher never returns)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    for fd in fds.values():
        os.close(fd)
    job = _Launched(conn, os.path.join(folder, f"launcher-of-{stub_pid}"))
    launched[pid] = job
    with open(job.mark + ".tmp", "w") as fh:
        fh.write(str(pid))
    os.rename(job.mark + ".tmp", job.mark)
    try:
        conn.sendall(f"pid {pid}\n".encode())
        conn.setblocking(False)
    except OSError:  # the stub is gone already: so is its launcher
        _stub_gone(pid, job)
        return
    job.unread = unread
    _signal_lines(pid, job)


def _read_stub(pid: int, job: _Launched) -> None:
    """What the stub sent: signals to pass on ("sig N"), or its end (its launcher's too)."""
    try:
        data = job.conn.recv(4096)  # type: ignore[union-attr]
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:
        _stub_gone(pid, job)
        return
    job.unread += data
    _signal_lines(pid, job)


def _signal_lines(pid: int, job: _Launched) -> None:
    while b"\n" in job.unread:
        line, _, job.unread = job.unread.partition(b"\n")
        words = line.split()
        if len(words) == 2 and words[0] == b"sig" and words[1].isdigit():
            with contextlib.suppress(OSError, ValueError):
                os.kill(pid, int(words[1]))  # (our child, not yet reaped: the pid is its)


def _stub_gone(pid: int, job: _Launched) -> None:
    """A stub killed outright takes its launcher with it (reaped later)."""
    _kill(pid)
    if job.conn is not None:
        job.conn.close()
        job.conn = None
    with contextlib.suppress(OSError):
        os.unlink(job.mark)


def _receive(conn: socket.socket) -> tuple[bytes, dict[int, int], bytes]:
    """(the request's JSON, {0|1|2: the descriptor received for it}, what came after it)"""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    try:
        while 0 < len(data) < 7:
            data += conn.recv(7 - len(data))
        if len(data) < 7:
            raise ValueError("cut short")
        (size,) = struct.unpack("!I", data[:4])
        sent = [i for i in (0, 1, 2) if data[4 + i]]
        if size > MAX_REQUEST or len(sent) != len(fds):
            raise ValueError("a request that does not add up")
        received = dict(zip(sent, fds, strict=True))
        body = data[7:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ValueError("cut short")
            body += more
        return body[:size], received, body[size:]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _become_launcher(request: dict[str, Any], fds: dict[int, int], zygote: int) -> None:
    """In the fork (the signals a stub passes on blocked): become the process `python ARGV`
    would have been, then run ARGV's module as `-m` does; end as that process would."""
    import ctypes
    import resource
    import runpy
    import traceback

    # A zygote that ends, however, takes its launchers with it (PR_SET_PDEATHSIG).
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != zygote:
        os._exit(70)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in FORWARDED:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if int(sig) in request["ignored"] else default)
    for target in (0, 1, 2):
        if target in fds:
            os.dup2(fds[target], target)
        else:
            os.close(target)
    for fd in fds.values():
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name, (soft, hard) in request["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    assert argv[0] == "-m", argv
    sys.argv = [argv[1], *argv[2:]]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.modules.pop(argv[1], None)  # `-m` runs the module as __main__ only, never imported
    code, interrupted = 1, False
    try:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        finally:  # (a signal from here on finds the process ending)
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - as the interpreter does with any uncaught error
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        os._exit(code & 0xFF)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reap(launched: dict[int, _Launched]) -> None:
    """Tell each stub whose launcher ended how it ended."""
    while launched:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job = launched.pop(pid, None)
        if job is None:
            continue
        with contextlib.suppress(OSError):
            os.unlink(job.mark)
        if job.conn is None:
            continue
        if os.WIFSIGNALED(status):
            end = f"signal {os.WTERMSIG(status)}\n"
        else:
            end = f"exit {os.WEXITSTATUS(status)}\n"
        job.conn.setblocking(True)
        job.conn.settimeout(10)
        with contextlib.suppress(OSError):
            job.conn.sendall(end.encode())
        job.conn.close()


def probe() -> None:
    """`-m warm_launch probe ...`: what the tests of this module launch instead of torchrun."""
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
                      "nofile": _limit("RLIMIT_NOFILE"), "marker": os.environ.get("PROBE")}),
          flush=True)  # fmt: skip
    action = sys.argv[2] if len(sys.argv) > 2 else ""
    if action == "sleep":
        time.sleep(300)
    if action.startswith("exit"):
        raise SystemExit(int(action[4:]))
    if action == "raise":
        raise RuntimeError("the probe failed")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["probe"]:
        probe()
    else:
        stub(sys.argv[1], sys.argv[2:])
