"""Metas files: where a running `save-metas` job holds each tensor, for `join` to pull from.

    write_metas_file(path, ps.get_metas(), checkpoint_name=..., world_size=...)
    mf = read_metas_file(path, allow_pickle=False)
    ps.load_metas(mf.metas)

Everything here imports torch and checkpoint-engine lazily, inside the functions.
"""

from ckptctl.metas.fileformat import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_METAS_FILE_BYTES,
    MetasFile,
    read_metas_file,
    validate_metas,
    write_metas_file,
)
from ckptctl.metas.summary import (
    CheckpointTensor,
    Difference,
    MetasSummary,
    compare_with_checkpoint,
    summarize,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_METAS_FILE_BYTES",
    "CheckpointTensor",
    "Difference",
    "MetasFile",
    "MetasSummary",
    "compare_with_checkpoint",
    "read_metas_file",
    "summarize",
    "validate_metas",
    "write_metas_file",
]
