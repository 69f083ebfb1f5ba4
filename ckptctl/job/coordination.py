"""Keeping every rank of a job bounded: a shared abort flag, heartbeats, and a watchdog.

checkpoint-engine's waits are long or endless (10-minute store and NCCL timeouts, a zmq REQ
socket that blocks forever when nobody connects, HTTP errors lost in a thread). So every rank
runs a watchdog thread that ends the process itself - `os._exit`, the only way out of a thread
stuck inside NCCL or zmq - when:

- the command's `--timeout` runs out (exit 4);
- this rank recorded a failure (the HTTP request, the receiver's reply...) (its exit code);
- another rank did: failures are published in torchrun's own TCP store, no home-made network;
- a peer stopped sending heartbeats (it died on another node, or hangs);
- SIGTERM/SIGINT arrived while the main thread is blocked in C code (torchrun tearing down).

The store is torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) or, for other launchers,
one that rank 0 hosts on MASTER_PORT; checkpoint-engine itself uses MASTER_PORT+1.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ckptctl import results
from ckptctl.errors import (
    CkptctlError,
    DeadlineExceeded,
    ExitCode,
    Interrupted,
    error_for,
    print_error,
)
from ckptctl.launch import LaunchInfo
from ckptctl.settings import Setting

HEARTBEAT_INTERVAL_S = 1.0
# How far past the job's deadline our own bounded waits (store barriers, zmq) may run: the
# watchdog, which ends the job with exit 4 and names the stage that ran out, must go first.
PAST_DEADLINE_S = 5.0


def _store_prefix() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ckptctl/{run_id}/{restart}/"


FAILURE_CODES = frozenset({ExitCode.FAILED, ExitCode.INVALID_INPUT, ExitCode.TIMEOUT, 130})


def _notice(raw: bytes | str, text_field: str, what: str) -> tuple[dict[str, Any], Any, str]:
    """(document, rank, text) of a notice read from the store: the rank an int (else "?"),
    the text one clean line (no terminal escapes reach the operator's screen)."""
    from ckptctl.inference_server import one_line

    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        doc = {text_field: f"an unreadable {what} notice in the job's store"}
    rank, text = doc.get("rank"), doc.get(text_field)
    rank = rank if type(rank) is int and rank >= 0 else "?"
    return doc, rank, one_line(text if isinstance(text, str) else "", 2000) or "no reason given"


def read_abort(raw: bytes | str) -> dict[str, Any]:
    """An abort document as read from the store, which anyone who reaches its port can write:
    trusted for no more than "the job failed". A code that is not a failure code becomes 1 (a
    forged 0 once ended `update` with exit 0 and `"ok": true`), the rank an int, the message
    one clean line."""
    doc, rank, message = _notice(raw, "message", "abort")
    code = doc.get("code")
    return {
        "code": code if type(code) is int and code in FAILURE_CODES else int(ExitCode.FAILED),
        "rank": rank,
        "message": message,
        # Given up on request (a stop, a client's cancel), not because a rank failed.
        "request": doc.get("request") is True,
    }


def describe_abort(abort: dict[str, Any]) -> str:
    """An abort notice (read_abort's) as one line for the error it causes."""
    if abort["request"]:
        return str(abort["message"])
    return f"rank {abort['rank']} failed: {abort['message']}"


def abort_error(abort: dict[str, Any]) -> CkptctlError:
    """The error a rank raises when its job (or push) was given up: the notice's exit code."""
    return error_for(abort["code"], describe_abort(abort))


def read_stop(raw: bytes | str, world_size: int) -> dict[str, Any]:
    """A stop notice as read from the store: as forgeable as an abort (see `Coordinator.stopped`),
    its rank one of the job's (else "?") and its reason one clean line."""
    _, rank, reason = _notice(raw, "reason", "stop")
    return {"rank": rank if rank != "?" and rank < world_size else "?", "reason": reason}


class StoppedByPeer(Interrupted):
    """This rank read a stop from the job's store, and got no signal itself: it ends as
    interrupted (130), never as a success, and tells no one (every rank reads the stop)."""


class Coordinator:
    """Cross-rank signals kept in a torch.distributed store."""

    def __init__(
        self,
        store: Any,
        launch: LaunchInfo,
        *,
        scope: str = "",
        address: tuple[str, int, str] | None = None,
    ) -> None:
        self.store = store
        self.launch = launch
        self.scope = scope  # set for a scoped view: its waits also end on its own abort key
        self._address = address  # (host, port, key prefix) of the store, to connect again
        self._scopes: dict[str, Coordinator] = {}  # views not yet dropped (drop_scope)
        self._written: set[str] = set()  # the keys this rank wrote through this view
        self._dropped = False
        self._keys_lock = threading.Lock()

    def second_connection(self) -> Any:
        """The same store through a client of its own, for a thread that blocks in it (the
        NCCL group's rendezvous). A client serves its calls one at a time: on the shared one,
        the watchdog's abort checks and heartbeats would wait behind that block, and a rank
        whose peer failed before the rendezvous would never hear of it."""
        if self._address is None:
            return self.store
        from torch.distributed import PrefixStore, TCPStore

        host, port, prefix = self._address
        client = TCPStore(host, port, None, False, timeout=timedelta(minutes=10))
        return PrefixStore(prefix, client) if prefix else client

    def scoped(self, name: str) -> Coordinator:
        """A view whose keys live under `name/` (one per push of a long-lived job), so that
        keys of one push never answer the waits of the next."""
        from torch.distributed import PrefixStore

        view = Coordinator(PrefixStore(f"{name}/", self.store), self.launch, scope=name)
        self._scopes[name] = view
        return view

    def drop_scope(self, name: str) -> int:
        """Delete the keys this rank wrote in scope `name` (a long-lived job would otherwise
        grow its store by every push's keys); returns how many were there. Call it once no
        rank can still read them - every rank is past that push - on every rank: each deletes
        its own. Writes through the view afterwards (a late thread's abort) are dropped."""
        view = self._scopes.pop(name, None)
        if view is None:
            return 0
        with view._keys_lock:
            view._dropped = True
            keys = sorted(view._written)
            view._written.clear()
        deleted = 0
        for key in keys:
            # A key left behind is no reason to stop serving.
            with contextlib.suppress(Exception):
                deleted += bool(view.store.delete_key(key))
        return deleted

    def _writes(self, key: str) -> bool:
        """Record that this rank writes `key` (drop_scope deletes it); False once dropped."""
        with self._keys_lock:
            if self._dropped:
                return False
            self._written.add(key)
            return True

    @classmethod
    def local(cls, launch: LaunchInfo) -> Coordinator:
        """A store of our own for a job of one process (a long-lived job still needs one):
        in memory, with no port. A TCPStore listens on every interface, and anyone who
        reached it could end the job. Its waits release the store to other threads, so the
        one store serves as its own second connection."""
        from torch.distributed import HashStore

        return cls(HashStore(), launch)

    @classmethod
    def connect(cls, launch: LaunchInfo, timeout_s: float) -> Coordinator | None:
        """Join the job's store; None for a single process (nothing to coordinate)."""
        if launch.world_size <= 1:
            return None
        from torch.distributed import PrefixStore, TCPStore

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        is_master = launch.rank == 0 and not agent_store
        store = TCPStore(
            host,
            port,
            launch.world_size if is_master else None,
            is_master,
            timeout=timedelta(seconds=max(timeout_s, 1.0)),
            wait_for_workers=False,
        )
        return cls(
            PrefixStore(_store_prefix(), store), launch, address=(host, port, _store_prefix())
        )

    # -- abort -----------------------------------------------------------------------------------
    def publish_abort(self, code: int, message: str, *, request: bool = False) -> None:
        """Give up the job (or, on a scoped view, the push): `request` when it is asked for (a
        stop, a cancel), not because something failed."""
        fields = {"code": int(code), "message": message, "rank": self.launch.rank}
        doc = json.dumps({**fields, "request": True} if request else fields)
        if not self._writes("abort"):
            return  # the push is over on every rank: nobody reads it any more
        # First failure wins: later ones are usually consequences of it.
        self.store.compare_set("abort", "", doc)

    def aborted(self) -> dict[str, Any] | None:
        if not self.store.check(["abort"]):
            return None
        raw = self.store.get("abort")
        return read_abort(raw) if raw else None

    # -- a job-wide stop (serving ends) ----------------------------------------------------------
    # A signal to one rank stops every rank: that rank publishes the stop, the others read it.
    # Whoever reaches the store's port can write one too, and nothing in the store tells the two
    # apart. So only a rank's own signal (or its own --sleep-time) ends it with success; a rank
    # that only read the stop ends with 130 (stages.hold_for_joiners), its reason one clean line.
    def publish_stop(self, reason: str) -> None:
        self.store.compare_set("stop", "", json.dumps({"reason": reason, "rank": self.launch.rank}))

    def stopped(self) -> dict[str, Any] | None:
        if not self.store.check(["stop"]):
            return None
        return read_stop(self.store.get("stop"), self.launch.world_size)

    # -- heartbeats --------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(f"hb/{self.launch.rank}", 1)

    def beats(self, rank: int) -> int:
        return int(self.store.add(f"hb/{rank}", 0))

    # -- barriers ------------------------------------------------------------------------------------
    def barrier(self, name: str, timeout_s: float) -> None:
        """Every rank reaches `name` (bounded; the watchdog ends us sooner on a failure)."""
        key = f"{name}/{self.launch.rank}"
        self._writes(key)
        self.store.set(key, "1")
        self._wait_for([f"{name}/{r}" for r in range(self.launch.world_size)], timeout_s)

    def _wait_for(self, keys: list[str], timeout_s: float) -> None:
        """Poll with short `check` calls, never a blocking `wait`: the store client serialises
        its calls, and a long wait would starve the watchdog's heartbeats on the same client."""
        deadline = time.monotonic() + max(timeout_s, 1.0)
        # The others are usually a few milliseconds behind: look again soon, then less often
        # (a fixed 50 ms pause would add up to that much to every wait of every push).
        pause = 0.001
        while not self.store.check(keys):
            if self.scope:
                abort = self.aborted()
                if abort is not None:  # this push was given up: so do we
                    raise abort_error(abort)
            if time.monotonic() > deadline:
                what = keys[0].rsplit("/", 1)[0]
                raise DeadlineExceeded(f"timed out waiting for every rank to reach {what}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- figures -------------------------------------------------------------------------------------
    def publish(self, key: str, doc: dict[str, Any]) -> None:
        self._writes(f"{key}/{self.launch.rank}")
        self.store.set(f"{key}/{self.launch.rank}", json.dumps(doc))

    def collect(self, key: str, timeout_s: float) -> list[dict[str, Any]]:
        keys = [f"{key}/{r}" for r in range(self.launch.world_size)]
        self._wait_for(keys, timeout_s)
        return [json.loads(self.store.get(k)) for k in keys]


def _ignore_in_main_thread(signum: int, frame: Any) -> None:
    """Installed while a watchdog runs: it reads the signal from the wakeup fd and ends the rank."""


class Watchdog:
    """Ends this process, with one error line and the right exit code, when a wait must end."""

    def __init__(
        self,
        launch: LaunchInfo,
        coordinator: Coordinator | None,
        *,
        timeout_s: float,
        timeout_flag: str = Setting.timeout.flag,
        stale_after_s: float = 30.0,
        describe_stage: Callable[[], str] = lambda: "",
    ) -> None:
        self.launch = launch
        self.coordinator = coordinator
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.timeout_flag = timeout_flag  # what the timeout's line tells the operator to raise
        self.stale_after_s = stale_after_s
        self.describe_stage = describe_stage
        self._failure: tuple[int, str] | None = None
        # (when, code, message): a last resort that ends this rank at `when` whatever it is doing.
        self._end_at: tuple[float, int, str] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ckptctl-watchdog", daemon=True)
        self._wakeup_r, self._wakeup_w = os.pipe()
        self._exiting = False
        self._old_handlers: dict[int, Any] = {}
        # While set, SIGTERM/SIGINT call this instead of ending the rank (a server job that
        # shuts down cleanly on a signal).
        self.on_signal: Callable[[signal.Signals], None] | None = None
        # Run once, however this rank ends (os._exit skips every `finally`): each is bounded
        # and must not raise (the servers a push paused are resumed: transfer/pausing.py).
        self._exit_hooks: list[Callable[[], None]] = []

    # -- called from any thread ------------------------------------------------------------------
    def fail(self, code: int, message: str) -> None:
        """Record a failure of this rank; the watchdog ends the job promptly."""
        with self._lock:
            if self._failure is None:
                self._failure = (int(code), message)
        os.write(self._wakeup_w, b"f")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def end_at(self, when: float, code: int, message: str) -> None:
        """End this rank at `when` (time.monotonic) unless it has ended by then (a serve job
        told to stop, whose push under way may not end on its own)."""
        with self._lock:
            if self._end_at is None or when < self._end_at[0]:
                self._end_at = (when, int(code), message)

    def add_exit_hook(self, hook: Callable[[], None]) -> None:
        with self._lock:
            self._exit_hooks.append(hook)

    def run_exit_hooks(self) -> None:
        """Run the exit hooks, each once (this rank is ending); one that fails is skipped."""
        with self._lock:
            hooks, self._exit_hooks = self._exit_hooks, []
        for hook in hooks:
            with contextlib.suppress(Exception):
                hook()

    def exit_on_signal(self, sig: signal.Signals) -> None:
        """End this rank now, as a signal does when nobody handles it (a second SIGTERM)."""
        self._exit_on_signal(sig)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        # A signal's C handler writes to the wakeup fd at once, even while the main thread is
        # stuck in NCCL or zmq and its Python handler cannot run.
        if threading.current_thread() is threading.main_thread():
            os.set_blocking(self._wakeup_w, False)
            signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)
            # The watchdog thread acts on the signal; the main thread just carries on until then.
            self._old_handlers = {
                sig: signal.signal(sig, _ignore_in_main_thread)
                for sig in (signal.SIGTERM, signal.SIGINT)
            }
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wakeup_w, b"s")
        self._thread.join(timeout=2)
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # noqa: BLE001 - an unwatched rank could wait forever
            self._exit(ExitCode.FAILED, f"the watchdog failed: {type(exc).__name__}: {exc}")

    def _watch(self) -> None:
        last_beat = 0.0
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.is_set():
            ready, _, _ = select.select([self._wakeup_r], [], [], 0.1)
            if self._stop.is_set():
                return
            if ready:
                data = os.read(self._wakeup_r, 64)
                for byte in data:
                    if byte in (signal.SIGTERM, signal.SIGINT):
                        if self.on_signal is not None:
                            self.on_signal(signal.Signals(byte))
                        else:
                            self._exit_on_signal(signal.Signals(byte))
            if self._failure is not None:
                code, message = self._failure
                self._exit(code, message, publish=True)
            if self._end_at is not None and time.monotonic() >= self._end_at[0]:
                _, code, message = self._end_at
                self._exit(code, message, publish=True)
            if self.remaining() <= 0:
                stage = self.describe_stage()
                where = f" during {stage}" if stage else ""
                self._exit(
                    ExitCode.TIMEOUT,
                    f"timed out after {self.timeout_s:g}s{where}; raise {self.timeout_flag} if "
                    "the server or the checkpoint is just slow",
                    publish=True,
                )
            if self.coordinator is None:
                continue
            try:
                abort = self.coordinator.aborted()
                if abort is not None:
                    self._exit(abort["code"], describe_abort(abort))
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_INTERVAL_S:
                    last_beat = now
                    self.coordinator.beat()
                    self._check_peers(seen, now)
            except Exception as exc:  # noqa: BLE001 - the store itself is gone
                if self._stop.is_set():
                    return
                self._exit(
                    ExitCode.FAILED,
                    f"lost contact with the job's store ({type(exc).__name__}): "
                    "another rank or the torchrun agent probably died",
                )

    def _check_peers(self, seen: dict[int, tuple[int, float]], now: float) -> None:
        """Rank 0 watches everyone; the others watch rank 0 (who publishes an abort)."""
        assert self.coordinator is not None
        peers = range(1, self.launch.world_size) if self.launch.rank == 0 else (0,)
        for peer in peers:
            count = self.coordinator.beats(peer)
            last_count, since = seen.get(peer, (-1, now))
            if count != last_count:
                seen[peer] = (count, now)
            elif now - since > self.stale_after_s:
                self._exit(
                    ExitCode.FAILED,
                    f"rank {peer} stopped responding (no heartbeat for {now - since:.0f}s); "
                    "it probably died - see its log",
                    publish=True,
                )

    def _exit_on_signal(self, sig: signal.Signals) -> None:
        abort = None
        if self.coordinator is not None:
            try:
                abort = self.coordinator.aborted()
            except Exception:  # noqa: BLE001
                abort = None
        if abort is not None:
            self._exit(abort["code"], describe_abort(abort))
        self._exit(ExitCode.INTERRUPTED, f"interrupted by {sig.name}")

    def _exit(self, code: int, message: str, *, publish: bool = False) -> None:
        with self._lock:
            if self._exiting:
                return
            self._exiting = True
        code = int(code) or ExitCode.FAILED  # this path only ever ends a job that failed
        try:
            # Each step is best effort: a closed stderr or stdout (EPIPE) must not keep this
            # rank from ending.
            with contextlib.suppress(Exception):
                print_error(message)  # first: torchrun may SIGKILL us soon after a peer exits
            with contextlib.suppress(Exception):
                results.write_failure(code, message)
            with contextlib.suppress(Exception):
                if sys.stderr.isatty():
                    # A live display hid the cursor; os._exit skips its cleanup.
                    sys.stderr.write("\x1b[?25h")
            if publish and self.coordinator is not None:
                with contextlib.suppress(Exception):
                    self.coordinator.publish_abort(code, message)
                    # Give peers a moment to read the reason before torchrun tears them down.
                    time.sleep(0.3)
            self.run_exit_hooks()  # (after the abort: the other ranks start on theirs meanwhile)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
        finally:
            os._exit(int(code))
