"""What the Conductor knows of each instance, kept current by events.

A `PrefillView` holds the instance's queue: the requests routed to it, in order,
each with a predicted start and finish (a new request starts when the last
queued one finishes, or now). A `DecodeView` holds the requests decoding there
(start time, context tokens, expected output; their start times summed, from
which decode selection estimates the tokens they generated), the KV tokens they occupy, the
requests reserved there (accepted, still in prefill or transfer: they count
toward its load from acceptance on) and its limits (`sched.join.DecodeLimits`).
Both are updated only through the event types below, so a replay of events
reproduces them exactly.

A `PrefillBoard` / `DecodeBoard` lays views of one kind side by side, with what
routing and decode selection compare kept as arrays (busy-until times; each
decode instance's load, its decoding batch's size, prompts and summed start
times, and its limits), so that choosing among hundreds of instances is a few
array operations rather than a loop. Array slots go in instance id order, so
the first minimum is the one ties go to. The owner of the views calls
`refresh(slot)` after changing one; a board built from views reads them.

Invariants (`check_invariants`): queue times are ordered and never negative;
a request is in at most one queue and at most one decode batch; VRAM in use
equals the sum of its active requests' tokens (the decode instance's own check
keeps it within capacity; promises made on a predicted load may exceed it); a
board's arrays equal what its views say.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import attrs
import numpy as np

from mooncake._checks import int_at_least, require_int, require_number, shown
from mooncake.errors import InvalidRequestError
from mooncake.sched.join import UNLIMITED, DecodeLimits, DecodeLoad, load_problem, takes_slot
from mooncake.sched.outcome import ABORT_REASONS, DECODE_REFUSALS, Reason
from mooncake.types import InstanceId, RequestId, check_request_id

__all__ = [
    "ActiveDecode",
    "BoardLoads",
    "DecodeBoard",
    "DecodeFinished",
    "DecodeJoined",
    "DecodeView",
    "InstanceDown",
    "InstanceUp",
    "PrefillBacklog",
    "PrefillBoard",
    "PrefillFinished",
    "PrefillStarted",
    "PrefillView",
    "PrefilledInline",
    "QueuedPrefill",
    "RequestAborted",
    "RequestRejected",
    "Reservation",
    "SchedulerEvent",
    "board_loads_problem",
]


@attrs.frozen(kw_only=True)
class QueuedPrefill:
    """A request waiting for or running its prefill on an instance: it starts at `start_s`, the instance
    may start the next at `frees_s` (a chunked-pipeline group takes it once this one's chunks have left
    the first stage; any other instance when this one ends) and its first token comes at `finish_s`
    (`sched.cost.prefill_end_s`: on a group, no sooner than the one ahead of it has left the last stage).
    `prefill_s` and `occupancy_s`: its own times (`RouteDecision`'s), which the others are retimed from.
    `joins_after_s`: from its first token until it joins its decode instance (the first token's overhead and
    the KV stream's tail, `RouteDecision.overhead_s` + `handoff_s`), so it joins at `joins_s`.
    `started`: its start was reported. `earliest_s`: it never starts before then (`Conductor._retime` starts it
    as early as that, the one ahead and the present allow, however late it was predicted before): when it could
    start as it was routed (its transfer done, the instance's reported backlog over, no sooner than it was
    routed), or once its start is reported, that time.

    Raises:
        InvalidRequestError: a time that is no finite number or a token count that is no integer >= 0, naming the
            field and its value (a NaN finish made every time retimed from it NaN, and its queue never drained).
    """

    request_id: RequestId
    start_s: float
    finish_s: float
    frees_s: float = attrs.field(default=attrs.Factory(lambda self: self.finish_s, takes_self=True))
    prefill_s: float = attrs.field(default=attrs.Factory(lambda self: self.finish_s - self.start_s, takes_self=True))
    occupancy_s: float = attrs.field(default=attrs.Factory(lambda self: self.frees_s - self.start_s, takes_self=True))
    joins_after_s: float = 0.0
    started: bool = False
    decode_instance: InstanceId | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    transfer_source: InstanceId | None = None
    transfer_finish_s: float = 0.0
    earliest_s: float = attrs.field(default=attrs.Factory(lambda self: self.start_s, takes_self=True))

    def __attrs_post_init__(self) -> None:
        # The Conductor builds one per accepted request and evolves one per entry it retimes (several a decision),
        # of finite floats and plain ints: one sum and two type tests pass it, as the rest of its making costs (a
        # NaN or an infinity in any time makes the sum so; text fails to add). Anything else is looked into field
        # by field, to name it.
        try:
            total = (
                self.start_s
                + self.finish_s
                + self.frees_s
                + self.prefill_s
                + self.occupancy_s
                + self.joins_after_s
                + self.transfer_finish_s
                + self.earliest_s
            )
        except (TypeError, OverflowError):
            total = math.nan
        inputs, outputs = self.input_tokens, self.output_tokens
        # total - total is 0 for a finite total, NaN for NaN or an infinity (one subtraction, no call).
        if total - total != 0 or type(inputs) is not int or type(outputs) is not int or inputs < 0 or outputs < 0:
            for name in _QUEUED_TIMES:
                _check_time(name, getattr(self, name))
            _check_counts(self, "input_tokens", "output_tokens")

    @property
    def joins_s(self) -> float:
        """When it joins its decode instance: what a decode load predictor counts it from."""
        return self.finish_s + self.joins_after_s


_QUEUED_TIMES = (
    "start_s",
    "finish_s",
    "frees_s",
    "prefill_s",
    "occupancy_s",
    "joins_after_s",
    "transfer_finish_s",
    "earliest_s",
)


def _check_time(name: str, value: object) -> None:
    """A time: a finite number of seconds, or an InvalidRequestError naming it (a NaN would poison every queue time
    after it)."""
    if type(value) is not float or not math.isfinite(value):  # the common case, a finite float, is one test
        require_number(name, value, minimum=-math.inf, error=InvalidRequestError)


def _check_counts(record: object, *names: str) -> None:
    """A record's token counts: integers >= 0, or an InvalidRequestError naming the first that is not (the records
    test their plain ints first, and call this for anything else)."""
    for name in names:
        require_int(name, getattr(record, name), minimum=0, error=InvalidRequestError)


@attrs.frozen(kw_only=True)
class ActiveDecode:
    """A request decoding on an instance.

    It decodes since `start_s` (a finite number of seconds), holding `context_tokens` (its prompt), to generate at
    most `output_tokens` (integers >= 0).

    Raises:
        InvalidRequestError: a field that is none of these (or a request id that is none), naming it and its value:
            a NaN start reached the view and failed there, after the view had changed.
    """

    request_id: RequestId
    start_s: float
    context_tokens: int
    output_tokens: int  # expected (the request's max tokens, or a prediction)

    def __attrs_post_init__(self) -> None:
        # One per request that joins (the Conductor's, from an event already checked): a few tests pass it.
        start, context, output = self.start_s, self.context_tokens, self.output_tokens
        _check_time("start_s", start)
        if type(context) is not int or type(output) is not int or context < 0 or output < 0:
            _check_counts(self, "context_tokens", "output_tokens")
        check_request_id("request_id", self.request_id)


@attrs.define
class PrefillView:
    """One prefill instance: its queue, the backlog its owner reported (`PrefillBacklog`: work the
    Conductor did not route, busy until `backlog_until_s`), and whether it is up."""

    instance_id: InstanceId
    is_up: bool = True
    queue: list[QueuedPrefill] = attrs.field(factory=list)
    backlog_until_s: float = -math.inf

    def busy_until_s(self, now: float) -> float:
        """When the instance can start a new request: the last queued one frees it, or the backlog ends
        (now, if idle)."""
        last = self.queue[-1].frees_s if self.queue else -math.inf
        return max(now, last, self.backlog_until_s)

    def queue_s(self, now: float) -> float:
        """Predicted wait before a new request could start."""
        return self.busy_until_s(now) - now

    def drained_s(self) -> float:
        """When the work queued or reported ends: the last queued prefill's first token (on a chunked-pipeline
        group, when it leaves the last stage), or the backlog's end (−inf with neither)."""
        return max(self.queue[-1].finish_s if self.queue else -math.inf, self.backlog_until_s)

    def drain_s(self, now: float) -> float:
        """Predicted time until the work queued or reported ends (0 if it has)."""
        return max(self.drained_s() - now, 0.0)

    def stale_s(self) -> float:
        """When the queue's times go stale unless an event comes first (+inf if they never do): a request reported
        started is predicted to end then (it runs until its end is reported), or the first one not reported
        started behind it to start (it starts no sooner than the present). The walk stops at that one: those
        behind it start after it. A queue where no start was reported never goes stale (its owner may report
        none: a server that tells only of first tokens; its queue drains by prediction)."""
        stale = math.inf
        for queued in self.queue:
            if not queued.started:
                return stale if stale == math.inf else min(stale, queued.start_s)
            stale = min(stale, queued.finish_s)
        return stale

    def check_invariants(self) -> None:
        previous = float("-inf")
        for queued in self.queue:
            assert queued.earliest_s <= queued.start_s, f"{queued.request_id}: starts before it can"
            assert queued.start_s <= queued.frees_s <= queued.finish_s, f"{queued.request_id}: times out of order"
            assert queued.frees_s >= previous, f"{self.instance_id}: queue out of order"
            previous = queued.frees_s


