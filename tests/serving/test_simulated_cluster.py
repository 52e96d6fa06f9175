"""The example cluster's simulated twin: the workload scaled as load.py sends it, and the spec and Conductor
replay.py's `--config` builds from the cluster's own config.

Properties of `scaling.scale` over generated workloads and scalings: each scaled request is what the
cluster sees of its prompt (the tokenizer's ids, the hasher's keys of them, one per block), its prompt and
output within the caps; requests sharing leading workload blocks share that much prompt text. Examples:
bad scalings are ConfigErrors naming the option; `simulation.config_spec` and `config_conductor` take
the config's nodes, caches, block size, cost models and decode limits, the limits the gateway's
dispatcher registers its decode workers with; validate.py's `compare` computes its errors request by request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scaling
import simulation
from hypothesis import given
from hypothesis import strategies as st
from scaling import Scaling, prompt_of, scale
from serving.config import load_config
from serving.machine import Machine
from serving.models import cost_models, decode_limits, prefill_cache_blocks
from serving.tokenizer import ByteTokenizer

from mooncake.cache.hashing import BlockHasher
from mooncake.errors import ConfigError
from mooncake.sched.outcome import Outcome
from mooncake.sim.metrics import RequestRecord
from mooncake.types import InstanceId, Request, RequestId, Slo
from mooncake.workload import ArrivalProcess, generate_requests, preset

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"

scalings = st.builds(
    Scaling,
    length_scale=st.sampled_from([1 / 512, 1 / 64, 1 / 32, 1 / 8]),
    output_scale=st.sampled_from([1 / 64, 1 / 16, 1.0]),
    max_prompt_tokens=st.integers(min_value=1, max_value=2048),
    max_output_tokens=st.integers(min_value=1, max_value=64),
)


@given(
    st.sampled_from(["conversation", "synthetic", "toolagent"]),
    st.integers(0, 2**16),
    scalings,
    st.sampled_from([4, 16]),
)
def test_a_scaled_request_is_what_the_cluster_sees_of_its_prompt(
    name: str, seed: int, scaled_by: Scaling, block: int
) -> None:
    requests = list(generate_requests(preset(name), num_requests=5, arrivals=ArrivalProcess(rate_per_s=2.0), seed=seed))
    hasher = BlockHasher(model="tiny", block_size_tokens=block)
    encode = ByteTokenizer().encode
    for original, one in zip(requests, scale(requests, scaled_by, encode=encode, hasher=hasher), strict=True):
        seen = one.request
        # The module docstring's rule: the blocks' texts joined, cut to input × scale characters (at least 1,
        # at most the cap); the output scaled the same way.
        size = max(1, round(512 * scaled_by.length_scale))
        text = "".join(scaling.block_text(int(key), size) for key in original.block_keys)
        wanted = min(scaled_by.max_prompt_tokens, round(original.input_length * scaled_by.length_scale), len(text))
        assert one.prompt == text[: max(1, wanted)]
        assert (seen.request_id, seen.arrival_s) == (original.request_id, original.arrival_s)
        assert list(seen.tokens) == encode(one.prompt) and seen.input_length == len(encode(one.prompt))
        assert seen.block_keys == hasher.block_keys(encode(one.prompt)) and seen.block_size_tokens == block
        output = round(original.output_length * scaled_by.output_scale)
        assert seen.output_length == max(1, min(scaled_by.max_output_tokens, output))


@given(st.integers(1, 6), st.integers(0, 4), st.integers(0, 4), scalings)
def test_requests_sharing_blocks_share_that_much_prompt(shared: int, a: int, b: int, scaled_by: Scaling) -> None:
    """Two requests whose first `shared` workload blocks are the same have prompts that agree on those blocks'
    text (as far as both prompts reach)."""
    size = max(1, round(512 * scaled_by.length_scale))

    def request(name: str, extra: int, offset: int) -> Request:
        keys = [*range(shared), *range(offset, offset + extra)]
        return Request(
            request_id=RequestId(name),
            arrival_s=0.0,
            input_length=512 * len(keys),
            output_length=10,
            block_keys=keys,
            block_size_tokens=512,
        )

    first, second = prompt_of(request("a", a, 100), scaled_by), prompt_of(request("b", b, 200), scaled_by)
    common = min(shared * size, len(first), len(second))
    assert first[:common] == second[:common]
    assert first[: min(size, len(first))] == scaling.block_text(0, size)[: min(size, len(first))]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("length_scale", 0.0),
        ("output_scale", -1.0),
        ("max_prompt_tokens", 0),
        ("length_scale", float("nan")),
        ("length_scale", 10**400),  # past float's range: not an OverflowError
        ("max_prompt_tokens", 2.5),  # a count: a prompt cut at 2.5 characters would be a TypeError
        ("max_output_tokens", True),
    ],
)
def test_a_bad_scaling_names_its_option(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}"):
        Scaling(**{field: value})


def test_the_spec_and_conductor_are_the_configs() -> None:
    """Nodes, block size, cache per instance, the wait for decode room, the cost models and decode limits the
    cluster's Conductor uses (the dispatcher registers its decode workers with the same `decode_limits`)."""
    config = load_config(TINY, machine=Machine()).with_overrides("cache", ssd_blocks=128)
    spec = simulation.config_spec(config)
    prefill, step = cost_models(config)
    assert (spec.num_prefill, spec.num_decode) == (config.cluster.num_prefill, config.cluster.num_decode)
    assert spec.block_size_tokens == config.model.block_tokens
    assert spec.cache_capacity_tokens == (config.cache.dram_blocks + 128) * config.model.block_tokens
    assert (spec.prefill_cost, spec.decode_cost, spec.decode_limits) == (prefill, step, decode_limits(config))
    assert spec.admission_wait_s == config.limits.admission_wait_s > 0  # it waits for decode room as the gateway does
    conductor = simulation.config_conductor(config, spec)
    assert [v.instance_id for v in conductor.prefill_views] == [f"prefill-{i}" for i in range(spec.num_prefill)]
    assert [v.limits for v in conductor.decode_views] == [decode_limits(config)] * spec.num_decode
    assert conductor.slo.ttft_s == config.slo.ttft_s and conductor.block_size_tokens == config.model.block_tokens
    # The nodes hold as many blocks as the Conductor counts queued prompts' blocks to, the gateway's bound too.
    assert spec.prefill_cache_blocks == prefill_cache_blocks(config) == config.cache.dram_blocks + 128


