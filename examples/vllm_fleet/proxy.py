"""The router's HTTP side: an OpenAI-compatible proxy in front of the fleet.

`POST /v1/completions` and `/v1/chat/completions`: the prompt is tokenized with
the servers' tokenizer (a chat through its template, as vLLM renders it:
`vllm_fleet.prompt`; one the router cannot render is routed by its texts and
left to the server to answer), the `Fleet` schedules it (keyed in a LoRA
adapter's namespace when its `model` is none of the served names: `_adapter`)
(429 with `Retry-After` when the Conductor rejects it: the estimated TTFT
misses `[router] ttft_slo_s`, or no server can hold it), and the body goes
unchanged to the chosen server (a disaggregated pair: first the prompt with
`max_tokens` 1 and `kv_transfer_params` asking for a remote decode to the
prefill server, then the body with the parameters it answered to the decode
server, as vLLM's disaggregated-serving proxy does); its answer streams back as it comes (SSE
passed through line by line), with the headers `X-Mooncake-Prefill-Instance`,
`X-Mooncake-Decode-Instance` and `X-Mooncake-Cached-Tokens` (the prefix the
router expected the server to hold). The client's end-to-end headers go to the
server (`Authorization`, `X-Request-Id`...) and the server's come back, on a
stream too. A stream's usage is asked of the server
(`stream_options.include_usage`) to count the tokens; the client sees the usage
chunk only if it asked for it (and the usage in every chunk only if it asked for
that with it). A chat that sets no `max_tokens` runs to the context's end in vLLM
and is planned for `default_max_tokens`, or the room its prompt leaves if less.

Failures: a server that cannot be reached, or answers 502/503/504, before
anything was streamed is marked down (it leaves routing; its requests end) and
the request is scheduled again, up to `[router] max_retries` times; a failure
after the first byte ends the stream with an error event. A request that runs
past `[router] request_timeout_s` (aiohttp's total limit, not a socket's
connect or read timeout) is a 504, or a stream's error event, and its server,
slow rather than gone, stays up. Each server's
`/health` and `/metrics` are read every `health_interval_s`, all servers at
once: `/health` alone says whether a server is up (`health_failures` failed
checks in a row mark it down; a request's failure, above, marks it at once),
and a `/metrics` that fails or runs past `connect_timeout_s` leaves the load
as last read (`load_stale` in `/health`), the server up and its cache in the
index. A down server that answers again is probed as at start-up and marked up (its KV events start
a new epoch) unless it came back unlike itself (another model, block size or
tokenizer: it stays down, the reason logged once); its limits follow a new
`max_model_len` or KV capacity. A server that cannot be reached at start-up (refused, timed out, not
HTTP, 502/503/504: still loading its model, or restarting) is logged and starts down, and joins so once
its health checks pass; the router starts while one server answers (it learns the model from one), and
only a server that answers what the router cannot use stops the start. A client
that leaves closes the request's upstream connection, and the server aborts the
request as it would for that client leaving it directly (vLLM 0.32 missed one
of 20 whole answers so, directly and through the router alike).

`GET /v1/models` (every card the servers list: each served name, each LoRA
adapter), `POST /tokenize` and `/detokenize` (passed to a server that is up),
`/health` (200 while the servers up can serve a request: one of role `both`,
or a prefill one and a decode one; with each one's state), `/metrics` (the
router's own, `serving.metrics`'s families: responses by status, every answer
to a completion counted, a 500 too; rejections by reason, TTFT and
inter-token latency as a stream's chunks arrive (a whole answer's tokens come
at once: no inter-token latency), generated tokens and finish reasons as each
answer's usage and `finish_reason` say (vLLM's engine reasons: `tool_calls`
is its `stop`), prefix hits as each server reports them in its usage,
`prompt_tokens_details.cached_tokens`, else as the router expected them;
`engine` is the instance id; each server's `vllm:` counters are in its own
`/metrics`). Requests and health checks have
sessions of their own, with no cap on connections: a burst of requests never
makes a health check wait for a connection and time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from serving.api import (
    DECODE_HEADER,
    PREFILL_HEADER,
    ApiError,
    authorized,
    cache_salt,
    check_output_limit,
    decode_body,
    echo_only,
    error_body,
    max_tokens_within,
    output_limit_field,
    rejection_error,
    requested_max_tokens,
    stream_flag,
    stream_usage,
    vllm_prompt_logprobs,
)
from serving.metrics import CONTENT_TYPE, FinishedRequest, HistogramBounds, ServingMetrics, counted_finish_reason
from serving.protocol import http_url
from vllm_events import KvEventSubscriber

from mooncake import _json
from mooncake.cache import BlockIndex
from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched import Outcome, Reason, http_status
from mooncake.types import InstanceId, as_token_array, prefix_reusable
from vllm_fleet.config import InstanceSection, RouterConfig
from vllm_fleet.fleet import Fleet, FleetInstance, Flight
from vllm_fleet.prompt import prompt_of
from vllm_fleet.upstream import PROBE_TEXT, InstanceInfo, calibrate, lines, probe, reprobe, scrape

__all__ = ["CACHED_HEADER", "VllmRouter"]

log = logging.getLogger("vllm_router")
CACHED_HEADER = "X-Mooncake-Cached-Tokens"
FAILOVER_STATUSES = frozenset({502, 503, 504})
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "server", "date"}
)
MAX_BODY_BYTES = 32 << 20
VLLM_COMPLETION_MAX_TOKENS = 16  # vLLM's (and OpenAI's) max_tokens for a completion that sets none
SHUTDOWN_GRACE_S = 5.0  # what a request still in flight gets at `close` before it is cancelled (aiohttp's: 60 s)
# Set on a request once its streamed answer has begun: no other answer can follow.
PREPARED = web.RequestKey("mooncake_prepared", bool)
# A stream's chunks, read without parsing each: one with a choice carries tokens (a usage chunk's choices are
# empty), unless it is a chat's first, which only names the role; a finish reason, where a chunk gives one.
_CHOICE = re.compile(rb'"choices":\s*\[\s*\{')
_ROLE_ONLY = re.compile(rb'"delta":\s*\{\s*"role"')
_FINISH = re.compile(rb'"finish_reason":\s*"([A-Za-z_]+)"')


# What vLLM's disaggregated-serving proxy asks of the prefill server: keep the KV for a decode elsewhere.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class _ServerFailed(Exception):
    """A server failed before anything was streamed: mark it down and try another."""

    def __init__(self, instance_id: InstanceId, message: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class _TimedOut(Exception):
    """The request ran past `request_timeout_s` on a server that is slow, not gone: a 504, the server stays up."""

    def __init__(self, instance_id: InstanceId) -> None:
        super().__init__(instance_id)
        self.instance_id = instance_id


def _unreachable(error: ConfigError) -> bool:
    """Whether a start-up probe's refusal is only that its server could not be reached (what `probe` raises
    from): refused or timed out, an answer that is not HTTP, or one of `FAILOVER_STATUSES` (a gateway in front
    of a server still loading its model). Any other answer (a 404, a 401, a body that is not vLLM's) is the
    server's own, refused."""
    cause = error.__cause__
    if isinstance(cause, aiohttp.ClientResponseError):
        # aiohttp raises one for an answer it cannot parse too: its cause is the parser's error, not a status.
        return cause.status in FAILOVER_STATUSES or isinstance(cause.__cause__, HttpProcessingError)
    return isinstance(cause, (aiohttp.ClientError, TimeoutError, OSError))


def _ran_out(error: BaseException) -> bool:
    """Whether an upstream error is the request's own time running out: aiohttp's total timeout is a plain
    TimeoutError; its socket timeouts (`ServerTimeoutError`: connect, read) are the server's, as the rest are."""
    return isinstance(error, TimeoutError) and not isinstance(error, aiohttp.ServerTimeoutError)


def _failure(instance_id: InstanceId, error: BaseException) -> Exception:
    """What an upstream error before the first byte streamed means (see `_ran_out`)."""
    return _TimedOut(instance_id) if _ran_out(error) else _ServerFailed(instance_id, f"{type(error).__name__}: {error}")


class VllmRouter:
    """The proxy, its fleet and its background tasks. `await start()`, then `url`; `await close()` stops all."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.settings = config.router
        self.tokenizer = load_tokenizer(self.settings.tokenizer)
        self.fleet: Fleet | None = None
        self.metrics: ServingMetrics | None = None
        self.url = ""
        self.model = ""
        self._session: aiohttp.ClientSession | None = None
        self._checks: aiohttp.ClientSession | None = None  # health checks': never queued behind requests
        self._cards: list[tuple[dict[str, Any], ...]] = []  # each server's /v1/models cards
        self._served: frozenset[str] = frozenset()  # the model's names (`--served-model-name a b`): no adapter's
        self._max_model_len = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Probe every server, bind the KV-event endpoints, start serving; returns the URL. A server that cannot
        be reached (`_unreachable`: one still loading its model, or restarting) is logged and added down: it
        joins when its health checks pass (`_check`, `_reprobe`).

        Raises:
            ConfigError: a server answers what the router cannot use (the first, in config order), the servers
                serve different models, or none can be reached (naming each); the router's address is refused.
        """
        key = self.settings.server_api_key  # the servers' own --api-key, on every call the router makes itself
        keyed = {"Authorization": f"Bearer {key}"} if key else None

        def pool() -> aiohttp.ClientSession:
            # aiohttp's default connector holds 100 connections: the 101st request would wait for one, counted as
            # queued on its server, and a fleet of over 100 servers' health checks would wait too, time out and
            # mark healthy servers down. So neither pool has a cap.
            return aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0), headers=keyed
            )

        self._session = pool()
        self._checks = pool()
        try:
            probes = await asyncio.gather(
                *(
                    probe(
                        self._session,
                        name,
                        section.base_url,
                        block_size=self.settings.block_size,
                        tokenizer=self.tokenizer,
                        timeout_s=max(self.settings.connect_timeout_s, 5.0),
                    )
                    for name, section in zip(self.config.instance_ids, self.config.instances, strict=True)
                ),
                return_exceptions=True,
            )
            answered = self._answered(probes)  # None: unreachable
            infos = [info for info in answered if info is not None]
            models = {info.model for info in infos}
            if len(models) > 1:
                raise ConfigError(f"{self.config.source}: the instances serve different models: {sorted(models)}")
            self.model = infos[0].model
            self._served = frozenset(name for info in infos for name in info.served_names)
            # A server unreachable at start-up lists its cards once it joins (`_reprobe`).
            self._cards = [() if info is None else info.cards or (info.card,) for info in answered]
            self.fleet = Fleet(self.config, answered, subscribe=_subscriber, now=time.monotonic())
            fleet = self.fleet
            self._max_model_len = fleet.max_model_len
            fleet.hasher.block_keys(self.tokenizer.encode(PROBE_TEXT))  # compiles the hashing kernel before traffic
            longest = min(self.settings.calibration_tokens, min(info.max_model_len for info in infos) - 1)
            if longest >= 8:
                lengths = [max(1, longest // 8), longest // 2, longest]
                answered = [instance for instance in fleet.instances.values() if instance.probed]
                for number, instance in enumerate(answered):
                    fleet.prefill_model.calibrate(
                        await calibrate(
                            self._session,
                            instance.url,
                            self.model,
                            vocab_size=self.tokenizer.vocab_size,
                            lengths=lengths,
                            seed=time.time_ns() + number,  # prompts no server has cached
                            timeout_s=max(60.0, self.settings.connect_timeout_s),
                        )
                    )
                c0, c1, c2 = fleet.prefill_model.current.coefficients
                log.info(
                    "prefill model from %d timed prefills: %.4f s + %.3g s/token + %.3g s/token^2",
                    len(fleet.prefill_model.samples),
                    c0,
                    c1,
                    c2,
                )
            self.metrics = ServingMetrics(
                model_name=self.model,
                bounds=HistogramBounds(
                    longest_request_s=self.settings.request_timeout_s,
                    max_prompt_tokens=self._max_model_len,
                    max_output_tokens=self._max_model_len,
                ),
                prefill_engines=fleet.instances,
                decode_engines=fleet.instances,
            )
            for instance_id, instance in fleet.instances.items():
                self.metrics.up[instance_id].set(1 if instance.up else 0)
            app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/tokenize", self._pass)
            app.router.add_post("/detokenize", self._pass)
            app.router.add_get("/health", self._health)
            app.router.add_get("/metrics", self._metrics)
            self._runner = web.AppRunner(
                app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
            try:
                await site.start()
            except OSError as error:  # in use, not this host's address, a privileged port
                raise ConfigError(
                    f"{self.config.source}: [router] host = {self.settings.host!r}, port = {self.settings.port}: "
                    f"the router cannot listen there: {error.strerror or error}"
                ) from error
            sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
            port = sockets[0].getsockname()[1]
            self.url = http_url(self.settings.host, port)
            self._tasks = [asyncio.create_task(self._event_loop()), asyncio.create_task(self._health_loop())]
        except BaseException:
            await self.close()
            raise
        return self.url

    def _answered(self, probes: Sequence[InstanceInfo | BaseException]) -> list[InstanceInfo | None]:
        """Each server's probe, in config order, None for one that could not be reached (logged: it starts down).

        Raises:
            ConfigError: the first server's (config order) that answered what the router cannot use, or one
                naming every server when none could be reached.
            BaseException: any other failure of a probe, as it came.
        """
        unreachable: list[str] = []
        for result in probes:
            if isinstance(result, ConfigError) and _unreachable(result):
                unreachable.append(str(result))
            elif isinstance(result, BaseException):
                raise result
        if len(unreachable) == len(probes):
            raise ConfigError(f"{self.config.source}: no instance can be reached: {'; '.join(unreachable)}")
        for reason in unreachable:
            log.warning("%s; it starts down and joins once its health checks pass", reason)
        return [None if isinstance(result, BaseException) else result for result in probes]

    async def close(self) -> None:
        """Stop serving (requests still in flight get `SHUTDOWN_GRACE_S`, then are cancelled) and close the
        sessions and the KV-event subscribers, the last whatever failed before."""
        try:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks = []
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            for session in (self._session, self._checks):
                if session is not None:
                    await session.close()
            self._session = self._checks = None
        finally:
            if self.fleet is not None:
                self.fleet.close()

    async def _event_loop(self) -> None:
        """Apply the servers' KV events as they come (every few ms; a replay's answer is read over later polls, never waited on)."""
        assert self.fleet is not None
        while True:
            if not self.fleet.poll_events():
                await asyncio.sleep(0.005)
            else:
                await asyncio.sleep(0)

    async def _health_loop(self) -> None:
        assert self.fleet is not None
        while True:
            # First the interval: `start` has just probed every server. (A pass at once raced the first requests:
            # it could mark up again, from a /health asked before, a server a request had just found failing.)
            await asyncio.sleep(self.settings.health_interval_s)
            # All at once: one slow server never delays the others' checks.
            await asyncio.gather(*(self._check(instance) for instance in list(self.fleet.instances.values())))

    async def _check(self, instance: FleetInstance) -> None:
        """One health check of one server. Its `/health` alone decides whether it is up: `health_failures`
        failures in a row mark it down (a blip or one slow answer does not empty its cache from the index, which
        without a replay socket would never come back); one that answers again is probed (`_reprobe`) before it
        is marked up. Its `/metrics` gives its load (`_scrape`)."""
        assert self.fleet is not None and self._checks is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
        try:
            try:
                async with self._checks.get(f"{instance.url}/health", timeout=timeout) as answer:
                    healthy = answer.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                healthy = False
            instance.failed_checks = 0 if healthy else instance.failed_checks + 1
            if not instance.up:
                if healthy and await self._reprobe(instance):  # back, perhaps restarted with other flags
                    log.warning("instance %s (%s) is up", instance.instance_id, instance.url)
                    self._mark(instance.instance_id, True)
            elif not healthy and instance.failed_checks >= self.settings.health_failures:
                log.warning(
                    "instance %s (%s) is down: %d health checks failed in a row",
                    instance.instance_id,
                    instance.url,
                    instance.failed_checks,
                )
                self._mark(instance.instance_id, False)
            if healthy and instance.up:
                await self._scrape(instance, timeout)
        except Exception:  # whatever one answer does, the loop goes on: it alone marks servers up again
            log.exception("checking instance %s (%s) failed", instance.instance_id, instance.url)

    async def _scrape(self, instance: FleetInstance, timeout: aiohttp.ClientTimeout) -> None:
        """Read a healthy server's `/metrics` and reconcile its queue. One that fails or is slow (a scrape
        waits behind a busy server's engine) leaves its load as last read, marked stale: it says nothing of the
        server's health."""
        assert self.fleet is not None and self._checks is not None
        asked = self.fleet.unprefilled(instance.instance_id)  # answers may come during the scrape
        try:
            async with self._checks.get(f"{instance.url}/metrics", timeout=timeout) as answer:
                if answer.status != 200:
                    raise aiohttp.ClientResponseError(
                        answer.request_info, answer.history, status=answer.status, message=answer.reason or ""
                    )
                text = await answer.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            if not instance.load_stale:
                log.warning(
                    "instance %s (%s): /metrics failed (%s); its load stays as last read",
                    instance.instance_id,
                    instance.url,
                    f"{type(error).__name__}: {error or 'no answer within connect_timeout_s'}",
                )
            instance.load_stale = True
            return
        instance.load_stale = False
        instance.state = scrape(text)
        self.fleet.reconcile(instance.instance_id, instance.state, time.monotonic(), asked=asked)

    async def _reprobe(self, instance: FleetInstance) -> bool:
        """Probe a down server that answers `/health` again (`upstream.reprobe`): whether it may be marked up. A
        refusal or a failed probe keeps it down, its line logged once per reason and shown in `/health`; a new
        `max_model_len` or KV capacity is logged and becomes its limits. A server unreachable at start-up is
        checked against the fleet's model (its stand-in info's) and takes its own info and card so."""
        assert self.fleet is not None and self._checks is not None
        try:
            info, changes = await reprobe(
                self._checks,
                instance.instance_id,
                instance.url,
                before=instance.info,
                block_size=self.settings.block_size,
                tokenizer=self.tokenizer,
                timeout_s=max(self.settings.connect_timeout_s, 5.0),
            )
        except ConfigError as error:
            if str(error) != instance.refused:
                log.error("%s; it stays down until it serves as at start-up", error)
                instance.refused = str(error)
            return False
        instance.refused = ""
        if changes and instance.probed:  # a stand-in's limits were never this server's: nothing changed
            log.warning("instance %s (%s) came back with %s", instance.instance_id, instance.url, ", ".join(changes))
        self.fleet.refresh(instance.instance_id, info)
        self._cards[list(self.fleet.instances).index(instance.instance_id)] = info.cards or (info.card,)
        self._served |= frozenset(info.served_names)
        self._max_model_len = self.fleet.max_model_len
        return True

    def _mark(self, instance_id: InstanceId, up: bool) -> None:
        assert self.fleet is not None and self.metrics is not None
        self.fleet.set_up(instance_id, up, time.monotonic())
        self.metrics.up[instance_id].set(1 if up else 0)

    # ------------------------------------------------------------------ small routes

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every answer to a completion is counted by status: an ApiError's, and a failure's 500 (as OpenAI's
        error, logged with its traceback), unless a stream had begun (counted as its 200; the connection is
        closed)."""
        counted = self.metrics is not None and request.path.startswith("/v1/") and request.method == "POST"
        try:
            return await handler(request)
        except ApiError as error:
            if counted and self.metrics is not None:
                self.metrics.responses[str(error.status)].inc()
            return web.json_response(error.body(), status=error.status, headers=error.headers)
        except web.HTTPException as error:  # aiohttp's own (a body over client_max_size: 413)
            if counted and self.metrics is not None:
                self.metrics.responses[str(error.status)].inc()
            raise
        except ConnectionResetError:  # the client left: no one to answer
            raise
        except Exception as error:
            if request.get(PREPARED):
                raise
            log.exception("%s %s failed", request.method, request.path)
            if counted and self.metrics is not None:
                self.metrics.responses["500"].inc()
            message = f"the router failed the request: {type(error).__name__}: {error}"
            return web.json_response(error_body(message, kind="server_error", code=500), status=500)

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """The client's end-to-end headers for a server; with `server_api_key`, the servers' key in place of the
        client's `Authorization` (which was the router's to check)."""
        headers = _forwarded(request.headers)
        if self.settings.server_api_key:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {self.settings.server_api_key}"
        return headers

    def _authorize(self, request: web.Request) -> None:
        if not authorized(request.headers.get("Authorization"), self.settings.api_key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")

    async def _models(self, request: web.Request) -> web.Response:
        """Every card the servers list, as the first to list it gives it (its `max_model_len`, `root`, `parent`,
        `permission`...): each of the model's served names, then each LoRA adapter, once."""
        self._authorize(request)
        entries: dict[str, dict[str, Any]] = {}
        for cards in self._cards:
            for card in cards:
                entries.setdefault(str(card.get("id")), card)
        data = list(entries.values()) or [{"id": self.model, "object": "model", "owned_by": "vllm"}]
        return web.json_response({"object": "list", "data": data})

    async def _pass(self, request: web.Request) -> web.Response:
        """`/tokenize` and `/detokenize`: the same tokenizer on every server, so the first that is up answers. No
        API key is asked for, as vLLM 0.32 asks for one only under `/v1` (its servers' own keys are passed on)."""
        assert self.fleet is not None and self._session is not None
        body = await request.read()
        for instance in self.fleet.instances.values():
            if not instance.up:
                continue
            try:
                async with self._session.post(
                    f"{instance.url}{request.path}",
                    data=body,
                    headers={
                        **self._upstream_headers(request),
                        "Content-Type": request.headers.get("Content-Type", "application/json"),
                    },
                    timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s),
                ) as answer:
                    data = await answer.read()
                    kept = _passed_back(answer.headers)
                    return web.Response(body=data, status=answer.status, headers=kept)
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                log.warning("instance %s failed %s: %s; trying another", instance.instance_id, request.path, error)
        raise ApiError(503, "no vLLM server is up")

    async def _health(self, _request: web.Request) -> web.Response:
        assert self.fleet is not None
        instances = {
            instance_id: {
                "url": instance.url,
                "role": instance.section.role,
                "up": instance.up,
                "cached_blocks": self.fleet.cached_blocks(instance_id),
                "running": instance.state.running,
                "waiting": instance.state.waiting,
                "event_errors": instance.event_errors,
                **({"refused": instance.refused} if instance.refused else {}),
                **({"load_stale": True} if instance.load_stale else {}),
            }
            for instance_id, instance in self.fleet.instances.items()
        }
        # Up as a whole when a request can be served: a coupled server, or a prefill and a decode one.
        roles = {instance.section.role for instance in self.fleet.instances.values() if instance.up}
        healthy = "both" in roles or {"prefill", "decode"} <= roles
        body = {
            "status": "ok" if healthy else "unavailable",
            "in_flight": len(self.fleet.flights),
            "instances": instances,
        }
        return web.json_response(body, status=200 if healthy else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        assert self.fleet is not None and self.metrics is not None
        queued: dict[str, int] = {view.instance_id: len(view.queue) for view in self.fleet.conductor.prefill_views}
        for instance_id, instance in self.fleet.instances.items():
            decoding = sum(
                1
                for f in self.fleet.flights.values()
                if f.first_token_s is not None and f.decode_instance_id == instance_id
            )
            self.metrics.set_engine(instance_id, up=instance.up, running=decoding, waiting=queued.get(instance_id, 0))
            self.metrics.set_kv_usage(instance_id, instance.state.kv_usage)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ------------------------------------------------------------------ completions

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        assert self.fleet is not None and self.metrics is not None and self._session is not None
        received = time.monotonic()
        self._authorize(request)
        body = decode_body(
            await request.read(),
            content_type=request.headers.get("Content-Type"),
            content_encoding=request.headers.get("Content-Encoding"),
            max_bytes=MAX_BODY_BYTES,
        )
        # What vLLM will generate at most, read as vLLM reads it (a bad value is vLLM's 400, before any server
        # sees it); a completion that sets none gets vLLM's 16 (a null too: vLLM 0.32's `CompletionRequest` reads
        # it as unset), a chat runs to the context's end in vLLM and is planned for `default_max_tokens`.
        if not chat and _echo_only(body):
            # lm-eval-harness's loglikelihood: vLLM scores the prompt and draws one token it neither shows nor
            # counts (`CompletionRequest.to_sampling_params`: `echo_without_generation`).
            max_tokens: int | None = 1
        else:
            max_tokens = requested_max_tokens(
                body, default=None if chat else VLLM_COMPLETION_MAX_TOKENS, completion=not chat
            )
            if max_tokens is not None:
                # Over every server's context: each would refuse it (before rendering the prompt), so the router
                # does, with vLLM's 400, rather than plan a trimmed output no server would run.
                check_output_limit(max_tokens, self._max_model_len, output_limit_field(body, completion=not chat))
        prompt = prompt_of(self.tokenizer, body, chat=chat, max_model_len=self._max_model_len)
        tokens = prompt.tokens
        if not chat and isinstance(body.get("prompt"), list):  # ids a client gave (a tokenizer's are in range)
            try:
                as_token_array(tokens)  # the block keys hash them as int32; vLLM refuses any out of its vocabulary
            except InvalidRequestError as error:
                raise ApiError(400, f"prompt: {error}", param="prompt") from None
        salt = cache_salt(body)  # vLLM's 400 for a bad one, before any server sees it
        lora = _adapter(body, self._served)
        max_tokens = self._trimmed(len(tokens), max_tokens)
        stream = stream_flag(body)
        upstream_body = dict(body)
        if "stream" in body:
            upstream_body["stream"] = stream  # the server reads it as the router did; no other reading to diverge
        wants_usage, _ = stream_usage(upstream_body)  # vLLM's reading, so that the answer is the one vLLM gives
        if stream:
            options = {**(body.get("stream_options") or {}), "include_usage": True}
            if not wants_usage:  # asked for the count only: no usage in the chunks the client reads
                options["continuous_usage_stats"] = False
            upstream_body["stream_options"] = options
        payload = json.dumps(upstream_body).encode()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        # A scored prompt reads no cached prefix on vLLM (`skip_reading_prefix_cache`): planned as computed whole.
        reusable = prefix_reusable(vllm_prompt_logprobs(body, chat=chat))
        wasted: str | None = None  # a decode server failed after the prefill ran: what a rejection now says
        for _attempt in range(self.settings.max_retries + 1):
            now = time.monotonic()
            _, decision = self.fleet.schedule(
                tokens, max_tokens, now, cache_salt=salt, lora=lora, reuses_prefix=reusable
            )
            if not decision.accepted:
                assert decision.reason is not None
                self.metrics.rejections[decision.reason.value].inc()
                status = http_status(decision.reason)
                detail = {
                    503: self._none_up(decision.reason),
                    # The prompt fits the longest context (`_trimmed`), but no server up has one that long.
                    400: f"the prompt's {len(tokens)} tokens and max_tokens {max_tokens} exceed the servers' "
                    "maximum context",
                }.get(status)
                raise rejection_error(
                    decision.reason,
                    Outcome.REJECTED_BEFORE_PREFILL if wasted is None else Outcome.REJECTED_AFTER_PREFILL,
                    detail=detail,
                    ttft_s=decision.ttft_s,
                    ttft_slo_s=self.settings.ttft_slo_s,
                    param="max_tokens" if status == 400 else None,
                    failure=wasted,
                )
            log.debug(
                "%s: %d tokens, %d cached on %s, estimated TTFT %.3f s",
                decision.request_id,
                len(tokens),
                decision.prefix_tokens,
                decision.prefill_instance,
                decision.ttft_s or 0.0,
            )
            flight = self.fleet.flights[decision.request_id]
            if prompt.approximate:  # its TTFT is of a prompt the router did not see: it teaches nothing
                flight.idle = False
            overhead_us = round((time.monotonic() - received) * 1e6)
            try:
                if flight.instance_id == flight.decode_instance_id:
                    return await self._forward(
                        request, flight, path, payload, stream, wants_usage, received, overhead_us
                    )
                prefilled = await self._prefill(request, flight, path, upstream_body, received)
                if isinstance(prefilled, web.Response):
                    return prefilled
                return await self._forward(request, flight, path, prefilled, stream, wants_usage, received, overhead_us)
            except _TimedOut as late:
                # Slow, not gone: the server keeps its place and its cache (a wedged one is /health's to find).
                self.fleet.failed(flight, time.monotonic(), Reason.TIMEOUT)
                raise ApiError(504, self._timeout_message(late.instance_id)) from None
            except _ServerFailed as failure:
                log.warning(
                    "instance %s failed request %s: %s; trying another",
                    failure.instance_id,
                    decision.request_id,
                    failure,
                )
                self.fleet.failed(flight, time.monotonic(), Reason.INSTANCE_DOWN)
                self._mark(failure.instance_id, False)
                if failure.instance_id != flight.instance_id and flight.prefilled_s is not None:
                    wasted = (
                        f"decode server {failure.instance_id} failed ({failure}) after the prefill on "
                        f"{flight.instance_id} ran"
                    )
            except (asyncio.CancelledError, ConnectionResetError):
                self.fleet.failed(flight, time.monotonic(), Reason.CLIENT_GONE)
                raise
            except BaseException:  # anything else: the request ends here all the same, never left in flight
                self.fleet.failed(flight, time.monotonic(), Reason.FAILED)
                raise
        raise ApiError(502, f"the request failed on {self.settings.max_retries + 1} servers")

    def _trimmed(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """What the request is planned for: `max_tokens` (a chat's None: `default_max_tokens`) trimmed to the
        room the prompt leaves in the longest `max_model_len` of the fleet, as vLLM 0.32 trims it
        (`get_max_tokens`: a prompt that fits is served, its output cut at the context's end; a server with less
        room than that is the Conductor's to rule out). A `max_tokens` over that `max_model_len` itself was
        refused before (`check_output_limit`, vLLM's 400), never trimmed.

        Raises:
            ApiError: 400, vLLM's answers: a prompt longer than `max_model_len` (`input_tokens`, the renderer's
                message), or one that leaves no room for a token (`max_tokens` 0, `SamplingParams`' message).
        """
        limit = self._max_model_len
        if num_prompt_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{num_prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        return max_tokens_within(
            self.settings.default_max_tokens if max_tokens is None else max_tokens, num_prompt_tokens, limit
        )

    def _none_up(self, reason: Reason) -> str:
        """What a 503 says is missing: the side of a disaggregated fleet that has no server up."""
        roles = {instance.section.role for instance in self.fleet.instances.values()} if self.fleet else set()
        if roles <= {"both"}:
            return "no vLLM server is up"
        if reason is Reason.NO_DECODE_INSTANCE:
            return 'no decode server is up (role "decode" or "both")'
        return 'no prefill server is up (role "prefill" or "both")'

    def _timeout_message(self, instance_id: InstanceId) -> str:
        return f"the request ran past request_timeout_s ({self.settings.request_timeout_s:g} s) on {instance_id}"

    def _upstream_timeout(self, received: float, instance_id: InstanceId) -> aiohttp.ClientTimeout:
        """One upstream call's limits: what is left of `request_timeout_s` since the request was received (end to
        end: a disaggregated pair's two steps and any retries share it), and the connect timeout."""
        left = received + self.settings.request_timeout_s - time.monotonic()
        if left <= 0:
            raise _TimedOut(instance_id)
        return aiohttp.ClientTimeout(total=left, sock_connect=self.settings.connect_timeout_s)

    async def _prefill(
        self, request: web.Request, flight: Flight, path: str, body: dict[str, Any], received: float
    ) -> bytes | web.Response:
        """Step one of the disaggregated flow (that of vLLM's disaggregated-serving proxy): the prompt with
        `max_tokens` 1 on the prefill server, asking it to keep the KV for a decode elsewhere (`REMOTE_DECODE`).

        Returns the decode step's body: the request as the client sent it, with the `kv_transfer_params` the
        prefill server answered (a connector that matches by prompt, such as vLLM's `ExampleConnector`,
        answers none). A prefill server's own refusal (a 4xx) is returned as the client's answer.
        """
        assert self.fleet is not None and self.metrics is not None and self._session is not None
        instance_id = flight.instance_id
        prefill = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
        prefill["max_tokens"] = 1
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        prefill.pop("min_tokens", None)  # the decode step's: above 1 it would be vLLM's 400 here
        prefill["kv_transfer_params"] = REMOTE_DECODE
        try:
            async with self._session.post(
                f"{self.fleet.instances[instance_id].url}{path}",
                json=prefill,
                headers=self._upstream_headers(request),
                timeout=self._upstream_timeout(received, instance_id),
            ) as upstream:
                data = await upstream.read()
                status, headers = upstream.status, upstream.headers
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise _failure(instance_id, error) from error
        if status in FAILOVER_STATUSES:
            raise _ServerFailed(instance_id, f"HTTP {status}")
        now = time.monotonic()
        if status != 200:
            self.fleet.failed(flight, now, Reason.FAILED)
            self.metrics.responses[str(status)].inc()
            kept = _passed_back(headers)
            return web.Response(body=data, status=status, headers=kept)
        answer: Any = None
        with contextlib.suppress(ValueError, TypeError):
            answer = _json.loads(data)
        answer = answer if isinstance(answer, dict) else {}
        # A one-token answer comes when the prefill ends; its usage says what the prefill server found cached.
        self.fleet.prefilled(flight, now, cached_tokens=_cached_tokens(answer.get("usage")))
        decode = dict(body)
        params = answer.get("kv_transfer_params")
        if params:
            decode["kv_transfer_params"] = params
        return json.dumps(decode).encode()

    async def _forward(
        self,
        request: web.Request,
        flight: Flight,
        path: str,
        payload: bytes,
        stream: bool,
        wants_usage: bool,
        received: float,
        overhead_us: int,
    ) -> web.StreamResponse:
        """Send the request to its decode instance (the instance itself when coupled) and pass its answer on."""
        assert self.fleet is not None and self.metrics is not None and self._session is not None
        fleet, metrics = self.fleet, self.metrics
        instance_id = flight.decode_instance_id  # the instance itself when coupled
        instance = fleet.instances[instance_id]
        headers = {**self._upstream_headers(request), "Content-Type": "application/json"}
        route_headers = {
            PREFILL_HEADER: flight.instance_id,
            DECODE_HEADER: flight.decode_instance_id,
            CACHED_HEADER: str(flight.decision.prefix_tokens),
            "X-Mooncake-Router-Overhead-Us": str(overhead_us),
        }
        generated: int | None = None
        cached: int | None = None  # the prompt tokens the server found cached, as its usage says
        finish = "length"
        done = False  # the answer was read to its end (else the connection is closed: the server aborts it)
        try:
            upstream = await self._session.post(
                f"{instance.url}{path}",
                data=payload,
                headers=headers,
                timeout=self._upstream_timeout(received, instance_id),
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as error:  # unreachable, or an answer not HTTP
            raise _failure(instance_id, error) from error
        log.debug("%s: %s answered %d", flight.request.request_id, instance_id, upstream.status)
        try:
            if upstream.status in FAILOVER_STATUSES:
                raise _ServerFailed(instance_id, f"HTTP {upstream.status}")
            kept = _passed_back(upstream.headers)
            if upstream.status != 200 or not stream:
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as error:
                    raise _failure(instance_id, error) from error
                now = time.monotonic()
                if upstream.status == 200:
                    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError, IndexError):
                        answer = _json.loads(data)
                        cached = _cached_tokens(answer.get("usage"))
                        generated = int(answer["usage"]["completion_tokens"])
                        finish = str(answer["choices"][0].get("finish_reason") or "length")
                    # An answer of one token came at its first token: its time is the prefill's.
                    fleet.first_token(flight, now, timed=flight.request.output_length == 1)
                    fleet.finished(flight, now, generated, cached_tokens=cached)
                    self._account(flight, now, now, now, generated, finish)
                else:
                    fleet.failed(flight, now, Reason.FAILED)
                metrics.responses[str(upstream.status)].inc()
                done = True
                return web.Response(body=data, status=upstream.status, headers={**kept, **route_headers})
            response = web.StreamResponse(
                headers={**kept, "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **route_headers}
            )
            first_s: float | None = None
            last_token_s: float | None = None  # when the last chunk carrying tokens came
            token_chunks = 0
            itl = metrics.itl[instance_id]
            prepared = skip_blank = False
            try:
                async for line in lines(upstream.content):
                    if skip_blank and not line.strip():
                        skip_blank = False
                        continue  # the blank line that ended a usage chunk the client did not ask for
                    skip_blank = False
                    if line.startswith(b"data:"):
                        if first_s is None:
                            first_s = time.monotonic()
                            fleet.first_token(flight, first_s)
                            metrics.ttft[flight.instance_id].observe(first_s - received)
                        if _CHOICE.search(line) and not _ROLE_ONLY.search(line):
                            # vLLM observes the time between a request's engine steps; each chunk is one step's.
                            arrived = time.monotonic()
                            if last_token_s is not None:
                                itl.observe(arrived - last_token_s)
                            last_token_s = arrived
                            token_chunks += 1
                        if (named := _FINISH.search(line)) is not None:
                            finish = named[1].decode()
                    if line.startswith(b"data:") and b'"usage"' in line:
                        with contextlib.suppress(ValueError, TypeError, KeyError):
                            chunk = _json.loads(line[5:])
                            if chunk.get("usage") and not chunk.get("choices"):
                                cached = _cached_tokens(chunk["usage"])
                                generated = int(chunk["usage"]["completion_tokens"])
                                if not wants_usage:
                                    skip_blank = True
                                    continue
                    if not prepared:
                        await response.prepare(request)
                        prepared = request[PREPARED] = True
                        metrics.responses["200"].inc()
                    await response.write(line)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as error:
                if isinstance(error, ConnectionResetError):
                    # Writing to the client failed: it left before aiohttp noticed and cancelled this handler. The
                    # request ends here (`finally` closes the upstream connection: the server aborts it), quietly,
                    # as a cancellation would: raised, aiohttp would log it as an error with its traceback.
                    fleet.failed(flight, time.monotonic(), Reason.CLIENT_GONE)
                    return response
                if not prepared:
                    raise _failure(instance_id, error) from error
                timed_out = _ran_out(error)
                fleet.failed(flight, time.monotonic(), Reason.TIMEOUT if timed_out else Reason.FAILED)
                # The shape vLLM ends a failed stream with (`create_streaming_error_response`: OpenAI's error with
                # `param` and the status as `code`, then `[DONE]`), so that a client reading to `[DONE]` ends.
                message = error_body(
                    self._timeout_message(instance_id) if timed_out else f"the server failed mid-stream: {error}",
                    kind="timeout_error" if timed_out else "server_error",
                    code=504 if timed_out else 502,
                )
                await response.write(b"data: " + json.dumps(message).encode() + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
            if not prepared:
                await response.prepare(request)
                request[PREPARED] = True
                metrics.responses["200"].inc()
            now = time.monotonic()
            fleet.finished(flight, now, generated, cached_tokens=cached)
            counted = generated if generated is not None else token_chunks  # a server that gave no usage
            self._account(flight, first_s if first_s is not None else now, last_token_s or now, now, counted, finish)
            done = True
            with contextlib.suppress(ConnectionResetError):  # the answer is whole: a client leaving now loses nothing
                await response.write_eof()
            return response
        finally:
            if done:
                upstream.release()
            else:
                upstream.close()

    def _account(
        self, flight: Flight, first_s: float, last_s: float, end_s: float, generated: int | None, finish: str
    ) -> None:
        """Count a completed answer as vLLM's logger counts a finished request: its prompt on its prefill
        server, its generated tokens (`generation_tokens`, from its usage) and its finish reason as the engine
        names it (`serving.metrics.counted_finish_reason`) on its decode server.
        Inter-token latency was observed as the stream came (`_forward`): a whole answer has none."""
        assert self.metrics is not None
        request = flight.request
        self.metrics.generation_tokens[flight.decode_instance_id].inc(generated or 0)
        self.metrics.prefilled(
            flight.instance_id,
            prompt_tokens=request.input_length,
            cached_tokens=flight.cached_tokens if flight.cached_tokens is not None else flight.decision.prefix_tokens,
            fetched_bytes=0,
            pushed_bytes=0,
            looked_up=request.reuses_prefix,  # a scored prompt reads no cached prefix: no query, as vLLM counts it
        )
        self.metrics.finished(
            FinishedRequest(
                prefill_engine=flight.instance_id,
                decode_engine=flight.decode_instance_id,
                finished_reason=counted_finish_reason(finish),
                arrival_s=flight.dispatched_s,
                prefill_started_s=None,
                prefill_done_s=None,
                first_token_s=first_s,
                last_token_s=last_s,
                end_s=end_s,
                prompt_tokens=request.input_length,
                generation_tokens=generated or 0,
                max_tokens=request.output_length,
            )
        )


# What is not the client's to pass on: the connection's own headers, and those the router sets or recomputes.
_NOT_FORWARDED = HOP_BY_HOP | {
    "host",
    "content-type",
    "accept-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
}


def _passed_back(headers: Any) -> dict[str, str]:
    """A server's end-to-end headers, as the client should see them (not the connection's own)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def _forwarded(headers: Any) -> dict[str, str]:
    """The client's end-to-end headers, as a server should see them (`Authorization`, `X-Request-Id`...)."""
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_FORWARDED}


def _adapter(body: dict[str, Any], served: Collection[str]) -> str | None:
    """The LoRA adapter a request names, as vLLM reads its `model` (`_maybe_get_adapters`): every name a server
    accepts is one of its model's (`served`: the cards of its /v1/models without a `parent`, every name of
    `--served-model-name a b`) or an adapter's, listed with the model as `parent`, or loaded since
    (`/v1/load_lora_adapter`), so any other name is taken for an adapter's. None: the served model (any of its
    names, no `model`, or not a string: vLLM's 400 comes from the server). A name no server serves is keyed as
    an adapter no server has cached: planned uncached, then vLLM's 404."""
    if isinstance(served, str):  # one name, not its letters
        served = (served,)
    model = body.get("model")
    if not isinstance(model, str) or not model or model in served:
        return None
    return model


def _echo_only(body: dict[str, Any]) -> bool:
    """`api.echo_only`, a bad `echo` read as none (vLLM's 400 comes from the server)."""
    with contextlib.suppress(ApiError):
        return echo_only(body)
    return False


def _subscriber(section: InstanceSection, decoder: Any, index: BlockIndex) -> KvEventSubscriber:
    """The KV-event subscriber of one server: bound at its `kv_events` endpoint, connected to its replay socket if
    any.

    Raises:
        ConfigError: naming the instance and the key whose endpoint ZeroMQ refused.
    """
    where = f"instance {decoder.source} ({section.base_url})"
    try:
        subscriber = KvEventSubscriber(section.kv_events, decoder=decoder, index=index, replay_timeout_s=1.0)
    except Exception as error:  # zmq.ZMQError: the endpoint cannot be bound here
        raise ConfigError(
            f"{where}: kv_events = {section.kv_events!r} cannot be bound on this host: {error}"
        ) from error
    if section.replay:
        try:
            subscriber.connect_replay(section.replay)
        except Exception as error:  # zmq.ZMQError: no endpoint ZeroMQ can connect to
            subscriber.close()
            raise ConfigError(f"{where}: replay = {section.replay!r} cannot be connected to: {error}") from error
    return subscriber


def _cached_tokens(usage: Any) -> int | None:
    """The prompt tokens a vLLM server found in its prefix cache, from an answer's usage
    (`prompt_tokens_details.cached_tokens`, given with `--enable-prompt-tokens-details`); None where it says
    nothing usable."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None
