"""Tests for `mooncake.engine.prefill.PrefillEngine`: prefix reuse, chunking and layer-wise I/O change nothing.

Properties over random prompts, block sizes and chunk sizes: a prefill from
scratch gives the plain forward pass's last logits and greedy token; a
prefill over a cached prefix (as long as the cache can give it: whole blocks,
at least one token computed) gives those of a prefill from scratch; layer-wise
load/store is bit-identical to the serialized baseline, pages included.
Examples: chunked equals unchunked (chunks that do not divide the block too);
the pages hold the model's K and V; a prefix comes back from the SSD tier; the
sink hears every layer once, in order, after its bytes are final; and the
error contracts — bad tokens, a full cache, a failing sink — leave no pin, no
reservation and no running helper behind. A batch (`prefill_batch`, the
prompts packed into shared passes) gives each prompt what prefilling it alone
gives, streams each to its own sink, and fails as one, holding nothing; a bad prompt anywhere runs nothing,
whatever the forward pass, and NaN logits commit nothing.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.tiered import TieredCache
from mooncake.engine.model import LlamaModel
from mooncake.engine.prefill import KvBuffers, MessengerSink, ModelForward, PrefillConfig, PrefillEngine, PrefillResult
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.errors import Cancelled, CapacityError, ConfigError, EngineError, InvalidRequestError
from mooncake.types import BlockKey, Tier
from tests.engine.support import (
    TINY,
    TOLERANCE,
    CancelAfter,
    assert_nothing_held,
    block_sizes,
    dram_cache,
    hasher,
    layout,
    page_bytes,
    prompts,
    reference_logits,
    tcp_nodes,
    tiered_cache,
    tiny_model,
)

PREFILL_SETTINGS = settings(max_examples=25, deadline=None)  # each example runs a few tiny prefills
chunk_sizes = st.sampled_from([1, 2, 3, 5, 4096])
PROMPT = [(7 * i + 3) % TINY.vocab_size for i in range(23)]  # 5 blocks of 4 and a partial one of 3


def prefill(cache: TieredCache, tokens: list[int], *, block: int, **options: Any) -> PrefillResult:
    with PrefillEngine(tiny_model(), cache, hasher(block), PrefillConfig(**options)) as engine:
        return engine.prefill(tokens)


def stored_pages(cache: TieredCache, keys: tuple[BlockKey, ...]) -> list[bytes]:
    return [page_bytes(cache, key) for key in keys]


def as_floats(pages: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(pages), dtype=np.float32)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_like_the_model(result: PrefillResult, tokens: list[int]) -> None:
    expected = reference_logits(tokens)[-1]
    assert result.logits.shape == (TINY.vocab_size,) and result.logits.dtype == torch.float32
    assert torch.allclose(result.logits, expected, **TOLERANCE)
    assert result.first_token == int(torch.argmax(expected))


# --------------------------------------------------------------------------- properties


@PREFILL_SETTINGS
@given(prompts, block_sizes, chunk_sizes, st.booleans())
def test_prefill_from_scratch_equals_the_model_forward(
    tokens: list[int], block: int, chunk: int, layerwise: bool
) -> None:
    """An empty cache: the model's last logits and greedy token; every block, the partial last one included,
    is stored in a page sized to its tokens."""
    cache = dram_cache(block)
    result = prefill(cache, tokens, block=block, chunk_tokens=chunk, layerwise=layerwise)
    assert_like_the_model(result, tokens)
    assert result.keys == hasher(block).block_keys(tokens) == result.stored_keys
    assert (result.prefix_tokens, result.computed_tokens) == (0, len(tokens))
    for i, key in enumerate(result.keys):
        location = cache.location(key)
        assert location is not None and location.ready and location.tier == Tier.DRAM
        assert location.length == layout(block).block_bytes(min(block, len(tokens) - i * block))
    assert_nothing_held(cache, result.keys)


@PREFILL_SETTINGS
@given(prompts, prompts, prompts, block_sizes, chunk_sizes, st.booleans())
def test_a_cached_prefix_gives_the_logits_of_a_prefill_from_scratch(
    shared: list[int], first_tail: list[int], second_tail: list[int], block: int, chunk: int, layerwise: bool
) -> None:
    """After prefilling A, prefilling B reuses the whole blocks they share (leaving at least one token to
    compute) and gives B's logits and token from scratch; only B's other blocks are stored."""
    first, second = shared + first_tail, shared[: len(shared) // 2] + second_tail
    cache = dram_cache(block)
    prefill(cache, first, block=block)
    result = prefill(cache, second, block=block, chunk_tokens=chunk, layerwise=layerwise)
    prefix_blocks = min(common_prefix(first, second) // block, (len(second) - 1) // block)
    assert result.prefix_tokens == prefix_blocks * block
    # What the router estimates and the simulators charge for the same cached blocks:
    assert result.prefix_tokens == reusable_prefix_tokens(len(second), common_prefix(first, second) // block, block)
    assert result.computed_tokens == len(second) - result.prefix_tokens
    scratch = prefill(dram_cache(block), second, block=block)
    assert torch.allclose(result.logits, scratch.logits, **TOLERANCE)
    assert result.first_token == scratch.first_token
    assert_like_the_model(result, second)
    first_keys = set(hasher(block).block_keys(first))
    assert result.stored_keys == tuple(key for key in result.keys if key not in first_keys)
    assert_nothing_held(cache, result.keys + tuple(first_keys))


@PREFILL_SETTINGS
@given(prompts, prompts, block_sizes, chunk_sizes)
def test_layerwise_is_bit_identical_to_serialized(first: list[int], tail: list[int], block: int, chunk: int) -> None:
    """Overlapping loads and stores with compute changes neither the logits nor a byte of a page."""
    second = first[: len(first) // 2 + 1] + tail
    caches, results = [], []
    for layerwise in (True, False):
        cache = dram_cache(block)
        prefill(cache, first, block=block, chunk_tokens=chunk, layerwise=layerwise)
        results.append(prefill(cache, second, block=block, chunk_tokens=chunk, layerwise=layerwise))
        caches.append(cache)
    overlapped, serialized = results
    assert torch.equal(overlapped.logits, serialized.logits)
    assert overlapped.first_token == serialized.first_token
    assert overlapped.prefix_tokens == serialized.prefix_tokens
    keys = hasher(block).block_keys(first) + overlapped.keys
    assert stored_pages(caches[0], keys) == stored_pages(caches[1], keys)


# --------------------------------------------------------------------------- examples


def test_a_cache_salt_keys_a_prompt_apart() -> None:
    """vLLM's `cache_salt`: a prompt prefilled under one salt is reused under that salt only (its keys are the
    salted hasher's); unsalted or another salt computes it whole, with the same logits; `prefill_batch` salts each
    prompt by its own."""
    block = 4
    cache = dram_cache(block)
    with PrefillEngine(tiny_model(), cache, hasher(block), PrefillConfig()) as engine:
        first = engine.prefill(PROMPT, cache_salt="alice")
        assert first.keys == hasher(block).salted("alice").block_keys(PROMPT) and first.prefix_tokens == 0
        for salt in (None, "bob"):
            assert engine.prefill(PROMPT, cache_salt=salt).prefix_tokens == 0
        again = engine.prefill(PROMPT, cache_salt="alice")
        assert again.prefix_tokens == reusable_prefix_tokens(len(PROMPT), len(first.keys), block) > 0
        assert torch.allclose(again.logits, first.logits, **TOLERANCE)
        both = engine.prefill_batch([PROMPT, PROMPT], cache_salts=["carol", "bob"])
        assert [r.prefix_tokens for r in both] == [0, again.prefix_tokens]
        with pytest.raises(InvalidRequestError, match="one sampling, sink and cache salt per prompt"):
            engine.prefill_batch([PROMPT], cache_salts=[])


@pytest.mark.parametrize("cached_tokens", [0, 9])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 6, 7, 16])
def test_chunked_prefill_equals_unchunked(chunk: int, cached_tokens: int) -> None:
    """Chunks of any size (dividing the 4-token block or not), over a cached prefix or none: same token,
    logits and page contents as one chunk."""
    results, pages = [], []
    for chunk_tokens in (4096, chunk):
        cache = dram_cache(4)
        if cached_tokens:
            prefill(cache, PROMPT[:cached_tokens], block=4)
        results.append(prefill(cache, PROMPT, block=4, chunk_tokens=chunk_tokens))
        pages.append(as_floats(stored_pages(cache, results[-1].keys)))
    whole, chunked = results
    assert chunked.prefix_tokens == whole.prefix_tokens == (8 if cached_tokens else 0)
    assert chunked.first_token == whole.first_token
    assert torch.allclose(chunked.logits, whole.logits, **TOLERANCE)
    np.testing.assert_allclose(pages[1], pages[0], **TOLERANCE)


def test_pages_hold_the_models_k_and_v() -> None:
    """Layer l of block b holds the K and V (after RoPE) that the plain forward pass computes for its tokens."""
    cache = dram_cache(4)
    result = prefill(cache, PROMPT, block=4)
    model, kv_layout = tiny_model(), layout(4)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((k.clone(), v.clone()))
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)

    with torch.inference_mode():
        x = model.embed(torch.tensor(PROMPT))
        cos, sin = model.rope(torch.arange(len(PROMPT)))
        for layer in model.layers:
            x = layer(x, cos, sin, recording)
    for b, key in enumerate(result.keys):
        rows = slice(4 * b, 4 * b + 4)
        for index, (k, v) in enumerate(seen):
            k_page, v_page = kv_layout.layer_kv(cache.get(key), index)
            assert torch.allclose(k_page, k[rows], **TOLERANCE) and torch.allclose(v_page, v[rows], **TOLERANCE)


def test_a_prompt_seen_twice_reuses_all_but_its_last_block() -> None:
    """The same prompt again reuses every whole block except the last (its logits need one computed token);
    nothing new is stored; a stored partial block is never reused as a prefix."""
    cache = dram_cache(4)
    first = prefill(cache, PROMPT[:20], block=4)  # five whole blocks
    again = prefill(cache, PROMPT[:20], block=4)
    assert (again.prefix_tokens, again.computed_tokens, again.stored_keys) == (16, 4, ())
    assert torch.allclose(again.logits, first.logits, **TOLERANCE) and again.first_token == first.first_token
    longer = prefill(cache, PROMPT, block=4)
    assert longer.prefix_tokens == 20 and longer.stored_keys == longer.keys[5:]
    assert_like_the_model(longer, PROMPT)


def test_stored_blocks_are_chained_to_their_parents() -> None:
    """Each block a prefill stores names the block before it as its parent (the first none, a continuation the
    cached block it follows): what prefix-aware eviction needs to take leaves before their prefix."""
    cache = dram_cache(16)
    first = prefill(cache, PROMPT[:12], block=4)
    longer = prefill(cache, PROMPT[:20], block=4)  # continues the three cached blocks
    keys = longer.keys
    parents = [cache._entries[key].parent for key in keys]  # the chain the cache keeps (no public view of it)
    assert first.keys == keys[:3] and parents == [None, *keys[:-1]]


@pytest.mark.parametrize("promote_after", [1, 0])
def test_a_prefix_demoted_to_ssd_is_reused(tmp_path: Path, promote_after: int) -> None:
    """Blocks pushed down to the SSD tier by later prompts still serve as a prefix, with the same result:
    promoted back to DRAM on the read, or (promote_after=0) read as verified copies from SSD."""
    cache = tiered_cache(4, tmp_path / "ssd.pool", dram_pages=6, ssd_pages=32, promote_after=promote_after)
    first = prefill(cache, PROMPT[:16], block=4)
    for other in range(3):
        prefill(cache, [(other * 31 + i) % 256 for i in range(12)], block=4)
    assert all(cache.tier_of(key) == Tier.SSD for key in first.keys)
    result = prefill(cache, PROMPT, block=4)
    assert result.prefix_tokens == 16
    expected_tier = Tier.DRAM if promote_after else Tier.SSD
    assert all(cache.tier_of(key) == expected_tier for key in first.keys)
    assert torch.allclose(result.logits, prefill(dram_cache(4), PROMPT, block=4).logits, **TOLERANCE)
    assert_like_the_model(result, PROMPT)
    assert_nothing_held(cache, result.keys)
    cache.close()


def test_store_off_computes_without_touching_the_cache() -> None:
    """With `store=False` the result is the same and the cache stays empty."""
    cache = dram_cache(4)
    result = prefill(cache, PROMPT, block=4, store=False)
    assert result.stored_keys == () and len(cache) == 0
    assert_like_the_model(result, PROMPT)


def test_the_first_token_is_drawn_by_the_requests_sampler() -> None:
    """With a temperature, the first token is the request's seeded draw from the last logits."""
    params = SamplingParams(temperature=0.8, seed=5)
    with PrefillEngine(tiny_model(), dram_cache(4), hasher(4)) as engine:
        result = engine.prefill(PROMPT, sampling=params)
    assert result.first_token == Sampler(params).next_token(result.logits)


