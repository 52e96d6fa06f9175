"""Hypothesis strategies shared by the test modules."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.router import RouteQuery, TtftEstimator
from mooncake.sched.view import PrefillView, QueuedPrefill
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Tier
from mooncake.workload.generator import LengthDistribution, WorkloadSpec

token_ids = st.integers(min_value=0, max_value=2**31 - 1)
small_token_ids = st.integers(min_value=0, max_value=7)  # collisions of content are likely: good for prefixes

tiers = st.sampled_from(list(Tier))
instance_ids = st.sampled_from([InstanceId(f"node-{i}") for i in range(5)])
block_keys = st.integers(min_value=0, max_value=30).map(BlockKey)  # a small universe: keys recur


def token_arrays(*, max_size: int = 200, elements: st.SearchStrategy[int] = token_ids) -> st.SearchStrategy[np.ndarray]:
    return st.lists(elements, max_size=max_size).map(lambda xs: np.array(xs, dtype=np.int32))


@st.composite
def key_chains(draw: st.DrawFn, *, max_size: int = 8) -> tuple[BlockKey, ...]:
    """Chains of distinct keys, as a request's block keys are."""
    return tuple(draw(st.lists(block_keys, max_size=max_size, unique=True)))


@st.composite
def requests(draw: st.DrawFn, *, block_size_tokens: int = 4, max_input: int = 40) -> list[Request]:
    """Valid requests in arrival order with whole-millisecond arrivals, each one's keys distinct (chained ids, as a
    trace's: a trace line that repeats one is refused)."""
    count = draw(st.integers(min_value=0, max_value=8))
    arrival_ms = sorted(draw(st.lists(st.integers(0, 10**9), min_size=count, max_size=count)))
    out = []
    for index, ms in enumerate(arrival_ms):
        input_length = draw(st.integers(1, max_input))
        num_blocks = -(-input_length // block_size_tokens)
        keys = draw(st.lists(st.integers(0, 2**64 - 1), min_size=num_blocks, max_size=num_blocks, unique=True))
        out.append(
            Request(
                request_id=RequestId(str(index)),
                arrival_s=ms / 1000,
                input_length=input_length,
                output_length=draw(st.integers(1, 5000)),
                block_keys=tuple(BlockKey(k) for k in keys),
            )
        )
    return out


@st.composite
def prefix_workloads(
    draw: st.DrawFn, *, block_size_tokens: int = 4, max_requests: int = 12, max_blocks: int = 8
) -> list[Request]:
    """Requests in arrival order whose key chains often share prefixes with earlier ones.

    Each request starts from a prefix of an earlier request's keys (or from nothing) and
    appends keys that are fresh or drawn from a small universe, so keys also recur out
    of chain: the cases a prefix-reuse count must get right. Never within one request (a
    `Request` refuses a chain that repeats a key): a drawn key the chain holds already is
    replaced by a fresh one.
    """
    count = draw(st.integers(min_value=0, max_value=max_requests))
    arrival_ms = sorted(draw(st.lists(st.integers(0, 10**6), min_size=count, max_size=count)))
    chains: list[tuple[BlockKey, ...]] = []
    fresh = iter(range(1000, 10**6))
    out = []
    for index, ms in enumerate(arrival_ms):
        base: tuple[BlockKey, ...] = ()
        if chains and draw(st.booleans()):
            parent = draw(st.sampled_from(chains))
            base = parent[: draw(st.integers(0, len(parent)))]
        num_new = draw(st.integers(min_value=0 if base else 1, max_value=max(max_blocks - len(base), 0 if base else 1)))
        keys = base
        for _ in range(num_new):
            key = BlockKey(next(fresh)) if draw(st.booleans()) else draw(block_keys)
            keys += (BlockKey(next(fresh)) if key in keys else key,)
        chains.append(keys)
        input_length = draw(st.integers((len(keys) - 1) * block_size_tokens + 1, len(keys) * block_size_tokens))
        out.append(
            Request(
                request_id=RequestId(str(index)),
                arrival_s=ms / 1000,
                input_length=input_length,
                output_length=draw(st.integers(1, 5000)),
                block_keys=keys,
            )
        )
    return out


@st.composite
def workload_specs(draw: st.DrawFn) -> WorkloadSpec:
    """Small synthetic-workload specs (short segments, small blocks) that generate quickly."""

    def lengths(max_mean: int) -> LengthDistribution:
        low = draw(st.integers(1, 20))
        return LengthDistribution(
            mean_tokens=draw(st.floats(1, max_mean)),
            sigma=draw(st.sampled_from([0.0, 0.3, 1.0])),
            min_tokens=low,
            max_tokens=draw(st.integers(low, 4 * max_mean)),
        )

    weights = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3, max_size=3).filter(lambda w: sum(w) > 0))
    return WorkloadSpec(
        block_size_tokens=draw(st.integers(1, 32)),
        chat_weight=weights[0],
        document_weight=weights[1],
        agent_weight=weights[2],
        num_system_prompts=draw(st.integers(1, 4)),
        system_prompt_share=draw(st.sampled_from([0.0, 0.5, 1.0])),
        system_prompt_tokens=lengths(100),
        num_documents=draw(st.integers(1, 6)),
        document_tokens=lengths(300),
        num_agent_preambles=draw(st.integers(1, 3)),
        agent_preamble_tokens=lengths(150),
        popularity_skew=draw(st.sampled_from([0.0, 1.0, 2.0])),
        user_message_tokens=lengths(60),
        observation_tokens=lengths(60),
        output_tokens=lengths(40),
        mean_turns=draw(st.floats(1, 6)),
        continue_probability=draw(st.sampled_from([0.0, 0.5, 0.9])),
        max_input_tokens=draw(st.integers(1, 1500)),
    )


