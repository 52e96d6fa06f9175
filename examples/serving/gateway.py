"""The gateway: an OpenAI-compatible HTTP API in front of the Conductor and the engine workers.

Per request: check the API key (401 without it when one is set), read and
check the body (`serving.api`: 400 naming the field, 413 over the prompt
limit) and let the dispatcher admit it (`serving.dispatch`: a rejection is a
429 with `Retry-After`, no engine up a 503). An accepted request goes to its
prefill worker; its tokens come back through the dispatcher, and the gateway
answers with the whole completion or streams it as server-sent events,
headers going out with the first token (so a late rejection is still a 429).
A request that fails mid-stream ends its stream with an error event; a client
that hangs up is cancelled on its decode engine. `/metrics` serves the
registry, `/health` the engines up.

`build_conductor` assembles the Conductor of the config's policies, on the
analytic CPU cost models or, with `[prefill] profile`, on the models
`examples/profile_engine.py` fitted to the engines: its "prefill" section
(`FittedPrefillModel`) for the router's TTFT estimates and its "decode"
section (`FittedStepModel`) as the Conductor's step model, which its decode
rule's TBT check and decode selection read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from mooncake.cache.hashing import BlockHasher
from mooncake.sched.build import build_conductor as build
from mooncake.sched.conductor import Conductor
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.types import Slo
from serving import registry
from serving.api import HttpError, Reply, parse_request, usage
from serving.config import ClusterConfig
from serving.dispatch import Dispatcher, LiveRequest
from serving.metrics import Registry
from serving.models import CPU, cost_models, model_shape
from serving.tokenizer import ByteTokenizer

__all__ = ["Gateway", "build_conductor"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def build_conductor(config: ClusterConfig) -> Conductor:
    """The Conductor of the config's policies, on the fitted profile when one is named (its prefill
    model for the router, its decode step model for the decode rule), else on the analytic CPU models.

    Raises:
        ConfigError: a profile that cannot be read (see `read_profile`).
    """
    prefill, step_model = cost_models(config)
    policy = config.policy
    # Workers register their instances with the dispatcher as they come up.
    return build(
        model=model_shape(config),
        hardware=CPU,
        prefill_instances=[],
        decode_instances=[],
        hasher=BlockHasher(model=config.model.preset, block_size_tokens=config.model.block_tokens),
        router=registry.router(policy.router, threshold=policy.threshold),
        admission=registry.admission(policy.admission),
        predictor=UniformDecodePredictor(decode_s=1.0),
        slo=Slo(ttft_s=config.slo.ttft_s, tbt_s=config.slo.tbt_s),
        prefill=prefill,
        step_model=step_model,
    )


def declare_metrics() -> Registry:
    """The gateway's metric families (docs/cluster.md lists them)."""
    m = Registry()
    m.counter("mooncake_requests_total", "Requests answered, by outcome.")
    m.counter("mooncake_rejections_total", "Requests rejected, by reason.")
    m.histogram("mooncake_ttft_seconds", "Time to first token.", LATENCY_BUCKETS)
    m.histogram("mooncake_tbt_seconds", "Time between tokens.", LATENCY_BUCKETS)
    m.counter("mooncake_prompt_tokens_total", "Prompt tokens of prefilled requests.")
    m.counter("mooncake_prefix_hit_tokens_total", "Prompt tokens whose KV came from a cache.")
    m.counter("mooncake_computed_tokens_total", "Prompt tokens prefill computed.")
    m.counter("mooncake_generation_tokens_total", "Tokens the decode engines generated (for live requests or not).")
    m.gauge("mooncake_prefix_hit_ratio", "Prefix hit tokens / prompt tokens, since start.")
    m.counter("mooncake_transfer_bytes_total", "KV bytes moved between nodes, by kind (fetch, stream).")
    m.gauge("mooncake_queue_length", "Requests queued for prefill or decoding, per instance.")
    m.gauge("mooncake_instance_up", "1 when the instance is up.")
    m.counter("mooncake_index_gaps_total", "Cache events that arrived out of sequence.")
    return m


