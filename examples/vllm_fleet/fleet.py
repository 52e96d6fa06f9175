"""The router's view of a vLLM fleet: the Conductor over its instances, fed by their KV events.

Each vLLM server is an instance of the Conductor: role `both` a coupled
instance (it prefills and decodes what it prefilled), `prefill` and `decode`
the two halves of a disaggregated pair. Instances cannot fetch each other's
blocks (each vLLM holds its own cache), so the Conductor is built with
`transfers=False`: Algorithm 1 then picks, per request, the instance with the
lowest estimated TTFT = queue + prefill of the tokens its own cache lacks
(the tokens its index holds, continued by the prompts queued there ahead of
this one), and the admission policy rejects a request whose estimate misses the
TTFT objective, or that the decode rule refuses (context over the server's
`max_model_len`, KV over its cache), before any server sees it.

The queue is the router's own bookkeeping: a request is queued on its instance
from dispatch to its first token, or to its prefill server's answer in a
disaggregated pair (then it decodes until its last); a
head of queue still without its first token after its predicted prefill is
taken to start now (`PrefillStarted`), so the queue never drains by prediction
alone. Its
prefill time comes from an `OnlinePrefillModel` taught by the requests that
found their instance idle. The index is each server's cache as its KV events
say (`KvEventSubscriber`: gaps recovered from the replay socket; a restart,
seen as numbers starting again, empties the server's holdings).

An instance that could not be reached at start-up is added down under another's probe (its stand-in
limits, which routing never reads while it is down) until `refresh` gives its own.

A `Fleet` reads no clock (times are passed in) and does no network I/O beyond
its ZeroMQ sockets, polled by `poll_events`. Invariant: every request it
accepted is in `flights` until exactly one of `finished`, `failed` or an
instance going down ends it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Sequence
from typing import Any

import attrs
from serving import registry

from mooncake.cache import BlockHasher
from mooncake.cache.vllm_events import VllmEventDecoder
from mooncake.errors import ConfigError, MooncakeError
from mooncake.sched import (
    DEFAULT_DECODE_S,
    Conductor,
    DecodeFinished,
    DecodeJoined,
    DecodeLimits,
    FittedStepModel,
    InstanceDown,
    InstanceUp,
    PrefillBacklog,
    PrefillFinished,
    PrefillStarted,
    Reason,
    RequestAborted,
    RequestEnd,
    ScheduleDecision,
    TransferCostModel,
    TtftEstimator,
    UniformDecodePredictor,
)
from mooncake.types import InstanceId, Request, RequestId, Slo
from vllm_fleet.config import InstanceSection, RouterConfig
from vllm_fleet.online import OnlinePrefillModel
from vllm_fleet.upstream import InstanceInfo, InstanceState

__all__ = ["Fleet", "FleetInstance", "Flight"]

log = logging.getLogger("vllm_router")
DAY_S = 86_400.0
TYPICAL_PROMPT_TOKENS = 512  # a foreign request's prompt before the router has seen any
FULL_ATTENTION = "full_attention"  # vLLM's kv_cache_spec_kind of a full-attention group
HASH_MODEL = "vllm-fleet"  # the block keys' namespace: the router hashes both the prompts and the servers' blocks


@attrs.define(eq=False)
class FleetInstance:
    """One vLLM server: its config, what the probe found, its KV-event subscriber and its last counters."""

    instance_id: InstanceId
    section: InstanceSection
    info: InstanceInfo
    subscriber: Any = None  # a vllm_events.KvEventSubscriber, or None (no events: the index never holds it)
    up: bool = True
    state: InstanceState = attrs.field(factory=InstanceState)
    event_errors: int = 0
    # False while `info` is another server's stand-in: it could not be reached at start-up and has not been
    # probed since (it is down until then: nothing reads its stand-in limits to route to it).
    probed: bool = True
    refused: str = ""  # why it stays down though its /health answers (it came back unlike its start-up probe)
    group_warned: bool = False  # its events said the KV-cache group read is not full attention (logged once)
    failed_checks: int = 0  # consecutive failed /health checks: `[router] health_failures` of them mark it down
    load_stale: bool = False  # its last /metrics failed: `state` is the scrape before

    @property
    def url(self) -> str:
        return self.section.base_url


@attrs.define(eq=False)
class Flight:
    """A request the Conductor accepted: where it goes and what the router saw of it."""

    request: Request
    decision: ScheduleDecision
    dispatched_s: float
    idle: bool  # nothing of the router's was queued ahead on its instance: its TTFT teaches the prefill model
    prefilled_s: float | None = None
    first_token_s: float | None = None
    # The prompt tokens the server found cached (vLLM's usage.prompt_tokens_details.cached_tokens), once it said.
    cached_tokens: int | None = None
    # A timed prefill's seconds, learnt from once the server says what it found cached (or the request ends).
    prefill_sample_s: float | None = None

    @property
    def instance_id(self) -> InstanceId:
        assert self.decision.prefill_instance is not None
        return self.decision.prefill_instance

    @property
    def decode_instance_id(self) -> InstanceId:
        assert self.decision.decode_instance is not None
        return self.decision.decode_instance


class Fleet:
    """The Conductor over the fleet's instances (see the module docstring).

    Args:
        config: the router's config.
        infos: each instance's probe, in config order; None for one that could not be reached at start-up: it
            is added down (`probed` False), under the first probe's info until `refresh` gives its own.
        subscribe: makes an instance's KV-event subscriber from its section and decoder (None: no events).
        now: when the unreachable ones are marked down.

    Raises:
        ConfigError: no instance was probed (the fleet's model and limits come from a probe).
    """

    def __init__(
        self,
        config: RouterConfig,
        infos: Sequence[InstanceInfo | None],
        *,
        subscribe: Any = None,
        now: float = 0.0,
    ) -> None:
        stand_in = next((info for info in infos if info is not None), None)
        if stand_in is None:
            raise ConfigError(f"{config.source}: no instance was probed: the fleet needs one to learn its model")
        settings = config.router
        self.hasher = BlockHasher(model=HASH_MODEL, block_size_tokens=settings.block_size)
        self.prefill_model = OnlinePrefillModel()
        estimator = TtftEstimator(
            prefill=self.prefill_model,
            transfer=TransferCostModel(bandwidth_bytes_per_s=1.0),  # never used: no instance fetches from another
            kv_bytes_per_token=1,
        )
        self.conductor = Conductor(
            router=registry.router(settings.policy, threshold=settings.threshold)(estimator),
            # No TBT objective: the router does not model the servers' decode steps (a zero step model).
            step_model=FittedStepModel(coefficients=(0.0, 0.0, 0.0)),
            admission=registry.admission(settings.admission),
            predictor=UniformDecodePredictor(decode_s=DEFAULT_DECODE_S, step_s=DAY_S),  # the objective's pace
            slo=Slo(ttft_s=settings.ttft_slo_s, tbt_s=DAY_S),
            block_size_tokens=settings.block_size,
            transfers=False,
        )
        self.instances: dict[InstanceId, FleetInstance] = {}
        try:
            for name, section, probed in zip(config.instance_ids, config.instances, infos, strict=True):
                instance_id = InstanceId(name)
                info = stand_in if probed is None else probed
                limits = DecodeLimits(kv_capacity_tokens=info.kv_capacity_tokens, max_context_tokens=info.max_model_len)
                # vLLM's prefix cache is its KV blocks: queued prompts' blocks count that far (0: not reported).
                cache_blocks = info.kv_capacity_tokens // settings.block_size or None
                if section.role == "both":
                    self.conductor.add_coupled_instance(instance_id, limits, cache_blocks=cache_blocks)
                elif section.role == "prefill":
                    self.conductor.add_prefill_instance(instance_id, cache_blocks=cache_blocks)
                else:
                    self.conductor.add_decode_instance(instance_id, limits)
                # "full": a client may send `vllm_xargs: {"kv_cache_report_mode": "full"}`, and vLLM then
                # re-announces the cached blocks each such request reuses. Read as new copies (the "incremental"
                # reading), they would outlive the evictions that remove the real ones: blocks believed cached for
                # ever. "full" reads a parentless GPU BlockStored of a block already held as no copy; it may
                # under-count a copy two requests computed at once, which only drops a block from the index early.
                decoder = VllmEventDecoder(
                    self.hasher, instance_id, kv_group=section.kv_group, strict=False, report_mode="full"
                )
                subscriber = subscribe(section, decoder, self.conductor.index) if subscribe is not None else None
                self.instances[instance_id] = FleetInstance(
                    instance_id, section, info, subscriber, probed=probed is not None
                )
        except BaseException:
            # The subscribers bound so far are closed here: a ZeroMQ context left to the garbage collector
            # terminates there and waits forever for its sockets (a failed start once hung pytest so).
            self.close()
            raise
        self._queues = {view.instance_id: view for view in self.conductor.prefill_views}
        self.flights: dict[RequestId, Flight] = {}
        self._ids = itertools.count()
        self._prompt_tokens = self._prompts = 0  # what the router has seen: a foreign request is taken as typical
        for instance_id, instance in self.instances.items():
            if not instance.probed:
                self.set_up(instance_id, False, now)

    # ------------------------------------------------------------------ requests

    def schedule(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        now: float,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        reuses_prefix: bool = True,
    ) -> tuple[Request, ScheduleDecision]:
        """Key the prompt's blocks and ask the Conductor; an accepted request is in flight from now. A request
        of a LoRA adapter (`lora`: its name) is keyed in the adapter's namespace (`BlockHasher.for_lora`), where
        the decoders key the servers' blocks of that adapter: it reuses that adapter's prefixes only, as in vLLM.
        A request with a `cache_salt` is keyed in its salt's namespace (`BlockHasher.salted`), as the gateway
        keys it: the servers' salted blocks are not indexed (their events' `extra_keys` cannot be told from a
        multimodal input's), so its prompt is planned as uncached, which vLLM's salted hash makes it against
        any unsalted copy. `reuses_prefix` False (a scored prompt: `types.prefix_reusable`) plans it as computed
        whole, as vLLM computes it."""
        request = Request(
            request_id=RequestId(f"r{next(self._ids)}"),
            arrival_s=0.0,
            input_length=len(tokens),
            output_length=max(1, max_tokens),
            block_keys=self.hasher.for_lora(lora).salted(cache_salt).block_keys(tokens),
            block_size_tokens=self.hasher.block_size_tokens,
            reuses_prefix=reuses_prefix,
        )
        self._overdue(now)
        self._prompt_tokens += request.input_length
        self._prompts += 1
        decision = self.conductor.schedule(request, now)
        if decision.accepted:
            assert decision.prefill_instance is not None
            idle = len(self._queues[decision.prefill_instance].queue) == 1  # only this request
            self.flights[request.request_id] = Flight(request, decision, now, idle)
        return request, decision

    def _overdue(self, now: float) -> None:
        """A server still owing the first token of the request at the head of its queue after the prefill
        predicted for it is taken to be starting that prefill now: the queue behind it waits its whole
        predicted time again, instead of draining by prediction while the server is busier than the model
        says (a server's speed under load is below what it was timed at idle)."""
        for view in self.conductor.prefill_views:
            if view.queue and view.queue[0].finish_s < now and view.is_up:
                head = view.queue[0].request_id
                self.conductor.handle(PrefillStarted(request_id=head, instance_id=view.instance_id, now=now))

    def prefilled(self, flight: Flight, now: float, *, timed: bool = True, cached_tokens: int | None = None) -> None:
        """The request's prefill is done: it leaves its prefill instance's queue. `timed`: `now` is when the
        prefill ended (a first token streamed, or the one-token answer of a disaggregated prefill), so an idle
        instance's prefill teaches the model, with the prefix the server found cached (`cached_tokens`, from its
        answer's usage; a stream says it at its end, so the sample waits for `finished`; a server that never
        says: the prefix the router expected); an answer that came whole says nothing about its prefill."""
        if flight.prefilled_s is not None:
            return
        flight.prefilled_s = now
        if cached_tokens is not None:
            flight.cached_tokens = cached_tokens
        request = flight.request
        if timed and flight.idle:
            flight.prefill_sample_s = now - flight.dispatched_s
            if flight.cached_tokens is not None:
                self._learn(flight)
        self.conductor.handle(PrefillFinished(request_id=request.request_id, instance_id=flight.instance_id, now=now))

    def first_token(self, flight: Flight, now: float, *, timed: bool = True) -> None:
        """The request's first token came back from its decode instance (the same instance when coupled): its
        prefill is done (`prefilled`, with `timed`, unless a disaggregated prefill said so first) and it
        decodes."""
        if flight.first_token_s is not None:
            return
        flight.first_token_s = now
        self.prefilled(flight, now, timed=timed)
        request = flight.request
        self.conductor.handle(
            DecodeJoined(
                request_id=request.request_id,
                instance_id=flight.decode_instance_id,
                now=now,
                context_tokens=request.input_length,
                output_tokens=request.output_length,
            )
        )

    def finished(
        self, flight: Flight, now: float, generated_tokens: int | None, *, cached_tokens: int | None = None
    ) -> None:
        """The request's last token came back; `cached_tokens`: the prompt tokens its server found cached, as its
        answer's usage says (None: it did not say)."""
        if self.flights.pop(flight.request.request_id, None) is None:
            return
        if flight.first_token_s is None:
            self.first_token(flight, now, timed=False)
        if flight.cached_tokens is None:
            flight.cached_tokens = cached_tokens
        self._learn(flight)
        self.conductor.handle(
            DecodeFinished(
                request_id=flight.request.request_id,
                instance_id=flight.decode_instance_id,
                now=now,
                generated_tokens=generated_tokens,
            )
        )

    def failed(self, flight: Flight, now: float, reason: Reason) -> None:
        """The request ended without completing: its client left, its deadline passed, its server failed it."""
        if self.flights.pop(flight.request.request_id, None) is not None:
            self._learn(flight)
            self.conductor.handle(RequestAborted(request_id=flight.request.request_id, now=now, reason=reason))

    def _learn(self, flight: Flight) -> None:
        """Teach the prefill model the flight's timed prefill, once: with the prefix its server found cached, else
        the one the router expected."""
        if flight.prefill_sample_s is None:
            return
        cached = flight.cached_tokens if flight.cached_tokens is not None else flight.decision.prefix_tokens
        self.prefill_model.observe(flight.request.input_length, cached, flight.prefill_sample_s)
        flight.prefill_sample_s = None

    # ------------------------------------------------------------------ instances

    def unprefilled(self, instance_id: InstanceId) -> frozenset[RequestId]:
        """The router's requests on `instance_id` not yet prefilled (waiting or running there)."""
        return frozenset(
            request_id
            for request_id, flight in self.flights.items()
            if flight.instance_id == instance_id and flight.prefilled_s is None
        )

    def reconcile(
        self, instance_id: InstanceId, state: InstanceState, now: float, *, asked: Collection[RequestId] = ()
    ) -> float:
        """Reconcile the router's queue of a server with the server's own count (`vllm:num_requests_waiting`):
        requests waiting there beyond every request of the router's not yet prefilled are another client's,
        and the server is busy with them for a prefill of the router's mean prompt each (`PrefillBacklog`;
        none beyond: no backlog). Counting all of the router's unprefilled requests, running ones included,
        never takes the router's own for foreign. `asked`: the router's unprefilled requests when the count
        was asked for (`unprefilled`), counted too: the count may predate an answer the router has had since,
        and that request, still waiting when the server counted, is the router's, not another client's.
        Returns the backlog's seconds."""
        if instance_id not in self._queues:
            return 0.0  # a decode server: it prefills nothing the router routes
        own = len(self.unprefilled(instance_id).union(asked))
        foreign = state.waiting - own
        backlog = 0.0
        if foreign > 0:
            typical = self._prompt_tokens // self._prompts if self._prompts else TYPICAL_PROMPT_TOKENS
            backlog = foreign * self.prefill_model.prefill_s(max(1, typical), 0)
        self.conductor.handle(PrefillBacklog(instance_id=instance_id, now=now, until_s=now + backlog))
        return backlog

    def set_up(self, instance_id: InstanceId, up: bool, now: float) -> tuple[RequestEnd, ...]:
        """Mark an instance up or down (down: it leaves routing, its cache leaves the index, what it held ends)."""
        instance = self.instances[instance_id]
        if instance.up == up:
            return ()
        instance.up = up
        if up:
            return self.conductor.handle(InstanceUp(instance_id=instance_id, now=now))
        if instance.subscriber is not None:
            # Its holdings leave the index; its next events start a new epoch there, from batch 0: a restarted
            # server's, whose numbers start again, or a live one's after a blip, which the subscriber asks its
            # replay socket for at once. Its most recent hash translations are kept (`skip_to`, not `restart`:
            # bounded by its retired list), so that replayed blocks whose parents came before the replay
            # buffer's window are still understood.
            instance.subscriber.decoder.skip_to(0)
        ends = self.conductor.handle(InstanceDown(instance_id=instance_id, now=now))
        for end in ends:
            self.flights.pop(end.request_id, None)
        return ends

    def refresh(self, instance_id: InstanceId, info: InstanceInfo) -> None:
        """An instance's probe again (a server restarted with another `--max-model-len` or KV budget): the
        Conductor checks its new requests against the new limits; what it already holds stays. An instance
        unreachable at start-up takes its own info so, in place of its stand-in."""
        instance = self.instances[instance_id]
        instance.info = info
        instance.probed = True
        if instance.section.role != "prefill":
            limits = DecodeLimits(kv_capacity_tokens=info.kv_capacity_tokens, max_context_tokens=info.max_model_len)
            self.conductor.set_decode_limits(instance_id, limits)

    @property
    def max_model_len(self) -> int:
        """The longest `max_model_len` of the instances probed (a stand-in's is not a server's)."""
        return max(instance.info.max_model_len for instance in self.instances.values() if instance.probed)

    def poll_events(self) -> int:
        """Apply every KV-event batch waiting on the subscribers' sockets; returns how many."""
        handled = 0
        for instance in self.instances.values():
            subscriber = instance.subscriber
            if subscriber is None:
                continue
            try:
                handled += subscriber.poll(0)
            except MooncakeError as error:  # the index refused an event: start this server's holdings afresh
                subscriber.stats.num_errors += 1
                subscriber.stats.last_error = str(error)
                subscriber.decoder.restart()
            self._check_group(instance)
            errors = subscriber.stats.num_errors
            if errors > instance.event_errors:
                instance.event_errors = errors
                log.error(
                    "instance %s (%s): %d KV-event batches unreadable so far, last: %s",
                    instance.instance_id,
                    instance.url,
                    errors,
                    subscriber.stats.last_error,
                )
        return handled

    def _check_group(self, instance: FleetInstance) -> None:
        """Log once if the server's events say the KV-cache group read is not full attention while another is
        (a hybrid model's sliding-window group loses blocks its full-attention group keeps: the index would
        disagree with the server's hits), naming the `kv_group` to set."""
        decoder = instance.subscriber.decoder
        kind = decoder.group_kinds.get(decoder.kv_group)
        if instance.group_warned or kind in (None, FULL_ATTENTION):
            return
        full = sorted(group for group, named in decoder.group_kinds.items() if named == FULL_ATTENTION)
        if not full:
            return
        instance.group_warned = True
        log.error(
            "instance %s (%s): kv_group = %d is a %s group, whose blocks the server drops apart from the prefix; "
            "set kv_group = %d in its [[instances]] table (the full-attention group)",
            instance.instance_id,
            instance.url,
            decoder.kv_group,
            kind,
            full[0],
        )

    def cached_blocks(self, instance_id: InstanceId) -> int:
        """The blocks the index holds for `instance_id`."""
        return self.conductor.index.num_blocks(instance_id)

    def close(self) -> None:
        for instance in self.instances.values():
            if instance.subscriber is not None:
                instance.subscriber.close()