@st.composite
def cache_event_sequences(
    draw: st.DrawFn,
    *,
    sources: st.SearchStrategy[InstanceId] = instance_ids,
    max_events: int = 30,
    max_keys: int = 6,
) -> list[CacheEvent]:
    """Correctly sequenced cache events from several sources, interleaved.

    Each source starts at epoch 0, seq 0 and counts up by one; now and then it
    restarts with the next epoch (seq back to 0). Stored keys are distinct chains,
    removed keys any keys of `block_keys` (held or not), across every tier.
    """
    epoch: dict[InstanceId, int] = {}
    next_seq: dict[InstanceId, int] = {}
    events: list[CacheEvent] = []
    for _ in range(draw(st.integers(min_value=0, max_value=max_events))):
        source = draw(sources)
        if source in next_seq and draw(st.integers(min_value=0, max_value=7)) == 0:
            epoch[source] += 1
            next_seq[source] = 0
        stamp = {"source": source, "seq": next_seq.get(source, 0), "epoch": epoch.setdefault(source, 0)}
        kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
        if kind == "stored":
            events.append(BlockStored(keys=draw(key_chains(max_size=max_keys)), tier=draw(tiers), **stamp))
        elif kind == "removed":
            keys = draw(st.lists(block_keys, max_size=max_keys))
            events.append(BlockRemoved(keys=tuple(keys), tier=draw(tiers), **stamp))
        else:
            events.append(AllBlocksCleared(**stamp))
        next_seq[source] = stamp["seq"] + 1
    return events


# Eviction policies and capacity -------------------------------------------------

POLICY_KEY_UNIVERSE = tuple(BlockKey(k) for k in range(10))
policy_keys = st.sampled_from(POLICY_KEY_UNIVERSE)  # ten keys: re-access, pins and removes hit cached keys often
policy_parents = st.none() | policy_keys
policy_positions = st.integers(min_value=0, max_value=5)


_POLICY_OP_NAMES = ("access", "access", "access", "evict", "pin", "pin", "unpin", "remove")  # weights by repetition


@st.composite
def _policy_op(draw: st.DrawFn, keys: st.SearchStrategy[BlockKey]) -> tuple[object, ...]:
    name = draw(st.sampled_from(_POLICY_OP_NAMES))
    if name == "access":
        return (name, draw(keys), draw(st.none() | keys), draw(policy_positions))
    if name == "evict":
        return (name,)
    return (name, draw(keys))