def _nanoseconds(seconds: float) -> int:
    """`seconds` in whole nanoseconds (how a view sums start times exactly).

    Raises:
        InvalidRequestError: seconds past what a float holds in nanoseconds (about 1.8e299), which has no integer.
    """
    try:
        return round(seconds * 1e9)
    except (OverflowError, ValueError):
        raise InvalidRequestError(
            f"start_s must be seconds a float holds in nanoseconds, got {shown(seconds)}"
        ) from None


@attrs.frozen
class Reservation:
    """A batch slot and KV promised on a decode instance to a request still in prefill or transfer.

    A request whose only token is its prefill's (output 1) never takes a slot: it is tracked, but
    promised nothing (the decode rule does not ask for room for it).
    """

    prompt_tokens: int
    output_tokens: int

    def __attrs_post_init__(self) -> None:
        """Counts that are integers >= 0, or an InvalidRequestError naming them (a negative prompt made a negative
        load; text, a bare TypeError in the view's sums)."""
        prompt, output = self.prompt_tokens, self.output_tokens
        if type(prompt) is not int or type(output) is not int or prompt < 0 or output < 0:  # the common case: 4 tests
            _check_counts(self, "prompt_tokens", "output_tokens")

    @property
    def takes_slot(self) -> bool:
        return takes_slot(self.output_tokens)

    @property
    def tokens(self) -> int:
        """KV promised: prompt + output, or nothing."""
        return self.prompt_tokens + self.output_tokens if self.takes_slot else 0

    @property
    def context_tokens(self) -> int:
        """What it adds to the KV a step reads once it joins."""
        return self.prompt_tokens if self.takes_slot else 0


