"""Kernels of the Conductor's per-request loops: compiled by numba where it imports, else plain Python.

Choosing a decode instance and shortlisting prefill instances each compare
every instance of a board for every request. As whole-array numpy they cost a
dozen array operations of about a microsecond each on a board of tens; as one
compiled loop, one call. Counting a queued prompt's blocks and walking a new
prompt along them is a loop over its keys. The functions are written once, in the subset of
Python that numba compiles and numpy scalars run unchanged: compiled where
numba imports, the same functions undecorated otherwise
(`mooncake.cache._compiled`, the one switch between the two paths), so both
paths give the same answers; the plain one is slower on large boards.

- `roofline_step`: a `RooflineStep`'s step, from its `coefficients`, with the
  float64 operations in `RooflineStep.step_s`'s order, so it equals it to the bit.
- `best_decode_slot`: the decode selection's candidate scan (`sched.decode`):
  `sched.join.refusal`, the decode rule's structural checks, compiled from that
  one definition.
- `shortest_by_length`: the router's shortlist (`sched.router`).
- `pending_*`: the compiled path of `sched.pending.PendingBlocks`, a table (add, remove, grow)
  and its walk along a prompt from each instance's cached prefix (its plain path keeps a Counter
  per instance instead: the table's probing as Python would cost more than it saves).
"""

import numpy as np

from mooncake.cache._compiled import jit as _jit
from mooncake.cache._key_table_kernels import bucket as _bucket
from mooncake.sched import join as _join

__all__ = [
    "best_decode_slot",
    "pending_add",
    "pending_find",
    "pending_rehash",
    "pending_remove",
    "pending_walk",
    "refusal",
    "roofline_step",
    "shortest_by_length",
]

jit = _jit(cache=True, nogil=True)

refusal = jit(_join.refusal)


@jit
def roofline_step(coefficients, overhead_s, batch_size, context_tokens):
    # coefficients[k] = (fixed_s, per_sequence_s, per_context_token_s) of branch k.
    slowest = -np.inf
    for k in range(coefficients.shape[0]):
        seconds = coefficients[k, 0] + coefficients[k, 1] * batch_size + coefficients[k, 2] * context_tokens
        if seconds > slowest:
            slowest = seconds
    return overhead_s + slowest


@jit
def best_decode_slot(
    prompt_tokens,
    output_tokens,
    up,
    check_batch,
    check_context,
    check_kv,
    max_batch,
    capacity,
    max_context,
    rank_batch,
    rank_context,
    coefficients,
    overhead_s,
):
    # The slot up whose structural checks pass on its checked load with the lowest step once the request
    # joins its ranked batch (rank_batch, rank_context); the first minimum, so ties go to the smallest
    # slot; -1: none. With it, the step predicted on the checked load with the request added.
    best = -1
    best_step = np.inf
    for slot in range(up.size):
        if not up[slot]:
            continue
        code = refusal(
            prompt_tokens,
            output_tokens,
            check_batch[slot],
            check_kv[slot],
            max_batch[slot],
            capacity[slot],
            max_context[slot],
        )
        if code != 0:
            continue
        step = roofline_step(coefficients, overhead_s, rank_batch[slot] + 1, rank_context[slot] + prompt_tokens)
        if best < 0 or step < best_step:
            best = slot
            best_step = step
    if best < 0:
        return best, np.inf
    predicted = roofline_step(coefficients, overhead_s, check_batch[best] + 1, check_context[best] + prompt_tokens)
    return best, predicted


