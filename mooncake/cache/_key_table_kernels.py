"""Kernels of `_key_table`: compiled by numba (cached on disk) where it imports, else plain Python.

Arrays: `keys` uint64[capacity] (a power of two), `words` uint64[capacity,
num_words] of holder nibbles; an entry is empty iff all its words are zero.
See `_key_table` for the layout and invariants.

The functions are written once, in the subset of Python that numba compiles and
that numpy scalars run unchanged: `_compiled.jit` compiles them, and
`_compiled.plain_kernels` gives the same functions undecorated, so both paths
lay out the table identically (same probe sequences, same entries). One
exception: the plain path matches with `match_arrays`, the same answer from
whole-array numpy operations, since `match` run as Python is ~30x slower than
compiled and is the query a router asks per request.
"""

import numpy as np

from mooncake.cache._compiled import jit as _jit

__all__ = ["add", "clear", "discard", "find", "match", "rehash"]

_PRESENCE = np.uint64(0x8888888888888888)
_MIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)

jit = _jit(cache=True, nogil=True)


@jit
def bucket(key, mask):  # type: ignore[no-untyped-def]
    # murmur3 finalizer: trace ids are small consecutive ints, keys from a hash are not.
    h = key ^ (key >> _SHIFT)
    h *= _MIX_1
    h ^= h >> _SHIFT
    h *= _MIX_2
    h ^= h >> _SHIFT
    return np.int64(h & np.uint64(mask))


@jit
def is_empty(words, i):  # type: ignore[no-untyped-def]
    for w in range(words.shape[1]):  # noqa: SIM110 - an explicit loop compiles to a tight loop in numba
        if words[i, w] != 0:
            return False
    return True


@jit
def find(keys, words, key):  # type: ignore[no-untyped-def]
    mask = keys.size - 1
    i = bucket(key, mask)
    while not is_empty(words, i):
        if keys[i] == key:
            return i
        i = (i + 1) & mask
    return -1


@jit
def delete_at(keys, words, i):  # type: ignore[no-untyped-def]
    # Backward-shift deletion: pull later entries of the probe run into the hole.
    mask = keys.size - 1
    hole = i
    j = i
    while True:
        j = (j + 1) & mask
        if is_empty(words, j):
            break
        home = bucket(keys[j], mask)
        # Move j into the hole unless its home lies cyclically in (hole, j].
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            keys[hole] = keys[j]
            words[hole, :] = words[j, :]
            hole = j
    keys[hole] = 0
    words[hole, :] = 0


@jit
def add(keys, words, batch, word, bits, counts, slot):  # type: ignore[no-untyped-def]
    """Set `bits` (tier | presence) in `word` for each key; returns entries created."""
    mask = keys.size - 1
    created = 0
    for key in batch:
        i = bucket(key, mask)
        while not is_empty(words, i) and keys[i] != key:
            i = (i + 1) & mask
        if is_empty(words, i):
            keys[i] = key
            created += 1
        old = words[i, word]
        presence = bits & _PRESENCE
        if old & presence == 0:
            counts[slot] += 1
        words[i, word] = old | bits
    return created


@jit
def discard(keys, words, batch, word, tier_bit, nibble, counts, slot):  # type: ignore[no-untyped-def]
    """Clear `tier_bit`; drop presence when no tier is left; returns entries deleted."""
    deleted = 0
    for key in batch:
        i = find(keys, words, key)
        if i < 0 or words[i, word] & tier_bit == 0:
            continue
        value = words[i, word] ^ tier_bit
        if value & nibble & ~_PRESENCE == 0:
            value &= ~nibble
            counts[slot] -= 1
        words[i, word] = value
        if is_empty(words, i):
            delete_at(keys, words, i)
            deleted += 1
    return deleted


@jit
def clear(keys, words, word, nibble):  # type: ignore[no-untyped-def]
    """Clear one slot's nibble everywhere; returns whether an entry became empty."""
    emptied = False
    for i in range(keys.size):
        if words[i, word] & nibble:
            words[i, word] &= ~nibble
            if is_empty(words, i):
                emptied = True
    return emptied


@jit
def rehash(keys, words, new_keys, new_words):  # type: ignore[no-untyped-def]
    mask = new_keys.size - 1
    count = 0
    for i in range(keys.size):
        if is_empty(words, i):
            continue
        j = bucket(keys[i], mask)
        while not is_empty(new_words, j):
            j = (j + 1) & mask
        new_keys[j] = keys[i]
        new_words[j, : words.shape[1]] = words[i, :]
        count += 1
    return count


@jit
def set_lengths(lengths, w, presence, length):  # type: ignore[no-untyped-def]
    """lengths[s] = length for each slot s of word `w` whose presence bit is set in `presence`."""
    # Sixteen fixed steps: a tight loop compiled, and few numpy-scalar operations in the plain path.
    for slot in range(16):
        if presence >> np.uint64(4 * slot + 3) & np.uint64(1):
            lengths[w * 16 + slot] = length


@jit
def match(keys, words, query, lengths, alive):  # type: ignore[no-untyped-def]
    """lengths[s] = contiguous prefix of `query` held by slot s (alive: scratch, all presence bits)."""
    mask = keys.size - 1
    num_words = words.shape[1]
    position = 0
    for position in range(query.size):
        i = bucket(query[position], mask)
        while not is_empty(words, i) and keys[i] != query[position]:
            i = (i + 1) & mask
        found = not is_empty(words, i)
        any_alive = False
        for w in range(num_words):
            still = alive[w] & words[i, w] if found else np.uint64(0)
            dropped = alive[w] ^ still
            if dropped:
                set_lengths(lengths, w, dropped, position)
            alive[w] = still
            if still:
                any_alive = True
        if not any_alive:
            return
    for w in range(num_words):
        if alive[w]:
            set_lengths(lengths, w, alive[w], query.size)


def match_arrays(keys, words, query, lengths, alive):  # type: ignore[no-untyped-def]
    """`match` in whole-array numpy operations (the plain path's): the same `lengths`, no Python loop per key.

    Every query key is probed at once (one round per probe step), then a running
    AND of the found entries' words gives, per slot, the positions its presence
    bit survives: their count is its prefix length, as `match` finds it.
    """
    mask = np.uint64(keys.size - 1)
    h = query ^ (query >> _SHIFT)  # `bucket` on the whole query; uint64 arrays wrap silently
    h *= _MIX_1
    h ^= h >> _SHIFT
    h *= _MIX_2
    h ^= h >> _SHIFT
    position = (h & mask).astype(np.int64)
    entry = np.full(query.size, -1, dtype=np.int64)
    pending = np.arange(query.size)
    while pending.size:
        occupied = words[position].any(axis=1)
        hit = occupied & (keys[position] == query[pending])
        entry[pending[hit]] = position[hit]
        probing = occupied & ~hit
        pending, position = pending[probing], (position[probing] + 1) & np.int64(mask)
    held = np.where((entry >= 0)[:, None], words[entry], np.uint64(0)) & alive
    running = np.bitwise_and.accumulate(held, axis=0)
    shifts = np.arange(3, 64, 4, dtype=np.uint64)
    present = (running[:, :, None] >> shifts) & np.uint64(1)  # [position, word, slot]
    lengths[:] = present.sum(axis=0).reshape(-1)
