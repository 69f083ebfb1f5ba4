"""Where a serve push's time goes on one GPU, and what the transfer's bucket size does to it:
serve pushes through `ckptctl.client.push` (every push traced and checked bit for bit), one
serve job per bucket size, each push's time split from its timeline (`push --trace`); the
machine's host-to-device and page-cache read limits measured in the same run; optionally
SGLang's example script (the seed) once against the same receiver and checkpoint.

    python bench/bench_push.py --model qwen3-8b --bucket-sizes 8,2,1 --pushes 6 \
        [--seed-script .seed/update.py] [--workdir /dev/shm/ckptctl-bench]

Writes push-<model>-tp1.{json,md} to --out (bench/results/ by default), replacing the previous
run's, with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _support.ckpt_factory import MODELS, write_checkpoint
from _support.limits import h2d_bandwidth, limit_read
from _support.torchrun_launch import torchrun_cmd
from bench_serve import set_receiver
from bench_update import (
    all_received,
    report,
    run_seed,
    start_receiver,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]
# The tracks of a trace (ckptctl.observe.timeline).
STAGES, BUCKETS, COPIES, WORKER, REQUEST, BUFFERS = 1, 3, 4, 5, 6, 7


def breakdown(trace: dict[str, Any], rank: int = 0) -> dict[str, float]:
    """One push's time on `rank`, from its trace, in seconds: the stages; inside the update the
    IPC buffers' set-up (until the worker connects), the data (to the last bucket loaded), the
    worker's release, the ParameterServer's, the post-hook and what follows; the read."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]

    def on(track: int) -> list[dict[str, Any]]:
        return [e for e in spans if e["tid"] == track]

    def end(e: dict[str, Any]) -> float:
        return float(e["ts"] + e["dur"])

    out: dict[str, float] = {}
    stages = {e["name"]: e for e in on(STAGES)}
    for name, e in stages.items():
        out[f"stage_{name}_s"] = e["dur"] / 1e6
    first = min(e["ts"] for e in on(STAGES))
    out["push_s"] = (max(end(e) for e in on(STAGES)) - first) / 1e6
    update = stages.get("update")
    worker = {e["name"]: e for e in on(WORKER)}
    buckets, copies = on(BUCKETS), on(COPIES)
    if update is None or len(worker) < 4 or not buckets:
        return out
    connect = worker["worker connects, takes the IPC handle"]
    post_hook = worker["worker runs its post-hook"]
    last_loaded = max(end(e) for e in buckets)
    out["update_until_socket_s"] = (connect["ts"] - update["ts"]) / 1e6
    out["worker_connects_s"] = connect["dur"] / 1e6
    out["data_s"] = (last_loaded - end(connect)) / 1e6
    out["worker_release_s"] = worker["worker releases the IPC buffer"]["dur"] / 1e6
    out["ps_release_s"] = worker["ParameterServer frees its transfer buffers"]["dur"] / 1e6
    out["post_hook_s"] = post_hook["dur"] / 1e6
    out["after_post_hook_s"] = (end(update) - end(post_hook)) / 1e6
    out["buckets"] = len(buckets)
    if copies:
        out["copies_s"] = sum(e["dur"] for e in copies) / 1e6
        out["copies_waited_for_read_s"] = sum(e["args"].get("waited_s", 0.0) for e in copies)
        out["first_copy_after_update_start_s"] = (copies[0]["ts"] - update["ts"]) / 1e6
    filled = on(BUFFERS)
    if filled:
        out["read_s"] = (max(end(e) for e in filled) - min(e["ts"] for e in filled)) / 1e6
        out["read_done_before_update_end_s"] = (end(update) - max(end(e) for e in filled)) / 1e6
    return out


