"""`mooncake:http_responses_total` counts every answer to a completion request once, by its HTTP status, with real
sockets against a worker-less gateway on 127.0.0.1 (test_edge's `served`).

What is counted: the gateway's own refusals (a bad body's 400, no engine's 503), aiohttp's (a body over the cap:
413, raised while the body is read) and the error middleware's 500 for a failure; what is not: answers to other
routes, and another method on a completion path (405).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("aiohttp")

from aiohttp import web
from serving.gateway import Gateway
from serving.protocol import EdgeLimits

from tests.serving.test_edge import ask, connect, get, post, served

BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


def responses(gateway: Gateway) -> dict[str, float]:
    """The scrape's `http_responses_total`, by status."""
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(gateway.metrics.render().decode())
        for sample in family.samples
        if sample.name == "mooncake:http_responses_total"
    }


def test_every_answer_to_a_completion_counts_once_by_its_status() -> None:
    """A 413 (aiohttp's, for a body over the cap), a 500 (a failure the error middleware answers), a 400 and a 503
    (the gateway's own) count once each under their status; a 405 on a completion path and a /health do not."""
    with served(EdgeLimits(max_body_bytes=1024)) as (gateway, port):
        assert ask(port, post("/v1/completions", b"x" * 5000))[0] == 413
        assert ask(port, post("/v1/chat/completions", b"{"))[0] == 400
        assert ask(port, post("/v1/completions", BODY))[0] == 503  # no engine is up
        assert ask(port, get("/v1/completions"))[0] == 405
        assert ask(port, get("/health"))[0] == 503

        def failing(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        gateway._prepared = failing  # type: ignore[method-assign]
        assert ask(port, post("/v1/chat/completions", BODY))[0] == 500
        assert responses(gateway) == {"413": 1.0, "400": 1.0, "503": 1.0, "500": 1.0}


def test_a_stream_that_fails_after_its_start_counts_as_its_200_alone() -> None:
    """A failure after a stream's headers went out gets no second answer (the connection closes after what was
    sent): the stream counts as its 200 only, not as a 500 too."""
    with served(EdgeLimits()) as (gateway, port):

        async def failing_stream(request: web.Request, *, chat: bool) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: {}\n\n")
            raise RuntimeError("a bug mid-stream")

        gateway._serve = failing_stream  # type: ignore[method-assign]
        with connect(port) as sock:
            sock.sendall(post("/v1/completions", BODY))
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    data += chunk
        assert data.startswith(b"HTTP/1.1 200") and data.count(b"HTTP/1.1") == 1 and b"data: {}" in data
        assert responses(gateway) == {"200": 1.0}
