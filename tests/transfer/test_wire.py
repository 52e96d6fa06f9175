"""Properties of the wire format (`mooncake.transfer.wire`) and of region bounds (`region.bounds_error`).

A frame sent over a socket pair comes back as the same header with the same payload; a header that is not
one this version writes (magic, version, kind, flags, a length past its bound) is a `ProtocolError`; a
stream that ends inside a header is a `ConnectionError`. A span is inside a region exactly when it starts
at or after 0, has a length >= 0 and ends by the region's end.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import AuthenticationError, ConfigError
from mooncake.transfer.region import bounds_error
from mooncake.transfer.wire import (
    HANDSHAKE_CHECKSUMS,
    HEADER,
    INCARNATION_BYTES,
    MAX_CONTROL_BYTES,
    VERSION,
    Frame,
    Kind,
    ProtocolError,
    recv_exact,
    recv_frame,
    send_frame,
    server_hello,
    server_verdict,
)

MAX_DATA = 1 << 16
U64 = st.integers(0, 2**64 - 1)


frames = st.builds(
    Frame,
    kind=st.sampled_from(list(Kind)),
    tag=U64,
    region=st.integers(0, 2**32 - 1),
    offset=U64,
    length=st.integers(0, 4096),
    checksum=st.none() | U64,
)


@given(frame=frames, data=st.data())
def test_a_frame_comes_back_as_it_was_sent(frame: Frame, data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=frame.length, max_size=frame.length))
    a, b = socket.socketpair()
    try:
        send_frame(a, frame, payload)
        assert recv_frame(b, max_length=MAX_DATA) == frame
        received = bytearray(frame.length)
        if frame.length:
            b.recv_into(received, frame.length, socket.MSG_WAITALL)
        assert bytes(received) == payload
    finally:
        a.close()
        b.close()


def header(
    *, magic: bytes = b"MCTE", version: int = VERSION, kind: int = Kind.WRITE, flags: int = 0, length: int = 0
) -> bytes:
    """A header this version writes, but for the field given (each bad one reaches its own check)."""
    return HEADER.pack(magic, version, kind, flags, 0, 7, 0, length, 0)


def test_a_header_of_this_version_is_read() -> None:
    """The header the tests below break one field of is itself one `recv_frame` reads (it was of version 1, which
    the version check refused before any other check was reached)."""
    a, b = socket.socketpair()
    try:
        a.sendall(header())
        assert recv_frame(b, max_length=MAX_DATA).kind is Kind.WRITE
    finally:
        a.close()
        b.close()


@given(
    bad=st.one_of(
        st.binary(min_size=4, max_size=4).filter(lambda m: m != b"MCTE").map(lambda m: header(magic=m)),
        st.integers(0, 255).filter(lambda v: v != VERSION).map(lambda v: header(version=v)),
        st.integers(0, 255).filter(lambda k: k not in set(Kind)).map(lambda k: header(kind=k)),
        st.integers(2, 2**16 - 1).map(lambda f: header(flags=f)),
        st.integers(MAX_DATA + 1, 2**64 - 1).map(lambda n: header(length=n)),
        st.integers(MAX_CONTROL_BYTES + 1, 2**64 - 1).map(lambda n: header(kind=Kind.CALL, length=n)),
    )
)
def test_a_header_this_version_does_not_write_is_a_protocol_error(bad: bytes) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(bad)
        with pytest.raises(ProtocolError):
            recv_frame(b, max_length=MAX_DATA)
    finally:
        a.close()
        b.close()


def test_a_deadline_already_passed_is_a_timeout_before_any_read() -> None:
    """`recv_exact` with a deadline in the past raises at once (the peer has sent nothing: a read would block)."""
    a, b = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):
            recv_exact(b, memoryview(bytearray(1)), deadline=time.monotonic() - 0.5)
    finally:
        a.close()
        b.close()


def _answer(secret: bytes, server_nonce: bytes, flags: int) -> bytes:
    """A client's answer to the hello that knows the secret, with `flags`."""
    client_nonce, raw = os.urandom(32), bytes([flags])
    return client_nonce + raw + hmac.new(secret, b"client" + server_nonce + client_nonce + raw, hashlib.sha256).digest()


@given(flags=st.integers(0, 255))
def test_a_handshake_flag_this_version_does_not_know_is_refused(flags: int) -> None:
    """A client that knows the secret but sets a flag other than checksums' is refused (its meaning cannot be
    honoured); the checksum flag alone, or none, is agreed as asked. A wrong-sized incarnation is the server's
    own misuse, a ConfigError."""
    secret = b"s" * 32
    nonce, _hello = server_hello()
    answer = _answer(secret, nonce, flags)
    if flags & ~HANDSHAKE_CHECKSUMS:
        with pytest.raises(AuthenticationError, match="flags"):
            server_verdict(secret, nonce, answer, incarnation=bytes(INCARNATION_BYTES))
    else:
        _reply, agreement = server_verdict(secret, nonce, answer, incarnation=bytes(INCARNATION_BYTES))
        assert agreement.checksums == bool(flags)
    with pytest.raises(ConfigError, match="incarnation"):
        server_verdict(secret, nonce, _answer(secret, nonce, 0), incarnation=b"x")


@given(cut=st.integers(0, HEADER.size - 1))
def test_a_stream_ending_inside_a_header_is_a_connection_error(cut: int) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(header()[:cut])
        a.close()
        with pytest.raises(ConnectionError):
            recv_frame(b, max_length=MAX_DATA)
    finally:
        b.close()


def test_the_checksum_flag_says_whether_a_checksum_is_carried() -> None:
    """Flag bit 0 set: the checksum field is the frame's, even 0; clear: there is none, whatever the field holds."""
    a, b = socket.socketpair()
    try:
        a.sendall(HEADER.pack(b"MCTE", VERSION, Kind.WRITE, 1, 0, 0, 0, 0, 0))
        a.sendall(HEADER.pack(b"MCTE", VERSION, Kind.WRITE, 0, 0, 0, 0, 0, 99))
        assert recv_frame(b, max_length=MAX_DATA).checksum == 0
        assert recv_frame(b, max_length=MAX_DATA).checksum is None
    finally:
        a.close()
        b.close()


@given(offset=st.integers(-(2**40), 2**40), length=st.integers(-(2**40), 2**40), size=st.integers(0, 2**40))
def test_a_span_is_inside_a_region_exactly_when_it_starts_and_ends_within_it(
    offset: int, length: int, size: int
) -> None:
    inside = offset >= 0 and length >= 0 and offset + length <= size
    problem = bounds_error(offset, length, size)
    assert (problem is None) == inside
    if problem is not None:
        assert f"{size} bytes" in problem


def test_the_header_is_the_documented_44_bytes() -> None:
    assert HEADER.size == 44
