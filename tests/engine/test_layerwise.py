"""Tests for `mooncake.engine.layerwise.LayerwiseKvIo`: the loads and stores of one prefill.

The object is driven as the prefill engine drives it, with a stand-in for the
compute that writes each chunk's K and V rows into the buffers. Property, the
two modes in lockstep against a reference: layer-wise and serialized load the
same prefix rows (layer l's rows are in place when `wait_for_prefix(l)`
returns) and leave the same page bytes, the reference pages built through
`KvLayout.layer_kv`; the listener hears every layer once, in order, after its
bytes are final; the invariants hold after every call. Examples: a prefix block
that fails to load, and a failing listener, raise to the caller, and after
`abort()` no task submitted to the helper threads is left to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.cache.tiered import TieredCache
from mooncake.engine.kv import KvLayout
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.errors import IntegrityError
from mooncake.types import BlockKey
from tests.engine.support import TINY, block_sizes, dram_cache, layout

NUM_LAYERS, ROW_SHAPE = TINY.num_layers, (TINY.num_kv_heads, TINY.head_dim)
P = ParamSpec("P")
T = TypeVar("T")


class TrackingExecutor(ThreadPoolExecutor):
    """One worker, like the engine's helpers, remembering every future it handed out."""

    def __init__(self) -> None:
        super().__init__(1)
        self.futures: list[Future[Any]] = []

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


@contextlib.contextmanager
def helpers() -> Iterator[tuple[TrackingExecutor, TrackingExecutor]]:
    loader, storer = TrackingExecutor(), TrackingExecutor()
    try:
        yield loader, storer
    finally:
        loader.shutdown()
        storer.shutdown()


