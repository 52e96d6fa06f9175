"""examples/load.py's HTTP client (`replay_http`) against small servers of this module's own, in its event loop.

What a server may answer that the client must read tolerantly: a usage without `prompt_tokens_details` (vLLM
without `--enable-prompt-tokens-details`), a `data:` line that is no JSON or no completion chunk (that request
fails, of its kind; the others are measured); and more streams at once than aiohttp's default pool of 100
(every one reaches the server together, none waits in the client, where its wait would count in its TTFT).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import load
from scaling import Scaling
from serving.protocol import ConnectionGuard, EdgeLimits

from mooncake.errors import ConfigError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.types import Request

SCALING = Scaling(length_scale=0.03125, output_scale=1.0, max_prompt_tokens=512, max_output_tokens=4)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def requests(count: int) -> list[Request]:
    return [
        Request(
            request_id=str(i),
            arrival_s=0.0,
            input_length=512,
            output_length=2,
            block_keys=(i + 1,),
            block_size_tokens=512,
        )
        for i in range(count)
    ]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """`handler` at /v1/completions on a free loopback port; its URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def stream(request: web.Request, lines: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for line in lines:
        await response.write(f"data: {line}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def chunk(text: str, usage: dict[str, Any] | None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text}] if text else [], "usage": usage})


def replay(handler: Handler, count: int) -> list[load.ClientRecord]:
    async def run() -> list[load.ClientRecord]:
        async with serving(handler) as url:
            records, _ = await load.replay_http(url, requests(count), SCALING, model="m", timeout_s=30)
            return records

    return asyncio.run(run())


def test_an_answer_without_cached_tokens_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage without `prompt_tokens_details` (vLLM without `--enable-prompt-tokens-details`) completes the
    request, its prefix counted 0 and a note saying the hit ratio counts none (it raised KeyError, and the run
    ended in a traceback without its summary)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
        return await stream(
            request, [chunk(" a", usage), chunk(" b", {**usage, "completion_tokens": 2}), chunk("", usage)]
        )

    records = replay(handler, 2)
    assert [r.outcome for r in records] == [Outcome.COMPLETED] * 2
    assert [(r.input_tokens, r.prefix_tokens, r.output_tokens, r.event_tokens) for r in records] == [(9, 0, 1, [1])] * 2
    assert "the cache hit ratio counts none" in capsys.readouterr().err


def test_a_malformed_stream_fails_that_request_only(capsys: pytest.CaptureFixture[str]) -> None:
    """A `data:` line that is no JSON, or JSON that is no completion chunk, fails its request as a "malformed
    stream" (the first shown on stderr); the other requests are measured (it raised out of the run)."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}
    answers = {0: ["{not json"], 1: [json.dumps({"id": "x"})], 2: [chunk(" a", usage), chunk("", usage)]}

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream(request, answers[(await request.json())["seed"]])

    records = replay(handler, 3)
    assert [(r.outcome, r.reason) for r in records] == [(None, Reason.FAILED)] * 2 + [(Outcome.COMPLETED, None)]
    assert records[2].prefix_tokens == 4
    err = capsys.readouterr().err
    assert "failed (malformed stream): a data line that is no completion chunk: data: {not json" in err
    assert "cache hit ratio" not in err


def test_more_streams_than_aiohttps_pool_reach_the_server_at_once() -> None:
    """120 streams at once all reach the server together: aiohttp's default pool holds 100, and the others
    waited in the client for a connection, their wait counted in their TTFT. The server answers none until all
    have come (or 10 s have passed: then the client held some back)."""
    count, arrived, held_back = 120, [], []
    everyone = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        arrived.append(1)
        if len(arrived) == count:
            everyone.set()
        try:
            await asyncio.wait_for(everyone.wait(), 10)
        except TimeoutError:
            held_back.append(len(arrived))
        return await stream(request, [chunk(" a", None)])

    records = replay(handler, count)
    assert not held_back and [r.outcome for r in records] == [Outcome.COMPLETED] * count


def test_a_stream_cut_short_fails_as_truncated(capsys: pytest.CaptureFixture[str]) -> None:
    """A stream that closes without `[DONE]` or its final usage-only chunk may be cut short: it fails as a
    "truncated stream" (it counted as completed, its output the tokens asked for, its TBT from an interval or
    two). Either end mark alone completes it."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    texts = [chunk(" a", usage), chunk(" b", {**usage, "completion_tokens": 2})]

    async def handler(request: web.Request) -> web.StreamResponse:
        seed = (await request.json())["seed"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ends = {0: [], 1: ["[DONE]"], 2: [chunk("", {**usage, "completion_tokens": 2})]}[seed]
        for line in [*texts, *ends]:
            await response.write(f"data: {line}\n\n".encode())
        return response

    records = replay(handler, 3)
    assert [(r.outcome, r.reason) for r in records] == [(None, Reason.FAILED)] + [(Outcome.COMPLETED, None)] * 2
    assert "failed (truncated stream)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://127.0.0.1:abc", "Port could not be cast"),
        ("ftp://127.0.0.1:8000", ""),
        ("127.0.0.1:8000", ""),
    ],
)
def test_a_url_that_is_no_http_url_is_a_config_error_naming_it(url: str, why: str) -> None:
    """`check_url` names the --url and what is wrong with it: a malformed IPv6 host was a bare ValueError from
    urllib (exit 1, a traceback), a bad port an aiohttp error quoting only the URL."""
    with pytest.raises(ConfigError, match=r"^--url must be an http:// or https:// URL") as raised:
        load.check_url(url)
    assert repr(url) in str(raised.value) and why in str(raised.value)


