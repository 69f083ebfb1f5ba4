"""A serve push whose reading of the checkpoint overlaps its transfer to the server.

Without it a push reads the whole share into the pinned pool, then updates: read + copy. Here
the buffers are handed to checkpoint-engine as soon as the reader has them (the metas need
only names, shapes and offsets, never the bytes), the metas are gathered and the update starts
while the reader still fills them; each host-to-device copy waits, range by range, until the
reader has filled every byte it copies (host_memory.ReadProgress). The push then takes about
max(read, copy).

- `Gate` wraps checkpoint-engine's copy of a bucket out of the registered host memory
  (ce_internals.wrap_bucket_copy). For a checkpoint being read it copies range by range, in
  CHUNK pieces, each once filled, as the original copies them (non_blocking, then one
  synchronize); anything else goes to the original.
- A read that fails (or a push past its deadline) while the update runs: the gate copies
  nothing more and fails the push through the push's guard (PushFailure: every rank hears of
  it through the abort key, and the transfer is cancelled: the made-up error reply sends
  checkpoint-engine down its own error path on every rank, so the bucket being copied is never
  announced to the server's workers). No bucket announced: the server's weights are untouched.

Only buffers pinned before the read overlap (a serve pool's, from its second push on, without
p2p, where others may read the buffers); a first push and `update` (whose read already overlaps
`import torch` and the ParameterServer's start) read first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptctl.ce import internals as ce_internals
from ckptctl.errors import CkptctlError, ExitCode, OperationFailed
from ckptctl.observe import timeline

if TYPE_CHECKING:
    from ckptctl.ce import ParameterServerSession
    from ckptctl.job.runner import Job
    from ckptctl.transfer.host_memory import ShareReader

# One host-to-device copy at most: small enough that the copies follow the reader closely,
# large enough that the copy engine runs at its full rate.
CHUNK = 64 << 20
# How often a waiting copy looks at the push's deadline and whether it was cancelled.
POLL_S = 0.05
# How long a failed push waits for its reader to stop before the buffers go back to the pool.
STOP_READER_S = 30.0


class Gate:
    """checkpoint-engine's bucket copy, waiting for the reader of a checkpoint being read
    (`arm`); installed on the session's ParameterServer once, for the job."""

    def __init__(self, session: ParameterServerSession) -> None:
        self._ps = session.ps
        self._reading: dict[str, OverlappedRead] = {}
        self._original: Callable[..., None] = _no_copy
        ce_internals.wrap_bucket_copy(self._ps, self._wrap)

    def _wrap(self, original: Callable[..., None]) -> Callable[..., None]:
        self._original = original
        return self._copy

    def arm(self, read: OverlappedRead) -> None:
        self._reading[read.name] = read

    def disarm(self, name: str) -> None:
        self._reading.pop(name, None)

    def armed(self, name: str) -> bool:
        return name in self._reading

    def _copy(
        self, checkpoint_name: str, bucket: Any, buffer: Any, owner_rank: int | None = None
    ) -> None:
        started = time.perf_counter()
        read = self._reading.get(checkpoint_name)
        if read is None or owner_rank is not None or read.all_read():
            self._original(checkpoint_name, bucket, buffer, owner_rank)
            timeline.record("copy", timeline.COPIES, started, bytes=bucket.size)
            return
        assert read.reader is not None  # (armed once registered: `register`)
        progress, offset, waited = read.reader.progress, 0, 0.0
        for r in bucket.ranges:
            if offset + r.size > bucket.size:  # (checkpoint-engine's own assertion)
                raise AssertionError(f"offset {offset} + size {r.size} > bucket_size {bucket.size}")
            source = read.buffers[r.idx].buffer  # (the ones registered: `register`)
            for lo in range(0, r.size, CHUNK):
                n = min(CHUNK, r.size - lo)
                if progress.filled(r.idx) < r.offset + lo + n:  # (not read yet)
                    t = time.perf_counter()
                    if not read.wait_filled(r.idx, r.offset + lo + n):
                        return  # the push failed: nothing more is copied, nor announced
                    waited += time.perf_counter() - t
                buffer[offset + lo : offset + lo + n].data.copy_(
                    source[r.offset + lo : r.offset + lo + n], non_blocking=True
                )
            offset += r.size
        if offset != bucket.size:
            raise AssertionError(f"offset {offset} != bucket_size {bucket.size}")
        self._ps.device_manager.device_module.synchronize()
        # (--trace) `waited_s`: how long the copies waited for the read to fill their bytes
        timeline.record("copy", timeline.COPIES, started, bytes=bucket.size, waited_s=waited)


