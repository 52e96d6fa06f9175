"""A stand-in for a vLLM server (a test double beside the real ones of `test_with_vllm.py`): the endpoints the
router reads, and completions that take `seconds_per_token` of prefill before streaming `max_tokens` tokens.
A disaggregated pair's protocol as vLLM's NIXL connector speaks it: a request asking `do_remote_decode` is
answered with `kv_transfer_params` naming this server; one carrying `do_remote_prefill` skips its prefill.

Switches: `status` (what completions answer: 200, or an error status), `healthy` (what `/health` answers),
`seconds_between_tokens` (a stream's pace),
`waiting` (the requests `/metrics` says wait there: another client's, as far as the router knows),
`cached_tokens` (None, or the prefix-cache hit its usage reports, as `--enable-prompt-tokens-details` does).
`received` holds every completion body. It serves from a thread of its own on 127.0.0.1 (`port` 0: any
free one; a stopped fake started again keeps its port).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

from mooncake.engine.tokenizer import Tokenizer


class FakeVllm:
    def __init__(
        self, tokenizer: Tokenizer, *, block_size: int = 32, max_model_len: int = 2048, seconds_per_token: float = 0.0
    ) -> None:
        self.tokenizer, self.block_size, self.max_model_len = tokenizer, block_size, max_model_len
        self.seconds_per_token = seconds_per_token
        self.seconds_between_tokens = 0.002  # a stream's pace once its first token is out
        self.status = 200
        self.healthy = True
        self.waiting = 0
        self.cached_tokens: int | None = None
        self.received: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each completion's request headers
        self.first_text = " x"  # the first chunk's text (a long one stands for prompt log-probabilities)
        self.metrics_tail = b""  # bytes after the counters (not UTF-8, say)
        self.active = self.peak = 0  # completions being answered now, and the most at once
        self.api_key = ""  # as `vllm serve --api-key`: the /v1 routes need it
        self.aborted = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeVllm:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    @web.middleware
    async def _keyed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        wanted = f"Bearer {self.api_key}"
        if self.api_key and request.path.startswith("/v1") and request.headers.get("Authorization") != wanted:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._keyed])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        if self._loop is None:
            return
        assert self._runner is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "max_model_len": self.max_model_len}]})

    async def _metrics(self, _request: web.Request) -> web.Response:
        info = (
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",'
            f'engine="0",kv_cache_size_tokens="65536",num_gpu_blocks="2048"}} 1.0\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {self.waiting}.0\n'
        )
        return web.Response(body=info.encode() + self.metrics_tail)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":  # as FastAPI reads a body: JSON only when it says so
            return web.json_response({"detail": "not JSON"}, status=422)
        body = await request.json()
        return web.json_response({"tokens": self.tokenizer.encode(body["prompt"])})

    async def _detokenize(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return web.json_response({"detail": "not JSON"}, status=422)
        body = await request.json()
        return web.json_response({"prompt": self.tokenizer.decode(body["tokens"])})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self._complete(request)
        finally:
            self.active -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        echoed = {"X-Request-Id": request.headers["X-Request-Id"]} if "X-Request-Id" in request.headers else {}
        if self.status != 200:
            return web.json_response({"error": {"message": "failing on purpose"}}, status=self.status)
        if int(body.get("min_tokens") or 0) > int(body.get("max_completion_tokens") or body.get("max_tokens") or 16):
            message = "min_tokens must be less than or equal to max_tokens"  # vLLM's SamplingParams check
            return web.json_response({"error": {"message": message}}, status=400)
        prompt = body.get("prompt", "")
        tokens = len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(str(prompt)))
        count = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        usage: dict[str, Any] = {"prompt_tokens": tokens, "completion_tokens": count, "total_tokens": tokens + count}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        transfer = body.get("kv_transfer_params") or {}
        try:
            if not transfer.get("do_remote_prefill"):  # else its KV came from the prefill server
                await asyncio.sleep(self.seconds_per_token * tokens)
            if not body.get("stream"):
                choice = {"index": 0, "text": " x" * count, "finish_reason": "length"}
                answer = {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage}
                if transfer.get("do_remote_decode"):
                    answer["kv_transfer_params"] = {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_engine_id": f"fake-{self.port}",
                        "remote_block_ids": list(range(-(-tokens // self.block_size))),
                        "remote_host": "127.0.0.1",
                        "remote_port": self.port,
                    }
                return web.json_response(answer, headers=echoed)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **echoed})
            await response.prepare(request)
            for number in range(count):
                finish = "length" if number == count - 1 else None
                text = self.first_text if number == 0 else " x"
                chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(self.seconds_between_tokens)
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(
                    b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n"
                )
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
