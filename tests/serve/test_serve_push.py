"""Pushes of a real `ckptctl serve` job on CPU (torchrun, 2 ranks, real HTTP to a fake SGLang),
with only checkpoint-engine's ParameterServer stood in (tests/support/cpu_ps_rank.py): how a push fails
without ending the job, what `status` then says, the closing barrier of every push, and the
default control socket named after the server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_serve_job, run_script, wait_for_path, wait_until
from cpu_jobs import update_on_cpu
from fake_server import Behaviour, FakeServer
from locations import CPU_PS_RANK, TINY
from torchrun_launch import free_master_port

pytestmark = pytest.mark.slow


def _push(sock: str, *args: str, path: Path = TINY) -> subprocess.CompletedProcess[str]:
    return run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(path), "--json", *args,
        timeout=120,
    )  # fmt: skip


def _status(sock: str) -> dict:
    r = run_script("status", "--control-socket", sock, "--json", timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _stop(job: subprocess.Popen[str], sock: str) -> tuple[str, str]:
    assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
    return job.communicate(timeout=60)


def test_a_push_that_breaks_off_after_the_workers_connected_says_partial_and_the_next_push_makes_it_whole(
    short_tmp: Path,
) -> None:
    """Issue 14 item 9: the server may now hold a mix of old and new weights. The push's error
    and JSON say so, `status` shows it, and the next good push (every tensor) records a whole
    set again, with its checkpoint and weight version. (One process: the server and the job's
    record of it are the subject here, not the ranks.)"""
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        assert _status(sock)["server_weights"] is None  # nothing pushed yet
        first = _push(sock, "--weight-version", "v1", "--checkpoint-name", "one")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["server_weights"] == "whole"

        # The stand-in's workers take the handle, then one fails mid-transfer; SGLang
        # then answers 400 too (its "partially updated" refusal).
        s.behaviour.update_status = 400
        s.behaviour.update_message = "partially updated. Please discard the whole weights"
        broken = _push(sock, "--weight-version", "v2", "--checkpoint-name", "x-fail-after-connect")
        s.behaviour.update_status = 200
        assert broken.returncode == 1, broken.stderr
        doc = json.loads(broken.stdout)
        assert doc["ok"] is False and doc.get("server_weights") == "partial", doc
        assert "partly updated weights" in doc["error"]
        assert "partly updated weights" in broken.stderr
        st = _status(sock)
        assert st["server_weights"] == "partial" and st["state"] == "idle"
        assert st["weights"]["checkpoint_name"] == "one"  # the last whole set
        human = run_script("status", "--control-socket", sock, timeout=30)
        assert "server weights: PARTIAL" in human.stdout, human.stdout

        again = _push(sock, "--weight-version", "v3", "--checkpoint-name", "three")
        assert again.returncode == 0, again.stderr
        assert s.behaviour.weight_version == "v3"
        st = _status(sock)
        assert st["server_weights"] == "whole"
        assert st["weights"]["checkpoint_path"] == str(TINY.resolve())
        assert st["weights"]["weight_version"] == "v3" and st["weights"]["seq"] == 3
        assert st["last"]["ok"] and st["last"]["total_bytes"] > 0
        assert st["last"]["ranks"][0]["figures"]["stages"]["update"]["seconds"] >= 0
        assert st["registered"] == "three"
        assert st["commands"] == 3 and st["succeeded"] == 2 and st["failed"] == 1
        human = run_script("status", "--control-socket", sock, timeout=30).stdout
        assert "server weights: whole, from push 3" in human and "weight version v3" in human
        assert "3 command(s) run: 2 ok, 1 failed" in human, human
        out, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]


def test_a_push_that_fails_before_a_rank_began_its_update_fails_alone(short_tmp: Path) -> None:
    """Issue 37: on a busy machine rank 1 may begin its update after rank 0's server refused
    it; its push's guard hears of the failure first. The guard judged rank 1's transfer by the
    previous push's, whose workers had connected, waited 15 s for it to end, then ended the job
    (`push`: "ended the connection without an answer"). CPU_PS_LATE_UPDATE_RANK forces that
    order of events."""
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(
            s.endpoint, "--control-socket", sock, env={"CPU_PS_LATE_UPDATE_RANK": "1"}
        ) as job,
    ):
        assert wait_for_path(sock)
        connected = _push(sock, "--checkpoint-name", "x-fail-after-connect")
        assert json.loads(connected.stdout)["server_weights"] == "partial", connected.stderr
        s.behaviour.update_status = 400
        refused = _push(sock)
        assert refused.returncode == 1, refused.stderr
        assert "refused the update: HTTP 400" in json.loads(refused.stdout)["error"]
        s.behaviour.update_status = 200
        again = _push(sock, "--weight-version", "after")
        assert again.returncode == 0, again.stderr
        assert s.behaviour.weight_version == "after"
        _, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]


def test_a_push_past_its_timeout_fails_alone_and_the_job_serves_on(short_tmp: Path) -> None:
    """Issue 14 item 4 in serve: a server that takes longer than --push-timeout fails that push
    with exit 4; its workers never connected, so the transfer is ended (the rescue) and the
    next push goes through."""
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour(update_delay_s=30)) as s,
        # (--push-timeout bounds the job's start too: 10 s lets it start on a busy machine.)
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "10") as job,
    ):
        assert wait_for_path(sock)
        slow = _push(sock)
        assert slow.returncode == 4, slow.stderr
        assert json.loads(slow.stdout)["server_weights"] is None  # never reached them
        s.behaviour.update_delay_s = 0
        ok = _push(sock, "--weight-version", "after")
        assert ok.returncode == 0, ok.stderr
        assert s.behaviour.weight_version == "after"
        assert job.poll() is None
        out, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]


def test_a_push_waits_for_a_server_until_its_own_deadline_not_the_jobs(
    short_tmp: Path, refused_endpoint: str
) -> None:
    """Issue 33 item 9: a push's stages see the push's deadline (--push-timeout), never the job
    watchdog's, HARD_GRACE_S later, which ends the job: the first push into a server that is
    not there waits 10 s at most (the job's start has those 10 s too), says so, and the job
    serves on."""
    sock = str(short_tmp / "serve.sock")
    with cpu_serve_job(refused_endpoint, "--control-socket", sock, "--push-timeout", "10") as job:
        assert wait_for_path(sock)
        r = _push(sock)
        assert r.returncode == 4, r.stderr
        error = json.loads(r.stdout)["error"]
        waited = re.search(r"did not answer within serve --push-timeout \(([0-9.]+)s,", error)
        assert waited is not None and float(waited.group(1)) <= 10.0, error
        assert _status(sock)["state"] == "idle" and job.poll() is None
        out, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]


def test_a_job_that_cannot_start_within_push_timeout_names_that_flag(short_tmp: Path) -> None:
    """Until it serves, a serve job's start is bounded by --push-timeout (its help says so); past
    it the job ends with exit 4 and its line names the flag to raise, not update's --timeout."""
    with FakeServer(Behaviour()) as s:
        r = subprocess.run(
            [sys.executable, CPU_PS_RANK, "serve", "--inference-parallel-size", "1",
             "--endpoint", s.endpoint, "--control-socket", str(short_tmp / "serve.sock"),
             "--push-timeout", "1"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "CPU_PS_START_HOLD_S": "30"},
        )  # fmt: skip
    assert r.returncode == 4, r.stderr
    assert "timed out after 1s" in r.stderr, r.stderr
    assert "raise serve --push-timeout if" in r.stderr and "--timeout if" not in r.stderr.replace(
        "--push-timeout if", ""
    ), r.stderr


def test_no_rank_frees_the_previous_checkpoint_before_every_rank_has_pushed(
    short_tmp: Path, tmp_path: Path
) -> None:
    """Issue 14 item 10 (checkpoint-engine #106): from the second update on, its own barrier no
    longer waits. Rank 1 is slow here; no rank may unregister the checkpoint a push replaces
    while another rank is still in that push's update. (With checkpoint-engine's own buffers:
    direct registration refills its pool at the start of the next push, after the closing
    barrier of the one before.)"""
    sock, events = str(short_tmp / "serve.sock"), tmp_path / "events"
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(
            s.endpoint,
            "--control-socket",
            sock,
            "--register-mode",
            "engine",
            env={"CPU_PS_SLOW_UPDATE_RANK": "1", "CPU_PS_EVENTS": str(events)},
        ) as job,
    ):
        assert wait_for_path(sock)
        for name in ("a", "b", "c"):
            r = _push(sock, "--checkpoint-name", name)
            assert r.returncode == 0, r.stderr
        _, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    order = [(e["event"], e["name"], e["rank"]) for e in lines]
    for previous, name in (("a", "b"), ("b", "c")):
        last_update = max(order.index(("update-end", name, r)) for r in (0, 1))
        for r in (0, 1):
            freed = order.index(("unregister", previous, r))
            assert freed > last_update, f"rank {r} freed {previous} during push {name}: {order}"


