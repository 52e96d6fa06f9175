"""Edges of the example cluster's control plane: the wire format, the metrics, the config, the policy names and
the reporter, where the tests of each module leave a rule unchecked.

- `serving.wire`: a value a loose check would take (a boolean for an integer, an integer for a boolean, a token
  of six items, a key that is a boolean) is a `MessageError` naming the method and the field's full path; args
  that are not an object are refused even by a message without fields; an unknown method is named as sent.
- `serving.reporter`: a `RuleBasedStateMachine` drives the sender one call at a time (each delivery waits on a
  gate the test opens) against a model of its queue: the calls are the messages sent, in order, neighbouring
  token reports of one engine merged; `flush` holds while a report is pending and holds once all are done.
- `serving.metrics`: finished requests observed against a reference model (count, sum and every bucket of every
  end histogram, success by reason), counters equal to the sums reported and never falling, every series of an
  engine present at zero from the start and each label set once in a scrape, engine gauges as set.
- `serving.config`: every bounded number accepted at its bounds and refused one step past, naming section, key
  and value; booleans, values outside a set, bad hosts and keys refused; unknown and non-table sections named
  with the file; the rules across sections exact at their boundary; a TOML syntax error names its line.
- `serving.registry`: names resolve (the threshold reaches the router), unknown ones and bad router files are
  ConfigErrors.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client.parser import text_string_to_metric_families
from serving import registry, wire
from serving.config import SECTIONS, ClusterConfig, load_config
from serving.machine import Machine
from serving.metrics import FINISH_REASONS, FinishedRequest, HistogramBounds, ServingMetrics, latency_buckets
from serving.models import build_conductor
from serving.reporter import Reporter

from mooncake.errors import ConfigError, MooncakeError
from mooncake.sched.build import ttft_estimator
from mooncake.sched.cost import HARDWARE, MODELS
from tests.serving.test_reporter import tokens as token_report  # one decode node's report of tokens
from tests.serving.test_wire import messages

DEADLINE_S = 10.0

# ---------------------------------------------------------------------------------------------- wire


def near_values(codec: Any, value: Any) -> list[Any]:
    """Values of a near type for a field of `codec` whose valid value is `value`."""
    if codec is wire.INT:
        return [True, False, 1.0]
    if codec is wire.FLOAT:
        return [True, None, "1.0"]
    if codec is wire.BOOL:
        return [1, 0, None]
    if codec is wire.STR:
        return [None, ["a"], 1]
    if codec is wire.INTS:
        return [[*value, True], [*value, 1.0], [*value, None]]
    if codec is wire.STR_MAP:
        return [{**value, "k": None}, ["k", "v"]]
    if codec is wire.EVENTS:
        return [[["stored", "p", 0, 0, 1, [True]]], [["cleared", 5, 0, 0]], [["stored", "p", 0, 0]]]
    if codec is wire.OPTIONAL_INT:
        return [True, 1.0, "1"]
    if codec is wire.OPTIONAL_STR:
        return [["a"], 1, True]
    if codec is wire.OPTIONAL_LOGPROBS:
        return [[-0.5, True, []], [True, 1, []], [-0.5, 1, [[True, -0.1]]], [-0.5, 1, [[1, None]]], [-0.5, 1.0, []]]
    if codec is wire.BIASES:
        return [[[True, 1.0]], [[1, None]], [[1, 2.0, 3]], {"1": 2.0}]
    if codec is wire.OPTIONAL_LOGPROBS_LIST:
        return [[[-0.5, True, []]], [[-0.5, 1, []], None], {"0": [-0.5, 1, []]}]
    assert codec is wire.TOKENS, codec
    return [
        [[1, 0, 5, 0, False, 0]],
        [[1, 0, 5, True, False]],
        [[1.0, 0, 5, 0, False]],
        [[1, 0, 5, 0, False, [-0.5, 1, [[2, True]]]]],
    ]


def near_misses(cls: type[Any], args: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the field's path, `args` with that field given a value of a near type) for each field of `cls`: values
    that `isinstance` or a check of the outer shape alone would let through."""
    nested = {"sampling": wire.Sampling, "fetch": wire.Fetch}
    for field in attrs.fields(cls):
        name, value, codec = field.name, args[field.name], field.metadata["codec"]
        where = f"{path}.{name}"
        if name in nested:
            if value is not None:
                for inner, broken in near_misses(nested[name], value, where):
                    yield inner, {**args, name: broken}
            if name == "sampling":
                yield where, {**args, name: None}
            continue
        bad = near_values(codec, value)
        for item in bad:
            yield where, {**args, name: item}


