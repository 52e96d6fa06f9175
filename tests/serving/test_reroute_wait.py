"""A request rerouted after an engine of its failed, scheduled again by the gateway's `Dispatcher` (examples/serving
/dispatch.py), without workers: the `dispatching` harness of test_dispatch_edges (a real Conductor, the workers'
calls recorded).

The contract: scheduled again as `admit` schedules a request, its arrival kept. Refused for room (a full batch, no
KV room, the TBT objective), it waits in the admission line by its arrival, ahead of the requests that arrived after
it (it was accepted before them), is admitted before them when room frees, and its deadline counts from its arrival. Its wait
ending, or a refusal no wait could lift, ends it with the refusal, whose message says which engine failed first and
whose `outcome` says whether a prefill of it had run for nothing. A client that leaves while it waits takes it out
of the line; shutting down answers it with a 503. `AdmissionQueue.arrive(again=True)`, which puts a request ahead of
later arrivals, is pinned against a scripted scheduler here too (its model test: tests/sched/test_waiting.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving import wire
from serving.api import ApiError
from serving.dispatch import Dispatcher, LiveRequest, _Waiter

from mooncake.errors import InvalidRequestError
from mooncake.sched.conductor import ScheduleDecision
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sched.waiting import AdmissionQueue
from mooncake.types import InstanceId, Request, RequestId, Slo
from tests.serving.test_dispatch_edges import (
    admitted,
    dispatching,
    finished,
    joined,
    prefilled,
    sample,
    sent,
    settle,
    tokens,
)

DEADLINE_S = 5.0  # the longest any wait here may take (each is expected in milliseconds)


async def full_cluster(d: Dispatcher, *, victim_prefilled: bool = True) -> tuple[LiveRequest, list[LiveRequest]]:
    """Two decode engines of 8 slots: decode-1 full (8 requests joined, generating); the victim routed to decode-0,
    its prefill done (or not yet) but not handed on. Returns the victim and decode-1's requests."""
    d._worker_failed(InstanceId("decode-0"))  # the fillers all go to decode-1
    fillers = []
    for i in range(8):
        live = await admitted(d, 1000 + 100 * i)
        d.submit(live)
        prefilled(d, live)
        joined(d, live)
        fillers.append(live)
    await d._probe(d.workers["decode-0"])  # decode-0 answers again
    victim = await admitted(d, 0)
    assert victim.decode == "decode-0", victim.decode
    d.submit(victim)
    if victim_prefilled:
        prefilled(d, victim)
    return victim, fillers


def end_one(d: Dispatcher, live: LiveRequest) -> None:
    """`live` generates its last tokens: it ends, freeing its batch slot."""
    d._dispatch(tokens(live, (7, 0, False), (8, 1, False), (9, 2, False), (10, 3, True)))


