"""torchrun's store takes writes from anyone who reaches its port: an abort notice read from it
is trusted for no more than "the job failed". A forged exit code 0 once ended `update` with exit
0 and `"ok": true` (found in an adversarial review); a forged message carried terminal escape
sequences to the operator's screen."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ckptctl.pipeline.coordination import read_abort


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
from ckptctl.pipeline.coordination import Coordinator, Watchdog

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
