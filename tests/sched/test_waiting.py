"""Tests for `mooncake.sched.waiting`: the line of requests waiting for decode room.

A `RuleBasedStateMachine` drives the queue against a plain list that states the discipline directly (try
the head until one keeps its place, then everyone past a deadline once, by deadline, out of the line), both
scheduling on their own copy of a room-counting fake of the Conductor: the same decisions in the same order,
the same line, the same deadlines; the decode side may shrink meanwhile, and after each pump no one waits whom no
wait could get in. Examples: nobody overtakes the head, a wait ends where its TTFT objective would be broken, what
no wait could help is refused at once, a request the scheduler raises for is handed back alone, bad input is
named. (That the real Conductor counts the wait: tests/sched/test_admission.py.)
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.admission import WAITS_FOR_ROOM, room_wait_deadline
from mooncake.sched.build import build_conductor
from mooncake.sched.conductor import ScheduleDecision
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.join import DecodeLimits
from mooncake.sched.outcome import Reason
from mooncake.sched.view import InstanceDown
from mooncake.sched.waiting import AdmissionQueue
from mooncake.types import InstanceId, Request, RequestId, Slo

SLO = Slo(ttft_s=10.0, tbt_s=0.1)
CAPACITY = 10  # the fake decode side's room, in units a request's input_length takes


@attrs.define
class FakeConductor:
    """Room for `CAPACITY` units; a request takes `input_length` of them and its estimated TTFT is
    `output_length` tenths of a second plus a quarter second per unit taken. Checks in the Conductor's order:
    never fits (over `largest`, what the decode side holds at most: it shrinks as an instance goes down or is
    resized), TTFT with the wait counted, then room."""

    free: int = CAPACITY
    largest: int = CAPACITY
    slo: Slo = SLO
    held: dict[RequestId, int] = attrs.field(factory=dict)
    calls: list[tuple[RequestId, float, float]] = attrs.field(factory=list)

    def schedule(self, request: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
        self.calls.append((request.request_id, now, waited_s))
        # A busier decode side, a longer estimate (as a prefill queue would grow): room freed moves deadlines.
        size, ttft_s = request.input_length, request.output_length / 10 + 0.25 * (CAPACITY - self.free)
        reason = None
        if size > self.largest:
            reason = Reason.CONTEXT_TOO_LONG
        elif waited_s + ttft_s > SLO.ttft_s:
            reason = Reason.TTFT_SLO
        elif size > self.free:
            reason = Reason.BATCH_FULL
        if reason is not None:
            return ScheduleDecision(request_id=request.request_id, accepted=False, reason=reason, ttft_s=ttft_s)
        self.free -= size
        self.held[request.request_id] = size
        return ScheduleDecision(request_id=request.request_id, accepted=True, ttft_s=ttft_s)

    def release(self, request_id: RequestId) -> None:
        self.free += self.held.pop(request_id)

    def lasting_refusal(self, request: Request) -> Reason | None:
        return Reason.CONTEXT_TOO_LONG if request.input_length > self.largest else None


def request(number: int, now: float, size: int, ttft_tenths: int) -> Request:
    return Request(
        request_id=RequestId(f"r{number}"),
        arrival_s=now,
        input_length=size,
        output_length=ttft_tenths,
        block_keys=(),
    )


@attrs.define(eq=False)
class _Row:
    item: int
    request: Request
    deadline_s: float
    joined: int  # when it joined the line (ties between equal deadlines go in this order)


@attrs.define
class LineModel:
    """The discipline written plainly: a list in arrival order, scanned whole."""

    conductor: FakeConductor
    max_wait_s: float
    line: list[_Row] = attrs.field(factory=list)
    joins: int = 0

    def _try(self, row_request: Request, now: float) -> tuple[ScheduleDecision, float]:
        decision = self.conductor.schedule(row_request, now, waited_s=max(0.0, now - row_request.arrival_s))
        if decision.accepted:
            return decision, -math.inf
        assert decision.reason is not None
        deadline = room_wait_deadline(
            decision.reason,
            estimated_ttft_s=decision.ttft_s,
            arrival_s=row_request.arrival_s,
            slo=SLO,
            max_wait_s=self.max_wait_s,
        )
        return decision, deadline

    def arrive(self, item: int, req: Request, now: float, *, again: bool = False) -> ScheduleDecision | None:
        # At the end; arriving again, right behind the last waiting one that arrived no later than it.
        position = len(self.line)
        if again:
            earlier = [i for i, row in enumerate(self.line) if row.request.arrival_s <= req.arrival_s]
            position = earlier[-1] + 1 if earlier else 0
        if position and self._refused_for_good(req):  # behind others, and no wait could get it in: refused at once
            return ScheduleDecision(request_id=req.request_id, accepted=False, reason=Reason.CONTEXT_TOO_LONG)
        if position:  # behind others: untried
            self.joins += 1
            self.line.insert(position, _Row(item, req, req.arrival_s + min(self.max_wait_s, SLO.ttft_s), self.joins))
            return None
        decision, deadline = self._try(req, now)
        if now < deadline:
            self.joins += 1
            self.line.insert(0, _Row(item, req, deadline, self.joins))
            return None
        return decision

    def pump(self, now: float) -> list[tuple[int, ScheduleDecision]]:
        out = []
        while self.line:
            head = self.line[0]
            decision, deadline = self._try(head.request, now)
            if now < deadline:
                head.deadline_s = deadline
                break
            self.line.pop(0)
            out.append((head.item, decision))
        for row in [row for row in self.line[1:] if self._refused_for_good(row.request)]:  # behind a head that waits
            self.line.remove(row)
            out.append(
                (
                    row.item,
                    ScheduleDecision(request_id=row.request.request_id, accepted=False, reason=Reason.CONTEXT_TOO_LONG),
                )
            )
        for row in sorted((r for r in self.line if r.deadline_s <= now), key=lambda r: (r.deadline_s, r.joined)):
            self.line.remove(row)
            out.append((row.item, self._try(row.request, now)[0]))
        return out

    def _refused_for_good(self, req: Request) -> bool:
        return req.input_length > self.conductor.largest

    def remove(self, item: int) -> bool:
        for row in self.line:
            if row.item == item:
                self.line.remove(row)
                return True
        return False


def summary(decided: list[tuple[int, ScheduleDecision]]) -> list[tuple[int, bool, Reason | None]]:
    return [(item, d.accepted, d.reason) for item, d in decided]


class LineMachine(RuleBasedStateMachine):
    """The queue against `LineModel`, each with its own fake Conductor."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.number = 0
        self.queue: AdmissionQueue[int] | None = None
        self.model: LineModel | None = None
        self.real = FakeConductor()
        self.arrivals: dict[int, float] = {}
        self.decided: set[int] = set()
        self.removed: set[int] = set()
        self.accepted: list[RequestId] = []
        self.requests: dict[int, Request] = {}
        self.arrived_again = False

    @initialize(max_wait_s=st.sampled_from([0.0, 2.0, 7.5, 30.0]))
    def start(self, max_wait_s: float) -> None:
        self.queue = AdmissionQueue(self.real, max_wait_s=max_wait_s)
        self.model = LineModel(FakeConductor(), max_wait_s)

    def _record(
        self, decided: list[tuple[int, ScheduleDecision]], expected: list[tuple[int, ScheduleDecision]]
    ) -> None:
        assert summary(decided) == summary(expected)
        for item, decision in decided:
            assert item not in self.decided, "decided twice"
            self.decided.add(item)
            if decision.accepted:
                self.accepted.append(RequestId(f"r{item}"))

    @precondition(lambda self: self.queue is not None)
    @rule(size=st.integers(1, CAPACITY + 1), ttft_tenths=st.integers(1, 120), late_s=st.sampled_from([0.0, 0.0, 1.5]))
    def arrive(self, size: int, ttft_tenths: int, late_s: float) -> None:
        """A request arrives, `late_s` after its arrival time (the gateway reads and tokenizes its body first):
        one that joins the line late may be due before those ahead of it."""
        assert self.queue is not None and self.model is not None
        self.number += 1
        arrival = max(0.0, self.now - late_s)
        req = request(self.number, arrival, size, ttft_tenths)
        self.arrivals[self.number] = arrival
        self.requests[self.number] = req
        got = self.queue.arrive(self.number, req, self.now)
        want = self.model.arrive(self.number, req, self.now)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            self._record([(self.number, got)], [(self.number, want)])

    @precondition(lambda self: self.queue is not None and self.accepted)
    @rule(data=st.data())
    def arrive_again(self, data: st.DataObject) -> None:
        """An accepted request's instance fails: its room is freed and it arrives again, its arrival kept, to stand
        ahead of the waiting requests that arrived after it."""
        assert self.queue is not None and self.model is not None
        request_id = self.accepted.pop(data.draw(st.integers(0, len(self.accepted) - 1)))
        self.real.release(request_id)
        self.model.conductor.release(request_id)
        item = int(request_id[1:])
        self.decided.discard(item)
        self.arrived_again = True
        req = self.requests[item]
        got = self.queue.arrive(item, req, self.now, again=True)
        want = self.model.arrive(item, req, self.now, again=True)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            self._record([(item, got)], [(item, want)])

    @precondition(lambda self: self.queue is not None)
    @rule(dt=st.floats(0.0, 6.0))
    def advance_to_a_deadline_or_by(self, dt: float) -> None:
        """Time passes, to the earliest deadline if that comes first, where the line is pumped (a caller's timer)."""
        assert self.queue is not None and self.model is not None
        deadline = self.queue.next_deadline()
        if deadline <= self.now + dt:
            self.now = max(self.now, deadline)
            self._record(self.queue.pump(self.now), self.model.pump(self.now))
        else:
            self.now += dt

    @precondition(lambda self: self.queue is not None and self.accepted)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A request ends: room is freed, the line pumped."""
        assert self.queue is not None and self.model is not None
        request_id = self.accepted.pop(data.draw(st.integers(0, len(self.accepted) - 1)))
        self.real.release(request_id)
        self.model.conductor.release(request_id)
        self._record(self.queue.pump(self.now), self.model.pump(self.now))

    @precondition(lambda self: self.queue is not None and len(self.queue) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """A waiting client leaves: the line is pumped after."""
        assert self.queue is not None and self.model is not None
        item = data.draw(st.sampled_from(list(self.queue)))
        assert self.queue.remove(item) and self.model.remove(item)
        assert not self.queue.remove(item)
        self.removed.add(item)
        self._record(self.queue.pump(self.now), self.model.pump(self.now))

    @precondition(lambda self: self.queue is not None and len(self.queue) > 1)
    @rule(data=st.data())
    def resize_the_decode_side(self, data: st.DataObject) -> None:
        """The largest request the decode side holds changes (an instance goes down, comes up, is resized): the
        line is pumped, as the gateway and the simulator do on such news. Often between the head's size and the
        largest behind it: a refusal behind the head becomes lasting while the head may keep its place."""
        assert self.queue is not None and self.model is not None
        head, *behind = (self.requests[item].input_length for item in self.queue)
        sizes = st.integers(1, CAPACITY)
        if behind and max(behind) > head:
            sizes = st.integers(head, max(behind) - 1) | sizes
        largest = data.draw(sizes)
        self.real.largest = self.model.conductor.largest = largest
        self._record(self.queue.pump(self.now), self.model.pump(self.now))

    @invariant()
    def no_one_waits_whom_no_wait_could_get_in(self) -> None:
        """Every rule that changes what the decode side holds pumps the line: a request refused for good (here a
        context over the largest instance) is not left waiting behind the head until its deadline."""
        if self.queue is None:
            return
        for item in self.queue:
            assert self.real.lasting_refusal(self.requests[item]) is None, (item, list(self.queue), self.real.largest)

    @invariant()
    def same_line_and_deadlines(self) -> None:
        if self.queue is None or self.model is None:
            return
        waiting = list(self.queue)
        assert waiting == [row.item for row in self.model.line]
        if not self.arrived_again:
            assert waiting == sorted(waiting), "the line is in the order requests joined it"
        assert len(self.queue) == len(waiting)
        for row in self.model.line:
            assert self.queue.deadline(row.item) == row.deadline_s
            arrival = self.arrivals[row.item]
            assert row.deadline_s <= arrival + min(self.queue.max_wait_s, SLO.ttft_s)
        assert self.queue.next_deadline() == min((row.deadline_s for row in self.model.line), default=math.inf)
        if self.queue.max_wait_s == 0:
            assert not waiting
        assert self.real.free == self.model.conductor.free

    @invariant()
    def every_request_is_in_one_place(self) -> None:
        if self.queue is None:
            return
        waiting = set(self.queue)
        assert not waiting & self.decided and not waiting & self.removed and not self.decided & self.removed
        assert waiting | self.decided | self.removed == set(self.arrivals)

    @invariant()
    def every_try_counts_the_wait(self) -> None:
        for request_id, now, waited_s in self.real.calls:
            assert waited_s == pytest.approx(now - self.arrivals[int(request_id[1:])], abs=1e-9)


TestLine = LineMachine.TestCase
TestLine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_nobody_overtakes_the_head_and_its_turn_comes_when_room_does() -> None:
    """A large request at the head blocks the smaller ones behind it (they are not even tried); when room
    frees, it goes first, then those behind, in arrival order."""
    conductor = FakeConductor(free=3)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    assert queue.arrive("big", request(1, 0.0, 5, 10), 0.0) is None
    for n, name in ((2, "small-a"), (3, "small-b")):
        assert queue.arrive(name, request(n, 0.1 * n, 1, 10), 0.1 * n) is None
    assert [c[0] for c in conductor.calls] == ["r1"], "those behind the head are not tried on arrival"
    assert queue.pump(0.5) == [] and list(queue) == ["big", "small-a", "small-b"]
    conductor.free = 6
    decided = queue.pump(1.0)
    assert [(item, d.accepted) for item, d in decided] == [("big", True), ("small-a", True)]
    assert list(queue) == ["small-b"]  # no room left for it: it keeps its place
    assert [c[2] for c in conductor.calls[-3:]] == pytest.approx([1.0, 0.8, 0.7])  # the wait counted on each try


def test_a_request_whose_wait_cannot_meet_its_objective_leaves_rejected() -> None:
    """Its deadline is where the wait plus its estimated TTFT reaches the objective; room that comes after it
    is no use to it: tried then it leaves (TTFT, the wait counted), and the next in line is tried in the same
    pump and takes the room."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    assert queue.arrive("a", request(1, 0.0, 1, 60), 0.0) is None  # 8.5 s estimated now: 1.5 s to wait at most
    assert queue.deadline("a") == pytest.approx(1.5)
    assert queue.arrive("b", request(2, 1.0, 1, 10), 1.0) is None
    assert queue.deadline("b") == pytest.approx(11.0)  # untried: the most a wait may be
    conductor.free = 1
    decided = queue.pump(2.0)
    assert [(item, d.accepted, d.reason) for item, d in decided] == [("a", False, Reason.TTFT_SLO), ("b", True, None)]
    assert len(queue) == 0 and queue.next_deadline() == math.inf


