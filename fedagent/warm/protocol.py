"""Wire format between the light client and the warm server (stdlib only: the client stays light).

One message = a 4-byte big-endian length + that many bytes of UTF-8 JSON. A job request carries
the client's fds 0/1/2 as ``SCM_RIGHTS`` ancillary data on its first bytes, so the forked job
writes to the job's own log exactly as a fresh process would. Replies: ``{"pid": n}`` at once,
``{"exit": code}`` when the job ends (a signal death as ``-signum``), or ``{"error": message}``.
"""

from __future__ import annotations

import json
import socket
import struct

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a request holds argv + the whole environment: far below this
MAX_FDS = 8


class ProtocolError(RuntimeError):
    """A malformed or truncated message."""


def encode(obj: dict) -> bytes:
    """One framed message."""
    data = json.dumps(obj).encode()
    return _HEADER.pack(len(data)) + data


def send(sock: socket.socket, obj: dict, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send one message, ``fds`` attached to its first bytes (blocking socket)."""
    data = encode(obj)
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    if sent < len(data):  # never an empty send: it fails once the server answered and closed
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            if got:
                raise ProtocolError(f"connection closed after {got} of {n} bytes")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> dict | None:
    """The next message (blocking); None when the peer closed the connection between messages."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes is over the {MAX_MESSAGE} limit")
    body = _recv_exact(sock, n)
    if body is None:
        raise ProtocolError("connection closed inside a message")
    return json.loads(body)


class Reader:
    """Server side, non-blocking: bytes and passed fds accumulate until a message is complete."""

    def __init__(self):
        self.buf = bytearray()
        self.fds: list[int] = []

    def feed(self, sock: socket.socket) -> bool:
        """Read what is there (raises BlockingIOError when nothing is); False at end of stream."""
        data, fds, flags, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
        self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("passed file descriptors were truncated")
        if not data:
            return False
        self.buf += data
        if len(self.buf) > MAX_MESSAGE + _HEADER.size:
            raise ProtocolError("message over the size limit")
        return True

    def message(self) -> dict | None:
        """The first complete message, or None while it is still arriving."""
        if len(self.buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self.buf)
        if n > MAX_MESSAGE:
            raise ProtocolError(f"message of {n} bytes is over the {MAX_MESSAGE} limit")
        if len(self.buf) < _HEADER.size + n:
            return None
        body = bytes(self.buf[_HEADER.size : _HEADER.size + n])
        del self.buf[: _HEADER.size + n]
        try:
            msg = json.loads(body)
        except ValueError as err:
            raise ProtocolError(f"not JSON: {err}") from None
        if not isinstance(msg, dict):
            raise ProtocolError("a message must be a JSON object")
        return msg

    def take_fds(self) -> list[int]:
        """The fds received so far (the caller owns and must close them)."""
        fds, self.fds = self.fds, []
        return fds
