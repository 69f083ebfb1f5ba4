"""Pinning through the CUDA driver before torch is imported (host_memory DriverPin), on a GPU.

The buffers must come out exactly as the runtime's `cudaHostRegister(ptr, n, 0)` makes them:
checkpoint-engine's unpinning asserts that `cudaHostGetFlags` reads 0x02, then calls
`cudaHostUnregister`. The check runs in a fresh interpreter, where torch is not imported
until the share is read and pinned.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_factory import mixed_tensors, write_real_checkpoint

pytestmark = [pytest.mark.gpu]

SCRIPT = r"""
import ctypes, json, sys
from ckptctl.checkpoint import read_checkpoint
from ckptctl.transfer.host_memory import ShareReader
from ckptctl.transfer.host_memory._cuda_pinning import DriverPin

if sys.argv[2] == "other-gpu":  # as if the driver had picked another GPU than torch gives
    DriverPin.is_torchs_gpu = lambda self, rank: False
checkpoint = read_checkpoint(sys.argv[1])
reader = ShareReader(checkpoint, list(checkpoint.tensors), threads=2, pin=True)
reader.wait()  # (result() imports torch: first let the reading thread pin, torch not imported)
buffers = reader.result()
import torch
from safetensors.torch import load_file

libc = ctypes.CDLL(None)
get_flags = libc.cudaHostGetFlags
get_flags.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
flags = []
for b in buffers:
    f = ctypes.c_uint()
    flags.append((get_flags(ctypes.byref(f), ctypes.c_void_p(b.buffer.data_ptr())), f.value))
expected = {}
for name in checkpoint.files:
    expected.update(load_file(str(checkpoint.path_of(name))))
same = 0
for b in buffers:
    on_gpu = b.buffer.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    offset = 0
    for m in b.metas:
        n = m.shape.numel() * m.dtype.itemsize
        got = on_gpu[offset : offset + n].cpu()
        offset += m.aligned_size
        want = expected[m.name].contiguous().reshape(-1).view(torch.uint8)
        same += bool(torch.equal(got, want))
unpinned = [torch.cuda.cudart().cudaHostUnregister(b.buffer.data_ptr()) for b in buffers]
print(json.dumps({
    "pinned_by_driver": reader.pinned_by_driver,
    "pinned_before_torch": reader.pinned_before_torch,
    "flags": flags, "same": same, "tensors": len(expected), "unpinned": [int(u) for u in unpinned],
}))
"""


@pytest.mark.parametrize("case", ["same-gpu", "other-gpu"])
def test_driver_pin_is_what_checkpoint_engine_expects(tmp_path: Path, case: str) -> None:
    """same-gpu: pinned through the driver before torch was imported. other-gpu: the driver's
    pins are undone and the buffers pinned again through torch's runtime, the same way."""
    mixed = mixed_tensors(seed=3)
    ckpt = write_real_checkpoint(tmp_path / "ckpt", [mixed])
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ckpt), case],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    if case == "same-gpu":
        assert doc["pinned_by_driver"] and doc["pinned_before_torch"], doc
    else:
        assert not doc["pinned_by_driver"] and not doc["pinned_before_torch"], doc
    # checkpoint-engine's _unpin: cudaHostGetFlags succeeds and says 0x02 (mapped, by UVA).
    assert doc["flags"] and all(f == [0, 2] for f in doc["flags"]), doc
    assert doc["same"] == doc["tensors"] == len(mixed), doc
    assert doc["unpinned"] == [0] * len(doc["flags"]), doc
