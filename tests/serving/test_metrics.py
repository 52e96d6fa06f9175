"""The gateway's metrics: vLLM's families under `mooncake:`, read back with prometheus_client's own parser.

Without a cluster: the bucket ladders reach their top (any top, a property test) and the config's request timeout;
a finished request counts once with the phases it reached; a scrape has no `_created` series, the inter-token
histogram under both of vLLM's names, and two gateways' metrics live side by side in one process.

On a real tiny cluster (2 prefill + 1 decode engine whose batch holds one request), one scenario: a greedy request
and the same prompt again with a stop string, a whole request and a streamed one sharing its prefix, a long stream
holding the decode engine while another request is refused (429), then abandoned by its client. The scrape, parsed
with `text_string_to_metric_families`, has vLLM's names and label sets (`model_name`, `engine`; never
`instance`), counts that match what the answers reported (finishes by reason, first tokens, prompt tokens, cache
hits, the rejection and its reason), duration buckets reaching the configured request timeout, and engine gauges
that follow the decode engine's batch and the workers' health answers.

Every wait is bounded (`wait_for` fails naming what it waited for); the cluster is closed by its context manager.
"""

from __future__ import annotations

import itertools
import math
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serving.config import load_config
from serving.metrics import (
    FINISH_REASONS,
    FinishedRequest,
    HistogramBounds,
    ServingMetrics,
    counted_finish_reason,
    latency_buckets,
    token_buckets,
)

from mooncake.errors import ConfigError
from tests.waiting import wait_for

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0  # the cluster's [limits] request_timeout_s: above any fixed top a registry might pick
ENGINES = {"prefill-0", "prefill-1", "decode-0"}
DURATIONS = (
    "mooncake:time_to_first_token_seconds",
    "mooncake:inter_token_latency_seconds",
    "mooncake:time_per_output_token_seconds",
    "mooncake:e2e_request_latency_seconds",
    "mooncake:request_queue_time_seconds",
    "mooncake:request_prefill_time_seconds",
    "mooncake:request_decode_time_seconds",
    "mooncake:request_inference_time_seconds",
)
FAMILIES = {  # name → (type, label names of its samples, less `le`)
    **{name: ("histogram", {"model_name", "engine"}) for name in DURATIONS},
    "mooncake:request_prompt_tokens": ("histogram", {"model_name", "engine"}),
    "mooncake:request_generation_tokens": ("histogram", {"model_name", "engine"}),
    "mooncake:request_max_num_generation_tokens": ("histogram", {"model_name", "engine"}),
    "mooncake:request_params_max_tokens": ("histogram", {"model_name", "engine"}),
    "mooncake:num_requests_running": ("gauge", {"model_name", "engine"}),
    "mooncake:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "mooncake:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "mooncake:gpu_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "mooncake:engine_up": ("gauge", {"model_name", "engine"}),
    "mooncake:num_requests_admission_waiting": ("gauge", {"model_name"}),
    "mooncake:prompt_tokens": ("counter", {"model_name", "engine"}),
    "mooncake:generation_tokens": ("counter", {"model_name", "engine"}),
    "mooncake:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "mooncake:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "mooncake:kv_transfer_bytes": ("counter", {"model_name", "engine", "kind"}),
    "mooncake:cache_index_gaps": ("counter", {"model_name", "engine"}),
    "mooncake:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "mooncake:request_rejected": ("counter", {"model_name", "reason"}),
    "mooncake:http_responses": ("counter", {"model_name", "status"}),
    "mooncake:connections_refused": ("counter", {"model_name", "status"}),
}

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name → (labels, value) of each series


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """A scrape as (family name → type, sample name → its series), through prometheus_client's parser."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels` (0 when there is none)."""
    return sum(v for series, v in samples.get(name, []) if labels.items() <= series.items())


def top_bucket(samples: Samples, histogram: str) -> float:
    """The largest finite bucket bound of a histogram's series."""
    return max(float(labels["le"]) for labels, _ in samples[f"{histogram}_bucket"] if labels["le"] != "+Inf")


# ---------------------------------------------------------------------------------------------- without a cluster


