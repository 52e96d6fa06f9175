"""An engine worker: one prefill or decode engine with its node's cache and block service.

A worker owns a tiny world: the model, a `TieredCache` (DRAM pages in shared
memory, optionally an SSD tier in a file labelled and named for what its pages
mean: `ssd_label`, `ssd_file_name`), a `TransferEngine` listening on its spec's
host (127.0.0.1; on a multi-node Ray cluster its node's address) and
the `Messenger` serving its blocks. The gateway drives it with control calls
over the same authenticated transport, each carrying one `serving.wire`
message (a malformed one is refused back to its caller, naming it); the worker
answers at once and does the work on its own thread, reporting back with calls
to the gateway (`wire`'s module docstring lists them).

A prefill fetches the blocks the Conductor's transfer plan names from their
holder (keeping the copy), prefills layer-wise while streaming each layer's KV
to the chosen decode node, then hands the request to that node. Its cache
events travel with `prefill.done`, in order, so the gateway's index follows the
node's cache exactly. A `prefill.cancel` (the client left, or the gateway
rerouted the request) drops the job if it is still queued, and stops a running
one before its next chunk (`PrefillEngine`'s `cancelled`: nothing it computed
is kept, a prefix it fetched stays cached, its KV stream aborts, and `prefill.failed` carries its cache events to
a gateway that has forgotten the attempt), or, once computed, keeps it from
being handed on (a pipeline group's prefill stops at the same chunk boundary). When the decode node does not answer (a control call
of the KV stream or the hand-off timed out or found no connection, or the
stream's slices did not settle), `prefill.failed` names it
(`peer`): the failure is that node's, not this one's. With `[prefill] pipeline_size` X > 1 the worker is
stage 0 of a chunked pipeline group (`serving.prefill_group`): X − 1 stage
processes it starts hold the later layers, and the instance is still this one
worker to the gateway. A stage that exits stops the worker (its health answer
turns not ok, then it exits, ending the other stages); the stages exit when the
worker does, however it dies.

A decode node joins a request by the decode rule (`DecodeEngine.try_join`, the
same `sched.join` rule the gateway's Conductor asks): a refusal is reported as
`decode.rejected` with the rule's reason (a `sched.outcome.Reason` value); a
request whose KV is missing or does not match its prompt is `decode.failed`, and
so is one whose token draw fails in a step (its sampling params leave no token,
its logits are NaN): the engine drops it alone, the others' tokens of that step
are reported, and the batch decodes on.
It holds one attempt of a request at a time: a hand-off of a later attempt
replaces the one it holds, a hand-off of an earlier one (from a prefill engine
that was presumed dead and resumed) is dropped, and so, for `TIMEOUT_S`, is one
of an attempt that ended here or of a request cancelled before its hand-off came
(its client left after the prefill's last check: `_EndedAttempts`). A hand-off
some of whose blocks another prefill's push is still filling here (requests sharing a prefix, sent
at once: each push fills only the blocks no other is filling) waits for them,
at most `TIMEOUT_S`, pinning the blocks already there, without holding up the
batch; blocks that push gave up on are then missing, a KV refusal as
for any block that did not stay, and so is a wait that runs out (that push's
reservation still holds the memory). Its health answer lists the
requests it decodes, so the gateway can cancel those it no longer serves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import attrs
import torch
import xxhash

from mooncake.cache import TieredCache
from mooncake.cache.pool import PagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cli import one_line
from mooncake.engine.checkpoint import load_model
from mooncake.engine.config import PRESETS
from mooncake.engine.decode import DecodeConfig, DecodeEngine, TokenEvent
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import MessengerSink, PrefillConfig, PrefillEngine
from mooncake.engine.sampling import SamplingParams
from mooncake.errors import (
    Cancelled,
    ConfigError,
    MooncakeError,
    PeerUnavailable,
    TransferTimeout,
    UnknownBlockError,
)
from mooncake.sched.outcome import Reason
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey, InstanceId, RequestId, Tier
from serving import wire
from serving.config import ClusterConfig
from serving.models import cost_models, decode_limits
from serving.prefill_group import group_prefill_engine, start_group
from serving.reporter import Reporter

__all__ = ["Worker", "WorkerSpec", "build_model", "run_worker", "ssd_file_name", "ssd_label", "start_failure"]

TIMEOUT_S = 30.0
MAX_ENDED = 65_536  # requests a decode node remembers it is done with (for TIMEOUT_S at most): `_EndedAttempts`
LOG = logging.getLogger("serving.worker")


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """What a worker process (or Ray actor) is started with; pickled to it, config and all."""

    role: str  # "prefill" or "decode"
    instance_id: str
    config: ClusterConfig
    secret: bytes
    host: str = "127.0.0.1"  # where its transfer engine listens: the address its peers and the gateway reach


Job = wire.PrefillJob | wire.DecodeJob | wire.CancelDecode

# What a peer that does not answer raises: a timeout, or a connection refused, reset or timed out.
_UNREACHABLE = (PeerUnavailable, TransferTimeout, OSError)


@attrs.define(eq=False)
class _Arriving:
    """A hand-off waiting for blocks another push is filling: until when, and the blocks it pinned meanwhile."""

    job: wire.DecodeJob
    deadline: float
    pinned: set[BlockKey] = attrs.field(factory=set)


EVERY_ATTEMPT = sys.maxsize


@attrs.define(eq=False)
class _EndedAttempts:
    """The attempts of requests a decode node is done with, lately: a hand-off of one that comes late is dropped,
    not decoded for nobody until a health probe cancels it.

    A request's entry is the latest attempt of it that must not join here, and when that was noted: one that ended
    here (finished, or replaced by a later attempt) or was cancelled while held or waiting for blocks. A
    `decode.cancel` that finds nothing of the request here makes every attempt of it ended, unless the request has
    an entry already: the message names no attempt, and the gateway cancels a request it still serves elsewhere
    only when this node listed it as held (its health answer), which leaves an entry; so such a cancel is the
    gateway ending the request (its client left, a stop string) before the prefill's hand-off came, and no attempt
    of it is ever sent again. Entries are forgotten after `keep_s`, and the oldest beyond `max_entries`: a hand-off
    later than that joins, and the next health probe cancels it.

    Invariants: entries are in the order they were noted, times not decreasing; at most `max_entries` of them.
    """

    keep_s: float
    max_entries: int
    _entries: OrderedDict[RequestId, tuple[int, float]] = attrs.field(init=False, factory=OrderedDict)

    def end(self, request_id: RequestId, attempt: int, now: float) -> None:
        """No attempt of `request_id` up to `attempt` may join from now on."""
        latest = max(attempt, self._entries.pop(request_id, (attempt, now))[0])
        self._entries[request_id] = (latest, now)
        self._forget(now)

    def cancel(self, request_id: RequestId, held: int | None, now: float, *, every_attempt: bool = False) -> None:
        """`decode.cancel` of `request_id`, of which this node held (or awaited the blocks of) attempt `held`;
        `every_attempt`: the gateway ended the request, so no attempt of it joins from now on (one held here, or an
        earlier one's entry, would otherwise let a later attempt's hand-off join and decode for nobody)."""
        if every_attempt:
            self.end(request_id, EVERY_ATTEMPT, now)
        elif held is not None:
            self.end(request_id, held, now)
        elif request_id not in self._entries:
            self.end(request_id, EVERY_ATTEMPT, now)

    def has_ended(self, request_id: RequestId, attempt: int, now: float) -> bool:
        self._forget(now)
        entry = self._entries.get(request_id)
        return entry is not None and attempt <= entry[0]

    def _forget(self, now: float) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries or next(iter(self._entries.values()))[1] < now - self.keep_s
        ):
            self._entries.popitem(last=False)

    def check_invariants(self) -> None:
        times = [when for _attempt, when in self._entries.values()]
        assert times == sorted(times), "entries out of the order they were noted"
        assert len(self._entries) <= self.max_entries, "more entries than the bound"


class _DecodeStream(MessengerSink):
    """The prefill's KV stream to its decode node, noting whether a failure was that node not answering
    (`unreachable`) rather than this prefill's own."""

    unreachable = False

    def _guard(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except _UNREACHABLE:
            self.unreachable = True
            raise

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        self._guard(super().begin, keys)

    def layer_ready(self, layer: int) -> None:
        self._guard(super().layer_ready, layer)

    def end(self) -> None:
        self._guard(super().end)


def build_model(config: ClusterConfig) -> LlamaModel:
    """The served model in `[model] dtype`: the checkpoint's weights (`load_model`), or the preset's seeded ones.

    Raises:
        ConfigError: the checkpoint's weights cannot be loaded (a missing tensor, a shape, a corrupt shard).
    """
    model = config.model
    if model.checkpoint is not None:
        return load_model(model.checkpoint, dtype=model.dtype)
    return LlamaModel(PRESETS[model.preset], seed=model.seed, dtype=model.dtype)


def ssd_label(config: ClusterConfig, layout: KvLayout) -> str:
    """What the pages of a node's SSD pool mean (`SsdPagePool`'s label): the block keys' namespace (the model, its
    weights and the dtype: `ModelSection.namespace`), the block size and the KV page layout. A key names tokens,
    not the bytes their KV takes, so a pool file written under another label must never be adopted."""
    model = layout.config
    return (
        f"{config.model.namespace} {layout.block_tokens}-token blocks of KV [{model.num_layers} layers][K, V]"
        f"[tokens][{model.num_kv_heads} heads][{model.head_dim}] {layout.dtype}"
    )


def ssd_file_name(instance_id: str, label: str) -> str:
    """A node's SSD pool file in `[cache] ssd_dir`: `<instance>-<xxh3 of the label, 16 hex digits>.pool`. A cluster
    restarted with the same config reopens its pages; one with another model, dtype or block size gets files of its
    own (as vLLM keys its offload folders by model, dtype and parallel config) instead of failing to start on the
    old ones, which stay until deleted; the label in the file is the guard against a collision of the names."""
    return f"{instance_id}-{xxhash.xxh3_64_intdigest(label.encode()):016x}.pool"


class Worker:
    """One engine node; `start()` returns how to reach it, `wait()` blocks until it is told to stop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        config = spec.config
        self.instance_id = InstanceId(spec.instance_id)
        torch.set_num_threads(1)  # many engines share this machine's cores
        self._stop = threading.Event()  # before the pipeline group: a stage that dies sets it
        self._group = self._start_group() if spec.role == "prefill" and config.prefill.pipeline_size > 1 else None
        if self._group is not None:
            self.model = self._group.model  # stage 0's layers; the group's other stages hold the rest
        else:
            self.model = build_model(config)
        block = config.model.block_tokens
        self.hasher = config.model.hasher()
        self.layout = KvLayout(config=self.model.config, block_tokens=block, dtype=config.model.dtype)
        self.engine = TransferEngine(
            # No polling for answers (spin_us=0): engines share the machine's cores, and polling threads
            # starve each other of the GIL (a layer's batch of small slices took ~0.5 ms a slice).
            secret=spec.secret,
            config=EngineConfig(transports=("tcp", "shm"), io_timeout_s=5.0, spin_us=0, host=spec.host),
        )
        pool, region = shared_dram_pool(self.engine, self.layout.page_bytes, config.cache.dram_blocks)
        pools: list[PagePool] = [pool]
        self._ssd_dir: tempfile.TemporaryDirectory[str] | None = None
        if config.cache.ssd_blocks:
            folder = config.cache.ssd_dir
            if not folder:
                # Named with our pid: a launcher removes it if we are killed before we can (`launch.SSD_FOLDER_NAME`).
                self._ssd_dir = tempfile.TemporaryDirectory(prefix=f"mooncake-ssd-{os.getpid()}-")
                folder = self._ssd_dir.name
            label = ssd_label(config, self.layout)
            path = Path(folder) / ssd_file_name(spec.instance_id, label)
            pools.append(SsdPagePool(path, self.layout.page_bytes, config.cache.ssd_blocks, label=label))
        self.cache = TieredCache(pools, source=self.instance_id, epoch=time.time_ns())
        self.messenger = Messenger(self.engine, self.cache, region=region)
        self._jobs: queue.Queue[Job] = queue.Queue()
        # The prefill attempts queued or running here → whether the gateway cancelled them (server threads set it).
        self._prefill_jobs: dict[tuple[int, int], bool] = {}
        self._prefill_lock = threading.Lock()
        self._peers: dict[str, str] = {}  # instance id → peer name (connected lazily)
        self._addresses: dict[str, str] = {}
        self._gateway: str | None = None
        self._prefill: PrefillEngine | None = None
        self._decode: DecodeEngine | None = None
        self._attempts: dict[RequestId, int] = {}  # the decode batch's requests → the attempt held (decode loop only)
        self._stepped: list[TokenEvent] = []  # the tokens the decode engine called back (decode loop only)
        # Hand-offs waiting for blocks another push is filling here (decode loop only)
        self._arriving: dict[RequestId, _Arriving] = {}
        self._ended = _EndedAttempts(keep_s=TIMEOUT_S, max_entries=MAX_ENDED)  # (decode loop only)
        self._active: tuple[int, ...] = ()  # a snapshot of _attempts' keys for the health answer (another thread)
        self._generated = 0
        self._decode_kv_usage = 0.0  # the decode batch's share of its KV budget, set by the decode loop
        if spec.role == "prefill" and self._group is not None:
            self._prefill = group_prefill_engine(self._group, self.cache, self.hasher)
            loop = self._prefill_loop
        elif spec.role == "prefill":
            self._prefill = PrefillEngine(
                self.model, self.cache, self.hasher, PrefillConfig(chunk_tokens=config.prefill.chunk_tokens)
            )
            loop = self._prefill_loop
        else:
            limits = decode_limits(config)
            assert limits.max_batch_size is not None and limits.max_context_tokens is not None
            self._decode = DecodeEngine(
                self.model,
                self.cache,
                block_tokens=block,
                config=DecodeConfig(  # the limits the Conductor checks this engine against, by construction
                    max_batch_size=limits.max_batch_size,
                    max_context_tokens=limits.max_context_tokens,
                    kv_budget_tokens=limits.kv_capacity_tokens,
                    tbt_slo_s=config.objectives().tbt_s,  # the Conductor's objective: one number, both checks
                ),
                step_model=cost_models(config)[1],  # the decode rule as the Conductor asks it
            )
            loop = self._decode_loop
        served: dict[type[Any], Callable[[Any], wire.Message | None]] = {
            wire.Connect: self._on_connect,
            wire.HealthCheck: self._on_health,
            wire.Stop: self._on_stop,
            wire.Announce: self._on_announce,
            wire.PeerGone: self._on_peer_gone,
            wire.PrefillJob: self._on_job,
            wire.CancelPrefill: self._on_cancel_prefill,
            wire.DecodeJob: self._on_job,
            wire.CancelDecode: self._on_job,  # applied by the decode loop, the engine's only user
        }
        for method, handler in wire.handlers(served).items():
            self.engine.register_handler(method, handler)
        self._reporter = Reporter(self._deliver, name=f"{spec.role}-reports")
        self._thread = threading.Thread(target=self._guarded, args=(loop,), name=f"{spec.role}-loop", daemon=True)

    def start(self) -> dict[str, Any]:
        self._thread.start()
        shm = [d.shm_name for d in self.engine.regions() if getattr(d, "shm_name", None)]
        return {
            "instance_id": self.spec.instance_id,
            "role": self.spec.role,
            "address": self.engine.address,
            "shm": shm,
        }

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)
        self._reporter.close()
        for closer in (self.messenger.close, self.engine.close, self.cache.close):
            with contextlib.suppress(Exception):
                closer()
        if self._prefill is not None:
            self._prefill.close()
        if self._group is not None:
            self._group.close()  # its stage processes: asked to stop, then killed
        if self._ssd_dir is not None:
            self._ssd_dir.cleanup()

    # ------------------------------------------------------------------ control calls (server threads)

    def _on_connect(self, message: wire.Connect) -> None:
        self._addresses = dict(message.peers)
        self._gateway = self.engine.connect(message.gateway, transport="tcp")

    def _on_health(self, _message: wire.HealthCheck) -> wire.Health:
        return wire.Health(
            ok=not self._stop.is_set(),
            pid=os.getpid(),
            queued=self._jobs.qsize(),
            active=self._active,
            generated_tokens=self._generated,
            kv_usage=self._kv_usage(),
        )

    def _kv_usage(self) -> float:
        """The share of this engine's KV memory in use: a decode engine's KV budget its batch reserves (as the
        decode rule counts it), a prefill engine's cache pages in DRAM that hold blocks."""
        if self._decode is not None:
            return self._decode_kv_usage
        return self.cache.used_bytes(Tier.DRAM) / max(1, self.cache.capacity_bytes(Tier.DRAM))

    def _on_stop(self, _message: wire.Stop) -> None:
        self._stop.set()

    def _on_announce(self, _message: wire.Announce) -> None:
        # A new epoch above every one used (the cache's starts at its start time in ns), announcing all it holds:
        # the gateway's index takes an epoch's first event whatever it knew of us, so its gap is mended.
        self.cache.announce_all(max(self.cache.epoch + 1, time.time_ns()))

    def _on_peer_gone(self, message: wire.PeerGone) -> None:
        self.messenger.release_owner(message.address)

    def _on_job(self, message: Job) -> None:
        if isinstance(message, wire.PrefillJob):
            with self._prefill_lock:
                self._prefill_jobs[message.request_id, message.attempt] = False
        self._jobs.put(message)

    def _on_cancel_prefill(self, message: wire.CancelPrefill) -> None:
        with self._prefill_lock:
            key = (message.request_id, message.attempt)
            if key in self._prefill_jobs:  # else done already, or never sent: nothing to stop
                self._prefill_jobs[key] = True

    def _cancel_asked(self, key: tuple[int, int]) -> bool:
        """Whether the gateway has cancelled this prefill attempt (the engine asks before each chunk)."""
        with self._prefill_lock:
            return self._prefill_jobs.get(key, False)

    def _cancelled(self, key: tuple[int, int], *, leaving: bool) -> bool:
        """Whether the gateway cancelled this prefill attempt; one cancelled, or `leaving` (the worker is done with
        it), is forgotten."""
        with self._prefill_lock:
            cancelled = self._prefill_jobs.get(key, False)
            if cancelled or leaving:
                self._prefill_jobs.pop(key, None)
            return cancelled

    # ------------------------------------------------------------------ helpers

    def _peer(self, instance_id: str) -> str:
        if instance_id not in self._peers:
            address = self._addresses.get(instance_id)
            if address is None:  # the gateway's mistake, not the node's (no probe, no reroute); the worker goes on
                raise ConfigError(f"no address for {instance_id}: the gateway's connect did not name it")
            self._peers[instance_id] = self.engine.connect(address)
        return self._peers[instance_id]

    def _tell_gateway(self, message: wire.Message) -> None:
        """Report to the gateway without waiting for it (in order, by the reporter's thread)."""
        self._reporter.send(message)

    def _deliver(self, message: wire.Message) -> None:
        if self._gateway is not None:  # not connected yet: nothing was asked of this worker
            self.engine.call(self._gateway, *wire.encode(message))

    def _guarded(self, loop: Any) -> None:
        try:
            loop()
        finally:
            self._stop.set()

    # ------------------------------------------------------------------ prefill

    def _start_group(self) -> PipelineGroup:
        """This worker as stage 0 of a chunked pipeline group of `[prefill] pipeline_size` processes."""
        config = self.spec.config
        return start_group(
            config, timeout_s=max(TIMEOUT_S, config.limits.request_timeout_s), on_failure=self._group_failed
        )

    def _group_failed(self, reason: str) -> None:
        """A stage died or stopped answering: this instance cannot prefill any more, so it answers not ok and exits."""
        print(f"{self.spec.instance_id}: pipeline {reason}; stopping", file=sys.stderr, flush=True)
        self._stop.set()

    def _prefill_loop(self) -> None:
        assert self._prefill is not None
        me = self.spec.instance_id
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if not isinstance(job, wire.PrefillJob):
                continue  # a decode message sent to a prefill node: nothing of it concerns this engine
            key = (job.request_id, job.attempt)
            if self._cancelled(key, leaving=False):
                continue  # its client left or it was rerouted: the gateway has forgotten this attempt
            ids: dict[str, Any] = {"instance_id": me, "request_id": job.request_id, "attempt": job.attempt}
            self._tell_gateway(wire.PrefillStarted(**ids))
            sink: _DecodeStream | None = None
            try:
                sink = _DecodeStream(self.messenger, self._peer(job.decode), num_layers=self.model.config.num_layers)
                done, join = self._run_prefill(job, sink)
            except Cancelled as error:  # its client left while it ran: stopped, nothing kept
                self._cancelled(key, leaving=True)
                self._tell_gateway(wire.PrefillFailed(**ids, error=str(error), peer="", events=self._events()))
                continue
            except (MooncakeError, OSError, RuntimeError) as error:
                self._cancelled(key, leaving=True)
                if self._group is not None and self._group.failure is not None:
                    # The instance is dead, as if its worker had been killed: no report, so the gateway marks it
                    # down and schedules the request again (a failure report would end it with a 500).
                    break
                # Not reached: connecting to the decode node failed (no sink yet), or its KV stream did.
                unreachable = isinstance(error, _UNREACHABLE) if sink is None else sink.unreachable
                peer = job.decode if unreachable else ""
                self._tell_gateway(wire.PrefillFailed(**ids, error=str(error), peer=peer, events=self._events()))
                continue
            # Delivered before the hand-off: the decode node's tokens (another connection) must not overtake it,
            # or a short request ends before the gateway learns its prefix hit.
            self._tell_gateway(attrs.evolve(done, events=self._events()))
            self._reporter.flush(TIMEOUT_S)
            if self._cancelled(key, leaving=True):
                continue  # cancelled while it ran: its KV stays cached here, and what it streamed, there
            try:
                self.engine.call(self._peer(job.decode), *wire.encode(join))
            except (MooncakeError, OSError) as error:
                peer = job.decode if isinstance(error, _UNREACHABLE) else ""
                failed = wire.PrefillFailed(**ids, error=f"hand-off to {job.decode}: {error}", peer=peer, events=())
                self._tell_gateway(failed)

    def _events(self) -> tuple[Any, ...]:
        return tuple(self.cache.take_events())

    def _run_prefill(self, job: wire.PrefillJob, sink: MessengerSink) -> tuple[wire.PrefillDone, wire.DecodeJob]:
        """Fetch the planned prefix, prefill streaming the KV to the decode node through `sink`; returns (stats, its
        join call)."""
        assert self._prefill is not None
        tokens = list(job.tokens)
        fetched = 0
        if job.fetch is not None:  # the transfer plan: bring the prefix from its holder first, and keep the copy
            keys = self.hasher.salted(job.cache_salt).block_keys(tokens)[: job.fetch.blocks]
            try:
                fetched = len(self.messenger.fetch(keys, self._peer(job.fetch.source)).finish(TIMEOUT_S))
            except (MooncakeError, OSError):
                fetched = 0  # the holder is gone or busy: compute the prefix instead
        sampling = _sampling_params(job.sampling)
        key = (job.request_id, job.attempt)
        result = self._prefill.prefill(
            tokens, sampling=sampling, sink=sink, cancelled=lambda: self._cancel_asked(key), cache_salt=job.cache_salt
        )
        join = wire.DecodeJob(
            request_id=job.request_id,
            attempt=job.attempt,
            keys=tuple(int(k) for k in result.keys),
            prompt_tokens=len(tokens),
            first_token=result.first_token,
            sampling=job.sampling,
            first_logprobs=result.first_logprobs,
            prompt_ids=tuple(tokens) if sampling.needs_prompt else (),
        )
        done = wire.PrefillDone(
            instance_id=self.spec.instance_id,
            request_id=job.request_id,
            attempt=job.attempt,
            prefix_tokens=result.prefix_tokens,
            computed_tokens=result.computed_tokens,
            fetched_blocks=fetched,
            streamed_blocks=len(sink.committed),
            events=(),
            prompt_logprobs=result.prompt_logprobs,
        )
        return done, join

    # ------------------------------------------------------------------ decode

    def _decode_loop(self) -> None:
        decode = self._decode
        assert decode is not None
        while not self._stop.is_set():
            jobs: list[Job] = []
            idle_s = 0.005 if self._arriving else 0.05  # a waiting hand-off is checked again soon
            try:
                jobs.append(self._jobs.get(timeout=0.0 if decode.num_active else idle_s))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            first: list[wire.Token] = []  # the joins' first tokens (the prefills'): reported before the step
            for job in jobs:
                if isinstance(job, wire.CancelDecode):
                    cancelled = RequestId(job.request_id)  # type: ignore[arg-type]
                    self._ended.cancel(
                        cancelled, self._held_attempt(cancelled), time.monotonic(), every_attempt=job.every_attempt
                    )
                    self._stop_waiting(cancelled)
                    decode.cancel(cancelled)
                    self._attempts.pop(cancelled, None)
                elif isinstance(job, wire.DecodeJob):
                    request_id = RequestId(job.request_id)  # type: ignore[arg-type]
                    if self._ended.has_ended(request_id, job.attempt, time.monotonic()):
                        continue  # a late hand-off: its request was cancelled, or this attempt ended here
                    waiting = self._arriving.get(request_id)
                    if waiting is None or waiting.job.attempt < job.attempt:  # else a stale hand-off
                        self._stop_waiting(request_id)
                        self._arriving[request_id] = _Arriving(job, time.monotonic() + TIMEOUT_S)
            self._join_arrived(first.append)
            # Nobody indexes a decode node's cache (the gateway announces prefill workers only): its change log,
            # one entry per block the prefills push here, is dropped each round instead of growing for ever.
            self.cache.take_events()
            # Before the first tokens go out: a health answer must count what joined (a client that has its first
            # token, then leaves, would otherwise find the engine idle while the step runs).
            self._publish_health(decode)
            self._report(first)  # not held back by a step: its client's TTFT would carry one
            tokens, failed = self._step(decode) if decode.num_active else ([], [])
            self._publish_health(decode)
            self._report(tokens)
            for message in failed:
                self._tell_gateway(message)

    def _step(self, decode: DecodeEngine) -> tuple[list[wire.Token], list[wire.DecodeFailed]]:
        """One decode step: its tokens, and the failure reports of the requests it dropped.

        The tokens are those the engine called back (`on_token`), not `step`'s answer: a step where one request's
        draw fails (params that leave no token, its NaN logits) raises, once the others took and were called back
        with their tokens, and those tokens must still reach their clients. Every request the step dropped, the
        one its error names (`MooncakeError.request_id`) and any other whose draw failed too (the step raises only
        the first), ends here as failed; the batch decodes on. Any other error (the engine's own, naming no one
        request: its state is in doubt) ends the loop, and so the worker, as before: the gateway finds it down.
        """
        self._stepped.clear()  # the joins' first tokens, reported by `_join` with their attempts
        failure: MooncakeError | None = None
        try:
            decode.step()
        except MooncakeError as error:
            if error.request_id is None:
                raise
            failure = error
        tokens = [self._token(event) for event in self._stepped]
        self._stepped.clear()
        if failure is None:
            return tokens, []
        failed: list[wire.DecodeFailed] = []
        now = time.monotonic()
        decoding = set(decode.active_ids)
        for request_id in [r for r in self._attempts if r not in decoding]:  # neither finished nor decoding: dropped
            attempt = self._attempts.pop(request_id)
            self._ended.end(request_id, attempt, now)
            reason = str(failure)
            if request_id != failure.request_id:
                reason = f"request {request_id}: its token draw failed in the step that raised {reason}"
            LOG.warning("decode failed: %s", reason)
            failed.append(
                wire.DecodeFailed(
                    instance_id=self.spec.instance_id, request_id=int(request_id), attempt=attempt, error=reason
                )
            )
        return tokens, failed

    def _held_attempt(self, request_id: RequestId) -> int | None:
        """The latest attempt of the request this node decodes or awaits the blocks of, if any."""
        arriving = self._arriving.get(request_id)
        held = (self._attempts.get(request_id), arriving.job.attempt if arriving is not None else None)
        return max((attempt for attempt in held if attempt is not None), default=None)

    def _publish_health(self, decode: DecodeEngine) -> None:
        """The batch and KV a health answer gives (read on another thread): snapshots of the decode loop's."""
        self._active = tuple(int(r) for r in self._attempts)
        self._decode_kv_usage = decode.reserved_tokens / max(1, decode.config.budget_tokens)

    def _report(self, tokens: list[wire.Token]) -> None:
        """Tell the gateway of `tokens` (nothing when there are none), stamped with this step's end on this
        process's monotonic clock: the gateway times them by it, however late (or merged with the next steps'
        by the reporter) the report reaches it."""
        if not tokens:
            return
        assert self._decode is not None
        self._generated += len(tokens)
        at_s = time.monotonic()
        # Built anew rather than `attrs.evolve`d: a third of the time, for a batch's tokens every step.
        stamped = tuple(
            wire.Token(t.request_id, t.attempt, t.token, t.index, t.finished, t.logprobs, at_s) for t in tokens
        )
        self._tell_gateway(wire.DecodeTokens(instance_id=self.spec.instance_id, tokens=stamped))

    def _token(self, event: TokenEvent) -> wire.Token:
        if event.finished:
            attempt = self._attempts.pop(event.request_id, 0)
            self._ended.end(event.request_id, attempt, time.monotonic())
        else:
            attempt = self._attempts.get(event.request_id, 0)
        return wire.Token(int(event.request_id), attempt, event.token, event.index, event.finished, event.logprobs)

    def _join_arrived(self, first_token: Callable[[wire.Token], None]) -> None:
        """Join the hand-offs, in their order of arrival, except those still waiting for blocks another push is
        filling here; one that waited `TIMEOUT_S` for them is refused for KV (their push neither committed nor
        gave up, and holds that memory)."""
        now = time.monotonic()
        for request_id, arriving in list(self._arriving.items()):
            job, filling, ready = arriving.job, [], []
            for k in job.keys:
                where = self.cache.location(BlockKey(k))
                if where is not None:
                    (ready if where.ready else filling).append(BlockKey(k))
            if filling and now < arriving.deadline:
                # What is here stays while it waits (a burst of pushes evicts), a block landed since it began to
                # wait included: one push may commit while another still fills.
                for key in ready:
                    if key not in arriving.pinned:
                        with contextlib.suppress(UnknownBlockError):  # left since: the join finds it missing
                            self.cache.pin(key)
                            arriving.pinned.add(key)
                continue
            self._stop_waiting(request_id)
            if filling:
                # The push filling them neither committed nor gave up (its prefill engine stopped, say): its
                # reservation holds that memory, so this node cannot take the request's KV: refused for KV, as
                # when the blocks are missing (a 429 the client may retry), not failed (a 500).
                LOG.warning(
                    "request %s: %d KV blocks of its prompt were still being pushed here by another prefill after "
                    "%g s: refused for KV",
                    job.request_id,
                    len(filling),
                    TIMEOUT_S,
                )
                self._tell_gateway(
                    wire.DecodeRejected(
                        instance_id=self.spec.instance_id,
                        request_id=job.request_id,
                        attempt=job.attempt,
                        reason=Reason.KV_BUDGET.value,
                    )
                )
            else:
                self._join(job, first_token)

    def _stop_waiting(self, request_id: RequestId) -> None:
        """Forget the request's waiting hand-off, if any, and let go of the blocks it pinned."""
        arriving = self._arriving.pop(request_id, None)
        if arriving is not None:
            for key in arriving.pinned:
                with contextlib.suppress(UnknownBlockError):
                    self.cache.unpin(key)

    def _join(self, job: wire.DecodeJob, first_token: Callable[[wire.Token], None]) -> None:
        assert self._decode is not None
        request_id = RequestId(job.request_id)  # type: ignore[arg-type]
        ids: dict[str, Any] = {
            "instance_id": self.spec.instance_id,
            "request_id": job.request_id,
            "attempt": job.attempt,
        }
        held = self._attempts.get(request_id)
        if held is not None:
            if job.attempt <= held:
                return  # a stale hand-off (its prefill engine was presumed dead): the later attempt decodes
            self._decode.cancel(request_id)
            del self._attempts[request_id]
            self._ended.end(request_id, held, time.monotonic())
        try:
            joined = self._decode.try_join(
                request_id,
                [BlockKey(k) for k in job.keys],
                prompt_tokens=job.prompt_tokens,
                first_token=job.first_token,
                max_new_tokens=job.sampling.max_tokens,
                sampling=_sampling_params(job.sampling),
                on_token=self._stepped.append,  # the first token's call is dropped: the one below reports it
                prompt=job.prompt_ids or None,
            )
        except MooncakeError as error:
            if isinstance(error, UnknownBlockError) and not all(BlockKey(k) in self.cache for k in job.keys):
                # Its KV did not stay here until the join (no room for it, or evicted since): the decode
                # node's memory refused it, as the decode rule's KV budget would have.
                self._tell_gateway(wire.DecodeRejected(**ids, reason=Reason.KV_BUDGET.value))
                return
            # The stream failed verification or does not match the prompt: a failure, not a refusal.
            self._tell_gateway(wire.DecodeFailed(**ids, error=str(error)))
            return
        if not joined.accepted:
            assert joined.reason is not None
            self._tell_gateway(wire.DecodeRejected(**ids, reason=joined.reason.value))
            return
        self._tell_gateway(
            wire.DecodeJoined(**ids, context_tokens=job.prompt_tokens, output_tokens=job.sampling.max_tokens)
        )
        # The engine's own answer to "did the first token end it" (max_tokens 1, or a stop token): not a second rule.
        decoding = request_id in self._decode.active_ids
        if decoding:
            self._attempts[request_id] = job.attempt
        else:
            self._ended.end(request_id, job.attempt, time.monotonic())
        # The prefill's token is the request's first output token, reported with its attempt.
        first_token(wire.Token(job.request_id, job.attempt, job.first_token, 0, not decoding, job.first_logprobs))


def _sampling_params(sampling: wire.Sampling) -> SamplingParams:
    """The engines' sampling options for a job's, field by field: each wire field but `max_tokens` (the decode
    engine's `max_new_tokens`) is the `SamplingParams` field of its name (`stop_ids` is `stop_token_ids`: they
    end the generation in the decode engine)."""
    fields = {f.name: getattr(sampling, f.name) for f in attrs.fields(wire.Sampling) if f.name != "max_tokens"}
    fields["stop_token_ids"] = fields.pop("stop_ids")
    return SamplingParams(**fields)


def run_worker(spec: WorkerSpec, connection: Any) -> None:
    """A worker process's main: start, report how to reach it, serve until stopped (SIGTERM).

    A start that fails reports `start_failure` on `connection` instead, and the process exits with status 1: the
    launcher's error names the worker and why (a truncated shard's `ConfigError`, the failed pipeline stage's
    `EngineError`), where an end of the pipe alone would say only that it died.

    SIGINT is ignored, from before the worker starts its pipeline stages, which inherit that (an ignored signal
    stays ignored across their spawn): a terminal's Ctrl-C reaches every process of its foreground group, and only
    the launcher may act on it, stopping the gateway (requests in flight end first) before the workers.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(spec)
    except Exception as error:
        _failed_to_start(spec, error, connection)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        try:
            info = worker.start()
        except Exception as error:
            _failed_to_start(spec, error, connection)
        connection.send(info)
        while not worker.wait(0.5):
            pass
    finally:
        worker.close()


def _failed_to_start(spec: WorkerSpec, error: Exception, connection: Any) -> NoReturn:
    """Send `start_failure` on the start pipe (the launcher's error then says why), and exit with status 1."""
    with contextlib.suppress(OSError, ValueError):  # the launcher has gone, or closed its end
        connection.send(start_failure(spec.instance_id, error))
    sys.exit(1)


def start_failure(instance_id: str, error: Exception) -> dict[str, str]:
    """What a worker that failed to start sends back instead of how to reach it: its id and `error` in one line
    (a `MooncakeError`'s message, which names what is wrong; another's type too). The error is logged here: a
    `MooncakeError` (a bad checkpoint, a pipeline stage that failed) in that line, another with its traceback."""
    expected = isinstance(error, MooncakeError)
    reason = one_line(str(error) if expected else f"{type(error).__name__}: {error}")
    LOG.error("worker %s failed to start: %s", instance_id, reason, exc_info=None if expected else error)
    return {"instance_id": instance_id, "error": reason}
