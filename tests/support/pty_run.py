"""Running a command with stderr on a real terminal (a pty) and stdout on a pipe: where Rich
draws its live views, and where results go. torchrun's ranks inherit the one terminal, as
they do on a person's screen."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import threading
import time
from collections.abc import Callable


def run_on_pty(
    cmd: list[str],
    *,
    columns: int = 80,
    timeout: float = 120,
    on_output: Callable[[str], None] | None = None,
) -> tuple[int, str, str]:
    """(exit code, stdout, what the terminal received) of `cmd`, bounded by `timeout`.
    `on_output` sees the terminal's text so far after every read (to act on what is shown)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NO_COLOR")}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**env, "TERM": "xterm", "COLUMNS": str(columns), "OMP_NUM_THREADS": "1"},
    )
    os.close(slave)
    out: list[bytes] = []
    # stdout is read beside the terminal: a large result must not block the process.
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # (EIO: every process holding the terminal is gone)
                break
            if not data:
                break
            chunks.append(data)
            if on_output is not None:
                on_output(b"".join(chunks).decode(errors="replace"))
        elif proc.poll() is not None:
            break
    os.close(master)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait(timeout=30)
    reader.join(timeout=10)
    return code, b"".join(out).decode(), b"".join(chunks).decode(errors="replace")
