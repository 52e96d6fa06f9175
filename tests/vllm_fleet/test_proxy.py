"""The vLLM router's HTTP side against stand-in servers (`fake.FakeVllm`), in the main suite.

The real servers' tests (`test_with_vllm.py`, `make test-vllm`) prove the router against vLLM itself; these
prove the proxy's own rules anywhere: streams pass through line by line with the usage chunk shown only
to a client that asked for it, whole answers pass through unchanged with the route headers, a server that
refuses connections or answers 503 is marked down and the request served by another, a server that
answers again is marked up, a burst over the TTFT objective gets 429 with Retry-After, a prompt beyond
the context is a 400, a missing API key a 401, and a client that leaves aborts its request upstream. Every
fake and router is stopped at the end; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("transformers")

from serving.api import DECODE_HEADER, PREFILL_HEADER
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import RouterConfig, parse_router_config
from vllm_fleet.model import words
from vllm_fleet.servers import free_port

from tests.vllm_fleet.fake import FakeVllm
from tests.vllm_fleet.http import fetch


def router_config(fakes: list[FakeVllm], tokenizer_dir: Path, roles: Sequence[str] = (), **router: Any) -> RouterConfig:
    settings = {
        "port": 0,
        "block_size": 32,
        "tokenizer": str(tokenizer_dir),
        "health_interval_s": 0.2,
        "calibration_tokens": 256,
        **router,
    }
    instances: list[dict[str, Any]] = [{"url": f.url, "kv_events": f"tcp://127.0.0.1:{free_port()}"} for f in fakes]
    for instance, role in zip(instances, roles, strict=False):
        instance["role"] = role
    return parse_router_config({"router": settings, "instances": instances}, "test.toml")


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    answer = fetch(url, body, headers)
    return answer.status_code, answer.headers, answer.text.encode()


def wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_streams_and_whole_answers_pass_through(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        status, headers, body = post(
            f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada keli", "max_tokens": 5, "stream": True}
        )
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in body.decode().split("\n\n") if line]
        assert len(events) == 6 and events[-1] == "data: [DONE]"  # five tokens, no usage chunk: not asked for
        upstream = (
            fakes[0].received[-1] if fakes[0].received[-1].get("prompt") == "bada keli" else fakes[1].received[-1]
        )
        # The usage, for the router's count; not in every chunk (the client asked for none).
        assert upstream["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
        _, _, asked = post(
            f"{router.url}/v1/completions",
            {
                "model": "tiny",
                "prompt": "bada",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert b'"usage"' in asked
        for options in ({}, {"continuous_usage_stats": True}):  # vLLM 0.32's defaults: no usage chunk for these
            _, _, defaulted = post(
                f"{router.url}/v1/completions",
                {"model": "tiny", "prompt": "bada", "max_tokens": 2, "stream": True, "stream_options": options},
            )
            assert b'"usage"' not in defaulted and defaulted.endswith(b"data: [DONE]\n\n")
        status, _, refused = post(
            f"{router.url}/v1/completions",
            {"model": "tiny", "prompt": "bada", "max_tokens": 2, "stream_options": {"include_usage": True}},
        )
        assert status == 400 and b"stream_options" in refused
        status, headers, body = post(
            f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", "max_tokens": 3}
        )
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
        assert headers[PREFILL_HEADER] in ("vllm-0", "vllm-1")
        assert router.read(lambda r: len(r.fleet.flights)) == 0


def test_prefix_hits_are_counted_as_the_server_reports_them(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """The router's prefix-hit counter takes each answer's `prompt_tokens_details.cached_tokens` (whole answers
    and streams alike), not the prefix it expected; the X-Mooncake-Cached-Tokens header stays the expectation."""
    for fake in fakes:
        fake.cached_tokens = 7
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "bada keli", "max_tokens": 2, "stream": stream}
            status, headers, _ = post(f"{router.url}/v1/completions", body)
            assert status == 200 and headers["X-Mooncake-Cached-Tokens"] == "0"
        metrics = fetch(f"{router.url}/metrics").text
        hits = [line for line in metrics.splitlines() if line.startswith("mooncake:prefix_cache_hits_total")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) == 14, metrics

        def total(family: str) -> float:
            lines = fetch(f"{router.url}/metrics").text.splitlines()
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(family))

        # A scored prompt reads no cached prefix on vLLM: its prompt counts, no query or hit, as vLLM counts it.
        queries, prompts = total("mooncake:prefix_cache_queries_total"), total("mooncake:prompt_tokens_total")
        body = {"model": "tiny", "prompt": "bada keli", "max_tokens": 2, "prompt_logprobs": 1}
        assert post(f"{router.url}/v1/completions", body)[0] == 200
        assert total("mooncake:prefix_cache_queries_total") == queries
        assert total("mooncake:prompt_tokens_total") > prompts
        assert total("mooncake:prefix_cache_hits_total") == 14


def test_a_failing_server_is_routed_around_and_restored(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    with BackgroundRouter(router_config(fakes, tokenizer_dir, health_interval_s=30.0)) as router:
        fakes[0].stop()  # refuses connections now
        fakes[1].status = 503
        status, _, _ = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", "max_tokens": 2})
        assert status in (502, 503)  # both failed: the request could not be served
        fakes[1].status = 200
        assert router.read(lambda r: {i: x.up for i, x in r.fleet.instances.items()}) == {
            "vllm-0": False,
            "vllm-1": False,
        }
    with BackgroundRouter(router_config(fakes[1:], tokenizer_dir)) as router:
        fakes[1].status = 503
        status, _, _ = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", "max_tokens": 2})
        assert status == 503  # marked down, and no other server is up
        fakes[1].status = 200
        wait_until(lambda: router.read(lambda r: r.fleet.instances["vllm-0"].up))  # its /health answers
        status, headers, _ = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", "max_tokens": 2})
        assert status == 200 and headers[PREFILL_HEADER] == "vllm-0"


def test_a_server_down_sends_its_requests_to_the_other(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        fakes[0].stop()
        for i in range(4):
            status, headers, _ = post(
                f"{router.url}/v1/completions", {"model": "tiny", "prompt": words(20, seed=i), "max_tokens": 2}
            )
            assert status == 200 and headers[PREFILL_HEADER] == "vllm-1"
        assert router.read(lambda r: r.fleet.instances["vllm-0"].up) is False
        fakes[0].start()  # the same port again
        wait_until(lambda: router.read(lambda r: r.fleet.instances["vllm-0"].up))


def test_a_disaggregated_pair_prefills_then_decodes_with_the_transfer_parameters(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """vLLM's two-step flow: the prompt with max_tokens 1 on the prefill server, asking for a remote decode;
    then the client's request, with the `kv_transfer_params` the prefill server answered, on the decode
    server, whose answer streams back."""
    prefill, decode = fakes
    with BackgroundRouter(router_config(fakes, tokenizer_dir, roles=("prefill", "decode"))) as router:
        body = {"model": "tiny", "prompt": words(80, seed=3), "max_tokens": 5, "stream": True}
        status, headers, text = post(f"{router.url}/v1/completions", body)
        assert status == 200 and (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("vllm-0", "vllm-1")
        assert [line for line in text.decode().split("\n\n") if line][-1] == "data: [DONE]"
        first, second = prefill.received[-1], decode.received[-1]
        assert first["prompt"] == second["prompt"] == body["prompt"]
        assert first["max_tokens"] == 1 and "stream" not in first and first["kv_transfer_params"]["do_remote_decode"]
        assert second["max_tokens"] == 5 and second["stream"] is True
        assert second["kv_transfer_params"]["do_remote_prefill"] is True
        assert second["kv_transfer_params"]["remote_engine_id"] == f"fake-{prefill.port}"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "bada keli"}], "max_completion_tokens": 3}
        status, _, text = post(f"{router.url}/v1/chat/completions", chat)
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
        assert prefill.received[-1]["max_completion_tokens"] == 1 and decode.received[-1]["max_completion_tokens"] == 3
        # A floor on the output is the decode step's: the prefill step of one token would be vLLM's 400.
        status, _, _ = post(f"{router.url}/v1/completions", {**body, "stream": False, "min_tokens": 4})
        assert status == 200 and "min_tokens" not in prefill.received[-1] and decode.received[-1]["min_tokens"] == 4
        prefill.status = 400  # the prefill server's own refusal is the client's answer; no decode is asked
        asked = len(decode.received)
        status, _, _ = post(f"{router.url}/v1/completions", {**body, "stream": False})
        assert status == 400 and len(decode.received) == asked
        assert router.read(lambda r: len(r.fleet.flights)) == 0
        assert router.read(lambda r: [len(v.queue) for v in r.fleet.conductor.prefill_views]) == [0]


def test_a_failed_prefill_or_decode_server_is_routed_around(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    more = [FakeVllm(fakes[0].tokenizer).start() for _ in range(2)]
    try:
        servers = [fakes[0], more[0], fakes[1], more[1]]
        roles = ("prefill", "prefill", "decode", "decode")
        with BackgroundRouter(router_config(servers, tokenizer_dir, roles=roles, health_interval_s=30.0)) as router:
            servers[0].stop()  # refuses connections
            servers[2].status = 503
            for i in range(3):
                body = {"model": "tiny", "prompt": words(40, seed=i), "max_tokens": 2}
                status, headers, _ = post(f"{router.url}/v1/completions", body)
                assert status == 200 and (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("vllm-1", "vllm-3")
            up = router.read(lambda r: {i: x.up for i, x in r.fleet.instances.items()})
            assert up == {"vllm-0": False, "vllm-1": True, "vllm-2": False, "vllm-3": True}
            assert router.read(lambda r: len(r.fleet.flights)) == 0
    finally:
        for server in more:
            server.stop()


def test_another_clients_waiting_requests_count_as_queue(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """Requests a server says wait there beyond the router's own (`vllm:num_requests_waiting`) are a backlog:
    new requests go to the other server until the count drops."""
    for fake in fakes:
        fake.seconds_per_token = 0.0005  # a 512-token prompt in 0.25 s: forty of them wait 10 s
    fakes[0].waiting = 40
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        wait_until(lambda: router.read(lambda r: r.fleet.conductor.prefill_views[0].queue_s(time.monotonic())) > 0)
        for i in range(3):
            status, headers, _ = post(
                f"{router.url}/v1/completions", {"model": "tiny", "prompt": words(30, seed=70 + i), "max_tokens": 2}
            )
            assert status == 200 and headers[PREFILL_HEADER] == "vllm-1"
        fakes[0].waiting = 0
        wait_until(lambda: router.read(lambda r: r.fleet.conductor.prefill_views[0].backlog_until_s) == -math.inf)


def test_a_burst_over_the_objective_gets_429s(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """16 prompts (8 queued per server) under an objective of three lone prefills of one, as the router's
    calibrated model estimates it: the first on each server fit and the last do not, however fast or
    loaded this machine is (a fixed objective is met by the whole burst or by none of it on some day)."""
    for fake in fakes:
        fake.seconds_per_token = 0.0005  # 0.25 s for 500 tokens
    prompts = [words(200, seed=50 + i) for i in range(16)]
    with BackgroundRouter(router_config(fakes, tokenizer_dir, calibration_tokens=512)) as probe:
        lone = probe.read(lambda r: r.fleet.prefill_model.prefill_s(len(r.tokenizer.encode(prompts[0])), 0))
    slo = round(3 * lone, 4)
    with BackgroundRouter(router_config(fakes, tokenizer_dir, ttft_slo_s=slo, calibration_tokens=512)) as router:
        body = {"model": "tiny", "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(
                pool.map(lambda prompt: post(f"{router.url}/v1/completions", {**body, "prompt": prompt}), prompts)
            )
        statuses = sorted(status for status, _, _ in answers)
        assert 200 in statuses and 429 in statuses, statuses
        for status, headers, text in answers:
            if status == 429:
                assert int(headers["Retry-After"]) >= 1 and json.loads(text)["error"]["type"] == "rate_limit_error"
        assert router.read(lambda r: len(r.fleet.flights)) == 0


def test_bad_requests_are_refused_before_any_server(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    with BackgroundRouter(router_config(fakes, tokenizer_dir, api_key="secret")) as router:
        before = sum(len(f.received) for f in fakes)
        status, _, _ = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada"})
        assert status == 401
        key = {"Authorization": "Bearer secret"}
        status, _, text = post(
            f"{router.url}/v1/completions", {"model": "tiny", "prompt": list(range(2049)), "max_tokens": 1}, key
        )
        error = json.loads(text)["error"]
        assert (status, error["param"]) == (400, "input_tokens")
        assert error["message"].startswith("This model's maximum context length is 2048 tokens. However, your prompt")
        status, _, _ = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": ""}, key)
        assert status == 400
        for bad in ({"max_tokens": 0}, {"max_tokens": "8.5"}, {"max_tokens": "1e3"}):  # vLLM's 400s
            status, _, text = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", **bad}, key)
            assert status == 400 and json.loads(text)["error"]["param"] in bad
        for bad_stream in ("maybe", 2, [True]):  # no boolean pydantic reads: vLLM's 400, naming the value
            status, _, text = post(
                f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", "stream": bad_stream}, key
            )
            error = json.loads(text)["error"]
            assert (status, error["param"]) == (400, "stream") and repr(bad_stream) in error["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
        for bad_max in ("abc", [1], {"x": 1}):  # typed by vLLM's chat model though max_completion_tokens sets the limit
            status, _, text = post(f"{router.url}/v1/chat/completions", {**chat, "max_tokens": bad_max}, key)
            assert (status, json.loads(text)["error"]["param"]) == (400, "max_tokens"), (bad_max, text)
        assert sum(len(f.received) for f in fakes) == before
        # What vLLM's pydantic takes: "8" is 8; a completion has no max_completion_tokens, and ignores one.
        for taken in ({"max_tokens": "8"}, {"max_tokens": 2, "max_completion_tokens": 1.5}):
            status, _, text = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada", **taken}, key)
            assert status == 200, (taken, text)
        status, _, text = post(f"{router.url}/v1/chat/completions", {**chat, "max_tokens": "7"}, key)
        assert status == 200, text
        # vLLM asks for the key under /v1 only: /tokenize and /detokenize answer without it.
        assert post(f"{router.url}/tokenize", {"model": "tiny", "prompt": "bada"})[0] == 200
        assert post(f"{router.url}/detokenize", {"model": "tiny", "tokens": [1, 2]})[0] == 200


def test_a_prompt_that_fits_is_served_with_max_tokens_trimmed_as_vllm_trims_it(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """vLLM 0.32 refuses a prompt longer than `max_model_len` and a `max_tokens` over it (test below); any other
    request is served, its `max_tokens` (or the default) trimmed to the room the prompt leaves (`get_max_tokens`):
    so is it through the router, which plans it for that room and forwards the body unchanged."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        for prompt, extra in (
            (list(range(2000)), {"max_tokens": 100}),  # 48 tokens of room: served, 48 at most
            (list(range(2040)), {}),  # a completion's default 16, over the room of 8
            (list(range(2028)), {"max_completion_tokens": None, "max_tokens": 21}),
            (list(range(2047)), {"max_tokens": 2000}),  # one token of room
            (list(range(2047)), {"max_tokens": 2048}),  # the whole context: not over it, so trimmed too
        ):
            body = {"model": "tiny", "prompt": prompt, **extra}
            status, _, text = post(f"{router.url}/v1/completions", body)
            assert status == 200, text
            (upstream,) = [b for fake in fakes for b in fake.received if b.get("prompt") == prompt]
            assert upstream == body  # unchanged: the server trims it itself
            for fake in fakes:
                fake.received.clear()
        assert router.read(lambda r: len(r.fleet.flights)) == 0
        # A prompt that leaves no room at all: vLLM's SamplingParams refuses max_tokens 0.
        status, _, text = post(f"{router.url}/v1/completions", {"model": "tiny", "prompt": list(range(2048))})
        assert (status, json.loads(text)["error"]["param"]) == (400, "max_tokens")