# --------------------------------------------------------------------------- the sink


class RecordingSink:
    """Records the calls and, at each `layer_ready(l)`, copies layer l of every block from the DRAM pages."""

    def __init__(self, cache: TieredCache, block: int, num_tokens: int) -> None:
        self.cache, self.layout, self.num_tokens = cache, layout(block), num_tokens
        self.calls: list[object] = []
        self.keys: tuple[BlockKey, ...] = ()
        self.snapshots: dict[int, list[bytes]] = {}

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        self.calls.append("begin")
        self.keys = keys

    def layer_ready(self, layer: int) -> None:
        self.calls.append(layer)
        self.snapshots[layer] = [self._layer_bytes(i, key, layer) for i, key in enumerate(self.keys)]

    def end(self) -> None:
        self.calls.append("end")

    def abort(self) -> None:
        pass  # a `KvSink` has one (the engine refuses a sink without it); nothing was sent to drop

    def _layer_bytes(self, index: int, key: BlockKey, layer: int) -> bytes:
        location = self.cache.location(key)
        assert location is not None and location.tier == Tier.DRAM
        size = self.layout.layer_bytes(
            min(self.layout.block_tokens, self.num_tokens - index * self.layout.block_tokens)
        )
        start = location.page * self.cache.page_bytes + layer * size
        return bytes(self.cache.pools[0].buffer[start : start + size])  # type: ignore[attr-defined]


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("chunk", [3, 4096])
def test_the_sink_hears_each_layer_once_in_order_after_its_bytes_are_final(layerwise: bool, chunk: int) -> None:
    """begin(keys), layer_ready(0 … L-1), end(); at layer_ready(l) layer l of every block (prefix included)
    already holds its final bytes."""
    cache = dram_cache(4)
    prefill(cache, PROMPT[:9], block=4)
    sink = RecordingSink(cache, 4, len(PROMPT))
    with PrefillEngine(
        tiny_model(), cache, hasher(4), PrefillConfig(chunk_tokens=chunk, layerwise=layerwise)
    ) as engine:
        result = engine.prefill(PROMPT, sink=sink)
    assert sink.calls == ["begin", *range(TINY.num_layers), "end"]
    assert sink.keys == result.keys and result.prefix_tokens == 8
    for layer, snapshot in sink.snapshots.items():
        assert snapshot == [sink._layer_bytes(i, key, layer) for i, key in enumerate(result.keys)]


