"""A real torchrun `serve` job on CPU driven through its control socket by `ckptctl push` and
`ckptctl status`: commands reach every rank in order, a failed push leaves the job serving."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from conftest import raw_exchange, run_script, wait_for_path
from fake_server import job_of_ranks, torchrun_job
from locations import SERVE_RANK, TINY

pytestmark = pytest.mark.slow


def test_push_status_and_a_failed_push_in_between(short_tmp: Path) -> None:
    sock = str(short_tmp / "serve.sock")
    with _job(sock) as job:
        assert wait_for_path(sock), "the control socket never appeared"

        good = run_script(
            "push",
            "--control-socket",
            sock,
            "--checkpoint-path",
            str(TINY),
            "--checkpoint-name",
            "step-1",
            "--json",
            timeout=60,
        )
        assert good.returncode == 0, good.stderr
        doc = json.loads(good.stdout)
        assert doc["ok"] and doc["seq"] == 1
        assert sum(r["tensors"] for r in doc["ranks"]) == 25  # every tensor, once, over 2 ranks

        bad = run_script(
            "push",
            "--control-socket",
            sock,
            "--checkpoint-path",
            str(short_tmp / "missing"),
            timeout=60,
        )
        assert bad.returncode == 3
        assert "missing" in bad.stderr

        # A push that fails with a plain exception on one rank (checkpoint-engine raises
        # those) fails like any other: exit 1, and the job goes on.
        boom = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
            "--checkpoint-name", "boom", timeout=60,
        )  # fmt: skip
        assert boom.returncode == 1, boom.stderr
        assert "RuntimeError: injected" in boom.stderr

        # Issue 34: any failure of one command, where it runs or around it, is that command's
        # result; the job serves on.
        unmerged = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
            "--checkpoint-name", "unmerged", "--json", timeout=60,
        )  # fmt: skip
        assert unmerged.returncode == 1, unmerged.stderr
        failed = json.loads(unmerged.stdout)
        assert failed["seq"] == 4 and failed["action"] == "push", failed
        assert failed["error"] == "RuntimeError: injected: the loop's own bookkeeping failed"

        again = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY), timeout=60
        )
        assert again.returncode == 0, again.stderr  # the job is still usable
        assert again.stdout.startswith(f"pushed {TINY.resolve()} (push 5, "), again.stdout
        assert doc["wall_s"] == doc["seconds"] > 0

        status = run_script("status", "--control-socket", sock, "--json", timeout=30)
        assert status.returncode == 0
        st = json.loads(status.stdout)
        assert st["state"] == "idle" and st["commands"] == 5 and st["world_size"] == 2
        assert st["last"]["ok"] and st["last"]["seq"] == 5 and st["failed"] == 3

        stop = run_script("stop", "--control-socket", sock, timeout=30)
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout == f"stopped: the serve job on {sock}\n"  # the result: stdout
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "rank 1: stopped by a client (ckptctl stop) (on rank 0)" in out
    assert not os.path.exists(sock)


def test_push_without_a_serve_job_says_so(short_tmp: Path) -> None:
    r = run_script(
        "push", "--control-socket", str(short_tmp / "none.sock"), "--checkpoint-path", str(TINY)
    )
    assert r.returncode == 1 and "no serve job answers" in r.stderr
    assert "or wait for it with --wait SECONDS" in r.stderr  # (push has one)


def test_every_client_offers_its_wait_for_a_job_until_a_wait_given_ran_out(
    short_tmp: Path,
) -> None:
    """--wait means one thing in every client command (wait for a serve job to answer): each
    offers it when no job answers, and none once a --wait given ran out (exit 4)."""
    sock = str(short_tmp / "none.sock")
    for command in ("rollback", "stop", "status", "stage", "push"):
        path = ["--checkpoint-path", str(TINY)] if command in ("push", "stage") else []
        r = run_script(command, *path, "--control-socket", sock)
        assert r.returncode == 1 and "no serve job answers" in r.stderr, (command, r.stderr)
        assert "or wait for it with --wait SECONDS" in r.stderr, (command, r.stderr)
        r = run_script(command, *path, "--control-socket", sock, "--wait", "0.5")
        assert r.returncode == 4 and "waited 0.5s" in r.stderr, (command, r.stderr)
        assert "--wait" not in r.stderr, (command, r.stderr)
    # --timeout bounds the whole command, its wait for a job too
    r = run_script("status", "--control-socket", sock, "--wait", "600", "--timeout", "1")
    assert r.returncode == 4 and "waited 1s" in r.stderr, r.stderr


def _job(
    sock: str, *, port: int | None = None, ranks: int = 2, **env: str
) -> AbstractContextManager[subprocess.Popen[str]]:
    """The 2-rank serve job of serve_rank.py on control socket `sock`; `ranks=1`: one process,
    for the tests whose subject is the control socket and its clients, not the ranks."""
    return job_of_ranks(ranks, SERVE_RANK, sock, port=port, env=env)


def _ran(log: Path) -> list[str]:
    """The pushes every rank ran (serve_rank.py's log), as rank:name."""
    names = []
    for rank in (0, 1):
        f = Path(f"{log}.{rank}")
        if f.exists():
            names += [
                f"{rank}:{json.loads(x)['checkpoint_name']}" for x in f.read_text().splitlines()
            ]
    return names


# What `push` and a stop wrote into torchrun's store when commands travelled through it. The
# store listens for anyone who can reach the node, and checks no one.
FORGER = """
import json, sys
from datetime import timedelta
from torch.distributed import PrefixStore, TCPStore
port, ckpt = int(sys.argv[1]), sys.argv[2]
client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
# The job's keys, the way its ranks name them (torchrun's default run id, first start).
store = PrefixStore("ckptctl/none/0/", client)
seq = store.add("serve/next", 1)
store.set(f"serve/cmd/{seq}", json.dumps({
    "action": "push", "checkpoint_path": ckpt, "checkpoint_name": "ATTACKER",
    "weight_version": "ATTACKER", "consume_shm_files": False, "seq": seq}))
store.set("stop", json.dumps({"reason": "stopped by attacker", "rank": 0}))
print("forged", seq)
"""


def test_commands_written_into_torchruns_store_change_nothing(short_tmp: Path) -> None:
    """Issue 14 item 1: a process that writes into the job's store exactly what a push and a
    stop wrote there is ignored: commands come only from the control socket, over the job's
    own gloo group. The job runs no forged push and keeps serving."""
    from torchrun_launch import free_master_port

    sock, log, port = str(short_tmp / "serve.sock"), short_tmp / "ran", free_master_port()
    with _job(sock, port=port, SERVE_RANK_LOG=str(log)) as job:
        assert wait_for_path(sock), "the control socket never appeared"
        import sys

        forged = subprocess.run(
            [sys.executable, "-c", FORGER, str(port), str(TINY)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert forged.returncode == 0 and "forged 1" in forged.stdout, forged.stderr
        # The job's own push after the forgery: it is the first and only one the job runs.
        good = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
            "--checkpoint-name", "legit", "--json", timeout=60,
        )  # fmt: skip
        assert good.returncode == 0, good.stderr
        assert json.loads(good.stdout)["seq"] == 1
        status = run_script("status", "--control-socket", sock, "--json", timeout=30)
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["state"] == "idle" and st["commands"] == 1
        assert st["last"]["checkpoint_name"] == "legit"
        assert sorted(_ran(log)) == ["0:legit", "1:legit"]
        assert job.poll() is None, "the forged stop ended the job"
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "attacker" not in out + err
    assert "rank 0: stopped by a client (ckptctl stop) (on rank 0)" in out


def test_sigterm_to_any_rank_stops_every_rank(short_tmp: Path) -> None:
    """A signal to one rank travels to the others in the next tick of the job's own group."""
    import signal

    sock, pids = str(short_tmp / "serve.sock"), short_tmp / "pids"
    pids.mkdir()
    with _job(sock, SERVE_RANK_PIDS=str(pids)) as job:
        assert wait_for_path(sock)
        os.kill(int((pids / "1").read_text()), signal.SIGTERM)
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "rank 0: stopped by SIGTERM (on rank 1)" in out
    assert "rank 1: stopped by SIGTERM (on rank 1)" in out
    assert not os.path.exists(sock)


def test_push_and_status_wait_for_a_job_that_is_still_starting(short_tmp: Path) -> None:
    """`serve &` then `push --wait`: the push waits for the socket instead of failing."""
    sock = str(short_tmp / "serve.sock")
    nothing = run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(TINY), "--wait", "0.5"
    )
    assert nothing.returncode == 4 and "waited 0.5s" in nothing.stderr, nothing.stderr
    # Both clients start before the job does: no socket can be there when they first look.
    push, status = (
        subprocess.Popen(
            [*_script(*args), "--control-socket", sock, "--wait", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (("push", "--checkpoint-path", str(TINY), "--json"), ("status",))
    )
    assert not os.path.exists(sock)
    with _job(sock, ranks=1) as job:
        out, err = push.communicate(timeout=180)
        assert push.returncode == 0, err
        assert json.loads(out)["ok"] is True
        status_out, status_err = status.communicate(timeout=180)
        assert status.returncode == 0, status_err
        assert "serve job:" in status_out
        stop = run_script("stop", "--control-socket", sock, "--wait", "60")
        assert stop.returncode == 0 and stop.stdout == f"stopped: the serve job on {sock}\n"
        assert not os.path.exists(sock)
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]


def _script(*args: str) -> list[str]:
    from conftest import ckptctl_script

    return [ckptctl_script(), *args]


def test_malformed_requests_get_an_answer_and_the_job_serves_on(short_tmp: Path) -> None:
    """Issue 14 item 7: a bad Content-Length is a 400, a huge one a 413; never a traceback."""
    sock = str(short_tmp / "serve.sock")
    with _job(sock, ranks=1) as job:
        assert wait_for_path(sock)
        bad = raw_exchange(sock, b"POST /push HTTP/1.1\r\nContent-Length: abc\r\n\r\n")
        assert bad.startswith(b"HTTP/1.1 400 "), bad
        assert b"Content-Length" in bad
        huge = raw_exchange(sock, b"POST /push HTTP/1.1\r\nContent-Length: 100000000000000\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 413 "), huge
        notjson = raw_exchange(sock, b"POST /push HTTP/1.1\r\nContent-Length: 3\r\n\r\n{{{")
        assert notjson.startswith(b"HTTP/1.1 400 "), notjson
        status = run_script("status", "--control-socket", sock, "--json", timeout=30)
        assert status.returncode == 0 and json.loads(status.stdout)["commands"] == 0
        assert run_script("stop", "--control-socket", sock).returncode == 0
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "Traceback" not in err and "MemoryError" not in err


def test_on_two_nodes_the_second_nodes_socket_takes_status_and_stop_only(
    short_tmp: Path,
) -> None:
    """Two torchrun 'nodes' on loopback, one rank each: each node's local rank 0 hosts a
    socket. Pushes go through global rank 0's node; the other node's socket refuses them,
    answers status with its own view (every rank keeps the results), and takes a stop."""
    import socket as socketlib

    from torchrun_launch import free_master_port

    port = free_master_port()
    socks = [str(short_tmp / "node0.sock"), str(short_tmp / "node1.sock")]

    def node(n: int) -> AbstractContextManager[subprocess.Popen[str]]:
        return torchrun_job(SERVE_RANK, socks[n], nproc=1, nnodes=2, node_rank=n, port=port)

    with node(0) as node0, node(1) as node1:
        nodes = [node0, node1]
        assert all(wait_for_path(s) for s in socks)
        refused = run_script("push", "--control-socket", socks[1], "--checkpoint-path", str(TINY))
        assert refused.returncode == 2, refused.stderr
        assert f"push on {socketlib.gethostname()}" in refused.stderr
        good = run_script(
            "push", "--control-socket", socks[0], "--checkpoint-path", str(TINY),
            "--checkpoint-name", "both", timeout=60,
        )  # fmt: skip
        assert good.returncode == 0, good.stderr
        st = run_script("status", "--control-socket", socks[1], "--json", timeout=30)
        doc = json.loads(st.stdout)
        assert doc["rank"] == 1 and doc["takes_push"] is False
        assert doc["commands"] == 1 and doc["last"]["checkpoint_name"] == "both"
        assert run_script("stop", "--control-socket", socks[1]).returncode == 0
        outs = [n.communicate(timeout=60) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert "rank 0: stopped by a client (ckptctl stop) (on rank 1)" in outs[0][0]
