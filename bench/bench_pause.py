"""What a push into a server that is generating costs, by `--pause` mode (issue 35), on one GPU:
serve pushes of the model's shapes through `ckptctl.client.push` into the GPU stand-in
(tests/support/gpu_receiver.py, which keeps SGLang's model-update lock: every /generate holds
the reader lock for its tokens, the update takes the writer lock unless the server is paused;
tests/support/fake_generation.py) while it serves --generations concurrent generations of
--generation-s seconds each. For each mode: the push's wall (the client's and the job's), its
pause, drain, update and resume stages, and what became of the generations (completed,
aborted = lost, retracted, held); the idle push beside them; optionally SGLang's example script
(the seed; it does not pause) into the same busy server. Every push checked bit for bit.

    python bench/bench_pause.py --model qwen3-8b [--seed-script .seed/update.py]

Goals: with retract or in_place the push takes at most the idle push + 0.1 s and loses no
request; with none the wait for the drain is reported as its own stage. Writes
pause-<model>-tp1.{json,md} to --out (bench/results/ by default), replacing the previous run's,
with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _support.ckpt_factory import MODELS, write_checkpoint
from _support.torchrun_launch import torchrun_cmd
from bench_serve import set_receiver
from bench_update import all_received, report, run_seed, start_receiver
from result_files import RESULTS, write_results

MODES = ("none", "abort", "retract", "in_place")
COUNTS = ("completed", "aborted", "retracted", "held")


class Generations:
    """`count` generations of `seconds` each (None: until `finish`) in flight in the stand-in at
    `endpoint` (its time per token is its own: read from it)."""

    def __init__(self, endpoint: str, count: int, seconds: float | None) -> None:
        self.endpoint = endpoint
        self.before = counts(endpoint)
        delay = float(self.before["token_delay_s"])
        self.tokens = 10**9 if seconds is None else max(int(seconds / delay), 1)
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(count)]
        self.reasons: list[str] = []

    def _one(self) -> None:
        body = {"text": "x", "sampling_params": {"max_new_tokens": self.tokens}}
        answer = httpx.post(f"{self.endpoint}/generate", json=body, timeout=600).json()
        self.reasons.append(answer["meta_info"]["finish_reason"]["type"])

    def start(self) -> None:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while counts(self.endpoint)["running"] < len(self.threads):
            if time.monotonic() > deadline:
                raise SystemExit("the generations did not all start within 60 s")
            time.sleep(0.01)

    def finish(self, after_s: float) -> None:
        """Every one ends `after_s` seconds from now."""
        r = httpx.post(f"{self.endpoint}/stand-in/finish", json={"after_s": after_s}, timeout=30)
        r.raise_for_status()

    def end(self) -> dict[str, int]:
        """Once every one has ended: what became of them (the stand-in's counts, this run's)."""
        for t in self.threads:
            t.join(timeout=600)
        after = counts(self.endpoint)
        return {k: after[k] - self.before[k] for k in COUNTS}


def counts(endpoint: str) -> dict[str, Any]:
    return httpx.get(f"{endpoint}/stand-in/generations", timeout=30).json()


def stages_of(answer: dict[str, Any]) -> dict[str, float]:
    """Rank 0's stages of a push (the leader's: it pauses, drains and resumes)."""
    stages = answer["ranks"][0].get("figures", {}).get("stages", {})
    return {name: st["wall_s"] for name, st in stages.items()}


def serve_job(endpoint: str, work: Path) -> tuple[subprocess.Popen[str], str, Path]:
    sock = str(work / f"pause-{os.getpid()}.sock")
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", "serve", "--control-socket", sock,
        "--inference-parallel-size", "1", "--endpoint", endpoint, "--push-timeout", "600",
        nproc=1,
    )  # fmt: skip
    log = work / "serve-pause.log"
    with log.open("w") as fh:
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, text=True)
    t0 = time.perf_counter()
    while not os.path.exists(sock):
        if job.poll() is not None or time.perf_counter() - t0 > 180:
            raise SystemExit(f"serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return job, sock, log


def one_push(
    ckpt: Path, sock: str, endpoint: str, n_tensors: int, version: str, **kw: Any
) -> dict[str, Any]:
    from ckptctl import client

    set_receiver(endpoint, verify_against=str(ckpt), scrub=False)
    t0 = time.perf_counter()
    answer = client.push(ckpt, weight_version=version, control_socket=sock, check=False, **kw)
    wall = time.perf_counter() - t0
    if not answer["ok"]:
        raise SystemExit(f"push {version} failed: {answer['error']}")
    rep = report(endpoint)
    return {
        "client_wall_s": round(wall, 4),
        "job_wall_s": answer["wall_s"],
        "stages": stages_of(answer),
        "bit_exact": all_received(rep, n_tensors) and rep["weight_version"] == version,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-8b")
    parser.add_argument("--generations", type=int, default=32)
    parser.add_argument("--generation-s", type=float, default=10.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed-script", help="SGLang's examples/checkpoint_engine/update.py")
    parser.add_argument("--workdir", default="/tmp/ckptctl-bench")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = parser.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpts = [work / args.model, work / f"{args.model}-serve-1"]
    for ckpt, seed in zip(ckpts, [20261129, 1001], strict=True):
        if not (ckpt / "model.safetensors.index.json").exists():
            write_checkpoint(ckpt, args.model, seed=seed)
    index = json.loads((ckpts[0] / "model.safetensors.index.json").read_text())
    total, n_tensors = index["metadata"]["total_size"], len(index["weight_map"])
    modes = args.modes.split(",")
    rows: list[dict[str, Any]] = []
    seed = None
    doc: dict[str, Any] = {}

    def save(final: bool = False) -> None:
        doc.update(
            model=args.model,
            tp=1,
            total_bytes=total,
            tensors=n_tensors,
            generations=args.generations,
            generation_s=args.generation_s,
            runs=rows,
            seed_script=seed,
            goals=goals(rows),
            bench_command=f"python bench/bench_pause.py --model {args.model}"
            + (" --seed-script SEED" if args.seed_script else ""),
        )
        write_results(args.out, f"pause-{args.model}-tp1", doc, markdown(doc) if final else None)

    receiver, endpoint = start_receiver(ckpts[0], 1)
    job = None
    try:
        job, sock, _ = serve_job(endpoint, work)
        one_push(ckpts[0], sock, endpoint, n_tensors, "warm-up")  # (the pool, pinned once)
        for i, mode in enumerate(["idle", *modes]):
            ckpt = ckpts[i % 2]
            busy = None
            if mode != "idle":  # (started now: the push begins with them all in flight)
                busy = Generations(endpoint, args.generations, args.generation_s)
                busy.start()
            pause = None if mode == "idle" else mode
            pushed = one_push(ckpt, sock, endpoint, n_tensors, f"v-{mode}", pause=pause)
            row = {"mode": mode, **pushed}
            if busy is not None:
                row["generations"] = busy.end()
                row["finish_reasons"] = sorted(set(busy.reasons))
            rows.append(row)
            print(f"{mode}: {row}", flush=True)
            save()
        from ckptctl import client

        client.stop(control_socket=sock, timeout=120)
        job.wait(timeout=120)
        if args.seed_script:
            seed = busy_seed(args, endpoint, ckpts[0], n_tensors)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        receiver.terminate()
        receiver.wait(timeout=60)
        if not args.keep:
            for ckpt in ckpts:
                shutil.rmtree(ckpt, ignore_errors=True)
    save(final=True)


def busy_seed(args: Any, endpoint: str, ckpt: Path, n_tensors: int) -> dict[str, Any]:
    """The seed script into the same server while it serves the generations: it does not pause.
    Its process starts for longer than a generation lasts, so the generations run until its
    update waits for them (the stand-in says so), and end --generation-s later: the drain it
    waits, at most."""
    busy = Generations(endpoint, args.generations, None)
    set_receiver(endpoint, verify_against=str(ckpt), scrub=False)
    busy.start()
    seed: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: seed.update(run_seed(ckpt, 1, endpoint, args.seed_script)), daemon=True
    )
    runner.start()
    while runner.is_alive() and not counts(endpoint)["update_waiting"]:
        time.sleep(0.01)
    busy.finish(args.generation_s)
    runner.join(timeout=900)
    seed["generations"] = busy.end()
    seed["bit_exact"] = all_received(report(endpoint), n_tensors)
    print(f"seed script: {seed}", flush=True)
    return seed


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, checked: retract and in_place within the idle push + 0.1 s and no
    request lost; none's drain reported as a stage of its own."""
    by = {r["mode"]: r for r in rows}
    idle = by.get("idle", {}).get("job_wall_s")
    out: dict[str, Any] = {}
    for mode in ("retract", "in_place"):
        row = by.get(mode)
        if row is None or idle is None:
            continue
        out[mode] = {
            "within_idle_plus_0.1_s": row["job_wall_s"] <= idle + 0.1,
            "none_lost": row["generations"]["aborted"] == 0,
        }
    if "none" in by:
        out["none"] = {"drain_reported": "drain" in by["none"]["stages"]}
    return out


