"""Properties of the wire format (`mooncake.transfer.wire`) and of region bounds (`region.bounds_error`).

A frame sent over a socket pair comes back as the same header with the same payload; a header that is not
one this version writes (magic, version, kind, flags, a length past its bound) is a `ProtocolError`; a
stream that ends inside a header is a `ConnectionError`. A span is inside a region exactly when it starts
at or after 0, has a length >= 0 and ends by the region's end.
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.transfer.region import bounds_error
from mooncake.transfer.wire import (
    HEADER,
    MAX_CONTROL_BYTES,
    VERSION,
    Frame,
    Kind,
    ProtocolError,
    recv_frame,
    send_frame,
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
    *, magic: bytes = b"MCTE", version: int = 1, kind: int = Kind.WRITE, flags: int = 0, length: int = 0
) -> bytes:
    return HEADER.pack(magic, version, kind, flags, 0, 7, 0, length, 0)


@given(
    bad=st.one_of(
        st.binary(min_size=4, max_size=4).filter(lambda m: m != b"MCTE").map(lambda m: header(magic=m)),
        st.integers(0, 255).filter(lambda v: v != 1).map(lambda v: header(version=v)),
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