@settings(max_examples=60, deadline=None)
@given(message=messages)
def test_a_value_of_a_near_type_is_refused_naming_its_full_path(message: wire.Message) -> None:
    """A boolean for an integer or a number, an integer for a boolean, a list with a boolean among its integers,
    a token of six items or with a boolean index, a key that is a boolean: each a MessageError naming the method
    and the field's full path (`prefill.submit.sampling.stop_ids`), never a message."""
    method, args = wire.encode(message)
    for where, broken in near_misses(type(message), args, method):
        with pytest.raises(wire.MessageError) as raised:
            wire.decode(method, broken)
        assert where in str(raised.value), (where, broken, str(raised.value))


@pytest.mark.parametrize("args", [[], None, "{}", 0, [["a", 1]]])
@pytest.mark.parametrize("method", ["worker.health", "worker.stop", "decode.cancel"])
def test_args_that_are_not_an_object_are_refused_even_without_fields(method: str, args: Any) -> None:
    """A call's args must be a JSON object, even for a message without fields (a truncated or garbled call is not
    a `HealthCheck`); through `decode` and through `handlers`, whose handler then never runs."""
    with pytest.raises(wire.MessageError, match=rf"^{re.escape(method)}: expected a JSON object"):
        wire.decode(method, args)
    ran: list[Any] = []
    served = wire.handlers({type(_example(method)): ran.append})
    with pytest.raises(wire.MessageError, match=re.escape(method)):
        served[method](args)
    assert ran == []


def _example(method: str) -> wire.Message:
    return {
        "worker.health": wire.HealthCheck(),
        "worker.stop": wire.Stop(),
        "decode.cancel": wire.CancelDecode(request_id=1),
    }[method]


@pytest.mark.parametrize(
    "method", ["bogus.method", "decode.tok", "Decode.Tokens", "decode.tokens ", "", "worker.health.reply.x"]
)
def test_an_unknown_method_is_named_as_sent(method: str) -> None:
    """An unknown method (a misspelt, truncated or padded one) is a MessageError quoting it as sent."""
    with pytest.raises(wire.MessageError) as raised:
        wire.decode(method, {})
    assert f"unknown message {method!r}" in str(raised.value)


def test_a_reply_decoded_as_its_record_names_its_method() -> None:
    """`decode_as` names the reply's method (`worker.health.reply`) and the field when the reply is malformed."""
    args = wire.encode(wire.Health(ok=True, pid=1, queued=0, active=(), generated_tokens=0, kv_usage=0.5))[1]
    with pytest.raises(wire.MessageError, match=r"^worker\.health\.reply\.pid: expected an integer, got True"):
        wire.decode_as(wire.Health, {**args, "pid": True})
    with pytest.raises(wire.MessageError, match=r"^worker\.health\.reply: missing field 'kv_usage'"):
        wire.decode_as(wire.Health, {k: v for k, v in args.items() if k != "kv_usage"})


@pytest.mark.parametrize(
    "event",
    [
        ["cleared", 5, 0, 0],  # a source that is not a name
        ["cleared", None, 0, 0],
        ["stored", 7, 0, 0, 1, [1]],
        ["removed", "p", 0, 0, True, [1]],  # a boolean tier
        ["stored", "p", 0, 0, 1.0, [1]],
        ["stored", "p", 0, 0, 1, [1, True]],
        ["stored", "p", 0, 0, 1, [1], "extra"],
        ["cleared", "p", 0, 0, 1],
        ["stored", "p", True, 0, 1, [1]],
        ["cleared", "p", 0, 1.5],
    ],
)
def test_a_cache_event_field_of_a_near_type_is_refused(event: Any) -> None:
    """Each field of a cache event on the wire is checked strictly, the source and the tier included."""
    with pytest.raises(wire.MessageError, match=r"^prefill\.done\.events\[0\]"):
        wire.decode(
            "prefill.done",
            {
                "instance_id": "p",
                "request_id": 1,
                "attempt": 0,
                "prefix_tokens": 0,
                "computed_tokens": 0,
                "fetched_blocks": 0,
                "streamed_blocks": 0,
                "events": [event],
            },
        )


# ---------------------------------------------------------------------------------------------- reporter