def test_a_refused_or_failed_request_records_when_it_was_answered() -> None:
    """Goodput's span runs to the last answer of any kind (`sim.metrics.summarize`, as vLLM's benchmark times the
    whole run): a refusal (a 429 naming its outcome) and a failure now carry the time their answer came, as a
    completion does; they carried none, so a real run's span ended at its last completion."""

    async def handler(request: web.Request) -> web.StreamResponse:
        seed = (await request.json())["seed"]
        if seed == 0:
            error = {"outcome": Outcome.REJECTED_BEFORE_PREFILL.value, "code": Reason.KV_BUDGET.value}
            return web.json_response({"error": error}, status=429)
        if seed == 1:
            return web.Response(status=500, text="boom")
        usage = {"prompt_tokens": 9, "completion_tokens": 1}
        return await stream(request, [chunk(" a", usage), chunk("", usage)])

    records = replay(handler, 3)
    assert [(r.outcome, r.reason) for r in records] == [
        (Outcome.REJECTED_BEFORE_PREFILL, Reason.KV_BUDGET),
        (None, Reason.FAILED),
        (Outcome.COMPLETED, None),
    ]
    assert all(r.finish_s is not None and r.finish_s >= r.arrival_s for r in records)


def test_a_429_or_503_naming_no_outcome_is_a_failure_not_a_rejection() -> None:
    """Only an answer whose error names its outcome is a rejection. The gateway's refusal of a connection past its
    limits (`ConnectionGuard`: a 429 per client, a 503 in all) names none, being no scheduling decision: it
    counts as failed, as vLLM's benchmark counts any non-200. A bare 429 was counted as rejected before prefill
    (reason decode_rejected), charging the refusal to the admission policy."""
    guard = ConnectionGuard(EdgeLimits(max_connections=2, max_connections_per_client=1))
    assert guard.admit("10.0.0.1") is None
    per_client = guard.admit("10.0.0.1")
    assert guard.admit("10.0.0.2") is None
    in_all = guard.admit("10.0.0.3")
    assert per_client is not None and in_all is not None and (per_client.status, in_all.status) == (429, 503)

    async def handler(request: web.Request) -> web.StreamResponse:
        refusal = [per_client, in_all][(await request.json())["seed"]]
        return web.json_response(refusal.body(), status=refusal.status)

    assert [(r.outcome, r.reason) for r in replay(handler, 2)] == [(None, Reason.FAILED)] * 2


def test_a_choice_with_no_text_is_the_first_token_as_vllms_benchmark_counts_it() -> None:
    """An answer whose one choice chunk has empty text (the tiny byte model's lone token a UTF-8 lead byte, a
    special token) has its first token when that chunk came, as vLLM's benchmark times it ("text could be empty
    here"): it completed with no first token, so it was left out of the TTFT percentiles and met any TTFT
    objective. Every later choice chunk, with text or not, is an interval; a stream that carries no choice at
    all fails, as vLLM's benchmark fails it."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1}

    async def handler(request: web.Request) -> web.StreamResponse:
        seed = (await request.json())["seed"]
        empty = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": usage})
        lines = {0: [empty, chunk("", usage)], 1: [chunk(" a", usage), empty, chunk("", usage)], 2: [chunk("", usage)]}
        return await stream(request, lines[seed])

    records = replay(handler, 3)
    assert [(r.outcome, r.reason) for r in records] == [(Outcome.COMPLETED, None)] * 2 + [(None, Reason.FAILED)]
    assert records[0].first_token_s is not None and records[0].intervals.count == 0
    assert records[1].first_token_s is not None and records[1].intervals.count == 1
    assert records[1].event_tokens == [0]
