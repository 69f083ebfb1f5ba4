"""`ckptctl.client`: driving a real `ckptctl serve` job on CPU from Python (torchrun, 2 ranks,
real HTTP to a fake SGLang; only checkpoint-engine's ParameterServer stood in), as a training
loop would, without starting a `ckptctl push` process per push."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import cpu_serve_job, wait_for_path
from fake_server import Behaviour, FakeServer
from locations import TINY

from ckptctl import client
from ckptctl.errors import ExitCode, InvalidInput, OperationFailed, UsageError

pytestmark = pytest.mark.slow


def test_push_status_and_stop_from_python(short_tmp: Path) -> None:
    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "60", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        first = client.push(TINY, weight_version="v1", control_socket=sock, wait=60)
        assert first["ok"] and first["seq"] == 1 and first["server_weights"] == "whole"
        assert s.behaviour.weight_version == "v1"
        assert len(first["ranks"]) == 1  # (a job of one process)

        # A push the server refuses: raised with the job's own line, or returned on request.
        s.behaviour.update_status = 400
        s.behaviour.update_message = "busy"
        with pytest.raises(OperationFailed, match="busy") as failed:
            client.push(TINY, weight_version="v2", control_socket=sock)
        assert failed.value.exit_code == ExitCode.FAILED
        answer = client.push(TINY, weight_version="v3", control_socket=sock, check=False)
        assert answer["ok"] is False and answer["exit_code"] == ExitCode.FAILED
        assert "busy" in answer["error"]

        # A trace file that would overwrite another file: refused before anything is sent,
        # naming the argument as Python spells it.
        notes = short_tmp / "notes.txt"
        notes.write_text("mine")
        with pytest.raises(UsageError, match=r"^trace= .*not a trace ckptctl wrote"):
            client.push(TINY, control_socket=sock, trace=notes)
        assert notes.read_text() == "mine"

        # A checkpoint that is not one: exit 3's exception; the job goes on serving.
        with pytest.raises(InvalidInput):
            client.push(short_tmp / "no-such-checkpoint", control_socket=sock)
        s.behaviour.update_status = 200
        again = client.push(TINY, weight_version="v4", control_socket=sock)
        assert again["seq"] == 5 and s.behaviour.weight_version == "v4"

        assert again["wall_s"] == again["seconds"] > 0

        # The documents `status --json` and `stop --json` print, envelope included.
        state = client.status(control_socket=sock)
        assert state["ok"] is True and state["exit_code"] == 0 and state["error"] is None
        assert state["control_socket"] == sock and state["state"] == "idle"
        assert state["weights"]["weight_version"] == "v4" and state["commands"] == 5
        assert state["failed"] == 3 and state["succeeded"] == 2
        cli = subprocess.run(
            [sys.executable, "-m", "ckptctl", "status", "--control-socket", sock, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert set(json.loads(cli.stdout)) == set(state)

        stopped = client.stop(control_socket=sock, wait=60)
        assert stopped == {
            "ok": True,
            "exit_code": 0,
            "error": None,
            "control_socket": sock,
            "stopped": True,
        }
        job.communicate(timeout=60)
        assert job.returncode == 0
    with pytest.raises(client.NotAnswering):
        client.status(control_socket=sock)


def test_the_client_imports_neither_torch_nor_typer() -> None:
    code = (
        "import sys, ckptctl.client; "
        "print(sorted(m for m in ('torch', 'typer', 'rich', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: client.status(wait=float("nan")), "wait takes a finite number of seconds"),
        (lambda: client.stop(timeout=float("inf")), "timeout takes a finite number of seconds"),
        (lambda: client.push("/x", timeout=-1), "timeout takes a finite number of seconds"),
    ],
)
def test_a_wait_that_is_not_a_finite_number_of_seconds_is_a_usage_error(
    call: Callable[[], object], words: str
) -> None:
    """NaN passes every comparison: taken as a wait, it waited for ever. Refused before any
    job is looked for."""
    with pytest.raises(UsageError, match=words):
        call()
