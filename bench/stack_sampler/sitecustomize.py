"""Samples every thread's stack every 0.1 s for 12 s into $STACK_SAMPLES.<RANK>, in each process
that starts with this folder first on PYTHONPATH and both STACK_SAMPLES and RANK set (torchrun
sets RANK). A diagnostic of where a stage's time goes (bench/probe_tp1_start.sh), not a
benchmark: a gap well over 0.1 s between samples means some thread held the GIL that long."""

import os
import sys
import threading
import time
import traceback

INTERVAL_S = 0.1
DURATION_S = 12.0


def _sample(path: str, started: float) -> None:
    me = threading.get_ident()
    with open(path, "w") as out:
        last = time.perf_counter()
        while time.perf_counter() - started < DURATION_S:
            time.sleep(INTERVAL_S)
            now = time.perf_counter()
            out.write(f"=== t={now - started:.2f} gap={now - last:.2f}\n")
            last = now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                out.write(f"-- {names.get(ident, ident)}\n")
                for fs in traceback.extract_stack(frame)[-6:]:
                    out.write(f"   {os.path.basename(fs.filename)}:{fs.lineno} {fs.name}\n")
            out.flush()


if os.environ.get("STACK_SAMPLES") and os.environ.get("RANK") is not None:
    threading.Thread(
        target=_sample,
        args=(f"{os.environ['STACK_SAMPLES']}.{os.environ['RANK']}", time.perf_counter()),
        name="stack-sampler",
        daemon=True,
    ).start()
