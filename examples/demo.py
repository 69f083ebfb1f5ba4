"""`make demo`: the real thing where it can run, the dry run where it cannot.

On a machine whose torch sees a CUDA GPU (and has checkpoint-engine), this starts the bundled
stand-in inference server (tests/support/gpu_receiver.py: an SGLang-like HTTP server whose worker per
GPU loads the weights through checkpoint-engine's own worker call, as SGLang does, and checks
every tensor bit for bit), runs a real

    torchrun --nproc-per-node N -m ckptctl update --checkpoint-path examples/tiny-checkpoint ...

into it, with the live progress and the closing summary, and reports what the server received.
Anywhere else it says why not, and shows the dry run of the same update instead: the split and
the server groups the real run would use.

    python examples/demo.py            # what `make demo` runs
    python examples/demo.py --gpus 1   # use one GPU even where there are more
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "examples" / "tiny-checkpoint"
RECEIVER = ROOT / "tests" / "support" / "gpu_receiver.py"
READY_TIMEOUT_S = 180.0  # the receiver's workers start CUDA and allocate the parameters
UPDATE_TIMEOUT_S = 120


def say(message: str) -> None:
    print(f"demo: {message}", file=sys.stderr, flush=True)


def why_no_gpu() -> str | None:
    """Why the real update cannot run here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch {torch.__version__} ({build}) sees no CUDA GPU"
    try:
        import checkpoint_engine.worker  # noqa: F401 - the receiver loads through it
    except ImportError as exc:
        return f"checkpoint-engine cannot be imported ({exc})"
    if not RECEIVER.exists():
        return f"the stand-in server {RECEIVER.relative_to(ROOT)} is not in this copy"
    return None


def ckptctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptctl", *args]


def dry_run(reason: str) -> int:
    say(f"no real update here: {reason}.")
    say("showing the dry run instead - the split and the server groups a 2-GPU run would use:")
    args = ["update", "--dry-run", "--checkpoint-path", str(CHECKPOINT), "--world-size", "2"]
    done = subprocess.run(ckptctl(*args, "--inference-parallel-size", "2"), check=False)
    if done.returncode == 0:
        say("on a machine with GPUs, `make demo` pushes this checkpoint into a running server.")
    return done.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_receiver(gpus: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The stand-in server on loopback, once every worker has allocated its parameters."""
    devices = ",".join(str(i) for i in range(gpus))
    cmd = [sys.executable, str(RECEIVER), "--checkpoint-path", str(CHECKPOINT)]
    cmd += ["--devices", devices, "--port", "0", "--profile", "sglang-0.5.23"]
    out = open(log, "wb")  # noqa: SIM115 - the receiver writes to it for as long as it runs
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("READY "):
                return proc, line.split()[1]
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    stop(proc)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(f"the stand-in server did not get ready:\n{tail}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def real_update(gpus: int) -> int:
    # A folder of our own (mode 0700): a log path in /tmp could be planted by another user.
    log = Path(tempfile.mkdtemp(prefix="ckptctl-demo-")) / "receiver.log"
    say(f"starting the stand-in SGLang server on {gpus} GPU(s) (log: {log})")
    proc, endpoint = start_receiver(gpus, log)
    try:
        say(f"it is up at {endpoint}; now the update, one rank per GPU:")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m"]
        cmd += ["ckptctl", "update", "--checkpoint-path", str(CHECKPOINT)]
        cmd += ["--inference-parallel-size", str(gpus), "--endpoint", endpoint]
        cmd += ["--weight-version", "demo-1", "--timeout", str(UPDATE_TIMEOUT_S)]
        print(f"$ torchrun --nproc-per-node {gpus} -m ckptctl update ...", file=sys.stderr)
        code = subprocess.run(cmd, check=False, timeout=UPDATE_TIMEOUT_S + 60).returncode
        if code != 0:
            say(f"the update failed (exit {code}); the server's log: {log}")
            return code
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
        with no_proxy.open(f"{endpoint}/receiver/report", timeout=120) as answer:
            report = json.load(answer)
    finally:
        stop(proc)
    return judge(report)


def judge(report: dict) -> int:
    """What the server received, in one line per GPU; 0 when every tensor arrived intact."""
    for w in report["workers"]:
        say(
            f"GPU {w['device']}: received {w['tensors_received']} of "
            f"{report['expected_tensors']} tensors, {len(w['mismatches'])} mismatch(es), "
            f"{len(w['missing'])} missing"
        )
    if report["ok"] and all(not w["mismatches"] and not w["missing"] for w in report["workers"]):
        say(
            f"every tensor arrived bit for bit; the server now reports weight version "
            f"{report['weight_version']!r}"
        )
        return 0
    say("the server did not get every tensor intact: " + json.dumps(report["workers"])[:2000])
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="GPUs to use at most (default 2)")
    parser.add_argument("--dry-run", action="store_true", help="show the dry run in any case")
    args = parser.parse_args(argv)
    reason = "asked for with --dry-run" if args.dry_run else why_no_gpu()
    if reason is not None:
        return dry_run(reason)
    import torch

    return real_update(max(1, min(args.gpus, torch.cuda.device_count())))


if __name__ == "__main__":
    sys.exit(main())
