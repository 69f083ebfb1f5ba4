"""The warm launcher the tests' torchrun jobs start from (tests/support/warm_launch.py): the
process a test holds (the stub) must stand for the launcher as `python -m` would be it: the same
streams, environment, folder and limits, every signal passed on, the same end. Checked with its
probe module in place of torchrun (the suite's torchrun jobs check the rest)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import wait_until
from fake_server import running_job
from warm_launch import launcher_pid, warm_cmd


def probe(*args: str) -> list[str]:
    return warm_cmd("-m", "warm_launch", "probe", *args)


def test_the_launcher_gets_the_streams_environment_folder_and_limits_of_its_stub(
    tmp_path: Path,
) -> None:
    def lower_open_files() -> None:  # what `ulimit -n 200` would do before the command
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    r = subprocess.run(
        probe("exit3"), capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PROBE": "the test's"}, preexec_fn=lower_open_files,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    seen = json.loads(r.stdout)
    assert seen["argv"][1:] == ["probe", "exit3"]
    assert seen["marker"] == "the test's" and seen["cwd"] == str(tmp_path)
    assert seen["nofile"][0] == 200


def test_an_uncaught_error_ends_the_launcher_with_exit_1_and_its_traceback() -> None:
    r = subprocess.run(probe("raise"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "RuntimeError: the probe failed" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_stub_reaches_the_launcher_and_the_stub_ends_as_it_did(
    sig: signal.Signals,
) -> None:
    with running_job(probe("sleep"), None) as proc:
        started = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert launcher_pid(proc) == started["pid"] != proc.pid
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == -sig  # killed by it, as the launcher was


def test_a_stub_killed_outright_takes_its_launcher_with_it() -> None:
    with running_job(probe("sleep"), None) as proc:
        proc.stdout.readline()  # type: ignore[union-attr]
        launcher = launcher_pid(proc)
        proc.kill()
        proc.wait(timeout=60)
    wait_until(lambda: not os.path.exists(f"/proc/{launcher}"), 60, "the launcher to end")


def test_stubs_killed_while_they_start_leave_the_zygote_serving_and_no_launcher() -> None:
    """A job killed while it starts (a test that fails early ends its jobs): whether its stub
    had sent its request, or been told its launcher's pid, or not, the zygote serves on and
    kills that launcher (a zygote that ended left the launchers it forked running)."""
    import warm_launch

    for _ in range(8):
        proc = subprocess.Popen(probe("sleep"), stdout=subprocess.DEVNULL)
        proc.kill()
        proc.wait(timeout=60)
    zygote = warm_launch._zygote
    assert zygote is not None and zygote.poll() is None
    children = Path(f"/proc/{zygote.pid}/task/{zygote.pid}/children")
    wait_until(lambda: not children.read_text().split(), 60, "the zygote's launchers to end")
    assert subprocess.run(probe("exit0"), capture_output=True, timeout=120).returncode == 0


def test_a_signal_sent_as_the_job_starts_ends_it() -> None:
    """However early a test's SIGINT comes (before the stub has a launcher, before the fork
    runs Python), the job ends: the stub's own Ctrl-C, or the launcher's."""
    import time

    for step in range(16):  # at moments spread over the stub's start, whatever they fall on
        with running_job(probe("sleep"), None) as proc:
            time.sleep(step * 0.008)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) in (1, -signal.SIGINT)


def test_a_job_that_sets_what_python_reads_at_start_is_launched_cold() -> None:
    """LOGLEVEL (torch's launcher reads it on import), PYTHON*, TORCH_*, the locale: a fork of
    the zygote would keep the zygote's, so such a job runs `python -m` itself."""
    env = {**os.environ, "LOGLEVEL": "INFO"}
    with running_job(probe("sleep"), env) as proc:
        started = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert launcher_pid(proc) == started["pid"] == proc.pid
