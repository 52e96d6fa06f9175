"""The blocks that prefills queued on each instance will leave in its cache: a multiset of keys per owner.

A request queued on a prefill instance behind others starts after them (FIFO),
so it will find in that instance's cache what they stored as well as what the
index shows now. The Conductor counts each queued prompt's block keys for its
instance (`add`) until the request leaves the queue (`remove`), and continues
each instance's indexed prefix of a new prompt while the prompt's next key is
counted there (`walk`).

The counts live in one open-addressing table of (owner, key) → count for all
owners (numpy arrays, linear probing, backward-shift deletion, grown by
doubling at half full), worked by the compiled kernels of `sched._kernels`
where numba imports: adding a 64-block prompt is one call, not 64 inserts into
a Python dict that, with a few thousand queued prompts, no longer fits the CPU's
caches. Owners are small non-negative ints the caller assigns (the Conductor:
one per prefill instance, for its lifetime); keys are uint64 as the index
stores them (`cache.index.key_array`).

Invariants (`check_invariants`): an entry is present iff its count is > 0;
`len()` is the number of present entries; every present entry is reachable
from its home bucket without crossing an empty one; the table is at most half full.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from mooncake.cache._compiled import kernels

__all__ = ["PendingBlocks"]

_KERNELS = "mooncake.sched._kernels"
_MIN_CAPACITY = 1024


class PendingBlocks:
    """Block keys counted per owner, with the walk along a prompt (see the module docstring)."""

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        size = 1 << max(4, (max(capacity, 1) - 1).bit_length())
        self._keys = np.zeros(size, dtype=np.uint64)
        self._owners = np.full(size, -1, dtype=np.int64)
        self._counts = np.zeros(size, dtype=np.int64)
        self._size = 0
        self._k = kernels(_KERNELS)  # the path in use when the table is made, for its lifetime (as a KeyTable)

    def __len__(self) -> int:
        """(owner, key) pairs counted at least once."""
        return self._size

    def add(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        """Count each of `keys` (a key twice: twice) once more for `owner`."""
        if (self._size + keys.size) * 2 > self._keys.size:
            self._grow(self._size + keys.size)
        self._size += self._k.pending_add(self._keys, self._owners, self._counts, keys, owner)

    def remove(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        """Count each of `keys` once less for `owner`: what `add` counted for a request that left."""
        self._size -= self._k.pending_remove(self._keys, self._owners, self._counts, keys, owner)

    def count(self, owner: int, key: int) -> int:
        """How many times `key` is counted for `owner`."""
        at = self._k.pending_find(self._keys, self._owners, np.uint64(key), owner)
        return 0 if at < 0 else int(self._counts[at])

    def walk(
        self, prompt: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64], owners: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Each slot's prefix `lengths[slot]` continued while the prompt's next key is counted for
        `owners[slot]` (< 0: nothing is coming there), as a new array."""
        walked: npt.NDArray[np.int64] = self._k.pending_walk(self._keys, self._owners, prompt, lengths, owners)
        return walked

    def counts(self) -> dict[tuple[int, int], int]:
        """Every (owner, key) counted, with its count."""
        present = np.flatnonzero(self._owners >= 0)
        return {
            (int(owner), int(key)): int(count)
            for owner, key, count in zip(
                self._owners[present].tolist(),
                self._keys[present].tolist(),
                self._counts[present].tolist(),
                strict=True,
            )
        }

    def _grow(self, needed: int) -> None:
        size = self._keys.size
        while needed * 2 > size:
            size *= 2
        keys = np.zeros(size, dtype=np.uint64)
        owners = np.full(size, -1, dtype=np.int64)
        counts = np.zeros(size, dtype=np.int64)
        self._k.pending_rehash(self._keys, self._owners, self._counts, keys, owners, counts)
        self._keys, self._owners, self._counts = keys, owners, counts

    def check_invariants(self) -> None:
        present = self._owners >= 0
        assert int(present.sum()) == self._size, "size out of sync"
        assert (self._counts[present] > 0).all(), "a present entry counted 0 times"
        assert (self._counts[~present] == 0).all(), "an empty entry with a count"
        assert self._size * 2 <= self._keys.size, "more than half full"
        for i in np.flatnonzero(present).tolist():
            found = self._k.pending_find(self._keys, self._owners, self._keys[i], int(self._owners[i]))
            assert found == i, f"entry {i} unreachable from its home bucket"