def test_a_cpp_cluster_is_simulated_as_groups() -> None:
    """Its stages count as nodes, and without a profile its prefills are priced as a chunked pipeline of its
    stages (one process's analytic model, as before, ignored the group) by the gateway and the twin alike."""
    config = load_config(TINY, machine=Machine()).with_overrides("prefill", pipeline_size=2)
    spec = simulation.config_spec(config)
    assert (spec.num_prefill, spec.cpp_group_size, spec.num_prefill_instances) == (4, 2, 2)
    assert spec.cache_capacity_tokens * 2 == config.cache.dram_blocks * config.model.block_tokens
    odd = config.with_overrides("cache", dram_blocks=config.cache.dram_blocks + 1)  # not shared evenly by 2 stages
    assert simulation.config_spec(odd).prefill_cache_blocks == prefill_cache_blocks(odd)
    prefill, _ = cost_models(config)
    single, _ = cost_models(load_config(TINY, machine=Machine()))
    assert spec.prefill_cost == prefill and prefill != single
    tokens = 4 * config.prefill.chunk_tokens
    assert prefill.prefill_s(tokens) < single.prefill_s(tokens)  # four chunks pipelined over two stages


def record(name: str, ttft: float | None, tbt: float, route: tuple[str, str] | None, outcome: Outcome) -> RequestRecord:
    done = RequestRecord(request_id=RequestId(name), arrival_s=1.0, input_tokens=10, output_tokens=4)
    done.outcome, done.tbt_s = outcome, tbt
    done.first_token_s = None if ttft is None else 1.0 + ttft
    if route is not None:
        done.prefill_instance, done.decode_instance = (InstanceId(i) for i in route)
    return done


def test_compare_measures_the_simulation_against_the_real_run_request_by_request() -> None:
    """TTFT errors per request completed in both (median and p90), the error of the mean TBT, and the share of
    requests routed alike among those completed in both (a request the simulation rejected before prefill names
    the instance it chose, where it ran on none: it was counted as routed otherwise)."""
    validate = pytest.importorskip("validate")
    ok, rejected = Outcome.COMPLETED, Outcome.REJECTED_BEFORE_PREFILL
    a, b = ("prefill-0", "decode-0"), ("prefill-1", "decode-0")
    real = [
        record("1", 1.0, 0.010, a, ok),
        record("2", 2.0, 0.010, a, ok),
        record("3", 0.5, 0.0, None, rejected),
        record("4", 0.5, 0.010, a, ok),
    ]
    sim = [
        record("1", 1.5, 0.012, a, ok),
        record("2", 2.0, 0.014, b, ok),
        record("3", None, 0.0, b, rejected),
        record("4", None, 0.0, a, rejected),  # completed on a for real, rejected in the simulation
    ]
    result = validate.compare(
        real, sim, Slo(), 8, validate.Calibration(first_token_s=0.01, prefill_scale=1.0, step_s=0.002)
    )
    assert result.compared == 2
    assert result.ttft_median_rel_error == pytest.approx(0.25)  # errors 0.5 and 0
    assert result.tbt_mean_rel_error == pytest.approx(0.3)  # 13 ms against 10 ms
    assert result.same_route_fraction == pytest.approx(0.5)  # of 1 and 2: 3 and 4 did not complete in both
    assert (result.real.rejected, result.sim.rejected) == (1, 2)


