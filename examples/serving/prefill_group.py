"""A prefill instance as a chunked pipeline group: `[prefill] pipeline_size = X` processes, one instance.

The worker of such an instance stays the instance — its gateway connection,
transfer engine, tiered cache and health answer are the same as a single
process's — and is stage 0 of a `mooncake.engine.pipeline.PipelineGroup`
whose X − 1 other stages are processes it starts, each holding a contiguous
slice of the layers (`stage_layers`). The Conductor and the gateway see one
prefill instance.

`GroupPrefillEngine.prefill` keeps `PrefillEngine`'s contract (prefix reuse,
pages reserved then committed once every layer is stored, a `KvSink` that
hears of each layer once its bytes are final) with the forward pass on the
group:

1. The prompt's block keys; the longest cached prefix of whole blocks is
   pinned (capped so that one token is computed); a page is reserved per new block.
2. The prefix's KV is read out of the pinned pages for every layer, before the
   group starts: each stage needs its own layers' prefix at its first chunk.
3. The group computes the new rows; `LayerwiseKvIo.store` writes each layer's
   rows into the reserved pages as they become final in stage 0's buffers —
   stage 0's layers chunk by chunk as it computes them, the other stages'
   layers when their KV comes back — and the sink hears of each layer after
   its last store, so the decode instance receives the layers of the first
   stages while the last ones still compute.
4. The stores finish, the pages are committed, the sink ends.

Only this process touches the cache: the stages send their KV back rather than
writing the shared pages themselves (see `mooncake.engine.pipeline`), so a page
given back after a failure is never written afterwards.

Invariants: as `PrefillEngine`'s, a prefill leaves no pin and no reservation
behind, on success or error, and a reserved page is committed only once all
its layers are stored; the pages hold the bytes a single-process
`PrefillEngine` stores for the same prompt and cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import Buffer
from mooncake.cache.tiered import TieredCache
from mooncake.engine.kv import KvLayout
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import KvSink, PrefillResult
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.errors import ConfigError, InvalidRequestError, UnknownBlockError
from mooncake.types import BlockKey

__all__ = ["GroupPrefillEngine"]


class GroupPrefillEngine:
    """Prefills prompts on a pipeline group over this node's tiered cache (`PrefillEngine`'s contract).

    Args:
        group: the pipeline group, this process its stage 0 (its owner closes it).
        cache: the node's tiered cache; its page size must be the layout's.
        hasher: the block keys' namespace; its block size is the KV page's.
        layerwise: store each layer's KV while later layers compute (off: every store after the forward pass).

    One prefill runs at a time; the cache may be read and written by other threads meanwhile.
    """

    def __init__(
        self, group: PipelineGroup, cache: TieredCache, hasher: BlockHasher, *, layerwise: bool = True
    ) -> None:
        self.group, self.cache, self.hasher, self.layerwise = group, cache, hasher, layerwise
        model = group.model
        dtype = str(model.dtype).removeprefix("torch.")
        self.layout = KvLayout(config=group.config, block_tokens=hasher.block_size_tokens, dtype=dtype)
        if cache.page_bytes < self.layout.page_bytes:
            raise ConfigError(
                f"cache pages of {cache.page_bytes} bytes cannot hold a {self.layout.page_bytes}-byte KV block"
            )
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="kv-store")

    def close(self) -> None:
        """Stop the helper threads (the group is its owner's to close)."""
        self._loader.shutdown()
        self._storer.shutdown()

    def __enter__(self) -> GroupPrefillEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], *, sampling: SamplingParams | None = None, sink: KvSink | None = None
    ) -> PrefillResult:
        """Prefill `tokens` on the group, reusing cached prefix KV and storing the new KV.

        Raises:
            InvalidRequestError: no tokens, or ids outside the vocabulary.
            EngineError: a stage failed (the group has failed: every later prefill raises it too).
        """
        started = time.perf_counter()
        n = len(tokens)
        if n == 0:
            raise InvalidRequestError("a prompt needs at least one token")
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.group.config.vocab_size:
            raise InvalidRequestError(f"token ids must lie in [0, {self.group.config.vocab_size})")
        block = self.layout.block_tokens
        keys = self.hasher.block_keys(ids.numpy())
        prefix_blocks = self._pin_prefix(keys, max_blocks=(n - 1) // block)
        pages: list[Buffer | None] = []
        reserved: list[BlockKey] = []
        streaming = False
        try:
            pages, reserved = self._reserve(keys, prefix_blocks, n)
            if sink is not None:
                sink.begin(keys)
                streaming = True
            logits, load_wait, store_wait = self._forward(ids.tolist(), keys[:prefix_blocks], pages, sink)
            for key in reserved:
                self.cache.commit(key)
            reserved = []
            if sink is not None:
                streaming = False  # end() finishes or cleans up by itself
                sink.end()
        except BaseException:
            if streaming:
                with contextlib.suppress(Exception):  # the original error is the one to report
                    sink.abort()  # type: ignore[union-attr]
            raise
        finally:
            for key in reserved:
                self.cache.abort(key)
            for key in keys[:prefix_blocks]:
                self._unpin(key)
        prefix = prefix_blocks * block
        return PrefillResult(
            keys=keys,
            first_token=Sampler(sampling or SamplingParams()).next_token(logits),
            logits=logits,
            prefix_tokens=prefix,
            computed_tokens=n - prefix,
            stored_keys=tuple(k for k, page in zip(keys[prefix_blocks:], pages, strict=True) if page is not None),
            seconds=time.perf_counter() - started,
            load_wait_s=load_wait,
            store_wait_s=store_wait,
        )

    def _forward(
        self, tokens: list[int], prefix_keys: tuple[BlockKey, ...], pages: list[Buffer | None], sink: KvSink | None
    ) -> tuple[torch.Tensor, float, float]:
        """The last position's logits and the load and store waits; the pages hold every layer's new KV."""
        config, model = self.group.config, self.group.model
        shape = (len(tokens), config.num_kv_heads, config.head_dim)
        k_all = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(config.num_layers)]
        v_all = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(config.num_layers)]
        io = LayerwiseKvIo(
            cache=self.cache,
            layout=self.layout,
            k_buffers=k_all,
            v_buffers=v_all,
            prefix_keys=prefix_keys,
            pages=pages,
            on_layer_final=None if sink is None else sink.layer_ready,
            layerwise=self.layerwise,
            loader=self._loader,
            storer=self._storer,
        )
        try:
            io.start_loading()
            for layer in range(config.num_layers):  # every stage needs its prefix before its first chunk
                io.wait_for_prefix(layer)
            logits = self.group.prefill(
                tokens, kv=list(zip(k_all, v_all, strict=True)), prefix_tokens=io.prefix_tokens, on_rows=io.store
            )
            io.finish()
        except BaseException:
            io.abort()  # stores may still be queued: let none touch a page the caller gives back
            raise
        return logits, io.load_wait_s, io.store_wait_s

    def _pin_prefix(self, keys: tuple[BlockKey, ...], *, max_blocks: int) -> int:
        """Pin the longest cached run of leading blocks (at most `max_blocks`); its length."""
        count = 0
        try:
            for key in keys[:max_blocks]:
                self.cache.touch(key)  # a read: promotes a lower-tier block to DRAM (so it can stream)
                try:
                    self.cache.pin(key)
                except UnknownBlockError:
                    break
                count += 1
        except BaseException:  # a failed read (SSD I/O): give back the pins taken so far
            for key in keys[:count]:
                self._unpin(key)
            raise
        return count

    def _unpin(self, key: BlockKey) -> None:
        with contextlib.suppress(UnknownBlockError):
            self.cache.unpin(key)

    def _reserve(self, keys: tuple[BlockKey, ...], first: int, n: int) -> tuple[list[Buffer | None], list[BlockKey]]:
        """A writable page (or None: not ours to fill) per block from `first` on, and the keys reserved."""
        pages: list[Buffer | None] = []
        reserved: list[BlockKey] = []
        block = self.layout.block_tokens
        try:
            for i in range(first, len(keys)):
                page = self.cache.reserve(
                    keys[i],
                    self.layout.block_bytes(min(block, n - i * block)),
                    parent=keys[i - 1] if i else None,
                    position=i,
                )
                pages.append(page)
                if page is not None:
                    reserved.append(keys[i])
        except BaseException:  # e.g. CapacityError: the caller never sees these, so give them back here
            for key in reserved:
                self.cache.abort(key)
            raise
        return pages, reserved
