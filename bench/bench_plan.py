"""Planning at DeepSeek-V3 scale: read every header and split, on sparse full-size files.

    python bench/bench_plan.py [--repeat 5] [--world-size 8 --world-size 64]

Writes ~162 sparse shards (real headers, 688 GB of holes: no disk used) to a temporary
directory, removed afterwards, and prints one JSON document with the timings (seconds; best
and median of --repeat runs). `cli_*` figures time the installed `ckptctl` end to end, with
`cli_startup_s` (`ckptctl --version`) as the start-up cost to subtract. The same document goes
to plan-deepseek-v3-cpu.{json,md} in --out (bench/results/ by default, replacing the previous
run's), with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _support.ckpt_factory import write_sparse_checkpoint
from _support.model_shapes import deepseek_v3

from ckptctl.checkpoint import load_rank_tensors, plan_split, read_checkpoint


def timed(fn, repeat: int) -> tuple[dict[str, float], object]:  # type: ignore[no-untyped-def]
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return {"best_s": round(min(times), 4), "median_s": round(statistics.median(times), 4)}, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--world-size", type=int, action="append", dest="worlds")
    parser.add_argument("--out", help="default: bench/results/")
    args = parser.parse_args()
    worlds = args.worlds or [8, 64]
    ckptctl = str(Path(sys.executable).with_name("ckptctl"))

    tmp = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    try:
        root = write_sparse_checkpoint(tmp / "deepseek-v3", deepseek_v3(), shard_bytes=int(4.3e9))
        read_stats, ckpt = timed(lambda: read_checkpoint(root), args.repeat)
        report: dict[str, object] = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "files": len(ckpt.files),  # type: ignore[attr-defined]
            "tensors": len(ckpt.tensors),  # type: ignore[attr-defined]
            "total_bytes": ckpt.total_bytes,  # type: ignore[attr-defined]
            "read_checkpoint": read_stats,
        }
        for world in worlds:
            for mode in ("files", "tensors", "auto"):
                stats, plan = timed(lambda w=world, m=mode: plan_split(ckpt, w, m), args.repeat)  # type: ignore[misc]
                stats["max_rank_over_lower_bound"] = round(
                    plan.max_rank_bytes / plan.lower_bound_bytes,
                    4,  # type: ignore[attr-defined]
                )
                stats["split"] = plan.split  # type: ignore[attr-defined]
                report[f"plan_{mode}_world{world}"] = stats
            both, _ = timed(
                lambda w=world: plan_split(read_checkpoint(root), w, "auto"),  # type: ignore[misc]
                args.repeat,
            )
            report[f"read_and_plan_auto_world{world}"] = both
        plan = plan_split(ckpt, worlds[0], "auto")  # type: ignore[arg-type]
        import torch  # noqa: F401 - import once, outside the timing

        views, named = timed(lambda: load_rank_tensors(ckpt, plan.ranks[0]), 1)  # type: ignore[arg-type]
        views["tensors"] = len(named)  # type: ignore[arg-type]
        report[f"load_rank_tensors_rank0_of_{worlds[0]}"] = views

        startup, _ = timed(
            lambda: subprocess.run([ckptctl, "--version"], capture_output=True, check=True),
            args.repeat,
        )
        report["cli_startup_s"] = startup
        cmd = [ckptctl, "update", "--dry-run", "--json", "--checkpoint-path", str(root)]
        for world in worlds:
            stats, _ = timed(
                lambda w=world: subprocess.run(  # type: ignore[misc]
                    [*cmd, "--world-size", str(w)], capture_output=True, check=True
                ),
                args.repeat,
            )
            report[f"cli_dry_run_json_world{world}"] = stats
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from result_files import RESULTS, write_results

    report["command"] = " ".join(["python", "bench/bench_plan.py", *sys.argv[1:]])
    write_results(args.out or RESULTS, "plan-deepseek-v3-cpu", report, markdown(report))


def markdown(report: dict[str, object]) -> str:
    """Every timed step, best / median seconds."""
    lines = [
        "# Planning at DeepSeek-V3 scale (sparse files: real headers, data as holes)",
        "",
        f"    {report['command']}",
        "",
        f"{report['files']} shards, {report['tensors']} tensors, "
        f"{int(report['total_bytes']) / 1e9:.1f} GB; Python {report['python']}.",  # type: ignore[call-overload]
        "",
        "| step | best s | median s | largest rank / lower bound |",
        "| --- | --- | --- | --- |",
    ]
    for name, stats in report.items():
        if isinstance(stats, dict) and "best_s" in stats:
            ratio = stats.get("max_rank_over_lower_bound", "")
            lines.append(f"| `{name}` | {stats['best_s']} | {stats['median_s']} | {ratio} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()