@attrs.define
class DecodeView:
    """One decode instance: its batch, the KV it holds and has promised, its limits, and whether it is up.

    `reserved` holds the requests routed here that are still in prefill or
    transfer: from their acceptance on they count toward the instance's batch,
    the KV a step reads and the KV it holds (`load`), as they will once they join.
    """

    instance_id: InstanceId
    limits: DecodeLimits
    is_up: bool = True
    active: dict[RequestId, ActiveDecode] = attrs.field(factory=dict)
    used_tokens: int = 0
    context_tokens: int = 0  # prompt tokens of the active requests (the KV a step reads, less what they generated)
    # The active requests' start times, summed in integer nanoseconds: exact, however many join and leave (a
    # float sum would drift); their decoding seconds are n·now − `started_s_sum`.
    started_ns_sum: int = 0
    reserved: dict[RequestId, Reservation] = attrs.field(factory=dict)
    reserved_tokens: int = 0
    reserved_context_tokens: int = 0  # prompt tokens of the reserved requests
    reserved_slots: int = 0

    @property
    def capacity_tokens(self) -> int:
        return self.limits.kv_capacity_tokens

    @property
    def batch_size(self) -> int:
        return len(self.active)

    @property
    def started_s_sum(self) -> float:
        """The active requests' start times, summed (seconds)."""
        return self.started_ns_sum / 1e9

    @property
    def output_tokens(self) -> int:
        """The active requests' expected outputs, summed: the most they generate."""
        return self.used_tokens - self.context_tokens

    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens - self.reserved_tokens

    def load(self) -> DecodeLoad:
        """The batch the instance is committed to: its active requests and those reserved."""
        return DecodeLoad(
            len(self.active) + self.reserved_slots,
            self.context_tokens + self.reserved_context_tokens,
            self.used_tokens + self.reserved_tokens,
        )

    def reserve(self, request_id: RequestId, prompt_tokens: int, output_tokens: int) -> None:
        """Promise `request_id`, routed here and still in prefill or transfer, a slot and its KV (`Reservation`):
        from now on it counts toward `load()`.

        Invariants: a request is reserved at most once, and never while it decodes here; the reserved totals are
        the sums over `reserved`.

        Raises:
            InvalidRequestError: a request id that is none, counts that are not integers >= 0, or a request already
                reserved or decoding here (counted twice, its release would leave one reservation's tokens and slot
                behind); nothing changed.
        """
        check_request_id("request_id", request_id)
        if request_id in self.reserved or request_id in self.active:
            where = "reserved" if request_id in self.reserved else "decoding"
            raise InvalidRequestError(f"request {shown(request_id)} is already {where} on {self.instance_id}")
        reservation = Reservation(prompt_tokens, output_tokens)
        self.reserved[request_id] = reservation
        self.reserved_tokens += reservation.tokens
        self.reserved_context_tokens += reservation.context_tokens
        self.reserved_slots += reservation.takes_slot

    def release(self, request_id: RequestId) -> None:
        """Drop `request_id`'s reservation, if it has one here (it joined, or ended before): what it was promised no
        longer counts. Releasing one not reserved changes nothing (a request ends once, wherever it was)."""
        reservation = self.reserved.pop(request_id, None)
        if reservation is not None:
            self.reserved_tokens -= reservation.tokens
            self.reserved_context_tokens -= reservation.context_tokens
            self.reserved_slots -= reservation.takes_slot

    def join(self, request: ActiveDecode) -> None:
        """`request` starts decoding here: its reservation, if any, is released and it counts as active.

        Invariants: a request is active at most once; `used_tokens`, `context_tokens` and `started_ns_sum` are the
        sums over `active`.

        Raises:
            InvalidRequestError: no `ActiveDecode`, a request already decoding here (counted twice, its leave would
                leave its tokens behind), or a start whose nanoseconds no integer holds; nothing changed.
        """
        if type(request) is not ActiveDecode and not isinstance(request, ActiveDecode):
            raise InvalidRequestError(f"a decoding request must be an ActiveDecode, got {shown(request)}")
        if request.request_id in self.active:
            raise InvalidRequestError(f"request {shown(request.request_id)} already decodes on {self.instance_id}")
        started_ns = _nanoseconds(request.start_s)  # before any change: it is the one step that can still fail
        self.release(request.request_id)
        self.active[request.request_id] = request
        self.used_tokens += request.context_tokens + request.output_tokens
        self.context_tokens += request.context_tokens
        self.started_ns_sum += started_ns

    def leave(self, request_id: RequestId) -> None:
        """`request_id` stops decoding here (finished, refused, aborted): it no longer counts. Leaving when it is not
        active changes nothing (a repeated report)."""
        request = self.active.pop(request_id, None)
        if request is not None:
            self.used_tokens -= request.context_tokens + request.output_tokens
            self.context_tokens -= request.context_tokens
            self.started_ns_sum -= _nanoseconds(request.start_s)

    def check_invariants(self) -> None:
        total = sum(a.context_tokens + a.output_tokens for a in self.active.values())
        assert total == self.used_tokens, f"{self.instance_id}: used {self.used_tokens} != {total}"
        assert self.context_tokens == sum(a.context_tokens for a in self.active.values()), "context total out of sync"
        started = sum(_nanoseconds(a.start_s) for a in self.active.values())
        assert self.started_ns_sum == started, f"{self.instance_id}: start times out of sync"
        assert sum(r.tokens for r in self.reserved.values()) == self.reserved_tokens, (
            f"{self.instance_id}: reservations out of sync"
        )
        assert sum(r.context_tokens for r in self.reserved.values()) == self.reserved_context_tokens
        assert sum(r.takes_slot for r in self.reserved.values()) == self.reserved_slots
        assert not set(self.reserved) & set(self.active), f"{self.instance_id}: a request both reserved and active"
        # Within capacity as the instance's own check keeps it; the Conductor only accounts what joined.
        assert self.used_tokens >= 0 and self.reserved_tokens >= 0, f"{self.instance_id}: negative KV"


