"""`--log-format json`: one JSON object per stderr line, from a real 2-rank `update` under
torchrun on CPU (checkpoint-engine's ParameterServer stood in: tests/cpu_ps_rank.py) and from
a command that fails before any job starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_script
from fake_server import Behaviour, FakeServer, run_torchrun
from locations import CPU_PS_RANK as SCRIPT
from locations import TINY

KEYS = {"time", "rank", "level", "stage", "message", "figures"}


def _records(stderr: str) -> list[dict]:
    lines = stderr.splitlines()
    assert lines
    records = [json.loads(line) for line in lines]  # every line, or the test fails here
    for r in records:
        assert set(r) == KEYS, r
        assert r["time"].endswith("Z") and r["level"] in ("info", "warning", "error")
    return records


@pytest.mark.slow
def test_every_stderr_line_of_an_update_is_a_json_object() -> None:
    with FakeServer(Behaviour()) as s:
        r = run_torchrun(
            SCRIPT, "update", "--checkpoint-path", str(TINY), "--timeout", "60",
            "--inference-parallel-size", "2", "--endpoint", s.endpoint, "--log-format", "json",
            # (torchrun's own banner on stderr is not ours: it is left out where this is set)
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    records = _records(r.stderr)
    assert {r["rank"] for r in records} == {0, 1}
    for rank in (0, 1):
        ended = {r["stage"]: r for r in records if r["rank"] == rank and r["figures"]}
        assert {"split", "register", "wait_server", "gather_metas", "update"} <= set(ended)
        update = ended["update"]
        assert update["figures"]["bytes"] > 0 and update["figures"]["wall_s"] >= 0
        assert update["message"].startswith("update: ")
        assert not any(r["message"].startswith("[rank") for r in records)
    assert "peak RSS" in r.stdout  # the result stays on stdout, as text


def test_an_error_line_is_a_json_object_too(tmp_path: Path) -> None:
    r = run_script(
        "update", "--dry-run", "--checkpoint-path", str(tmp_path / "missing"),
        "--log-format", "json",
    )  # fmt: skip
    assert r.returncode == 3
    (record,) = _records(r.stderr)
    assert record["level"] == "error" and "missing" in record["message"]
    assert record["rank"] == 0 and record["stage"] is None and record["figures"] is None


@pytest.mark.parametrize(
    "args",
    [
        ("update", "--log-format", "json", "--bogus"),  # (Typer's own: an unknown flag)
        ("stage", "--log-format=json", "--checkpoint-path", "/tmp", "--timeout", "0.5"),
        ("push", "--checkpoint-path", "/tmp", "--pause", "sideways", "--log-format", "json"),
    ],
)
def test_a_usage_error_found_while_parsing_is_a_json_object_too(args: tuple[str, ...]) -> None:
    r = run_script(*args)
    assert r.returncode == 2
    (record,) = _records(r.stderr)
    assert record["level"] == "error" and f"(see ckptctl {args[0]} --help)" in record["message"]


@pytest.mark.slow
def test_a_serve_job_logs_a_failed_push_as_an_error_and_push_writes_json_lines(
    short_tmp: Path,
) -> None:
    from conftest import cpu_serve_job, wait_for_path

    sock = str(short_tmp / "serve.sock")
    json_logs = ("--log-format", "json")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(
            s.endpoint, "--control-socket", sock, *json_logs, env={"OMP_NUM_THREADS": "1"}, ranks=1
        ) as job,
    ):
        assert wait_for_path(sock), "the control socket never appeared"
        missing = str(short_tmp / "missing")
        bad = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", missing, *json_logs,
            timeout=60,
        )  # fmt: skip
        assert bad.returncode == 3, bad.stderr
        errors = [r for r in _records(bad.stderr) if r["level"] == "error"]
        assert len(errors) == 1 and "missing" in errors[0]["message"], bad.stderr
        stop = run_script("stop", "--control-socket", sock, timeout=30)
        assert stop.returncode == 0, stop.stderr
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    failed = [r for r in _records(err) if r["message"].startswith("push 1 ")]
    assert failed and failed[0]["level"] == "error", failed
    assert "failed" in failed[0]["message"] and "missing" in failed[0]["message"]