def test_what_no_wait_could_get_in_is_refused_at_once_even_behind_others() -> None:
    """Behind a waiter, an arrival is not tried (no overtaking), but one no wait could help (here a context
    past what the decode side holds) is refused at once, not left to wait for its turn."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    assert queue.arrive("a", request(1, 0.0, 1, 10), 0.0) is None
    decision = queue.arrive("huge", request(2, 0.1, CAPACITY + 1, 10), 0.1)
    assert decision is not None and decision.reason is Reason.CONTEXT_TOO_LONG
    assert list(queue) == ["a"] and [c[0] for c in conductor.calls] == ["r1"]


def real_request(number: int, prompt_tokens: int, output_tokens: int) -> Request:
    """A request of its own blocks (16 tokens each), arrived at 0."""
    first = number * 100_000
    return Request(
        request_id=RequestId(f"r{number}"),
        arrival_s=0.0,
        input_length=prompt_tokens,
        output_length=output_tokens,
        block_keys=tuple(range(first, first + -(-prompt_tokens // 16))),
        block_size_tokens=16,
    )


@pytest.mark.parametrize("change", ["instance-down", "instance-shrinks"])
def test_a_refusal_that_becomes_lasting_behind_the_head_ends_that_wait_at_once(change: str) -> None:
    """The reviewer's case, on the real Conductor: a request waits behind the head that only the large decode
    instance can hold; that instance goes down (or is resized too small). The next pump (the head still waits for a
    batch slot) refuses it at once, for the reason an identical new arrival gets, not at its deadline 30 s on."""
    conductor = build_conductor(
        model=MODELS["llama3-70b"],
        hardware=HARDWARE["8xA800"],
        prefill_instances=["p0"],
        decode_instances=["small"],
        block_size_tokens=16,
        decode_limits=DecodeLimits(kv_capacity_tokens=20_000, max_batch_size=1),
        slo=Slo(ttft_s=30.0, tbt_s=10.0),
    )
    conductor.add_decode_instance(InstanceId("big"), DecodeLimits(kv_capacity_tokens=200_000, max_batch_size=1))
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    for number, item in enumerate(("a", "b")):  # one batch slot each: both full
        first = queue.arrive(item, real_request(number, 100, 50), 0.0)
        assert first is not None and first.accepted
    assert queue.arrive("head", real_request(2, 100, 50), 0.0) is None
    assert queue.arrive("large", real_request(3, 50_000, 10_000), 0.0) is None  # only "big" holds it
    if change == "instance-down":
        conductor.handle(InstanceDown(instance_id=InstanceId("big"), now=1.0))
    else:
        conductor.set_decode_limits(InstanceId("big"), DecodeLimits(kv_capacity_tokens=20_000, max_batch_size=1))
    arrival = queue.arrive("identical", attrs.evolve(real_request(4, 50_000, 10_000), arrival_s=1.0), 1.0)
    assert arrival is not None and arrival.reason is not None
    decided = queue.pump(1.0)
    assert decided == [("large", ScheduleDecision(request_id=RequestId("r3"), accepted=False, reason=arrival.reason))]
    assert list(queue) == ["head"]


def test_a_request_the_scheduler_raises_for_is_handed_back_alone() -> None:
    """Given `failed`, a request whose try raises (at the head, or out of turn at its deadline) or whose lasting
    check raises (behind the head) leaves the line and is handed back with its error, once; the pump goes on:
    every other request is decided as it would be, none lost."""

    @attrs.define
    class Raising(FakeConductor):
        try_raises: set[RequestId] = attrs.field(factory=set)
        check_raises: set[RequestId] = attrs.field(factory=set)

        def schedule(self, req: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
            if req.request_id in self.try_raises:
                raise RuntimeError(f"predictor bug for {req.request_id}")
            return super().schedule(req, now, waited_s=waited_s)

        def lasting_refusal(self, req: Request) -> Reason | None:
            if req.request_id in self.check_raises:
                raise InvalidRequestError(f"request {req.request_id} is already scheduled")
            return super().lasting_refusal(req)

    conductor = Raising(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    for n, name in ((1, "a"), (2, "b"), (3, "c")):
        assert queue.arrive(name, request(n, 5.0, 1, 1), 5.0) is None
    assert queue.arrive("late", request(4, 0.0, 1, 1), 5.0) is None  # its body read slowly: due at 10.0
    failed: list[tuple[str, Exception]] = []

    def record(item: str, error: Exception) -> None:
        failed.append((item, error))

    conductor.check_raises = {RequestId("r3")}  # behind the head: its lasting check raises
    assert queue.pump(6.0, failed=record) == [] and list(queue) == ["a", "b", "late"]
    conductor.try_raises = {RequestId("r4")}  # due: its one try, out of turn, raises
    assert queue.pump(10.0, failed=record) == [] and list(queue) == ["a", "b"]
    conductor.free, conductor.try_raises = 2, {RequestId("r1")}  # the head's try raises; "b" gets the room
    assert [(item, d.accepted) for item, d in queue.pump(11.0, failed=record)] == [("b", True)]
    assert [(item, str(error)) for item, error in failed] == [
        ("c", "request r3 is already scheduled"),
        ("late", "predictor bug for r4"),
        ("a", "predictor bug for r1"),
    ]
    assert len(queue) == 0 and queue.next_deadline() == math.inf and queue.pump(12.0, failed=record) == []
    assert len(failed) == 3


def test_with_no_wait_allowed_nothing_waits() -> None:
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=0)
    decision = queue.arrive("a", request(1, 0.0, 1, 10), 0.0)
    assert decision is not None and decision.reason is Reason.BATCH_FULL and len(queue) == 0


@pytest.mark.parametrize(
    ("max_wait_s", "words"),
    [
        (-1.0, ["max_wait_s", ">= 0", "-1.0"]),
        (math.inf, ["max_wait_s", "finite", "inf"]),
        ("5", ["max_wait_s", "'5'"]),
    ],
)
def test_bad_settings_are_named(max_wait_s: object, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        AdmissionQueue(FakeConductor(), max_wait_s=max_wait_s)  # type: ignore[arg-type]
    for word in words:
        assert word in str(caught.value)


def test_an_item_waits_once() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(FakeConductor(free=0), max_wait_s=5.0)
    assert queue.arrive("a", request(1, 0.0, 1, 10), 0.0) is None
    with pytest.raises(InvalidRequestError, match="already waits"):
        queue.arrive("a", request(2, 0.0, 1, 10), 0.0)
    with pytest.raises(InvalidRequestError, match="request r1 already waits"):  # another item, the same request id
        queue.arrive("b", request(1, 0.0, 1, 10), 0.0)
    with pytest.raises(InvalidRequestError, match="does not wait"):
        queue.deadline("b")
    assert queue.clear() == ["a"] and len(queue) == 0 and not queue.remove("a")
    assert queue.arrive("b", request(1, 0.0, 1, 10), 0.0) is None  # its id free again
    with pytest.raises(InvalidRequestError, match=r"arrive takes a mooncake\.types\.Request, got str"):
        queue.arrive("c", "r9", 0.0)  # type: ignore[arg-type]


def test_a_decision_made_before_a_try_that_raises_comes_with_the_next_pump() -> None:
    """A try the scheduler raises for (its request scheduled meanwhile by another caller, say) takes that request
    out of the line and propagates; the decisions the same pump made before it are not lost: the next pump hands
    them back first, once."""

    @attrs.define
    class Raising(FakeConductor):
        def schedule(self, req: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
            if req.request_id == RequestId("r2") and now > 0:
                raise InvalidRequestError("request r2 is already scheduled")
            return super().schedule(req, now, waited_s=waited_s)

    conductor = Raising(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    for n, name in ((1, "a"), (2, "b"), (3, "c")):
        assert queue.arrive(name, request(n, 0.0, 1, 10), 0.0) is None
    conductor.free = 3
    with pytest.raises(InvalidRequestError, match="r2"):
        queue.pump(1.0)
    assert list(queue) == ["c"]  # "b" left with its error; "c" still waits
    assert [(item, d.accepted) for item, d in queue.pump(1.0)] == [("a", True), ("c", True)]
    assert queue.pump(1.0) == []


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(WAITS_FOR_ROOM, key=lambda r: r.value)), st.floats(0.0, 20.0))
def test_only_a_rejection_for_room_waits(reason: Reason, ttft_s: float) -> None:
    """`arrive` waits exactly when `room_wait_deadline` lets the first rejection wait."""

    @attrs.define
    class Refuses:
        slo: Slo = SLO

        def schedule(self, req: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
            return ScheduleDecision(request_id=req.request_id, accepted=False, reason=reason, ttft_s=ttft_s)

        def lasting_refusal(self, req: Request) -> Reason | None:
            return None

    queue: AdmissionQueue[int] = AdmissionQueue(Refuses(), max_wait_s=5.0)
    waits = queue.arrive(1, request(1, 0.0, 1, 1), 0.0) is None
    assert waits == (room_wait_deadline(reason, estimated_ttft_s=ttft_s, arrival_s=0.0, slo=SLO, max_wait_s=5.0) > 0.0)


def test_a_late_joiner_is_decided_by_a_pump_at_exactly_its_deadline() -> None:
    """A caller's timer fires at `next_deadline()` exactly: that pump must decide the one due then (else the
    timer fires again at the same time forever)."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=5.0)
    assert queue.arrive("head", request(1, 2.0, 1, 10), 2.0) is None  # deadline 2 + 5 = 7
    assert queue.arrive("late", request(2, 0.5, 1, 10), 2.0) is None  # read late: deadline 0.5 + 5 = 5.5
    due = queue.next_deadline()
    assert due == 5.5
    decided = queue.pump(due)
    assert [(item, d.accepted) for item, d in decided] == [("late", False)]
    assert list(queue) == ["head"] and queue.next_deadline() > due