_V = TypeVar("_V", bound="PrefillView | DecodeView")


def check_one_view_each(ids: Sequence[InstanceId]) -> None:
    """Refuse views that name an instance twice: on a board, the second would take a slot that no id names (its
    load never read, or read for the other), and a router could choose one instance for another's queue.

    Raises:
        InvalidRequestError: naming the first id seen twice.
    """
    seen: set[InstanceId] = set()
    for instance in ids:
        if instance in seen:
            raise InvalidRequestError(f"views must name each instance once, got {shown(instance)} twice")
        seen.add(instance)


class _Board(Sequence[_V]):
    """Views side by side: a sequence of the views in the order given, and per view a slot
    in the arrays; slots go in id order, so the first of equal values is the smallest id.

    Raises:
        InvalidRequestError: two views of one instance.
    """

    def __init__(self, views: Sequence[_V]) -> None:
        self.views: tuple[_V, ...] = tuple(views)
        self.slot_views: tuple[_V, ...] = tuple(sorted(self.views, key=lambda view: view.instance_id))
        self.instance_ids = tuple(view.instance_id for view in self.slot_views)
        self.slot = {instance: slot for slot, instance in enumerate(self.instance_ids)}
        if len(self.slot) != len(self.instance_ids):
            check_one_view_each(self.instance_ids)
        self.is_up = np.ones(len(self.views), dtype=bool)
        self.all_up = True
        self._down: set[int] = set()  # slots of views that are down

    def __len__(self) -> int:
        return len(self.views)

    @overload
    def __getitem__(self, index: int) -> _V: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[_V, ...]: ...

    def __getitem__(self, index: int | slice) -> _V | tuple[_V, ...]:
        return self.views[index]

    def __iter__(self) -> Iterator[_V]:
        return iter(self.views)

    def _refresh_up(self, slot: int, is_up: bool) -> None:
        if is_up == (slot in self._down):  # changed
            self.is_up[slot] = is_up
            if is_up:
                self._down.discard(slot)
            else:
                self._down.add(slot)
            self.all_up = not self._down

    def refresh_all(self) -> None:
        for slot in range(len(self.views)):
            self.refresh(slot)

    def refresh(self, slot: int) -> None:
        raise NotImplementedError


