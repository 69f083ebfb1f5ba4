"""The serve job's control socket (ckptctl/serve/control.py and its client half,
ckptctl/serve/control_client.py) with real Unix sockets:
where it lives and who may enter, what it refuses to replace, the peer check, the clients'
checks, the bounded HTTP, and which job a client picks. Another user is played by uid 65534
through `setpriv` where the machine allows it (root)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import raw_exchange, run_script

from ckptctl.defaults import SOCKET_DIR_ENV
from ckptctl.errors import OperationFailed, UsageError
from ckptctl.serve import control, control_client
from ckptctl.serve.control import ControlServer

NOBODY = 65534


def _can_setpriv() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


needs_other_uid = pytest.mark.skipif(
    not _can_setpriv(), reason="needs root and setpriv to act as another uid"
)


def as_nobody(code: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run Python `code` as uid 65534 (another user, with no groups)."""
    return subprocess.run(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
         sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=60, **kw,
    )  # fmt: skip


class Calls:
    """Handlers that record what reached them."""

    def __init__(self, targets: list[str] | None = None) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.targets = targets or []

    def handlers(self) -> dict[tuple[str, str], control.Handler]:
        def status(doc: Any) -> tuple[int, dict[str, Any]]:
            self.seen.append(("status", doc))
            return 200, {"ok": True, "state": "idle", "targets": self.targets}

        def stop(doc: Any) -> tuple[int, dict[str, Any]]:
            self.seen.append(("stop", doc))
            return 200, {"ok": True}

        return {("GET", "/status"): status, ("POST", "/stop"): stop}


