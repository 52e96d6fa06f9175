"""Synthetic workloads: determinism, arrivals, chained-key structure, multi-turn sessions, presets, specs."""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.types import BlockKey, Request
from mooncake.workload import (
    ARRIVAL_RANGE,
    DEFAULT_WORKLOAD,
    PRESETS,
    TRACE_BLOCK_SIZE_TOKENS,
    ArrivalProcess,
    LengthDistribution,
    WorkloadSpec,
    fixed_length_requests,
    generate_requests,
    preset,
    trace_stats,
    write_trace,
)
from tests.strategies import workload_specs

PUBLISHED = {"conversation": (12035, 343), "toolagent": (8596, 182), "synthetic": (15325, 149)}
"""Mean input / output tokens of the Mooncake traces (FAST'25)."""

PRESET_SEEDS = range(6)
PRESET_REQUESTS = 4000
WORKLOADS_DOC = Path(__file__).parents[2] / "docs" / "workloads.md"
seeds = st.integers(min_value=0, max_value=2**32 - 1)
preset_names = st.sampled_from(sorted(PRESETS))


def generate(spec: WorkloadSpec, num_requests: int, seed: int = 0, **arrivals: float) -> list[Request]:
    return list(generate_requests(spec, num_requests=num_requests, arrivals=ArrivalProcess(**arrivals), seed=seed))


@pytest.fixture(scope="module")
def preset_workloads() -> dict[str, list[list[Request]]]:
    """Each preset at 4,000 requests, at the default workload's rate, for seeds 0..5 (about 5 s in all, shared by
    this module): what docs/workloads.md's preset table states."""
    rate = DEFAULT_WORKLOAD.rate_per_s
    return {
        name: [generate(preset(name), PRESET_REQUESTS, seed, rate_per_s=rate) for seed in PRESET_SEEDS]
        for name in PUBLISHED
    }


def assert_valid(workload: Sequence[Request], spec: WorkloadSpec) -> None:
    """Ids 0..n-1, non-decreasing whole-ms arrivals from 0, ceil(input/block) keys, lengths within the spec."""
    block = spec.block_size_tokens
    assert [r.request_id for r in workload] == [str(i) for i in range(len(workload))]
    if workload:
        assert workload[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(workload))
    for r in workload:
        assert round(r.arrival_s * 1000) / 1000 == r.arrival_s
        assert len(r.block_keys) == math.ceil(r.input_length / block)
        assert all(type(k) is int and k >= 0 for k in r.block_keys)
        assert r.input_length <= spec.max_input_tokens  # >= 1 is Request's own contract
        assert spec.output_tokens.min_tokens <= r.output_length <= spec.output_tokens.max_tokens


def assert_keys_are_chained(workload: Sequence[Request], block_size_tokens: int) -> None:
    """Equal keys imply equal prefixes: key → (position, parent key, block length) is a function.

    By induction over positions, two requests sharing key i then share keys 0..i and
    every block's length, so no key repeats within a request either.
    """
    seen: dict[BlockKey, tuple[int, BlockKey | None, int]] = {}
    for r in workload:
        assert len(set(r.block_keys)) == len(r.block_keys), f"request {r.request_id} repeats a key"
        parent: BlockKey | None = None
        for position, key in enumerate(r.block_keys):
            block_length = min(block_size_tokens, r.input_length - position * block_size_tokens)
            shape = (position, parent, block_length)
            assert seen.setdefault(key, shape) == shape, f"key {key} of request {r.request_id} has two prefixes"
            parent = key


def continuations(workload: Sequence[Request], block_size_tokens: int) -> int:
    """Requests whose keys start with all full blocks of an earlier request, after its prompt and output."""
    earlier: dict[BlockKey, list[tuple[tuple[BlockKey, ...], int]]] = {}
    count = 0
    for r in workload:
        keys = r.block_keys
        count += any(
            keys[: i + 1] == prefix and r.input_length > min_input
            for i, key in enumerate(keys)
            for prefix, min_input in earlier.get(key, ())
        )
        num_full = r.input_length // block_size_tokens
        if num_full:
            earlier.setdefault(keys[num_full - 1], []).append((keys[:num_full], r.input_length + r.output_length))
    return count


def gap_cv(workload: Sequence[Request]) -> float:
    gaps = np.diff([r.arrival_s for r in workload])
    return float(gaps.std() / gaps.mean())


# --------------------------------------------------------------------------- determinism


@settings(max_examples=20)
@given(name=preset_names, seed=seeds)
def test_same_seed_gives_the_same_workload(name: str, seed: int) -> None:
    """The same spec, count and seed give identical requests."""
    assert generate(preset(name), 40, seed) == generate(preset(name), 40, seed)


