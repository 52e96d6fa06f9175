"""The prefill engine: prefix reuse, layer-wise KV load and store, chunked prefill.

One `prefill(tokens)`:

1. Block keys of the prompt; the longest prefix of whole blocks the node's
   tiered cache holds is reused (capped so that at least one token is computed:
   its logits give the first token). Those blocks are pinned until the end.
2. New blocks (the partial last one included) get a first-tier page each,
   reserved in the cache and invisible until committed.
3. The uncached tokens are computed in chunks of at most `chunk_tokens`; each
   chunk runs through every layer, attending to the prefix and earlier chunks.
4. Layer-wise (paper §5.2, Fig. 7; `mooncake.engine.layerwise`): while layer
   l computes, a loader thread brings layer l + 1 of the prefix KV out of the
   cache's pages, and as soon as layer l's attention has produced its new K and
   V a store thread writes them into the reserved pages; the engine waits for
   the stores only at the end, then commits the pages. Without `layerwise`, the
   prefix is loaded before and the KV stored after the forward pass (the
   serialized baseline).
5. An optional `KvSink` hears of each layer once its bytes are final in every
   page of the request, so the KV can stream to a decode node while later
   layers still compute (`MessengerSink` pushes them through the node's
   `Messenger`, one layer per part).

Steps 1, 2 and the commit are the engine's; step 3 is a `ForwardPass`: the
whole model in this process (`ModelForward`, the default when the engine is
given a `LlamaModel`), or any other computation of the same KV — a chunked
pipeline group across processes (the example cluster's `GroupForward`) — so
the cache choreography exists once.

Invariants: a prefill leaves no pin and no reservation behind, on success or
error; a reserved page is committed only once all its layers are stored.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import attrs
import torch

from mooncake._checks import int_at_least
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import Buffer
from mooncake.cache.tiered import TieredCache
from mooncake.engine.attention import prefill_attention_into
from mooncake.engine.config import ModelConfig
from mooncake.engine.kv import KvLayout
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.engine.model import LlamaModel
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.errors import ConfigError, InvalidRequestError, UnknownBlockError
from mooncake.transfer.messenger import Messenger, Push
from mooncake.types import BlockKey

__all__ = ["ForwardPass", "KvSink", "MessengerSink", "ModelForward", "PrefillConfig", "PrefillEngine", "PrefillResult"]


class KvSink(Protocol):
    """Where a prefill streams its KV as layers complete (e.g. a decode node)."""

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        """The request's blocks (cached or reserved in the local cache) are about to fill."""

    def layer_ready(self, layer: int) -> None:
        """Layer `layer` of every block is final in the local pages."""

    def end(self) -> None:
        """Every layer is final and the local blocks are committed."""

    def abort(self) -> None:
        """The prefill failed after `begin`: drop what was streamed (nothing may be committed)."""


@attrs.frozen(kw_only=True)
class PrefillConfig:
    """Options of a prefill engine.

    Attributes:
        chunk_tokens: prompts with more uncached tokens are computed in chunks of this many.
        layerwise: overlap prefix loads and KV stores with the layers' compute.
        store: store the new KV in the cache (off: compute only).
    """

    chunk_tokens: int = attrs.field(default=4096, validator=int_at_least(1))
    layerwise: bool = True
    store: bool = True


@attrs.frozen(kw_only=True)
class PrefillResult:
    """What a prefill produced.

    Attributes:
        keys: the prompt's block keys (the partial last block included).
        first_token: the token sampled from the last position's logits.
        logits: float32 [vocab] at the last position.
        prefix_tokens: tokens whose KV came from the cache.
        computed_tokens: tokens computed (len(tokens) - prefix_tokens).
        stored_keys: blocks this prefill wrote into the cache.
        seconds: wall time of the prefill.
        load_wait_s, store_wait_s: time the compute waited for prefix loads and for stores
            (the exposed I/O; layer-wise overlap shrinks it).
    """

    keys: tuple[BlockKey, ...]
    first_token: int
    logits: torch.Tensor
    prefix_tokens: int
    computed_tokens: int
    stored_keys: tuple[BlockKey, ...]
    seconds: float
    load_wait_s: float
    store_wait_s: float


