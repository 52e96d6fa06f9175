"""How the gateway times a request's tokens (examples/serving/dispatch.py `_on_tokens`, wire.py `Token.at_s`).

A decode worker stamps each step's tokens with the step's end on its own monotonic clock; its reporter merges the
reports that queue behind a slow delivery. The gateway must time tokens as the steps ran, not as the reports
reached it: a token's inter-token latency is the difference of its and its request's previous token's worker
times (as vLLM times it by its engine core's step times), whatever reports carried them and whenever they
arrived; the first token's TTFT places the report's latest step at its arrival and earlier steps as long before
as they ran before it on the worker. Examples: a merged report of three steps 10 ms apart observes 10 ms three
times (the old gateway observed its arrival gap, then 0, 0); a merged first token's TTFT is its step's. A
property: for any steps split into reports arriving at any times, the observed intervals are the worker-time
differences. The wire carries the times once per step and keeps them through JSON; a decode worker stamps each
step's tokens on its monotonic clock.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving import wire
from serving.config import load_config
from serving.dispatch import Dispatcher, LiveRequest

from mooncake.engine.logprobs import TokenLogprobs
from tests.serving.test_dispatch_edges import admitted, dispatching, joined, prefilled, sample
from tests.serving.test_worker import TINY, workers
from tests.serving.test_worker_edges import serve_a_first_request, tokens_of


@attrs.define
class Taps:
    """Stands in for a histogram family's series by engine: records each observation, then hands it on."""

    family: Any
    values: collections.defaultdict[str, list[float]] = attrs.field(factory=lambda: collections.defaultdict(list))

    def __getitem__(self, engine: str) -> Any:
        series, values = self.family[engine], self.values[engine]

        class Tap:
            def observe(self, value: float) -> None:
                values.append(value)
                series.observe(value)

        return Tap()


@attrs.define
class Clock:
    """The dispatcher's clock, set by the test."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def timed(d: Dispatcher) -> tuple[Clock, Taps, Taps]:
    """`d` on a clock the test sets, its ITL and TTFT observations recorded."""
    clock = Clock(5.0)
    d.now = clock  # type: ignore[method-assign]
    itl, ttft = Taps(d.metrics.itl), Taps(d.metrics.ttft)
    d.metrics.itl, d.metrics.ttft = itl, ttft  # type: ignore[assignment]
    return clock, itl, ttft


def report(instance: str, *tokens: tuple[LiveRequest, int, float]) -> wire.DecodeTokens:
    """A decode report of (request, index, worker time) tokens: one step's, or several merged."""
    step = tuple(wire.Token(int(r.request_id), r.attempt, 7, i, False, None, at_s) for r, i, at_s in tokens)
    return wire.DecodeTokens(instance_id=instance, tokens=step)


def through_the_wire(message: wire.DecodeTokens) -> wire.Message:
    method, args = wire.encode(message)
    return wire.decode(method, json.loads(json.dumps(args)))


async def decoding(d: Dispatcher, first_token: int = 0) -> LiveRequest:
    live = await admitted(d, first_token, max_tokens=64)
    d.submit(live)
    prefilled(d, live)
    joined(d, live)
    return live


def test_a_merged_report_is_timed_by_its_steps_not_its_arrival() -> None:
    """The first token alone at 100.00 s on the worker, then three steps 10 ms apart merged into one report that
    arrives 0.4 s later: three intervals of 10 ms (the gateway read its clock once per report and observed
    0.4 s, 0, 0); the request's last token sits at the report's arrival, its first at its own."""

    async def run() -> None:
        async with dispatching() as d:
            clock, itl, _ttft = timed(d)
            live = await decoding(d)
            clock.now = 5.1
            d._dispatch(through_the_wire(report(live.decode, (live, 0, 100.00))))
            clock.now = 5.5
            merged = report(live.decode, (live, 1, 100.01), (live, 2, 100.02), (live, 3, 100.03))
            d._dispatch(through_the_wire(merged))
            assert itl.values[live.decode] == pytest.approx([0.01, 0.01, 0.01], abs=1e-9)
            assert sample(d, "inter_token_latency_seconds_count", engine=live.decode) == 3
            assert sample(d, "inter_token_latency_seconds_sum", engine=live.decode) == pytest.approx(0.03)
            assert live.first_token_s == 5.1 and live.last_token_s == 5.5 and live.generated == 4

    asyncio.run(run())


def test_a_merged_first_tokens_ttft_is_its_steps() -> None:
    """Two requests' first tokens at 100.00 s on the worker merged with the next step (100.02 s, and the first
    token of a third request) into a report arriving at 6.0 s: the first two are placed 20 ms before it, the
    third at it; each TTFT counts from its request's arrival to that time, and the one interval is 20 ms."""

    async def run() -> None:
        async with dispatching() as d:
            clock, itl, ttft = timed(d)
            a, b = await decoding(d, 0), await decoding(d, 100)
            clock.now = 5.5
            c = await decoding(d, 200)
            clock.now = 6.0
            d._dispatch(report(a.decode, (a, 0, 100.00), (b, 0, 100.00), (a, 1, 100.02), (c, 0, 100.02)))
            assert ttft.values[a.prefill] == pytest.approx([6.0 - 0.02 - 5.0, 6.0 - 0.02 - 5.0, 6.0 - 5.5])
            assert (a.first_token_s, b.first_token_s, c.first_token_s) == pytest.approx((5.98, 5.98, 6.0))
            assert itl.values[a.decode] == pytest.approx([0.02])

    asyncio.run(run())


