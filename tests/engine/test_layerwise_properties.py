"""Properties of `LayerwiseKvIo` over random geometries, chunkings and faults, against a byte-level reference.

`test_layerwise.py` drives the tiny model's two layers in equal chunks with every page ours. Here the model's
shape (layers, KV heads, head dim), the dtype, the block size, the prefix, the chunk boundaries (any cut of
[p, n)), which new blocks are ours to fill (the rest are None), whether anybody listens, and whether a
prefix block comes as a zero-copy view (DRAM) or a read-only copy (a lower tier) are all drawn. Pages are
slices of one arena with canary bytes around them, as a DRAM pool hands them out.

Properties: both modes leave every page of ours holding exactly the reference bytes
`concat over l of K_l[rows] ‖ V_l[rows]` (the page layout written out by hand, not through `KvLayout`),
touch no byte outside those pages, load rows [0, p) of layer l bit-exactly by the time `wait_for_prefix(l)`
returns, never write a cached prefix page, tell the listener each layer once, in order, each when it is
final in every page, and use the helper threads only layer-wise. Faults: a cache read, a layer's load, a
store or the listener raises part-way; the caller sees that very error at the documented step, and once
`abort()` returns every task given to the helpers is done and no page byte changes afterwards (tasks
queued behind the failure are held until `abort()` is waiting, so one it failed to wait for shows).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

import attrs
import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

import tests.engine.support  # noqa: F401  (one torch thread, as in every engine test)
from mooncake.cache.tiered import TieredCache
from mooncake.engine.config import ModelConfig
from mooncake.engine.kv import KvLayout
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.types import BlockKey
from tests.engine.strategies import model_configs

P = ParamSpec("P")
T = TypeVar("T")

CANARY = 0xFF  # NaN in every float dtype: no computed row is ever all 0xFF bytes
GAP_BYTES = 8
# A held task waits this long at most, then it and the rest run: harmless when the caller is fine (its error
# came first; abort() still waits for them), and a caller stuck on a held task fails rather than hangs.
HOLD_TIMEOUT_S = 2.0
ABORT_TIMEOUT_S = 30.0


class InjectedFault(Exception):
    """The error a test double raises on purpose."""


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------- the case


@attrs.frozen
class Case:
    """A prefill: `prefix_blocks` cached blocks, then `new_tokens` computed tokens cut at `cuts`."""

    config: ModelConfig
    dtype: str
    block: int
    prefix_blocks: int
    new_tokens: int
    cuts: tuple[int, ...]  # chunk boundaries strictly inside (p, n), increasing
    ours: tuple[bool, ...]  # per block after the prefix: a page to fill (True) or None
    listening: bool
    read_only: tuple[bool, ...]  # per prefix block: served as a read-only copy (True) or a view
    seed: int

    @property
    def layout(self) -> KvLayout:
        return KvLayout(config=self.config, block_tokens=self.block, dtype=self.dtype)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

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
    def has_output(self) -> bool:
        return any(self.ours) or self.listening

    def chunks(self) -> list[tuple[int, int]]:
        bounds = [self.prefix_tokens, *self.cuts, self.num_tokens]
        return list(itertools.pairwise(bounds))

    def tokens_of(self, b: int) -> int:
        return min(self.block, self.num_tokens - b * self.block)

    def block_rows(self, b: int) -> slice:
        return slice(b * self.block, b * self.block + self.tokens_of(b))

    def rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every token's K and V per layer, as the compute produces them (the prefix's too)."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.num_tokens, self.config.num_kv_heads, self.config.head_dim)
        dtype = self.layout.torch_dtype
        ks = [torch.randn(shape, generator=generator).to(dtype) for _ in range(self.num_layers)]
        vs = [torch.randn(shape, generator=generator).to(dtype) for _ in range(self.num_layers)]
        return ks, vs

    def expected_page(self, b: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> bytes:
        """Block b's page by the documented layout [layer][K, V][token][kv_head][dim], written out by hand."""
        rows = self.block_rows(b)
        return b"".join(raw(ks[layer][rows]) + raw(vs[layer][rows]) for layer in range(self.num_layers))

    def layer_span(self, b: int, layer: int) -> slice:
        """Layer `layer`'s bytes within block b's page: the l-th of num_layers equal parts."""
        c = self.config
        per_layer = 2 * self.tokens_of(b) * c.num_kv_heads * c.head_dim * self.layout.torch_dtype.itemsize
        return slice(layer * per_layer, (layer + 1) * per_layer)


