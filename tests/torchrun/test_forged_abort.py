"""torchrun's store takes writes from anyone who reaches its port: an abort or stop notice read
from it is trusted for no more than "the job failed" or "the job was interrupted". A forged exit
code 0 once ended `update` with exit 0 and `"ok": true`, a forged stop ended `save-metas` with
exit 0 (both found in adversarial reviews); a forged message carried terminal escape sequences
to the operator's screen."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import CPU_PS_RANK
from fake_server import torchrun_job
from locations import TINY
from torchrun_launch import free_master_port

from ckptctl.job.coordination import read_abort, read_stop


def test_an_abort_notice_is_always_a_failure_with_a_clean_line() -> None:
    forged = read_abort(
        json.dumps({"code": 0, "rank": "x", "message": "ended\x1b[2J\x1b]0;pwned\x07 here\n"})
    )
    assert forged["code"] == 1 and forged["rank"] == "?"
    assert "\x1b" not in forged["message"] and "\n" not in forged["message"]
    assert forged["message"].startswith("ended") and forged["message"].endswith("here")
    assert read_abort(b"\xff not json")["code"] == 1
    assert read_abort(json.dumps([1, 2]))["code"] == 1
    assert read_abort(json.dumps({"code": 4, "rank": 1, "message": "timed out"})) == {
        "code": 4,
        "rank": 1,
        "message": "timed out",
        "request": False,
    }
    # "request" (a stop or a cancel, not a failure) is true only when it is exactly true.
    assert read_abort(json.dumps({"code": 1, "message": "m", "request": "yes"}))["request"] is False
    assert read_abort(json.dumps({"code": 1, "message": "m", "request": True}))["request"] is True


RANK = """
import json, sys, time
from ckptctl import results
from ckptctl.launch import LaunchInfo
from ckptctl.job.coordination import Coordinator, Watchdog

launch = LaunchInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, under_torchrun=True)
coordinator = Coordinator.local(launch)
results.expect(sys.stdout)
# What a store writer plants: "success", from a rank that does not exist.
coordinator.store.set("abort", json.dumps({"code": 0, "message": "all good", "rank": 0}))
Watchdog(launch, coordinator, timeout_s=60).start()
time.sleep(30)  # the watchdog ends the process long before
"""


def test_a_forged_success_notice_ends_the_rank_as_a_failure() -> None:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RANK)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert "rank 0 failed: all good" in r.stderr


def test_a_stop_notice_is_one_clean_line_from_one_of_the_jobs_ranks() -> None:
    forged = read_stop(
        json.dumps({"rank": 7, "reason": "done\x1b[2J\x1b]0;pwned\x07 here\nsecond"}), 2
    )
    assert forged == {"rank": "?", "reason": "done here second"}
    assert read_stop(json.dumps({"rank": True, "reason": 5}), 2)["rank"] == "?"
    assert read_stop(b"\xff", 2)["reason"] == "an unreadable stop notice in the job's store"
    assert read_stop("[" * 100_000, 2)["rank"] == "?"
    assert read_stop(json.dumps({"rank": 1, "reason": "stopped by SIGTERM"}), 2) == {
        "rank": 1,
        "reason": "stopped by SIGTERM",
    }


def test_a_forged_stop_never_ends_save_metas_with_success(tmp_path: Path) -> None:
    """What a store writer plants while a CPU save-metas job holds its checkpoint (torchrun's
    agent store, on MASTER_PORT, where the job's keys live under ckptctl/<run id>/<restart>//):
    every rank ends as interrupted (130), and the reason reaches the terminal as one clean line."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_master_port()
    with torchrun_job(
        CPU_PS_RANK, "save-metas", "--checkpoint-path", str(TINY), "--metas-file",
        str(tmp_path / "metas.json"), "--json", port=port,
    ) as proc:  # fmt: skip
        assert proc.stderr is not None
        seen = ""
        while "serving the registered weights" not in seen:
            line = proc.stderr.readline()
            assert line, f"the job ended before serving: {seen}"
            seen += line
        store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        store.set(
            "ckptctl/none/0//stop",  # (PrefixStore adds a "/")
            json.dumps({"rank": 0, "reason": "all done\x1b]0;PWNED\x07\x1b[2J\nforged"}),
        )
        out, err = proc.communicate(timeout=60)
    err = seen + err
    assert proc.returncode != 0, err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 130 and "served" not in doc
    assert "rank 0 stopped the job (all done forged), as the job's store says" in doc["error"]
    for rank in (0, 1):
        assert f"[rank {rank}] error: rank 0 stopped the job (all done forged)" in err
    assert "\x1b" not in err and "PWNED" not in err
    assert "exitcode  : 0" not in err  # (torchrun's report of each rank that ended)