def test_max_tokens_over_the_whole_context_is_refused_as_vllm_refuses_it(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """vLLM 0.32's `TokenizeParams`: a `max_tokens` (a chat's `max_completion_tokens` where set) over
    `max_model_len` (2048, the fleet's longest) fits beside no prompt and every server would refuse it, so the
    router does, with vLLM's 400 naming that field, before any server sees it or the Conductor plans it: never
    a refusal turned into a trimmed, served request."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        before = sum(len(f.received) for f in fakes)  # the router's calibration at start
        for path, body, field in (
            ("/v1/completions", {"prompt": "bada", "max_tokens": 2049}, "max_tokens"),
            ("/v1/completions", {"prompt": list(range(4000)), "max_tokens": 2049}, "max_tokens"),  # before the prompt
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
                "max_tokens",
            ),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 2049},
                "max_completion_tokens",
            ),
        ):
            status, _, text = post(f"{router.url}{path}", {"model": "tiny", **body})
            error = json.loads(text)["error"]
            assert (status, error["param"]) == (400, field), text
            assert error["message"] == (
                f"{field}={body[field]} cannot be greater than max_model_len=2048. Please request fewer output tokens."
            )
        assert sum(len(f.received) for f in fakes) == before
        assert router.read(lambda r: len(r.fleet.flights)) == 0


def test_echo_with_max_tokens_zero_and_a_string_stream_are_read_as_vllm_reads_them(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """`echo: true, max_tokens: 0` (lm-eval-harness's loglikelihood requests) is served, as vLLM serves it (the
    prompt scored, nothing generated); without echo, max_tokens 0 is vLLM's 400. `"stream": "false"` is no
    stream in vLLM (pydantic's lax bool): a whole answer, and the server is sent a boolean."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        body = {"model": "tiny", "prompt": "bada keli", "echo": True, "max_tokens": 0, "logprobs": 1}
        status, _, text = post(f"{router.url}/v1/completions", body)
        assert status == 200, text
        assert [b for fake in fakes for b in fake.received if b.get("prompt") == "bada keli"] == [body]
        status, _, text = post(f"{router.url}/v1/completions", {**body, "echo": False})
        assert (status, json.loads(text)["error"]["param"]) == (400, "max_tokens")
        for zero in ("0", False, 0.0):  # pydantic's lax int: each is 0
            status, _, text = post(f"{router.url}/v1/completions", {**body, "max_tokens": zero})
            assert status == 200, (zero, text)
        for text_flag, streamed in (("false", False), ("True", True), (0, False)):
            status, headers, answer = post(
                f"{router.url}/v1/completions",
                {"model": "tiny", "prompt": "sunu", "max_tokens": 2, "stream": text_flag},
            )
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream") is streamed
            assert answer.endswith(b"data: [DONE]\n\n") is streamed
            (upstream,) = [b for fake in fakes for b in fake.received if b.get("prompt") == "sunu"]
            assert upstream["stream"] is streamed
            for fake in fakes:
                fake.received.clear()


def test_a_line_past_aiohttps_buffer_streams_whole_and_the_request_ends(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """A 700 kB chunk (what prompt log-probabilities of a long prompt are in one SSE line) passes through whole;
    aiohttp's line reader refused it, and the request stayed in flight in the router for good."""
    for fake in fakes:
        fake.first_text = "y" * 700_000
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        status, _, body = post(
            f"{router.url}/v1/completions", {"model": "tiny", "prompt": "bada keli", "max_tokens": 3, "stream": True}
        )
        assert status == 200 and body.count(b"y" * 700_000) == 1 and body.endswith(b"data: [DONE]\n\n")
        assert router.read(lambda r: (len(r.fleet.flights), len(r.fleet.conductor.in_flight))) == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_headers_pass_both_ways(fakes: list[FakeVllm], tokenizer_dir: Path, stream: bool) -> None:
    """The client's end-to-end headers reach the server (a server's API key, a request id) and the server's come
    back, on a stream too; the connection's own do not pass."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        sent = {"Authorization": "Bearer server-key", "X-Request-Id": "req-7", "Connection": "close"}
        status, headers, _ = post(
            f"{router.url}/v1/completions",
            {"model": "tiny", "prompt": "bada keli", "max_tokens": 2, "stream": stream},
            headers=sent,
        )
        assert status == 200 and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "req-7"
        (seen,) = [{k.lower(): v for k, v in h.items()} for fake in fakes for h in fake.headers if "X-Request-ID" in h]
        assert seen["authorization"] == "Bearer server-key" and seen["x-request-id"] == "req-7"
        assert seen.get("connection", "").lower() != "close"


def test_servers_started_with_an_api_key_get_theirs(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """Servers started with `--api-key`: with `server_api_key` the router probes and calibrates them, and sends them
    their key in place of the client's (which was the router's own to check)."""
    for fake in fakes:
        fake.api_key = "server-key"
    settings = {"api_key": "client-key", "server_api_key": "server-key"}
    with BackgroundRouter(router_config(fakes, tokenizer_dir, **settings)) as router:
        body = {"model": "tiny", "prompt": "bada keli", "max_tokens": 2}
        assert post(f"{router.url}/v1/completions", body)[0] == 401  # no key for the router
        status, _, _ = post(f"{router.url}/v1/completions", body, headers={"Authorization": "Bearer client-key"})
        assert status == 200
        sent = [h for fake in fakes for h in fake.headers]  # the calibration's requests and the client's
        assert len(sent) > 1 and all(h["Authorization"] == "Bearer server-key" for h in sent)


def test_usage_in_every_chunk_only_with_the_usage_asked_for(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """vLLM reads `continuous_usage_stats` only beside `include_usage`: a client asking for it without the usage
    gets none, as from vLLM itself (the router asks for the usage for its count, and not in every chunk)."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        options = {"include_usage": False, "continuous_usage_stats": True}
        body = {"model": "tiny", "prompt": "bada", "max_tokens": 3, "stream": True, "stream_options": options}
        status, _, answer = post(f"{router.url}/v1/completions", body)
        assert status == 200 and b"usage" not in answer
        (upstream,) = [b for fake in fakes for b in fake.received if b["prompt"] == "bada"]
        assert upstream["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_a_chat_without_max_tokens_is_planned_for_the_room_its_prompt_leaves(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """vLLM runs a chat that sets no max_tokens to the context's end: one whose prompt leaves less room than
    `default_max_tokens` is served (it was refused as too long); one with no room at all is not."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir, default_max_tokens=256)) as router:

        def chat_tokens(text: str) -> int:
            return len(router.read(lambda r: r.tokenizer.encode_chat([{"role": "user", "content": text}])))

        text = next(t for n in range(600, 1000, 4) if 2048 - 256 < chat_tokens(t := words(n, seed=3)) < 2040)
        status, _, _ = post(
            f"{router.url}/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]}
        )
        assert status == 200
        (upstream,) = [b for fake in fakes for b in fake.received if "messages" in b]
        assert "max_tokens" not in upstream  # the body goes as the client sent it
        long = {"model": "tiny", "messages": [{"role": "user", "content": words(2100, seed=4)}]}
        assert post(f"{router.url}/v1/chat/completions", long)[0] == 400


def test_a_chat_of_content_parts_is_served(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """The OpenAI SDK's `content: [{"type": "text", "text": ...}]` is read as vLLM reads it (the texts joined,
    the prompt that of the same string: the router answered 400, "can only concatenate str (not "list") to
    str"); a part that is no text (an image, for a multimodal model) is routed by the texts, for the server to
    answer. Both bodies go to the server unchanged."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir, calibration_tokens=0)) as router:
        text = words(40, seed=5)
        parts = [{"type": "text", "text": text}]
        image = [*parts, {"type": "image_url", "image_url": {"url": "data:,"}}]
        for content in (parts, image):
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
            status, _, answer = post(f"{router.url}/v1/chat/completions", body)
            assert status == 200, answer
            assert body["messages"] in [b.get("messages") for f in fakes for b in f.received]
        same = router.read(lambda r: r.tokenizer.encode_chat([{"role": "user", "content": text}]))
        assert router.read(lambda r: r.tokenizer.encode_chat([{"role": "user", "content": parts}])) == same


def test_tokenize_detokenize_and_models_are_the_servers(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """/tokenize and /detokenize go to a server that is up; /v1/models lists the model as a server does (with
    its max_model_len)."""
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        fakes[0].stop()
        router.read(lambda r: r._mark("vllm-0", False))
        status, _, tokens = post(f"{router.url}/tokenize", {"model": "tiny", "prompt": "bada keli"})
        assert status == 200
        ids = json.loads(tokens)["tokens"]
        status, _, text = post(f"{router.url}/detokenize", {"model": "tiny", "tokens": ids})
        assert status == 200 and json.loads(text)["prompt"].endswith("bada keli")
        models = fetch(f"{router.url}/v1/models").json()["data"]
        assert models == [{"id": "tiny", "max_model_len": 2048}]
        router.read(lambda r: r._mark("vllm-1", False))
        assert post(f"{router.url}/tokenize", {"model": "tiny", "prompt": "x"})[0] == 503


def test_a_burst_past_a_hundred_connections_reaches_the_servers_and_keeps_them_up(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """120 streams at once reach the servers together (aiohttp's default pool held 100, the rest waited there,
    counted as queued) and no health check waits behind them (they timed out and marked healthy servers down)."""
    for fake in fakes:
        fake.seconds_between_tokens = 0.1  # ten tokens: about a second a stream
    with BackgroundRouter(router_config(fakes, tokenizer_dir, ttft_slo_s=1000.0)) as router:
        body = {"model": "tiny", "max_tokens": 10, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(120) as pool:
            answers = list(
                pool.map(lambda i: post(f"{router.url}/v1/completions", {**body, "prompt": f"bada {i}"})[0], range(120))
            )
        assert answers == [200] * 120
        assert sum(fake.peak for fake in fakes) > 100
        assert router.read(lambda r: all(x.up for x in r.fleet.instances.values()))


def test_an_unreadable_metrics_page_does_not_stop_the_health_checks(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """A /metrics page that is not UTF-8 once ended the health loop, so a server marked down never came back."""
    for fake in fakes:
        fake.metrics_tail = b"\xff\xfe broken\n"
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        router.read(lambda r: r._mark("vllm-0", False))
        wait_until(lambda: router.read(lambda r: r.fleet.instances["vllm-0"].up))


def test_a_client_that_leaves_aborts_its_request_upstream(
    fakes: list[FakeVllm], tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A streaming client that leaves mid-answer: the router closes the upstream connection (the server aborts
    the request), the flight ends, and nothing is logged as an error (a client leaving is
    not the router's failure, whether aiohttp cancels the handler first or the next write to the client fails)."""
    import logging
    import socket

    caplog.set_level(logging.WARNING)
    with BackgroundRouter(router_config(fakes, tokenizer_dir)) as router:
        port = int(router.url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "prompt": "bada", "max_tokens": 1500, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert client.recv(1024).startswith(b"HTTP/1.1 200")
        wait_until(lambda: sum(f.aborted for f in fakes) == 1)
        wait_until(lambda: router.read(lambda r: len(r.fleet.flights)) == 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("how", ["shutdown", "close"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_first_byte_aborts_its_request_upstream(
    fakes: list[FakeVllm], tokenizer_dir: Path, stream: bool, how: str
) -> None:
    """A client that closes its socket (or only its write side: a FIN) while the server is still prefilling, a
    whole answer or a stream's first byte, aborts the request upstream, as vLLM aborts it for a client gone; the
    flight ends. aiohttp does not cancel a handler on a FIN, so a whole answer was waited for to its end."""
    import socket

    for fake in fakes:
        fake.seconds_per_token = 1.0  # a prefill of seconds: the client leaves long before it ends
    with BackgroundRouter(router_config(fakes, tokenizer_dir, calibration_tokens=0)) as router:
        port = int(router.url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "prompt": "bada keli sunu", "max_tokens": 5, "stream": stream}).encode()
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(lambda: sum(f.active for f in fakes) == 1)
            if how == "shutdown":
                client.shutdown(socket.SHUT_WR)
            else:
                client.close()
            wait_until(lambda: sum(f.aborted for f in fakes) == 1, timeout_s=2.5)
            wait_until(lambda: router.read(lambda r: len(r.fleet.flights)) == 0, timeout_s=2.5)
        finally:
            client.close()


def test_the_command_line_serves_until_sigterm_and_reports_bad_config(
    fakes: list[FakeVllm], tokenizer_dir: Path, tmp_path: Path
) -> None:
    """`examples/vllm_router.py --config` prints its URL when ready, serves, and stops on SIGTERM; a bad
    config is one `error:` line and exit status 1."""
    import signal
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "vllm_router.py"
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[router]\ntokenizer = "{tokenizer_dir}"\nblock_size = 16\n' + instances_toml(fakes))
    done = subprocess.run(
        [sys.executable, str(script), "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]  # the servers are probed together: either may be named
    assert last.startswith("error: instance vllm-") and "stores blocks of 32 tokens, [router] block_size = 16" in last
    good = tmp_path / "good.toml"
    good.write_text(
        f'[router]\nport = 0\ntokenizer = "{tokenizer_dir}"\nblock_size = 32\ncalibration_tokens = 64\n'
        + instances_toml(fakes)
    )
    process = subprocess.Popen(
        [sys.executable, str(script), "--config", str(good)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("vllm router ready: http://127.0.0.1:"), line
        url = line.split()[3]
        status, _, _ = post(f"{url}/v1/completions", {"model": "tiny", "prompt": "bada", "max_tokens": 2})
        assert status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def instances_toml(fakes: list[FakeVllm]) -> str:
    return "".join(f'[[instances]]\nurl = "{f.url}"\nkv_events = "tcp://127.0.0.1:{free_port()}"\n' for f in fakes)
