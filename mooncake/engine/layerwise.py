"""Layer-wise KV I/O of one prefill: prefix loads and new-KV stores around the layers' compute.

A prefill computes into per-layer K and V buffers `[n, kv_heads, head_dim]`:
rows 0 … p − 1 hold the cached prefix, rows p … n − 1 the tokens it computes,
chunk by chunk. `LayerwiseKvIo` moves KV between those buffers and the cache's
pages (paper §5.2, Fig. 7):

- Loads. The prefix's pages (pinned by the engine) are read once; layer l of
  every prefix block is copied into rows 0 … p − 1 of layer l's buffers.
  Layer-wise, a loader thread copies layer l + 1 while layer l computes, so the
  compute waits only for what the copy has not hidden; serialized, every layer
  is copied before the first one computes. A prefix page that fails verification,
  or holds less than a full block, is an `IntegrityError` for every layer.
- Stores. Rows [start, end) of layer l, once computed, are copied into the
  reserved pages of the blocks they fall in. Layer-wise, a store thread copies
  them while later layers compute (on a GPU through a side stream that waits
  for the layer's compute event, not for later layers); serialized, every store
  runs after the forward pass.
- Streaming. `on_layer_final(l)` is called once layer l of every block holds
  its final bytes: after the last chunk's store of layer l (layer-wise from the
  store thread, which runs its tasks in order). Once a store (or a listener
  call) has failed, the tasks queued after it do nothing: no page is written
  that the caller is about to give back, and no layer is called final.

The caller's loop: `start_loading()`; per chunk and layer, `wait_for_prefix(l)`,
compute, `store(l, start, end)`; then `finish()`. On any error it calls
`abort()` before it gives a page back. The time the compute waited for I/O (the
exposed I/O) is `load_wait_s` and `store_wait_s`.

Invariants: at most one load is queued, the one for the next prefix layer the
compute will wait for, and only layer-wise; serialized, nothing goes to the
helper threads; once `finish()` or `abort()` returned, nothing submitted by
this object is queued or running, so no page it writes can be given back under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_all

import torch

from mooncake.cache.pool import Buffer
from mooncake.cache.tiered import TieredCache
from mooncake.engine.kv import KvLayout
from mooncake.errors import IntegrityError
from mooncake.types import BlockKey

__all__ = ["LayerwiseKvIo"]


class LayerwiseKvIo:
    """The KV loads and stores of one prefill, overlapped with its layers (`layerwise`) or serialized.

    Args:
        cache: the node's tiered cache, holding the pinned prefix blocks.
        layout: the KV page geometry.
        k_buffers, v_buffers: the prefill's K and V per layer, `[n, kv_heads, head_dim]` each.
        prefix_keys: the pinned prefix blocks whose KV fills the buffers' first rows.
        pages: a writable page (or None: not ours to fill) per block after the prefix.
        on_layer_final: called with l once layer l is final in every page (None: nobody listens).
        layerwise: overlap loads and stores with the compute on the helper threads.
        loader, storer: single-worker executors (they run tasks in submission order).

    Invariants:
        `check_invariants()`; see the module docstring.
    """

    def __init__(
        self,
        *,
        cache: TieredCache,
        layout: KvLayout,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        prefix_keys: tuple[BlockKey, ...],
        pages: Sequence[Buffer | None],
        on_layer_final: Callable[[int], None] | None,
        layerwise: bool,
        loader: Executor,
        storer: Executor,
    ) -> None:
        self.cache, self.layout, self.layerwise = cache, layout, layerwise
        self._k, self._v = k_buffers, v_buffers
        self._prefix_keys, self._pages, self._on_layer_final = prefix_keys, pages, on_layer_final
        self._loader, self._storer = loader, storer
        self._num_layers, self._num_tokens = len(k_buffers), k_buffers[0].shape[0]
        device = k_buffers[0].device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._has_output = any(page is not None for page in pages) or on_layer_final is not None
        self._prefix_pages: list[Buffer] = []
        self._prefix_views: list[torch.Tensor] = []  # page_kv of each prefix page (loader thread)
        self._page_views: list[torch.Tensor | None] | None = None  # page_kv of each page to fill (store thread)
        self._loads: dict[int, Future[None]] = {}  # layer → its queued load (layer-wise)
        self._stores: list[Future[None]] = []  # queued stores and listener calls (layer-wise)
        self._deferred: list[tuple[int, int, int]] = []  # (layer, start, end) stored at the end (serialized)
        self._submitted: list[Future[None]] = []  # every task given to the helpers, for abort()
        self._store_failed = False  # a task on the store thread raised: the ones after it do nothing (store thread)
        self.num_loaded_layers = 0
        self.load_wait_s = 0.0
        self.store_wait_s = 0.0

    @property
    def prefix_tokens(self) -> int:
        return len(self._prefix_keys) * self.layout.block_tokens

    # ------------------------------------------------------------------ the caller's loop

    def start_loading(self) -> None:
        """Begin loading the prefix: layer-wise, queue layer 0; serialized, load every layer now."""
        if not self._prefix_keys:
            return
        if self.layerwise:
            self._loads[0] = self._submit(self._loader, self._load, 0)
            return
        waited = time.perf_counter()
        for layer in range(self._num_layers):
            self._load(layer)
        self.num_loaded_layers = self._num_layers
        self.load_wait_s += time.perf_counter() - waited

    def wait_for_prefix(self, layer: int) -> None:
        """Return once `layer`'s prefix KV is in the buffers, the next layer's load queued first.

        Raises:
            IntegrityError: a pinned prefix block failed verification when read, or holds less than a full block
                (or what else the load raised).
        """
        future = self._loads.pop(layer, None)
        if future is None:  # serialized, no prefix, or a later chunk: loaded already
            return
        if layer + 1 < self._num_layers:
            self._loads[layer + 1] = self._submit(self._loader, self._load, layer + 1)
        waited = time.perf_counter()
        future.result()
        self.load_wait_s += time.perf_counter() - waited
        self.num_loaded_layers = layer + 1

    def store(self, layer: int, start: int, end: int) -> None:
        """`layer` has computed rows [start, end): store them (layer-wise: queue the store); an empty range is
        nothing to store (nor a second "final" for the layer after its last chunk)."""
        if not self._has_output or start >= end:
            return
        if not self.layerwise:
            self._deferred.append((layer, start, end))
            return
        computed = torch.cuda.Event() if self._side is not None else None  # type: ignore[no-untyped-call]
        if computed is not None:
            computed.record()
        self._stores.append(self._submit(self._storer, self._queued, self._store, layer, start, end, computed))
        if end == self._num_tokens and self._on_layer_final is not None:  # the last chunk: the layer is final
            self._stores.append(self._submit(self._storer, self._queued, self._on_layer_final, layer))

    def finish(self) -> None:
        """Wait for the queued stores, then run the deferred ones and tell the listener (serialized).

        Raises:
            Exception: the first error of a store or of `on_layer_final`; call `abort()` before giving pages back.
        """
        waited = time.perf_counter()
        for future in self._stores:
            future.result()
        for layer, start, end in self._deferred:
            self._store(layer, start, end)
        if self._on_layer_final is not None and not self.layerwise:
            for layer in range(self._num_layers):
                self._on_layer_final(layer)
        self.store_wait_s += time.perf_counter() - waited

    def abort(self) -> None:
        """Return once nothing submitted runs any more (their errors are the caller's to ignore)."""
        wait_all(self._submitted)

    def check_invariants(self) -> None:
        assert len(self._loads) <= 1, "more than one prefix load queued"
        assert all(layer == self.num_loaded_layers for layer in self._loads), "a load queued out of order"
        assert self.layerwise or not self._submitted, "the serialized baseline used a helper thread"
        assert self.layerwise or not self._loads
        assert self._prefix_keys or (self.num_loaded_layers == 0 and not self._loads), "a load without a prefix"

    # ------------------------------------------------------------------ the copies

    def _submit(self, executor: Executor, task: Callable[..., None], *args: object) -> Future[None]:
        future = executor.submit(task, *args)
        self._submitted.append(future)
        return future

    def _queued(self, task: Callable[..., None], *args: object) -> None:
        """Run a store or listener call queued on the store thread, unless one before it failed.

        The store thread runs its tasks in order, so once one failed (its error is the caller's from `finish`),
        no later store writes a page that is about to be given back, and the listener never hears that a layer
        is final whose bytes a failed store did not write.
        """
        if self._store_failed:
            return
        try:
            task(*args)
        except BaseException:
            self._store_failed = True
            raise

    @torch.inference_mode()  # the mode is per thread: this runs on the loader thread
    def _load(self, layer: int) -> None:
        """Gather layer `layer` of every prefix block into the contiguous buffers."""
        if not self._prefix_pages:  # pinned: DRAM pages are zero-copy views, lower tiers one verified read
            # Kept only once all were read: a read that fails must fail every later layer's load too.
            read = [self.cache.get(key) for key in self._prefix_keys]
            missing = [key for key, page in zip(self._prefix_keys, read, strict=True) if page is None]
            if missing:
                raise IntegrityError(f"pinned prefix block {missing[0]} failed verification while loading")
            pages = [page for page in read if page is not None]
            self._prefix_pages = pages
        block = self.layout.block_tokens
        if not self._prefix_views:  # one view per page, not one per page and layer (this runs per layer)
            views = [self.layout.page_kv(page) for page in self._prefix_pages]
            # A prefix block's page is a full block (a peer's push or a damaged tier may hold fewer tokens under its
            # key, each checksum fine): copy_ would broadcast a 1-token page over the block's rows and fail on 2..
            # block - 1 with torch's bare error. Kept only once all were checked, as the pages are.
            for key, kv in zip(self._prefix_keys, views, strict=True):
                if kv.shape[2] != block:
                    raise IntegrityError(
                        f"pinned prefix block {key}'s page holds {kv.shape[2]} of a block's {block} tokens"
                    )
            self._prefix_views.extend(views)
        for b, kv in enumerate(self._prefix_views):
            rows = slice(b * block, (b + 1) * block)
            self._k[layer][rows].copy_(kv[layer, 0], non_blocking=True)
            self._v[layer][rows].copy_(kv[layer, 1], non_blocking=True)
        device = self._k[layer].device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    @torch.inference_mode()  # runs on the store thread
    def _store(self, layer: int, start: int, end: int, computed: torch.cuda.Event | None = None) -> None:
        """Copy rows [start, end) of `layer` into the pages of the blocks they fall in."""
        k_rows, v_rows = self._k[layer][start:end], self._v[layer][start:end]
        if self._side is not None and computed is not None:
            # Layer-wise: copy out once the layer's compute is done, not after later layers. Serialized
            # stores (no event) run after the forward pass, on its own stream: nothing to wait for.
            with torch.cuda.stream(self._side):
                self._side.wait_event(computed)
                k_host, v_host = k_rows.cpu(), v_rows.cpu()
        else:
            k_host, v_host = k_rows.cpu(), v_rows.cpu()
        block, first_page = self.layout.block_tokens, len(self._prefix_keys)
        if self._page_views is None:  # one view per page, made on the store thread, not one per page and layer
            self._page_views = [None if page is None else self.layout.page_kv(page) for page in self._pages]
        for b in range(start // block, (end - 1) // block + 1):
            kv = self._page_views[b - first_page]
            if kv is None:
                continue
            lo, hi = max(start, b * block), min(end, (b + 1) * block)
            kv[layer, 0, lo - b * block : hi - b * block].copy_(k_host[lo - start : hi - start])
            kv[layer, 1, lo - b * block : hi - b * block].copy_(v_host[lo - start : hi - start])
