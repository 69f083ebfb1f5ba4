"""Drive a `gpu_receiver.py` with checkpoint-engine's own ParameterServer (GPU only).

    python tests/support/gpu_smoke_ps.py write DIR             # a small mixed-dtype checkpoint
    torchrun --nproc-per-node N tests/support/gpu_smoke_ps.py drive --checkpoint DIR \\
        --endpoint http://127.0.0.1:P [--uds PATH] --engine sglang|vllm \\
        --rounds ok,fail_last,fail_mid,ok --out result.json

Each rank registers the whole checkpoint as `named_tensors` only on rank 0 (the others own
nothing, so every bucket is broadcast from rank 0 to every GPU), gathers metas and calls
`ParameterServer.update(name, req_func)`, where rank 0's `req_func` POSTs the socket paths to
the receiver. A round sets the receiver's failure injection first, then checks
`/receiver/report`:

- `ok`: HTTP 200 and success, every worker got every tensor once, bit-exact.
- `fail_last`: `run` raises in the last bucket. checkpoint-engine discards that reply, so the
  PS returns normally; the receiver must still answer 400 and report the error.
- `fail_mid`: `run` raises in bucket 1; the PS raises, the receiver answers 400.

Exits 0 when every round behaved as expected. Small buckets (1 MiB) make several of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXPECT = {
    "ok": {"fail_bucket": None},
    "fail_last": {"fail_bucket": -1},
    "fail_mid": {"fail_bucket": 1},
}


def write_checkpoint(out: str) -> None:
    """Two shards, ~4.6 MB: bf16, fp16, fp32, fp8 e4m3, int64, bool, 0-dim tensors."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1234)
    shard1 = {
        "model.embed_tokens.weight": torch.randn(1024, 512, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 1024, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(1024, 1024, generator=g).to(
            torch.float8_e4m3fn
        ),
        "model.layers.0.mlp.down_proj.weight_scale": torch.tensor(0.0125),
        "model.layers.0.attn.bias": torch.tensor(3.5).to(torch.bfloat16),
    }
    shard2 = {
        "model.layers.1.attn.q_proj.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "model.layers.1.attn.k_proj.weight": torch.randn(7, 13, generator=g).to(torch.float16),
        "model.rotary.positions": torch.arange(4096, dtype=torch.int64) * 7919 - 2**40,
        "model.attention_mask": torch.rand(1000, 3, generator=g) > 0.5,
        "lm_head.weight": torch.randn(768, 512, generator=g).to(torch.bfloat16),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(shard1, f"{out}/model-00001-of-00002.safetensors")
    save_file(shard2, f"{out}/model-00002-of-00002.safetensors")
    n = sum(t.numel() * t.element_size() for t in (*shard1.values(), *shard2.values()))
    print(f"wrote {len(shard1) + len(shard2)} tensors, {n} bytes to {out}")


def _client(args: argparse.Namespace) -> Any:
    import httpx

    transport = httpx.HTTPTransport(uds=args.uds) if args.uds else None
    base = "http://localhost" if args.uds else args.endpoint
    return httpx.Client(base_url=base, transport=transport, timeout=args.http_timeout)


def _post_update(client: Any, engine: str, paths: list[tuple[str, str]], version: str) -> Any:
    handles = dict(paths)
    if engine == "vllm":
        body = {"method": "update_weights_from_ipc", "args": [handles], "timeout": 120.0}
        return client.post("/collective_rpc", json=body)
    body = {"zmq_handles": handles, "flush_cache": True, "weight_version": version}
    return client.post("/update_weights_from_ipc", json=body)


def _judge(kind: str, rnd: dict[str, Any], report: dict[str, Any], engine: str) -> list[str]:
    """What went against expectations in one round (empty: it passed)."""
    bad = []
    workers = report["workers"]
    expected = report["expected_tensors"]
    status = rnd.get("http_status")
    if kind == "ok":
        if status != 200:
            bad.append(f"HTTP {status}: {rnd.get('http_body')}")
        if engine != "vllm" and not (rnd.get("http_body") or {}).get("success"):
            bad.append("success is not true")
        if rnd["ps_error"]:
            bad.append(f"PS raised {rnd['ps_error']}")
        if report["ok"] is not True:
            bad.append("report ok is not true")
        for w in workers:
            if w["tensors_received"] != expected or w["mismatches"] or w["missing"]:
                bad.append(
                    f"GPU {w['device']}: {w['tensors_received']}/{expected} tensors, "
                    f"mismatches {w['mismatches']}, missing {w['missing']}"
                )
            if w["errors"] or w["swallowed_errors"] or w["unexpected"] or w["duplicates"]:
                bad.append(f"GPU {w['device']}: {w}")
        if engine != "vllm" and report["weight_version"] != rnd["weight_version"]:
            bad.append(f"weight_version {report['weight_version']} != {rnd['weight_version']}")
        return bad
    # failure rounds
    want_status = 500 if engine == "vllm" else 400
    if status != want_status:
        bad.append(f"HTTP {status}, expected {want_status}: {rnd.get('http_body')}")
    if report["ok"] is not False:
        bad.append("report ok is not false")
    if report["weight_version"] == rnd["weight_version"]:
        bad.append("weight_version changed on a failed update")
    if kind == "fail_last":
        if rnd["ps_error"]:
            bad.append(f"PS raised {rnd['ps_error']} (checkpoint-engine 0.4.2 swallows it)")
        if not all(w["swallowed_errors"] and not w["errors"] for w in workers):
            bad.append("report lacks the swallowed last-bucket error")
    if kind == "fail_mid":
        if not rnd["ps_error"]:
            bad.append("PS did not raise")
        if not all(any("bucket 1" in e for e in w["errors"]) for w in workers):
            bad.append("report lacks the bucket-1 error")
    return bad


def drive(args: argparse.Namespace) -> int:
    import torch
    from checkpoint_engine.ps import ParameterServer
    from gpu_receiver import checkpoint_files
    from safetensors.torch import load_file

    # 1 MiB buckets (a power of two, so the two IPC slots stay aligned): several buckets.
    os.environ.setdefault("PS_MAX_BUCKET_SIZE_GB", str(1 / 1024))
    rank = int(os.environ["RANK"])
    named: dict[str, torch.Tensor] = {}
    if rank == 0:
        for f in checkpoint_files(args.checkpoint):
            named.update(load_file(str(f)))
    ps = ParameterServer(auto_pg=True)
    name = "smoke"
    t0 = time.monotonic()
    if named:
        ps.register_checkpoint(name, named_tensors=named)
    ps.gather_metas(name)
    register_s = time.monotonic() - t0
    client = _client(args) if rank == 0 else None
    results, failed = [], False
    for i, kind in enumerate(args.rounds.split(",")):
        version = f"smoke-{i}"
        rnd: dict[str, Any] = {"round": i, "kind": kind, "weight_version": version}
        if client is not None:
            client.post("/receiver/reset").raise_for_status()
            client.post("/receiver/config", json=EXPECT[kind]).raise_for_status()

        def req_func(paths: list[tuple[str, str]], rnd: dict[str, Any] = rnd) -> None:
            if client is None:
                return
            r = _post_update(client, args.engine, paths, rnd["weight_version"])
            rnd["http_status"] = r.status_code
            rnd["http_body"] = r.json() if r.content else None

        t1 = time.monotonic()
        try:
            ps.update(name, req_func)
            rnd["ps_error"] = None
        except Exception as exc:  # noqa: BLE001 - expected in fail_mid
            rnd["ps_error"] = f"{type(exc).__name__}: {exc}"
        rnd["update_s"] = round(time.monotonic() - t1, 4)
        if client is not None:
            report = client.get("/receiver/report").json()
            rnd["report"] = report
            rnd["problems"] = _judge(kind, rnd, report, args.engine)
            failed |= bool(rnd["problems"])
            w = report["workers"]
            print(
                f"ROUND {i} {kind}: {'FAIL' if rnd['problems'] else 'PASS'} "
                f"http={rnd.get('http_status')} ps_error={bool(rnd['ps_error'])} "
                f"tensors={[x['tensors_received'] for x in w]}/{report['expected_tensors']} "
                f"bytes={[x['bytes'] for x in w]} buckets={[x['buckets'] for x in w]} "
                f"mismatches={sum(len(x['mismatches']) for x in w)} "
                f"update_s={rnd['update_s']} problems={rnd['problems']}",
                flush=True,
            )
        results.append(rnd)
    if rank == 0:
        doc = {"register_s": round(register_s, 4), "rounds": results, "passed": not failed}
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
        print(f"SMOKE {'PASSED' if not failed else 'FAILED'} ({args.engine})", flush=True)
    return 1 if failed else 0


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    d = sub.add_parser("drive")
    d.add_argument("--checkpoint", required=True)
    d.add_argument("--endpoint", default="http://127.0.0.1:30000")
    d.add_argument("--uds")
    d.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    d.add_argument("--rounds", default="ok,fail_last,fail_mid,ok")
    d.add_argument("--http-timeout", type=float, default=120.0)
    d.add_argument("--out")
    args = p.parse_args()
    if args.cmd == "write":
        write_checkpoint(args.dir)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
