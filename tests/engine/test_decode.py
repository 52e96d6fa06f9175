"""Tests for `mooncake.engine.decode.DecodeEngine`: continuous batching changes no request's tokens.

A batch of requests with mixed prompt lengths, joining and retiring mid-way
(so slots are compacted), gives each request the logits and tokens it gets
decoding alone and that the plain forward pass of its prompt and outputs
predicts. KV pages that went through the SSD tier, or to another node over real
TCP (fetched, pushed, or streamed layer by layer by a prefill's
`MessengerSink`), decode bit-identically to pages that never left DRAM. A state
machine joins and steps requests against a reference of the bookkeeping (active
set, emitted counts, reserved tokens, every request ending exactly once) and
checks every token against the model's greedy continuation. Examples pin the
local checks and the error contracts.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("torch")

import torch

from mooncake.cache.pool import AllocatingPool, VramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.attention import decode_attention, sdpa_decode_attention
from mooncake.engine.decode import DecodeConfig, DecodeEngine, TokenEvent
from mooncake.engine.model import LlamaModel
from mooncake.engine.prefill import MessengerSink, PrefillConfig, PrefillEngine, PrefillResult
from mooncake.engine.sampling import SamplingParams, token_logprobs
from mooncake.errors import ConfigError, InvalidRequestError, UnknownBlockError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict
from mooncake.sched.outcome import Reason
from mooncake.sched.step import DecodeCostModel, FittedStepModel
from mooncake.types import BlockKey, RequestId, Tier
from tests.engine.support import (
    TINY,
    TOLERANCE,
    assert_nothing_held,
    dram_cache,
    hasher,
    layout,
    page_bytes,
    reference_logits,
    tcp_nodes,
    tiered_cache,
    tiny_model,
)

BLOCK = 4


class RecordingModel(LlamaModel):
    """The tiny model (same weights) remembering the logits of its last call: a decode step's rows, in slot order."""

    def __init__(self) -> None:
        super().__init__(TINY, seed=0)
        self.last_logits = torch.empty(0)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        self.last_logits = super().logits(x)
        return self.last_logits


@functools.cache
def recording_model() -> RecordingModel:
    return RecordingModel()


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * i + i * i) % TINY.vocab_size for i in range(length)]


@attrs.frozen
class Planned:
    """A request of a decode scenario: it joins just before step `join_before_step`."""

    request_id: RequestId
    prompt: list[int]
    max_new_tokens: int
    join_before_step: int = 0
    sampling: SamplingParams = attrs.Factory(SamplingParams)


@attrs.define
class Trace:
    """What a request got: its tokens and, for each, the logits it was drawn from."""

    tokens: list[int] = attrs.Factory(list)
    logits: list[torch.Tensor] = attrs.Factory(list)
    events: list[TokenEvent] = attrs.Factory(list)


SHARED = tokens_of(1, 9)
MIXED = [  # prompt lengths 1 … 14 (whole and partial blocks, a shared prefix); one ends at join
    Planned(RequestId("a"), tokens_of(2, 7), 6),
    Planned(RequestId("b"), tokens_of(3, 3), 1),
    Planned(RequestId("c"), tokens_of(4, 1), 4),
    Planned(RequestId("d"), [*SHARED, *tokens_of(5, 5)], 8, join_before_step=1),
    Planned(RequestId("e"), tokens_of(6, 4), 2, join_before_step=3),
    Planned(
        RequestId("f"),
        [*SHARED, *tokens_of(7, 3)],
        5,
        join_before_step=3,
        sampling=SamplingParams(temperature=0.9, seed=3),
    ),
    Planned(RequestId("g"), tokens_of(8, 9), 3, join_before_step=3, sampling=SamplingParams(temperature=1.5, seed=4)),
]


def prefill_all(cache: TieredCache, plan: list[Planned], **options: Any) -> dict[RequestId, PrefillResult]:
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK), PrefillConfig(**options)) as engine:
        return {p.request_id: engine.prefill(p.prompt, sampling=p.sampling) for p in plan}


def decode(
    cache: TieredCache,
    plan: list[Planned],
    prefilled: dict[RequestId, PrefillResult],
    *,
    config: DecodeConfig | None = None,
    slots_seen: list[tuple[RequestId, ...]] | None = None,
) -> dict[RequestId, Trace]:
    """Run `plan` to the end on a fresh engine over `cache`; every request's trace."""
    model = recording_model()
    engine = DecodeEngine(
        model, cache, block_tokens=BLOCK, config=config or DecodeConfig(max_batch_size=8, max_context_tokens=32)
    )
    traces = {p.request_id: Trace() for p in plan}
    step = 0
    while step <= max(p.join_before_step for p in plan) or engine.num_active:
        for p in plan:
            if p.join_before_step == step:
                result = prefilled[p.request_id]
                trace = traces[p.request_id]
                trace.logits.append(result.logits)
                joined = engine.try_join(
                    p.request_id,
                    result.keys,
                    prompt_tokens=len(p.prompt),
                    first_token=result.first_token,
                    max_new_tokens=p.max_new_tokens,
                    sampling=p.sampling,
                    on_token=trace.events.append,
                    first_logprobs=result.first_logprobs,
                )
                assert joined.accepted, joined
        events = engine.step()
        for event, row in zip(events, model.last_logits if events else [], strict=True):
            traces[event.request_id].logits.append(row.clone())
        engine.check_invariants()
        if slots_seen is not None:
            slots_seen.append(engine.active_ids)
        step += 1
    for trace in traces.values():
        trace.tokens = [e.token for e in trace.events]
    return traces


def assert_same_traces(got: dict[RequestId, Trace], expected: dict[RequestId, Trace], *, exact: bool) -> None:
    assert got.keys() == expected.keys()
    for request_id, trace in got.items():
        assert trace.tokens == expected[request_id].tokens, request_id
        assert len(trace.logits) == len(expected[request_id].logits)
        for mine, theirs in zip(trace.logits, expected[request_id].logits, strict=True):
            assert torch.equal(mine, theirs) if exact else torch.allclose(mine, theirs, **TOLERANCE), request_id