class PrefillBoard(_Board["PrefillView"]):
    """Prefill views side by side: `busy_until_s[s]` is when the last request queued on the
    view in slot s is predicted to free it or its backlog ends (−inf with neither), `drained_s[s]`
    when its work ends (`PrefillView.drained_s`), `stale_at_s[s]` when its times go stale
    (`PrefillView.stale_s`), `is_up[s]` whether it is up. `stale_s` is the least of
    `stale_at_s`, kept as views change (the array is read again only when the least time was the
    refreshed view's own and moved later, as when the prefill it timed ends): one comparison tells
    that no view has gone stale by a time."""

    def __init__(self, views: Sequence[PrefillView]) -> None:
        super().__init__(views)
        self.busy_until_s = np.full(len(self.views), -math.inf)
        self.drained_s = np.full(len(self.views), -math.inf)
        self.stale_at_s = np.full(len(self.views), math.inf)
        self.stale_s = math.inf
        self.refresh_all()

    def refresh(self, slot: int) -> None:
        """Read the view in `slot` again (after its queue or state changed)."""
        view = self.slot_views[slot]
        was = self.stale_at_s[slot]
        if view.queue:
            last = view.queue[-1]
            self.busy_until_s[slot] = max(last.frees_s, view.backlog_until_s)
            self.drained_s[slot] = max(last.finish_s, view.backlog_until_s)
            # Most queues have no start reported (a head waits): never stale, known without the walk.
            stale = self.stale_at_s[slot] = view.stale_s() if view.queue[0].started else math.inf
        else:
            self.busy_until_s[slot] = self.drained_s[slot] = view.backlog_until_s
            stale = self.stale_at_s[slot] = math.inf
        if stale < self.stale_s:
            self.stale_s = stale
        elif was == self.stale_s and stale > was:
            # The least time was this view's and moved later (its timed prefill ended). Left low, the bound would
            # send every decision until the next retime down the stale path to find nothing.
            self.stale_s = float(self.stale_at_s.min())
        self._refresh_up(slot, view.is_up)

    def check_invariants(self) -> None:
        views = self.slot_views
        assert self.busy_until_s.tolist() == [v.busy_until_s(-math.inf) for v in views]
        assert self.drained_s.tolist() == [v.drained_s() for v in views]
        assert self.stale_at_s.tolist() == [v.stale_s() for v in views], "stale times out of sync"
        assert self.stale_s == min((v.stale_s() for v in views), default=math.inf), "the least stale time drifted"
        assert self.is_up.tolist() == [v.is_up for v in views], "up states out of sync"
        assert self.all_up == all(v.is_up for v in views)


