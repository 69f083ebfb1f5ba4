"""Does reading (and pinning) a rank's share slow the `import torch` it overlaps? (GPU node)

Every `torchrun ... ckptctl update` rank reads its share in a thread while the interpreter
imports torch (stages.EarlyShare). Faulting in fresh memory (MADV_POPULATE_WRITE) and pinning
(cuMemHostRegister) hold the process's mmap lock for reading, and every mmap of the import
(dlopen, the allocator) waits for it. This runs, in pairs of fresh processes (two ranks at
once, RANK 0 and 1), the time from the process's start to the end of `import torch` and to the
share being ready (read, pinned, as tensors), for each way of overlapping:

    none              import torch alone (the floor)
    read              read into fresh memory, no population call, no pin
    read-pop          read with MADV_POPULATE_WRITE per run (a CPU-only read's fill), no pin
    read-huge         read-pop into memory asked for in huge pages (MADV_HUGEPAGE)
    pin-driver-pop    read-pop, then pin through the driver before torch (7cdc960)
    pin-driver        the same without the population call (ckptctl now)
    pin-driver-huge   pin-driver into memory asked for in huge pages
    pin-after         read-pop, then pin through the runtime once torch is there (before 7cdc960)

    python bench/bench_import_overlap.py --model qwen3-8b --reps 6

Writes import-overlap-<model>-tp2.{json,md} to --out (bench/results/ by default, replacing the
previous run's), with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = [
    "none",
    "read",
    "read-pop",
    "read-huge",
    "pin-driver-pop",
    "pin-driver",
    "pin-driver-huge",
    "pin-after",
]


def rank_main(path: str, mode: str, rank: int) -> None:
    """One rank: start the overlap, import torch, wait for the share; print the times."""
    started = time.perf_counter()
    os.environ["RANK"] = str(rank)
    reader = None
    if mode != "none":
        from ckptctl.transfer import host_memory
        from ckptctl.transfer.host_memory import _cuda_pinning, _file_reads
        from ckptctl.transfer.stages import read_and_plan

        if mode == "read":
            _file_reads._Populate.__call__ = lambda self, run: None  # type: ignore[method-assign]
        if mode in ("pin-driver-pop", "pin-after"):  # the population call ahead of the pin
            fill = _file_reads.fill
            _file_reads.fill = lambda *a, **k: fill(*a, **{**k, "fresh": True})  # type: ignore[assignment]
        if mode.endswith("-huge"):
            anonymous = _file_reads.anonymous_memory

            def huge(size: int) -> Any:
                memory = anonymous(size)
                if size > 0:
                    memory.madvise(mmap.MADV_HUGEPAGE)
                return memory

            _file_reads.anonymous_memory = huge  # type: ignore[assignment]
        if mode == "pin-after":
            _cuda_pinning.DriverPin.for_rank = classmethod(lambda cls, rank: None)  # type: ignore[assignment]
        checkpoint, plan = read_and_plan(path, 2, "tensors")  # as stages.EarlyShare plans
        share = plan.ranks[rank]
        reader = host_memory.ShareReader(
            checkpoint, list(share.tensors), pin=mode.startswith("pin"), rank=rank
        )
    import torch

    imported = time.perf_counter() - started
    ready = None
    detail: dict[str, Any] = {}
    if reader is not None:
        reader.result()
        ready = time.perf_counter() - started
        detail = {
            "read_s": reader.read_seconds,
            "pin_s": reader.pin_seconds,
            "pinned_before_torch": reader.pinned_before_torch,
        }
    if torch.cuda.is_available():
        torch.cuda.init()
    print(
        json.dumps(
            {
                "mode": mode,
                "rank": rank,
                "import_torch_done_s": round(imported, 3),
                "share_ready_s": None if ready is None else round(ready, 3),
                **detail,
            }
        ),
        flush=True,
    )


def system_facts() -> dict[str, str]:
    """The kernel and its transparent huge page settings (what MADV_HUGEPAGE can get)."""
    facts = {"kernel": os.uname().release}
    for name in ("enabled", "defrag"):
        with contextlib.suppress(OSError):
            path = f"/sys/kernel/mm/transparent_hugepage/{name}"
            facts[f"thp_{name}"] = Path(path).read_text().strip()
    return facts


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Does the early read and pin slow the `import torch` it overlaps? {doc['model']} "
        "shapes, 2 ranks",
        "",
        f"    {doc['command']}",
        "",
        "Medians over every repetition and rank, seconds from the process's start; the modes "
        "are those of bench/bench_import_overlap.py's docstring.",
        "",
        "| mode | runs | import torch done s | share ready s | read s | pin s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, s in doc["median"].items():
        runs = sum(1 for r in doc["rows"] if r["mode"] == mode)
        lines.append(
            f"| {mode} | {runs} | {s['import_torch_done_s']:.2f} | {s['share_ready_s']:.2f} | "
            f"{s['read_s']:.2f} | {s['pin_s']:.2f} |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ckpt = Path(args.workdir) / args.model
    if args.rank is not None:
        rank_main(str(ckpt), args.mode, args.rank)
        return

    from _support.ckpt_factory import write_checkpoint

    if not any(ckpt.glob("*.safetensors")):
        write_checkpoint(ckpt, args.model)
    for f in ckpt.iterdir():  # warm page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for mode in args.modes.split(","):
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--model",
                        args.model,
                        "--workdir",
                        args.workdir,
                        "--rank",
                        str(r),
                        "--mode",
                        mode,
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
                for r in (0, 1)
            ]
            for p in procs:
                out, _ = p.communicate(timeout=120)
                for line in out.splitlines():
                    if line.startswith("{"):
                        rows.append({**json.loads(line), "rep": rep})
                        print(line, flush=True)
    summary = {}
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue  # (every run of it failed: its errors are above)
        summary[mode] = {
            "import_torch_done_s": statistics.median(r["import_torch_done_s"] for r in mine),
            "share_ready_s": statistics.median(r["share_ready_s"] or 0 for r in mine),
            "ready_s": statistics.median(
                max(r["import_torch_done_s"], r["share_ready_s"] or 0) for r in mine
            ),
            "read_s": statistics.median(r.get("read_s") or 0 for r in mine),
            "pin_s": statistics.median(r.get("pin_s") or 0 for r in mine),
        }
    doc = {"model": args.model, "rows": rows, "median": summary, "system": system_facts()}
    doc["command"] = f"python bench/bench_import_overlap.py --model {args.model} --reps {args.reps}"
    from result_files import write_results

    write_results(args.out, f"import-overlap-{args.model}-tp2", doc, markdown(doc))
    for mode, s in summary.items():
        print(f"{mode:18s} import done {s['import_torch_done_s']:.2f}s  share ready "
              f"{s['share_ready_s']:.2f}s  both {s['ready_s']:.2f}s  read {s['read_s']:.2f}s  "
              f"pin {s['pin_s']:.2f}s")  # fmt: skip


if __name__ == "__main__":
    main()