def assert_each_ends_once(plan: list[Planned], traces: dict[RequestId, Trace]) -> None:
    for p in plan:
        events = traces[p.request_id].events
        assert [e.index for e in events] == list(range(p.max_new_tokens))
        assert [e.finished for e in events] == [False] * (p.max_new_tokens - 1) + [True]
        assert {e.request_id for e in events} == {p.request_id}


def assert_greedy_continuation(plan: list[Planned], traces: dict[RequestId, Trace]) -> None:
    """Each token's logits are the forward pass's at its position; greedy tokens are their argmax."""
    for p in plan:
        trace = traces[p.request_id]
        rows = reference_logits(p.prompt + trace.tokens[:-1])[len(p.prompt) - 1 :]
        for index, (logits, row) in enumerate(zip(trace.logits, rows, strict=True)):
            assert torch.allclose(logits, row, **TOLERANCE), (p.request_id, index)
            if p.sampling.temperature == 0:
                assert trace.tokens[index] == int(torch.argmax(row)), (p.request_id, index)


# --------------------------------------------------------------------------- batching changes nothing


@pytest.mark.parametrize("attention", [decode_attention, sdpa_decode_attention], ids=["grouped", "sdpa"])
def test_a_mixed_batch_decodes_as_each_request_alone(attention: Callable[..., torch.Tensor]) -> None:
    """Mixed prompt lengths, joins after steps 0, 1 and 3, retirements mid-way (slots compacted): every request's
    tokens and logits equal decoding it alone and the model's continuation; each ends exactly once."""
    cache = dram_cache(BLOCK)
    prefilled = prefill_all(cache, MIXED)
    slots: list[tuple[RequestId, ...]] = []
    config = DecodeConfig(max_batch_size=8, max_context_tokens=32, attention=attention)
    batched = decode(cache, MIXED, prefilled, config=config, slots_seen=slots)
    alone: dict[RequestId, Trace] = {}
    for p in MIXED:
        single = DecodeConfig(max_batch_size=1, max_context_tokens=32, attention=attention)
        alone |= decode(cache, [attrs.evolve(p, join_before_step=0)], prefilled, config=single)
    assert_same_traces(batched, alone, exact=False)
    assert_each_ends_once(MIXED, batched)
    assert_greedy_continuation(MIXED, batched)
    moved = [
        rid
        for before, after in itertools.pairwise(slots)
        for rid in after
        if rid in before and after.index(rid) < before.index(rid)
    ]
    assert moved, "no retirement compacted the slots"
    assert max(len(s) for s in slots) >= 4 and slots[-1] == ()
    assert_nothing_held(cache, [k for r in prefilled.values() for k in r.keys])


def test_sampled_tokens_do_not_depend_on_the_batch() -> None:
    """Seeded sampling draws the same tokens in a batch as alone (each request owns its random stream)."""
    plan = [
        Planned(RequestId(str(i)), tokens_of(i, 3 + i), 6, sampling=SamplingParams(temperature=1.0, seed=i))
        for i in range(4)
    ]
    cache = dram_cache(BLOCK)
    prefilled = prefill_all(cache, plan)
    batched = decode(cache, plan, prefilled)
    for p in plan:
        assert decode(cache, [p], prefilled)[p.request_id].tokens == batched[p.request_id].tokens


def test_each_token_comes_with_the_logprobs_of_the_logits_it_was_drawn_from() -> None:
    """With `logprobs: 3` every token of the mixed batch (the prefill's first included) carries `token_logprobs`
    of the very logits it was drawn from, in the batch as alone, and the tokens are those drawn without them;
    without it no token carries any."""
    plan = [attrs.evolve(p, sampling=attrs.evolve(p.sampling or SamplingParams(), logprobs=3)) for p in MIXED]
    cache = dram_cache(BLOCK)
    prefilled = prefill_all(cache, plan)
    traces = decode(cache, plan, prefilled)
    plain = decode(cache, MIXED, prefill_all(cache, MIXED))
    for p in plan:
        trace = traces[p.request_id]
        assert trace.tokens == plain[p.request_id].tokens
        assert all(event.logprobs is None for event in plain[p.request_id].events)
        for event, logits in zip(trace.events, trace.logits, strict=True):
            assert event.logprobs == token_logprobs(logits, event.token, 3), (p.request_id, event.index)


def test_the_decode_engine_goes_on_with_the_stream_the_prefill_started() -> None:
    """Token 0 (drawn by the prefill engine) and token 1 (by the decode engine) are separate draws of one
    stream: at a temperature where the next token is close to uniform they rarely agree (they agreed in
    39 of 40 requests when each engine started the seed's stream afresh)."""
    plan = [
        Planned(RequestId(str(i)), tokens_of(i, 5), 2, sampling=SamplingParams(temperature=50.0, seed=i))
        for i in range(40)
    ]
    cache = dram_cache(BLOCK, pages=len(plan) * 2)  # every prompt's blocks stay for its decode
    prefilled = prefill_all(cache, plan)
    traces = decode(cache, plan, prefilled, config=DecodeConfig(max_batch_size=len(plan), max_context_tokens=32))
    same = sum(traces[p.request_id].tokens[0] == traces[p.request_id].tokens[1] for p in plan)
    assert same <= 4  # independent draws over a vocabulary of hundreds agree well under once in 40


# --------------------------------------------------------------------------- pages that travelled


def demote(cache: TieredCache, *, num_prompts: int = 6) -> None:
    """Prefill unrelated prompts until earlier blocks leave DRAM."""
    prefill_all(cache, [Planned(RequestId(f"filler{i}"), tokens_of(100 + i, 12), 1) for i in range(num_prompts)])


