"""mooncake, checkpoint-engine's p2p transport: blocked for broadcast (installed without RDMA,
it makes the ParameterServer's constructor raise for every method), checked where p2p is
asked for, and a failed read turned into the end of the transfer instead of a hang."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from ckptctl.errors import OperationFailed


def block_mooncake() -> None:
    """Make `import mooncake` fail with ImportError, which checkpoint-engine treats as 'no p2p'."""
    for name in ("mooncake", "mooncake.engine"):
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]


def prefer_system_unwinder() -> None:
    """Put the system's libgcc_s in the global symbol scope before mooncake loads: its wheel
    bundles libunwind, and a C++ exception inside mooncake (a refused connection to a holder
    that is gone) unwound half by each would abort the process instead of returning an error."""
    import ctypes

    with contextlib.suppress(OSError):  # no such library (not glibc): nothing to prefer
        ctypes.CDLL("libgcc_s.so.1", mode=ctypes.RTLD_GLOBAL)


def p2p_missing() -> str | None:
    """Why p2p cannot work here, or None when it can (mooncake and an RDMA device)."""
    try:
        found = importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "mooncake is not installed (pip install 'ckptctl[p2p]': checkpoint-engine[p2p])"
    if not (
        glob.glob("/sys/class/infiniband/*")
        or os.environ.get("PS_P2P_STORE_RDMA_DEVICES")
        or os.environ.get("NCCL_IB_HCA")
    ):
        return "no RDMA device (/sys/class/infiniband is empty and no NCCL_IB_HCA is set)"
    return None


def watch_p2p_reads(store: Any, on_failed_read: Callable[[str], None]) -> None:
    """Make a failed p2p read of checkpoint-engine's `P2PStore` call `on_failed_read` (with one
    line that names the holder) before it raises: checkpoint-engine would then join the request
    thread, whose server's worker waits for the next bucket with no timeout (a hang)."""
    read = store.batch_transfer_sync_read

    def checked_read(target: str, buf_ptrs: Any, remote_ptrs: Any, lens: Any) -> Any:
        try:
            return read(target, buf_ptrs, remote_ptrs, lens)
        except Exception as exc:  # noqa: BLE001 - mooncake's failure is a bare AssertionError
            why = f": {type(exc).__name__}: {exc}" if str(exc) else ""
            message = (
                f"p2p read of {sum(lens)} bytes from the holder at {target} failed{why} "
                "(the holder is gone, or its network is unreachable)"
            )
            on_failed_read(message)
            raise OperationFailed(message) from None

    store.batch_transfer_sync_read = checked_read
