"""The decode engine: continuous batching over KV that prefill left in the local cache.

A request joins when its prompt's KV pages are in the node's tiered cache (a
prefill streamed them there): `try_join` asks the decode rule, copies the KV
into a free slot and emits the first token (the prefill's). Each `step()`
decodes one token for every active request: embeds their last tokens, and per
layer writes the new K and V at each request's own position and attends over
each request's own context (`decode_attention` over the slots, ragged lengths);
then draws every request's token before any request moves on, retires the
requests that reached their `max_new_tokens` or, from their `min_tokens` on,
sampled one of their `SamplingParams.stop_token_ids` (the model's EOS; emitted
as the last token), and only then reports every token to its request's
callback: the batch is whole whatever a draw or a callback does (as vLLM
applies a step's output as a whole).
A request whose draw fails (NaN logits, params that leave no token) is dropped
as a cancelled one, the others take their tokens, and the error, naming the
request, is raised after the callbacks. A callback may `cancel` any request of
the step (one not yet called back gets no token of that step, its last
included); a callback that raises has its request dropped, as a cancelled one
(its consumer failed), the other callbacks still run, and its error is raised
after them.

KV lives in per-layer slot tensors `[max_batch_size, kv_heads, max_context_tokens,
head_dim]`; active requests occupy slots 0 … B − 1 (a retired request's slot is
filled by moving the last one in), so a step works on one contiguous prefix.
Attention reads every slot up to the batch's longest context: a slot's rows past
its own are masked, yet V's are still multiplied (by weight 0, and 0 × NaN is
NaN), so they must be finite. A slot's rows at or past `_filled[slot]` are kept
zero: a request that leaves zeroes the rows it wrote past its successor's
context when that one moves in, a join those past its prompt, so the cost is
that of rows once written, never a pass over the slot per step (as masking V in
the kernel would be, and in each kernel).

The check on join (paper §5: the decode instance's own check, after which a
rejection wastes the prefill) is the decode rule every scheduler and simulator
asks, `sched.join.check_join`, on the engine's `limits` (a slot's
`max_context_tokens`, never above the model's, `max_batch_size` slots, the KV budget) and its `load()`
(active requests, the KV a step reads, Σ prompt + max_new_tokens reserved):
context too long, batch full, KV budget, and with a TBT SLO and a step model
the predicted step time with the request added. A request whose only token is
its prefill's (`max_new_tokens == 1`, or a first token that stops it) is
finished at join and takes no slot, so only its context is checked.

Invariants: slots 0 … B − 1 hold exactly the active requests; each request's
context length = prompt + tokens emitted − 1; reserved tokens = Σ (prompt +
max_new_tokens) ≤ budget; every slot's K and V rows from `_filled[slot]` on are
zero, and an active request's context ≤ `_filled` ≤ context + 1 (its slot's row
at its context is written by a step that then failed); every request ends at
most once (its last token has `finished=True`), exactly once unless dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from mooncake._checks import int_at_least, is_int, non_negative, require_int, shown
from mooncake.cache.tiered import TieredCache
from mooncake.engine.attention import decode_attention
from mooncake.engine.config import check_callback, check_instance
from mooncake.engine.kv import KvLayout
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.engine.model import LlamaModel, token_ids
from mooncake.engine.sampling import Sampler, SamplingParams
from mooncake.engine.tokenizer import can_stop_at
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError, UnknownBlockError
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict, check_join
from mooncake.sched.step import StepModel
from mooncake.types import BlockKey, RequestId, block_count, check_request_id, check_token_count

__all__ = ["DecodeConfig", "DecodeEngine", "TokenEvent", "TokenStream"]


@attrs.frozen(kw_only=True)
class DecodeConfig:
    """Options of a decode engine.

    Attributes:
        max_batch_size: slots.
        max_context_tokens: prompt + output tokens a slot holds.
        kv_budget_tokens: Σ (prompt + max_new_tokens) of active requests allowed
            (default: every slot full); the decode rule's KV capacity.
        tbt_slo_s: the TBT SLO of the decode rule's check (None: no check).
        attention: the decode attention kernel (the benchmark swaps in SDPA).
    """

    max_batch_size: int = attrs.field(default=8, validator=int_at_least(1))
    max_context_tokens: int = attrs.field(default=2048, validator=int_at_least(2))
    kv_budget_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(0)))
    tbt_slo_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative))
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = decode_attention

    @property
    def budget_tokens(self) -> int:
        return self.max_batch_size * self.max_context_tokens if self.kv_budget_tokens is None else self.kv_budget_tokens


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token: the `index`-th output token of `request_id`, with its log-probabilities where the
    request's sampling asks for them."""

    request_id: RequestId
    token: int
    index: int
    finished: bool
    logprobs: TokenLogprobs | None = None


