"""A stand-in inference server that really receives checkpoint-engine updates on GPUs.

`ReceiverServer` = `FakeServer` (HTTP on loopback or a Unix socket, SGLang or vLLM contract)
+ one worker process per GPU of the "server" (TP size N = N devices), started with `spawn`.

On `POST /update_weights_from_ipc` (SGLang) or `POST /collective_rpc` (vLLM) the HTTP handler
sends the `zmq_handles` dict to every worker. Each worker picks the handle for its own GPU
exactly as SGLang does (`f"GPU-{torch.cuda.get_device_properties(dev).uuid}"`, `ValueError`
when missing) and calls `checkpoint_engine.worker.update_weights_from_ipc(zmq.Context(),
handle, device_id=dev, run=..., post_hook=...)` - the call SGLang's worker extension makes.
`run` copies every received tensor into a parameter preallocated at start-up from the
checkpoint's safetensors headers (like SGLang's dummy weights). The HTTP answer comes only
when every worker has finished, like SGLang's POST.

After each update every worker checks every parameter bit for bit against the checkpoint on
disk and counts what arrived: each tensor exactly once per update (the checkpoint-engine
broadcast delivers the whole checkpoint to every GPU, so each worker checks all tensors).
`GET /receiver/report` returns the results, `POST /receiver/reset` clears them and
`POST /receiver/config` changes the failure injection (see `ReceiverConfig`). These control
routes need no API key and work in every profile.

`/weights_checker` answers as the profile's SGLang version does (tests/support/fake_checker.py,
WEIGHTS-CHECKER.md), over the parameters on the GPUs: worker i of N plays TP rank i (its
checksums cover row block i of each parameter whose first dim splits evenly). `drop_tensor` and
`corrupt_tensor` make an update silently skip or flip one tensor (the HTTP answer stays 200).

The HTTP answer follows the engine: 400 `{"success": false, "message": "IPC weight update
failed: ..."}` (SGLang) or 500 (vLLM) when a worker raised, died or timed out, or when `run`
raised in a bucket whose error checkpoint-engine swallowed (the last one). Wrong or missing
bytes do not change the HTTP answer - a real engine would not notice either - they are in
the report.

Command line (prints `READY <endpoint>` once the parameters are allocated):

    python tests/support/gpu_receiver.py --checkpoint-path DIR --devices 0,1 --port P \\
        --profile sglang-0.5.23 [--fail-bucket K] [--refuse MSG] [--never-connect] ...

Python:

    with ReceiverServer("ckpt/", devices=[0], profile="sglang-0.5.23") as rx:
        ... POST to rx.endpoint ...
        assert rx.report()["ok"]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import struct
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, fields
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fake_checker import Weights
from fake_server import PROFILES, Behaviour, FakeServer

# -- configuration -------------------------------------------------------------------------


@dataclass
class ReceiverConfig:
    """Failure injection and limits; change at runtime with `POST /receiver/config`."""

    # Answer every update 400 `success: false` with this message, never connecting.
    refuse: str | None = None
    # The worker's `run` raises in bucket k (0-based; -1 = the bucket that completes the
    # checkpoint, i.e. the last one, whose error checkpoint-engine discards).
    fail_bucket: int | None = None
    # A worker process exits hard (os._exit) in bucket k (-1 = last), mid-update.
    die_in_bucket: int | None = None
    # fail_bucket and die_in_bucket apply to the next update only (the restore after it goes
    # through).
    once: bool = False
    # The HTTP handler never hands the sockets to the workers; it answers 200 after this
    # many seconds, or never (None) while `never_connect` is set.
    never_connect: bool = False
    never_connect_answer_after_s: float | None = None
    # Sleep before handling an update.
    delay_s: float = 0.0
    # Sleep this long in each bucket before loading it (a slow server: a push long enough to
    # stop, cancel or kill the server in the middle of).
    bucket_delay_s: float = 0.0
    # How long a worker waits on its zmq socket (no PS, stalled PS), and the HTTP handler
    # on a worker, before the update is failed and reported.
    worker_timeout_s: float = 300.0
    # Verify every parameter against the checkpoint on disk after each update.
    verify: bool = True
    # Refill every parameter with dummy bytes before each update, so that a tensor an update
    # failed to deliver shows as a mismatch even if an earlier update had delivered it.
    scrub: bool = True
    # Verify against this checkpoint instead of the one the receiver started with (same
    # names, dtypes and shapes): for a job that pushes one checkpoint after another.
    verify_against: str | None = None
    # Mimic checkpoint-engine 0.4.2 + SGLang exactly: an error raised by `run` that the
    # worker call swallowed (last bucket) does not fail the HTTP answer (it still shows in
    # the report). Off by default: the receiver answers 400, as the task asks.
    hide_swallowed_errors: bool = False
    # A receiver that silently loses one tensor (its bytes stay as they were) or corrupts one
    # (its first byte arrives flipped): the update still answers 200, as a buggy one would.
    drop_tensor: str | None = None
    corrupt_tensor: str | None = None

    def update(self, doc: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ValueError(f"unknown config keys: {unknown}; known: {sorted(names)}")
        for key, value in doc.items():
            setattr(self, key, value)


# -- the checkpoint on disk ----------------------------------------------------------------


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {p}")
    return files


def read_headers(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """name -> {"dtype": "BF16", "shape": [...], "nbytes": n, "file": path}; no torch needed."""
    out: dict[str, dict[str, Any]] = {}
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise ValueError(f"tensor {name!r} is in both {out[name]['file']} and {f}")
            start, end = info["data_offsets"]
            out[name] = {
                "dtype": info["dtype"],
                "shape": info["shape"],
                "nbytes": end - start,
                "file": str(f),
            }
    return out


# -- the worker process (one per GPU) ------------------------------------------------------


def _torch_dtype(code: str) -> Any:
    import torch

    table = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "U16": torch.uint16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "I64": torch.int64,
        "U64": torch.uint64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
    return table[code]


def _as_bytes(t: Any) -> Any:
    """A flat uint8 view of any tensor (0-dim, bool and fp8 included)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]


