"""The words every layer shares for what a command was asked: one enum per set of values, and
one name per setting that a message may tell the operator to change (`Setting`). The CLI offers
the value sets as flag choices as they are (what each value means is the flag's help, in
cli/_options.py); they are str-valued, so a JSON result shows the same words. A setting is
spelled as a flag in one place, `Setting.flag`, for the messages; inside ckptctl it travels by
its name. No imports beyond the standard library: the CLI starts fast.
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A str-valued enum that prints as its value (also in f-strings, on every Python)."""

    def __str__(self) -> str:
        return str(self.value)


class ServerKind(Word):
    """Which inference server speaks at an endpoint (`--engine`)."""

    sglang = "sglang"
    vllm = "vllm"


class ReadyCondition(Word):
    """What `wait-ready --for` waits for."""

    listening = "listening"
    healthy = "healthy"


class SplitMode(Word):
    """How a checkpoint is split across ranks (`--split`)."""

    auto = "auto"
    files = "files"
    tensors = "tensors"


class RegisterMode(Word):
    """How a rank's share reaches pinned memory."""

    ce_copy = "engine"  # checkpoint-engine copies it from the file mapping (--register-mode engine)
    direct = "direct"  # read straight into buffers pinned in place (host_memory/_cuda_pinning.py)
    consume = "consume"  # --consume-shm-files: /dev/shm files pinned in place, then deleted


class UpdateMethod(Word):
    broadcast = "broadcast"
    p2p = "p2p"
    all = "all"  # broadcast, then p2p

    @property
    def broadcasts(self) -> bool:
        return self is not UpdateMethod.p2p

    @property
    def uses_p2p(self) -> bool:
        return self is not UpdateMethod.broadcast


class Verify(Word):
    """A way to prove what the servers hold (the words of a result's `"verified"`; what each
    proves, in words: weights_checker.VERIFY_HOWS)."""

    checksum = "checksum"
    per_server = "per-engine"
    round_trip = "round-trip"


# What each flag accepts, strongest first: the servers' offers decide among them.
VERIFY = (Verify.checksum, Verify.per_server)  # --verify
ROUND_TRIP = (Verify.round_trip,)  # --verify-round-trip


class P2P(Word):
    """Whether the parameter server starts checkpoint-engine's p2p store (mooncake)."""

    off = "off"  # never imported
    optional = "optional"  # used if it starts (a joinable metas file)
    required = "required"  # p2p/all updates, join


class Setting(Word):
    """A setting that bounds a wait, by its one name inside ckptctl; `flag` is what a message
    tells the operator to raise (the command line's spelling)."""

    timeout = "timeout"  # update, join, save-metas, wait-ready: the whole command
    push_timeout = "push_timeout"  # serve: each push
    server_wait = "server_wait"  # serve: a push's wait for a server that does not answer
    server_start_wait = "server_start_wait"  # serve: the first push's, for one that starts
    restore_wait = "restore_wait"  # serve: a restore's own short wait (no flag sets it)

    @property
    def flag(self) -> str:
        return _FLAGS[self]


_FLAGS = {
    Setting.timeout: "--timeout",
    Setting.push_timeout: "serve --push-timeout",
    Setting.server_wait: "serve --server-wait",
    Setting.server_start_wait: "serve --server-start-wait",
    Setting.restore_wait: "a restore's wait",
}


class PauseMode(Word):
    """What the inference servers do with the generations in flight while a push lands
    (docs/pause-contract.md): none is the server's own behaviour (SGLang's update waits for
    them; vLLM's runs beside them); the others are the server's own pause modes."""

    none = "none"
    abort = "abort"  # both: end them (finish reason "abort")
    retract = "retract"  # SGLang: back to the queue, recomputed under the new weights
    in_place = "in_place"  # SGLang: held with their KV cache, continued after
    wait = "wait"  # vLLM: take no new ones, let those running finish
    keep = "keep"  # vLLM: held, recomputed under the new weights (its clear_cache default)


# The modes each kind of server (--engine) has.
PAUSE_MODES: dict[ServerKind, tuple[PauseMode, ...]] = {
    ServerKind.sglang: (PauseMode.none, PauseMode.abort, PauseMode.retract, PauseMode.in_place),
    ServerKind.vllm: (PauseMode.none, PauseMode.abort, PauseMode.wait, PauseMode.keep),
}
