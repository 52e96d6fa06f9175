"""Staging memory: where a checksummed WRITE waits until it is verified.

A WRITE that carries a checksum is received into a staging buffer, hashed
there, and copied into its target region only if the hash matches, so a
payload that fails its checksum never becomes visible in the region (a
reader of the region sees the old bytes or the new ones, never corrupt ones).
The price is one extra copy of the payload (memory speed, several times the
speed of loopback TCP) and the staging memory itself.

`StagingPool` bounds that memory: buffers are handed out whole (a frame gets
all the bytes it needs or waits, so frames staged concurrently never deadlock
on halves of the pool), kept on a free list for reuse once given back (fresh
pages fault in on first touch, reused ones do not), and dropped from the free
list, largest first, when a new size must be allocated and the budget is
spent. A buffer's size is its request rounded up to a power of two (at least
64 KiB; the exact request when the rounded size does not fit), so sizes
repeat and reuse is likely.

Invariants:
- held_bytes (free + in use) never exceeds capacity_bytes.
- A buffer is either free or in use, never both; in-use sizes + free sizes = held_bytes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt

from mooncake._checks import require_int

__all__ = ["StagingPool"]

_MIN_BUFFER_BYTES = 64 << 10


class StagingPool:
    """A bounded pool of reusable byte buffers.

    Args:
        capacity_bytes: the most memory the pool holds, free and in use together.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = require_int("capacity_bytes", capacity_bytes, minimum=1)
        self._free: list[npt.NDArray[np.uint8]] = []
        self._in_use: dict[int, int] = {}  # id(buffer) -> its size
        self._held_bytes = 0
        self._waiting = 0  # threads in try_allocate waiting for memory
        self._changed = threading.Condition(threading.Lock())

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def try_allocate(self, nbytes: int, *, deadline: float) -> npt.NDArray[np.uint8] | None:
        """A buffer of at least `nbytes`, waiting until `deadline` (time.monotonic) for memory.

        Returns:
            The buffer (give it back with `free`), or None when the pool could
            not supply one by the deadline (or `nbytes` exceeds its capacity).
        """
        if nbytes > self.capacity_bytes:
            return None
        size = min(self.capacity_bytes, max(_MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length()))
        with self._changed:
            if self._free and nbytes <= self._free[-1].nbytes <= size:
                warm = self._free.pop()  # the one freed last fits snugly, and is warm in cache
                self._in_use[id(warm)] = warm.nbytes
                return warm
            while True:
                buffer = self._take_free(nbytes)
                for fresh in (size, nbytes):  # the exact size when the rounded one does not fit
                    if buffer is None and self._make_room(fresh):
                        buffer = np.empty(fresh, dtype=np.uint8)
                        self._held_bytes += fresh
                if buffer is not None:
                    self._in_use[id(buffer)] = buffer.nbytes
                    return buffer
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._waiting += 1
                try:
                    self._changed.wait(remaining)
                finally:
                    self._waiting -= 1

    def free(self, buffer: npt.NDArray[np.uint8]) -> None:
        """Give back a buffer from `try_allocate`."""
        with self._changed:
            if self._in_use.pop(id(buffer), None) is None:
                raise ValueError("this buffer is not in use from this pool")
            self._free.append(buffer)
            if self._waiting:
                self._changed.notify_all()

    def check_invariants(self) -> None:
        with self._changed:
            free_bytes = sum(buffer.nbytes for buffer in self._free)
            assert self._held_bytes <= self.capacity_bytes, (self._held_bytes, self.capacity_bytes)
            assert free_bytes + sum(self._in_use.values()) == self._held_bytes
            assert not {id(buffer) for buffer in self._free} & set(self._in_use)

    def _take_free(self, nbytes: int) -> npt.NDArray[np.uint8] | None:
        """The smallest free buffer that holds `nbytes`, off the free list."""
        fitting = [i for i, buffer in enumerate(self._free) if buffer.nbytes >= nbytes]
        if not fitting:
            return None
        best = min(fitting, key=lambda i: self._free[i].nbytes)
        return self._free.pop(best)

    def _make_room(self, size: int) -> bool:
        """Drop free buffers (largest first) until `size` more bytes fit; False (dropping none) if they cannot."""
        if self._held_bytes - sum(buffer.nbytes for buffer in self._free) + size > self.capacity_bytes:
            return False
        self._free.sort(key=lambda buffer: buffer.nbytes)
        while self._held_bytes + size > self.capacity_bytes and self._free:
            self._held_bytes -= self._free.pop().nbytes
        return self._held_bytes + size <= self.capacity_bytes
