"""Benchmark `torchrun ... ckptctl update` on a GPU node against the machine's own limits.

    python bench/bench_update.py --model qwen3-8b --tp 2   # 16.4 GB, 2 GPUs
    python bench/bench_update.py --model qwen3-32b --tp 2 --register-modes direct   # 65.5 GB
    python bench/bench_update.py --model deepseek-v3-small --tp 2   # 90k tensors, 3.1 GB
    python bench/bench_update.py --model qwen3-4b --tp 1 --out /tmp/x   # quick, 1 GPU

It writes a synthetic checkpoint with the model's real tensor names and shapes (HF layout:
shards + index.json, random bytes), starts the test receiver (tests/support/gpu_receiver.py: one
process per GPU loading through checkpoint_engine.worker.update_weights_from_ipc and checking
every tensor bit for bit), runs the real CLI under torchrun, and measures in the same run:
pinned and pageable host->device copies, the page cache's read limit with 1..16 threads (each
reading 64 MiB pieces with os.preadv) and the disk's (the files dropped from the page cache
with posix_fadvise first), and the bare `torchrun` + `import torch` + NCCL process-group time.
Each contender (the seed script with --seed-script, then each --register-modes) runs --runs
times, the first from a cold page cache (--cold-first), the others warm. ckptctl's read is
reported per rank against both limits. Results: update-<model>-tp<N>.{json,md} in --out
(bench/results/ by default, replacing the previous run's), with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _support.ckpt_factory import MODELS, drop_cache, write_checkpoint
from _support.limits import h2d_bandwidth, read_limits
from _support.torchrun_launch import free_port, torchrun_cmd
from result_files import RESULTS, write_results

REPO = Path(__file__).resolve().parents[1]

GiB = 1 << 30


# -- the limits ----------------------------------------------------------------------------------


_BARE = (
    "import os, torch, torch.distributed as dist\n"
    "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
    "dist.init_process_group('nccl')\n"
    "t = torch.ones(1, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize()\n"
    "dist.destroy_process_group()\n"
)


def bare_torchrun_seconds(tp: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(_BARE)
    t0 = time.perf_counter()
    subprocess.run(
        torchrun_cmd(fh.name, nproc=tp),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return time.perf_counter() - t0


# -- the run -------------------------------------------------------------------------------------


def start_receiver(
    ckpt: Path, tp: int, profile: str = "sglang-0.5.23"
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "support" / "gpu_receiver.py"),
            "--checkpoint-path",
            str(ckpt),
            "--devices",
            ",".join(map(str, range(tp))),
            "--port",
            str(free_port()),
            "--profile",
            profile,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"receiver did not start: {line!r}")
    return proc, line.split()[1]


def run_update(
    ckpt: Path, tp: int, endpoint: str, extra: list[str], log: Path | None = None
) -> dict[str, Any]:
    """One `torchrun ... ckptctl update` (its stderr, the ranks' stage lines, kept in `log`)."""
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", "update", "--checkpoint-path", str(ckpt),
        "--inference-parallel-size", str(tp), "--endpoint", endpoint, "--json", *extra,
        nproc=tp,
    )  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if log is not None:
        log.write_text(r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"ckptctl update failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return {"torchrun_wall_s": wall, "summary": json.loads(r.stdout), "command": " ".join(cmd[2:])}


# Runs a command and reports the peak RSS of its largest descendant (the ranks under torchrun).
_RSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:])\n"
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,"
    " file=sys.stderr)\n"
    "sys.exit(r.returncode)\n"
)


def run_seed(ckpt: Path, tp: int, endpoint: str, script: str) -> dict[str, Any]:
    """SGLang's examples/checkpoint_engine/update.py (the seed), unmodified, the same way."""
    cmd = [
        sys.executable, "-c", _RSS_WRAPPER,
        *torchrun_cmd(script, "--checkpoint-path", str(ckpt), "--inference-parallel-size",
                      str(tp), "--endpoint", endpoint, nproc=tp),
    ]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"the seed script failed ({r.returncode}):\n{r.stderr[-4000:]}")

    def seconds(label: str) -> float | None:
        found = re.findall(rf"{label} duration: ([0-9.]+) seconds", r.stderr)
        return max(map(float, found)) if found else None

    rss = re.findall(r"MAXRSS (\d+)", r.stderr)
    return {
        "register_mode": "seed script",
        "torchrun_wall_s": wall,
        "gather_s": seconds("Gather metas"),
        "update_s": seconds("Update weights without setting ranks"),
        "max_rss_bytes": int(rss[-1]) if rss else None,
        "command": " ".join(cmd[5:]),
    }


