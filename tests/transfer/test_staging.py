"""The staging pool: bounded memory for checksummed writes, whole buffers or none, reused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from mooncake.errors import ConfigError
from mooncake.transfer.staging import StagingPool

MIB = 1 << 20


def test_buffers_are_reused_and_the_budget_holds() -> None:
    """A freed buffer serves the next request that fits; past the budget a request gets None at its deadline."""
    pool = StagingPool(4 * MIB)
    first = pool.try_allocate(3 * MIB, deadline=time.monotonic())
    assert first is not None and first.nbytes >= 3 * MIB
    assert pool.try_allocate(2 * MIB, deadline=time.monotonic() + 0.05) is None  # 3 + 2 > 4: waits, then gives up
    pool.free(first)
    again = pool.try_allocate(1 * MIB, deadline=time.monotonic())
    assert again is first  # the smallest free buffer that holds it
    pool.free(again)
    assert pool.try_allocate(5 * MIB, deadline=time.monotonic() + 10) is None  # never fits: at once
    pool.check_invariants()


def test_sizes_round_up_to_a_power_of_two_and_a_request_gets_the_snuggest_free_buffer() -> None:
    """A request's buffer is its size rounded up to a power of two (a power of two stays itself, 64 KiB at
    least); from the free list it gets the smallest buffer that holds it, not a larger one freed last."""
    pool = StagingPool(8 * MIB)
    now = time.monotonic()
    sizes = {n: pool.try_allocate(n, deadline=now) for n in (MIB, 4 * MIB)}
    assert {n: b.nbytes for n, b in sizes.items() if b is not None} == {MIB: MIB, 4 * MIB: 4 * MIB}
    pool.free(sizes[MIB])  # type: ignore[arg-type]
    pool.free(sizes[4 * MIB])  # type: ignore[arg-type]  # freed last, and warm, but four times too big
    small = pool.try_allocate(600 << 10, deadline=now)
    assert small is sizes[MIB]
    tiny = pool.try_allocate(10, deadline=now)
    assert tiny is sizes[4 * MIB]  # the only one free: any that holds it will do
    pool.free(small)  # type: ignore[arg-type]
    pool.free(tiny)  # type: ignore[arg-type]
    assert pool.try_allocate(100, deadline=now) is small  # not the 4 MiB one freed last: past its 64 KiB
    pool.check_invariants()


def test_free_memory_is_dropped_to_make_room_for_another_size() -> None:
    """Free buffers too small for a request are dropped when the budget is needed for a bigger one."""
    pool = StagingPool(4 * MIB)
    small = pool.try_allocate(MIB, deadline=time.monotonic())
    assert small is not None
    pool.free(small)
    big = pool.try_allocate(4 * MIB, deadline=time.monotonic())
    assert big is not None and pool.held_bytes == 4 * MIB
    pool.check_invariants()


def test_a_waiting_request_is_served_when_memory_is_freed() -> None:
    """A request that does not fit waits, and is woken by the buffer another connection gives back (at once, not
    at its deadline)."""
    pool = StagingPool(2 * MIB)
    held = pool.try_allocate(2 * MIB, deadline=time.monotonic())
    assert held is not None
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.try_allocate(MIB, deadline=time.monotonic() + 30)))
    waiter.start()
    deadline = time.monotonic() + 10
    while pool._waiting == 0:  # it is waiting: only a wake-up serves it before its deadline
        assert time.monotonic() < deadline, "the request never waited"
        time.sleep(0.005)
    freed = time.monotonic()
    pool.free(held)
    waiter.join(timeout=10)
    assert got and got[0] is not None and time.monotonic() - freed < 5


def test_a_buffer_is_freed_once() -> None:
    pool = StagingPool(MIB)
    buffer = pool.try_allocate(10, deadline=time.monotonic())
    assert buffer is not None
    pool.free(buffer)
    with pytest.raises(ValueError):
        pool.free(buffer)
    with pytest.raises(ConfigError):
        StagingPool(0)


class PoolMachine(RuleBasedStateMachine):
    """Allocations and frees against a model of what is in use: a request is refused exactly when no
    free buffer holds it and it does not fit beside the buffers in use; the budget always holds."""

    buffers = Bundle("buffers")

    def __init__(self) -> None:
        super().__init__()
        self.pool = StagingPool(8 * MIB)
        self.in_use: dict[int, int] = {}  # id -> bytes asked

    @rule(target=buffers, nbytes=st.integers(0, 9 * MIB))
    def allocate(self, nbytes: int) -> object:
        fits_a_free_one = any(free.nbytes >= nbytes for free in self.pool._free)
        used = sum(self.in_use.values())  # the sizes handed out, rounded up as the pool rounds
        buffer = self.pool.try_allocate(nbytes, deadline=time.monotonic())
        # Refused exactly when nothing free holds it and it cannot fit beside what is in use.
        assert (buffer is None) == (not fits_a_free_one and used + nbytes > 8 * MIB)
        if buffer is None:
            return None
        assert buffer.nbytes >= nbytes and buffer.dtype == np.uint8
        assert id(buffer) not in self.in_use
        buffer[:nbytes] = 1  # writable, all of it
        self.in_use[id(buffer)] = buffer.nbytes
        return buffer

    @rule(buffer=consumes(buffers))
    def free(self, buffer: object) -> None:
        if buffer is None:
            return
        del self.in_use[id(buffer)]
        self.pool.free(buffer)  # type: ignore[arg-type]

    @invariant()
    def within_budget(self) -> None:
        self.pool.check_invariants()
        assert self.pool.held_bytes <= 8 * MIB


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