@settings(max_examples=100, deadline=None)
@given(top=st.floats(min_value=1e-4, max_value=86_400.0), smallest=st.sampled_from([1e-9, 1e-3, 1e-2, 0.25]))
def test_latency_buckets_climb_to_the_first_rung_at_or_above_the_top(top: float, smallest: float) -> None:
    """Strictly increasing 1-2.5-5 rungs from `smallest`; the last is at or above the top, the one before below."""
    buckets = latency_buckets(top, smallest_s=smallest)
    assert buckets[0] == smallest
    assert all(a < b for a, b in itertools.pairwise(buckets))
    assert buckets[-1] >= top and (len(buckets) == 1 or buckets[-2] < top)
    for bound in buckets:
        rung = bound / smallest
        mantissa = rung / 10 ** math.floor(math.log10(rung) + 1e-9)
        assert any(math.isclose(mantissa, m) for m in (1.0, 2.5, 5.0)), bound


@settings(max_examples=100, deadline=None)
@given(top=st.integers(min_value=1, max_value=10**7))
def test_token_buckets_are_vllms_one_two_five_up_to_the_top(top: int) -> None:
    buckets = token_buckets(top)
    assert buckets[:3] == (1, 2, 5)[: len(buckets)]
    assert buckets[-1] >= top and (len(buckets) == 1 or buckets[-2] < top)
    assert all(a < b for a, b in itertools.pairwise(buckets))


def test_bad_bucket_tops_are_config_errors() -> None:
    for top in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            latency_buckets(top)
    with pytest.raises(ConfigError):
        token_buckets(0)


def test_bounds_come_from_the_config() -> None:
    """The buckets of waits reach the request timeout (not a fixed 30 s), those of whole requests vLLM's 7,680 s or
    the timeout if longer (a request whose tokens keep coming has no deadline), the token buckets the prompt limit
    and the longest output a decode slot leaves room for (beside a one-token prompt)."""
    config = load_config(TINY).with_overrides("limits", request_timeout_s=600.0, max_prompt_tokens=1000)
    bounds = HistogramBounds.from_config(config)
    assert bounds == HistogramBounds(
        longest_request_s=7680.0,
        longest_wait_s=600.0,
        max_prompt_tokens=1000,
        max_output_tokens=config.decode.max_context_tokens - 1,
    )
    assert bounds.latency[-1] >= 600.0 > bounds.latency[-2]
    assert bounds.duration[-1] >= 7680.0 > bounds.duration[-2]
    long_wait = HistogramBounds.from_config(config.with_overrides("limits", request_timeout_s=10_000.0))
    assert long_wait.duration[-1] >= 10_000.0 > long_wait.duration[-2]
    assert bounds.prompt_tokens[-1] >= 1000 and bounds.output_tokens[-1] >= bounds.max_output_tokens


def scrape(metrics: ServingMetrics) -> tuple[dict[str, str], Samples]:
    return parse(metrics.render().decode())


def small_metrics() -> ServingMetrics:
    bounds = HistogramBounds(longest_request_s=60.0, max_prompt_tokens=100, max_output_tokens=100)
    return ServingMetrics(model_name="m", bounds=bounds, prefill_engines=["p"], decode_engines=["d"])


def test_a_finished_request_counts_once_with_the_phases_it_reached() -> None:
    """A whole request observes every end histogram once on its engines; one aborted before its prefill began
    counts its finish and end-to-end latency only."""
    metrics = small_metrics()
    whole = FinishedRequest(
        prefill_engine="p",
        decode_engine="d",
        finished_reason="length",
        arrival_s=1.0,
        prefill_started_s=1.5,
        prefill_done_s=2.0,
        first_token_s=2.5,
        last_token_s=4.0,
        end_s=4.0,
        prompt_tokens=30,
        generation_tokens=4,
        max_tokens=4,
    )
    metrics.finished(whole)
    unstarted = attrs.evolve(
        whole,
        finished_reason="abort",
        prefill_started_s=None,
        prefill_done_s=None,
        first_token_s=None,
        last_token_s=None,
        generation_tokens=0,
    )
    metrics.finished(unstarted)
    _types, samples = scrape(metrics)
    assert value(samples, "mooncake:request_success_total", engine="d", finished_reason="length") == 1
    assert value(samples, "mooncake:request_success_total", engine="d", finished_reason="abort") == 1
    assert value(samples, "mooncake:e2e_request_latency_seconds_count", engine="d") == 2
    assert value(samples, "mooncake:e2e_request_latency_seconds_sum", engine="d") == 3.0 + 3.0
    for name, engine, total in (
        ("request_queue_time_seconds", "p", 0.5),
        ("request_prefill_time_seconds", "p", 0.5),
        ("request_decode_time_seconds", "d", 1.5),
        ("request_inference_time_seconds", "d", 2.5),
    ):
        assert value(samples, f"mooncake:{name}_count", engine=engine) == 1, name
        assert value(samples, f"mooncake:{name}_sum", engine=engine) == total, name
    assert value(samples, "mooncake:request_prompt_tokens_sum", engine="p") == 60
    assert value(samples, "mooncake:request_max_num_generation_tokens_sum", engine="d") == 8