def reference_run(plan: list[Planned]) -> tuple[TieredCache, dict[RequestId, PrefillResult], dict[RequestId, Trace]]:
    """Prefill and decode on one node whose pages never leave DRAM."""
    cache = dram_cache(BLOCK)
    prefilled = prefill_all(cache, plan)
    return cache, prefilled, decode(cache, plan, prefilled)


def assert_same_pages(cache: TieredCache, reference: TieredCache, keys: list[BlockKey]) -> None:
    assert [page_bytes(cache, key) for key in keys] == [page_bytes(reference, key) for key in keys]


def all_keys(prefilled: dict[RequestId, PrefillResult]) -> list[BlockKey]:
    return list(dict.fromkeys(k for result in prefilled.values() for k in result.keys))


PLAN = [MIXED[0], MIXED[2], MIXED[3], MIXED[5]]  # 1 … 14 tokens; the last two share two blocks, one samples


def test_pages_through_the_ssd_tier_decode_identically(tmp_path: Path) -> None:
    """Pages demoted to SSD (checksummed, read back as verified copies) give bit-identical logits and tokens."""
    reference, _, expected = reference_run(PLAN)
    cache = tiered_cache(BLOCK, tmp_path / "ssd.pool", dram_pages=6, ssd_pages=64, promote_after=0)
    prefilled = prefill_all(cache, PLAN)
    demote(cache)
    keys = all_keys(prefilled)
    assert all(cache.tier_of(key) == Tier.SSD for key in keys)
    assert_same_traces(decode(cache, PLAN, prefilled), expected, exact=True)
    assert_same_pages(cache, reference, keys)
    assert_nothing_held(cache, keys)
    cache.close()


class CpuTensorPool(VramPagePool):
    """A VRAM pool's kind of page (flat uint8 tensor slices, read zero-copy) held on the CPU: the engines' path
    for tensor pages, run where there is no CUDA device."""

    def __init__(self, page_bytes: int, num_pages: int) -> None:
        AllocatingPool.__init__(self, Tier.VRAM, page_bytes, num_pages)
        self._torch = torch
        self.buffer = torch.empty(page_bytes * num_pages, dtype=torch.uint8)


def test_tensor_pages_prefill_reuse_and_decode_identically() -> None:
    """A first tier of tensor pages (a VRAM pool's, here on the CPU) takes a prefill's KV layer by layer, gives it
    back for a prefix reuse and to the decode engine: logits, tokens and page bytes are the DRAM run's (memoryview
    could not take a tensor page, so a VRAM tier failed every prefill)."""
    reference, reference_prefilled, expected = reference_run(PLAN)
    cache = TieredCache([CpuTensorPool(layout(BLOCK).page_bytes, 64)])
    prefilled = prefill_all(cache, PLAN)
    assert prefilled[RequestId("f")].prefix_tokens == 8  # two blocks of SHARED, loaded from tensor pages
    for request_id, result in prefilled.items():
        assert torch.equal(result.logits, reference_prefilled[request_id].logits), request_id
    keys = all_keys(prefilled)
    assert all(isinstance(cache.get(key), torch.Tensor) for key in keys)
    assert_same_traces(decode(cache, PLAN, prefilled), expected, exact=True)
    assert [bytes(cache.get(key).numpy()) for key in keys] == [page_bytes(reference, key) for key in keys]  # type: ignore[union-attr]
    assert_nothing_held(cache, keys)


def test_pages_fetched_over_tcp_from_a_node_with_ssd_decode_identically(tmp_path: Path) -> None:
    """The decode node fetches the prompt's pages over TCP from a prefill node that had demoted them to SSD."""
    reference, _, expected = reference_run(PLAN)
    with tcp_nodes(BLOCK, ssd_dir=tmp_path, ssd_node=1) as (decode_node, prefill_node, peer):
        prefilled = prefill_all(prefill_node.cache, PLAN)
        demote(prefill_node.cache)
        keys = all_keys(prefilled)
        assert all(prefill_node.cache.tier_of(key) == Tier.SSD for key in keys)
        for result in prefilled.values():
            fetch = decode_node.messenger.fetch(result.keys, peer)  # blocks held already are skipped
            assert fetch.finish(timeout=30) == fetch.keys
            assert all(key in decode_node.cache for key in result.keys)
        assert_same_pages(decode_node.cache, reference, keys)
        assert_same_traces(decode(decode_node.cache, PLAN, prefilled), expected, exact=True)
        assert_nothing_held(prefill_node.cache, keys)  # the peer's pins were released
        assert_nothing_held(decode_node.cache, keys)


def test_pages_pushed_over_tcp_decode_identically() -> None:
    """The prefill node pushes finished requests' pages into the decode node over TCP."""
    reference, _, expected = reference_run(PLAN)
    with tcp_nodes(BLOCK) as (prefill_node, decode_node, peer):
        prefilled = prefill_all(prefill_node.cache, PLAN)
        for result in prefilled.values():
            prefill_node.messenger.push(result.keys, peer).finish(timeout=30)
        keys = all_keys(prefilled)
        assert_same_pages(decode_node.cache, reference, keys)
        assert_same_traces(decode(decode_node.cache, PLAN, prefilled), expected, exact=True)
        assert_nothing_held(prefill_node.cache, keys)