class FailingSink(RecordingSink):
    def __init__(self, cache: TieredCache, fail_at: object) -> None:
        super().__init__(cache, 4, len(PROMPT))
        self.fail_at = fail_at

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        super().begin(keys)
        self._maybe_fail("begin")

    def layer_ready(self, layer: int) -> None:
        self.calls.append(layer)
        self._maybe_fail(layer)

    def end(self) -> None:
        super().end()
        self._maybe_fail("end")

    def _maybe_fail(self, call: object) -> None:
        if call == self.fail_at:
            raise ConnectionError(f"the decode node went away at {call}")


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("fail_at", ["begin", 0, 1, "end"])
def test_a_failing_sink_leaves_no_pin_no_reservation_and_no_helper_running(layerwise: bool, fail_at: object) -> None:
    """The sink's error reaches the caller; the prefix is unpinned, reserved pages are given back (unless the
    blocks were already committed, before end()), and nothing of the prefill runs after it returned."""
    cache = dram_cache(4)
    prefix = prefill(cache, PROMPT[:9], block=4)
    sink = FailingSink(cache, fail_at)
    engine = PrefillEngine(tiny_model(), cache, hasher(4), PrefillConfig(chunk_tokens=5, layerwise=layerwise))
    with pytest.raises(ConnectionError):
        engine.prefill(PROMPT, sink=sink)
    calls_when_raised = list(sink.calls)
    engine.close()  # waits for the helper threads
    assert sink.calls == calls_when_raised
    keys = hasher(4).block_keys(PROMPT)
    committed = fail_at == "end"
    assert all((key in cache) == committed for key in keys[2:])
    assert all(key in cache for key in prefix.keys)
    assert_nothing_held(cache, keys + prefix.keys)