def markdown(doc: dict[str, Any]) -> str:
    gb = doc["total_bytes"] / 1e9
    lines = [
        f"# Pushes into a serving server by --pause mode, {doc['model']} shapes ({gb:.2f} GB, "
        f"{doc['tensors']} tensors), TP1",
        "",
        f"    {doc['bench_command']}",
        "",
        f"The GPU stand-in with SGLang 0.5.23's lock semantics serves {doc['generations']} "
        f"generations of {doc['generation_s']:g} s each, started right before each push (the "
        "idle push: none). Push: `ckptctl.client.push` into one `serve` job; stages are rank "
        "0's; every push checked bit for bit by the stand-in.",
        "",
        "| --pause | push (client) s | push (job) s | pause s | drain s | update s | resume s "
        "| completed | aborted (lost) | retracted | held | bit-exact |",
        "| --- " * 12 + "|",
    ]
    for r in doc["runs"]:
        st, g = r["stages"], r.get("generations") or {}

        def s(name: str, stages: dict[str, float] = st) -> str:
            return f"{stages[name]:.3f}" if name in stages else "-"

        lines.append(
            f"| {r['mode']} | {r['client_wall_s']:.3f} | {r['job_wall_s']:.3f} | {s('pause')} "
            f"| {s('drain')} | {s('update')} | {s('resume')} | {g.get('completed', '-')} "
            f"| {g.get('aborted', '-')} | {g.get('retracted', '-')} | {g.get('held', '-')} "
            f"| {r['bit_exact']} |"
        )
    seed = doc.get("seed_script")
    if seed:
        g = seed["generations"]
        lines += [
            "",
            f"SGLang's example script into the same busy server (no pause; the generations "
            f"end {doc['generation_s']:g} s after its update starts waiting): torchrun wall "
            f"{seed['torchrun_wall_s']:.2f} s, its update {seed['update_s']} s (the drain "
            f"included), generations completed {g['completed']}, aborted {g['aborted']}; "
            f"bit-exact {seed['bit_exact']}.",
        ]
    lines += ["", f"Goals: {json.dumps(doc['goals'])}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