def test_the_default_socket_is_named_after_the_server(socket_dir: Path) -> None:
    """Without --control-socket: the job's socket lives in the socket directory (the test's
    own, conftest.socket_dir; $XDG_RUNTIME_DIR/ckptctl/ by default, test_serve_control.py),
    named after its server; `push --endpoint URL` finds it, so does a plain `status` (the only
    job), and `push --wait` started with the job waits for it."""
    with FakeServer(Behaviour()) as s, cpu_serve_job(s.endpoint, ranks=1) as job:
        push = run_script(
            "push", "--endpoint", s.endpoint, "--checkpoint-path", str(TINY),
            "--wait", "120", "--weight-version", "w1", timeout=180,
        )  # fmt: skip
        assert push.returncode == 0, push.stderr
        assert s.behaviour.weight_version == "w1"
        st = run_script("status", "--json", timeout=30)
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        sock = doc["control_socket"]
        assert Path(sock).parent == socket_dir and Path(sock).name.startswith("serve-")
        assert doc["targets"] == [s.endpoint.rstrip("/")]
        other = run_script(
            "push", "--endpoint", "http://127.0.0.1:1", "--checkpoint-path", str(TINY), timeout=30,
        )  # fmt: skip
        assert other.returncode == 1 and "no serve job of yours answers" in other.stderr
        stop = run_script("stop", "--wait", "60", timeout=90)
        assert stop.returncode == 0, stop.stderr
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    assert not os.path.exists(sock)