class _Update:
    """What one worker saw during one update."""

    def __init__(self, params: dict[str, Any], cfg: dict[str, Any]) -> None:
        self.params = params
        self.cfg = cfg
        self.counts: dict[str, int] = {}
        self.unexpected: list[str] = []
        self.bytes = 0
        self.buckets = 0
        self.run_errors: list[str] = []

    def _is_target(self, k: int | None, bucket: int, completes: bool) -> bool:
        return k is not None and (bucket == k or (k == -1 and completes))

    def run(self, weights: list[tuple[str, Any]]) -> None:
        bucket = self.buckets
        self.buckets += 1
        if self.cfg.get("bucket_delay_s"):
            time.sleep(float(self.cfg["bucket_delay_s"]))
        for name, _ in weights:
            self.counts[name] = self.counts.get(name, 0) + 1
        completes = all(name in self.counts for name in self.params)
        if self._is_target(self.cfg["die_in_bucket"], bucket, completes):
            os._exit(17)  # a crash, mid-update: no reply, no clean-up
        if self._is_target(self.cfg["fail_bucket"], bucket, completes):
            msg = f"injected failure in bucket {bucket}" + (" (last)" if completes else "")
            self.run_errors.append(f"RuntimeError: {msg}")
            raise RuntimeError(msg)
        try:
            for name, tensor in weights:
                param = self.params.get(name)
                if param is None:
                    self.unexpected.append(name)
                    continue
                if param.dtype != tensor.dtype or param.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: got {tensor.dtype}{list(tensor.shape)}, "
                        f"expected {param.dtype}{list(param.shape)}"
                    )
                if name == self.cfg.get("drop_tensor"):
                    continue  # lost without a word
                _as_bytes(param).copy_(_as_bytes(tensor))  # bytes: works for every dtype
                if name == self.cfg.get("corrupt_tensor") and param.numel():
                    _as_bytes(param)[:1].bitwise_not_()
                self.bytes += tensor.numel() * tensor.element_size()
        except Exception as exc:
            self.run_errors.append(_short(exc))
            raise


