"""Edge contracts of the prefill pipeline (prefill, layer-wise I/O, CPP) and the decode engine.

Gaps the main tests of `mooncake.engine.{prefill,pipeline,decode,kv}` leave open.
Properties: the reused prefix is the leading run of cached blocks only (a
missing block ends it; what follows is recomputed into the KV it held); a
one-stage pipeline group gives one forward pass's logits and KV for any
chunking and cached prefix, reporting each chunk's rows once; continuous
batching with waits for slots, stop tokens (the first token included),
`min_tokens` and `max_new_tokens` gives each request its greedy decode alone.
Examples: a failed read while pinning the prefix gives back the pins taken; a
forward pass that fails gives back no page a queued store still writes; a
batch whose sampling list does not match its prompts, a decode join whose keys
do not cover the prompt, and a KV page failing verification are refused with
nothing held; bad pipeline sizes, timeouts and prefix counts and a negative
page size are MooncakeErrors naming the value.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.engine.decode import DecodeConfig, DecodeEngine
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import KvBuffers, ModelForward, PrefillConfig, PrefillEngine, PrefillResult
from mooncake.engine.sampling import SamplingParams
from mooncake.errors import ConfigError, EngineError, IntegrityError, InvalidRequestError, UnknownBlockError
from mooncake.types import BlockKey, RequestId
from tests.engine.support import (
    TINY,
    TOLERANCE,
    assert_nothing_held,
    dram_cache,
    hasher,
    layout,
    page_bytes,
    reference_logits,
    tiny_model,
)
from tests.engine.test_pipeline import reference

KV = list[tuple[torch.Tensor, torch.Tensor]]
BLOCK = 4
PROMPT = [(5 * i + 2) % TINY.vocab_size for i in range(19)]  # 4 whole blocks of 4 and a partial one of 3
tokens_strategy = st.lists(st.integers(min_value=0, max_value=TINY.vocab_size - 1), min_size=1, max_size=20)


def prefill(cache: TieredCache, tokens: list[int], *, block: int = BLOCK, **options: Any) -> PrefillResult:
    with PrefillEngine(tiny_model(), cache, hasher(block), PrefillConfig(**options)) as engine:
        return engine.prefill(tokens)


def floats(page: bytes) -> np.ndarray:
    return np.frombuffer(page, dtype=np.float32)


def one_pass(tokens: list[int]) -> tuple[torch.Tensor, KV]:
    """The tiny model (seed 0, a group's default) over `tokens` in one chunk: the last logits and every layer's
    K and V."""
    return reference(tokens, tiny_model())


# --------------------------------------------------------------------------- prefix reuse


@settings(max_examples=25, deadline=None)
@given(tokens=tokens_strategy, block=st.sampled_from([1, 2, 4]), data=st.data())
def test_the_reused_prefix_is_the_leading_run_of_cached_blocks(
    tokens: list[int], block: int, data: st.DataObject
) -> None:
    """With some blocks of a prompt evicted after it was prefilled, prefilling it again reuses exactly the
    blocks before the first missing one (capped to leave one token), recomputes the rest, and gives the
    forward pass's logits; the missing blocks are stored again with the KV they held (loaded prefix KV and
    recomputed KV agree) and nothing stays pinned or reserved."""
    cache = dram_cache(block)
    keys = prefill(cache, tokens, block=block).keys
    before = [floats(page_bytes(cache, key)) for key in keys]
    removed = data.draw(st.sets(st.integers(min_value=0, max_value=len(keys) - 1)), label="removed")
    for index in removed:
        cache.remove(keys[index])
    result = prefill(cache, tokens, block=block, chunk_tokens=data.draw(st.sampled_from([1, 3, 64]), label="chunk"))
    leading = next((i for i in range(len(keys)) if i in removed), len(keys))
    assert result.prefix_tokens == min(leading, (len(tokens) - 1) // block) * block
    assert result.computed_tokens == len(tokens) - result.prefix_tokens
    assert torch.allclose(result.logits, reference_logits(tokens)[-1], **TOLERANCE)
    assert set(result.stored_keys) == {keys[i] for i in removed if i * block >= result.prefix_tokens}
    for key, page in zip(keys, before, strict=True):  # recomputed blocks hold the KV they held before
        assert np.allclose(floats(page_bytes(cache, key)), page, **TOLERANCE)
    assert_nothing_held(cache, keys)


class FailingReadCache(TieredCache):
    """A DRAM cache whose reads of one block fail as a verified lower-tier read does: `touch` raises, `get`
    reports the miss (None) that a block failing verification is."""

    def __init__(self) -> None:
        super().__init__([DramPagePool(layout(BLOCK).page_bytes, 32)])
        self.failing_touch: BlockKey | None = None
        self.failing_get: BlockKey | None = None

    def touch(self, key: BlockKey) -> Any:
        if key == self.failing_touch:
            raise IntegrityError(f"block {key} failed verification while touched")
        return super().touch(key)

    def get(self, key: BlockKey) -> Any:
        return None if key == self.failing_get else super().get(key)


@pytest.mark.parametrize("failing_block", [0, 2])
def test_a_failed_read_while_pinning_the_prefix_gives_back_the_pins_taken(failing_block: int) -> None:
    """A prefix block whose read fails while the engine pins the prefix raises that error; the blocks pinned
    before it are unpinned, nothing is reserved, and the engine then prefills as before."""
    keys = hasher(BLOCK).block_keys(PROMPT)
    cache = FailingReadCache()
    prefill(cache, PROMPT)
    cache.failing_touch = keys[failing_block]
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK)) as engine:
        with pytest.raises(IntegrityError, match="failed verification"):
            engine.prefill(PROMPT)
        cache.failing_touch = None
        assert torch.allclose(engine.prefill(PROMPT).logits, reference_logits(PROMPT)[-1], **TOLERANCE)
    assert_nothing_held(cache, keys)


class FailingForward:
    """A forward pass that queues its layer-wise stores behind a gate on the store thread, then fails; the gate
    opens when the engine aborts the I/O (or, failing that, when a reserved page is given back)."""

    def __init__(self) -> None:
        self.inner = ModelForward(tiny_model(), chunk_tokens=3)
        self.model_config, self.dtype, self.device = TINY, self.inner.dtype, self.inner.device
        self.gate = threading.Event()
        self.io: LayerwiseKvIo | None = None

    def run(self, ids: torch.Tensor, kv: KvBuffers, io: LayerwiseKvIo) -> torch.Tensor:
        self.io = io
        abort = io.abort

        def opening_abort() -> None:
            self.gate.set()
            abort()

        io.abort = opening_abort  # type: ignore[method-assign]
        io._storer.submit(self.gate.wait, 30.0)  # bounded: a lost wake-up cannot hang the suite
        self.inner.run(ids, kv, io)
        raise RuntimeError("the compute failed after queueing its stores")


class GivingBackCache(TieredCache):
    """A DRAM cache noting, whenever a reserved page is given back, whether a store of `forward` is still due."""

    def __init__(self, forward: FailingForward) -> None:
        super().__init__([DramPagePool(layout(BLOCK).page_bytes, 32)])
        self.forward = forward
        self.given_back_under_a_store = 0

    def abort(self, key: BlockKey) -> None:
        io = self.forward.io
        if io is not None and not all(future.done() for future in io._submitted):
            self.given_back_under_a_store += 1
            self.forward.gate.set()
        super().abort(key)


def test_a_forward_pass_that_fails_gives_back_no_page_a_queued_store_still_writes() -> None:
    """When the computation fails after queueing layer-wise stores, the engine waits for every queued store before
    it gives the reserved pages back (a late store would write a page the cache has handed to someone else); the
    error reaches the caller and nothing stays pinned or reserved."""
    forward = FailingForward()
    cache = GivingBackCache(forward)
    with (
        PrefillEngine(forward, cache, hasher(BLOCK), PrefillConfig(layerwise=True)) as engine,
        pytest.raises(RuntimeError, match="compute failed"),
    ):
        engine.prefill(PROMPT)
    assert forward.gate.is_set() and forward.io is not None
    assert cache.given_back_under_a_store == 0
    assert len(cache) == 0 and cache.pools[0].num_free == cache.pools[0].num_pages


def test_a_batch_whose_sampling_list_does_not_match_its_prompts_is_refused_before_anything_is_held() -> None:
    """One `SamplingParams` per prompt, as one sink per prompt: a shorter or longer list is an
    InvalidRequestError raised before any block is pinned, reserved or stored."""
    cache = dram_cache(BLOCK)
    cached = prefill(cache, PROMPT[:8])
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK)) as engine:
        for sampling in ([SamplingParams()], [None, None, None]):
            with pytest.raises(InvalidRequestError):
                engine.prefill_batch([PROMPT, PROMPT[:12]], sampling=sampling)
            assert len(cache) == 2
    assert_nothing_held(cache, cached.keys + hasher(BLOCK).block_keys(PROMPT))


def test_a_closed_engine_refuses_a_prefill_before_anything_is_held() -> None:
    """After `close` the loader and store threads are gone: a prefill is an EngineError saying so, raised before
    the cached prefix is pinned or a page reserved (it was the executor's RuntimeError)."""
    cache = dram_cache(BLOCK)
    cached = prefill(cache, PROMPT[:8])
    engine = PrefillEngine(tiny_model(), cache, hasher(BLOCK))
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.prefill(PROMPT)
    assert len(cache) == 2
    assert_nothing_held(cache, cached.keys + hasher(BLOCK).block_keys(PROMPT))


# --------------------------------------------------------------------------- one-stage CPP


@settings(max_examples=30, deadline=None)
@given(tokens=tokens_strategy, chunk=st.integers(min_value=1, max_value=8), data=st.data())
def test_a_one_stage_group_equals_one_pass_for_any_chunking_and_prefix(
    tokens: list[int], chunk: int, data: st.DataObject
) -> None:
    """A one-stage group (this process only) with any chunk size, after any cached prefix p, gives the
    one-pass logits and fills rows [p, n) of every layer with the one-pass K and V (rows [0, p) untouched);
    `on_rows` hears each layer's chunks of [p, n) once each, in order, each when its rows are final."""
    n = len(tokens)
    prefix = data.draw(st.integers(min_value=0, max_value=n - 1), label="prefix")
    wanted_logits, wanted_kv = one_pass(tokens)
    kv = [(k.clone(), v.clone()) for k, v in wanted_kv]
    for k, v in kv:
        k[prefix:], v[prefix:] = float("nan"), float("nan")
    heard: dict[int, list[tuple[int, int]]] = {layer: [] for layer in range(TINY.num_layers)}

    def on_rows(layer: int, start: int, end: int) -> None:
        heard[layer].append((start, end))
        assert not torch.isnan(kv[layer][0][start:end]).any() and not torch.isnan(kv[layer][1][start:end]).any()

    group = PipelineGroup(TINY, num_stages=1, chunk_tokens=chunk)
    try:
        logits = group.prefill(tokens, kv=kv, prefix_tokens=prefix, on_rows=on_rows)
    finally:
        group.close()
    assert torch.allclose(logits, wanted_logits, **TOLERANCE)
    for (k, v), (k_wanted, v_wanted) in zip(kv, wanted_kv, strict=True):
        assert torch.allclose(k, k_wanted, **TOLERANCE) and torch.allclose(v, v_wanted, **TOLERANCE)
    chunks = [(start, min(n, start + chunk)) for start in range(prefix, n, chunk)]
    assert heard == {layer: chunks for layer in range(TINY.num_layers)}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": True}, "num_stages"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": -3}, "chunk_tokens"),
        ({"chunk_tokens": 2.5}, "chunk_tokens"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),  # was a TypeError from `>`
        ({"timeout_s": True}, "timeout_s"),
        ({"num_stages": 2, "start_timeout_s": math.inf}, "start_timeout_s"),  # was an OverflowError, a socket open
    ],
)
def test_pipeline_sizes_and_timeouts_are_config_errors_naming_the_field(options: dict[str, Any], field: str) -> None:
    """A stage count or chunk size that is no positive integer (0, a bool, a float) and a timeout that is no
    finite positive number of seconds are ConfigErrors naming the field, raised before any stage starts."""
    with pytest.raises(ConfigError, match=field):
        PipelineGroup(TINY, **{"num_stages": 1, **options}).close()