policy_ops = _policy_op(policy_keys)
"""One eviction-policy call: ("access", key, parent, position), ("evict",), ("pin" | "unpin" | "remove", key)."""


@st.composite
def policy_op_lists(draw: st.DrawFn, *, max_size: int = 60) -> list[tuple[object, ...]]:
    """Operation sequences over a universe of 2 to 10 keys drawn per example.

    Small universes make crowded states likely: every cached key pinned, parent
    cycles, the SIEVE hand on a protected key.
    """
    num_keys = draw(st.integers(min_value=2, max_value=len(POLICY_KEY_UNIVERSE)))
    keys = st.sampled_from(POLICY_KEY_UNIVERSE[:num_keys])
    size = draw(st.integers(min_value=0, max_value=max_size))  # lists() alone favours very short runs
    return draw(st.lists(_policy_op(keys), min_size=size, max_size=size))


@st.composite
def chained_workloads(
    draw: st.DrawFn, *, max_requests: int = 12, max_blocks: int = 6, alphabet: int = 3
) -> list[tuple[BlockKey, ...]]:
    """Requests' chained keys over a small trie: equal leading block contents give equal leading keys.

    Each block's content is drawn from `alphabet` values; a key names the whole
    content prefix up to its block, so keys are shared exactly as prefixes are.
    """
    ids: dict[tuple[int, ...], BlockKey] = {}
    out = []
    for _ in range(draw(st.integers(min_value=0, max_value=max_requests))):
        contents = draw(st.lists(st.integers(min_value=0, max_value=alphabet - 1), max_size=max_blocks))
        out.append(tuple(ids.setdefault(tuple(contents[: i + 1]), BlockKey(len(ids))) for i in range(len(contents))))
    return out


# Page pools ----------------------------------------------------------------------

POOL_KEY_UNIVERSE = tuple(BlockKey(k) for k in range(6))
pool_keys = st.sampled_from(POOL_KEY_UNIVERSE)  # six keys: the same key lands in several pages often
page_sizes = st.sampled_from([1, 7, 64, 4095, 4096, 5000])  # around the 4 KiB alignment unit


def page_payloads(page_bytes: int) -> st.SearchStrategy[bytes]:
    """Data for one page: any length up to `page_bytes`, often exactly a full page."""
    full = st.integers(min_value=0, max_value=255).map(lambda b: bytes([b]) * page_bytes)
    return st.binary(max_size=page_bytes) | full


@st.composite
def page_pool_ops(draw: st.DrawFn, *, page_bytes: int, max_size: int = 40) -> list[tuple[object, ...]]:
    """Operations on a byte-holding page pool, pages named by index into the live pages
    (taken modulo their number when applied): ("allocate",), ("write", index, key, data),
    ("free", index), ("reopen",) (persistent pools close and reopen; others ignore it)."""
    indexes = st.integers(min_value=0, max_value=63)
    op = st.one_of(
        st.just(("allocate",)),
        st.tuples(st.just("write"), indexes, pool_keys, page_payloads(page_bytes)),
        st.tuples(st.just("free"), indexes),
        st.just(("reopen",)),
    )
    size = draw(st.integers(min_value=0, max_value=max_size))  # lists() alone favours very short runs
    return draw(st.lists(op, min_size=size, max_size=size))


# Scheduling ----------------------------------------------------------------------

SCHED_PREFILL_IDS = tuple(InstanceId(f"prefill-{i}") for i in range(8))
SCHED_OUTSIDE_HOLDER = InstanceId("prefill-remote")  # holds blocks but is not a candidate (e.g. down)
SCHED_NOW_S = 100.0
_millis = st.integers(min_value=0, max_value=4000).map(lambda ms: ms / 1000)  # whole ms: ties are likely


