"""Who is behind a Unix socket: the socket file's owner and the listening process's uid.

A Unix socket path is only a name: another local user may have bound it first (a squatter
on `--uds`), and then receives whatever we send, the API key and CUDA IPC handles included.
A client checks the file's owner before connecting and the peer's uid (SO_PEERCRED, Linux)
once connected, before sending a byte.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Collection

from ckptctl.errors import OperationFailed


class UntrustedSocket(OperationFailed):
    """The socket, or the process listening on it, belongs to a user we do not talk to."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def server_uids() -> frozenset[int]:
    """Who may run the inference server we talk to over a Unix socket: this user, or root."""
    return frozenset({os.getuid(), 0})


def _whom(trusted: Collection[int]) -> str:
    return "you or root" if set(trusted) == server_uids() else f"uid {sorted(trusted)}"


def check_socket_owner(path: str, trusted: Collection[int]) -> None:
    """Before connecting: a socket at `path` must belong to a trusted uid. Nothing there yet
    (a server still starting) is left to the connect to report, and an abstract socket (a
    name starting with NUL, no file) to the peer check."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    if stat.S_ISSOCK(st.st_mode) and st.st_uid not in trusted:
        raise UntrustedSocket(
            f"the Unix socket {path} belongs to uid {st.st_uid}, not to {_whom(trusted)}: "
            "refusing to send it anything (another user's socket, or one planted there)"
        )


def check_peer(conn: socket.socket, path: str, trusted: Collection[int]) -> None:
    """Once connected, before anything is sent: the listening process runs as a trusted uid."""
    uid = peer_uid(conn)
    if uid not in trusted:
        where = "@" + path[1:] if path.startswith("\0") else path  # (an abstract name)
        raise UntrustedSocket(
            f"the process listening on {where} runs as uid {uid}, not as {_whom(trusted)}: "
            "refusing to send it anything"
        )