@settings(max_examples=20)
@given(name=preset_names, seeds=st.lists(seeds, min_size=2, max_size=2, unique=True))
def test_different_seeds_give_different_workloads(name: str, seeds: list[int]) -> None:
    """Different seeds give different requests."""
    assert generate(preset(name), 40, seeds[0]) != generate(preset(name), 40, seeds[1])


def test_zero_requests_is_an_empty_workload() -> None:
    """num_requests=0 yields nothing."""
    assert generate(preset("synthetic"), 0) == []


# --------------------------------------------------------------------------- validity and structure


@given(spec=workload_specs(), num_requests=st.integers(0, 60), seed=seeds)
def test_random_specs_generate_valid_chained_workloads(spec: WorkloadSpec, num_requests: int, seed: int) -> None:
    """Any spec gives num_requests valid requests whose keys are chained at the spec's block size."""
    workload = generate(spec, num_requests, seed)
    assert len(workload) == num_requests
    assert_valid(workload, spec)
    assert_keys_are_chained(workload, spec.block_size_tokens)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_workloads_are_valid_and_chained(preset_workloads: dict[str, list[list[Request]]], name: str) -> None:
    """Every preset request is valid with ceil(input/512) keys, and equal keys imply equal prefixes."""
    assert preset(name).block_size_tokens == TRACE_BLOCK_SIZE_TOKENS
    for workload in preset_workloads[name]:
        assert_valid(workload, preset(name))
        assert_keys_are_chained(workload, TRACE_BLOCK_SIZE_TOKENS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_multi_turn_sessions(preset_workloads: dict[str, list[list[Request]]], name: str) -> None:
    """Many preset requests extend an earlier request's full blocks beyond its prompt and output."""
    for workload in preset_workloads[name]:
        assert continuations(workload, TRACE_BLOCK_SIZE_TOKENS) > len(workload) // 5


def test_turns_extend_the_previous_prompt_only_when_sessions_continue() -> None:
    """With unique first blocks, continuations exist iff continue_probability > 0."""
    spec = WorkloadSpec(
        system_prompt_tokens=LengthDistribution(mean_tokens=1, sigma=0),  # the first block is the user's message
        user_message_tokens=LengthDistribution(mean_tokens=900, sigma=0.3, min_tokens=600),
        output_tokens=LengthDistribution(mean_tokens=100, sigma=0.5),
        mean_turns=4.0,
        continue_probability=0.6,
    )
    assert continuations(generate(spec, 500), spec.block_size_tokens) > 100
    single = attrs.evolve(spec, continue_probability=0.0)
    assert continuations(generate(single, 500), spec.block_size_tokens) == 0


def test_single_turn_sessions_never_continue() -> None:
    """mean_turns=1 ends every session after one request, whatever continue_probability says."""
    spec = WorkloadSpec(
        system_prompt_tokens=LengthDistribution(mean_tokens=1, sigma=0),
        user_message_tokens=LengthDistribution(mean_tokens=900, sigma=0.3, min_tokens=600),
        mean_turns=1.0,
        continue_probability=0.9,
    )
    assert continuations(generate(spec, 300), spec.block_size_tokens) == 0


@given(seed=seeds, turns=st.integers(2, 4))
def test_a_turn_that_reaches_max_input_tokens_exactly_is_kept(seed: int, turns: int) -> None:
    """The limit is inclusive: with every length constant, a session's `turns`-th prompt fills the context
    exactly and is still asked, and nothing longer ever is."""
    fixed = LengthDistribution(mean_tokens=100, sigma=0)
    spec = WorkloadSpec(
        system_prompt_tokens=fixed,
        user_message_tokens=fixed,
        output_tokens=fixed,
        mean_turns=10_000,  # sessions end at the limit, not by their turn count
        continue_probability=0.99,
        think_time_s=0.0,  # the next arrival is the session's next turn: a session runs to the limit at once
        max_input_tokens=200 * turns,  # system prompt and first message, then 200 more per turn
    )
    lengths = {r.input_length for r in generate_requests(spec, num_requests=60, seed=seed)}
    assert max(lengths) == 200 * turns
    assert lengths <= {200 * turn for turn in range(1, turns + 1)}


@given(seed=seeds, max_input=st.integers(1, 3000))
@settings(max_examples=20)
def test_inputs_never_exceed_max_input_tokens(seed: int, max_input: int) -> None:
    """Prompts are clipped (first turn) or the session ends (later turns) at max_input_tokens."""
    spec = attrs.evolve(preset("conversation"), max_input_tokens=max_input)
    workload = generate(spec, 80, seed)
    assert max(r.input_length for r in workload) <= max_input
    assert_keys_are_chained(workload, spec.block_size_tokens)


# --------------------------------------------------------------------------- sessions over time

SESSIONS = WorkloadSpec(
    block_size_tokens=16,
    system_prompt_tokens=LengthDistribution(mean_tokens=1, sigma=0),  # the first block is the session's own message
    user_message_tokens=LengthDistribution(mean_tokens=24, sigma=0.3, min_tokens=16, max_tokens=64),
    output_tokens=LengthDistribution(mean_tokens=8, sigma=0.5, max_tokens=32),
)
"""Chat sessions whose first block is their first message (unique to the session): a request's session is its first
key. Short segments in small blocks, so that 40,000 requests generate in a second or two."""


def session_statistics(workload: Sequence[Request]) -> tuple[float, float, float]:
    """(mean turns of the sessions that start in the first half of the workload, continuation share, median gap
    between a session's turns in seconds). Sessions started in the first half have had time to finish."""
    arrivals: dict[BlockKey, list[float]] = {}
    for r in workload:
        arrivals.setdefault(r.block_keys[0], []).append(r.arrival_s)
    half = workload[-1].arrival_s / 2
    turns = statistics.fmean(len(times) for times in arrivals.values() if times[0] <= half)
    gaps = [later - earlier for times in arrivals.values() for earlier, later in itertools.pairwise(times)]
    return turns, 1 - len(arrivals) / len(workload), statistics.median(gaps)


@settings(max_examples=2)
@given(seed=seeds, mean_turns=st.sampled_from([2.0, 4.0]), cv=st.sampled_from([1.0, 3.0]))
def test_sessions_are_stationary_in_the_number_of_requests(seed: int, mean_turns: float, cv: float) -> None:
    """Turns per session, the share of arrivals that continue a session and the gap between a session's turns are
    the same at 4,000 and 40,000 requests, and what the spec says: mean_session_turns, continuation_share, and the
    think time's median (exponential: ln 2 of its mean), a little longer for waiting on the next arrival. A
    finished session once stayed open until a random pick landed on it: at 40,000 requests turns were ten times
    further apart than at 4,000, and sessions had 2.4 turns of a mean_turns of 4."""
    spec = attrs.evolve(SESSIONS, mean_turns=mean_turns)
    short, long = (generate(spec, n, seed, rate_per_s=4.0, cv=cv) for n in (4_000, 40_000))
    (short_turns, short_share, short_gap), (long_turns, long_share, long_gap) = map(session_statistics, (short, long))
    assert short_turns == pytest.approx(long_turns, rel=0.08)
    assert short_gap == pytest.approx(long_gap, rel=0.15)
    assert long_turns == pytest.approx(spec.mean_session_turns, rel=0.05)
    assert long_share == pytest.approx(spec.continuation_share, abs=0.02)
    assert short_share == pytest.approx(spec.continuation_share, abs=0.05)  # the first think time opens sessions only
    median_think_s = spec.think_time_s * math.log(2)
    for gap in (short_gap, long_gap):
        assert median_think_s * 0.85 < gap < median_think_s * 1.3


@pytest.mark.parametrize(
    ("mean_turns", "continue_probability", "session_turns"),
    [(3.0, None, 3.0), (4.0, 0.5, 2.0), (2.0, 0.9, 2.0), (6.0, 0.0, 1.0), (1.0, 0.9, 1.0)],
)
def test_continue_probability_caps_the_turns(
    mean_turns: float, continue_probability: float | None, session_turns: float
) -> None:
    """mean_turns and continue_probability say one thing (a session of m turns continues m - 1 arrivals of m): a
    session has the fewer turns of the two."""
    spec = WorkloadSpec(mean_turns=mean_turns, continue_probability=continue_probability)
    assert spec.mean_session_turns == pytest.approx(session_turns)
    assert spec.continuation_share == pytest.approx(1 - 1 / session_turns)


def test_sessions_with_no_think_time_run_turn_after_turn() -> None:
    """think_time_s=0: each arrival continues the session before it until that session has used its turns."""
    workload = generate(attrs.evolve(SESSIONS, think_time_s=0.0, mean_turns=3.0), 300)
    firsts = [r.block_keys[0] for r in workload]
    runs = [len(list(group)) for _, group in itertools.groupby(firsts)]
    assert len(runs) == len(set(firsts))  # each session's turns are one run of consecutive requests
    assert statistics.fmean(runs) == pytest.approx(3.0, rel=0.15)


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_means_match_the_published_traces(preset_workloads: dict[str, list[list[Request]]], name: str) -> None:
    """Mean input/output at 4,000 requests: within 3% of the published figures over seeds 0..5, 6% per seed."""
    published_input, published_output = PUBLISHED[name]
    inputs = [statistics.fmean(r.input_length for r in w) for w in preset_workloads[name]]
    outputs = [statistics.fmean(r.output_length for r in w) for w in preset_workloads[name]]
    assert statistics.fmean(inputs) == pytest.approx(published_input, rel=0.03)
    assert statistics.fmean(outputs) == pytest.approx(published_output, rel=0.03)
    for mean_input, mean_output in zip(inputs, outputs, strict=True):
        assert mean_input == pytest.approx(published_input, rel=0.06)
        assert mean_output == pytest.approx(published_output, rel=0.06)


def documented(pattern: str) -> tuple[str, ...]:
    """The groups of `pattern`'s one match in docs/workloads.md (spaces there may be line breaks)."""
    found = re.findall(pattern.replace(" ", r"\s+"), WORKLOADS_DOC.read_text(encoding="utf-8"))
    assert len(found) == 1, pattern
    return tuple(found[0])


def figure(text: str) -> float:
    return float(text.replace(",", ""))


def test_the_documented_preset_table_is_what_the_generator_gives(
    preset_workloads: dict[str, list[list[Request]]],
) -> None:
    """docs/workloads.md's preset table, at the count, rate and seeds it states (the default workload's, as
    `mooncake trace generate` and replay.py generate it), holds the published means and, to its rounding, the
    generated means, prefix reuse and turns per session. It once held the figures of 1 request/s, ArrivalProcess's
    own default: sessions cut short at the end of a workload four times shorter lower them 0.5-2 %."""
    count, rate, first, last = documented(
        r"at ([\d,]+) requests arriving at ([\d.]+) per second \(`DEFAULT_WORKLOAD`'s rate[\s\S]*?averaged over seeds "
        r"(\d+)-(\d+)"
    )
    assert (figure(count), figure(rate)) == (PRESET_REQUESTS, DEFAULT_WORKLOAD.rate_per_s)
    assert range(int(first), int(last) + 1) == PRESET_SEEDS
    cell = r"([\d,.]+)"
    for name in PRESETS:
        row = documented(rf"\n\| `{name}` \| {cell} / {cell} \| {cell} / {cell} \| {cell} \| {cell} \|\n")
        published_input, published_output, mean_input, mean_output, reuse, turns = map(figure, row)
        assert (published_input, published_output) == PUBLISHED[name]
        stats = [trace_stats(workload) for workload in preset_workloads[name]]
        assert statistics.fmean(s.mean_input_length for s in stats) == pytest.approx(mean_input, abs=1)
        assert statistics.fmean(s.mean_output_length for s in stats) == pytest.approx(mean_output, abs=1)
        assert statistics.fmean(s.prefix_reuse_ratio for s in stats) == pytest.approx(reuse, abs=0.006)
        assert preset(name).mean_session_turns == pytest.approx(turns)


def test_the_documented_edge_effect_is_what_the_generator_gives(
    preset_workloads: dict[str, list[list[Request]]],
) -> None:
    """docs/workloads.md's example of a workload's edges: 4,000 conversation requests average the input it states at
    4 requests/s (the table's), and more at 1 request/s, where they last four times as many think times."""
    fast, slow = map(
        figure,
        documented(
            r"last about 17 think times and average ([\d,]+) input tokens; at 1 per "
            r"second \(`ArrivalProcess`'s own default\), 67 think times, ([\d,]+)\."
        ),
    )
    spec = preset("conversation")
    for rate, think_times, tokens in ((DEFAULT_WORKLOAD.rate_per_s, 17, fast), (1.0, 67, slow)):
        workloads = [generate(spec, PRESET_REQUESTS, seed, rate_per_s=rate) for seed in PRESET_SEEDS]
        assert statistics.fmean(w[-1].arrival_s for w in workloads) / spec.think_time_s == pytest.approx(
            think_times, rel=0.05
        )
        assert statistics.fmean(trace_stats(w).mean_input_length for w in workloads) == pytest.approx(tokens, abs=1)
    assert fast < slow


def test_preset_lookup() -> None:
    """preset(name) returns the PRESETS entry, named after itself."""
    assert sorted(PRESETS) == ["conversation", "synthetic", "toolagent"]
    for name, spec in PRESETS.items():
        assert preset(name) is spec and spec.name == name


@pytest.mark.parametrize("name", ["", "Synthetic", "chat", "toolagent ", []])
def test_unknown_preset_is_a_config_error(name: str) -> None:
    """An unknown preset name raises ConfigError naming it and the choices."""
    with pytest.raises(ConfigError, match="conversation") as caught:
        preset(name)
    assert repr(name) in str(caught.value)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: generate_requests(preset("synthetic"), num_requests=2, seed=-1), "seed"),
        (lambda: generate_requests("synthetic", num_requests=2), "WorkloadSpec"),  # type: ignore[arg-type]
        (lambda: generate_requests(preset("synthetic"), num_requests=2, arrivals=2.0), "ArrivalProcess"),  # type: ignore[arg-type]
        (
            lambda: fixed_length_requests(input_tokens=100, output_tokens=1, num_requests=2, block_size_tokens=0),
            "block_size_tokens",
        ),
        (lambda: fixed_length_requests(input_tokens=100, output_tokens=1, num_requests=2, seed=-1), "seed"),
    ],
)
def test_bad_generator_options_are_refused_at_the_call(call: Any, field: str) -> None:
    """Refused when called, naming the option (a generator does not wait for its first request; a zero
    block size once looped forever)."""
    with pytest.raises(ConfigError, match=field):
        call()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"mean_turns": 1e300}, "mean_turns"),
        ({"chat_weight": 1e308, "document_weight": 1e308, "agent_weight": 1e308}, "finite sum"),
        ({"system_prompt_tokens": 5}, "system_prompt_tokens"),
        ({"output_tokens": {"mean_tokens": 300}}, "output_tokens"),
        ({"name": None}, "name"),
    ],
)
def test_a_spec_out_of_its_range_or_type_is_refused_by_name(options: dict[str, Any], field: str) -> None:
    """Values the generator cannot draw from (a Poisson mean, weights that overflow their sum, a length
    that is not a distribution) are ConfigErrors naming the field, not numpy errors at the first draw."""
    with pytest.raises(ConfigError, match=field):
        WorkloadSpec(**options)
    with pytest.raises(ConfigError, match="sigma"):
        LengthDistribution(mean_tokens=10, sigma=1e200)


