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
   `Messenger`, one layer per part). A push ships first-tier pages only, so in a
   batch that streams every block of a prompt is brought there: a prefix block
   that its read left on a lower tier (`promote_after` other than 1, say) is
   copied up (removed there, reserved and committed in the first tier), and a
   block the prefill computes that is cached on a lower tier is overwritten (a
   fresh reservation its computation fills: the bytes are the same, so no read is
   needed); one cached in the first tier, and each new one once committed, is
   pinned until the push ends. (A lower-tier block another holder pins cannot
   move: its push still fails.) A block moves up only once a first-tier page is
   held for it, so a first tier whose every page is pinned leaves the block where
   it is (the prefill then fails with CapacityError, as for a new block).
6. A caller's `cancelled` flag (its client left) is asked before each chunk: a
   cancelled prefill stops there, within one chunk's time, as a failed one
   does (the stream aborts, nothing is committed).

Steps 1, 2 and the commit are the engine's; step 3 is a `ForwardPass`: the
whole model in this process (`ModelForward`, the default when the engine is
given a `LlamaModel`), or any other computation of the same KV — a chunked
pipeline group across processes (the example cluster's `GroupForward`) — so
the cache choreography exists once.

Invariants: a prefill leaves no pin and no reservation behind, on success,
error or cancellation; a reserved page is committed only once all its layers are stored.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import attrs
import torch

from mooncake._checks import int_at_least, require_iterable
from mooncake.cache.hashing import BlockHasher, reusable_prefix_tokens
from mooncake.cache.pool import Buffer
from mooncake.cache.tiered import TieredCache
from mooncake.engine.attention import prefill_attention_into
from mooncake.engine.config import ModelConfig, check_callback, check_instance, switch
from mooncake.engine.kv import KvLayout
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.engine.model import Attend, LlamaModel, token_ids
from mooncake.engine.sampling import Sampler, SamplingParams, rows_logprobs
from mooncake.errors import (
    BlockPinnedError,
    Cancelled,
    CapacityError,
    ConfigError,
    EngineError,
    InvalidRequestError,
    TransferError,
    UnknownBlockError,
)
from mooncake.sched.cost import DEFAULT_CHUNK_TOKENS
from mooncake.transfer.messenger import Messenger, Push
from mooncake.types import BLOCK_KEY_LIMIT, BlockKey, prefix_reusable

__all__ = [
    "ForwardPass",
    "KvBuffers",
    "KvSink",
    "MessengerSink",
    "ModelForward",
    "PrefillConfig",
    "PrefillEngine",
    "PrefillResult",
]


_NAMED_KEYS = 8  # blocks an error names (a long prompt's push has thousands)
# The key of the scratch reservation that holds a first-tier page while a block moves up (`_move_up`): invisible,
# never committed. No 64- or 128-bit hasher makes it; a SHA-256 key equal to it only keeps that block where it is.
_ROOM_KEY = BlockKey(BLOCK_KEY_LIMIT - 1)

# One prompt's (K, V) buffers, one pair per layer, each [tokens, kv_heads, head_dim].
KvBuffers = list[tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable  # the engine refuses, by name, a sink without these methods
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

    chunk_tokens: int = attrs.field(default=DEFAULT_CHUNK_TOKENS, validator=int_at_least(1))
    layerwise: bool = attrs.field(default=True, validator=switch)
    store: bool = attrs.field(default=True, validator=switch)


@attrs.frozen(kw_only=True)
class PrefillResult:
    """What a prefill produced.

    Attributes:
        keys: the prompt's block keys (the partial last block included).
        first_token: the token sampled from the last position's logits.
        first_logprobs: its log-probabilities, where the request's sampling asks for them (None otherwise).
        prompt_logprobs: where the sampling's `prompt_logprobs` asks, the log-probabilities of prompt tokens
            1..n-1, each given the tokens before it (token 0 has none); None otherwise.
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
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class ForwardPass(Protocol):
    """A prefill's computation of a prompt's KV and last logits, after a cached prefix.

    `run(ids, kv, io)` fills rows [io.prefix_tokens, len(ids)) of every layer's (K, V) buffers in `kv`
    (rows before hold the prefix once `io.wait_for_prefix(layer)` returns), calls `io.store(layer, start,
    end)` for rows as they become final, and returns the last position's float logits on the CPU. It must
    give the bytes one process's forward pass gives. `cancelled` (None: never) is asked before each chunk; True
    stops the run with `mooncake.errors.Cancelled` (the rows after are not filled). A forward pass without the
    parameter still serves: the engine then asks the flag once, before the run.
    """

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def run(
        self,
        ids: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        io: LayerwiseKvIo,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Compute the new rows of every layer through `io`; the last position's logits."""
        ...


def _check_prompt_options(sampling: object, sink: object, *, index: int | None = None) -> None:
    """Refuse a prompt's `sampling` that is no `SamplingParams` or `sink` that is no `KvSink` (None is either's
    default) with an InvalidRequestError naming it (in a batch, as `sampling[i]` or `sinks[i]`): else a bare
    AttributeError once the prefill holds pins and pages."""
    at = "" if index is None else f"[{index}]"
    check_instance(f"sampling{at}", sampling, SamplingParams, error=InvalidRequestError)
    check_instance("sink" if index is None else f"sinks{at}", sink, KvSink, error=InvalidRequestError)


def _takes_keyword(function: Callable[..., object], name: str) -> bool:
    """Whether `function` accepts the keyword argument `name` (by name, or through **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): assume the plain call only
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


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

    def run(
        self,
        ids: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        io: LayerwiseKvIo,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        return self.run_many([(ids, kv, io)], cancelled=cancelled)[0][0]

    def run_many(
        self,
        prompts: Sequence[tuple[torch.Tensor, KvBuffers, LayerwiseKvIo]],
        *,
        scores: Sequence[int | None] = (),
        cancelled: Callable[[], bool] | None = None,
    ) -> list[tuple[torch.Tensor, tuple[TokenLogprobs, ...] | None]]:
        """`run` of several prompts, their uncached tokens packed into shared passes; each prompt's logits, and
        its prompt log-probabilities where `scores` (one per prompt; none: no prompt's) gives a count k.
        `cancelled` is asked before each pass (not once the last is done): True stops the run there (`Cancelled`),
        as a server's scheduler drops an aborted request at its next step.

        Each pass takes up to `chunk_tokens` tokens, prompt after prompt in order (a prompt may
        continue in the next pass), and runs them through every layer as one [T, hidden] batch:
        the matrix products are shared, attention and RoPE positions stay per prompt (each piece
        attends to its own prefix and earlier pieces only). One prompt's passes are `run`'s chunks.
        A scored prompt (computed from its first token: no prefix) has each position's logits taken
        in its pass, scoring the token after it (`rows_logprobs`): a pass's rows at a time, never the
        whole prompt's [n, vocab] at once.
        """
        model = self.model
        cursor = [io.prefix_tokens for _, _, io in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        counts = list(scores) or [None] * len(prompts)
        scored: list[list[TokenLogprobs]] = [[] for _ in prompts]
        for count, (_, _, io) in zip(counts, prompts, strict=True):
            if count is not None and io.prefix_tokens:
                raise InvalidRequestError("a prompt scored for its log-probabilities is computed whole: no prefix")
        while True:
            pieces: list[tuple[int, int, int]] = []  # (prompt, start, end)
            budget = self.chunk_tokens
            for i, (ids, _, _) in enumerate(prompts):
                if budget and cursor[i] < ids.shape[0]:
                    end = min(ids.shape[0], cursor[i] + budget)
                    pieces.append((i, cursor[i], end))
                    budget -= end - cursor[i]
                    cursor[i] = end
            if not pieces:
                break
            if cancelled is not None and cancelled():
                done = sum(cursor) - sum(end - start for _, start, end in pieces)
                total = sum(ids.shape[0] for ids, _, _ in prompts)
                raise Cancelled(f"prefill cancelled with {done} of its {total} prompt tokens computed or cached")
            x = model.embed(torch.cat([prompts[i][0][start:end] for i, start, end in pieces]))
            cos, sin = model.rope(torch.cat([torch.arange(start, end) for _, start, end in pieces]))
            for index, layer in enumerate(model.layers):
                attends = []
                for i, start, end in pieces:
                    prompts[i][2].wait_for_prefix(index)
                    k, v = prompts[i][1][index]
                    attends.append(prefill_attention_into(k, v, start, end))
                x = layer(x, cos, sin, attends[0] if len(attends) == 1 else _packed(attends, pieces))
                for i, start, end in pieces:
                    prompts[i][2].store(index, start, end)
            row = 0
            for i, start, end in pieces:
                ids, count = prompts[i][0], counts[i]
                if count is not None and start + 1 < ids.shape[0]:  # positions start.. score the tokens after them
                    rows = min(end, ids.shape[0] - 1) - start
                    scoring = model.logits(x[row : row + rows])
                    scored[i] += rows_logprobs(scoring, ids[start + 1 : start + 1 + rows].tolist(), count)
                row += end - start
                if end == ids.shape[0]:
                    last[i] = x[row - 1]
        outs = list(model.logits(torch.stack([h for h in last if h is not None])).cpu())
        return [(out, None if c is None else tuple(s)) for out, c, s in zip(outs, counts, scored, strict=True)]


def _packed(attends: list[Attend], pieces: list[tuple[int, int, int]]) -> Attend:
    """One `attend` over packed pieces: each piece's rows through its own attend, the results in order."""
    sizes = [end - start for _, start, end in pieces]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = zip(attends, torch.split(q, sizes), torch.split(k, sizes), torch.split(v, sizes), strict=True)
        return torch.cat([one(qp, kp, vp) for one, qp, kp, vp in parts])

    return attend


class PrefillEngine:
    """Prefills prompts over one node's tiered cache, with one model or another `ForwardPass`.

    Args:
        model: the whole model (run by `ModelForward` in chunks of `config.chunk_tokens`), or a forward pass
            (a pipeline group's, say).
        cache: the node's tiered cache; its page size must be the layout's.
        hasher: the block keys' namespace; its block size is the KV page's.
        config: options.

    Raises:
        ConfigError: a `cache`, `hasher` or `config` of another type (naming it), a model that is a pipeline stage,
            or cache pages too small for a KV block.

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
        check_instance("cache", cache, TieredCache, error=ConfigError, optional=False)
        check_instance("hasher", hasher, BlockHasher, error=ConfigError, optional=False)
        check_instance("config", config, PrefillConfig, error=ConfigError)
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
        self._closed = False
        # A ForwardPass written before `cancelled` existed takes no flag: it is asked once, before the run, instead.
        self._run_takes_flag = _takes_keyword(self.forward.run, "cancelled")

    def close(self) -> None:
        self._closed = True
        self._loader.shutdown()
        self._storer.shutdown()

    def __enter__(self) -> PrefillEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prefill

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        sampling: SamplingParams | None = None,
        sink: KvSink | None = None,
        cancelled: Callable[[], bool] | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Prefill `tokens`, reusing cached prefix KV and storing the new KV; with a `cache_salt` (vLLM's) its
        blocks are keyed in that salt's namespace (`BlockHasher.salted`): only prompts of the same salt share them.

        Raises:
            InvalidRequestError: no tokens, ids outside the vocabulary, more tokens than the model's
                `max_context_tokens`, or a `sampling`, `sink` or `cancelled` of another kind (naming it).
            EngineError: the engine is closed, or the last logits hold a NaN (no block is committed).
            Cancelled: `cancelled` answered True (`prefill_batch` says when it is asked).
            TransferError: the sink's `end` failed (`MessengerSink`: the peer did not commit a block the push sent).
        """
        _check_prompt_options(sampling, sink)  # named as this call's own arguments, not the batch's lists
        return self.prefill_batch(
            [tokens], sampling=[sampling], sinks=[sink], cancelled=cancelled, cache_salts=[cache_salt]
        )[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        sampling: Sequence[SamplingParams | None] | None = None,
        sinks: Sequence[KvSink | None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        cache_salts: Sequence[str | None] | None = None,
    ) -> list[PrefillResult]:
        """`prefill` of several prompts at once: each as `prefill` would, their uncached tokens sharing passes.

        With a `ModelForward` the prompts' new tokens are packed into passes of up to
        `chunk_tokens` (`ModelForward.run_many`), so short prompts share their matrix
        products as a batched server's prefill does; other forward passes run them one
        after another. A prompt whose prefix another prompt of the batch computes does not
        reuse it (its blocks are committed at the end). Every prompt and its params are checked
        before anything runs, so a bad one anywhere leaves the batch undone, whatever the forward
        pass. With a `ModelForward` the batch then succeeds or fails as one; one prompt at a time,
        a failure while running (a pipeline stage's, a full cache, a cancellation) keeps the prompts
        done before it, committed and streamed. Each result's `seconds` is the batch's (one at a
        time: its own prompt's).

        Cancellation: `cancelled` (a caller's flag, read on this thread) is asked by the forward pass before each
        chunk (a `ModelForward`'s pass of `chunk_tokens`; a pipeline group's chunk, at stage 0). True stops the
        batch there as a failure does: the KV streams abort, the reserved pages and pins are given back, no block
        is committed.

        Raises:
            InvalidRequestError: a prompt with no tokens, ids outside the vocabulary or more tokens than the
                model's `max_context_tokens`, params naming a token outside it, lists that are not iterable or of
                another length than `prompts`, or an element of `sampling` or `sinks`, or `cancelled`, of another
                kind (each naming it; nothing is done, for any forward pass).
            EngineError: the engine is closed (its loader and store threads are gone; nothing is done), or a
                prompt's last logits hold a NaN (`Sampler.next_token`; nothing of the batch is kept).
            Cancelled: `cancelled` answered True (nothing of the batch is kept; where the forward pass runs the
                prompts one at a time, those done before are kept, committed and streamed).
            TransferError: a sink's `end` failed (`MessengerSink`: the peer did not commit a block the push sent);
                the blocks stay committed here, and the streams after it abort.
        """
        if self._closed:  # else executor's RuntimeError, once the prefix is pinned and pages reserved
            raise EngineError("the prefill engine is closed")
        started = time.perf_counter()
        prompts = list(require_iterable("prompts", prompts, error=InvalidRequestError))
        count = len(prompts)
        params = (
            [None] * count
            if sampling is None
            else list(require_iterable("sampling", sampling, error=InvalidRequestError))
        )
        outs = [None] * count if sinks is None else list(require_iterable("sinks", sinks, error=InvalidRequestError))
        salts = (
            [None] * count
            if cache_salts is None
            else list(require_iterable("cache_salts", cache_salts, error=InvalidRequestError))
        )
        if not count or len(params) != count or len(outs) != count or len(salts) != count:
            raise InvalidRequestError(
                "prefill_batch needs one or more prompts, and one sampling, sink and cache salt per prompt"
            )
        for i, (sp, sink) in enumerate(zip(params, outs, strict=True)):
            _check_prompt_options(sp, sink, index=i)
        check_callback("cancelled", cancelled, error=InvalidRequestError)
        hashers = [self.hasher.salted(salt) for salt in salts]  # a bad salt refused before anything is held
        for sp in params:
            if sp is not None:
                sp.check_vocabulary(self.forward.model_config.vocab_size)  # before anything is held
        scores = [None if sp is None else sp.prompt_logprobs for sp in params]
        if not isinstance(self.forward, ModelForward) and any(k is not None for k in scores):
            raise InvalidRequestError(
                "prompt log-probabilities need the whole model in this process (a pipeline's last stage returns the "
                "last position's logits only)"
            )
        # Every prompt checked before any runs: one at a time, a bad last prompt would come after the others were
        # committed and streamed.
        ids = [self._ids(tokens) for tokens in prompts]
        for one in ids:  # a checkpoint's bound (its accepted sliding window's): past it the logits would be wrong
            self.forward.model_config.check_context_tokens(one.shape[0])
        if count > 1 and not isinstance(self.forward, ModelForward):  # nothing to share: one at a time
            return [
                self.prefill(p, sampling=sp, sink=sk, cancelled=cancelled, cache_salt=salt)
                for p, sp, sk, salt in zip(prompts, params, outs, salts, strict=True)
            ]
        block = self.layout.block_tokens
        keys = [hasher.block_keys(one.numpy()) for hasher, one in zip(hashers, ids, strict=True)]
        prefixes: list[int] = []  # blocks pinned, per prompt so far
        reserved: list[BlockKey] = []
        held: list[BlockKey] = []  # cached first-tier blocks the prompts compute, pinned for their pushes
        streaming: list[KvSink] = []
        # A push ships first-tier pages only: in a batch that streams, every block it pins or computes is brought
        # there (the whole batch's, so that no prompt's pin holds a block another's push needs on a lower tier).
        lift = any(sink is not None for sink in outs)
        try:
            for one, ks, k in zip(ids, keys, scores, strict=True):
                reusable = reusable_prefix_tokens(one.shape[0], len(ks), block) // block if prefix_reusable(k) else 0
                prefixes.append(self._pin_prefix(ks, max_blocks=reusable, lift=lift))
            pages = []
            for one, ks, prefix_blocks in zip(ids, keys, prefixes, strict=True):
                prompt_pages, prompt_reserved = self._reserve(
                    ks, prefix_blocks, one.shape[0], held=held if lift else None
                )
                pages.append(prompt_pages)
                reserved += prompt_reserved
            for sink, ks in zip(outs, keys, strict=True):
                if sink is not None:
                    sink.begin(ks)
                    streaming.append(sink)
            runs = self._forward(
                [
                    (one, ks[:prefix_blocks], ps, sink)
                    for one, ks, prefix_blocks, ps, sink in zip(ids, keys, prefixes, pages, outs, strict=True)
                ],
                scores,
                cancelled,
            )
            # Drawn before anything is committed or ends its stream: a draw that fails (a model's NaN logits, whose
            # KV is NaN too) then fails the batch as a failed pass does, leaving no block of it in the cache.
            samplers, firsts = [], []
            for one, sp, (logits, *_) in zip(ids, params, runs, strict=True):
                sp = sp or SamplingParams()
                samplers.append(Sampler(sp, prompt=one.tolist() if sp.needs_prompt else None))
                firsts.append(samplers[-1].next_token(logits))
            for key in reserved:
                self.cache.commit(key)
                if lift:  # the commit ends the reservation's pin: held where the push reads it until the push ends
                    with contextlib.suppress(UnknownBlockError):
                        self.cache.pin(key)
                        held.append(key)
            reserved = []
            while streaming:
                streaming.pop(0).end()  # end() finishes or cleans up by itself
        except BaseException:
            for sink in streaming:
                with contextlib.suppress(Exception):  # the original error is the one to report
                    sink.abort()
            raise
        finally:
            for key in reserved:
                self.cache.abort(key)
            for ks, prefix_blocks in zip(keys, prefixes, strict=False):
                for key in ks[:prefix_blocks]:
                    self._unpin(key)
            for key in held:
                self._unpin(key)
        seconds = time.perf_counter() - started
        results = []
        for one, ks, prefix_blocks, ps, sampler, first, (logits, scored, load_wait, store_wait) in zip(
            ids, keys, prefixes, pages, samplers, firsts, runs, strict=True
        ):
            prefix = prefix_blocks * block
            results.append(
                PrefillResult(
                    keys=ks,
                    first_token=first,
                    first_logprobs=sampler.logprobs_of(logits, first),
                    prompt_logprobs=scored,
                    logits=logits,
                    prefix_tokens=prefix,
                    computed_tokens=one.shape[0] - prefix,
                    stored_keys=tuple(k for k, page in zip(ks[prefix_blocks:], ps, strict=True) if page is not None),
                    seconds=seconds,
                    load_wait_s=load_wait,
                    store_wait_s=store_wait,
                )
            )
        return results

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return token_ids(tokens, self.forward.model_config.vocab_size)

    def _pin_prefix(self, keys: tuple[BlockKey, ...], *, max_blocks: int, lift: bool = False) -> int:
        """Pin the longest cached run of leading blocks (at most `max_blocks`); its length. With `lift` (the KV
        streams) each is first brought to the first tier (`_lift`), and the run ends at one that cannot be."""
        count = 0
        try:
            for i, key in enumerate(keys[:max_blocks]):
                self.cache.touch(key)  # a read: promotes a lower-tier block by the cache's policy
                if lift and not self._lift(key, parent=keys[i - 1] if i else None, position=i):
                    break
                try:
                    self.cache.pin(key)
                except UnknownBlockError:
                    break
                if lift and not self._in_first_tier(key):  # demoted between its lift and the pin: computed instead
                    self._unpin(key)
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

    def _in_first_tier(self, key: BlockKey) -> bool:
        location = self.cache.location(key)
        return location is not None and location.tier == self.cache.pools[0].tier

    def _lift(self, key: BlockKey, *, parent: BlockKey | None, position: int) -> bool:
        """Whether cached `key` is in the first tier, copied up from a lower tier if need be (a push ships
        first-tier pages only, and the cache's own promotion follows its `promote_after`).

        The copy replaces the block: its verified bytes are read, and `_move_up` gives a first-tier page for it
        in place of the lower-tier copy, filled and committed here, so the cache holds one copy throughout (its
        usual invariants) and announces the move as a removal and a store. False where the block is not cached
        (or fails verification), or cannot move: another holder pins it where it is (a pinned block never moves),
        or every first-tier page is pinned (the block stays where it is; its computation then finds no room).
        """
        location = self.cache.location(key)
        if location is None or not location.ready:
            return False
        if location.tier == self.cache.pools[0].tier:
            return True
        data = self.cache.get(key)  # a verified copy (or, where this read promotes it, the first-tier page)
        if data is None:
            return False
        try:
            self.cache.pin(key)  # where it is now: it stays there until `_move_up` has room for it
        except UnknownBlockError:
            return False  # evicted meanwhile: computed instead
        if self._in_first_tier(key):  # promoted by the read
            self._unpin(key)
            return True
        try:
            page = self._move_up(key, location.length, parent=parent, position=position)
        except CapacityError:
            return False
        if page is None:  # another holder pins it, or it is cached or being filled again by another writer
            return self._in_first_tier(key)
        try:
            self.layout.page_kv(page).copy_(self.layout.page_kv(data))
        except BaseException:
            self.cache.abort(key)
            raise
        self.cache.commit(key)
        return True

    def _reserve(
        self, keys: tuple[BlockKey, ...], first: int, n: int, *, held: list[BlockKey] | None = None
    ) -> tuple[list[Buffer | None], list[BlockKey]]:
        """A writable page (or None: not ours to fill) per block from `first` on, and the keys reserved.

        With `held` (the KV streams: its push ships first-tier pages only), a block already cached is pinned where
        it is if that is the first tier (its key appended to `held`; the caller unpins it), and overwritten if it
        is lower: removed there and reserved again, as the computation that fills the page gives the same bytes
        (cheaper than copying it up, and the cache keeps one copy). One being filled by another writer is left to
        it (its page is in the first tier).
        """
        pages: list[Buffer | None] = []
        reserved: list[BlockKey] = []
        if not self.config.store:
            return [None] * (len(keys) - first), reserved
        block = self.layout.block_tokens
        try:
            for i in range(first, len(keys)):
                tokens = min(block, n - i * block)
                length, parent = self.layout.block_bytes(tokens), keys[i - 1] if i else None
                page = self.cache.reserve(keys[i], length, parent=parent, position=i)
                if page is None and held is not None:
                    page = self._overwrite_if_lower(keys[i], length, parent=parent, position=i, held=held)
                pages.append(page)
                if page is not None:
                    reserved.append(keys[i])
        except BaseException:  # e.g. CapacityError: the caller never sees these, so give them back here
            for key in reserved:
                self.cache.abort(key)
            raise
        return pages, reserved

    def _overwrite_if_lower(
        self, key: BlockKey, length: int, *, parent: BlockKey | None, position: int, held: list[BlockKey]
    ) -> Buffer | None:
        """For a block `reserve` found cached: pinned (appended to `held`) if in the first tier and None, else a
        fresh first-tier reservation in place of its lower-tier copy (`_move_up`; None if another holder pins that).

        Raises:
            CapacityError: every first-tier page is pinned; the lower-tier copy stays cached.
        """
        try:
            self.cache.pin(key)
        except UnknownBlockError:
            return None  # being filled by another writer, in a first-tier page (or gone meanwhile)
        if self._in_first_tier(key):
            held.append(key)
            return None
        return self._move_up(key, length, parent=parent, position=position)

    def _move_up(self, key: BlockKey, length: int, *, parent: BlockKey | None, position: int) -> Buffer | None:
        """A first-tier reservation of `key` in place of its lower-tier copy, which the caller has pinned (this
        call takes that pin back): the page for the caller to fill and commit, or abort. None, the copy left where
        it is, where another holder pins it (a pinned block never moves); None too where the block is cached or
        being filled again meanwhile, by another writer.

        The room comes first: a scratch reservation holds a first-tier page while the copy is removed, and is given
        back for the block's own. Removed first, a copy whose reservation then found no room (every first-tier
        page pinned) would be in no tier at all, though only moving. The caller's pin keeps the copy where it is
        while the room is made (its demotions may evict from the lower tier). (The engine is the cache's one
        writer; only a reader's promotion, in the instant between the scratch's abort and the block's reserve,
        could still take that page.)

        Raises:
            CapacityError: every first-tier page is pinned; the copy stays where it is.
        """
        first = self.cache.pools[0].tier.name
        try:
            room = self.cache.reserve(_ROOM_KEY, 0)
        except CapacityError as error:  # its message names the scratch key (the cause, chained, says why)
            location = self.cache.location(key)
            where = "" if location is None else f", it stays in {location.tier.name}"
            raise CapacityError(
                f"no room to move block {key} up to {first}{where}: every {first} page holds a pinned block (or a"
                " prefix no lower tier can take)"
            ) from error
        finally:
            self._unpin(key)
        if room is None:  # the scratch key is a cached block's: it does not move
            return None
        try:
            self.cache.remove(key)
        except BlockPinnedError:
            return None  # another holder reads it where it is: it cannot move
        except UnknownBlockError:
            pass  # evicted meanwhile: its bytes are still the caller's to write
        finally:
            self.cache.abort(_ROOM_KEY)
        return self.cache.reserve(key, length, parent=parent, position=position)

    # ------------------------------------------------------------------ the forward pass

    def _forward(
        self,
        prompts: list[tuple[torch.Tensor, tuple[BlockKey, ...], list[Buffer | None], KvSink | None]],
        scores: list[int | None],
        cancelled: Callable[[], bool] | None,
    ) -> list[tuple[torch.Tensor, tuple[TokenLogprobs, ...] | None, float, float]]:
        """Per prompt (ids, prefix keys, pages, sink): its last position's logits, its prompt log-probabilities
        (where its `scores` count is set; a `ModelForward` only) and load and store waits; the pages hold the new
        KV."""
        forward, config = self.forward, self.forward.model_config
        runs: list[tuple[torch.Tensor, KvBuffers, LayerwiseKvIo]] = []
        for ids, prefix_keys, pages, sink in prompts:
            shape = (ids.shape[0], config.num_kv_heads, config.head_dim)
            kv = [
                (
                    torch.empty(shape, dtype=forward.dtype, device=forward.device),
                    torch.empty(shape, dtype=forward.dtype, device=forward.device),
                )
                for _ in range(config.num_layers)
            ]
            io = LayerwiseKvIo(
                cache=self.cache,
                layout=self.layout,
                k_buffers=[k for k, _ in kv],
                v_buffers=[v for _, v in kv],
                prefix_keys=prefix_keys,
                pages=pages,
                on_layer_final=None if sink is None else sink.layer_ready,
                layerwise=self.config.layerwise,
                loader=self._loader,
                storer=self._storer,
            )
            runs.append((ids, kv, io))
        try:
            for _, _, io in runs:
                io.start_loading()
            if isinstance(forward, ModelForward):
                outs = forward.run_many(runs, scores=scores, cancelled=cancelled)
            else:
                assert len(runs) == 1  # prefill_batch runs others one prompt at a time, unscored
                if cancelled is not None and self._run_takes_flag:
                    run = forward.run(*runs[0], cancelled=cancelled)
                else:
                    if cancelled is not None and cancelled():
                        raise Cancelled("prefill cancelled before its forward pass started")
                    run = forward.run(*runs[0])
                outs = [(run, None)]
            for _, _, io in runs:
                io.finish()
        except BaseException:
            for _, _, io in runs:
                io.abort()  # loads and stores may still be queued: let none touch a page the caller gives back
            raise
        return [
            (out, scored, io.load_wait_s, io.store_wait_s) for (out, scored), (_, _, io) in zip(outs, runs, strict=True)
        ]


class MessengerSink:
    """Streams a prefill's KV to a decode node through a `Messenger` push, one layer per part.

    Args:
        messenger: the prefill node's messenger (over the same cache as the engine).
        peer: the decode node's peer name.
        num_layers: the model's layers (the number of parts each block is cut into).
        timeout_s: for the final commit at the peer.

    `end` raises `TransferError` unless the peer committed every block the push sent (`Push.keys`: those it
    reserved; one it held already or had no room for is not sent): a part that failed mid-stream, or a block that
    failed the peer's checksum, would otherwise pass as streamed and be found missing at the hand-off.
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
        """Finish the push; `committed` is what the peer committed.

        Raises:
            TransferError: a block the push sent was not committed (named, with the count), or `Push.finish`'s.
        """
        assert self._push is not None, "end before begin"
        self.committed = self._push.finish(self.timeout_s)
        committed = set(self.committed)
        missing = [key for key in self._push.keys if key not in committed]
        if missing:
            named = ", ".join(map(str, missing[:_NAMED_KEYS])) + (" ..." if len(missing) > _NAMED_KEYS else "")
            raise TransferError(
                f"the KV push to {self.peer} committed {len(self._push.keys) - len(missing)} of the"
                f" {len(self._push.keys)} blocks it sent; not committed: {named}"
            )

    def abort(self) -> None:
        if self._push is not None:
            self._push.abort()
