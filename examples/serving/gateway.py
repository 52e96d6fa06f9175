"""The gateway: an OpenAI-compatible HTTP API in front of the Conductor and the engine workers.

Per request: check the API key (401 without it when one is set), read the body
within its deadline and decode and check it (`serving.api`: 400 naming the
field, 404 `model_not_found`, 400 `context_length_exceeded` over the prompt
limit, as vLLM answers) and let the
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
an error event; a whole answer whose decode engine fails mid-generation is generated again on another
(`Dispatcher._reroute`: its client has had none of it), the answer holding the retry's tokens alone; a client that hangs up, streaming or not, is cancelled on its
decode engine (aiohttp cancels the handler when its connection is lost).
Decoding, checking, chat rendering and tokenizing a body (and /tokenize's and
/detokenize's work) run on a few threads of their own (`PREPARE_THREADS`), never
on the event loop: tokenizing megabytes of text takes seconds, during which the
loop would deliver no token of any stream, admit nothing and answer no probe. A
text certainly over the prompt limit is refused before it is tokenized
(`api.encoded`). A client that leaves meanwhile cancels its handler: the work
is pure (nothing is admitted before it ends), so what a thread still computes is
dropped, and work not yet begun never runs.
`/metrics` serves the metrics (`serving.metrics`: vLLM's families under the
prefix `mooncake:`), `/health` (and vLLM's `/ping`) the engines up, `/v1/models`
the served model, `/version` this version, `/tokenize` and `/detokenize`
vLLM's token views; every GET route answers HEAD too. The API key guards the
routes under /v1 only, as vLLM's does (its middleware's guarded prefixes).

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
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
from aiohttp import HttpVersion11, web

import mooncake
from mooncake.engine.logprobs import CONTEXT_TOKENS, TokenLogprobs
from mooncake.sched.outcome import Outcome, Reason
from serving import wire
from serving.api import (
    DECODE_HEADER,
    PREFILL_HEADER,
    ApiError,
    ChatRequest,
    Choice,
    Chunk,
    Completion,
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
    parse_tokenize,
    prompt_logprobs_json,
    prompt_tokens,
    tokenize_body,
)
from serving.config import ClusterConfig
from serving.dispatch import Dispatcher, LiveRequest
from serving.machine import page_bytes
from serving.metrics import CONTENT_TYPE, ServingMetrics
from serving.models import build_conductor
from serving.protocol import EdgeLimits, GuardedSite, install_log_limits, loop_exception_handler
from serving.tokenizer import ServingTokenizer, TextStream, generation_defaults, serving_tokenizer

__all__ = ["Gateway"]

LOG = logging.getLogger("serving.gateway")
# Threads that decode and tokenize bodies: a few, so that a burst of large bodies queues here instead of taking every
# core from the engines beside the gateway (the tokenizers' work releases the GIL: these threads run in parallel).
PREPARE_THREADS = max(1, min(4, os.cpu_count() or 1))
T = TypeVar("T")


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
        defaults = generation_defaults(config)
        chat_max_tokens = defaults.pop("max_tokens", None)  # a completion's default stays vLLM's 16: the config's
        self.served = ServedModel(
            name=config.model.served_name,
            max_prompt_tokens=config.limits.max_prompt_tokens,
            default_max_tokens=config.limits.default_max_tokens,
            max_context_tokens=config.decode.max_context_tokens,
            vocab_size=config.model.config.vocab_size,
            default_chat_max_tokens=None if chat_max_tokens is None else int(chat_max_tokens),
            **{f"default_{name}": value for name, value in defaults.items()},
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
        self._preparing = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="gateway-prepare")
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
        app.on_response_prepare.append(self._count_answer)
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
        # Not waited for: a thread still tokenizing a body ends by itself, and nothing reads what it computes.
        self._preparing.shutdown(wait=False, cancel_futures=True)
        if self._uninstall_log_limits is not None:
            self._uninstall_log_limits()

    async def _count_answer(self, request: web.Request, response: web.StreamResponse) -> None:
        """Count an answer to a completion request by its status as its headers go out: the one place it is counted,
        so each answer counts once whoever made it (a handler, the error middleware: an ApiError, aiohttp's 413 for
        a body over the cap, the 500 of a failure; `_expect`'s 417). A stream counts as the 200 it starts with; a
        client gone before any header got no answer, and counts none."""
        if request.match_info.handler in (self._completions, self._chat):
            self.metrics.responses[str(response.status)].inc()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error answer as OpenAI's JSON body: ours, aiohttp's (404, 405, 413...) and the unexpected (a 500,
        unless a stream had begun: its connection is closed after what it sent)."""
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
            if request.writer.output_size > 0:
                # A stream's 200 went out: no answer can follow it. aiohttp's handler (`JsonRequestHandler`) logs the
                # failure and closes the connection.
                raise
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
        """vLLM's `/tokenize`: a completion's `prompt`, or a chat's `messages` through the chat template. Open without
        the API key, as vLLM's (its key guards only the paths under /v1)."""
        body = await self._body(request)

        def tokenized() -> str:  # the answer's JSON too: a million ids take a tenth of a second to write
            parsed, token_strs = parse_tokenize(body(), self.served)
            return json.dumps(tokenize_body(parsed, self.tokenizer, self.served, token_strs=token_strs))

        return web.json_response(text=await self._off_loop(tokenized))

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/detokenize`, open without the API key as `/tokenize` is."""
        body = await self._body(request)

        def detokenized() -> str:
            return json.dumps(detokenize_body(body(), self.tokenizer, self.served))

        return web.json_response(text=await self._off_loop(detokenized))

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

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """`work()`'s result, computed on a preparing thread (the module's docstring says why). Cancelled (the
        client left), work not yet begun is dropped and work under way runs out unread: it must change nothing."""
        return await asyncio.get_running_loop().run_in_executor(self._preparing, work)

    async def _body(self, request: web.Request) -> Callable[[], dict[str, Any]]:
        """The request's body, read within its deadline, and its decoding into a JSON object (`decode_body`), to be
        called off the loop: it reads nothing of `request`."""
        try:
            async with asyncio.timeout(self.edge.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.edge.body_timeout_s:g} s") from None
        return functools.partial(
            decode_body,
            raw,
            content_type=request.headers.get("Content-Type"),
            content_encoding=request.headers.get("Content-Encoding"),
            max_bytes=self.edge.max_body_bytes,
        )

    def _prepared(
        self, body: Callable[[], dict[str, Any]], *, chat: bool
    ) -> tuple[
        CompletionRequest | ChatRequest,
        list[CompletionRequest | ChatRequest],
        list[list[int]],
        list[SamplingOptions],
    ]:
        """A completion's body decoded and checked: the request, its prompts (a batch's each), their tokens and their
        sampling options with `max_tokens` settled (`generation_limit`), every prompt tokenized and checked before
        any is admitted (a bad one, its `min_tokens` over what its context leaves too, refuses the batch at once,
        as vLLM builds every prompt's sampling parameters before it runs any). Pure: run off the loop (`_off_loop`).

        Raises:
            ApiError: what `serving.api` refuses.
        """
        decoded = body()
        parsed = parse_chat(decoded, self.served) if chat else parse_completion(decoded, self.served)
        if parsed.sampling.prompt_logprobs is not None and self.config.prefill.pipeline_size > 1:
            field = "prompt_logprobs" if parsed.output.prompt_logprobs is not None else "echo"
            raise ApiError(
                400,
                f"{'prompt_logprobs' if field == 'prompt_logprobs' else 'echo with logprobs'} needs the "
                "prompt's log-probabilities, which a pipelined prefill ([prefill] pipeline_size > 1) does not "
                "compute",
                param=field,
            )
        prompts: list[CompletionRequest | ChatRequest] = (
            [*parsed.split()] if isinstance(parsed, CompletionRequest) else [parsed]
        )
        tokenized = [prompt_tokens(one, self.tokenizer, self.served) for one in prompts]
        settled = [
            generation_limit(one.sampling, len(tokens), self.served)
            for one, tokens in zip(prompts, tokenized, strict=True)
        ]
        return parsed, prompts, tokenized, settled

    # ------------------------------------------------------------------ completions

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """Serve one completion: its `n` choices are `n` requests of the cluster, each sent on as it is admitted;
        one refused withdraws those admitted before it (the answer is the refusal), and a choice failing later
        ends the others with it."""
        dispatcher = self.dispatcher
        arrival = dispatcher.now()
        lives: list[LiveRequest] = []
        asked: list[CompletionRequest | ChatRequest] = []  # each choice's request: its prompt's (a batch's one)
        try:
            self._authorize(request)
            body = await self._body(request)
            prepared = await self._off_loop(functools.partial(self._prepared, body, chat=chat))
            parsed, prompts, tokenized, settled = prepared
            for one, tokens, sampling in zip(prompts, tokenized, settled, strict=True):
                for index in range(one.n):
                    live = await dispatcher.admit(
                        tokens,
                        _choice_sampling(sampling, index),
                        arrival,
                        cache_salt=one.cache_salt,
                        streamed=parsed.stream,  # a whole answer's request may start again (`Dispatcher._reroute`)
                    )
                    lives.append(live)
                    asked.append(one)
                    dispatcher.submit(live)  # at once: a later choice waiting for room waits for these to make it
        except BaseException:  # a refusal, the client gone, or a bug (the error middleware's 500)
            self._withdraw(lives)
            raise
        reply = Reply(
            name=f"{'chatcmpl' if chat else 'cmpl'}-{_answer_id(request, parsed)}",
            created=int(time.time()),
            model=self.served.name,
            chat=chat,
        )
        try:
            if parsed.stream:
                return await self._stream(request, lives, reply, parsed, asked)
            return await self._whole(lives, reply, parsed, asked)
        except BaseException:
            # The client left, or an error ended the answer: a refusal, or a bug raised while reading a choice (the
            # error middleware's 500), which would otherwise leave its request decoding for nobody.
            self._withdraw(lives)
            raise

    def _withdraw(self, lives: list[LiveRequest]) -> None:
        """Abort the choices still live (their client left, or another choice of theirs failed: its answer is
        the error, and nobody reads theirs), cancelling them on their engines; no-ops for the ones counted already
        (one whose last token came unread counts as aborted: its client got no answer of it)."""
        for live in lives:
            self.dispatcher.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)

    def _text_stream(self, sampling: SamplingOptions, prompt: Sequence[int]) -> TextStream:
        """The request's text as its tokens come after `prompt`, ended as its sampling options say."""
        return self.tokenizer.stream(
            sampling.stop,
            skip_special_tokens=sampling.skip_special_tokens,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            stop_token_ids=sampling.stop_token_ids,
            include_stop=sampling.include_stop_str_in_output,
            prompt=prompt,
        )

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
        # A text as sent (vLLM's); ids as the engines got them (after `truncate_prompt_tokens`), decoded whole.
        prompt = parsed.prompt if isinstance(parsed.prompt, str) else self.tokenizer.decode(live.tokens)
        if parsed.sampling.prompt_logprobs is None:
            return prompt, [(token, None) for token in live.tokens]
        scored = self._scored(live)
        return prompt, [(live.tokens[0], None), *zip(live.tokens[1:], scored, strict=True)]

    def _scored(self, live: LiveRequest) -> tuple[TokenLogprobs, ...]:
        """The prompt's log-probabilities its prefill reported (tokens 1 to n - 1).

        Raises:
            ApiError: 500, the prefill did not report them though they were asked of it (never nulls instead).
        """
        scored = live.prompt_logprobs
        if scored is None or len(scored) != len(live.tokens) - 1:
            self.dispatcher.end(live, Outcome.ABORTED, Reason.FAILED)
            raise ApiError(500, "the prefill did not report the prompt's log-probabilities")
        return scored

    def _usage(self, lives: list[LiveRequest], completion: int, n: int) -> Usage:
        """A usage: each prompt once (`lives` hold `n` choices of each, in order; its cached tokens its first
        choice's) and `completion` tokens."""
        firsts = lives[::n]
        return Usage(
            prompt_tokens=sum(len(first.tokens) for first in firsts),
            completion_tokens=completion,
            cached_tokens=sum(first.cached_tokens for first in firsts),
        )

    def _choices(
        self, lives: list[LiveRequest], reply: Reply, asked: list[CompletionRequest | ChatRequest]
    ) -> list[_Choice]:
        """The answer's choices, in index order: each live request with the request of its prompt."""
        return [
            self._choice(live, index, reply, one) for index, (live, one) in enumerate(zip(lives, asked, strict=True))
        ]

    def _choice(self, live: LiveRequest, index: int, reply: Reply, parsed: CompletionRequest | ChatRequest) -> _Choice:
        sampling, output = parsed.sampling, parsed.output
        logprobs = None
        if sampling.logprobs is not None:
            # vLLM's `return_tokens_as_token_ids`: a token any client can tell from another, whatever its bytes.
            if output.tokens_as_ids:
                logprobs = Logprobs(chat=reply.chat, k=sampling.logprobs, token_text=_token_id_text)
            else:
                echoed = len(live.tokens) if isinstance(parsed, CompletionRequest) and parsed.echo else 0
                logprobs = _SequenceLogprobs(
                    chat=reply.chat, k=sampling.logprobs, tokenizer=self.tokenizer, echoed=echoed
                )
        echo_only = isinstance(parsed, CompletionRequest) and parsed.echo_only
        prompt_ids = tuple(live.tokens) if output.return_token_ids else None
        return _Choice(
            live,
            index,
            reply,
            self._text_stream(sampling, live.tokens),
            logprobs,
            echo_only=echo_only,
            prompt_ids=prompt_ids,
        )

    async def _whole(
        self,
        lives: list[LiveRequest],
        reply: Reply,
        parsed: CompletionRequest | ChatRequest,
        asked: list[CompletionRequest | ChatRequest],
    ) -> web.StreamResponse:
        choices = self._choices(lives, reply, asked)
        try:
            await _together([self._read_tokens(choice, one) for choice, one in zip(choices, asked, strict=True)])
            # After the tokens: the prompt's log-probabilities came before them.
            k = parsed.output.prompt_logprobs
            whole = [
                choice.whole(
                    self._echoed(one, choice.live),
                    # Each choice's prefill scored its own prompt.
                    None
                    if k is None
                    else _prompt_logprobs(self.tokenizer, choice.live.tokens, self._scored(choice.live), k),
                )
                for choice, one in zip(choices, asked, strict=True)
            ]
        except ApiError:
            self._withdraw(lives)
            raise
        answer = Completion(
            reply=reply,
            choices=tuple(whole),
            usage=self._usage(lives, sum(choice.count for choice in choices), parsed.n),
        )
        return web.json_response(answer.to_json(), headers=_route_headers(lives))

    async def _read_tokens(self, choice: _Choice, parsed: CompletionRequest | ChatRequest) -> None:
        """Feed a choice its tokens until it ends (a stop string ends its request here). A token of another attempt
        than the ones before it (the request was scheduled again after its decode engine failed: `_reroute`) starts
        the choice again: the answer holds the last attempt's tokens only."""
        async for token in self.dispatcher.tokens(choice.live):
            if choice.attempt is not None and token.attempt != choice.attempt:
                choice.restart(self._text_stream(parsed.sampling, choice.live.tokens))
            choice.feed(token)
            if choice.text.stopped:
                break
        self.dispatcher.finish(choice.live, choice.finish_reason(), choice.answered_tokens())

    async def _stream(
        self,
        request: web.Request,
        lives: list[LiveRequest],
        reply: Reply,
        parsed: CompletionRequest | ChatRequest,
        asked: list[CompletionRequest | ChatRequest],
    ) -> web.StreamResponse:
        streams = [self.dispatcher.tokens(live) for live in lives]
        try:
            # Headers go out with every choice's first token (a late rejection is still a 429), waited for together:
            # one choice refused ends the wait for the others.
            firsts: list[wire.Token | None] = await _together([_first(tokens) for tokens in streams])
        except ApiError:
            self._withdraw(lives)
            raise
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_route_headers(lives)}
        )
        await response.prepare(request)  # the 200 is counted (`_count_answer`); a failure later is an error event
        choices = self._choices(lives, reply, asked)

        def so_far(choice: _Choice) -> Usage | None:
            """The usage so far of `choice` (continuous_usage_stats: its prompt and its own tokens, as vLLM's)."""
            return self._usage([choice.live], choice.count, 1) if parsed.continuous_usage else None

        events: asyncio.Queue[Chunk | None] = asyncio.Queue()

        async def pump(choice: _Choice, first: wire.Token | None, tokens: AsyncIterator[wire.Token]) -> None:
            """One choice's chunks into the queue, in order; None once it ended."""
            echoed = self._echoed(asked[choice.index], choice.live)
            if echoed:  # the prompt first, as vLLM's stream echoes it, with its log-probabilities
                events.put_nowait(choice.echo_chunk(echoed, so_far(choice)))
            async for token in _following(first, tokens):
                piece = choice.feed(token)
                if piece:
                    events.put_nowait(choice.chunk(piece, so_far(choice)))
                if choice.text.stopped:
                    break
            self.dispatcher.finish(choice.live, choice.finish_reason(), choice.answered_tokens())
            events.put_nowait(choice.last_chunk(so_far(choice)))
            events.put_nowait(None)

        if reply.chat:  # a chat stream opens with the assistant's role and no text, as vLLM's and OpenAI's do
            for choice in choices:
                await response.write(choice.role_chunk(so_far(choice)).to_sse())
        pumps = [
            asyncio.ensure_future(pump(choice, first, tokens))
            for choice, first, tokens in zip(choices, firsts, streams, strict=True)
        ]
        waiting: asyncio.Future[Chunk | None] | None = None
        try:
            ended = 0
            while ended < len(pumps):
                failed = next((p for p in pumps if p.done() and not p.cancelled() and p.exception() is not None), None)
                if failed is not None:
                    # A choice failed (a choice that ended well queued its None first): the others stop at once,
                    # what was queued before goes out, then the error ends the stream.
                    for p in pumps:
                        p.cancel()
                    while not events.empty():
                        if (queued := events.get_nowait()) is not None:
                            await response.write(queued.to_sse())
                    raise failed.exception()  # type: ignore[misc]
                if events.empty():
                    waiting = asyncio.ensure_future(events.get())
                    await asyncio.wait(
                        [waiting, *(p for p in pumps if not p.done())], return_when=asyncio.FIRST_COMPLETED
                    )
                    if not waiting.done():  # a choice's pump ended without a chunk: look again
                        waiting.cancel()
                        continue
                    chunk, waiting = waiting.result(), None
                else:
                    chunk = events.get_nowait()
                if chunk is None:
                    ended += 1
                    continue
                await response.write(chunk.to_sse())
            if parsed.include_usage:
                total = sum(choice.count for choice in choices)
                await response.write(reply.usage_chunk(self._usage(lives, total, parsed.n)).to_sse())
        except ApiError as error:
            self._withdraw(lives)
            await response.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
        finally:
            for p in pumps:
                p.cancel()
            if waiting is not None:  # the client left during the wait: no task is left pending for the collector
                waiting.cancel()
        await response.write(b"data: [DONE]\n\n")  # after an error event too, as vLLM ends every stream
        await response.write_eof()
        return response


class _Choice:
    """One choice of an answer as its tokens come: its text stream, log-probabilities and token count, and the
    chunks or the whole choice they make.

    `echo_only` (echo with `max_tokens: 0`): the one token drawn is neither shown nor counted. `prompt_ids`
    (`return_token_ids`): the prompt's token ids, which the choice's first chunk carries (a chat's role chunk);
    then each chunk carries the ids of the tokens that came since the last, as its log-probabilities.
    """

    def __init__(
        self,
        live: LiveRequest,
        index: int,
        reply: Reply,
        text: TextStream,
        logprobs: Logprobs | None,
        *,
        echo_only: bool = False,
        prompt_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.live, self.index, self.reply, self.logprobs = live, index, reply, logprobs
        self.echo_only, self.prompt_ids = echo_only, prompt_ids
        self._opened = False  # a chunk of this choice went out
        self.restart(text)

    def restart(self, text: TextStream) -> None:
        """Forget the tokens fed so far (those of an attempt abandoned after its decode engine failed: a whole
        answer, of which no chunk went out), to be fed again from the first, the text read by `text`."""
        assert not self._opened, "a choice whose chunks went out cannot start again"
        self.text = text
        self.attempt: int | None = None  # the attempt of the tokens fed
        self.count = 0  # tokens generated, as the usage counts them
        self.pieces: list[str] = []
        self.generated: list[tuple[int, TokenLogprobs | None]] = []
        self._unshown: list[tuple[int, TokenLogprobs | None]] = []  # tokens whose text no chunk has carried yet
        self._unshown_ids: list[int] = []  # of them, the generated ones (`return_token_ids`)
        self._end: tuple[str, str, str | int | None] | None = None  # `_ending`, once read

    def answered_tokens(self) -> int | None:
        """The generated tokens the answer holds (its usage's), which the metrics count; None for an echo-only
        choice, whose one token drawn the metrics count as vLLM does (it runs such a request for one token)."""
        return None if self.echo_only else self.count

    def feed(self, token: wire.Token) -> str:
        """Take the next token; the text it lets out (none for an echo-only choice)."""
        self.attempt = token.attempt
        if self.echo_only:
            return ""
        self.count += 1
        self.generated.append((token.token, token.logprobs))
        self._unshown.append((token.token, token.logprobs))
        self._unshown_ids.append(token.token)
        piece = self.text.feed(token.token)
        self.pieces.append(piece)
        return piece

    def _chunk(self, text: str | None, usage: Usage | None, **fields: Any) -> Chunk:
        """A chunk of this choice: the log-probabilities and ids of the tokens that came since its last chunk, and
        the prompt's ids in its first where asked."""
        logprobs = None
        if self.logprobs is not None and self._unshown:
            logprobs = self.logprobs.take(self._unshown)
        self._unshown.clear()
        ids = None if self.prompt_ids is None or fields.get("role") else tuple(self._unshown_ids)
        if ids is not None:
            self._unshown_ids.clear()
        prompt = self.prompt_ids if not self._opened else None
        self._opened = True
        return self.reply.chunk(
            text, usage=usage, logprobs=logprobs, index=self.index, token_ids=ids, prompt_token_ids=prompt, **fields
        )

    def role_chunk(self, usage: Usage | None) -> Chunk:
        """A chat choice's first chunk: the assistant's role, no text."""
        return self._chunk("", usage, role=True)

    def echo_chunk(self, echoed: tuple[str, list[tuple[int, TokenLogprobs | None]]], usage: Usage | None) -> Chunk:
        self._unshown[:0] = echoed[1]
        return self._chunk(echoed[0], usage)

    def chunk(self, piece: str, usage: Usage | None) -> Chunk:
        return self._chunk(piece, usage)

    def _ending(self) -> tuple[str, str, str | int | None]:
        """At the end: the text held back, the finish reason and the stop reason (the one rule of both answers and
        of the metrics). Read once: the text's `finish` gives what it held back once, and may itself complete a
        stop string (a character its last bytes finish), so the reason is known only after it."""
        if self._end is None:
            rest = "" if self.echo_only else self.text.finish()
            stop_reason = None if self.echo_only else self.text.stop_reason
            self._end = rest, "stop" if self.text.stopped else "length", stop_reason
        return self._end

    def finish_reason(self) -> str:
        """The choice's finish reason, once its tokens are in: the answer's, and the one its request is counted
        with (`Dispatcher.finish`), so the metrics never tell another than the client was told."""
        return self._ending()[1]

    def last_chunk(self, usage: Usage | None) -> Chunk:
        """The choice's last chunk: the text held back, its finish reason, the tokens not shown yet."""
        rest, finish, stop_reason = self._ending()
        return self._chunk(rest or None, usage, finish_reason=finish, stop_reason=stop_reason)

    def whole(
        self,
        echoed: tuple[str, list[tuple[int, TokenLogprobs | None]]] | None,
        prompt_logprobs: list[Any] | None = None,
    ) -> Choice:
        """The choice whole, once its tokens are in (the echoed prompt before them; `prompt_logprobs`: its prompt's
        listing, where asked)."""
        rest, finish, stop_reason = self._ending()
        entries = [*(echoed[1] if echoed else []), *self.generated]
        return Choice(
            text=(echoed[0] if echoed else "") + "".join(self.pieces) + rest,
            finish_reason=finish,
            stop_reason=stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs.take(entries),
            token_ids=None if self.prompt_ids is None else tuple(token for token, _ in self.generated),
            prompt_token_ids=self.prompt_ids,
            prompt_logprobs=prompt_logprobs,
        )


class _SequenceLogprobs(Logprobs):
    """`Logprobs` whose token texts read as vLLM's do in sequence: a byte of a character shows "" until its last
    byte, which shows the character (`token_text` after a context). A place's context, for its token and the
    alternatives beside it alike, is the last tokens before it that have log-probabilities (vLLM's sampled ones);
    the echoed prompt's (`echoed` tokens, which come first) and the generation's apart, as vLLM keeps its prompt's
    and its sample's log-probabilities apart (a prompt's first token has none, so it is never context). A token
    without log-probabilities reads as its lone decode, as vLLM writes one (no space restored, no context)."""

    def __init__(self, *, chat: bool, k: int, tokenizer: ServingTokenizer, echoed: int = 0) -> None:
        super().__init__(chat=chat, k=k, token_text=self._text)
        self._tokenizer, self._echoed_left = tokenizer, echoed
        self._context: list[int] = []  # the tokens before the next place that count
        self._scored = True  # the place being written has log-probabilities

    def _text(self, token: int) -> str:
        if not self._scored:
            return self._tokenizer.decode([token])
        return self._tokenizer.token_text(token, context=self._context)

    def take(self, tokens: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        """As `Logprobs.take`, a place at a time (each with its own context); the parts joined (each field a
        list, as both shapes have them)."""
        taken = super().take([])
        for token, entry in tokens:
            self._scored = entry is not None
            for field, values in super().take([(token, entry)]).items():
                taken[field].extend(values)
            if entry is not None:
                self._context = [*self._context, token][-CONTEXT_TOKENS:]
            if self._echoed_left:
                self._echoed_left -= 1
                if not self._echoed_left:
                    self._context = []  # the generation's context starts after the prompt's, empty
        return taken


def _prompt_logprobs(
    tokenizer: ServingTokenizer, tokens: Sequence[int], scored: Sequence[TokenLogprobs], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """`prompt_logprobs_json`, each place's texts read after the prompt's tokens before it as vLLM reads them (its
    last `CONTEXT_TOKENS`, from the second token on: the first has no log-probabilities, so vLLM never counts it)."""
    listed: list[dict[str, dict[str, Any]] | None] = [None]
    for at in range(1, len(tokens)):
        text = functools.partial(tokenizer.token_text, context=tokens[max(1, at - CONTEXT_TOKENS) : at])
        listed.append(prompt_logprobs_json(tokens[at - 1 : at + 1], scored[at - 1 : at], k, text)[1])
    return listed


def _token_id_text(token: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` writes it beside its log-probability."""
    return f"token_id:{token}"


def _choice_sampling(sampling: SamplingOptions, index: int) -> SamplingOptions:
    """Choice `index`'s sampling: the request's, a seed moved on by the index (vLLM's rule for `n`), so the choices
    are independent draws yet each reproducible; without a seed each draws its own at admission."""
    if index == 0 or sampling.seed is None:
        return sampling
    return attrs.evolve(sampling, seed=(sampling.seed + index) % (1 << 64))


async def _first(tokens: AsyncIterator[wire.Token]) -> wire.Token | None:
    """A choice's first token (None: it ended with none)."""
    try:
        return await tokens.__anext__()
    except StopAsyncIteration:
        return None


async def _together(reads: list[Any]) -> list[Any]:
    """Run the choices' reads at once, their results in order; the first to fail cancels the others and raises
    its error."""
    if len(reads) == 1:
        return [await reads[0]]
    tasks = [asyncio.ensure_future(read) for read in reads]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each has stopped reading before it is withdrawn
        raise


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


def _answer_id(request: web.Request, parsed: CompletionRequest | ChatRequest) -> str:
    """The answer's id after its `cmpl-` or `chatcmpl-`, as vLLM 0.32 takes it (`_base_request_id`): the client's
    `X-Request-Id` header (its bytes as latin-1, as Starlette reads a header), else the body's `request_id`, else a
    fresh uuid (unique across restarts). Only the answer shows it: the dispatcher numbers the cluster's requests
    itself, so two requests sending the same id (vLLM appends a random suffix to its internal ids for the same
    reason) never meet on an engine or in the Conductor."""
    given = request.headers.get("X-Request-Id")
    if given is not None:
        # aiohttp decodes a header's bytes as UTF-8, a byte outside it becoming a lone surrogate, which is no valid
        # JSON text for a strict client; vLLM's server (Starlette) decodes every byte as latin-1 (0xff is "ÿ"), so
        # the same bytes give the id vLLM's would.
        return given.encode("utf-8", "surrogateescape").decode("latin-1")
    return uuid.uuid4().hex if parsed.request_id is None else parsed.request_id


def _route_headers(lives: list[LiveRequest]) -> dict[str, str]:
    """Where the request ran (`serving.api`'s headers): each choice's instance, in index order, comma-separated."""
    return {
        PREFILL_HEADER: ",".join(str(live.prefill) for live in lives),
        DECODE_HEADER: ",".join(str(live.decode) for live in lives),
    }


async def _following(first: wire.Token | None, tokens: AsyncIterator[wire.Token]) -> AsyncIterator[wire.Token]:
    """`first` (None: there is none), then the rest of `tokens`."""
    if first is None:
        return
    yield first
    async for token in tokens:
        yield token


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)
