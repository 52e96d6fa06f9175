"""The Conductor: schedules each request onto a prefill and a decode instance, or rejects it.

`schedule(request, now)`:
1. match the request's block keys in the global index (each prefill instance's
   prefix, the best holder); an instance's prefix continues with the blocks the
   requests queued on it will have stored when this one starts (FIFO), which the
   prefill will find (`sched.pending`; only the index's holders are transfer sources),
   as far as its cache holds them (`cache_blocks`, where the instance was added with one);
2. route it (`router`) among prefill instances that are up;
3. choose the decode instance (`choose_decode`; a coupled instance, one that
   prefills and decodes, decodes what it prefilled and nothing else): ranked by what each is
   committed to (decoding and reserved), checked by the decode rule
   (`sched.join`) against the load the admission policy asks about: none (the
   instance checks for itself), what it is committed to now, or the batch
   predicted for when the request will arrive (now + estimated TTFT);
4. let the admission policy accept or reject; an accepted request joins the
   prefill instance's queue and is reserved on the decode instance (it counts
   toward that instance's batch and KV from then on).

It returns a frozen `ScheduleDecision`; the caller carries it out (moves KV per
the transfer plan, runs prefill, ...) and reports progress with events, which
keep the views and the index current (`handle`, `apply_cache_event`). Before
routing, a queue whose started prefill ran past its predicted end is predicted again from the present
(`PrefillView.stale_s`): it ends no sooner, and those behind it start no sooner. The
Conductor never routes to an instance marked down. It reads no clock and draws
randomness only from its seeded generator, so a replay is reproducible. The
views also sit on boards (`PrefillBoard`, `DecodeBoard`), refreshed at each
change, so that routing and decode selection over hundreds of instances are
array operations; the router is handed the prefill board as its candidates.

Invariants (`check_invariants`): every in-flight request is either queued on
exactly one prefill instance (with a reservation on its decode instance),
prefilled and on its way (still reserved), or decoding on exactly one decode
instance; views satisfy their own invariants, and the boards say what the
views say; the blocks counted as coming to a prefill instance are those of the
requests queued there (that keep them). Every request ends exactly once (`RequestEnd`, in the vocabulary of
`sched.outcome`): `handle` reports each end, and events about a request that
already ended are ignored.
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
import math
import random
import typing
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import binding_error, require_bool, require_int, require_number, require_str, shown
from mooncake.cache.events import CacheEvent, SequenceGap
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.index import BlockIndex, key_array
from mooncake.errors import ConfigError, InvalidRequestError, UnknownInstanceError
from mooncake.sched.admission import LOAD_AT, WAITS_FOR_ROOM, AdmissionDecision, AdmissionPolicy
from mooncake.sched.cost import prefill_end_s, transfers_in_flight
from mooncake.sched.decode import DecodeChoice, choose_decode, lasting_decode_refusal
from mooncake.sched.join import DecodeLimits, load_problem
from mooncake.sched.outcome import Outcome, Reason, RequestEnd
from mooncake.sched.pending import PendingBlocks
from mooncake.sched.predictor import LoadPredictor
from mooncake.sched.router import PrefixBlocks, RouteDecision, RouteQuery, Router, TransferPlan
from mooncake.sched.step import AnalyticStepModel
from mooncake.sched.view import (
    ActiveDecode,
    BoardLoads,
    DecodeBoard,
    DecodeFinished,
    DecodeJoined,
    DecodeView,
    InstanceDown,
    InstanceUp,
    PrefillBacklog,
    PrefillBoard,
    PrefilledInline,
    PrefillFinished,
    PrefillStarted,
    PrefillView,
    QueuedPrefill,
    RequestAborted,
    RequestRejected,
    SchedulerEvent,
)
from mooncake.types import InstanceId, Request, RequestId, Slo, require_slo

__all__ = ["Conductor", "ScheduleDecision"]

REMEMBERED_REMOVALS = 1024
"""How many removed instance ids a Conductor remembers, to ignore their late reports (bounded: instances come
and go on a long-running server)."""


@attrs.frozen(kw_only=True)
class ScheduleDecision:
    """What to do with one request.

    Attributes:
        accepted: False means reject (`reason` says why).
        prefill_instance, decode_instance: where it goes (set when routing got that far).
        prefix_tokens: cached prompt tokens the prefill will reuse.
        transfer: KV to move to the prefill instance first (the copy is kept there).
        ttft_s, tbt_s: the estimates the decision was taken on.
    """

    request_id: RequestId
    accepted: bool
    reason: Reason | None = None
    prefill_instance: InstanceId | None = None
    decode_instance: InstanceId | None = None
    prefix_tokens: int = 0
    transfer: TransferPlan | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None


class _Stage(enum.Enum):
    QUEUED = "queued"  # on its prefill instance's queue (waiting or running)
    PREFILLED = "prefilled"  # off the queue; its KV is on its way to the decode instance
    DECODING = "decoding"


@attrs.define
class _InFlight:
    prefill_instance: InstanceId
    decode_instance: InstanceId
    scheduled_s: float
    prefill_estimate_s: float  # from scheduling to the prefill's end, as estimated: what PrefillFinished measures
    had_transfer: bool
    stage: _Stage = _Stage.QUEUED
    # (source, estimated finish) of the transfer its prefill waits for: counted in the source's congestion
    # until the request leaves its prefill queue (then the blocks have arrived) or ends.
    transfer: tuple[InstanceId, float] | None = None


_EVENT_TYPES = typing.get_args(SchedulerEvent)


def _check_limits(limits: object) -> None:
    """A decode instance's limits are `DecodeLimits` (ConfigError otherwise)."""
    if not isinstance(limits, DecodeLimits):
        raise ConfigError(f"decode limits must be DecodeLimits, got {shown(limits)}")


def _check_call(
    method: typing.Any, name: str, call: str, args: tuple[typing.Any, ...], kwargs: dict[str, typing.Any]
) -> None:
    """`method` (a policy's) takes the arguments the Conductor passes it (`call` spells them out).

    Raises:
        ConfigError: it cannot be called so, naming the policy and the call.
    """
    if (error := binding_error(method, *args, **kwargs)) is not None:
        raise ConfigError(
            f"{name} {shown(method.__self__ if hasattr(method, '__self__') else method)}: its {call} cannot be "
            f"called as the Conductor calls it ({error}; see its Protocol)"
        )


