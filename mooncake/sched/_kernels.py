"""Kernels of the Conductor's two per-request scans: compiled by numba where it imports, else plain Python.

Choosing a decode instance and shortlisting prefill instances each compare
every instance of a board for every request. As whole-array numpy they cost a
dozen array operations of about a microsecond each on a board of tens; as one
compiled loop, one call. The functions are written once, in the subset of
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
"""

import numpy as np

from mooncake.cache._compiled import jit as _jit
from mooncake.sched import join as _join

__all__ = ["best_decode_slot", "refusal", "roofline_step", "shortest_by_length"]

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
    check_kv,
    max_batch,
    capacity,
    max_context,
    rank_batch,
    rank_context,
    coefficients,
    overhead_s,
):
    # The slot up whose structural checks pass on (check_batch, check_kv) with the lowest step once the
    # request joins its (rank_batch, rank_context); the first minimum, so ties go to the smallest slot; -1: none.
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
    return best


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