def test_a_rerouted_request_refused_for_room_waits_ahead_of_later_arrivals() -> None:
    """decode-0 fails with the victim prefilled for it while decode-1's batch is full: instead of a 429 the victim
    waits in the line, its arrival and request kept, ahead of a newcomer already waiting (which arrived after it);
    the first slot that frees goes to the victim (sent as its next attempt), the second to the newcomer."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            victim, fillers = await full_cluster(d)
            arrival, request = victim.arrival, victim.request
            # Both decode engines full: decode-0 gets 7 more requests that have begun generating.
            began = []
            for i in range(7):
                live = await admitted(d, 3000 + 100 * i)
                assert live.decode == "decode-0"
                d.submit(live)
                prefilled(d, live)
                joined(d, live)
                d._dispatch(tokens(live, (5, 0, False)))
                began.append(live)
            newcomer = asyncio.ensure_future(admitted(d, 5000))
            await settle()
            assert not newcomer.done() and len(d._waiting) == 1
            d._worker_failed(InstanceId("decode-0"))
            for live in began:  # their tokens had begun: a 503, not rerouted
                assert [kind for kind, _ in [live.events.get_nowait(), live.events.get_nowait()]] == ["token", "error"]
            assert victim.events.empty() and victim.request_id not in d.live  # waiting, not refused
            assert (victim.attempt, victim.arrival, victim.request) == (1, arrival, request)
            assert next(iter(d._waiting)).live is victim and len(d._waiting) == 2
            assert d._waiting.deadline(d._rerouted[victim.request_id]) <= arrival + d.config.limits.admission_wait_s
            assert sample(d, "request_rejected_total", reason=Reason.BATCH_FULL.value) == 0
            end_one(d, fillers[0])
            assert d.live[victim.request_id] is victim and victim.decode == "decode-1"
            job = sent(d, victim.prefill)[-1]
            assert isinstance(job, wire.PrefillJob) and (job.request_id, job.attempt) == (int(victim.request_id), 1)
            await settle()
            assert not newcomer.done() and not d._rerouted
            end_one(d, fillers[1])
            async with asyncio.timeout(DEADLINE_S):
                assert (await newcomer).decode == "decode-1"
            d.conductor.check_invariants()

    asyncio.run(run())


@pytest.mark.parametrize("victim_prefilled", [True, False])
def test_a_rerouted_requests_wait_that_ends_is_refused_saying_what_happened(victim_prefilled: bool) -> None:
    """The victim waits for room that never frees: at its deadline (0.3 s after its arrival) it ends with the 429
    for room, its message naming the engine that failed first, its outcome whether its prefill had run (for
    nothing, now) or not; the refusal is counted once."""

    async def run() -> None:
        async with dispatching(num_decode=2, admission_wait_s=0.3) as d:
            victim, _ = await full_cluster(d, victim_prefilled=victim_prefilled)
            d._worker_failed(InstanceId("decode-0"))
            assert victim.events.empty() and len(d._waiting) == 1
            async with asyncio.timeout(DEADLINE_S):
                kind, error = await victim.events.get()
            assert kind == "error" and isinstance(error, ApiError)
            outcome = Outcome.REJECTED_AFTER_PREFILL if victim_prefilled else Outcome.REJECTED_BEFORE_PREFILL
            body = error.body()["error"]
            assert (error.status, body["code"], body["outcome"]) == (429, Reason.BATCH_FULL.value, outcome.value)
            assert body["message"].startswith("the decode engine decode-0 failed; scheduling the request again was")
            assert error.headers["Retry-After"] == "1"
            assert sample(d, "request_rejected_total", reason=Reason.BATCH_FULL.value) == 1
            assert not d._rerouted and len(d._waiting) == 0 and victim.request_id not in d.live
            d.conductor.check_invariants()

    asyncio.run(run())


def test_a_rerouted_request_no_wait_can_help_is_refused_at_once_saying_what_happened() -> None:
    """The only decode engine fails after the request's prefill: no decode engine is up, a lasting reason, so the
    503 comes at once (no wait), naming the failed engine, its outcome saying the prefill ran for nothing."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            prefilled(d, live)
            d._worker_failed(InstanceId("decode-0"))
            kind, error = live.events.get_nowait()
            body = error.body()["error"]
            assert (kind, error.status, body["code"]) == ("error", 503, Reason.NO_DECODE_INSTANCE.value)
            assert body["outcome"] == Outcome.REJECTED_AFTER_PREFILL.value
            assert "decode-0 failed" in body["message"] and len(d._waiting) == 0

    asyncio.run(run())


