"""A serve job under the faults an operator meets, on CPU: a real torchrun job of 2 ranks (or
one process, where the fault is the server's alone) whose update is the real
ParameterServerSession's, speaking checkpoint-engine's IPC protocol over real zmq sockets
(tests/support/cpu_ps_rank.py, CPU_PS_TRANSFER=zmq) to the workers of a fake SGLang
(tests/support/fake_worker.py) that can die, fail or be slow mid-transfer, or not be there at all.

Each fault must end the push (never the job), with the documented exit code and words, and
leave the server whole where it can: after a push that broke off once the workers had taken
weights, the job pushes the last whole checkpoint again. Deadlines here are safety nets far
below the product's own bounds (--push-timeout 300): a push that is not ended by the fault's
handling would run into them and fail the test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ckpt_factory import rewrite_in_place_setting_the_mtime_back
from conftest import ckptctl_script, cpu_serve_job, run_script, wait_for_path, wait_until
from fake_server import Behaviour, FakeServer, rank_pid
from fake_worker import ZmqWorkers
from locations import TINY

pytestmark = pytest.mark.slow


def tensor_names(root: Path = TINY) -> set[str]:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    return set(index["weight_map"])


def loaded_names(workers: ZmqWorkers, update: int | None = None) -> set[str]:
    return {n for buckets in workers.loaded.values() for b in buckets for n in b}


class Site:
    """A fake SGLang of TP2 on a port of its own that can die and come back on that port."""

    def __init__(self) -> None:
        # SO_REUSEADDR before bind, as the server that comes back sets it: the connections
        # of the server that died (inheriting it) must not keep the port from being bound.
        port_sock = socket.socket()
        port_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port_sock.bind(("127.0.0.1", 0))
        self.port = port_sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.workers = ZmqWorkers()
        self.server: FakeServer | None = FakeServer(
            Behaviour(on_update=self.workers), listen_on=port_sock
        ).start()

    @property
    def behaviour(self) -> Behaviour:
        assert self.server is not None
        return self.server.behaviour

    def die(self) -> None:
        self.workers.die()
        assert self.server is not None
        self.server.stop()
        self.server = None

    def come_back(self) -> None:
        self.workers = ZmqWorkers()
        self.server = FakeServer(Behaviour(on_update=self.workers), port=self.port).start()

    def close(self) -> None:
        if self.server is not None:
            self.workers.die()
            self.server.stop()


@contextmanager
def serve_job(
    short_tmp: Path, *flags: str, ranks: int = 2
) -> Iterator[tuple[Site, subprocess.Popen[str], str]]:
    """A serve job feeding a fresh Site: 2 ranks under torchrun (a TP2 server), or, where the
    fault's subject is the server and not the ranks, `ranks=1` (one process, a TP1 server)."""
    sock = str(short_tmp / "serve.sock")
    site = Site()
    try:
        with cpu_serve_job(
            site.endpoint, "--control-socket", sock, "--push-timeout", "300", *flags,
            env={"CPU_PS_TRANSFER": "zmq", "CPU_PS_BUCKETS": "4"}, ranks=ranks,
        ) as job:  # fmt: skip
            assert wait_for_path(sock), "the serve job did not open its control socket"
            yield site, job, sock
    finally:
        site.close()


def push(sock: str, *args: str, path: Path = TINY, timeout: float = 120) -> tuple[int, dict, str]:
    r = run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(path), "--json", *args,
        timeout=timeout,
    )  # fmt: skip
    return r.returncode, json.loads(r.stdout), r.stderr