@jit
def shortest_by_length(own, busy_until_s, now, weight):
    # For each distinct value of own (blocks held), the slot with the shortest queue max(busy - now, 0),
    # ties by the heaviest weight (none given, an empty array: all weigh alike), then the smallest slot;
    # in order of first appearance. Also whether some length's shortest queue is shared (where weights
    # decide; with none given, the smallest slot stood in for them).
    slots = np.empty(own.size, dtype=np.int64)
    queues = np.empty(own.size, dtype=np.float64)
    shared = np.zeros(own.size, dtype=np.bool_)  # another slot of this length has the same shortest queue
    found = 0
    weighed = weight.size > 0
    for slot in range(own.size):
        queue = max(busy_until_s[slot] - now, 0.0)
        j = 0
        while j < found and own[slots[j]] != own[slot]:
            j += 1
        if j == found:
            slots[found] = slot
            queues[found] = queue
            found += 1
        elif queue < queues[j]:
            slots[j] = slot
            queues[j] = queue
            shared[j] = False
        elif queue == queues[j]:
            shared[j] = True
            if weighed and weight[slot] > weight[slots[j]]:
                slots[j] = slot
    return slots[:found], shared[:found].any()


# ---------------------------------------------------------------- pending blocks (`sched.pending`)
# A linear-probing table of (owner, key) -> count: `owners[i] < 0` marks an empty entry; the
# table's size is a power of two.

_OWNER_MIX = np.uint64(0x9E3779B97F4A7C15)


@jit
def pending_bucket(key, owner, mask):
    # The key table's bucket (murmur3's finalizer) of the key xor a multiple of the owner: one table for
    # every owner.
    return _bucket(key ^ (np.uint64(owner) * _OWNER_MIX), mask)


@jit
def pending_find(keys, owners, key, owner):
    mask = keys.size - 1
    i = pending_bucket(key, owner, mask)
    while owners[i] >= 0:
        if keys[i] == key and owners[i] == owner:
            return i
        i = (i + 1) & mask
    return -1


@jit
def pending_add(keys, owners, counts, added, owner):
    # Count each of `added` once more for `owner`; returns the entries created.
    mask = keys.size - 1
    created = 0
    for key in added:
        i = pending_bucket(key, owner, mask)
        while owners[i] >= 0 and not (keys[i] == key and owners[i] == owner):
            i = (i + 1) & mask
        if owners[i] < 0:
            keys[i] = key
            owners[i] = owner
            counts[i] = 0
            created += 1
        counts[i] += 1
    return created


@jit
def pending_remove(keys, owners, counts, removed, owner):
    # Count each of `removed` once less for `owner` (one absent is skipped); returns the entries deleted.
    mask = keys.size - 1
    deleted = 0
    for key in removed:
        hole = pending_find(keys, owners, key, owner)
        if hole < 0:
            continue
        counts[hole] -= 1
        if counts[hole] > 0:
            continue
        deleted += 1
        # Backward-shift deletion: pull later entries of the probe run into the hole, unless an
        # entry's home lies cyclically in (hole, j].
        j = hole
        while True:
            j = (j + 1) & mask
            if owners[j] < 0:
                break
            home = pending_bucket(keys[j], owners[j], mask)
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                keys[hole] = keys[j]
                owners[hole] = owners[j]
                counts[hole] = counts[j]
                hole = j
        owners[hole] = -1
        counts[hole] = 0
    return deleted


@jit
def pending_rehash(keys, owners, counts, new_keys, new_owners, new_counts):
    mask = new_keys.size - 1
    for i in range(keys.size):
        if owners[i] < 0:
            continue
        j = pending_bucket(keys[i], owners[i], mask)
        while new_owners[j] >= 0:
            j = (j + 1) & mask
        new_keys[j] = keys[i]
        new_owners[j] = owners[i]
        new_counts[j] = counts[i]


@jit
def pending_walk(keys, owners, prompt, lengths, owner_of_slot):
    # Each slot's prefix `lengths[slot]` continued while the prompt's next key is counted for the
    # slot's owner (an owner < 0 has nothing coming), as a new array.
    walked = lengths.copy()
    for slot in range(lengths.size):
        owner = owner_of_slot[slot]
        if owner < 0:
            continue
        end = walked[slot]
        while end < prompt.size and pending_find(keys, owners, prompt[end], owner) >= 0:
            end += 1
        walked[slot] = end
    return walked
