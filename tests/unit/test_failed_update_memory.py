"""Issue 13: a failed update must not keep what checkpoint-engine's failing frames hold.

checkpoint-engine's `_update_per_bucket` keeps its GPU transfer buffers (24 GiB with the
default bucket) in local variables; a traceback of its exception keeps those frames alive.
Here a stand-in for that method holds a sentinel object the same way, and the tests check
that once ckptctl has turned the failure into its own error, nothing holds the sentinel -
even while the caller still holds the error (as a serve loop's result, a variable...).
The GPU test (test_gpu_serve.py) checks the real buffers with nvidia-smi.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from ckptctl.ce.session import ParameterServerSession, drop_frames
from ckptctl.errors import OperationFailed


class TransferBuffer:
    """Stands in for a GPU tensor: only its lifetime matters here."""


class FailingParameterServer:
    """checkpoint-engine's ParameterServer as far as `update` goes: it raises from deep inside,
    with its buffers in the failing frame's locals."""

    def __init__(self) -> None:
        self.buffer_ref: weakref.ref[TransferBuffer] | None = None

    def update(self, name: str, req_func: object, ranks: object = None) -> None:
        self._update_per_bucket()

    def _update_per_bucket(self) -> None:
        buffer = TransferBuffer()  # noqa: F841 - held by this frame, like the real one's
        self.buffer_ref = weakref.ref(buffer)
        raise RuntimeError("Failed to update weights due to remote errors")


class _BuiltGroup:
    seconds = 0.0

    def wait(self, timeout_s: float) -> None:
        pass


def _session(ps: object) -> ParameterServerSession:
    """A session around a stand-in PS (the real constructor needs CUDA)."""
    session = object.__new__(ParameterServerSession)
    session.ps = ps  # type: ignore[assignment]
    session.sockets = []
    session._group = _BuiltGroup()  # type: ignore[assignment]
    session._io_timeout = lambda: 10.0
    return session


def test_the_error_of_a_failed_update_does_not_hold_its_buffers(monkeypatch) -> None:
    import ckptctl.ce.session as module

    released = []
    monkeypatch.setattr(module, "release_transfer_memory", lambda: released.append(True))
    ps = FailingParameterServer()
    monkeypatch.setattr(ParameterServerSession, "device_uuid", property(lambda self: "GPU-x"))
    with pytest.raises(OperationFailed) as info:
        _session(ps).update("ckpt", lambda paths: None, None)
    error = info.value  # the caller keeps the error, as serve keeps a push's result
    gc.collect()
    assert ps.buffer_ref is not None and ps.buffer_ref() is None, (
        "the failing frame's buffer lives on"
    )
    assert error.__cause__ is None and error.__context__ is None
    assert "Failed to update weights due to remote errors" in str(error)
    assert error.debug_traceback and "_update_per_bucket" in error.debug_traceback
    assert released == [True]  # GPU memory is handed back once the frames are gone


def test_drop_frames_lets_go_of_a_whole_chain() -> None:
    refs = []

    def inner() -> None:
        buffer = TransferBuffer()
        refs.append(weakref.ref(buffer))
        raise RuntimeError("inner")

    def outer() -> None:
        try:
            inner()
        except RuntimeError as exc:
            buffer = TransferBuffer()
            refs.append(weakref.ref(buffer))
            raise OperationFailed("outer") from exc

    try:
        outer()
    except OperationFailed as exc:
        kept = exc
    drop_frames(kept)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert str(kept) == "outer" and str(kept.__cause__) == "inner"  # the messages stay
