"""Opening the files users name (indexes, headers, metas, shards) without being fooled.

A path can be a FIFO (reading it blocks until some writer comes), a device (/dev/zero never
ends), a folder, or a file far larger than anything it should hold. Every file ckptctl reads
goes through `open_regular`: stat first (a device or FIFO is never opened), open with
O_NONBLOCK (a FIFO swapped in after the stat cannot block the open), then fstat what was
really opened. `read_regular` also refuses a file above its cap before reading a byte.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import BinaryIO, NamedTuple

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnfitFile(Exception):
    """Why a file was not read. `problem` completes a sentence that starts with the path:
    "does not exist", "is a FIFO (named pipe), not a regular file", ..."""

    def __init__(self, problem: str, errno: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.errno = errno  # the OSError's, when the system refused to open the file


class FileIdentity(NamedTuple):
    """What tells one version of a file from another: the same inode, size, mtime and ctime.
    Whoever can write a file can rewrite it in place and set its mtime back; its ctime (the
    inode's last change: every write, and the utime that sets the mtime back) no user sets."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_kind(st: os.stat_result, what: str) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnfitFile(f"is a folder, not {what}")
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a plain file")
    raise UnfitFile(f"is {kind}, not a regular file")


def open_regular(path: str | os.PathLike[str], what: str = "a file") -> tuple[int, os.stat_result]:
    """(read-only fd, its fstat) of a regular file, or UnfitFile. The caller closes the fd."""
    try:
        _check_kind(os.stat(path), what)  # a device or FIFO is never even opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnfitFile("does not exist") from None
    except OSError as exc:
        raise UnfitFile(f"cannot be read ({exc.strerror or exc})", exc.errno) from None
    try:
        st = os.fstat(fd)
        _check_kind(st, what)  # what was opened, should the path have changed since the stat
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def read_regular(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The whole of a regular file of at most `limit` bytes, or UnfitFile (checked from its
    size before anything is read)."""
    fd, st = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise UnfitFile(f"is larger than {_size_text(limit)}, the most {what} may be")
        try:
            data = f.read(st.st_size + 1)  # one more byte: a file that grows is noticed
        except OSError as exc:
            raise UnfitFile(f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > st.st_size:
        raise UnfitFile("changed size while being read; retry when nothing is writing it")
    return data


# Whether an existing file is one ckptctl wrote (and so may replace): given the open file, at
# its start, and its size.
IsOurs = Callable[[BinaryIO, int], bool]


def replaceable_target(path: str | os.PathLike[str], is_ours: IsOurs, what: str, flag: str) -> str:
    """`path` as an absolute path (its last part not resolved) that `what` ("a trace") may be
    written to, or a UsageError naming `flag`: its folder exists, and nothing is there that
    ckptctl may not replace (why_not_replace)."""
    from ckptctl.errors import UsageError

    full = os.path.abspath(os.fspath(path))
    where = os.path.dirname(full)
    if not os.path.isdir(where):
        raise UsageError(f"{flag} {path}: no directory {where}")
    problem = why_not_replace(full, is_ours, what)
    if problem:
        raise UsageError(f"{flag} {path}: {problem}; name a new file (or {what} written before)")
    return full


def why_not_replace(path: str, is_ours: IsOurs, what: str) -> str | None:
    """Why the file at `path` may not be replaced by `what` ("a trace") that ckptctl writes;
    None when nothing is there, or when it is a regular file of this user that is empty (from
    mktemp, say) or that `is_ours` takes for one ckptctl wrote before (it reads what it needs).
    Anything else is the user's and stays as it is; a symlink there is refused, never
    followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "a symlink" if os.path.islink(path) else f"cannot be read ({exc.strerror})"
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return "exists and is not a regular file"
    with os.fdopen(fd, "rb") as f:
        if info.st_uid != os.geteuid():
            return "a file of another user"
        try:
            if info.st_size and not is_ours(f, info.st_size):  # (an empty file holds nothing)
                return f"exists and is not {what} ckptctl wrote"
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
    return None