@attrs.define(eq=False)
class _Active:
    request_id: RequestId
    prompt_tokens: int
    max_new_tokens: int
    sampler: Sampler
    on_token: Callable[[TokenEvent], None] | None
    last_token: int
    emitted: int = 1
    done: bool = False  # its last token is out: `max_new_tokens` reached or a stop token sampled
    dropped: bool = False  # cancelled, or its callback failed: it gets no further token

    def ends_with(self, token: int) -> bool:
        """Whether `token`, just emitted as the `emitted`-th, is the request's last (the one rule): `max_new_tokens`
        reached, or a stop token where `can_stop_at` lets one end it (from `min_tokens` tokens on, as vLLM's
        `check_stop`: never before, even where the sampler could not hold it back, every allowed token a stop
        token). The gateway's text stream applies the same `can_stop_at`, so both see the same end."""
        params = self.sampler.params
        return self.emitted >= self.max_new_tokens or (
            token in params.stop_token_ids and can_stop_at(self.emitted, params.min_tokens)
        )

    @property
    def context(self) -> int:  # KV positions filled; the next token is fed at this position
        return self.prompt_tokens + self.emitted - 1


class DecodeEngine:
    """Continuous-batching decode of one model over one node's tiered cache.

    Args:
        model: the whole model.
        cache: the node's tiered cache, where prefill puts the requests' KV pages.
        block_tokens: tokens per KV page (the block hasher's block size).
        config: options (default: `DecodeConfig()`, its slot no longer than the model's `max_context_tokens`).
        step_model: predicts step times for the TBT check (required when `config.tbt_slo_s` is set).

    `limits` is what the engine holds, as the decode rule (`sched.join`) reads it:
    the KV budget, its slots and a slot's context. A slot is never longer than the
    model's `ModelConfig.max_context_tokens` (a checkpoint's bound), so the rule's
    context check holds every request to it.

    Raises:
        ConfigError: a pipeline stage for a model, a `cache` or `config` of another type (naming it),
            `tbt_slo_s` without a step model, or a `config.max_context_tokens` above the model's
            `max_context_tokens`.

    Not thread-safe: one thread calls `try_join` and `step`.
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: TieredCache,
        *,
        block_tokens: int,
        config: DecodeConfig | None = None,
        step_model: StepModel | None = None,
    ) -> None:
        if not (model.has_embedding and model.has_head):
            raise ConfigError("the decode engine needs the whole model, not a pipeline stage")
        check_instance("cache", cache, TieredCache, error=ConfigError, optional=False)
        check_instance("config", config, DecodeConfig, error=ConfigError)
        self.model, self.cache = model, cache
        bound = model.config.max_context_tokens  # a checkpoint's (vLLM's max_model_len): None for a preset
        if config is None:  # as vLLM derives max_model_len: the default slot, no longer than the model computes
            config = DecodeConfig()
            if bound is not None and config.max_context_tokens > bound:
                config = attrs.evolve(config, max_context_tokens=bound)
        if bound is not None and config.max_context_tokens > bound:  # as vLLM refuses a max_model_len above it
            raise ConfigError(
                f"max_context_tokens={config.max_context_tokens} exceeds model {shown(model.config.name)}'s "
                f"max_context_tokens={bound} (from the checkpoint's max_position_embeddings, as vLLM refuses a "
                "max_model_len above it)"
            )
        self.config = config
        if self.config.tbt_slo_s is not None and step_model is None:
            raise ConfigError("tbt_slo_s needs a step_model to predict step times")
        self.step_model = step_model
        self.limits = DecodeLimits(
            kv_capacity_tokens=self.config.budget_tokens,
            max_batch_size=self.config.max_batch_size,
            max_context_tokens=self.config.max_context_tokens,
        )
        dtype = str(model.dtype).removeprefix("torch.")
        self.layout = KvLayout(config=model.config, block_tokens=block_tokens, dtype=dtype)
        c, mc = self.config, model.config
        shape = (c.max_batch_size, mc.num_kv_heads, c.max_context_tokens, mc.head_dim)
        self._k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(mc.num_layers)]
        self._v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(mc.num_layers)]
        self._active: list[_Active] = []
        self._filled = [0] * c.max_batch_size  # per slot: rows from here on are zero in every layer's K and V
        # The finished requests of the delivery under way not yet called back (retired: `cancel` finds them here).
        self._finishing: dict[RequestId, _Active] = {}
        self.last_step_s = 0.0

    # ------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def active_ids(self) -> tuple[RequestId, ...]:
        return tuple(a.request_id for a in self._active)

    @property
    def reserved_tokens(self) -> int:
        return sum(a.prompt_tokens + a.max_new_tokens for a in self._active)

    @property
    def context_tokens(self) -> int:
        return sum(a.context for a in self._active)

    def load(self) -> DecodeLoad:
        """The batch as the decode rule counts it: active requests, the KV a step reads, the KV reserved."""
        return DecodeLoad(self.num_active, self.context_tokens, self.reserved_tokens)

    def check_invariants(self) -> None:
        ids = [a.request_id for a in self._active]
        assert len(ids) == len(set(ids)), "a request holds two slots"
        assert len(ids) <= self.config.max_batch_size
        assert self.reserved_tokens <= self.config.budget_tokens
        for a in self._active:
            assert 1 <= a.emitted < a.max_new_tokens, "a finished request is still active"
            assert a.context < self.config.max_context_tokens
        for slot, filled in enumerate(self._filled):
            if slot < len(self._active):
                assert self._active[slot].context <= filled <= self._active[slot].context + 1
            for kc, vc in zip(self._k, self._v, strict=True):
                assert not (kc[slot, :, filled:].any() or vc[slot, :, filled:].any()), f"slot {slot} holds stale KV"

    # ------------------------------------------------------------------ joining

    @torch.inference_mode()
    def try_join(
        self,
        request_id: RequestId,
        keys: Sequence[BlockKey],
        *,
        prompt_tokens: int,
        first_token: int,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
        first_logprobs: TokenLogprobs | None = None,
        prompt: Sequence[int] | None = None,
    ) -> JoinVerdict:
        """Admit a prefilled request into the batch, or say which check of the decode rule refused it.

        The verdict is `check_join(self.limits, self.load(), ...)` with the engine's step
        model and `config.tbt_slo_s` (its `predicted_tbt_s` is set when there is a step
        model). On acceptance the request's first token (the prefill's, with its
        `first_logprobs`) is reported at once; `prompt` (the prompt's token ids) is
        needed only by a repetition penalty (`SamplingParams.needs_prompt`). A
        request with `max_new_tokens == 1`, or whose first token is one of its stop
        tokens (and `min_tokens` at most 1), is then already finished and takes no slot (so
        only its context is checked).
        If `on_token` raises on the first token, the request is dropped again (it holds no slot) and the
        error raised.

        Raises:
            InvalidRequestError: an id that is no request id (`types.check_request_id`) or is decoding already,
                counts that are not integers in [1, 2**40], a first token outside the vocabulary, keys that are no
                sequence or do not cover the prompt, `sampling` that is no `SamplingParams`, an `on_token` that
                cannot be called, `first_logprobs` that is no `TokenLogprobs`, a `prompt` that is no sequence of
                token ids in the vocabulary (`model.token_ids`, the prefill's check), or one missing where the
                sampling needs it or of another length (each naming the field and the value).
            UnknownBlockError: a KV block of the prompt is not in the local cache.
        """
        check_request_id("request_id", request_id)  # hashable: a step's delivery keys its requests by id
        prompt_tokens = check_token_count("prompt_tokens", prompt_tokens)
        max_new_tokens = check_token_count("max_new_tokens", max_new_tokens)
        check_callback("on_token", on_token, error=InvalidRequestError)  # else a bare TypeError at the first token
        check_instance("first_logprobs", first_logprobs, TokenLogprobs, error=InvalidRequestError)
        vocab = self.model.config.vocab_size
        if not is_int(first_token) or not 0 <= first_token < vocab:  # checked here, or every later step fails
            raise InvalidRequestError(f"first_token must lie in [0, {vocab}), got {shown(first_token)}")
        if any(a.request_id == request_id for a in self._active):
            raise InvalidRequestError(f"request {shown(request_id, quote=str)} is already decoding")
        block = self.layout.block_tokens
        try:
            num_keys = len(keys)
        except TypeError:  # None, or an iterator (the copy reads the keys twice)
            raise InvalidRequestError(f"keys must be a sequence of block keys, got {shown(keys)}") from None
        if num_keys != block_count(prompt_tokens, block):
            raise InvalidRequestError(
                f"{num_keys} keys do not cover a {prompt_tokens}-token prompt in {block}-token blocks"
            )
        check_instance("sampling", sampling, SamplingParams, error=InvalidRequestError)  # a dict: at its first use
        sampling = sampling or SamplingParams()
        sampling.check_vocabulary(vocab)
        if prompt is not None:
            try:
                prompt = token_ids(prompt, vocab).tolist()
            except InvalidRequestError as error:
                raise InvalidRequestError(f"prompt {shown(prompt)}: {error}") from None
        if sampling.needs_prompt and (prompt is None or len(prompt) != prompt_tokens):
            got = "none" if prompt is None else f"{len(prompt)} ids"
            raise InvalidRequestError(f"the repetition penalty needs the prompt's {prompt_tokens} token ids, got {got}")
        active = _Active(
            request_id,
            prompt_tokens,
            max_new_tokens,
            # The prefill drew token 0 (`first_token`) from the same stream; the penalties count it.
            Sampler(sampling, position=1, prompt=prompt, output=(first_token,)),
            on_token,
            first_token,
        )
        active.done = active.ends_with(first_token)
        # A request that ends at its first token (a stop token, or max_new_tokens 1) has no other: asked as such,
        # the rule checks only its context (a full batch does not refuse a request that takes no slot).
        verdict = check_join(
            self.limits,
            self.load(),
            prompt_tokens=prompt_tokens,
            output_tokens=1 if active.done else max_new_tokens,
            step_model=self.step_model,
            tbt_slo_s=self.config.tbt_slo_s,
        )
        if not verdict.accepted:
            return verdict
        if not active.done:
            self._copy_kv(len(self._active), keys, prompt_tokens)
            self._active.append(active)
        event = TokenEvent(
            request_id=request_id, token=first_token, index=0, finished=active.done, logprobs=first_logprobs
        )
        self._deliver([(active, event)])
        return verdict

    def _copy_kv(self, slot: int, keys: Sequence[BlockKey], prompt_tokens: int) -> None:
        """Copy the prompt's KV pages into the free `slot`, then zero what an earlier occupant left past them."""
        block = self.layout.block_tokens
        stale = self._filled[slot]
        self._filled[slot] = max(stale, prompt_tokens)  # first: a copy that fails midway leaves the rows it wrote
        pinned: list[BlockKey] = []
        try:
            for key in keys:
                self.cache.pin(key)  # UnknownBlockError when it is not here
                pinned.append(key)
            for b, key in enumerate(keys):
                page = self.cache.get(key)
                if page is None:
                    raise UnknownBlockError(f"KV block {key} failed verification")
                tokens = self.layout.page_tokens(page)
                if tokens != min(block, prompt_tokens - b * block):
                    raise InvalidRequestError(
                        f"KV block {key} holds {tokens} tokens, the prompt needs {min(block, prompt_tokens - b * block)}"
                    )
                kv = self.layout.page_kv(page).to(self.model.device)
                rows = slice(b * block, b * block + tokens)
                for layer in range(self.model.config.num_layers):
                    self._k[layer][slot, :, rows] = kv[layer, 0].transpose(0, 1)
                    self._v[layer][slot, :, rows] = kv[layer, 1].transpose(0, 1)
        finally:
            for key in pinned:
                self.cache.unpin(key)
        self._clear(slot, prompt_tokens, stale)
        self._filled[slot] = prompt_tokens

    def _clear(self, slot: int, start: int, end: int) -> None:
        """Zero rows [start, end) of `slot` in every layer's K and V (see the module's docstring: why)."""
        if start < end:
            for kc, vc in zip(self._k, self._v, strict=True):
                kc[slot, :, start:end] = 0
                vc[slot, :, start:end] = 0

    # ------------------------------------------------------------------ stepping

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Decode one token for every active request; the tokens, in slot order.

        Raises:
            MooncakeError: a request's draw failed (`Sampler.next_token`: an `EngineError` for NaN logits, an
                `InvalidRequestError` for params that leave no token), the first such, its message prefixed
                `request <id>: ` and its `request_id` that id, raised once every callback ran: that request is
                dropped (its slot freed, no token of this step, never `finished`), the others took their tokens.
                Else the first error a callback raised (its request dropped).
        """
        if not self._active:
            return []
        started = time.perf_counter()
        model, active = self.model, self._active
        b = len(active)
        device = model.device
        self._filled[:b] = [a.context + 1 for a in active]  # the rows this step writes, before it writes them
        positions = torch.tensor([a.context for a in active], device=device)
        lengths = positions + 1
        width = int(lengths.max())
        slots = torch.arange(b, device=device)
        x = model.embed(torch.tensor([a.last_token for a in active], device=device))
        cos, sin = model.rope(positions)
        for index, layer in enumerate(model.layers):
            k_cache, v_cache = self._k[index], self._v[index]

            def attend(
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                kc: torch.Tensor = k_cache,
                vc: torch.Tensor = v_cache,
            ) -> torch.Tensor:
                kc[slots, :, positions] = k
                vc[slots, :, positions] = v
                return self.config.attention(q, kc[:b, :, :width], vc[:b, :, :width], lengths)

            x = layer(x, cos, sin, attend)
        logits = model.logits(x)
        # Every row is drawn before any request moves on: a draw that fails drops its request alone (as a failing
        # callback does), where advancing the others first would leave them past their last token, unretired.
        drawn: list[tuple[_Active, int, TokenLogprobs | None]] = []
        failed: list[_Active] = []
        failure: MooncakeError | None = None
        for a, row in zip(active, logits, strict=True):
            try:
                token = a.sampler.next_token(row)
                drawn.append((a, token, a.sampler.logprobs_of(row, token)))
            except MooncakeError as error:
                # Named, type kept: its caller ends that request's stream (it is dropped: no `finished` token).
                error.args = (f"request {a.request_id}: {error}", *error.args[1:])
                error.request_id = a.request_id  # and by value: its caller need not parse the message
                failed.append(a)
                failure = failure or error
        emitted = []
        for a, token, logprobs in drawn:
            a.last_token = token
            a.emitted += 1
            a.done = a.ends_with(token)
            event = TokenEvent(
                request_id=a.request_id, token=token, index=a.emitted - 1, finished=a.done, logprobs=logprobs
            )
            emitted.append((a, event))
        for a in failed:
            self._drop(a)
        self._retire()
        self.last_step_s = time.perf_counter() - started
        self._deliver(emitted, failure)
        return [event for _, event in emitted]

    def run(self, *, max_steps: int) -> list[TokenEvent]:
        """Step until no request is active or `max_steps` steps ran; every token emitted.

        Raises:
            InvalidRequestError: `max_steps` is not a non-negative integer (naming it).
        """
        max_steps = require_int("max_steps", max_steps, minimum=0, error=InvalidRequestError)
        events: list[TokenEvent] = []
        for _ in range(max_steps):
            if not self._active:
                break
            events.extend(self.step())
        return events

    def _deliver(self, emitted: Sequence[tuple[_Active, TokenEvent]], failure: Exception | None = None) -> None:
        """Call back each request with its token, in order, once the batch is whole: a request dropped (by an
        earlier callback, say) is skipped; one whose callback raises is dropped, and the first error (`failure`,
        the step's own, before any callback's) is raised once every other callback ran. Meanwhile `cancel` finds
        the finished requests not yet called back (retired, they hold no slot) in `_finishing`."""
        outer = self._finishing  # a callback that joins a request delivers its first token inside this delivery
        self._finishing = {active.request_id: active for active, event in emitted if event.finished}
        try:
            for active, event in emitted:
                self._finishing.pop(active.request_id, None)  # called back now: too late to cancel its token
                if active.on_token is None or active.dropped:
                    continue
                try:
                    active.on_token(event)
                except Exception as error:  # its consumer failed: it takes no further token, the others go on
                    self._drop(active)
                    failure = failure or error
        finally:
            self._finishing = outer
        if failure is not None:
            raise failure

    def cancel(self, request_id: RequestId) -> bool:
        """Drop an active request without another token (its client went away); False if it is not active.
        A callback may call it during `step` for any request of the step: one not called back yet gets no token
        of that step, even one the step finished (retired, it is no longer active, yet its last token is still
        held back: it then never gets `finished=True`); one already called back with its last token is over
        (False)."""
        for active in self._active:
            if active.request_id == request_id:
                return self._drop(active)
        finishing = self._finishing.pop(request_id, None)
        if finishing is None:
            return False
        finishing.dropped = True
        return True

    def _drop(self, active: _Active) -> bool:
        """End `active` without another token, freeing its slot if it holds one; False if it held none."""
        active.dropped = True
        for slot, held in enumerate(self._active):
            if held is active:
                self._remove(slot)
                return True
        return False

    def _retire(self) -> None:
        slot = 0
        while slot < len(self._active):
            if not self._active[slot].done:
                slot += 1
                continue
            self._remove(slot)

    def _remove(self, slot: int) -> None:
        """Free `slot`, moving the last slot's request into it; the rows left behind are zeroed once another
        request's context would cover them (here for the hole's, at a join for the freed last slot)."""
        last = len(self._active) - 1
        if slot != last:  # fill the hole with the last slot, so active slots stay 0 … B − 1
            stale, width = self._filled[slot], self._filled[last]
            for kc, vc in zip(self._k, self._v, strict=True):
                kc[slot, :, :width] = kc[last, :, :width]
                vc[slot, :, :width] = vc[last, :, :width]
            self._clear(slot, width, stale)
            self._filled[slot] = width
            self._active[slot] = self._active[last]
        self._active.pop()


class TokenStream:
    """One request's tokens as an async iterator: pass `stream.put` as the request's `on_token`.

    `put` and `close` may be called from any thread (the decode loop's); iteration happens on
    `loop` and ends after the event with `finished=True`, or at `close()`: a request that
    `DecodeEngine.cancel` dropped gets no further token, so whoever cancels it closes its stream
    (as vLLM's abort ends a request's output stream). Once `loop` is closed (its consumer is gone), `put` and
    `close` drop what they are given: nobody listens, and the decode loop calling them must not fail for it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._done = False

    def put(self, event: TokenEvent) -> None:
        self._send(event)

    def close(self) -> None:
        """End the iteration after the tokens already put (idempotent)."""
        self._send(None)

    def _send(self, item: TokenEvent | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: its consumer is gone (asking first would race with its closing)
            if not self._loop.is_closed():
                raise

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            self._done = True
            raise StopAsyncIteration
        self._done = event.finished
        return event
