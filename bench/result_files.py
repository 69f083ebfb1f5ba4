"""The one current results file of a benchmark: `<bench>-<model>-<topology>.{json,md}`, overwritten
by each run, with the commit, the date and the machine inside (history is left to git)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _run(*cmd: str) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit() -> str:
    """HEAD's short hash, `-dirty` when tracked files differ from it; CKPTCTL_BENCH_COMMIT names
    it where the copy of the tree has no .git (a device machine)."""
    named = os.environ.get("CKPTCTL_BENCH_COMMIT")
    if named:
        return named
    head = _run("git", "rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no")
    return f"{head}-dirty" if dirty else head


def machine() -> str:
    """The GPUs (count x name, from nvidia-smi), the CPUs and the kernel."""
    gpus = (_run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader") or "").splitlines()
    gpu = f"{len(gpus)}x {gpus[0]}" if gpus else "no GPU"
    cpus = len(os.sched_getaffinity(0))
    return f"{gpu}, {cpus} CPUs, {platform.machine()}, Linux {platform.release()}"


def provenance() -> dict[str, str]:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"commit": commit(), "date": now, "machine": machine()}


def stamp_line(made: dict[str, str]) -> str:
    return f"Commit {made['commit']}, {made['date']}, on {made['machine']}."


def write_results(out_dir: str | Path, stem: str, doc: dict[str, Any], md: str | None) -> None:
    """Write `stem`.json (and `stem`.md when given) into `out_dir`, replacing the previous run's;
    the Markdown gets the provenance as its second paragraph (after the title)."""
    made = provenance()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"provenance": made, **doc}, indent=1) + "\n")
    if md is not None:
        title, _, rest = md.partition("\n")
        (out / f"{stem}.md").write_text(f"{title}\n\n{stamp_line(made)}\n{rest}")
        print(md)


if __name__ == "__main__":  # the provenance line, for a shell script's Markdown
    print(stamp_line(provenance()))
