"""A simulated disaggregated cluster on a virtual clock, driving the real Conductor.

Prefill instances are FIFO servers. A request starts when its instance is free
and the KV transfer the Conductor planned for it (if any) has arrived; its
prefill time comes from the cost model given the prefix its own metadata-only
`TieredCache` actually holds then (LRU, prefix-aware); afterwards its blocks are
stored in that cache, whose events feed the Conductor's index. Transfers are
timed by the transfer model, slowed by the transfers already in flight from
the same source; the copy they bring is kept (hot-spot replication) when the
plan says so (`TransferPlan.keep_local_copy`), else dropped after the prefill,
with the blocks computed after it. The transfer overlaps the request's wait in
the queue: the prefill starts when both are over, as the router's estimate assumes. With
`cpp_group_size` X > 1, each X prefill nodes form one chunked-pipeline group:
one instance to the Conductor, X nodes' cache, the CPP prefill time.

The prefill's KV streams to the decode instance layer by layer while the
prefill runs; what the prefill does not hide delays the arrival. There the
instance's own check runs (its TBT with the request added within the SLO, its
HBM not overflowing), else the request is rejected after prefill: wasted work.
As the example cluster's decode worker does, the check runs between steps: a
request whose KV arrives while a step runs waits for that step's end, where the
members it finished have left, and the requests waiting there are checked in
their order of arrival (an idle instance checks at once). Accepted requests
join the `ContinuousBatch` at that step boundary; the batch advances a whole
stretch between membership changes analytically, cut at the next step boundary
when a request arrives (`analytic_decode=False` steps one by one instead, for
checking).

With `inline_prefill_tokens` n > 0, a request of at most n prompt tokens is
prefilled inside its decode instance's batch (paper §5) when the step carrying
it stays within the TBT SLO: the batch stalls for the prefill, and the request
never visits a prefill instance.

In local-cache mode (`global_pool=False`) nodes never fetch each other's
blocks: the KV-cache-centric router becomes the local-cache-aware one.

With `admission_wait_s` > 0, a request the Conductor rejects for room the
decode side frees as its requests end waits before any prefill, in the line
`sched.waiting.AdmissionQueue` keeps (first come, first served), tried again
whenever a request ends and at its deadline, as the example cluster's gateway
does; with 0 (the default, the paper's) it is rejected at once.

Everything is deterministic for a given workload, spec and seed.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import attrs

from mooncake._checks import require_iterable, shown
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.tiered import TieredCache
from mooncake.errors import InvalidRequestError, UnknownInstanceError
from mooncake.sched.admission import AdmissionPolicy
from mooncake.sched.build import RouterFactory
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.cost import PrefillCostModel, occupancy_s, prefill_end_s, transfers_in_flight
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict, check_join, takes_slot
from mooncake.sched.outcome import Outcome
from mooncake.sched.predictor import LoadPredictor, uniform_decode_s
from mooncake.sched.router import KvCacheCentricRouter
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    PrefilledInline,
    PrefillFinished,
    PrefillStarted,
    RequestRejected,
)
from mooncake.sched.waiting import AdmissionQueue
from mooncake.sim.batch import Member
from mooncake.sim.metrics import ReplayResult, RequestRecord
from mooncake.sim.node import DecodeNode, metadata_cache, shared_prefix_blocks
from mooncake.sim.replayer import Progress, ReplayContext
from mooncake.sim.spec import ClusterSpec, build_conductor
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier, require_slo

__all__ = ["DisaggregatedCluster", "replay"]


@attrs.define(eq=False)
class _Queued:
    request: Request
    record: RequestRecord
    decision: ScheduleDecision
    ready_s: float  # when its planned transfer has arrived
    moved: int | None = None  # blocks the transfer brought (None: not arrived yet)


@attrs.define(eq=False)
class _PrefillNode:
    instance_id: InstanceId
    cache: TieredCache
    queue: deque[_Queued] = attrs.field(factory=deque)
    busy: bool = False
    drained_s: float = -math.inf  # when the prefills started so far have all ended (left a group's last stage)
    # The blocks of prompts started and not yet ended that the node will keep (a group's next prompt may start
    # before they are stored, and reuse them stage by stage: the Conductor counts them as its pending blocks).
    in_pipeline: dict[RequestId, Sequence[BlockKey]] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Joiner:
    member: Member
    inline_s: float = 0.0  # > 0: prefilled inside the batch, stalling it this long


@attrs.define(eq=False)
class _DecodeSide:
    """A decode instance: its node, its limits, the requests whose KV arrived during the running step (checked at
    its end, in their order of arrival), and the requests joining at the next boundary.

    `kv_tokens` is every member's and joiner's reservation (prompt + output), as the decode rule counts it.
    """

    node: DecodeNode
    limits: DecodeLimits
    arrived: list[RequestRecord] = attrs.field(factory=list)
    joining: list[_Joiner] = attrs.field(factory=list)
    joining_tokens: int = 0
    kv_tokens: int = 0

    def load(self, now: float) -> DecodeLoad:
        """The batch as it stands at `now`, mid-stretch (what stepping one by one would see), with the joiners."""
        batch = self.node.batch
        return DecodeLoad(
            len(batch) + len(self.joining), batch.context + self.node.grown(now) + self.joining_tokens, self.kv_tokens
        )


def replay(
    spec: ClusterSpec,
    requests: Iterable[Request],
    *,
    router: RouterFactory = KvCacheCentricRouter,
    admission: AdmissionPolicy | None = None,
    slo: Slo | None = None,
    decode_s: float | None = None,
    predictor: LoadPredictor | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    keep_intervals: bool = True,
) -> ReplayResult:
    """Build a Conductor for `spec` (`build_conductor`'s options and defaults) and replay `requests`.

    Without a `decode_s` or a `predictor`, the paper's predictor takes the workload's t_d
    (`sched.predictor.uniform_decode_s`: mean output × TBT objective, as the experiments and the replay tool
    do); the requests are then read into a list first.

    Raises:
        ConfigError: both a `decode_s` and a `predictor`, an `slo` that is no `Slo`, or what
            `DisaggregatedCluster.run` refuses.
        InvalidRequestError: `requests` that are no iterable, an item that is not a `Request`, or no request at all.
    """
    if slo is not None:  # read below before the Conductor would refuse it
        require_slo(slo)
    if decode_s is None and predictor is None:
        requests = list(require_iterable("requests", requests, error=InvalidRequestError))
        for item in requests:
            if not isinstance(item, Request):
                raise InvalidRequestError(f"a replay takes mooncake.types.Request items, got {type(item).__name__}")
        decode_s = uniform_decode_s((r.output_length for r in requests), (slo or Slo()).tbt_s)
    conductor = build_conductor(
        spec, router=router, admission=admission, slo=slo, decode_s=decode_s, predictor=predictor, seed=seed
    )
    return DisaggregatedCluster(spec, conductor).run(requests, progress=progress, keep_intervals=keep_intervals)


class DisaggregatedCluster:
    """Replays requests through a simulated disaggregated cluster governed by `conductor`.

    The conductor must know the prefill and decode instances the spec describes
    (`build_conductor` makes such a one); one cluster replays one workload (a second `run` is refused: build a
    new cluster, and Conductor, for another), in `context` (by default its own, on the conductor's SLO).
    """

    def __init__(self, spec: ClusterSpec, conductor: Conductor, *, context: ReplayContext | None = None) -> None:
        self.spec = spec
        self.conductor = conductor
        self.slo = conductor.slo
        self.replay = (
            context if context is not None else ReplayContext(self.slo, sample_interval_s=spec.sample_interval_s)
        )
        self.loop = self.replay.loop
        self.prefill_cost = spec.prefill_cost
        self.transfer_cost = spec.transfer_cost
        self.kv_bytes_per_token = spec.model.kv_bytes_per_token
        self.page_bytes = spec.block_size_tokens * self.kv_bytes_per_token
        self.step_model = spec.decode_cost
        self.join_model = spec.decode_join_cost  # what the node's join check asks (the engine's configured model)
        self.decode_prefill_cost = PrefillCostModel(model=spec.model, hardware=spec.decode_hardware, mfu=spec.mfu)
        # A capacity under one block caches nothing (its cache, a page no chain is put into, stays empty).
        self._caches = spec.prefill_cache_blocks > 0
        pages = max(1, spec.prefill_cache_blocks)
        self._prefill = {
            view.instance_id: _PrefillNode(
                view.instance_id,
                metadata_cache(view.instance_id, Tier.DRAM, page_bytes=self.page_bytes, num_pages=pages),
            )
            for view in conductor.prefill_views
        }
        self._decode = {
            view.instance_id: _DecodeSide(DecodeNode.of(view.instance_id, self.step_model), view.limits)
            for view in conductor.decode_views
        }
        self._prefill_count = 0
        self._decode_count = 0
        self._transfers: dict[InstanceId, list[float]] = {}
        # Requests waiting for room on the decode side, each with its record; one timer for the earliest deadline.
        self._waiting = AdmissionQueue[tuple[Request, RequestRecord]](conductor, max_wait_s=spec.admission_wait_s)
        self._timer_s = math.inf

    def run(
        self, requests: Iterable[Request], *, progress: Progress | None = None, keep_intervals: bool = True
    ) -> ReplayResult:
        """Replay `requests` (in arrival order; streamed) through the cluster to the end, and summarize.

        Raises:
            InvalidRequestError: this cluster has replayed a workload already, or what `ReplayContext.run` refuses
                in `requests`.
            ConfigError: a `progress` or `keep_intervals` that `ReplayContext.run` refuses.
        """
        return self.replay.run(requests, self._arrive, self._counts, progress=progress, keep_intervals=keep_intervals)

    def decode_load(self, decode_instance: InstanceId, now: float) -> DecodeLoad:
        """What `decode_instance` really holds at `now` (within the current stretch), for scoring load
        predictors: requests decoding, the KV tokens a step reads (prompts and tokens generated),
        and their reservations (prompt + output each).

        Raises:
            UnknownInstanceError: `decode_instance` is no decode instance of this cluster.
        """
        side = self._decode.get(decode_instance)
        if side is None:  # else a bare KeyError
            raise UnknownInstanceError(
                f"decode_instance {shown(decode_instance)} is no decode instance of this cluster"
            )
        batch = side.node.batch
        kv = sum(m.record.input_tokens + m.record.output_tokens for m in batch.members)
        return DecodeLoad(len(batch), batch.context + side.node.grown(now), kv)

    def _counts(self) -> tuple[int, int]:
        return self._prefill_count, self._decode_count

    # ------------------------------------------------------------------ prefill side

    def _arrive(self, now: float, request: Request) -> None:
        record = self.replay.open(now, request)
        decision = self._waiting.arrive((request, record), request, now)
        if decision is None:
            self._arm()
        else:
            self._decided(now, request, record, decision)

    def _decided(self, now: float, request: Request, record: RequestRecord, decision: ScheduleDecision) -> None:
        record.prefill_instance, record.decode_instance = decision.prefill_instance, decision.decode_instance
        if decision.accepted:
            self._admit(now, request, record, decision)
        else:
            assert decision.reason is not None
            self.replay.reject(now, record, Outcome.REJECTED_BEFORE_PREFILL, decision.reason)

    def _room_freed(self, now: float) -> None:
        """A request ended, or a wait's deadline came: the line is tried (`AdmissionQueue.pump`)."""
        for (request, record), decision in self._waiting.pump(now):
            self._decided(now, request, record, decision)
        self._arm()

    def _arm(self) -> None:
        """A timer for the earliest deadline in the line, unless one as early is set."""
        deadline = self._waiting.next_deadline()
        if deadline < self._timer_s:
            self._timer_s = deadline
            self.loop.at(deadline, self._deadline)

    def _deadline(self, now: float) -> None:
        if now >= self._timer_s:  # else a later timer, superseded by an earlier one that fired
            self._timer_s = math.inf
            self._room_freed(now)

    def _admit(self, now: float, request: Request, record: RequestRecord, decision: ScheduleDecision) -> None:
        assert decision.prefill_instance is not None and decision.decode_instance is not None
        if self._try_inline(now, request, record, decision):
            return
        node = self._prefill[decision.prefill_instance]
        ready = now
        plan = decision.transfer
        if plan is not None and self.spec.global_pool:
            # The blocks from the holder must arrive before the prefill may start.
            ends = self._transfers.setdefault(plan.source, [])
            congestion = transfers_in_flight(ends, now)
            ready = now + self.transfer_cost.transfer_s(plan.num_bytes, in_flight_from_source=congestion)
            heapq.heappush(ends, ready)
        queued = _Queued(request, record, decision, ready)
        node.queue.append(queued)
        self._prefill_count += 1
        if ready > now:
            self.loop.at(ready, self._transfer_arrived, queued)
        self._start_next(now, node)

    def _transfer_arrived(self, _now: float, queued: _Queued) -> None:
        """What the planned transfer brought: the holder's prefix as it arrived, no more than the plan reuses
        (the holder may have cached more of the prompt, or evicted some, since the plan)."""
        plan = queued.decision.transfer
        assert plan is not None
        holder = self._prefill.get(plan.source)
        matched = holder.cache.prefix_match(queued.request.block_keys) if holder is not None else 0
        queued.moved = min(matched, queued.decision.prefix_tokens // self.spec.block_size_tokens)

    def _start_next(self, now: float, node: _PrefillNode) -> None:
        if node.busy or not node.queue:
            return
        head = node.queue[0]
        node.busy = True
        if head.ready_s > now:  # FIFO: the head waits for its transfer, the others for the head
            self.loop.at(head.ready_s, self._free, node)
            return
        node.queue.popleft()
        request, record, decision = head.request, head.record, head.decision
        moved = 0  # blocks the transfer brought
        plan = decision.transfer
        if plan is not None and self.spec.global_pool:  # never planned for a prompt computed whole
            if head.moved is None:  # it arrives now: its event has not come yet
                self._transfer_arrived(now, head)
            assert head.moved is not None
            moved = head.moved
            if plan.keep_local_copy:  # hot-spot replication
                self._store(node, request, moved)
        # The prefix counts as used when the prefill ends and stores the whole chain (`_store`).
        keys = request.block_keys
        cached = 0
        if request.reuses_prefix:
            cached = max(node.cache.prefix_match(keys), moved)
            for ahead in node.in_pipeline.values():
                cached = max(cached, shared_prefix_blocks(keys, ahead))
        record.prefix_tokens = reusable_prefix_tokens(request.input_length, cached, self.spec.block_size_tokens)
        record.prefill_s = self.prefill_cost.prefill_s(request.input_length, record.prefix_tokens)
        self.conductor.handle(PrefillStarted(request_id=request.request_id, instance_id=node.instance_id, now=now))
        hold = occupancy_s(self.prefill_cost, request.input_length, record.prefix_tokens, prefill_s=record.prefill_s)
        end = node.drained_s = prefill_end_s(now, record.prefill_s, hold, node.drained_s)
        if now + hold < end:  # a CPP group takes the next prompt before this one's KV is done
            if self._keeps_blocks(decision):
                node.in_pipeline[request.request_id] = keys
            self.loop.at(end, self._prefill_done, node, head, False)
            self.loop.at(now + hold, self._free, node)
        else:
            self.loop.at(end, self._prefill_done, node, head, True)

    def _free(self, now: float, node: _PrefillNode) -> None:
        node.busy = False
        self._start_next(now, node)

    def _store(self, node: _PrefillNode, request: Request, upto: int) -> None:
        """Put the request's first `upto` blocks into the node's cache (evicting by its policy)."""
        if not self._caches:
            return
        cache = node.cache
        cache.put_chain(request.block_keys[:upto], length=self.page_bytes)
        for event in cache.take_events():
            self.conductor.apply_cache_event(event)

    def _keeps_blocks(self, decision: ScheduleDecision) -> bool:
        """Whether the prefill instance keeps the prompt's blocks once it is prefilled (as the Conductor counts
        them pending there): not after a moved prefix the plan drops after use (the blocks computed after it
        are no use alone)."""
        plan = decision.transfer
        return plan is None or plan.keep_local_copy or not self.spec.global_pool

    def _prefill_done(self, now: float, node: _PrefillNode, queued: _Queued, frees_node: bool) -> None:
        request, record = queued.request, queued.record
        node.in_pipeline.pop(request.request_id, None)
        if self._keeps_blocks(queued.decision):
            self._store(node, request, len(request.block_keys))
        overhead = self.spec.first_token_overhead_s
        record.first_token_s = now + overhead
        self._prefill_count -= 1
        self.conductor.handle(PrefillFinished(request_id=request.request_id, instance_id=node.instance_id, now=now))
        if frees_node:
            self._free(now, node)
        if not takes_slot(request.output_length):  # the first token was the last
            self.loop.at(record.first_token_s, self._finish, record)
            return
        # The KV streamed layer by layer during the prefill: only what the prefill did not hide remains.
        handoff = self.transfer_cost.handoff_s(request.input_length * self.kv_bytes_per_token, record.prefill_s)
        arrival = now + overhead + handoff
        assert record.decode_instance is not None
        self.loop.at(arrival, self._decode_arrive, self._decode[record.decode_instance], record)

    # ------------------------------------------------------------------ decode side

    def _try_inline(self, now: float, request: Request, record: RequestRecord, decision: ScheduleDecision) -> bool:
        """Prefill a short request inside its decode batch when the decode rule takes it and the step
        carrying its prefill stays within the TBT SLO."""
        if request.input_length > self.spec.inline_prefill_tokens or not takes_slot(request.output_length):
            return False
        assert decision.decode_instance is not None and decision.prefill_instance is not None
        side = self._decode[decision.decode_instance]
        inline_s = self.decode_prefill_cost.prefill_s(request.input_length)
        # Checked even when the batch is empty (the rule waives TBT for a lone request; its own stall is not
        # waived): the step carrying this prefill must fit what the step's other inline prefills leave.
        verdict = self._check(side, record, now, tbt_slo_s=None)
        step_s = verdict.predicted_tbt_s
        if not verdict.accepted or step_s is None or step_s + inline_s > self._tbt_budget_s(side):
            return False
        # It never reaches the prefill instance the Conductor queued it on.
        self.conductor.handle(
            PrefilledInline(request_id=request.request_id, instance_id=decision.decode_instance, now=now)
        )
        record.prefill_instance = None
        record.inline_prefill = True
        record.prefill_s = inline_s
        self._enqueue(now, side, _Joiner(Member(record, request.output_length - 1, request.input_length), inline_s))
        return True

    def _tbt_budget_s(self, side: _DecodeSide) -> float:
        """What the TBT objective leaves for the decode step at the instance's next boundary: the objective less
        the inline prefills already joining there, which stall that same step (may be negative: then no one
        more joins that step with a batch to slow)."""
        return self.slo.tbt_s - sum(joiner.inline_s for joiner in side.joining)

    def _check(self, side: _DecodeSide, record: RequestRecord, now: float, *, tbt_slo_s: float | None) -> JoinVerdict:
        """The decode rule on the instance's batch as it stands at `now`."""
        return check_join(
            side.limits,
            side.load(now),
            prompt_tokens=record.input_tokens,
            output_tokens=record.output_tokens,
            step_model=self.join_model,
            tbt_slo_s=tbt_slo_s,
        )

    def _decode_arrive(self, now: float, side: _DecodeSide, record: RequestRecord) -> None:
        """A prefilled request reaches its decode instance. An idle instance decides at once (`_decide`); a busy
        one at the end of the step it runs, after the members that step finishes have left (`_boundary`), as the
        example cluster's decode worker joins its hand-offs between steps: the stretch is cut there."""
        if side.node.batch.members:
            side.arrived.append(record)
            self._cut(now, side)
        elif self._decide(now, side, record):
            self._wake(now, side)

    def _decide(self, now: float, side: _DecodeSide, record: RequestRecord) -> bool:
        """The decode rule decides on a prefilled request at a step boundary (or an idle instance), against the
        step it would join, whose time is the TBT objective less the inline prefills that step carries (as
        `_try_inline` counts them: every step stays within the objective, whichever of the two came first).
        Returns whether it joins (at this boundary)."""
        verdict = self._check(side, record, now, tbt_slo_s=self._tbt_budget_s(side))
        if not verdict.accepted:  # the instance's own check: the prefill was wasted
            assert verdict.reason is not None and record.decode_instance is not None
            record.first_token_s = None  # its client never gets the prefill's token: the refusal comes instead
            self.replay.reject(now, record, Outcome.REJECTED_AFTER_PREFILL, verdict.reason)
            self.conductor.handle(
                RequestRejected(
                    request_id=record.request_id, instance_id=record.decode_instance, now=now, reason=verdict.reason
                )
            )
            if self._waiting:
                self.loop.at(now, self._room_freed)
            return False
        self._add_joiner(side, _Joiner(Member(record, record.output_tokens - 1, record.input_tokens)))
        return True

    def _add_joiner(self, side: _DecodeSide, joiner: _Joiner) -> None:
        side.joining.append(joiner)
        side.joining_tokens += joiner.member.context
        side.kv_tokens += joiner.member.record.input_tokens + joiner.member.record.output_tokens

    def _enqueue(self, now: float, side: _DecodeSide, joiner: _Joiner) -> None:
        """`joiner` joins at the batch's next step boundary (now, if the batch is idle)."""
        self._add_joiner(side, joiner)
        if side.node.batch.members:
            self._cut(now, side)
        else:
            self._wake(now, side)

    def _wake(self, now: float, side: _DecodeSide) -> None:
        """An idle batch's joiners join now: one boundary for all those joining at this instant."""
        if len(side.joining) == 1:
            side.node.void_plans()
            self.loop.at(now, self._boundary, side, side.node.version)

    def _cut(self, now: float, side: _DecodeSide) -> None:
        """The batch's current stretch ends at its first step boundary after `now` (a membership change waits
        there)."""
        node = side.node
        steps = min(node.planned_steps, node.steps_to_next_boundary(now))
        if steps < node.planned_steps:
            self.loop.at(node.plan(steps), self._boundary, side, node.version)

    def _boundary(self, now: float, side: _DecodeSide, version: int) -> None:
        node = side.node
        if not node.is_current(version):
            return  # the plan changed since this boundary was planned
        for member in node.end_stretch(now):
            self._decode_count -= 1
            side.kv_tokens -= member.record.input_tokens + member.record.output_tokens
            self._finish(now, member.record)
        arrived, side.arrived = side.arrived, []
        for record in arrived:  # the worker's join: after the step, in their order of arrival
            self._decide(now, side, record)
        batch = node.batch
        joiners, side.joining, side.joining_tokens = side.joining, [], 0
        for joiner in joiners:
            if joiner.inline_s:  # its prefill runs in the batch, before the next step
                batch.stall(joiner.inline_s)
                # No hand-off: the decode instance prefilled it itself (the first-token overhead is a hand-off's).
                joiner.member.record.first_token_s = batch.start_s
        for joiner in joiners:
            member = joiner.member
            record = member.record
            assert record.first_token_s is not None
            member.gap_s = batch.start_s - record.first_token_s
            batch.join(member)
            self._decode_count += 1
            self.conductor.handle(
                DecodeJoined(
                    request_id=record.request_id,
                    instance_id=node.instance_id,
                    now=now,
                    context_tokens=record.input_tokens,
                    output_tokens=record.output_tokens,
                )
            )
        if batch.members:
            steps = batch.min_remaining() if self.spec.analytic_decode else 1
            self.loop.at(node.plan(steps), self._boundary, side, node.version)
        else:
            node.void_plans()

    def _finish(self, now: float, record: RequestRecord) -> None:
        self.replay.complete(now, record)
        assert record.decode_instance is not None
        self.conductor.handle(
            DecodeFinished(
                request_id=record.request_id,
                instance_id=record.decode_instance,
                now=now,
                generated_tokens=record.output_tokens,
            )
        )
        if self._waiting:  # tried as an event of its own: a finish may be in the middle of a batch boundary
            self.loop.at(now, self._room_freed)
