"""The vLLM router against stand-in servers that fail or answer in ways the main tests' fakes do not.

What each test proves: a slow or failing `/metrics` leaves a healthy server up with its cache in the index, and
one failed `/health` does not mark it down (`health_failures` in a row do); every name of
`--served-model-name a b` is the model's (its prefixes hit) and `/v1/models` lists every card; prompt ids out of
range are a counted 400 naming `prompt`; an answer that is not HTTP fails over like a refused connection; a
failure inside the router is a counted OpenAI-shaped 500; the router counts generated tokens, observes
inter-token latency on streams only, and counts finish reasons as vLLM's engine does; a bad URL and a port in
use are one-line ConfigErrors; a disaggregated pair whose decode server fails after the prefill says so, and
`/health` says a fleet without a decode server up cannot serve. Every server and router is stopped; every wait
is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("transformers")

from aiohttp import web
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import parse_router_config
from vllm_fleet.proxy import _adapter
from vllm_fleet.upstream import probe

from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError
from tests.vllm_fleet.fake import FakeVllm
from tests.vllm_fleet.http import fetch
from tests.vllm_fleet.test_fleet_edges import MODEL, post, proxy_config, sample, stored
from tests.waiting import wait_for

BLOCK = 32


class StandIn(FakeVllm):
    """A `FakeVllm` with more switches: `metrics_delay_s` (a slow /metrics), `health_blips` (the next /health
    answers that are 503), `cards` (its /v1/models data), `finish_reason` (what its answers end with, as a chat
    with tools answers), `garbage` (completions answered with bytes that are not HTTP)."""

    def __init__(self, tokenizer: Any, **options: Any) -> None:
        super().__init__(tokenizer, **options)
        self.metrics_delay_s = 0.0
        self.health_blips = 0
        self.health_answers = 0
        self.cards: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None
        self.garbage = False

    async def _models(self, request: web.Request) -> web.Response:
        if self.cards is None:
            return await super()._models(request)
        return web.json_response({"object": "list", "data": self.cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.metrics_delay_s)
        return await super()._metrics(request)

    async def _health(self, request: web.Request) -> web.Response:
        self.health_answers += 1
        if self.health_blips > 0:
            self.health_blips -= 1
            return web.Response(status=503)
        return await super()._health(request)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if self.garbage:
            await request.read()
            assert request.transport is not None
            request.transport.write(b"NOT-HTTP garbage\r\n\r\n")
            request.transport.close()
            return web.Response()
        if self.finish_reason is None:
            return await super()._complete(request)
        body = await request.json()
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant"}, "finish_reason": self.finish_reason}
            return web.json_response({"id": "c", "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": self.finish_reason}]},
            {"choices": [], "usage": usage},
        ]
        for chunk in chunks:  # vLLM's spacing: none
            await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def stand_ins(tokenizer_dir: Path) -> Iterator[list[StandIn]]:
    tokenizer = load_tokenizer(tokenizer_dir)
    servers: list[StandIn] = []
    try:
        for _ in range(2):
            servers.append(StandIn(tokenizer).start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def _downs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " is down" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- health


def test_a_slow_metrics_page_leaves_the_server_up_with_its_cache(
    stand_ins: list[StandIn], tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A /metrics slower than connect_timeout_s (a busy engine) once marked a healthy server down, and its
    blocks left the index for good (no replay socket). Now its load stays as last read, shown stale, and it
    stays up with its blocks; a /metrics that answers again clears the mark and updates the load."""
    caplog.set_level(logging.WARNING, logger="vllm_router")
    config = proxy_config(stand_ins, tokenizer_dir, health_interval_s=0.05, connect_timeout_s=0.5)
    with BackgroundRouter(config) as router:
        router.read(lambda r: stored(r.fleet, "vllm-0", list(range(1, 4 * BLOCK + 1)), 0))
        assert router.read(lambda r: r.fleet.cached_blocks("vllm-0")) == 4
        stand_ins[0].metrics_delay_s = 1.5
        seen = stand_ins[0].health_answers
        wait_for(lambda: stand_ins[0].health_answers >= seen + 3, timeout=10, what="three more health checks")
        assert router.read(lambda r: (r.fleet.instances["vllm-0"].up, r.fleet.cached_blocks("vllm-0"))) == (True, 4)
        assert not _downs(caplog)
        assert fetch(f"{router.url}/health").json()["instances"]["vllm-0"]["load_stale"] is True
        stand_ins[0].metrics_delay_s, stand_ins[0].waiting = 0.0, 3
        wait_for(
            lambda: router.read(lambda r: r.fleet.instances["vllm-0"].state.waiting) == 3,
            timeout=10,
            what="the load read again",
        )
        assert "load_stale" not in fetch(f"{router.url}/health").json()["instances"]["vllm-0"]