def test_outputs_past_what_a_trace_line_holds_are_refused_at_the_spec(tmp_path: Any) -> None:
    """A spec whose outputs may pass 2**24 tokens (MAX_LINE_TOKENS) is refused, naming the field and the value:
    its workload once generated and then failed at `write_trace`. Outputs of up to 2**24 are written."""
    with pytest.raises(ConfigError, match=r"output_tokens\.max_tokens must be at most 16777216 .*got 16777217"):
        WorkloadSpec(output_tokens=LengthDistribution(mean_tokens=2**25, sigma=0, max_tokens=2**24 + 1))
    spec = WorkloadSpec(output_tokens=LengthDistribution(mean_tokens=2**25, sigma=0, max_tokens=2**24))
    workload = generate(spec, 3)
    assert {r.output_length for r in workload} == {2**24}
    assert write_trace(tmp_path / "out.jsonl", workload) == 3


def test_a_huge_draw_is_clipped_not_overflowed() -> None:
    rng = np.random.default_rng(0)
    draws = {LengthDistribution(mean_tokens=1e300, sigma=10, max_tokens=4096).sample(rng) for _ in range(20)}
    assert draws <= set(range(1, 4097))


# --------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("seed", [0, 1])
def test_bursty_arrivals_vary_more_than_poisson(seed: int) -> None:
    """At the same rate, cv=3 arrivals have a larger inter-arrival CV (about 3) than Poisson (about 1)."""
    spec = preset("toolagent")
    poisson = gap_cv(generate(spec, 2000, seed, rate_per_s=4.0, cv=1.0))
    bursty = gap_cv(generate(spec, 2000, seed, rate_per_s=4.0, cv=3.0))
    assert bursty > poisson
    assert 0.85 < poisson < 1.15
    assert 2.0 < bursty < 4.0