@attrs.define
class Case:
    """A prefill's I/O: `prefix_blocks` cached blocks, then `new_tokens` tokens computed in `chunk`-token chunks."""

    block: int
    prefix_blocks: int
    new_tokens: int
    chunk: int
    seed: int

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_blocks * self.block

    @property
    def num_tokens(self) -> int:
        return self.prefix_tokens + self.new_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block)

    @property
    def layout(self) -> KvLayout:
        return layout(self.block)

    def rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V of every token per layer, as the compute would produce them (the prefix's too)."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.num_tokens, *ROW_SHAPE)
        ks = [torch.randn(shape, generator=generator) for _ in range(NUM_LAYERS)]
        vs = [torch.randn(shape, generator=generator) for _ in range(NUM_LAYERS)]
        return ks, vs

    def tokens_of(self, block: int) -> int:
        return min(self.block, self.num_tokens - block * self.block)

    def reference_page(self, block: int) -> bytes:
        """Block `block`'s page written directly through `KvLayout.layer_kv`."""
        ks, vs = self.rows()
        page = bytearray(self.layout.block_bytes(self.tokens_of(block)))
        rows = slice(block * self.block, block * self.block + self.tokens_of(block))
        for layer in range(NUM_LAYERS):
            k_page, v_page = self.layout.layer_kv(page, layer)
            k_page.copy_(ks[layer][rows])
            v_page.copy_(vs[layer][rows])
        return bytes(page)

    def cache_with_prefix(self) -> tuple[TieredCache, tuple[BlockKey, ...]]:
        cache = dram_cache(self.block)
        keys = tuple(BlockKey(1000 + b) for b in range(self.prefix_blocks))
        for b, key in enumerate(keys):
            cache.put(key, self.reference_page(b))
        return cache, keys

    def new_pages(self) -> list[bytearray]:
        return [
            bytearray(self.layout.block_bytes(self.tokens_of(b))) for b in range(self.prefix_blocks, self.num_blocks)
        ]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return Case(
        block=draw(block_sizes),
        prefix_blocks=draw(st.integers(min_value=0, max_value=3)),
        new_tokens=draw(st.integers(min_value=1, max_value=10)),
        chunk=draw(st.sampled_from([1, 2, 3, 5, 4096])),
        seed=draw(st.integers(min_value=0, max_value=2**16)),
    )


@attrs.define
class Outcome:
    buffers: list[bytes]
    pages: list[bytes]
    heard: list[int]
    loads: int
    stores: int


def new_io(
    case: Case,
    cache: TieredCache,
    prefix_keys: tuple[BlockKey, ...],
    threads: tuple[TrackingExecutor, TrackingExecutor],
    *,
    pages: Sequence[bytearray | None],
    on_layer_final: Callable[[int], None] | None,
    layerwise: bool,
) -> tuple[LayerwiseKvIo, list[torch.Tensor], list[torch.Tensor]]:
    """The I/O object over fresh NaN-filled buffers (a row nobody wrote shows); call it in inference mode."""
    shape = (case.num_tokens, *ROW_SHAPE)
    k_all = [torch.full(shape, float("nan")) for _ in range(NUM_LAYERS)]
    v_all = [torch.full(shape, float("nan")) for _ in range(NUM_LAYERS)]
    io = LayerwiseKvIo(
        cache=cache,
        layout=case.layout,
        k_buffers=k_all,
        v_buffers=v_all,
        prefix_keys=prefix_keys,
        pages=pages,
        on_layer_final=on_layer_final,
        layerwise=layerwise,
        loader=threads[0],
        storer=threads[1],
    )
    return io, k_all, v_all


def drive(case: Case, *, layerwise: bool) -> Outcome:
    """Run the prefill's loop with a stand-in compute; check what each step promises as it goes."""
    ks, vs = case.rows()
    cache, prefix_keys = case.cache_with_prefix()
    pages = case.new_pages()
    heard: list[int] = []
    prefix_rows = slice(0, case.prefix_tokens)

    def on_layer_final(layer: int) -> None:  # every page holds layer l's final bytes by now
        for offset, page in enumerate(pages):
            b = case.prefix_blocks + offset
            rows = slice(b * case.block, b * case.block + case.tokens_of(b))
            k_page, v_page = case.layout.layer_kv(page, layer)
            assert torch.equal(k_page, ks[layer][rows]) and torch.equal(v_page, vs[layer][rows])
        heard.append(layer)

    with helpers() as (loader, storer), torch.inference_mode():
        io, k_all, v_all = new_io(
            case, cache, prefix_keys, (loader, storer), pages=pages, on_layer_final=on_layer_final, layerwise=layerwise
        )
        assert io.prefix_tokens == case.prefix_tokens
        io.start_loading()
        io.check_invariants()
        for start in range(case.prefix_tokens, case.num_tokens, case.chunk):
            end = min(case.num_tokens, start + case.chunk)
            for layer in range(NUM_LAYERS):
                io.wait_for_prefix(layer)
                io.check_invariants()
                assert torch.equal(k_all[layer][prefix_rows], ks[layer][prefix_rows])
                assert torch.equal(v_all[layer][prefix_rows], vs[layer][prefix_rows])
                k_all[layer][start:end] = ks[layer][start:end]  # the layer's attention writes its new rows
                v_all[layer][start:end] = vs[layer][start:end]
                io.store(layer, start, end)
                io.check_invariants()
        io.finish()
        io.check_invariants()
        assert all(future.done() for future in loader.futures + storer.futures)
        assert io.load_wait_s >= 0 and io.store_wait_s >= 0
        buffers = [bytes(t.numpy().tobytes()) for t in k_all + v_all]
    cache.close()
    return Outcome(buffers, [bytes(page) for page in pages], heard, len(loader.futures), len(storer.futures))


# --------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(cases())
def test_layerwise_and_serialized_load_and_store_the_same_bytes(case: Case) -> None:
    """Both modes fill the buffers with the prefix and the computed rows and leave the reference pages; the
    listener hears each layer once, in order; only layer-wise uses the helper threads: one load per layer,
    one store per chunk and layer, one listener call per layer."""
    overlapped, serialized = drive(case, layerwise=True), drive(case, layerwise=False)
    ks, vs = case.rows()
    assert overlapped.buffers == serialized.buffers == [t.numpy().tobytes() for t in ks + vs]
    expected = [case.reference_page(b) for b in range(case.prefix_blocks, case.num_blocks)]
    assert overlapped.pages == serialized.pages == expected
    assert overlapped.heard == serialized.heard == list(range(NUM_LAYERS))
    assert (serialized.loads, serialized.stores) == (0, 0)
    assert overlapped.loads == (NUM_LAYERS if case.prefix_blocks else 0)
    num_chunks = len(range(case.prefix_tokens, case.num_tokens, case.chunk))
    assert overlapped.stores == num_chunks * NUM_LAYERS + NUM_LAYERS


@settings(max_examples=10, deadline=None)
@given(cases())
def test_without_pages_or_listener_nothing_is_stored(case: Case) -> None:
    """No page to fill and nobody listening: no store is queued or deferred, and the prefix still loads."""
    ks, _vs = case.rows()
    cache, prefix_keys = case.cache_with_prefix()
    with helpers() as (loader, storer), torch.inference_mode():
        pages = [None] * len(case.new_pages())
        io, k_all, _v = new_io(
            case, cache, prefix_keys, (loader, storer), pages=pages, on_layer_final=None, layerwise=True
        )
        io.start_loading()
        for layer in range(NUM_LAYERS):
            io.wait_for_prefix(layer)
            io.store(layer, case.prefix_tokens, case.num_tokens)
        io.finish()
        io.check_invariants()
        assert storer.futures == []
        assert all(torch.equal(k[: case.prefix_tokens], ks[i][: case.prefix_tokens]) for i, k in enumerate(k_all))
    cache.close()


# --------------------------------------------------------------------------- failures


def test_a_prefix_block_that_fails_to_load_raises_and_abort_leaves_nothing_running() -> None:
    """A prefix block missing from the cache is an IntegrityError at the wait for layer 0; after `abort()`
    every task given to the helpers has finished."""
    case = Case(block=4, prefix_blocks=2, new_tokens=3, chunk=4096, seed=1)
    cache = dram_cache(4)
    with helpers() as (loader, storer), torch.inference_mode():
        missing = (BlockKey(1), BlockKey(2))
        io, _k, _v = new_io(
            case, cache, missing, (loader, storer), pages=case.new_pages(), on_layer_final=None, layerwise=True
        )
        io.start_loading()
        with pytest.raises(IntegrityError, match="prefix block"):
            io.wait_for_prefix(0)
        io.abort()
        assert loader.futures and all(future.done() for future in loader.futures)
    cache.close()


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("short", [1, 2, 3])
def test_a_prefix_page_shorter_than_a_block_is_an_integrity_error_naming_it(short: int, layerwise: bool) -> None:
    """A pinned prefix block whose page holds fewer than `block` tokens (a peer pushed it so; its checksum is
    fine): an IntegrityError naming the block and its token count, for every layer's load, not a 1-token page
    broadcast over the block's rows (wrong KV, no error) nor torch's bare RuntimeError for 2..block - 1 tokens."""
    case = Case(block=4, prefix_blocks=2, new_tokens=3, chunk=4096, seed=6)
    cache, prefix_keys = dram_cache(case.block), (BlockKey(1000), BlockKey(1001))
    cache.put(prefix_keys[0], case.reference_page(0))
    cache.put(prefix_keys[1], case.reference_page(1)[: case.layout.block_bytes(short)])
    message = rf"prefix block {prefix_keys[1]}'s page holds {short} of a block's 4 tokens"
    with helpers() as threads, torch.inference_mode():
        io, _k, _v = new_io(
            case, cache, prefix_keys, threads, pages=case.new_pages(), on_layer_final=None, layerwise=layerwise
        )
        if layerwise:
            io.start_loading()
            for layer in range(NUM_LAYERS):  # the next layer's load, queued before the wait, fails too
                with pytest.raises(IntegrityError, match=message):
                    io.wait_for_prefix(layer)
        else:
            with pytest.raises(IntegrityError, match=message):
                io.start_loading()
        io.abort()
    cache.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_failing_listener_raises_from_finish_and_abort_leaves_nothing_running(layerwise: bool) -> None:
    """The listener's error reaches the caller at `finish()`; after `abort()` no store or call is left to run,
    so the caller can give the pages back."""
    case = Case(block=4, prefix_blocks=1, new_tokens=9, chunk=3, seed=2)
    cache, prefix_keys = case.cache_with_prefix()
    heard: list[int] = []

    def on_layer_final(layer: int) -> None:
        heard.append(layer)
        raise ConnectionError(f"the decode node went away at layer {layer}")

    with helpers() as (loader, storer), torch.inference_mode():
        pages = case.new_pages()
        io, _k, _v = new_io(
            case, cache, prefix_keys, (loader, storer), pages=pages, on_layer_final=on_layer_final, layerwise=layerwise
        )
        io.start_loading()
        for start in range(case.prefix_tokens, case.num_tokens, case.chunk):
            for layer in range(NUM_LAYERS):
                io.wait_for_prefix(layer)
                io.store(layer, start, min(case.num_tokens, start + case.chunk))
        with pytest.raises(ConnectionError, match="layer 0"):
            io.finish()
        io.abort()
        assert all(future.done() for future in loader.futures + storer.futures)
        assert heard == [0]  # in both modes nothing runs after the first failure (layer-wise: queued tasks skip)
    cache.close()


def test_a_read_that_fails_midway_leaves_no_later_layer_a_partial_prefix() -> None:
    """The second prefix block's read raises once (an SSD read error): the wait for layer 0 raises it, and the
    load of layer 1, queued before that wait, reads the prefix again rather than copying the one block it had read:
    a load reports success only with every prefix row in place."""
    case = Case(block=4, prefix_blocks=2, new_tokens=3, chunk=4096, seed=5)
    ks, vs = case.rows()
    cache, prefix_keys = case.cache_with_prefix()
    gets = []

    def get(key: BlockKey) -> Any:
        gets.append(key)
        if len(gets) == 2:
            raise OSError("reading the second prefix block failed")
        return real_get(key)

    real_get, cache.get = cache.get, get  # type: ignore[method-assign]
    with helpers() as threads, torch.inference_mode():
        io, k_all, v_all = new_io(
            case, cache, prefix_keys, threads, pages=case.new_pages(), on_layer_final=None, layerwise=True
        )
        io.start_loading()
        with pytest.raises(OSError, match="second prefix block"):
            io.wait_for_prefix(0)
        io.wait_for_prefix(1)
        rows = slice(0, case.prefix_tokens)
        assert torch.equal(k_all[1][rows], ks[1][rows]) and torch.equal(v_all[1][rows], vs[1][rows])
        io.abort()
    cache.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_an_empty_chunk_stores_nothing_and_finalizes_no_layer_twice(layerwise: bool) -> None:
    """A caller that reports an empty range [n, n) after the last chunk: nothing is queued for it, and the
    listener still hears each layer exactly once."""
    case = Case(block=4, prefix_blocks=0, new_tokens=6, chunk=4096, seed=3)
    cache, prefix_keys = case.cache_with_prefix()
    heard: list[int] = []
    with helpers() as (loader, storer), torch.inference_mode():
        io, _k, _v = new_io(
            case,
            cache,
            prefix_keys,
            (loader, storer),
            pages=case.new_pages(),
            on_layer_final=heard.append,
            layerwise=layerwise,
        )
        io.start_loading()
        for layer in range(NUM_LAYERS):
            io.wait_for_prefix(layer)
            io.store(layer, 0, case.num_tokens)
            io.store(layer, case.num_tokens, case.num_tokens)
        io.finish()
        assert heard == list(range(NUM_LAYERS))
        assert len(storer.futures) == (2 * NUM_LAYERS if layerwise else 0)
    cache.close()
