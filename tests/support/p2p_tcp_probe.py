"""Does mooncake's TCP transport move bytes here? Host memory only, no GPU, no torch.

A holder process registers a buffer of random bytes with its own `TransferEngine` (P2P
handshake, 127.0.0.1); this process reads it back with `batch_transfer_sync_read` in two halves
and compares digests; then the holder is killed and a second read must fail (not hang). Prints
one JSON line; exit 0 when all of that held, 1 otherwise. Used by tests/support/p2p_kit.sh on the GPU
machine (before the p2p GPU tests) and by tests/torchrun/test_p2p_cpu.py where mooncake is installed.

    python tests/support/p2p_tcp_probe.py [--mib 64]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

HOST = "127.0.0.1"


def _engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    # The protocol argument is the one checkpoint-engine passes without an RDMA NIC ("rdma"):
    # mooncake 0.3.x ignores it and picks TCP when it finds no HCA (or MC_FORCE_TCP is set).
    ret = engine.initialize(HOST, "P2PHANDSHAKE", "rdma", os.environ.get("P2P_DEVICE", "tcp"))
    if ret != 0:
        raise SystemExit(f"TransferEngine.initialize returned {ret}")
    return engine


def holder(n: int) -> None:
    engine = _engine()
    buf = (ctypes.c_uint8 * n)()
    ctypes.memmove(buf, os.urandom(n), n)
    ptr = ctypes.addressof(buf)
    if engine.batch_register_memory([ptr], [n]) != 0:
        raise SystemExit("batch_register_memory failed")
    digest = hashlib.sha256(ctypes.string_at(ptr, n)).hexdigest()
    print(f"ADDR {HOST}:{engine.get_rpc_port()} {ptr} {n} {digest}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or kills us)


def probe(mib: int, timeout_s: float = 60.0) -> dict[str, Any]:
    n = mib << 20
    os.environ.setdefault("MC_FORCE_TCP", "1")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--holder", str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    result: dict[str, Any] = {"bytes": n}
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("ADDR "):
            result["error"] = f"holder did not start (exit {proc.wait(timeout=timeout_s)})"
            return result
        _, target, rptr, _, digest = line.split()
        engine = _engine()
        buf = (ctypes.c_uint8 * n)()
        ptr = ctypes.addressof(buf)
        if engine.batch_register_memory([ptr], [n]) != 0:
            result["error"] = "batch_register_memory failed on the reader"
            return result
        half = n // 2
        t0 = time.monotonic()
        ret = engine.batch_transfer_sync_read(
            target, [ptr, ptr + half], [int(rptr), int(rptr) + half], [half, n - half]
        )
        seconds = time.monotonic() - t0
        result.update(
            read_ret=ret,
            read_seconds=round(seconds, 4),
            gb_per_s=round(n / seconds / 1e9, 3),
            bit_exact=hashlib.sha256(ctypes.string_at(ptr, n)).hexdigest() == digest,
        )
        proc.kill()
        proc.wait(timeout=timeout_s)
        t0 = time.monotonic()
        ret = engine.batch_transfer_sync_read(target, [ptr], [int(rptr)], [n])
        result.update(gone_read_ret=ret, gone_read_seconds=round(time.monotonic() - t0, 3))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--holder", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.holder:
        holder(a.holder)
        return 0
    result = probe(a.mib)
    ok = result.get("read_ret") == 0 and result.get("bit_exact") and result.get("gone_read_ret")
    result["ok"] = bool(ok)
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
