"""The transfer engine's wire format: authenticated TCP, fixed headers, bounded frames.

Every connection starts with a mutual HMAC-SHA256 challenge over a shared secret:

    server → client   "MCTE-HELLO" version  server_nonce(32)
    client → server   client_nonce(32)  HMAC(secret, "client" || server_nonce || client_nonce)
    server → client   "OK" HMAC(secret, "server" || client_nonce || server_nonce)
                      (or "NO": the client failed; or "BY": the server serves as many
                      authenticated connections as it may; then close)

so no byte of data moves before both sides proved they know the secret, and a
client never talks to an impostor. The server side is two steps (`server_hello`,
`server_verdict`) so that one thread can drive many handshakes without blocking
(`listener`); the client side is `client_handshake`, all within one deadline.
Then frames follow, each a 44-byte header:

    magic "MCTE" | version u8 | kind u8 | flags u16 | region u32 | tag u64 | offset u64 | length u64 | checksum u64

(flag bit 0: the checksum field is set; any other bit is refused)

WRITE carries `length` payload bytes for `region` at `offset`; READ asks for
them; OK / ERROR answer a tag (ERROR and CALL / REPLY carry a short UTF-8 or
JSON payload). Data frames are bounded by the engine's `max_frame_bytes`,
control payloads by `MAX_CONTROL_BYTES`; a header that breaks a bound, or any
malformed header, ends the connection. `recv_frame` takes a deadline, so a
header that has started must be complete by it (a peer cannot hold a
connection by sending half a header).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct
import time
from typing import TypeAlias

import attrs

from mooncake.errors import AuthenticationError, PeerUnavailable, TransferError

__all__ = [
    "ANSWER_BYTES",
    "BUSY",
    "Frame",
    "HEADER",
    "Json",
    "Kind",
    "MAX_CONTROL_BYTES",
    "ProtocolError",
    "REFUSED",
    "client_handshake",
    "recv_exact",
    "recv_frame",
    "send_frame",
    "server_hello",
    "server_verdict",
]

MAGIC = b"MCTE"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQQQQ")
MAX_CONTROL_BYTES = 1 << 20
FLAG_CHECKSUM = 1

# A decoded JSON value: what CALL and REPLY payloads carry.
Json: TypeAlias = dict[str, "Json"] | list["Json"] | str | int | float | bool | None
_HELLO = b"MCTE-HELLO"
_DEADLINE_SLACK_S = 0.05
_NONCE_BYTES = 32
_MAC_BYTES = 32
ANSWER_BYTES = _NONCE_BYTES + _MAC_BYTES  # what a client sends after the hello
REFUSED = b"NO"  # the client failed the challenge
BUSY = b"BY"  # authenticated, but the server is at its connection limit


class ProtocolError(TransferError):
    """The peer sent something the protocol does not allow."""


class Kind(enum.IntEnum):
    WRITE = 1
    READ = 2
    OK = 3
    ERROR = 4
    CALL = 5
    REPLY = 6


@attrs.frozen
class Frame:
    """A frame header (its payload, if any, follows on the stream)."""

    kind: Kind
    tag: int = 0
    region: int = 0
    offset: int = 0
    length: int = 0
    checksum: int | None = None

    def pack(self) -> bytes:
        flags = FLAG_CHECKSUM if self.checksum is not None else 0
        return HEADER.pack(
            MAGIC, VERSION, self.kind, flags, self.region, self.tag, self.offset, self.length, self.checksum or 0
        )


def recv_exact(sock: socket.socket, view: memoryview, *, deadline: float | None = None) -> None:
    """Fill `view` from `sock` (recv_into, no copies), by `deadline` (time.monotonic) if given.

    With a deadline, each wait is bounded by what is left of it (give or take
    `_DEADLINE_SLACK_S`), and the socket keeps that timeout afterwards.

    Raises:
        ConnectionError: the peer closed the connection first.
        TimeoutError: the deadline (or the socket's timeout) passed.
    """
    got = 0
    total = view.nbytes
    while got < total:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer is too slow")
            current = sock.gettimeout()
            # A timeout within the slack of what is left stands (settimeout is a system call).
            if current is None or abs(current - remaining) > _DEADLINE_SLACK_S:
                sock.settimeout(remaining)
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {total} bytes")
        got += n


def recv_frame(sock: socket.socket, *, max_length: int, deadline: float | None = None) -> Frame:
    """Read one header, all of it by `deadline` (time.monotonic) if given.

    Raises:
        ProtocolError: it is malformed or breaks its bound.
        ConnectionError: the peer closed the connection first.
        TimeoutError: the deadline (or the socket's timeout) passed.
    """
    raw = bytearray(HEADER.size)
    recv_exact(sock, memoryview(raw), deadline=deadline)
    magic, version, kind, flags, region, tag, offset, length, checksum = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
    if flags & ~FLAG_CHECKSUM:  # a flag this version does not know: its meaning cannot be honoured
        raise ProtocolError(f"unknown frame flags {flags:#06x}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    bound = max_length if kind in (Kind.WRITE, Kind.READ, Kind.OK) else MAX_CONTROL_BYTES
    if length > bound:
        raise ProtocolError(f"{kind.name} frame of {length} bytes exceeds the bound of {bound}")
    return Frame(kind, tag, region, offset, length, checksum if flags & FLAG_CHECKSUM else None)


def send_frame(sock: socket.socket, frame: Frame, payload: memoryview | bytes | None = None) -> None:
    """Send a header and its payload; the payload is sent from its own memory (no copy)."""
    if payload is None or len(payload) == 0:
        sock.sendall(frame.pack())
    elif len(payload) <= 64 * 1024:  # one syscall for small frames
        sock.sendall(frame.pack() + bytes(payload))
    else:
        sock.sendall(frame.pack())
        sock.sendall(payload)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def server_hello() -> tuple[bytes, bytes]:
    """The server's first step: a fresh nonce and the hello that carries it (send it at once)."""
    server_nonce = os.urandom(_NONCE_BYTES)
    return server_nonce, _HELLO + bytes([VERSION]) + server_nonce


def server_verdict(secret: bytes, server_nonce: bytes, answer: bytes) -> bytes:
    """The server's second step: check the client's `answer` (ANSWER_BYTES) to the hello.

    Returns:
        What to send back: "OK" and the server's own proof of the secret.

    Raises:
        AuthenticationError: the client does not know the secret (send REFUSED, then close).
    """
    if len(answer) != ANSWER_BYTES:
        raise AuthenticationError(f"a handshake answer is {ANSWER_BYTES} bytes, got {len(answer)}")
    client_nonce, client_mac = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
    if not hmac.compare_digest(client_mac, _mac(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("a peer failed the shared-secret challenge")
    return b"OK" + _mac(secret, b"server", client_nonce, server_nonce)


def client_handshake(sock: socket.socket, secret: bytes, *, deadline: float | None = None) -> None:
    """Authenticate to the server on `sock`, and check that it knows the secret too, all by `deadline`.

    Raises:
        AuthenticationError: either side failed the challenge.
        PeerUnavailable: the server is at its connection limit.
        ProtocolError: the server does not speak this protocol.
        TimeoutError: the server did not finish by `deadline` (or the socket's timeout).
        ConnectionError: the server closed the connection before its greeting (`tcp.connect` reads
            this, as any dropped handshake, as PeerUnavailable).
    """
    hello = bytearray(len(_HELLO) + 1 + _NONCE_BYTES)
    recv_exact(sock, memoryview(hello), deadline=deadline)
    if bytes(hello[: len(_HELLO)]) != _HELLO or hello[len(_HELLO)] != VERSION:
        raise ProtocolError("the peer is not a mooncake transfer engine of this version")
    server_nonce = bytes(hello[len(_HELLO) + 1 :])
    client_nonce = os.urandom(_NONCE_BYTES)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    verdict = bytearray(2)
    try:
        recv_exact(sock, memoryview(verdict), deadline=deadline)
    except ConnectionError as error:
        raise AuthenticationError("the peer closed the connection during authentication") from error
    if bytes(verdict) == BUSY:
        raise PeerUnavailable("the peer serves as many connections as it may (max_connections)")
    if bytes(verdict) != b"OK":
        raise AuthenticationError("the peer refused our shared secret")
    server_mac = bytearray(_MAC_BYTES)
    recv_exact(sock, memoryview(server_mac), deadline=deadline)
    if not hmac.compare_digest(bytes(server_mac), _mac(secret, b"server", client_nonce, server_nonce)):
        raise AuthenticationError("the peer failed the shared-secret challenge")