@st.composite
def timelines(draw: st.DrawFn) -> tuple[list[float], list[int], list[float]]:
    """A request's decode steps (worker times, increasing, from any start), cut into consecutive reports (the cut
    after each report's last step) and the gateway's clock at each report's arrival (increasing, any lag)."""
    start = draw(st.floats(0.0, 1e6))
    gaps = draw(st.lists(st.floats(1e-4, 2.0), min_size=1, max_size=12))
    steps = [start]
    for gap in gaps:
        steps.append(steps[-1] + gap)
    cuts = sorted(draw(st.sets(st.integers(1, len(steps) - 1), max_size=len(steps) - 1)) | {len(steps)})
    arrivals, now = [], 6.0
    for _ in cuts:
        now += draw(st.floats(0.0, 3.0))
        arrivals.append(now)
    return steps, cuts, arrivals


@settings(max_examples=40, deadline=None)
@given(timeline=timelines(), two_requests=st.booleans())
def test_intervals_are_the_workers_step_differences_however_reports_merge(
    timeline: tuple[list[float], list[int], list[float]], two_requests: bool
) -> None:
    """Any steps of one or two requests split into any merged reports that reach the gateway at any times: each
    observed interval is the difference of the worker times of a request's consecutive tokens, within a report or
    across two; each request's TTFT is its first report's arrival less how long before that report's latest step
    its first token's step ran; its last token sits at the last report's arrival."""
    steps, cuts, arrivals = timeline

    async def run() -> None:
        async with dispatching() as d:
            clock, itl, ttft = timed(d)
            requests = [await decoding(d, 100 * n) for n in range(1 + two_requests)]
            begin = 0
            for end, arrival in zip(cuts, arrivals, strict=True):
                clock.now = arrival
                step_tokens = [(r, i, steps[i]) for i in range(begin, end) for r in requests]
                d._dispatch(through_the_wire(report(requests[0].decode, *step_tokens)))
                begin = end
            differences = [later - earlier for earlier, later in itertools.pairwise(steps)]
            expected = [gap for gap in differences for _ in requests]  # each step: one interval per request
            assert itl.values[requests[0].decode] == pytest.approx(expected, rel=1e-12, abs=1e-9)
            first_ttft = arrivals[0] - (steps[cuts[0] - 1] - steps[0]) - 5.0
            assert ttft.values[requests[0].prefill] == pytest.approx([first_ttft] * len(requests), abs=1e-9)
            for live in requests:
                assert live.last_token_s == arrivals[-1] and live.generated == len(steps)

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- the worker


def test_a_decode_worker_stamps_each_steps_tokens_with_its_monotonic_clock() -> None:
    """A request decoded alone on a real decode worker: its first token (reported at its join) and each step's
    token carry a time on the worker's `time.monotonic()`, within the run and strictly later step by step."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with workers(config) as pair:
        before_s = time.monotonic()
        serve_a_first_request(pair)
        after_s = time.monotonic()
        times = [t.at_s for t in tokens_of(pair[3], 1)]
    assert len(times) == 3 and before_s <= times[0] and times[-1] <= after_s
    assert all(earlier < later for earlier, later in itertools.pairwise(times))


# ---------------------------------------------------------------------------------------------- the wire

at_times = st.lists(st.floats(-1e9, 1e9), max_size=6).map(sorted)
logprobs = st.none() | st.builds(TokenLogprobs, logprob=st.floats(max_value=0.0), rank=st.integers(1, 9))


@given(times=at_times, data=st.data())
def test_step_times_survive_the_wire_once_per_step(times: list[float], data: st.DataObject) -> None:
    """Tokens of merged steps (non-decreasing `at_s`, log-probabilities or not) come back equal through JSON;
    a time travels only on the token whose step's time differs from the token before's (0.0 before the first)."""
    tokens = tuple(
        wire.Token(1, 0, 7, i, False, data.draw(logprobs), at_s)
        for i, at_s in enumerate(t for t in times for _ in range(data.draw(st.integers(1, 3))))
    )
    message = wire.DecodeTokens(instance_id="decode-0", tokens=tokens)
    assert through_the_wire(message) == message
    items = wire.encode(message)[1]["tokens"]
    changes = sum(1 for before, t in zip((0.0, *(t.at_s for t in tokens)), tokens, strict=False) if t.at_s != before)
    assert sum(len(item) == 7 for item in items) == changes


@pytest.mark.parametrize(
    ("tokens", "named"),
    [
        ([[1, 0, 5, 0, False, None, 2.0], [1, 0, 5, 1, False, None, 1.0]], "tokens[1][6]"),
        ([[1, 0, 5, 0, False, None, float("nan")]], "tokens[0][6]"),
        ([[1, 0, 5, 0, False, None, "1.0"]], "tokens[0][6]"),
        ([[1, 0, 5, 0, False, [0.5, 1, []], 1.0]], "tokens[0][5][0]"),
        ([[1, 0, 5, 0, False, None, 1.0, 2.0]], "tokens[0]"),
    ],
)
def test_a_bad_step_time_is_named(tokens: list[Any], named: str) -> None:
    """A step time that is not a finite number, or earlier than the token before's, is refused naming it."""
    with pytest.raises(wire.MessageError, match=named.replace("[", r"\[").replace("]", r"\]")):
        wire.decode("decode.tokens", {"instance_id": "d", "tokens": tokens})