@st.composite
def prefill_views(
    draw: st.DrawFn, *, min_size: int = 2, max_size: int = 8, now: float = SCHED_NOW_S
) -> list[PrefillView]:
    """Prefill views with random queues around `now`: empty, already drained, or long (equal lengths are likely)."""
    count = draw(st.integers(min_value=min_size, max_value=max_size))
    views = []
    for instance in SCHED_PREFILL_IDS[:count]:
        clock = now - draw(_millis)  # the head may have started before now
        queue = []
        for position in range(draw(st.integers(min_value=0, max_value=4))):
            duration = draw(_millis)
            queue.append(
                QueuedPrefill(request_id=RequestId(f"{instance}/{position}"), start_s=clock, finish_s=clock + duration)
            )
            clock += duration
        views.append(PrefillView(instance, queue=queue))
    return views


@st.composite
def route_queries(draw: st.DrawFn, views: list[PrefillView], *, allow_outside_holder: bool = True) -> RouteQuery:
    """A request's view of the index over `views`: per-instance prefix blocks (zero often,
    equal lengths sometimes), the best holder (possibly one outside the candidates), how
    many hold its prefix, and the transfers already leaving it."""
    block_size = draw(st.sampled_from([16, 64, 256, 512]))
    input_tokens = draw(st.integers(min_value=1, max_value=16384))
    num_blocks = -(-input_tokens // block_size)
    levels = st.sampled_from(sorted({0, 1, num_blocks // 4, num_blocks // 2, num_blocks}))
    lengths: dict[InstanceId, int] = {}
    for view in views:
        blocks = draw(st.just(0) | levels | st.integers(min_value=0, max_value=num_blocks))
        if blocks:
            lengths[view.instance_id] = blocks
    if allow_outside_holder and draw(st.integers(min_value=0, max_value=4)) == 0:
        lengths[SCHED_OUTSIDE_HOLDER] = draw(st.integers(min_value=max([1, *lengths.values()]), max_value=num_blocks))
    best = min(lengths, key=lambda i: (-lengths[i], i)) if lengths else None
    return RouteQuery(
        input_tokens=input_tokens,
        block_size_tokens=block_size,
        prefix_blocks=lengths,
        best_instance=best,
        best_blocks=lengths[best] if best is not None else 0,
        best_holders=sum(1 for blocks in lengths.values() if best is not None and blocks >= lengths[best]),
        best_transfers_in_flight=draw(st.integers(min_value=0, max_value=3)) if best is not None else 0,
    )


@st.composite
def ttft_estimators(draw: st.DrawFn) -> TtftEstimator:
    """LLaMA3-70B on a preset, with a network slow enough that transfers sometimes lose."""
    model = MODELS["llama3-70b"]
    return TtftEstimator(
        prefill=PrefillCostModel(model=model, hardware=HARDWARE[draw(st.sampled_from(["8xA800", "8xH800"]))]),
        transfer=TransferCostModel(bandwidth_bytes_per_s=draw(st.sampled_from([1e9, 6e9, 25e9, 100e9]))),
        kv_bytes_per_token=model.kv_bytes_per_token,
    )


finite_thresholds = st.sampled_from([1.0, 1.5, 2.0, 4.0, 16.0]) | st.floats(min_value=1.0, max_value=64.0)


@st.composite
def request_streams(draw: st.DrawFn, block_size_tokens: int) -> list[Request]:
    """Requests in arrival order whose key chains share prefixes (keys from a small tree), so routers see
    holders, queues build up and seeded choices matter; up to a few thousand tokens each."""
    count = draw(st.integers(1, 12))
    arrivals = sorted(draw(st.lists(st.integers(0, 3_000), min_size=count, max_size=count)))
    out = []
    for index, ms in enumerate(arrivals):
        input_length = draw(st.integers(1, min(6 * block_size_tokens, 3_000)))
        branch = draw(st.integers(0, 2))
        num_blocks = -(-input_length // block_size_tokens)
        out.append(
            Request(
                request_id=RequestId(f"r{index}"),
                arrival_s=ms / 1000,
                input_length=input_length,
                output_length=draw(st.integers(1, 600)),
                block_keys=tuple(BlockKey(1 + 10_000 * branch + depth) for depth in range(num_blocks)),
                block_size_tokens=block_size_tokens,
            )
        )
    return out