class GatedCall:
    """A gateway whose every call waits until the test opens its gate, then delivers, or fails as told."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.entered: list[wire.Message] = []
        self.delivered: list[wire.Message] = []
        self.returned = 0
        self._gates: list[threading.Event] = []
        self._outcomes: dict[int, str] = {}
        self._all_open = False

    def __call__(self, message: wire.Message) -> None:
        with self.changed:
            index = len(self.entered)
            self.entered.append(message)
            gate = threading.Event()
            if self._all_open:
                gate.set()
            self._gates.append(gate)
            self.changed.notify_all()
        gate.wait(DEADLINE_S)
        outcome = self._outcomes.get(index, "ok")
        try:
            if outcome == "mooncake":
                raise MooncakeError("the gateway is gone")
            if outcome == "oserror":
                raise ConnectionResetError("connection reset")
            with self.changed:
                self.delivered.append(message)
        finally:
            with self.changed:
                self.returned += 1
                self.changed.notify_all()

    def open(self, index: int, outcome: str) -> None:
        self._outcomes[index] = outcome
        with self.changed:
            self._gates[index].set()

    def open_all(self) -> None:
        with self.changed:
            self._all_open = True
            for gate in self._gates:
                gate.set()

    def wait(self, what: str, predicate: Any) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=DEADLINE_S), f"waited {DEADLINE_S} s for {what}"


reports = st.one_of(
    st.builds(token_report, st.sampled_from(["decode-0", "decode-1"]), st.integers(0, 99), st.integers(1, 3)),
    st.builds(wire.PrefillStarted, instance_id=st.just("prefill-0"), request_id=st.integers(0, 9), attempt=st.just(0)),
)


class ReporterMachine(RuleBasedStateMachine):
    """The reporter against a model of its queue: `in_flight` (the report the sender is delivering, blocked on
    its gate) and `queue` (waiting, with the sends merged into each). Every step waits until the sender has
    taken the next report, so what the model says the sender holds, it holds."""

    @initialize()
    def start(self) -> None:
        self.call = GatedCall()
        self.reporter = Reporter(self.call, capacity=1000, name="reporter-under-test")
        self.in_flight: wire.Message | None = None
        self.queue: list[wire.Message] = []
        self.called: list[wire.Message] = []  # what the sender should have called, in order
        self.delivered: list[wire.Message] = []

    def _take_next(self) -> None:
        if self.in_flight is None and self.queue:
            self.in_flight = self.queue.pop(0)
            self.called.append(self.in_flight)
        count = len(self.called)
        self.call.wait(f"the sender to take report {count}", lambda: len(self.call.entered) == count)

    @rule(message=reports)
    def send(self, message: wire.Message) -> None:
        self.reporter.send(message)
        last = self.queue[-1] if self.queue else None
        if (
            isinstance(message, wire.DecodeTokens)
            and isinstance(last, wire.DecodeTokens)
            and last.instance_id == message.instance_id
        ):
            self.queue[-1] = attrs.evolve(message, tokens=last.tokens + message.tokens)
        else:
            self.queue.append(message)
        self._take_next()

    @precondition(lambda self: self.in_flight is not None)
    @rule(outcome=st.sampled_from(["ok", "ok", "mooncake", "oserror"]))
    def answer(self, outcome: str) -> None:
        index = len(self.called) - 1
        self.call.open(index, outcome)
        if outcome == "ok":
            self.delivered.append(self.called[index])
        self.in_flight = None
        self.call.wait("the call to return", lambda: self.call.returned == index + 1)
        self._take_next()

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def flush_while_pending(self) -> None:
        """A report is held at the gateway: `flush` cannot say everything was delivered."""
        assert not self.reporter.flush(0.0)

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def flush_when_done(self) -> None:
        assert self.reporter.flush(DEADLINE_S)

    @invariant()
    def calls_are_the_sends_in_order_merged(self) -> None:
        if hasattr(self, "call"):
            with self.call.changed:
                assert self.call.entered == self.called
                assert self.call.delivered == self.delivered

    def teardown(self) -> None:
        if hasattr(self, "call"):
            self.call.open_all()
            self.reporter.close(DEADLINE_S)


ReporterMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_the_reporter_keeps_order_merges_neighbours_and_flushes_honestly = ReporterMachine.TestCase


def test_a_gateway_gone_is_dropped_silently(capsys: pytest.CaptureFixture[str]) -> None:
    """A call failing with a MooncakeError or an OSError (the gateway is gone) is dropped without a word on
    stderr (that line is for the unforeseen) and the next report is still delivered."""
    failures: list[BaseException] = [MooncakeError("gone"), ConnectionRefusedError("refused")]
    delivered: list[wire.Message] = []

    def call(message: wire.Message) -> None:
        if failures:
            raise failures.pop(0)
        delivered.append(message)

    reporter = Reporter(call)
    sent = [wire.PrefillStarted(instance_id="prefill-0", request_id=i, attempt=0) for i in range(3)]
    try:
        for message in sent:
            reporter.send(message)
        assert reporter.flush(DEADLINE_S)
    finally:
        reporter.close(DEADLINE_S)
    assert delivered == sent[2:]
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- metrics

PREFILLS, DECODES = ("p0", "p1"), ("d0", "d1")
BOUNDS = HistogramBounds(longest_request_s=60.0, max_prompt_tokens=100, max_output_tokens=100)


def new_metrics() -> ServingMetrics:
    return ServingMetrics(model_name="m", bounds=BOUNDS, prefill_engines=PREFILLS, decode_engines=DECODES)


Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: ServingMetrics) -> Scrape:
    """Every sample the registry serves, by (name, label set)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value for family in metrics.registry.collect() for s in family.samples
    }