@pytest.mark.parametrize(("layerwise", "chunk"), [(True, 4096), (True, 3), (False, 5)])
def test_kv_streamed_layer_by_layer_during_prefill_decodes_identically(layerwise: bool, chunk: int) -> None:
    """A `MessengerSink` streams each layer to the decode node as the prefill finishes it; the decode node
    commits every block (a cached prefix's included) and decodes them as the prefill node would."""
    _, _, expected = reference_run(PLAN)
    with tcp_nodes(BLOCK) as (prefill_node, decode_node, peer):
        with PrefillEngine(
            tiny_model(), prefill_node.cache, hasher(BLOCK), PrefillConfig(layerwise=layerwise, chunk_tokens=chunk)
        ) as engine:
            prefilled = {}
            for p in PLAN:
                sink = MessengerSink(prefill_node.messenger, peer, num_layers=TINY.num_layers)
                prefilled[p.request_id] = engine.prefill(p.prompt, sampling=p.sampling, sink=sink)
                assert set(sink.committed) <= set(prefilled[p.request_id].keys)
                assert all(key in decode_node.cache for key in prefilled[p.request_id].keys)
        assert prefilled[PLAN[3].request_id].prefix_tokens == 8  # the shared prefix came from the cache
        keys = all_keys(prefilled)
        assert_same_pages(decode_node.cache, prefill_node.cache, keys)
        traces = decode(decode_node.cache, PLAN, prefilled)
        assert_same_traces(traces, decode(prefill_node.cache, PLAN, prefilled), exact=True)
        assert_same_traces(traces, expected, exact=chunk == 4096)  # chunking may move the last bit
        assert_greedy_continuation(PLAN, traces)
        assert_nothing_held(prefill_node.cache, keys)
        assert_nothing_held(decode_node.cache, keys)


# --------------------------------------------------------------------------- local checks


@pytest.fixture
def prefilled_cache() -> Iterator[tuple[TieredCache, dict[RequestId, PrefillResult]]]:
    plan = [Planned(RequestId(f"r{n}"), tokens_of(n, n), 4) for n in (3, 5, 8, 13)]
    cache = dram_cache(BLOCK)
    yield cache, prefill_all(cache, plan)


def join(
    engine: DecodeEngine, result: PrefillResult, request_id: str, max_new_tokens: int, **options: Any
) -> JoinVerdict:
    return engine.try_join(
        RequestId(request_id),
        result.keys,
        prompt_tokens=options.pop("prompt_tokens", result.prefix_tokens + result.computed_tokens),
        first_token=options.pop("first_token", result.first_token),
        max_new_tokens=max_new_tokens,
        **options,
    )


def test_batch_full_refuses_a_decoding_request_but_not_a_finished_one(prefilled_cache: Any) -> None:
    """With every slot taken, a request needing steps is refused (batch_full); one needing no step is served."""
    cache, r = prefilled_cache
    engine = DecodeEngine(
        tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=2, max_context_tokens=32)
    )
    assert join(engine, r["r3"], "x", 4).accepted and join(engine, r["r5"], "y", 4).accepted
    events: list[TokenEvent] = []
    assert join(engine, r["r8"], "z", 4, on_token=events.append) == JoinVerdict(
        accepted=False, reason=Reason.BATCH_FULL
    )
    assert events == [] and engine.active_ids == ("x", "y")
    assert join(engine, r["r8"], "z", 1, on_token=events.append).accepted
    assert events == [TokenEvent(request_id=RequestId("z"), token=r["r8"].first_token, index=0, finished=True)]
    assert engine.num_active == 2
    engine.check_invariants()


def test_a_request_whose_first_token_stops_it_is_served_by_a_full_batch(prefilled_cache: Any) -> None:
    """A first token that is one of the request's stop tokens is its last: it takes no slot, so a full batch
    serves it (as one with max_new_tokens 1) instead of refusing it as batch_full and wasting its prefill."""
    cache, r = prefilled_cache
    engine = DecodeEngine(
        tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=2, max_context_tokens=32)
    )
    assert join(engine, r["r3"], "x", 4).accepted and join(engine, r["r5"], "y", 4).accepted
    events: list[TokenEvent] = []
    stop = SamplingParams(stop_token_ids=frozenset({r["r8"].first_token}))
    assert join(engine, r["r8"], "z", 4, sampling=stop, on_token=events.append).accepted
    assert events == [TokenEvent(request_id=RequestId("z"), token=r["r8"].first_token, index=0, finished=True)]
    other = SamplingParams(stop_token_ids=frozenset({(r["r8"].first_token + 1) % TINY.vocab_size}))
    assert join(engine, r["r8"], "w", 4, sampling=other) == JoinVerdict(accepted=False, reason=Reason.BATCH_FULL)
    assert engine.active_ids == ("x", "y")
    engine.check_invariants()


def test_kv_budget_counts_prompt_and_max_new_tokens(prefilled_cache: Any) -> None:
    """Σ (prompt + max_new_tokens) of the active requests may not exceed the budget; retiring frees it."""
    cache, r = prefilled_cache
    config = DecodeConfig(max_batch_size=4, max_context_tokens=32, kv_budget_tokens=20)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config)
    assert join(engine, r["r8"], "x", 3).accepted  # 11 reserved
    assert join(engine, r["r5"], "y", 5) == JoinVerdict(accepted=False, reason=Reason.KV_BUDGET)  # 11 + 10 > 20
    assert join(engine, r["r5"], "y", 4).accepted and engine.reserved_tokens == 20
    engine.run(max_steps=2)  # x retires after its third token
    assert engine.active_ids == ("y",) and engine.reserved_tokens == 9
    assert join(engine, r["r8"], "z", 3).accepted


def test_the_join_check_is_the_decode_rule_on_the_engines_limits_and_load(prefilled_cache: Any) -> None:
    """`limits` are the config's (KV budget, slots, a slot's context) and `load()` counts the active
    requests, the KV a step reads and the reservations, as `sched.join.check_join` reads them."""
    cache, r = prefilled_cache
    config = DecodeConfig(max_batch_size=3, max_context_tokens=24, kv_budget_tokens=40)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config)
    assert engine.limits == DecodeLimits(kv_capacity_tokens=40, max_batch_size=3, max_context_tokens=24)
    assert engine.load() == DecodeLoad(0, 0, 0)
    assert join(engine, r["r8"], "x", 4).accepted and join(engine, r["r5"], "y", 3).accepted
    assert engine.load() == DecodeLoad(2, 8 + 5, 8 + 4 + 5 + 3)
    engine.step()
    assert engine.load() == DecodeLoad(2, 9 + 6, 20)
    default = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=2))
    assert default.limits == DecodeLimits(kv_capacity_tokens=2 * 2048, max_batch_size=2, max_context_tokens=2048)