class DyingMessengerSink(MessengerSink):
    """Streams its first layer, then the prefill fails (the sink stands in for any error after begin)."""

    def layer_ready(self, layer: int) -> None:
        super().layer_ready(layer)
        raise ConnectionError("the prefill failed mid-stream")


def test_a_prefill_failing_mid_stream_releases_the_pins_of_its_push() -> None:
    """After a prefill that fails while streaming, the prefill node holds no pin for the stream and the
    decode node neither commits nor keeps a reservation of any block of it."""
    with tcp_nodes(4) as (prefill_node, decode_node, peer):
        with PrefillEngine(tiny_model(), prefill_node.cache, hasher(4)) as engine:
            prefix = engine.prefill(PROMPT[:9])
            with pytest.raises(ConnectionError):
                engine.prefill(
                    PROMPT, sink=DyingMessengerSink(prefill_node.messenger, peer, num_layers=TINY.num_layers)
                )
        assert_nothing_held(prefill_node.cache, prefix.keys)
        assert all(decode_node.cache.location(key) is None for key in hasher(4).block_keys(PROMPT))


class AbortingSink(RecordingSink):
    def abort(self) -> None:
        self.calls.append("abort")


@PREFILL_SETTINGS
@given(st.integers(min_value=1, max_value=8), st.sampled_from([1, 2, 3, 5]), st.booleans())
def test_a_cancelled_prefill_stops_before_its_next_chunk_and_keeps_nothing(
    asks: int, chunk: int, layerwise: bool
) -> None:
    """The flag is read once before each chunk; True stops the prefill there (`Cancelled`): no later chunk runs,
    the sink is aborted, no new block is cached, the prefix stays cached and unpinned, and the engine's next
    prefill of the same prompt is the model's. A flag that turns True only after the last chunk changes nothing."""
    cache = dram_cache(4)
    prefix = prefill(cache, PROMPT[:9], block=4)  # 8 tokens cached: 15 to compute
    passes = -(-(len(PROMPT) - 8) // chunk)
    flag, sink = CancelAfter(asks), AbortingSink(cache, 4, len(PROMPT))
    with PrefillEngine(
        tiny_model(), cache, hasher(4), PrefillConfig(chunk_tokens=chunk, layerwise=layerwise)
    ) as engine:
        if asks <= passes:
            with pytest.raises(Cancelled, match=f"with {8 + (asks - 1) * chunk} of its 23 prompt tokens"):
                engine.prefill(PROMPT, sink=sink, cancelled=flag)
            assert flag.read == asks and sink.calls[0] == "begin" and sink.calls[-1] == "abort"
            keys = hasher(4).block_keys(PROMPT)
            assert [key in cache for key in keys] == [True, True] + [False] * (len(keys) - 2)
            assert_like_the_model(engine.prefill(PROMPT), PROMPT)
        else:
            result = engine.prefill(PROMPT, sink=sink, cancelled=flag)
            assert flag.read == passes and sink.calls == ["begin", *range(TINY.num_layers), "end"]
            assert_like_the_model(result, PROMPT)
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT) + prefix.keys)


