"""The blocks that prefills queued on each instance will leave in its cache: a multiset of keys per owner.

A request queued on a prefill instance behind others starts after them (FIFO),
so it will find in that instance's cache what they stored as well as what the
index shows now. The Conductor counts each queued prompt's block keys for its
instance (`add`) until the request leaves the queue (`remove`), and continues
each instance's indexed prefix of a new prompt while the prompt's next key is
counted there (`walk`).

Where numba imports, the counts live in one open-addressing table of
(owner, key) → count for all owners (numpy arrays, linear probing,
backward-shift deletion, grown by doubling at half full), worked by the
compiled kernels of `sched._kernels`: adding a 64-block prompt is one call, not
64 inserts into a Python dict that, with a few thousand queued prompts, no
longer fits the CPU's caches. Without numba (or with
`_compiled.use_compiled(False)` when the object is made) they live in one
`collections.Counter` per owner, whose `update` is one C call: the same counts
and walks, without the table's kernels run as slow Python. Owners are small
non-negative ints the caller assigns (the Conductor: one per prefill instance,
for its lifetime); keys are uint64 as the index stores them
(`cache.index.key_array`).

Invariants (`check_invariants`): what is counted is present, with a count
> 0; `len()` is the number of (owner, key) pairs counted; in the table, every
present entry is reachable from its home bucket without crossing an empty one,
and the table is at most half full.
"""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt

from mooncake._checks import require_int, shown
from mooncake.cache._compiled import is_compiled, kernels
from mooncake.errors import InvalidRequestError

__all__ = ["PendingBlocks"]

_KERNELS = "mooncake.sched._kernels"
_MIN_CAPACITY = 1024
_KEY_DTYPE = np.dtype(np.uint64)
_MAX_CAPACITY = 1 << 32  # a first size past this is a mistake (a table of 2**33 slots), not a hint


class _Table:
    """The compiled path: one open-addressing table of (owner, key) -> count."""

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        size = 1 << max(4, (max(capacity, 1) - 1).bit_length())
        self._keys = np.zeros(size, dtype=np.uint64)
        self._owners = np.full(size, -1, dtype=np.int64)
        self._counts = np.zeros(size, dtype=np.int64)
        self._size = 0
        self._k = kernels(_KERNELS)

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


class _Counters:
    """The plain path: a `collections.Counter` of keys per owner."""

    def __init__(self) -> None:
        self._coming: dict[int, collections.Counter[int]] = {}

    def __len__(self) -> int:
        return sum(len(counter) for counter in self._coming.values())

    def add(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        if keys.size:
            self._coming.setdefault(owner, collections.Counter()).update(keys.tolist())

    def remove(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        counter = self._coming.get(owner)
        if counter is None:
            return
        for key in keys.tolist():
            count = counter.get(key, 0)
            if count > 1:
                counter[key] = count - 1
            elif count:
                del counter[key]
        if not counter:  # nothing coming there any more: the walk skips the owner
            del self._coming[owner]

    def count(self, owner: int, key: int) -> int:
        return self._coming.get(owner, collections.Counter())[key]

    def walk(
        self, prompt: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64], owners: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        walked = lengths.copy()
        if not self._coming:
            return walked
        keys = prompt.tolist()
        for slot, owner in enumerate(owners.tolist()):
            counter = self._coming.get(owner)
            if counter is None:
                continue
            end = int(walked[slot])
            while end < len(keys) and keys[end] in counter:
                end += 1
            walked[slot] = end
        return walked

    def counts(self) -> dict[tuple[int, int], int]:
        return {(owner, key): n for owner, counter in self._coming.items() for key, n in counter.items()}

    def check_invariants(self) -> None:
        for owner, counter in self._coming.items():
            assert counter, f"owner {owner}: an empty counter kept"
            assert all(n > 0 for n in counter.values()), f"owner {owner}: a key counted 0 times"


class PendingBlocks:
    """Block keys counted per owner, with the walk along a prompt (see the module docstring); the
    path (compiled table or plain counters) is chosen when it is made, for its lifetime, as a
    `KeyTable`'s is.

    Args:
        capacity: (owner, key) pairs the table is first sized for (it grows past them); the plain path ignores it.

    Raises:
        ConfigError: a `capacity` that is not an integer in [0, 2**32).
    """

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        capacity = require_int("capacity", capacity, minimum=0, below=_MAX_CAPACITY)
        self.is_compiled = is_compiled()
        self._store: _Table | _Counters = _Table(capacity) if self.is_compiled else _Counters()

    def __len__(self) -> int:
        """(owner, key) pairs counted at least once."""
        return len(self._store)

    def add(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        """Count each of `keys` (a key twice: twice) once more for `owner` (>= 0: the table marks an empty
        slot with owner −1, and `walk` reads a negative owner as "nothing is coming").

        Raises:
            InvalidRequestError: an owner that is not an integer >= 0, or `keys` that are no 1-D uint64 array
                (`cache.index.key_array`); nothing counted.
        """
        owner = _check_owner(owner)
        _check_keys(keys)
        self._store.add(owner, keys)

    def remove(self, owner: int, keys: npt.NDArray[np.uint64]) -> None:
        """Count each of `keys` once less for `owner`: what `add` counted for a request that left.

        Raises:
            InvalidRequestError: as `add`'s; nothing changed.
        """
        owner = _check_owner(owner)
        _check_keys(keys)
        self._store.remove(owner, keys)

    def count(self, owner: int, key: int) -> int:
        """How many times `key` is counted for `owner`."""
        return self._store.count(owner, key)

    def walk(
        self, prompt: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64], owners: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Each slot's prefix `lengths[slot]` continued while the prompt's next key is counted for
        `owners[slot]` (< 0: nothing is coming there), as a new array."""
        return self._store.walk(prompt, lengths, owners)

    def counts(self) -> dict[tuple[int, int], int]:
        """Every (owner, key) counted, with its count."""
        return self._store.counts()

    def check_invariants(self) -> None:
        self._store.check_invariants()


def _check_owner(owner: int) -> int:
    """`owner` as a plain int (a numpy integer converted: the kernels take one type), or an InvalidRequestError."""
    if type(owner) is int and owner >= 0:  # the Conductor's owners: one test each
        return owner
    return require_int("owner (an instance slot)", owner, minimum=0, error=InvalidRequestError)


def _check_keys(keys: npt.NDArray[np.uint64]) -> None:
    """`keys` as the index stores them, a 1-D uint64 array; anything else an InvalidRequestError (a list failed
    deep inside as an AttributeError; int64 keys would compile the kernels anew and count other keys)."""
    # A native uint64 array's dtype is numpy's one instance of it: `is` passes it without building a dtype to compare.
    if type(keys) is not np.ndarray or (keys.dtype is not _KEY_DTYPE and keys.dtype != _KEY_DTYPE) or keys.ndim != 1:
        raise InvalidRequestError(f"keys must be a 1-D uint64 array (cache.index.key_array), got {shown(keys)}")