def test_context_too_long_is_checked_per_slot(prefilled_cache: Any) -> None:
    """prompt + max_new_tokens beyond a slot's context is refused, even for a request that would take no slot."""
    cache, r = prefilled_cache
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=16))
    assert join(engine, r["r13"], "x", 4) == JoinVerdict(accepted=False, reason=Reason.CONTEXT_TOO_LONG)
    assert join(engine, r["r13"], "x", 3).accepted  # exactly 16: the last position written is 14
    events = engine.run(max_steps=10)
    assert [e.index for e in events] == [1, 2] and events[-1].finished


class FakeStepModel:
    """10 ms per request in the batch plus 1 ms per 10 context tokens; records its questions."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        self.asked.append((batch_size, context_tokens))
        return 0.010 * batch_size + 0.0001 * context_tokens


def test_tbt_slo_with_a_step_model(prefilled_cache: Any) -> None:
    """The predicted step time with the request added must stay within the SLO; an empty batch always takes one."""
    cache, r = prefilled_cache
    step_model = FakeStepModel()
    config = DecodeConfig(max_context_tokens=32, tbt_slo_s=0.0225)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config, step_model=step_model)
    lone = join(engine, r["r13"], "x", 4)
    assert lone.accepted and lone.predicted_tbt_s == pytest.approx(0.0113)
    second = join(engine, r["r8"], "y", 4)  # 2 requests, 13 + 8 context tokens: 22.1 ms
    assert second.accepted and second.predicted_tbt_s == pytest.approx(0.0221) and step_model.asked[-1] == (2, 21)
    too_slow = join(engine, r["r13"], "z", 4)  # 3 requests: 30 ms + context
    assert too_slow == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=pytest.approx(0.0334))
    assert engine.active_ids == ("x", "y")
    # Its only token is the prefill's: it takes no slot and slows no step, so the TBT check does not apply.
    events: list[TokenEvent] = []
    single = join(engine, r["r13"], "z", 1, on_token=events.append)
    assert single == JoinVerdict(accepted=True, predicted_tbt_s=pytest.approx(0.0334))
    assert [e.finished for e in events] == [True] and engine.active_ids == ("x", "y")


def test_tbt_slo_with_the_decode_cost_model(prefilled_cache: Any) -> None:
    """`sched.cost.DecodeCostModel` is a step model: the SLO just below its 2-request step refuses the second."""
    cache, r = prefilled_cache
    cost = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
    two = cost.step_s(2, 13 + 8)
    engine = DecodeEngine(
        tiny_model(),
        cache,
        block_tokens=BLOCK,
        config=DecodeConfig(max_context_tokens=32, tbt_slo_s=two * 0.999),
        step_model=cost,
    )
    assert join(engine, r["r13"], "x", 4).accepted
    assert join(engine, r["r8"], "y", 4) == JoinVerdict(accepted=False, reason=Reason.TBT_SLO, predicted_tbt_s=two)
    at_slo = DecodeEngine(
        tiny_model(),
        cache,
        block_tokens=BLOCK,
        config=DecodeConfig(max_context_tokens=32, tbt_slo_s=two),
        step_model=cost,
    )
    assert join(at_slo, r["r13"], "x", 4).accepted and join(at_slo, r["r8"], "y", 4).accepted


@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.integers(0, 100_000), st.floats(1e-4, 0.1)), min_size=3, max_size=30
    ).filter(lambda samples: len({(b, t) for b, t, _ in samples}) >= 3)
)
def test_a_fitted_step_never_gets_faster_as_the_batch_grows(samples: list[tuple[int, int, float]]) -> None:
    """Noisy samples (a step that barely grows tilts an unconstrained plane): every coefficient is >= 0, one
    request's step takes time, and the fit is no worse than any plane with a coefficient held at 0."""
    try:
        fitted = FittedStepModel.fit(samples)
    except ConfigError as error:
        assert "vary" in str(error)  # collinear shapes (every sample on one line)
        return
    c0, c1, c2 = fitted.coefficients
    assert min(c0, c1, c2) >= 0 and fitted.step_s(1, 0) > 0

    def residual(c: tuple[float, float, float]) -> float:
        return sum((c[0] + c[1] * b + c[2] * t - y) ** 2 for b, t, y in samples)

    for held in range(3):  # the best plane without that coefficient, clamped at 0, is never better
        free = [i for i in range(3) if i != held]
        matrix = np.array([[1.0, b, t] for b, t, _ in samples])[:, free]
        solution = np.linalg.lstsq(matrix, np.array([y for _, _, y in samples]), rcond=None)[0]
        other = [0.0, 0.0, 0.0]
        for i, value in zip(free, solution, strict=True):
            other[i] = max(0.0, float(value))
        if other[0] + other[1] > 0:
            assert residual((c0, c1, c2)) <= residual((other[0], other[1], other[2])) * (1 + 1e-9) + 1e-15