def sample(metrics: ServingMetrics | Scrape, name: str, **labels: str) -> float | None:
    """A sample's value (None: no such series), from the metrics or from one scrape of them."""
    samples = scrape(metrics) if isinstance(metrics, ServingMetrics) else metrics
    return samples.get((f"mooncake:{name}", frozenset({"model_name": "m", **labels}.items())))


quarters = st.integers(0, 400).map(lambda n: n / 4)  # exact sums, values on and between bucket bounds


@st.composite
def finished_requests(draw: st.DrawFn) -> FinishedRequest:
    """A request that reached its phases in order (`reached`: 0 none, 1 its prefill started, 2 done, 3 its
    tokens came), ending at `end_s`."""
    reached = draw(st.integers(0, 3))
    times = [draw(quarters)]
    for _ in range(5):
        times.append(times[-1] + draw(quarters))
    arrival, started, done, first, last, end = times
    return FinishedRequest(
        prefill_engine=draw(st.sampled_from(PREFILLS)),
        decode_engine=draw(st.sampled_from(DECODES)),
        finished_reason=draw(st.sampled_from(FINISH_REASONS)),
        arrival_s=arrival,
        prefill_started_s=started if reached >= 1 else None,
        prefill_done_s=done if reached >= 2 else None,
        first_token_s=first if reached >= 3 else None,
        last_token_s=last if reached >= 3 else None,
        end_s=end,
        prompt_tokens=draw(st.integers(0, 120)),
        generation_tokens=draw(st.integers(0, 120)),
        max_tokens=draw(st.integers(1, 120)),
    )


def expected_observations(request: FinishedRequest) -> list[tuple[str, str, float]]:
    """(histogram, engine, value) that a finished request observes: its ends, and each phase it reached."""
    r, p, d = request, request.prefill_engine, request.decode_engine
    seen = [
        ("e2e_request_latency_seconds", d, r.end_s - r.arrival_s),
        ("request_prompt_tokens", p, r.prompt_tokens),
        ("request_generation_tokens", d, r.generation_tokens),
        ("request_max_num_generation_tokens", d, r.max_tokens),
    ]
    if r.prefill_started_s is not None:
        seen.append(("request_queue_time_seconds", p, r.prefill_started_s - r.arrival_s))
    if r.prefill_started_s is not None and r.prefill_done_s is not None:
        seen.append(("request_prefill_time_seconds", p, r.prefill_done_s - r.prefill_started_s))
    if r.first_token_s is not None and r.last_token_s is not None:
        seen.append(("request_decode_time_seconds", d, r.last_token_s - r.first_token_s))
        if r.prefill_started_s is not None:
            seen.append(("request_inference_time_seconds", d, r.last_token_s - r.prefill_started_s))
    return seen


PREFILL_SIDE = {"request_prompt_tokens", "request_queue_time_seconds", "request_prefill_time_seconds"}
END_HISTOGRAMS = {
    "e2e_request_latency_seconds": BOUNDS.duration,
    "request_prompt_tokens": BOUNDS.prompt_tokens,
    "request_generation_tokens": BOUNDS.output_tokens,
    "request_max_num_generation_tokens": BOUNDS.output_tokens,
    "request_queue_time_seconds": BOUNDS.latency,
    "request_prefill_time_seconds": BOUNDS.latency,
    "request_decode_time_seconds": BOUNDS.duration,
    "request_inference_time_seconds": BOUNDS.duration,
}


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(finished_requests(), max_size=8))
def test_finished_requests_match_a_reference_model(requests: list[FinishedRequest]) -> None:
    """After any finished requests, every end histogram's count, sum and each cumulative bucket per engine, and
    `request_success` per engine and reason, are what a plain list of the expected observations gives."""
    metrics = new_metrics()
    for request in requests:
        metrics.finished(request)
    observed = [o for request in requests for o in expected_observations(request)]
    scraped = scrape(metrics)
    for histogram, buckets in END_HISTOGRAMS.items():
        for engine in (*PREFILLS, *DECODES):
            values = [v for h, e, v in observed if h == histogram and e == engine]
            count = sample(scraped, f"{histogram}_count", engine=engine)
            if engine in (PREFILLS if histogram in PREFILL_SIDE else DECODES):
                assert count == len(values), (histogram, engine)
                assert sample(scraped, f"{histogram}_sum", engine=engine) == sum(values), (histogram, engine)
                for bound in buckets:
                    below = sample(scraped, f"{histogram}_bucket", engine=engine, le=str(float(bound)))
                    assert below == sum(v <= bound for v in values), (histogram, engine, bound)
            else:
                assert not values and count is None, (histogram, engine)
    for engine in DECODES:
        for reason in FINISH_REASONS:
            ends = sum(r.decode_engine == engine and r.finished_reason == reason for r in requests)
            assert sample(scraped, "request_success_total", engine=engine, finished_reason=reason) == ends