@pytest.mark.parametrize("leaves_by", ["client", "shutdown"])
def test_a_rerouted_request_that_ends_while_it_waits_leaves_the_line(leaves_by: str) -> None:
    """The victim waits; its client leaves (the gateway ends it): it leaves the line, counted once as an abort, and
    room that frees later admits nothing for it. Or the cluster shuts down: it gets the 503 as every waiter does."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            victim, fillers = await full_cluster(d)
            d._worker_failed(InstanceId("decode-0"))
            assert len(d._waiting) == 1 and victim.request_id in d._rerouted
            if leaves_by == "shutdown":
                d.shut_down_requests()
                kind, error = victim.events.get_nowait()
                assert (kind, error.status) == ("error", 503) and not d._rerouted
                return
            assert d.end(victim, Outcome.ABORTED, Reason.CLIENT_GONE) == ()  # the Conductor ended it already
            assert len(d._waiting) == 0 and not d._rerouted and victim.events.empty()
            assert finished(d, victim.decode, "abort") == 1
            d.end(victim, Outcome.ABORTED, Reason.CLIENT_GONE)  # again: nothing more
            assert finished(d, victim.decode, "abort") == 1
            jobs = len(sent(d, victim.prefill))
            end_one(d, fillers[0])
            assert victim.request_id not in d.live and len(sent(d, victim.prefill)) == jobs
            d.conductor.check_invariants()

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- the line itself


@attrs.define
class Scripted:
    """A scheduler whose decisions the test sets: a request id's refusal reason (None: accepted), tried in order."""

    refusals: dict[int, Reason | None]
    lasting: dict[int, Reason] = attrs.field(factory=dict)
    tried: list[int] = attrs.field(factory=list)
    slo: Slo = attrs.field(factory=lambda: Slo(ttft_s=30.0, tbt_s=1.0))

    def schedule(self, request: Request, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
        self.tried.append(int(request.request_id))
        reason = self.refusals.get(int(request.request_id))
        return ScheduleDecision(request_id=request.request_id, accepted=reason is None, reason=reason, ttft_s=1.0)

    def lasting_refusal(self, request: Request) -> Reason | None:
        return self.lasting.get(int(request.request_id))


def waiter(request_id: int, arrival_s: float) -> tuple[_Waiter, Request]:
    request = Request(
        request_id=RequestId(request_id),  # type: ignore[arg-type]
        arrival_s=arrival_s,
        input_length=16,
        output_length=4,
        block_keys=(),
    )
    live = LiveRequest(RequestId(request_id), [0] * 16, request, None, arrival_s)  # type: ignore[arg-type]
    return _Waiter(live), request


def test_arriving_again_puts_a_request_ahead_of_later_arrivals_only() -> None:
    """A (arrival 1) and B (3) wait for room. R (arrival 2) arrives again: an earlier arrival (A) waits, so R is
    not tried and waits between A and B until arrival + the longest wait; R0 (arrival 0) is the earliest: tried at
    once, refused for room, it heads the line. One whose refusal is lasting is refused at once; one already waiting
    cannot arrive again. The pumps then try the line in that order."""
    scheduler = Scripted(refusals=dict.fromkeys([1, 3, 2, 10, 5], Reason.BATCH_FULL))
    line: AdmissionQueue[_Waiter] = AdmissionQueue(scheduler, max_wait_s=10.0)
    a, b, r, r0 = waiter(1, 1.0), waiter(3, 3.0), waiter(2, 2.0), waiter(10, 0.0)
    assert line.arrive(*a, now=4.0) is None and line.arrive(*b, now=4.0) is None
    assert line.arrive(*r, now=4.0, again=True) is None
    assert list(line) == [a[0], r[0], b[0]] and line.deadline(r[0]) == 2.0 + 10.0
    assert scheduler.tried == [1]  # A alone: B and R wait behind it untried
    assert line.arrive(*r0, now=4.0, again=True) is None
    assert list(line) == [r0[0], a[0], r[0], b[0]] and scheduler.tried == [1, 10]
    assert line.deadline(r0[0]) == min(0.0 + 10.0, 0.0 + 30.0 - 1.0)  # room_wait_deadline, from its arrival
    lasting = waiter(5, 2.5)
    scheduler.lasting[5] = Reason.CONTEXT_TOO_LONG
    decision = line.arrive(*lasting, now=4.0, again=True)
    assert decision is not None and (decision.accepted, decision.reason) == (False, Reason.CONTEXT_TOO_LONG)
    with pytest.raises(InvalidRequestError):
        line.arrive(*r, now=4.0, again=True)
    scheduler.refusals.update({10: None, 1: None})  # room for R0 and A, not for R
    decided: list[Any] = line.pump(5.0)
    assert [(item, d.accepted) for item, d in decided] == [(r0[0], True), (a[0], True)]
    assert list(line) == [r[0], b[0]]