@given(seed=seeds, rate=st.floats(0.01, 1000.0), cv=st.sampled_from([1.0, 2.0, 3.0]))
def test_arrival_process_times(seed: int, rate: float, cv: float) -> None:
    """times_s: starts at 0, non-decreasing, whole ms; Poisson's CV is below a bursty one's from the same seed."""
    process = ArrivalProcess(rate_per_s=rate, cv=cv)
    times = process.times_s(np.random.default_rng(seed), 2000)
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    assert np.array_equal(np.round(times * 1000) / 1000, times)
    poisson = np.diff(ArrivalProcess(rate_per_s=rate, cv=1.0).times_s(np.random.default_rng(seed), 2000))
    bursty = np.diff(ArrivalProcess(rate_per_s=rate, cv=3.0).times_s(np.random.default_rng(seed), 2000))
    assert bursty.std() / bursty.mean() > poisson.std() / poisson.mean()


@given(
    seed=seeds,
    rate=st.floats(*ARRIVAL_RANGE),
    cv=st.floats(*ARRIVAL_RANGE),
    outside=st.just(math.nan)
    | st.floats(max_value=ARRIVAL_RANGE[0], exclude_max=True)
    | st.floats(min_value=ARRIVAL_RANGE[1], exclude_min=True),
)
def test_arrivals_are_finite_in_range_and_refused_outside(seed: int, rate: float, cv: float, outside: float) -> None:
    """Within ARRIVAL_RANGE every rate and cv give finite, non-decreasing times (no overflow warning); a value
    outside it (or NaN) is a ConfigError naming the field, at construction, not an OverflowError later."""
    with np.errstate(all="raise"):
        times = ArrivalProcess(rate_per_s=rate, cv=cv).times_s(np.random.default_rng(seed), 50)
    assert np.all(np.isfinite(times)) and np.all(np.diff(times) >= 0)
    for field in ("rate_per_s", "cv"):
        with pytest.raises(ConfigError, match=field):
            ArrivalProcess(**{field: outside})


