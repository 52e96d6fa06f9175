"""A prefill that runs past its estimate: the queue behind it does not drain by prediction.

The Conductor re-predicts a queue at each start and end reported there; between them, a started prefill not
reported ended runs on, so `schedule` re-predicts a queue whose started request was to end before now (or
whose first request not reported started, behind a started one, was to start before now) before it routes:
routing, TTFT admission and the decode side's picture all read it as the present leaves it.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.cache import BlockHasher
from mooncake.sched import (
    HARDWARE,
    MODELS,
    BaselineAdmission,
    PrefillFinished,
    PrefillStarted,
    UniformDecodePredictor,
    build_conductor,
)
from mooncake.sched.conductor import Conductor
from mooncake.sched.outcome import Reason
from mooncake.types import InstanceId, Request, RequestId, Slo

MODEL, GPUS = MODELS["llama3-70b"], HARDWARE["8xA800"]
HASHER = BlockHasher(model="llama3-70b", block_size_tokens=512)
PROMPT = 32_000


def conductor(prefill: list[str], *, slo: Slo | None = None) -> Conductor:
    return build_conductor(
        model=MODEL,
        hardware=GPUS,
        prefill_instances=prefill,
        decode_instances=["d0"],
        hasher=HASHER,
        admission=BaselineAdmission(),
        predictor=UniformDecodePredictor(decode_s=10.0),  # a request joined at 5 s is gone by 25 s
        slo=slo,
    )


def request(request_id: str, base: int, tokens: int = PROMPT) -> Request:
    """A prompt no other shares (`base` sets its tokens apart), so no prefix or transfer moves a time."""
    return Request(
        request_id=RequestId(request_id),
        arrival_s=0.0,
        input_length=tokens,
        output_length=10,
        block_keys=HASHER.block_keys(list(range(base, base + tokens))),
        block_size_tokens=512,
    )


def place(c: Conductor, request_id: str) -> InstanceId:
    return next(v.instance_id for v in c.prefill_views if any(q.request_id == request_id for q in v.queue))


def test_an_overrunning_prefill_keeps_its_instance_busy() -> None:
    """The reviewer's case: A and C queued on p0, B on p1, A and B reported started at 0 and still running at
    20 s, long past their ~5 s estimate. Scheduling D at 20 s sees both instances busy until now at least, and
    p0 busy with C after that: D goes to p1 and starts now, its TTFT its own prefill; nothing queued is
    predicted in the past (before the fix both queues had drained by prediction: p0 looked idle, D went there,
    and the decode side saw A and B as joined at 5 s)."""
    c = conductor(["p0", "p1"])
    for rid, base in (("A", 0), ("B", 10**6), ("C", 2 * 10**6)):
        assert c.schedule(request(rid, base), now=0.0).accepted
    assert place(c, "A") == place(c, "C") != place(c, "B")
    for rid in ("A", "B"):
        c.handle(PrefillStarted(request_id=RequestId(rid), instance_id=place(c, rid), now=0.0))
    estimate = next(q.prefill_s for v in c.prefill_views for q in v.queue if q.request_id == "A")
    now = 20.0
    assert estimate < now  # A and B overran
    d = c.schedule(request("D", 3 * 10**6), now=now)
    c.check_invariants()
    assert d.accepted and d.prefill_instance == place(c, "B")  # not the instance that still has C to run
    assert d.ttft_s == pytest.approx(estimate)  # its own prefill, from now: B ends no sooner than now
    for view in c.prefill_views:
        for q in view.queue:
            assert (q.finish_s if q.started else q.start_s) >= now, q
    c_entry = next(q for v in c.prefill_views for q in v.queue if q.request_id == "C")
    assert c_entry.start_s == now and c_entry.finish_s == pytest.approx(now + estimate)
    incoming = {q.request_id: q for q in c.incoming(InstanceId("d0"))}
    assert all(q.joins_s >= now for q in incoming.values()), incoming
    # The decode side's prediction for D's arrival counts the overrunning A and B, not a batch they have left.
    load = c.predictor.predict((), tuple(incoming.values()), now, now + d.ttft_s)
    assert load.batch_size >= 2


def test_ttft_admission_counts_the_overrun() -> None:
    """One instance: a short A started at 0 and still running at 20 s, C queued behind it. D's TTFT is C's
    prefill and its own; under an objective that D's own prefill meets but not with C's, it is refused (before
    the fix the queue had drained by prediction, and D was accepted on its own prefill alone)."""
    a_s, c_s, d_s = (  # each alone on an idle instance: its own prefill
        conductor(["p0"]).schedule(request(rid, base, tokens), now=0.0).ttft_s
        for rid, base, tokens in (("A", 0, 4096), ("C", 10**6, PROMPT // 2), ("D", 2 * 10**6, PROMPT))
    )
    assert a_s is not None and c_s is not None and d_s is not None
    slo = Slo(ttft_s=1.1 * d_s)
    assert a_s + c_s < slo.ttft_s < c_s + d_s
    c = conductor(["p0"], slo=slo)
    assert c.schedule(request("A", 0, 4096), now=0.0).accepted
    assert c.schedule(request("C", 10**6, PROMPT // 2), now=0.0).accepted
    c.handle(PrefillStarted(request_id=RequestId("A"), instance_id=InstanceId("p0"), now=0.0))
    d = c.schedule(request("D", 2 * 10**6), now=20.0)
    assert not d.accepted and d.reason is Reason.TTFT_SLO
    assert d.ttft_s == pytest.approx(c_s + d_s)
    # Once A reports its end, C runs from then, and D's wait is still C's.
    c.handle(PrefillFinished(request_id=RequestId("A"), instance_id=InstanceId("p0"), now=20.0))
    again = c.schedule(request("D2", 3 * 10**6), now=20.0)
    assert again.ttft_s == pytest.approx(d.ttft_s)


def test_a_queue_with_no_start_reported_drains_by_prediction() -> None:
    """A queue where no start was reported is left as predicted (its owner may report none, as a server that
    tells only of first tokens): routing reads it without re-predicting every queue at every decision."""
    c = conductor(["p0"])
    assert c.schedule(request("A", 0), now=0.0).accepted
    assert c.schedule(request("B", 10**6), now=0.0).accepted
    before = list(c.prefill_views[0].queue)
    c.schedule(request("C", 2 * 10**6), now=1.0)
    assert c.prefill_views[0].queue[:2] == before


@settings(max_examples=60, deadline=None)
@example(["arrive", "arrive", "start", "wait", "arrive"], [0.0, 0.0, 0.0, 5.0, 0.0])  # a started prefill overruns
@given(
    st.lists(st.sampled_from(["arrive", "start", "finish", "wait"]), min_size=1, max_size=25),
    st.lists(st.floats(0.0, 8.0), min_size=25, max_size=25),
)
def test_after_a_decision_nothing_reported_running_is_predicted_over(actions: list[str], waits: list[float]) -> None:
    """Whatever starts and ends were reported, after `schedule(now)` every started request still queued ends no
    sooner than now, and the first not reported started behind one starts no sooner; the board's bound on when
    a queue goes stale is never above a queue's own (`PrefillBoard.check_invariants`)."""
    c = conductor(["p0", "p1"])
    now, made = 0.0, 0
    for action, wait in zip(actions, waits, strict=False):
        queued = [(v.instance_id, q) for v in c.prefill_views for q in v.queue]
        if action == "arrive" or not queued:
            made += 1
            c.schedule(request(f"r{made}", made * 10**6, tokens=4096 * (1 + made % 4)), now=now)
            for view in c.prefill_views:
                running = [q for q in view.queue if q.started]
                assert all(q.finish_s >= now for q in running), view.queue
                waiting = [q for q in view.queue if not q.started]
                if running and waiting:
                    assert waiting[0].start_s >= now, view.queue
        elif action == "start":
            instance, q = next(((i, q) for i, q in queued if not q.started), queued[0])
            c.handle(PrefillStarted(request_id=q.request_id, instance_id=instance, now=now))
        elif action == "finish":
            instance, q = queued[0]
            c.handle(PrefillFinished(request_id=q.request_id, instance_id=instance, now=now))
        else:
            now += wait
        c.check_invariants()  # the board's bound on when a queue goes stale among them
