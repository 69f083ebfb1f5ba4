"""Proving what the inference server holds after an update: SGLang's weights checker.

`POST /weights_checker {"action": ...}` (SGLang 0.5.6+; what each version answers is written
down in tests/WEIGHTS-CHECKER.md). Three ways to prove an update, strongest first:

- `compare_checksum` (proposed in SGLang PR #17009, in no release): we send the SHA-256 of every
  tensor as the checkpoint stores it, hashed from the bytes this job registered, and the server
  compares them with the full tensors it rebuilt from its shards. Proves every byte.
- `checksum` (0.5.12+): the server hashes its own parameters (its names, its TP shards, a
  64-bit Triton hash on GPUs), which nobody can predict from the checkpoint. What it proves:
  every server that was given the same checkpoint holds the same bytes ("per-engine").
- `snapshot` → `reset_tensors` → update → `compare` (the round trip): the server compares
  against what it was started with. Proves TP rank 0's shard of each DP group (only that rank
  answers) and overwrites the served weights with noise until the update lands.

What a server offers is read from its answers, never from a version string: 404 on the route
means no checker; 400 `{"success": false, "message": "Unsupported action='X'"}` means no X.
Answers are read to at most `MAX_ANSWER_BYTES`, within a total deadline.

Only hashlib and httpx are imported here; nothing of torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptctl.bounded_http import ResponseTooLarge
from ckptctl.defaults import API_KEY_ENV
from ckptctl.errors import DeadlineExceeded, InvalidInput, OperationFailed
from ckptctl.inference_server import (
    ServerAddress,
    describe_failure,
    make_client,
    one_line,
    parse_json_object,
)

CHECKER_PATH = "/weights_checker"
# A checksum answer lists every parameter of every rank: about 1 MB for DeepSeek-V3 on TP8.
# (The README states this cap; every other answer is capped at bounded_http's 1 MiB.)
MAX_ANSWER_BYTES = 16 << 20
SHOWN_NAMES = 10  # tensors named in one error line

# The actions ckptctl uses, as `offers` reports them.
COMPARE_CHECKSUM = "compare_checksum"
CHECKSUM = "checksum"
COMPARE = "compare"  # snapshot / reset_tensors / compare only (SGLang 0.5.6 - 0.5.11)

# What `"verified"` says in a result, and in words.
VERIFY_HOWS = {
    "checksum": "the SHA-256 of every tensor (compare_checksum)",
    "per-engine": "the same per-engine checksum on every server",
    "round-trip": "snapshot, reset_tensors, update, compare",
}


# -- talking to the checker ------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    doc: dict[str, Any] | None  # the body when it is a JSON object

    @property
    def succeeded(self) -> bool:
        return self.status == 200 and self.doc is not None and self.doc.get("success") is True

    @property
    def message(self) -> str:
        if self.doc is None:
            return "(the answer was not a JSON object)"
        value = self.doc.get("message", self.doc.get("detail", self.doc.get("error", "")))
        return value if isinstance(value, str) else json.dumps(value)[:2000]

    @property
    def unsupported(self) -> bool:
        """SGLang's answer to an action it does not know (`Unsupported action='X'`)."""
        return (
            self.status == 400
            and self.doc is not None
            and self.doc.get("success") is False
            and "Unsupported action" in self.message
        )


