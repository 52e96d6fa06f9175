"""Tests for `mooncake.sim.clock.EventLoop`: time order, ties in scheduling order, no going back."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sim.clock import EventLoop


def test_events_run_in_time_order_and_see_their_time() -> None:
    """Handlers run by time whatever the order they were scheduled in; `now` is the event's time."""
    loop = EventLoop()
    seen: list[tuple[float, str, float]] = []
    for time_s, name in ((3.0, "c"), (1.0, "a"), (2.0, "b")):
        loop.at(time_s, lambda now, label: seen.append((now, label, loop.now)), name)
    assert len(loop) == 3
    loop.run()
    assert seen == [(1.0, "a", 1.0), (2.0, "b", 2.0), (3.0, "c", 3.0)]
    assert len(loop) == 0
    assert loop.now == 3.0


def test_ties_run_in_the_order_they_were_scheduled() -> None:
    """Events at one time run first scheduled, first run, including ones scheduled by a handler at `now`."""
    loop = EventLoop()
    order: list[str] = []

    def first(now: float) -> None:
        order.append("first")
        loop.at(now, lambda _now: order.append("scheduled at now, by first"))

    loop.at(1.0, first)
    loop.at(1.0, lambda _now: order.append("second"))
    loop.at(1.0, lambda _now: order.append("third"))
    loop.run()
    assert order == ["first", "second", "third", "scheduled at now, by first"]


def test_handlers_get_their_arguments() -> None:
    """`at(time, handler, *args)` calls `handler(time, *args)`."""
    loop = EventLoop()
    calls: list[tuple[Any, ...]] = []
    loop.at(0.5, lambda *args: calls.append(args), "x", 2)
    loop.run()
    assert calls == [(0.5, "x", 2)]


def test_scheduling_in_the_past_raises() -> None:
    """The clock never goes backwards: an event before `now` is a bug, before or during a run."""
    loop = EventLoop()
    with pytest.raises(ValueError, match="-1"):
        loop.at(-1.0, lambda _now: None)
    failures: list[Exception] = []

    def late(now: float) -> None:
        try:
            loop.at(now - 0.25, lambda _now: None)
        except ValueError as error:
            failures.append(error)

    loop.at(2.0, late)
    loop.run()
    assert len(failures) == 1 and "1.75" in str(failures[0])
    assert len(loop) == 0


def test_before_each_runs_before_every_event_with_its_time() -> None:
    """The hook sees each event's time before its handler runs (LoadTrace relies on it)."""
    loop = EventLoop()
    log: list[tuple[str, float]] = []
    for time_s in (0.0, 0.5, 0.5, 2.0):
        loop.at(time_s, lambda now: log.append(("handler", now)))
    loop.run(before_each=lambda now: log.append(("hook", now)))
    assert log == [(kind, t) for t in (0.0, 0.5, 0.5, 2.0) for kind in ("hook", "handler")]


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=20), st.lists(st.integers(0, 5), max_size=3)),
        max_size=30,
    )
)
def test_order_is_time_then_insertion(schedule: list[tuple[int, list[int]]]) -> None:
    """Against a stable sort: (time, sequence) order, where handlers add events after themselves."""
    loop = EventLoop()
    ran: list[tuple[float, int]] = []
    expected_log: list[tuple[float, int]] = []  # (time, sequence) of every event ever scheduled
    sequence = iter(range(10**6))

    def handler(now: float, number: int, later: list[int]) -> None:
        ran.append((now, number))
        for delay in later:  # delays of zero land at `now`, after everything already due then
            n = next(sequence)
            expected_log.append((now + delay, n))
            loop.at(now + delay, handler, n, [])

    for time_s, later in schedule:
        n = next(sequence)
        expected_log.append((float(time_s), n))
        loop.at(float(time_s), handler, n, later)
    loop.run()
    assert [t for t, _ in ran] == sorted(t for t, _ in ran)
    assert sorted(ran) == sorted(expected_log)
    for (t1, n1), (t2, n2) in itertools.pairwise(ran):
        assert t1 < t2 or n1 < n2, "ties must run in scheduling order"


def test_run_does_young_collections_only_and_restores_the_thresholds() -> None:
    """Inside `run` the oldest generation is never collected automatically; after it (even when
    a handler raises) the garbage collector's thresholds are what they were."""
    before = gc.get_threshold()
    seen: list[tuple[int, ...]] = []
    loop = EventLoop()
    loop.at(1.0, lambda _now: seen.append(gc.get_threshold()))
    loop.run()
    assert seen[0][:2] == before[:2] and seen[0][2] >= 1 << 30
    assert gc.get_threshold() == before

    def fail(_now: float) -> None:
        raise RuntimeError("handler failed")

    failing = EventLoop()
    failing.at(1.0, fail)
    with pytest.raises(RuntimeError):
        failing.run()
    assert gc.get_threshold() == before


@given(
    scheduled=st.lists(st.integers(0, 5), max_size=12),
    arrivals=st.lists(st.integers(0, 5), max_size=12).map(sorted),
)
def test_fed_arrivals_merge_in_time_order_before_events_at_the_same_time(
    scheduled: list[int], arrivals: list[int]
) -> None:
    """Against a sort by (time, arrivals first, then scheduling order): a fed stream merges into the scheduled
    events, each arrival handled before any event due at its time."""
    loop = EventLoop()
    ran: list[tuple[float, int, int]] = []
    for number, time_s in enumerate(scheduled):
        loop.at(float(time_s), lambda now, n: ran.append((now, 1, n)), number)
    loop.feed(list(enumerate(arrivals)), lambda item: float(item[1]), lambda now, item: ran.append((now, 0, item[0])))
    loop.run()
    expected = sorted(
        [(float(t), 1, n) for n, t in enumerate(scheduled)] + [(float(t), 0, n) for n, t in enumerate(arrivals)]
    )
    assert ran == expected


def test_a_fed_arrival_earlier_than_the_clock_is_an_invalid_request() -> None:
    loop = EventLoop()
    loop.feed([2.0, 1.0], float, lambda now, item: None)
    with pytest.raises(InvalidRequestError, match="out of order"):
        loop.run()