def test_a_scrape_is_vllms_shape() -> None:
    """Every family of the table is there with its type and labels from the start (engine series at zero, every
    finish reason), no `_created` series, no `instance` label, and the inter-token histogram, the KV usage and
    the max_tokens histogram under vLLM's older names too, sample for sample."""
    metrics = small_metrics()
    for gap in (0.002, 0.02, 0.2):
        metrics.itl["d"].observe(gap)
    metrics.set_kv_usage("d", 0.5)
    types, samples = scrape(metrics)
    assert types == {name: kind for name, (kind, _) in FAMILIES.items()}
    assert not [name for name in samples if name.endswith("_created")]
    for name, series in samples.items():
        for labels, _ in series:
            assert "instance" not in labels and labels["model_name"] == "m", (name, labels)
    assert {labels["finished_reason"] for labels, _ in samples["mooncake:request_success_total"]} == set(FINISH_REASONS)
    assert value(samples, "mooncake:num_requests_running", engine="p") == 0
    assert value(samples, "mooncake:engine_up", engine="d") == 1
    for name, alias, suffixes in (
        ("inter_token_latency_seconds", "time_per_output_token_seconds", ("_bucket", "_count", "_sum")),
        ("request_max_num_generation_tokens", "request_params_max_tokens", ("_bucket", "_count", "_sum")),
        ("kv_cache_usage_perc", "gpu_cache_usage_perc", ("",)),
    ):
        for suffix in suffixes:
            assert samples[f"mooncake:{alias}{suffix}"] == samples[f"mooncake:{name}{suffix}"]
    assert value(samples, "mooncake:inter_token_latency_seconds_count") == 3
    assert value(samples, "mooncake:gpu_cache_usage_perc", engine="d") == 0.5


def test_two_gateways_in_one_process_keep_their_own_metrics() -> None:
    """Each has its registries: a second is made without a duplicate-series error and counts apart."""
    first, second = small_metrics(), small_metrics()
    first.rejections["ttft_slo"].inc()
    assert value(scrape(first)[1], "mooncake:request_rejected_total") == 1
    assert value(scrape(second)[1], "mooncake:request_rejected_total") == 0


def test_kv_usage_is_a_fraction() -> None:
    metrics = small_metrics()
    for reported, shown in ((0.25, 0.25), (1.5, 1.0), (-0.1, 0.0)):
        metrics.set_kv_usage("d", reported)
        assert value(scrape(metrics)[1], "mooncake:kv_cache_usage_perc", engine="d") == shown


# ---------------------------------------------------------------------------------------------- on a real cluster

pytest.importorskip("torch")
pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from serving.launch import RunningCluster, start_cluster  # noqa: E402


def http_metrics(cluster: RunningCluster) -> tuple[dict[str, str], Samples]:
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=TIMEOUT_S) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
        return parse(answer.read().decode())


def decoding(cluster: RunningCluster) -> tuple[int, ...]:
    return cluster.gateway.dispatcher.health("decode-0").active


