"""The example cluster end to end: engine workers, the Conductor's gateway, the OpenAI API, failures, launchers.

Every cluster runs the tiny model on 127.0.0.1 with `port = 0`. Starting one
costs seconds, so the tests that only send requests share a module-scoped
cluster (with an API key, which every client here sends); the tests that need
another shape or kill engines start their own. Every wait is bounded: the
OpenAI clients have `max_retries=0` and a timeout, threads and processes are
joined with one, a condition is awaited with `wait_for` (which fails naming
it), and every cluster is closed by a context manager.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.homes import prompt_homed_on
from tests.waiting import is_running, wait_for

pytest.importorskip("torch")
pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from serving import wire  # noqa: E402
from serving.api import ApiError, SamplingOptions  # noqa: E402
from serving.config import ClusterConfig, load_config  # noqa: E402
from serving.dispatch import Dispatcher, LiveRequest  # noqa: E402
from serving.gateway import build_conductor  # noqa: E402
from serving.launch import RunningCluster, start_cluster  # noqa: E402

from mooncake.errors import ConfigError  # noqa: E402
from mooncake.sched.cost import FittedPrefillModel  # noqa: E402
from mooncake.sched.join import DecodeLimits  # noqa: E402
from mooncake.sched.outcome import Outcome, Reason, RequestEnd  # noqa: E402
from mooncake.sched.step import DecodeCostModel, FittedStepModel  # noqa: E402
from mooncake.types import BlockKey, InstanceId, Request, RequestId  # noqa: E402

TINY = ROOT / "examples" / "configs" / "tiny.toml"
API_KEY = "test-key"
TIMEOUT_S = 60.0  # any one request; far above what the tiny model needs
SAMPLE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? (-?[0-9.e+-]+|[+-]Inf|NaN)$")


def tiny(**sections: dict[str, Any]) -> ClusterConfig:
    """tiny.toml on any free port, with some sections' keys replaced (in the order given)."""
    config = load_config(TINY).with_overrides("cluster", port=0)
    for section, values in sections.items():
        config = config.with_overrides(section, **values)
    return config


def client(cluster: RunningCluster, *, api_key: str = API_KEY, timeout: float = TIMEOUT_S) -> Any:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def http(url: str, body: Any = None, *, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """(status, headers, text) of a GET (no body) or a POST (bytes as given, anything else as JSON)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers, error.read().decode()


def metrics(cluster: RunningCluster) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value}; every sample line must be well formed."""
    status, _headers, text = http(f"{cluster.url}/metrics")
    assert status == 200
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert SAMPLE.match(line), line
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a family's series (`name` and any labels) in `metrics`' samples."""
    return sum(value for key, value in samples.items() if key == name or key.startswith(name + "{"))


def completion_text(chunks: list[Any], *, chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    """The tiny config's cluster (2 prefill + 1 decode) requiring API_KEY; for tests that only send requests."""
    with start_cluster(tiny(cluster={"api_key": API_KEY})) as running:
        yield running


# ---------------------------------------------------------------------------------------------- the OpenAI API


def test_completions_streamed_equal_whole(cluster: RunningCluster) -> None:
    """Greedy completions: the streamed text is the whole one; usage counts the prompt's bytes and max_tokens."""
    api = client(cluster)
    prompt = "The Mooncake paper splits prefill from decode."
    whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert whole.object == "text_completion" and whole.model == "tiny"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens == len(prompt.encode())
    assert whole.usage.total_tokens == len(prompt.encode()) + 24

    stream = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert completion_text(chunks, chat=False) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24

    # continuous_usage_stats (vLLM's): every chunk carries the tokens generated so far, so a client can tell
    # how many tokens each event brought (load.py's event_tokens)
    stream = api.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [c.usage.completion_tokens for c in stream if c.choices and c.usage is not None]
    assert counts == sorted(counts) and 0 < counts[0] < counts[-1] == 24
    assert len(set(counts)) >= len(counts) - 1  # the count so far, not the total: only the finish chunk repeats it


def test_chat_completions_streamed_equal_whole(cluster: RunningCluster) -> None:
    """Chat: the reply is the assistant's; streamed deltas (the first with the role) add up to the whole reply."""
    api = client(cluster)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=20, seed=7)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 20
    prompt = "<|system|>\nBe brief.\n<|user|>\nWhat is a KV cache?\n<|assistant|>\n"
    assert whole.usage.prompt_tokens == len(prompt.encode())

    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=20, seed=7, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    # The stream opens as vLLM's does: the assistant's role and no text yet; then text only.
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    assert completion_text(chunks, chat=True) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # continuous_usage_stats: the role chunk carries the usage too, nothing generated yet (as vLLM's does)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, seed=7, stream=True, stream_options=options
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage is not None
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (len(prompt.encode()), 0)


