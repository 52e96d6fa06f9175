"""Properties of the shared-memory transport against a bytearray model of the peer's segment.

Each example creates a real POSIX shared-memory segment (unlinked at its end), describes a
region over it the way a peer would, and copies slices through `ShmTransport`, inline and
through its worker threads. The model is the segment's bytes: a slice inside the described
region moves exactly its bytes and nothing else; any other slice is refused with
`TransferError` before a byte moves.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.region import RegionDescriptor, bounds_error, create_shared
from mooncake.transfer.request import Slice, TransferOp
from mooncake.transfer.shm import ShmTransport
from tests.transfer.test_shm import gone_pid
from tests.waiting import wait_for

REGION_ID = 7
MAX_SEGMENT_BYTES = 4096


@contextlib.contextmanager
def segment_with(initial: bytes) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """A fresh shared-memory segment holding `initial`: its name and a function that reads all of it (views
    of it are not handed out, so that it can be unmapped); closed and unlinked at the end."""
    segment, array = create_shared(len(initial))
    array[:] = np.frombuffer(initial, np.uint8)
    del array
    buffer = segment.buf
    assert buffer is not None
    try:
        yield segment.name, lambda: bytes(buffer[: len(initial)])
    finally:
        try:
            segment.close()
        finally:
            segment.unlink()


@contextlib.contextmanager
def transport_for(
    descriptors: dict[int, RegionDescriptor], *, peer_pid: int | None = None, workers: int = 1
) -> Iterator[ShmTransport]:
    transport = ShmTransport(descriptors.get, peer_pid=os.getpid() if peer_pid is None else peer_pid, workers=workers)
    try:
        yield transport
    finally:
        transport.close()


@st.composite
def layouts(draw: st.DrawFn) -> tuple[bytes, int]:
    """A segment's initial bytes and the length a peer describes over it (all of it, often, or less)."""
    initial = draw(st.binary(min_size=1, max_size=MAX_SEGMENT_BYTES))
    length = draw(st.just(len(initial)) | st.integers(min_value=0, max_value=len(initial)))
    return initial, length


@st.composite
def slice_specs(draw: st.DrawFn, length: int) -> tuple[TransferOp, int, bytes]:
    """(op, remote offset, local bytes): inside a region of `length` bytes mostly, across or beyond its ends
    (negative offsets included) sometimes."""
    op = draw(st.sampled_from(list(TransferOp)))
    if draw(st.integers(min_value=0, max_value=3)):
        offset = draw(st.integers(min_value=0, max_value=length))
        size = draw(st.integers(min_value=0, max_value=min(length - offset, 512)))
    else:
        offset = draw(st.integers(min_value=-3, max_value=length + 3))
        size = draw(st.integers(min_value=max(0, length - offset + 1), max_value=max(0, length - offset) + 64))
    return op, offset, draw(st.binary(min_size=size, max_size=size))


def local_buffer(op: TransferOp, payload: bytes) -> bytearray:
    """What a slice copies from (WRITE: the payload) or into (READ: a fill pattern that no copy makes)."""
    return bytearray(payload) if op == TransferOp.WRITE else bytearray(b"\x5a" * len(payload))


def apply_to_model(model: bytearray, length: int, op: TransferOp, offset: int, local: bytearray) -> bool:
    """Apply one slice to the model of the segment; whether the transport must accept it."""
    if bounds_error(offset, len(local), length) is not None:
        return False
    if op == TransferOp.WRITE:
        model[offset : offset + len(local)] = local
    return True


