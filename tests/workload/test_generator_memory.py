"""The workload generator streams in bounded memory: a finished session's blocks leave its id table, and the ids
it hands out are the same as if nothing were forgotten; arrival times are drawn a chunk at a time, the same times
as drawn at once."""

from __future__ import annotations

import tracemalloc

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.types import Request
from mooncake.workload import ArrivalProcess, LengthDistribution, generate_requests, preset
from mooncake.workload import generator as generator_module


def _workload(name: str, count: int, *, seed: int, rate: float, cv: float = 1.0, **changes: object) -> list[Request]:
    spec = attrs.evolve(preset(name), **changes)
    arrivals = ArrivalProcess(rate_per_s=rate, cv=cv)
    return list(generate_requests(spec, num_requests=count, arrivals=arrivals, seed=seed))


@given(
    name=st.sampled_from(["synthetic", "conversation", "toolagent"]),
    seed=st.integers(0, 2**32 - 1),
    rate=st.floats(0.5, 50.0),
    think=st.sampled_from([0.0, 1.0, 60.0]),
    max_input=st.sampled_from([2_000, 20_000, 128_000]),  # small ones end sessions at the context limit
)
@settings(max_examples=25, deadline=None)
def test_forgetting_finished_sessions_changes_no_id(
    name: str, seed: int, rate: float, think: float, max_input: int
) -> None:
    """Every request is the same whether finished sessions' blocks are forgotten or kept: a forgotten block
    never comes back (its content held a piece of a session that asks no more)."""
    changes = {"think_time_s": think, "max_input_tokens": max_input}
    forgetting = _workload(name, 150, seed=seed, rate=rate, **changes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generator_module._BlockIds, "forget", lambda self, segments: None)
        keeping = _workload(name, 150, seed=seed, rate=rate, **changes)
    assert forgetting == keeping


def test_the_id_table_stops_growing_with_the_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a steady arrival rate, the table holds the shared prefixes' blocks and the live sessions' only: three
    times the requests leave it about as large (kept whole, it grew with every request: 12 k entries at 3,000
    tool-agent requests, 37 k at 9,000)."""
    tables: list[generator_module._BlockIds] = []

    class Recorded(generator_module._BlockIds):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            tables.append(self)

    monkeypatch.setattr(generator_module, "_BlockIds", Recorded)
    sizes = []
    for count in (3_000, 9_000):
        _workload("toolagent", count, seed=3, rate=20.0)
        sizes.append(len(tables[-1]._ids))
    assert sizes[1] < 1.5 * sizes[0], sizes


def test_a_session_ended_at_the_context_limit_is_forgotten_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session whose next turn would pass max_input_tokens ends there, its blocks with it."""
    fixed = LengthDistribution(mean_tokens=600, sigma=0)
    forgotten: list[int] = []
    original = generator_module._BlockIds.forget

    def spy(self: generator_module._BlockIds, segments: list[tuple[int, int]]) -> None:
        forgotten.append(len(segments))
        original(self, segments)

    monkeypatch.setattr(generator_module._BlockIds, "forget", spy)
    # Each turn adds 1,200 tokens to a 1,200-token first prompt: the second turn would pass 2,000, so every
    # session ends at the limit (its turn count, 10,000 on average, never runs out).
    _workload(
        "conversation",
        40,
        seed=0,
        rate=10.0,
        think_time_s=0.0,
        mean_turns=10_000,
        continue_probability=0.99,
        system_prompt_tokens=fixed,
        user_message_tokens=fixed,
        output_tokens=fixed,
        max_input_tokens=2_000,
    )
    assert forgotten and set(forgotten) == {2}  # the system prompt and the first message


def test_arrival_times_are_drawn_as_the_workload_reaches_them() -> None:
    """The first request of two million holds no array of two million arrival times (16 MB a copy, three copies
    while they were drawn at once): they are drawn a chunk at a time, so only the live sessions and the shared
    prefixes' ids grow with a workload, and they stop growing."""
    tracemalloc.start()
    try:
        next(generate_requests(preset("synthetic"), num_requests=2_000_000))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 8 << 20, peak_bytes


@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(0, 40),
    rate=st.floats(0.01, 100.0),
    cv=st.sampled_from([0.5, 1.0, 3.0]),
    chunk=st.integers(1, 9),
)
@settings(max_examples=40, deadline=None)
def test_arrival_times_drawn_in_chunks_are_those_drawn_at_once(
    seed: int, count: int, rate: float, cv: float, chunk: int
) -> None:
    """Chunked, the times are one cumsum of one gamma draw's gaps, to the bit, and leave the generator where that
    draw does; so a workload is the same whatever the chunk."""
    process = ArrivalProcess(rate_per_s=rate, cv=cv)
    once = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    gaps = once.gamma(shape, 1.0 / (rate * shape), size=count)
    gaps[:1] = 0.0
    expected = np.round(np.cumsum(gaps) * 1000.0) / 1000.0
    chunked = np.random.default_rng(seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generator_module, "_ARRIVAL_CHUNK", chunk)
        assert np.array_equal(process.times_s(chunked, count), expected)
        assert chunked.random() == once.random()
        small = _workload("conversation", count, seed=seed, rate=rate, cv=cv)
    assert small == _workload("conversation", count, seed=seed, rate=rate, cv=cv)
