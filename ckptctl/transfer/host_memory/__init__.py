"""A rank's share in host memory: read from its files, pinned in place, handed to
checkpoint-engine as the buffers it sends from (`--register-mode direct`).

    reader = ShareReader(checkpoint, share.tensors, pin=True)  # reads and pins in the background
    session.register_buffers(name, reader.result())            # waits, then the MemoryBuffers
"""

from ckptctl.transfer.host_memory._cuda_pinning import import_torch
from ckptctl.transfer.host_memory._file_reads import ReadProgress
from ckptctl.transfer.host_memory._pinned_pool import PinnedPool
from ckptctl.transfer.host_memory._share_reader import ShareReader, gc_paused, planned_buffers

__all__ = [
    "PinnedPool",
    "ReadProgress",
    "ShareReader",
    "gc_paused",
    "import_torch",
    "planned_buffers",
]
