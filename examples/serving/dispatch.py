"""Requests in flight between the Conductor and the engine workers.

The `Dispatcher` holds the Conductor, a control connection to every worker and
the table of live requests. `admit` keys a request's blocks and lets the
Conductor decide (a rejection is a 429, no engine up a 503; one for room the
decode side frees as its requests end waits first: `admit`); `submit` sends an
accepted request to its prefill worker (a `wire.PrefillJob` with the
decision's transfer plan). The workers report progress with `serving.wire`
messages that arrive on the transfer engine's threads, are decoded there (a
malformed one is refused to its sender and logged) and handed to the event
loop, where they become Conductor events, index updates (the prefill node's
cache events), metrics, and the request's queue of tokens that `tokens` reads
until the last one, an error or a wait for a token past `[limits] request_timeout_s`.

Ends, in `sched.outcome`'s vocabulary: a decode engine's refusal is the decode
rule's reason (`REJECTED_AFTER_PREFILL`, a 429); a prefill or a join that fails
(the KV missing on the decode node, say) is `ABORTED` / `FAILED` (a 500); a
client that leaves is `ABORTED` / `CLIENT_GONE` and a request that hits a stop
string is `COMPLETED` early — both cancel the request's decode, and a request
that ends before its prefill is done is cancelled on its prefill engine too
(`wire.CancelPrefill`: a job still queued there is dropped, a running one stops
before its next chunk, or, once computed, is not handed on).

Health: every `[limits] health_interval_s` each worker that is due is probed
(its process is alive and it answers a `HealthCheck` within `PROBE_TIMEOUT_S`).
A worker that fails a probe is marked down in the Conductor and probed again
with exponential backoff (the period doubling up to
`[limits] health_probe_backoff_max_s`); one that answers again (a process
resumed after SIGSTOP, say) is marked up. A probe's answer lists the requests
the worker decodes: those the gateway no longer routes to it (ended while it
was down, or rescheduled) are cancelled there. Each worker's control calls go
out from a thread of its own and its probes from another, so a worker that
stops answering delays no other worker's calls or probes; its prefill jobs not
sent yet are dropped when it is marked down. When an engine goes down, the
requests routed to it of which no token has reached the client (waiting for
or in their prefill, prefilled there but not yet handed on, on their way to
the decode engine, joined but not yet stepped, or decoding for a whole, not
streamed, answer, whose client gets its tokens only at its end: those tokens
are dropped, and the retry, its seed fixed at admission, draws them again)
are scheduled again on the engines still up (twice at most, each time as the next attempt, so a resumed
engine's reports about an earlier attempt are ignored); the earlier attempt's prefill job is cancelled on its prefill
engine (at once, or when a down one answers again), so a stopped decode node
holds up a prefill engine's queue for the job running there at most. Scheduled
again as `admit` schedules a request, keeping its arrival (its TTFT objective
and longest wait count from it): one refused for room waits in the admission
line by its arrival, right behind the last waiting request that arrived before it and so ahead
of the later ones (`AdmissionQueue.arrive(again=True)`: it was accepted before them); one refused for good, or whose wait ends, gets the
refusal, its message saying which engine failed first and its `outcome`
whether a prefill of it had run for nothing (`REJECTED_AFTER_PREFILL`).
Streamed requests whose tokens have begun end with a 503. A prefill engine that reports its
decode node did not answer (`PrefillFailed.peer`) has that node probed at
once: marked down if it does not answer (the request rerouted with the
others), else the request alone is scheduled again.

Every Conductor call happens on the event loop's thread: it is the Conductor's
only user.

Invariants: a request is in `live` from its acceptance until it ends, but while,
rerouted, it waits in the line again (`_rerouted` holds it then); the
Conductor learns of each end once (from `end`, a no-op for a request no longer
live, or by itself when an instance goes down); tokens reach a request's queue
only while it is live, from the decode engine and attempt it is routed to, in
order (a whole answer's scheduled again: those of its earlier attempt still
queued are dropped).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from mooncake.engine.logprobs import TokenLogprobs
from mooncake.errors import MooncakeError
from mooncake.sched.conductor import Conductor, ScheduleDecision
from mooncake.sched.outcome import Outcome, Reason, RequestEnd, refusal_named
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    InstanceDown,
    InstanceUp,
    PrefillFinished,
    PrefillStarted,
    RequestAborted,
    RequestRejected,
)
from mooncake.sched.waiting import AdmissionQueue
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig
from mooncake.types import InstanceId, Request, RequestId, prefix_reusable
from serving import wire
from serving.api import MAX_SEED, ApiError, SamplingOptions, rejection_error
from serving.config import ClusterConfig
from serving.metrics import FinishedRequest, ServingMetrics
from serving.models import decode_limits, prefill_cache_blocks

__all__ = ["Dispatcher", "LiveRequest", "WorkerState"]

LOG = logging.getLogger("serving.dispatch")
PROBE_TIMEOUT_S = 5.0  # a health answer's deadline: the control calls' own I/O timeout
# A worker asked to announce its cache (after a gap in its events) is asked again after this long if its events
# still leave gaps: the ask (or the report carrying the announcement) may have been lost.
ANNOUNCE_AGAIN_S = 5.0
MAX_REROUTES = 2
UNROUTED = InstanceId("")
REPORTS = (
    wire.PrefillStarted,
    wire.PrefillDone,
    wire.PrefillFailed,
    wire.DecodeJoined,
    wire.DecodeRejected,
    wire.DecodeFailed,
    wire.DecodeTokens,
)


@attrs.define(eq=False)
class LiveRequest:
    """A request between its acceptance and its end; `events` queues ("token", wire.Token) or ("error", e)."""

    request_id: RequestId
    tokens: list[int]
    request: Request
    sampling: SamplingOptions
    arrival: float
    prefill: InstanceId = UNROUTED
    decode: InstanceId = UNROUTED
    fetch: wire.Fetch | None = None
    cache_salt: str | None = None  # vLLM's: the namespace of its blocks' keys
    # Its tokens reach the client as they come (a stream); a whole answer's only at its end, so one whose decode
    # engine fails mid-generation can still be scheduled again (`_reroute`).
    is_streamed: bool = True
    attempt: int = 0  # rises each time the request is scheduled again after an engine of its went down
    sent_attempt: int = -1  # the attempt last sent to a prefill worker (`submit`)
    events: asyncio.Queue[tuple[str, Any]] = attrs.field(factory=asyncio.Queue)
    generated: int = 0
    cached_tokens: int = 0
    has_prefilled: bool = False  # a prefill of some attempt of it finished (a refusal after that wasted it)
    # The prompt's log-probabilities (tokens 1..n-1), from its prefill, where it asked for them (echo and logprobs).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # When each phase began, on the dispatcher's clock (None: not yet), for the metrics and the engines' loads;
    # the prefill phases start again when the request is scheduled again.
    prefill_started_s: float | None = None
    prefill_done_s: float | None = None
    joined_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    # Its last token's step time on its decode worker's clock (`wire.Token.at_s`), for the inter-token latency.
    last_token_at_s: float | None = None
    # When its last token ended it, while its finish reason waits for its reader's judgement (`Dispatcher.finish`).
    unjudged_end_s: float | None = None


@attrs.define(eq=False)
class _Waiter:
    """A request in the admission line. A new one's `admit` waits for `decided`, settled when it leaves (live, or its
    rejection). One rerouted after an engine of its failed (`failure`: that engine's 503) has no `admit` waiting for
    it: admitted, it is sent on at once; refused, the refusal goes to its token queue."""

    live: LiveRequest
    decided: asyncio.Future[None] | None = None
    failure: ApiError | None = None


@attrs.define(eq=False)
class WorkerState:
    """What the health loop knows of a worker: up or down, its failed probes in a row, when to probe next."""

    instance_id: InstanceId
    role: str
    up: bool = True
    failures: int = 0
    next_probe_s: float = 0.0
    probing: bool = False
    gone: bool = False  # its process was found dead (the other workers were told: `PeerGone`)


class Dispatcher:
    """The Conductor, the workers' control connections and the requests in flight.

    Args:
        config: the cluster config.
        conductor: the scheduler; every worker is added to it here.
        secret: the transfer engines' shared secret.
        workers: each worker's `start()` info (instance id, role, address).
        is_alive: tells whether a worker's process (or actor) still runs; False only when it is certainly gone.
        metrics: where the request and engine metrics go (default: a registry of the dispatcher's own).
        block_bytes: the KV bytes of one block (for the transfer metrics).
        host: where the dispatcher's transfer engine listens for the workers' reports (an address they reach).
        stop_token_ids: the tokens that end a generation (the tokenizer's: the decode engines stop there), but one
            asking `ignore_eos`.
    """

    def __init__(
        self,
        config: ClusterConfig,
        conductor: Conductor,
        *,
        secret: bytes,
        workers: list[dict[str, Any]],
        is_alive: Callable[[str], bool],
        metrics: ServingMetrics | None = None,
        block_bytes: int,
        host: str = "127.0.0.1",
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self._stop_ids = tuple(sorted(stop_token_ids))
        self.hasher = config.model.hasher()
        self.conductor = conductor
        self.metrics = metrics or ServingMetrics.for_config(config, workers)
        self.roles = {w["instance_id"]: w["role"] for w in workers}
        limits = decode_limits(config)
        for worker in workers:
            if worker["role"] == "prefill":
                self.conductor.add_prefill_instance(
                    InstanceId(worker["instance_id"]), cache_blocks=prefill_cache_blocks(config)
                )
            else:
                self.conductor.add_decode_instance(InstanceId(worker["instance_id"]), limits)
        self.workers = {i: WorkerState(InstanceId(i), role) for i, role in self.roles.items()}
        self._is_alive = is_alive
        self.engine = TransferEngine(
            secret=secret,
            config=EngineConfig(transports=("tcp",), io_timeout_s=PROBE_TIMEOUT_S, spin_us=0, host=host),
        )
        try:  # a worker gone before it heard of the gateway: the engine (its listener, its threads) goes too
            for cls in REPORTS:
                self.engine.register_handler(cls.METHOD, self._receiver(cls))
            self._addresses = {w["instance_id"]: w["address"] for w in workers}
            self.peers = {w["instance_id"]: self.engine.connect(w["address"], transport="tcp") for w in workers}
            connect = wire.Connect(gateway=self.engine.address, peers=self._addresses)
            for instance in self.peers:
                self.engine.call(self.peers[instance], *wire.encode(connect))
        except BaseException:
            self.engine.close()
            raise
        self.live: dict[RequestId, LiveRequest] = {}
        self._ids = itertools.count(1)
        self._started = time.monotonic()
        # Control calls go out from one thread per worker, and its health probes from another: a worker that stops
        # answering (SIGSTOP, a hung process) holds up only its own calls, each until the I/O timeout, never the
        # other workers' calls or probes (with one shared pool, its blocked calls filled the threads, healthy
        # workers' probes timed out in the queue and the whole cluster was marked down).
        self._calls = {i: ThreadPoolExecutor(1, thread_name_prefix=f"gateway-call-{i}") for i in self.peers}
        self._probe_calls = {i: ThreadPoolExecutor(1, thread_name_prefix=f"gateway-probe-{i}") for i in self.peers}
        # Each worker's prefill jobs not sent yet: cancelled when it is marked down (they are rerouted).
        self._unsent: dict[str, set[asyncio.Future[Any]]] = {i: set() for i in self.peers}
        # Cancellations of abandoned prefill attempts for each worker that was down: sent when it answers again.
        self._stale: dict[str, list[wire.CancelPrefill]] = {i: [] for i in self.peers}
        # Workers asked to announce their caches (a gap in their events), and when: until an event of theirs
        # applies without a gap.
        self._announcing: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._block_bytes = block_bytes
        self._probes: set[asyncio.Task[None]] = set()
        # Requests waiting for room on the decode side (`admit`), first come, first served, within the Conductor's
        # TTFT objective (capped at the request timeout: `ClusterConfig.objectives`).
        self._waiting: AdmissionQueue[_Waiter] = AdmissionQueue(conductor, max_wait_s=config.limits.admission_wait_s)
        self._rerouted: dict[RequestId, _Waiter] = {}  # rerouted requests waiting in the line (none of them live)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._closed = False  # shut down: nothing is admitted or sent any more

    @property
    def up(self) -> dict[str, bool]:
        """Each worker's instance id → whether it is up."""
        return {i: w.up for i, w in self.workers.items()}

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the workers' reports to `loop` from now on (reports before are dropped)."""
        self._loop = loop

    def close(self) -> None:
        """End every live request with a 503, stop the control calls and the transfer engine."""
        self.shut_down_requests()
        for task in self._probes:
            task.cancel()
        for pool in (*self._calls.values(), *self._probe_calls.values()):
            pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def shut_down_requests(self) -> None:
        """End every live request, and every one waiting for room, with a 503 saying the cluster is shutting down
        (on the event loop's thread); admit and send nothing from now on."""
        self._closed = True
        for live in list(self.live.values()):
            live.events.put_nowait(("error", ApiError(503, "the cluster is shutting down")))
        for waiter in self._waiting.clear():
            error = ApiError(503, "the cluster is shutting down")
            if waiter.decided is not None:
                waiter.decided.set_exception(error)
            else:
                waiter.live.events.put_nowait(("error", error))
        self._rerouted.clear()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self.metrics.admission_waiting.set(0)

    def now(self) -> float:
        """Seconds since the dispatcher started: the Conductor's clock."""
        return time.monotonic() - self._started

    def num_up(self, role: str) -> int:
        """How many engines of `role` ("prefill" or "decode") are up."""
        return sum(1 for w in self.workers.values() if w.up and w.role == role)

    def call(self, instance: str, message: wire.Message) -> Any:
        """Send `message` to a worker and wait for its answer (blocking: from a thread, or in tests)."""
        return self.engine.call(self.peers[instance], *wire.encode(message))

    def health(self, instance: str) -> wire.Health:
        """A worker's answer to a `HealthCheck` (blocking).

        Raises:
            MooncakeError: it did not answer, or not with a `Health`.
        """
        return wire.decode_as(wire.Health, self.call(instance, wire.HealthCheck()))

    # ------------------------------------------------------------------ scheduling

    async def admit(
        self,
        tokens: list[int],
        sampling: SamplingOptions,
        arrival: float,
        *,
        cache_salt: str | None = None,
        streamed: bool = True,
    ) -> LiveRequest:
        """Schedule a request (its `max_tokens` settled: `api.generation_limit`); it is live once this returns.
        With a `cache_salt` (vLLM's) its blocks are keyed in that salt's namespace, here and in the engines.
        Not `streamed` (a whole answer), its tokens reach its client only at its end: an engine of its failing
        mid-generation schedules it again, and its reader sees the tokens start again (`_reroute`).

        A request the Conductor rejects for room the decode side frees as its requests end (a full batch, no KV
        room, a step over the TBT objective) waits for it, before any prefill, in the line `sched.waiting`'s
        `AdmissionQueue` keeps: first come, first served (one arriving while others wait queues behind them), tried
        again each time a request ends or an engine comes up or goes down, for at most `[limits] admission_wait_s`
        after its arrival and only while it could still meet its TTFT objective (capped at
        `[limits] request_timeout_s`), the wait counted. vLLM queues such a request; the paper's Conductor rejects
        it at once (a wait of 0).

        Raises:
            ApiError: the Conductor's rejection (`_rejection`), once the request may wait no longer: 503 when no
                prefill or no decode engine is up, or the cluster is shutting down; a 500 when the Conductor raises
                trying it again in line (`_try_failed`).
        """
        if self._closed:
            raise ApiError(503, "the cluster is shutting down")
        for role, reason in (("prefill", Reason.NO_PREFILL_INSTANCE), ("decode", Reason.NO_DECODE_INSTANCE)):
            if not self.num_up(role):  # what the Conductor would answer, before the prompt is hashed for it
                self.metrics.rejections[reason.value].inc()
                raise rejection_error(reason, Outcome.REJECTED_BEFORE_PREFILL)
        assert sampling.max_tokens is not None, "settle a chat's max_tokens first (api.generation_limit)"
        if sampling.seed is None:  # drawn once: a retry on another engine samples the same stream
            sampling = attrs.evolve(sampling, seed=secrets.randbelow(MAX_SEED + 1))
        request_id = RequestId(next(self._ids))  # type: ignore[arg-type]
        keys = self.hasher.salted(cache_salt).block_keys(np.asarray(tokens, dtype=np.int32))
        request = Request(
            request_id=request_id,
            arrival_s=arrival,
            input_length=len(tokens),
            output_length=sampling.max_tokens,
            block_keys=keys,
            block_size_tokens=self.hasher.block_size_tokens,
            reuses_prefix=prefix_reusable(sampling.prompt_logprobs),  # the engine's rule
        )
        live = LiveRequest(request_id, tokens, request, sampling, arrival, cache_salt=cache_salt, is_streamed=streamed)
        decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(live, decided)
        decision = self._waiting.arrive(waiter, request, self.now())
        if decision is not None:
            self._decided(waiter, decision, waited=False)
        else:
            self._waited()
        try:
            # Shielded: the client leaving cancels this wait, not the decision, which the line may settle before
            # this handler runs.
            await asyncio.shield(decided)  # at once when decided above
        except asyncio.CancelledError:  # the client left
            if self._waiting.remove(waiter):
                # An abort, counted once as any end is (as a rerouted request leaving the line is: `_leave_line`),
                # on no engine yet (`engine=""`).
                self._finished(live, _unfinished(Reason.CLIENT_GONE), self.now())
                self._room_freed()  # the head leaving lets the next try
            elif decided.done() and decided.exception() is None and self.live.get(live.request_id) is live:
                self.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)  # accepted as it left
            raise
        return live

    def _decided(self, waiter: _Waiter, decision: ScheduleDecision, *, waited: bool = True) -> None:
        """Settle a request's admission: live, or its rejection for its `admit` to raise (saying how long it
        `waited` in line, if it did); a rerouted one's is sent on, or its rejection ends it."""
        live = waiter.live
        if waiter.failure is not None:
            self._rerouted.pop(live.request_id, None)
        if decision.accepted:
            self._accepted(live, decision)
            if waiter.decided is not None:
                waiter.decided.set_result(None)
            else:
                self.submit(live)
            return
        assert decision.reason is not None
        self.metrics.rejections[decision.reason.value].inc()
        waited_s = self.now() - live.request.arrival_s if waited else 0.0
        self._refused(waiter, self._rejection(decision, waiter, waited_s=waited_s))

    def _refused(self, waiter: _Waiter, error: ApiError) -> None:
        """End a request that left the line unadmitted with `error`: its `admit` raises it, a rerouted one's
        reader gets it."""
        if waiter.decided is not None:
            waiter.decided.set_exception(error)
        else:
            waiter.live.events.put_nowait(("error", error))

    def _try_failed(self, waiter: _Waiter, error: Exception) -> None:
        """The Conductor raised trying `waiter`'s request in line (it left the line undecided): it ends with the
        500 the gateway answers an error raised at a request's first try with, the error logged; else its client
        would wait for a decision that never comes."""
        LOG.error("scheduling request %s in the admission line failed", waiter.live.request_id, exc_info=error)
        if waiter.failure is not None:
            self._rerouted.pop(waiter.live.request_id, None)
        self._refused(waiter, ApiError(500, "internal error"))

    def _room_freed(self) -> None:
        """A request ended, an engine came up or went down, or a wait's deadline came: the line is tried
        (`AdmissionQueue.pump`); a request the Conductor raises for fails alone (`_try_failed`)."""
        if self._closed:
            return
        for waiter, decision in self._waiting.pump(self.now(), failed=self._try_failed):
            self._decided(waiter, decision)
        self._waited()

    def _waited(self) -> None:
        """Count those waiting, and set the timer for the earliest deadline among them."""
        self.metrics.admission_waiting.set(len(self._waiting))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        deadline = self._waiting.next_deadline()
        if deadline < math.inf:
            delay = max(0.0, deadline - self.now())
            self._deadline_timer = asyncio.get_running_loop().call_later(delay, self._room_freed)

    def _rejection(self, decision: ScheduleDecision, waiter: _Waiter, *, waited_s: float) -> ApiError:
        """The answer to the Conductor's rejection of `waiter`'s request (`rejection_error`), `waited_s` after its
        arrival (a TTFT estimate under the objective is then refused for the wait). A new request's is before its
        prefill; a rerouted one's (`failure` set: an engine of its failed) says so first, and whether a prefill of
        it had run, for nothing now (`REJECTED_AFTER_PREFILL`), or not."""
        assert decision.reason is not None
        failure, live = waiter.failure, waiter.live
        outcome = Outcome.REJECTED_BEFORE_PREFILL
        if failure is not None and live.has_prefilled:
            outcome = Outcome.REJECTED_AFTER_PREFILL
        return rejection_error(
            decision.reason,
            outcome,
            ttft_s=decision.ttft_s,
            ttft_slo_s=self.conductor.slo.ttft_s,
            waited_s=waited_s,
            failure=None if failure is None else failure.message,
        )

    def _accepted(self, live: LiveRequest, decision: ScheduleDecision) -> None:
        assert decision.prefill_instance is not None and decision.decode_instance is not None
        live.prefill, live.decode = decision.prefill_instance, decision.decode_instance
        plan = decision.transfer
        live.fetch = None if plan is None else wire.Fetch(source=plan.source, blocks=plan.num_blocks)
        self.live[live.request_id] = live

    def submit(self, live: LiveRequest) -> None:
        """Send an admitted request's current attempt to its prefill worker, once (on the event loop's thread).

        Nothing is sent once the cluster is shutting down (the request has its 503: `shut_down_requests`), for a
        request no longer live, or for an attempt already sent: between the line admitting a request and its
        `admit` returning, an engine of its may fail and the request be rerouted and sent (or ended) already.
        """
        if self._closed or self.live.get(live.request_id) is not live or live.sent_attempt == live.attempt:
            return
        live.sent_attempt = live.attempt
        sampling = live.sampling
        assert sampling.seed is not None  # drawn at admission
        job = wire.PrefillJob(
            request_id=int(live.request_id),
            attempt=live.attempt,
            tokens=tuple(live.tokens),
            decode=live.decode,
            fetch=live.fetch,
            cache_salt=live.cache_salt,
            # The request's options by name (each wire field is one of them); the stop ids are `_stop_ids_of`'s.
            sampling=wire.Sampling(
                stop_ids=self._stop_ids_of(live),
                **{f.name: getattr(sampling, f.name) for f in attrs.fields(wire.Sampling) if f.name != "stop_ids"},
            ),
        )
        instance = live.prefill
        future = asyncio.get_running_loop().run_in_executor(self._calls[instance], self.call, instance, job)
        unsent = self._unsent[instance]
        unsent.add(future)

        def check(done: asyncio.Future[Any]) -> None:
            unsent.discard(done)
            if not done.cancelled() and done.exception() is not None:
                self._worker_failed(instance)  # unreachable: mark it down (its requests are rerouted)

        future.add_done_callback(check)

    async def tokens(self, live: LiveRequest) -> AsyncIterator[wire.Token]:
        """The request's tokens as they arrive (with their log-probabilities where it asked for them).

        `[limits] request_timeout_s` bounds each wait: for the first token from the request's arrival, for each
        next one from the one before. A request whose tokens keep coming runs to its end however long that takes
        (vLLM's server sets no deadline at all); one that stalls (an engine hung, a step lost) ends.

        Raises:
            ApiError: the request failed, or no token came within the timeout: a 504.
        """
        timeout_s = self.config.limits.request_timeout_s
        deadline = live.arrival + timeout_s
        while True:
            try:
                # Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation (the client left) that
                # arrives as the queue hands over a token, and the decode then runs on for nobody.
                async with asyncio.timeout(max(0.0, deadline - self.now())):
                    kind, payload = await live.events.get()
            except TimeoutError:
                self.end(live, Outcome.ABORTED, Reason.TIMEOUT)
                raise ApiError(504, f"no token came for {timeout_s:g} s: the request timed out") from None
            if kind == "error":
                raise payload
            yield payload
            if payload.finished:
                return
            deadline = self.now() + timeout_s  # from when the reader asks again: a slow client is not a stall

    def finish(self, live: LiveRequest, finish_reason: str, answered_tokens: int | None = None) -> None:
        """The reader's judgement of a request whose text ended: `finish_reason` is its answer's ("stop" or
        "length", the gateway's `_Choice.finish_reason`), the one decision the metrics count too, as vLLM sets its
        finish reason from its detokenizer's stop strings before it counts it. A request still decoding (its text
        reached a stop string first) ends here, cancelled on its decode engine; one its last token ended is counted
        now, at that token's end time. Nothing for a request already counted. `answered_tokens`: the tokens its
        answer holds (its usage's), which its generated-tokens figure counts, not those that came after the stop
        string before the cancellation landed (vLLM counts a request's tokens up to its stop)."""
        if answered_tokens is not None:
            live.generated = min(live.generated, answered_tokens)
        if live.request_id in self.live:
            self.end(live, Outcome.COMPLETED, cancel=True, finish_reason=finish_reason)
        elif live.unjudged_end_s is not None:
            end_s, live.unjudged_end_s = live.unjudged_end_s, None
            self._finished(live, finish_reason, end_s)

    def _stop_ids_of(self, live: LiveRequest) -> tuple[int, ...]:
        """The token ids that end `live`'s generation: the model's (none with `ignore_eos`, vLLM's) and the
        request's own `stop_token_ids`."""
        model = () if live.sampling.ignore_eos else self._stop_ids
        return tuple(sorted({*model, *live.sampling.stop_token_ids}))

    def end(
        self,
        live: LiveRequest,
        outcome: Outcome,
        reason: Reason | None = None,
        *,
        cancel: bool = False,
        finish_reason: str | None = None,
    ) -> tuple[RequestEnd, ...]:
        """Tell the Conductor the request ended (once; later calls do nothing); returns the end it reports.

        A request whose client left or timed out, or one ended with `cancel`, is cancelled on its decode engine, and
        one whose client left or timed out before it joined there, on its prefill engine too. A completed one is
        counted with `finish_reason`, its reader's judgement (`finish`); without one (its last token ended it,
        before the reader read its text) the count waits for that judgement, or for its end as unread: a request
        whose reader left or failed before judging its last token counts as the reader's end ("abort", "error"),
        as its client got no answer of it.
        """
        if self.live.pop(live.request_id, None) is None:
            if live.unjudged_end_s is not None and outcome is not Outcome.COMPLETED:
                end_s, live.unjudged_end_s = live.unjudged_end_s, None
                self._finished(live, _unfinished(reason), end_s)
            self._leave_line(live, reason)
            return ()
        now = self.now()
        if outcome is Outcome.COMPLETED:
            if finish_reason is None:
                live.unjudged_end_s = now
            else:
                self._finished(live, finish_reason, now)
        elif outcome is not Outcome.REJECTED_AFTER_PREFILL:  # a rejection was counted as one
            self._finished(live, _unfinished(reason), now)
        if (cancel or reason in (Reason.CLIENT_GONE, Reason.TIMEOUT)) and self.workers[live.decode].up:
            # Stop the decode engine from generating for nobody (it ignores requests it does not hold).
            stop = wire.CancelDecode(request_id=int(live.request_id), every_attempt=True)  # ended: every attempt
            self._calls[live.decode].submit(self._tell, live.decode, stop)
        if reason in (Reason.CLIENT_GONE, Reason.TIMEOUT) and live.joined_s is None:
            self._abandon(live)  # nor prefill it for nobody
        if outcome is Outcome.COMPLETED:
            event: DecodeFinished | RequestRejected | RequestAborted = DecodeFinished(
                request_id=live.request_id, instance_id=live.decode, now=now, generated_tokens=live.generated
            )
        elif outcome is Outcome.REJECTED_AFTER_PREFILL:
            event = RequestRejected(
                request_id=live.request_id, instance_id=live.decode, now=now, reason=reason or Reason.DECODE_REJECTED
            )
        else:
            event = RequestAborted(request_id=live.request_id, now=now, reason=reason or Reason.FAILED)
        ends = self.conductor.handle(event)
        self._room_freed()
        return ends

    def _leave_line(self, live: LiveRequest, reason: Reason | None) -> None:
        """A rerouted request waiting in the line again ends (its client left, it timed out): it leaves the line,
        counted as ended (the Conductor ended it when its engine failed, and its abandoned attempt was cancelled
        then); the line is tried, its head may have left. Nothing for any other request that is not live."""
        waiter = self._rerouted.get(live.request_id)
        if waiter is None or waiter.live is not live:
            return
        del self._rerouted[live.request_id]
        self._waiting.remove(waiter)
        self._finished(live, _unfinished(reason), self.now())
        self._room_freed()

    def _finished(self, live: LiveRequest, reason: str, now: float) -> None:
        record = FinishedRequest(
            prefill_engine=live.prefill,
            decode_engine=live.decode,
            finished_reason=reason,
            arrival_s=live.arrival,
            prefill_started_s=live.prefill_started_s,
            prefill_done_s=live.prefill_done_s,
            first_token_s=live.first_token_s,
            last_token_s=live.last_token_s,
            end_s=now,
            prompt_tokens=len(live.tokens),
            generation_tokens=live.generated,
            max_tokens=live.sampling.max_tokens,
        )
        self.metrics.finished(record)

    def loads(self) -> dict[str, tuple[int, int]]:
        """Each engine's (running, waiting) requests as the reports tell them: a prefill engine runs a request from
        its start to its end, a decode engine from its join to the request's end; each waits for them before."""
        loads = dict.fromkeys(self.workers, (0, 0))
        for live in self.live.values():
            if live.prefill_done_s is None:
                engine, running = live.prefill, live.prefill_started_s is not None
            else:
                engine, running = live.decode, live.joined_s is not None
            held, waiting = loads.get(engine, (0, 0))
            loads[engine] = (held + 1, waiting) if running else (held, waiting + 1)
        return loads

    def _abandon(self, live: LiveRequest) -> None:
        """The request's current attempt will not be served: its prefill worker drops the job (told now, or when it
        answers again if it is down; one that has done the job ignores it)."""
        job = wire.CancelPrefill(request_id=int(live.request_id), attempt=live.attempt)
        if self.workers[live.prefill].up:
            self._calls[live.prefill].submit(self._tell, live.prefill, job)
        elif not self.workers[live.prefill].gone:
            self._stale[live.prefill].append(job)

    # ------------------------------------------------------------------ worker reports

    def _receiver(self, cls: type[Any]) -> Callable[[Any], Any]:
        """A control-call handler: decode the report here (a malformed one goes back to its sender as an
        error, and is logged), apply it on the event loop."""

        def handler(args: Any) -> Any:
            try:
                message = wire.decode_as(cls, args)
            except wire.MessageError as error:
                LOG.warning("refused a malformed worker report: %s", error)
                raise
            loop = self._loop
            if loop is not None:
                loop.call_soon_threadsafe(self._dispatch, message)
            return None

        return handler

    def _dispatch(self, message: wire.Message) -> None:
        if isinstance(message, wire.DecodeTokens):
            self._on_tokens(message)
            return
        if isinstance(message, wire.PrefillDone | wire.PrefillFailed):
            gap = False
            for event in message.events:
                # The index forgot the worker (marked down, then up) or a report was lost: count it, and ask the
                # worker to announce its cache, a new epoch the index takes whole (else it stays blind to that
                # cache, its events all gaps, for as long as the worker runs).
                if self.conductor.apply_cache_event(event, strict=False) is not None:
                    self.metrics.index_gaps[message.instance_id].inc()
                    gap = True
            if gap:
                self._ask_announce(message.instance_id)
            elif message.events:
                self._announcing.pop(message.instance_id, None)
        assert not isinstance(message, wire.DecodeTokens)
        live = self.live.get(RequestId(message.request_id))  # type: ignore[union-attr, arg-type]
        if live is None or live.attempt != message.attempt:  # type: ignore[union-attr]
            return  # ended, or a report of an earlier attempt (from an engine presumed dead)
        prefill = isinstance(message, wire.PrefillStarted | wire.PrefillDone | wire.PrefillFailed)
        if message.instance_id != (live.prefill if prefill else live.decode):  # type: ignore[union-attr]
            return
        now = self.now()
        if isinstance(message, wire.PrefillStarted):
            live.prefill_started_s = now
            self.conductor.handle(PrefillStarted(request_id=live.request_id, instance_id=live.prefill, now=now))
        elif isinstance(message, wire.PrefillDone):
            self._prefilled(live, message, now)
        elif isinstance(message, wire.PrefillFailed) and message.peer:
            self._unreachable(live, message)
        elif isinstance(message, wire.PrefillFailed | wire.DecodeFailed):  # a failure, not a scheduling decision
            stage = "prefill" if prefill else "decode"
            self._fail(live, ApiError(500, f"{stage} failed: {message.error}"), Outcome.ABORTED, Reason.FAILED)
        elif isinstance(message, wire.DecodeJoined):
            live.joined_s = now
            joined = DecodeJoined(
                request_id=live.request_id,
                instance_id=live.decode,
                now=now,
                context_tokens=message.context_tokens,
                output_tokens=message.output_tokens,
            )
            self.conductor.handle(joined)
        elif isinstance(message, wire.DecodeRejected):
            reason = refusal_named(message.reason)
            self.metrics.rejections[f"decode_{reason.value}"].inc()
            self._fail(
                live, rejection_error(reason, Outcome.REJECTED_AFTER_PREFILL), Outcome.REJECTED_AFTER_PREFILL, reason
            )

    def _unreachable(self, live: LiveRequest, failed: wire.PrefillFailed) -> None:
        """The prefill's decode node did not answer it: a probe of that node decides at once whether it is down
        (then this request is rerouted with the others routed there), not one prefill engine's word, which would
        end the node's streams too; if it answers, this request alone is scheduled again."""
        task = asyncio.get_running_loop().create_task(self._probe_then_reroute(live, failed))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_then_reroute(self, live: LiveRequest, failed: wire.PrefillFailed) -> None:
        state = self.workers.get(InstanceId(failed.peer))
        if state is not None and state.up:
            LOG.warning("worker %s did not answer %s: probing it now", failed.peer, failed.instance_id)
            while state.probing:  # the health loop's probe is on its way: its verdict will do
                await asyncio.sleep(0.05)
            if state.up:
                state.probing = True
                await self._probe(state)  # no answer: marked down, this request rerouted with the others
        if self.live.get(live.request_id) is not live or live.attempt != failed.attempt:
            return  # ended or rerouted meanwhile
        if live.joined_s is not None or live.generated:
            return  # its hand-off reached the node after all (the call timed out after it was taken)
        self.live.pop(live.request_id)
        self.conductor.handle(RequestAborted(request_id=live.request_id, now=self.now(), reason=Reason.FAILED))
        self._reroute(live, ApiError(503, f"the decode engine {failed.peer} did not answer: {failed.error}"))

    def _prefilled(self, live: LiveRequest, done: wire.PrefillDone, now: float) -> None:
        self.conductor.handle(PrefillFinished(request_id=live.request_id, instance_id=live.prefill, now=now))
        live.cached_tokens = done.prefix_tokens
        live.prompt_logprobs = done.prompt_logprobs
        live.prefill_done_s = now
        live.has_prefilled = True
        self.metrics.prefilled(
            live.prefill,
            prompt_tokens=len(live.tokens),
            cached_tokens=done.prefix_tokens,
            fetched_bytes=done.fetched_blocks * self._block_bytes,
            pushed_bytes=done.streamed_blocks * self._block_bytes,
            looked_up=live.request.reuses_prefix,
        )

    def _on_tokens(self, report: wire.DecodeTokens) -> None:
        """One decode step's tokens (or several steps', merged while this loop was behind): counted at once, each
        handed to its request (one clock read for all).

        Timed as the steps ran, not as the report arrived (which would make every merged token's interval 0):
        a token's inter-token latency is its step's time on its decode worker's monotonic clock (`Token.at_s`)
        less its request's previous token's, as vLLM times it by its engine core's step times (one attempt's
        tokens all come from one worker: its first, index 0, starts the intervals again). On this clock (TTFT,
        a request's first and last token), the report's latest step is placed at its arrival, `now`, and each
        earlier step as long before it as it ran before on the worker: only differences of one worker's clock
        are used, never a worker's reading against this one's; an unmerged report lands at `now`."""
        instance, live_requests, tokens = report.instance_id, self.live, report.tokens
        self.metrics.generation_tokens[instance].inc(len(tokens))
        inter_token = self.metrics.itl[instance]
        now = self.now()
        latest_at_s = max((token.at_s for token in tokens), default=0.0)
        for token in tokens:
            live = live_requests.get(RequestId(token.request_id))  # type: ignore[arg-type]
            if live is None or live.decode != instance or live.attempt != token.attempt:
                continue
            placed_s = now - (latest_at_s - token.at_s)
            if token.index == 0:
                if live.first_token_s is None:  # once per request: a whole answer's retry begins again (`_reroute`)
                    self.metrics.ttft[live.prefill].observe(placed_s - live.arrival)
                live.first_token_s = placed_s
            elif live.last_token_at_s is not None:
                inter_token.observe(token.at_s - live.last_token_at_s)
            live.last_token_s, live.last_token_at_s = placed_s, token.at_s
            live.generated += 1
            live.events.put_nowait(("token", token))
            if token.finished:  # its finish reason is its reader's to judge, from its text (`finish`)
                self.end(live, Outcome.COMPLETED)

    def _fail(self, live: LiveRequest, error: ApiError, outcome: Outcome, reason: Reason) -> None:
        self.end(live, outcome, reason)
        live.events.put_nowait(("error", error))

    # ------------------------------------------------------------------ health

    async def health_loop(self) -> None:
        """Every `[limits] health_interval_s`, probe the workers that are due (each probe on its own task)."""
        while True:
            await asyncio.sleep(self.config.limits.health_interval_s)
            now = self.now()
            for state in self.workers.values():
                if not state.probing and state.next_probe_s <= now:
                    state.probing = True
                    task = asyncio.create_task(self._probe(state))
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)

    async def _probe(self, state: WorkerState) -> None:
        loop = asyncio.get_running_loop()
        instance = state.instance_id
        health: wire.Health | None = None
        alive = True
        try:
            probe = self._probe_calls[instance]  # its own thread: the timeout is the answer's, never a queue's
            alive = await loop.run_in_executor(probe, self._is_alive, instance)
            if alive:
                async with asyncio.timeout(PROBE_TIMEOUT_S + 1.0):  # (not wait_for: see `tokens`)
                    health = await loop.run_in_executor(probe, self.health, instance)
        except (MooncakeError, OSError, TimeoutError):
            health = None
        finally:
            state.probing = False
        if not alive and not state.gone:
            self._peer_gone(state)
        limits = self.config.limits
        if health is None or not health.ok:
            state.failures += 1
            # The doubling stops once past the cap (the config keeps cap >= interval): 2.0**failures itself
            # overflows after 1023 failures (85 minutes down at the default cap), and the probe then raised before
            # setting its next time, on every health tick.
            cap_s, interval_s = limits.health_probe_backoff_max_s, limits.health_interval_s
            doublings = min(state.failures, math.ceil(math.log2(cap_s / interval_s)) + 1)
            backoff = min(cap_s, interval_s * 2.0**doublings)
            state.next_probe_s = self.now() + backoff
            if state.up:
                LOG.warning("worker %s does not answer: marked down", instance)
                self._worker_failed(instance)
            return
        state.failures, state.next_probe_s = 0, self.now()
        self.metrics.set_kv_usage(instance, health.kv_usage)
        if not state.up:
            LOG.warning("worker %s answers again: marked up", instance)
            state.up = True
            self.conductor.handle(InstanceUp(instance_id=instance, now=self.now()))
            if state.role != "decode":  # marked down, its cache was forgotten: its next report brings it back
                self._ask_announce(instance)
            self._room_freed()
            for job in self._stale[instance]:  # jobs still queued there that were rerouted while it was down
                self._calls[instance].submit(self._tell, instance, job)
            self._stale[instance].clear()
            for other in self.workers.values():  # the deaths it missed while down: it may hold leases of theirs
                if other.gone:
                    self._calls[instance].submit(self._tell, instance, self._gone_message(other))
        for request_id in health.active:
            live = self.live.get(RequestId(request_id))  # type: ignore[arg-type]
            if live is None or live.decode != instance:  # ended while it was down, or rescheduled elsewhere
                # Where it ended, every attempt; else only the one there. Unanswered: a dead engine generates
                # nothing; a live one that missed this is cancelled by the next health probe.
                stop = wire.CancelDecode(request_id=request_id, every_attempt=live is None)
                self._calls[instance].submit(self._tell, instance, stop)

    def _peer_gone(self, state: WorkerState) -> None:
        """Its process is dead: the other workers end the leases it held with them at once (pins it took to
        fetch, pages it reserved to push into), instead of keeping them until they expire. Only a dead process is
        certain to write no more: a stopped one keeps its reservations (`Messenger`'s quarantine)."""
        state.gone = True
        self._stale[state.instance_id].clear()  # its queue died with it
        message = self._gone_message(state)
        for other, worker in self.workers.items():  # one down now is told when it answers again
            if other != state.instance_id and worker.up:
                self._calls[other].submit(self._tell, other, message)

    def _gone_message(self, state: WorkerState) -> wire.PeerGone:
        return wire.PeerGone(address=self._addresses[state.instance_id])

    def _ask_announce(self, instance: str) -> None:
        """Ask `instance` to announce its cache (`wire.Announce`), unless asked within `ANNOUNCE_AGAIN_S`."""
        now = time.monotonic()
        if now - self._announcing.get(instance, -math.inf) >= ANNOUNCE_AGAIN_S:
            self._announcing[instance] = now
            self._calls[instance].submit(self._tell, instance, wire.Announce())

    def _tell(self, instance: str, message: wire.Message) -> None:
        """`call`, for a message whose answer nobody waits for (a worker that does not answer is the health
        loop's to find)."""
        try:
            self.call(instance, message)
        except (MooncakeError, OSError):
            pass

    def _worker_failed(self, instance: InstanceId) -> None:
        state = self.workers[instance]
        if not state.up:
            return
        state.up = False
        state.next_probe_s = max(state.next_probe_s, self.now() + self.config.limits.health_interval_s)
        for future in list(self._unsent.get(instance, ())):
            future.cancel()  # a job still queued for it: its request is rerouted below (one being sent goes on: the
            # worker's reports about that attempt are then ignored)
        ends: tuple[RequestEnd, ...] = self.conductor.handle(InstanceDown(instance_id=instance, now=self.now()))
        for end in ends:
            live = self.live.pop(end.request_id, None)
            if live is not None:
                self._reroute(live, ApiError(503, f"the {state.role} engine {instance} failed"))
        # Prefilled there but not handed on: the worker reports PrefillDone, then calls the decode node, so the
        # Conductor counts these as the decode node's and ended none of them above. A worker that died or stopped in
        # between never hands them on, and they would wait out the request timeout (a 504). A hand-off that comes
        # after all is stale: the decode node keeps the later attempt, and the health probes cancel the rest.
        stranded = [
            live
            for live in self.live.values()
            if live.prefill == instance and live.prefill_done_s is not None and live.joined_s is None
        ]
        for live in stranded:
            self.live.pop(live.request_id)
            self.conductor.handle(RequestAborted(request_id=live.request_id, now=self.now(), reason=Reason.FAILED))
            self._reroute(live, ApiError(503, f"the prefill engine {instance} failed before handing the request on"))
        self._room_freed()  # its requests that ended freed room (those rerouted went first: they were accepted before)

    def _reroute(self, live: LiveRequest, failure: ApiError) -> None:
        """A request the Conductor has ended (no longer live) because an engine of its failed: scheduled again as
        its next attempt while nothing of it has reached its client and it has attempts left, else ended with
        `failure`. Its abandoned attempt is cancelled on its prefill engine either way.

        A whole (not streamed) answer's tokens reach its client only at its end: one with tokens is scheduled
        again too, those tokens forgotten (the ones still queued dropped, the count back to 0), so that its reader,
        seeing a token of the next attempt, starts the answer again; its seed, fixed at admission, draws the same
        tokens again."""
        self._abandon(live)
        began = live.generated > 0 and live.is_streamed
        if self._closed or began or live.attempt >= MAX_REROUTES:  # shut down: it has its 503
            self._finished(live, "error", self.now())
            live.events.put_nowait(("error", failure))
            return
        if live.generated:  # its reader must see none of them after the retry's (a stop string there would end it)
            queued = [live.events.get_nowait() for _ in range(live.events.qsize())]
            for kept in (event for event in queued if event[0] != "token"):
                live.events.put_nowait(kept)
            live.generated = 0
        live.attempt += 1
        live.prefill_started_s = live.prefill_done_s = live.joined_s = None  # prefilled again
        # Scheduled again on the engines up (a prefix it had prefilled is cached there now) as `admit` schedules a
        # request, arrival kept: refused for room, it waits in line, ahead of those that came after it (an immediate
        # 429 would treat it worse than a newcomer, whom the line lets wait).
        waiter = _Waiter(live, failure=failure)
        decision = self._waiting.arrive(waiter, live.request, self.now(), again=True)
        if decision is None:
            self._rerouted[live.request_id] = waiter
            self._waited()
        else:
            self._decided(waiter, decision)


def _unfinished(reason: Reason | None) -> str:
    """The finish reason counted for a request that ended without an answer: "abort" where its client left or it
    timed out, else "error" (an engine failed it)."""
    return "abort" if reason in (Reason.CLIENT_GONE, Reason.TIMEOUT) else "error"