@pytest.mark.parametrize("prefix_tokens", [2.0, 1.5, True, "1"])
def test_a_prefix_count_that_is_no_integer_is_an_invalid_request(prefix_tokens: object) -> None:
    """`prefix_tokens` is a count of tokens: a float (even a whole one), a bool or a string is an
    InvalidRequestError naming it, as the prefill engine refuses float or bool token ids, not truncated."""
    tokens = [1, 2, 3, 4, 5]
    kv = [(k.clone(), v.clone()) for k, v in one_pass(tokens)[1]]
    group = PipelineGroup(TINY, num_stages=1, chunk_tokens=2)
    try:
        with pytest.raises(InvalidRequestError, match="prefix_tokens"):
            group.prefill(tokens, kv=kv, prefix_tokens=prefix_tokens)  # type: ignore[arg-type]
    finally:
        group.close()


@pytest.mark.parametrize("num_bytes", [-1, 1.0])
def test_a_negative_or_float_page_size_holds_no_whole_number_of_tokens(num_bytes: float) -> None:
    """A page size below zero, or not an integer, is no page: ConfigError, not a negative or float count."""
    with pytest.raises(ConfigError, match="whole number"):
        layout(BLOCK).tokens_in(num_bytes * layout(BLOCK).block_bytes(1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- decode joins


def test_a_kv_page_that_fails_verification_is_an_unknown_block_and_nothing_is_held() -> None:
    """A prompt block whose read fails verification while the engine copies the KV (`get` gives None) is an
    UnknownBlockError naming it; every pin taken is released, no slot is taken, and the engine decodes on."""
    cache = FailingReadCache()
    result = prefill(cache, PROMPT[:10])
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=32))
    cache.failing_get = result.keys[1]
    with pytest.raises(UnknownBlockError, match="verification"):
        engine.try_join(RequestId("x"), result.keys, prompt_tokens=10, first_token=result.first_token, max_new_tokens=4)
    assert engine.num_active == 0
    cache.failing_get = None
    joined = engine.try_join(
        RequestId("x"), result.keys, prompt_tokens=10, first_token=result.first_token, max_new_tokens=2
    )
    assert joined.accepted and [e.finished for e in engine.run(max_steps=5)] == [True]
    assert_nothing_held(cache, result.keys)