@given(seed=seeds, rate=st.floats(0.1, 100.0))
@settings(max_examples=30)
def test_poisson_arrivals_have_the_requested_rate(seed: int, rate: float) -> None:
    """A Poisson process at rate r has a mean gap of 1/r (within 15% over 2,000 arrivals)."""
    times = ArrivalProcess(rate_per_s=rate).times_s(np.random.default_rng(seed), 2001)
    assert times[-1] / 2000 == pytest.approx(1 / rate, rel=0.15)


# --------------------------------------------------------------------------- invalid specs

INVALID: list[tuple[type, dict[str, Any], str]] = [
    (LengthDistribution, {"mean_tokens": 0}, "mean_tokens"),
    (LengthDistribution, {"mean_tokens": -5}, "mean_tokens"),
    (LengthDistribution, {"mean_tokens": math.nan}, "mean_tokens"),
    (LengthDistribution, {"mean_tokens": 10, "sigma": -0.1}, "sigma"),
    (LengthDistribution, {"mean_tokens": 10, "min_tokens": 0}, "min_tokens"),
    (LengthDistribution, {"mean_tokens": 10, "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    (ArrivalProcess, {"rate_per_s": 0}, "rate_per_s"),
    (ArrivalProcess, {"rate_per_s": -1}, "rate_per_s"),
    (ArrivalProcess, {"rate_per_s": math.inf}, "rate_per_s"),
    (ArrivalProcess, {"rate_per_s": math.nan}, "rate_per_s"),
    (ArrivalProcess, {"cv": 0}, "cv"),
    (ArrivalProcess, {"cv": math.inf}, "cv"),
    (WorkloadSpec, {"block_size_tokens": 0}, "block_size_tokens"),
    (WorkloadSpec, {"chat_weight": -1.0}, "chat_weight"),
    (WorkloadSpec, {"chat_weight": 0.0}, "weights"),
    (WorkloadSpec, {"num_system_prompts": 0}, "num_system_prompts"),
    (WorkloadSpec, {"num_documents": 0}, "num_documents"),
    (WorkloadSpec, {"num_agent_preambles": 0}, "num_agent_preambles"),
    (WorkloadSpec, {"popularity_skew": -0.5}, "popularity_skew"),
    (WorkloadSpec, {"mean_turns": 0.5}, "mean_turns"),
    (WorkloadSpec, {"continue_probability": 1.0}, "continue_probability"),
    (WorkloadSpec, {"continue_probability": -0.1}, "continue_probability"),
    (WorkloadSpec, {"think_time_s": -1.0}, "think_time_s"),
    (WorkloadSpec, {"think_time_s": math.inf}, "think_time_s"),
    (WorkloadSpec, {"think_time_s": math.nan}, "think_time_s"),
    (WorkloadSpec, {"max_input_tokens": 0}, "max_input_tokens"),
]


@pytest.mark.parametrize(("cls", "options", "field"), INVALID, ids=[f"{c.__name__}-{o}" for c, o, _ in INVALID])
def test_invalid_specs_are_config_errors(cls: type, options: dict[str, Any], field: str) -> None:
    """Each out-of-range option raises ConfigError naming the field and the value."""
    with pytest.raises(ConfigError, match=field) as caught:
        cls(**options)
    assert isinstance(caught.value, ValueError)
    assert repr(list(options.values())[-1]) in str(caught.value)  # the offending value


def test_evolve_validates_too() -> None:
    """attrs.evolve on a preset re-runs validation."""
    with pytest.raises(ConfigError, match="block_size_tokens"):
        attrs.evolve(preset("synthetic"), block_size_tokens=-512)


@pytest.mark.parametrize("num_requests", [-1, 2.5, "10", None])
def test_invalid_request_count_is_a_config_error(num_requests: object) -> None:
    """num_requests must be an integer >= 0."""
    with pytest.raises(ConfigError, match="num_requests"):
        list(generate_requests(preset("synthetic"), num_requests=num_requests))  # type: ignore[arg-type]


def test_bool_request_count_is_a_config_error() -> None:
    """num_requests=True is rejected like other non-integers."""
    with pytest.raises(ConfigError, match="num_requests"):
        list(generate_requests(preset("synthetic"), num_requests=True))


def test_invalid_request_count_is_rejected_when_called() -> None:
    """generate_requests raises for a bad num_requests when called, not later when iterated."""
    with pytest.raises(ConfigError, match="num_requests"):
        generate_requests(preset("synthetic"), num_requests=-1)


def test_infinite_mean_tokens_is_a_config_error() -> None:
    """mean_tokens must be finite, as ArrivalProcess requires of its rate."""
    with pytest.raises(ConfigError, match="mean_tokens"):
        LengthDistribution(mean_tokens=math.inf)


# --------------------------------------------------------------------------- sharing across sessions


def first_keys(spec: WorkloadSpec, count: int = 600, seed: int = 0) -> Counter[int]:
    return Counter(r.block_keys[0] for r in generate_requests(spec, num_requests=count, seed=seed))


def test_one_system_prompt_is_shared_by_every_session() -> None:
    """With a single system prompt longer than a block, every request starts with the same key."""
    spec = WorkloadSpec(
        num_system_prompts=1,
        system_prompt_tokens=LengthDistribution(mean_tokens=2000, sigma=0.0),
        continue_probability=0.0,  # every request opens a new session
    )
    assert len(first_keys(spec)) == 1


def test_documents_are_shared_between_sessions() -> None:
    """Document sessions over a small pool reuse each document's blocks across sessions."""
    spec = WorkloadSpec(
        chat_weight=0.0,
        document_weight=1.0,
        num_system_prompts=1,
        system_prompt_tokens=LengthDistribution(mean_tokens=100, sigma=0.0),
        num_documents=3,
        document_tokens=LengthDistribution(mean_tokens=5000, sigma=0.0),
        continue_probability=0.0,
    )
    counts = first_keys(spec, count=300)
    assert len(counts) <= 3
    assert all(n >= 2 for n in counts.values())


def test_popularity_is_zipf_ordered_and_skew_zero_is_uniform() -> None:
    """The first pool member is drawn most; with popularity_skew=0 the members are drawn about evenly."""
    base = WorkloadSpec(
        num_system_prompts=5,
        system_prompt_tokens=LengthDistribution(mean_tokens=2000, sigma=0.0),
        continue_probability=0.0,
    )
    skewed = first_keys(base, count=2000).most_common()
    assert len(skewed) == 5
    assert skewed[0][1] > 2 * skewed[-1][1]
    uniform = first_keys(attrs.evolve(base, popularity_skew=0.0), count=2000).most_common()
    assert uniform[0][1] < 1.3 * uniform[-1][1]


# --------------------------------------------------------------------------- fixed-length workloads


def infinite_cache_hit_ratio(workload: Sequence[Request], block_size_tokens: int) -> float:
    """Share of prompt tokens an infinite prefix cache holds when each request arrives (blocks of earlier ones)."""
    seen: set[int] = set()
    hit = total = 0
    for request in workload:
        cached = 0
        for key in request.block_keys:
            if key not in seen:
                break
            cached += 1
        hit += min(cached * block_size_tokens, request.input_length)
        total += request.input_length
        seen.update(request.block_keys)
    return hit / total


@settings(max_examples=40)
@given(
    st.integers(min_value=1, max_value=20_000),
    st.integers(min_value=1, max_value=2000),
    st.integers(min_value=0, max_value=30),
    st.sampled_from([0.0, 0.25, 0.5, 0.9]) | st.floats(min_value=0.0, max_value=0.99),
    st.integers(min_value=1, max_value=5),
    st.sampled_from([16, 512]),
    seeds,
)
def test_fixed_length_requests_shape(
    input_tokens: int, output_tokens: int, count: int, ratio: float, num_prefixes: int, block: int, seed: int
) -> None:
    """Every request has the given lengths, ids 0..n-1, ceil(input / block) chained keys, non-decreasing
    arrivals from 0; two prompts share exactly their prefix's whole blocks or nothing."""
    workload = fixed_length_requests(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        num_requests=count,
        cache_ratio=ratio,
        num_prefixes=num_prefixes,
        block_size_tokens=block,
        seed=seed,
    )
    assert len(workload) == count
    assert [r.request_id for r in workload] == [str(i) for i in range(count)]
    assert all((r.input_length, r.output_length) == (input_tokens, output_tokens) for r in workload)
    assert all(len(r.block_keys) == math.ceil(input_tokens / block) for r in workload)
    if workload:
        assert workload[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(workload))
    shared_blocks = int(ratio * input_tokens) // block
    for a, b in itertools.combinations(workload, 2):
        pairs = zip(a.block_keys, b.block_keys, strict=True)
        common = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))
        assert common in (0, shared_blocks)
        assert not set(a.block_keys[common:]) & set(b.block_keys), "only the shared prefix is shared"
    assert len({r.block_keys[:shared_blocks] for r in workload if shared_blocks}) <= num_prefixes


