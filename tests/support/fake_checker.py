"""SGLang's `/weights_checker`, version by version, over the tensors a test server holds.

What each version answers is in tests/WEIGHTS-CHECKER.md (read from SGLang's released wheels);
this module answers the same way, computing real hashes of real bytes:

- `Weights`: what a checker needs of the weights it checks; `HeldWeights` implements it over
  bytes (the GPU receiver over its workers' GPU tensors, gpu_receiver.py).
- `HeldWeights`: what the server holds, by checkpoint tensor name, as TP shards (a tensor with
  two or more dims whose first dim divides by the TP size is split along it; the rest is
  replicated), plus a RoPE-cache buffer like every SGLang model has. Filled from a checkpoint
  (`receive`), with failure injection: `drop` (a tensor the update silently leaves as it was)
  and `corrupt` (a tensor whose first byte arrives flipped).
- `checker_answer(version, weights, action_doc)`: (HTTP status, JSON body) as SGLang `version`
  answers. Versions: "0.5.6" (snapshot/reset_tensors/compare, resets RoPE caches too),
  "0.5.12" (+ checksum, TP rank 0 only), "0.5.13" (every rank, per_gpu/per_engine checksums,
  GET), "0.5.23" (parallelism_info per role), "pr17009" (+ compare_checksum, the proposal).

The checksum of a parameter is SGLang's CPU `tensor_hash`: the first 8 bytes of the SHA-256 of
the shard's bytes, as 16 hex digits (a GPU server uses a Triton hash instead: same role).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# version -> what it has. "get": the route also takes GET (no body: checksum).
CHECKER_VERSIONS: dict[str, dict[str, Any]] = {
    "0.5.6": {"actions": ("snapshot", "reset_tensors", "compare"), "get": False},
    "0.5.12": {"actions": ("snapshot", "reset_tensors", "compare", "checksum"), "get": False},
    "0.5.13": {"actions": ("snapshot", "reset_tensors", "compare", "checksum"), "get": True},
    "0.5.23": {"actions": ("snapshot", "reset_tensors", "compare", "checksum"), "get": True},
    "pr17009": {
        "actions": ("snapshot", "reset_tensors", "compare", "checksum", "compare_checksum"),
        "get": True,
    },
}
ROPE_BUFFER = "model.rotary_emb.cos_sin_cache"  # a non-persistent buffer: no update restores it


@dataclass
class Tensor:
    dtype: str
    shape: list[int]
    data: bytearray


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a safetensors checkpoint (a file or a folder of them), no torch."""
    p = Path(path)
    out: dict[str, Tensor] = {}
    for f in [p] if p.is_file() else sorted(p.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            out[name] = Tensor(
                info["dtype"], list(info["shape"]), bytearray(raw[base + start : base + end])
            )
    return out


class Weights:
    """What a checker works on: the server's weights as `tp_size` ranks hold them. Implemented
    over bytes here (`HeldWeights`) and over GPU workers in gpu_receiver.py."""

    tp_size: int = 1
    lock: threading.Lock

    def snapshot(self) -> None:
        raise NotImplementedError

    def drop_snapshot(self) -> None:
        raise NotImplementedError

    def reset(self, *, rope_too: bool) -> None:
        raise NotImplementedError

    def differs_from_snapshot(self) -> list[str] | None:
        """Names whose TP-rank-0 shard changed since the snapshot; None without one."""
        raise NotImplementedError

    def rank_checksums(self, rank: int) -> dict[str, str]:
        """SGLang's CPU `tensor_hash` of each parameter's shard on `rank` (RoPE cache left out)."""
        raise NotImplementedError

    def sha256(self) -> dict[str, str]:
        """The SHA-256 of every whole tensor (what compare_checksum rebuilds and hashes)."""
        raise NotImplementedError


@dataclass
class HeldWeights(Weights):
    """The weights a fake server holds, as `tp_size` ranks would."""

    tp_size: int = 1
    tensors: dict[str, Tensor] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    saved: dict[str, bytes] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.tensors.setdefault(ROPE_BUFFER, Tensor("F32", [64, 2], bytearray(range(256)) * 2))

    @classmethod
    def started_from(cls, checkpoint: str | os.PathLike[str], tp_size: int = 1) -> HeldWeights:
        """A server launched with --model-path on this checkpoint (not dummy weights)."""
        return cls(tp_size, dict(read_checkpoint(checkpoint)))

    def receive(self, checkpoint: str | os.PathLike[str]) -> None:
        """An update with `checkpoint`, minus the injected failures."""
        with self.lock:
            for name, t in read_checkpoint(checkpoint).items():
                if name in self.drop:
                    if name not in self.tensors:  # dummy weights stay dummy
                        self.tensors[name] = Tensor(
                            t.dtype, t.shape, bytearray(b"\xa5" * len(t.data))
                        )
                    continue
                if name in self.corrupt and t.data:
                    t.data[0] ^= 0xFF
                self.tensors[name] = t

    def shard(self, name: str, rank: int) -> bytes:
        t = self.tensors[name]
        return shard_bytes(t.data, t.shape, self.tp_size, rank)

    def snapshot(self) -> None:
        self.saved = {name: bytes(t.data) for name, t in self.tensors.items()}

    def drop_snapshot(self) -> None:
        self.saved = None

    def reset(self, *, rope_too: bool) -> None:
        for name, t in self.tensors.items():
            if name != ROPE_BUFFER or rope_too:
                t.data[:] = os.urandom(len(t.data))

    def differs_from_snapshot(self) -> list[str] | None:
        if self.saved is None:
            return None
        return [
            name
            for name in sorted(self.tensors)
            if shard_bytes(self.saved[name], self.tensors[name].shape, self.tp_size, 0)
            != self.shard(name, 0)
        ]

    def rank_checksums(self, rank: int) -> dict[str, str]:
        return {n: tensor_hash(self.shard(n, rank)) for n in self.tensors if n != ROPE_BUFFER}

    def sha256(self) -> dict[str, str]:
        return {n: hashlib.sha256(t.data).hexdigest() for n, t in self.tensors.items()}


def shard_bytes(data: Any, shape: list[int], tp_size: int, rank: int) -> bytes:
    """TP rank `rank`'s part of a tensor: a row block when the first dim splits evenly."""
    if tp_size > 1 and len(shape) >= 2 and shape[0] % tp_size == 0:
        step = len(data) // tp_size
        return bytes(data[rank * step : (rank + 1) * step])
    return bytes(data)


def tensor_hash(data: bytes) -> str:
    """SGLang's `tensor_hash` of a CPU tensor, as its checker prints it."""
    return hashlib.sha256(data).digest()[:8].hex()


def _fail(message: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    return 400, {"success": False, "message": message, **extra}


_OK = (200, {"success": True, "message": "Success."})


def checker_answer(version: str, weights: Weights, doc: Any) -> tuple[int, dict[str, Any]]:
    """(status, body) of `POST /weights_checker` with body `doc` on SGLang `version`."""
    spec = CHECKER_VERSIONS[version]
    if doc is None and spec["get"]:
        doc = {}
    if not isinstance(doc, dict) or ("action" not in doc and not spec["get"]):
        return 400, {
            "object": "error",
            "message": "action: Field required",
            "type": "BadRequestError",
            "code": 400,
        }
    action = doc.get("action", "checksum")
    if not isinstance(action, str):
        return 400, {"object": "error", "message": "action: Input should be a valid string",
                     "type": "BadRequestError", "code": 400}  # fmt: skip
    if action not in spec["actions"]:
        return _fail(f"Unsupported action={action!r}")
    with weights.lock:
        return _ACTIONS[action](version, weights, doc)


def _snapshot(version: str, weights: Weights, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    weights.snapshot()
    return _OK


def _reset(version: str, weights: Weights, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    weights.reset(rope_too=version == "0.5.6")  # 0.5.12 on skip non-persistent buffers
    return _OK


def _compare(version: str, weights: Weights, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    # Only TP rank 0's reply reaches the client (WEIGHTS-CHECKER.md, Dispatch).
    changed = weights.differs_from_snapshot()
    if changed is None:
        return _fail("")  # SGLang: a bare AssertionError
    if version == "0.5.23":
        weights.drop_snapshot()
    if changed:
        lines = [f"name={n} max_abs_err=1.0 mean_abs_err=0.5 num_exceed=1 " for n in changed]
        return _fail("check tensor equality failed:\n" + "\n".join(lines))
    return _OK


def _checksum(version: str, weights: Weights, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    tp = weights.tp_size
    ranks = []
    for rank in range(tp if version != "0.5.12" else 1):  # 0.5.12: TP rank 0 only
        sums = weights.rank_checksums(rank)
        info: Any = {"tp_rank": rank, "tp_size": tp, "dp_rank": 0, "dp_size": 1,
                     "pp_rank": 0, "pp_size": 1, "rank": rank, "size": tp}  # fmt: skip
        entry: dict[str, Any] = {"checksums": sums}
        if version != "0.5.12":
            h = hashlib.sha256()
            for name in sorted(sums):
                h.update(name.encode())
                h.update(sums[name].encode())
            entry["per_gpu_checksum"] = h.hexdigest()
        if version in ("0.5.23", "pr17009"):
            info = [{"role": "target", **info}]
        entry["parallelism_info"] = info
        ranks.append(entry)
    body: dict[str, Any] = {"success": True, "message": "Success.", "ranks": ranks}
    if version != "0.5.12":
        h = hashlib.sha256()
        for entry in ranks:
            h.update(entry["per_gpu_checksum"].encode())
        body["per_engine_checksum"] = h.hexdigest()
    return 200, body


def _compare_checksum(
    version: str, weights: Weights, doc: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    expected = doc.get("checksums")
    if not isinstance(expected, dict):
        return _fail("compare_checksum needs 'checksums': {name: sha256}")
    held = weights.sha256() if expected else {}
    mismatched = sorted(n for n, want in expected.items() if n in held and held[n] != want)
    unknown = sorted(n for n in expected if n not in held)
    if mismatched or unknown:
        return _fail(
            f"checksum comparison failed: {len(mismatched)} mismatched: {', '.join(mismatched)}; "
            f"{len(unknown)} unknown: {', '.join(unknown)}",
            mismatched=mismatched,
        )
    return 200, {"success": True, "message": f"Success: {len(expected)} tensors match."}


_ACTIONS = {
    "snapshot": _snapshot,
    "reset_tensors": _reset,
    "compare": _compare,
    "checksum": _checksum,
    "compare_checksum": _compare_checksum,
}