_LOAD_FIELDS = ("batch_size", "context_tokens", "kv_tokens")
_COUNT_DTYPE = np.dtype(np.int64)


@attrs.frozen
class BoardLoads:
    """Loads of a board's instances, slot by slot (what the decode rule checks): batch sizes, the
    KV tokens a step reads, the KV tokens held or promised.

    What decode selection's compiled scan reads: 1-D int64 arrays of one whole count per slot, each in the rule's
    range (`load_problem`). `of` makes them so, checking each load; loads made otherwise keep it as their maker does
    (`board_loads_problem` checks their shape, which the scan's memory safety rests on).
    """

    batch_size: np.ndarray
    context_tokens: np.ndarray
    kv_tokens: np.ndarray
    # Made by `of`, which checked every count: only their number is left to check against a board.
    _checked: bool = attrs.field(default=False, init=False, eq=False, repr=False)

    def at(self, slot: int) -> DecodeLoad:
        return DecodeLoad(int(self.batch_size[slot]), int(self.context_tokens[slot]), int(self.kv_tokens[slot]))

    @classmethod
    def of(cls, loads: Sequence[DecodeLoad]) -> BoardLoads:
        """From one load per slot (fractional predictions rounded as the rule rounds them: `DecodeLoad.rounded`).

        Raises:
            InvalidRequestError: a load `load_problem` refuses (no `DecodeLoad`, a NaN, a count out of the rule's
                range), naming its slot: else a rounding failed bare, or a negative count reached the scan.
        """
        for slot, load in enumerate(loads):
            problem = load_problem(load)
            if problem is not None:
                raise InvalidRequestError(f"the load for slot {slot}: {problem}")
        whole = [load.rounded() for load in loads]
        made = cls(
            np.array([load.batch_size for load in whole], dtype=np.int64),
            np.array([load.context_tokens for load in whole], dtype=np.int64),
            np.array([load.kv_tokens for load in whole], dtype=np.int64),
        )
        object.__setattr__(made, "_checked", True)
        return made


def board_loads_problem(loads: object, slots: int) -> str | None:
    """What is wrong with `loads` as the loads of a board of `slots` views (None: nothing): they must be a
    `BoardLoads` of 1-D int64 arrays of one count per slot. Else the compiled scan reads past short arrays, passes a
    NaN KV count (its comparisons are false) or fails to type. O(1), as decode selection asks it per decision: the
    counts' range is checked where loads are made (`BoardLoads.of`, from loads `load_problem` passes); arrays made
    otherwise are their maker's to keep in it (the Conductor's are zeros, or slices of `of`'s)."""
    if not isinstance(loads, BoardLoads):
        return f"loads must be None or a BoardLoads (one load per slot: BoardLoads.of), got {shown(loads)}"
    if loads._checked:  # `of` made them: three int64 arrays of one length
        if len(loads.batch_size) == slots:
            return None
        return f"loads must hold one load per slot of the board ({slots}), got {len(loads.batch_size)}"
    arrays = (loads.batch_size, loads.context_tokens, loads.kv_tokens)
    for name, array in zip(_LOAD_FIELDS, arrays, strict=True):
        # A native int64 array's dtype is numpy's one instance of it: `is` passes it without building one to compare.
        if (
            type(array) is not np.ndarray
            or (array.dtype is not _COUNT_DTYPE and array.dtype != _COUNT_DTYPE)
            or array.shape != (slots,)
        ):
            return (
                f"loads.{name} must be an int64 array of one count per slot of the board ({slots}; BoardLoads.of"
                f" makes them from loads), got {shown(array)}"
            )
    return None