@st.composite
def cases(draw: st.DrawFn, *, listening: bool | None = None) -> Case:
    config = draw(model_configs())
    block = draw(st.integers(min_value=1, max_value=5))
    prefix_blocks = draw(st.integers(min_value=0, max_value=3))
    new_tokens = draw(st.integers(min_value=1, max_value=12))
    p, n = prefix_blocks * block, prefix_blocks * block + new_tokens
    cuts = draw(st.sets(st.integers(min_value=p + 1, max_value=n - 1), max_size=4)) if n - p > 1 else set()
    num_new_blocks = -(-n // block) - prefix_blocks
    return Case(
        config=config,
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        block=block,
        prefix_blocks=prefix_blocks,
        new_tokens=new_tokens,
        cuts=tuple(sorted(cuts)),
        ours=tuple(draw(st.lists(st.booleans(), min_size=num_new_blocks, max_size=num_new_blocks))),
        listening=draw(st.booleans()) if listening is None else listening,
        read_only=tuple(draw(st.lists(st.booleans(), min_size=prefix_blocks, max_size=prefix_blocks))),
        seed=draw(st.integers(min_value=0, max_value=2**16)),
    )


# --------------------------------------------------------------------------- doubles


class Arena:
    """Pages as slices of one bytearray (as a DRAM pool hands them out), canary bytes around each."""

    def __init__(self, sizes: list[int]) -> None:
        self.spans: list[slice] = []
        offset = GAP_BYTES
        for size in sizes:
            self.spans.append(slice(offset, offset + size))
            offset += size + GAP_BYTES
        self.memory = bytearray([CANARY]) * offset

    def page(self, i: int) -> memoryview:
        return memoryview(self.memory)[self.spans[i]]

    def bytes_of(self, i: int) -> bytes:
        return bytes(self.memory[self.spans[i]])

    def outside(self) -> bytes:
        """Every byte of the arena that lies in no page."""
        kept = bytearray(self.memory)
        for span in reversed(self.spans):
            del kept[span]
        return bytes(kept)


class PrefixCache:
    """`TieredCache.get` as the I/O object uses it: a view of a DRAM page, or a read-only copy of a lower
    tier's; the `fail_at`-th get raises."""

    def __init__(self, case: Case, ks: list[torch.Tensor], vs: list[torch.Tensor], fail_at: int | None) -> None:
        self.keys = tuple(BlockKey(7000 + b) for b in range(case.prefix_blocks))
        pages = [case.expected_page(b, ks, vs) for b in range(case.prefix_blocks)]
        self.arena = Arena([len(page) for page in pages])
        for i, page in enumerate(pages):
            self.arena.memory[self.arena.spans[i]] = page
        self.read_only = case.read_only
        self.fail_at = fail_at
        self.num_gets = 0
        self.raised: InjectedFault | None = None

    def get(self, key: BlockKey) -> memoryview:
        count, self.num_gets = self.num_gets, self.num_gets + 1
        if count == self.fail_at:
            self.raised = InjectedFault(f"reading prefix block {key} failed")
            raise self.raised
        i = self.keys.index(key)
        view = self.arena.page(i)
        return memoryview(bytes(view)) if self.read_only[i] else view


class HoldingExecutor(ThreadPoolExecutor):
    """One worker, like the engine's helpers, remembering every future; once a task has raised, the tasks
    after it wait for `release` (so a task `abort()` does not wait for is still pending when it returns)."""

    def __init__(self, name: str) -> None:
        super().__init__(1, thread_name_prefix=name)
        self.futures: list[Future[Any]] = []
        self.failed = threading.Event()
        self.release = threading.Event()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        def run() -> T:
            if self.failed.is_set() and not self.release.wait(HOLD_TIMEOUT_S):
                self.release.set()
                raise TimeoutError("a held task was never released")
            try:
                return fn(*args, **kwargs)
            except BaseException:
                self.failed.set()
                raise

        future = super().submit(run)
        self.futures.append(future)
        return future


@contextlib.contextmanager
def helpers() -> Iterator[tuple[HoldingExecutor, HoldingExecutor]]:
    loader, storer = HoldingExecutor("loader"), HoldingExecutor("storer")
    try:
        yield loader, storer
    finally:
        loader.release.set()
        storer.release.set()
        loader.shutdown()
        storer.shutdown()


class Role:
    """Who is touching a layer's buffer: the loader, the storer, or (serialized) the caller in a phase."""

    def __init__(self) -> None:
        self.phase = "compute"

    def now(self) -> str:
        name = threading.current_thread().name
        if name.startswith("loader"):
            return "load"
        if name.startswith("storer"):
            return "store"
        return self.phase


class FaultyLayers(list[torch.Tensor]):
    """Per-layer K buffers whose `index`-th access for (`role`, `layer`) raises: a load's or a store's copy
    of that layer failing part-way."""

    def __init__(self, tensors: list[torch.Tensor], role: Role, fault: tuple[str, int, int] | None) -> None:
        super().__init__(tensors)
        self.role, self.fault = role, fault
        self.counts: dict[tuple[str, int], int] = {}
        self.raised: InjectedFault | None = None
        self.lock = threading.Lock()

    def __getitem__(self, index: Any) -> Any:
        if self.fault is not None and isinstance(index, int):
            key = (self.role.now(), index)
            with self.lock:
                count = self.counts.get(key, 0)
                self.counts[key] = count + 1
            if (*key, count) == self.fault:
                self.raised = InjectedFault(f"the {key[0]} of layer {index} failed (access {count})")
                raise self.raised
        return super().__getitem__(index)


# --------------------------------------------------------------------------- the driver


@attrs.frozen
class Fault:
    """`kind`: "get" (the cache's `index`-th read), "load" (layer `layer`), "store" (layer `layer`'s
    `index`-th chunk), or "listener" (its call for `layer`)."""

    kind: str
    layer: int = 0
    index: int = 0


@attrs.define
class Run:
    pages: list[bytes]  # per block after the prefix, its arena slot (a None page's slot too)
    outside: bytes  # the arena's bytes between pages
    prefix_arena: bytes
    buffers: list[bytes]
    heard: list[tuple[int, bool]]  # (layer, final in every page of ours when heard)
    loads: int
    stores: int
    num_loaded_layers: int
    load_wait_s: float
    store_wait_s: float
    error: BaseException | None = None
    failed_at: str | None = None
    raised: BaseException | None = None
    done_when_aborted: bool | None = None
    changed_after_abort: bool | None = None


def run_prefill(case: Case, *, layerwise: bool, fault: Fault | None = None) -> Run:
    """The prefill engine's loop around a stand-in compute, checking each step's promise as it goes; with a
    fault, the caller's error path (`abort()`, then give the pages back) as well."""
    ks, vs = case.rows()
    cache = PrefixCache(case, ks, vs, fault.index if fault is not None and fault.kind == "get" else None)
    sizes = [case.layout.block_bytes(case.tokens_of(b)) for b in range(case.prefix_blocks, case.num_blocks)]
    arena = Arena(sizes)
    pages = [arena.page(i) if ours else None for i, ours in enumerate(case.ours)]
    role = Role()
    layer_fault = None
    if fault is not None and fault.kind == "load":
        layer_fault = ("load", fault.layer, 0)
    elif fault is not None and fault.kind == "store":
        layer_fault = ("store", fault.layer, fault.index)
    shape = (case.num_tokens, case.config.num_kv_heads, case.config.head_dim)
    dtype = case.layout.torch_dtype
    k_all = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(case.num_layers)]
    v_all = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(case.num_layers)]
    faulty_k = FaultyLayers(k_all, role, layer_fault)
    heard: list[tuple[int, bool]] = []
    listener_raised: list[InjectedFault] = []

    def on_layer_final(layer: int) -> None:
        final = all(
            arena.bytes_of(i)[case.layer_span(case.prefix_blocks + i, layer)]
            == case.expected_page(case.prefix_blocks + i, ks, vs)[case.layer_span(case.prefix_blocks + i, layer)]
            for i, ours in enumerate(case.ours)
            if ours
        )
        heard.append((layer, final))
        if fault is not None and fault.kind == "listener" and layer == fault.layer:
            listener_raised.append(InjectedFault(f"the listener failed at layer {layer}"))
            raise listener_raised[-1]

    prefix = slice(0, case.prefix_tokens)
    step = "init"
    error: BaseException | None = None
    with helpers() as (loader, storer), torch.inference_mode():
        io = LayerwiseKvIo(
            cache=cast(TieredCache, cache),
            layout=case.layout,
            k_buffers=faulty_k,
            v_buffers=v_all,
            prefix_keys=cache.keys,
            pages=pages,
            on_layer_final=on_layer_final if case.listening else None,
            layerwise=layerwise,
            loader=loader,
            storer=storer,
        )
        assert io.prefix_tokens == case.prefix_tokens
        try:
            step, role.phase = "start_loading", "load"
            io.start_loading()
            role.phase = "compute"
            io.check_invariants()
            for chunk, (start, end) in enumerate(case.chunks()):
                for layer in range(case.num_layers):
                    step = f"wait_for_prefix({layer})"
                    io.wait_for_prefix(layer)
                    io.check_invariants()
                    loaded = layer + 1 if layerwise and chunk == 0 else case.num_layers  # serialized: all up front
                    assert io.num_loaded_layers == (loaded if case.prefix_blocks else 0)
                    assert raw(k_all[layer][prefix]) == raw(ks[layer][prefix]), f"layer {layer}'s prefix K"
                    assert raw(v_all[layer][prefix]) == raw(vs[layer][prefix]), f"layer {layer}'s prefix V"
                    k_all[layer][start:end] = ks[layer][start:end]  # the layer's attention writes its new rows
                    v_all[layer][start:end] = vs[layer][start:end]
                    step = f"store({layer})"
                    io.store(layer, start, end)
                    io.check_invariants()
            step, role.phase = "finish", "store"
            io.finish()
            role.phase = "compute"
            io.check_invariants()
            assert all(future.done() for future in loader.futures + storer.futures), "finish() left a task"
        except InjectedFault as caught:
            if fault is None:
                raise
            error = caught
        done_when_aborted = changed_after_abort = None
        if fault is not None:
            done_when_aborted, changed_after_abort = abort_and_watch(io, arena, loader, storer)
        loads, stores = len(loader.futures), len(storer.futures)
    raised = cache.raised or faulty_k.raised or (listener_raised[0] if listener_raised else None)
    return Run(
        pages=[arena.bytes_of(i) for i in range(len(case.ours))],
        outside=arena.outside(),
        prefix_arena=bytes(cache.arena.memory),
        buffers=[raw(t) for t in k_all + v_all],
        heard=heard,
        loads=loads,
        stores=stores,
        num_loaded_layers=io.num_loaded_layers,
        load_wait_s=io.load_wait_s,
        store_wait_s=io.store_wait_s,
        error=error,
        failed_at=step if error is not None else None,
        raised=raised,
        done_when_aborted=done_when_aborted,
        changed_after_abort=changed_after_abort,
    )


