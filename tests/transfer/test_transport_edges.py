"""Edges of the transfer engine's data path that its other tests leave open.

Regions: `Region.slice` against Python's own slicing (bounds refused by a `TransferError` that names the
region, the offset and the end; never a negative index wrapping around); read-only buffers refused at
registration; a segment this process created stays tracked when mapped again. The staging pool: an
exact-size free buffer is reused, free memory is dropped largest first and never dropped in vain.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import MooncakeError, TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.region import Region, RegionDescriptor, attach_shared, create_shared
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp
from mooncake.transfer.staging import StagingPool
from tests.transfer.conftest import SECRET, request
from tests.waiting import wait_for

MIB = 1 << 20
KIB = 1 << 10


# --------------------------------------------------------------------------- regions


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(0, 64),
    offset=st.integers(-70, 70),
    length=st.integers(-70, 70),
    region_id=st.integers(1, 1000),
)
def test_a_region_slice_is_the_python_slice_inside_and_refused_by_name_outside(
    size: int, offset: int, length: int, region_id: int
) -> None:
    """`Region.slice(offset, length)` is exactly bytes[offset:offset + length] (a writable view of the same
    memory) when 0 <= offset and 0 <= length and offset + length <= size; otherwise it raises a TransferError
    naming the region id, the offset and the end (never a negative index that Python would wrap around)."""
    backing = bytearray(bytes(range(size)))
    region = Region(RegionDescriptor(region_id=region_id, length=size), memoryview(backing))
    inside = offset >= 0 and length >= 0 and offset + length <= size
    if not inside:
        with pytest.raises(TransferError) as refused:
            region.slice(offset, length)
        message = str(refused.value)
        assert isinstance(refused.value, MooncakeError)
        assert f"region {region_id}" in message and f"[{offset}, {offset + length})" in message, message
        assert backing == bytearray(bytes(range(size)))
        return
    view = region.slice(offset, length)
    assert bytes(view) == bytes(backing[offset : offset + length])
    if length:
        view[0] ^= 0xFF  # the same memory, not a copy
        assert backing[offset] == (offset ^ 0xFF)


@pytest.mark.parametrize(
    "buffer",
    [
        pytest.param(lambda: b"\x00" * 64, id="bytes"),
        pytest.param(lambda: memoryview(bytearray(64)).toreadonly(), id="readonly-view"),
        pytest.param(lambda: _readonly(), id="readonly-array"),
    ],
)
def test_a_read_only_buffer_is_refused_and_registers_nothing(buffer: Any) -> None:
    """Registering memory a peer could not write into (bytes, a read-only view or array) raises a
    TransferError and leaves the engine's regions as they were."""
    with TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",))) as engine:
        before = engine.regions()
        with pytest.raises(TransferError, match="writable"):
            engine.register_memory(buffer())
        assert engine.regions() == before


def _readonly() -> np.ndarray:
    array = np.zeros(64, np.uint8)
    array.flags.writeable = False
    return array