@pytest.fixture
def runtime_dir(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for this test, where serve jobs put their sockets by default
    (the suite's own CKPTCTL_SOCKET_DIR unset: conftest.socket_dir)."""
    xdg = short_tmp / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.delenv(SOCKET_DIR_ENV)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    yield xdg


@pytest.fixture
def open_dir(short_tmp: Path) -> Path:
    """A directory anyone may enter and write to, like /tmp (sticky)."""
    d = short_tmp / "open"
    d.mkdir()
    os.chmod(d, 0o1777)
    os.chmod(short_tmp, 0o755)
    return d


# -- where it lives --------------------------------------------------------------------------------


def test_the_default_socket_is_0600_in_a_0700_directory_whatever_the_umask(
    runtime_dir: Path,
) -> None:
    old = os.umask(0)
    try:
        path = control.default_socket_path(["http://127.0.0.1:30000"])
        server = ControlServer(path, Calls().handlers()).start()
    finally:
        os.umask(old)
    try:
        assert Path(path).parent == runtime_dir / "ckptctl"
        assert stat.S_IMODE(os.lstat(runtime_dir / "ckptctl").st_mode) == 0o700
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    finally:
        server.close()
    assert not os.path.exists(path)


def test_without_xdg_runtime_dir_a_private_directory_in_tmp(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SOCKET_DIR_ENV)  # (the suite's: conftest.socket_dir)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    old = os.umask(0)
    try:
        d = control.private_socket_dir(tmp_root=str(open_dir))
    finally:
        os.umask(old)
    assert d == open_dir / f"ckptctl-{os.getuid()}"
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700


@pytest.mark.parametrize("planted", ["symlink", "loose mode", "file"])
def test_a_socket_directory_that_is_not_private_is_refused(
    planted: str, open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SOCKET_DIR_ENV)  # (the suite's: conftest.socket_dir)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    d = open_dir / f"ckptctl-{os.getuid()}"
    elsewhere = open_dir / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if planted == "symlink":
        d.symlink_to(elsewhere)
    elif planted == "loose mode":
        d.mkdir()
        os.chmod(d, 0o755)
    else:
        d.write_text("x")
    with pytest.raises(UsageError, match="not a (private )?directory"):
        control.private_socket_dir(tmp_root=str(open_dir))
    assert os.path.lexists(d)  # refused, never removed or "fixed"


@needs_other_uid
def test_a_socket_directory_planted_by_another_user_is_refused(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SOCKET_DIR_ENV)  # (the suite's: conftest.socket_dir)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    d = open_dir / f"ckptctl-{os.getuid()}"
    made = as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(d))
    assert made.returncode == 0, made.stderr
    with pytest.raises(UsageError, match=f"owner uid {NOBODY}"):
        control.private_socket_dir(tmp_root=str(open_dir))


def test_an_xdg_runtime_dir_others_can_write_to_is_refused(
    short_tmp: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xdg = short_tmp / "xdg"
    xdg.mkdir()
    os.chmod(xdg, 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert control.private_socket_dir() == socket_dir  # CKPTCTL_SOCKET_DIR: XDG's is not used
    monkeypatch.delenv(SOCKET_DIR_ENV)
    with pytest.raises(UsageError, match="XDG_RUNTIME_DIR"):
        control.private_socket_dir()


# -- what --control-socket may replace ---------------------------------------------------------------


def test_a_file_that_is_not_a_socket_is_refused_and_left_alone(short_tmp: Path) -> None:
    victim = short_tmp / "notes.txt"
    victim.write_text("keep me")
    with pytest.raises(UsageError, match="not a socket"):
        ControlServer(str(victim), Calls().handlers())
    assert victim.read_text() == "keep me"


def test_a_stale_socket_of_ours_is_replaced_a_live_one_refused(short_tmp: Path) -> None:
    path = str(short_tmp / "ctl.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a job that died: the file stays, nobody listens
    first = ControlServer(path, Calls().handlers()).start()
    try:
        with pytest.raises(UsageError, match="in use by another serve job"):
            ControlServer(path, Calls().handlers())
        status, doc = control_client.call(path, "GET", "/status", None, 10)
        assert status == 200 and doc["state"] == "idle"  # the first one still answers
    finally:
        first.close()


@needs_other_uid
def test_a_socket_of_another_user_is_never_replaced(open_dir: Path) -> None:
    path = str(open_dir / "ctl.sock")
    made = as_nobody(
        "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.close()",
        path,
    )
    assert made.returncode == 0, made.stderr
    with pytest.raises(UsageError, match=f"uid {NOBODY}, not yours"):
        ControlServer(path, Calls().handlers())
    assert os.lstat(path).st_uid == NOBODY  # still there, still theirs


# -- who may talk to it ------------------------------------------------------------------------------


NOBODY_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect failed:", type(exc).__name__)
    sys.exit(0)
s.sendall(b"POST /stop HTTP/1.1\\r\\nContent-Length: 0\\r\\n\\r\\n")
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(data.decode())
"""


@needs_other_uid
def test_another_user_cannot_reach_the_default_socket(runtime_dir: Path) -> None:
    calls = Calls()
    os.chmod(runtime_dir, 0o755)  # even where the runtime directory lets others pass
    path = control.default_socket_path(["http://127.0.0.1:30000"])
    server = ControlServer(path, calls.handlers()).start()
    try:
        r = as_nobody(NOBODY_CLIENT, path)
    finally:
        server.close()
    assert "connect failed: PermissionError" in r.stdout, r.stdout + r.stderr
    assert calls.seen == []


@needs_other_uid
def test_the_server_refuses_another_uid_even_through_an_open_socket(open_dir: Path) -> None:
    """The peer check stands on its own: with the socket's mode opened up by hand, another
    user connects, and is answered 403 without a byte of its request read."""
    calls = Calls()
    path = str(open_dir / "ctl.sock")
    server = ControlServer(path, calls.handlers()).start()
    try:
        os.chmod(path, 0o666)
        r = as_nobody(NOBODY_CLIENT, path)
        assert r.stdout.startswith("HTTP/1.1 403 "), r.stdout + r.stderr
        assert "takes commands from uid" in r.stdout
        assert calls.seen == []  # the stop never reached the job
        status, _ = control_client.call(path, "GET", "/status", None, 10)  # its owner still can
        assert status == 200
    finally:
        server.close()


def test_the_server_refuses_another_uid_unprivileged(
    server: tuple[str, Calls], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same peer check without root: the running job's accept loop compares each real
    connection's SO_PEERCRED uid with os.getuid(), which here says the job runs as another
    uid; this process's connection is answered 403, and its request never reaches a handler."""
    path, calls = server
    job_uid = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: job_uid)
    answer = raw_exchange(path, b"POST /stop HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 "), answer[:200]
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error == f"this serve job takes commands from uid {job_uid} only, not {job_uid - 1}"
    assert calls.seen == []  # the stop never reached the job
    monkeypatch.undo()
    assert control_client.call(path, "GET", "/status", None, 10)[0] == 200  # its owner still can


def test_a_client_refuses_a_job_run_by_another_uid_unprivileged(
    server: tuple[str, Calls], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's own peer check, past the file-owner check (the socket file is ours): the
    process listening is taken to run as another uid, and nothing is sent to it."""
    from ckptctl.unix_peers import peer_uid

    path, calls = server
    monkeypatch.setattr(control_client, "peer_uid", lambda conn: peer_uid(conn) + 1)
    with pytest.raises(OperationFailed, match=f"runs as uid {os.getuid() + 1}, not as you"):
        control_client.call(path, "POST", "/stop", None, 10)
    assert not control_client.answers(path)
    assert calls.seen == []


NOBODY_SQUATTER = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(8)
import os
os.chmod(sys.argv[1], 0o777)
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 56\\r\\n\\r\\n{"ok": true, "seq": 42, "state": "idle", "world_size": 9}')
    c.close()
"""


@needs_other_uid
def test_clients_refuse_a_socket_planted_by_another_user(open_dir: Path) -> None:
    path = str(open_dir / "ctl.sock")
    squatter = subprocess.Popen(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
         sys.executable, "-c", NOBODY_SQUATTER, path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        for args in (["status"], ["push", "--checkpoint-path", str(open_dir)], ["stop"]):
            r = run_script(*args, "--control-socket", path, timeout=30)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            assert f"belongs to uid {NOBODY}, not to you" in r.stderr
            assert "42" not in r.stdout
    finally:
        squatter.kill()
        squatter.wait(timeout=10)


def test_a_client_refuses_a_path_that_is_not_a_socket(short_tmp: Path) -> None:
    f = short_tmp / "plain"
    f.write_text("")
    r = run_script("status", "--control-socket", str(f), timeout=30)
    assert r.returncode == 1 and "is not a socket" in r.stderr


# -- the HTTP it speaks --------------------------------------------------------------------------------


@pytest.fixture
def server(short_tmp: Path) -> Iterator[tuple[str, Calls]]:
    calls = Calls()
    path = str(short_tmp / "ctl.sock")
    s = ControlServer(path, calls.handlers(), request_deadline_s=1.0).start()
    yield path, calls
    s.close()


def test_a_connection_past_the_cap_is_told_so_not_reset(short_tmp: Path) -> None:
    """With MAX_CONNECTIONS connections open and silent, one more is answered 503 with the
    reason, though its request (a stop with a body) is never read: the job lets its bytes in
    before closing, where closing on them reset the connection and lost the answer. Its stop
    never reaches the job; once the others close, requests are served again."""
    calls = Calls()
    path = str(short_tmp / "ctl.sock")
    server = ControlServer(path, calls.handlers(), request_deadline_s=120).start()
    silent = []
    try:
        for _ in range(control.MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            silent.append(s)
        body = b"x" * 4000
        request = b"POST /stop HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        answer = raw_exchange(path, request)
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error == f"more than {control.MAX_CONNECTIONS} connections at once"
        assert calls.seen == []
    finally:
        for s in silent:
            s.close()
    try:
        deadline = time.monotonic() + 60
        while control_client.call(path, "GET", "/status", None, 10)[0] != 200:
            assert time.monotonic() < deadline, "no slot came free"
            time.sleep(0.1)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /stop HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST /stop HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /stop HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"POST /stop HTTP/1.1\r\nContent-Length: 100000000000000\r\n\r\n", 413),
        (b"POST /stop HTTP/1.1\r\nContent-Length: 65537\r\n\r\n", 413),
        (b"POST /stop HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        (b"POST /stop HTTP/1.1\r\nContent-Length: 4\r\n\r\n{{{{", 400),
        (b"POST /stop HTTP/1.1\r\nContent-Length: 20000\r\n\r\n" + b"[" * 20000, 400),
        (b"hello\r\n\r\n", 400),
        (b"GET /status HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20000 + b"\r\n\r\n", 431),
        (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
        (b"DELETE /status HTTP/1.1\r\n\r\n", 405),
    ],
)
def test_malformed_requests_get_an_answer_never_a_crash(
    server: tuple[str, Calls], request_bytes: bytes, status: int
) -> None:
    path, calls = server
    answer = raw_exchange(path, request_bytes)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    doc = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert doc["ok"] is False and doc["error"]
    assert calls.seen == []
    assert control_client.call(path, "GET", "/status", None, 10)[0] == 200  # and it serves on


def test_a_client_that_trickles_its_request_is_cut_off(server: tuple[str, Calls]) -> None:
    """A per-request deadline, not a per-read one: a byte at a time never holds it."""
    import select

    path, calls = server
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"POST /stop HTTP/1.1\r\n")
        answer = b""
        deadline = time.monotonic() + 60  # the test's own bound; the server's is 1 s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([s], [], [], 0.1)
            if ready:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
                continue
            try:
                s.sendall(b"X")
            except OSError:
                break
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert calls.seen == []


@pytest.mark.parametrize(("status", "exit_code"), [(400, 2), (409, 2), (403, 1), (500, 1)])
def test_the_jobs_refusal_exits_as_documented(short_tmp: Path, status: int, exit_code: int) -> None:
    """A push the job refuses as malformed (400) or as sent to the wrong node (409) is a usage
    error, exit 2; any other refusal a failure, exit 1; the --json document says so too."""

    def refuse(_doc: Any) -> tuple[int, dict[str, Any]]:
        return status, {"ok": False, "error": f"refused with {status}"}

    path = str(short_tmp / "ctl.sock")
    s = ControlServer(path, {("POST", "/push"): refuse}).start()
    try:
        r = run_script(
            "push", "--control-socket", path, "--checkpoint-path", str(short_tmp), "--json",
            timeout=30,
        )  # fmt: skip
    finally:
        s.close()
    assert r.returncode == exit_code, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == exit_code and f"refused with {status}" in doc["error"]


def test_the_python_clients_status_redacts_a_password_in_a_target(short_tmp: Path) -> None:
    """The job lists the servers it feeds as given (`targets`); ckptctl.client.status() returns
    them as `status --json` prints them, the password of a URL taken out."""
    from ckptctl import client

    path = str(short_tmp / "ctl.sock")
    target = "http://admin:Pa55word!@127.0.0.1:30000"
    s = ControlServer(path, Calls([target]).handlers()).start()
    try:
        doc = client.status(control_socket=path)
        cli = run_script("status", "--control-socket", path, "--json", timeout=30)
    finally:
        s.close()
    assert doc["targets"] == ["http://admin:***@127.0.0.1:30000"]
    assert "Pa55word" not in json.dumps(doc) and "Pa55word" not in cli.stdout
    assert json.loads(cli.stdout)["targets"] == doc["targets"]


def test_a_request_within_bounds_reaches_its_handler(server: tuple[str, Calls]) -> None:
    path, calls = server
    status, doc = control_client.call(path, "POST", "/stop", {"why": "done"}, 10)
    assert status == 200 and doc == {"ok": True}
    assert calls.seen == [("stop", {"why": "done"})]


# -- which job a client talks to ---------------------------------------------------------------------


def test_two_jobs_get_two_sockets_and_clients_never_guess(socket_dir: Path) -> None:
    a, b = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
    path_a, path_b = control.default_socket_path([a]), control.default_socket_path([b])
    assert path_a != path_b
    servers = [
        ControlServer(path_a, Calls([a]).handlers()).start(),
        ControlServer(path_b, Calls([b]).handlers()).start(),
    ]
    stale = str(socket_dir / "serve-000000000000.sock")
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(stale)  # a job that died: never a candidate
    try:
        r = run_script("status", "--json", timeout=30)
        assert r.returncode == 2, r.stderr
        assert "2 serve jobs answer" in r.stderr and path_a in r.stderr and path_b in r.stderr
        assert json.loads(r.stdout)["ok"] is False
        assert control_client.choose_socket([b + "/"]) == path_b  # named after the endpoint
        r = run_script("status", "--endpoint", b, "--json", timeout=30)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["control_socket"] == path_b
        none = run_script("status", "--endpoint", "http://127.0.0.1:1", timeout=30)
        assert none.returncode == 1 and "no serve job of yours answers" in none.stderr
    finally:
        for s in servers:
            s.close()
    with pytest.raises(OperationFailed, match="no serve job of yours answers"):
        control_client.choose_socket([])


def test_a_job_feeding_several_servers_is_found_by_any_one_of_them() -> None:
    servers = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    path = control.default_socket_path(servers)
    s = ControlServer(path, Calls(servers).handlers()).start()
    try:
        assert control_client.choose_socket([servers[1]]) == path
        assert control_client.choose_socket([]) == path  # the only one
    finally:
        s.close()


def test_the_python_client_takes_one_endpoint_as_a_string_and_picks_its_job() -> None:
    """Two serve jobs on the node: `ckptctl.client.status(endpoint=URL)` talks to the one that
    feeds URL (a lone string is one URL, not a list of its characters), as `--endpoint` does."""
    from ckptctl import client

    a, b = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
    servers = [
        ControlServer(control.default_socket_path([t]), Calls([t]).handlers()).start()
        for t in (a, b)
    ]
    try:
        assert client.status(endpoint=b)["targets"] == [b]
        assert client.status(endpoint=[a])["targets"] == [a]
        assert client.find_job(endpoint=a + "/") == control.default_socket_path([a])
        with pytest.raises(UsageError, match="2 serve jobs"):
            client.status()
    finally:
        for server in servers:
            server.close()


def test_the_suite_never_sees_a_serve_job_of_the_users(
    socket_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`make test` beside the user's own serve job: every test, and every process it starts,
    looks for jobs in a directory of its own under pytest's (CKPTCTL_SOCKET_DIR, set by
    conftest.socket_dir). Live jobs planted where serve jobs go by default - a
    $XDG_RUNTIME_DIR/ckptctl/ and a /tmp/ckptctl-UID/, both moved into this test's directory,
    never the user's - are not seen while it is set, and are once it is unset."""
    assert control.socket_dirs() == [socket_dir]
    assert socket_dir.is_relative_to(tmp_path_factory.getbasetemp())
    xdg, tmp_root = short_tmp / "xdg", short_tmp / "tmp"
    xdg.mkdir(mode=0o700)
    tmp_root.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    calls = Calls()
    jobs = []
    for d in (xdg / "ckptctl", tmp_root / f"ckptctl-{os.getuid()}"):
        d.mkdir(mode=0o700)
        jobs.append(ControlServer(str(d / "serve-0123456789ab.sock"), calls.handlers()).start())
    try:
        # A process started by a test: it looked in the test's directory and nowhere else.
        r = run_script("status", "--json", timeout=30)
        assert r.returncode == 1, r.stderr
        assert f"(looked in {socket_dir}):" in json.loads(r.stdout)["error"]
        with pytest.raises(control_client.NotAnswering, match="no serve job of yours answers"):
            control_client.choose_socket([], tmp_root=str(tmp_root))
        assert calls.seen == []  # neither job was asked anything
        # Without the override both are found: the test above could have failed.
        monkeypatch.delenv(SOCKET_DIR_ENV)
        with pytest.raises(UsageError, match="2 serve jobs answer"):
            control_client.choose_socket([], tmp_root=str(tmp_root))
    finally:
        for job in jobs:
            job.close()


def test_a_relative_socket_dir_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOCKET_DIR_ENV, "sockets")
    r = run_script("status", timeout=30)
    assert r.returncode == 2 and "CKPTCTL_SOCKET_DIR=sockets is not an absolute path" in r.stderr


def test_ctrl_c_on_a_push_finds_its_answer_also_when_it_was_refused(short_tmp: Path) -> None:
    """Ctrl-C on `push` cancels it and waits for its answer in `status`: a push that ended
    refused before sending is there as `last_refused` (it does not replace `last`)."""
    from ckptctl.cli._output import Output
    from ckptctl.cli.serve import _cancel

    refused = {"ok": False, "exit_code": 3, "seq": 2, "push_id": "mine",
               "server_weights": None, "error": "no checkpoint at /typo"}  # fmt: skip
    last = {"ok": True, "exit_code": 0, "seq": 1, "push_id": "before", "server_weights": "whole"}
    handlers: dict[tuple[str, str], control.Handler] = {
        ("POST", "/cancel"): lambda _: (200, {"ok": True, "cancel": "cancelling", "seq": 2}),
        ("GET", "/status"): lambda _: (200, {"ok": True, "last": last, "last_refused": refused}),
    }
    path = str(short_tmp / "ctl.sock")
    server = ControlServer(path, handlers).start()
    try:
        answer = _cancel(Output(quiet=True), path, "mine")
    finally:
        server.close()
    assert answer["exit_code"] == 3 and answer["seq"] == 2, answer
    assert answer["error"].startswith("no checkpoint at /typo")


# A job whose stop handler has returned, and which ends at once: its answer is still being
# written by the connection's thread (made slow here), which the process's end would kill.
STOP_THEN_END = """
import sys, threading, time
from ckptctl.serve import control

control.ANSWER_GRACE_S = 120  # (a busy machine's pace must not decide it)
slow_send = control.send_json
control.send_json = lambda *a: (time.sleep(2), slow_send(*a))
stopped = threading.Event()
handlers = {("POST", "/stop"): lambda doc: (stopped.set(), (200, {"ok": True, "stopping": True}))[1]}
server = control.ControlServer(sys.argv[1], handlers).start()
print("listening", flush=True)
stopped.wait()
server.close()
"""


def test_a_job_that_ends_right_after_a_stop_still_answers_it(short_tmp: Path) -> None:
    """The client of `stop` got no answer (and exited 1) when the job ended before the
    connection's thread wrote it: closing waits for the answers already decided."""
    sock = str(short_tmp / "serve.sock")
    with subprocess.Popen(
        [sys.executable, "-c", STOP_THEN_END, sock], stdout=subprocess.PIPE, text=True
    ) as job:
        assert job.stdout.readline() == "listening\n"  # type: ignore[union-attr]
        status, answer = control_client.call(sock, "POST", "/stop", {}, timeout=120)
        assert (status, answer) == (200, {"ok": True, "stopping": True})
        assert job.wait(timeout=120) == 0


def test_a_client_still_sending_its_request_does_not_hold_the_job_at_its_end(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only answers already decided are waited for: a silent or trickling client (as many as
    the connection cap) never delays the end of the job."""
    import threading

    monkeypatch.setattr(control, "ANSWER_GRACE_S", 600.0)  # waited for, it would fail the test
    path = str(short_tmp / "ctl.sock")
    server = ControlServer(path, Calls().handlers(), request_deadline_s=600.0).start()
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.sendall(b"POST /stop HTTP/1.1\r\n")  # and nothing more
    assert control_client.call(path, "GET", "/status", None, timeout=60)[0] == 200
    closing = threading.Thread(target=server.close)
    closing.start()
    closing.join(timeout=60)
    silent.close()
    assert not closing.is_alive()