def test_compare_groups_the_errors_by_output_and_prompt_length() -> None:
    """Per band of output (and of prompt) tokens, the requests completed in both: their count, the mean TBT
    of each run and the median signed TTFT error; bands no request falls in are left out."""
    validate = pytest.importorskip("validate")
    ok = Outcome.COMPLETED
    real, sim = [], []
    for name, output, prompt, ttft, tbt in (
        ("a", 2, 100, 1.0, 0.010),
        ("b", 3, 600, 2.0, 0.020),
        ("c", 50, 600, 1.0, 0.030),
    ):
        r, s = record(name, ttft, tbt, None, ok), record(name, ttft * 1.5, tbt * 2, None, ok)
        for done in (r, s):
            done.output_tokens, done.input_tokens = output, prompt
        real.append(r)
        sim.append(s)
    result = validate.compare(
        real, sim, Slo(), 8, validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0)
    )
    by_output = [(b.low, b.high, b.count) for b in result.by_output_tokens]
    assert by_output == [(1, 5, 2), (40, None, 1)]
    first = result.by_output_tokens[0]
    assert (first.tbt_real_s, first.tbt_sim_s, first.ttft_signed_error) == pytest.approx((0.015, 0.030, 0.5))
    assert [(b.low, b.high, b.count) for b in result.by_prompt_tokens] == [(1, 128, 1), (512, 1024, 2)]
    assert result.to_json()["by_prompt_tokens"][1]["count"] == 2


def streamed(intervals_ms: list[float]) -> RequestRecord:
    done = record("s", 0.01, 0.0, None, Outcome.COMPLETED)
    for interval in intervals_ms:
        done.intervals.add(interval / 1000, 0.0, 1)
    done.tbt_s = max(intervals_ms) / 1000 if intervals_ms else 0.0
    return done


