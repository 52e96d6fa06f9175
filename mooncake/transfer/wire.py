"""The transfer engine's wire format: authenticated TCP, fixed headers, bounded frames.

Every connection starts with a mutual HMAC-SHA256 challenge over a shared secret:

    server → client   "MCTE-HELLO" version  server_nonce(32)
    client → server   client_nonce(32)  flags(1)  HMAC(secret, "client" || server_nonce || client_nonce || flags)
    server → client   "OK" incarnation(16)  HMAC(secret, "server" || client_nonce || server_nonce || incarnation)
                      (or "NO": the client failed; or "BY": the server serves as many
                      authenticated connections as it may; then close)

so no byte of data moves before both sides proved they know the secret, and a
client never talks to an impostor. Both MACs cover what their sender settles
for the connection. The client's flags (bit 0: `HANDSHAKE_CHECKSUMS`) say that
every data frame on it carries a checksum, so a frame that lost its checksum
flag is refused rather than taken unverified (`Agreement`). The server's
incarnation is a random id its engine drew at start-up: a client that
reconnects to an address learns whether the same engine answers, and not one
restarted there since (whose region ids start again at 1). The server side is
two steps (`server_hello`, `server_verdict`) so that one thread can drive many
handshakes without blocking (`listener`); the client side is
`client_handshake`, all within one deadline. Then frames follow, each a
44-byte header:

    magic "MCTE" | version u8 | kind u8 | flags u16 | region u32 | tag u64 | offset u64 | length u64 | checksum u64

(flag bit 0: the checksum field is set; any other bit is refused)

A checksum covers the request as well as the bytes (`bind_checksum`): it is
the XXH3-64 of the request's kind, region, tag, offset and length followed by
the payload's own XXH3-64 (the request is a WRITE's own header; for the
payload an OK carries, the READ it answers, as the server read it). So a
header corrupted on the way (a WRITE sent elsewhere, a READ served from
elsewhere, a WRITE taken for a READ) fails its check as a corrupted payload
does: the fields the receiver acted on are not the ones the sender hashed.

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
import xxhash

from mooncake.errors import AuthenticationError, ConfigError, PeerUnavailable, ProtocolError

__all__ = [
    "ANSWER_BYTES",
    "Agreement",
    "BUSY",
    "Frame",
    "HANDSHAKE_CHECKSUMS",
    "HEADER",
    "INCARNATION_BYTES",
    "Json",
    "Kind",
    "MAX_CONTROL_BYTES",
    "ProtocolError",
    "REFUSED",
    "bind_checksum",
    "client_handshake",
    "new_incarnation",
    "recv_exact",
    "recv_frame",
    "send_frame",
    "server_hello",
    "server_verdict",
]

MAGIC = b"MCTE"
# 2: the client's flags and the server's incarnation in the handshake; 3: checksums bound to their request
VERSION = 3
HEADER = struct.Struct("<4sBBHIQQQQ")
_BOUND = struct.Struct("<BIQQQQ")  # a checksum's request (kind, region, tag, offset, length) and payload digest
MAX_CONTROL_BYTES = 1 << 20
FLAG_CHECKSUM = 1

# A decoded JSON value: what CALL and REPLY payloads carry.
Json: TypeAlias = dict[str, "Json"] | list["Json"] | str | int | float | bool | None
_HELLO = b"MCTE-HELLO"
_DEADLINE_SLACK_S = 0.05
_NONCE_BYTES = 32
_MAC_BYTES = 32
_FLAGS_BYTES = 1
ANSWER_BYTES = _NONCE_BYTES + _FLAGS_BYTES + _MAC_BYTES  # what a client sends after the hello
INCARNATION_BYTES = 16  # random: two engines (or one engine restarted) never share one
HANDSHAKE_CHECKSUMS = 1  # a client's handshake flag: every data frame on this connection carries a checksum
REFUSED = b"NO"  # the client failed the challenge
BUSY = b"BY"  # authenticated, but the server is at its connection limit


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


def bind_checksum(request: Frame, digest: int) -> int:
    """The checksum a data frame carries for a payload whose XXH3-64 is `digest`, bound to `request`.

    `request` is the WRITE that carries the payload, or the READ that an OK's payload answers (its checksum field
    aside). The result is the XXH3-64 of the request's kind, region, tag, offset and length and of `digest`:
    each side computes it from the header as it sent or read it, so the check fails when any of those changed on
    the way, as when a payload byte did (one more hash of 37 bytes per frame, well under a microsecond).
    """
    return xxhash.xxh3_64_intdigest(
        _BOUND.pack(request.kind, request.region, request.tag, request.offset, request.length, digest)
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


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    # Every part has a fixed length (nonces, flags, incarnation): their concatenation is unambiguous.
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


@attrs.frozen
class Agreement:
    """What the client of one connection settled in its handshake.

    Attributes:
        checksums: every data frame on the connection carries a checksum: a WRITE without one is refused, and
            every READ is answered with one.
    """

    checksums: bool = False


def new_incarnation() -> bytes:
    """A fresh incarnation id, drawn once per engine when it starts (`INCARNATION_BYTES` random bytes)."""
    return os.urandom(INCARNATION_BYTES)


def server_hello() -> tuple[bytes, bytes]:
    """The server's first step: a fresh nonce and the hello that carries it (send it at once)."""
    server_nonce = os.urandom(_NONCE_BYTES)
    return server_nonce, _HELLO + bytes([VERSION]) + server_nonce