def test_a_deadline_a_try_moved_later_is_not_acted_on_at_its_old_time() -> None:
    """Room freed shortens the head's TTFT estimate, moving its deadline later; at a time past the old deadline
    but before the new one the head still waits."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    assert queue.arrive("a", request(1, 0.0, 2, 10), 0.0) is None  # estimate 1 + 2.5: deadline 6.5
    assert queue.deadline("a") == 6.5
    conductor.free = 1  # still no room for it, estimate 1 + 2.25: deadline 6.75
    assert queue.pump(1.0) == [] and queue.deadline("a") == 6.75
    assert queue.pump(6.6) == []
    assert list(queue) == ["a"] and queue.next_deadline() == 6.75


def test_a_request_id_that_left_the_line_may_wait_again() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(FakeConductor(free=0), max_wait_s=5.0)
    assert queue.arrive("a", request(1, 0.0, 1, 10), 0.0) is None
    assert queue.remove("a")
    assert queue.arrive("b", request(1, 0.1, 1, 10), 0.1) is None  # the same id, its earlier wait over
    assert list(queue) == ["b"]


def test_a_try_before_the_arrival_time_counts_no_negative_wait() -> None:
    """A caller's clock a little behind the request's arrival stamp: the wait passed is 0, never negative (a
    negative wait would let the Conductor accept a TTFT past the objective)."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=5.0)
    assert queue.arrive("a", request(1, 1.0, 1, 10), 0.5) is None
    assert conductor.calls[-1][2] == 0.0