class ForwardPass(Protocol):
    """A prefill's computation of a prompt's KV and last logits, after a cached prefix.

    `run(ids, kv, io)` fills rows [io.prefix_tokens, len(ids)) of every layer's (K, V) buffers in `kv`
    (rows before hold the prefix once `io.wait_for_prefix(layer)` returns), calls `io.store(layer, start,
    end)` for rows as they become final, and returns the last position's float logits on the CPU. It must
    give the bytes one process's forward pass gives.
    """

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def run(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], io: LayerwiseKvIo) -> torch.Tensor:
        """Compute the new rows of every layer through `io`; the last position's logits."""
        ...


class ModelForward:
    """The whole model in this process: the uncached tokens in chunks of `chunk_tokens`, each chunk through
    every layer, attending to the prefix and the earlier chunks; each layer waits for its prefix rows only."""

    def __init__(self, model: LlamaModel, *, chunk_tokens: int) -> None:
        if not (model.has_embedding and model.has_head):
            raise ConfigError("the prefill engine needs the whole model, not a pipeline stage")
        self.model, self.chunk_tokens = model, chunk_tokens

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], io: LayerwiseKvIo) -> torch.Tensor:
        model, n, chunk = self.model, ids.shape[0], self.chunk_tokens
        x = torch.empty(0)
        for start in range(io.prefix_tokens, n, chunk):
            end = min(n, start + chunk)
            x = model.embed(ids[start:end])
            cos, sin = model.rope(torch.arange(start, end))
            for index, layer in enumerate(model.layers):
                io.wait_for_prefix(index)
                k, v = kv[index]
                x = layer(x, cos, sin, prefill_attention_into(k, v, start, end))
                io.store(index, start, end)
        return model.logits(x[-1:])[0].cpu()