class Gateway:
    """The HTTP front of a cluster; `dispatcher` holds the Conductor, the workers and the requests in flight.

    Args:
        config: the cluster config.
        secret: the transfer engines' shared secret.
        workers: each worker's `start()` info (instance id, role, address).
        is_alive: tells whether a worker's process (or actor) still runs.
    """

    def __init__(
        self, config: ClusterConfig, secret: bytes, workers: list[dict[str, Any]], is_alive: Callable[[str], bool]
    ) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.metrics = declare_metrics()
        self.dispatcher = Dispatcher(
            config,
            build_conductor(config),
            secret=secret,
            workers=workers,
            is_alive=is_alive,
            metrics=self.metrics,
            block_bytes=model_shape(config).kv_bytes_per_token * config.model.block_tokens,
        )
        self._health_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.dispatcher.attach(asyncio.get_running_loop())
        self._health_task = asyncio.create_task(self.dispatcher.health_loop())

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        self.dispatcher.close()

    # ------------------------------------------------------------------ routes

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except HttpError as error:
            return error.response()
        model = {"id": self.config.model.preset, "object": "model", "created": 0, "owned_by": "mooncake"}
        return web.json_response({"object": "list", "data": [model]})

    async def _metrics(self, _request: web.Request) -> web.Response:
        dispatcher = self.dispatcher
        for view in dispatcher.conductor.prefill_views:
            self.metrics.set("mooncake_queue_length", len(view.queue), instance=view.instance_id)
        for decode in dispatcher.conductor.decode_views:
            self.metrics.set("mooncake_queue_length", decode.batch_size, instance=decode.instance_id)
        for instance, up in dispatcher.up.items():
            self.metrics.set("mooncake_instance_up", 1.0 if up else 0.0, instance=instance)
        return web.Response(
            text=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8", "X-Content-Type-Options": "nosniff"},
        )

    async def _health(self, _request: web.Request) -> web.Response:
        prefill, decode = self.dispatcher.num_up("prefill"), self.dispatcher.num_up("decode")
        healthy = prefill > 0 and decode > 0
        body = {
            "status": "ok" if healthy else "unavailable",
            "prefill_up": prefill,
            "decode_up": decode,
            "in_flight": len(self.dispatcher.live),
        }
        return web.json_response(body, status=200 if healthy else 503)

    def _authorize(self, request: web.Request) -> None:
        key = self.config.cluster.api_key
        if key and request.headers.get("Authorization", "") != f"Bearer {key}":
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    # ------------------------------------------------------------------ completions

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        dispatcher = self.dispatcher
        arrival = dispatcher.now()
        try:
            self._authorize(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HttpError(400, "the body is not valid JSON") from None
            parsed = parse_request(
                body,
                chat=chat,
                tokenizer=self.tokenizer,
                limits=self.config.limits,
                max_context_tokens=self.config.decode.max_context_tokens,
            )
            live = dispatcher.admit(parsed, arrival)
        except HttpError as error:
            self.metrics.inc("mooncake_requests_total", outcome=str(error.status))
            return error.response()
        dispatcher.submit(live)
        reply = Reply(
            name=f"{'chatcmpl' if chat else 'cmpl'}-{live.request_id}",
            created=int(time.time()),
            model=self.config.model.preset,
            chat=chat,
        )
        if parsed.stream:
            return await self._stream(request, live, reply, with_usage=parsed.include_usage)
        try:
            generated = [token async for token in dispatcher.tokens(live)]
        except HttpError as error:
            self.metrics.inc("mooncake_requests_total", outcome=str(error.status))
            return error.response()
        self.metrics.inc("mooncake_requests_total", outcome="200")
        return web.json_response(reply.whole(self.tokenizer.decode(generated), self._usage(live, len(generated))))

    def _usage(self, live: LiveRequest, completion: int) -> dict[str, Any]:
        return usage(prompt_tokens=len(live.tokens), completion_tokens=completion, cached_tokens=live.cached_tokens)

    async def _stream(
        self, request: web.Request, live: LiveRequest, reply: Reply, *, with_usage: bool
    ) -> web.StreamResponse:
        tokens = self.dispatcher.tokens(live)
        decoder = self.tokenizer.stream_decoder()
        try:
            first = await tokens.__anext__()  # headers go out with the first token: a late rejection is still a 429
        except HttpError as error:
            self.metrics.inc("mooncake_requests_total", outcome=str(error.status))
            return error.response()
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        count = 0
        try:
            if first is not None:
                count += 1
                # The role goes with the first chunk counted here: the decode thread may run ahead of the writes.
                text = decoder.decode(bytes([first]) if first < 256 else b"")
                await response.write(reply.chunk(text, None, first=count == 1))
                async for token in tokens:
                    count += 1
                    text = decoder.decode(bytes([token]) if token < 256 else b"")
                    await response.write(reply.chunk(text, None, first=count == 1))
            await response.write(reply.chunk(decoder.decode(b"", final=True) or None, "length", first=count == 1))
            if with_usage:
                await response.write(reply.usage_chunk(self._usage(live, count)))
            await response.write(b"data: [DONE]\n\n")
            self.metrics.inc("mooncake_requests_total", outcome="200")
        except HttpError as error:
            await response.write(f"data: {json.dumps(error.body())}\n\n".encode())
            self.metrics.inc("mooncake_requests_total", outcome=f"{error.status}-mid-stream")
        except (ConnectionResetError, asyncio.CancelledError):
            self.dispatcher.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)
            raise
        await response.write_eof()
        return response