def _outcome(run_errors: list[str], errors: list[str]) -> dict[str, list[str]]:
    """`run` errors that checkpoint-engine swallowed (the worker call returned normally) apart
    from errors that ended the worker call."""
    if errors:
        return {"swallowed_errors": [], "errors": run_errors + errors}
    return {"swallowed_errors": run_errors, "errors": []}


def _verify(params: dict[str, Any], ckpt: str, device: Any) -> list[str]:
    """Names whose bytes on the GPU differ from the checkpoint on disk."""
    import torch
    from safetensors import safe_open

    mismatches = []
    for f in checkpoint_files(ckpt):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                want = fh.get_tensor(name).to(device)
                got = params[name]
                if got.shape != want.shape or not torch.equal(_as_bytes(got), _as_bytes(want)):
                    mismatches.append(name)
    return mismatches


def _checker_op(params: dict[str, Any], state: dict[str, Any], op: str, rank: int, tp: int) -> Any:
    """One worker's part of a weights checker action (fake_checker.Weights, on the GPU)."""
    import hashlib

    import torch
    from fake_checker import shard_bytes, tensor_hash

    def host(p: Any) -> Any:
        return _as_bytes(p).cpu().numpy()

    if op == "snapshot":
        state["snapshot"] = {n: _as_bytes(p).clone() for n, p in params.items()}
    elif op == "drop_snapshot":
        state.pop("snapshot", None)
    elif op == "reset":
        for p in params.values():
            raw = _as_bytes(p)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device))
    elif op == "compare":
        saved = state.get("snapshot")
        if saved is None:
            return None
        return sorted(n for n, p in params.items() if not torch.equal(_as_bytes(p), saved[n]))
    elif op in ("checksums", "sha256"):
        from concurrent.futures import ThreadPoolExecutor

        def one(item: tuple[str, Any]) -> tuple[str, str]:
            name, p = item
            data = host(p)  # (hashlib lets go of the GIL: the threads hash side by side)
            if op == "sha256":
                return name, hashlib.sha256(data).hexdigest()
            return name, tensor_hash(shard_bytes(data, list(p.shape), tp, rank))

        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(pool.map(one, params.items()))
    else:
        raise ValueError(f"unknown checker op {op!r}")
    return None