def ignore(_error: TransferError | None) -> None:
    pass


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), data=st.data())
def test_inline_slices_match_a_bytearray_model(layout: tuple[bytes, int], data: st.DataObject) -> None:
    """Any sequence of READ and WRITE slices run inline: one inside the described region succeeds, a WRITE
    leaving exactly its bytes at its offset and a READ returning exactly the model's; one that is not inside
    it (past the end, negative, or past the described length though inside the segment) is refused with
    the documented TransferError naming the bounds, and neither the segment nor the local buffer changes."""
    initial, length = layout
    model = bytearray(initial)
    with segment_with(initial) as (name, contents):
        descriptor = RegionDescriptor(region_id=REGION_ID, length=length, shm_name=name)
        with transport_for({REGION_ID: descriptor}) as transport:
            for op, offset, payload in data.draw(st.lists(slice_specs(length), min_size=1, max_size=8), label="slices"):
                local = local_buffer(op, payload)
                before = bytes(local)
                expected_ok = apply_to_model(model, length, op, offset, local)
                error = transport.run_inline(Slice(op, memoryview(local), REGION_ID, offset, ignore))
                if expected_ok:
                    assert error is None, error
                    if op == TransferOp.READ:
                        assert bytes(local) == bytes(model[offset : offset + len(local)])
                else:
                    assert type(error) is TransferError and "outside the region" in str(error), error
                    assert bytes(local) == before
                assert contents() == bytes(model), "the segment differs from the model"


def submit_all(
    transport: ShmTransport, batch: list[tuple[TransferOp, int, bytearray]]
) -> list[list[TransferError | None]]:
    """Submit every slice of `batch` at once; per slice, every outcome its `on_done` reported (once all ended)."""
    outcomes: list[list[TransferError | None]] = [[] for _ in batch]
    lock = threading.Lock()

    def recorder(index: int) -> Callable[[TransferError | None], None]:
        def done(error: TransferError | None) -> None:
            with lock:
                outcomes[index].append(error)

        return done

    for index, (op, offset, local) in enumerate(batch):
        transport.submit(Slice(op, memoryview(local), REGION_ID, offset, recorder(index)))

    def all_ended() -> bool:
        with lock:
            return all(outcomes)

    wait_for(all_ended, timeout=10, what="every slice to end")
    return outcomes


@settings(max_examples=30, deadline=None)
@given(layout=layouts(), workers=st.integers(min_value=1, max_value=4), data=st.data())
def test_submitted_slices_each_end_once_with_the_inline_outcome(
    layout: tuple[bytes, int], workers: int, data: st.DataObject
) -> None:
    """Slices submitted to the worker threads at once (WRITEs to disjoint ranges, and slices out of bounds):
    each slice's `on_done` is called exactly once, with None where the model accepts it and the bounds
    TransferError where not; then the segment equals the model, and READs submitted likewise return it.
    Closing the transport afterwards ends no slice a second time."""
    initial, length = layout
    model = bytearray(initial)
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=length), max_size=6), label="cuts"))
    writes = [
        (TransferOp.WRITE, start, data.draw(st.binary(min_size=end - start, max_size=end - start), label="bytes"))
        for start, end in zip([0, *cuts], [*cuts, length], strict=True)
    ]
    others = data.draw(st.lists(slice_specs(length), max_size=3), label="others")
    out_of_bounds = [spec for spec in others if bounds_error(spec[1], len(spec[2]), length) is not None]
    reads = [
        (TransferOp.READ, offset, payload)
        for _op, offset, payload in data.draw(st.lists(slice_specs(length), max_size=6), label="reads")
    ]
    with segment_with(initial) as (name, contents):
        descriptor = RegionDescriptor(region_id=REGION_ID, length=length, shm_name=name)
        with transport_for({REGION_ID: descriptor}, workers=workers) as transport:
            ended = []
            for specs in ([*writes, *out_of_bounds], reads):
                batch = [(op, offset, local_buffer(op, payload)) for op, offset, payload in specs]
                expected = [apply_to_model(model, length, op, offset, local) for op, offset, local in batch]
                outcomes = submit_all(transport, batch)
                ended.append(outcomes)
                for index, (op, offset, local) in enumerate(batch):
                    assert len(outcomes[index]) == 1, f"slice {index} ended {len(outcomes[index])} times"
                    error = outcomes[index][0]
                    if expected[index]:
                        assert error is None, error
                        if op == TransferOp.READ:
                            assert bytes(local) == bytes(model[offset : offset + len(local)])
                    else:
                        assert type(error) is TransferError and "outside the region" in str(error), error
                assert contents() == bytes(model)
            transport.close()
            assert all(len(outcome) == 1 for outcomes in ended for outcome in outcomes), "a slice ended again"


