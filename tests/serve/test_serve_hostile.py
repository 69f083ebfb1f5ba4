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
import os
import random
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
from ckpt_factory import write_real_checkpoint
from conftest import raw_exchange, run_script, wait_until
from test_serve_faults import push, status
from test_serve_overlap import SHARDS, file_digests, make_checkpoint, serving
from test_serve_stage import stage, staged_and_read
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


def same_tensors_other_files(root: Path, like: int) -> Path:
    """make_checkpoint(seed=like)'s tensors, in 2 files instead of SHARDS: the same layout, a
    different plan (another node's copy, re-sharded)."""
    from safetensors.torch import load_file

    source = make_checkpoint(root.parent / f"{root.name}-source", seed=like)
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(shard))
    names = sorted(tensors)
    half = len(names) // 2
    shards = [{n: tensors[n] for n in names[:half]}, {n: tensors[n] for n in names[half:]}]
    assert len(shards) != SHARDS
    return write_real_checkpoint(root, shards)


def rank0_fingerprint(path: Path) -> str:
    """What rank 0 of a 2-rank job computes for `path` (the plan a forger claims for all)."""
    from ckptctl.transfer.stages import plan_fingerprint, read_and_plan

    return plan_fingerprint(read_and_plan(str(path), 2, "auto")[1])


def test_what_a_store_writer_forges_never_decides_what_a_push_sends_or_reports(
    short_tmp: Path, tmp_path: Path
) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    c = make_checkpoint(tmp_path / "c", seed=3)
    c_elsewhere = same_tensors_other_files(tmp_path / "c-node1", like=3)
    port = free_master_port()
    # Rank 1 stands on "another node": its copy of c is re-sharded, and it has no copy of a2.
    a2 = tmp_path / "a2"
    shutil.copytree(a, a2)
    node_copy = {"CPU_PS_NODE_COPY": f"{c.resolve()}:{c_elsewhere},{a2.resolve()}:/no/copy"}
    with serving(short_tmp, tmp_path, a, checker=True, port=port, env=node_copy) as job:
        # 1. The attack: push a (push 1, by `serving`), stage b (2), push a again (3)
        # while "usable" is written for every rank where the ranks once agreed on a stage.
        code, _, err = stage(job.sock, b)
        assert code == 0, err
        wait_until(lambda: staged_and_read(job.sock), what="the staged read")
        usable = json.dumps({"usable": True})
        job.workers.digests.clear()
        with forging(port, {"push3//staged/0": usable, "push3//staged/1": usable}) as rounds:
            code, doc, err = push(job.sock, path=a)
        assert rounds[0] > 0
        assert code == 0, err
        assert doc["seq"] == 3 and doc["checkpoint_path"] == str(a.resolve()), doc
        assert not any(r["staged"] for r in doc["ranks"]), doc["ranks"]
        assert job.workers.digests == file_digests(a)  # every tensor of a, none of b

        # 2. --verify's proofs: every rank's hashes and offers, forged to disagree with what
        # the server holds. They travel over the job's group: the push proves b all the same.
        junk = json.dumps({"sha256": {"layers.0.w": "0" * 64}, "where": "x", "offers": []})
        keys = {f"push4//{k}/{r}": junk for r in (0, 1) for k in ("verify-sha256",
                "verify-checksums", "verify-offers", "verify-weights")}  # fmt: skip
        job.pushing = b
        with forging(port, keys):
            code, doc, err = push(job.sock, "--verify", path=b)
        assert code == 0, err
        assert doc["verified"] == "checksum" and doc["verification"]["tensor_count"] == 16, doc
        assert job.workers.digests == file_digests(b)

        # 3. Rank 1 (on "another node") sees c re-sharded: a forger claims one plan for both
        # ranks. The plans are compared over the group: refused, and nothing moves.
        fingerprint = json.dumps({"fingerprint": rank0_fingerprint(c), "host": "x"})
        updates = job.workers.updates
        with forging(port, {"push5//plan/0": fingerprint, "push5//plan/1": fingerprint}):
            code, doc, err = push(job.sock, path=c)
        assert code == 3, err
        assert "rank 1 (on " in doc["error"] and "sees a different checkpoint" in doc["error"]
        assert doc["server_weights"] is None and job.workers.updates == updates
        # (A rank that fails before the ranks compare their plans still answers there with its
        # error: the group stays in step, and the job serves on.)
        code, doc, err = push(job.sock, path=a2)
        assert code == 3, err
        assert doc["error"].startswith("/no/copy: does not exist"), doc["error"]
        assert doc["ranks"][0]["error"].startswith("rank 1 failed: /no/copy"), doc["ranks"]

        # 4. Forged barrier keys let a rank pass early: the push is what it would be.
        passed = {f"push7//{k}/{r}": "1" for r in (0, 1) for k in ("servers-up", "pushed")}
        job.pushing = a
        with forging(port, passed):
            code, doc, err = push(job.sock, path=a)
        assert code == 0, err
        assert job.workers.digests == file_digests(a)

        # 5. A forged abort notice of a push fails that push, as a failure and one clean line;
        # the job serves on.
        notice = json.dumps({"code": 0, "message": "all good\x1b[2J\x1b]0;PWNED\x07", "rank": 0})
        with forging(port, {"push8//abort": notice}):
            code, doc, err = push(job.sock, path=b)
        assert code == 1 and doc["ok"] is False, err
        assert doc["error"] == "rank 0 failed: all good", doc["error"]
        job.pushing = b
        code, doc, err = push(job.sock, path=b)
        assert code == 0, err
        assert job.workers.digests == file_digests(b)
        assert status(job.sock)["last"]["seq"] == 9

        # 6. A forged abort notice of the whole job ends it, as a failure: never 0.
        assert job.proc is not None
        with forging(port, {"abort": notice}):
            _, err = job.proc.communicate(timeout=60)
        assert job.proc.returncode not in (0, None), err[-3000:]
        assert "rank 0 failed: all good" in err and "PWNED" not in err