@pytest.mark.parametrize(("input_tokens", "ratio"), [(8192, 0.5), (16_384, 0.25), (32_768, 0.75), (4096, 0.0)])
def test_fixed_length_hit_ratio_tends_to_the_cache_ratio(input_tokens: int, ratio: float) -> None:
    """With block-aligned prefixes, an infinite cache finds ratio · input of every prompt but each prefix's first."""
    workload = fixed_length_requests(
        input_tokens=input_tokens, output_tokens=512, num_requests=400, cache_ratio=ratio, num_prefixes=8, seed=3
    )
    hit = infinite_cache_hit_ratio(workload, TRACE_BLOCK_SIZE_TOKENS)
    assert hit <= ratio
    assert hit == pytest.approx(ratio, abs=0.03)
    firsts = {r.block_keys[0] for r in workload}
    assert len(firsts) == (8 if ratio else 400)  # every prefix is drawn; without one, no two prompts share


@pytest.mark.parametrize("input_tokens", [1000, 3000, 16_500, 100_000])
def test_fixed_length_hit_ratio_tends_to_the_cache_ratio_in_whole_blocks(input_tokens: int) -> None:
    """Off a block boundary the cached share tends to cache_ratio rounded down to whole blocks, as documented
    (the docstring promised cache_ratio: 0.33 at 3,000 tokens, nothing at 1,000)."""
    workload = fixed_length_requests(
        input_tokens=input_tokens, output_tokens=1, num_requests=400, cache_ratio=0.5, num_prefixes=8, seed=3
    )
    block = TRACE_BLOCK_SIZE_TOKENS
    whole = math.floor(0.5 * input_tokens / block) * block / input_tokens
    hit = infinite_cache_hit_ratio(workload, block)
    assert hit <= whole
    assert hit == pytest.approx(whole, abs=0.03)
    assert len({r.block_keys[0] for r in workload}) == (8 if whole else 400)  # a sub-block prefix shares nothing