def push_in_background(sock: str, *args: str, path: Path = TINY) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [ckptctl_script(), "push", "--control-socket", sock, "--checkpoint-path", str(path),
         "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def status(sock: str) -> dict:
    """`ckptctl status --json`'s document, asked from this process: tests poll it, and a
    command's process (a second or more on a busy machine) could miss a state that lasts
    seconds (the CLI's own output is tested in test_serve.py and test_serve_history.py)."""
    from ckptctl import client

    return client.status(control_socket=sock)


def stop(job: subprocess.Popen[str], sock: str) -> str:
    assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    return err


def test_a_server_that_dies_mid_push_fails_the_push_and_the_job_serves_on(short_tmp: Path) -> None:
    with serve_job(short_tmp, "--server-wait", "3") as (site, job, sock):
        code, first, err = push(sock, "--weight-version", "v1")
        assert code == 0, err
        assert loaded_names(site.workers) == tensor_names()

        site.workers.loaded.clear()
        site.workers.hold_at_bucket = 2  # (bucket 1 loaded: the server's weights are partial)
        broken = push_in_background(sock, "--weight-version", "v2")
        wait_until(site.workers.holding.is_set, what="the server's worker to hold a bucket")
        site.die()
        out, err = broken.communicate(timeout=120)  # (--push-timeout is 300)
        assert broken.returncode == 1, err
        doc = json.loads(out)
        assert "127.0.0.1" in doc["error"] and "partly updated" in doc["error"], doc["error"]
        # The restore had no server to go to: the job says so, and says partial.
        assert doc["server_weights"] == "partial"
        assert doc["restore"]["ok"] is False and doc["restore"]["restored_push"] == 1
        assert "did not answer" in doc["restore"]["error"]
        st = status(sock)
        assert st["state"] == "idle" and st["server_weights"] == "partial", st
        assert job.poll() is None

        site.come_back()
        code, again, err = push(sock, "--weight-version", "v3")
        assert code == 0, err
        assert again["server_weights"] == "whole"
        assert loaded_names(site.workers) == tensor_names()
        assert site.behaviour.weight_version == "v3"
        stop(job, sock)


def test_a_push_refused_mid_way_is_followed_by_a_restore_of_the_last_whole_push(
    short_tmp: Path,
) -> None:
    with serve_job(short_tmp) as (site, job, sock):
        code, _, err = push(sock, "--weight-version", "v1")
        assert code == 0, err
        site.workers.fail_at_bucket = 2
        code, doc, err = push(sock, "--weight-version", "v2")
        assert code == 1, err
        assert "injected failure" in doc["error"], doc["error"]
        assert "server weights: whole again (restored push 1)" in doc["error"]
        assert doc["server_weights"] == "whole" and doc["restore"]["ok"] is True
        # The restore went through the server again, whole, with push 1's weight version
        # (the stand-in fails one bucket only on the first update it is told to).
        assert site.behaviour.weight_version == "v1"
        st = status(sock)
        assert st["server_weights"] == "whole" and st["weights"]["seq"] == 1, st
        assert st["last"]["ok"] is False and st["failed"] == 1
        human = run_script("status", "--control-socket", sock, timeout=30).stdout
        assert "server weights: whole, from push 1" in human, human
        stop(job, sock)


def test_a_restore_is_refused_when_the_last_whole_push_changed_on_disk(
    short_tmp: Path, tmp_path: Path
) -> None:
    """Issue 33 item 9: the restore after a push that failed part-way pushes the last whole
    checkpoint again only if its files are those it pushed; rewritten since, nothing is sent,
    and the server is said to hold a mix."""
    first = tmp_path / "first"
    shutil.copytree(TINY, first)
    with serve_job(short_tmp, ranks=1) as (site, job, sock):
        assert push(sock, "--weight-version", "v1", path=first)[0] == 0
        shard = next(first.glob("*.safetensors"))
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
        site.workers.fail_at_bucket = 2
        updates = site.workers.updates
        code, doc, err = push(sock, "--weight-version", "v2")
        assert code == 1, err
        assert doc["server_weights"] == "partial" and doc["restore"]["ok"] is False, doc
        assert f"{shard.name} was rewritten" in doc["restore"]["error"], doc["restore"]
        assert "whole again" not in doc["error"] and "the restore of push 1 failed" in doc["error"]
        assert site.workers.updates == updates + 1  # the failed push; the restore sent nothing
        assert status(sock)["server_weights"] == "partial"
        stop(job, sock)


def test_no_restore_leaves_the_server_partial_and_says_so(short_tmp: Path) -> None:
    with serve_job(short_tmp, "--no-restore", ranks=1) as (site, job, sock):
        assert push(sock)[0] == 0
        site.workers.fail_at_bucket = 2
        code, doc, err = push(sock)
        assert code == 1, err
        assert doc["server_weights"] == "partial" and "restore" not in doc
        assert "not restored: serve --no-restore" in doc["error"]
        assert status(sock)["server_weights"] == "partial"
        stop(job, sock)


def test_a_server_that_does_not_answer_fails_the_push_at_server_wait_and_shows_the_wait(
    short_tmp: Path,
) -> None:
    with serve_job(short_tmp, "--server-wait", "8", ranks=1) as (site, job, sock):
        assert push(sock)[0] == 0
        site.die()
        waiting = push_in_background(sock)
        seen: list[dict] = []

        def waiting_shown() -> bool:
            running = status(sock).get("running") or {}
            seen.append(running)
            return running.get("stage") == "wait_server" and "connection refused" in str(
                running.get("detail")
            )

        wait_until(waiting_shown, what="status to show the wait for the server")
        out, err = waiting.communicate(timeout=120)
        assert waiting.returncode == 1, err
        doc = json.loads(out)
        assert doc["server_weights"] is None  # never reached the server
        assert site.endpoint in doc["error"] and "serve --server-wait" in doc["error"]
        assert "connection refused" in doc["error"]
        assert status(sock)["state"] == "idle" and job.poll() is None

        site.come_back()
        assert push(sock)[0] == 0
        assert loaded_names(site.workers) == tensor_names()
        stop(job, sock)


def test_the_first_push_waits_server_start_wait_for_a_wrong_endpoint_and_says_so(
    short_tmp: Path, refused_endpoint: str
) -> None:
    """A serve job pointed at a wrong endpoint: its first push waits --server-start-wait (not
    the whole --push-timeout), says from its first line which flag bounds the wait, fails with
    exit 1, and the job serves on."""
    sock = str(short_tmp / "serve.sock")
    with cpu_serve_job(
        refused_endpoint, "--control-socket", sock, "--push-timeout", "300",
        "--server-start-wait", "3",
    ranks=1,) as job:  # fmt: skip
        assert wait_for_path(sock), "the serve job did not open its control socket"
        code, doc, _ = push(sock)
        assert code == 1, doc
        assert f"{refused_endpoint} did not answer within serve --server-start-wait" in doc["error"]
        assert doc["server_weights"] is None
        assert status(sock)["state"] == "idle" and job.poll() is None
        err = stop(job, sock)
    assert f"waiting up to 3s (serve --server-start-wait) for {refused_endpoint}: " in err, err


def test_stop_cancels_a_push_under_way_and_the_job_ends(short_tmp: Path) -> None:
    """The server's worker is stuck loading a bucket (held): the push's transfer is ended on
    our side all the same, and the job ends, long before --push-timeout."""
    with serve_job(short_tmp) as (site, job, sock):
        assert push(sock, "--weight-version", "v1")[0] == 0
        site.workers.hold_at_bucket = 2
        running = push_in_background(sock, "--weight-version", "v2")
        wait_until(site.workers.holding.is_set, what="the server's worker to hold a bucket")
        err = stop(job, sock)  # the job ends with exit 0
        out, push_err = running.communicate(timeout=60)
        assert running.returncode == 1, push_err
        doc = json.loads(out)
        assert doc["error"].startswith("stopped (stopped by a client"), doc["error"]
        assert doc["server_weights"] == "whole"  # restored: the server itself was fine
        # Both workers of the push get checkpoint-engine's exception and raise: the held one
        # too, once its bucket is loaded - not left waiting forever for a bucket that never
        # comes (which would keep its server's update, and the next one, waiting).
        site.workers.release()
        wait_until(
            lambda: site.workers.endings.count("aborted") == 2, what="both workers to be told"
        )
        assert "push 2 (" in err and ") failed: stopped (stopped by a client" in err


def test_ctrl_c_on_push_cancels_it_and_the_server_is_restored(short_tmp: Path) -> None:
    with serve_job(short_tmp) as (site, job, sock):
        assert push(sock, "--weight-version", "v1")[0] == 0
        site.workers.hold_at_bucket = 2
        running = push_in_background(sock, "--weight-version", "v2")
        wait_until(site.workers.holding.is_set, what="the server's worker to hold a bucket")
        running.send_signal(signal.SIGINT)
        out, err = running.communicate(timeout=60)
        assert running.returncode == 130, err
        assert "cancelling the push" in err
        doc = json.loads(out)
        assert doc["error"].startswith("cancelled by its client"), doc
        assert doc["server_weights"] == "whole" and doc["restore"]["restored_push"] == 1
        assert site.behaviour.weight_version == "v1"
        assert loaded_names(site.workers) == tensor_names()  # the restore: every tensor
        st = status(sock)
        assert st["state"] == "idle" and st["server_weights"] == "whole"
        assert job.poll() is None
        stop(job, sock)


def test_ctrl_c_on_a_push_before_it_sent_anything_says_the_weights_are_unchanged(
    short_tmp: Path,
) -> None:
    with serve_job(short_tmp, "--server-wait", "120", ranks=1) as (site, job, sock):
        assert push(sock)[0] == 0
        site.die()  # the push waits for the server: nothing of it reaches the server
        running = push_in_background(sock)
        wait_until(
            lambda: (status(sock).get("running") or {}).get("stage") == "wait_server",
            what="the push to wait for the server",
        )
        running.send_signal(signal.SIGINT)
        out, err = running.communicate(timeout=60)
        assert running.returncode == 130, err
        doc = json.loads(out)
        assert doc["server_weights"] is None, doc
        assert doc["error"].startswith("cancelled by its client"), doc["error"]
        assert doc["error"].endswith("; the server's weights are unchanged"), doc["error"]
        assert "the server's weights are unchanged" in err
        site.come_back()
        stop(job, sock)


def test_rollback_pushes_the_previous_whole_checkpoint_unless_it_changed(
    short_tmp: Path, tmp_path: Path
) -> None:
    first, third = tmp_path / "first", tmp_path / "third"
    shutil.copytree(TINY, first)
    shutil.copytree(TINY, third)
    with serve_job(short_tmp, ranks=1) as (site, job, sock):
        refused = run_script("rollback", "--control-socket", sock, "--json", timeout=60)
        assert refused.returncode == 3, refused.stderr
        assert "nothing to roll back to" in json.loads(refused.stdout)["error"]

        assert push(sock, "--weight-version", "v1", path=first)[0] == 0
        assert push(sock, "--weight-version", "v2")[0] == 0
        assert push(sock, "--weight-version", "v3", path=third)[0] == 0
        # Each rollback goes one whole push further back: 3 -> 2 -> 1.
        for seq, path, version in ((2, TINY, "v2"), (1, first, "v1")):
            back = run_script("rollback", "--control-socket", sock, "--json", timeout=120)
            assert back.returncode == 0, back.stderr
            doc = json.loads(back.stdout)
            assert doc["restores"] == seq and doc["checkpoint_path"] == str(path), doc
            assert site.behaviour.weight_version == version
            assert status(sock)["weights"]["seq"] == seq

        # Pushed again, then changed on disk: a rollback to it is refused before anything moves,
        # also when the change kept the file's inode, size and mtime (only its ctime tells).
        assert push(sock, "--weight-version", "v4")[0] == 0
        shard = next(first.glob("*.safetensors"))
        rewrite_in_place_setting_the_mtime_back(shard)
        updates = site.workers.updates
        changed = run_script("rollback", "--control-socket", sock, "--json", timeout=120)
        assert changed.returncode == 3, changed.stderr
        assert f"{shard.name} was rewritten" in json.loads(changed.stdout)["error"]
        assert site.workers.updates == updates  # nothing was sent
        assert site.behaviour.weight_version == "v4"
        stop(job, sock)


def test_a_second_sigterm_ends_the_job_at_once(short_tmp: Path) -> None:
    """Kubernetes sends SIGTERM, then waits: the first one stops the job cleanly (cancelling
    the push under way), a second one ends it on the spot, whatever it was still doing."""
    with serve_job(short_tmp) as (site, job, sock):
        assert push(sock)[0] == 0
        # The push under way and the restore after it cannot end on their own: the job stays
        # busy until the stop's grace (STOP_GRACE_S) runs out, unless a second signal comes.
        site.workers.hold_at_bucket, site.workers.hold_every_update = 2, True
        running = push_in_background(sock)
        wait_until(site.workers.holding.is_set, what="the server's worker to hold a bucket")
        rank = rank_pid(job, 0)
        os.kill(rank, signal.SIGTERM)
        # (Two signals sent at once would be one: the second is sent once the first is seen.)
        wait_until(lambda: status(sock)["state"] == "stopping", what="the job to be stopping")
        os.kill(rank, signal.SIGTERM)
        _, err = job.communicate(timeout=60)
        assert job.returncode != 0
        assert "interrupted by SIGTERM" in err, err[-3000:]
        running.communicate(timeout=60)


def test_an_update_says_what_it_waits_for_every_ten_seconds(tmp_path: Path) -> None:
    """Piped, the wait for a server that is down was silent until the error; now its first
    line names what bounds it (the flag), and a line every Reporter.TICK_S (10 s) says what it
    waits for and what it last heard."""
    from conftest import CPU_PS_RANK
    from fake_server import reserved_port

    with reserved_port() as held:
        endpoint = f"http://127.0.0.1:{held.getsockname()[1]}"
        r = subprocess.run(
            [sys.executable, CPU_PS_RANK, "update", "--checkpoint-path", str(TINY),
             "--inference-parallel-size", "1", "--endpoint", endpoint, "--timeout", "20"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 4, r.stderr
    assert f"s (--timeout) for {endpoint}: connection refused\n" in r.stderr, r.stderr
    first = r.stderr.index(f"(--timeout) for {endpoint}")
    assert r.stderr.rfind("waiting up to ", 0, first) != -1, r.stderr  # the wait's first line
    assert f"still waiting for {endpoint}: connection refused (1" in r.stderr, r.stderr
    # The wait and the job's deadline end together: whichever says so first, the job's
    # deadline names the server while the wait runs (and only the time once it has ended).
    last = r.stderr.strip().splitlines()[-1]
    assert (
        f"{endpoint} did not answer within --timeout" in last
        or f"during waiting for the inference server ({endpoint}: connection refused" in last
        or "timed out after 20s; raise --timeout" in last
    ), last


def test_stop_ends_the_job_even_when_the_push_under_way_cannot_end(short_tmp: Path) -> None:
    """The server's workers hold every update: neither the cancelled push nor the restore after
    it ever end. The job still ends, STOP_GRACE_S after the stop, and says why."""
    with serve_job(short_tmp, ranks=1) as (site, job, sock):
        assert push(sock)[0] == 0
        site.workers.hold_at_bucket, site.workers.hold_every_update = 2, True
        running = push_in_background(sock)
        wait_until(site.workers.holding.is_set, what="the server's worker to hold a bucket")
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        _, err = job.communicate(timeout=120)  # (--push-timeout is 300)
        assert job.returncode == 1, err[-3000:]
        assert "did not end within 8s: ending the job" in err, err[-3000:]
        running.communicate(timeout=60)
