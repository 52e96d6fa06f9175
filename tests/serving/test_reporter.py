"""The worker's reporter: reports delivered in order on a thread of their own, token reports merged, flush
and capacity honoured, a failing delivery dropped without stopping the rest."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import wire
from serving.reporter import Reporter

from mooncake.errors import MooncakeError

DEADLINE_S = 10.0


def tokens(instance: str, first: int, count: int) -> wire.DecodeTokens:
    """One decode step's report: `count` tokens from index `first`, the step ended at `first` ms on the worker."""
    return wire.DecodeTokens(
        instance_id=instance,
        tokens=tuple(
            wire.Token(request_id=1, attempt=0, token=first + i, index=first + i, finished=False, at_s=first / 1e3)
            for i in range(count)
        ),
    )


def flat(messages: list[Any]) -> list[tuple[Any, ...]]:
    """Messages as the gateway acts on them: a token report is its tokens, one by one."""
    out: list[tuple[Any, ...]] = []
    for message in messages:
        if isinstance(message, wire.DecodeTokens):
            out += [(message.instance_id, t) for t in message.tokens]
        else:
            out.append((message,))
    return out


messages = st.lists(
    st.one_of(
        st.builds(tokens, st.sampled_from(["decode-0", "decode-1"]), st.integers(0, 1000), st.integers(1, 3)),
        st.builds(
            wire.PrefillStarted, instance_id=st.just("prefill-0"), request_id=st.integers(0, 9), attempt=st.just(0)
        ),
    ),
    max_size=40,
)


@given(sent=messages, pause=st.floats(0, 0.002), fail=st.sets(st.integers(0, 40), max_size=3))
@settings(max_examples=60, deadline=None)
def test_reports_arrive_in_order_merged_and_flushed(sent: list[Any], pause: float, fail: set[int]) -> None:
    """Whatever the delivery speed: after `flush`, the deliveries read token by token are the messages sent, in
    order (merging only joins neighbours), each token with its own step's time, in no more calls than sends; a
    failed delivery loses only itself."""
    delivered: list[Any] = []
    calls = 0
    lock = threading.Lock()

    def call(message: wire.Message) -> None:
        nonlocal calls
        with lock:
            index, calls = calls, calls + 1
        time.sleep(pause)
        if index in fail:
            raise MooncakeError("the gateway is gone")
        delivered.append(message)

    reporter = Reporter(call, capacity=4)
    try:
        for message in sent:
            reporter.send(message)
        assert reporter.flush(DEADLINE_S)
        lost = {i for i in fail if i < calls}
        assert len(delivered) == calls - len(lost)
        assert calls <= len(sent)  # merging only ever makes fewer calls
        if not lost:
            assert flat(delivered) == flat(sent)
        else:  # what arrived is a subsequence of what was sent, in order
            expected = iter(flat(sent))
            assert all(any(item == e for e in expected) for item in flat(delivered))
    finally:
        reporter.close()


def test_send_waits_when_the_queue_is_full_and_flush_times_out_while_stuck() -> None:
    """With the gateway stuck, `capacity` messages queue, the next `send` waits and `flush` says False; once
    the gateway answers again everything is delivered, in order."""
    release = threading.Event()
    delivered: list[Any] = []

    def call(message: wire.Message) -> None:
        release.wait(DEADLINE_S)
        delivered.append(message)

    reporter = Reporter(call, capacity=2)
    sent = [wire.PrefillStarted(instance_id="prefill-0", request_id=i, attempt=0) for i in range(4)]
    try:
        for message in sent[:3]:  # one in flight, two queued
            reporter.send(message)
        blocked = threading.Thread(target=reporter.send, args=(sent[3],))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive(), "send did not wait for room"
        assert not reporter.flush(0.1)
        release.set()
        blocked.join(DEADLINE_S)
        assert reporter.flush(DEADLINE_S)
        assert delivered == sent
    finally:
        release.set()
        reporter.close()


def test_an_unexpected_error_drops_one_report_and_the_sender_lives_on(capsys: pytest.CaptureFixture[str]) -> None:
    """A delivery raising something unforeseen is dropped with a line on stderr; the next is delivered."""
    delivered: list[Any] = []

    def call(message: wire.Message) -> None:
        if not delivered and isinstance(message, wire.PrefillStarted) and message.request_id == 0:
            delivered.append(None)
            raise ValueError("boom")
        delivered.append(message)

    reporter = Reporter(call)
    try:
        reporter.send(wire.PrefillStarted(instance_id="prefill-0", request_id=0, attempt=0))
        reporter.send(wire.PrefillStarted(instance_id="prefill-0", request_id=1, attempt=0))
        assert reporter.flush(DEADLINE_S)
    finally:
        reporter.close()
    assert delivered[1:] == [wire.PrefillStarted(instance_id="prefill-0", request_id=1, attempt=0)]
    assert "dropped a PrefillStarted: ValueError('boom')" in capsys.readouterr().err


def test_merged_reports_keep_each_steps_time_in_order() -> None:
    """Three steps' reports queued behind a slow delivery travel as one, their tokens in order, each with its own
    step's `at_s` (the gateway times the tokens by them); the other worker's report
    and a report of another kind are never merged into it."""
    entered, release = threading.Event(), threading.Event()
    delivered: list[Any] = []

    def call(message: wire.Message) -> None:
        entered.set()
        release.wait(DEADLINE_S)
        delivered.append(message)

    def step(index: int, at_s: float, instance: str = "decode-0") -> wire.DecodeTokens:
        token = wire.Token(request_id=1, attempt=0, token=7, index=index, finished=False, at_s=at_s)
        return wire.DecodeTokens(instance_id=instance, tokens=(token,))

    reporter = Reporter(call, capacity=8)
    try:
        reporter.send(step(0, 10.0))
        assert entered.wait(DEADLINE_S)  # the sender holds the first report: the next ones queue behind it
        for index, at_s in ((1, 10.02), (2, 10.04), (3, 10.06)):
            reporter.send(step(index, at_s))
        reporter.send(step(9, 10.07, instance="decode-1"))
        reporter.send(wire.PrefillStarted(instance_id="prefill-0", request_id=2, attempt=0))
        reporter.send(step(4, 10.08))
        release.set()
        assert reporter.flush(DEADLINE_S)
    finally:
        release.set()
        reporter.close()
    assert [type(m).__name__ for m in delivered] == ["DecodeTokens"] * 3 + ["PrefillStarted", "DecodeTokens"]
    merged = delivered[1]
    assert [(t.index, t.at_s) for t in merged.tokens] == [(1, 10.02), (2, 10.04), (3, 10.06)]
    assert [(t.index, t.at_s) for t in delivered[2].tokens] == [(9, 10.07)]
    assert [(t.index, t.at_s) for t in delivered[4].tokens] == [(4, 10.08)]
