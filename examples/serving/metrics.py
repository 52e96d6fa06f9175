"""The gateway's metrics, in vLLM's shape on `prometheus_client`: every metric the cluster serves is named here.

Names, kinds, labels and meanings follow vLLM v1's Prometheus logger with the
prefix `mooncake:` for `vllm:`, so a vLLM dashboard works after that one
change. Every series has the label `model_name` (the served model); those of
an engine have `engine` too (a worker's instance id, "prefill-0"). A
request's queue, prefill and first-token times and its prompt tokens count on
its prefill engine; its inter-token, decode and end-to-end times, its
generated tokens and its finish on its decode engine. There is never an
`instance` label: Prometheus gives that one to the scrape target. Beyond
vLLM's families, under the same prefix: `request_rejected{reason}`,
`http_responses{status}`, `kv_transfer_bytes{kind}`, `engine_up` and
`cache_index_gaps`.

Buckets: a wait for a token lasts at most `[limits] request_timeout_s` (the
gateway answers 504 then), so the histograms of waits (time to first token,
between tokens, queue, prefill) are a 1-2.5-5 ladder from 1 ms up to the first
rung at or above that timeout; a whole request whose tokens keep coming has no
bound, so those of whole requests (end to end, decode, inference) climb the same
ladder to vLLM's top bucket for them, 7,680 s (or the timeout, if longer); the
token-count histograms are
vLLM's 1-2-5 ladder up to the first rung at or above the prompt limit and the
longest output a decode slot leaves room for.

Cost on the hot path: an engine's series of a family is looked up once and
kept (`_Series`; `labels()` takes a lock and builds a dict), a decode report
counts its tokens with one increment, and inter-token latency is one
observation per token, as vLLM observes each request once per step. A scrape
(`render`) leaves out the `_created` series (vLLM turns them off too) and
shows three families a second time under the older names vLLM still emits
and its example dashboard queries (`ALIASES`: `time_per_output_token_seconds`,
`gpu_cache_usage_perc`, `request_params_max_tokens`), at no cost before then.
Each gateway has registries of its own: several clusters may share a process.

Invariants: a request that ends counts once in `request_success` (or, refused,
in `request_rejected`), with one observation in each end histogram of the
phases it reached; every finite bucket bound of a duration histogram below
its largest is below the request timeout, and the largest is at or above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from mooncake.errors import ConfigError
from serving.config import ClusterConfig

__all__ = [
    "CONTENT_TYPE",
    "FINISH_REASONS",
    "counted_finish_reason",
    "PREFIX",
    "FinishedRequest",
    "HistogramBounds",
    "ServingMetrics",
    "latency_buckets",
    "token_buckets",
]

PREFIX = "mooncake:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the format `generate_latest` writes
# vLLM's finish reasons (`FINISH_REASON_STRINGS`): this gateway's engines never end one for repetition, a vLLM
# server behind the vLLM router may.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# An answer's `finish_reason` as vLLM's engine counts it in `vllm:request_success` (`FinishReason`): the chat layer
# answers `tool_calls` for the engine's STOP when tools were called (older clients: `function_call`).
_COUNTED_AS = {reason: reason for reason in FINISH_REASONS} | {"tool_calls": "stop", "function_call": "stop"}
SMALLEST_LATENCY_S = 0.001
LONGEST_REQUEST_S = 7680.0  # vLLM's top bucket of its end-to-end latency histogram
# Families shown a second time under the names vLLM's own dashboards still query (vLLM emits both too).
ALIASES = {
    f"{PREFIX}inter_token_latency_seconds": f"{PREFIX}time_per_output_token_seconds",
    f"{PREFIX}kv_cache_usage_perc": f"{PREFIX}gpu_cache_usage_perc",
    f"{PREFIX}request_max_num_generation_tokens": f"{PREFIX}request_params_max_tokens",
}


def _ladder(mantissas: tuple[float, ...], smallest: float, top: float) -> tuple[float, ...]:
    """mantissa × 10^k for k = 0, 1, ... times `smallest`, from `smallest` up to the first value >= `top`."""
    bounds: list[float] = []
    scale = smallest
    while True:
        for mantissa in mantissas:
            value = float(f"{mantissa * scale:.12g}")  # 0.0025, not 0.0025000000000000005
            bounds.append(value)
            if value >= top:
                return tuple(bounds)
        scale *= 10


def latency_buckets(top_s: float, *, smallest_s: float = SMALLEST_LATENCY_S) -> tuple[float, ...]:
    """Bucket bounds for a duration: 1, 2.5, 5 × 10^k × `smallest_s`, the last the first at or above `top_s`.

    Raises:
        ConfigError: `top_s` or `smallest_s` is not a positive finite number.
    """
    if not (0 < smallest_s < float("inf") and 0 < top_s < float("inf")):
        raise ConfigError(f"latency buckets need positive finite bounds (smallest {smallest_s!r}, top {top_s!r})")
    return _ladder((1.0, 2.5, 5.0), smallest_s, top_s)


def token_buckets(top: int) -> tuple[float, ...]:
    """Bucket bounds for a token count: 1, 2, 5 × 10^k, the last the first at or above `top` (vLLM's 1-2-5).

    Raises:
        ConfigError: `top` is below 1.
    """
    if top < 1:
        raise ConfigError(f"token buckets need a top of at least 1, got {top}")
    return _ladder((1.0, 2.0, 5.0), 1.0, top)


@attrs.frozen(kw_only=True)
class HistogramBounds:
    """The largest values the histograms must hold: the longest request, the longest wait within one (None: the
    request's), and the longest prompt and output."""

    longest_request_s: float
    max_prompt_tokens: int
    max_output_tokens: int
    longest_wait_s: float | None = None

    @classmethod
    def from_config(cls, config: ClusterConfig) -> HistogramBounds:
        """A cluster's: the gateway ends a request that waits `[limits] request_timeout_s` for a token, and one
        whose tokens keep coming runs on (vLLM's top bucket, if the timeout is shorter); a prompt holds at most
        `[limits] max_prompt_tokens`, an output what a decode slot's context has left."""
        limits = config.limits
        return cls(
            longest_request_s=max(limits.request_timeout_s, LONGEST_REQUEST_S),
            longest_wait_s=limits.request_timeout_s,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_output_tokens=config.max_output_tokens,
        )

    @property
    def latency(self) -> tuple[float, ...]:
        """Buckets of a wait within a request (to its first token, between tokens, in the queue, the prefill)."""
        return latency_buckets(self.longest_request_s if self.longest_wait_s is None else self.longest_wait_s)

    @property
    def duration(self) -> tuple[float, ...]:
        """Buckets of a whole request, or of its decode or inference."""
        return latency_buckets(self.longest_request_s)

    @property
    def prompt_tokens(self) -> tuple[float, ...]:
        return token_buckets(self.max_prompt_tokens)

    @property
    def output_tokens(self) -> tuple[float, ...]:
        return token_buckets(self.max_output_tokens)


def counted_finish_reason(answered: str | None) -> str:
    """The one of `FINISH_REASONS` an answer's `finish_reason` is counted as (vLLM's engine's reason for it); one
    no table knows (None, a newer server's) as "length", the reason of an answer cut short."""
    return _COUNTED_AS.get(answered or "", "length")


@attrs.frozen(kw_only=True)
class FinishedRequest:
    """One request's end as the metrics count it: times in seconds on one clock, None for a phase not reached.

    `finished_reason` is one of `FINISH_REASONS`: "stop" (a stop string or a stop id such as EOS), "length"
    (max_tokens), "abort" (its client left or it waited too long for a token), "error" (an engine failed it),
    "repetition" (a vLLM server behind the router found a repeating pattern; `counted_finish_reason`).
    """

    prefill_engine: str
    decode_engine: str
    finished_reason: str
    arrival_s: float
    prefill_started_s: float | None
    prefill_done_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    end_s: float
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int


M = TypeVar("M", Counter, Gauge, Histogram)


class _Series(Generic[M]):
    """A family's series by label values after `model_name` (an engine, or a tuple), each made on first use and
    kept: `labels()` takes a lock and builds a dict."""

    def __init__(self, family: M, model_name: str) -> None:
        self._family: M = family
        self._model_name = model_name
        self._series: dict[str | tuple[str, ...], M] = {}

    def __getitem__(self, values: str | tuple[str, ...]) -> M:
        series = self._series.get(values)
        if series is None:
            labels = (values,) if isinstance(values, str) else values
            series = self._series[values] = self._family.labels(self._model_name, *labels)
        return series


class ServingMetrics:
    """The metric families of one gateway, on a registry of their own (several clusters may share a process).

    Args:
        model_name: the served model's name (the `model_name` label).
        bounds: the largest values the histograms hold.
        prefill_engines, decode_engines: the engines whose series exist from the start (at zero, as vLLM makes
            them); others are made when first used.
    """

    def __init__(
        self,
        *,
        model_name: str,
        bounds: HistogramBounds,
        prefill_engines: Iterable[str] = (),
        decode_engines: Iterable[str] = (),
    ) -> None:
        self.model_name = model_name
        self.bounds = bounds
        source = CollectorRegistry(auto_describe=True)
        self.registry = CollectorRegistry(auto_describe=False)
        """What a scrape reads (`render`, or `registry.get_sample_value` in tests)."""
        self.registry.register(_Exposed(source))

        def series(kind: type[M], name: str, doc: str, *labels: str, **options: Any) -> _Series[M]:
            return _Series(kind(PREFIX + name, doc, ("model_name", *labels), registry=source, **options), model_name)

        latency, duration, engine = bounds.latency, bounds.duration, "engine"
        # Engine state (vLLM's scheduler state and KV cache).
        self.running = series(Gauge, "num_requests_running", "Requests an engine is prefilling or decoding.", engine)
        self.waiting = series(Gauge, "num_requests_waiting", "Requests sent to an engine, not started yet.", engine)
        self.kv_usage = series(
            Gauge,
            "kv_cache_usage_perc",
            "KV-cache usage, 1 = 100 percent: the share of a decode engine's KV budget its batch reserves, "
            "of a prefill engine's cache pages in use.",
            engine,
        )
        self.up = series(Gauge, "engine_up", "1 while the engine is up, 0 while the gateway holds it down.", engine)
        self.connections_refused = series(
            Counter,
            "connections_refused",
            "Client connections refused before a request was read: 429 over a client's share "
            "([limits] max_connections_per_client), 503 over the total (max_connections).",
            "status",
        )
        for status in ("429", "503"):
            self.connections_refused[status]  # at zero from the start
        self.admission_waiting = series(
            Gauge,
            "num_requests_admission_waiting",
            "Requests the gateway holds before their prefill until the decode side has room ([limits] admission_wait_s).",
        )[()]
        # Tokens (vLLM's counters count tokens).
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prompt tokens prefilled (cached ones included).", engine)
        self.prefix_queries = series(
            Counter, "prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.", engine
        )
        self.prefix_hits = series(Counter, "prefix_cache_hits", "Prefix cache hits, in cached prompt tokens.", engine)
        self.generation_tokens = series(
            Counter, "generation_tokens", "Tokens generated (for requests still served or not).", engine
        )
        self.transfer_bytes = series(
            Counter,
            "kv_transfer_bytes",
            "KV bytes a prefill engine moved: fetched from a peer's cache (kind=fetch), "
            "streamed to the decode engine (kind=push).",
            engine,
            "kind",
        )
        self.index_gaps = series(
            Counter, "cache_index_gaps", "Cache events from an engine that arrived out of sequence.", engine
        )
        # Requests.
        self.success = series(
            Counter,
            "request_success",
            "Requests finished, by finished_reason (stop, length, abort, error, repetition).",
            engine,
            "finished_reason",
        )
        self.rejections = series(
            Counter,
            "request_rejected",
            "Requests the scheduler refused, by reason (the Conductor's, decode_<the decode engine's>).",
            "reason",
        )
        self.responses = series(
            Counter, "http_responses", "Answers to completion requests by HTTP status (a stream is a 200).", "status"
        )
        self.ttft = series(
            Histogram, "time_to_first_token_seconds", "Time to first token in seconds.", engine, buckets=latency
        )
        self.itl = series(
            Histogram, "inter_token_latency_seconds", "Time between tokens in seconds.", engine, buckets=latency
        )
        self.e2e = series(
            Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.", engine, buckets=duration
        )
        self.queue = series(
            Histogram,
            "request_queue_time_seconds",
            "Seconds from arrival to the prefill's start.",
            engine,
            buckets=latency,
        )
        self.prefill = series(
            Histogram, "request_prefill_time_seconds", "Seconds the prefill took.", engine, buckets=latency
        )
        self.decode = series(
            Histogram,
            "request_decode_time_seconds",
            "Seconds from the first token to the last.",
            engine,
            buckets=duration,
        )
        self.inference = series(
            Histogram,
            "request_inference_time_seconds",
            "Seconds from the prefill's start to the last token.",
            engine,
            buckets=duration,
        )
        self.request_prompt_tokens = series(
            Histogram,
            "request_prompt_tokens",
            "Prompt tokens per finished request.",
            engine,
            buckets=bounds.prompt_tokens,
        )
        self.request_generation_tokens = series(
            Histogram,
            "request_generation_tokens",
            "Generated tokens per finished request.",
            engine,
            buckets=bounds.output_tokens,
        )
        self.request_max_tokens = series(
            Histogram,
            "request_max_num_generation_tokens",
            "The max_tokens a finished request asked for.",
            engine,
            buckets=bounds.output_tokens,
        )
        prefill_side: tuple[_Series[Any], ...] = (
            self.prompt_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.ttft,
            self.queue,
            self.prefill,
            self.request_prompt_tokens,
        )
        decode_side: tuple[_Series[Any], ...] = (
            self.generation_tokens,
            self.itl,
            self.e2e,
            self.decode,
            self.inference,
            self.request_generation_tokens,
            self.request_max_tokens,
        )
        for name in prefill_engines:
            self._make(name, prefill_side)
            for kind in ("fetch", "push"):
                self.transfer_bytes[name, kind]
        for name in decode_engines:
            self._make(name, decode_side)
            for reason in FINISH_REASONS:
                self.success[name, reason]

    @classmethod
    def for_config(cls, config: ClusterConfig, workers: Iterable[Mapping[str, Any]] = ()) -> ServingMetrics:
        """The metrics of a cluster of `config` serving its preset, with these workers' series made at zero
        (`workers`: their `start()` info, with instance id and role)."""
        workers = list(workers)
        return cls(
            model_name=config.model.served_name,
            bounds=HistogramBounds.from_config(config),
            prefill_engines=[w["instance_id"] for w in workers if w["role"] == "prefill"],
            decode_engines=[w["instance_id"] for w in workers if w["role"] != "prefill"],
        )

    def _make(self, engine: str, families: tuple[_Series[Any], ...]) -> None:
        self.up[engine].set(1)
        every: tuple[_Series[Any], ...] = (self.running, self.waiting, self.kv_usage, self.index_gaps, *families)
        for family in every:
            family[engine]  # made now: at zero until used

    # ------------------------------------------------------------------ what the dispatcher and gateway report

    def prefilled(
        self,
        engine: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        fetched_bytes: int,
        pushed_bytes: int,
        looked_up: bool = True,
    ) -> None:
        """A prefill `engine` finished: its prompt, the part its cache held and the KV bytes it moved. `looked_up`:
        its cache was asked for the prompt's prefix; a prefill that reuses none (`types.prefix_reusable`: one
        scoring its prompt) counts no query, as vLLM's prefix-cache stats skip such a request."""
        self.prompt_tokens[engine].inc(prompt_tokens)
        if looked_up:
            self.prefix_queries[engine].inc(prompt_tokens)
            self.prefix_hits[engine].inc(cached_tokens)
        self.transfer_bytes[engine, "fetch"].inc(fetched_bytes)
        self.transfer_bytes[engine, "push"].inc(pushed_bytes)

    def finished(self, request: FinishedRequest) -> None:
        """A request ended: its finish reason and the durations of the phases it reached."""
        prefill, decode = request.prefill_engine, request.decode_engine
        self.success[decode, request.finished_reason].inc()
        self.e2e[decode].observe(request.end_s - request.arrival_s)
        self.request_prompt_tokens[prefill].observe(request.prompt_tokens)
        self.request_generation_tokens[decode].observe(request.generation_tokens)
        self.request_max_tokens[decode].observe(request.max_tokens)
        started = request.prefill_started_s
        if started is not None:
            self.queue[prefill].observe(started - request.arrival_s)
            if request.prefill_done_s is not None:
                self.prefill[prefill].observe(request.prefill_done_s - started)
        if request.first_token_s is not None and request.last_token_s is not None:
            self.decode[decode].observe(request.last_token_s - request.first_token_s)
            if started is not None:
                self.inference[decode].observe(request.last_token_s - started)

    def set_engine(self, engine: str, *, up: bool, running: int, waiting: int) -> None:
        """An engine's state as the gateway knows it (at each scrape)."""
        self.up[engine].set(1 if up else 0)
        self.running[engine].set(running)
        self.waiting[engine].set(waiting)

    def set_kv_usage(self, engine: str, usage: float) -> None:
        """An engine's KV usage from its health answer, clamped to 0..1."""
        self.kv_usage[engine].set(min(1.0, max(0.0, usage)))

    def render(self) -> bytes:
        """What `GET /metrics` serves (as `CONTENT_TYPE`): Prometheus' text format, whatever the scraper accepts.

        Not OpenMetrics on request: prometheus_client 0.26 writes it with `mooncake:` turned into `mooncake_`,
        names no dashboard of ours would find.
        """
        return generate_latest(self.registry)


class _Exposed:
    """The families as scraped: without `_created` series, those of `ALIASES` also under their other name."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
            alias = ALIASES.get(family.name)
            if alias is not None:
                copy = Metric(alias, f"{family.documentation} (as {family.name})", family.type)
                copy.samples = [s._replace(name=alias + s.name[len(family.name) :]) for s in family.samples]
                yield copy
