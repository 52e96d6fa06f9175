"""Trace statistics: brute-force prefix reuse, the empty workload, the public synthetic trace."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload import (
    ArrivalProcess,
    TraceStats,
    generate_requests,
    iter_trace,
    load_trace,
    preset,
    trace_stats,
)
from tests.strategies import prefix_workloads, requests


def brute_force_reuse(workload: Sequence[Request]) -> float:
    """Per request, its leading keys that all occur in some earlier request; summed over all keys."""
    hits = total = 0
    for index, request in enumerate(workload):
        earlier = {key for other in workload[:index] for key in other.block_keys}
        for key in request.block_keys:
            if key not in earlier:
                break
            hits += 1
        total += len(request.block_keys)
    return hits / total if total else 0.0


def make(index: int, keys: Sequence[int], arrival_s: float = 0.0, output_length: int = 1) -> Request:
    return Request(
        request_id=RequestId(str(index)),
        arrival_s=arrival_s,
        input_length=4 * len(keys),
        output_length=output_length,
        block_keys=tuple(BlockKey(k) for k in keys),
    )


def workload_of(*chains: Sequence[int]) -> list[Request]:
    return [make(i, keys) for i, keys in enumerate(chains)]


# --------------------------------------------------------------------------- against a reference


@given(workload=prefix_workloads() | requests())
def test_stats_equal_a_brute_force_computation(workload: list[Request]) -> None:
    """Every statistic equals its definition computed directly from the list."""
    stats = trace_stats(iter(workload))
    assert stats.num_requests == len(workload)
    assert stats.prefix_reuse_ratio == pytest.approx(brute_force_reuse(workload), abs=1e-12)
    assert stats.num_blocks == sum(len(r.block_keys) for r in workload)
    assert stats.num_unique_blocks == len({k for r in workload for k in r.block_keys})
    if not workload:
        return
    assert stats.mean_input_length == pytest.approx(statistics.fmean(r.input_length for r in workload))
    assert stats.mean_output_length == pytest.approx(statistics.fmean(r.output_length for r in workload))
    assert stats.max_input_length == max(r.input_length for r in workload)
    duration = workload[-1].arrival_s - workload[0].arrival_s
    assert stats.duration_s == pytest.approx(duration)
    expected_rate = (len(workload) - 1) / duration if duration > 0 else 0.0
    assert stats.mean_rate_per_s == pytest.approx(expected_rate)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from(["conversation", "toolagent", "synthetic"]))
def test_generated_workloads_match_brute_force_and_reuse_prefixes(seed: int, name: str) -> None:
    """On generated workloads the ratio equals brute force and is positive (sessions and shared prompts)."""
    workload = list(generate_requests(preset(name), num_requests=150, seed=seed))
    ratio = trace_stats(workload).prefix_reuse_ratio
    assert ratio == pytest.approx(brute_force_reuse(workload), abs=1e-12)
    assert 0.0 < ratio < 1.0


@given(workload=prefix_workloads())
def test_reuse_ratio_is_a_fraction_and_zero_for_the_first_request(workload: list[Request]) -> None:
    """The ratio lies in [0, 1]; a single request never reuses anything."""
    assert 0.0 <= trace_stats(workload).prefix_reuse_ratio <= 1.0
    if workload:
        assert trace_stats(workload[:1]).prefix_reuse_ratio == 0.0


# --------------------------------------------------------------------------- examples


def test_empty_workload_gives_zeros() -> None:
    """No requests: every statistic is zero."""
    stats = trace_stats([])
    assert attrs.asdict(stats) == {field.name: 0 for field in attrs.fields(TraceStats)}
    assert isinstance(stats.prefix_reuse_ratio, float)


@pytest.mark.parametrize(
    ("chains", "ratio"),
    [
        ([[1, 2, 3], [1, 2, 4]], 2 / 6),  # shared prefix of two blocks
        ([[1, 2], [1, 2]], 2 / 4),  # an exact repeat
        ([[1, 2], [1, 9, 2]], 1 / 5),  # a miss stops the run: key 2 after it does not count
        ([[1, 2], [2, 1]], 2 / 4),  # keys seen earlier count wherever they were seen
        ([[1], [2], [1, 2]], 2 / 4),
        ([[1, 2, 3], [7], [1, 2, 3]], 3 / 7),
    ],
)
def test_prefix_reuse_examples(chains: list[list[int]], ratio: float) -> None:
    """Hand-computed reuse ratios for small workloads."""
    workload = workload_of(*chains)
    assert trace_stats(workload).prefix_reuse_ratio == pytest.approx(ratio)
    assert brute_force_reuse(workload) == pytest.approx(ratio)


def test_single_request_statistics() -> None:
    """One request: its own lengths, zero duration and rate, nothing reused."""
    stats = trace_stats([make(0, [1, 2, 3], arrival_s=7.5, output_length=9)])
    assert stats == TraceStats(
        num_requests=1,
        mean_input_length=12.0,
        mean_output_length=9.0,
        max_input_length=12,
        num_blocks=3,
        num_unique_blocks=3,
        prefix_reuse_ratio=0.0,
        duration_s=0.0,
        mean_rate_per_s=0.0,
    )


def test_duration_and_rate_are_from_first_to_last_arrival() -> None:
    """duration_s spans first to last arrival; the rate counts gaps: (n - 1) / duration."""
    workload = [make(i, [i], arrival_s=t) for i, t in enumerate([10.0, 11.0, 12.0, 14.0])]
    stats = trace_stats(workload)
    assert stats.duration_s == 4.0
    assert stats.mean_rate_per_s == 0.75


def test_stats_consume_an_iterator_once() -> None:
    """trace_stats accepts a one-shot iterator (it streams)."""
    workload = list(generate_requests(preset("toolagent"), num_requests=50, arrivals=ArrivalProcess(rate_per_s=2.0)))
    assert trace_stats(iter(workload)) == trace_stats(workload)


# --------------------------------------------------------------------------- the public synthetic trace


def test_synthetic_trace_statistics(synthetic_trace: Path) -> None:
    """3,993 requests, mean input 15,325.5 and output 149.1 tokens, prefix reuse 0.6396."""
    stats = trace_stats(iter_trace(synthetic_trace))
    assert stats.num_requests == 3993
    assert round(stats.mean_input_length, 1) == 15325.5
    assert round(stats.mean_output_length, 1) == 149.1
    assert round(stats.prefix_reuse_ratio, 4) == 0.6396
    assert stats.num_blocks == sum(len(r.block_keys) for r in load_trace(synthetic_trace))
    assert 0 < stats.num_unique_blocks < stats.num_blocks
    assert stats.duration_s > 0 and stats.mean_rate_per_s > 0