def test_an_update_that_breaks_off_after_the_workers_connected_says_partial_in_its_json() -> None:
    """The same for `update`: its error line and its JSON document say the server's weights
    may be partial."""
    with FakeServer(Behaviour()) as s:
        # 2 ranks: the worker that fails is the last rank's, and rank 0 must still say partial.
        r = update_on_cpu(
            "--checkpoint-name", "x-fail-after-connect", "--inference-parallel-size", "2",
            "--endpoint", s.endpoint, "--json",
        )  # fmt: skip
    assert r.returncode != 0
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["server_weights"] == "partial", doc
    assert "partly updated weights" in doc["error"]


def test_a_push_of_other_shapes_is_refused_before_anything_is_sent(
    short_tmp: Path, tmp_path: Path
) -> None:
    """Issue 23 item 7: the job knows the served tensors' names, dtypes and shapes. A push of
    another layout exits 3 naming the tensor and both shapes, with no request to the server
    and the served checkpoint kept registered (direct mode: its pool not refilled); the next
    push of the served layout works, and --allow-layout-change pushes the other one anyway
    (whose layout is then the served one)."""
    import torch
    from ckpt_factory import write_real_checkpoint

    def checkpoint(name: str, w_shape: tuple[int, ...]) -> Path:
        tensors = {
            "embed": torch.zeros(8, 4),
            "w": torch.ones(w_shape),
            "norm": torch.ones(4),
            "head": torch.zeros(4, 8),
        }
        return write_real_checkpoint(tmp_path / name, [tensors])

    a, b = checkpoint("a", (4, 4)), checkpoint("b", (4, 6))
    sock, events = str(short_tmp / "serve.sock"), tmp_path / "events"
    env = {"CPU_PS_EVENTS": str(events)}
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, env=env, ranks=1) as job,
    ):

        def updates() -> int:
            return sum(r["path"] == "/update_weights_from_ipc" for r in list(s.behaviour.requests))

        assert wait_for_path(sock)
        first = _push(sock, "--checkpoint-name", "first", path=a)
        assert first.returncode == 0, first.stderr
        assert _status(sock)["served_tensors"] == 4
        sent, seen = updates(), events.read_text()

        refused = _push(sock, "--weight-version", "other", path=b)
        assert refused.returncode == 3, refused.stderr
        shapes = "w: F32 [4, 6] here, F32 [4, 4] served"
        assert shapes in refused.stderr and "--allow-layout-change" in refused.stderr
        doc = json.loads(refused.stdout)
        assert doc["exit_code"] == 3 and shapes in doc["error"] and doc["server_weights"] is None
        assert updates() == sent and s.behaviour.weight_version != "other"
        assert events.read_text() == seen  # nothing unregistered, nothing updated
        st = _status(sock)
        assert st["state"] == "idle" and st["registered"] == "first"
        assert st["server_weights"] == "whole" and st["last_refused"]["exit_code"] == 3
        assert st["last"]["checkpoint_name"] == "first"  # the last push that ran
        human = run_script("status", "--control-socket", sock, timeout=30).stdout
        assert "served layout: 4 tensors" in human, human

        again = _push(sock, "--weight-version", "a-again", path=a)
        assert again.returncode == 0, again.stderr
        assert s.behaviour.weight_version == "a-again" and updates() == sent + 1

        allowed = _push(sock, "--allow-layout-change", "--weight-version", "b", path=b)
        assert allowed.returncode == 0, allowed.stderr
        assert s.behaviour.weight_version == "b" and updates() == sent + 2
        back = _push(sock, path=a)  # b's layout is the served one now
        assert back.returncode == 3 and "w: F32 [4, 4] here, F32 [4, 6] served" in back.stderr
        _, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]