def test_any_forward_pass_is_handed_the_flag() -> None:
    """A forward pass that is not a `ModelForward` (a pipeline group's) gets the flag to ask before its chunks:
    True before the first stores nothing; one that turns True after the last chunk changes nothing."""
    forward = OtherForward()
    cache = dram_cache(4)
    with PrefillEngine(forward, cache, hasher(4)) as engine:
        with pytest.raises(Cancelled, match="with 0 of its 23 prompt tokens"):
            engine.prefill(PROMPT, cancelled=lambda: True)
        assert forward.runs == 1 and len(cache) == 0
        assert_like_the_model(engine.prefill(PROMPT, cancelled=CancelAfter(2)), PROMPT)  # one chunk: asked once
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT))


def test_a_prefill_cancelled_mid_stream_leaves_nothing_on_the_decode_node() -> None:
    """The push to the decode node began; cancelled before the second chunk, it is aborted there: the decode node
    neither commits nor keeps a reservation of any block, and the prefill node holds no pin."""
    with tcp_nodes(4) as (prefill_node, decode_node, peer):
        with PrefillEngine(tiny_model(), prefill_node.cache, hasher(4), PrefillConfig(chunk_tokens=5)) as engine:
            sink = MessengerSink(prefill_node.messenger, peer, num_layers=TINY.num_layers)
            with pytest.raises(Cancelled):
                engine.prefill(PROMPT, sink=sink, cancelled=CancelAfter(2))
        assert_nothing_held(prefill_node.cache, hasher(4).block_keys(PROMPT))
        assert all(decode_node.cache.location(key) is None for key in hasher(4).block_keys(PROMPT))


# --------------------------------------------------------------------------- batches