prefills = st.tuples(
    st.sampled_from(PREFILLS), st.integers(0, 10**6), st.floats(0, 1), st.integers(0, 10**9), st.integers(0, 10**9)
)


@settings(max_examples=100, deadline=None)
@given(reported=st.lists(prefills, max_size=10))
def test_prefill_counters_are_the_sums_reported_and_never_fall(
    reported: list[tuple[str, int, float, int, int]],
) -> None:
    """After each prefill report, per engine: prompt tokens and cache queries are the prompts' sum, hits the
    cached tokens', transfer bytes the fetched and pushed bytes' (each under its own kind); no counter falls."""
    metrics = new_metrics()
    sums = {(e, k): 0 for e in PREFILLS for k in ("prompt", "cached", "fetch", "push")}
    before: dict[tuple[str, str, str], float] = {}
    for engine, prompt, share, fetched, pushed in reported:
        cached = int(prompt * share)
        metrics.prefilled(
            engine, prompt_tokens=prompt, cached_tokens=cached, fetched_bytes=fetched, pushed_bytes=pushed
        )
        for key, value in (("prompt", prompt), ("cached", cached), ("fetch", fetched), ("push", pushed)):
            sums[engine, key] += value
        scraped = scrape(metrics)
        for e in PREFILLS:
            now = {
                ("prompt_tokens_total", e, ""): sums[e, "prompt"],
                ("prefix_cache_queries_total", e, ""): sums[e, "prompt"],
                ("prefix_cache_hits_total", e, ""): sums[e, "cached"],
                ("kv_transfer_bytes_total", e, "fetch"): sums[e, "fetch"],
                ("kv_transfer_bytes_total", e, "push"): sums[e, "push"],
            }
            for (name, eng, kind), expected in now.items():
                labels = {"engine": eng, **({"kind": kind} if kind else {})}
                got = sample(scraped, name, **labels)
                assert got == expected, (name, labels)
                assert got >= before.get((name, eng, kind), 0)
                before[name, eng, kind] = got


def test_every_series_exists_at_zero_from_the_start_once_per_label_set() -> None:
    """As vLLM makes them: before any request, each engine has every series of its side (a prefill engine both
    transfer kinds, a decode engine every finish reason), every engine its state gauges and index gaps, the
    gateway both refusal statuses; a scrape holds each (sample name, label set) once."""
    metrics = new_metrics()
    both = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_index_gaps_total")
    prefill_side = (
        "prompt_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_prompt_tokens_count",
    )
    decode_side = (
        "generation_tokens_total",
        "inter_token_latency_seconds_count",
        "time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_generation_tokens_count",
        "request_max_num_generation_tokens_count",
    )
    for engine, side in [(e, prefill_side) for e in PREFILLS] + [(e, decode_side) for e in DECODES]:
        assert sample(metrics, "engine_up", engine=engine) == 1, engine
        for name in (*both, *side):
            assert sample(metrics, name, engine=engine) == 0, (name, engine)
    for engine in PREFILLS:
        for kind in ("fetch", "push"):
            assert sample(metrics, "kv_transfer_bytes_total", engine=engine, kind=kind) == 0, (engine, kind)
    for engine in DECODES:
        for reason in FINISH_REASONS:
            assert sample(metrics, "request_success_total", engine=engine, finished_reason=reason) == 0
    for status in ("429", "503"):
        assert sample(metrics, "connections_refused_total", status=status) == 0, status
    assert sample(metrics, "num_requests_admission_waiting") == 0
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in seen, key
            seen.add(key)


