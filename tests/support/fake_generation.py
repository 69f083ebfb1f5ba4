"""Generations in flight in the stand-in servers (fake_server.FakeServer, and through it the GPU
receiver), with SGLang's and vLLM's locks and pause modes as docs/pause-contract.md sets them
out, version by version (`Behaviour.version`; the profile's by default, vLLM 0.34.0).

SGLang:
- POST /generate {"text", "sampling_params": {"max_new_tokens": N}}: waits while the server is
  paused (no 503), takes the model-update reader lock (writer-preferring: not while an update
  waits), "decodes" N tokens of `Behaviour.token_delay_s` each, answers 200 {"text",
  "output_ids", "meta_info": {"id", "finish_reason", "completion_tokens", "weight_version"}}
  with finish reason {"type": "length"} or, aborted, {"type": "abort", "message": "Aborted"}.
- POST /pause_generation: 404 before 0.4.9; up to 0.5.5 the body is ignored and every request
  aborted, answered at once; from 0.5.6 a JSON object {"mode": abort|retract|in_place} (400
  otherwise): abort answers once no request holds the reader lock (looking again every
  `abort_poll_s`, SGLang's 1 s), retract puts the running requests back in the queue (they
  keep their tokens and go on after the continue), in_place holds them, both at once.
- POST /continue_generation (a JSON object from 0.5.6): waits while a pause or a paused update
  holds the pause condition, then lets everything go on.
- POST /update_weights_from_ipc: the writer lock (it waits for every generation), except from
  0.5.11 while paused, when it runs holding the pause condition instead, and a continue waits
  for it (before 0.5.11 it deadlocks while requests are held: their reader locks never go). flush_cache=true with requests held
  in place (or, on 0.5.10-0.5.20, retracted ones queued) ends the server before 0.5.22 (its
  connections reset from then on) and answers 400 from 0.5.22, the weights applied but not
  the version.
- GET /get_server_info and /server_info: {"version"}; GET on a POST-only route: 405.

vLLM (dev mode, 0.12 and later):
- POST /v1/completions {"prompt", "max_tokens"}: finish_reason "length" or "abort"; while paused
  it waits, or from 0.33 (abort, wait) is refused at once with 503.
- POST /pause?mode=abort|wait|keep&clear_cache=: query parameters only (before 0.16 no mode:
  abort, or wait with wait_for_inflight_requests=true); abort and wait answer once the running
  requests are gone; keep holds them (clear_cache, the default, preempts them to the queue:
  "retracted" here, from 0.17). POST /resume, GET /is_paused, GET /version.
- POST /collective_rpc takes no lock: it runs beside the generations.

Both: GET /stand-in/generations (no key needed) counts the requests completed, aborted,
retracted, held and refused, and says what is paused; POST /stand-in/finish {"after_s": S}
ends every generation in flight S seconds of tokens later (`finish_all`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)
SGLANG_MODES = ("abort", "retract", "in_place")
VLLM_MODES = ("abort", "wait", "keep")


def release(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in version.split(".") if n.isdigit())


@dataclass
class _Request:
    id: int
    tokens: int
    done: int = 0
    abort: bool = False


class Generations:
    """One server's generations, its locks and its pause state (every field under `cond`)."""

    def __init__(self, kind: str, version: str, behaviour: Any) -> None:
        self.kind = kind  # "sglang" | "vllm"
        self.version = version
        self.v = release(version)
        self.b = behaviour  # token_delay_s, abort_poll_s, weight_version
        self.cond = threading.Condition()
        self.readers = 0  # requests holding the model-update reader lock (SGLang)
        self.writers_waiting = 0
        self.writing = 0  # updates holding the writer lock
        self.paused_updates = 0  # updates holding SGLang's pause condition instead (0.5.11+)
        self.gate = False  # SGLang's is_pause, vLLM's front-end pause: new requests wait
        self.held: str | None = None  # the scheduler holds its running requests: in which mode
        self.vllm_mode: str | None = None
        self.cond_busy = False  # an abort's drain holds SGLang's pause condition
        self.running: dict[int, _Request] = {}
        self.ids = itertools.count(1)
        self.counts = dict.fromkeys(("completed", "aborted", "retracted", "held", "refused"), 0)

    # -- what tests read -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            return {
                **self.counts,
                "running": len(self.running),
                "update_waiting": self.writers_waiting > 0,  # (for the generations in flight)
                "paused": self.gate or self.held is not None,
                "held_mode": self.held,
                "version": self.version,
                "token_delay_s": self.b.token_delay_s,
            }

    def finish_all(self, after_s: float = 0.0) -> None:
        """End every generation in flight `after_s` seconds of tokens from now (at its next
        token by default; a held one once it goes on)."""
        more = 1 + int(after_s / self.b.token_delay_s) if self.b.token_delay_s else 1
        with self.cond:
            for request in self.running.values():
                request.tokens = min(request.tokens, request.done + more)
            self.cond.notify_all()

    # -- the routes ------------------------------------------------------------------------------
    def route(self, method: str, url: str, body: bytes) -> tuple[int, Any] | None:
        """The answer to a generation or pause route, or None for any other route."""
        path, _, query = url.partition("?")
        if method == "GET" and path == "/stand-in/generations":
            return 200, self.snapshot()
        if method == "POST" and path == "/stand-in/finish":  # {"after_s": S}: finish_all
            self.finish_all(float((_json(body) or {}).get("after_s") or 0.0))
            return 200, self.snapshot()
        if self.kind == "sglang":
            return self._sglang(method, path, body)
        return self._vllm(method, path, parse_qs(query), body)

    def _sglang(self, method: str, path: str, body: bytes) -> tuple[int, Any] | None:
        v = self.v
        if path in ("/get_server_info", "/server_info") and method == "GET":
            if path == "/server_info" and v < (0, 5, 6):
                return 404, {"detail": "Not Found"}
            return 200, {"version": self.version, "tokenizer_path": "Qwen/Qwen3-8B"}
        if path not in ("/generate", "/pause_generation", "/continue_generation"):
            return None
        if path != "/generate" and v < (0, 4, 9):
            return 404, {"detail": "Not Found"}
        if method != "POST":
            return 405, {"detail": "Method Not Allowed"}
        doc = _json(body)
        if path == "/generate":
            tokens = ((doc or {}).get("sampling_params") or {}).get("max_new_tokens", 16)
            return self.generate(int(tokens))
        if v >= (0, 5, 6) and not isinstance(doc, dict):  # (SGLang's 422, made 400)
            return 400, _sglang_error("[{'type': 'missing', 'loc': ('body',)}]")
        if path == "/continue_generation":
            self.resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        mode = "abort" if v < (0, 5, 6) else doc.get("mode", "abort")  # type: ignore[union-attr]
        if mode not in SGLANG_MODES:
            return 400, _sglang_error("mode: Input should be 'abort', 'retract' or 'in_place'")
        self.sglang_pause(mode)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _vllm(
        self, method: str, path: str, query: dict[str, list[str]], body: bytes
    ) -> tuple[int, Any] | None:
        if path == "/version" and method == "GET":
            return 200, {"version": self.version}
        if path == "/v1/completions" and method == "POST":
            return self.generate(int((_json(body) or {}).get("max_tokens", 16)))
        if path not in ("/pause", "/resume", "/is_paused"):
            return None
        if self.v < (0, 12):
            return 404, {"detail": "Not Found"}
        if path == "/is_paused":
            if method != "GET":
                return 405, {"detail": "Method Not Allowed"}
            with self.cond:
                return 200, {"is_paused": self.gate or self.held is not None}
        if method != "POST":
            return 405, {"detail": "Method Not Allowed"}
        if path == "/resume":
            self.resume()
            return 200, {"status": "resumed"}

        def flag(name: str, default: bool) -> bool:
            return (query.get(name) or [str(default)])[-1].lower() in ("true", "1")

        mode = "abort"
        if self.v >= (0, 16):  # (a body is ignored: only the query string counts)
            mode = (query.get("mode") or ["abort"])[-1]
            if mode not in VLLM_MODES:
                message = f"1 validation error: mode: Input should be {VLLM_MODES}"
                return 400, {"error": {"message": message, "type": "Bad Request", "code": 400}}
        if self.v < (0, 32) and flag("wait_for_inflight_requests", False):
            mode = "wait"
        self.vllm_pause(mode, clear_cache=flag("clear_cache", True))
        return 200, {"status": "paused"}

    # -- generation --------------------------------------------------------------------------------
    def generate(self, tokens: int) -> tuple[int, Any]:
        with self.cond:
            refuse = (
                self.kind == "vllm" and self.v >= (0, 33) and self.vllm_mode in ("abort", "wait")
            )
            if refuse and self.gate:
                self.counts["refused"] += 1
                message = "Generation is paused. Please retry after it resumes."
                return 503, {"error": {"message": message, "code": "engine_paused"}}
            while self.gate or self.writing or self.writers_waiting:  # (no 503 on SGLang)
                self.cond.wait()
            request = _Request(next(self.ids), tokens)
            self.running[request.id] = request
            self.readers += 1
        try:
            while request.done < request.tokens:
                with self.cond:
                    while self.held is not None and not request.abort:
                        self.cond.wait()
                    if request.abort:
                        break
                time.sleep(self.b.token_delay_s)
                request.done += 1
        finally:
            with self.cond:
                del self.running[request.id]
                self.readers -= 1
                self.counts["aborted" if request.abort else "completed"] += 1
                self.cond.notify_all()
        text = " tok" * request.done
        if self.kind == "vllm":
            reason = "abort" if request.abort else "length"
            choice = {"index": 0, "text": text, "finish_reason": reason}
            return 200, {"id": f"cmpl-{request.id}", "choices": [choice]}
        finish: dict[str, Any] = {"type": "length", "length": request.done}
        if request.abort:
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        meta = {
            "id": str(request.id),
            "finish_reason": finish,
            "completion_tokens": request.done,
            "weight_version": self.b.weight_version,
        }
        return 200, {"text": text, "output_ids": list(range(request.done)), "meta_info": meta}

    # -- pausing ---------------------------------------------------------------------------------
    def _abort_running(self) -> None:
        for request in self.running.values():
            request.abort = True
        self.cond.notify_all()

    def _hold(self, mode: str, *, retract: bool) -> None:
        self.held = mode
        held = [r for r in self.running.values() if r.done < r.tokens]
        self.counts["retracted" if retract else "held"] += len(held)

    def sglang_pause(self, mode: str) -> None:
        with self.cond:
            if self.v < (0, 5, 6):  # any mode: abort, answered at once
                self.gate = True
                self._abort_running()
                return
            while self.cond_busy or self.paused_updates:
                self.cond.wait()
            self.gate = True
            if mode != "abort":
                self._hold(mode, retract=mode == "retract")
                return
            self.cond_busy = True  # the drain below holds SGLang's pause condition
        try:
            while True:
                with self.cond:
                    self._abort_running()
                    if self.readers == 0:
                        return
                time.sleep(self.b.abort_poll_s)
        finally:
            with self.cond:
                self.cond_busy = False
                self.cond.notify_all()

    def vllm_pause(self, mode: str, *, clear_cache: bool) -> None:
        with self.cond:
            if self.v < (0, 17) and (self.gate or self.held):
                return  # "if self._paused: return"
            self.vllm_mode = mode
            if mode == "keep":
                self.gate = True  # (new ones queue)
                self._hold("keep", retract=clear_cache and self.v >= (0, 17))
                return
            self.gate = True
            if mode == "abort":
                self._abort_running()
            while self.running:  # abort and wait answer once the engine is idle
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            while self.cond_busy or self.paused_updates:  # (SGLang's pause condition is held)
                self.cond.wait()
            self.gate, self.held, self.vllm_mode = False, None, None
            self.cond.notify_all()

    # -- the update ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around an update: SGLang's writer lock (after every generation in flight), or from
        0.5.11 while paused its pause condition (a continue waits for the update); vLLM's RPC
        takes neither. Updates do not wait for one another here, as SGLang's would: a worker
        a cancelled push left behind must not hold the restore after it."""
        if self.kind == "vllm":
            yield
            return
        with self.cond:
            paused_path = self.v >= (0, 5, 11) and self.gate
            if paused_path:
                self.paused_updates += 1
            else:
                self.writers_waiting += 1
                while self.readers:
                    self.cond.wait()
                self.writers_waiting -= 1
                self.writing += 1
        try:
            yield
        finally:
            with self.cond:
                if paused_path:
                    self.paused_updates -= 1
                else:
                    self.writing -= 1
                self.cond.notify_all()

    def flush_refusal(self, flush_cache: bool) -> str | None:
        """After an SGLang update: None (flushed, or not asked), "crash" (the server died, before
        0.5.22) or the 400's message (0.5.22+: the weights applied, the version not)."""
        if self.kind != "sglang" or not flush_cache:
            return None
        with self.cond:
            unfinished = any(r.done < r.tokens for r in self.running.values())
            in_place = self.held == "in_place" and unfinished
            queued = self.held == "retract" and unfinished and (0, 5, 10) <= self.v < (0, 5, 21)
        if not (in_place or queued):
            return None
        return FLUSH_REFUSED if self.v >= (0, 5, 22) else "crash"


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _sglang_error(message: str) -> dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