def _worker_main(ckpt: str, device: int, conn: Connection, rank: int = 0, tp: int = 1) -> None:
    """Allocate the parameters, then serve ("update", seq, handles, cfg) and
    ("checker", seq, op) until ("stop",)."""
    import torch
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        uuid = f"GPU-{torch.cuda.get_device_properties(dev).uuid}"
        params = {}
        for name, h in sorted(read_headers(ckpt).items()):
            p = torch.empty(h["shape"], dtype=_torch_dtype(h["dtype"]), device=dev)
            _as_bytes(p).fill_(0xA5)  # recognisable dummy weights
            params[name] = p
        torch.cuda.synchronize(dev)
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails start-up
        conn.send(("error", traceback.format_exc() or _short(exc)))
        return
    ready = {"device": device, "uuid": uuid, "param_tensors": len(params), "param_bytes": nbytes}
    conn.send(("ready", ready))

    checker_state: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "checker":
            _, seq, op = msg
            try:
                conn.send(
                    ("checker", seq, {"ok": _checker_op(params, checker_state, op, rank, tp)})
                )
            except Exception as exc:  # noqa: BLE001 - the HTTP answer reports it
                conn.send(("checker", seq, {"error": _short(exc)}))
            continue
        _, seq, handles, cfg = msg
        t0 = time.monotonic()
        if cfg["scrub"]:  # back to dummy weights: what this update misses shows as a mismatch
            for p in params.values():
                _as_bytes(p).fill_(0xA5)
        up = _Update(params, cfg)
        errors: list[str] = []
        timeout_ms = int(cfg["worker_timeout_s"] * 1000)
        ctx = zmq.Context()
        # Defaults for the sockets checkpoint-engine creates on this context: a bounded
        # wait instead of a recv that blocks forever when no PS ever talks to us.
        ctx.setsockopt(zmq.RCVTIMEO, timeout_ms)
        ctx.setsockopt(zmq.SNDTIMEO, timeout_ms)
        ctx.setsockopt(zmq.LINGER, 0)
        try:
            if uuid not in handles:  # what SGLang's worker extension raises
                raise ValueError(f"Device UUID {uuid} not found in zmq_handles: {list(handles)}")
            update_weights_from_ipc(
                ctx,
                handles[uuid],
                device_id=device,
                run=up.run,
                post_hook=lambda: torch.cuda.synchronize(dev),
            )
        except Exception as exc:  # noqa: BLE001 - every failure goes into the report
            # A timeout on the first recv surfaces as the EFSM error of checkpoint-engine's
            # attempt to answer it: look at the cause too.
            if isinstance(exc, zmq.Again) or isinstance(exc.__context__, zmq.Again):
                errors.append(
                    f"TimeoutError: no message from the parameter server in {timeout_ms} ms"
                )
            else:
                errors.append(_short(exc))
        finally:
            ctx.destroy(linger=0)
        seconds = time.monotonic() - t0

        loaded = {
            "device": device,
            "uuid": uuid,
            "update": seq,
            "tensors_received": sum(up.counts.values()),
            "bytes": up.bytes,
            "buckets": up.buckets,
            "seconds": round(seconds, 6),
            "verify_seconds": None,
            "mismatches": [],
            "missing": sorted(n for n in params if n not in up.counts),
            "unexpected": sorted(set(up.unexpected)),
            "duplicates": sorted(n for n, c in up.counts.items() if c > 1),
            **_outcome(up.run_errors, errors),
        }
        # The HTTP answer goes out now (a real server answers once the load is over); the
        # bit-for-bit check follows and /receiver/report waits for it.
        conn.send(("loaded", seq, loaded))
        mismatches: list[str] = []
        t1 = time.monotonic()
        if cfg["verify"]:
            try:
                mismatches = _verify(params, cfg.get("verify_against") or ckpt, dev)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"verify: {_short(exc)}")
        verify_seconds = round(time.monotonic() - t1, 6)
        verified = {
            **loaded,
            "verify_seconds": verify_seconds,
            "mismatches": mismatches,
            **_outcome(up.run_errors, errors),
        }
        conn.send(("done", seq, verified))


# -- the parent: HTTP server + worker pool -------------------------------------------------

_GONE = ("gone",)  # what _recv returns once a worker has exited


class _GpuWeights(Weights):
    """fake_checker.Weights over the receiver's GPU workers: worker i plays TP rank i."""

    def __init__(self, receiver: ReceiverServer) -> None:
        self.rx = receiver
        self.lock = threading.Lock()

    @property  # type: ignore[override]
    def tp_size(self) -> int:
        return len(self.rx.devices)

    def snapshot(self) -> None:
        self.rx.ask_workers("snapshot")

    def drop_snapshot(self) -> None:
        self.rx.ask_workers("drop_snapshot")

    def reset(self, *, rope_too: bool) -> None:
        self.rx.ask_workers("reset")  # (no RoPE cache here)

    def differs_from_snapshot(self) -> list[str] | None:
        (changed,) = self.rx.ask_workers("compare", [0])  # only TP rank 0 answers in SGLang
        return changed

    def rank_checksums(self, rank: int) -> dict[str, str]:
        (sums,) = self.rx.ask_workers("checksums", [rank])
        return sums

    def sha256(self) -> dict[str, str]:
        (sums,) = self.rx.ask_workers("sha256", [0])
        return sums