@pytest.mark.parametrize(("prompt_tokens", "num_keys"), [(12, 2), (8, 3), (5, 3), (4, 2)])
def test_a_join_whose_keys_do_not_cover_the_prompt_exactly_is_refused(prompt_tokens: int, num_keys: int) -> None:
    """Keys of full pages that cover fewer or more tokens than the prompt (12 tokens named by 2 full blocks,
    8 by 3) are an InvalidRequestError naming the counts, before a page is read: nothing pinned, no slot taken."""
    cache = dram_cache(BLOCK)
    keys = prefill(cache, PROMPT[:16]).keys[:num_keys]  # full blocks only
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_context_tokens=32))
    with pytest.raises(InvalidRequestError, match="do not cover"):
        engine.try_join(RequestId("x"), keys, prompt_tokens=prompt_tokens, first_token=0, max_new_tokens=4)
    assert engine.num_active == 0 and engine.step() == []
    assert_nothing_held(cache, keys)


# --------------------------------------------------------------------------- decode batching


def greedy_alone(prompt: list[int], max_new_tokens: int, stop: frozenset[int], min_tokens: int) -> list[int]:
    """The one-request reference from the forward pass: greedy tokens (stop tokens held back before output
    position `min_tokens`), ended by `max_new_tokens` or the first stop token, which is emitted as the last."""
    tokens: list[int] = []
    while not tokens or (len(tokens) < max_new_tokens and tokens[-1] not in stop):
        logits = reference_logits(prompt + tokens)[-1].clone()
        if len(tokens) < min_tokens:
            logits[list(stop)] = -math.inf
        tokens.append(int(torch.argmax(logits)))
    return tokens


