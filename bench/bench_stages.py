"""Every CPU-side stage of `update` on a many-tensor checkpoint, against the machine's own limits.

    python bench/bench_stages.py --model deepseek-v3-small --world-size 2

Writes the checkpoint once (bench_update.py's writer; reused when it is there) and measures,
in one run, with no GPU needed:

- split: read_checkpoint + plan_split + the plan's fingerprint, before torch is imported (as
  stages.EarlyShare runs it) and after (garbage collection paused or not);
- read: one rank's share with ckptctl's reader (host_memory.ShareReader, pinning left out: that
  needs CUDA) against the page cache's limit measured in the same run - N threads, each
  reading 64 MiB pieces of the files with os.preadv into a buffer of its own (reused: the
  ceiling; fresh memory: what a first read must also fault in) - then the same from a cold
  cache (the files dropped with posix_fadvise(DONTNEED));
- metas: every rank's metas from the plan (what gather_planned needs) against what
  checkpoint-engine's gather_metas costs on the CPU (each rank pickles its DataToGather and
  unpickles every rank's);
- update, sender side: checkpoint-engine's own _gen_h2d_buckets, _to_named_tensor and the
  pickle that send_pyobj makes of each bucket, for 90k metas as ours and as checkpoint-engine
  builds them; receiver side: the unpickle and checkpoint_engine.worker._extract_weights
  (views into a CPU buffer standing in for the IPC buffer);
- imports: `import torch`, `import checkpoint_engine.ps`, and ckptctl's engine_module("ps");
- the early read: plan + read one rank's share, then `import torch`, against the same with
  the read in a thread while torch is imported (stages.EarlyShare), in fresh processes.

Results: stages-<model>-cpu.{json,md} in --out (bench/results/ by default, replacing the
previous run's), with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from _support.ckpt_factory import drop_cache
from _support.limits import limit_read
from bench_plan import timed

REPO = Path(__file__).resolve().parents[1]

CHUNK = 64 << 20


# -- reading -------------------------------------------------------------------------------------


def ours_read(checkpoint: Any, share: Any, threads: int | None) -> dict[str, Any]:
    from ckptctl.transfer.host_memory import ShareReader
    from ckptctl.transfer.host_memory._file_reads import layout, read_runs

    reader = ShareReader(checkpoint, share.tensors, threads, pin=False)
    reader.wait()
    assert reader.read_seconds is not None
    runs = read_runs(layout(share.tensors))
    return {
        "threads": reader.threads,
        "seconds": round(reader.read_seconds, 4),
        "gb_s": round(share.bytes / reader.read_seconds / 1e9, 3),
        "requests": len(runs),
        "tensors": len(share.tensors),
    }


def warm(files: list[Path]) -> None:
    """Everything in the page cache."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(CHUNK):
                pass


def read_section(checkpoint: Any, share: Any, threads: list[int], repeat: int) -> dict[str, Any]:
    files = [checkpoint.path_of(f) for f in checkpoint.files]
    mine = [checkpoint.path_of(f) for f in share.files]
    warm(files)
    out: dict[str, Any] = {
        "share_bytes": share.bytes,
        "files_bytes": sum(f.stat().st_size for f in files),
    }
    out["warm_limit_gb_s"] = {
        n: round(max(limit_read(files, n, fresh=False) for _ in range(repeat)), 3) for n in threads
    }
    out["warm_limit_fresh_memory_gb_s"] = {
        n: round(max(limit_read(files, n, fresh=True) for _ in range(repeat)), 3) for n in threads
    }
    runs = [ours_read(checkpoint, share, None) for _ in range(repeat)]
    out["warm_ours"] = max(runs, key=lambda r: r["gb_s"])
    out["warm_ours_by_threads"] = {
        n: max((ours_read(checkpoint, share, n) for _ in range(repeat)), key=lambda r: r["gb_s"])
        for n in threads
    }
    cold: dict[str, Any] = {}
    for n in threads:
        drop_cache(files)
        cold[n] = round(limit_read(mine, n, fresh=False), 3)
    out["cold_limit_gb_s"] = cold
    drop_cache(files)
    out["cold_ours"] = ours_read(checkpoint, share, None)
    return out