@given(
    intervals=st.lists(st.floats(0.1, 50.0), min_size=1, max_size=40),
    jitter=st.lists(st.floats(-5.0, 20.0), min_size=1, max_size=20),
)
def test_observed_tbt_is_the_paper_metric_of_intervals_with_jitter(intervals: list[float], jitter: list[float]) -> None:
    """A simulated client's TBT lies between the metric of the intervals shifted by the smallest and by the
    largest delay (never below zero); a constant delay shifts the metric by exactly that delay."""
    validate = pytest.importorskip("validate")
    rng = np.random.default_rng(0)
    done = streamed(intervals)
    top = max(1, -(-len(intervals) // 10))
    bare = float(np.mean(sorted(intervals)[-top:])) / 1000
    seen = validate.observed_tbt(done, [j / 1000 for j in jitter], rng)
    low, high = (
        float(np.mean(sorted(max(0.0, i + j) for i in intervals)[-top:])) / 1000 for j in (min(jitter), max(jitter))
    )
    assert low - 1e-12 <= seen <= high + 1e-12
    shifted = validate.observed_tbt(done, [0.002], rng)
    assert shifted == pytest.approx(bare + 0.002)
    assert validate.observed_tbt(done, [], rng) == done.tbt_s  # no jitter measured: the simulated TBT


def merged_tbt_expected(intervals: list[float], sizes: list[int]) -> float:
    """The reference: over every way the tokens can come in events of sizes drawn uniformly from `sizes` (the
    last cut short at the last token), weighted by its chance, the paper's metric of the sums of the
    intervals between events (0 for one event)."""
    times = np.concatenate(([0.0], np.cumsum(intervals)))
    last = len(intervals)

    def ways(first: int) -> list[tuple[list[int], float]]:  # (the tokens events end at, chance) from `first` on
        found = []
        for size in sizes:
            end = first + size - 1
            if end >= last:
                found.append(([last], 1 / len(sizes)))
            else:
                found += [([end, *ends], chance / len(sizes)) for ends, chance in ways(end + 1)]
        return found

    expected = 0.0
    for ends, chance in ways(0):
        seen = np.diff(times[ends])
        top = -(-seen.size // 10)
        expected += chance * (float(np.mean(sorted(seen)[-top:])) if seen.size else 0.0)
    return expected


@given(
    intervals=st.lists(st.floats(0.1, 50.0), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_a_client_sees_merged_intervals_for_tokens_that_end_no_event(intervals: list[float], sizes: list[int]) -> None:
    """With no jitter, the observed TBT's expectation is the metric over the merged intervals, every way the
    tokens can come in events weighted by its chance (enumerated); 1,000 draws come within a tenth of the
    largest value it can take, their sum (six standard errors at most)."""
    validate = pytest.importorskip("validate")
    done = streamed(intervals)
    observed = validate.observed_tbt(done, [0.0], np.random.default_rng(0), sizes, draws=1000)
    expected = merged_tbt_expected(intervals, sizes)
    assert observed * 1000 == pytest.approx(expected, abs=0.1 * sum(intervals))


def test_the_last_token_always_ends_an_event() -> None:
    """The last token always ends an event: in events of four tokens, a 4-token answer comes in one event
    (no interval: TBT 0); in events of one, the metric is the plain one; in events of one or two, a merged
    interval is as likely as the enumeration says."""
    validate = pytest.importorskip("validate")
    done = streamed([1.0, 1.0, 3.0])
    assert validate.observed_tbt(done, [0.0], np.random.default_rng(0), [4]) == 0.0
    assert validate.observed_tbt(done, [0.0], np.random.default_rng(0), [1]) == pytest.approx(0.003)
    assert validate.observed_tbt(done, [0.0], np.random.default_rng(0), [2]) == pytest.approx(0.004)  # 1+3
    mixed = validate.observed_tbt(done, [0.0], np.random.default_rng(0), [1, 2], draws=20_000)
    assert mixed * 1000 == pytest.approx(merged_tbt_expected([1.0, 1.0, 3.0], [1, 2]), rel=0.03)


def test_event_excess_subtracts_the_steps_of_the_tokens_each_event_carried() -> None:
    """An event of n tokens is set against the profile's n steps at their contexts; the first event's tokens
    are those the later ones did not carry; events of no token are left out; without event tokens every
    event is one token."""
    validate = pytest.importorskip("validate")
    load = pytest.importorskip("load")
    _, step = cost_models(load_config(TINY))
    seen = load.ClientRecord(request_id=RequestId("r"), arrival_s=0.0, input_tokens=10, output_tokens=6)
    for interval in (0.010, 0.020, 0.0001):
        seen.intervals.add(interval, 0.0, 1)
    seen.event_tokens = [1, 3, 0]  # the first event carried 6 - 4 = 2 tokens: tokens 0 and 1
    excess, carried = validate.event_excess([seen], step)
    assert carried.tolist() == [1, 3]
    assert excess[0] == pytest.approx(0.010 - step.step_s(1, 12))
    assert excess[1] == pytest.approx(0.020 - sum(step.step_s(1, 10 + t) for t in (3, 4, 5)))
    seen.event_tokens = []
    excess, carried = validate.event_excess([seen], step)
    assert carried.tolist() == [1, 1, 1]
    assert excess[2] == pytest.approx(0.0001 - step.step_s(1, 10 + 6 - 3 + 2))


def test_compare_judges_the_simulated_tbt_as_a_client_sees_it() -> None:
    """With the calibration's jitter, compare's simulated TBT is the observed one, not the bare step."""
    validate = pytest.importorskip("validate")
    a = ("prefill-0", "decode-0")
    real = [record("s", 0.01, 0.003, a, Outcome.COMPLETED)]
    sim = [streamed([1.0] * 20)]
    sim[0].prefill_instance, sim[0].decode_instance = (InstanceId(i) for i in a)
    calm = validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0)
    jittery = validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0, jitter_s=(0.002,))
    assert validate.compare(real, sim, Slo(), 8, calm).sim.tbt_s["mean"] == pytest.approx(0.001)
    assert validate.compare(real, sim, Slo(), 8, jittery).tbt_mean_rel_error == pytest.approx(0.0)
    assert jittery.to_json()["jitter_s"] == {"intervals": 1, "p50": 0.002, "p90": 0.002, "p99": 0.002}
    assert jittery.to_json()["events_per_token"] == 1.0 and jittery.to_json()["event_sizes"] == {"1": 1}
    merging = validate.Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0, event_sizes=(1, 1, 2))
    assert merging.events_per_token == 0.75
