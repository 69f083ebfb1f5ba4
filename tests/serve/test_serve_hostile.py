"""A serve job among hostile neighbours (issue 33 items 1 and 3), on CPU: a real 2-rank job
whose stand-in engine sends the bytes the way checkpoint-engine does, to a fake SGLang whose
workers hash every tensor they load (as tests/serve/test_serve_overlap.py).

- Beside it, a plain TCPStore client writes into torchrun's store, which has no
  authentication: each key the job reads there (SECURITY.md's table) can only make it more
  careful - fail a push, end the job - never choose what a server loads or what a push reports.
- Its control socket takes a thousand hostile requests: each gets an answer, and the job
  serves on.

Deadlines are safety nets; nothing here depends on how long anything takes."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
from conftest import run_script, wait_until
from test_serve_faults import push, status
from test_serve_overlap import file_digests, make_checkpoint, serving
from torchrun_launch import free_master_port

pytestmark = pytest.mark.slow

# Where the job's keys live in torchrun's store (its default run id, first start); a push's
# under `push<seq>/` (PrefixStore joins with "/").
JOB_KEYS = "ckptctl/none/0//"


@contextmanager
def forging(port: int, keys: dict[str, str]) -> Iterator[list[int]]:
    """A client of the job's store that writes `keys` (under JOB_KEYS) over and over, as fast
    as the store takes them, until the block ends: whenever a rank reads one, the forger's
    value is there. Yields how many rounds it wrote so far."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    rounds, done = [0], threading.Event()

    def forge() -> None:
        while not done.is_set():
            try:
                for key, value in keys.items():
                    store.set(JOB_KEYS + key, value)
            except RuntimeError:  # (DistNetworkError) the job, and its store, ended
                return
            rounds[0] += 1

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        yield rounds
    finally:
        done.set()
        thread.join(timeout=10)


# -- the control socket ------------------------------------------------------------------------


def draining(proc: subprocess.Popen[str]) -> list[str]:
    """Read the job's output as it comes, into the list returned: its log names each hostile
    push, and a pipe left full would stall the rank that writes to it."""
    lines: list[str] = []

    def read(stream: IO[str]) -> None:
        lines.extend(stream)

    for stream in (proc.stdout, proc.stderr):
        assert stream is not None
        threading.Thread(target=read, args=(stream,), daemon=True).start()
    return lines


def raw(sock: str, request: bytes, timeout: float = 120) -> tuple[int, dict]:
    """Send `request` as is; (HTTP status, JSON answer) - the job always answers."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(sock)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(route: str, body: bytes) -> bytes:
    return (
        f"POST {route} HTTP/1.1\r\nHost: serve\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def hostile_body(rng: random.Random) -> bytes:
    """Random, huge, nested, non-UTF-8 or ill-typed bodies, and some that read as a push of a
    checkpoint that does not exist (the job runs those, and fails them)."""
    texts = ["", "a", "é" * rng.randrange(1, 9000), "😀" * rng.randrange(1, 9000),
             "\udcff" * 50, "\x00", "\x1b[2J", "/no/such/" + "x" * rng.randrange(5000)]  # fmt: skip
    values: list[object] = [None, True, 1, -1, 10**30, 1.5, [], {}, *texts]
    kind = rng.choices(range(7), weights=[3, 2, 3, 4, 2, 0.3, 1])[0]
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
    if kind == 1:
        depth = rng.randrange(500, 100_000)
        return b'{"push_id": ' + b"[" * depth + b"]" * depth + b', "checkpoint_path": "/x"}'
    if kind == 2:
        return json.dumps(rng.choice(values)).encode()
    if kind == 3:  # every field, any value
        fields = ["checkpoint_path", "checkpoint_name", "weight_version", "push_id", "trace",
                  "verify", "consume_shm_files", "allow_layout_change", "seq", "action"]  # fmt: skip
        doc = {f: rng.choice(values) for f in rng.sample(fields, rng.randrange(1, len(fields)))}
        return json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if kind == 4:  # near the bounds, in wide characters
        wide = rng.choice(["é", "😀", "\x01", "\udcff"])
        doc = {
            "checkpoint_path": "/no/such/" + wide * rng.randrange(900, 4200),
            "checkpoint_name": wide * rng.randrange(200, 1100),
            "push_id": wide * rng.randrange(50, 300),
        }
        return json.dumps(doc).encode()
    if kind == 5:  # runs: a push of nothing that exists
        return json.dumps({"checkpoint_path": f"/no/such/{rng.random()}"}).encode()
    return b'{"checkpoint_path": "/x", "push_id": "' + b"\xc3\xa9" * 30_000 + b'"}'


def test_a_thousand_hostile_requests_are_each_answered_and_the_job_serves_on(
    short_tmp: Path, tmp_path: Path
) -> None:
    """Issue 33 item 3: bounds in bytes, push_id checked, every failure of one command
    contained. The last push is bit-exact."""
    from ckptctl import client

    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    port = free_master_port()
    with serving(short_tmp, tmp_path, a, port=port) as job:
        assert job.proc is not None
        output = draining(job.proc)
        # The three: through the Python client, and as bytes (990 lists deep: deeper
        # than this test's own JSON encoder goes; 30,000 "é" in UTF-8, as no escapes).
        for push_id in ([[["x"]]], "é" * 10_000):
            with pytest.raises(Exception, match="push_id must be a string"):
                client.push(b, control_socket=job.sock, push_id=push_id)  # type: ignore[arg-type]
        for push_id in (b"[" * 990 + b"]" * 990, b'"' + "é".encode() * 30_000 + b'"'):
            body = b'{"checkpoint_path": "/x", "push_id": ' + push_id + b"}"
            code, doc = raw(job.sock, post("/push", body))
            assert code == 400 and "push_id must be a string" in doc["error"], doc
        with pytest.raises(Exception, match="at most 1024 bytes"):
            client.push(b, control_socket=job.sock, checkpoint_name="😀" * 1024)
        rng = random.Random(3333)
        routes = ["/push", "/stage", "/rollback", "/cancel", "/status", "/nowhere"]
        answered: dict[int, int] = {}
        ran = 0
        for _ in range(1000):
            route = rng.choice(routes)
            code, doc = raw(job.sock, post(route, hostile_body(rng)))
            answered[code] = answered.get(code, 0) + 1
            assert isinstance(doc, dict) and "ok" in doc or code == 405, (code, doc)
            if code == 200 and doc.get("seq"):
                ran += 1
                assert doc["ok"] is False and doc["exit_code"] in (2, 3), doc  # nothing there
        assert ran > 3 and answered.get(400, 0) > 300, answered
        assert 500 not in answered, answered
        assert job.proc.poll() is None
        assert status(job.sock)["state"] == "idle"
        code, doc, err = push(job.sock, path=b)
        assert code == 0, err
        assert job.workers.digests == file_digests(b)
        history = run_script("status", "--control-socket", job.sock, "--history", "--json")
        assert json.loads(history.stdout)["pushes_run"] == ran + 2  # (serving's push, and b)

        # A heartbeat counter that is not a number: the store drops the connection of every
        # rank that adds to it, and the job ends, as a failure.
        with forging(port, {"hb/1": "not a number"}):
            job.proc.wait(timeout=60)
        assert job.proc.returncode != 0
        wait_until(lambda: "lost contact with the job's store" in "".join(output), what="why")
