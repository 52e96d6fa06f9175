"""The gateway: an OpenAI-compatible HTTP API in front of the Conductor and the engine workers.

Per request: validate the body (400 naming the field; 413 over the prompt
limit; 401 without the API key when one is set), tokenize (bytes), key its
blocks, and let the Conductor decide. A rejection is a 429 with `Retry-After`;
no engine up, a 503. An accepted request goes to its prefill worker with the
decision's transfer plan; the workers report progress (prefill started/done,
decode joined/rejected, tokens), which the gateway turns into Conductor events,
index updates (the prefill node's cache events), metrics and the response —
whole, or streamed as server-sent events.

Failures: a health loop checks every worker; a dead one is marked down in the
Conductor. Requests waiting for a dead prefill engine are scheduled again on
the survivors; requests decoding on a dead decode engine end with an error
(a 503, or an error event in their stream). Every request has a deadline.

All Conductor calls happen on the event loop's thread: it is the Conductor's only user.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
from aiohttp import web

from mooncake.cache.hashing import BlockHasher
from mooncake.engine.config import PRESETS
from mooncake.errors import MooncakeError
from mooncake.sched.admission import BaselineAdmission, EarlyRejection, predictive_early_rejection
from mooncake.sched.conductor import Conductor, RequestEnd
from mooncake.sched.cost import (
    DecodeCostModel,
    FittedPrefillModel,
    Hardware,
    ModelShape,
    PrefillCostModel,
    TransferCostModel,
)
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import (
    KvCacheCentricRouter,
    LoadBalancingRouter,
    RandomRouter,
    TtftEstimator,
    local_cache_aware_router,
)
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    InstanceDown,
    PrefillFinished,
    PrefillStarted,
    RequestRejected,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig
from mooncake.types import InstanceId, Request, RequestId, Slo
from serving.config import ClusterConfig
from serving.metrics import Registry
from serving.tokenizer import ByteTokenizer, chat_prompt
from serving.wire import event_from_wire

__all__ = ["CPU", "Gateway", "build_conductor"]

# The analytic cost model's idea of one CPU engine (used without a fitted profile).
CPU = Hardware(
    name="cpu",
    num_gpus=1,
    peak_flops_per_gpu=2e10,
    hbm_bytes_per_s=1e10,
    hbm_bytes=8e9,
    host_to_device_bytes_per_s=1e10,
    nic_bytes_per_s=1e9,
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def model_shape(config: ClusterConfig) -> ModelShape:
    return PRESETS[config.model.preset].shape(config.model.dtype)


def build_conductor(config: ClusterConfig) -> Conductor:
    """The Conductor of the config's policies, on the fitted profile when one is named."""
    shape = model_shape(config)
    prefill: Any = PrefillCostModel(model=shape, hardware=CPU)
    if config.prefill.profile:
        with open(config.prefill.profile) as stream:
            prefill = FittedPrefillModel.from_json(json.dumps(json.load(stream)["prefill"]))
    estimator = TtftEstimator(
        prefill=prefill,
        transfer=TransferCostModel(bandwidth_bytes_per_s=CPU.nic_bytes_per_s),
        kv_bytes_per_token=shape.kv_bytes_per_token,
    )
    policy = config.policy
    routers: dict[str, Callable[[], Any]] = {
        "random": lambda: RandomRouter(estimator),
        "load_balancing": lambda: LoadBalancingRouter(estimator),
        "local_cache_aware": lambda: local_cache_aware_router(estimator),
        "kvcache_centric": lambda: KvCacheCentricRouter(estimator=estimator, threshold=policy.threshold),
    }
    admissions: dict[str, Callable[[], Any]] = {
        "baseline": BaselineAdmission,
        "early_rejection": EarlyRejection,
        "predictive_early_rejection": predictive_early_rejection,
    }
    return Conductor(
        router=routers[policy.router](),
        decode_cost=DecodeCostModel(model=shape, hardware=CPU, overhead_s=0.0),
        admission=admissions[policy.admission](),
        predictor=UniformDecodePredictor(decode_s=1.0),
        slo=Slo(ttft_s=config.slo.ttft_s, tbt_s=config.slo.tbt_s),
        block_size_tokens=config.model.block_tokens,
    )


