"""The serve job's clients start fast: `push`, `status`, `stop` and `rollback` import neither
torch nor pydantic nor httpx (read from `python -X importtime`, what the interpreter itself
reports having imported), and their plain command lines are read without Typer's parsing -
with every other line left to Typer, which answers as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl.cli import _fast, serve
from ckptctl.settings import PauseMode

HEAVY = {"torch", "pydantic", "pydantic_core", "httpx", "numpy", "safetensors", "checkpoint_engine"}


def _imported(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckptctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    names = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "typer" in names or "ckptctl" in names, r.stderr[-2000:]  # importtime did report
    return r, names


@pytest.mark.parametrize(
    "args",
    [
        ["push", "--checkpoint-path", "/nonexistent", "--weight-version", "v1", "--json"],
        ["push", "--checkpoint-path", "/nonexistent", "--pause", "retract"],
        ["status"],
        ["status", "--json", "-q"],
        ["status", "--history"],
        ["stop", "--timeout", "5"],
        ["rollback", "--timeout=30"],
    ],
)
def test_the_clients_import_no_heavy_module(short_tmp: Path, args: list[str]) -> None:
    r, names = _imported(*args, "--control-socket", str(short_tmp / "none.sock"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "no serve job answers" in r.stderr
    assert not names & HEAVY, sorted(names & HEAVY)


def test_typer_still_answers_what_the_fast_path_does_not_take(short_tmp: Path) -> None:
    sock = str(short_tmp / "none.sock")
    r, _ = _imported("stop", "--wait", "-1", "--control-socket", sock, "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"].startswith("--wait must be at least 0, not -1")
    r, _ = _imported("push", "--control-socket", sock)  # --checkpoint-path is required
    assert r.returncode == 2 and "--checkpoint-path" in r.stderr
    r, _ = _imported("status", "--no-such-flag")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr


def test_the_fast_path_reads_a_line_as_typer_does() -> None:
    kw = _fast.parse(
        serve.push_command,
        ["--checkpoint-path", "/c", "--endpoint", "http://a", "--endpoint=http://b", "-q",
         "--timeout", "5", "--verify", "--wait=2.5"],
    )  # fmt: skip
    assert kw is not None
    assert kw["checkpoint_path"] == Path("/c") and kw["endpoint"] == ["http://a", "http://b"]
    assert kw["quiet"] is True and kw["verify"] is True and kw["json_output"] is False
    assert kw["timeout"] == 5.0 and kw["wait"] == 2.5 and kw["uds"] is None
    assert kw["pause"] is None  # (the job's own)
    kw = _fast.parse(serve.push_command, ["--checkpoint-path", "/c", "--pause", "in_place"])
    assert kw is not None and kw["pause"] is PauseMode.in_place
    assert _fast.parse(serve.status_command, []) is not None
    for line in (
        ["--timeout", "0"],  # below its limit: Typer's usage error
        ["--timeout", "--json"],  # a flag where a value belongs
        ["--timeout"],  # no value
        ["--timeout", "nan"],
        ["-qv"],
        ["--json=1"],
        ["--help"],
        ["-h"],
        ["extra"],
        ["--pause", "bogus"],  # not a mode: Typer's usage error
    ):
        assert _fast.parse(serve.push_command, ["--checkpoint-path", "/c", *line]) is None, line
    assert _fast.parse(serve.push_command, []) is None  # --checkpoint-path missing


def test_a_client_flag_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTCTL_CONTROL_SOCKET", "/run/x.sock")
    kw = _fast.parse(serve.status_command, [])
    assert kw is not None and kw["control_socket"] == "/run/x.sock"
    monkeypatch.setenv("CKPTCTL_ENDPOINT", "http://a http://b")
    assert _fast.parse(serve.status_command, []) is None  # a list: Typer splits it


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["update", "--help"]])
def test_help_imports_no_metrics_library(args: list[str]) -> None:
    """prometheus_client comes in only with `serve --metrics-port` (ckptctl.observe.metrics)."""
    r, names = _imported(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prometheus_client" not in names and not names & HEAVY - {"pydantic", "pydantic_core"}