class DecodeBoard(_Board["DecodeView"]):
    """Decode views side by side: per slot, what each is committed to (`committed`: its `load()`,
    reservations included), its decoding batch (`active_batch`, `active_context`: their prompts,
    `active_output`: their expected outputs, `started_s_sum`: their start times), all summed, its limits (`max_batch_size`, `kv_capacity_tokens`,
    `max_context_tokens`; `UNLIMITED` where none is set) and `is_up`."""

    def __init__(self, views: Sequence[DecodeView]) -> None:
        super().__init__(views)
        count = len(self.views)
        self.committed = BoardLoads(*(np.zeros(count, dtype=np.int64) for _ in range(3)))
        self.active_batch = np.zeros(count, dtype=np.int64)
        self.active_context = np.zeros(count, dtype=np.int64)
        self.active_output = np.zeros(count, dtype=np.int64)
        self.started_s_sum = np.zeros(count, dtype=np.float64)
        self.max_batch_size = np.zeros(count, dtype=np.int64)
        self.kv_capacity_tokens = np.zeros(count, dtype=np.int64)
        self.max_context_tokens = np.zeros(count, dtype=np.int64)
        self.refresh_all()

    def refresh_load(self, slot: int) -> None:
        """Read the load of the view in `slot` again (after a reservation, join or leave: its limits and
        state unchanged)."""
        view = self.slot_views[slot]
        load = view.load()
        committed = self.committed
        committed.batch_size[slot] = load.batch_size
        committed.context_tokens[slot] = load.context_tokens
        committed.kv_tokens[slot] = load.kv_tokens
        self.active_batch[slot] = len(view.active)
        self.active_context[slot] = view.context_tokens
        self.active_output[slot] = view.output_tokens
        self.started_s_sum[slot] = view.started_s_sum

    def refresh(self, slot: int) -> None:
        """Read the view in `slot` again (its load, limits and state)."""
        self.refresh_load(slot)
        view = self.slot_views[slot]
        limits = view.limits
        self.max_batch_size[slot] = _limit(limits.max_batch_size)
        self.kv_capacity_tokens[slot] = limits.kv_capacity_tokens
        self.max_context_tokens[slot] = _limit(limits.max_context_tokens)
        self._refresh_up(slot, view.is_up)

    def check_invariants(self) -> None:
        views = self.slot_views
        committed = BoardLoads.of([v.load() for v in views])
        for name in ("batch_size", "context_tokens", "kv_tokens"):
            assert getattr(self.committed, name).tolist() == getattr(committed, name).tolist(), f"committed {name}"
        assert self.active_batch.tolist() == [len(v.active) for v in views], "batches out of sync"
        assert self.active_context.tolist() == [v.context_tokens for v in views], "contexts out of sync"
        assert self.active_output.tolist() == [v.output_tokens for v in views], "outputs out of sync"
        assert self.started_s_sum.tolist() == [v.started_s_sum for v in views], "start times out of sync"
        assert self.kv_capacity_tokens.tolist() == [v.capacity_tokens for v in views], "capacities out of sync"
        assert self.max_batch_size.tolist() == [_limit(v.limits.max_batch_size) for v in views], (
            "batch limits out of sync"
        )
        assert self.max_context_tokens.tolist() == [_limit(v.limits.max_context_tokens) for v in views], (
            "context limits out of sync"
        )
        assert self.is_up.tolist() == [v.is_up for v in views], "up states out of sync"
        assert self.all_up == all(v.is_up for v in views)


def _limit(value: int | None) -> int:
    """A limit as the board holds it: `UNLIMITED` where none is set."""
    return UNLIMITED if value is None else value


def _finite_time(_instance: object, attribute: Any, value: Any) -> None:
    """An event's time: a finite number of seconds (`_check_time`)."""
    _check_time(attribute.name, value)