def report(endpoint: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{endpoint}/receiver/report", timeout=60).json()


def all_received(rep: dict[str, Any], n_tensors: int) -> bool:
    """The receiver's report of the last update: every worker got every tensor, bit for bit."""
    return bool(rep["ok"]) and all(
        not w["mismatches"] and not w["missing"] and w["tensors_received"] == n_tensors
        for w in rep["workers"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="runs of each contender")
    parser.add_argument(
        "--cold-first",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each contender's first run from a cold page cache",
    )
    parser.add_argument("--seed-runs", type=int, default=None, help="runs of the seed script")
    parser.add_argument("--threads", default="1,2,4,8,16", help="thread counts for the limits")
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(RESULTS), help="where update-<model>-tp<N> goes")
    parser.add_argument("--logs", help="where each run's stderr goes (default: WORKDIR/logs)")
    parser.add_argument("--extra", default="", help="more flags for ckptctl update")
    parser.add_argument(
        "--seed-script",
        help="path to SGLang's examples/checkpoint_engine/update.py: run it first, the same "
        "way, for a side-by-side figure (not shipped here: bring your own copy)",
    )
    parser.add_argument(
        "--register-modes",
        default="engine,direct",
        help="comma-separated --register-mode values to run side by side (engine,direct)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()

    import torch

    ckpt = Path(args.workdir) / args.model
    t0 = time.perf_counter()
    total, n_tensors = write_checkpoint(ckpt, args.model)
    write_s = time.perf_counter() - t0
    shards = sorted(ckpt.glob("*.safetensors"))
    limits = {
        "pinned_h2d_gb_s": h2d_bandwidth(True),
        "pageable_h2d_gb_s": h2d_bandwidth(False),
        **read_limits(shards, [int(x) for x in args.threads.split(",")]),
        "bare_torchrun_import_torch_nccl_s": bare_torchrun_seconds(args.tp),
    }
    # The seed polls /ping until it answers 200, which SGLang 0.5.23 does only after the first
    # weights: it runs against 0.5.22's behaviour (200 at once), as it was written for.
    profile = "sglang-0.5.22" if args.seed_script else "sglang-0.5.23"
    receiver, endpoint = start_receiver(ckpt, args.tp, profile)
    runs = []
    seeds: list[dict[str, Any]] = []
    try:
        seed_runs = args.runs if args.seed_runs is None else args.seed_runs
        for i in range(seed_runs if args.seed_script else 0):
            cold = i == 0 and args.cold_first and seed_runs > 1
            if cold:
                drop_cache(shards)
            seed = run_seed(ckpt, args.tp, endpoint, args.seed_script)
            seed["cache"] = "cold" if cold else "warm"
            seed["bit_exact"] = all_received(report(endpoint), n_tensors)
            seeds.append(seed)
        for mode in args.register_modes.split(","):
            for i in range(args.runs):
                cold = i == 0 and args.cold_first and args.runs > 1
                if cold:
                    drop_cache(shards)  # the first run starts from a cold cache
                extra = [*args.extra.split(), "--register-mode", mode]
                log = Path(args.logs or Path(args.workdir) / "logs")
                log /= f"update-{args.model}-tp{args.tp}-{mode}-run{i + 1}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                run = run_update(ckpt, args.tp, endpoint, extra, log)
                run["register_mode"] = mode
                run["cache"] = "cold" if cold else "warm"
                run["bit_exact"] = all_received(report(endpoint), n_tensors)
                runs.append(run)
    finally:
        receiver.terminate()
        receiver.wait(timeout=60)
        if not args.keep:
            import shutil

            shutil.rmtree(ckpt, ignore_errors=True)

    doc = {
        "model": args.model,
        "tp": args.tp,
        "total_bytes": total,
        "tensors": n_tensors,
        "files": len(shards),
        "checkpoint_write_s": write_s,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "limits": limits,
        "runs": runs,
        "seed_script": seeds,
        "command": f"python bench/bench_update.py --model {args.model} --tp {args.tp} --runs {args.runs}"
        f" --register-modes {args.register_modes}"
        + ("" if args.cold_first else " --no-cold-first")
        + (f" --seed-runs {args.seed_runs}" if args.seed_runs is not None else "")
        + (" --seed-script SEED" if args.seed_script else "")
        + (f" --extra '{args.extra}'" if args.extra else ""),
    }
    write_results(args.out, f"update-{args.model}-tp{args.tp}", doc, markdown(doc))


def rank_figures(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: its share (from the split's detail), its read (direct: from the register
    stage's detail) and the sum of every stage but the update."""
    out = []
    for r in run["summary"]["ranks"]:
        stages = r["stages"]
        share = re.search(r"this rank ([0-9.]+) GB", stages.get("split", {}).get("detail", ""))
        detail = stages.get("register", {}).get("detail", "")
        read = re.search(r"read ([0-9.]+)s \+ pin ([0-9.]+)s", detail)
        threads = re.search(r"(\d+) reader threads", detail)
        share_gb = float(share.group(1)) if share else None
        out.append(
            {
                "rank": r["rank"],
                "share_gb": share_gb,
                "read_s": float(read.group(1)) if read else None,
                "pin_s": float(read.group(2)) if read else None,
                "read_gb_s": share_gb / float(read.group(1))
                if read and share_gb and float(read.group(1))
                else None,
                "reader_threads": int(threads.group(1)) if threads else None,
                "stages_but_update_s": sum(
                    v.get("seconds") or 0.0 for k, v in stages.items() if k != "update"
                ),
                "job_wall_s": r["wall_s"],
                "peak_rss_gb": r["peak_rss_bytes"] / 1e9,
            }
        )
    return out


def markdown(doc: dict[str, Any]) -> str:
    lim = doc["limits"]
    gb = doc["total_bytes"] / 1e9
    warm_by = lim["warm_read_gb_s_by_threads"]
    lines = [
        f"# `ckptctl update`, {doc['model']} shapes ({gb:.2f} GB, {doc['tensors']} tensors, "
        f"{doc['files']} files), TP{doc['tp']} on {doc['tp']}x {doc['gpu']}",
        "",
        f"    {doc['command']}",
        "",
        "Limits measured in the same run: pinned H2D "
        f"{lim['pinned_h2d_gb_s']:.1f} GB/s, pageable H2D {lim['pageable_h2d_gb_s']:.1f} GB/s; "
        "reading the shards from the page cache (threads: GB/s) "
        + ", ".join(f"{n}: {v:.1f}" for n, v in warm_by.items())
        + f"; from the disk (cold, {lim['cold_read_threads']} threads) {lim['cold_read_gb_s']:.2f} GB/s; "
        f"bare torchrun + import torch + NCCL group {lim['bare_torchrun_import_torch_nccl_s']:.2f} s.",
        "",
        "| run | contender | cache | torchrun wall s | job wall s | split s | start s | "
        "register s | gather s | update s (GB/s per GPU) | all but update s | "
        "read per rank GB/s (x warm limit, x cold) | peak RSS GB (x share) | bit-exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, seed in enumerate(doc.get("seed_script") or []):
        rss = seed["max_rss_bytes"]
        lines.append(
            f"| s{i + 1} | the seed script | {seed.get('cache', 'warm')} | "
            f"{seed['torchrun_wall_s']:.2f} | - | - | - | - | {_s(seed['gather_s'])} | "
            f"{_s(seed['update_s'])} | - | - | {'-' if rss is None else f'{rss / 1e9:.1f}'} | "
            f"{seed['bit_exact']} |"
        )
    for i, run in enumerate(doc["runs"]):
        ranks = run["summary"]["ranks"]
        figs = rank_figures(run)

        def stage(name: str, ranks: list[dict[str, Any]] = ranks) -> float:
            return max(r["stages"].get(name, {}).get("seconds") or 0.0 for r in ranks)

        upd_s = stage("update")
        reads = [f for f in figs if f["read_gb_s"]]
        read_text = (
            ", ".join(
                f"{f['read_gb_s']:.1f} ({f['read_gb_s'] / warm_by.get(f['reader_threads'], lim['warm_read_gb_s']):.2f}, "
                f"{f['read_gb_s'] / lim['cold_read_gb_s']:.2f})"
                for f in reads
            )
            or "-"
        )
        rss = ", ".join(
            f"{f['peak_rss_gb']:.1f}"
            + (f" ({f['peak_rss_gb'] / f['share_gb']:.2f})" if f["share_gb"] else "")
            for f in figs
        )
        lines.append(
            f"| {i + 1} | {run.get('register_mode', 'engine')} | {run['cache']} | "
            f"{run['torchrun_wall_s']:.2f} | {max(f['job_wall_s'] for f in figs):.2f} | "
            f"{stage('split'):.2f} | {stage('start'):.2f} | {stage('register'):.2f} | "
            f"{stage('gather_metas'):.2f} | "
            f"{upd_s:.2f} ({doc['total_bytes'] / upd_s / 1e9 if upd_s else 0:.1f}) | "
            f"{max(f['stages_but_update_s'] for f in figs):.2f} | {read_text} | {rss} | "
            f"{run['bit_exact']} |"
        )
    lines += ["", "Reads: each rank's share over its read time (direct registration, from the "
              "register stage's detail), against the page cache's limit at the rank's thread "
              "count (one process) and against the disk's.", ""]  # fmt: skip
    seeds = doc.get("seed_script") or []
    for cache in ("warm", "cold"):
        seed = min(
            (s for s in seeds if s.get("cache") == cache),
            key=lambda s: s["torchrun_wall_s"],
            default=None,
        )
        if seed is None:
            continue
        for mode in dict.fromkeys(r["register_mode"] for r in doc["runs"]):
            mine = [r for r in doc["runs"] if r["register_mode"] == mode and r["cache"] == cache]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["torchrun_wall_s"])
            lines.append(
                f"- {cache}, --register-mode {mode}: wall {best['torchrun_wall_s']:.2f} s = "
                f"**{best['torchrun_wall_s'] / seed['torchrun_wall_s']:.2f}x** the seed script's "
                f"{seed['torchrun_wall_s']:.2f} s; wall / bare floor "
                f"{best['torchrun_wall_s'] / lim['bare_torchrun_import_torch_nccl_s']:.2f}"
            )
    lines.append("")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