class HttpError(Exception):
    """An error answer: status, OpenAI-style type, message, the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


@attrs.define(eq=False)
class _Live:
    request_id: RequestId
    tokens: list[int]
    request: Request
    job: dict[str, Any]
    prefill: InstanceId
    decode: InstanceId
    arrival: float
    events: asyncio.Queue[tuple[str, Any]] = attrs.field(factory=asyncio.Queue)
    last_token_s: float | None = None
    generated: int = 0
    cached_tokens: int = 0
    reroutes: int = 0


class Gateway:
    """The HTTP front, the Conductor and the workers' callbacks.

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
        self.hasher = BlockHasher(model=config.model.preset, block_size_tokens=config.model.block_tokens)
        self.conductor = build_conductor(config)
        self.roles = {w["instance_id"]: w["role"] for w in workers}
        capacity = config.decode.max_batch_size * config.decode.max_context_tokens
        for worker in workers:
            if worker["role"] == "prefill":
                self.conductor.add_prefill_instance(InstanceId(worker["instance_id"]))
            else:
                self.conductor.add_decode_instance(InstanceId(worker["instance_id"]), capacity_tokens=capacity)
        self.up = dict.fromkeys(self.roles, True)
        self._is_alive = is_alive
        self.engine = TransferEngine(
            secret=secret, config=EngineConfig(transports=("tcp",), io_timeout_s=5.0, spin_us=0)
        )
        for method in (
            "prefill.started",
            "prefill.done",
            "prefill.failed",
            "decode.joined",
            "decode.rejected",
            "decode.tokens",
        ):
            self.engine.register_handler(method, self._callback(method))
        self.peers = {w["instance_id"]: self.engine.connect(w["address"], transport="tcp") for w in workers}
        addresses = {w["instance_id"]: w["address"] for w in workers}
        for instance in self.peers:
            self.engine.call(
                self.peers[instance], "worker.connect", {"gateway": self.engine.address, "peers": addresses}
            )
        self.live: dict[RequestId, _Live] = {}
        self._ids = itertools.count(1)
        self._started = time.monotonic()
        self._calls = ThreadPoolExecutor(max(4, len(workers)), thread_name_prefix="gateway-call")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.metrics = self._declare_metrics()
        kv_per_block = model_shape(config).kv_bytes_per_token * config.model.block_tokens
        self._block_bytes = kv_per_block

    # ------------------------------------------------------------------ set-up

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
        self._loop = asyncio.get_running_loop()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for live in list(self.live.values()):
            live.events.put_nowait(("error", HttpError(503, "the cluster is shutting down", kind="server_error")))
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def now(self) -> float:
        return time.monotonic() - self._started

    def _declare_metrics(self) -> Registry:
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

    # ------------------------------------------------------------------ HTTP

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
        for view in self.conductor.prefill_views:
            self.metrics.set("mooncake_queue_length", len(view.queue), instance=view.instance_id)
        for decode in self.conductor.decode_views:
            self.metrics.set("mooncake_queue_length", decode.batch_size, instance=decode.instance_id)
        for instance, up in self.up.items():
            self.metrics.set("mooncake_instance_up", 1.0 if up else 0.0, instance=instance)
        return web.Response(
            text=self.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8", "X-Content-Type-Options": "nosniff"},
        )

    async def _health(self, _request: web.Request) -> web.Response:
        prefill = sum(1 for i, up in self.up.items() if up and self.roles[i] == "prefill")
        decode = sum(1 for i, up in self.up.items() if up and self.roles[i] == "decode")
        healthy = prefill > 0 and decode > 0
        body = {
            "status": "ok" if healthy else "unavailable",
            "prefill_up": prefill,
            "decode_up": decode,
            "in_flight": len(self.live),
        }
        return web.json_response(body, status=200 if healthy else 503)

    def _authorize(self, request: web.Request) -> None:
        key = self.config.cluster.api_key
        if key and request.headers.get("Authorization", "") != f"Bearer {key}":
            raise HttpError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    def _parse(self, body: Any, *, chat: bool) -> tuple[list[int], int, float, int, bool]:
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages must be a non-empty list", param="messages")
            for i, message in enumerate(messages):
                if (
                    not isinstance(message, dict)
                    or not isinstance(message.get("content"), str)
                    or message.get("role") not in ("system", "user", "assistant")
                ):
                    raise HttpError(
                        400,
                        f"messages[{i}] needs a role (system, user, assistant) and a string content",
                        param=f"messages[{i}]",
                    )
            text = chat_prompt(messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise HttpError(400, "prompt must be a string", param="prompt")
            text = prompt
        limits = self.config.limits
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", limits.default_max_tokens))
        ceiling = self.config.decode.max_context_tokens - limits.max_prompt_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= ceiling:
            raise HttpError(
                400, f"max_tokens must be an integer in [1, {ceiling}], got {max_tokens!r}", param="max_tokens"
            )
        temperature = body.get("temperature", 0.0)
        if temperature is None:
            temperature = 0.0
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= 2
            or not math.isfinite(temperature)
        ):
            raise HttpError(400, f"temperature must be a number in [0, 2], got {temperature!r}", param="temperature")
        seed = body.get("seed", 0)
        if seed is None:
            seed = 0
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise HttpError(400, f"seed must be an integer >= 0, got {seed!r}", param="seed")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, f"stream must be a boolean, got {stream!r}", param="stream")
        tokens = self.tokenizer.encode(text)
        if not tokens:
            raise HttpError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if len(tokens) > limits.max_prompt_tokens:
            raise HttpError(
                413,
                f"the prompt has {len(tokens)} tokens, over the limit of {limits.max_prompt_tokens}",
                param="messages" if chat else "prompt",
            )
        return tokens, max_tokens, float(temperature), seed, stream

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival = self.now()
        try:
            self._authorize(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HttpError(400, "the body is not valid JSON") from None
            tokens, max_tokens, temperature, seed, stream = self._parse(body, chat=chat)
            live = self._admit(tokens, max_tokens, temperature, seed, arrival)
        except HttpError as error:
            self.metrics.inc("mooncake_requests_total", outcome=str(error.status))
            return error.response()
        self._submit(live)
        created = int(time.time())
        name = f"{'chatcmpl' if chat else 'cmpl'}-{live.request_id}"
        if stream:
            options = body.get("stream_options") or {}
            with_usage = isinstance(options, dict) and options.get("include_usage") is True
            return await self._stream(request, live, chat=chat, name=name, created=created, with_usage=with_usage)
        try:
            generated = [token async for token in self._tokens(live)]
        except HttpError as error:
            self.metrics.inc("mooncake_requests_total", outcome=str(error.status))
            return error.response()
        text = self.tokenizer.decode(generated)
        usage = self._usage(live, len(generated))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self.metrics.inc("mooncake_requests_total", outcome="200")
        return web.json_response(
            {
                "id": name,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.config.model.preset,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _usage(self, live: _Live, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": len(live.tokens),
            "completion_tokens": completion,
            "total_tokens": len(live.tokens) + completion,
            "prompt_tokens_details": {"cached_tokens": live.cached_tokens},
        }

    async def _stream(
        self, request: web.Request, live: _Live, *, chat: bool, name: str, created: int, with_usage: bool = False
    ) -> web.StreamResponse:
        tokens = self._tokens(live)
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

        def chunk(text: str | None, finish: str | None) -> bytes:
            if chat:
                delta: dict[str, Any] = {"content": text} if text is not None else {}
                if text is not None and count == 1:  # the first chunk: the decode thread may run ahead of the writes
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            data = {
                "id": name,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.config.model.preset,
                "choices": [choice],
            }
            return f"data: {json.dumps(data)}\n\n".encode()

        count = 0
        try:
            if first is not None:
                count += 1
                await response.write(chunk(decoder.decode(bytes([first]) if first < 256 else b""), None))
                async for token in tokens:
                    count += 1
                    await response.write(chunk(decoder.decode(bytes([token]) if token < 256 else b""), None))
            await response.write(chunk(decoder.decode(b"", final=True) or None, "length"))
            if with_usage:  # OpenAI's stream_options.include_usage: a last chunk with no choices and the usage
                usage = {
                    "id": name,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": self.config.model.preset,
                    "choices": [],
                    "usage": self._usage(live, count),
                }
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            self.metrics.inc("mooncake_requests_total", outcome="200")
        except HttpError as error:
            await response.write(f"data: {json.dumps(error.body())}\n\n".encode())
            self.metrics.inc("mooncake_requests_total", outcome=f"{error.status}-mid-stream")
        except (ConnectionResetError, asyncio.CancelledError):
            self._end(live, "rejected:client_gone")
            raise
        await response.write_eof()
        return response

    async def _tokens(self, live: _Live) -> Any:
        """The request's tokens as they arrive; raises HttpError when it fails or times out."""
        deadline = live.arrival + self.config.limits.request_timeout_s
        while True:
            try:
                kind, payload = await asyncio.wait_for(live.events.get(), timeout=max(0.0, deadline - self.now()))
            except TimeoutError:
                self._end(live, "rejected:timeout")
                raise HttpError(504, "the request timed out", kind="timeout_error") from None
            if kind == "error":
                raise payload
            token, finished = payload
            yield token
            if finished:
                return

    # ------------------------------------------------------------------ scheduling

    def _admit(self, tokens: list[int], max_tokens: int, temperature: float, seed: int, arrival: float) -> _Live:
        prefill_up = any(up and self.roles[i] == "prefill" for i, up in self.up.items())
        decode_up = any(up and self.roles[i] == "decode" for i, up in self.up.items())
        if not (prefill_up and decode_up):
            raise HttpError(
                503, "no prefill or no decode engine is up", kind="server_error", headers={"Retry-After": "5"}
            )
        request_id = RequestId(next(self._ids))
        keys = self.hasher.block_keys(np.asarray(tokens, dtype=np.int32))
        request = Request(
            request_id=request_id,
            arrival_s=arrival,
            input_length=len(tokens),
            output_length=max_tokens,
            block_keys=keys,
        )
        job = {
            "request_id": int(request_id),
            "tokens": tokens,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        live = _Live(request_id, tokens, request, job, InstanceId(""), InstanceId(""), arrival)
        self._schedule(live)
        return live

    def _schedule(self, live: _Live) -> None:
        decision = self.conductor.schedule(live.request, self.now())
        if not decision.accepted:
            reason = decision.reason.value if decision.reason is not None else "rejected"
            self.metrics.inc("mooncake_rejections_total", reason=reason)
            raise HttpError(
                429,
                f"the cluster is at capacity ({reason}); retry later",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        assert decision.prefill_instance is not None and decision.decode_instance is not None
        live.prefill, live.decode = decision.prefill_instance, decision.decode_instance
        live.job["decode"] = decision.decode_instance
        live.job["fetch"] = None
        if decision.transfer is not None:
            live.job["fetch"] = {"source": decision.transfer.source, "blocks": decision.transfer.num_blocks}
        self.live[live.request_id] = live

    def _submit(self, live: _Live) -> None:
        peer = self.peers[live.prefill]
        future = asyncio.get_running_loop().run_in_executor(
            self._calls, self.engine.call, peer, "prefill.submit", live.job
        )
        instance = live.prefill

        def check(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is not None:
                self._worker_failed(instance)  # unreachable: mark it down (its requests are rerouted)

        future.add_done_callback(check)

    def _end(self, live: _Live, outcome: str) -> None:
        if self.live.pop(live.request_id, None) is None:
            return
        now = self.now()
        if outcome in ("rejected:client_gone", "rejected:timeout") and self.up.get(live.decode):
            # Stop the decode engine from generating for nobody (it ignores requests it does not hold).
            self._calls.submit(self._cancel, live.decode, live.request_id)
        if outcome == "finished":
            self.conductor.handle(
                DecodeFinished(
                    request_id=live.request_id, instance_id=live.decode, now=now, generated_tokens=live.generated
                )
            )
        else:
            self.conductor.handle(
                RequestRejected(
                    request_id=live.request_id,
                    instance_id=live.decode,
                    now=now,
                    reason=outcome.removeprefix("rejected:"),
                )
            )

    def _cancel(self, instance: InstanceId, request_id: RequestId) -> None:
        try:
            self.engine.call(self.peers[instance], "decode.cancel", {"request_id": int(request_id)})
        except (MooncakeError, OSError):
            pass  # a dead engine generates nothing

    # ------------------------------------------------------------------ worker callbacks

    def _callback(self, method: str) -> Callable[[Any], Any]:
        def handler(args: Any) -> Any:
            loop = self._loop
            if loop is not None:
                loop.call_soon_threadsafe(self._dispatch, method, args)
            return {"ok": True}

        return handler

    def _dispatch(self, method: str, args: dict[str, Any]) -> None:
        if method == "decode.tokens":
            self.metrics.inc("mooncake_generation_tokens_total", len(args["tokens"]))
            for request_id, token, index, finished in args["tokens"]:
                self._on_token(RequestId(request_id), token, index, finished)
            return
        for wire in args.get("events", ()):
            if self.conductor.apply_cache_event(event_from_wire(wire)) is not None:
                self.metrics.inc("mooncake_index_gaps_total")  # events lost: the index catches up on the next epoch
        live = self.live.get(RequestId(args["request_id"]))
        if live is None:
            return
        now = self.now()
        if method == "prefill.started":
            self.conductor.handle(PrefillStarted(request_id=live.request_id, instance_id=live.prefill, now=now))
        elif method == "prefill.done":
            self.conductor.handle(PrefillFinished(request_id=live.request_id, instance_id=live.prefill, now=now))
            live.cached_tokens = args["prefix_tokens"]
            self.metrics.inc("mooncake_prompt_tokens_total", len(live.tokens))
            self.metrics.inc("mooncake_prefix_hit_tokens_total", args["prefix_tokens"])
            self.metrics.inc("mooncake_computed_tokens_total", args["computed_tokens"])
            self.metrics.inc("mooncake_transfer_bytes_total", args["fetched_blocks"] * self._block_bytes, kind="fetch")
            self.metrics.inc(
                "mooncake_transfer_bytes_total", args["streamed_blocks"] * self._block_bytes, kind="stream"
            )
            total = self.metrics.value("mooncake_prompt_tokens_total")
            self.metrics.set(
                "mooncake_prefix_hit_ratio", self.metrics.value("mooncake_prefix_hit_tokens_total") / total
            )
        elif method == "prefill.failed":
            self._fail(live, HttpError(500, f"prefill failed: {args['error']}", kind="server_error"), "prefill_failed")
        elif method == "decode.joined":
            self.conductor.handle(
                DecodeJoined(
                    request_id=live.request_id,
                    instance_id=live.decode,
                    now=now,
                    context_tokens=args["context_tokens"],
                    output_tokens=args["output_tokens"],
                )
            )
        elif method == "decode.rejected":
            self.metrics.inc("mooncake_rejections_total", reason=f"decode_{str(args['reason']).split(':')[0]}")
            self._fail(
                live,
                HttpError(
                    429,
                    f"the decode engine refused the request ({args['reason']}); retry later",
                    kind="rate_limit_error",
                    headers={"Retry-After": "1"},
                ),
                "decode_rejected",
            )

    def _on_token(self, request_id: RequestId, token: int, index: int, finished: bool) -> None:
        live = self.live.get(request_id)
        if live is None:
            return
        now = self.now()
        if index == 0:
            self.metrics.observe("mooncake_ttft_seconds", now - live.arrival)
        elif live.last_token_s is not None:
            self.metrics.observe("mooncake_tbt_seconds", now - live.last_token_s)
        live.last_token_s = now
        live.generated += 1
        live.events.put_nowait(("token", (token, finished)))
        if finished:
            self._end(live, "finished")

    def _fail(self, live: _Live, error: HttpError, outcome: str) -> None:
        self._end(live, f"rejected:{outcome}")
        live.events.put_nowait(("error", error))

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.limits.health_interval_s)
            for instance, up in list(self.up.items()):
                if not up:
                    continue
                alive = self._is_alive(instance)
                if alive:
                    try:
                        reply = await asyncio.wait_for(
                            loop.run_in_executor(
                                self._calls, self.engine.call, self.peers[instance], "worker.health", {}
                            ),
                            timeout=10.0,
                        )
                        alive = bool(reply.get("ok"))
                    except (MooncakeError, OSError, TimeoutError):
                        alive = False
                if not alive:
                    self._worker_failed(InstanceId(instance))

    def _worker_failed(self, instance: InstanceId) -> None:
        if not self.up.get(instance):
            return
        self.up[instance] = False
        ends: tuple[RequestEnd, ...] = self.conductor.handle(InstanceDown(instance_id=instance, now=self.now()))
        for end in ends:
            live = self.live.pop(end.request_id, None)
            if live is None:
                continue
            if live.prefill == instance and live.reroutes < 2 and live.generated == 0:
                live.reroutes += 1
                try:  # not prefilled yet: schedule it again on the survivors
                    self._schedule(live)
                except HttpError as error:
                    live.events.put_nowait(("error", error))
                    continue
                self._submit(live)
            else:
                role = self.roles[instance]
                live.events.put_nowait(
                    ("error", HttpError(503, f"the {role} engine {instance} failed", kind="server_error"))
                )