def abort_and_watch(
    io: LayerwiseKvIo, arena: Arena, loader: HoldingExecutor, storer: HoldingExecutor
) -> tuple[bool, bool]:
    """`abort()` on another thread while the tasks queued behind the failure are held; release them once it
    waits (a correct `abort()` cannot return before). Returns whether every task was done when `abort()`
    returned, and whether a page byte changed after it returned."""
    seen: dict[str, Any] = {}

    def aborting() -> None:
        io.abort()
        seen["done"] = all(future.done() for future in loader.futures + storer.futures)
        seen["memory"] = bytes(arena.memory)

    thread = threading.Thread(target=aborting, name="aborting")
    thread.start()
    # Only a faulty abort() can return while tasks are held; give it the chance to show, then release.
    thread.join(timeout=0.05)
    loader.release.set()
    storer.release.set()
    thread.join(timeout=ABORT_TIMEOUT_S)
    assert not thread.is_alive(), "abort() did not return once every task could run"
    loader.shutdown()  # joins the workers: any write still to come has happened now
    storer.shutdown()
    return bool(seen["done"]), bytes(arena.memory) != seen["memory"]


# --------------------------------------------------------------------------- properties


@settings(deadline=None)
@given(cases())
def test_both_modes_leave_the_reference_bytes_and_hear_each_layer_once_when_final(case: Case) -> None:
    """Layer-wise and serialized: every page of ours holds exactly the hand-written reference bytes, a None
    block's slot and the bytes between pages stay untouched, the cached prefix pages are never written, the
    buffers end as the reference rows (the prefix rows bit-exact from the first wait for each layer), the
    listener hears layers 0 … L − 1 once each, in order, each final in every page; only layer-wise uses the
    helpers: one load per layer with a prefix, one store per chunk and layer plus one call per layer heard,
    and none when there is nothing to store or hear."""
    overlapped, serialized = run_prefill(case, layerwise=True), run_prefill(case, layerwise=False)
    ks, vs = case.rows()
    for run in (overlapped, serialized):
        for i, ours in enumerate(case.ours):
            b = case.prefix_blocks + i
            untouched = bytes([CANARY]) * case.layout.block_bytes(case.tokens_of(b))
            assert run.pages[i] == (case.expected_page(b, ks, vs) if ours else untouched), f"block {b}"
        assert set(run.outside) <= {CANARY}, "a byte outside every page was written"
        assert (
            run.prefix_arena
            == b"".join(bytes([CANARY]) * GAP_BYTES + case.expected_page(b, ks, vs) for b in range(case.prefix_blocks))
            + bytes([CANARY]) * GAP_BYTES
        ), "a cached prefix page was written"
        assert run.buffers == [raw(t) for t in ks + vs]
        assert run.heard == ([(layer, True) for layer in range(case.num_layers)] if case.listening else [])
        assert run.num_loaded_layers == (case.num_layers if case.prefix_blocks else 0)
        assert run.load_wait_s >= 0 and run.store_wait_s >= 0
        if not case.prefix_blocks:
            assert run.load_wait_s == 0.0
    assert overlapped.pages == serialized.pages
    assert (serialized.loads, serialized.stores) == (0, 0)
    assert overlapped.loads == (case.num_layers if case.prefix_blocks else 0)
    num_stores = len(case.chunks()) * case.num_layers + (case.num_layers if case.listening else 0)
    assert overlapped.stores == (num_stores if case.has_output else 0)