def _no_copy(*args: Any) -> None:
    raise AssertionError("the bucket copy was called before it was wrapped")


class OverlappedRead:
    """One push's read overlapping its transfer: `register` (Transfer's register_early hook)
    hands the buffers over before they are filled; then `finish` after the push, or `stop`
    after a failure, before the buffers go back to the pool."""

    def __init__(
        self,
        job: Job,
        session: ParameterServerSession,
        gate: Gate,
        on_failure: Callable[[int, str], None],
    ) -> None:
        self.job, self.session, self.gate = job, session, gate
        self.on_failure = on_failure  # the push's guard: fails it on every rank
        self.name = ""
        self.reader: ShareReader | None = None
        self.buffers: list[Any] = []  # the MemoryBuffers registered as `name`

    def register(self, name: str, reader: ShareReader) -> bool:
        """Register the reader's buffers as checkpoint `name` now, while it fills them, and
        arm the gate for them (True); False where they are not pinned yet (then they are
        registered once read)."""
        if not reader.pinned_ahead or self.session.p2p_enabled:
            return False
        # (No nbytes: the stage ends as the read begins; the update's figure carries the read.)
        with self.job.reporter.stage("register", "loading the shares") as st:
            self.buffers = reader.early_buffers()
            self.session.register_buffers(name, self.buffers)
            self.name, self.reader = name, reader
            self.gate.arm(self)
            st.detail = (
                f"direct registration, read overlapping the transfer ({reader.threads} reader "
                f"thread{'' if reader.threads == 1 else 's'})"
            )
        return True

    def all_read(self) -> bool:
        return self.reader is not None and self.reader.progress.done.is_set()

    def wait_filled(self, buffer: int, end: int) -> bool:
        """Wait until `buffer` is filled up to `end` (True), or fail the push (False)."""
        assert self.reader is not None
        progress = self.reader.progress
        if progress.filled(buffer) >= end:
            return True
        while True:
            if self.session.cancelled() is not None:
                return False  # the push failed elsewhere: its failure path is under way
            try:
                if progress.wait(buffer, end, POLL_S):
                    return True
            except CkptctlError as exc:
                self._fail(exc.exit_code, f"reading the checkpoint failed mid-push: {exc}")
                return False
            except Exception as exc:  # noqa: BLE001 - the reader's; one line for the push
                self._fail(ExitCode.FAILED, f"reading the checkpoint failed mid-push: {exc}")
                return False
            if self.job.watchdog.remaining() <= 0:
                self._fail(
                    ExitCode.TIMEOUT,
                    "reading the checkpoint did not keep up with the transfer within the push's "
                    "deadline; raise serve --push-timeout if the storage is just slow",
                )
                return False
            if self.reader.wait(0) and not progress.wait(buffer, end, 0):
                self._fail(ExitCode.FAILED, "the reader ended before filling the buffers")
                return False

    def _fail(self, code: int, message: str) -> None:
        self.on_failure(code, message)
        self.session.cancel(message)  # (a no-op when on_failure cancelled it already)

    def finish(self) -> None:
        """After the push: the reader is done (every byte was copied); what it raised after
        the read fails the push. The gate stays armed until the reader has ended (one that
        does not end is stopped by `stop` before its buffers go back to the pool)."""
        if self.reader is None or not self.gate.armed(self.name):
            return
        if not self.reader.wait(max(self.job.watchdog.remaining(), 1.0)):
            raise OperationFailed("reading the checkpoint did not end after its transfer")
        self.gate.disarm(self.name)
        self.reader.raise_if_failed()

    def stop(self) -> None:
        """A push failed: stop its reader before its buffers go back to the pool (a reader
        still writing into them would corrupt the next push)."""
        if self.reader is None or not self.gate.armed(self.name):
            return
        self.gate.disarm(self.name)
        self.reader.progress.stop()
        if not self.reader.wait(STOP_READER_S):
            self.job.watchdog.fail(
                ExitCode.FAILED,
                "the failed push's reader did not stop: the serve job ends rather than reuse "
                "buffers it may still write into",
            )
