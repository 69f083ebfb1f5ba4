"""Benchmark `ckptctl serve` + `ckptctl push` on a GPU node: pushes of alternating checkpoints
into one test receiver, each checked bit for bit, a refused push (HTTP 400) in between, and
the memory on both sides after every push (no leak: pinned host memory and GPU memory flat).

    python bench/bench_serve.py --model qwen3-8b --tp 2 --pushes 10 --register-mode direct

Writes serve-<model>-tp<N>-<mode>.{json,md} to --out (bench/results/ by default, replacing the
previous run's), with the commit, date and machine; <mode> is the register mode, or `consume`
when the run also pushed from /dev/shm (--consume-pushes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _support.ckpt_factory import MODELS, write_checkpoint
from _support.torchrun_launch import torchrun_cmd
from bench_update import (
    all_received,
    report,
    start_receiver,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]


def ckptctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ckptctl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def gpu_memory_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def rss_bytes(pids: list[int]) -> list[int]:
    """VmRSS of each serve rank (pinned buffers count in it once touched)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue  # not a rank after all (gone)
        out.append(kb * 1024)
    return out


def serve_ranks(torchrun_pid: int) -> list[int]:
    """The ckptctl serve processes under torchrun (its grandchildren via the agent)."""
    found = subprocess.run(
        ["pgrep", "-f", "ckptctl serve"], capture_output=True, text=True, check=False
    ).stdout.split()
    return sorted(int(p) for p in found if int(p) != torchrun_pid)


def set_receiver(endpoint: str, **config: Any) -> None:
    import httpx

    httpx.post(f"{endpoint}/receiver/config", json=config, timeout=30).raise_for_status()


