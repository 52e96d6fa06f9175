"""Tests for `mooncake.sim.disaggregated`: the disaggregated cluster replayed on the real Conductor.

Properties over small random workloads, cluster specs, routers, admission
policies and SLOs: every request ends exactly once and the Conductor ends
with nothing in flight; analytic decode gives the times stepping one by one
gives; a replay is a function of its workload, spec and seed. Examples pin a
lone request's TTFT to the cost model (with and without a cached prefix,
chunked-pipeline groups, inline prefill) and the spec's validation.
"""

from __future__ import annotations

import csv
import functools
import math
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.admission import AdmissionPolicy, BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.build import RouterFactory
from mooncake.sched.cost import HARDWARE, MODELS, ChunkedPipelineCost, FittedPrefillModel, PrefillCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sched.router import KvCacheCentricRouter, LoadBalancingRouter, RandomRouter, local_cache_aware_router
from mooncake.sched.step import FittedStepModel, StepModel
from mooncake.sim.disaggregated import DisaggregatedCluster, replay
from mooncake.sim.metrics import RecordTable, ReplayResult, RequestRecord, top_mean
from mooncake.sim.spec import ClusterSpec, build_conductor
from mooncake.types import BlockKey, Request, RequestId, Slo
from mooncake.workload import ArrivalProcess, fixed_length_requests

LLAMA3 = MODELS["llama3-70b"]
A800 = HARDWARE["8xA800"]
H800 = HARDWARE["8xH800"]
BLOCK = 512
INFINITE_CACHE_TOKENS = 10**9
DECODE_RULE_REASONS = (Reason.CONTEXT_TOO_LONG, Reason.BATCH_FULL, Reason.KV_BUDGET, Reason.TBT_SLO)
REPLAY_SETTINGS = settings(deadline=None)  # examples from the profile: replays take milliseconds


def make_spec(**options: Any) -> ClusterSpec:
    defaults: dict[str, Any] = {
        "num_prefill": 1,
        "num_decode": 1,
        "model": LLAMA3,
        "prefill_hardware": A800,
        "decode_hardware": A800,
    }
    return ClusterSpec(**{**defaults, **options})


def make_request(name: str, arrival_s: float, input_tokens: int, output_tokens: int, keys: Sequence[int]) -> Request:
    return Request(
        request_id=RequestId(name),
        arrival_s=arrival_s,
        input_length=input_tokens,
        output_length=output_tokens,
        block_keys=tuple(BlockKey(k) for k in keys),
    )