# -- metas, gather, update -------------------------------------------------------------------------


def engine_style_metas(plan: Any) -> dict[int, list[tuple[int, list[Any]]]]:
    """Every rank's metas as validated ParameterMetas, one torch.Size per tensor (what
    checkpoint-engine's register_checkpoint and gather_metas hand around)."""
    from ckptctl.ce.bare_import import engine_module
    from ckptctl.checkpoint.loader import torch_layout
    from ckptctl.transfer.host_memory._file_reads import aligned, layout

    meta_cls = engine_module("data_types").ParameterMeta
    out = {}
    for r in plan.ranks:
        buckets = []
        for b in layout(r.tensors):
            metas = []
            for t, _ in b.placed:
                dtype, shape = torch_layout(t)
                metas.append(
                    meta_cls(
                        name=t.name, dtype=dtype, shape=list(shape), aligned_size=aligned(t.nbytes)
                    )
                )
            buckets.append((b.size, metas))
        out[r.rank] = buckets
    return out


def global_metas(
    planned: dict[int, list[tuple[int, list[Any]]]], world: int
) -> tuple[dict[int, Any], Any]:
    from collections import defaultdict

    from ckptctl.ce.bare_import import engine_module
    from ckptctl.ce.internals import apply_gathered

    ps = object.__new__(engine_module("ps").ParameterServer)
    ps._gpu_count, ps._all_hosts, ps._global_device_uuids = world, [], []
    ps._local_rdma_devices = defaultdict(set)
    docs = [
        {
            "ptrs": [1 << 40] * len(planned.get(r, [])),
            "sizes": [s for s, _ in planned.get(r, [])],
            "tensors": [len(m) for _, m in planned.get(r, [])],
            "p2p_store_addr": None,
            "host_ip": "127.0.0.1",
            "device_uuid": f"GPU-{r}",
            "rdma_device": "",
        }
        for r in range(world)
    ]
    apply_gathered(ps, docs, planned)
    return dict(ps._current_global_parameter_metas), ps


def gather_section(plan: Any, repeat: int) -> dict[str, Any]:
    from ckptctl.ce.bare_import import engine_module
    from ckptctl.transfer.host_memory import gc_paused, planned_buffers

    types = engine_module("data_types")
    out: dict[str, Any] = {}
    out["planned_metas_every_rank"], planned = timed(lambda: planned_buffers(plan), repeat)
    with gc_paused():
        out["validated_metas_every_rank"], engine = timed(lambda: engine_style_metas(plan), 1)

    def pickled_gather() -> int:
        # What all_gather_object costs every rank on the CPU: pickle its own, unpickle all.
        blobs = [
            pickle.dumps(
                types.DataToGather(
                    memory_buffer_metas_list=[
                        types.MemoryBufferMetas(metas=m, ptr=1 << 40, size=s) for s, m in engine[r]
                    ],
                    p2p_store_addr=None,
                    host_ip="127.0.0.1",
                    device_uuid=f"GPU-{r}",
                    rdma_device="",
                )
            )
            for r in engine
        ]
        for blob in blobs:
            pickle.loads(blob)
        return sum(map(len, blobs))

    world = len(plan.ranks)
    out["apply_gathered_every_rank"], _ = timed(lambda: global_metas(planned, world), repeat)
    out["checkpoint_engine_gather_pickles"], size = timed(pickled_gather, 1)
    out["checkpoint_engine_gather_pickles"]["bytes"] = size
    out["note"] = (
        "checkpoint-engine's gather: every rank pickles its own DataToGather (validated on the "
        "way in) and unpickles every rank's; the figure is the sum for all ranks on one CPU, "
        "i.e. close to what one rank pays (dominated by the unpickling of all)."
    )
    return out, planned, engine


