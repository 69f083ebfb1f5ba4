"""`ckptctl stage`: a checkpoint read ahead into a second set of the pool's buffers while the
server keeps its weights, then pushed without being read - on CPU, in a real 2-rank serve job
whose stand-in engine sends the bytes the way checkpoint-engine does, to a fake SGLang whose
workers hash every tensor they load (as tests/serve/test_serve_overlap.py). Deadlines are safety
nets; nothing here depends on how long anything takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_factory import rewrite_in_place_setting_the_mtime_back
from conftest import run_script, wait_until
from test_serve_faults import push, status
from test_serve_overlap import file_digests, make_checkpoint, serving, shards_of

from ckptctl.regular_files import FileIdentity

pytestmark = pytest.mark.slow


def stage(sock: str, path: Path) -> tuple[int, dict, str]:
    r = run_script(
        "stage", "--control-socket", sock, "--checkpoint-path", str(path), "--json", timeout=120
    )
    return r.returncode, json.loads(r.stdout), r.stderr


def staged_and_read(sock: str) -> bool:
    staged = status(sock)["staged"]
    return bool(staged and staged["read"])


def test_a_staged_checkpoint_is_pushed_from_its_read_ahead_buffers(
    short_tmp: Path, tmp_path: Path
) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    c = make_checkpoint(tmp_path / "c", seed=3)
    with serving(short_tmp, tmp_path, a) as job:
        one_share = status(job.sock)["pinned_pool_bytes"]
        code, doc, err = stage(job.sock, b)
        assert code == 0, err
        assert doc["action"] == "stage" and doc["server_weights"] is None, doc
        wait_until(lambda: staged_and_read(job.sock), what="the staged read")
        now = status(job.sock)
        assert now["staged"]["checkpoint_path"] == str(b.resolve()), now["staged"]
        assert 0 < now["staged"]["bytes_read"] == now["staged"]["share_bytes"]
        assert now["pinned_pool_bytes"] == 2 * one_share  # (its own buffers: one share more)
        assert job.workers.digests == file_digests(a)  # nothing went to the server
        assert now["weights"]["checkpoint_path"] == str(a.resolve())
        human = run_script("status", "--control-socket", job.sock, timeout=30)
        assert f"staged for the next push: {b.resolve()}" in human.stdout, human.stdout

        # Its push takes the buffers read ahead: every tensor arrives, bit for bit.
        job.workers.digests.clear()
        code, doc, err = push(job.sock, path=b)
        assert code == 0, err
        assert all(r["staged"] for r in doc["ranks"]), doc["ranks"]
        assert job.workers.digests == file_digests(b)
        assert status(job.sock)["staged"] is None

        # A stage that the next push does not take (another checkpoint) is dropped: that push
        # reads its own, and the pool is back to one share.
        code, _, err = stage(job.sock, c)
        assert code == 0, err
        code, doc, err = push(job.sock, path=a)
        assert code == 0, err
        assert not any(r["staged"] for r in doc["ranks"])
        assert job.workers.digests == file_digests(a)
        after = status(job.sock)
        assert after["staged"] is None and after["pinned_pool_bytes"] == one_share
        history = run_script("status", "--control-socket", job.sock, "--history", "--json")
        actions = [p["action"] for p in json.loads(history.stdout)["pushes"]]
        assert actions == ["push", "stage", "push", "stage", "push"], actions


def test_a_stage_whose_files_changed_is_read_again(short_tmp: Path, tmp_path: Path) -> None:
    """Bytes staged before the files changed are never pushed: the push reads them anew. The
    files keep their inodes, sizes and mtimes (rewritten in place, the mtime set back): their
    ctimes tell."""
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    other = make_checkpoint(tmp_path / "other", seed=3)  # the same layout, other bytes
    with serving(short_tmp, tmp_path, a) as job:
        code, _, err = stage(job.sock, b)
        assert code == 0, err
        wait_until(lambda: staged_and_read(job.sock), what="the staged read")
        for shard in b.glob("*.safetensors"):  # rewritten since: other bytes
            rewrite_in_place_setting_the_mtime_back(shard, (other / shard.name).read_bytes())
        code, doc, err = push(job.sock, path=b)
        assert code == 0, err
        assert not any(r["staged"] for r in doc["ranks"])
        assert job.workers.digests == file_digests(other)


def test_a_stage_is_refused_as_its_push_would_be(short_tmp: Path, tmp_path: Path) -> None:
    """...and a refused stage leaves the stage before it as it was."""
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    with serving(short_tmp, tmp_path, a) as job:
        code, _, err = stage(job.sock, b)
        assert code == 0, err
        code, doc, err = stage(job.sock, tmp_path / "no-such-checkpoint")
        assert code == 3, err
        assert "no-such-checkpoint" in doc["error"] and doc["server_weights"] is None
        assert status(job.sock)["staged"]["checkpoint_path"] == str(b.resolve())
        code, doc, err = push(job.sock, path=b)  # the job serves on, from the stage
        assert code == 0, err
        assert all(r["staged"] for r in doc["ranks"])
        assert job.workers.digests == file_digests(b)


def test_a_stage_whose_read_failed_is_read_again(short_tmp: Path, tmp_path: Path) -> None:
    """A staged read that failed (a passing I/O error: the files are as they were, untouched)
    is not the push's: the push reads the files anew and succeeds."""
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    with serving(short_tmp, tmp_path, a) as job:
        first = b / shards_of(b)[0]  # (rank 0's: status shows rank 0's read)
        before = first.stat()
        job.hold(b, first.name, fail=True)
        (job.flags / "loaded").touch()  # the held read goes on at once, and fails
        code, _, err = stage(job.sock, b)
        assert code == 0, err
        wait_until(lambda: (status(job.sock)["staged"] or {}).get("error"), what="the failure")
        job.release_all()
        assert FileIdentity.of(first.stat()) == FileIdentity.of(before)  # (as staged)
        code, doc, err = push(job.sock, path=b)
        assert code == 0, doc.get("error")
        assert not any(r["staged"] for r in doc["ranks"])
        assert job.workers.digests == file_digests(b)


def test_a_staged_push_failing_part_way_is_restored_from_the_files_of_the_last_whole_one(
    short_tmp: Path, tmp_path: Path
) -> None:
    """The server fails a bucket of a staged push: the restore pushes the checkpoint it held
    before (still registered: a staged push does not unregister it first) bit for bit, the
    stage's buffers go back to the pool, and the same stage's files push whole afterwards."""
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    with serving(short_tmp, tmp_path, a, restore=True) as job:
        one_share = status(job.sock)["pinned_pool_bytes"]
        code, _, err = stage(job.sock, b)
        assert code == 0, err
        wait_until(lambda: staged_and_read(job.sock), what="the staged read")
        job.workers.fail_at_bucket = 2  # (the stand-in fails the first update it is told to)
        code, doc, err = push(job.sock, path=b)
        assert code == 1, err
        assert "injected failure" in doc["error"], doc["error"]
        assert doc["server_weights"] == "whole" and doc["restore"]["ok"] is True, doc
        assert job.workers.digests == file_digests(a)  # every tensor of `a` again
        now = status(job.sock)
        assert now["weights"]["seq"] == 1 and now["server_weights"] == "whole", now
        assert now["staged"] is None and now["pinned_pool_bytes"] == one_share, now

        code, doc, err = push(job.sock, path=b)
        assert code == 0, err
        assert not any(r["staged"] for r in doc["ranks"])
        assert job.workers.digests == file_digests(b)