Scenario = tuple[int, list[tuple[list[int], int, int, int | None, int]]]


@st.composite
def decode_scenarios(draw: st.DrawFn) -> Scenario:
    """A batch size and requests (prompt, max_new_tokens, arrival step, which of its unconstrained greedy tokens
    is its stop token, min_tokens)."""
    max_batch_size = draw(st.integers(min_value=1, max_value=3), label="max_batch_size")
    requests = []
    for _ in range(draw(st.integers(min_value=1, max_value=5), label="requests")):
        length = draw(st.integers(min_value=1, max_value=9))
        seed = draw(st.integers(min_value=0, max_value=3))
        prompt = [(seed * 31 + 7 * i + i * i) % TINY.vocab_size for i in range(length)]
        max_new_tokens = draw(st.integers(min_value=1, max_value=5))
        stop_at = draw(st.none() | st.integers(min_value=0, max_value=max_new_tokens - 1))
        min_tokens = draw(st.sampled_from([0, 0, 1, 2, 3]))
        requests.append((prompt, max_new_tokens, draw(st.integers(min_value=0, max_value=4)), stop_at, min_tokens))
    return max_batch_size, requests


@settings(max_examples=20, deadline=None)
@given(decode_scenarios())
def test_continuous_batching_gives_each_request_its_decode_alone(scenario: Scenario) -> None:
    """Requests arrive at various steps and wait (FIFO) while every slot is taken; they join, finish by
    `max_new_tokens` or a stop token (the prefill's first token included; none before `min_tokens`) and free
    their slots for the waiting ones. Each gets exactly the tokens of its greedy decode alone, indices 0, 1, …
    and `finished` on its last token only; the batch never exceeds its slots, a request whose first token ends
    it takes no slot, and nothing stays pinned."""
    max_batch_size, requests = scenario
    cache = dram_cache(BLOCK, pages=64)
    config = DecodeConfig(max_batch_size=max_batch_size, max_context_tokens=16)
    engine = DecodeEngine(tiny_model(), cache, block_tokens=BLOCK, config=config)
    expected: dict[RequestId, list[int]] = {}
    plans = []
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK)) as prefiller:
        for index, (prompt, max_new_tokens, arrival, stop_at, min_tokens) in enumerate(requests):
            full = greedy_alone(prompt, max_new_tokens, frozenset(), 0)
            stop = frozenset() if stop_at is None or stop_at >= len(full) else frozenset({full[stop_at]})
            sampling = SamplingParams(stop_token_ids=stop, min_tokens=min_tokens)
            request_id = RequestId(f"r{index}")
            expected[request_id] = greedy_alone(prompt, max_new_tokens, stop, min_tokens)
            result = prefiller.prefill(prompt, sampling=sampling)
            assert result.first_token == expected[request_id][0]
            plans.append((request_id, result, len(prompt), max_new_tokens, arrival, sampling))
    events: dict[RequestId, list[Any]] = {request_id: [] for request_id, *_ in plans}
    waiting: list[Any] = []
    step = 0
    while step < 200 and (step <= 4 or waiting or engine.num_active):
        waiting += [plan for plan in plans if plan[4] == step]
        while waiting:
            request_id, result, prompt_tokens, max_new_tokens, _, sampling = waiting[0]
            active_before = engine.num_active
            verdict = engine.try_join(
                request_id,
                result.keys,
                prompt_tokens=prompt_tokens,
                first_token=result.first_token,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                on_token=events[request_id].append,
            )
            if not verdict.accepted:
                assert active_before == max_batch_size, verdict  # only a full batch makes a request wait
                break
            waiting.pop(0)
            alone = expected[request_id]
            assert engine.num_active == active_before + (len(alone) > 1)
        engine.check_invariants()
        assert engine.num_active <= max_batch_size
        engine.step()
        step += 1
    assert not waiting and engine.num_active == 0
    for request_id, tokens in expected.items():
        got = events[request_id]
        assert [e.token for e in got] == tokens, request_id
        assert [e.index for e in got] == list(range(len(tokens)))
        assert [e.finished for e in got] == [False] * (len(tokens) - 1) + [True]
    assert_nothing_held(cache, [key for _, result, *_ in plans for key in result.keys])