def update_section(
    planned: dict[int, Any], engine: dict[int, Any], world: int, bucket_gb: float, repeat: int
) -> dict[str, Any]:
    import torch

    from ckptctl.ce.bare_import import engine_module
    from ckptctl.transfer.host_memory import gc_paused

    ps_mod = engine_module("ps")
    worker = engine_module("worker")
    bucket_size = int(bucket_gb * (1 << 30))
    out: dict[str, Any] = {"bucket_size_bytes": bucket_size}
    for label, metas in (("ours", planned), ("checkpoint-engine's", engine)):
        gm, ps = global_metas(metas, world)

        def sender(gm: Any = gm, ps: Any = ps) -> tuple[list[bytes], int]:
            buckets = ps_mod._gen_h2d_buckets(
                gm, bucket_size, ps._local_rdma_devices, ps._remote_rdma_devices, None
            )
            # _detect_bucket_size's pass over every meta, then every bucket's message
            largest = max(
                m.aligned_size
                for e in gm.values()
                for b in e.memory_buffer_metas_list
                for m in b.metas
            )
            payloads = [
                pickle.dumps(
                    ps_mod._to_named_tensor(b.items, i % 2 * bucket_size),
                    protocol=pickle.DEFAULT_PROTOCOL,
                )
                for i, (_, _, b) in enumerate(buckets)
            ]
            return payloads, largest

        with gc_paused():
            stats, (payloads, _) = timed(sender, repeat)
        stats["buckets"] = len(payloads)
        stats["pickled_bytes"] = sum(map(len, payloads))
        buffer = torch.empty(2 * bucket_size, dtype=torch.uint8)  # untouched: no memory used

        def receiver(payloads: list[bytes] = payloads, buffer: Any = buffer) -> int:
            n = 0
            for blob in payloads:
                n += len(worker._extract_weights(pickle.loads(blob), buffer))
            return n

        with gc_paused():
            recv, n = timed(receiver, repeat)
            unpickle, _ = timed(lambda p=payloads: [pickle.loads(b) for b in p], repeat)
        recv["tensors"] = n
        recv["of_which_unpickle"] = unpickle
        out[label] = {"sender": stats, "receiver": recv}
    return out


# -- imports and the early read ------------------------------------------------------------------


def fresh(code: str) -> float:
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return float(r.stdout.strip().splitlines()[-1])


_T0 = "import time; t0 = time.perf_counter()\n"
_DT = "print(time.perf_counter() - t0)\n"

IMPORTS = {
    "import torch": "import torch\n",
    "import checkpoint_engine.ps": "import checkpoint_engine.ps\n",
    "engine_module('ps') (ckptctl)": (
        "from ckptctl.ce.bare_import import engine_module\nengine_module('ps')\n"
    ),
}

EARLY = """
import sys
from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.transfer.host_memory import ShareReader, gc_paused
def plan_and_read():
    with gc_paused():
        ck = read_checkpoint({path!r})
        plan = plan_split(ck, {world}, "auto")
    reader = ShareReader(ck, plan.ranks[0].tensors, pin=False)
    return reader
if {early}:
    import threading
    box = []
    th = threading.Thread(target=lambda: box.append(plan_and_read()))
    th.start()
    import torch
    th.join()
    box[0].wait()
else:
    import torch
    plan_and_read().wait()
"""


