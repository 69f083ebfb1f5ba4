"""Benchmark `torchrun ... ckptctl update` on a GPU node against the machine's own limits.

    python bench/bench_update.py --model qwen3-8b --tp 2 --out bench/results   # 16.4 GB, 2 GPUs
    python bench/bench_update.py --model qwen3-4b --tp 1 --out bench/results   # quick, 1 GPU

It writes a synthetic bf16 checkpoint with the model's real tensor names and shapes (HF layout:
4 GiB shards + index.json, random bytes), starts the test receiver (tests/gpu_receiver.py: one
process per GPU loading through checkpoint_engine.worker.update_weights_from_ipc and checking
every tensor bit for bit), runs the real CLI under torchrun, and measures in the same run:
pinned and pageable host->device copies, cold and warm reads of the shards, and the bare
`torchrun` + `import torch` + NCCL process-group time. Results: JSON + Markdown in --out.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fake_server import free_port, torchrun_cmd  # noqa: E402

GiB = 1 << 30


# -- the checkpoint ----------------------------------------------------------------------------


def write_checkpoint(
    root: Path, model: str, seed: int = 20261129, specs: list[Any] | None = None
) -> tuple[int, int]:
    """Write shards of random bytes (made on the GPU, fast) with real headers; (bytes, tensors).
    `specs` (model_shapes' (name, dtype, shape)) stand in for `model`'s when given."""
    import torch
    from ckpt_factory import header_bytes, nbytes, shard, shard_names, write_index
    from model_shapes import qwen3_4b, qwen3_8b

    if specs is None:
        specs = list({"qwen3-4b": qwen3_4b, "qwen3-8b": qwen3_8b}[model]())
    root.mkdir(parents=True, exist_ok=True)
    shards = shard(specs, 4 * GiB)
    names = shard_names(len(shards))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor_name, dtype, shape in group:
            size = nbytes(dtype, shape)
            header[tensor_name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tensor_name] = name
        with open(root / name, "wb") as fh:
            fh.write(header_bytes(header))
            left = offset
            while left:
                n = min(left, 512 << 20)
                chunk = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
                fh.write(chunk.cpu().numpy().tobytes())
                left -= n
        total += offset
    write_index(root, weight_map, total)
    return total, len(specs)


# -- the limits ----------------------------------------------------------------------------------


def h2d_bandwidth(pinned: bool, nbytes: int = 4 * GiB, repeat: int = 3) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def read_bandwidth(files: list[Path], cold: bool) -> float | None:
    """One reader (`cat`), like the baseline; cold drops the page cache first (root only)."""
    if cold:
        try:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            return None
    total = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return total / (time.perf_counter() - t0) / 1e9


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
            str(REPO / "tests" / "gpu_receiver.py"),
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
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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
    import re

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


def write_results(out_dir: str, stem: str, doc: dict[str, Any], md: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["qwen3-4b", "qwen3-8b"], default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--extra", default="", help="more flags for ckptctl update")
    parser.add_argument(
        "--seed-script",
        help="path to SGLang's examples/checkpoint_engine/update.py: run it first, the same "
        "way, for a side-by-side figure (not shipped here: bring your own copy)",
    )
    parser.add_argument(
        "--register-modes",
        default="engine",
        help="comma-separated --register-mode values to run side by side (engine,direct)",
    )
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
        "cold_read_gb_s": read_bandwidth(shards, cold=True),
        "warm_read_gb_s": read_bandwidth(shards, cold=False),
        "bare_torchrun_import_torch_nccl_s": bare_torchrun_seconds(args.tp),
    }
    # The seed polls /ping until it answers 200, which SGLang 0.5.23 does only after the first
    # weights: it runs against 0.5.22's behaviour (200 at once), as it was written for.
    profile = "sglang-0.5.22" if args.seed_script else "sglang-0.5.23"
    receiver, endpoint = start_receiver(ckpt, args.tp, profile)
    runs = []
    seed: dict[str, Any] | None = None
    try:
        if args.seed_script:
            if limits["cold_read_gb_s"] is not None:
                read_bandwidth(shards, cold=True)  # from a cold cache, as our first runs
            seed = run_seed(ckpt, args.tp, endpoint, args.seed_script)
            seed["bit_exact"] = all_received(report(endpoint), n_tensors)
        for mode in args.register_modes.split(","):
            for i in range(args.runs):
                if i == 0 and limits["cold_read_gb_s"] is not None:
                    read_bandwidth(shards, cold=True)  # the first run starts from a cold cache
                extra = [*args.extra.split(), "--register-mode", mode]
                log = Path(args.out) / f"update-{args.model}-tp{args.tp}-{mode}-run{i + 1}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                run = run_update(ckpt, args.tp, endpoint, extra, log)
                run["register_mode"] = mode
                run["cache"] = "cold" if i == 0 and limits["cold_read_gb_s"] is not None else "warm"
                run["bit_exact"] = all_received(report(endpoint), n_tensors)
                runs.append(run)
    finally:
        receiver.terminate()
        receiver.wait(timeout=60)

    doc = {
        "model": args.model,
        "tp": args.tp,
        "total_bytes": total,
        "tensors": n_tensors,
        "checkpoint_write_s": write_s,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "limits": limits,
        "runs": runs,
        "seed_script": seed,
        "command": f"python bench/bench_update.py --model {args.model} --tp {args.tp} --runs {args.runs}"
        f" --register-modes {args.register_modes}"
        + (" --seed-script SEED" if args.seed_script else "")
        + (f" --extra '{args.extra}'" if args.extra else ""),
    }
    write_results(args.out, f"update-{args.model}-tp{args.tp}", doc, markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    lim = doc["limits"]
    gb = doc["total_bytes"] / 1e9
    lines = [
        f"# `ckptctl update`, {doc['model']} shapes ({gb:.2f} GB, {doc['tensors']} tensors), "
        f"TP{doc['tp']} on {doc['tp']}x {doc['gpu']}",
        "",
        f"    {doc['command']}",
        "",
        "Limits measured in the same run: pinned H2D "
        f"{lim['pinned_h2d_gb_s']:.1f} GB/s, pageable H2D {lim['pageable_h2d_gb_s']:.1f} GB/s, "
        f"read (one `cat`) cold {_f(lim['cold_read_gb_s'])} / warm {_f(lim['warm_read_gb_s'])} GB/s, "
        f"bare torchrun + import torch + NCCL group {lim['bare_torchrun_import_torch_nccl_s']:.2f} s.",
        "",
        "| run | register mode | cache | torchrun wall s | start s | register s (GB/s, all ranks) | gather s | "
        "update s (GB/s per GPU) | peak RSS per rank GB | bit-exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, run in enumerate(doc["runs"]):
        ranks = run["summary"]["ranks"]

        def stage(name: str, key: str = "seconds", ranks: list[dict[str, Any]] = ranks) -> float:
            return max(r["stages"].get(name, {}).get(key) or 0.0 for r in ranks)

        reg_s = stage("register")
        # direct: the read and the pinning run in the background, from before the PS start;
        # the stage itself only waits for what is left of them. Rate over read + pin.
        background = [
            sum(map(float, found))
            for r in ranks
            if (
                found := re.findall(
                    r"(?:read|pin) ([0-9.]+)s", r["stages"]["register"].get("detail", "")
                )
            )
        ]
        loaded_s = max(background) if background else reg_s
        reg_rate = doc["total_bytes"] / loaded_s / 1e9 if loaded_s else 0.0
        reg_text = (
            f"{reg_s:.2f} (read + pin {loaded_s:.2f} s before it, {reg_rate:.1f})"
            if background
            else f"{reg_s:.2f} ({reg_rate:.1f})"
        )
        upd_s = stage("update")
        lines.append(
            f"| {i + 1} | {run.get('register_mode', 'engine')} | {run['cache']} | {run['torchrun_wall_s']:.2f} | {stage('start'):.2f} | "
            f"{reg_text} | {stage('gather_metas'):.2f} | "
            f"{upd_s:.2f} ({doc['total_bytes'] / upd_s / 1e9 if upd_s else 0:.1f}) | "
            f"{max(r['peak_rss_bytes'] for r in ranks) / 1e9:.1f} | {run['bit_exact']} |"
        )
    seed = doc.get("seed_script")
    if seed:
        rss = seed["max_rss_bytes"]
        lines.append(
            f"| seed | the seed script | cold | {seed['torchrun_wall_s']:.2f} | - | - | "
            f"{_s(seed['gather_s'])} | {_s(seed['update_s'])} | "
            f"{'-' if rss is None else f'{rss / 1e9:.1f}'} | {seed['bit_exact']} |"
        )
    best = min(doc["runs"], key=lambda r: r["torchrun_wall_s"])
    lines += [
        "",
        f"Ratios (best run): wall / bare floor = "
        f"{best['torchrun_wall_s'] / lim['bare_torchrun_import_torch_nccl_s']:.2f}; "
        f"update rate / pinned H2D = "
        f"{doc['total_bytes'] / max(max(r['stages']['update']['seconds'] for r in best['summary']['ranks']), 1e-9) / 1e9 / lim['pinned_h2d_gb_s']:.2f}.",
        "",
    ]
    if seed:
        best_update = min(
            max(r["stages"]["update"]["seconds"] for r in run["summary"]["ranks"])
            for run in doc["runs"]
        )
        lines[-1:] = [
            f"Best run / the seed script, same run: wall "
            f"{best['torchrun_wall_s'] / seed['torchrun_wall_s']:.2f}x"
            + (
                f"; update stage {best_update / seed['update_s']:.2f}x (best {best_update:.2f} s)"
                if seed.get("update_s")
                else ""
            )
            + ".",
            "",
        ]
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