def test_shared_prefix_is_a_cache_hit(cluster: RunningCluster) -> None:
    """The second of two prompts sharing a long prefix reuses its KV: counted as hits, not computed again.

    One output token each, a few times over: the shortest request must still learn its prefix hit (the prefill's
    report once raced the decode node's last token, and lost about one time in five).
    """
    api = client(cluster)
    for _ in range(5):
        prefix = f"{uuid.uuid4()} " + "Prefill computes the KV cache once; decode reuses it. " * 6  # unique per run
        first = api.completions.create(model="tiny", prompt=prefix + "First.", max_tokens=1)
        before = metrics(cluster)
        second_prompt = prefix + "And a second question."
        second = api.completions.create(model="tiny", prompt=second_prompt, max_tokens=1)
        after = metrics(cluster)

        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < len(second_prompt.encode())
        hits = total(after, "mooncake:prefix_cache_hits_total") - total(before, "mooncake:prefix_cache_hits_total")
        queries = total(after, "mooncake:prefix_cache_queries_total") - total(
            before, "mooncake:prefix_cache_queries_total"
        )
        assert hits == cached
        assert queries == len(second_prompt.encode())


def test_answers_name_the_instances_that_ran_them(cluster: RunningCluster) -> None:
    """Whole and streamed answers carry X-Mooncake-Prefill-Instance and X-Mooncake-Decode-Instance, naming one
    of the cluster's prefill and decode workers."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for stream in (False, True):
        body = {"model": "tiny", "prompt": "Where did I run?", "max_tokens": 2, "stream": stream}
        status, headers, _ = http(f"{cluster.url}/v1/completions", body, headers=auth)
        assert status == 200
        assert headers["X-Mooncake-Prefill-Instance"] in ("prefill-0", "prefill-1")
        assert headers["X-Mooncake-Decode-Instance"] == "decode-0"


BAD_BODIES = [
    ("completions", {"prompt": 3}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "8.5"}, "max_tokens"),  # "8" is 8, as vLLM reads it
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # over the context: test_api.py
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "hi", "stream": "maybe"}, "stream"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"prompt": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
    # (a message with no content is vLLM's empty one: CustomChatCompletionMessageParam's content is optional)
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]},
        "messages[1].content",
    ),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "echo": "maybe"}, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "a\ud800"}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_bad_body_is_a_400_naming_the_field(cluster: RunningCluster, path: str, body: Any, field: str) -> None:
    status, _headers, text = http(f"{cluster.url}/v1/{path}", body, headers={"Authorization": f"Bearer {API_KEY}"})
    error = json.loads(text)["error"]
    assert status == 400 and error["code"] == 400
    assert error["param"] == field
    assert field.split("[")[0] in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"prompt"'])
def test_body_not_a_json_object_is_a_400(cluster: RunningCluster, body: bytes) -> None:
    status, _headers, text = http(f"{cluster.url}/v1/completions", body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 400
    assert "JSON" in json.loads(text)["error"]["message"]


def test_prompt_over_the_limit_is_a_context_length_error(cluster: RunningCluster) -> None:
    """One token over [limits] max_prompt_tokens is vLLM's 400 `context_length_exceeded` (the OpenAI client's
    BadRequestError, which clients catch to shorten the context), for both APIs."""
    limit = cluster.config.limits.max_prompt_tokens
    api = client(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="tiny", prompt="x" * (limit + 1), max_tokens=1)
    assert raised.value.code == "context_length_exceeded" and str(limit) in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * limit}], max_tokens=1)
    assert raised.value.code == "context_length_exceeded"
    assert api.completions.create(model="tiny", prompt="x" * limit, max_tokens=1).usage.prompt_tokens == limit


def test_a_batch_refused_on_a_later_prompt_admits_none_of_it(cluster: RunningCluster) -> None:
    """A batch whose second prompt leaves less of the context than its `min_tokens` is a 400 naming `min_tokens`
    before any of it is admitted (vLLM builds every prompt's sampling parameters before it runs any): the first
    prompt's choices were never sent to prefill, so none is counted as aborted."""
    context = cluster.config.decode.max_context_tokens
    # The first prompt (900 tokens) leaves 48 tokens more than min_tokens, the second (1000) 52 fewer.
    min_tokens = context - 900 - 48
    body = {"prompt": ["a" * 900, "b" * 1000], "max_tokens": context, "min_tokens": min_tokens, "n": 4}
    before = metrics(cluster)
    status, _headers, text = http(f"{cluster.url}/v1/completions", body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 400 and json.loads(text)["error"]["param"] == "min_tokens"
    after = metrics(cluster)
    aborted = [key for key in after if key.startswith("mooncake:request_success_total{") and '"abort"' in key]
    assert aborted and all(after[key] == before.get(key, 0.0) for key in aborted)
    assert not cluster.gateway.dispatcher.live


def test_a_browser_page_may_call_the_api_as_on_vllms_server(cluster: RunningCluster) -> None:
    """CORS as vLLM's default: a preflight (no key needed) is a 200 allowing the method and the headers asked for;
    answers to a request with an Origin, a stream's and an error's included, allow any origin."""
    origin = {"Origin": "http://localhost:3000"}
    preflight = urllib.request.Request(
        f"{cluster.url}/v1/chat/completions",
        method="OPTIONS",
        headers={**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"},
    )
    with urllib.request.urlopen(preflight, timeout=TIMEOUT_S) as answer:
        assert answer.status == 200 and "POST" in answer.headers["Access-Control-Allow-Methods"]
        assert answer.headers["Access-Control-Allow-Headers"] == "authorization"
        assert answer.headers["Access-Control-Allow-Origin"] == "*"
    keyed = {**origin, "Authorization": f"Bearer {API_KEY}"}
    for body, expected in (
        ({"prompt": "hi", "max_tokens": 2}, 200),
        ({"prompt": "hi", "max_tokens": 2, "stream": True}, 200),
        ({"prompt": 5}, 400),
    ):
        status, headers, _text = http(f"{cluster.url}/v1/completions", body, headers=keyed)
        assert status == expected and headers["Access-Control-Allow-Origin"] == "*"
    assert http(f"{cluster.url}/v1/completions", {"prompt": "hi"}, headers=origin)[1]["Access-Control-Allow-Origin"]
    assert "Access-Control-Allow-Origin" not in http(f"{cluster.url}/health")[1]  # no Origin: no CORS header


def test_api_key_is_required(cluster: RunningCluster) -> None:
    """With [cluster] api_key set, a wrong or missing key is a 401 on every route under /v1; /health, /tokenize and
    /detokenize stay open, as on vLLM's server (its key guards the paths under /v1 only)."""
    with pytest.raises(openai.AuthenticationError):
        client(cluster, api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=1)
    for path, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": []})):
        status, _headers, text = http(f"{cluster.url}/v1/{path}", body)
        assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
    status, _headers, _text = http(f"{cluster.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert http(f"{cluster.url}/v1/models", headers={"Authorization": f"bearer {API_KEY}"})[0] == 200  # any case
    (model,) = client(cluster).models.list()
    # vLLM's field: the longest prompt plus max_tokens that is never refused for length (the prompt has a limit
    # of its own below the decode context's)
    limits, context = cluster.config.limits, cluster.config.decode.max_context_tokens
    assert model.id == "tiny" and model.max_model_len == min(limits.max_prompt_tokens, context)
    assert http(f"{cluster.url}/health")[0] == 200
    status, _headers, text = http(f"{cluster.url}/tokenize", {"prompt": "hi"})
    assert status == 200 and json.loads(text)["tokens"] == [104, 105]
    assert (
        http(f"{cluster.url}/detokenize", {"tokens": [104, 105]}, headers={"Authorization": "Bearer wrong"})[0] == 200
    )


def test_a_client_gone_mid_stream_stops_its_decode(cluster: RunningCluster) -> None:
    """A client that hangs up mid-stream is cancelled on the decode engine: its batch empties long before
    the request's max_tokens could have been generated."""
    body = {"prompt": "bye " * 20, "max_tokens": 1000, "stream": True}
    before = total(metrics(cluster), "mooncake:generation_tokens_total")
    request = urllib.request.Request(
        f"{cluster.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        assert response.readline().startswith(b"data: ")  # streaming has begun
    dispatcher = cluster.gateway.dispatcher
    decode = next(i for i, role in dispatcher.roles.items() if role == "decode")
    wait_for(
        lambda: dispatcher.health(decode).active == (),
        timeout=20.0,
        what="the decode engine to stop generating for a client that left",
    )
    assert not dispatcher.live  # the gateway forgot it too
    assert total(metrics(cluster), "mooncake:generation_tokens_total") - before < 1000  # cut short, not run to the end


def test_a_client_gone_mid_stream_stops_every_choice_and_leaves_no_task(
    cluster: RunningCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that hangs up a stream of 1 or 3 choices: every choice is cancelled on the decode engine, the
    gateway forgets them, and no task of the stream is left pending for the collector (its event loop would log
    "Task was destroyed but it is pending"); nothing is logged as an error (a write to the client that failed
    before aiohttp noticed it leave had been logged with its traceback)."""
    dispatcher = cluster.gateway.dispatcher
    decode = next(i for i, role in dispatcher.roles.items() if role == "decode")
    for n in (1, 3):
        body = {"prompt": "bye " * 20, "max_tokens": 1000, "stream": True, "n": n, "ignore_eos": True}
        request = urllib.request.Request(
            f"{cluster.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        with caplog.at_level("ERROR"), urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            for _ in range(3):
                assert response.readline()  # streaming has begun
        wait_for(lambda: dispatcher.health(decode).active == (), timeout=20.0, what=f"all {n} choices to stop")
        wait_for(lambda: not dispatcher.live, timeout=20.0, what="the gateway to forget them")
        with caplog.at_level("ERROR"):
            gc.collect()
            time.sleep(0.2)  # the loop's handler runs on its own thread
    assert not [r for r in caplog.records if "was destroyed but it is pending" in r.getMessage()]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_choice_refused_at_admission_withdraws_the_others() -> None:
    """With a decode batch of 2 and no wait for room, `n: 3` has its third choice refused for the batch: the
    answer is that 429, and the two choices admitted before it are withdrawn (none left live or decoding)."""
    config = tiny(decode={"max_batch_size": 2}, limits={"admission_wait_s": 0.0})
    with start_cluster(config) as running:
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        with pytest.raises(openai.RateLimitError) as raised:
            api.completions.create(
                model="tiny", prompt="three of us", max_tokens=200, n=3, extra_body={"ignore_eos": True}
            )
        assert raised.value.body["code"] == "batch_full"
        dispatcher = running.gateway.dispatcher
        decode = next(i for i, role in dispatcher.roles.items() if role == "decode")
        wait_for(
            lambda: not dispatcher.live and dispatcher.health(decode).active == (), timeout=20.0, what="withdrawal"
        )
        assert len(api.completions.create(model="tiny", prompt="two of us", max_tokens=2, n=2).choices) == 2


def test_health_and_metrics(cluster: RunningCluster) -> None:
    """/health counts the engines up; /metrics is Prometheus text with the families docs/cluster.md lists."""
    client(cluster).completions.create(model="tiny", prompt="Count me in the metrics.", max_tokens=4)
    status, _headers, text = http(f"{cluster.url}/health")
    health = json.loads(text)
    assert status == 200
    assert health == {"status": "ok", "prefill_up": 2, "decode_up": 1, "in_flight": 0}

    status, headers, text = http(f"{cluster.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for family, kind in (
        ("mooncake:time_to_first_token_seconds", "histogram"),
        ("mooncake:inter_token_latency_seconds", "histogram"),
        ("mooncake:request_rejected_total", "counter"),
        ("mooncake:kv_transfer_bytes_total", "counter"),
        ("mooncake:num_requests_running", "gauge"),
    ):
        assert f"# TYPE {family} {kind}" in text
    samples = metrics(cluster)
    for histogram in ("mooncake:time_to_first_token_seconds", "mooncake:inter_token_latency_seconds"):
        assert total(samples, f"{histogram}_count") > 0 and total(samples, f"{histogram}_sum") > 0
    assert total(samples, "mooncake:kv_transfer_bytes_total") > 0
    for instance in ("prefill-0", "prefill-1", "decode-0"):
        labels = f'{{engine="{instance}",model_name="tiny"}}'
        assert samples[f"mooncake:num_requests_running{labels}"] == 0
        assert samples[f"mooncake:engine_up{labels}"] == 1
    assert samples['mooncake:http_responses_total{model_name="tiny",status="200"}'] >= 1


def test_gateway_imports_no_torch() -> None:
    """The gateway schedules and serves HTTP only: importing it (in a fresh interpreter) loads no torch."""
    code = "import sys; import serving.gateway; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "examples",
        env={**os.environ, "PYTHONPATH": str(ROOT / "examples")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- the gateway's models and ends


def test_a_profile_gives_the_conductor_its_fitted_prefill_and_decode_models(tmp_path: Path) -> None:
    """With `[prefill] profile` (the JSON examples/profile_engine.py writes: each model's `to_json`), the
    router estimates prefill with the fitted prefill model and the Conductor's step model, which its decode
    rule's TBT check and decode selection read, is the fitted decode model; without a profile both are the
    analytic CPU models; a profile lacking its decode section is a ConfigError naming the file."""
    prefill = FittedPrefillModel(coefficients=(0.01, 2e-4, 1e-8))
    decode = FittedStepModel(coefficients=(0.002, 3e-4, 1e-6))
    path = tmp_path / "tiny.json"
    profile = {"model": "tiny", "prefill": json.loads(prefill.to_json()), "decode": json.loads(decode.to_json())}
    path.write_text(json.dumps(profile))
    conductor = build_conductor(tiny(prefill={"profile": str(path)}))
    assert conductor.step_model == decode
    assert conductor.router.estimator.prefill == prefill  # type: ignore[attr-defined]
    assert isinstance(build_conductor(tiny()).step_model, DecodeCostModel)
    del profile["decode"]
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match="no 'decode' section") as raised:
        build_conductor(tiny(prefill={"profile": str(path)}))
    assert str(path) in str(raised.value)


def test_decode_reports_end_requests_in_the_outcome_vocabulary() -> None:
    """A decode engine's refusal names the decode rule's reason by its value: the request is rejected after
    prefill with that `Reason` (a 429, counted as decode_<reason>; a value the gateway does not know is
    DECODE_REJECTED); a join that failed (its KV missing) is aborted as FAILED (a 500), no rejection.
    The reports are fed to the dispatcher as the transfer engine's handler would, without workers."""
    config = tiny()
    conductor = build_conductor(config)
    conductor.add_prefill_instance(InstanceId("prefill-0"))
    conductor.add_decode_instance(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=4096, max_batch_size=8))
    ends: list[RequestEnd] = []
    handle = conductor.handle

    def spy(event: Any) -> tuple[RequestEnd, ...]:
        ended = handle(event)
        ends.extend(ended)
        return ended

    conductor.handle = spy  # type: ignore[method-assign]
    dispatcher = Dispatcher(config, conductor, secret=bytes(32), workers=[], is_alive=lambda _: True, block_bytes=1)
    try:

        def live(number: int) -> LiveRequest:
            request = Request(
                request_id=RequestId(number),
                arrival_s=0.0,
                input_length=20,
                output_length=8,
                block_keys=(BlockKey(2 * number), BlockKey(2 * number + 1)),  # two 16-token blocks
            )
            decision = conductor.schedule(request, dispatcher.now())
            assert decision.accepted and decision.prefill_instance and decision.decode_instance
            entry = LiveRequest(
                request.request_id,
                [0] * 20,
                request,
                SamplingOptions(max_tokens=8),
                0.0,
                prefill=decision.prefill_instance,
                decode=decision.decode_instance,
            )
            dispatcher.live[request.request_id] = entry
            return entry

        cases = [
            (wire.DecodeRejected, {"reason": "kv_budget"}, Outcome.REJECTED_AFTER_PREFILL, Reason.KV_BUDGET, 429),
            (
                wire.DecodeRejected,
                {"reason": "no_such_reason"},
                Outcome.REJECTED_AFTER_PREFILL,
                Reason.DECODE_REJECTED,
                429,
            ),
            (wire.DecodeFailed, {"error": "KV block 7 is not cached"}, Outcome.ABORTED, Reason.FAILED, 500),
        ]
        for number, (message, report, outcome, reason, status) in enumerate(cases, start=1):
            entry = live(number)
            ids = {"instance_id": "decode-0", "request_id": number, "attempt": 0}
            dispatcher._dispatch(message(**ids, **report))
            assert ends[-1] == RequestEnd(RequestId(number), outcome, reason)
            kind, error = entry.events.get_nowait()
            assert kind == "error" and isinstance(error, ApiError) and error.status == status
            assert RequestId(number) not in dispatcher.live
        registry = dispatcher.metrics.registry

        def rejected(reason: str) -> float | None:
            return registry.get_sample_value(
                "mooncake:request_rejected_total", {"model_name": "tiny", "reason": reason}
            )

        assert rejected("decode_kv_budget") == 1
        assert rejected("decode_decode_rejected") == 1
        assert rejected("decode_failed") is None
        failed = {"model_name": "tiny", "engine": "decode-0", "finished_reason": "error"}
        assert registry.get_sample_value("mooncake:request_success_total", failed) == 1
        assert conductor.in_flight == ()
        conductor.check_invariants()
    finally:
        dispatcher.close()


# ---------------------------------------------------------------------------------------------- overload and failures


BURST_PROMPT = "Overload: " + "x" * 90  # 100 tokens
BURST_TOKENS = 100  # generated by each request of `burst`: with its prompt, two never fit 256 tokens


def burst(cluster: RunningCluster, *, timeout_s: float, num_requests: int = 8) -> list[Any]:
    """`num_requests` completions sent at once (each a 100-token prompt and `BURST_TOKENS`), each answer or
    error; every request answered within `timeout_s` + 15 s or the test fails."""
    barrier = threading.Barrier(num_requests, timeout=TIMEOUT_S)
    outcomes: list[Any] = []

    def send() -> None:
        api = client(cluster, timeout=timeout_s)
        barrier.wait()
        try:
            outcomes.append(api.completions.create(model="tiny", prompt=BURST_PROMPT, max_tokens=BURST_TOKENS))
        except openai.APIError as error:  # a timeout too: it fails the test, with the others' outcomes
            outcomes.append(error)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(num_requests)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s + 15.0
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a request was not answered in time"
    assert len(outcomes) == num_requests
    return outcomes


def test_burst_beyond_capacity_gets_429s_and_nothing_hangs() -> None:
    """Decode KV room for one request, eight at once: the rest are 429s with Retry-After, all answered in time."""
    config = tiny(
        limits={"max_prompt_tokens": 128, "default_max_tokens": 16, "admission_wait_s": 0.0},  # no waiting
        decode={"max_batch_size": 1, "max_context_tokens": 256},  # the Conductor's room: 256 tokens
    )
    with start_cluster(config) as cluster:
        outcomes = burst(cluster, timeout_s=30.0)
        errors = [o for o in outcomes if isinstance(o, openai.APIError)]
        served = [o for o in outcomes if not isinstance(o, openai.APIError)]
        assert served and errors, outcomes
        assert all(o.usage.completion_tokens == BURST_TOKENS for o in served)
        for error in errors:
            assert isinstance(error, openai.APIStatusError) and error.status_code == 429, error
            assert int(error.response.headers["Retry-After"]) > 0
            assert error.body["type"] == "rate_limit_error"
        assert total(metrics(cluster), "mooncake:request_rejected_total") == len(errors)
        # The burst left nothing reserved: a lone request is served again.
        assert (
            client(cluster).completions.create(model="tiny", prompt=BURST_PROMPT, max_tokens=4).usage.completion_tokens
            == 4
        )


def test_a_burst_beyond_the_batch_waits_for_room_and_is_served() -> None:
    """The same burst with the default `admission_wait_s`: the requests the decode engine has no room for wait at
    the gateway, before any prefill, and are scheduled as the ones ahead end: all eight served, none refused,
    and nothing left waiting (as vLLM's scheduler queues a burst over its batch)."""
    config = tiny(
        limits={"max_prompt_tokens": 128, "default_max_tokens": 16},
        decode={"max_batch_size": 1, "max_context_tokens": 256},
    )
    assert config.limits.admission_wait_s > 0
    with start_cluster(config) as cluster:
        outcomes = burst(cluster, timeout_s=60.0)
        assert not [o for o in outcomes if isinstance(o, openai.APIError)], outcomes
        assert [o.usage.completion_tokens for o in outcomes] == [BURST_TOKENS] * len(outcomes)
        scrape = metrics(cluster)
        assert total(scrape, "mooncake:request_rejected_total") == 0
        assert total(scrape, "mooncake:num_requests_admission_waiting") == 0


@pytest.fixture
def two_by_two() -> Iterator[RunningCluster]:
    """2 prefill + 2 decode engines, with room for requests long enough to be killed mid-stream."""
    config = tiny(
        cluster={"num_prefill": 2, "num_decode": 2},
        limits={"max_prompt_tokens": 256, "default_max_tokens": 16},
        decode={"max_context_tokens": 4096},
    )
    with start_cluster(config) as running:
        yield running


def the_live_request(cluster: RunningCluster) -> Any:
    """The gateway's only request in flight."""
    (live,) = list(cluster.gateway.dispatcher.live.values())
    return live


def test_decode_killed_mid_stream(two_by_two: RunningCluster) -> None:
    """SIGKILL the decode engine serving a stream: that client gets an error; the survivor serves what follows."""
    cluster, api = two_by_two, client(two_by_two, timeout=30.0)
    max_tokens = 3000  # many seconds of decoding: the kill lands long before the end
    started = time.monotonic()
    with api.completions.create(model="tiny", prompt="A long story.", max_tokens=max_tokens, stream=True) as stream:
        chunks = iter(stream)
        next(chunks)
        killed = the_live_request(cluster).decode
        survivor = ({"decode-0", "decode-1"} - {killed}).pop()
        cluster.backend.kill(killed)
        received = 1
        with pytest.raises(openai.APIError, match=killed):  # the error event the gateway sends in the stream
            for _chunk in chunks:
                received += 1
    assert received < max_tokens
    assert time.monotonic() - started < 30.0

    status, _headers, text = http(f"{cluster.url}/health")
    assert status == 200 and json.loads(text)["decode_up"] == 1
    assert metrics(cluster)[f'mooncake:engine_up{{engine="{killed}",model_name="tiny"}}'] == 0
    for i in range(3):
        answer = api.completions.create(model="tiny", prompt=f"After the failure, #{i}.", max_tokens=8)
        assert answer.usage.completion_tokens == 8
    with api.completions.create(
        model="tiny", prompt="Who serves me?", max_tokens=64, stream=True, stream_options={"include_usage": True}
    ) as stream:
        chunks = iter(stream)
        next(chunks)
        assert the_live_request(cluster).decode == survivor
        *_, last = chunks
        assert last.usage.completion_tokens == 64


def test_decode_killed_mid_whole_answer_is_generated_again(two_by_two: RunningCluster) -> None:
    """SIGKILL the decode engine generating a whole (not streamed) answer, of which its client has had nothing yet:
    the request is scheduled again on the survivor and answered in full, 200 with the very text and tokens of an
    undisturbed run of the same seed, its usage counting the retry alone (it was a 503 naming the dead engine)."""
    cluster = two_by_two
    url = f"{cluster.url}/v1/completions"
    max_tokens = 1500  # seconds of decoding: the kill lands long before the end
    body = {
        "model": "tiny",
        "prompt": "A story told twice.",
        "max_tokens": max_tokens,
        "seed": 1234,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, _headers, text = http(url, body)
    assert status == 200, text
    undisturbed = json.loads(text)
    answered: list[tuple[int, Any, str]] = []
    request = threading.Thread(target=lambda: answered.append(http(url, body)))
    request.start()
    try:
        dispatcher = cluster.gateway.dispatcher
        wait_for(
            lambda: any(live.generated >= 8 for live in list(dispatcher.live.values())),
            timeout=TIMEOUT_S,
            what="the request to decode",
        )
        live = the_live_request(cluster)
        killed = live.decode
        cluster.backend.kill(killed)
        at_kill = live.generated
    finally:
        request.join(timeout=2 * TIMEOUT_S)
    assert not request.is_alive() and at_kill < max_tokens
    ((status, headers, text),) = answered
    assert status == 200, text
    answer = json.loads(text)
    survivor = ({"decode-0", "decode-1"} - {killed}).pop()
    assert headers["X-Mooncake-Decode-Instance"] == survivor and live.attempt == 1
    assert answer["usage"]["completion_tokens"] == max_tokens
    (choice,), (first,) = answer["choices"], undisturbed["choices"]
    assert len(choice["token_ids"]) == max_tokens
    assert (choice["text"], choice["token_ids"]) == (first["text"], first["token_ids"])
    assert choice["finish_reason"] == first["finish_reason"] == "length"


def test_prefill_killed_requests_rerouted() -> None:
    """SIGKILL prefill-0 unnoticed by the health loop: requests sent to it are scheduled again on prefill-1.

    Both idle and no prefix cached, the Conductor picks the first prompt's rendezvous home, prefill-0 (a prompt
    chosen for it), so the first request is sent to the dead engine; its failed submit marks it down and reroutes
    the request.
    """
    # Only a failed submit can notice the dead engine.
    config = tiny(limits={"health_interval_s": 600.0, "health_probe_backoff_max_s": 600.0})
    with start_cluster(config) as cluster:
        api = client(cluster, timeout=30.0)
        cluster.backend.kill("prefill-0")
        first = prompt_homed_on(cluster, "prefill-0", "Rerouted request")
        for prompt in (first, "Rerouted request a.", "Rerouted request b.", "Rerouted request c."):
            answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=8)
            assert answer.usage.completion_tokens == 8
        status, _headers, text = http(f"{cluster.url}/health")
        assert status == 200 and json.loads(text)["prefill_up"] == 1
        assert metrics(cluster)['mooncake:engine_up{engine="prefill-0",model_name="tiny"}'] == 0


def test_no_engine_up_is_a_503() -> None:
    """With the only decode engine dead, requests are refused with 503 and Retry-After, and /health says so."""
    with start_cluster(tiny(limits={"health_interval_s": 0.1})) as cluster:
        cluster.backend.kill("decode-0")
        wait_for(
            lambda: http(f"{cluster.url}/health")[0] == 503,
            timeout=20.0,
            what="/health to notice the dead decode engine",
        )
        with pytest.raises(openai.APIStatusError) as raised:
            client(cluster).completions.create(model="tiny", prompt="anyone?", max_tokens=4)
        assert raised.value.status_code == 503
        assert int(raised.value.response.headers["Retry-After"]) > 0
        # The Conductor's vocabulary, as every other rejection: the reason as the code, no prefill ran.
        error = raised.value.response.json()["error"]
        assert (error["code"], error["outcome"]) == ("no_decode_instance", "rejected_before_prefill")


# ---------------------------------------------------------------------------------------------- backends and the launcher


@pytest.mark.slow
def test_ray_backend_serves_a_request() -> None:
    """The same cluster as Ray actors on a local Ray instance."""
    pytest.importorskip("ray")
    config = tiny(cluster={"num_prefill": 1, "num_decode": 1})
    with start_cluster(config, backend="ray") as cluster:
        answer = client(cluster).completions.create(model="tiny", prompt="Hello from Ray.", max_tokens=8)
        assert answer.usage.completion_tokens == 8
        assert json.loads(http(f"{cluster.url}/health")[2])["status"] == "ok"


def children(pid: int) -> set[int]:
    """Every live descendant of `pid`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def segments_of(pids: set[int]) -> set[str]:
    """The /dev/shm segments mooncake created in these processes (named mooncake-<pid>-<hex>)."""
    prefixes = tuple(f"mooncake-{pid}-" for pid in pids)
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefixes)}


@pytest.mark.skipif(not Path("/proc").is_dir() or not Path("/dev/shm").is_dir(), reason="needs /proc and /dev/shm")
def test_launcher_serves_until_sigterm_and_leaves_nothing() -> None:
    """examples/cluster.py prints its URL, serves /health; SIGTERM stops it, its workers and their shared memory."""
    command = [sys.executable, str(ROOT / "examples" / "cluster.py"), "--config", str(TINY), "--port", "0"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert launcher.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # drains the pipe so that the launcher never blocks on it
        for line in launcher.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120.0
        url = None
        while url is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if found := re.search(r"mooncake cluster ready: (http://\S+)", line):
                url = found.group(1)
        assert url.startswith("http://127.0.0.1:")
        status, _headers, text = http(f"{url}/health")
        assert status == 200 and json.loads(text)["status"] == "ok"

        spawned = children(launcher.pid)
        ours = spawned | {launcher.pid}
        assert len(spawned) >= 3  # two prefill and one decode worker (and multiprocessing's resource tracker)
        assert len(segments_of(ours)) == 3  # one DRAM pool per worker

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        wait_for(
            lambda: not any(is_running(pid) for pid in spawned),
            timeout=10.0,
            what="the launcher's workers to exit (no orphan processes)",
        )
        assert not segments_of(ours), "leftover shared memory"
        reader.join(timeout=10)
        assert any(line.startswith("stopping") for line in list(lines.queue))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        reader.join(timeout=10)
        launcher.stdout.close()


def test_launcher_reports_a_bad_config(tmp_path: Path) -> None:
    """A bad config stops the launcher before anything starts: exit status 1, the file and key on stderr."""
    config = tmp_path / "bad.toml"
    config.write_text("[decode]\nmax_batch_size = 0\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cluster.py"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert str(config) in done.stderr and "[decode] max_batch_size = 0" in done.stderr


@pytest.mark.parametrize(("value", "said"), [("70000", "70000 is not a port"), ("-1", "-1 is not a port")])
@pytest.mark.parametrize(("script", "config"), [("cluster.py", TINY), ("vllm_router.py", TINY.parent / "router.toml")])
def test_launcher_blames_a_bad_port_on_the_option_not_the_file(
    value: str, said: str, script: str, config: Path
) -> None:
    """A `--port` out of range is the command line's error (argparse's: exit 2, the option named), not the config
    file's, whose port is fine (it was reported as `tiny.toml: [cluster] port = 70000`), for the example cluster
    and the vLLM router alike (`mooncake.cli.port`; the router's blamed its file, exit 1)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--config", str(config), f"--port={value}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"argument --port: {said}" in done.stderr and str(config) not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[bogus]\nx = 1\n", ["[bogus]"]),
        ("[cluster]\nnum_prefil = 3\n", ["[cluster]", "num_prefil", "3"]),
        ('[cluster]\nport = "8000"\n', ["[cluster]", "port", "'8000'", "int"]),
        ("[model]\nseed = true\n", ["[model]", "seed", "True"]),
        ("[decode]\nmax_batch_size = 0\n", ["[decode]", "max_batch_size", "0", ">= 1"]),
        ("[slo]\nttft_s = -1.5\n", ["[slo]", "ttft_s", "-1.5"]),
        ('[policy]\nrouter = "fastest"\n', ["[policy]", "router", "'fastest'", "kvcache_centric"]),
        ('[model]\npreset = "huge"\n', ["[model]", "preset", "'huge'", "tiny"]),
        ("cluster = 3\n", ["[cluster]", "3", "table"]),
        (
            "[limits]\nmax_prompt_tokens = 4000\n",
            ["[limits] max_prompt_tokens", "4000", "[decode] max_context_tokens = 2048"],
        ),
        ("[cluster\nport = 1\n", ["not valid TOML", "line 1"]),
    ],
)
def test_config_error_names_file_section_key_value(tmp_path: Path, text: str, named: list[str]) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ")
    for part in named:
        assert part in message


def test_config_defaults_and_overrides(tmp_path: Path) -> None:
    """Missing keys take their defaults; with_overrides is checked like the file; a missing file is named."""
    path = tmp_path / "small.toml"
    path.write_text("[cluster]\nnum_decode = 2\n")
    config = load_config(path)
    assert config.cluster.num_decode == 2 and config.cluster.num_prefill == 2
    assert config.slo.ttft_s == 30.0 and isinstance(config.policy.threshold, float)
    assert config.with_overrides("slo", ttft_s=2).slo.ttft_s == 2.0
    assert config.cluster.port == 8000  # overrides make copies
    with pytest.raises(ConfigError, match=r"\[cluster\] port = -1"):
        config.with_overrides("cluster", port=-1)
    with pytest.raises(ConfigError, match=r"\[nope\]"):
        config.with_overrides("nope", x=1)
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(tmp_path / "missing.toml")
