"""Requests in flight between the Conductor and the engine workers.

The `Dispatcher` holds the Conductor, a control connection to every worker and
the table of live requests. `admit` keys a request's blocks and lets the
Conductor decide (a rejection is a 429, no engine up a 503); `submit` sends an
accepted request to its prefill worker with the decision's transfer plan. The
workers report progress (prefill started/done/failed, decode joined/rejected/
failed, tokens) with calls that arrive on the transfer engine's threads and are handed
to the event loop, where they become Conductor events, index updates (the
prefill node's cache events), metrics, and the request's queue of tokens that
`tokens` reads until the last one, an error or the request's deadline.

Ends, in `sched.outcome`'s vocabulary: a decode engine's refusal is the decode
rule's reason (`REJECTED_AFTER_PREFILL`, a 429); a prefill or a join that fails
(the KV missing on the decode node, say) is `ABORTED` / `FAILED` (a 500).

Failures: a health loop checks every worker; a dead one is marked down in the
Conductor. Requests waiting for a dead prefill engine are scheduled again on
the survivors (twice at most); requests decoding on a dead decode engine end
with an error.

Every Conductor call happens on the event loop's thread: it is the Conductor's
only user.

Invariants: a request is in `live` from its acceptance until it ends; the
Conductor learns of each end once (from `end`, a no-op for a request no longer
live, or by itself when an instance goes down); tokens reach a request's queue
only while it is live, in order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from mooncake.cache.hashing import BlockHasher
from mooncake.errors import MooncakeError
from mooncake.sched.conductor import Conductor
from mooncake.sched.join import DecodeLimits
from mooncake.sched.outcome import Outcome, Reason, RequestEnd
from mooncake.sched.view import (
    DecodeFinished,
    DecodeJoined,
    InstanceDown,
    PrefillFinished,
    PrefillStarted,
    RequestAborted,
    RequestRejected,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig
from mooncake.types import InstanceId, Request, RequestId
from serving.api import CompletionRequest, HttpError
from serving.config import ClusterConfig
from serving.metrics import Registry
from serving.wire import event_from_wire

__all__ = ["Dispatcher", "LiveRequest"]

REPORTS = (
    "prefill.started",
    "prefill.done",
    "prefill.failed",
    "decode.joined",
    "decode.rejected",
    "decode.failed",
    "decode.tokens",
)


@attrs.define(eq=False)
class LiveRequest:
    """A request between its acceptance and its end; `events` queues ("token", (token, finished)) or ("error", e)."""

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


class Dispatcher:
    """The Conductor, the workers' control connections and the requests in flight.

    Args:
        config: the cluster config.
        conductor: the scheduler; every worker is added to it here.
        secret: the transfer engines' shared secret.
        workers: each worker's `start()` info (instance id, role, address).
        is_alive: tells whether a worker's process (or actor) still runs.
        metrics: the registry the request and engine metrics go to.
        block_bytes: the KV bytes of one block (for the transfer metrics).
    """

    def __init__(
        self,
        config: ClusterConfig,
        conductor: Conductor,
        *,
        secret: bytes,
        workers: list[dict[str, Any]],
        is_alive: Callable[[str], bool],
        metrics: Registry,
        block_bytes: int,
    ) -> None:
        self.config = config
        self.hasher = BlockHasher(model=config.model.preset, block_size_tokens=config.model.block_tokens)
        self.conductor = conductor
        self.metrics = metrics
        self.roles = {w["instance_id"]: w["role"] for w in workers}
        # What each decode engine holds, as its own check counts it (`DecodeConfig`): the Conductor asks the same rule.
        limits = DecodeLimits(
            kv_capacity_tokens=config.decode.max_batch_size * config.decode.max_context_tokens,
            max_batch_size=config.decode.max_batch_size,
            max_context_tokens=config.decode.max_context_tokens,
        )
        for worker in workers:
            if worker["role"] == "prefill":
                self.conductor.add_prefill_instance(InstanceId(worker["instance_id"]))
            else:
                self.conductor.add_decode_instance(InstanceId(worker["instance_id"]), limits)
        self.up = dict.fromkeys(self.roles, True)
        self._is_alive = is_alive
        self.engine = TransferEngine(
            secret=secret, config=EngineConfig(transports=("tcp",), io_timeout_s=5.0, spin_us=0)
        )
        for method in REPORTS:
            self.engine.register_handler(method, self._callback(method))
        self.peers = {w["instance_id"]: self.engine.connect(w["address"], transport="tcp") for w in workers}
        addresses = {w["instance_id"]: w["address"] for w in workers}
        for instance in self.peers:
            self.engine.call(
                self.peers[instance], "worker.connect", {"gateway": self.engine.address, "peers": addresses}
            )
        self.live: dict[RequestId, LiveRequest] = {}
        self._ids = itertools.count(1)
        self._started = time.monotonic()
        self._calls = ThreadPoolExecutor(max(4, len(workers)), thread_name_prefix="gateway-call")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._block_bytes = block_bytes

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the workers' reports to `loop` from now on (reports before are dropped)."""
        self._loop = loop

    def close(self) -> None:
        """End every live request with a 503, stop the control calls and the transfer engine."""
        for live in list(self.live.values()):
            live.events.put_nowait(("error", HttpError(503, "the cluster is shutting down", kind="server_error")))
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def now(self) -> float:
        """Seconds since the dispatcher started: the Conductor's clock."""
        return time.monotonic() - self._started

    def num_up(self, role: str) -> int:
        """How many engines of `role` ("prefill" or "decode") are up."""
        return sum(1 for i, up in self.up.items() if up and self.roles[i] == role)

    # ------------------------------------------------------------------ scheduling

    def admit(self, parsed: CompletionRequest, arrival: float) -> LiveRequest:
        """Schedule a request; it is live once this returns.

        Raises:
            HttpError: 503 when no prefill or no decode engine is up; 429 when the Conductor rejects it.
        """
        if not (self.num_up("prefill") and self.num_up("decode")):
            raise HttpError(
                503, "no prefill or no decode engine is up", kind="server_error", headers={"Retry-After": "5"}
            )
        tokens = parsed.tokens
        request_id = RequestId(next(self._ids))
        keys = self.hasher.block_keys(np.asarray(tokens, dtype=np.int32))
        request = Request(
            request_id=request_id,
            arrival_s=arrival,
            input_length=len(tokens),
            output_length=parsed.max_tokens,
            block_keys=keys,
            block_size_tokens=self.hasher.block_size_tokens,
        )
        job = {
            "request_id": int(request_id),
            "tokens": tokens,
            "max_tokens": parsed.max_tokens,
            "temperature": parsed.temperature,
            "seed": parsed.seed,
        }
        live = LiveRequest(request_id, tokens, request, job, InstanceId(""), InstanceId(""), arrival)
        self._schedule(live)
        return live

    def _schedule(self, live: LiveRequest) -> None:
        decision = self.conductor.schedule(live.request, self.now())
        if not decision.accepted:
            assert decision.reason is not None
            reason = decision.reason.value
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

    def submit(self, live: LiveRequest) -> None:
        """Send an admitted request to its prefill worker (on the event loop's thread)."""
        peer = self.peers[live.prefill]
        future = asyncio.get_running_loop().run_in_executor(
            self._calls, self.engine.call, peer, "prefill.submit", live.job
        )
        instance = live.prefill

        def check(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is not None:
                self._worker_failed(instance)  # unreachable: mark it down (its requests are rerouted)

        future.add_done_callback(check)

    async def tokens(self, live: LiveRequest) -> AsyncIterator[int]:
        """The request's tokens as they arrive.

        Raises:
            HttpError: the request failed, or its deadline (`[limits] request_timeout_s`) passed: a 504.
        """
        deadline = live.arrival + self.config.limits.request_timeout_s
        while True:
            try:
                kind, payload = await asyncio.wait_for(live.events.get(), timeout=max(0.0, deadline - self.now()))
            except TimeoutError:
                self.end(live, Outcome.ABORTED, Reason.TIMEOUT)
                raise HttpError(504, "the request timed out", kind="timeout_error") from None
            if kind == "error":
                raise payload
            token, finished = payload
            yield token
            if finished:
                return

    def end(self, live: LiveRequest, outcome: Outcome, reason: Reason | None = None) -> tuple[RequestEnd, ...]:
        """Tell the Conductor the request ended (once; later calls do nothing); returns the end it reports."""
        if self.live.pop(live.request_id, None) is None:
            return ()
        now = self.now()
        if reason in (Reason.CLIENT_GONE, Reason.TIMEOUT) and self.up.get(live.decode):
            # Stop the decode engine from generating for nobody (it ignores requests it does not hold).
            self._calls.submit(self._cancel, live.decode, live.request_id)
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
        return self.conductor.handle(event)

    def _cancel(self, instance: InstanceId, request_id: RequestId) -> None:
        try:
            self.engine.call(self.peers[instance], "decode.cancel", {"request_id": int(request_id)})
        except (MooncakeError, OSError):
            pass  # a dead engine generates nothing

    # ------------------------------------------------------------------ worker reports

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
            # A worker restarted or a message was lost: count it; the index catches up on the next epoch.
            if self.conductor.apply_cache_event(event_from_wire(wire), strict=False) is not None:
                self.metrics.inc("mooncake_index_gaps_total")
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
        elif method in ("prefill.failed", "decode.failed"):  # a failure, not a scheduling decision
            stage = method.split(".")[0]
            self._fail(
                live,
                HttpError(500, f"{stage} failed: {args['error']}", kind="server_error"),
                Outcome.ABORTED,
                Reason.FAILED,
            )
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
            reason = _reason(str(args["reason"]))
            self.metrics.inc("mooncake_rejections_total", reason=f"decode_{reason.value}")
            self._fail(
                live,
                HttpError(
                    429,
                    f"the decode engine refused the request ({reason.value}); retry later",
                    kind="rate_limit_error",
                    headers={"Retry-After": "1"},
                ),
                Outcome.REJECTED_AFTER_PREFILL,
                reason,
            )
        elif method in ("prefill.failed", "decode.failed"):  # a failure, not a scheduling decision
            stage = method.split(".")[0]
            self._fail(
                live,
                HttpError(500, f"{stage} failed: {args['error']}", kind="server_error"),
                Outcome.ABORTED,
                Reason.FAILED,
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
            self.end(live, Outcome.COMPLETED)

    def _fail(self, live: LiveRequest, error: HttpError, outcome: Outcome, reason: Reason) -> None:
        self.end(live, outcome, reason)
        live.events.put_nowait(("error", error))

    # ------------------------------------------------------------------ health

    async def health_loop(self) -> None:
        """Every `[limits] health_interval_s`, mark down the workers that are gone or do not answer."""
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
                self.submit(live)
            else:
                role = self.roles[instance]
                live.events.put_nowait(
                    ("error", HttpError(503, f"the {role} engine {instance} failed", kind="server_error"))
                )


def _reason(value: str) -> Reason:
    """The `Reason` a decode engine's refusal names by its value (the decode rule's); a value this
    gateway does not know (a worker of another version) is DECODE_REJECTED."""
    try:
        return Reason(value)
    except ValueError:
        return Reason.DECODE_REJECTED
