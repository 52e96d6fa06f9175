"""The default workload against the public trace it stands for, and `system_prompt_share`, the mechanism that lets
it open sessions with no shared prefix.

The `synthetic` preset once matched the public synthetic trace's means only: every prompt opened with one of 8
system prompts and documents came from a Zipf-1 pool, so an LRU cache of 1,000 blocks hit 0.237 of blocks where the
trace hits 0.082, and no prompt was under 512 tokens where 27.7 % of the trace's are. These tests hold its shape to
the trace's: the finite-capacity hit curve, the short unshared prompts, the output tail, the means.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections import Counter
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache.capacity import simulate_prefix_hits
from mooncake.cache.policy import LruPolicy
from mooncake.errors import ConfigError
from mooncake.types import Request
from mooncake.workload import (
    DEFAULT_WORKLOAD,
    ArrivalProcess,
    LengthDistribution,
    WorkloadSpec,
    generate_requests,
    load_trace,
    preset,
    trace_stats,
)
from tests.strategies import workload_specs

CAPACITIES_BLOCKS = (100, 1_000, 5_000, 20_000)
"""A cache of about one request's blocks up to about a third of the trace's unique blocks."""

WORKLOADS_DOC = Path(__file__).parents[2] / "docs" / "workloads.md"
SHORT_PROMPT_TOKENS = 512  # one block: a prompt under it has no full block to share


def default_workload(seed: int = 0) -> list[Request]:
    """The default workload (`DEFAULT_WORKLOAD`: the synthetic preset, 4,000 requests at 4 per second)."""
    spec = preset(DEFAULT_WORKLOAD.preset)
    arrivals = ArrivalProcess(rate_per_s=DEFAULT_WORKLOAD.rate_per_s)
    return list(generate_requests(spec, num_requests=DEFAULT_WORKLOAD.num_requests, arrivals=arrivals, seed=seed))


def lru_curve(requests: list[Request]) -> list[float]:
    """Hit ratios at `CAPACITIES_BLOCKS`, as `mooncake trace capacity --policy lru` replays them (flat LRU)."""
    keys = [request.block_keys for request in requests]
    return [
        simulate_prefix_hits(keys, LruPolicy(prefix_aware=False), capacity_blocks=capacity).hit_ratio
        for capacity in CAPACITIES_BLOCKS
    ]


def short_share(requests: list[Request]) -> float:
    return sum(request.input_length < SHORT_PROMPT_TOKENS for request in requests) / len(requests)


@pytest.fixture(scope="module")
def real(synthetic_trace: Path) -> list[Request]:
    return load_trace(synthetic_trace)


@pytest.fixture(scope="module")
def generated() -> list[Request]:
    return default_workload(seed=0)


@pytest.fixture(scope="module")
def curves(real: list[Request], generated: list[Request]) -> tuple[list[float], list[float]]:
    """The LRU curves of the trace and of the default workload (a few seconds: computed once)."""
    return lru_curve(real), lru_curve(generated)


def first_block_repeats(requests: list[Request]) -> tuple[float, int]:
    """The share of requests whose first block an earlier request opened with, and the most requests one opens."""
    firsts = Counter(request.block_keys[0] for request in requests)
    return (len(requests) - len(firsts)) / len(requests), firsts.most_common(1)[0][1]


# --------------------------------------------------------------------------- the default workload vs the trace


def test_default_workload_lru_curve_tracks_the_public_trace(curves: tuple[list[float], list[float]]) -> None:
    """At 100 to 20,000 blocks an LRU cache hits the default workload's blocks within 25 % (relative) of the public
    trace's, or within 0.02 where the ratios are that small. The old preset hit 0.046 / 0.237 / 0.514 / 0.665 where
    the trace hits 0.005 / 0.082 / 0.279 / 0.571: results that depend on cache size looked far better than on real
    traffic."""
    for capacity, want, got in zip(CAPACITIES_BLOCKS, *curves, strict=True):
        assert got == pytest.approx(want, rel=0.25, abs=0.02), f"LRU hit ratio at {capacity:,} blocks"


def test_default_workload_has_the_trace_share_of_short_unshared_prompts(
    real: list[Request], generated: list[Request]
) -> None:
    """About as many prompts under one block as the trace (27.7 %; the old preset had none), and first blocks
    about as varied: about as many requests repeat an earlier first block, and none is hot (the trace's most common
    first block opens 24 requests; the old preset's 984)."""
    assert short_share(generated) == pytest.approx(short_share(real), abs=0.05)
    real_share, real_top = first_block_repeats(real)
    share, top = first_block_repeats(generated)
    assert share == pytest.approx(real_share, abs=0.1)
    assert top <= 2 * real_top


def test_default_workload_keeps_the_trace_means_and_output_tail(real: list[Request], generated: list[Request]) -> None:
    """Mean input and output within 5 %, prefix reuse within 0.05, arrivals as many per second with Poisson gaps,
    and outputs that stop near the trace's longest (893 tokens; the old preset's reached 3,463)."""
    want, got = trace_stats(real), trace_stats(generated)
    assert got.mean_input_length == pytest.approx(want.mean_input_length, rel=0.05)
    assert got.mean_output_length == pytest.approx(want.mean_output_length, rel=0.05)
    assert got.prefix_reuse_ratio == pytest.approx(want.prefix_reuse_ratio, abs=0.05)
    assert got.mean_rate_per_s == pytest.approx(want.mean_rate_per_s, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(generated)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)
    longest = max(request.output_length for request in real)
    assert longest <= max(request.output_length for request in generated) <= 1.25 * longest


def test_the_documented_fit_is_what_the_trace_and_generator_give(
    real: list[Request], generated: list[Request], curves: tuple[list[float], list[float]]
) -> None:
    """docs/workloads.md's table of the fit states, to its rounding, the trace's and the default workload's LRU
    curve, share of short prompts, share of first blocks seen before and longest output."""
    text = re.sub(r"\s+", " ", WORKLOADS_DOC.read_text(encoding="utf-8"))
    for label, requests, curve in (("public synthetic trace", real, curves[0]), ("`synthetic`", generated, curves[1])):
        number = r"([\d.,]+)"
        found = re.findall(
            rf"\| {re.escape(label)} \| {number} / {number} / {number} / {number} \| {number} % \| {number} % \| "
            rf"{number} \|",
            text,
        )
        assert len(found) == 1, label
        figures = [float(cell.replace(",", "")) for cell in found[0]]
        assert figures[:4] == pytest.approx(curve, abs=0.0005)
        assert figures[4] == pytest.approx(100 * short_share(requests), abs=0.05)
        assert figures[5] == pytest.approx(100 * first_block_repeats(requests)[0], abs=0.05)
        assert figures[6] == max(request.output_length for request in requests)


# --------------------------------------------------------------------------- system_prompt_share

block_sizes = st.integers(1, 32)


@settings(max_examples=30, deadline=None)
@given(spec=workload_specs(), num_requests=st.integers(1, 60), seed=st.integers(0, 2**32 - 1))
def test_one_turn_chats_without_a_system_prompt_share_no_block(
    spec: WorkloadSpec, num_requests: int, seed: int
) -> None:
    """system_prompt_share=0: a one-turn chat is its own message alone, so no two requests have a block in common."""
    spec = attrs.evolve(
        spec, chat_weight=1.0, document_weight=0.0, agent_weight=0.0, system_prompt_share=0.0, mean_turns=1.0
    )
    workload = list(generate_requests(spec, num_requests=num_requests, seed=seed))
    keys = [key for request in workload for key in request.block_keys]
    assert len(keys) == len(set(keys))


@settings(max_examples=30, deadline=None)
@given(
    block_size=block_sizes,
    share=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
    document_weight=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_share_of_sessions_open_with_a_system_prompt(
    block_size: int, share: float, document_weight: float, seed: int
) -> None:
    """About `system_prompt_share` of chat and document sessions open with a system prompt: all at 1, none at 0,
    within five binomial standard deviations between. Lengths are fixed (system prompt 7 tokens, document 100,
    message 3, one turn), so a prompt's length tells whether it holds one: 10 or 110 tokens with, 3 or 103 without.
    """
    count = 400
    fixed = {"sigma": 0.0, "max_tokens": 1000}
    spec = WorkloadSpec(
        block_size_tokens=block_size,
        chat_weight=1.0 - document_weight,
        document_weight=document_weight,
        system_prompt_tokens=LengthDistribution(mean_tokens=7, **fixed),
        document_tokens=LengthDistribution(mean_tokens=100, **fixed),
        user_message_tokens=LengthDistribution(mean_tokens=3, **fixed),
        system_prompt_share=share,
        mean_turns=1.0,
    )
    lengths = Counter(request.input_length for request in generate_requests(spec, num_requests=count, seed=seed))
    assert set(lengths) <= {3, 10, 103, 110}
    opened = lengths[10] + lengths[110]
    if share in (0.0, 1.0):
        assert opened == count * share
    else:
        assert abs(opened - count * share) <= 5 * math.sqrt(count * share * (1 - share))


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, "half", None, True])
def test_system_prompt_share_outside_zero_to_one_is_a_config_error(value: object) -> None:
    """A share outside [0, 1] (or no number) is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="system_prompt_share"):
        WorkloadSpec(system_prompt_share=value)  # type: ignore[arg-type]


def test_presets_other_than_synthetic_open_every_session_with_a_system_prompt() -> None:
    """The share defaults to 1, which draws nothing: the other presets generate what they did before it existed."""
    assert WorkloadSpec().system_prompt_share == 1.0
    assert preset("conversation").system_prompt_share == preset("toolagent").system_prompt_share == 1.0