def test_one_failed_health_check_is_a_blip_and_health_failures_in_a_row_mark_down(
    stand_ins: list[StandIn], tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One failed /health (health_failures = 2) leaves the server up with its blocks; two in a row mark it
    down, as a server that keeps failing its checks is."""
    caplog.set_level(logging.WARNING, logger="vllm_router")
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir, health_interval_s=0.05)) as router:
        router.read(lambda r: stored(r.fleet, "vllm-0", list(range(1, 4 * BLOCK + 1)), 0))
        stand_ins[0].health_blips = 1
        wait_for(lambda: stand_ins[0].health_blips == 0, timeout=10, what="the blip")
        seen = stand_ins[0].health_answers
        wait_for(lambda: stand_ins[0].health_answers >= seen + 2, timeout=10, what="two more health checks")
        assert router.read(lambda r: (r.fleet.instances["vllm-0"].up, r.fleet.cached_blocks("vllm-0"))) == (True, 4)
        assert not _downs(caplog)
        stand_ins[0].healthy = False
        wait_for(lambda: not router.read(lambda r: r.fleet.instances["vllm-0"].up), timeout=10, what="vllm-0 down")
        assert _downs(caplog) and "2 health checks failed in a row" in _downs(caplog)[0]
        assert router.read(lambda r: r.settings.health_failures) == 2  # the documented default


# ---------------------------------------------------------------------------------------------- served names


def test_every_served_name_is_the_models_and_models_lists_every_card(
    stand_ins: list[StandIn], tokenizer_dir: Path
) -> None:
    """`--served-model-name tiny tiny-alias` lists both names without a `parent`: a request naming the alias
    is keyed in the model's namespace (it hits the prefix the server holds), an adapter's (with `parent`) in
    its own; the router's /v1/models lists all three cards."""
    cards = [
        {"id": MODEL, "max_model_len": 2048, "parent": None},
        {"id": "tiny-alias", "max_model_len": 2048, "parent": None},
        {"id": "sql-lora", "max_model_len": 2048, "parent": MODEL},
    ]
    for server in stand_ins:
        server.cards = cards
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        listed = fetch(f"{router.url}/v1/models").json()["data"]
        assert [card["id"] for card in listed] == [MODEL, "tiny-alias", "sql-lora"]
        assert listed[2]["parent"] == MODEL
        prompt = list(range(1, 4 * BLOCK + 2))
        for instance in ("vllm-0", "vllm-1"):
            router.read(lambda r, i=instance: stored(r.fleet, i, prompt[: 4 * BLOCK], 0))
        hits = {}
        for name in (MODEL, "tiny-alias", "sql-lora"):
            status, headers, _ = post(
                f"{router.url}/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 1}
            )
            assert status == 200
            hits[name] = int(headers["X-Mooncake-Cached-Tokens"])
        assert hits == {MODEL: 4 * BLOCK, "tiny-alias": 4 * BLOCK, "sql-lora": 0}


def test_a_scored_prompt_is_planned_without_the_cached_prefix(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """vLLM reads no cached prefix for a request that scores its prompt (`prompt_logprobs`, or `echo` with
    `logprobs`): the proxy plans such a request as computed whole (X-Mooncake-Cached-Tokens 0) where the same
    prompt unscored hits the prefix the servers hold."""
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        prompt = list(range(1, 4 * BLOCK + 2))
        for instance in ("vllm-0", "vllm-1"):
            router.read(lambda r, i=instance: stored(r.fleet, i, prompt[: 4 * BLOCK], 0))
        scoring: dict[str, dict[str, Any]] = {
            "plain": {},
            "prompt_logprobs": {"prompt_logprobs": 1},
            "echo": {"echo": True, "logprobs": 1},
            "echo_alone": {"echo": True},
        }
        hits = {}
        for name, extra in scoring.items():
            status, headers, _ = post(
                f"{router.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
            )
            assert status == 200, name
            hits[name] = int(headers["X-Mooncake-Cached-Tokens"])
        assert hits == {"plain": 4 * BLOCK, "prompt_logprobs": 0, "echo": 0, "echo_alone": 4 * BLOCK}


def test_the_probe_reads_the_served_names_and_adapter_reads_them(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """The probe's `served_names` are the cards without a parent; `_adapter` takes any of them for the model
    and one name as one name, not its letters."""
    stand_ins[0].cards = [
        {"id": "tiny-alias", "max_model_len": 512},
        {"id": MODEL, "max_model_len": 512, "parent": None},
        {"id": "sql-lora", "parent": "tiny-alias"},
    ]

    async def probed() -> Any:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return await probe(
                session,
                "vllm-0",
                stand_ins[0].url,
                block_size=BLOCK,
                tokenizer=load_tokenizer(tokenizer_dir),
                timeout_s=5,
            )

    info = asyncio.run(probed())
    assert (info.model, info.served_names, info.max_model_len) == ("tiny-alias", ("tiny-alias", MODEL), 512)
    assert len(info.cards) == 3
    assert _adapter({"model": MODEL}, info.served_names) is None
    assert _adapter({"model": "sql-lora"}, info.served_names) == "sql-lora"
    assert _adapter({"model": "tin"}, MODEL) == "tin"


# ---------------------------------------------------------------------------------------------- failures


def test_prompt_ids_out_of_range_are_a_counted_400_naming_prompt(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """Ids the block keys cannot hash (negative, past int32) were a plain-text 500 with a traceback, uncounted;
    now the router's 400, OpenAI's shape, `param` prompt, before any server sees them, and counted."""
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        for prompt in ([-1, 5], [2**31, 1]):
            status, _, text = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            error = json.loads(text)["error"]
            assert status == 400 and error["param"] == "prompt" and "token ids" in error["message"], text
        assert sample(router, "mooncake:http_responses_total", {"status": "400"}) == 2
        assert not stand_ins[0].received and not stand_ins[1].received
        assert router.read(lambda r: len(r.fleet.flights)) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_is_not_http_fails_over(stand_ins: list[StandIn], tokenizer_dir: Path, stream: bool) -> None:
    """A server answering bytes that are not HTTP (aiohttp's ClientResponseError, not a connection error) was
    a 500 with no failover; now it is marked down and the request served by the other, counted once."""
    stand_ins[0].garbage = True
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        prompt = list(range(1, 4 * BLOCK + 2))
        router.read(lambda r: stored(r.fleet, "vllm-0", prompt[: 4 * BLOCK], 0))  # routed there first
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": stream}
        for _ in range(2):
            status, headers, _ = post(f"{router.url}/v1/completions", body)
            assert status == 200 and headers["X-Mooncake-Decode-Instance"] == "vllm-1"
        assert router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [False, True]
        assert sample(router, "mooncake:http_responses_total", {"status": "200"}) == 2
        assert sample(router, "mooncake:http_responses_total", {"status": "500"}) == 0


def test_a_failure_inside_the_router_is_a_counted_500_in_openais_shape(
    stand_ins: list[StandIn], tokenizer_dir: Path
) -> None:
    """Whatever breaks inside the router, the client gets OpenAI's error with status 500, and it is counted."""
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:

        def broken(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        router.read(lambda r: setattr(r.fleet, "schedule", broken))
        status, _, text = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada", "max_tokens": 2})
        assert status == 500 and json.loads(text)["error"]["code"] == 500 and "a bug" in text
        assert sample(router, "mooncake:http_responses_total", {"status": "500"}) == 1


# ---------------------------------------------------------------------------------------------- metrics


def test_generated_tokens_and_inter_token_latency_are_counted(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """`generation_tokens` counts every answer's generated tokens (its usage); inter-token latency is observed
    between a stream's chunks (five tokens: four gaps), never for a whole answer (its tokens came at once)."""
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        engines = ("vllm-0", "vllm-1")

        def total(name: str) -> float:
            return sum(sample(router, name, {"engine": e}) for e in engines)

        body = {"model": MODEL, "prompt": "bada keli", "max_tokens": 5}
        assert post(f"{router.url}/v1/completions", {**body, "stream": True})[0] == 200
        assert total("mooncake:generation_tokens_total") == 5
        assert total("mooncake:inter_token_latency_seconds_count") == 4
        assert post(f"{router.url}/v1/completions", {**body, "max_tokens": 3})[0] == 200
        assert total("mooncake:generation_tokens_total") == 8
        assert total("mooncake:inter_token_latency_seconds_count") == 4
        assert total("mooncake:request_generation_tokens_sum") == 8


def test_finish_reasons_are_counted_as_vllms_engine_counts_them(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """`tool_calls` is the engine's stop, `abort` an abort (both were counted as `length`); streamed (vLLM's
    unspaced JSON, the reason on a chunk of its own) and whole alike. A chat's role chunk carries no token."""
    stand_ins[0].finish_reason = stand_ins[1].finish_reason = "stop"
    with BackgroundRouter(proxy_config(stand_ins, tokenizer_dir)) as router:
        for reason in ("tool_calls", "abort", "stop", "length"):
            stand_ins[0].finish_reason = stand_ins[1].finish_reason = reason
            for stream in (False, True):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                assert post(f"{router.url}/v1/chat/completions", {**body, "stream": stream})[0] == 200

        def count(reason: str) -> float:
            name = "mooncake:request_success_total"
            return sum(sample(router, name, {"engine": e, "finished_reason": reason}) for e in ("vllm-0", "vllm-1"))

        assert {reason: count(reason) for reason in ("stop", "length", "abort")} == {"stop": 4, "length": 2, "abort": 2}
        itl = sum(
            sample(router, "mooncake:inter_token_latency_seconds_count", {"engine": e}) for e in ("vllm-0", "vllm-1")
        )
        assert itl == 4  # two token chunks in each of four streams: one gap each


# ---------------------------------------------------------------------------------------------- start-up


def test_a_url_urllib_cannot_split_is_a_one_line_config_error(tokenizer_dir: Path) -> None:
    instance = {"url": "http://[::1", "kv_events": "tcp://127.0.0.1:5557"}
    with pytest.raises(ConfigError) as raised:
        parse_router_config({"router": {"tokenizer": str(tokenizer_dir)}, "instances": [instance]}, "r.toml")
    message = str(raised.value)
    assert message.startswith("r.toml: [[instances]] 0 url = 'http://[::1': is not a URL") and "\n" not in message


def test_a_port_in_use_is_a_one_line_config_error_naming_host_and_port(
    stand_ins: list[StandIn], tokenizer_dir: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as raised:
            BackgroundRouter(proxy_config(stand_ins, tokenizer_dir, port=port)).close()
    message = str(raised.value)
    assert f"[router] host = '127.0.0.1', port = {port}: the router cannot listen there" in message, message
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------- disaggregated


def test_a_decode_server_failing_after_the_prefill_says_so(stand_ins: list[StandIn], tokenizer_dir: Path) -> None:
    """The decode server's 503 after a prefill ran: the rejection names the decode side and its outcome is
    rejected_after_prefill (it said "no vLLM server is up", rejected_before_prefill); /health is 503 while no
    decode server is up, though the prefill server is."""
    config = proxy_config(stand_ins, tokenizer_dir, roles=("prefill", "decode"))
    with BackgroundRouter(config) as router:
        assert fetch(f"{router.url}/health").status_code == 200
        stand_ins[1].status = 503
        status, _, text = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada keli", "max_tokens": 3})
        error = json.loads(text)["error"]
        assert status == 503 and error["outcome"] == "rejected_after_prefill", text
        assert "decode server vllm-1 failed (HTTP 503) after the prefill on vllm-0 ran" in error["message"]
        assert "no decode server is up" in error["message"]
        assert len(stand_ins[0].received) == 1
        health = fetch(f"{router.url}/health")
        assert health.status_code == 503 and health.json()["instances"]["vllm-0"]["up"] is True