def test_a_first_try_whose_wait_would_end_at_once_is_decided_at_once() -> None:
    """Its estimate already uses the whole TTFT objective (deadline = arrival + 10 - 10 = now): no wait is
    left, so the rejection is final and nothing joins the line."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    decision = queue.arrive("a", request(1, 0.0, 1, 75), 0.0)  # estimate 7.5 + 2.5 = 10.0 s, the objective
    assert decision is not None and decision.reason is Reason.BATCH_FULL
    assert len(queue) == 0 and queue.next_deadline() == math.inf


@pytest.mark.parametrize("now", [math.nan, math.inf, "soon", None])
@pytest.mark.parametrize("behind", [False, True], ids=["nobody-waits", "behind-a-waiter"])
def test_an_arrival_at_no_time_is_refused_whoever_waits(now: object, behind: bool) -> None:
    """`now` is checked on every arrival: behind a waiter the request is not tried, so no scheduler would see a NaN
    or a string there (it was taken, and the line went on as if nothing were wrong). Nothing changes."""
    conductor = FakeConductor(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    if behind:
        assert queue.arrive("a", request(1, 0.0, 1, 10), 0.0) is None
    calls = list(conductor.calls)
    with pytest.raises(InvalidRequestError, match=f"now must be a finite number, got {now!r}"):
        queue.arrive("b", request(2, 0.0, 1, 10), now)  # type: ignore[arg-type]
    assert list(queue) == (["a"] if behind else []) and conductor.calls == calls


def test_a_try_whose_estimate_is_no_time_leaves_the_line() -> None:
    """A rejection for room whose TTFT estimate is no time (a broken scheduler) sets no deadline: `pump` raises
    the InvalidRequestError naming it, and the request leaves the line as a try that raises does (else it would
    stay at the head and raise at every pump)."""

    @attrs.define
    class Broken(FakeConductor):
        broken: bool = False

        def schedule(self, req: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
            decision = super().schedule(req, now, waited_s=waited_s)
            return attrs.evolve(decision, ttft_s=math.nan) if self.broken else decision

    conductor = Broken(free=0)
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    assert queue.arrive("a", request(1, 0.0, 1, 10), 0.0) is None
    conductor.broken = True
    with pytest.raises(InvalidRequestError, match="estimated_ttft_s"):
        queue.pump(1.0)
    assert len(queue) == 0 and queue.pump(2.0) == []


def test_a_request_arriving_again_overtakes_no_earlier_arrival() -> None:
    """A line joined late may hold a later arrival (B, 5.0) ahead of an earlier one (C, 2.0). R (3.0) arriving
    again stands right behind the last waiting one that arrived before it (C), never ahead of an earlier arrival;
    before any of them (its arrival the earliest), it heads the line, tried at once."""
    conductor = FakeConductor()
    queue: AdmissionQueue[str] = AdmissionQueue(conductor, max_wait_s=30.0)
    first = queue.arrive("hog", request(0, 0.0, CAPACITY, 1), 0.0)  # takes all the room
    assert first is not None and first.accepted
    assert queue.arrive("A", request(1, 1.0, 5, 1), 1.0) is None
    assert queue.arrive("B", request(2, 5.0, 5, 1), 5.0) is None
    assert queue.arrive("C", request(3, 2.0, 5, 1), 6.0) is None  # arrived at 2.0, its body read slowly
    assert queue.arrive("R", request(4, 3.0, 5, 1), 7.0, again=True) is None
    assert list(queue) == ["A", "B", "C", "R"]
    tried = len(conductor.calls)
    assert queue.arrive("E", request(5, 0.5, 5, 1), 7.0, again=True) is None
    assert list(queue) == ["E", "A", "B", "C", "R"] and len(conductor.calls) == tried + 1  # the head: tried


def test_equal_deadlines_go_in_the_order_their_requests_joined_the_line() -> None:
    """Hypothesis's case (CI): r5 joins late behind the head, r1 arrives again at r5's arrival time and stands
    behind it, both due at once: r5 (joined first) is tried before r1, in the queue and in the model alike."""
    machine = LineMachine()
    machine.start(max_wait_s=2.0)
    machine.arrive(late_s=0.0, size=1, ttft_tenths=1)  # r1, accepted
    machine.advance_to_a_deadline_or_by(dt=1.0)
    machine.arrive(late_s=0.0, size=1, ttft_tenths=1)  # r2, accepted
    machine.arrive(late_s=0.0, size=1, ttft_tenths=1)  # r3, accepted
    machine.arrive(late_s=0.0, size=9, ttft_tenths=1)  # r4, waits for room at the head
    machine.arrive(late_s=1.5, size=1, ttft_tenths=1)  # r5, joins late behind it, due at 2.0
    assert machine.queue is not None
    request_id = machine.accepted.pop(0)  # r1's instance fails: it arrives again, due at 2.0 as well
    machine.real.release(request_id)
    machine.model.conductor.release(request_id)
    machine.decided.discard(1)
    machine.arrived_again = True
    assert machine.queue.arrive(1, machine.requests[1], machine.now, again=True) is None
    assert machine.model.arrive(1, machine.requests[1], machine.now, again=True) is None
    decided = machine.queue.pump(2.0)
    assert [item for item, _ in decided] == [5, 1]
    assert summary(decided) == summary(machine.model.pump(2.0))