def test_a_fitted_step_model_recovers_its_coefficients_and_serves_the_tbt_check(prefilled_cache: Any) -> None:
    """Least squares on exact samples gives back c0 + c1·batch + c2·context; too few or too alike samples are
    refused; an empty batch costs nothing and predictions never go below zero."""
    truth = (0.004, 0.0005, 2e-6)
    shapes = [(1, 10), (2, 50), (4, 300), (8, 1000), (3, 7)]
    samples = [(b, t, truth[0] + truth[1] * b + truth[2] * t) for b, t in shapes]
    fitted = FittedStepModel.fit(samples)
    assert fitted.coefficients == pytest.approx(truth, rel=1e-6, abs=1e-12)
    assert fitted.step_s(0, 100) == 0.0 and fitted.step_s(2, 50) == pytest.approx(samples[1][2])
    assert FittedStepModel(coefficients=(-1.0, 0.0, 0.0)).step_s(1, 0) == 0.0
    with pytest.raises(ConfigError, match="at least 3"):
        FittedStepModel.fit(samples[:2])
    with pytest.raises(ConfigError, match="vary"):
        FittedStepModel.fit([(2, 10, 0.1), (2, 10, 0.2), (2, 10, 0.3)])
    cache, r = prefilled_cache
    config = DecodeConfig(max_context_tokens=32, tbt_slo_s=fitted.step_s(2, 13 + 8) * 0.999)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config, step_model=fitted)
    assert join(engine, r["r13"], "x", 4).accepted
    assert join(engine, r["r8"], "y", 4).reason is Reason.TBT_SLO


coefficients = st.floats(min_value=-0.1, max_value=0.1) | st.sampled_from([0.0, -0.0, 1e-300])


@given(
    st.tuples(coefficients, coefficients.map(lambda c: c / 100), coefficients.map(lambda c: c / 10**5)),
    st.integers(min_value=-2, max_value=10_000),
    st.integers(min_value=0, max_value=10**7),
)
def test_a_fitted_step_model_is_its_roofline(
    fitted_coefficients: tuple[float, float, float], batch_size: int, context_tokens: int
) -> None:
    """step_s is max(0, c0 + c1·B + c2·C) (0 for an empty batch), and its roofline (the fitted plane and the
    zero plane, no overhead) gives the same float on every input, alone and in step_times."""
    fitted = FittedStepModel(coefficients=fitted_coefficients)
    c0, c1, c2 = fitted_coefficients
    expected = max(0.0, c0 + c1 * batch_size + c2 * context_tokens) if batch_size > 0 else 0.0
    roofline = fitted.roofline()
    assert fitted.step_s(batch_size, context_tokens) == expected
    assert roofline.step_s(batch_size, context_tokens) == expected
    assert roofline.overhead_s == 0.0 and [attrs.astuple(b) for b in roofline.branches] == [
        fitted_coefficients,
        (0.0, 0.0, 0.0),
    ]
    sizes, contexts = np.array([batch_size]), np.array([context_tokens])
    assert roofline.step_times(sizes, contexts).tolist() == [expected]


# --------------------------------------------------------------------------- error contracts


def test_a_missing_kv_block_raises_and_leaves_nothing_pinned(prefilled_cache: Any) -> None:
    """UnknownBlockError when a block of the prompt is not here; the blocks pinned before it are released
    and the batch is unchanged."""
    cache, r = prefilled_cache
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK)
    assert join(engine, r["r5"], "x", 4).accepted
    keys = r["r13"].keys
    cache.remove(keys[2])
    with pytest.raises(UnknownBlockError):
        join(engine, r["r13"], "y", 4)
    assert engine.active_ids == ("x",)
    assert len(engine.step()) == 1
    assert_nothing_held(cache, keys + r["r5"].keys)


def test_pages_that_do_not_match_the_prompt_are_refused(prefilled_cache: Any) -> None:
    """A page holding fewer tokens than the prompt claims is an InvalidRequestError, with nothing left pinned."""
    cache, r = prefilled_cache
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK)
    with pytest.raises(InvalidRequestError, match="holds 1 tokens"):
        join(engine, r["r5"], "x", 4, prompt_tokens=8)  # the second block holds 1 token, not 4
    assert engine.num_active == 0
    assert_nothing_held(cache, r["r5"].keys)


@pytest.mark.parametrize(
    "options",
    [
        {"prompt_tokens": 0},
        {"prompt_tokens": 9},  # 2 keys cannot cover 9 tokens in blocks of 4
        {"max_new_tokens": 0},
        {"max_new_tokens": True},
        {"first_token": TINY.vocab_size},
        {"first_token": -1},
        {"first_token": 3.0},
        {"sampling": SamplingParams(repetition_penalty=1.2)},  # no prompt to count
        {"sampling": SamplingParams(repetition_penalty=1.2), "prompt": [1, 2, 3, 4]},  # 4 ids for 5 tokens
        {"sampling": SamplingParams(repetition_penalty=1.2), "prompt": [1, 2, 3, 4, -1]},
        {"prompt": [1, 2, 3, 4, TINY.vocab_size]},
    ],
)
def test_bad_requests_are_refused(prefilled_cache: Any, options: dict[str, Any]) -> None:
    """Bad counts, uncovered prompts, first tokens outside the vocabulary, and prompt ids missing, miscounted or
    outside it where given: InvalidRequestError, nothing held."""
    cache, r = prefilled_cache
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK)
    with pytest.raises(InvalidRequestError):
        join(engine, r["r5"], "x", options.pop("max_new_tokens", 4), **options)
    assert engine.num_active == 0 and engine.step() == []
    assert_nothing_held(cache, r["r5"].keys)


def test_a_request_id_decodes_once_at_a_time(prefilled_cache: Any) -> None:
    """Joining an id that is still decoding is an InvalidRequestError; after it finished the id is free."""
    cache, r = prefilled_cache
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK)
    assert join(engine, r["r5"], "x", 2).accepted
    with pytest.raises(InvalidRequestError, match="already decoding"):
        join(engine, r["r8"], "x", 2)
    engine.step()
    assert join(engine, r["r8"], "x", 2).accepted


