"""--consume-shm-files: what checkpoint-engine may pin in place and delete.

checkpoint-engine pins each /dev/shm file as is and deletes it once registered, so every check
here runs before any file is consumed: the files must really live under /dev/shm and be ours
(`check_in_shm`), and their tensors must fit its unpadded in-place layout (`check_consumable`).
"""

from __future__ import annotations

import math
import os
import stat
from typing import TYPE_CHECKING

from ckptctl.errors import InvalidInput, UsageError

if TYPE_CHECKING:
    from ckptctl.checkpoint.headers import TensorInfo
    from ckptctl.checkpoint.plan import Plan


def check_consume(checkpoint_path: str, split: str) -> None:
    """--consume-shm-files takes files in /dev/shm only, whole files per rank (a usage error)."""
    real = os.path.realpath(checkpoint_path)
    if not real.startswith("/dev/shm/"):
        raise UsageError(
            f"--consume-shm-files pins and deletes files under /dev/shm only; {checkpoint_path} "
            "is not there (drop the flag to leave the files alone)"
        )
    if split == "tensors":
        raise UsageError("--consume-shm-files registers whole files: use --split files (or auto)")


SHM = "/dev/shm"


def check_in_shm(path: str) -> None:
    """Refuse (exit 3) a file that --consume-shm-files must not delete: one that is a symbolic
    link, or does not really live under /dev/shm (a folder on its way there is a symlink to
    elsewhere: checkpoint-engine would pin and delete the file where it really is), or whose
    way there someone else could change before checkpoint-engine opens it: the file and every
    folder below /dev/shm must be ours (folders may be root's)."""
    drop = "--consume-shm-files deletes the files it pins: drop the flag, or copy the files there"
    if os.path.islink(path):
        raise InvalidInput(f"{path}: is a symbolic link, not a file under {SHM}; {drop}")
    shm = os.path.realpath(SHM)
    real = os.path.realpath(path)
    if not real.startswith(shm + "/"):
        raise InvalidInput(
            f"{path}: really lives at {real}, outside {SHM} (a folder on the way is a symbolic "
            f"link); {drop}"
        )
    uid = os.getuid()
    try:
        if os.lstat(real).st_uid != uid:
            raise InvalidInput(f"{path}: belongs to another user; {drop}")
        folder = os.path.dirname(real)
        while folder != shm:
            st = os.lstat(folder)
            if st.st_uid not in (uid, 0):
                raise InvalidInput(
                    f"{path}: its folder {folder} belongs to another user, who could swap the "
                    f"file before it is consumed; {drop}"
                )
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                # (mkdir under umask 000): anyone may rename what is in it, a subfolder for a
                # symlink to elsewhere, between this check and checkpoint-engine's os.remove.
                raise InvalidInput(
                    f"{path}: its folder {folder} is writable by other users (mode "
                    f"{stat.S_IMODE(st.st_mode):o}), who could swap what is in it before it is "
                    f"consumed: chmod go-w it; {drop}"
                )
            folder = os.path.dirname(folder)
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be checked ({exc.strerror or exc})") from None


def check_consumable(plan: Plan) -> None:
    """Refuse, before any file is consumed, a checkpoint that checkpoint-engine's in-place
    pinning cannot serve, or files it must not delete (`check_in_shm`). Every rank checks every
    rank's share, so all refuse together.

    It pins each file's data area as is and asserts the tensors tile it with no gap (a file
    that fails that would be refused halfway, after other files were deleted). The update then
    packs a rank's tensors back to back, unpadded, into buckets that may start at any tensor,
    and the server views each tensor at its offset as its dtype, which fails unless the offset
    is a multiple of the element size. So every tensor before a tensor in its share must have
    a size that is a multiple of that tensor's element size (a 0-dim bf16 before an int64 is
    not).
    """
    from ckptctl.checkpoint.headers import DTYPE_BITS, open_planned

    checkpoint = plan.checkpoint
    for file in checkpoint.files:
        check_in_shm(str(checkpoint.path_of(file)))
    known = _in_place_dtypes()
    for t in checkpoint.tensors:
        if known is not None and t.dtype not in known:
            raise InvalidInput(
                f"{checkpoint.path_of(t.file)}: tensor {t.name!r} is {t.dtype}, which "
                "checkpoint-engine's in-place pinning cannot read: drop --consume-shm-files"
            )
    widest = max((max(DTYPE_BITS[t.dtype] // 8, 1) for t in checkpoint.tensors), default=1)
    largest = max(checkpoint.tensors, key=lambda t: t.nbytes, default=None)
    if largest is not None and largest.nbytes % widest:
        # A tensor larger than the bucket cap sets the bucket size, and the second half of
        # the double buffer starts at that offset: it must keep every dtype aligned.
        raise InvalidInput(
            f"{checkpoint.path_of(largest.file)}: the largest tensor {largest.name!r} "
            f"({largest.nbytes} bytes) is not a multiple of {widest} bytes, which in-place "
            "pinning's buffers would need: drop --consume-shm-files"
        )
    in_file: dict[str, list[TensorInfo]] = {f: [] for f in checkpoint.files}
    for t in checkpoint.tensors:  # (in read order: file, then offset)
        in_file[t.file].append(t)
    for file, tensors in in_file.items():
        path = checkpoint.path_of(file)
        fd = open_planned(checkpoint, file)  # still the file that was planned, else exit 3
        try:
            at = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")  # where the data area starts
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise InvalidInput(f"{path}: cannot be read ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        for t in tensors:
            if t.start != at:
                raise InvalidInput(
                    f"{path}: {t.start - at} bytes between tensor {t.name!r} and the one before; "
                    "checkpoint-engine's in-place pinning needs tightly packed files: drop "
                    "--consume-shm-files"
                )
            at = t.end
        if at != size:
            raise InvalidInput(
                f"{path}: {size - at} bytes after the last tensor; "
                "checkpoint-engine's in-place pinning needs tightly packed files: drop "
                "--consume-shm-files"
            )
    for share in plan.ranks:
        common = 0  # gcd of the sizes of the tensors so far in this share
        for t in share.tensors:
            width = max(DTYPE_BITS[t.dtype] // 8, 1)
            if common % width:
                raise InvalidInput(
                    f"{checkpoint.path_of(t.file)}: tensor {t.name!r} ({t.dtype}) would lose its "
                    f"{width}-byte alignment in checkpoint-engine's unpadded in-place layout "
                    "(a smaller tensor before it leaves it off), and the server could not read "
                    "it: drop --consume-shm-files"
                )
            common = math.gcd(common, t.nbytes)


def _in_place_dtypes() -> set[str] | None:
    """The safetensors dtypes checkpoint-engine's in-place pinning can read (it looks them up
    in safetensors' own table), or None when that table is not where it used to be."""
    try:
        from safetensors.torch import _TYPES
    except ImportError:
        return None
    return set(_TYPES)