def test_engine_state_gauges_are_as_set() -> None:
    """`set_engine` sets up (1 or 0), running and waiting, each its own gauge, for that engine only."""
    metrics = new_metrics()
    metrics.set_engine("d0", up=False, running=3, waiting=7)
    assert sample(metrics, "engine_up", engine="d0") == 0
    assert sample(metrics, "num_requests_running", engine="d0") == 3
    assert sample(metrics, "num_requests_waiting", engine="d0") == 7
    assert sample(metrics, "engine_up", engine="d1") == 1
    metrics.set_engine("d0", up=True, running=0, waiting=1)
    assert sample(metrics, "engine_up", engine="d0") == 1
    assert sample(metrics, "num_requests_running", engine="d0") == 0


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError) a call that has not returned after `seconds`: a bucket ladder that never ends."""

    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("smallest", [math.inf, math.nan, 0.0, -0.001])
def test_a_bad_smallest_latency_bucket_is_a_config_error(smallest: float) -> None:
    """The smallest bound must be a positive finite number too (else the ladder is one infinite rung, or never
    reaches its top)."""
    with within(5.0), pytest.raises(ConfigError, match="smallest"):
        latency_buckets(10.0, smallest_s=smallest)


# ---------------------------------------------------------------------------------------------- config


def numeric_fields() -> list[tuple[str, str]]:
    return [
        (section, field.name)
        for section, record in SECTIONS.items()
        for field in attrs.fields(record)
        if field.metadata["rule"].kind in (int, float)
    ]


@pytest.mark.parametrize(("section", "key"), numeric_fields())
def test_a_number_is_taken_at_its_bounds_and_refused_one_step_past(section: str, key: str) -> None:
    """Each bounded number: its minimum (or, when excluded, the next value above) and its maximum are taken; the
    step below and the step above are a ConfigError naming `[section] key = value`; so is a boolean."""
    record = SECTIONS[section]
    rule = attrs.fields_dict(record)[key].metadata["rule"]
    low, high = rule.minimum, rule.maximum
    assert low is not None, f"[{section}] {key} has no minimum"
    taken: list[Any] = []
    refused: list[Any] = [True, False]
    if rule.kind is int:
        taken.append(int(low))
        refused.append(int(low) - 1)
        if high is not None:
            taken.append(int(high))
            refused.append(int(high) + 1)
    else:
        taken.append(math.nextafter(low, math.inf) if rule.above else float(low))
        refused.append(float(low) if rule.above else math.nextafter(low, -math.inf))
        if high is not None:
            taken.append(float(high))
            refused.append(math.nextafter(high, math.inf))
    for value in taken:
        assert getattr(record(**{key: value}), key) == value, (section, key, value)
    for value in refused:
        with pytest.raises(ConfigError) as raised:
            record(**{key: value})
        assert f"[{section}] {key} = {value!r}" in str(raised.value), (value, str(raised.value))


DOCUMENTED = {  # (section, key) → (the smallest value taken, one refused below it), as the docs state them
    ("limits", "admission_wait_s"): (0.0, -1e-9),  # "admission_wait_s zero too": 0 rejects at once
    ("limits", "request_timeout_s"): (1e-9, 0.0),  # durations above zero
    ("limits", "body_timeout_s"): (1e-9, 0.0),
    ("limits", "header_timeout_s"): (1e-9, 0.0),
    ("slo", "ttft_s"): (1e-9, 0.0),
    ("slo", "tbt_s"): (1e-9, 0.0),
    ("limits", "health_interval_s"): (0.01, 0.0099),  # shorter is a busy loop
    ("limits", "health_probe_backoff_max_s"): (0.01, 0.0099),
    ("cluster", "port"): (0, -1),  # 0: any free port
    ("cache", "ssd_blocks"): (0, -1),  # 0: no SSD tier
}


@pytest.mark.parametrize(("section", "key"), DOCUMENTED.keys())
def test_the_documented_lowest_values_are_taken(section: str, key: str) -> None:
    """The bounds the module docstring and the sections' docs promise (not read back from the rules)."""
    lowest, below = DOCUMENTED[section, key]
    assert getattr(SECTIONS[section](**{key: lowest}), key) == lowest
    with pytest.raises(ConfigError, match=re.escape(f"[{section}] {key} = {below!r}")):
        SECTIONS[section](**{key: below})


@pytest.mark.parametrize(
    ("section", "key"),
    [(s, f.name) for s, r in SECTIONS.items() for f in attrs.fields(r) if f.metadata["rule"].allowed],
)
def test_a_name_outside_its_set_is_refused_listing_the_set(section: str, key: str) -> None:
    """A name that is not one of a field's choices is refused naming the field, the value and the choices."""
    rule = attrs.fields_dict(SECTIONS[section])[key].metadata["rule"]
    with pytest.raises(ConfigError) as raised:
        SECTIONS[section](**{key: "no_such_name"})
    assert f"[{section}] {key} = 'no_such_name': must be one of {', '.join(rule.allowed)}" in str(raised.value)