def test_engine_configuration_is_checked() -> None:
    """A pipeline stage, a TBT SLO without a step model, impossible sizes (a negative KV budget included) and a
    TBT SLO that is no time (NaN, negative, a bool, a string: the decode rule compared it to every step) are
    ConfigErrors naming the field."""
    cache = dram_cache(BLOCK)
    with pytest.raises(ConfigError, match="whole model"):
        DecodeEngine(LlamaModel(TINY, layers=[1]), cache, block_tokens=BLOCK)
    with pytest.raises(ConfigError, match="step_model"):
        DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(tbt_slo_s=0.1))
    for fields in ({"max_batch_size": 0}, {"max_context_tokens": 1}, {"kv_budget_tokens": -1}):
        with pytest.raises(ConfigError):
            DecodeConfig(**fields)  # type: ignore[arg-type]
    for slo in (math.nan, -0.1, math.inf, True, "0.1"):
        with pytest.raises(ConfigError, match="tbt_slo_s"):
            DecodeConfig(tbt_slo_s=slo)  # type: ignore[arg-type]
    assert DecodeConfig(tbt_slo_s=0).tbt_slo_s == 0  # an objective of 0: only a lone request decodes
    assert DecodeConfig(max_batch_size=3, max_context_tokens=10).budget_tokens == 30


# --------------------------------------------------------------------------- the state machine

MACHINE_BATCH, MACHINE_CONTEXT, MACHINE_BUDGET = 3, 14, 26


@attrs.define
class Expected:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = attrs.Factory(list)
    stop: frozenset[int] = frozenset()

    def over(self) -> bool:
        """The reference's end: `max_new_tokens` out, or a stop token sampled (emitted as the last)."""
        return len(self.tokens) == self.max_new_tokens or self.tokens[-1] in self.stop


class DecodeMachine(RuleBasedStateMachine):
    """Requests join (prefilled on the spot into the shared cache) and step, against a bookkeeping reference:
    the local checks' verdicts, the active set, emitted counts and reserved tokens; each token is the model's
    greedy continuation and every request ends exactly once, with finished=True on its last token: its
    `max_new_tokens`-th or the first of its stop tokens."""

    @initialize()
    def start(self) -> None:
        self.cache = dram_cache(BLOCK, pages=48)
        self.prefill = PrefillEngine(tiny_model(), self.cache, hasher(BLOCK))
        config = DecodeConfig(
            max_batch_size=MACHINE_BATCH, max_context_tokens=MACHINE_CONTEXT, kv_budget_tokens=MACHINE_BUDGET
        )
        self.engine = DecodeEngine(tiny_model(), self.cache, block_tokens=BLOCK, config=config)
        self.active: dict[RequestId, Expected] = {}
        self.ended: dict[RequestId, Expected] = {}
        self.events: dict[RequestId, list[TokenEvent]] = {}
        self.count = 0

    def teardown(self) -> None:
        if hasattr(self, "prefill"):
            self.prefill.close()

    @rule(
        length=st.integers(min_value=1, max_value=10),
        content=st.integers(min_value=0, max_value=2),
        max_new_tokens=st.integers(min_value=1, max_value=6),
        stop=st.frozensets(st.integers(min_value=0, max_value=255), max_size=96),  # the tiny vocabulary: often hit
    )
    def join(self, length: int, content: int, max_new_tokens: int, stop: frozenset[int]) -> None:
        prompt = tokens_of(content, length)  # three contents: prompts share prefixes often
        request_id = RequestId(f"q{self.count}")
        self.count += 1
        result = self.prefill.prefill(prompt)
        assert result.first_token == int(torch.argmax(reference_logits(prompt)[-1]))
        self.events[request_id] = []
        verdict = self.engine.try_join(
            request_id,
            result.keys,
            prompt_tokens=length,
            first_token=result.first_token,
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(stop_token_ids=stop),
            on_token=self.events[request_id].append,
        )
        reserved = sum(len(e.prompt) + e.max_new_tokens for e in self.active.values())
        output = 1 if result.first_token in stop else max_new_tokens  # a first token that stops it is its only one
        expected_reason: Reason | None = None
        if length + output > MACHINE_CONTEXT:
            expected_reason = Reason.CONTEXT_TOO_LONG
        elif output > 1 and len(self.active) >= MACHINE_BATCH:
            expected_reason = Reason.BATCH_FULL
        elif output > 1 and reserved + length + output > MACHINE_BUDGET:
            expected_reason = Reason.KV_BUDGET
        assert verdict.reason == expected_reason and verdict.accepted == (expected_reason is None)
        if not verdict.accepted:
            assert self.events.pop(request_id) == []
            return
        expected = Expected(prompt, max_new_tokens, [result.first_token], stop)
        (self.ended if expected.over() else self.active)[request_id] = expected

    @precondition(lambda self: bool(getattr(self, "active", None)))
    @rule()
    def step(self) -> None:
        before = set(self.engine.active_ids)
        events = self.engine.step()
        assert {e.request_id for e in events} == before and len(events) == len(before)
        for event in events:
            expected = self.active[event.request_id]
            logits = reference_logits(expected.prompt + expected.tokens)[-1]
            assert event.token == int(torch.argmax(logits))
            expected.tokens.append(event.token)
            if expected.over():
                self.ended[event.request_id] = self.active.pop(event.request_id)

    @rule()
    def step_when_idle(self) -> None:
        if not self.active:
            assert self.engine.step() == []

    @invariant()
    def bookkeeping_matches(self) -> None:
        if not hasattr(self, "engine"):
            return
        self.engine.check_invariants()
        assert set(self.engine.active_ids) == set(self.active)
        assert self.engine.reserved_tokens == sum(len(e.prompt) + e.max_new_tokens for e in self.active.values())
        assert self.engine.context_tokens == sum(len(e.prompt) + len(e.tokens) - 1 for e in self.active.values())
        for request_id, expected in (self.active | self.ended).items():
            events = self.events[request_id]
            assert [e.token for e in events] == expected.tokens
            assert [e.index for e in events] == list(range(len(expected.tokens)))
            finished = [e.finished for e in events]
            if request_id in self.ended:
                assert finished == [False] * (len(expected.tokens) - 1) + [True]
            else:
                assert not any(finished)


DecodeMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
test_decode_machine = DecodeMachine.TestCase


def test_a_cancelled_request_leaves_the_batch_and_the_others_decode_as_before(prefilled_cache: Any) -> None:
    """cancel() drops a request mid-decode (its slot refilled, no more tokens); the rest are unchanged."""
    cache, r = prefilled_cache
    config = DecodeConfig(max_batch_size=4, max_context_tokens=32)
    reference = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config)
    got: dict[str, list[int]] = {}
    expected: dict[str, list[int]] = {}
    for name in ("r3", "r5", "r8"):
        join(
            reference,
            r[RequestId(name)],
            name,
            6,
            on_token=lambda e: expected.setdefault(e.request_id, []).append(e.token),
        )
        join(engine, r[RequestId(name)], name, 6, on_token=lambda e: got.setdefault(e.request_id, []).append(e.token))
    engine.step()
    assert engine.cancel(RequestId("r3")) and not engine.cancel(RequestId("r3")) and not engine.cancel(RequestId("x"))
    engine.check_invariants()
    assert engine.active_ids == (RequestId("r8"), RequestId("r5"))  # the last slot moved into the hole
    engine.run(max_steps=20)
    reference.run(max_steps=20)
    assert got[RequestId("r3")] == expected[RequestId("r3")][:2]  # the first token and one step, then nothing
    assert got[RequestId("r5")] == expected[RequestId("r5")] and got[RequestId("r8")] == expected[RequestId("r8")]
    assert engine.num_active == 0


def three_decoding(
    cache: TieredCache, r: dict[RequestId, PrefillResult], on_token: Callable[[TokenEvent], None]
) -> DecodeEngine:
    """An engine decoding r3, r5 and r8 (in slots 0, 1, 2) for 6 tokens each, every token to `on_token`."""
    engine = DecodeEngine(
        tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=4, max_context_tokens=32)
    )
    for name in ("r3", "r5", "r8"):
        assert join(engine, r[RequestId(name)], name, 6, on_token=on_token).accepted
    return engine


def alone(cache: TieredCache, r: dict[RequestId, PrefillResult]) -> dict[RequestId, list[int]]:
    """Each request's tokens when nothing interferes."""
    tokens: dict[RequestId, list[int]] = {}
    three_decoding(cache, r, lambda e: tokens.setdefault(e.request_id, []).append(e.token)).run(max_steps=20)
    return tokens


@pytest.mark.parametrize("final", [False, True])
def test_a_callback_that_raises_drops_its_request_and_the_batch_goes_on(prefilled_cache: Any, final: bool) -> None:
    """r5's consumer fails at its third token (its last, with `final`): the step raises that error once every
    other request has its token, r5 is dropped (no slot, no later token: it ends once at most), and r3 and r8
    decode as they would alone."""
    cache, r = prefilled_cache
    expected = alone(cache, r)
    got: dict[RequestId, list[TokenEvent]] = {}
    failing_index = 5 if final else 2

    def on_token(event: TokenEvent) -> None:
        got.setdefault(event.request_id, []).append(event)
        if event.request_id == "r5" and event.index == failing_index:
            raise ConnectionError("r5's client went away")

    engine = three_decoding(cache, r, on_token)
    failures = 0
    for _ in range(20):
        try:
            engine.step()
        except ConnectionError:
            failures += 1
        engine.check_invariants()
        if not engine.num_active:
            break
    assert failures == 1 and engine.num_active == 0
    assert [e.token for e in got[RequestId("r5")]] == expected[RequestId("r5")][: failing_index + 1]
    assert sum(e.finished for e in got[RequestId("r5")]) == int(final)
    for name in ("r3", "r8"):
        events = got[RequestId(name)]
        assert [e.token for e in events] == expected[RequestId(name)]
        assert [e.finished for e in events] == [False] * 5 + [True]


@pytest.mark.parametrize("victim", ["r3", "r5", "r8"])
def test_a_callback_may_cancel_any_request_during_a_step(prefilled_cache: Any, victim: str) -> None:
    """r5's callback cancels `victim` at r5's second token (itself, a request called back before it, or one
    after): the victim gets no token once cancelled, every other token is the one it would be alone, in order."""
    cache, r = prefilled_cache
    expected = alone(cache, r)
    got: dict[RequestId, list[int]] = {}
    engine: DecodeEngine | None = None

    def on_token(event: TokenEvent) -> None:
        got.setdefault(event.request_id, []).append(event.token)
        if event.request_id == "r5" and event.index == 1:
            assert engine is not None and engine.cancel(RequestId(victim))

    engine = three_decoding(cache, r, on_token)
    engine.run(max_steps=20)
    engine.check_invariants()
    assert engine.num_active == 0
    order = ["r3", "r5", "r8"]  # the slot order of the step that cancels
    kept = 2 if order.index(victim) <= order.index("r5") else 1  # its first token, and that step's if called back
    for name in order:
        assert got[RequestId(name)] == expected[RequestId(name)][: kept if name == victim else None]


def test_a_join_whose_first_callback_raises_holds_nothing(prefilled_cache: Any) -> None:
    """A consumer that fails on the first token: try_join raises its error, the request holds no slot and no
    KV budget, and the same id joins again."""
    cache, r = prefilled_cache
    engine = DecodeEngine(
        tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=2, max_context_tokens=32)
    )

    def gone(_event: TokenEvent) -> None:
        raise ConnectionError("the client left")

    with pytest.raises(ConnectionError):
        join(engine, r[RequestId("r5")], "r5", 6, on_token=gone)
    engine.check_invariants()
    assert engine.num_active == 0 and engine.reserved_tokens == 0
    assert join(engine, r[RequestId("r5")], "r5", 6).accepted and engine.active_ids == (RequestId("r5"),)