def test_a_long_lived_job_deletes_the_store_keys_of_every_finished_push(short_tmp: Path) -> None:
    """Issue 23 item 6: each push's keys (its scope push<seq>/: plans, barriers, figures, its
    abort notice) are deleted once every rank is past it, whether it succeeded or failed, so a
    job that pushes for days does not grow torchrun's store."""
    import re
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock, port = str(short_tmp / "serve.sock"), free_master_port()
    log = short_tmp / "ps"
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(
            s.endpoint, "--control-socket", sock, "--push-timeout", "900",
            env={"CPU_PS_LOG": str(log)}, port=port,
        ) as job,
    ):  # fmt: skip
        assert wait_for_path(sock)
        store = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        assert _push(sock).returncode == 0
        assert _push(sock, path=short_tmp / "no-such-checkpoint").returncode == 3
        s.behaviour.update_status = 400  # refused by the server: the push's abort notice
        assert _push(sock).returncode == 1
        s.behaviour.update_status = 200
        assert _push(sock).returncode == 0
        assert any(re.search(r"/hb/\d+$", k) for k in store.list_keys())  # the job's store

        def pushes_keys() -> list[str]:
            return [k for k in store.list_keys() if re.search(r"(^|/)push\d+/", k)]

        # (Rank 0 answers the push while rank 1 may still be deleting its own keys.)
        wait_until(lambda: not pushes_keys(), what="every push's store keys to be deleted")
        _, err = _stop(job, sock)
    assert job.returncode == 0, err[-3000:]
    # Also item 6: NCCL's collective timeout outlasts the longest a push may wait (900 s, then
    # the watchdog's grace), where checkpoint-engine's 10 minutes would SIGABRT a long push.
    from ckptctl.job.process_group import TIMEOUT_GRACE_S
    from ckptctl.serve.push import HARD_GRACE_S

    for rank in (0, 1):
        session = json.loads(Path(f"{log}.session.{rank}").read_text())
        assert session["group_timeout_s"] == 900 + HARD_GRACE_S + TIMEOUT_GRACE_S, session