class PrefillEngine:
    """Prefills prompts over one node's tiered cache, with one model or another `ForwardPass`.

    Args:
        model: the whole model (run by `ModelForward` in chunks of `config.chunk_tokens`), or a forward pass
            (a pipeline group's, say).
        cache: the node's tiered cache; its page size must be the layout's.
        hasher: the block keys' namespace; its block size is the KV page's.
        config: options.

    One prefill runs at a time per engine (prefill is FIFO on a node); the cache
    may be read and written by other threads meanwhile.
    """

    def __init__(
        self,
        model: LlamaModel | ForwardPass,
        cache: TieredCache,
        hasher: BlockHasher,
        config: PrefillConfig | None = None,
    ) -> None:
        self.config = config or PrefillConfig()
        self.forward: ForwardPass = (
            ModelForward(model, chunk_tokens=self.config.chunk_tokens) if isinstance(model, LlamaModel) else model
        )
        self.cache, self.hasher = cache, hasher
        dtype = str(self.forward.dtype).removeprefix("torch.")
        self.layout = KvLayout(config=self.forward.model_config, block_tokens=hasher.block_size_tokens, dtype=dtype)
        if cache.page_bytes < self.layout.page_bytes:
            raise ConfigError(
                f"cache pages of {cache.page_bytes} bytes cannot hold a {self.layout.page_bytes}-byte KV block"
            )
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="kv-store")

    def close(self) -> None:
        self._loader.shutdown()
        self._storer.shutdown()

    def __enter__(self) -> PrefillEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], *, sampling: SamplingParams | None = None, sink: KvSink | None = None
    ) -> PrefillResult:
        """Prefill `tokens`, reusing cached prefix KV and storing the new KV.

        Raises:
            InvalidRequestError: no tokens, or ids outside the vocabulary.
        """
        started = time.perf_counter()
        n = len(tokens)
        if n == 0:
            raise InvalidRequestError("a prompt needs at least one token")
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        vocab = self.forward.model_config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidRequestError(f"token ids must lie in [0, {vocab})")
        block = self.layout.block_tokens
        keys = self.hasher.block_keys(ids.numpy())
        prefix_blocks = self._pin_prefix(keys, max_blocks=(n - 1) // block)
        prefix = prefix_blocks * block
        pages: list[Buffer | None] = []
        reserved: list[BlockKey] = []
        streaming = False
        try:
            pages, reserved = self._reserve(keys, prefix_blocks, n)
            if sink is not None:
                sink.begin(keys)
                streaming = True
            logits, load_wait, store_wait = self._forward(ids, keys[:prefix_blocks], pages, sink)
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
        first = Sampler(sampling or SamplingParams()).next_token(logits)
        return PrefillResult(
            keys=keys,
            first_token=first,
            logits=logits,
            prefix_tokens=prefix,
            computed_tokens=n - prefix,
            stored_keys=tuple(k for k, page in zip(keys[prefix_blocks:], pages, strict=True) if page is not None),
            seconds=time.perf_counter() - started,
            load_wait_s=load_wait,
            store_wait_s=store_wait,
        )

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
        try:
            self.cache.unpin(key)
        except UnknownBlockError:
            pass

    def _reserve(self, keys: tuple[BlockKey, ...], first: int, n: int) -> tuple[list[Buffer | None], list[BlockKey]]:
        """A writable page (or None: not ours to fill) per block from `first` on, and the keys reserved."""
        pages: list[Buffer | None] = []
        reserved: list[BlockKey] = []
        if not self.config.store:
            return [None] * (len(keys) - first), reserved
        block = self.layout.block_tokens
        try:
            for i in range(first, len(keys)):
                tokens = min(block, n - i * block)
                page = self.cache.reserve(
                    keys[i], self.layout.block_bytes(tokens), parent=keys[i - 1] if i else None, position=i
                )
                pages.append(page)
                if page is not None:
                    reserved.append(keys[i])
        except BaseException:  # e.g. CapacityError: the caller never sees these, so give them back here
            for key in reserved:
                self.cache.abort(key)
            raise
        return pages, reserved

    # ------------------------------------------------------------------ the forward pass

    def _forward(
        self,
        ids: torch.Tensor,
        prefix_keys: tuple[BlockKey, ...],
        pages: list[Buffer | None],
        sink: KvSink | None,
    ) -> tuple[torch.Tensor, float, float]:
        """The last position's logits and the load and store waits; the pages hold the new KV."""
        forward, config = self.forward, self.forward.model_config
        shape = (ids.shape[0], config.num_kv_heads, config.head_dim)
        k_all = [torch.empty(shape, dtype=forward.dtype, device=forward.device) for _ in range(config.num_layers)]
        v_all = [torch.empty(shape, dtype=forward.dtype, device=forward.device) for _ in range(config.num_layers)]
        io = LayerwiseKvIo(
            cache=self.cache,
            layout=self.layout,
            k_buffers=k_all,
            v_buffers=v_all,
            prefix_keys=prefix_keys,
            pages=pages,
            on_layer_final=None if sink is None else sink.layer_ready,
            layerwise=self.config.layerwise,
            loader=self._loader,
            storer=self._storer,
        )
        try:
            io.start_loading()
            logits = forward.run(ids, list(zip(k_all, v_all, strict=True)), io)
            io.finish()
        except BaseException:
            io.abort()  # loads and stores may still be queued: let none touch a page the caller gives back
            raise
        return logits, io.load_wait_s, io.store_wait_s


class MessengerSink:
    """Streams a prefill's KV to a decode node through a `Messenger` push, one layer per part.

    Args:
        messenger: the prefill node's messenger (over the same cache as the engine).
        peer: the decode node's peer name.
        num_layers: the model's layers (the number of parts each block is cut into).
        timeout_s: for the final commit at the peer.
    """

    def __init__(self, messenger: Messenger, peer: str, *, num_layers: int, timeout_s: float = 30.0) -> None:
        self.messenger, self.peer, self.num_layers, self.timeout_s = messenger, peer, num_layers, timeout_s
        self._push: Push | None = None
        self.committed: tuple[BlockKey, ...] = ()

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        self._push = self.messenger.push(keys, self.peer, parts=self.num_layers)

    def layer_ready(self, layer: int) -> None:
        assert self._push is not None, "layer_ready before begin"
        self._push.send_part(layer)

    def end(self) -> None:
        assert self._push is not None, "end before begin"
        self.committed = self._push.finish(self.timeout_s)

    def abort(self) -> None:
        if self._push is not None:
            self._push.abort()