@PREFILL_SETTINGS
@given(prompts, st.lists(prompts, min_size=1, max_size=4), block_sizes, chunk_sizes, st.booleans())
def test_a_batch_gives_each_prompt_what_prefilling_it_alone_gives(
    cached: list[int], batch: list[list[int]], block: int, chunk: int, layerwise: bool
) -> None:
    """Packed into shared passes (pieces split across passes when `chunk` is small), each prompt gets the
    logits, token and cached prefix of a prefill of it alone over the cache as it was before the batch;
    every new block of every prompt is stored once, with the KV a prompt-alone prefill stores."""
    batch = [cached[: len(cached) // 2] + tail for tail in batch]  # some share the cached prefix
    cache = dram_cache(block, pages=256)
    prefill(cache, cached, block=block)
    before = set(hasher(block).block_keys(cached))
    with PrefillEngine(
        tiny_model(), cache, hasher(block), PrefillConfig(chunk_tokens=chunk, layerwise=layerwise)
    ) as engine:
        results = engine.prefill_batch(batch)
    assert len(results) == len(batch)
    for tokens, result in zip(batch, results, strict=True):
        alone_cache = dram_cache(block, pages=256)
        prefill(alone_cache, cached, block=block)
        alone = prefill(alone_cache, tokens, block=block)
        assert torch.allclose(result.logits, alone.logits, **TOLERANCE)
        assert result.first_token == alone.first_token
        assert (result.keys, result.prefix_tokens) == (alone.keys, alone.prefix_tokens)
        for key in alone.stored_keys:
            assert np.allclose(
                as_floats([page_bytes(cache, key)]), as_floats([page_bytes(alone_cache, key)]), atol=1e-5
            )
    stored = [key for result in results for key in result.stored_keys]
    assert len(stored) == len(set(stored))  # a block two prompts share is written by one of them
    assert set(stored) == {key for result in results for key in result.keys} - before
    assert_nothing_held(cache, tuple(before) + tuple(stored))


def test_each_prompt_of_a_batch_streams_to_its_own_sink() -> None:
    """One sink per prompt: begin, every layer in order, end; None streams nothing."""
    cache = dram_cache(4)
    prefill(cache, PROMPT[:9], block=4)
    second = PROMPT[:5] + PROMPT[::-1]
    sinks = [RecordingSink(cache, 4, len(PROMPT)), None, RecordingSink(cache, 4, len(second))]
    with PrefillEngine(tiny_model(), cache, hasher(4), PrefillConfig(chunk_tokens=7)) as engine:
        results = engine.prefill_batch([PROMPT, PROMPT[:3], second], sinks=sinks)
    for sink, result in zip((sinks[0], sinks[2]), (results[0], results[2]), strict=True):
        assert sink is not None and sink.calls == ["begin", *range(TINY.num_layers), "end"]
        assert sink.keys == result.keys
    assert_like_the_model(results[1], PROMPT[:3])


class OtherForward:
    """A `ForwardPass` that is not a `ModelForward` (as a pipeline group's is): it cannot pack prompts."""

    def __init__(self) -> None:
        self.inner = ModelForward(tiny_model(), chunk_tokens=4096)
        self.model_config, self.dtype, self.device = TINY, self.inner.model.dtype, self.inner.model.device
        self.runs = 0

    def run(self, ids: torch.Tensor, kv: KvBuffers, io: Any, *, cancelled: Any = None) -> torch.Tensor:
        self.runs += 1
        return self.inner.run(ids, kv, io, cancelled=cancelled)


def test_a_forward_pass_that_cannot_pack_runs_the_batch_one_prompt_at_a_time() -> None:
    forward = OtherForward()
    batch = [PROMPT, PROMPT[:5], PROMPT[3:]]
    with PrefillEngine(forward, dram_cache(4), hasher(4)) as engine:
        results = engine.prefill_batch(batch)
    assert forward.runs == 3
    for tokens, result in zip(batch, results, strict=True):
        assert_like_the_model(result, tokens)


def test_a_batch_that_fails_holds_nothing_and_stores_nothing() -> None:
    """An invalid prompt anywhere refuses the batch before anything is held; a full cache while reserving a
    later prompt's pages gives back the earlier prompts' pins and reservations too."""
    cache = dram_cache(4, pages=5)
    prefix = prefill(cache, PROMPT[:8], block=4)
    with PrefillEngine(tiny_model(), cache, hasher(4)) as engine:
        with pytest.raises(InvalidRequestError):
            engine.prefill_batch([PROMPT[:12], [TINY.vocab_size]])
        with pytest.raises(InvalidRequestError):
            engine.prefill_batch([PROMPT[:12]], sinks=[None, None])
        assert len(cache) == 2
        with pytest.raises(CapacityError):
            engine.prefill_batch([PROMPT[:12], PROMPT[::-1]])  # 1 + 6 new blocks in 3 free pages
        assert len(cache) == 2 and cache.pools[0].num_free == 3
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT) + prefix.keys)