class ReceiverServer:
    """FakeServer + GPU workers. Context manager; `start()` returns once parameters exist."""

    def __init__(
        self,
        checkpoint_path: str | os.PathLike[str],
        devices: list[int],
        *,
        profile: str = "sglang-0.5.23",
        port: int = 0,
        uds: str | None = None,
        api_key: str | None = None,
        config: ReceiverConfig | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose from {PROFILES}")
        self.checkpoint_path = str(checkpoint_path)
        self.headers = read_headers(checkpoint_path)
        self.devices = list(devices)
        self.config = config or ReceiverConfig()
        self.startup_timeout_s = startup_timeout_s
        self.behaviour = Behaviour(profile=profile, api_key=api_key, on_update=self._on_update)
        self.behaviour.held = _GpuWeights(self)
        self.behaviour.routes = {
            ("GET", "/receiver/report"): lambda _doc: (200, self.report()),
            ("POST", "/receiver/reset"): self._route_reset,
            ("GET", "/receiver/config"): lambda _doc: (200, asdict(self.config)),
            ("POST", "/receiver/config"): self._route_config,
        }
        self.http = FakeServer(self.behaviour, uds=uds, port=port)
        self._stopping = threading.Event()
        self._verifying: threading.Thread | None = None
        self._update_lock = threading.Lock()  # one update at a time, like SGLang's writer lock
        self._state_lock = threading.Lock()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._workers: list[dict[str, Any]] = []  # start-up info + "alive"
        self._last: list[dict[str, Any] | None] = []  # last update's report per worker
        self._history: list[dict[str, Any]] = []
        self._seq = 0
        self._checker_seq = 0
        self._checker_log: list[dict[str, Any]] = []  # the weights checker's ops, timed

    # -- life cycle -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.http.endpoint

    def start(self) -> ReceiverServer:
        ctx = mp.get_context("spawn")
        try:
            for dev in self.devices:
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(self.checkpoint_path, dev, child, len(self._procs), len(self.devices)),
                    name=f"receiver-gpu{dev}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            deadline = time.monotonic() + self.startup_timeout_s
            for dev, proc, conn in zip(self.devices, self._procs, self._conns, strict=True):
                msg = self._recv(conn, proc, deadline)
                if msg is None:
                    why = "no answer in time"
                elif msg is _GONE:
                    why = f"it exited with code {proc.exitcode}"
                elif msg[0] != "ready":
                    why = msg[1]
                if msg is None or msg is _GONE or msg[0] != "ready":
                    raise RuntimeError(f"receiver worker for GPU {dev} failed to start: {why}")
                self._workers.append({**msg[1], "alive": True})
            self._last = [None] * len(self.devices)
            self._apply_config()
            self.http.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.http.stop()
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # a dead worker's pipe
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> ReceiverServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reports and config -----------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        verifying = self._verifying
        if verifying is not None:
            verifying.join(timeout=float(self.config.worker_timeout_s) + 30.0)
        with self._state_lock:
            workers = []
            for info, last in zip(self._workers, self._last, strict=False):
                workers.append({**info, **(last or {"update": None})})
            history = list(self._history)
            checker_ops = list(self._checker_log)
        last_ok = history[-1]["ok"] if history else None
        return {
            "profile": self.behaviour.profile,
            "checkpoint_path": self.checkpoint_path,
            "expected_tensors": len(self.headers),
            "expected_bytes": sum(h["nbytes"] for h in self.headers.values()),
            "weight_version": self.behaviour.weight_version,
            "updates": len(history),
            "ok": last_ok,
            "config": asdict(self.config),
            "workers": workers,
            "history": history,
            "checker_ops": checker_ops,
        }

    def reset(self) -> None:
        with self._state_lock:
            self._history.clear()
            self._checker_log.clear()
            self._last = [None] * len(self.devices)

    def set_config(self, **changes: Any) -> ReceiverConfig:
        self.config.update(changes)
        self._apply_config()
        return self.config

    def _apply_config(self) -> None:
        # `refuse` and `delay_s` are the FakeServer's own refusal and delay, applied before
        # our handler runs: the workers never hear of a refused update.
        b = self.behaviour
        b.update_status = 200 if self.config.refuse is None else 400
        b.update_message = self.config.refuse or "IPC weight update completed successfully"
        b.update_delay_s = float(self.config.delay_s)

    def _route_reset(self, _doc: Any) -> tuple[int, Any]:
        self.reset()
        return 200, {"success": True}

    def _route_config(self, doc: Any) -> tuple[int, Any]:
        if not isinstance(doc, dict):
            return 400, {"error": "expected a JSON object"}
        try:
            self.set_config(**doc)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        return 200, asdict(self.config)

    # -- the update ---------------------------------------------------------------------------
    def _on_update(self, handles: dict[str, str], body: dict[str, Any]) -> None:
        with self._update_lock:
            t0 = time.monotonic()
            try:
                self._run_update(handles)
            except Exception as exc:
                self._log(t0, False, str(exc))
                raise
            self._log(t0, True, "ok")

    def _log(self, t0: float, ok: bool, message: str) -> None:
        with self._state_lock:
            last = [r for r in self._last if r is not None]
            clean = all(
                not (r["mismatches"] or r["missing"] or r["unexpected"] or r["duplicates"])
                and not r["errors"]
                and not r["swallowed_errors"]
                for r in last
            )
            self._history.append(
                {
                    "update": self._seq,
                    "ok": ok and clean and len(last) == len(self.devices),
                    "http_ok": ok,
                    "seconds": round(time.monotonic() - t0, 6),
                    "message": message,
                }
            )

    def _run_update(self, handles: dict[str, str]) -> None:
        cfg = self.config
        if cfg.never_connect:
            self._seq += 1
            with self._state_lock:
                self._last = [None] * len(self.devices)
            wait_s = cfg.never_connect_answer_after_s
            if self._stopping.wait(None if wait_s is None else float(wait_s)):
                raise RuntimeError("receiver is stopping")
            return
        if not self._conns:
            raise RuntimeError("this receiver has no GPU workers")
        if not isinstance(handles, dict):
            raise ValueError("zmq_handles must be an object")
        if self._verifying is not None:  # the last update's check reads the same pipes
            self._verifying.join(timeout=float(cfg.worker_timeout_s) + 30.0)
        self._seq += 1
        seq = self._seq
        snapshot = asdict(cfg)
        if cfg.once:
            cfg.fail_bucket = cfg.die_in_bucket = None
            cfg.once = False
        for i, conn in enumerate(self._conns):
            if self._workers[i]["alive"]:
                conn.send(("update", seq, dict(handles), snapshot))
        # The worker's own zmq timeout fires first; this one catches a stuck worker.
        deadline = time.monotonic() + float(cfg.worker_timeout_s) + 30.0
        results: list[dict[str, Any]] = []
        for i, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            results.append(self._collect(i, proc, conn, seq, deadline, want="loaded"))
        with self._state_lock:
            self._last = results
        # Verification runs after the answer; report() waits for it.
        self._verifying = threading.Thread(
            target=self._collect_verified, args=(seq, deadline), daemon=True
        )
        self._verifying.start()
        failures = [f"GPU {r['device']}: {e}" for r in results for e in r["errors"]]
        if not cfg.hide_swallowed_errors:
            failures += [
                f"GPU {r['device']}: {e} (swallowed by checkpoint-engine)"
                for r in results
                for e in r["swallowed_errors"]
            ]
        if failures:
            raise RuntimeError("; ".join(failures))

    def _collect_verified(self, seq: int, deadline: float) -> None:
        verified = []
        for i, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            verified.append(self._collect(i, proc, conn, seq, deadline, want="done"))
        with self._state_lock:
            if self._seq == seq:
                self._last = verified

    def _collect(
        self, i: int, proc: Any, conn: Connection, seq: int, deadline: float, want: str = "done"
    ) -> dict[str, Any]:
        info = self._workers[i]
        empty = {
            "device": info["device"],
            "uuid": info["uuid"],
            "update": seq,
            "tensors_received": 0,
            "bytes": 0,
            "buckets": 0,
            "seconds": None,
            "verify_seconds": None,
            "mismatches": [],
            "missing": [],
            "unexpected": [],
            "duplicates": [],
            "swallowed_errors": [],
            "errors": [],
        }
        if not info["alive"]:
            return {**empty, "errors": [f"worker process is dead (exit code {proc.exitcode})"]}
        while True:
            msg = self._recv(conn, proc, deadline)
            if msg is _GONE:
                # The pipe closes while the process is still tearing CUDA down: wait for it.
                proc.join(timeout=30)
                info["alive"] = False
                why = f"worker process exited with code {proc.exitcode} during the update"
                return {**empty, "errors": [why]}
            if msg is None:
                why = "worker did not finish within worker_timeout_s + 30 s"
                return {**empty, "errors": [why]}
            if msg[0] == want and msg[1] == seq:
                return msg[2]
            # else: a late answer to an update we already gave up on

    # -- the weights checker ----------------------------------------------------------------------
    def ask_workers(self, op: str, indices: list[int] | None = None) -> list[Any]:
        """Run a checker op on the workers (all, or `indices`), between updates; their results."""
        with self._update_lock:
            if self._verifying is not None:  # the last update's check reads the same pipes
                self._verifying.join(timeout=float(self.config.worker_timeout_s) + 30.0)
            self._checker_seq += 1
            seq = self._checker_seq
            chosen = list(range(len(self._conns))) if indices is None else indices
            for i in chosen:
                if not self._workers[i]["alive"]:
                    raise RuntimeError(f"the worker for GPU {self.devices[i]} is dead")
                self._conns[i].send(("checker", seq, op))
            deadline = time.monotonic() + float(self.config.worker_timeout_s) + 30.0
            out = []
            t0 = time.monotonic()
            for i in chosen:
                while True:
                    msg = self._recv(self._conns[i], self._procs[i], deadline)
                    if msg is None or msg is _GONE:
                        raise RuntimeError(f"the worker for GPU {self.devices[i]} did not answer")
                    if msg[0] == "checker" and msg[1] == seq:
                        break
                if "error" in msg[2]:
                    raise RuntimeError(f"GPU {self.devices[i]}: {msg[2]['error']}")
                out.append(msg[2]["ok"])
            with self._state_lock:
                self._checker_log.append({"op": op, "seconds": round(time.monotonic() - t0, 6)})
            return out

    @staticmethod
    def _recv(conn: Connection, proc: Any, deadline: float) -> Any:
        """The next message from a worker; `_GONE` once it has exited (or closed its end of
        the pipe), None at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = wait([conn, proc.sentinel], timeout=min(left, 1.0))
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    return _GONE
            if proc.sentinel in ready:
                return _GONE


# -- command line --------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-path", required=True, help="a .safetensors file or a folder")
    p.add_argument("--devices", required=True, help="CUDA device indices, e.g. 0,1 (TP size)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=0, help="loopback TCP port (0: any free)")
    where.add_argument("--uds", help="Unix socket path instead of TCP")
    p.add_argument("--profile", default="sglang-0.5.23", choices=PROFILES)
    p.add_argument("--api-key")
    p.add_argument("--fail-bucket", type=int, help="run raises in bucket K (-1: last)")
    p.add_argument("--die-in-bucket", type=int, help="worker exits hard in bucket K (-1: last)")
    p.add_argument("--refuse", metavar="MSG", help="answer 400 success:false with MSG")
    p.add_argument("--never-connect", action="store_true", help="never hand over the sockets")
    p.add_argument(
        "--never-connect-answer-after", type=float, metavar="S", help="then answer 200 after S s"
    )
    p.add_argument("--delay", type=float, default=0.0, help="sleep S s before each update")
    p.add_argument("--worker-timeout", type=float, default=300.0)
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check")
    p.add_argument("--no-scrub", action="store_true", help="keep weights between updates")
    p.add_argument("--hide-swallowed-errors", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    config = ReceiverConfig(
        refuse=a.refuse,
        fail_bucket=a.fail_bucket,
        die_in_bucket=a.die_in_bucket,
        never_connect=a.never_connect,
        never_connect_answer_after_s=a.never_connect_answer_after,
        delay_s=a.delay,
        worker_timeout_s=a.worker_timeout,
        verify=not a.no_verify,
        scrub=not a.no_scrub,
        hide_swallowed_errors=a.hide_swallowed_errors,
    )
    devices = [int(d) for d in a.devices.split(",") if d.strip()]
    server = ReceiverServer(
        a.checkpoint_path,
        devices,
        profile=a.profile,
        port=a.port,
        uds=a.uds,
        api_key=a.api_key,
        config=config,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    where = f"unix:{a.uds}" if a.uds else server.endpoint
    print(f"READY {where}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
