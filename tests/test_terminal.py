"""On a terminal (a real pty) the live displays run: wait-ready's spinner, update's stage view.
Elsewhere they stay off: plain lines on stderr (covered by the other tests)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

from conftest import ckptctl_script
from fake_server import Behaviour, FakeServer

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-checkpoint"


def _run_on_pty(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """stderr is a terminal (where Rich draws), stdout a pipe (where results go)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NO_COLOR")}
    proc = subprocess.Popen(
        [ckptctl_script(), *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**env, "TERM": "xterm", "COLUMNS": "120"},
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(timeout=10), out, b"".join(chunks).decode(errors="replace")


def test_wait_ready_spinner_on_a_terminal() -> None:
    with FakeServer(Behaviour()) as s:

        def later() -> None:
            time.sleep(1.0)
            s.behaviour.weights_loaded = True

        import threading

        threading.Thread(target=later, daemon=True).start()
        code, out, err = _run_on_pty(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--for",
            "healthy",
            "--interval",
            "0.1",
            "--timeout",
            "20",
            "--json",
        )
    assert code == 0, err
    assert '"ready":true' in out.replace(" ", "")  # the result still goes to stdout, alone
    assert "attempts" in err and "HTTP 503" in err  # the live status line
    assert "Traceback" not in err


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