@pytest.mark.parametrize("packs", [True, False], ids=["ModelForward", "one-at-a-time"])
def test_a_bad_prompt_anywhere_in_a_batch_runs_and_commits_nothing(packs: bool) -> None:
    """Every prompt is checked before any runs, whatever the forward pass: one that takes the prompts one at a
    time (a pipeline group's) once prefilled, committed and streamed the good prompts before the bad last one
    raised. The error names the bad id and its position."""
    forward: Any = ModelForward(tiny_model(), chunk_tokens=4096) if packs else OtherForward()
    cache = dram_cache(4)
    sink = RecordingSink(cache, 4, len(PROMPT))
    with PrefillEngine(forward, cache, hasher(4)) as engine:
        with pytest.raises(InvalidRequestError, match=f"got {TINY.vocab_size} at position 2"):
            engine.prefill_batch([PROMPT, [1, 2, TINY.vocab_size, 3]], sinks=[sink, None])
        assert len(cache) == 0 and sink.calls == []
        assert packs or forward.runs == 0
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT))


class NanForward(OtherForward):
    """A forward pass whose model fails numerically: its last logits hold a NaN (its KV would be NaN too)."""

    def run(self, ids: torch.Tensor, kv: KvBuffers, io: Any, *, cancelled: Any = None) -> torch.Tensor:
        logits = super().run(ids, kv, io, cancelled=cancelled).clone()
        logits[7] = math.nan
        return logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_the_prefill_before_anything_is_committed(temperature: float) -> None:
    """A NaN among the last logits is an EngineError naming the token (greedy's argmax once returned the NaN's
    token, sampling the vocabulary's size, an id outside it): raised before the blocks commit or the stream
    ends, so no block of the failed model's KV is left in the cache and the sink aborts."""
    cache = dram_cache(4)
    sink = AbortingSink(cache, 4, len(PROMPT))
    params = SamplingParams(temperature=temperature, seed=1)
    with (
        PrefillEngine(NanForward(), cache, hasher(4)) as engine,
        pytest.raises(EngineError, match=r"NaN at tokens \[7\]"),
    ):
        engine.prefill(PROMPT, sampling=params, sink=sink)
    assert len(cache) == 0 and sink.calls[-1] == "abort"
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT))


def test_a_bias_or_a_repetition_penalty_that_overflows_still_draws_a_token_of_the_vocabulary() -> None:
    """A logit bias of 1e39 (past float32's range: clamped to 100, as vLLM clamps it) makes its token the first;
    a repetition penalty of 1e-40 (its quotient overflows to +inf) draws one of the prompt's tokens."""
    with PrefillEngine(tiny_model(), dram_cache(4), hasher(4)) as engine:
        biased = engine.prefill(PROMPT[:5], sampling=SamplingParams(temperature=1.0, seed=0, logit_bias={7: 1e39}))
        assert biased.first_token == 7
        tiny = SamplingParams(temperature=1.0, seed=0, repetition_penalty=1e-40)
        assert engine.prefill(PROMPT[:5], sampling=tiny).first_token in PROMPT[:5]


# --------------------------------------------------------------------------- prompt log-probabilities


@PREFILL_SETTINGS
@given(prompts, prompts, block_sizes, chunk_sizes, st.integers(min_value=0, max_value=4))
def test_prompt_logprobs_score_each_token_by_the_models_logits_before_it(
    cached: list[int], tokens: list[int], block: int, chunk: int, k: int
) -> None:
    """With `prompt_logprobs: k` (in a batch beside an unscored prompt sharing a cached prefix, in passes of
    `chunk` tokens): entry j scores prompt token j + 1 under the model's logits at position j, within float
    tolerance, with the k most probable; the whole prompt is computed (no prefix reused, though
    one is cached) and the last logits and first token are a plain prefill's. The other prompt is unchanged."""
    tokens = cached[: len(cached) // 2] + tokens
    cache = dram_cache(block, pages=256)
    prefill(cache, cached, block=block)
    scored = SamplingParams(prompt_logprobs=k)
    with PrefillEngine(tiny_model(), cache, hasher(block), PrefillConfig(chunk_tokens=chunk)) as engine:
        result, other = engine.prefill_batch([tokens, cached], sampling=[scored, None])
    assert (result.prefix_tokens, result.computed_tokens) == (0, len(tokens))
    assert_like_the_model(result, tokens)
    assert_like_the_model(other, cached)
    assert other.prompt_logprobs is None
    reference = torch.log_softmax(reference_logits(tokens), dim=-1)
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(tokens) - 1
    for position, entry in enumerate(result.prompt_logprobs):
        row, token = reference[position], tokens[position + 1]
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4)
        assert len(entry.top) == min(k, TINY.vocab_size)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        if k:
            assert math.isclose(entry.top[0][1], float(row.max()), abs_tol=1e-4)


