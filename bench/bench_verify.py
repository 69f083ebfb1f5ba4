"""Benchmark what `--verify` costs beside the update it proves.

    python bench/bench_verify.py hash                                  # CPU only: the hashing
    python bench/bench_verify.py gpu --model qwen3-8b --tp 2           # a GPU node (2 GPUs)
    python bench/bench_verify.py gpu --model deepseek-v3 --layers 5 --tp 2

hash: each rank hashes its share of the checkpoint (SHA-256 of every tensor, `sha256_tensors`
over its threads). For Qwen3-8B on TP2 (2 ranks) and DeepSeek-V3 (FP8, 92k tensors) on 16
ranks, the largest rank share is hashed - a sample of it, every k-th tensor from largest to
smallest so the size mix and the tensor count per byte stay, when the share does not fit in
--max-gb - and projected to the whole share. Limits measured in the same run: one thread's
SHA-256 rate (times the threads: the ceiling), and a memcpy of the same bytes.

gpu: a synthetic checkpoint with the model's real names and shapes (DeepSeek-V3: its first
--layers layers, embeddings and head: the full 680 GB does not fit on one node), the test
receiver (tests/support/gpu_receiver.py), and runs of `torchrun ... ckptctl update`, alternating:
a plain update, then `--verify` against a receiver that offers compare_checksum (profile
sglang-pr17009: every rank hashes its share while the update runs, the leader sends every
SHA-256), then `--verify-round-trip --reset-served-weights` against an SGLang 0.5.23 one. The
receiver's own part (its GPU-to-host copies and hashing, not SGLang's code) is timed apart.

Writes verify-hash-cpu or verify-<model>-tp<N> (.json, .md) to --out (bench/results/ by default,
replacing the previous run's), with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

GiB = 1 << 30


def model_specs(model: str, layers: int | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of `model`; DeepSeek-V3 cut to its first `layers` layers."""
    from _support import model_shapes

    if model == "qwen3-8b":
        return list(model_shapes.qwen3_8b())
    specs = list(model_shapes.deepseek_v3())
    if layers is None:
        return specs

    def kept(name: str) -> bool:
        parts = name.split(".")
        return not (parts[:2] == ["model", "layers"] and int(parts[2]) >= layers)

    return [s for s in specs if kept(s[0])]


def largest_share(specs: list[Any], world: int) -> list[Any]:
    """The biggest of `world` byte-balanced shares (largest tensor first to the emptiest rank,
    close to `--split tensors`)."""
    from _support.ckpt_factory import nbytes

    shares: list[list[Any]] = [[] for _ in range(world)]
    sizes = [0] * world
    for spec in sorted(specs, key=lambda s: -nbytes(s[1], s[2])):
        r = sizes.index(min(sizes))
        shares[r].append(spec)
        sizes[r] += nbytes(spec[1], spec[2])
    return shares[sizes.index(max(sizes))]


# -- hash: the CPU side ------------------------------------------------------------------------


