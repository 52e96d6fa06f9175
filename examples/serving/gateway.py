"""The gateway: an OpenAI-compatible HTTP API in front of the Conductor and the engine workers.

Per request: check the API key (401 without it when one is set), read the body
within its deadline and decode and check it (`serving.api`: 400 naming the
field, 404 `model_not_found`, 413 over the prompt limit) and let the
dispatcher admit it (`serving.dispatch`: one the decode side has no room
for waits for it up to `[limits] admission_wait_s`; a rejection is a 429 with
`Retry-After`, no engine up a 503). An accepted request goes to its prefill
worker; its tokens come back through the dispatcher, and the gateway answers
with the whole completion or streams it as server-sent events, headers going
out with the first token (so a late rejection is still a 429); an answer's
`X-Mooncake-Prefill-Instance` and `X-Mooncake-Decode-Instance` headers name
where it ran. Prompts are
encoded, chats rendered and text decoded by the served model's tokenizer
(`serving.tokenizer`: a checkpoint's, or bytes for the random preset). The
text ends before a stop string or at a stop id such as the checkpoint's EOS
(finish reason "stop"; the decode is cancelled), or at `max_tokens` ("length"). A request that fails mid-stream ends its stream with
an error event; a client that hangs up, streaming or not, is cancelled on its
decode engine (aiohttp cancels the handler when its connection is lost).
`/metrics` serves the metrics (`serving.metrics`: vLLM's families under the
prefix `mooncake:`), `/health` (and vLLM's `/ping`) the engines up, `/v1/models`
the served model, `/version` this version, `/tokenize` and `/detokenize`
vLLM's token views; every GET route answers HEAD too.

Every answer but a stream's is JSON: a middleware turns aiohttp's own errors
(404 for an unknown route, 405, 413 for a body over the cap) and anything
unexpected (a 500, logged once per kind and interval) into OpenAI's error body.
`Gateway.start` serves the app through `serving.protocol`'s guarded site
(connection caps, header deadline, JSON for unparsable requests).

The Conductor is `serving.models.build_conductor(config)`'s (the config's
policies on its engines' cost models); workers register their instances with
the dispatcher as they come up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import HttpVersion11, web

import mooncake
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.sched.outcome import Outcome, Reason
from serving import wire
from serving.api import (
    DECODE_HEADER,
    PREFILL_HEADER,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Logprobs,
    Reply,
    SamplingOptions,
    ServedModel,
    Usage,
    authorized,
    decode_body,
    detokenize_body,
    generation_limit,
    models_body,
    parse_chat,
    parse_completion,
    prompt_tokens,
    tokenize_body,
)
from serving.config import ClusterConfig
from serving.dispatch import Dispatcher, LiveRequest
from serving.machine import page_bytes
from serving.metrics import CONTENT_TYPE, ServingMetrics
from serving.models import build_conductor
from serving.protocol import EdgeLimits, GuardedSite, install_log_limits, loop_exception_handler
from serving.tokenizer import TextStream, generation_defaults, serving_tokenizer

__all__ = ["Gateway"]

LOG = logging.getLogger("serving.gateway")


class Gateway:
    """The HTTP front of a cluster; `dispatcher` holds the Conductor, the workers and the requests in flight.

    Args:
        config: the cluster config.
        secret: the transfer engines' shared secret.
        workers: each worker's `start()` info (instance id, role, address).
        is_alive: tells whether a worker's process (or actor) still runs.
        edge: the connections' caps and deadlines (default: the config's `[limits]`).
        host: where the gateway's transfer engine listens for the workers' reports (an address they reach).
    """

    def __init__(
        self,
        config: ClusterConfig,
        secret: bytes,
        workers: list[dict[str, Any]],
        is_alive: Callable[[str], bool],
        *,
        edge: EdgeLimits | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.edge = edge or EdgeLimits.from_config(config.limits)
        self.tokenizer = serving_tokenizer(config)
        self.served = ServedModel(
            name=config.model.served_name,
            max_prompt_tokens=config.limits.max_prompt_tokens,
            default_max_tokens=config.limits.default_max_tokens,
            max_context_tokens=config.decode.max_context_tokens,
            vocab_size=config.model.config.vocab_size,
            **{f"default_{name}": value for name, value in generation_defaults(config).items()},
        )
        self.metrics = ServingMetrics.for_config(config, workers)
        self.dispatcher = Dispatcher(
            config,
            build_conductor(config),
            secret=secret,
            workers=workers,
            is_alive=is_alive,
            metrics=self.metrics,
            block_bytes=page_bytes(config),
            host=host,
            stop_token_ids=self.tokenizer.stop_token_ids,
        )
        self.site: GuardedSite | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._uninstall_log_limits: Callable[[], None] | None = None

    def app(self) -> web.Application:
        """The aiohttp application (its handler options carry the header deadline and handler cancellation)."""
        app = web.Application(
            client_max_size=self.edge.max_body_bytes,
            middlewares=[_cors_preflight, self._errors],
            handler_args=self.edge.handler_args(),
        )
        app.on_response_prepare.append(_cors_headers)
        for method, path, handler in self._routes():
            app.router.add_route(method, path, handler, expect_handler=self._expect)
            if method == "GET":  # as vLLM's server and HTTP want: the headers without the body
                app.router.add_route("HEAD", path, handler, expect_handler=self._expect)
        # Last, for any other path or method: aiohttp would answer those (and their Expect) in plain text.
        app.router.add_route("*", "/{path:.*}", self._unrouted, expect_handler=self._expect)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def start(self, host: str, port: int) -> web.AppRunner:
        """Serve the app on `host:port` through the guarded site; returns the runner (`cleanup()` stops it)."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            self.site = GuardedSite(
                runner,
                host,
                port,
                limits=self.edge,
                handler_args={**self.edge.handler_args(), "access_log": None},
                on_refusal=lambda status: self.metrics.connections_refused[str(status)].inc(),
            )
            await self.site.start()
        except BaseException:  # the port is taken, say: undo the setup's startup (dispatcher, log limits)
            self.site = None
            await runner.cleanup()
            raise
        return runner

    async def _on_startup(self, _app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(loop_exception_handler)
        self._uninstall_log_limits = install_log_limits(self.edge.log_interval_s)
        self.dispatcher.attach(loop)
        self._health_task = asyncio.create_task(self.dispatcher.health_loop())

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        self.dispatcher.close()
        if self._uninstall_log_limits is not None:
            self._uninstall_log_limits()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error answer as OpenAI's JSON body: ours, aiohttp's (404, 405, 413...) and the unexpected."""
        try:
            return await handler(request)
        except ApiError as error:
            return _error_response(error)
        except web.HTTPException as exception:  # aiohttp's own (a body over the cap: 413), as JSON
            if exception.status < 400:
                raise
            headers = {k: v for k, v in exception.headers.items() if k in ("Allow", "Retry-After")}
            message = exception.text if exception.text and exception.text[:3] != str(exception.status) else None
            return _error_response(ApiError(exception.status, message or exception.reason, headers=headers))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            LOG.exception("unexpected error serving %s %s", request.method, request.path)
            return _error_response(ApiError(500, "internal error"))

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]]:
        return [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat),
            ("GET", "/v1/models", self._models),
            ("GET", "/metrics", self._metrics),
            ("GET", "/health", self._health),
            ("GET", "/ping", self._health),  # vLLM's (SageMaker's) name for the same check
            ("POST", "/ping", self._health),
            ("GET", "/version", self._version),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
        ]

    async def _unrouted(self, request: web.Request) -> web.StreamResponse:
        """404 for an unknown path (OpenAI's "Invalid URL"), 405 naming the allowed methods for a known one."""
        allowed = sorted(method for method, path, _ in self._routes() if path == request.path)
        shown = ascii(request.path)[1:-1][:200]
        if allowed:
            message = f"{request.method} is not allowed on {shown} (allowed: {', '.join(allowed)})"
            raise ApiError(405, message, headers={"Allow": ", ".join(allowed)})
        raise ApiError(404, f"Invalid URL ({request.method} {shown})")

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` gets its interim answer; any other expectation a 417 (JSON)."""
        if request.version != HttpVersion11:
            return None
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return _error_response(ApiError(417, f"unsupported Expect: {ascii(expect)[1:-1][:100]}"))
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not begun
        return None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response(models_body(self.served, created=int(time.time())))

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: a completion's `prompt`, or a chat's `messages` through the chat template."""
        self._authorize(request)
        body = await self._body(request)
        parsed = parse_chat(body, self.served) if "messages" in body else parse_completion(body, self.served)
        return web.json_response(tokenize_body(parsed, self.tokenizer, self.served))

    async def _detokenize(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response(detokenize_body(await self._body(request), self.tokenizer, self.served))

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": mooncake.__version__})

    async def _metrics(self, _request: web.Request) -> web.Response:
        dispatcher = self.dispatcher
        up = dispatcher.up
        for engine, (running, waiting) in dispatcher.loads().items():
            self.metrics.set_engine(engine, up=up.get(engine, False), running=running, waiting=waiting)
        headers = {"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"}
        return web.Response(body=self.metrics.render(), headers=headers)

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
        if not authorized(request.headers.get("Authorization"), self.config.cluster.api_key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")

    async def _read(self, request: web.Request, *, chat: bool) -> CompletionRequest | ChatRequest:
        """The request's body, read within its deadline, decoded and checked."""
        body = await self._body(request)
        return parse_chat(body, self.served) if chat else parse_completion(body, self.served)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The request's body, read within its deadline, decoded: a JSON object (`decode_body`)."""
        try:
            async with asyncio.timeout(self.edge.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.edge.body_timeout_s:g} s") from None
        return decode_body(
            raw,
            content_type=request.headers.get("Content-Type"),
            content_encoding=request.headers.get("Content-Encoding"),
            max_bytes=self.edge.max_body_bytes,
        )

    # ------------------------------------------------------------------ completions

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        dispatcher = self.dispatcher
        arrival = dispatcher.now()
        try:
            self._authorize(request)
            parsed = await self._read(request, chat=chat)
            if parsed.sampling.prompt_logprobs is not None and self.config.prefill.pipeline_size > 1:
                raise ApiError(
                    400,
                    "echo with logprobs needs the prompt's log-probabilities, which a pipelined prefill "
                    "([prefill] pipeline_size > 1) does not compute",
                    param="echo",
                )
            tokens = prompt_tokens(parsed, self.tokenizer, self.served)
            live = await dispatcher.admit(tokens, generation_limit(parsed.sampling, len(tokens), self.served), arrival)
        except ApiError as error:
            self.metrics.responses[str(error.status)].inc()
            raise
        dispatcher.submit(live)
        reply = Reply(
            name=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",  # unique across restarts, as vLLM's
            created=int(time.time()),
            model=self.served.name,
            chat=chat,
        )
        try:
            if parsed.stream:
                return await self._stream(request, live, reply, parsed)
            return await self._whole(live, reply, parsed)
        except (asyncio.CancelledError, ConnectionResetError):
            dispatcher.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)  # a no-op if it ended already
            raise

    def _text_stream(self, sampling: SamplingOptions) -> TextStream:
        """The request's text as its tokens come, ended as its sampling options say."""
        return self.tokenizer.stream(
            sampling.stop,
            skip_special_tokens=sampling.skip_special_tokens,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            stop_token_ids=sampling.stop_token_ids,
            include_stop=sampling.include_stop_str_in_output,
        )

    def _logprobs(self, reply: Reply, sampling: SamplingOptions) -> Logprobs | None:
        """The writer of the request's log-probabilities (None: it asked for none)."""
        if sampling.logprobs is None:
            return None
        return Logprobs(chat=reply.chat, k=sampling.logprobs, token_text=self.tokenizer.token_text)

    def _echoed(
        self, parsed: CompletionRequest | ChatRequest, live: LiveRequest
    ) -> tuple[str, list[tuple[int, TokenLogprobs | None]]] | None:
        """What a completion's `echo` puts before the generation: the prompt's text (as given, or its ids decoded
        whole, special tokens and stop ids included, as vLLM echoes them) and its tokens with their
        log-probabilities (the first has none; all none where none were asked); None without echo.

        Raises:
            ApiError: 500, the prefill did not report the log-probabilities asked of it (never nulls instead).
        """
        if not isinstance(parsed, CompletionRequest) or not parsed.echo:
            return None
        prompt = parsed.prompt if isinstance(parsed.prompt, str) else self.tokenizer.decode(parsed.prompt)
        if parsed.sampling.prompt_logprobs is None:
            return prompt, [(token, None) for token in live.tokens]
        scored = live.prompt_logprobs
        if scored is None or len(scored) != len(live.tokens) - 1:
            self.dispatcher.end(live, Outcome.ABORTED, Reason.FAILED)
            raise ApiError(500, "the prefill did not report the prompt's log-probabilities")
        return prompt, [(live.tokens[0], None), *zip(live.tokens[1:], scored, strict=True)]

    def _usage(self, live: LiveRequest, completion: int) -> Usage:
        return Usage(prompt_tokens=len(live.tokens), completion_tokens=completion, cached_tokens=live.cached_tokens)

    async def _whole(
        self, live: LiveRequest, reply: Reply, parsed: CompletionRequest | ChatRequest
    ) -> web.StreamResponse:
        text = self._text_stream(parsed.sampling)
        pieces, generated = [], []
        try:
            async for token in self.dispatcher.tokens(live):
                generated.append((token.token, token.logprobs))
                pieces.append(text.feed(token.token))
                if text.stopped:
                    self.dispatcher.finish(live)
                    break
        except ApiError as error:
            self.metrics.responses[str(error.status)].inc()
            raise
        pieces.append(text.finish())
        try:
            echoed = self._echoed(parsed, live)  # once tokens came: the prompt's log-probabilities came before them
        except ApiError as error:
            self.metrics.responses[str(error.status)].inc()
            raise
        self.metrics.responses["200"].inc()
        finish = "stop" if text.stopped else "length"
        if isinstance(parsed, CompletionRequest) and parsed.echo_only:  # the prompt alone: its one token dropped
            pieces, generated, finish = [], [], "length"
        logprobs = self._logprobs(reply, parsed.sampling)
        answer = reply.completion(
            (echoed[0] if echoed else "") + "".join(pieces),
            finish,
            self._usage(live, len(generated)),
            None if isinstance(parsed, CompletionRequest) and parsed.echo_only else text.stop_reason,
            logprobs=None if logprobs is None else logprobs.take([*(echoed[1] if echoed else []), *generated]),
        ).to_json()
        return web.json_response(answer, headers=_route_headers(live))

    async def _stream(
        self, request: web.Request, live: LiveRequest, reply: Reply, parsed: CompletionRequest | ChatRequest
    ) -> web.StreamResponse:
        tokens = self.dispatcher.tokens(live)
        text = self._text_stream(parsed.sampling)
        try:
            first = await tokens.__anext__()  # headers go out with the first token: a late rejection is still a 429
        except ApiError as error:
            self.metrics.responses[str(error.status)].inc()
            raise
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_route_headers(live)}
        )
        await response.prepare(request)
        self.metrics.responses["200"].inc()  # the status went out; a failure later is an error event in the stream
        count = 0
        logprobs = self._logprobs(reply, parsed.sampling)
        unshown: list[tuple[int, TokenLogprobs | None]] = []  # tokens whose text no chunk has carried yet

        def so_far() -> Usage | None:
            return self._usage(live, count) if parsed.continuous_usage else None

        def shown() -> dict[str, Any] | None:
            """The log-probabilities of the tokens the next chunk shows (all since the last chunk)."""
            if logprobs is None:
                return None
            taken = logprobs.take(unshown)
            unshown.clear()
            return taken

        if reply.chat:  # a chat stream opens with the assistant's role and no text, as vLLM's and OpenAI's do
            await response.write(reply.chunk("", role=True, usage=so_far()).to_sse())
        try:
            echoed = self._echoed(parsed, live)
            if echoed:  # the prompt first, as vLLM's stream echoes it, with its log-probabilities
                unshown += echoed[1]
                await response.write(reply.chunk(echoed[0], usage=so_far(), logprobs=shown()).to_sse())
            async for token in _following(first, tokens):
                if isinstance(parsed, CompletionRequest) and parsed.echo_only:
                    continue  # the prompt alone: the one token drawn for its prefill is not shown or counted
                count += 1
                unshown.append((token.token, token.logprobs))
                piece = text.feed(token.token)
                if piece:
                    await response.write(reply.chunk(piece, usage=so_far(), logprobs=shown()).to_sse())
                if text.stopped:
                    self.dispatcher.finish(live)
                    break
            rest = text.finish()
            finish = "stop" if text.stopped else "length"
            last = reply.chunk(
                rest or None,
                finish,
                stop_reason=text.stop_reason,
                usage=so_far(),
                logprobs=shown() if unshown else None,
            )
            await response.write(last.to_sse())
            if parsed.include_usage:
                await response.write(reply.usage_chunk(self._usage(live, count)).to_sse())
        except ApiError as error:
            await response.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")  # after an error event too, as vLLM ends every stream
        await response.write_eof()
        return response


# CORS as vLLM's server sets it by default (`--allowed-origins` "*", no credentials): browsers may call the API from
# any page, sending the key themselves. A preflight needs no key: browsers send none with it.
CORS_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


@web.middleware
async def _cors_preflight(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A browser's preflight (OPTIONS with Origin and Access-Control-Request-Method), answered before any route."""
    headers = request.headers
    if request.method != "OPTIONS" or "Origin" not in headers or "Access-Control-Request-Method" not in headers:
        return await handler(request)
    allowed = {"Access-Control-Allow-Methods": CORS_METHODS, "Access-Control-Max-Age": "600"}
    if "Access-Control-Request-Headers" in headers:
        allowed["Access-Control-Allow-Headers"] = headers["Access-Control-Request-Headers"]
    return web.Response(text="OK", headers=allowed)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer to a request from a page (an Origin header), streams included, may be read by it."""
    if "Origin" in request.headers:
        response.headers["Access-Control-Allow-Origin"] = "*"


def _route_headers(live: LiveRequest) -> dict[str, str]:
    """Where the request ran (`serving.api`'s headers)."""
    return {PREFILL_HEADER: str(live.prefill), DECODE_HEADER: str(live.decode)}


async def _following(first: wire.Token | None, tokens: AsyncIterator[wire.Token]) -> AsyncIterator[wire.Token]:
    """`first` (None: there is none), then the rest of `tokens`."""
    if first is None:
        return
    yield first
    async for token in tokens:
        yield token


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)