def imports_section(path: Path, world: int, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, code in IMPORTS.items():
        out[label] = round(min(fresh(_T0 + code + _DT) for _ in range(repeat)), 3)
    for label, early in (
        ("import torch, then plan + read", False),
        ("plan + read while torch is imported", True),
    ):
        out[label] = round(
            min(
                fresh(_T0 + EARLY.format(path=str(path), world=world, early=early) + _DT)
                for _ in range(repeat)
            ),
            3,
        )
    return out


# -- the run -------------------------------------------------------------------------------------


def split_section(path: Path, world: int, repeat: int) -> dict[str, Any]:
    import gc

    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.transfer.host_memory import gc_paused
    from ckptctl.transfer.stages import plan_fingerprint

    out: dict[str, Any] = {}
    code = (
        "import time\nfrom ckptctl.checkpoint import plan_split, read_checkpoint\n"
        "from ckptctl.transfer.host_memory import gc_paused\nt0 = time.perf_counter()\n"
        f"with gc_paused():\n    plan_split(read_checkpoint({str(path)!r}), {world}, 'auto')\n"
        "print(time.perf_counter() - t0)\n"
    )
    out["before_torch_fresh_process_s"] = round(min(fresh(code) for _ in range(repeat)), 4)
    import torch  # noqa: F401 - from here on, as inside the job after the store is joined

    with gc_paused():
        out["read_checkpoint"], ck = timed(lambda: read_checkpoint(path), repeat)
        out["plan_split"], plan = timed(lambda: plan_split(ck, world, "auto"), repeat)
        out["fingerprint"], _ = timed(lambda: plan_fingerprint(plan), repeat)
    gc.collect()
    out["read_checkpoint_gc_on"], _ = timed(lambda: read_checkpoint(path), repeat)
    out["split"] = plan.split
    out["max_rank_over_lower_bound"] = round(plan.max_rank_bytes / plan.lower_bound_bytes, 5)
    return out, ck, plan


def main() -> None:
    from _support.ckpt_factory import MODELS, write_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="deepseek-v3-small")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4,8,16", help="thread counts for the limits")
    parser.add_argument("--bucket-size-gb", type=float, default=8.0)
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()
    threads = [int(x) for x in args.threads.split(",")]

    path = Path(args.workdir) / args.model
    if not (path / "model.safetensors.index.json").exists():
        write_checkpoint(path, args.model)
    doc: dict[str, Any] = {
        "model": args.model,
        "world_size": args.world_size,
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "command": " ".join(["python", "bench/bench_stages.py", *sys.argv[1:]]),
    }
    doc["split"], ck, plan = split_section(path, args.world_size, args.repeat)
    doc["tensors"], doc["total_bytes"], doc["files"] = (
        len(ck.tensors),
        ck.total_bytes,
        len(ck.files),
    )
    from ckptctl.transfer.host_memory._file_reads import read_threads

    doc["read_threads_default"] = read_threads()
    doc["read"] = read_section(ck, plan.ranks[0], threads, args.repeat)
    doc["gather"], planned, engine = gather_section(plan, args.repeat)
    doc["update"] = update_section(
        planned, engine, args.world_size, args.bucket_size_gb, args.repeat
    )
    warm([ck.path_of(f) for f in ck.files])  # the cold read left the cache partly empty
    doc["imports"] = imports_section(path, args.world_size, args.repeat)
    from result_files import write_results

    write_results(args.out, f"stages-{args.model}-cpu", doc, markdown(doc))
    if not args.keep:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def row(label: str, cells: Any) -> str:
    """One markdown table row: the label, then each cell."""
    return f"| {label} | " + " | ".join(str(c) for c in cells) + " |"


def gb_s(by_threads: dict[Any, float]) -> list[str]:
    return [f"{v:.2f}" for v in by_threads.values()]