# --------------------------------------------------------------------------- faults


@st.composite
def faulty_cases(
    draw: st.DrawFn, *, kinds: tuple[str, ...] = ("get", "load", "store", "listener")
) -> tuple[Case, Fault]:
    """A case and one fault it can meet: a prefix read or load needs a prefix, a store something to store or
    hear, a listener's error a listener."""
    case = draw(cases(listening=True if kinds == ("store",) else None))
    layers, num_chunks = range(case.num_layers), len(case.chunks())
    options: list[Fault] = []
    if case.prefix_blocks and "get" in kinds:
        options += [Fault("get", index=i) for i in range(case.prefix_blocks)]
    if case.prefix_blocks and "load" in kinds:
        options += [Fault("load", layer=layer) for layer in layers]
    if case.has_output and "store" in kinds:
        options += [Fault("store", layer=layer, index=c) for layer in layers for c in range(num_chunks)]
    if case.listening and "listener" in kinds:
        options += [Fault("listener", layer=layer) for layer in layers]
    assume(options)
    return case, draw(st.sampled_from(options))


def expected_step(fault: Fault, *, layerwise: bool) -> str:
    """Where the caller meets the error: a load's at the wait for its layer (serialized: `start_loading`),
    a store's or the listener's at `finish()`."""
    if fault.kind in ("get", "load"):
        return f"wait_for_prefix({fault.layer})" if layerwise else "start_loading"
    return "finish"