def test_fixed_length_requests_are_seeded() -> None:
    """The same seed gives the same workload; another seed other arrivals and prefix choices."""
    options: dict[str, Any] = {"input_tokens": 4096, "output_tokens": 64, "num_requests": 50}
    assert fixed_length_requests(**options, seed=1) == fixed_length_requests(**options, seed=1)
    assert fixed_length_requests(**options, seed=1) != fixed_length_requests(**options, seed=2)
    paced = fixed_length_requests(**options, arrivals=ArrivalProcess(rate_per_s=1000.0), seed=1)
    assert paced[-1].arrival_s < 1.0
    assert fixed_length_requests(input_tokens=10, output_tokens=1, num_requests=0) == []


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"input_tokens": 0}, "input_tokens"),
        ({"input_tokens": 2.5}, "input_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"output_tokens": True}, "output_tokens"),
        ({"num_requests": -1}, "num_requests"),
        ({"num_requests": "3"}, "num_requests"),
        ({"num_prefixes": 0}, "num_prefixes"),
        ({"cache_ratio": 1.0}, "cache_ratio"),
        ({"cache_ratio": -0.1}, "cache_ratio"),
        ({"cache_ratio": math.nan}, "cache_ratio"),
    ],
    ids=repr,
)
def test_fixed_length_bad_arguments_are_config_errors(options: dict[str, Any], field: str) -> None:
    """Each bad argument raises ConfigError naming it."""
    arguments: dict[str, Any] = {"input_tokens": 1000, "output_tokens": 10, "num_requests": 5, **options}
    with pytest.raises(ConfigError, match=field):
        fixed_length_requests(**arguments)