_count = int_at_least(0, error=InvalidRequestError)


def _instance(_instance_obj: object, attribute: Any, value: Any) -> None:
    """An event's instance: an id string (anything else could not be looked up, or would look up nothing)."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{attribute.name} must be a non-empty instance id string, got {shown(value)}")


def _request(_instance_obj: object, attribute: Any, value: Any) -> None:
    """An event's request: an id as a `Request`'s (`types.check_request_id`)."""
    check_request_id(attribute.name, value)


def _reason(instance: object, attribute: Any, value: Any) -> None:
    """A rejection's or abort's reason: a `Reason` (a string would reach the request's end as it is) of the
    event's kind (`DECODE_REFUSALS` for a decode instance's refusal, `ABORT_REASONS` for an abort)."""
    if not isinstance(value, Reason):
        raise InvalidRequestError(f"{attribute.name} must be a mooncake.sched.Reason, got {shown(value)}")
    refusal = isinstance(instance, RequestRejected)
    allowed = DECODE_REFUSALS if refusal else ABORT_REASONS
    if value not in allowed:
        names = ", ".join(sorted(reason.name for reason in allowed))
        what = "a decode instance's refusal" if refusal else "an abort"
        raise InvalidRequestError(f"{attribute.name} {value} is no reason for {what}: one of {names}")


@attrs.frozen(kw_only=True)
class PrefillBacklog:
    """Work a prefill instance has that the Conductor did not route (another client of a shared server,
    as the server's own counters show it), measured by the instance's owner: it is busy with that work
    until `until_s`, and requests routed to it from now on start after it (those already queued keep
    their times). A later report replaces an earlier one; `until_s` <= `now` clears it."""

    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)
    until_s: float = attrs.field(validator=_finite_time)


@attrs.frozen(kw_only=True)
class PrefillStarted:
    """The routed prefill instance started the request's prefill."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)


@attrs.frozen(kw_only=True)
class PrefillFinished:
    """The request's prefill is done: it leaves the prefill queue, its KV is on its way to the decode instance."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)


@attrs.frozen(kw_only=True)
class PrefilledInline:
    """A request was prefilled inside its decode instance's batch (`instance_id`): it leaves the
    prefill queue it was routed to without running there, and its KV is already where it decodes."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)


@attrs.frozen(kw_only=True)
class DecodeJoined:
    """The request joined its decode instance's batch holding `context_tokens` (its prompt), to generate at most
    `output_tokens` in all (its output length, a server's `max_tokens`; the prefill's first token included), as
    its reservation says: the Conductor accounts the reservation and reads these only where there is none."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)
    context_tokens: int = attrs.field(validator=_count)
    output_tokens: int = attrs.field(validator=_count)


@attrs.frozen(kw_only=True)
class DecodeFinished:
    """A request finished decoding; `generated_tokens` (if known) teaches output-length predictors."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)
    generated_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(_count))


@attrs.frozen(kw_only=True)
class RequestRejected:
    """The decode instance refused a prefilled request it was routed to (its own check of the decode rule)."""

    request_id: RequestId = attrs.field(validator=_request)
    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)
    reason: Reason = attrs.field(default=Reason.DECODE_REJECTED, validator=_reason)


@attrs.frozen(kw_only=True)
class RequestAborted:
    """A request ended before completing for a reason no scheduling decision gave: its client left,
    its deadline passed, an engine failed."""

    request_id: RequestId = attrs.field(validator=_request)
    now: float = attrs.field(validator=_finite_time)
    reason: Reason = attrs.field(default=Reason.FAILED, validator=_reason)


@attrs.frozen(kw_only=True)
class InstanceDown:
    """An instance stopped answering: it gets no new requests, what it held is aborted, its cache leaves the index."""

    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)


@attrs.frozen(kw_only=True)
class InstanceUp:
    """An instance that was down serves again."""

    instance_id: InstanceId = attrs.field(validator=_instance)
    now: float = attrs.field(validator=_finite_time)


SchedulerEvent = (
    PrefillBacklog
    | PrefillStarted
    | PrefillFinished
    | PrefilledInline
    | DecodeJoined
    | DecodeFinished
    | RequestRejected
    | RequestAborted
    | InstanceDown
    | InstanceUp
)