def test_prompt_logprobs_need_a_forward_pass_that_keeps_every_position() -> None:
    """A forward pass that returns the last position's logits only (a pipeline group's) refuses a scored
    prompt before anything is held, naming why."""
    cache = dram_cache(4)
    refused = pytest.raises(InvalidRequestError, match="prompt log-probabilities need the whole model")
    with PrefillEngine(OtherForward(), cache, hasher(4)) as engine, refused:
        engine.prefill(PROMPT, sampling=SamplingParams(prompt_logprobs=1))
    assert len(cache) == 0


# --------------------------------------------------------------------------- error contracts


@pytest.mark.parametrize(
    "tokens", [[], [0, TINY.vocab_size], [-1, 3], [1, 2, 10**9], [1.7, 2.2, 3.9], [True, False], "abc"]
)
def test_invalid_prompts_are_refused_before_anything_is_held(tokens: list[int]) -> None:
    """No tokens, ids outside the vocabulary, or anything but integers (floats are not truncated, bools are not
    ids): InvalidRequestError, and the cache is untouched."""
    cache = dram_cache(4)
    prefill(cache, PROMPT[:8], block=4)
    with PrefillEngine(tiny_model(), cache, hasher(4)) as engine, pytest.raises(InvalidRequestError):
        engine.prefill(tokens)
    assert len(cache) == 2
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT[:8]))


def test_a_cache_too_small_for_the_new_blocks_gives_back_what_was_reserved() -> None:
    """CapacityError when DRAM cannot hold the new blocks while the prefix is pinned; the prefix pins and
    the pages reserved before the failure are released, and the engine works afterwards."""
    cache = dram_cache(4, pages=4)
    prefix = prefill(cache, PROMPT[:8], block=4)
    with PrefillEngine(tiny_model(), cache, hasher(4)) as engine:
        with pytest.raises(CapacityError):
            engine.prefill(PROMPT)  # 2 cached + 4 new blocks in 4 pages
        assert len(cache) == 2 and cache.pools[0].num_free == 2
        assert_like_the_model(engine.prefill(PROMPT[:12]), PROMPT[:12])
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT) + prefix.keys)


def test_engine_configuration_is_checked() -> None:
    """A pipeline stage, pages smaller than a KV block, and chunks of 0 tokens are ConfigErrors."""
    with pytest.raises(ConfigError, match="whole model"):
        PrefillEngine(LlamaModel(TINY, layers=[0]), dram_cache(4), hasher(4))
    with pytest.raises(ConfigError, match="cannot hold"):
        PrefillEngine(tiny_model(), dram_cache(2), hasher(4))
    with pytest.raises(ConfigError):
        PrefillConfig(chunk_tokens=0)


def test_concurrent_readers_do_not_disturb_a_prefill() -> None:
    """The cache may be read by other threads during a prefill (a messenger serving peers): same result."""
    cache = dram_cache(4)
    prefix = prefill(cache, PROMPT[:12], block=4)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for key in prefix.keys:
                with cache.pinned(key) as data:
                    assert data is not None

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        results = [prefill(cache, PROMPT, block=4) for _ in range(3)]
    finally:
        stop.set()
        thread.join()
    for result in results:
        assert_like_the_model(result, PROMPT)
    assert_nothing_held(cache, results[0].keys)


class PlainForward(OtherForward):
    """A `ForwardPass` written before the flag existed: `run` takes no `cancelled`."""

    def run(self, ids: torch.Tensor, kv: KvBuffers, io: Any) -> torch.Tensor:  # type: ignore[override]
        self.runs += 1
        return self.inner.run(ids, kv, io)


def test_a_forward_pass_without_the_flag_is_cancelled_before_it_runs_only() -> None:
    forward = PlainForward()
    cache = dram_cache(4)
    with PrefillEngine(forward, cache, hasher(4)) as engine:
        with pytest.raises(Cancelled, match="before its forward pass started"):
            engine.prefill(PROMPT, cancelled=lambda: True)
        assert forward.runs == 0 and len(cache) == 0
        flag = CancelAfter(2)
        assert_like_the_model(engine.prefill(PROMPT, cancelled=flag), PROMPT)
        assert flag.read == 1  # asked once, before the run
    assert_nothing_held(cache, hasher(4).block_keys(PROMPT))
