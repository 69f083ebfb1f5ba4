"""Pinning host memory in place for CUDA, and undoing it: with flags 0, as checkpoint-engine's
in-place pinning does (its unpinning checks them), through ctypes (which lets go of the GIL,
unlike torch's binding), before torch is imported through the CUDA driver (`DriverPin`).
Memory that cannot be unpinned is never freed."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ckptctl.errors import OperationFailed, print_error

if TYPE_CHECKING:
    import torch


def pin_in_place(buffer: torch.Tensor) -> None:
    """cudaHostRegister with flags 0, looked up in the process (where torch loads the CUDA
    runtime globally) and called without the GIL; torch's binding where it is not found."""
    import torch

    register = _runtime_function("cudaHostRegister")
    if register is not None:
        err = register(buffer.data_ptr(), buffer.numel(), 0)
    else:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if err != 0:
        raise OperationFailed(
            f"cannot pin {buffer.numel()} bytes of host memory (CUDA error {err})"
        )


@functools.cache
def _runtime_function(name: str) -> Any:
    """A CUDA runtime function from the process's global symbols, or None (no CUDA loaded)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    return function


class DriverPin:
    """Pinning through the CUDA driver before torch is imported (the share is read long before
    `import torch` ends), in the rank's GPU's primary context - the one the CUDA runtime takes
    up later. None from `for_rank` without a driver or GPU: the caller pins once torch is there,
    as it does after `release` where `is_torchs_gpu` says torch gives the rank another GPU."""

    _SUCCESS = 0
    _PCI_BUS_ID, _PCI_DEVICE_ID, _PCI_DOMAIN_ID = 33, 34, 50  # CUdevice_attribute

    def __init__(self, lib: Any, register: Any, release: Any, device: int, ordinal: int) -> None:
        self._lib, self._register, self._release = lib, register, release
        self.device, self.ordinal = device, ordinal
        self.pinned: list[int] = []  # the addresses pinned here, in order

    @classmethod
    def for_rank(cls, rank: int) -> DriverPin | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        try:
            c_int = ctypes.c_int
            if lib.cuInit(0) != cls._SUCCESS:
                return None
            count = c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != cls._SUCCESS or count.value < 1:
                return None
            ordinal = rank % count.value  # checkpoint-engine's rule (local_device_index)
            device = c_int(0)
            if lib.cuDeviceGet(ctypes.byref(device), ordinal) != cls._SUCCESS:
                return None
            release = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None)
            release = release or lib.cuDevicePrimaryCtxRelease
            release.argtypes = [c_int]
            context = ctypes.c_void_p()
            if lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != cls._SUCCESS:
                return None
            if lib.cuCtxSetCurrent(context) != cls._SUCCESS:  # (this thread only)
                release(device)
                return None
            register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
            register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            register.restype = c_int
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        except AttributeError:  # a driver without one of these calls
            return None
        return cls(lib, register, release, device.value, ordinal)

    def pin(self, address: int, size: int) -> bool:
        """cuMemHostRegister with flags 0 (checkpoint-engine's unpinning reads them back)."""
        if not size or self._register(address, size, 0) != self._SUCCESS:
            return False
        self.pinned.append(address)
        return True

    def unpin_all(self) -> list[int]:
        """Undo every `pin`; returns the positions (in `pinned`) of those the driver would not
        unpin: that memory is still registered and must stay mapped (keep_registered)."""
        failed = [
            i
            for i, address in enumerate(self.pinned)
            if self._lib.cuMemHostUnregister(address) != self._SUCCESS
        ]
        self.pinned = []
        return failed

    def release(self) -> None:
        """Drop this thread's hold on the device's primary context (after `unpin_all`)."""
        self._lib.cuCtxSetCurrent(None)
        self._release(self.device)

    def pci_address(self) -> tuple[int, int, int]:
        values = []
        for attribute in (self._PCI_DOMAIN_ID, self._PCI_BUS_ID, self._PCI_DEVICE_ID):
            value = ctypes.c_int(-1)
            self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, self.device)
            values.append(value.value)
        return values[0], values[1], values[2]

    def is_torchs_gpu(self, rank: int) -> bool:
        """Whether torch gives `rank` this device: the same ordinal by torch's count (which
        may come from NVML) and the same PCI address. Any error says no."""
        import torch

        from ckptctl.job.process_group import local_device_index

        try:
            index = local_device_index(rank)
            props = torch.cuda.get_device_properties(index)
        except (RuntimeError, AssertionError, ZeroDivisionError):
            return False
        names = ("pci_domain_id", "pci_bus_id", "pci_device_id")  # (torch >= 2.4 has them)
        pci = tuple(getattr(props, n, None) for n in names)
        return index == self.ordinal and pci == self.pci_address()


def torch_is_imported() -> bool:
    """Whether `import torch` has finished (not only begun: its spec says `_initializing`)."""
    module = sys.modules.get("torch")
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def import_torch() -> float | None:
    """Import torch; the seconds that took (or that waiting for another thread's import took),
    None where it had been imported already."""
    if torch_is_imported():
        return None
    started = time.perf_counter()
    import torch  # noqa: F401

    return time.perf_counter() - started


# Host memory that could not be unpinned: never unmapped while CUDA has it registered (the
# system could hand its pages out again, a later registration would collide with it).
kept_registered: list[Any] = []


def keep_registered(memory: Any, nbytes: int, why: str) -> None:
    """Keep `memory` mapped for good, and say so (a failed unpin is a leak, not a crash)."""
    kept_registered.append(memory)
    print_error(
        f"could not unpin {nbytes} bytes of host memory ({why}): keeping them mapped and "
        "pinned until the process ends",
        label="warning",
    )


def _unregister(address: int) -> int:
    """cudaHostUnregister through torch's binding: the CUDA error code (0: done)."""
    import torch

    return int(torch.cuda.cudart().cudaHostUnregister(address))


def unpin(buffer: torch.Tensor) -> bool:
    """cudaHostUnregister: undo `pin_in_place`. Where that fails the buffer is kept
    (keep_registered), never freed while still registered; returns whether it was unpinned."""
    err = _unregister(buffer.data_ptr())
    if err != 0:
        keep_registered(buffer, buffer.numel(), f"cudaHostUnregister: CUDA error {err}")
    return err == 0


def use_this_ranks_gpu() -> None:
    """Make this thread's current device the rank's GPU (it is per thread), when there is one,
    so that pinning here uses the same CUDA context as the ParameterServer."""
    import torch

    if torch.cuda.is_available():
        from ckptctl.job.process_group import local_device_index

        torch.cuda.set_device(local_device_index(int(os.environ.get("RANK", "0"))))