def _rate(fn: Any, nbytes: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def bench_hash(
    model: str, specs: list[Any], world: int, max_gb: float, threads: int
) -> dict[str, Any]:
    import hashlib

    import numpy as np
    from _support.ckpt_factory import nbytes

    from ckptctl.weights_checker import sha256_tensors

    share = largest_share(specs, world)
    sizes = [nbytes(s[1], s[2]) for s in share]  # largest first
    share_bytes = sum(sizes)
    step = max(1, -(-share_bytes // int(max_gb * GiB)))
    sample = list(range(0, len(share), step))
    sample_bytes = sum(sizes[i] for i in sample)
    buf = np.random.default_rng(1).integers(0, 256, sample_bytes, dtype=np.uint8)
    view = memoryview(buf)
    items, at = [], 0
    for i in sample:
        items.append((share[i][0], view[at : at + sizes[i]]))
        at += sizes[i]

    block = view[: min(sample_bytes, 512 << 20)]
    one_thread = _rate(lambda: hashlib.sha256(block).digest(), len(block))
    copy_dst = np.empty(len(block), dtype=np.uint8)
    memcpy = _rate(lambda: np.copyto(copy_dst, np.frombuffer(block, dtype=np.uint8)), len(block))
    t0 = time.perf_counter()
    sha256_tensors(items, threads)
    sample_s = time.perf_counter() - t0
    rate = sample_bytes / sample_s / 1e9
    # The whole share: its bytes at the sample's rate, but never under its largest tensor
    # (one tensor is one SHA-256 stream, on one thread).
    projected = max(share_bytes / 1e9 / rate, sizes[0] / 1e9 / one_thread)
    names = {s[0]: "0" * 64 for s in specs}
    t0 = time.perf_counter()
    encoded = json.dumps(names)
    json.loads(encoded)
    json_s = time.perf_counter() - t0
    return {
        "model": model,
        "world": world,
        "tensors": len(specs),
        "share_tensors": len(share),
        "share_bytes": share_bytes,
        "largest_tensor_bytes": sizes[0],
        "sample_tensors": len(sample),
        "sample_bytes": sample_bytes,
        "threads": threads,
        "sample_s": sample_s,
        "sample_gb_s": rate,
        "one_thread_sha256_gb_s": one_thread,
        "memcpy_gb_s": memcpy,
        "projected_share_s": projected,
        "ceiling_ratio": rate / (one_thread * threads),
        "all_sha256_json_bytes": len(encoded),
        "all_sha256_json_roundtrip_s": json_s,
    }


def hash_markdown(rows: list[dict[str, Any]], cpu: str) -> str:
    lines = [
        "# `--verify`: hashing each rank's share (SHA-256 of every tensor), CPU",
        "",
        "    python bench/bench_verify.py hash",
        "",
        f"On {cpu}. Limits measured in the same run: one thread's SHA-256 and a memcpy of the "
        "same bytes; the ceiling is one thread's rate times the threads.",
        "",
        "| model | ranks | largest share GB (tensors) | sampled GB (tensors) | threads | "
        "GB/s (ceiling ratio) | 1-thread SHA-256 GB/s | memcpy GB/s | projected share s | "
        "every SHA-256 as JSON MB (encode+decode s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['world']} | {r['share_bytes'] / 1e9:.2f} ({r['share_tensors']}) | "
            f"{r['sample_bytes'] / 1e9:.2f} ({r['sample_tensors']}) | {r['threads']} | "
            f"{r['sample_gb_s']:.2f} ({r['ceiling_ratio']:.2f}) | "
            f"{r['one_thread_sha256_gb_s']:.2f} | {r['memcpy_gb_s']:.1f} | "
            f"{r['projected_share_s']:.2f} | {r['all_sha256_json_bytes'] / 1e6:.2f} "
            f"({r['all_sha256_json_roundtrip_s']:.2f}) |"
        )
    lines.append("")
    return "\n".join(lines)


# -- gpu: the update with and without --verify -------------------------------------------------


def _stage(summary: dict[str, Any], name: str) -> float | None:
    found = [r["stages"][name]["seconds"] for r in summary["ranks"] if name in r["stages"]]
    return max(found) if found else None


def _run(ckpt: Path, tp: int, endpoint: str, flags: list[str], label: str, out: Path) -> dict:
    from bench_update import report, run_update

    httpx_reset(endpoint)
    run = run_update(ckpt, tp, endpoint, flags, out / f"verify-{label}.log")
    summary = run["summary"]
    rep = report(endpoint)
    return {
        "label": label,
        "flags": " ".join(flags),
        "torchrun_wall_s": run["torchrun_wall_s"],
        "update_s": _stage(summary, "update"),
        "checker_s": _stage(summary, "checker"),
        "round_trip_s": _stage(summary, "round_trip"),
        "check_weights_s": _stage(summary, "check_weights"),
        "verified": summary.get("verified"),
        "verification": summary.get("verification"),
        "receiver_checker_ops": rep.get("checker_ops", []),
        "bit_exact": bool(rep["ok"]),
    }


def httpx_reset(endpoint: str) -> None:
    import httpx

    httpx.post(f"{endpoint}/receiver/reset", timeout=60)


def bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from _support.ckpt_factory import write_checkpoint
    from bench_update import start_receiver

    out = Path(args.logs or Path(args.workdir) / "logs")  # each run's stderr
    out.mkdir(parents=True, exist_ok=True)
    label = args.model if args.layers is None else f"{args.model}-{args.layers}layers"
    specs = model_specs(args.model, args.layers if args.model == "deepseek-v3" else None)
    ckpt = Path(args.workdir) / label
    total, n_tensors = write_checkpoint(ckpt, label, specs=specs)
    runs: list[dict[str, Any]] = []
    extra = args.extra.split()
    for profile, flags in (
        ("sglang-pr17009", ["--verify"]),
        ("sglang-0.5.23", ["--verify-round-trip", "--reset-served-weights"]),
    ):
        receiver, endpoint = start_receiver(ckpt, args.tp, profile)
        try:
            for i in range(args.runs):
                runs.append(_run(ckpt, args.tp, endpoint, extra, f"{label}-plain-{i}", out))
                runs[-1]["profile"] = profile
                runs.append(
                    _run(
                        ckpt,
                        args.tp,
                        endpoint,
                        [*extra, *flags],
                        f"{label}-{flags[0][2:]}-{i}",
                        out,
                    )
                )
                runs[-1]["profile"] = profile
        finally:
            receiver.terminate()
            receiver.wait(timeout=60)
    return {
        "model": label,
        "tp": args.tp,
        "total_bytes": total,
        "tensors": n_tensors,
        "gpu": torch.cuda.get_device_name(0),
        "cpus": len(os.sched_getaffinity(0)),
        "hash_limits": bench_hash(label, specs, args.tp, args.max_gb, _threads(args.tp)),
        "runs": runs,
        "command": f"python bench/bench_verify.py gpu --model {args.model} --tp {args.tp}"
        + (f" --layers {args.layers}" if args.layers else "")
        + f" --runs {args.runs}",
    }


def gpu_markdown(doc: dict[str, Any]) -> str:
    lim = doc["hash_limits"]
    lines = [
        f"# `--verify` beside the update: {doc['model']} ({doc['total_bytes'] / 1e9:.2f} GB, "
        f"{doc['tensors']} tensors), TP{doc['tp']} on {doc['tp']}x {doc['gpu']}",
        "",
        f"    {doc['command']}",
        "",
        f"Hashing limits on this node ({doc['cpus']} CPUs), same run: one thread's SHA-256 "
        f"{lim['one_thread_sha256_gb_s']:.2f} GB/s, {lim['threads']} threads "
        f"{lim['sample_gb_s']:.2f} GB/s on a rank's share (ratio to the ceiling "
        f"{lim['ceiling_ratio']:.2f}), memcpy {lim['memcpy_gb_s']:.1f} GB/s.",
        "",
        "| run | receiver | torchrun wall s | update s | checker s | round trip s | "
        "check s (receiver's part s) | hashing s (after the update s) | verified | bit-exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["runs"]:
        v = r["verification"] or {}
        # The receiver's own work inside the check stage (not its probe, snapshot or reset).
        ops = sum(
            o["seconds"] for o in r["receiver_checker_ops"] if o["op"] in ("sha256", "compare")
        )
        hashing = (
            f"{v['hash_seconds']:.2f} ({v['hash_waited_seconds']:.2f})"
            if "hash_seconds" in v
            else "-"
        )
        lines.append(
            f"| {r['label']} | {r['profile']} | {r['torchrun_wall_s']:.2f} | {_s(r['update_s'])} | "
            f"{_s(r['checker_s'])} | {_s(r['round_trip_s'])} | "
            f"{_s(r['check_weights_s'])} ({ops:.2f}) | {hashing} | {r['verified']} | "
            f"{r['bit_exact']} |"
        )
    lines.append("")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _threads(local_world: int) -> int:
    from ckptctl.weights_checker import hashing_threads

    return hashing_threads(local_world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["hash", "gpu"])
    parser.add_argument("--model", choices=["qwen3-8b", "deepseek-v3"], default="qwen3-8b")
    parser.add_argument("--layers", type=int, help="deepseek-v3: keep the first N layers")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-gb", type=float, default=2.0, help="hash: the most to allocate")
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--logs", help="where each run's stderr goes (default: WORKDIR/logs)")
    parser.add_argument("--extra", default="", help="more flags for ckptctl update")
    args = parser.parse_args()
    from result_files import write_results

    if args.mode == "hash":
        import platform

        rows = [
            bench_hash("qwen3-8b", model_specs("qwen3-8b"), 2, args.max_gb, _threads(2)),
            bench_hash("deepseek-v3", model_specs("deepseek-v3"), 16, args.max_gb, _threads(8)),
        ]
        cpu = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
        write_results(
            args.out, "verify-hash-cpu", {"cpu": cpu, "rows": rows}, hash_markdown(rows, cpu)
        )
        return
    doc = bench_gpu(args)
    write_results(args.out, f"verify-{doc['model']}-tp{args.tp}", doc, gpu_markdown(doc))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