@settings(max_examples=30, deadline=None)
@given(data=st.data(), initial=st.binary(min_size=1, max_size=1024), excess=st.integers(min_value=1, max_value=1 << 20))
def test_a_descriptor_longer_than_its_segment_moves_nothing(data: st.DataObject, initial: bytes, excess: int) -> None:
    """A peer describing its region as longer than the segment behind it: every slice, even one inside the
    segment, is refused with TransferError and the segment is left as it was (a copy past the mapping's
    end could crash the process)."""
    length = len(initial) + excess
    with segment_with(initial) as (name, contents):
        descriptor = RegionDescriptor(region_id=REGION_ID, length=length, shm_name=name)
        with transport_for({REGION_ID: descriptor}) as transport:
            for op, offset, payload in data.draw(st.lists(slice_specs(len(initial)), min_size=1, max_size=4)):
                local = local_buffer(op, payload)
                before = bytes(local)
                error = transport.run_inline(Slice(op, memoryview(local), REGION_ID, offset, ignore))
                assert type(error) is TransferError, error
                assert bytes(local) == before and contents() == initial


@pytest.fixture(scope="module")
def exited_pid() -> int:
    return gone_pid()


@settings(max_examples=20, deadline=None)
@given(data=st.data(), initial=st.binary(min_size=1, max_size=1024))
def test_a_gone_peer_or_an_unshared_region_moves_nothing(exited_pid: int, data: st.DataObject, initial: bytes) -> None:
    """Whatever the slice: if the peer's process has exited, PeerUnavailable (its segment may outlive it);
    if the peer describes no such region, or the region is not in shared memory, a TransferError that
    is not PeerUnavailable. Nothing moves either way."""
    with segment_with(initial) as (name, contents):
        shared = RegionDescriptor(region_id=REGION_ID, length=len(initial), shm_name=name)
        plain = RegionDescriptor(region_id=REGION_ID + 1, length=len(initial))
        descriptors = {REGION_ID: shared, REGION_ID + 1: plain}
        op, offset, payload = data.draw(slice_specs(len(initial)), label="slice")
        cases: list[tuple[dict[str, Any], int, type[TransferError]]] = [
            ({"peer_pid": exited_pid}, REGION_ID, PeerUnavailable),
            ({}, REGION_ID + 1, TransferError),
            ({}, REGION_ID + 2, TransferError),
        ]
        for options, region_id, expected in cases:
            with transport_for(descriptors, **options) as transport:
                local = local_buffer(op, payload)
                before = bytes(local)
                error = transport.run_inline(Slice(op, memoryview(local), region_id, offset, ignore))
                assert type(error) is expected, (options, region_id, error)
                assert bytes(local) == before and contents() == initial


@settings(max_examples=20, deadline=None)
@given(data=st.data(), initial=st.binary(min_size=1, max_size=1024))
def test_a_closed_transport_ends_every_slice_unavailable_and_moves_nothing(data: st.DataObject, initial: bytes) -> None:
    """After `close`, any slice, run inline or submitted, ends at once with PeerUnavailable (its `on_done`
    called exactly once) and moves nothing."""
    with segment_with(initial) as (name, contents):
        descriptor = RegionDescriptor(region_id=REGION_ID, length=len(initial), shm_name=name)
        with transport_for({REGION_ID: descriptor}, workers=2) as transport:
            transport.close()
            for op, offset, payload in data.draw(st.lists(slice_specs(len(initial)), min_size=1, max_size=4)):
                local = local_buffer(op, payload)
                before = bytes(local)
                assert isinstance(
                    transport.run_inline(Slice(op, memoryview(local), REGION_ID, offset, ignore)), PeerUnavailable
                )
                ended: list[TransferError | None] = []
                transport.submit(Slice(op, memoryview(local), REGION_ID, offset, ended.append))
                assert len(ended) == 1 and isinstance(ended[0], PeerUnavailable), ended
                assert bytes(local) == before and contents() == initial