def num_blocks(input_tokens: int) -> int:
    return -(-input_tokens // BLOCK)


# --------------------------------------------------------------------------- strategies


@st.composite
def prefix_family_requests(
    draw: st.DrawFn, *, max_requests: int = 8, max_input_tokens: int = 6000, max_output_tokens: int = 40
) -> list[Request]:
    """Requests in arrival order whose prompts start with a shared prefix of one of two families.

    Block j of family f is key f·1000 + j; the rest of a prompt is its own, so
    equal keys mean equal prefixes as with real chained keys.
    """
    count = draw(st.integers(min_value=1, max_value=max_requests))
    gaps_ms = draw(st.lists(st.sampled_from([0, 5, 300, 2000]) | st.integers(0, 3000), min_size=count, max_size=count))
    out = []
    ms = 0
    for index, gap_ms in enumerate(gaps_ms):
        ms += gap_ms
        input_tokens = draw(st.integers(1, max_input_tokens))
        blocks = num_blocks(input_tokens)
        family = draw(st.integers(0, 1))
        shared = draw(st.sampled_from([0, blocks // 2, blocks]) | st.integers(0, blocks))
        keys = [family * 1000 + j for j in range(shared)] + [10**6 + index * 1000 + j for j in range(shared, blocks)]
        out.append(make_request(str(index), ms / 1000, input_tokens, draw(st.integers(1, max_output_tokens)), keys))
    return out


@st.composite
def fixed_length_workloads(draw: st.DrawFn, *, max_requests: int = 8, max_output_tokens: int = 40) -> list[Request]:
    """`fixed_length_requests` with small counts and random rates."""
    return fixed_length_requests(
        input_tokens=draw(st.integers(1, 9000)),
        output_tokens=draw(st.integers(1, max_output_tokens)),
        num_requests=draw(st.integers(1, max_requests)),
        cache_ratio=draw(st.sampled_from([0.0, 0.5, 0.9])),
        num_prefixes=draw(st.integers(1, 3)),
        arrivals=ArrivalProcess(rate_per_s=draw(st.sampled_from([0.5, 5.0, 100.0]))),
        seed=draw(st.integers(0, 1000)),
    )


def workloads(*, max_requests: int = 8, max_output_tokens: int = 40) -> st.SearchStrategy[list[Request]]:
    """Small workloads with shared prefixes, built directly or by `fixed_length_requests`."""
    return prefix_family_requests(max_requests=max_requests, max_output_tokens=max_output_tokens) | (
        fixed_length_workloads(max_requests=max_requests, max_output_tokens=max_output_tokens)
    )


@st.composite
def cluster_specs(draw: st.DrawFn, **fixed: Any) -> ClusterSpec:
    """Clusters of 1 to 3 prefill nodes (maybe one CPP group) and 1 to 3 decode nodes, caches small to infinite."""
    group = draw(st.sampled_from([1, 1, 2, 3]))
    options: dict[str, Any] = {
        "num_prefill": group * draw(st.integers(1, 3 // group)),
        "num_decode": draw(st.integers(1, 3)),
        "decode_hardware": draw(st.sampled_from([A800, H800])),
        "cache_capacity_tokens": draw(st.sampled_from([0, 1024, 8192, INFINITE_CACHE_TOKENS])),
        "global_pool": draw(st.booleans()),
        "cpp_group_size": group,
        "cpp_chunk_tokens": draw(st.sampled_from([512, 4096])),
        "inline_prefill_tokens": draw(st.sampled_from([0, 256, 4096])),
        "network_bytes_per_s": draw(st.sampled_from([None, 2e9])),
        "sample_interval_s": draw(st.sampled_from([0.25, 1.0])),
        "admission_wait_s": draw(st.sampled_from([0.0, 0.0, 0.5, 30.0])),
    }
    options.update(fixed)
    return make_spec(**options)


tight_or_loose_slos = st.builds(
    Slo,
    ttft_s=st.sampled_from([0.2, 1.0, 30.0]),
    tbt_s=st.sampled_from([0.0156, 0.016, 0.02, 0.1]),  # a decode step of LLaMA3-70B on 8×A800 takes ≥ 15.65 ms
)
# The policies by object (the library takes no names): every router at a few thresholds, every admission policy.
ROUTERS: dict[str, Callable[[float], RouterFactory]] = {
    "random": lambda _threshold: RandomRouter,
    "load_balancing": lambda _threshold: LoadBalancingRouter,
    "local_cache_aware": lambda _threshold: local_cache_aware_router,
    "kvcache_centric": lambda threshold: functools.partial(KvCacheCentricRouter, threshold=threshold),
}
ADMISSIONS: dict[str, Callable[[], AdmissionPolicy]] = {
    "baseline": BaselineAdmission,
    "early_rejection": EarlyRejection,
    "predictive_early_rejection": predictive_early_rejection,
}


@st.composite
def conductor_options(draw: st.DrawFn) -> dict[str, Any]:
    threshold = draw(st.sampled_from([1.0, 1.5, 4.0]))
    return {
        "router": ROUTERS[draw(st.sampled_from(sorted(ROUTERS)))](threshold),
        "admission": ADMISSIONS[draw(st.sampled_from(sorted(ADMISSIONS)))](),
        "decode_s": draw(st.sampled_from([0.5, 10.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


# --------------------------------------------------------------------------- checks


def assert_each_ended_once(requests: Sequence[Request], result: ReplayResult) -> None:
    """One record per request, each with one final outcome consistent with its times (and sealed:
    the table holds no live record once the replay is over)."""
    records = result.records
    if isinstance(records, RecordTable):
        records.check_invariants()
        assert records.num_live == 0, "a record was never sealed"
    assert Counter(r.request_id for r in records) == Counter(r.request_id for r in requests)
    by_id = {r.request_id: r for r in requests}
    for record in records:
        request = by_id[record.request_id]
        assert record.outcome is not None, f"request {record.request_id} never ended"
        assert (record.input_tokens, record.output_tokens) == (request.input_length, request.output_length)
        assert record.arrival_s == request.arrival_s
        assert 0 <= record.prefix_tokens <= max(0, request.input_length - 1)
        assert record.prefill_s >= 0
        if record.outcome == Outcome.COMPLETED:
            assert record.first_token_s is not None and record.finish_s is not None
            ttft = record.ttft_s
            assert ttft is not None and ttft >= 0
            assert record.first_token_s <= record.finish_s
            assert record.decode_instance is not None
            assert (record.prefill_instance is None) == record.inline_prefill
            assert record.intervals.count == request.output_length - 1
            if request.output_length == 1:
                assert record.finish_s == record.first_token_s
            assert record.tbt_s == top_mean(record.intervals) >= 0
            assert np.all(record.intervals.values() > 0)
        elif record.outcome == Outcome.REJECTED_BEFORE_PREFILL:
            assert record.first_token_s is None, "its client got no token"
            assert record.finish_s is not None and record.finish_s >= record.arrival_s, "the refusal's time"
            assert record.reason is not None, "a rejection says why"
            assert record.intervals.count == 0
        else:
            assert record.outcome == Outcome.REJECTED_AFTER_PREFILL
            assert record.first_token_s is None, "its client got no token"
            assert record.finish_s is not None and record.finish_s >= record.arrival_s, "the refusal's time"
            assert record.reason in DECODE_RULE_REASONS, "the decode instance's own check names its bound"
            assert request.output_length > 1 and record.intervals.count == 0
    summary = result.summary
    assert summary.num_requests == len(requests)
    assert summary.completed + summary.rejected_before_prefill + summary.rejected_after_prefill == len(requests)
    assert all(s.prefill_requests >= 0 and s.decode_requests >= 0 for s in result.load)


def assert_intervals_fill_decoding(result: ReplayResult, step: StepModel) -> None:
    """For every completed request, the time from its first token to its last is the sum of its
    token intervals, and each interval is at least one step of a batch holding its own context."""
    for record in result.records:
        if record.outcome != Outcome.COMPLETED:
            continue
        assert record.first_token_s is not None and record.finish_s is not None
        intervals = record.intervals.values()
        decoding_s = record.finish_s - record.first_token_s
        assert math.isclose(float(intervals.sum()), decoding_s, rel_tol=1e-9, abs_tol=1e-9), record.request_id
        # The k-th step reads at least its own context, input + k tokens, in a batch of at least one.
        lone_steps = np.array([step.step_s(1, record.input_tokens + k) for k in range(len(intervals))])
        assert np.all(intervals >= lone_steps * (1 - 1e-9)), record.request_id


def assert_same_records(first: Sequence[RequestRecord], second: Sequence[RequestRecord]) -> None:
    """The same outcomes, and every time equal to 1e-9 (absolute plus relative)."""

    def close(a: float | None, b: float | None) -> bool:
        if a is None or b is None:
            return a is b
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)

    assert [r.request_id for r in first] == [r.request_id for r in second]
    for x, y in zip(first, second, strict=True):
        context = f"request {x.request_id}"
        assert (x.outcome, x.reason) == (y.outcome, y.reason), context
        assert (x.prefill_instance, x.decode_instance, x.inline_prefill) == (
            y.prefill_instance,
            y.decode_instance,
            y.inline_prefill,
        ), context
        assert x.prefix_tokens == y.prefix_tokens, context
        assert close(x.prefill_s, y.prefill_s), context
        assert close(x.first_token_s, y.first_token_s), context
        assert close(x.finish_s, y.finish_s), context
        assert close(x.tbt_s, y.tbt_s), context
        assert x.intervals.count == y.intervals.count, context
        np.testing.assert_allclose(x.intervals.values(), y.intervals.values(), rtol=1e-9, atol=1e-9, err_msg=context)


# --------------------------------------------------------------------------- every request ends once


@REPLAY_SETTINGS
@given(workloads(), cluster_specs(), conductor_options(), tight_or_loose_slos)
def test_every_request_ends_exactly_once(
    requests: list[Request], spec: ClusterSpec, options: dict[str, Any], slo: Slo
) -> None:
    """Completed, or rejected before or after prefill, never left hanging; the Conductor ends empty."""
    conductor = build_conductor(spec, slo=slo, **options)
    result = DisaggregatedCluster(spec, conductor).run(requests)
    assert_each_ended_once(requests, result)
    assert_intervals_fill_decoding(result, spec.decode_cost)
    for record in result.records:
        event(f"outcome: {record.outcome.value if record.outcome else None}")
        if record.inline_prefill:
            event("inline prefill")
        if record.prefix_tokens:
            event("prefix reused")
    assert conductor.in_flight == ()
    conductor.check_invariants()
    assert all(not view.queue for view in conductor.prefill_views)
    assert all(not view.active and not view.reserved for view in conductor.decode_views)


def test_burst_of_identical_requests_all_end() -> None:
    """Twenty requests at the same instant on one prefill and one decode node: all end, none twice."""
    requests = [make_request(str(i), 0.0, 3000, 30, range(num_blocks(3000))) for i in range(20)]
    for admission in ADMISSIONS.values():
        conductor = build_conductor(make_spec(), admission=admission(), slo=Slo(ttft_s=2.0, tbt_s=0.02))
        result = DisaggregatedCluster(make_spec(), conductor).run(requests)
        assert_each_ended_once(requests, result)
        assert conductor.in_flight == ()
        assert result.summary.completed >= 1


def test_progress_is_told_each_arrival() -> None:
    """`progress(n)` sees 1, 2, ..., n in order."""
    seen: list[int] = []
    requests = [make_request(str(i), i * 0.1, 100, 2, [i]) for i in range(5)]
    replay(make_spec(), requests, progress=seen.append)
    assert seen == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- TTFT against the cost model


@pytest.mark.parametrize("input_tokens", [1, 511, 512, 513, 4096, 8192, 20_000])
@pytest.mark.parametrize("cpp_group_size", [1, 2, 4])
def test_lone_request_ttft_is_the_cost_model_prefill(input_tokens: int, cpp_group_size: int) -> None:
    """With nothing else running and an infinite cache, TTFT is exactly the prefill time the model predicts."""
    spec = make_spec(
        num_prefill=cpp_group_size, cpp_group_size=cpp_group_size, cache_capacity_tokens=INFINITE_CACHE_TOKENS
    )
    request = make_request("only", 1.5, input_tokens, 8, range(num_blocks(input_tokens)))
    (record,) = replay(spec, [request]).records
    assert record.outcome == Outcome.COMPLETED
    expected = spec.prefill_cost.prefill_s(input_tokens, 0)
    if cpp_group_size > 1:
        assert isinstance(spec.prefill_cost, ChunkedPipelineCost)
    assert record.prefix_tokens == 0
    assert record.ttft_s is not None
    assert math.isclose(record.ttft_s, expected, rel_tol=1e-9)
    assert math.isclose(record.prefill_s, expected, rel_tol=1e-12)


@pytest.mark.parametrize("cache_blocks", [0, 4, 40])
def test_a_prompt_queued_behind_a_chain_longer_than_the_cache_is_estimated_as_the_node_runs_it(
    cache_blocks: int,
) -> None:
    """B queues behind A on one node and extends A's 16-block chain: the node keeps only what its cache holds of
    A's chain (none, the first 4, all 16), and the Conductor counts A's pending blocks only that far, so its
    estimate of B's prefix and TTFT is what the simulator charges (it counted all 16 blocks, 42 % early)."""
    spec = make_spec(cache_capacity_tokens=cache_blocks * BLOCK)
    a = make_request("a", 0.0, 16 * BLOCK, 2, range(16))
    b = make_request("b", 0.01, 17 * BLOCK, 2, [*range(16), 99])
    conductor = build_conductor(spec)
    estimates = [conductor.schedule(r, r.arrival_s) for r in (a, b)]
    records = replay(spec, [a, b]).records
    assert [r.prefix_tokens for r in records] == [0, min(cache_blocks, 16) * BLOCK]
    assert [d.prefix_tokens for d in estimates] == [r.prefix_tokens for r in records]
    assert [r.ttft_s for r in records] == pytest.approx([d.ttft_s for d in estimates], rel=1e-9)


@pytest.mark.parametrize("cpp_group_size", [1, 4])
def test_the_conductor_estimates_a_queue_as_the_group_runs_it(cpp_group_size: int) -> None:
    """Three long prompts at once on one instance: a chunked-pipeline group takes the next once the last
    one's chunks have left its first stage (`sched.cost.occupancy_s`), anything else when it ends; the
    Conductor's estimates, made as they arrive, are the TTFTs the simulator gives them."""
    spec = make_spec(
        num_prefill=cpp_group_size, cpp_group_size=cpp_group_size, cache_capacity_tokens=INFINITE_CACHE_TOKENS
    )
    requests = [
        make_request(f"r{i}", 1.0, tokens, 8, range(1000 * i, 1000 * i + num_blocks(tokens)))
        for i, tokens in enumerate([32_768, 20_000, 9_000])
    ]
    conductor = build_conductor(spec)
    estimates = [conductor.schedule(r, r.arrival_s).ttft_s for r in requests]
    records = replay(spec, requests).records
    assert [r.ttft_s for r in records] == pytest.approx(estimates, rel=1e-9)
    if cpp_group_size > 1:  # pipelined: the second starts before the first's first token
        assert records[1].ttft_s is not None and records[0].ttft_s is not None
        assert records[1].ttft_s - records[1].prefill_s < records[0].ttft_s


@pytest.mark.parametrize("global_pool", [True, False])
@pytest.mark.parametrize("input_tokens", [512, 3000, 8192])
def test_repeated_prompts_reuse_the_cached_prefix(global_pool: bool, input_tokens: int) -> None:
    """Well-spaced requests: the first computes everything; a repeat finds every block cached and reuses all
    but the block holding its last token (recomputed for the first token, as the engine does); a half-shared
    prompt finds its shared blocks. TTFT follows the cost model each time."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, global_pool=global_pool)
    blocks = num_blocks(input_tokens)
    shared = blocks // 2
    requests = [
        make_request("first", 0.0, input_tokens, 4, range(blocks)),
        make_request("repeat", 100.0, input_tokens, 4, range(blocks)),
        make_request("half", 200.0, input_tokens, 4, [*range(shared), *range(1000, 1000 + blocks - shared)]),
    ]
    result = replay(spec, requests)
    cost = spec.prefill_cost
    last_block = (input_tokens - 1) // BLOCK  # the block holding the last token
    expected_prefix = [0, min(blocks, last_block) * BLOCK, min(shared, last_block) * BLOCK]
    for record, prefix in zip(result.records, expected_prefix, strict=True):
        assert record.outcome == Outcome.COMPLETED
        assert record.prefix_tokens == prefix
        assert record.ttft_s is not None
        assert math.isclose(record.ttft_s, cost.prefill_s(input_tokens, prefix), rel_tol=1e-9)


def test_two_nodes_pick_the_one_holding_the_prefix() -> None:
    """With two prefill nodes, a repeat goes where its prefix is (or moves it there): its TTFT is the
    cached one: the prefix's load from DRAM into HBM (20 ms at 128 GB/s) with the last block computed."""
    spec = make_spec(num_prefill=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    requests = [make_request(name, t, 8192, 4, range(16)) for name, t in (("a", 0.0), ("b", 50.0))]
    first, repeat = replay(spec, requests).records
    assert repeat.prefix_tokens == 8192 - BLOCK
    assert repeat.ttft_s is not None and first.ttft_s is not None
    load_s = repeat.prefix_tokens * LLAMA3.kv_bytes_per_token / A800.host_to_device_bytes_per_s
    assert load_s <= repeat.ttft_s < first.ttft_s / 10
    assert math.isclose(repeat.ttft_s, spec.prefill_cost.prefill_s(8192, repeat.prefix_tokens), rel_tol=1e-9)


def test_inline_prefill_of_a_short_prompt() -> None:
    """A prompt within `inline_prefill_tokens` is prefilled in its decode batch: no prefill node, the decode
    hardware's prefill time, and TTFT equal to it."""
    spec = make_spec(inline_prefill_tokens=512, decode_hardware=H800)
    (record,) = replay(spec, [make_request("short", 2.0, 300, 5, [1])]).records
    assert record.outcome == Outcome.COMPLETED
    assert record.inline_prefill and record.prefill_instance is None
    expected = PrefillCostModel(model=LLAMA3, hardware=H800).prefill_s(300)
    assert record.ttft_s is not None
    assert math.isclose(record.ttft_s, expected, rel_tol=1e-9)
    assert record.intervals.count == 4
    (long_record,) = replay(spec, [make_request("long", 2.0, 600, 5, [1, 2])]).records
    assert not long_record.inline_prefill and long_record.prefill_instance is not None


def test_inline_prefill_only_within_the_tbt_slo() -> None:
    """A short prompt is inlined only when the step carrying it (the batch's step with the prompt
    added, plus its prefill) stays within the TBT SLO: at the SLO it is inlined, one ulp below it
    is refused and goes to a prefill node instead."""
    spec = make_spec(inline_prefill_tokens=4096, decode_hardware=H800)
    request = make_request("short", 2.0, 3000, 5, range(num_blocks(3000)))
    step_s = spec.decode_cost.step_s(1, request.input_length)  # the decode rule's prediction, batch of one
    inline_s = PrefillCostModel(model=LLAMA3, hardware=H800, mfu=spec.mfu).prefill_s(request.input_length)
    carrying_s = step_s + inline_s
    (at_slo,) = replay(spec, [request], slo=Slo(tbt_s=carrying_s)).records
    assert at_slo.outcome == Outcome.COMPLETED and at_slo.inline_prefill
    (over_slo,) = replay(spec, [request], slo=Slo(tbt_s=math.nextafter(carrying_s, 0.0))).records
    assert over_slo.outcome == Outcome.COMPLETED
    assert not over_slo.inline_prefill and over_slo.prefill_instance is not None


def _inline_then_prefilled(
    *, running_tokens: int, inline_tokens: int, prefilled_tokens: int, after_s: float, slack_s: float
) -> tuple[list[Request], Slo]:
    """A running request A; a short prompt I inlined into A's batch at t = 60 s; a prefilled request R reaching
    the decode instance `after_s` later (before the boundary where I joins, for small `after_s`); A's and R's
    prompts over the inline limit (4096) when I's is within it; a TBT SLO
    `slack_s` above the step carrying A, I and I's prefill, so that R's step alone fits but not with I's stall."""
    spec = make_spec(inline_prefill_tokens=4096, cache_capacity_tokens=0)
    inline_s = PrefillCostModel(model=LLAMA3, hardware=A800, mfu=spec.mfu).prefill_s(inline_tokens)
    # A's context grows by one per step: its prompt plus a few thousand tokens by t = 60 s.
    tbt_s = spec.decode_cost.step_s(2, running_tokens + 3000 + inline_tokens) + inline_s + slack_s
    inline_at_s = 60.0  # after the longest prefill R may need
    prefill_s = spec.prefill_cost.prefill_s(prefilled_tokens)
    handoff_s = spec.transfer_cost.handoff_s(prefilled_tokens * LLAMA3.kv_bytes_per_token, prefill_s)
    requests = [
        make_request("A", 0.0, running_tokens, 8000, range(num_blocks(running_tokens))),
        make_request(
            "R",
            inline_at_s + after_s - prefill_s - handoff_s,
            prefilled_tokens,
            50,
            range(10_000, 10_000 + num_blocks(prefilled_tokens)),
        ),
        make_request("I", inline_at_s, inline_tokens, 50, range(20_000, 20_000 + num_blocks(inline_tokens))),
    ]
    return sorted(requests, key=lambda r: r.arrival_s), Slo(ttft_s=60.0, tbt_s=tbt_s)


def test_a_prefilled_request_joining_with_an_inline_prefill_counts_its_stall() -> None:
    """The reviewer's case: R reaches the decode instance 0.5 ms after I was inlined, before the boundary where
    both would join. R's step fits the SLO alone, not with I's prefill stalling it: the decode rule (given the
    objective less the stalls that step carries) rejects R, and A's intervals stay within the SLO."""
    requests, slo = _inline_then_prefilled(
        running_tokens=4096, inline_tokens=2000, prefilled_tokens=100_000, after_s=0.0005, slack_s=0.0005
    )
    spec = make_spec(inline_prefill_tokens=4096, cache_capacity_tokens=0)
    records = {r.request_id: r for r in replay(spec, requests, admission=BaselineAdmission(), slo=slo).records}
    assert records[RequestId("I")].inline_prefill
    assert records[RequestId("R")].outcome == Outcome.REJECTED_AFTER_PREFILL
    assert records[RequestId("R")].reason == Reason.TBT_SLO
    assert max(records[RequestId("A")].intervals.values()) <= slo.tbt_s


@REPLAY_SETTINGS
@given(
    running_tokens=st.integers(4097, 8000),  # over the inline limit, 4096: only I is inlined
    inline_tokens=st.integers(500, 4096),
    prefilled_tokens=st.integers(4097, 120_000),
    after_s=st.floats(0.0, 0.02),
    slack_s=st.floats(0.0, 0.01),
)
def test_every_interval_within_the_tbt_slo_with_inline_prefills_and_joiners(
    running_tokens: int, inline_tokens: int, prefilled_tokens: int, after_s: float, slack_s: float
) -> None:
    """Whichever comes first, an inline prefill or a prefilled request joining the same step, every decode
    step stays within the TBT objective (to rounding of the clock's sums): all of the running request's
    intervals, and every other request's after its first (a prefilled request's first interval also holds
    its hand-off and its wait for the boundary, which no decode rule bounds)."""
    requests, slo = _inline_then_prefilled(
        running_tokens=running_tokens,
        inline_tokens=inline_tokens,
        prefilled_tokens=prefilled_tokens,
        after_s=after_s,
        slack_s=slack_s,
    )
    spec = make_spec(inline_prefill_tokens=4096, cache_capacity_tokens=0)
    for record in replay(spec, requests, admission=BaselineAdmission(), slo=slo).records:
        event(f"{record.request_id}: {record.outcome.name}{' inline' if record.inline_prefill else ''}")
        steps = record.intervals.values()[0 if record.request_id == "A" else 1 :]
        assert all(steps <= slo.tbt_s * (1 + 1e-12))


# --------------------------------------------------------------------------- analytic decode = stepping


@REPLAY_SETTINGS
@given(
    workloads(max_output_tokens=80),
    cluster_specs(inline_prefill_tokens=0) | cluster_specs(inline_prefill_tokens=256),
    conductor_options(),
    tight_or_loose_slos,
)
def test_analytic_decode_matches_stepping(
    requests: list[Request], spec: ClusterSpec, options: dict[str, Any], slo: Slo
) -> None:
    """Advancing decode batches a stretch at a time gives the per-request times of stepping one by one,
    and the same admissions, with TBT SLOs tight enough for the decode side's own check to bind."""
    analytic = replay(attrs.evolve(spec, analytic_decode=True), requests, slo=slo, **options)
    stepped = replay(attrs.evolve(spec, analytic_decode=False), requests, slo=slo, **options)
    assert_same_records(analytic.records, stepped.records)
    assert_intervals_fill_decoding(analytic, spec.decode_cost)


def test_decode_check_sees_the_current_context() -> None:
    """The decode instance's own TBT check uses the batch's context now, whichever way the batch advances.

    A decodes alone from t ≈ 0.1 s (context 1,000 growing by one token a step); B (1,000 tokens) reaches
    the decode node at t ≈ 1.1 s, when A's context is about 1,063. With the TBT SLO at the step time for
    2,030 tokens, B does not fit: stepping rejects it after prefill; analytic decode must too.
    """
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    slo = Slo(tbt_s=spec.decode_cost.step_s(2, 2030))
    requests = [make_request("a", 0.0, 1000, 2000, [1, 2]), make_request("b", 1.0, 1000, 10, [3, 4])]
    stepped = replay(attrs.evolve(spec, analytic_decode=False), requests, slo=slo, admission=BaselineAdmission())
    analytic = replay(spec, requests, slo=slo, admission=BaselineAdmission())
    assert stepped.records[1].outcome == Outcome.REJECTED_AFTER_PREFILL  # the reference
    assert_same_records(analytic.records, stepped.records)


# --------------------------------------------------------------------------- determinism


@settings(max_examples=15, deadline=None)
@given(workloads(), cluster_specs(), conductor_options(), tight_or_loose_slos)
def test_replays_are_deterministic(
    requests: list[Request], spec: ClusterSpec, options: dict[str, Any], slo: Slo
) -> None:
    """Two replays of one workload, spec and seed give identical records and load samples."""
    first = replay(spec, requests, slo=slo, **options)
    second = replay(spec, requests, slo=slo, **options)
    assert first.records == second.records
    assert first.load == second.load
    assert attrs.evolve(first.summary, sim_wall_s=0.0) == attrs.evolve(second.summary, sim_wall_s=0.0)


def test_random_routing_depends_on_the_seed() -> None:
    """The random router draws from the Conductor's seeded generator: same seed, same routes; seeds differ."""
    spec = make_spec(num_prefill=3, num_decode=2)
    requests = [make_request(str(i), i * 0.05, 2000, 5, range(4 * i, 4 * i + 4)) for i in range(24)]

    def routes(seed: int) -> list[Any]:
        return [r.prefill_instance for r in replay(spec, requests, router=RandomRouter, seed=seed).records]

    assert routes(7) == routes(7)
    assert len({tuple(routes(seed)) for seed in range(4)}) > 1


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_prefill": 0}, "num_prefill"),
        ({"num_prefill": True}, "num_prefill"),
        ({"num_prefill": 1.0}, "num_prefill"),
        ({"num_decode": 0}, "num_decode"),
        ({"num_decode": -2}, "num_decode"),
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"cache_capacity_tokens": -1}, "cache_capacity_tokens"),
        ({"cpp_group_size": 0}, "cpp_group_size"),
        ({"num_prefill": 3, "cpp_group_size": 2}, "cpp_group_size"),
        ({"cpp_chunk_tokens": 0}, "cpp_chunk_tokens"),
        ({"inline_prefill_tokens": -1}, "inline_prefill_tokens"),
        ({"mfu": 0.0}, "mfu"),
        ({"mfu": -0.5}, "mfu"),
        ({"mfu": math.nan}, "mfu"),
        ({"sample_interval_s": 0.0}, "sample_interval_s"),
        ({"sample_interval_s": math.nan}, "sample_interval_s"),
        ({"mfu": 5.0}, "mfu"),
        ({"model": "llama3-70b"}, "model"),
        ({"decode_hardware": "8xA800"}, "decode_hardware"),
        ({"global_pool": "no"}, "global_pool"),
        ({"analytic_decode": 0}, "analytic_decode"),
        ({"step_model": 5}, "step_model"),
        ({"prefill_model": "x"}, "prefill_model"),
        ({"decode_node_limits": {"kv_capacity_tokens": 10}}, "decode_node_limits"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else None,
)
def test_bad_spec_values_are_config_errors(options: dict[str, Any], field: str) -> None:
    """Each out-of-range value raises ConfigError (a ValueError) naming the field."""
    with pytest.raises(ConfigError, match=field) as caught:
        make_spec(**options)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"network_bytes_per_s": 0.0}, "network_bytes_per_s"),
        ({"network_bytes_per_s": -1e9}, "network_bytes_per_s"),
        ({"network_bytes_per_s": math.nan}, "network_bytes_per_s"),
        ({"admission_wait_s": -1.0}, "admission_wait_s"),
        ({"admission_wait_s": math.inf}, "admission_wait_s"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else None,
)
def test_unvalidated_spec_values_are_config_errors(options: dict[str, Any], field: str) -> None:
    """The KV transfer bandwidth, when given, must be a finite number > 0."""
    with pytest.raises(ConfigError, match=field):
        make_spec(**options)


def test_cpp_groups_are_one_instance_each() -> None:
    """Six prefill nodes in groups of three are two Conductor instances timed by the CPP model."""
    spec = make_spec(num_prefill=6, cpp_group_size=3, num_decode=2)
    assert spec.num_prefill_instances == 2
    conductor = build_conductor(spec)
    assert [v.instance_id for v in conductor.prefill_views] == ["prefill-0", "prefill-1"]
    assert [v.instance_id for v in conductor.decode_views] == ["decode-0", "decode-1"]
    assert isinstance(spec.prefill_cost, ChunkedPipelineCost) and spec.prefill_cost.group_size == 3
    assert isinstance(make_spec().prefill_cost, PrefillCostModel)


def test_network_bandwidth_defaults_to_the_nic() -> None:
    """The transfer model uses `network_bytes_per_s`, else the prefill hardware's NIC."""
    assert make_spec().transfer_cost.bandwidth_bytes_per_s == A800.nic_bytes_per_s
    assert make_spec(network_bytes_per_s=5e9).transfer_cost.bandwidth_bytes_per_s == 5e9


FITTED_PREFILL = FittedPrefillModel(coefficients=(0.002, 3e-5, 1e-9))
FITTED_STEP = FittedStepModel(coefficients=(0.001, 2e-4, 3e-7))


def test_fitted_models_replace_the_analytic_ones() -> None:
    """A spec given the real engines' fitted prefill and step models and decode limits charges them: a lone
    request's TTFT is the fitted prefill, its token intervals the fitted steps of a batch of one, and the
    Conductor's decode instances hold the given limits."""
    limits = DecodeLimits(kv_capacity_tokens=16_384, max_batch_size=8, max_context_tokens=2048)
    spec = make_spec(
        cache_capacity_tokens=INFINITE_CACHE_TOKENS,
        prefill_model=FITTED_PREFILL,
        step_model=FITTED_STEP,
        decode_node_limits=limits,
    )
    assert (spec.prefill_cost, spec.decode_cost, spec.decode_limits) == (FITTED_PREFILL, FITTED_STEP, limits)
    assert [view.limits for view in build_conductor(spec).decode_views] == [limits]
    request = make_request("only", 1.0, 1500, 6, range(num_blocks(1500)))
    (record,) = replay(spec, [request]).records
    assert record.outcome == Outcome.COMPLETED and record.ttft_s is not None
    assert math.isclose(record.ttft_s, FITTED_PREFILL.prefill_s(1500), rel_tol=1e-9)
    steps = [FITTED_STEP.step_s(1, 1500 + k) for k in range(5)]
    intervals = record.intervals.values()  # the first also waits for the KV to reach the decode node
    assert intervals[0] >= steps[0] and np.allclose(intervals[1:], steps[1:], rtol=1e-9)


@pytest.mark.parametrize("network_bytes_per_s", [None, 1e9])
def test_the_kv_stream_hides_behind_the_prefill_and_only_what_it_does_not_hide_delays_the_join(
    network_bytes_per_s: float | None,
) -> None:
    """The KV streams layer by layer during the prefill: a lone request joins its decode node the network's
    latency after the prefill, or what the stream takes beyond the prefill when that is longer (a slow
    network); the first interval is that wait plus the first step."""
    spec = make_spec(
        cache_capacity_tokens=INFINITE_CACHE_TOKENS,
        prefill_model=FITTED_PREFILL,
        step_model=FITTED_STEP,
        network_bytes_per_s=network_bytes_per_s,
    )
    request = make_request("only", 1.0, 1500, 3, range(num_blocks(1500)))
    (record,) = replay(spec, [request]).records
    assert record.outcome == Outcome.COMPLETED
    transfer, prefill_s = spec.transfer_cost, FITTED_PREFILL.prefill_s(1500)
    stream_s = transfer.transfer_s(1500 * spec.model.kv_bytes_per_token)
    wait = max(transfer.latency_s, stream_s - prefill_s)
    assert (stream_s > prefill_s) == (network_bytes_per_s is not None)  # both cases are met
    assert math.isclose(record.intervals.values()[0], wait + FITTED_STEP.step_s(1, 1500), rel_tol=1e-9)


@pytest.mark.parametrize("output_tokens", [1, 6])
def test_the_first_token_overhead_delays_the_first_token_and_the_join(output_tokens: int) -> None:
    """The serving path's fixed latency: a lone request's first token comes that much after its prefill, and
    its decode (joining then) keeps the same intervals; a one-token request ends with its first token."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, prefill_model=FITTED_PREFILL, step_model=FITTED_STEP)
    late = attrs.evolve(spec, first_token_overhead_s=0.02)
    request = make_request("only", 1.0, 1500, output_tokens, range(num_blocks(1500)))
    ((plain,), (delayed,)) = (replay(s, [request]).records for s in (spec, late))
    assert plain.ttft_s is not None and delayed.ttft_s is not None and delayed.finish_s is not None
    assert math.isclose(delayed.ttft_s, plain.ttft_s + 0.02, rel_tol=1e-9)
    assert np.allclose(delayed.intervals.values(), plain.intervals.values(), rtol=1e-9)
    if output_tokens == 1:
        assert delayed.finish_s == delayed.first_token_s
    # The Conductor on the spec estimates the same TTFT the simulator charges, overhead included.
    decision = build_conductor(late).schedule(request, request.arrival_s)
    assert decision.ttft_s is not None and math.isclose(decision.ttft_s, delayed.ttft_s, rel_tol=1e-9)
    with pytest.raises(ConfigError, match="first_token_overhead_s"):
        attrs.evolve(spec, first_token_overhead_s=-1.0)
    with pytest.raises(ConfigError, match="first_token_overhead_s"):
        attrs.evolve(spec, first_token_overhead_s=math.inf)


@attrs.define
class _ScriptedTransfer:
    """A test router: the first request prefills on the first instance, the second on the second with the
    first's prefix moved over (its copy kept there or not, `keep`), the rest on the second with what it holds."""

    estimator: Any
    keep: bool
    routed: int = 0

    def route(self, candidates: Any, query: Any, now: float, rng: Any) -> Any:
        first, second = candidates[0], candidates[1]
        self.routed += 1
        if self.routed == 1:
            return self.estimator.decide_local(first, query, now)
        if self.routed == 2:
            held = query.prefix_blocks.get(first.instance_id, 0)
            return self.estimator.decide(
                second, query, now, prefix_blocks=held, transfer_from=first.instance_id, keep_copy=self.keep
            )
        return self.estimator.decide_local(second, query, now)

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        pass


@pytest.mark.parametrize("keep", [True, False])
def test_a_receiver_keeps_a_moved_prefix_only_when_the_plan_says_so(keep: bool) -> None:
    """Hot-spot replication (§6.2): the instance a prefix was moved to keeps it, and stores the whole prompt
    after its prefill, when the plan keeps the copy, and drops both otherwise; a later request there that
    continues the prompt finds all of it, or nothing."""
    spec = make_spec(num_prefill=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    requests = [
        make_request(name, 10.0 * i, tokens, 2, range(num_blocks(tokens)))
        for i, (name, tokens) in enumerate((("a", 8 * BLOCK), ("b", 12 * BLOCK), ("c", 16 * BLOCK)))
    ]  # each prompt continues the one before
    records = {r.request_id: r for r in replay(spec, requests, router=lambda e: _ScriptedTransfer(e, keep)).records}
    assert all(record.outcome == Outcome.COMPLETED for record in records.values())
    assert records[RequestId("b")].prefix_tokens == 8 * BLOCK  # a's blocks, moved
    assert records[RequestId("c")].prefix_tokens == (12 * BLOCK if keep else 0)  # b's, 4 of them computed there


def test_without_a_global_pool_the_router_never_transfers() -> None:
    """Local-cache mode: the Conductor shows the router no holder to move a prefix from, so the
    KV-cache-centric router routes as the local-cache-aware one does."""
    requests = [make_request(name, t, 8192, 4, range(16)) for name, t in (("a", 0.0), ("b", 0.1), ("c", 0.2))]
    spec = make_spec(num_prefill=2, global_pool=False, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    conductor = build_conductor(spec, router=KvCacheCentricRouter)
    decisions = [conductor.schedule(r, r.arrival_s) for r in requests]
    assert conductor.transfers is False and all(d.transfer is None for d in decisions)
    local = replay(spec, requests, router=local_cache_aware_router).records
    assert_same_records(replay(spec, requests, router=KvCacheCentricRouter).records, local)


# --------------------------------------------------------------------------- rejections


def busy_decode_scenario() -> tuple[ClusterSpec, Slo, list[Request]]:
    """A decodes 8,000 tokens of context from t ≈ 0.9 s; B (1,000 tokens) arrives at 3 s. The TBT SLO
    admits A's batch alone but not with B in it."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    slo = Slo(tbt_s=spec.decode_cost.step_s(1, 8500))
    requests = [make_request("a", 0.0, 8000, 2000, range(16)), make_request("b", 3.0, 1000, 10, [100, 101])]
    return spec, slo, requests


def test_decode_side_rejection_wastes_the_prefill() -> None:
    """Without early rejection, B is prefilled, then refused by its decode instance: wasted prefill. B's client
    never got a token (the refusal came instead of the prefill's): B has no first token, no TTFT."""
    spec, slo, requests = busy_decode_scenario()
    conductor = build_conductor(spec, admission=BaselineAdmission(), slo=slo)
    result = DisaggregatedCluster(spec, conductor).run(requests)
    a, b = result.records
    assert a.outcome == Outcome.COMPLETED
    assert b.outcome == Outcome.REJECTED_AFTER_PREFILL and b.reason is Reason.TBT_SLO
    assert b.first_token_s is None and b.ttft_s is None and b.prefill_s > 0
    assert result.summary.wasted_prefill_s == pytest.approx(b.prefill_s)
    assert conductor.in_flight == ()
    conductor.check_invariants()


def test_a_request_refused_after_prefill_has_no_ttft_in_its_records() -> None:
    """B, refused by its decode node after its prefill, has an empty TTFT in requests.csv (its client got no token);
    its prefill still counts as done: wasted, and in the mean prefill time beside A's."""
    from mooncake.sim.report import write_records_csv

    spec, slo, requests = busy_decode_scenario()
    result = replay(spec, requests, admission=BaselineAdmission(), slo=slo)
    a, b = result.records
    assert b.outcome == Outcome.REJECTED_AFTER_PREFILL and a.ttft_s is not None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "requests.csv"
        write_records_csv(result.records, path)
        rows = {row["request_id"]: row for row in csv.DictReader(path.open())}
    assert rows["b"]["outcome"] == Outcome.REJECTED_AFTER_PREFILL.value and rows["b"]["ttft_s"] == ""
    assert float(rows["a"]["ttft_s"]) == pytest.approx(a.ttft_s, abs=1e-6)
    assert result.summary.wasted_prefill_s == b.prefill_s > 0
    assert result.summary.mean_prefill_s == pytest.approx((a.prefill_s + b.prefill_s) / 2)
    assert result.summary.ttft_s["mean"] == pytest.approx(a.ttft_s)


@pytest.mark.parametrize("admission", ["early_rejection", "predictive_early_rejection"])
def test_early_rejection_refuses_before_prefill(admission: str) -> None:
    """With early rejection the Conductor sees the same overload and refuses B before any prefill."""
    spec, slo, requests = busy_decode_scenario()
    a, b = replay(spec, requests, admission=ADMISSIONS[admission](), slo=slo).records
    assert a.outcome == Outcome.COMPLETED
    assert b.outcome == Outcome.REJECTED_BEFORE_PREFILL and b.reason is Reason.TBT_SLO
    assert b.first_token_s is None and b.prefill_s == 0.0


def test_a_request_without_room_waits_for_it_before_its_prefill() -> None:
    """B, refused at 3 s for the TBT objective, waits (no prefill) and is scheduled again when A ends: with a
    TTFT objective A's decode fits into, it completes after A; with one it does not, it is rejected once the
    wait plus its estimated TTFT would break the objective, having wasted nothing."""
    spec, slo, requests = busy_decode_scenario()
    a_alone = replay(spec, requests[:1], admission=EarlyRejection(), slo=slo).records[0]
    assert a_alone.finish_s is not None and a_alone.finish_s > 30.0  # A decodes for tens of seconds
    patient = attrs.evolve(slo, ttft_s=100.0)
    waiting = attrs.evolve(spec, admission_wait_s=100.0)
    a, b = replay(waiting, requests, admission=EarlyRejection(), slo=patient).records
    assert a.outcome == b.outcome == Outcome.COMPLETED
    assert b.first_token_s is not None and b.first_token_s > a_alone.finish_s  # it started when A ended
    assert a.finish_s == pytest.approx(a_alone.finish_s)  # B never joined A's batch
    hurried = attrs.evolve(slo, ttft_s=10.0)
    result = replay(waiting, requests, admission=EarlyRejection(), slo=hurried)
    a, b = result.records
    assert a.outcome == Outcome.COMPLETED
    assert (b.outcome, b.reason) == (Outcome.REJECTED_BEFORE_PREFILL, Reason.TBT_SLO)
    assert b.prefill_s == 0.0 and result.summary.wasted_prefill_s == 0.0
    at_once = replay(spec, requests, admission=EarlyRejection(), slo=patient).records[1]  # admission_wait_s = 0
    assert (at_once.outcome, at_once.reason) == (Outcome.REJECTED_BEFORE_PREFILL, Reason.TBT_SLO)


def test_requests_waiting_for_room_are_served_in_arrival_order() -> None:
    """A decode node of one batch slot, eight requests at once: with a wait they all complete, one after another
    in arrival order (the longest waiting first); without, the first alone."""
    spec = make_spec(decode_node_limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1))
    requests = [make_request(f"r{i}", i * 0.001, 1000, 50, [1000 + i, 2000 + i]) for i in range(8)]
    slo = Slo(ttft_s=1000.0, tbt_s=1.0)
    records = replay(attrs.evolve(spec, admission_wait_s=1000.0), requests, slo=slo).records
    assert [r.outcome for r in records] == [Outcome.COMPLETED] * 8
    starts = [r.first_token_s for r in records]
    assert all(x is not None for x in starts) and starts == sorted(starts)  # type: ignore[type-var]
    alone = replay(spec, requests, slo=slo).records
    assert [r.outcome for r in alone] == [Outcome.COMPLETED] + [Outcome.REJECTED_BEFORE_PREFILL] * 7
    assert {r.reason for r in alone[1:]} == {Reason.BATCH_FULL}


def test_nobody_overtakes_a_request_waiting_for_room() -> None:
    """A holds most of the decode node's KV; B, too large for what is left, waits; C, small enough to fit beside
    A, arrives after B and waits behind it (first come, first served): it is prefilled after B, once A's end
    lets B in. Without a wait B is refused and C goes straight in."""
    spec = make_spec(decode_node_limits=DecodeLimits(kv_capacity_tokens=3000))
    requests = [
        make_request("a", 0.0, 2000, 50, range(100, 104)),
        make_request("b", 0.005, 1500, 50, range(200, 203)),
        make_request("c", 0.01, 500, 50, range(300, 301)),
    ]
    slo = Slo(ttft_s=1000.0, tbt_s=1.0)
    a, b, c = replay(attrs.evolve(spec, admission_wait_s=1000.0), requests, admission=EarlyRejection(), slo=slo).records
    assert a.outcome == b.outcome == c.outcome == Outcome.COMPLETED
    assert a.finish_s is not None and b.first_token_s is not None and c.first_token_s is not None
    assert a.finish_s < b.first_token_s < c.first_token_s
    a, b, c = replay(spec, requests, admission=EarlyRejection(), slo=slo).records
    assert (b.outcome, b.reason) == (Outcome.REJECTED_BEFORE_PREFILL, Reason.KV_BUDGET)
    assert c.first_token_s is not None and a.finish_s is not None and c.first_token_s < a.finish_s


def test_replay_refuses_an_empty_workload_and_what_is_not_a_request() -> None:
    """A workload iterator replayed twice (generate_requests' is one): the second replay is an error saying so,
    not an empty result; an item that is not a Request is an InvalidRequestError naming its type; so is a request
    id given twice, in either simulator (outcomes are counted by id)."""
    from mooncake.errors import InvalidRequestError
    from mooncake.workload import PRESETS, generate_requests

    spec = make_spec()
    workload = generate_requests(PRESETS["synthetic"], num_requests=5)
    assert replay(spec, workload, decode_s=5.0).summary.completed == 5
    with pytest.raises(InvalidRequestError, match="used up by one replay"):
        replay(spec, workload, decode_s=5.0)
    with pytest.raises(InvalidRequestError, match="got dict"):
        replay(spec, [{"arrival_s": 0.0}], decode_s=5.0)  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="got int"):  # without decode_s: read for the workload's t_d
        replay(spec, [1, 2])  # type: ignore[list-item]
    requests = list(generate_requests(PRESETS["synthetic"], num_requests=3))
    for decode_s in (5.0, None):  # a None is an item like any other, not the end of the workload
        with pytest.raises(InvalidRequestError, match="got NoneType"):
            replay(spec, [requests[0], None, *requests[1:]], decode_s=decode_s)  # type: ignore[list-item]
    requests = list(generate_requests(PRESETS["synthetic"], num_requests=5))
    twice = [*requests, attrs.evolve(requests[-1], request_id=requests[0].request_id, arrival_s=1e6)]
    with pytest.raises(InvalidRequestError, match="request id '0' appears twice"):  # its first has long ended
        replay(spec, twice, decode_s=5.0)
    from mooncake.sim import CoupledCluster, CoupledSpec

    coupled = CoupledCluster(CoupledSpec(num_instances=1, model=spec.model, hardware=spec.prefill_hardware))
    with pytest.raises(InvalidRequestError, match="appears twice"):
        coupled.run(twice)


def test_replay_predicts_with_the_workloads_decode_time_unless_told() -> None:
    """Without decode_s or a predictor, the predictive policy's t_d is the workload's (uniform_decode_s: what the
    experiments and the replay tool use), so the library and the tools agree; a predictor given is the one used;
    both at once is a ConfigError."""
    from mooncake.sched.predictor import UniformDecodePredictor, uniform_decode_s

    spec = make_spec(max_decode_batch_size=8)  # a decode side that binds: the prediction decides
    requests = fixed_length_requests(
        input_tokens=2048, output_tokens=1000, num_requests=120, arrivals=ArrivalProcess(rate_per_s=8.0)
    )
    slo = Slo(ttft_s=30.0, tbt_s=0.03)
    t_d = uniform_decode_s((r.output_length for r in requests), slo.tbt_s)
    policy = predictive_early_rejection()
    default = replay(spec, iter(requests), admission=policy, slo=slo).records
    assert default == replay(spec, requests, admission=policy, slo=slo, decode_s=t_d).records
    predicted = replay(spec, requests, admission=policy, slo=slo, predictor=UniformDecodePredictor(decode_s=t_d))
    assert predicted.records == default
    assert replay(spec, requests, admission=policy, slo=slo, decode_s=1.0).records != default  # t_d matters here
    with pytest.raises(ConfigError, match="not both"):
        replay(spec, requests, decode_s=1.0, predictor=UniformDecodePredictor(decode_s=1.0))


def test_a_decode_node_judges_joins_by_its_join_model_and_takes_its_steps_time() -> None:
    """`join_step_model` is what a decode node's join check asks, `step_model` what its steps take (a real
    engine judges joins by the model it was configured with, whatever its speed: validate.py's twin): a
    request joining a busy node, which the slow steps would refuse for TBT, joins by the fast model, and the
    lone first one's intervals take the slow steps; without it the node refuses the second after its prefill,
    by the slow model, where the Conductor (fast) accepted it."""
    slow = FittedStepModel(coefficients=(0.01, 2e-4, 3e-7))
    slo = Slo(ttft_s=30.0, tbt_s=0.005)  # between the fast steps of two (2.5 ms) and the slow (11.6 ms)
    limits = DecodeLimits(kv_capacity_tokens=16_384, max_batch_size=8, max_context_tokens=2048)
    fast_spec = make_spec(prefill_model=FITTED_PREFILL, step_model=FITTED_STEP, decode_node_limits=limits)
    first = make_request("first", 1.0, 1500, 400, range(num_blocks(1500)))
    second = make_request("second", 1.5, 1500, 6, range(10**6, 10**6 + num_blocks(1500)))
    outcomes = {}
    for join in (FITTED_STEP, None):
        spec = attrs.evolve(fast_spec, step_model=slow, join_step_model=join)
        assert spec.decode_join_cost is (join or slow)
        records = DisaggregatedCluster(spec, build_conductor(fast_spec, slo=slo)).run([first, second]).records
        outcomes[join is not None] = [(record.outcome, record.reason) for record in records]
        assert np.isclose(records[0].intervals.values()[1], slow.step_s(1, 1501))  # the slow steps' time
    done = (Outcome.COMPLETED, None)
    assert outcomes == {True: [done, done], False: [done, (Outcome.REJECTED_AFTER_PREFILL, Reason.TBT_SLO)]}