@pytest.mark.parametrize(
    ("key", "value", "taken"),
    [
        ("host", "a-.example", False),  # a label may not end with '-'
        ("host", "-a.example", False),
        ("host", "a..example", False),
        ("host", "a_b", False),
        ("host", "x" * 64, False),
        ("host", "node-1.example.", True),
        ("host", "::1", True),
        ("api_key", "with space", False),
        ("api_key", "tab\there", False),
        ("api_key", "caf\u00e9", False),
        ("api_key", "!~:sk-123", True),
    ],
)
def test_hosts_and_api_keys_have_their_shapes(key: str, value: str, taken: bool) -> None:
    """A host is an address or a name of labels (letters, digits, inner '-'); an API key visible ASCII."""
    if taken:
        assert getattr(SECTIONS["cluster"](**{key: value}), key) == value
    else:
        with pytest.raises(ConfigError, match=re.escape(f"[cluster] {key} = {value!r}")):
            SECTIONS["cluster"](**{key: value})


def refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_config(path, machine=Machine())
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def loads(tmp_path: Path, text: str) -> ClusterConfig:
    path = tmp_path / "cluster.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, machine=Machine())


def test_unknown_and_non_table_sections_are_named(tmp_path: Path) -> None:
    """A section that is not one of the config's, or a key at the top where a section belongs, is refused."""
    assert "unknown section [modle]" in refused(tmp_path, "[modle]\npreset = 'tiny'\n")
    assert "unknown section [port]" in refused(tmp_path, "port = 8000\n")
    assert "[model] = 5: must be a table" in refused(tmp_path, "model = 5\n")
    assert "[cluster] = ['a']: must be a table" in refused(tmp_path, "cluster = ['a']\n")


def test_a_boolean_in_the_file_is_not_a_number(tmp_path: Path) -> None:
    """TOML `true` for an integer or a float key is refused (Python's bool is an int, the config's is not)."""
    assert "[model] seed = True: expected int" in refused(tmp_path, "[model]\nseed = true\n")
    assert "[slo] ttft_s = False: expected float" in refused(tmp_path, "[slo]\nttft_s = false\n")


def test_a_toml_syntax_error_names_its_line(tmp_path: Path) -> None:
    """A document tomllib cannot parse is refused naming the file and the line of the error."""
    message = refused(tmp_path, "[cluster]\nport = 1\nhost = = '127.0.0.1'\n")
    assert "not valid TOML" in message and "line 3" in message


CROSS_RULES = {  # (a document, the value at the boundary, the value one past it, what the refusal names)
    "prompt and default output fill the context": (
        "[limits]\nmax_prompt_tokens = 100\ndefault_max_tokens = 28\n[decode]\nmax_context_tokens = {}\n",
        128,
        127,
        "100 + 28 exceed [decode] max_context_tokens = 127",
    ),
    "a stage per layer": ("[prefill]\npipeline_size = {}\n", 2, 3, "pipeline_size = 3: must be <= the 2 layers"),
    "a longest prompt fills the cache": (
        "[model]\nblock_tokens = 16\n[cache]\ndram_blocks = 4\n[limits]\nmax_prompt_tokens = {}\n",
        64,
        65,
        "max_prompt_tokens = 65: a prompt of 5 blocks",
    ),
    "the backoff cap equals the period": (
        "[limits]\nhealth_probe_backoff_max_s = 2\nhealth_interval_s = {}\n",
        2,
        3,
        "health_probe_backoff_max_s = 2.0: must be >= health_interval_s = 3.0",
    ),
}


@pytest.mark.parametrize(("template", "edge", "past", "named"), CROSS_RULES.values(), ids=CROSS_RULES.keys())
def test_rules_across_sections_hold_exactly_at_their_boundary(
    tmp_path: Path, template: str, edge: int, past: int, named: str
) -> None:
    """Each rule across sections takes the value at its boundary and refuses the next one, naming both sides."""
    assert isinstance(loads(tmp_path, template.format(edge)), ClusterConfig)
    assert named in refused(tmp_path, template.format(past))


def test_overrides_keep_the_sections_other_keys_and_objectives_cap_ttft() -> None:
    """`with_overrides` replaces only the keys given; the Conductor's TTFT objective is capped at the timeout."""
    config = ClusterConfig(source="x").with_overrides("limits", max_prompt_tokens=100, request_timeout_s=2.0)
    config = config.with_overrides("limits", default_max_tokens=3)
    assert (config.limits.max_prompt_tokens, config.limits.request_timeout_s) == (100, 2.0)
    assert config.objectives().ttft_s == min(config.slo.ttft_s, 2.0)