def test_a_segment_created_here_stays_tracked_when_mapped_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping one of this process's own segments (an engine that is its own shm peer) leaves it registered
    with the resource tracker (only a peer's segment is untracked, so that our exit does not unlink it)."""
    segment, array = create_shared(256)
    untracked: list[str] = []
    real_unregister = resource_tracker.unregister
    monkeypatch.setattr(resource_tracker, "unregister", lambda name, rtype: untracked.append(name))
    try:
        again = attach_shared(segment.name)
        again.close()
        assert untracked == []
    finally:
        monkeypatch.setattr(resource_tracker, "unregister", real_unregister)
        del array
        segment.unlink()


# --------------------------------------------------------------------------- staging


def test_a_free_buffer_of_exactly_the_size_asked_is_reused() -> None:
    """A request gets the smallest free buffer that holds it, an exact fit included (not a larger one)."""
    pool = StagingPool(4 * MIB)
    now = time.monotonic()
    exact = pool.try_allocate(64 * KIB, deadline=now)
    larger = pool.try_allocate(128 * KIB, deadline=now)
    assert exact is not None and larger is not None and exact.nbytes == 64 * KIB
    pool.free(exact)
    pool.free(larger)  # freed last: the warm one, but twice the size
    assert pool.try_allocate(64 * KIB, deadline=now) is exact
    pool.check_invariants()


def test_free_memory_is_dropped_largest_first_and_only_as_much_as_needed() -> None:
    """To make room, free buffers go largest first until the new one fits; the smaller ones stay for reuse."""
    pool = StagingPool(8 * MIB)
    now = time.monotonic()
    held, small, medium = (pool.try_allocate(n, deadline=now) for n in (2 * MIB, MIB, 2 * MIB))
    assert held is not None and small is not None and medium is not None
    pool.free(small)
    pool.free(medium)  # 5 MiB held: 2 in use, 1 + 2 free
    big = pool.try_allocate(3 * MIB, deadline=now)  # 4 MiB: dropping the 2 MiB one is enough
    assert big is not None and big.nbytes == 4 * MIB
    assert pool.held_bytes == 7 * MIB
    assert pool.try_allocate(MIB, deadline=now) is small
    pool.check_invariants()


def test_free_memory_is_not_dropped_when_the_request_cannot_fit_anyway() -> None:
    """A request that cannot fit beside the buffers in use drops no free buffer (it waits, then gets None)."""
    pool = StagingPool(4 * MIB)
    now = time.monotonic()
    in_use, free = pool.try_allocate(2 * MIB, deadline=now), pool.try_allocate(MIB, deadline=now)
    assert in_use is not None and free is not None
    pool.free(free)
    assert pool.try_allocate(3 * MIB, deadline=now) is None  # 2 in use + 3 > 4, however much is dropped
    assert pool.held_bytes == 3 * MIB
    assert pool.try_allocate(MIB, deadline=now) is free
    pool.check_invariants()


# --------------------------------------------------------------------------- two engines in this process

FAST = EngineConfig(
    transports=("shm", "tcp"),
    io_timeout_s=5.0,
    connect_timeout_s=5.0,
    slice_bytes=4 * KIB,
    max_frame_bytes=64 * KIB,
    streams_per_peer=2,
    spin_us=0,
)


@contextlib.contextmanager
def two_engines(config: EngineConfig = FAST) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A local engine and a peer engine on 127.0.0.1, both closed at the end."""
    with TransferEngine(secret=SECRET, config=config) as remote, TransferEngine(secret=SECRET, config=config) as local:
        yield local, remote


def transfer_threads() -> set[threading.Thread]:
    """The worker threads of transports (named by `Workers` after their transport)."""
    return {t for t in threading.enumerate() if t.name.startswith(("tcp-", "shm-"))}


def test_a_region_unregistered_after_it_was_mapped_is_not_written_over_shm() -> None:
    """Over shm, a write to a region its peer has unregistered fails with TransferError even though the
    segment is still mapped here from an earlier copy (the bytes would reach no one), and moves nothing."""
    with two_engines() as (local, remote):
        shared, remote_array = remote.allocate_shared(4 * KIB)
        mine, local_array = local.allocate_shared(4 * KIB)
        peer = local.connect(remote.address, transport="shm")
        remote_array[:] = 3
        (status,) = local.transfer_sync(
            [request(TransferOp.READ, mine.region_id, peer, shared.region_id, 100)], timeout=10
        )
        assert status.state == RequestState.DONE and local_array[:100].tolist() == [3] * 100
        remote.unregister_memory(shared.region_id)
        local_array[:] = 9
        write = request(TransferOp.WRITE, mine.region_id, peer, shared.region_id, 100)
        (status,) = local.transfer_sync([write], timeout=10)
        assert status.state == RequestState.FAILED and isinstance(status.error, TransferError)
        assert "unregistered" in str(status.error)
        assert remote_array.tolist() == [3] * (4 * KIB)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_closing_an_engine_stops_its_transport_threads(transport: str) -> None:
    """After a batch over every stream, closing the engine stops each of its transport's worker threads."""
    before = transfer_threads()
    with two_engines() as (local, remote):
        shared, _ = remote.allocate_shared(64 * KIB)
        mine, _ = local.allocate_shared(64 * KIB)
        peer = local.connect(remote.address, transport=transport)
        batch = local.submit([request(TransferOp.WRITE, mine.region_id, peer, shared.region_id, 64 * KIB)])
        assert [s.state for s in local.wait(batch, timeout=30)] == [RequestState.DONE]
        started = transfer_threads() - before
        assert len(started) >= FAST.streams_per_peer
        local.close()
        wait_for(lambda: not any(t.is_alive() for t in started), timeout=15, what="transport threads to stop")