# -- for tests: generations in flight, from the outside ----------------------------------------

FOREVER = 10**6  # tokens: a generation that ends when the test ends it (finish_all)


def start(endpoint: str, generations: Generations, count: int) -> tuple[list[Any], list[Any]]:
    """`count` generations against the server at `endpoint` (whose Generations is
    `generations`), running until `finish_all`: (their threads, their answers once they came),
    once every one runs."""
    import httpx

    vllm = generations.kind == "vllm"
    path, body = (
        ("/v1/completions", {"prompt": "x", "max_tokens": FOREVER})
        if vllm
        else ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": FOREVER}})
    )
    answers: list[Any] = []
    before = generations.snapshot()["running"]

    def one() -> None:
        answers.append(httpx.post(endpoint + path, json=body, timeout=300).json())

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while generations.snapshot()["running"] < before + count:
        if time.monotonic() > deadline:
            raise AssertionError("the generations did not start within 60 s")
        time.sleep(0.01)
    return threads, answers


@contextlib.contextmanager
def in_flight(endpoint: str, generations: Generations, count: int) -> Iterator[list[Any]]:
    """`count` generations in flight for the whole block, then ended; their answers."""
    threads, answers = start(endpoint, generations, count)
    try:
        yield answers
    finally:
        generations.finish_all()
        for t in threads:
            t.join(timeout=60)