# ---------------------------------------------------------------------------------------------- registry


def test_policy_names_resolve_and_the_threshold_reaches_the_threshold_routers() -> None:
    """Every router name makes a router from the estimator; the threshold asked for reaches exactly those of
    `registry.THRESHOLD_ROUTERS`, which --threshold's refusal and the paper experiments' `what_stops_transfers`
    both ask."""
    estimator = ttft_estimator(MODELS["llama3-70b"], HARDWARE["8xA800"])
    for name in registry.ROUTERS:
        made = registry.router(name, threshold=3.0)(estimator)
        assert made is not None, name
        assert (getattr(made, "threshold", None) == 3.0) == (name in registry.THRESHOLD_ROUTERS), name
    assert set(registry.ROUTERS) >= registry.THRESHOLD_ROUTERS
    for name in registry.ADMISSIONS:
        assert registry.admission(name) is not None


def test_unknown_policy_names_are_config_errors_listing_the_known() -> None:
    """An unknown admission or router name, or FILE.py: without a factory, is a ConfigError listing the names."""
    with pytest.raises(ConfigError, match="admission must be one of baseline, early_rejection"):
        registry.admission("lottery")
    with pytest.raises(ConfigError, match="router must be one of random, round_robin"):
        registry.router("lottery")
    with pytest.raises(ConfigError, match="router must be one of"):
        registry.router("file.py:")


@pytest.fixture
def router_file(tmp_path: Path) -> Iterator[Path]:
    """A folder for router files; the loader's entries in sys.path and sys.modules are removed afterwards."""
    modules, path = set(sys.modules), list(sys.path)
    try:
        yield tmp_path
    finally:
        for name in set(sys.modules) - modules:
            del sys.modules[name]
        sys.path[:] = path


def test_a_config_names_a_router_file_and_is_refused_where_it_names_none(router_file: Path) -> None:
    """`[policy] router` takes FILE.py:FACTORY as `--router` does, checked as the file is read (the file run once,
    however often the config is checked and the router built): a factory that cannot be found, or cannot be
    called with the estimator alone (`check_router_factory`, as `build_conductor` checks it), is refused naming
    the section, key and value, before any worker starts."""
    (router_file / "mine.py").write_text(
        "import builtins\nfrom mooncake.sched.router import LoadBalancingRouter, RouteDecision\n"
        "builtins.mooncake_test_runs = getattr(builtins, 'mooncake_test_runs', 0) + 1\n"
        "def Mine(estimator):\n    return LoadBalancingRouter(estimator)\n"
    )
    named = f"{router_file / 'mine.py'}:Mine"
    config = router_file / "cluster.toml"
    config.write_text(f"[policy]\nrouter = {named!r}\n")
    try:
        assert load_config(config).policy.router == named
        built = build_conductor(load_config(config), prefill_instances=["prefill-0"], decode_instances=["decode-0"])
        assert type(built.router).__name__ == "LoadBalancingRouter"
        assert registry.router_problem(named) is None
        assert builtins.mooncake_test_runs == 1  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(AttributeError):
            del builtins.mooncake_test_runs  # type: ignore[attr-defined]
    for wrong, why in [
        (f"{router_file / 'mine.py'}:Theirs", "has no callable 'Theirs'"),
        (f"{router_file / 'mine.py'}:RouteDecision", "cannot be called with the TTFT estimator alone"),
        ("fastest", "must be one of"),
    ]:
        config.write_text(f"[policy]\nrouter = {wrong!r}\n")
        with pytest.raises(ConfigError, match=re.escape(f"[policy] router = {wrong!r}: ") + ".*" + why):
            load_config(config)
        assert registry.router_problem(wrong) is not None


def test_a_router_file_without_the_factory_or_with_bad_syntax_is_a_config_error(router_file: Path) -> None:
    """A FACTORY that is not callable, a missing file and a syntax error (naming its line) are ConfigErrors; the
    broken file leaves no module behind."""
    (router_file / "plain.py").write_text("Router = 5\n")
    with pytest.raises(ConfigError, match="has no callable 'Router'"):
        registry.router(f"{router_file / 'plain.py'}:Router")
    with pytest.raises(ConfigError, match="not found"):
        registry.router(f"{router_file / 'absent.py'}:Router")
    (router_file / "broken_router.py").write_text("def Router(estimator):\n    return (\n")
    modules = set(sys.modules)
    with pytest.raises(ConfigError, match=r"broken_router\.py, line \d"):
        registry.router(f"{router_file / 'broken_router.py'}:Router")
    assert not [name for name in set(sys.modules) - modules if "broken_router" in name]