@attrs.frozen(kw_only=True)
class Scenario:
    """What the scenario's clients saw, and the scrapes: while the long stream held the decode engine, and at the
    end (every request ended, the workers' health probed since)."""

    cluster: RunningCluster
    answers: dict[str, Any]  # name → the answer's usage (A, B, C, D) or prompt (E)
    rejection: Any  # the 429's error body
    holding: Samples
    final: Samples
    types: dict[str, str]


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=2, num_decode=1)
    config = config.with_overrides("decode", max_batch_size=1, max_context_tokens=4096)
    config = config.with_overrides(
        "limits",
        max_prompt_tokens=256,
        default_max_tokens=16,
        request_timeout_s=REQUEST_TIMEOUT_S,
        admission_wait_s=0.0,  # F is refused at once, not held until E's slot frees
    )
    with start_cluster(config) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        answers: dict[str, Any] = {}
        # D: greedy text; C: the same prompt, stopped at a string of that text (a "stop" finish; cached prefix).
        prompt = f"{uuid.uuid4()} Stop me when you can."
        greedy = api.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0)
        answers["D"] = greedy.usage
        text = greedy.choices[0].text
        k = next(i for i in range(1, len(text) - 2) if text.find(text[i : i + 2]) == i)
        stopped = api.completions.create(
            model="tiny", prompt=prompt, max_tokens=64, temperature=0, stop=text[k : k + 2]
        )
        assert stopped.choices[0].finish_reason == "stop"
        answers["C"] = stopped.usage
        wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the stopped request to leave the batch")
        # A whole request, then a stream sharing its prefix (a prefix cache hit).
        prefix = f"{uuid.uuid4()} " + "Prefill computes the KV cache once; decode reuses it. " * 2
        answers["A"] = api.completions.create(model="tiny", prompt=prefix + "First.", max_tokens=8).usage
        chunks = list(
            api.completions.create(
                model="tiny",
                prompt=prefix + "Second.",
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        answers["B"] = chunks[-1].usage
        # E holds the decode engine's only slot; F is refused meanwhile; E's client then leaves.
        holder = f"{uuid.uuid4()} Hold the batch."
        answers["E"] = holder
        with api.completions.create(model="tiny", prompt=holder, max_tokens=3800, stream=True) as stream:
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as refused:
                api.completions.create(model="tiny", prompt="Is there room?", max_tokens=200)
            holding: Samples = {}

            def probed_while_holding() -> bool:
                nonlocal holding
                holding = http_metrics(cluster)[1]
                return value(holding, "mooncake:kv_cache_usage_perc", engine="decode-0") > 0

            wait_for(probed_while_holding, timeout=20.0, what="a health probe of the busy decode engine")
        wait_for(lambda: not cluster.gateway.dispatcher.live, timeout=20.0, what="the gateway to end the stream")
        wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the abandoned stream to leave the batch")
        final: Samples = {}
        types: dict[str, str] = {}

        def probed_when_idle() -> bool:
            nonlocal final, types
            types, final = http_metrics(cluster)
            idle = value(final, "mooncake:kv_cache_usage_perc", engine="decode-0") == 0
            cached = max(value(final, "mooncake:kv_cache_usage_perc", engine=e) for e in ("prefill-0", "prefill-1"))
            return idle and cached > 0

        wait_for(probed_when_idle, timeout=20.0, what="health probes of the idle engines")
        yield Scenario(
            cluster=cluster,
            answers=answers,
            rejection=refused.value.body,
            holding=holding,
            final=final,
            types=types,
        )


def test_the_scrape_has_vllms_names_and_label_sets(scenario: Scenario) -> None:
    """Every family with its type; every sample labelled with the served model and, where per engine, a worker's
    instance id; no `instance` label anywhere."""
    assert scenario.types == {name: kind for name, (kind, _) in FAMILIES.items()}
    for name, series in scenario.final.items():
        family = max((f for f in FAMILIES if name.startswith(f)), key=len)
        for labels, _ in series:
            assert set(labels) - {"le"} == FAMILIES[family][1], (name, labels)
            assert labels["model_name"] == "tiny"
            assert labels.get("engine", "prefill-0") in ENGINES, (name, labels)


def test_finishes_and_first_tokens_count_the_requests(scenario: Scenario) -> None:
    """Three ran to max_tokens, one hit its stop string, one was abandoned: five first tokens, five ends."""
    final = scenario.final
    success = "mooncake:request_success_total"
    assert value(final, success, finished_reason="length") == 3
    assert value(final, success, finished_reason="stop") == 1
    assert value(final, success, finished_reason="abort") == 1
    assert value(final, success, finished_reason="error") == 0
    assert value(final, success) == value(final, success, engine="decode-0")
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_decode_time"):
        assert value(final, f"mooncake:{histogram}_seconds_count") == 5, histogram
    assert value(final, "mooncake:http_responses_total", status="200") == 5
    usage = scenario.answers
    whole_gaps = usage["A"].completion_tokens + usage["B"].completion_tokens + usage["D"].completion_tokens - 3
    itl = value(final, "mooncake:inter_token_latency_seconds_count")
    assert itl >= whole_gaps + usage["C"].completion_tokens - 1
    assert itl == value(final, "mooncake:time_per_output_token_seconds_count")
    generated = value(final, "mooncake:generation_tokens_total")
    assert generated >= whole_gaps + 3 + usage["C"].completion_tokens + 1
    assert itl <= generated - 5  # each request's first token starts its gaps


def test_prompt_tokens_and_prefix_hits_are_what_the_answers_reported(scenario: Scenario) -> None:
    """Prompt tokens sum the prompts prefilled (the answers' usage, and the abandoned stream's bytes); queries
    count the same tokens; hits are the cached tokens the answers reported, more than none after a shared prefix."""
    final, answers = scenario.final, scenario.answers
    usages = [answers[name] for name in "ABCD"]
    prompts = sum(u.prompt_tokens for u in usages) + len(answers["E"].encode())
    assert value(final, "mooncake:prompt_tokens_total") == prompts
    assert value(final, "mooncake:prefix_cache_queries_total") == prompts
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert answers["B"].prompt_tokens_details.cached_tokens > 0
    assert value(final, "mooncake:prefix_cache_hits_total") == cached > 0
    assert value(final, "mooncake:kv_transfer_bytes_total", kind="push") > 0
    assert value(final, "mooncake:request_prompt_tokens_count") == 5


def test_a_rejection_counts_by_its_reason(scenario: Scenario) -> None:
    """The refused request counts once, under the reason its 429 named; it reached no engine (its body says
    so: rejected before prefill)."""
    final, reason = scenario.final, scenario.rejection["code"]
    assert scenario.rejection["outcome"] == "rejected_before_prefill"
    assert value(final, "mooncake:request_rejected_total") == 1
    assert value(final, "mooncake:request_rejected_total", reason=reason) == 1
    assert value(final, "mooncake:http_responses_total", status="429") == 1


def test_duration_buckets_reach_the_request_timeout(scenario: Scenario) -> None:
    for histogram in DURATIONS:
        assert top_bucket(scenario.final, histogram) >= REQUEST_TIMEOUT_S, histogram
    assert top_bucket(scenario.final, "mooncake:request_prompt_tokens") >= 256


def test_engine_gauges_follow_the_batch_and_the_health_answers(scenario: Scenario) -> None:
    """While the stream held the decode engine: one request running there, its KV in use; at the end nothing runs
    or waits anywhere, the decode engine's KV is free and a prefill engine's cache holds the prompts' blocks."""
    holding, final = scenario.holding, scenario.final
    assert value(holding, "mooncake:num_requests_running", engine="decode-0") == 1
    assert 0 < value(holding, "mooncake:kv_cache_usage_perc", engine="decode-0") <= 1
    for engine in ENGINES:
        assert value(final, "mooncake:engine_up", engine=engine) == 1
        assert value(final, "mooncake:num_requests_running", engine=engine) == 0
        assert value(final, "mooncake:num_requests_waiting", engine=engine) == 0
        assert 0 <= value(final, "mooncake:kv_cache_usage_perc", engine=engine) <= 1


def test_an_answers_finish_reason_is_counted_as_vllms_engine_counts_it() -> None:
    """One table for the gateway and the vLLM router: vLLM's five reasons (`FINISH_REASON_STRINGS`, "repetition"
    included, which a vLLM server behind the router may give) count as themselves, a chat's `tool_calls` (and the
    older `function_call`) as the engine's "stop", and one no table knows as "length"."""
    assert FINISH_REASONS == ("stop", "length", "abort", "error", "repetition")
    assert [counted_finish_reason(reason) for reason in FINISH_REASONS] == list(FINISH_REASONS)
    assert counted_finish_reason("tool_calls") == counted_finish_reason("function_call") == "stop"
    assert counted_finish_reason(None) == counted_finish_reason("something_new") == "length"