class Conductor:
    """Composes the index, views, router, decode selection, predictor and admission.

    Args:
        router: chooses prefill instances.
        step_model: the decode instances' step time (`DecodeCostModel`, or one fitted to an engine).
        admission: accepts or rejects.
        predictor: decode load forecast (used when the admission policy asks for it).
        slo: the objectives.
        block_size_tokens: tokens per block key.
        index: the global block index (one is made if not given).
        transfers: False when instances cannot fetch each other's blocks (no global pool): routers
            then see no holder to move a prefix from.
        seed: of the generator random routing draws from.
    """

    def __init__(
        self,
        *,
        router: Router,
        step_model: AnalyticStepModel,
        admission: AdmissionPolicy,
        predictor: LoadPredictor,
        slo: Slo,
        block_size_tokens: int,
        index: BlockIndex | None = None,
        transfers: bool = True,
        seed: int = 0,
    ) -> None:
        # What each part must be able to do, checked here: a misplaced argument (an SLO given as 30, a policy
        # given by its name) would otherwise fail at the first request, as an AttributeError.
        require_slo(slo)
        for name, part, methods in (
            ("router", router, ("route", "observe")),
            ("step_model", step_model, ("step_s", "roofline")),  # decode selection reads its roofline
            ("admission", admission, ("admit",)),
            ("predictor", predictor, ("predict", "observe")),
        ):
            if isinstance(part, type):
                raise ConfigError(f"{name} must be an instance, got the class {part.__name__} (call it)")
            for method in methods:
                if not callable(getattr(part, method, None)):
                    raise ConfigError(f"{name} must have a {method}() method (see its Protocol), got {shown(part)}")
        # The observations come only once a request has prefilled or finished: their signatures are checked now,
        # against the arguments they will be given (a wrong one was a bare TypeError in the middle of a run).
        _check_call(
            router.observe,
            "router",
            "observe(*, had_transfer, estimated_ttft_s, observed_ttft_s)",
            (),
            {"had_transfer": False, "estimated_ttft_s": 0.0, "observed_ttft_s": 0.0},
        )
        _check_call(predictor.observe, "predictor", "observe(output_tokens)", (1,), {})
        if getattr(admission, "load_at", None) not in LOAD_AT:
            raise ConfigError(f"admission's load_at must be one of {', '.join(LOAD_AT)}, got {shown(admission)}")
        self.router = router
        self.step_model = step_model
        self.admission = admission
        self.predictor = predictor
        self.slo = slo
        self.block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
        self.transfers = require_bool("transfers", transfers)  # "no" would read as true
        self.index = index if index is not None else BlockIndex()
        self._rng = random.Random(require_int("seed", seed, minimum=0))
        self._prefill: dict[InstanceId, PrefillView] = {}
        self._decode: dict[InstanceId, DecodeView] = {}
        # The same views side by side, for routing and decode selection; refreshed on every change.
        self._prefill_board = PrefillBoard(())
        self._decode_board = DecodeBoard(())
        self._incoming: dict[InstanceId, dict[RequestId, QueuedPrefill]] = {}  # decode instance → routed prefills
        self._in_flight: dict[RequestId, _InFlight] = {}
        # Per source instance, finish times of the KV transfers planned from it (a heap): congestion.
        self._transfers: dict[InstanceId, list[float]] = {}
        # The blocks that requests queued on prefill instances will leave in their caches, counted per
        # instance (its owner number, for its lifetime; per board slot in `_owner_of_slot`), and each
        # such request's owner and keys: a request queued behind them on the same instance reuses them.
        self._pending = PendingBlocks()
        self._owner: dict[InstanceId, int] = {}
        self._owners = itertools.count()  # never reused: a removed instance's number stays its own
        self._owner_of_slot = np.zeros(0, dtype=np.int64)
        # Per prefill instance, the most blocks its cache holds (None: no bound given), and per board slot (None
        # while no instance has a bound): what the queued prompts leave there is counted only that far.
        self._cache_blocks: dict[InstanceId, int | None] = {}
        self._cache_blocks_of_slot: npt.NDArray[np.int64] | None = None
        self._pending_of: dict[RequestId, tuple[int, npt.NDArray[np.uint64]]] = {}
        self._coupled: set[InstanceId] = set()  # instances that are both (`add_coupled_instance`)
        # Per prefill instance, when the last prefill reported finished at the head of its queue ended: all those
        # queued there were behind it, and on a chunked-pipeline group leave the last stage no sooner than that
        # plus their time there (`prefill_end_s`), as they were predicted to while it was queued (`_retime`).
        self._ended_s: dict[InstanceId, float] = {}
        # The ids removed last (`remove_instance`), so that their reports still on the way are ignored, not refused.
        self._removed: collections.OrderedDict[InstanceId, None] = collections.OrderedDict()

    # ------------------------------------------------------------------ instances

    def add_prefill_instance(self, instance_id: InstanceId, *, cache_blocks: int | None = None) -> None:
        self.add_prefill_instances((instance_id,), cache_blocks=cache_blocks)

    def add_prefill_instances(self, instance_ids: Iterable[InstanceId], *, cache_blocks: int | None = None) -> None:
        """Prefill instances, all checked before any is added; the board is rebuilt once (a cluster of n
        instances added one at a time costs O(n²)).

        `cache_blocks`: the most blocks each one's prefix cache holds (its DRAM and SSD pages; 0: it caches
        nothing), or None for no bound. The blocks that prompts queued on an instance will leave there count
        toward a later prompt's prefix only that far (`schedule`): a cache smaller than a queued chain keeps its
        first blocks, as a prefix-preserving cache does, and what the index holds there now stays counted.

        Raises:
            ConfigError: an id already known, or `cache_blocks` that is not an integer >= 0 or None.
        """
        if cache_blocks is not None:
            require_int("cache_blocks", cache_blocks, minimum=0, below=2**63)
        new = self._new_ids(instance_ids)
        self._check_new(*new)
        for instance_id in new:
            self._prefill[instance_id] = PrefillView(instance_id)
            self._owner[instance_id] = next(self._owners)
            self._cache_blocks[instance_id] = cache_blocks
        self._rebuild_prefill_board()

    def _rebuild_prefill_board(self) -> None:
        """The prefill board and the per-slot arrays that follow its slots (owners, cache bounds)."""
        self._prefill_board = PrefillBoard(tuple(self._prefill.values()))
        ids = self._prefill_board.instance_ids
        self._owner_of_slot = np.array([self._owner[i] for i in ids], dtype=np.int64)
        bounds = [self._cache_blocks[i] for i in ids]
        self._cache_blocks_of_slot = (
            None
            if all(bound is None for bound in bounds)
            else np.array([np.iinfo(np.int64).max if bound is None else bound for bound in bounds], dtype=np.int64)
        )

    def add_decode_instance(self, instance_id: InstanceId, limits: DecodeLimits) -> None:
        """A decode instance that holds what `limits` say (its KV, batch slots, a request's context)."""
        self.add_decode_instances((instance_id,), limits)

    def add_decode_instances(self, instance_ids: Iterable[InstanceId], limits: DecodeLimits) -> None:
        """Decode instances, each holding what `limits` say, all checked before any is added; the board is
        rebuilt once."""
        new = self._new_ids(instance_ids)
        self._check_new(*new, decode_limits=(limits,))
        for instance_id in new:
            self._decode[instance_id] = DecodeView(instance_id, limits)
            self._incoming[instance_id] = {}
        self._decode_board = DecodeBoard(tuple(self._decode.values()))

    def add_coupled_instance(
        self, instance_id: InstanceId, limits: DecodeLimits, *, cache_blocks: int | None = None
    ) -> None:
        """An instance that prefills and decodes on the same GPUs (a vLLM or SGLang server without
        disaggregation): a request routed to it decodes there, checked by the decode rule against
        `limits`, and it never decodes what another instance prefilled. Its prefill and decode
        events name it under the one id. `cache_blocks`: as `add_prefill_instances`'."""
        self._check_new(instance_id, decode_limits=(limits,))
        self.add_prefill_instance(instance_id, cache_blocks=cache_blocks)
        self._decode[instance_id] = DecodeView(instance_id, limits)
        self._decode_board = DecodeBoard(tuple(self._decode.values()))
        self._incoming[instance_id] = {}
        self._coupled.add(instance_id)

    def remove_instance(self, instance_id: InstanceId, now: float) -> tuple[RequestEnd, ...]:
        """Forget an instance (scaled in, replaced by another): it goes down as `InstanceDown` takes it (the requests
        that need it end, aborted as INSTANCE_DOWN; its blocks leave the index), then its views and its place on the
        boards go, so that a long-running server's instances come and go without the Conductor growing. Requests it
        already prefilled go on to their decode instance; its id may be added again (a new instance). Returns the
        requests it ended.

        Raises:
            UnknownInstanceError: no instance has that id.
            InvalidRequestError: `now` is not a finite number.
        """
        if not isinstance(instance_id, str) or (instance_id not in self._prefill and instance_id not in self._decode):
            raise UnknownInstanceError(f"no instance {shown(instance_id)} to remove")
        require_number("now", now, minimum=-math.inf, error=InvalidRequestError)
        ends = self._instance(InstanceDown(instance_id=instance_id, now=now))
        if self._prefill.pop(instance_id, None) is not None:
            del self._owner[instance_id]
            self._ended_s.pop(instance_id, None)
            self._transfers.pop(instance_id, None)  # what is left was estimated done: nothing waits on it
            del self._cache_blocks[instance_id]
            self._rebuild_prefill_board()
        if self._decode.pop(instance_id, None) is not None:
            assert not self._incoming.pop(instance_id), "a request bound for a removed instance outlived it"
            self._decode_board = DecodeBoard(tuple(self._decode.values()))
        self._coupled.discard(instance_id)
        self._removed[instance_id] = None
        self._removed.move_to_end(instance_id)
        if len(self._removed) > REMEMBERED_REMOVALS:
            self._removed.popitem(last=False)
        return ends

    def set_decode_limits(self, instance_id: InstanceId, limits: DecodeLimits) -> None:
        """What decode (or coupled) instance `instance_id` holds from now on: a server restarted with another batch
        size or memory budget (vLLM's `--max-num-seqs`, `--gpu-memory-utilization`). What it already holds or was
        promised stays; new requests are checked against `limits`.

        Raises:
            ConfigError: `limits` is no `DecodeLimits`.
            UnknownInstanceError: no decode instance has that id.
        """
        _check_limits(limits)
        view = self._decode.get(instance_id) if isinstance(instance_id, str) else None
        if view is None:
            raise UnknownInstanceError(f"no decode instance {shown(instance_id)}")
        view.limits = limits
        self._decode_board.refresh(self._decode_board.slot[instance_id])

    @property
    def prefill_views(self) -> tuple[PrefillView, ...]:
        return self._prefill_board.views

    @property
    def decode_views(self) -> tuple[DecodeView, ...]:
        return self._decode_board.views

    def incoming(self, decode_instance: InstanceId) -> tuple[QueuedPrefill, ...]:
        """The prefills routed to `decode_instance` that have not joined it yet (what predictors read).

        Raises:
            UnknownInstanceError: no decode instance has that id.
        """
        routed = self._incoming.get(decode_instance) if isinstance(decode_instance, str) else None
        if routed is None:
            raise UnknownInstanceError(f"no decode instance {shown(decode_instance)}")
        return tuple(routed.values())

    @property
    def in_flight(self) -> tuple[RequestId, ...]:
        return tuple(self._in_flight)

    # ------------------------------------------------------------------ scheduling

    def schedule(self, request: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
        """Decide where `request` goes, or reject it; an accepted request is now in flight.

        `waited_s`: how long has passed since the request arrived (`sched.waiting.AdmissionQueue` passes it: the
        wait for room, and a gateway's reading of the body before). It counts against the TTFT objective: the
        request is accepted only while the wait plus the estimated TTFT meets it, else rejected as TTFT_SLO
        (where the policy's reason was room).

        Raises:
            InvalidRequestError: not a `Request`, a request with this id is already in flight, or `now` or
                `waited_s` is not a finite time (`waited_s` >= 0).
        """
        # The request's own checks (Request validates its fields) come before any state changes.
        if not isinstance(request, Request):
            raise InvalidRequestError(f"schedule takes a mooncake.types.Request, got {type(request).__name__}")
        if type(now) is not float or not math.isfinite(now):  # the common case, a finite float, is one test
            require_number("now", now, minimum=-math.inf, error=InvalidRequestError)
        if waited_s or type(waited_s) is not float:  # the common 0.0 unchecked; False and None are no time
            require_number("waited_s", waited_s, minimum=0.0, error=InvalidRequestError)
        if request.request_id in self._in_flight:
            raise InvalidRequestError(f"request {request.request_id} is already scheduled")
        self._check_geometry(request)
        self._catch_up(now)
        board = self._prefill_board
        candidates: Sequence[PrefillView] = board
        keys = key_array(request.block_keys, integers=True)  # once, for the index and the tie-break
        lengths = self.index.prefix_lengths(keys, board.instance_ids)
        if not request.reuses_prefix:  # computed whole wherever it goes: no instance's prefix counts
            lengths = np.zeros_like(lengths)
        if not board.all_up:
            candidates = PrefillBoard([view for view in board if view.is_up])
            lengths = np.where(board.is_up, lengths, 0)
        # The prefix each will have by its turn (none counts for a prompt computed whole).
        own = self._pending.walk(keys, lengths, self._owner_of_slot) if request.reuses_prefix else lengths
        bounds = self._cache_blocks_of_slot
        if bounds is not None and own is not lengths:
            # A cache keeps no more of the queued chains than it holds (what the index shows there now stands).
            own = np.minimum(own, np.maximum(bounds, lengths))
        best = None
        best_blocks = best_holders = 0
        held = lengths.tolist()  # a few dozen numbers: list operations beat numpy's per-call cost
        congestion = 0
        if held:
            best_blocks = max(held)
            if best_blocks:
                # Holders of as many blocks as a prefill reuses (never the last token's block) are alike to it:
                # a copy of the whole prompt and one lacking only its last block are both replicas.
                bs = self.block_size_tokens
                enough = reusable_prefix_tokens(request.input_length, best_blocks, bs) // bs or best_blocks
                if enough == best_blocks:  # the common case, in C
                    best_holders, first = held.count(enough), held.index(enough)
                else:
                    holders = [slot for slot, blocks in enumerate(held) if blocks >= enough]
                    best_holders, first = len(holders), holders[0]
                if self.transfers:
                    best = board.instance_ids[first]  # slots go in id order: the smallest id
                    congestion = self._transfers_in_flight(best, now)
                    if best_holders > 1 and congestion:
                        # A hot prefix has replicas: its transfers leave the one with the fewest already leaving
                        # (ties: the smallest id), not all the first.
                        congestion, best = min(
                            (self._transfers_in_flight(instance, now), instance)
                            for instance, blocks in zip(board.instance_ids, held, strict=True)
                            if blocks >= enough
                        )
        query = RouteQuery(
            input_tokens=request.input_length,
            block_size_tokens=self.block_size_tokens,
            prefix_blocks=PrefixBlocks(board.instance_ids, own, board.slot),
            best_instance=best,
            best_blocks=best_blocks,
            best_holders=best_holders,
            best_transfers_in_flight=congestion,
            block_keys=keys,
        )
        route = self.router.route(candidates, query, now, self._rng)
        if route is None:
            return ScheduleDecision(request_id=request.request_id, accepted=False, reason=Reason.NO_PREFILL_INSTANCE)
        self._check_route(route, request.input_length)
        decode = self._choose_decode(request, route.prefill_instance, now + route.ttft_s + route.handoff_s, now)
        if decode.decode_instance is None and self._coupled:
            # A mixed fleet: a coupled instance decodes only what it prefills, and the others only on the decode
            # instances. The route was chosen by TTFT alone; where its decode side has no room, the best route of
            # the other kind may (else the request was refused though an instance could take it).
            coupled = route.prefill_instance in self._coupled
            others = [view for view in candidates if (view.instance_id in self._coupled) != coupled]
            other = self.router.route(PrefillBoard(others), query, now, self._rng) if others else None
            if other is not None:
                self._check_route(other, request.input_length)
                elsewhere = self._choose_decode(
                    request, other.prefill_instance, now + other.ttft_s + other.handoff_s, now
                )
                if elsewhere.decode_instance is not None or decode.verdict.reason is Reason.CONTEXT_TOO_LONG:
                    # Taken there; or never held by the kind routed to, so the other kind's answer is the
                    # request's (its room may free: a wait, not the 400 of a request never served here).
                    route, decode = other, elsewhere
            elif decode.decode_instance is None and decode.verdict.reason is Reason.CONTEXT_TOO_LONG:
                # Too long for the kind routed to, and the other kind has no prefill instance up: an instance of
                # that kind could hold it once one is up (`lasting_refusal`'s answer: a 503, not a 400).
                whole = lasting_decode_refusal(
                    self._decode_board,
                    prompt_tokens=request.input_length,
                    output_tokens=request.output_length,
                )
                if whole is not Reason.CONTEXT_TOO_LONG:
                    reason = whole or Reason.NO_PREFILL_INSTANCE
                    decode = attrs.evolve(decode, verdict=attrs.evolve(decode.verdict, reason=reason))
        ttft_s = route.ttft_s
        verdict = self.admission.admit(route, decode, self.slo)
        # `accepted` a bool: AdmissionDecision(Reason.TTFT_SLO), the reason given first, would be truthy.
        if (
            type(verdict) is not AdmissionDecision
            or type(verdict.accepted) is not bool
            or (
                (decode.decode_instance is None or verdict.reason is not None)
                if verdict.accepted
                else type(verdict.reason) is not Reason
            )
        ):
            raise ConfigError(
                f"admission {shown(self.admission)} answered {shown(verdict)} (decode instance {decode.decode_instance}): an"
                " AdmissionDecision accepts with no reason, only where the decode selection found an instance, or"
                " rejects with a mooncake.sched.Reason"
            )
        if waited_s and (verdict.accepted or verdict.reason in WAITS_FOR_ROOM) and waited_s + ttft_s > self.slo.ttft_s:
            # What the wait left of the objective is too little now: waiting longer only makes it less (the
            # policies check TTFT before the decode side's room, so the same order holds here).
            verdict = AdmissionDecision(False, Reason.TTFT_SLO)
        decision = ScheduleDecision(
            request_id=request.request_id,
            accepted=verdict.accepted,
            reason=verdict.reason,
            prefill_instance=route.prefill_instance,
            decode_instance=decode.decode_instance,
            prefix_tokens=route.prefix_tokens,
            transfer=route.transfer,
            ttft_s=ttft_s,
            tbt_s=decode.tbt_s,
        )
        if verdict.accepted:
            assert decode.decode_instance is not None  # checked above
            start = now + route.wait_s
            view = self._prefill[route.prefill_instance]
            ahead_end = view.drained_s()
            queued = QueuedPrefill(
                request_id=request.request_id,
                start_s=start,
                finish_s=prefill_end_s(start, route.prefill_s, route.occupancy_s, ahead_end),
                frees_s=start + route.occupancy_s,
                prefill_s=route.prefill_s,
                occupancy_s=route.occupancy_s,
                joins_after_s=route.overhead_s + route.handoff_s,
                decode_instance=decode.decode_instance,
                input_tokens=request.input_length,
                output_tokens=request.output_length,
                transfer_source=route.transfer.source if route.transfer else None,
                transfer_finish_s=now + route.transfer_s,
                # What holds it back but the queue ahead (which may yet end sooner than predicted): its transfer,
                # and the backlog it was routed behind (a later report leaves it as it is, as its times).
                earliest_s=max(now + route.transfer_s, view.backlog_until_s),
            )
            view.queue.append(queued)
            if route.transfer is None or route.transfer.keep_local_copy:
                owner = self._owner[route.prefill_instance]
                self._pending.add(owner, keys)
                self._pending_of[request.request_id] = (owner, keys)
            self._prefill_board.refresh(self._prefill_board.slot[route.prefill_instance])
            if route.transfer is not None:
                heapq.heappush(self._transfers.setdefault(route.transfer.source, []), now + route.transfer_s)
            self._decode[decode.decode_instance].reserve(
                request.request_id, request.input_length, request.output_length
            )
            self._decode_board.refresh_load(self._decode_board.slot[decode.decode_instance])
            self._incoming[decode.decode_instance][request.request_id] = queued
            self._in_flight[request.request_id] = _InFlight(
                route.prefill_instance,
                decode.decode_instance,
                now,
                route.prefill_end_s,  # the TTFT less the first token's overhead, which comes after
                route.transfer is not None,
                transfer=(route.transfer.source, now + route.transfer_s) if route.transfer is not None else None,
            )
        return decision

    def lasting_refusal(self, request: Request) -> Reason | None:
        """Why no wait for room could get `request` in, without scheduling it (nothing changes), or None: no
        prefill instance up, or the decode side's `lasting_decode_refusal` (no decode instance up that could hold
        it even empty: NO_DECODE_INSTANCE while one that could is down, CONTEXT_TOO_LONG when none could). What a
        wait could change (the TTFT estimate, the decode load) is not looked at.

        Raises:
            InvalidRequestError: not a `Request`, one keyed in other blocks than this Conductor's, or one already in
                flight (what `schedule` refuses as invalid).
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"lasting_refusal takes a mooncake.types.Request, got {type(request).__name__}")
        if request.request_id in self._in_flight:
            raise InvalidRequestError(f"request {request.request_id} is already scheduled")
        self._check_geometry(request)
        if not any(view.is_up for view in self._prefill_board):
            return Reason.NO_PREFILL_INSTANCE
        return lasting_decode_refusal(
            self._decode_board, prompt_tokens=request.input_length, output_tokens=request.output_length
        )

    def _check_route(self, route: RouteDecision, prompt_tokens: int) -> None:
        """A router's decision names a prefill instance that is up, its times are finite and not negative, its
        prefix is a count of the prompt's tokens, and a transfer it plans comes from another instance.

        Raises:
            ConfigError: naming the router and its decision.
        """
        if type(route) is not RouteDecision:
            raise ConfigError(f"router {shown(self.router)} returned {shown(route)}, not a RouteDecision (or None)")
        view = self._prefill.get(route.prefill_instance)
        problem = None
        if view is None or not view.is_up:
            problem = "a prefill instance that is not up" if view else "an unknown prefill instance"
        elif not (  # written out, not a loop: this runs for every decision
            0.0 <= route.queue_s < math.inf  # NaN fails each comparison
            and 0.0 <= route.transfer_s < math.inf
            and 0.0 <= route.prefill_s < math.inf
            and 0.0 <= route.ttft_s < math.inf
            and 0.0 <= route.occupancy_s < math.inf
            and 0.0 <= route.overhead_s < math.inf
            and 0.0 <= route.handoff_s < math.inf
            and 0.0 <= route.drain_s < math.inf
        ):
            problem = "a time that is negative or not finite"
        elif type(route.prefix_tokens) is not int or not 0 <= route.prefix_tokens <= prompt_tokens:
            problem = f"a prefix that is no count of the prompt's {prompt_tokens} tokens"
        elif route.transfer is not None:
            source = self._prefill.get(route.transfer.source)
            if route.transfer.source == route.prefill_instance:
                problem = "a transfer from the instance to itself"
            elif not self.transfers:
                problem = "a transfer in a cluster without transfers"
            elif source is None or not source.is_up:
                problem = (
                    "a transfer from a prefill instance that is not up"
                    if source
                    else "a transfer from an unknown instance"
                )
        if problem is not None:
            raise ConfigError(f"router {shown(self.router)} chose {problem}: {shown(route)}")

    def _choose_decode(self, request: Request, prefill: InstanceId, arrival_s: float, now: float) -> DecodeChoice:
        """`choose_decode` among the instances that can decode what `prefill` prefills: itself if it is
        coupled, else every decode instance that is not."""
        board, loads = self._decode_board, self._decode_loads(now, arrival_s)
        if self._coupled:
            slots = (
                [board.slot[prefill]]
                if prefill in self._coupled
                else [slot for slot, instance in enumerate(board.instance_ids) if instance not in self._coupled]
            )
            board = DecodeBoard([board.slot_views[slot] for slot in slots])
            if loads is not None:
                loads = BoardLoads(
                    *(getattr(loads, name)[slots] for name in ("batch_size", "context_tokens", "kv_tokens"))
                )
        return choose_decode(
            board,
            prompt_tokens=request.input_length,
            output_tokens=request.output_length,
            step_model=self.step_model,
            tbt_slo_s=self.slo.tbt_s,
            loads=loads,
            now=now,
        )

    def _decode_loads(self, now: float, arrival_s: float) -> BoardLoads | None:
        """The decode load the admission policy asks about, slot by slot: none (the instance checks for
        itself), what each is committed to now (decoding, with what it generated, and reserved: None,
        `choose_decode`'s default), or the batches predicted for the request's arrival at `arrival_s`."""
        board = self._decode_board
        if self.admission.load_at == "now":
            return None
        if self.admission.load_at == "arrival":
            predict = self.predictor.predict
            loads = [
                predict(tuple(view.active.values()), self.incoming(view.instance_id), now, arrival_s)
                for view in board.slot_views
            ]
            try:
                return BoardLoads.of(loads)  # checks each load as the rule takes it (`load_problem`)
            except InvalidRequestError:
                # A plugged-in predictor's answer (a NaN, an infinity, a count past the scan's int64 arrays) is a
                # configuration's fault: named here with its instance, looked for only once it failed.
                for view, load in zip(board.slot_views, loads, strict=True):
                    problem = load_problem(load)
                    if problem is not None:
                        raise ConfigError(
                            f"predictor {type(self.predictor).__name__} predicted {shown(load)} for {view.instance_id}:"
                            f" {problem}"
                        ) from None
                raise
        empty = np.zeros(len(board), dtype=np.int64)
        return BoardLoads(empty, empty, empty)

    def _catch_up(self, now: float) -> None:
        """Retime the queues whose times went stale by `now` (`PrefillView.stale_s`): a started request not
        reported ended ends no sooner than the present, the first not reported started behind it starts no sooner,
        and those behind follow. Else a queue would drain by prediction while its instance runs past the estimate:
        routing would see it idle, admission a TTFT too short, the decode side its requests joined and gone."""
        board = self._prefill_board
        if now > board.stale_s:  # one comparison while no queue can have gone stale
            for slot in np.flatnonzero(board.stale_at_s < now).tolist():
                self._retime(board.slot_views[slot], now=now)  # its refresh keeps the board's least time

    def _check_geometry(self, request: Request) -> None:
        """The request's keys must be this Conductor's blocks: one key per block, the partial last one included."""
        request.check_block_size(self.block_size_tokens)

    def _transfers_in_flight(self, source: InstanceId, now: float) -> int:
        finishes = self._transfers.get(source)
        return transfers_in_flight(finishes, now) if finishes else 0

    # ------------------------------------------------------------------ events

    def handle(self, event: SchedulerEvent) -> tuple[RequestEnd, ...]:
        """Apply a progress event; returns the requests it ended.

        Events about a request that already ended (or was never accepted) are ignored: reports race
        with ends; so are those from an instance removed since (the last `REMEMBERED_REMOVALS`), whose
        requests ended with it. An event from the wrong instance is a misuse.

        Raises:
            UnknownInstanceError: the event names an instance never added, or one of the wrong kind
                (a prefill event from a decode instance, and the reverse).
            InvalidRequestError: the event names a known instance the request was not routed to, or is no
                scheduler event.
        """
        if not isinstance(event, _EVENT_TYPES):
            raise InvalidRequestError(f"handle takes a scheduler event (mooncake.sched.view), got {shown(event)}")
        if isinstance(event, (InstanceDown, InstanceUp)):
            return self._instance(event)
        if isinstance(event, PrefillBacklog):
            if not self._check_instance(event):
                return ()
            view = self._prefill[event.instance_id]
            view.backlog_until_s = event.until_s if event.until_s > event.now else -math.inf
            self._prefill_board.refresh(self._prefill_board.slot[event.instance_id])
            return ()
        if not isinstance(event, RequestAborted) and not self._check_instance(event):
            return ()  # a late report from an instance removed since: its requests ended with it
        flight = self._in_flight.get(event.request_id)
        if flight is None:
            return ()  # already ended (or never accepted): nothing to do
        if not isinstance(event, RequestAborted):
            routed = flight.prefill_instance if isinstance(event, (PrefillStarted, PrefillFinished)) else None
            routed = routed or flight.decode_instance
            if event.instance_id != routed:
                raise InvalidRequestError(
                    f"{type(event).__name__} for request {event.request_id} comes from {event.instance_id}, "
                    f"but the request was routed to {routed}"
                )
        if isinstance(event, PrefillStarted):
            self._release_transfer(flight)  # the prefill runs: the blocks it fetched are there
            self._retime(self._prefill[flight.prefill_instance], now=event.now, started=(event.request_id, event.now))
        elif isinstance(event, PrefillFinished):
            if flight.stage is not _Stage.QUEUED:
                return ()  # a repeated report: learn from each request once
            flight.stage = _Stage.PREFILLED
            self._remove_from_queue(flight, event.request_id, event.now, ended=True)
            self._prefilled_at(flight, event.request_id, event.now)
            self.router.observe(
                had_transfer=flight.had_transfer,
                estimated_ttft_s=flight.prefill_estimate_s,
                observed_ttft_s=event.now - flight.scheduled_s,
            )
        elif isinstance(event, PrefilledInline):
            if flight.stage is _Stage.QUEUED:
                flight.stage = _Stage.PREFILLED  # no prefill instance ran it: nothing for the router to learn
                self._remove_from_queue(flight, event.request_id, event.now)
                self._prefilled_at(flight, event.request_id, event.now)
        elif isinstance(event, DecodeJoined):
            if flight.stage is not _Stage.DECODING:
                self._join(flight, event)
        elif isinstance(event, DecodeFinished):
            if event.generated_tokens is not None:
                self.predictor.observe(event.generated_tokens)
            return (self._end(event.request_id, Outcome.COMPLETED, None, event.now),)
        elif isinstance(event, RequestRejected):
            return (self._end(event.request_id, Outcome.REJECTED_AFTER_PREFILL, event.reason, event.now),)
        elif isinstance(event, RequestAborted):
            return (self._end(event.request_id, Outcome.ABORTED, event.reason, event.now),)
        return ()

    def _join(self, flight: _InFlight, event: DecodeJoined) -> None:
        self._remove_from_queue(flight, event.request_id, event.now)
        view = self._decode[flight.decode_instance]
        # Account what was reserved, not what the event claims: VRAM was promised at acceptance.
        reservation = view.reserved.get(event.request_id)
        if reservation is not None and not reservation.takes_slot:
            # It finishes at its first token (the decode rule promised it no slot and no KV):
            # counting it now would put the instance over what admission promised.
            flight.stage = _Stage.PREFILLED
            return
        total = (
            reservation.prompt_tokens + reservation.output_tokens
            if reservation is not None
            else event.context_tokens + event.output_tokens
        )
        context = min(event.context_tokens, total)
        self._incoming[flight.decode_instance].pop(event.request_id, None)
        view.join(
            ActiveDecode(
                request_id=event.request_id, start_s=event.now, context_tokens=context, output_tokens=total - context
            )
        )
        self._decode_board.refresh_load(self._decode_board.slot[flight.decode_instance])
        flight.stage = _Stage.DECODING

    def apply_cache_event(self, event: CacheEvent, *, strict: bool = True) -> SequenceGap | None:
        """Feed a cache event to the index (`BlockIndex.apply`: a gap raises
        `SequenceGapError`, or with ``strict=False`` is returned).

        An event from an instance removed since (the last `REMEMBERED_REMOVALS`) is a late report: dropped,
        not applied, as `handle` ignores that instance's reports.

        Raises:
            UnknownInstanceError: the event's source is no instance of this Conductor, nor one removed since (a
                misspelt id would otherwise index blocks no route ever finds); nothing is applied.
        """
        source = getattr(event, "source", None)
        if source is not None and source not in self._prefill and source not in self._decode:  # None: no event
            if source in self._removed:
                # A late report (a prefill that finished as it was removed): applied, it would put the removed
                # instance's blocks back in the index, where routes would find a cache that is gone.
                return None
            raise UnknownInstanceError(
                f"a cache event from {shown(source)}, which is no instance of this Conductor: add it first "
                f"(prefill instances: {', '.join(sorted(self._prefill)) or 'none'})"
            )
        return self.index.apply(event, strict=strict)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the views, their boards and the in-flight table disagree."""
        self._prefill_board.check_invariants()
        self._decode_board.check_invariants()
        queued: dict[RequestId, InstanceId] = {}
        for prefill in self._prefill.values():
            prefill.check_invariants()
            for entry in prefill.queue:
                assert entry.request_id not in queued, f"{entry.request_id} queued twice"
                queued[entry.request_id] = prefill.instance_id
        decoding: dict[RequestId, InstanceId] = {}
        for view in self._decode.values():
            view.check_invariants()
            for request_id in view.active:
                assert request_id not in decoding, f"{request_id} decoding twice"
                decoding[request_id] = view.instance_id
            assert set(view.reserved) == set(self._incoming[view.instance_id]), (
                f"{view.instance_id}: reservations != incoming"
            )
        for request_id, flight in self._in_flight.items():
            if flight.stage is _Stage.DECODING:
                assert decoding.get(request_id) == flight.decode_instance, f"{request_id} lost from its decode batch"
            else:
                if flight.stage is _Stage.PREFILLED:
                    assert request_id not in queued, f"{request_id} finished prefill but is still queued"
                else:
                    assert queued.get(request_id) == flight.prefill_instance, (
                        f"{request_id} lost from its prefill queue"
                    )
                assert request_id in self._decode[flight.decode_instance].reserved, (
                    f"{request_id} has no KV reservation"
                )
        assert set(queued) | set(decoding) <= set(self._in_flight), "a view holds a request that ended"
        assert len(set(self._owner.values())) == len(self._owner), "two prefill instances share an owner number"
        assert set(self._ended_s) <= set(self._prefill), "an end is noted for an instance that is no prefill instance"
        pending: collections.Counter[tuple[int, int]] = collections.Counter()
        for request_id, (owner, keys) in self._pending_of.items():
            assert request_id in queued, f"{request_id} left its queue but its blocks still count as coming"
            assert owner == self._owner[queued[request_id]], f"{request_id}'s blocks count for another instance"
            pending.update((owner, key) for key in keys.tolist())
        assert pending == self._pending.counts(), (
            "the blocks coming to prefill instances are out of sync with their queues"
        )
        self._pending.check_invariants()
        # Every transfer still counted against a source belongs to a queued request (none outlives its request).
        counted = collections.Counter(
            flight.transfer
            for request_id, flight in self._in_flight.items()
            if flight.transfer is not None and request_id in queued
        )
        for source, finishes in self._transfers.items():
            for finish in finishes:
                assert counted[(source, finish)] > 0, f"a transfer from {source} outlived its request"
                counted[(source, finish)] -= 1

    # ------------------------------------------------------------------ internals

    def _check_instance(
        self,
        event: PrefillBacklog
        | PrefillStarted
        | PrefillFinished
        | PrefilledInline
        | DecodeJoined
        | DecodeFinished
        | RequestRejected,
    ) -> bool:
        """Whether the event's instance is one of the kind the event names: False for one removed since."""
        prefill = isinstance(event, (PrefillBacklog, PrefillStarted, PrefillFinished))
        known = self._prefill if prefill else self._decode
        if event.instance_id not in known:
            if event.instance_id in self._removed:
                return False
            kind = "prefill" if prefill else "decode"
            other = " (it is a decode instance)" if prefill and event.instance_id in self._decode else ""
            other = other or (
                " (it is a prefill instance)" if not prefill and event.instance_id in self._prefill else ""
            )
            raise UnknownInstanceError(
                f"{type(event).__name__} names {event.instance_id}, which is not a {kind} instance of this "
                f"Conductor{other}: add it with add_{kind}_instance first"
            )
        return True

    @staticmethod
    def _new_ids(instance_ids: Iterable[InstanceId]) -> tuple[InstanceId, ...]:
        """A batch of ids as a tuple; one id alone is refused (a string is an iterable of characters)."""
        if isinstance(instance_ids, str):
            raise ConfigError(
                f"instance_ids must be a collection of instance ids, got the one string {shown(instance_ids)}"
            )
        if not isinstance(instance_ids, Iterable):  # None, or one id that is no string: a bare TypeError otherwise
            raise ConfigError(f"instance_ids must be a collection of instance ids, got {shown(instance_ids)}")
        return tuple(instance_ids)

    def _check_new(self, *instance_ids: InstanceId, decode_limits: tuple[DecodeLimits, ...] = ()) -> None:
        """New instances' ids (and decode instances' limits, when given), checked before anything is
        registered, so that a failed add changes nothing."""
        for limits in decode_limits:
            _check_limits(limits)
        seen: set[InstanceId] = set()
        for instance_id in instance_ids:
            require_str("an instance id", instance_id)
            if instance_id in self._prefill or instance_id in self._decode or instance_id in seen:
                raise ConfigError(f"instance {instance_id} is already known")
            seen.add(instance_id)

    def _end(self, request_id: RequestId, outcome: Outcome, reason: Reason | None, now: float) -> RequestEnd:
        flight = self._in_flight.pop(request_id)
        if flight.stage is _Stage.QUEUED:
            self._remove_from_queue(flight, request_id, now)
        decode = self._decode[flight.decode_instance]
        decode.release(request_id)
        decode.leave(request_id)
        self._decode_board.refresh_load(self._decode_board.slot[flight.decode_instance])
        self._incoming[flight.decode_instance].pop(request_id, None)
        return RequestEnd(request_id, outcome, reason)

    def _release_transfer(self, flight: _InFlight) -> None:
        """The request's transfer no longer counts against its source: its blocks have arrived (its prefill
        started or left the queue), or will never be needed (it ended)."""
        if flight.transfer is None:
            return
        source, finish = flight.transfer
        flight.transfer = None
        finishes = self._transfers.get(source, [])
        if finish in finishes:  # not yet trimmed as past
            finishes.remove(finish)
            heapq.heapify(finishes)
        if not finishes:
            self._transfers.pop(source, None)

    def _remove_from_queue(self, flight: _InFlight, request_id: RequestId, now: float, *, ended: bool = False) -> None:
        """The request leaves its prefill queue at `now`, and those behind it are retimed. `ended`: its prefill
        ended then (reported finished); at the head, that end holds back those behind it as its prediction did
        (`_ended_s`). Any other departure (aborted, prefilled elsewhere, joined unreported) leaves no time behind."""
        self._release_transfer(flight)
        pending = self._pending_of.pop(request_id, None)
        if pending is not None:
            self._pending.remove(*pending)
        view = self._prefill.get(flight.prefill_instance)
        if view is None:  # removed after it prefilled the request (nothing of it was queued there still)
            return
        kept = [q for q in view.queue if q.request_id != request_id]
        if len(kept) != len(view.queue):
            head = view.queue[0]
            # Only a pipelined prefill (it frees the first stage before it ends) holds those behind it at the last
            # stage; on a plain instance one reported started beside it runs beside it (a batched prefill).
            if ended and head.request_id == request_id and head.occupancy_s < head.prefill_s:
                self._ended_s[view.instance_id] = max(self._ended_s.get(view.instance_id, -math.inf), now)
            view.queue = kept
            self._retime(view, now=now)

    def _prefilled_at(self, flight: _InFlight, request_id: RequestId, now: float) -> None:
        """The decode side's picture of a request whose prefill ended at `now`: its first token came then, not
        when it was predicted (a prefill that ran long would otherwise look, to a predictor, as if it had already
        decoded for a while and left; one that ended early, as if it had not come yet)."""
        incoming = self._incoming.get(flight.decode_instance) if flight.decode_instance is not None else None
        entry = incoming.get(request_id) if incoming is not None else None
        if entry is not None and entry.finish_s != now:
            assert incoming is not None
            incoming[request_id] = attrs.evolve(
                entry, start_s=min(entry.start_s, now), frees_s=min(entry.frees_s, now), finish_s=now
            )

    def _retime(
        self, view: PrefillView, *, now: float | None = None, started: tuple[RequestId, float] | None = None
    ) -> None:
        """Re-predict the queue's times after a start or an end: each entry keeps its durations (its prefill,
        and until it frees the instance) and starts as soon as its predecessor frees the instance, from its
        `earliest_s` on (its transfer done and the backlog it was routed behind over; a started one's reported
        start); one not yet reported started also no earlier than `now` (a running one keeps its start: that time
        has passed); it ends by `prefill_end_s` after the one ahead (the first, after the last one reported ended
        at the head, `_ended_s`: on a chunked-pipeline group it still waits for that one to leave the last stage,
        as when that one was queued). A start may move earlier: a request ahead that ended early or was aborted
        leaves no time behind. The backlog is not the work ahead of any entry (those routed behind it start after
        it by their `earliest_s`; those routed before keep their times)."""
        not_before = now if now is not None else -math.inf
        previous_frees = -math.inf
        previous_end = self._ended_s.get(view.instance_id, -math.inf)
        retimed = []
        for entry in view.queue:
            hold, earliest, is_started = entry.occupancy_s, entry.earliest_s, entry.started
            if started is not None and entry.request_id == started[0]:
                earliest, is_started = started[1], True
            # A started one keeps a start that has passed; one not yet started is not before the present.
            start = max(earliest, previous_frees) if is_started else max(earliest, previous_frees, not_before)
            end = prefill_end_s(start, entry.prefill_s, hold, previous_end)
            frees = start + hold
            if end < not_before and is_started:
                # Running past its estimate (its end not reported): it ends no sooner than the present, and frees
                # the instance as much later (never past its end, which rounding alone could do).
                frees = min(frees + (not_before - end), not_before)
                end = not_before
            if (
                start != entry.start_s
                or end != entry.finish_s
                or frees != entry.frees_s
                or is_started != entry.started
                or earliest != entry.earliest_s
            ):
                entry = attrs.evolve(
                    entry, start_s=start, finish_s=end, frees_s=frees, started=is_started, earliest_s=earliest
                )
                incoming = self._incoming.get(entry.decode_instance) if entry.decode_instance is not None else None
                if incoming is not None and entry.request_id in incoming:  # the decode side's picture follows
                    incoming[entry.request_id] = entry
            retimed.append(entry)
            previous_frees, previous_end = frees, end
        view.queue = retimed
        self._prefill_board.refresh(self._prefill_board.slot[view.instance_id])

    def _instance(self, event: InstanceDown | InstanceUp) -> tuple[RequestEnd, ...]:
        instance = event.instance_id
        if instance not in self._prefill and instance not in self._decode:
            if instance in self._removed:
                return ()  # a late report: removing it took it down, and it stays forgotten
            raise UnknownInstanceError(
                f"{type(event).__name__} names {instance}, which this Conductor does not know: add it first"
            )
        is_up = isinstance(event, InstanceUp)
        for views, board in ((self._prefill, self._prefill_board), (self._decode, self._decode_board)):
            view = views.get(instance)
            if view is not None:  # a coupled instance is in both
                view.is_up = is_up
                board.refresh(board.slot[instance])
        if is_up:
            return ()
        self.index.remove_instance(instance)  # its cache is gone; a restart announces a new epoch
        # Its queued prefills, its decodes, and the prefills still waiting for a transfer from it (estimated
        # unfinished: the blocks their TTFT was planned on may never arrive).
        doomed = [
            request_id
            for request_id, flight in self._in_flight.items()
            if (flight.prefill_instance == instance and flight.stage is _Stage.QUEUED)
            or flight.decode_instance == instance
            or (flight.transfer is not None and flight.transfer[0] == instance and flight.transfer[1] > event.now)
        ]
        return tuple(self._end(request_id, Outcome.ABORTED, Reason.INSTANCE_DOWN, event.now) for request_id in doomed)