@given(faulty_cases(), st.booleans())
def test_a_fault_reaches_the_caller_and_after_abort_nothing_runs_or_writes(
    case_and_fault: tuple[Case, Fault], layerwise: bool
) -> None:
    """A prefix read, a layer's load, a store or the listener raising part-way: the caller gets that very
    error at the documented step; once `abort()` returns every task given to the helpers is done, even those
    queued behind the failure, and no page byte changes afterwards; nothing outside the pages or in the
    cached prefix is written; serialized, the helpers are never used."""
    case, fault = case_and_fault
    run = run_prefill(case, layerwise=layerwise, fault=fault)
    assert run.raised is not None, "the fault was never hit"
    assert run.error is run.raised, f"the caller got {run.error!r}, not {run.raised!r}"
    assert run.failed_at == expected_step(fault, layerwise=layerwise)
    assert run.done_when_aborted, "abort() returned while a task it submitted was queued or running"
    assert not run.changed_after_abort, "a page was written after abort() returned"
    assert set(run.outside) <= {CANARY}, "a byte outside every page was written"
    ks, vs = case.rows()
    assert (
        run.prefix_arena
        == b"".join(bytes([CANARY]) * GAP_BYTES + case.expected_page(b, ks, vs) for b in range(case.prefix_blocks))
        + bytes([CANARY]) * GAP_BYTES
    ), "a cached prefix page was written"
    if not layerwise:
        assert (run.loads, run.stores) == (0, 0)


def failed_store_touches_a_page(case_and_fault: tuple[Case, Fault]) -> bool:
    case, fault = case_and_fault
    start, end = case.chunks()[fault.index]
    blocks = range(start // case.block, (end - 1) // case.block + 1)
    return any(case.ours[b - case.prefix_blocks] for b in blocks)


@settings(max_examples=20, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking
@given(faulty_cases(kinds=("store",)).filter(failed_store_touches_a_page), st.booleans())
def test_the_listener_never_hears_a_layer_whose_store_failed(
    case_and_fault: tuple[Case, Fault], layerwise: bool
) -> None:
    """A store of layer l that raises leaves layer l not final, so neither mode may tell the listener it is
    (the module's promise: `on_layer_final(l)` once layer l of every block holds its final bytes)."""
    case, fault = case_and_fault
    run = run_prefill(case, layerwise=layerwise, fault=fault)
    assert run.error is run.raised is not None
    assert all(final for _layer, final in run.heard), f"heard {run.heard} after the store of layer {fault.layer} failed"
    assert fault.layer not in [layer for layer, _final in run.heard]
