"""On a terminal (a real pty) the live displays run: wait-ready's spinner, update's stage view.
Elsewhere they stay off: plain lines on stderr (covered by the other tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ckptctl_script
from fake_server import Behaviour, FakeServer
from locations import TINY
from pty_run import run_on_pty


def _run_on_pty(
    *args: str,
    timeout: float = 60,
    on_output: Callable[[str], None] | None = None,
    columns: int = 120,
) -> tuple[int, str, str]:
    """stderr is a terminal (where Rich draws), stdout a pipe (where results go)."""
    return run_on_pty(
        [ckptctl_script(), *args], columns=columns, timeout=timeout, on_output=on_output
    )


def test_wait_ready_spinner_on_a_terminal() -> None:
    with FakeServer(Behaviour()) as s:

        def load_weights_once_the_503_is_shown(shown: str) -> None:
            # Not after some time: the server turns healthy once the terminal has shown the
            # live status line with its 503, however slow the machine is.
            if "attempts" in shown and "HTTP 503" in shown:
                s.behaviour.weights_loaded = True

        code, out, err = _run_on_pty(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--for",
            "healthy",
            "--interval",
            "0.1",
            "--timeout",
            "60",
            "--json",
            on_output=load_weights_once_the_503_is_shown,
        )
        answers = s.behaviour.statuses("/health")
    assert code == 0, err
    assert '"ready":true' in out.replace(" ", "")  # the result still goes to stdout, alone
    assert "attempts" in err and "HTTP 503" in err  # the live status line
    assert answers[0] == 503 and answers[-1] == 200
    assert "Traceback" not in err


@pytest.mark.no_cuda
def test_update_stage_view_on_a_terminal_ends_with_one_error_line() -> None:
    # No GPU here: the stage view starts, the split runs, the parameter server cannot start.
    code, out, err = _run_on_pty(
        "update",
        "--checkpoint-path",
        str(TINY),
        "--inference-parallel-size",
        "1",
        "--timeout",
        "30",
    )
    assert code == 1
    assert "split" in err and "no CUDA device" in err
    assert "Traceback" not in err
    assert out == ""


def test_server_text_is_never_read_as_markup() -> None:
    # A weight version that looks like a Rich closing tag must not crash the live status.
    with FakeServer(Behaviour(weights_loaded=True, weight_version="[/v0]")) as s:

        def serve_v1_once_shown(shown: str) -> None:
            # The live status has shown the odd version as text: the wait may end now (the
            # server's answer, not a deadline, decides when).
            if "[/v0]" in shown:
                s.behaviour.weight_version = "v1"

        code, _, err = _run_on_pty(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "v1",
            "--timeout",
            "60",
            "--interval",
            "0.1",
            on_output=serve_v1_once_shown,
            columns=200,  # (the whole status line, the server's text at its end included)
        )
    assert code == 0, err
    assert "MarkupError" not in err and "[/v0]" in err


def test_checkpoint_path_with_brackets(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    odd = tmp_path / "runs[/x]"  # a folder "runs[" holding "x]": "[/x]" is a Rich closing tag
    odd.mkdir(parents=True)
    save_file({"w[0]": torch.ones(3), "b[/bold]": torch.zeros(2)}, str(odd / "model.safetensors"))
    code, out, err = _run_on_pty(
        "update",
        "--dry-run",
        "--checkpoint-path",
        str(odd),
        "--world-size",
        "2",
        "--inference-parallel-size",
        "2",
    )
    assert code == 0, err
    assert "runs[/x]" in out


# -- issue 25: what a newcomer's first commands show on an 80-column terminal ----------------


def test_the_first_dry_run_on_a_terminal_plans_one_server_group() -> None:
    code, out, err = _run_on_pty("update", "--dry-run", "--checkpoint-path", str(TINY), columns=80)
    assert code == 0, err
    tables = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert "over 8 rank(s)" in out and max(len(line) for line in tables) <= 80
    flat = " ".join(err.split())  # (the terminal wraps long lines)
    assert "dry run: planned one server group of 8 rank(s) (--inference-parallel-size 8)" in flat
    assert "fewer tensors than ranks" not in flat and "the checkpoint's largest tensor" in flat


def test_wait_ready_on_a_terminal_says_what_it_waited_for() -> None:
    with FakeServer(Behaviour()) as s:
        code, out, err = _run_on_pty("wait-ready", "--endpoint", s.endpoint, columns=80)
    assert code == 0, err
    flat = " ".join(out.split())  # the result: stdout
    assert (
        f"{s.endpoint} is listening after" in flat and "(1 attempt; it answered HTTP 503)" in flat
    )
    assert "ready after" not in flat


def test_short_help_on_a_terminal_fits_80_columns() -> None:
    code, out, err = _run_on_pty("update", "-h", columns=80)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "Usage: ckptctl update [OPTIONS]" and len(lines) <= 60
    assert max(len(line) for line in lines) <= 80