class Checker:
    """One server's `/weights_checker`, every call bounded by `deadline` (monotonic)."""

    def __init__(self, address: ServerAddress, deadline: float) -> None:
        self.address = address
        self.where = address.describe()
        self.deadline = deadline

    def ask(self, action: str, **fields: Any) -> Answer:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"no time left to ask {self.where} for {action!r}")
        import httpx

        try:
            # The client ends the exchange at the deadline and reads at most MAX_ANSWER_BYTES.
            with make_client(
                self.address, timeout=left, max_response_bytes=MAX_ANSWER_BYTES
            ) as client:
                response = client.post(CHECKER_PATH, json={"action": action, **fields})
        except ResponseTooLarge:
            raise OperationFailed(
                f"{self.where} answered {action!r} with more than "
                f"{MAX_ANSWER_BYTES >> 20} MiB: not a weights checker ckptctl knows"
            ) from None
        except httpx.TimeoutException:
            raise DeadlineExceeded(
                f"{self.where} did not answer the weights checker's {action!r} in time"
            ) from None
        except httpx.HTTPError as exc:
            raise OperationFailed(
                f"weights checker request {action!r} to {self.where} failed: "
                f"{describe_failure(exc, self.address, left)}"
            ) from None
        status = response.status_code
        if status in (401, 403):
            raise OperationFailed(
                f"{self.where} refused the API key on {CHECKER_PATH} (HTTP {status}): pass "
                f"--api-key or set {API_KEY_ENV} (SGLang checks --admin-api-key first)"
            )
        return Answer(status, parse_json_object(response))

    def require(self, action: str, **fields: Any) -> Answer:
        """Ask; anything but success is a failure that quotes the server."""
        answer = self.ask(action, **fields)
        if not answer.succeeded:
            raise self.failed(action, answer)
        return answer

    def failed(self, action: str, answer: Answer, silent: str = "") -> OperationFailed:
        """`action` failed: the error quotes the server's answer (`silent` where it says none)."""
        return OperationFailed(
            f"{self.where} failed the weights checker's {action!r}: HTTP {answer.status}: "
            f"{one_line(answer.message) or silent}"
        )


# -- what a server offers --------------------------------------------------------------------


def probe(checker: Checker) -> list[str]:
    """The checker actions this server has, among compare_checksum, checksum and compare.

    compare_checksum is asked for with nothing to compare (a server that has it compares
    nothing); checksum makes the server hash its weights once (GPU-fast, no change).
    """
    first = checker.ask(COMPARE_CHECKSUM, checksums={})
    if first.status == 404:
        return []
    if first.doc is None or "success" not in first.doc:
        raise OperationFailed(
            f"{checker.where} answered {CHECKER_PATH} with HTTP {first.status} and no "
            f"SGLang answer ({one_line(first.message)}): not a weights checker ckptctl knows"
        )
    if not first.unsupported:
        return [COMPARE_CHECKSUM, CHECKSUM, COMPARE]
    second = checker.ask(CHECKSUM)
    if second.unsupported:
        return [COMPARE]
    if second.succeeded:
        parse_checksums(second.doc or {}, checker.where)  # its answer must be one we can read
        return [CHECKSUM, COMPARE]
    raise checker.failed(CHECKSUM, second)


def plan_verification(offers: Sequence[tuple[str, Sequence[str]]], *, round_trip: bool) -> str:
    """How to verify, given (server, actions) for every server the job feeds; or why not
    (InvalidInput, exit 3: asked before anything was pushed)."""
    nothing = "nothing was pushed"
    lacking = [where for where, acts in offers if not acts]
    if lacking:
        raise InvalidInput(
            f"--verify: {lacking[0]} has no weights checker (HTTP 404 on {CHECKER_PATH}; "
            f"SGLang has it from 0.5.6, its checksum from 0.5.12): drop --verify; {nothing}"
        )
    old = [where for where, acts in offers if CHECKSUM not in acts]
    if round_trip:
        if old:
            raise InvalidInput(
                f"--verify-round-trip: {old[0]} resets its RoPE caches too (SGLang 0.5.6-0.5.11, "
                "no 'checksum' action), which no update restores: upgrade SGLang to >= 0.5.12; "
                f"{nothing}"
            )
        return "round-trip"
    if all(COMPARE_CHECKSUM in acts for _, acts in offers):
        return "checksum"
    if old:
        raise InvalidInput(
            f"--verify: {old[0]} offers only snapshot/reset_tensors/compare (SGLang "
            "0.5.6-0.5.11), no checksum: upgrade SGLang to >= 0.5.12, or drop --verify; "
            f"{nothing}"
        )
    if len(offers) < 2:
        raise InvalidInput(
            f"--verify: {offers[0][0]} offers only per-engine checksums (SGLang's 'checksum'; "
            "'compare_checksum' is in no release), and this job feeds one server: there is no "
            "other server to compare them with. Feed two or more servers, or drop --verify "
            f"(`update --verify-round-trip` proves one server's by a round trip); {nothing}"
        )
    return "per-engine"


# -- compare_checksum: the SHA-256 of every tensor -------------------------------------------