def test_a_forged_barrier_never_lets_a_rank_consume_its_files_before_every_rank_checked(
    short_tmp: Path,
) -> None:
    """push --consume-shm-files: no rank consumes (pins and deletes) a file before every rank
    has checked every file. Rank 0 checks late, and a forger writes "checked" for every rank
    where the ranks once met in the store: they meet over the job's group, and the push goes
    through whole."""
    from conftest import cpu_serve_job, wait_for_path
    from fake_server import Behaviour, FakeServer
    from locations import TINY

    shm = Path(tempfile.mkdtemp(prefix="ckptctl-test-consume-", dir="/dev/shm")) / "ck"
    shutil.copytree(TINY, shm)
    sock, port = str(short_tmp / "serve.sock"), free_master_port()
    try:
        with (
            FakeServer(Behaviour()) as server,
            cpu_serve_job(
                server.endpoint, "--control-socket", sock, "--push-timeout", "120",
                env={"CPU_PS_SLOW_CHECK_RANK": "0"}, port=port,
            ) as proc,
        ):  # fmt: skip
            output = draining(proc)
            assert wait_for_path(sock), "the serve job did not open its control socket"
            checked = {f"push1//consume-checked/{r}": "1" for r in (0, 1)}
            with forging(port, checked):
                code, doc, err = push(sock, "--consume-shm-files", path=shm)
            assert code == 0, err
            assert sorted(os.listdir(shm)) == ["model.safetensors.index.json"]  # all consumed
            assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
            proc.wait(timeout=60)
        assert proc.returncode == 0, "".join(output)[-3000:]
    finally:
        shutil.rmtree(shm.parent, ignore_errors=True)


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


def raw(sock: str, request: bytes) -> tuple[int, dict]:
    """Send `request` as is; (HTTP status, JSON answer) - the job always answers."""
    head, _, body = raw_exchange(sock, request, timeout=120).partition(b"\r\n\r\n")
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
