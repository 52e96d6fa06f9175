"""Open-addressing table of 64-bit block keys → holder bits, in numba-compiled loops.

The storage behind `BlockIndex`. Per entry: the key (uint64) and `num_words`
uint64 words of holder bits, 16 holder slots per word, a nibble per slot:
bits 0-2 say which tiers (VRAM, DRAM, SSD) hold the key, bit 3 is set iff any
of them is (the presence bit `match` reads). An entry is empty iff all its words
are zero: a key nobody holds is not stored. Linear probing on a mixed hash;
deletion shifts later entries back (no tombstones); the table doubles past 3/4
load. About 16 bytes per entry at one word, so 22-44 bytes per key.

Everything per key runs in compiled loops over numpy arrays: one cache line per
key touched, no Python object per key. Functions are compiled on first use and
cached on disk (numba `cache=True`). Without numba (or with
`_compiled.use_compiled(False)`) the same kernels run as plain Python on the
same arrays: identical tables and answers, slower.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mooncake.cache._compiled import is_compiled, plain_kernels

__all__ = ["KeyTable"]

SLOTS_PER_WORD = 16
_PRESENCE = 0x8888888888888888


# compiled? -> kernel name -> function; filled on first use of each path.
_KERNELS: dict[bool, dict[str, Any]] = {}


def _kernels(compiled: bool) -> dict[str, Any]:
    # Imported on first use so that `import mooncake.cache` does not load numba.
    if compiled not in _KERNELS:
        from mooncake.cache import _key_table_kernels as kernels

        if compiled:
            _KERNELS[compiled] = {name: getattr(kernels, name) for name in kernels.__all__}
        else:
            _KERNELS[compiled] = {**plain_kernels(kernels), "match": kernels.match_arrays}
    return _KERNELS[compiled]


class KeyTable:
    """uint64 key → holder nibbles, for up to ``16 * num_words`` slots (grows on demand).

    Invariants:
    - An entry is stored iff some nibble of it is non-zero.
    - A nibble's presence bit is set iff one of its tier bits is.
    - `counts[s]` is the number of entries whose slot-s nibble is non-zero.
    """

    def __init__(self, *, capacity: int = 1024, num_slots: int = 16) -> None:
        self.is_compiled = is_compiled()  # chosen once per table
        self._k = _kernels(self.is_compiled)
        size = 1 << max(4, (capacity - 1).bit_length())
        self.keys = np.zeros(size, dtype=np.uint64)
        self.words = np.zeros((size, max(1, -(-num_slots // SLOTS_PER_WORD))), dtype=np.uint64)
        self.counts = np.zeros(self.words.shape[1] * SLOTS_PER_WORD, dtype=np.int64)
        self.size = 0

    @property
    def num_slots(self) -> int:
        return int(self.counts.size)

    def ensure_slots(self, num_slots: int) -> None:
        """Make room for slots 0 .. num_slots-1 (adds zero words; no rehash)."""
        num_words = -(-num_slots // SLOTS_PER_WORD)
        if num_words > self.words.shape[1]:
            words = np.zeros((self.keys.size, num_words), dtype=np.uint64)
            words[:, : self.words.shape[1]] = self.words
            self.words = words
            counts = np.zeros(num_words * SLOTS_PER_WORD, dtype=np.int64)
            counts[: self.counts.size] = self.counts
            self.counts = counts

    def add(self, batch: np.ndarray[Any, Any], slot: int, tier: int) -> None:
        """Record that `slot` holds every key of `batch` in `tier`."""
        if self.size + batch.size > self.keys.size * 3 // 4:
            self._resize(self.size + batch.size)
        word, shift = divmod(slot, SLOTS_PER_WORD)
        bits = np.uint64((1 << (4 * shift + tier)) | (1 << (4 * shift + 3)))
        self.size += self._k["add"](self.keys, self.words, batch, word, bits, self.counts, slot)

    def discard(self, batch: np.ndarray[Any, Any], slot: int, tier: int) -> None:
        """Record that `slot` no longer holds the keys of `batch` in `tier`."""
        word, shift = divmod(slot, SLOTS_PER_WORD)
        tier_bit = np.uint64(1 << (4 * shift + tier))
        nibble = np.uint64(0xF << (4 * shift))
        self.size -= self._k["discard"](self.keys, self.words, batch, word, tier_bit, nibble, self.counts, slot)

    def clear_slot(self, slot: int) -> None:
        """Drop everything `slot` holds."""
        if not self.counts[slot]:
            return
        word, shift = divmod(slot, SLOTS_PER_WORD)
        emptied = self._k["clear"](self.keys, self.words, word, np.uint64(0xF << (4 * shift)))
        self.counts[slot] = 0
        if emptied:  # emptied entries break probe runs: rebuild from the survivors
            self._resize(self.size)

    def find(self, key: int) -> int:
        """Entry index of `key`, or -1."""
        return int(self._k["find"](self.keys, self.words, np.uint64(key)))

    def nibble(self, entry: int, slot: int) -> int:
        word, shift = divmod(slot, SLOTS_PER_WORD)
        return int(self.words[entry, word]) >> (4 * shift) & 0xF

    def match(self, query: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Per slot, the contiguous prefix of `query` it holds."""
        lengths = np.zeros(self.counts.size, dtype=np.int64)
        if query.size:
            alive = np.empty(self.words.shape[1], dtype=np.uint64)
            alive.fill(_PRESENCE)
            self._k["match"](self.keys, self.words, query, lengths, alive)
        return lengths

    def occupied(self) -> np.ndarray[Any, Any]:
        """Boolean mask of used entries."""
        return np.any(self.words != 0, axis=1)  # type: ignore[no-any-return]

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.words.nbytes + self.counts.nbytes)

    def _resize(self, needed: int) -> None:
        size = 16
        while needed > size * 3 // 4:
            size *= 2
        keys = np.zeros(size, dtype=np.uint64)
        words = np.zeros((size, self.words.shape[1]), dtype=np.uint64)
        self.size = int(self._k["rehash"](self.keys, self.words, keys, words))
        self.keys, self.words = keys, words


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel, e.g. right after install."""
    table = KeyTable(capacity=4)
    batch = np.arange(1, 40, dtype=np.uint64)
    table.add(batch, 0, 1)  # also resizes: rehash
    table.match(batch)
    table.find(1)
    table.discard(batch[:5], 0, 1)
    table.clear_slot(0)