def hashing_threads(local_world_size: int) -> int:
    """This rank's share of the CPUs it may run on (hashlib lets go of the GIL)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus // max(local_world_size, 1)))


def sha256_tensors(items: Iterable[tuple[str, Any]], threads: int) -> dict[str, str]:
    """{name: sha256 hex} of each (name, bytes-like) pair, the largest first over `threads`."""
    pairs = sorted(items, key=lambda item: -memoryview(item[1]).nbytes)

    def one(item: tuple[str, Any]) -> tuple[str, str]:
        return item[0], hashlib.sha256(item[1]).hexdigest()

    if threads <= 1 or len(pairs) < 2:
        return dict(map(one, pairs))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptctl-sha") as pool:
        return dict(pool.map(one, pairs))


@dataclass
class BackgroundHasher:
    """Hashes this rank's registered tensors in a thread while the update runs."""

    items: list[tuple[str, Any]]
    threads: int
    hashes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    nbytes: int = 0
    error: BaseException | None = None
    # Waited for in the thread before hashing (the bytes may still be being read); what it
    # raises is the hasher's error.
    ready: Callable[[], None] | None = None
    _thread: threading.Thread | None = None

    def start(self) -> BackgroundHasher:
        self.nbytes = sum(memoryview(b).nbytes for _, b in self.items)
        self._thread = threading.Thread(target=self._run, name="ckptctl-hash", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.ready is not None:
                self.ready()
                t0 = time.perf_counter()
            self.hashes = sha256_tensors(self.items, self.threads)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller in result()
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def result(self, timeout: float) -> dict[str, str]:
        assert self._thread is not None
        self._thread.join(max(timeout, 0.0))
        if self._thread.is_alive():
            raise DeadlineExceeded("hashing the registered tensors did not finish in time")
        if self.error is not None:
            raise OperationFailed(f"hashing the registered tensors failed: {self.error}")
        self.items = []  # let go of the views
        return self.hashes


def check_expected(checker: Checker, expected: dict[str, str]) -> None:
    """Send every tensor's SHA-256; fail (exit 1) naming the tensors the server disputes."""
    answer = checker.ask(COMPARE_CHECKSUM, checksums=expected)
    if answer.succeeded:
        return
    if answer.status == 400 and answer.doc is not None and answer.doc.get("success") is False:
        names = disputed_names(answer, set(expected))
        what = (
            f"{len(names)} tensor(s) differ from what was sent: {_list(names)} "
            f"(the server said: {one_line(answer.message, 200)})"
            if names
            else f"it disputes the checksums: {one_line(answer.message)}"
        )
        raise OperationFailed(f"{checker.where} does not hold the checkpoint: {what}")
    raise checker.failed(COMPARE_CHECKSUM, answer)


_NAME_FIELD = re.compile(r"name=([^\s,;'\"]+)")
_TOKEN = re.compile(r"[\w.\-/:]+")


def disputed_names(answer: Answer, known: set[str] | None = None) -> list[str]:
    """The tensors a failed check names: its `mismatched` list, SGLang's `name=X` lines, and
    (given `known`) every known tensor name the message mentions. Sorted, no repeats."""
    doc = answer.doc or {}
    found: set[str] = set()
    listed = doc.get("mismatched")
    if isinstance(listed, list):
        found.update(n for n in listed if isinstance(n, str) and len(n) <= 1024)
    message = answer.message
    found.update(_NAME_FIELD.findall(message))
    if known:
        found.update(t for t in _TOKEN.findall(message) if t in known)
    if known is not None and found & known:
        found &= known  # keep only the names that mean something here
    return sorted(found)


def _list(names: Sequence[str]) -> str:
    shown = ", ".join(one_line(n, 200) for n in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


# -- checksum: what every server reports -----------------------------------------------------


@dataclass
class ServerChecksums:
    """One server's `checksum` answer: {rank key: {parameter: hash}} and its own summary."""

    ranks: dict[str, dict[str, str]]
    per_engine_checksum: str | None = None

    def digest(self) -> str:
        """Independent of the order DP replies arrived in (SGLang's per_engine_checksum is not)."""
        h = hashlib.sha256()
        for key in sorted(self.ranks):
            h.update(f"{key}\n".encode())
            for name, value in sorted(self.ranks[key].items()):
                h.update(f"{name}\t{value}\n".encode())
        return h.hexdigest()

    def as_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "per_engine_checksum": self.per_engine_checksum}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerChecksums:
        return cls(doc["ranks"], doc.get("per_engine_checksum"))


def _rank_key(info: Any, index: int) -> str:
    """dp/pp/tp of a rank's `parallelism_info` (a dict; a list of per-role dicts in 0.5.23)."""
    if isinstance(info, list):
        info = next(
            (i for i in info if isinstance(i, dict) and i.get("role") == "target"), None
        ) or (info[0] if info and isinstance(info[0], dict) else None)
    if isinstance(info, dict):
        parts = [info.get(k) for k in ("dp_rank", "pp_rank", "tp_rank")]
        if all(isinstance(p, int) for p in parts):
            return f"dp{parts[0]}/pp{parts[1]}/tp{parts[2]}"
    return f"#{index}"


def parse_checksums(doc: dict[str, Any], where: str) -> ServerChecksums:
    """Read a `checksum` answer, refusing anything not shaped like SGLang's."""

    def bad(why: str) -> OperationFailed:
        return OperationFailed(f"{where}'s checksum answer is not SGLang's: {why}")

    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise bad("no 'ranks' list")
    out: dict[str, dict[str, str]] = {}
    for i, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not isinstance(entry.get("checksums"), dict):
            raise bad(f"ranks[{i}] has no 'checksums' object")
        sums = entry["checksums"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
            raise bad(f"ranks[{i}].checksums holds more than strings")
        key = _rank_key(entry.get("parallelism_info"), i)
        if key in out:
            key = f"{key}#{i}"
        out[key] = sums
    total = doc.get("per_engine_checksum")
    return ServerChecksums(out, total if isinstance(total, str) else None)


def compare_servers(reports: Sequence[tuple[str, ServerChecksums]]) -> list[str]:
    """Problems found between servers that were given the same checkpoint (empty: they agree).

    Raises InvalidInput when their layouts differ (other TP sizes, other models): then
    nothing can be concluded. Each problem names the server and the parameters (SGLang's
    names, per rank) where it differs from the majority.
    """
    layouts = {where: {(k, n) for k, sums in r.ranks.items() for n in sums} for where, r in reports}
    first_where, first = next(iter(layouts.items()))
    for where, layout in layouts.items():
        if layout != first:
            raise InvalidInput(
                f"--verify: {where} and {first_where} report different parameters "
                f"({len(layout)} against {len(first)} over their ranks): per-engine checksums "
                "compare only servers of one model and one parallel layout"
            )
    if len({r.digest() for _, r in reports}) == 1:
        return []
    differs: dict[str, list[str]] = {where: [] for where, _ in reports}
    tied: list[str] = []
    for key, name in sorted(first):
        votes = Counter(r.ranks[key][name] for _, r in reports)
        if len(votes) == 1:
            continue
        (top, n_top), *rest = votes.most_common()
        if rest and rest[0][1] == n_top:
            tied.append(f"{key} {name}")
            continue
        for where, r in reports:
            if r.ranks[key][name] != top:
                differs[where].append(f"{key} {name}")
    problems = [
        f"{where} differs from the other server(s) in {len(names)} parameter(s): {_list(names)}"
        for where, names in differs.items()
        if names
    ]
    if tied:
        servers = " and ".join(where for where, _ in reports)
        problems.append(
            f"{servers} disagree (no majority) in {len(tied)} parameter(s): {_list(tied)}"
        )
    return problems


# -- the round trip --------------------------------------------------------------------------


def round_trip_compare(checker: Checker) -> None:
    """After the update: the server compares with its snapshot; exit 1 naming what differs."""
    answer = checker.ask(COMPARE)
    if answer.succeeded:
        return
    names = disputed_names(answer)
    if answer.status == 400 and names:
        raise OperationFailed(
            f"{checker.where} does not hold what it was started with after the update: "
            f"{len(names)} parameter(s) differ: {_list(names)} (was it started from this "
            "checkpoint, not --load-format dummy?)"
        )
    raise checker.failed(COMPARE, answer, "(no message: was the snapshot lost?)")