def traced_medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """push --trace's cost: the median push through the client with and without it."""
    out: dict[str, float | None] = {}
    for key, traced in (("median_api_push_traced_s", True), ("median_api_push_untraced_s", False)):
        seconds = [r["client_wall_s"] for r in rows if r.get("traced") is traced]
        out[key] = statistics.median(seconds) if seconds else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=10)
    parser.add_argument(
        "--api-pushes",
        type=int,
        default=10,
        help="then this many through ckptctl.client.push, in this process (no CLI start-up)",
    )
    parser.add_argument("--register-mode", default="direct", choices=["engine", "direct"])
    parser.add_argument(
        "--consume-pushes",
        type=int,
        default=2,
        help="then this many pushes from /dev/shm with --consume-shm-files",
    )
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--logs", help="where the job's stderr goes (default: WORKDIR/logs)")
    parser.add_argument("--extra", default="", help="more flags for ckptctl serve")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="every other push through the client writes its timeline here (push --trace): "
        "the medians with and without it, and the last one's file",
    )
    args = parser.parse_args()

    # The first is bench_update.py's (same seed), reused when that already wrote it.
    ckpts = [Path(args.workdir) / args.model, Path(args.workdir) / f"{args.model}-serve-1"]
    for ckpt, seed in zip(ckpts, [20261129, 1001], strict=True):
        if not (ckpt / "model.safetensors.index.json").exists():
            write_checkpoint(ckpt, args.model, seed=seed)
    index = json.loads((ckpts[0] / "model.safetensors.index.json").read_text())
    total, n_tensors = index["metadata"]["total_size"], len(index["weight_map"])
    sock = f"/tmp/ckptctl-bench-serve-{os.getpid()}.sock"
    shm_dir = Path("/dev/shm") / f"ckptctl-bench-{os.getpid()}"
    receiver, endpoint = start_receiver(ckpts[0], args.tp)
    gpu_before = gpu_memory_used_mib()
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", "serve", "--control-socket", sock,
        "--inference-parallel-size", str(args.tp), "--endpoint", endpoint,
        "--register-mode", args.register_mode, "--push-timeout", "300", *args.extra.split(),
        nproc=args.tp,
    )  # fmt: skip
    t_start = time.perf_counter()
    logs = Path(args.logs or Path(args.workdir) / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    job_log = logs / f"serve-{args.model}-tp{args.tp}-job.log"  # the ranks' stderr
    with job_log.open("w") as log:
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    pushes: list[dict[str, Any]] = []
    refused: dict[str, Any] | None = None
    try:
        while not os.path.exists(sock):
            if job.poll() is not None or time.perf_counter() - t_start > 120:
                raise SystemExit(f"serve did not start:\n{job_log.read_text()[-3000:]}")
            time.sleep(0.1)
        startup_s = time.perf_counter() - t_start
        ranks = serve_ranks(job.pid)
        from ckptctl import client

        for i in range(args.pushes + args.api_pushes + args.consume_pushes):
            ckpt = ckpts[i % 2]
            consume = i >= args.pushes + args.api_pushes
            via = "python" if args.pushes <= i < args.pushes + args.api_pushes else "cli"
            extra, copy_s = [], None
            traced = bool(args.trace) and via == "python" and (i - args.pushes) % 2 == 1
            if consume:
                # A trainer that writes its checkpoint into /dev/shm and hands it over: the
                # copy stands in for its write (timed apart), the push pins the files in place
                # and deletes them, as --consume-shm-files says.
                t0 = time.perf_counter()
                shutil.copytree(ckpt, shm_dir)
                copy_s = time.perf_counter() - t0
                extra = ["--consume-shm-files"]
            set_receiver(endpoint, verify_against=str(ckpt))
            t0 = time.perf_counter()
            if via == "python":
                answer = client.push(
                    ckpt,
                    weight_version=f"v{i}",
                    control_socket=sock,
                    check=False,
                    trace=args.trace if traced else None,
                )
                seconds = time.perf_counter() - t0
                r = subprocess.CompletedProcess(
                    [], 0 if answer["ok"] else answer["exit_code"], json.dumps(answer), ""
                )
            else:
                r = ckptctl("push", "--control-socket", sock, "--checkpoint-path",
                            str(shm_dir if consume else ckpt), "--weight-version", f"v{i}",
                            "--json", *extra)  # fmt: skip
                seconds = time.perf_counter() - t0
            if r.returncode != 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.wait(timeout=30)  # when the job died, its last words are in the log
                raise SystemExit(
                    f"push {i} failed ({r.returncode}): {r.stderr[-2000:]}\n"
                    f"serve job (exit {job.poll()}), {job_log}:\n{job_log.read_text()[-4000:]}"
                )
            rep = report(endpoint)
            row: dict[str, Any] = {
                "push": i,
                "checkpoint": ckpt.name,
                "path": "/dev/shm, consumed" if consume else "disk (page cache)",
                "via": via,
                "traced": traced,
                "shm_copy_s": None if copy_s is None else round(copy_s, 3),
                "shm_files_left": sorted(os.listdir(shm_dir)) if consume else None,
                "client_wall_s": round(seconds, 3),
                "result": json.loads(r.stdout),
                "bit_exact": all_received(rep, n_tensors) and rep["weight_version"] == f"v{i}",
                "gpu_memory_used_mib": gpu_memory_used_mib(),
                "rank_rss_bytes": rss_bytes(ranks),
            }
            if consume:
                shutil.rmtree(shm_dir, ignore_errors=True)  # what is left of it (the index)
            pushes.append(row)
            print(f"push {i}: {seconds:.2f}s bit-exact={row['bit_exact']}", flush=True)
            if i == 5:  # a refused push, then the job goes on
                set_receiver(endpoint, refuse="IPC weight update failed: busy")
                t0 = time.perf_counter()
                bad = ckptctl("push", "--control-socket", sock, "--checkpoint-path", str(ckpt))
                refused = {
                    "exit_code": bad.returncode,
                    "seconds": round(time.perf_counter() - t0, 3),
                    "error": bad.stderr.strip().splitlines()[-1:],
                }
                set_receiver(endpoint, refuse=None)
                print(f"refused push: {refused}", flush=True)
        status = json.loads(ckptctl("status", "--control-socket", sock, "--json").stdout)
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=30) as client:
            client.post("http://serve/stop")
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
        receiver.terminate()
        receiver.wait(timeout=60)
        if not args.keep:
            for ckpt in ckpts:
                shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(shm_dir, ignore_errors=True)

    def from_disk(via: str) -> list[dict[str, Any]]:
        return [r for r in pushes if r.get("shm_copy_s") is None and r.get("via", "cli") == via]

    disk = [r["client_wall_s"] for r in from_disk("cli")]
    api = [r["client_wall_s"] for r in from_disk("python")]
    in_job = [
        float(r["result"].get("seconds") or 0) for r in from_disk("cli") + from_disk("python")
    ]
    doc = {
        "model": args.model,
        "tp": args.tp,
        "register_mode": args.register_mode,
        "total_bytes": total,
        "tensors": n_tensors,
        "serve_startup_s": round(startup_s, 3),
        "serve_exit_code": job.returncode,
        "gpu_memory_used_mib_before_serve": gpu_before,
        "median_push_s": statistics.median(disk) if disk else None,
        "median_push_after_first_s": statistics.median(disk[1:]) if len(disk) > 1 else None,
        # ckptctl.client.push from the benchmark's own process: no CLI start-up per push
        "median_api_push_s": statistics.median(api) if api else None,
        **traced_medians(from_disk("python")[1:]),
        # the job's own time per push (slowest rank), whichever client asked
        "median_in_job_s": statistics.median(in_job[1:]) if len(in_job) > 1 else None,
        "pushes": pushes,
        "refused_push": refused,
        "status_at_end": status,
        "command": " ".join(cmd[2:]),
        "bench_command": f"python bench/bench_serve.py --model {args.model} --tp {args.tp} "
        f"--pushes {args.pushes} --api-pushes {args.api_pushes} "
        f"--register-mode {args.register_mode} "
        f"--consume-pushes {args.consume_pushes}"
        + (f" --extra '{args.extra}'" if args.extra else "")
        + (f" --trace {args.trace}" if args.trace else ""),
    }
    mode = "consume" if args.consume_pushes else args.register_mode
    write_results(args.out, f"serve-{args.model}-tp{args.tp}-{mode}", doc, markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    gb = doc["total_bytes"] / 1e9
    refused = doc["refused_push"]
    refused_text = (
        f"exit {refused['exit_code']} in {refused['seconds']:.2f} s"
        if refused
        else "none (fewer than 6 pushes)"
    )
    lines = [
        f"# `ckptctl serve` + `push`, {doc['model']} shapes ({gb:.2f} GB), TP{doc['tp']}, "
        f"--register-mode {doc['register_mode']}",
        "",
        f"    {doc['bench_command']}",
        "",
        f"serve start-up (torchrun to control socket): {doc['serve_startup_s']:.2f} s; "
        f"exit code after POST /stop: {doc['serve_exit_code']}; refused push: {refused_text}.",
        "",
        "| push | from, via | client wall s | split s | register s (read + pin, max rank) | gather s | "
        "update s | bit-exact | GPU MiB used (per GPU) | serve rank RSS GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["pushes"]:
        ranks = row["result"].get("ranks") or []

        def stage(name: str, ranks: list[dict[str, Any]] = ranks) -> str:
            vals = [
                r["figures"]["stages"][name]["seconds"]
                for r in ranks
                if name in r.get("figures", {}).get("stages", {})
            ]
            return f"{max(vals):.2f}" if vals else "-"

        reads = [
            re.search(
                r"read ([0-9.]+)s \+ pin ([0-9.]+)s", r["figures"]["stages"]["register"]["detail"]
            )
            for r in ranks
            if "register" in r.get("figures", {}).get("stages", {})
        ]
        read = max((float(m.group(1)) for m in reads if m), default=None)
        pin = max((float(m.group(2)) for m in reads if m), default=None)
        read_text = f" ({read:.2f} + {pin:.2f})" if read is not None and pin is not None else ""
        lines.append(
            f"| {row['push']} | {row.get('path', 'disk')}, {row.get('via', 'cli')} | "
            f"{row['client_wall_s']:.2f} | "
            f"{stage('split')} | {stage('register')}{read_text} | "
            f"{stage('gather_metas')} | {stage('update')} | {row['bit_exact']} | "
            f"{row['gpu_memory_used_mib']} | "
            f"{[round(x / 1e9, 1) for x in row['rank_rss_bytes']]} |"
        )
    if doc.get("median_push_s") is not None:
        lines += [
            "",
            f"**Median of the pushes from disk through `ckptctl push` (a process each): "
            f"{doc['median_push_s']:.2f} s** (after the first, which pins the "
            f"pool: {doc['median_push_after_first_s'] or 0:.2f} s).",
            "",
        ]
    if doc.get("median_api_push_s") is not None:
        lines += [
            f"**Median through `ckptctl.client.push` (from a Python process, as a training "
            f"loop would): {doc['median_api_push_s']:.2f} s**; the job's own time per push "
            f"(slowest rank, median after the first): {doc['median_in_job_s'] or 0:.2f} s.",
            "",
        ]
    if doc.get("median_api_push_traced_s") is not None:
        lines += [
            f"With `push --trace` (every other push through the client, the first aside): "
            f"median {doc['median_api_push_traced_s']:.2f} s, without: "
            f"{doc['median_api_push_untraced_s'] or 0:.2f} s.",
            "",
        ]
    consumed = [r for r in doc["pushes"] if r.get("shm_copy_s") is not None]
    if consumed:
        lines += [
            "From /dev/shm with --consume-shm-files: pushes "
            + ", ".join(f"{r['client_wall_s']:.2f}" for r in consumed)
            + " s (the trainer's write, a copy here, took "
            + ", ".join(f"{r['shm_copy_s']:.2f}" for r in consumed)
            + " s apart from that); left in the folder afterwards: "
            + "; ".join(str(r["shm_files_left"]) for r in consumed)
            + ".",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