def serve_pushes(
    ckpts: list[Path],
    endpoint: str,
    bucket_gb: float,
    pushes: int,
    work: Path,
    n_tensors: int,
    staged: bool = False,
) -> dict[str, Any]:
    """One serve job with --bucket-size-gb `bucket_gb`: a first push (the pool's), then
    `pushes` pushes through ckptctl.client, alternating checkpoints, each traced; with
    `staged`, each of those read ahead first (client.stage, until its read is done)."""
    from ckptctl import client

    sock = str(work / f"push-{os.getpid()}-{bucket_gb}.sock")
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", "serve", "--control-socket", sock,
        "--inference-parallel-size", "1", "--endpoint", endpoint,
        "--push-timeout", "300", "--bucket-size-gb", str(bucket_gb), nproc=1,
    )  # fmt: skip
    log = work / f"serve-bucket-{bucket_gb}.log"
    with log.open("w") as fh:
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, text=True)
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        while not os.path.exists(sock):
            if job.poll() is not None or time.perf_counter() - t0 > 120:
                raise SystemExit(f"serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        for i in range(pushes + 1):
            ckpt = ckpts[i % 2]
            trace = work / f"push-{bucket_gb}-{i}.json"
            # No scrub between pushes (the receiver's refill of every tensor, 90k kernels for
            # the DeepSeek-V3 layout, is no server's work): the pushes alternate checkpoints
            # of other bytes, so a tensor one missed still shows as a mismatch.
            set_receiver(endpoint, verify_against=str(ckpt), scrub=False)
            if staged and i > 0:
                client.stage(ckpt, control_socket=sock)
                deadline = time.monotonic() + 120
                while not (client.status(control_socket=sock)["staged"] or {}).get("read"):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the stage of push {i} was not read in 120 s")
                    time.sleep(0.05)
            t0 = time.perf_counter()
            answer = client.push(
                ckpt, weight_version=f"v{i}", control_socket=sock, check=False, trace=str(trace)
            )
            wall = time.perf_counter() - t0
            if not answer["ok"]:
                raise SystemExit(f"push {i} failed: {answer['error']}\n{log.read_text()[-3000:]}")
            rep = report(endpoint)
            rows.append(
                {
                    "push": i,
                    "first": i == 0,
                    "staged": any(r.get("staged") for r in answer["ranks"]),
                    "client_wall_s": round(wall, 4),
                    "bit_exact": all_received(rep, n_tensors) and rep["weight_version"] == f"v{i}",
                    **{k: round(v, 4) for k, v in breakdown(json.loads(trace.read_text())).items()},
                }
            )
            print(f"bucket {bucket_gb} GiB push {i}: {wall:.3f}s {rows[-1]}", flush=True)
        client.stop(control_socket=sock)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    later = [r for r in rows if not r["first"]]
    keys = sorted({k for r in later for k in r if k.endswith("_s") or k == "buckets"})
    return {
        "bucket_size_gib": bucket_gb,
        "staged": staged,
        "pushes": rows,
        "median": {k: statistics.median(r[k] for r in later if k in r) for k in keys},
        "all_bit_exact": all(r["bit_exact"] for r in rows),
        "serve_exit_code": job.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-8b")
    parser.add_argument("--bucket-sizes", default="8,2,1", help="GiB, comma-separated")
    parser.add_argument("--pushes", type=int, default=6, help="after the first, per bucket size")
    parser.add_argument("--seed-script", help="SGLang's examples/checkpoint_engine/update.py")
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument(
        "--stage",
        action="store_true",
        help="also each bucket size with every push read ahead first (ckptctl stage)",
    )
    args = parser.parse_args()

    work = Path(args.workdir)
    ckpts = [work / args.model, work / f"{args.model}-serve-1"]
    t0 = time.perf_counter()
    for ckpt, seed in zip(ckpts, [20261129, 1001], strict=True):
        if not (ckpt / "model.safetensors.index.json").exists():
            write_checkpoint(ckpt, args.model, seed=seed)
    write_s = time.perf_counter() - t0
    index = json.loads((ckpts[0] / "model.safetensors.index.json").read_text())
    total, n_tensors = index["metadata"]["total_size"], len(index["weight_map"])
    files = sorted(ckpts[0].glob("*.safetensors"))
    for _ in range(2):  # every page in the cache
        limit_read(files, 16, fresh=False)
    limits = {
        "h2d_pinned_gb_s": round(h2d_bandwidth(True), 2),
        "warm_read_gb_s_16_threads": round(limit_read(files, 16, fresh=False), 2),
    }
    limits["h2d_s"] = round(total / 1e9 / limits["h2d_pinned_gb_s"], 3)
    limits["read_s"] = round(total / 1e9 / limits["warm_read_gb_s_16_threads"], 3)
    print(f"limits: {limits}", flush=True)
    runs: list[dict[str, Any]] = []
    seed = None

    def save() -> None:  # after each part: a run cut short keeps what it measured
        write_results(args.out, f"push-{args.model}-tp1", document(), None)

    def document() -> dict[str, Any]:
        return {
            "model": args.model,
            "tp": 1,
            "total_bytes": total,
            "tensors": n_tensors,
            "workdir": str(work),
            "checkpoint_write_s": round(write_s, 1),
            "limits": limits,
            "seed_script": seed,
            "runs": runs,
            "bench_command": f"python bench/bench_push.py --model {args.model} "
            f"--bucket-sizes {args.bucket_sizes} --pushes {args.pushes}"
            + (" --seed-script SEED" if args.seed_script else "")
            + (" --stage" if args.stage else "")
            + f" --workdir {args.workdir}",
        }

    if args.seed_script:
        # A receiver of its own: the seed waits for /ping, which SGLang 0.5.22 answers.
        receiver, endpoint = start_receiver(ckpts[0], 1, "sglang-0.5.22")
        try:
            set_receiver(endpoint, verify_against=str(ckpts[0]))
            seed = run_seed(ckpts[0], 1, endpoint, args.seed_script)
            seed["bit_exact"] = all_received(report(endpoint), n_tensors)
        finally:
            receiver.terminate()
            receiver.wait(timeout=60)
        print(f"seed script: {seed}", flush=True)
        save()
    receiver, endpoint = start_receiver(ckpts[0], 1)
    try:
        for gb in [float(x) for x in args.bucket_sizes.split(",")]:
            for staged in (False, True) if args.stage else (False,):
                runs.append(serve_pushes(ckpts, endpoint, gb, args.pushes, work, n_tensors, staged))
                save()
    finally:
        receiver.terminate()
        receiver.wait(timeout=60)
        if not args.keep:
            for ckpt in ckpts:
                shutil.rmtree(ckpt, ignore_errors=True)
    doc = document()
    write_results(args.out, f"push-{args.model}-tp1", doc, markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    lim = doc["limits"]
    gb = doc["total_bytes"] / 1e9
    bound = max(lim["h2d_s"], lim["read_s"])
    lines = [
        f"# Serve pushes by bucket size, {doc['model']} shapes ({gb:.2f} GB, "
        f"{doc['tensors']} tensors), TP1",
        "",
        f"    {doc['bench_command']}",
        "",
        f"Limits in this run: host-to-device (pinned) {lim['h2d_pinned_gb_s']} GB/s = "
        f"{lim['h2d_s']} s for the checkpoint; the page cache read with 16 threads "
        f"{lim['warm_read_gb_s_16_threads']} GB/s = {lim['read_s']} s; max(read, copy) "
        f"{bound:.3f} s. Checkpoints in {doc['workdir']}.",
    ]
    seed = doc.get("seed_script")
    if seed:
        lines += [
            "",
            f"The seed script (one-shot update of the same checkpoint into the same receiver): "
            f"torchrun wall {seed['torchrun_wall_s']:.2f} s, its update {seed['update_s']} s, "
            f"bit-exact {seed['bit_exact']}.",
        ]
    cols = [
        ("client_wall_s", "push (client) s"),
        ("stage_update_s", "update stage s"),
        ("update_until_socket_s", "IPC buffers set up s"),
        ("worker_connects_s", "worker connects s"),
        ("data_s", "data s"),
        ("copies_waited_for_read_s", "copies waited for read s"),
        ("worker_release_s", "worker release s"),
        ("ps_release_s", "PS release s"),
        ("post_hook_s", "post-hook s"),
        ("after_post_hook_s", "after s"),
        ("read_s", "read s"),
        ("buckets", "buckets"),
    ]
    lines += [
        "",
        "Medians of the pushes after each job's first (every push traced, every one checked "
        "bit for bit by the receiver):",
        "",
        "| bucket GiB | " + " | ".join(title for _, title in cols) + " | push / max(read, copy) "
        "| bit-exact |",
        "| --- " * (len(cols) + 3) + "|",
    ]
    for run in doc["runs"]:
        med = run["median"]
        cells = [f"{med[k]:.3f}" if k in med and k != "buckets" else str(med.get(k, "-"))
                 for k, _ in cols]  # fmt: skip
        ratio = med["client_wall_s"] / bound if bound else 0
        bucket = f"{run['bucket_size_gib']:g}" + (", staged" if run.get("staged") else "")
        lines.append(
            f"| {bucket} | " + " | ".join(cells) + f" | {ratio:.2f}x | {run['all_bit_exact']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