def server_verdict(secret: bytes, server_nonce: bytes, answer: bytes, *, incarnation: bytes) -> tuple[bytes, Agreement]:
    """The server's second step: check the client's `answer` (ANSWER_BYTES) to the hello.

    Args:
        incarnation: the serving engine's incarnation id (`INCARNATION_BYTES`), told to the client.

    Returns:
        What to send back ("OK", the incarnation and the server's own proof of the secret), and what the client
        asked of the connection.

    Raises:
        AuthenticationError: the client does not know the secret, or sets a flag this version does not know (send
            REFUSED, then close).
    """
    if len(answer) != ANSWER_BYTES:
        raise AuthenticationError(f"a handshake answer is {ANSWER_BYTES} bytes, got {len(answer)}")
    if len(incarnation) != INCARNATION_BYTES:
        raise ConfigError(f"incarnation must be {INCARNATION_BYTES} bytes, got {len(incarnation)}")
    client_nonce = answer[:_NONCE_BYTES]
    flags = answer[_NONCE_BYTES : _NONCE_BYTES + _FLAGS_BYTES]
    client_mac = answer[_NONCE_BYTES + _FLAGS_BYTES :]
    if not hmac.compare_digest(client_mac, _mac(secret, b"client", server_nonce, client_nonce, flags)):
        raise AuthenticationError("a peer failed the shared-secret challenge")
    if flags[0] & ~HANDSHAKE_CHECKSUMS:  # a flag whose meaning this version cannot honour
        raise AuthenticationError(f"unknown handshake flags {flags[0]:#04x}")
    reply = b"OK" + incarnation + _mac(secret, b"server", client_nonce, server_nonce, incarnation)
    return reply, Agreement(checksums=bool(flags[0] & HANDSHAKE_CHECKSUMS))


def client_handshake(
    sock: socket.socket, secret: bytes, *, deadline: float | None = None, checksums: bool = False
) -> bytes:
    """Authenticate to the server on `sock`, and check that it knows the secret too, all by `deadline`.

    Args:
        checksums: tell the server that every data frame on this connection carries a checksum.

    Returns:
        The server's incarnation id (`INCARNATION_BYTES`, proven with the secret): equal ids, the same engine.

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
    flags = bytes([HANDSHAKE_CHECKSUMS if checksums else 0])
    sock.sendall(client_nonce + flags + _mac(secret, b"client", server_nonce, client_nonce, flags))
    verdict = bytearray(2)
    try:
        recv_exact(sock, memoryview(verdict), deadline=deadline)
    except ConnectionError as error:
        raise AuthenticationError("the peer closed the connection during authentication") from error
    if bytes(verdict) == BUSY:
        raise PeerUnavailable("the peer serves as many connections as it may (max_connections)")
    if bytes(verdict) != b"OK":
        raise AuthenticationError("the peer refused our shared secret")
    proof = bytearray(INCARNATION_BYTES + _MAC_BYTES)
    recv_exact(sock, memoryview(proof), deadline=deadline)
    incarnation, server_mac = bytes(proof[:INCARNATION_BYTES]), bytes(proof[INCARNATION_BYTES:])
    if not hmac.compare_digest(server_mac, _mac(secret, b"server", client_nonce, server_nonce, incarnation)):
        raise AuthenticationError("the peer failed the shared-secret challenge")
    return incarnation