def markdown(doc: dict[str, Any]) -> str:
    s, r, g, u, imp = doc["split"], doc["read"], doc["gather"], doc["update"], doc["imports"]
    m = doc["machine"]
    best_limit_n = max(r["warm_limit_gb_s"], key=lambda n: r["warm_limit_gb_s"][n])
    best_limit = r["warm_limit_gb_s"][best_limit_n]
    fresh_limit = max(r["warm_limit_fresh_memory_gb_s"].values())
    ours = r["warm_ours"]
    cold_limit = max(r["cold_limit_gb_s"].values())
    lines = [
        f"# CPU stages of `update`, {doc['model']} ({doc['tensors']} tensors, "
        f"{doc['total_bytes'] / 1e9:.2f} GB, {doc['files']} files), world {doc['world_size']}",
        "",
        f"    {doc['command']}",
        "",
        f"Machine: {m['cpus']} CPUs ({m['affinity']} usable), Python {m['python']}; best / "
        "median of the repeats, seconds unless marked.",
        "",
        "## split (inside the job: read_checkpoint + plan_split + the plan's fingerprint)",
        "",
        f"- before torch is imported, in a fresh process (stages.EarlyShare): "
        f"**{s['before_torch_fresh_process_s']:.3f} s** (read + plan)",
        f"- torch imported, GC paused (plan_share): read_checkpoint {s['read_checkpoint']['best_s']:.3f}, "
        f"plan_split {s['plan_split']['best_s']:.3f}, fingerprint {s['fingerprint']['best_s']:.3f}; "
        f"sum **{s['read_checkpoint']['best_s'] + s['plan_split']['best_s'] + s['fingerprint']['best_s']:.3f} s**",
        f"- the same read_checkpoint with GC on: {s['read_checkpoint_gc_on']['best_s']:.3f}",
        f"- {s['split']} split, largest rank / lower bound {s['max_rank_over_lower_bound']}",
        "",
        f"## read (rank 0's share: {r['share_bytes'] / 1e9:.2f} GB, {ours['tensors']} tensors, "
        f"{ours['requests']} preadv requests)",
        "",
        row("threads", r["warm_limit_gb_s"]),
        row("---", ["---" for _ in r["warm_limit_gb_s"]]),
        row("page cache limit, GB/s (own buffer)", gb_s(r["warm_limit_gb_s"])),
        row("page cache limit, GB/s (fresh memory)", gb_s(r["warm_limit_fresh_memory_gb_s"])),
        row(
            "ckptctl's read, GB/s",
            gb_s({n: v["gb_s"] for n, v in r["warm_ours_by_threads"].items()}),
        ),
        row("cold (disk) limit, GB/s", gb_s(r["cold_limit_gb_s"])),
        "",
        f"ckptctl's default ({ours['threads']} threads here): **{ours['gb_s']:.2f} GB/s warm = "
        f"{ours['gb_s'] / best_limit:.2f}x the page cache's best ({best_limit:.2f} GB/s, "
        f"{best_limit_n} threads), {ours['gb_s'] / fresh_limit:.2f}x its best into fresh memory**; "
        f"cold {r['cold_ours']['gb_s']:.2f} GB/s = {r['cold_ours']['gb_s'] / cold_limit:.2f}x the "
        f"disk's ({cold_limit:.2f} GB/s).",
        "",
        "## metas and gather",
        "",
        f"- every rank's metas from the plan (gather_planned's input): "
        f"**{g['planned_metas_every_rank']['best_s']:.3f} s**",
        f"- gather_planned's work once the addresses are in (apply_gathered): "
        f"{g['apply_gathered_every_rank']['best_s']:.4f} s",
        f"- the same as validated ParameterMetas (checkpoint-engine's way): "
        f"{g['validated_metas_every_rank']['best_s']:.3f} s",
        f"- checkpoint-engine's gather on the CPU (pickle + unpickle of every rank's metas, "
        f"{g['checkpoint_engine_gather_pickles']['bytes'] / 1e6:.1f} MB): "
        f"{g['checkpoint_engine_gather_pickles']['best_s']:.3f} s, before any network",
        "",
        f"## update, per-tensor work (bucket {u['bucket_size_bytes'] / (1 << 30):g} GiB)",
        "",
        "| metas | buckets | sender: _gen_h2d_buckets + _to_named_tensor + pickle | pickled MB | "
        "receiver: unpickle + _extract_weights | of which unpickle |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label in ("ours", "checkpoint-engine's"):
        x = u[label]
        lines.append(
            f"| {label} | {x['sender']['buckets']} | {x['sender']['best_s']:.3f} | "
            f"{x['sender']['pickled_bytes'] / 1e6:.1f} | {x['receiver']['best_s']:.3f} "
            f"({x['receiver']['best_s'] / max(x['receiver']['tensors'], 1) * 1e6:.1f} us/tensor) | "
            f"{x['receiver']['of_which_unpickle']['best_s']:.3f} |"
        )
    lines += [
        "",
        "## imports and the early read (fresh processes, best of the repeats)",
        "",
        *(f"- {k}: {v:.2f} s" for k, v in imp.items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
