"""The line of requests waiting for room on the decode side, first come, first served.

A request the Conductor rejects for room the decode side frees as its own requests end
(`admission.WAITS_FOR_ROOM`: a full batch, no KV room, the TBT objective) need not be refused at once: it may
wait, before any prefill, and be scheduled again until `admission.room_wait_deadline` (vLLM's scheduler
queues such a request; the paper's Conductor rejects it, a `max_wait_s` of 0). This queue decides who is
tried when; its caller (the example cluster's gateway, the simulator) asks it whenever room may have
appeared (a request ended, an instance came up or went down) and when `next_deadline` comes, and acts on the
decisions it hands back.

The discipline (vLLM's FCFS waiting queue, which blocks on its head the same way):

- An arrival while no one waits is scheduled at once; rejected for room, it waits (`arrive` answers None)
  until its deadline, else its decision is final.
- An arrival while others wait joins the line behind them untried: nobody overtakes, so a large request at
  the head is never starved by smaller ones that came after it. Untried, its deadline is the most its wait
  may be (`max_wait_s`, the TTFT objective); its first try sets it from the TTFT the Conductor estimates.
  Only one that no wait could get in (`Scheduler.lasting_refusal`: no instance up, a context no instance
  holds) is refused at once instead.
- `pump` tries the head: accepted, it leaves and the next is tried; rejected for room before its deadline, it
  keeps its place and the line waits; rejected otherwise, it leaves rejected and the next is tried. Once the
  head keeps its place, each request behind it that no wait could get in any more (`lasting_refusal`: its
  instance went down, was removed or shrank since it joined) leaves refused, as an arrival would be, untried.
  Then each request whose deadline has come is tried once, out of turn (the head has just failed, so only room
  the head cannot use is taken), by deadline (equal ones in the order they joined the line: one arriving again
  joined last), and leaves, admitted or rejected. Only one that joined the line late (its caller
  read its body first) can be due before the head: a deadline is at most arrival plus the same bound.
- A request the scheduler raises for (a try, or `lasting_refusal`) leaves the line undecided: no wait would change
  that. `pump` hands its item and the error to the caller's `failed`, and goes on; without one, it raises.
- Every try passes the time waited since arrival (`Scheduler.schedule(..., waited_s=...)`): the Conductor
  counts it against the TTFT objective, so a request accepted after waiting still meets it by its estimate.
- A request that arrives again (`arrive(..., again=True)`: it was accepted, and the instance it went to
  failed) keeps its arrival and takes its place by it: right behind the last waiting request that arrived
  before it (or at the same time), so it overtakes no earlier arrival and goes ahead of the later ones behind
  that one (it was accepted before them; a line joined late may hold a later arrival ahead of an earlier
  one, which stays ahead). Untried while it stands behind one, else tried at once as a request that finds
  no line.

Invariants: the line is in the order requests joined it, but that a request arriving again stands right behind the
last waiting one that arrived no later than it; a request's deadline is at most `max_wait_s` and the TTFT
objective after its arrival; a request leaves the line once (admitted, rejected, failed or `remove`d) and its
decision (or failure) is handed back once, even when a later try in the same `pump` raises (the decisions made
before it come with the next `pump`); after a `pump`, no request behind the head has a lasting refusal (as of
that pump); no two waiting requests share a request id; with `max_wait_s` 0 nothing waits.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

import attrs

from mooncake._checks import require_number, shown
from mooncake.errors import InvalidRequestError
from mooncake.sched.admission import room_wait_deadline
from mooncake.sched.conductor import ScheduleDecision
from mooncake.sched.outcome import Reason
from mooncake.types import Request, RequestId, Slo

__all__ = ["AdmissionQueue", "Scheduler"]

T = TypeVar("T")


class Scheduler(Protocol):
    """What the queue schedules with: the Conductor (whose `slo` bounds a wait, as it bounds acceptance)."""

    @property
    def slo(self) -> Slo: ...

    def schedule(self, request: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision: ...

    def lasting_refusal(self, request: Request) -> Reason | None:
        """Why no wait could get `request` in (nothing scheduled), or None."""


@attrs.define(eq=False)
class _Entry(Generic[T]):
    item: T
    request: Request
    deadline_s: float
    seq: int
    waiting: bool = True


class AdmissionQueue(Generic[T]):
    """Requests waiting for decode room, each with its caller's `item` (handed back with its decision).

    Items are told apart by identity, not equality (`remove` and `deadline` take the very object `arrive` was
    given): a caller's record of a request need be neither hashable nor unique in value.

    Args:
        scheduler: decides on a request (the Conductor); its TTFT objective also bounds a wait
            (`room_wait_deadline`), so the two cannot disagree.
        max_wait_s: the longest a request waits after its arrival (0: never).

    Raises:
        ConfigError: `max_wait_s` negative or not finite.
    """

    def __init__(self, scheduler: Scheduler, *, max_wait_s: float) -> None:
        self.scheduler = scheduler
        self.max_wait_s = require_number("max_wait_s", max_wait_s, minimum=0.0)
        self._line: collections.deque[_Entry[T]] = collections.deque()  # the order they joined; left entries linger
        self._deadlines: list[tuple[float, int, int, _Entry[T]]] = []  # a heap (deadline, seq, row); stale rows linger
        self._entries: dict[int, _Entry[T]] = {}  # id(item) → its entry, while it waits
        self._request_ids: set[RequestId] = set()  # of the requests waiting
        self._undelivered: list[tuple[T, ScheduleDecision]] = []  # decided by a pump that then raised
        self._seq = itertools.count()
        self._rows = itertools.count()  # ties an entry's rows apart (a deadline may come back to a value)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[T]:
        """The items waiting, in the order they joined the line."""
        return (entry.item for entry in self._line if entry.waiting)

    def arrive(self, item: T, request: Request, now: float, *, again: bool = False) -> ScheduleDecision | None:
        """A request arrives: its decision, or None while it waits in line.

        `again`: the request was accepted before and arrives again, its arrival kept (its instance failed): it
        takes its place by its arrival, right behind the last waiting request that arrived no later than it (the
        module docstring).

        Raises:
            InvalidRequestError: `request` is no `Request`; `now` is not a finite number; `item`, or a request with this
                id, already waits; or the scheduler refuses the request as invalid (one already in flight, say),
                nothing changed.
        """
        if not isinstance(request, Request):
            raise InvalidRequestError(f"arrive takes a mooncake.types.Request, got {type(request).__name__}")
        # Checked here, whoever waits: behind others the request is not tried now, so no scheduler would see it.
        require_number("now", now, minimum=-math.inf, error=InvalidRequestError)
        if id(item) in self._entries:
            raise InvalidRequestError(f"{shown(item)} already waits for room")
        if request.request_id in self._request_ids:
            raise InvalidRequestError(f"request {request.request_id} already waits for room")
        later = None  # the waiting request it goes ahead of (only a request arriving again goes ahead)
        behind = bool(self._entries)  # whether it stands behind a waiting one
        if again and behind:
            waiting = [entry for entry in self._line if entry.waiting]
            # Right behind the last that arrived no later than it: it overtakes no earlier arrival.
            earlier = [i for i, entry in enumerate(waiting) if entry.request.arrival_s <= request.arrival_s]
            behind = bool(earlier)
            position = earlier[-1] + 1 if earlier else 0
            later = waiting[position] if position < len(waiting) else None
        if behind:  # untried, unless no wait could help it
            refusal = self._lasting_refusal(request)
            if refusal is not None:
                return refusal
            deadline = request.arrival_s + min(self.max_wait_s, self.scheduler.slo.ttft_s)
        else:
            decision = self._try(request, now)
            deadline = self._deadline(request, decision)
            if not now < deadline:
                return decision
        self._enter(item, request, deadline)
        if later is not None:  # arriving again: moved from the end to its place
            self._line.insert(self._line.index(later), self._line.pop())
        return None

    def pump(
        self, now: float, *, failed: Callable[[T, Exception], None] | None = None
    ) -> list[tuple[T, ScheduleDecision]]:
        """Room may have appeared, or a deadline come: try the line (the module's discipline); the decisions of
        those that left it, in the order they were made.

        `failed`: called with the item of a request the scheduler raises for (one scheduled meanwhile by another
        caller, a scheduler bug) and the error, once it has left the line undecided, for the caller to end it;
        the pump goes on with the others. It is called during the pump, so it must not use the queue.

        Raises:
            InvalidRequestError: `now` is not a finite number (the caller's error: nothing changed).
            whatever the scheduler raises for a request, when no `failed` is given: that request leaves the line
                undecided, and the decisions made before it come with the next `pump`.
        """
        # Checked here, not left to the scheduler: its refusal would read as the head request's fault and drop it.
        require_number("now", now, minimum=-math.inf, error=InvalidRequestError)
        decided, self._undelivered = self._undelivered, []
        try:
            while self._entries:
                head = self._head()
                try:
                    decision = self._try(head.request, now)
                    if self._keeps_place(head, decision, now):
                        break
                except Exception as error:
                    self._fail(head, error, failed)
                    continue
                self._leave(head)
                decided.append((head.item, decision))
            if self._entries:  # the head keeps its place: those behind it are not tried, but may be refused for good
                self._refuse_for_good_behind_head(decided, failed)
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, _, _, entry = heapq.heappop(self._deadlines)
                if not entry.waiting or deadline != entry.deadline_s:
                    continue  # it left, or a try moved its deadline (a newer row stands for it)
                # Behind the head, so never tried before: its deadline is the most any wait may be, which no
                # estimate can extend. Its one try gives its decision a reason.
                try:
                    decision = self._try(entry.request, now)
                except Exception as error:
                    self._fail(entry, error, failed)
                    continue
                self._leave(entry)
                decided.append((entry.item, decision))
        except BaseException:
            self._undelivered = decided  # each decision is handed back once: by the next pump
            raise
        return decided

    def remove(self, item: T) -> bool:
        """Take `item` out of the line (its client left); False if it was not waiting. Pump afterwards: the
        head leaving lets the next one try."""
        entry = self._entries.get(id(item))
        if entry is None:
            return False
        self._leave(entry)
        return True

    def clear(self) -> list[T]:
        """Empty the line; the items that waited, in line order."""
        items = list(self)
        for entry in self._entries.values():
            entry.waiting = False
        self._line.clear()
        self._deadlines.clear()
        self._entries.clear()
        self._request_ids.clear()
        return items

    def next_deadline(self) -> float:
        """When the earliest wait ends (`pump` then), math.inf when no one waits."""
        while self._deadlines:
            deadline, _, _, entry = self._deadlines[0]
            if entry.waiting and deadline == entry.deadline_s:
                return deadline
            heapq.heappop(self._deadlines)
        return math.inf

    def deadline(self, item: T) -> float:
        """When `item`'s wait ends.

        Raises:
            InvalidRequestError: `item` does not wait.
        """
        entry = self._entries.get(id(item))
        if entry is None:
            raise InvalidRequestError(f"{shown(item)} does not wait for room")
        return entry.deadline_s

    # ------------------------------------------------------------------ internals

    def _try(self, request: Request, now: float) -> ScheduleDecision:
        return self.scheduler.schedule(request, now, waited_s=max(0.0, now - request.arrival_s))

    def _lasting_refusal(self, request: Request) -> ScheduleDecision | None:
        """The refusal of a request no wait could get in (`Scheduler.lasting_refusal`), untried, or None."""
        reason = self.scheduler.lasting_refusal(request)
        if reason is None:
            return None
        return ScheduleDecision(request_id=request.request_id, accepted=False, reason=reason)

    def _refuse_for_good_behind_head(
        self, decided: list[tuple[T, ScheduleDecision]], failed: Callable[[T, Exception], None] | None
    ) -> None:
        """End each request behind the head (which keeps its place) that no wait could get in any more (a refusal
        that became lasting after it joined: its instance went down, was removed or shrank), as `arrive` refuses
        it. One `lasting_refusal` each, which schedules nothing: a pump where the head keeps its place costs one
        per waiting request, no try."""
        for entry in itertools.islice(self._line, 1, None):  # the head is the line's first: `_head` dropped those left
            if not entry.waiting:
                continue
            try:
                refusal = self._lasting_refusal(entry.request)
            except Exception as error:
                self._fail(entry, error, failed)
                continue
            if refusal is not None:
                self._leave(entry)
                decided.append((entry.item, refusal))

    def _fail(self, entry: _Entry[T], error: Exception, failed: Callable[[T, Exception], None] | None) -> None:
        """The scheduler raised for waiting `entry`: it leaves the line (no wait would change that), its item and
        the error handed to `failed`, else the error raised again. (An interrupt, a BaseException that is no
        Exception, is no fault of the request's: it is not caught, and the request keeps its place.)"""
        self._leave(entry)
        if failed is None:
            raise error
        failed(entry.item, error)

    def _deadline(self, request: Request, decision: ScheduleDecision) -> float:
        if decision.accepted:
            return -math.inf
        assert decision.reason is not None
        return room_wait_deadline(
            decision.reason,
            estimated_ttft_s=decision.ttft_s,
            arrival_s=request.arrival_s,
            slo=self.scheduler.slo,
            max_wait_s=self.max_wait_s,
        )

    def _keeps_place(self, entry: _Entry[T], decision: ScheduleDecision, now: float) -> bool:
        """After a try: whether `entry` still waits (its deadline set anew from the try). A decision no deadline can
        be set from (an estimate that is no time) raises, and its request fails as one whose try raises does."""
        deadline = self._deadline(entry.request, decision)
        if not now < deadline:
            return False
        if deadline != entry.deadline_s:
            entry.deadline_s = deadline
            self._push(entry)
        return True

    def _enter(self, item: T, request: Request, deadline: float) -> None:
        entry = _Entry(item, request, deadline, next(self._seq))
        self._line.append(entry)
        self._entries[id(item)] = entry
        self._request_ids.add(request.request_id)
        self._push(entry)

    def _push(self, entry: _Entry[T]) -> None:
        heapq.heappush(self._deadlines, (entry.deadline_s, entry.seq, next(self._rows), entry))

    def _head(self) -> _Entry[T]:
        while not self._line[0].waiting:
            self._line.popleft()
        return self._line[0]

    def _leave(self, entry: _Entry[T]) -> None:
        entry.waiting = False
        del self._entries[id(entry.item)]
        self._request_ids.discard(entry.request.request_id)
        if not self._entries:
            self._line.clear()
            self._deadlines.clear()
