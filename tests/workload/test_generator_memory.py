"""The workload generator streams in bounded memory: a finished session's blocks leave its id table, and the ids
it hands out are the same as if nothing were forgotten."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.types import Request
from mooncake.workload import ArrivalProcess, LengthDistribution, generate_requests, preset
from mooncake.workload import generator as generator_module


def _workload(name: str, count: int, *, seed: int, rate: float, **changes: object) -> list[Request]:
    spec = attrs.evolve(preset(name), **changes)
    return list(generate_requests(spec, num_requests=count, arrivals=ArrivalProcess(rate_per_s=rate), seed=seed))


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