def _resident(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, its pages in all): mincore(2) over a mapping of it,
    which faults nothing in."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(address, size, vec) == 0, ctypes.get_errno()
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def test_serve_drop_page_cache_leaves_no_pushed_pages_in_the_page_cache(short_tmp: Path) -> None:
    """Issue 23 item 6: a pushed checkpoint stays in the page cache beside its pinned copy.
    With serve --drop-page-cache, each rank drops what it read: after the push, of each shard
    only the pages at the edges of the ranks' spans (the header's, a boundary's) may remain."""
    import tempfile

    import torch
    from ckpt_factory import drop_cache, write_real_checkpoint

    # A real filesystem (tmpfs keeps its pages whatever the advice); /tmp may be tmpfs.
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    with tempfile.TemporaryDirectory(dir=base, prefix="ckptctl-fadvise-") as where:
        g = torch.Generator().manual_seed(3)
        shards = [
            {f"l{s}.w{i}": torch.randn(512, 512, generator=g) for i in range(3)} for s in (0, 1)
        ]
        ckpt = write_real_checkpoint(Path(where) / "ckpt", shards)
        files = sorted(ckpt.glob("*.safetensors"))
        drop_cache(files)
        if _resident(files[0])[0] > 8:
            pytest.skip(f"{where}: this filesystem keeps its pages on POSIX_FADV_DONTNEED")
        for f in files:
            f.read_bytes()  # cached, as a checkpoint just written is
        before = [_resident(f) for f in files]
        assert all(n > 0.9 * pages > 100 for n, pages in before), before
        sock = str(short_tmp / "serve.sock")
        with (
            FakeServer(Behaviour()) as s,
            cpu_serve_job(s.endpoint, "--control-socket", sock, "--drop-page-cache") as job,
        ):
            assert wait_for_path(sock)
            pushed = _push(sock, path=ckpt)
            assert pushed.returncode == 0, pushed.stderr
            after = [_resident(f) for f in files]
            _, err = _stop(job, sock)
        assert job.returncode == 0, err[-3000:]
    assert all(n <= 4 for n, _ in after), (before, after)


def test_push_on_a_terminal_shows_progress_there_and_its_result_on_stdout(short_tmp: Path) -> None:
    """At 80 columns: the push under way is drawn on the terminal (stderr), its result line
    goes to stdout and nowhere else; `stop` prints its result on stdout too."""
    from conftest import ckptctl_script
    from pty_run import run_on_pty

    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour(update_delay_s=3)) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        code, out, err = run_on_pty(
            [ckptctl_script(), "push", "--control-socket", sock, "--checkpoint-path", str(TINY)],
            columns=80,
        )
        assert code == 0, err
        assert out.startswith(f"pushed {TINY.resolve()} (push 1, ") and out.count("\n") == 1, out
        assert "push 1: " in err and "pushed " not in err, err  # the progress, not the result
        shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err).replace("\r", "\n")
        assert all(len(line) <= 80 for line in shown.splitlines()), err
        stop = run_script("stop", "--control-socket", sock, timeout=30)
        assert stop.returncode == 0 and stop.stdout.startswith("stopped: "), stop.stderr
        job.communicate(timeout=60)
    assert job.returncode == 0
