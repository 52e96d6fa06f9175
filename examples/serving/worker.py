"""An engine worker: one prefill or decode engine with its node's cache and block service.

A worker owns a tiny world: the model, a `TieredCache` (DRAM pages in shared
memory, optionally an SSD tier), a `TransferEngine` listening on 127.0.0.1 and
the `Messenger` serving its blocks. The gateway drives it with control calls
over the same authenticated transport; the worker answers at once and does the
work on its own thread, reporting back with calls to the gateway:

    gateway → worker   worker.connect {gateway, peers}   worker.health   worker.stop
    gateway → prefill  prefill.submit {request_id, tokens, decode, fetch, max_tokens, temperature, seed}
    gateway → decode   decode.cancel {request_id}          (its client went away or timed out)
    prefill → decode   decode.join {request_id, keys, prompt_tokens, first_token, ...}
    prefill → gateway  prefill.started / prefill.done {prefix_tokens, computed_tokens, events} / prefill.failed
    decode  → gateway  decode.joined / decode.rejected {reason} / decode.failed {error}
                       / decode.tokens [[request_id, token, index, finished]…]

A prefill fetches the blocks the Conductor's transfer plan names from their
holder (keeping the copy), prefills layer-wise while streaming each layer's KV
to the chosen decode node, then hands the request to that node. Its cache
events travel with `prefill.done`, in order, so the gateway's index follows the
node's cache exactly.

A decode node joins a request by the decode rule (`DecodeEngine.try_join`, the
same `sched.join` rule the gateway's Conductor asks): a refusal is reported as
`decode.rejected` with the rule's reason (a `sched.outcome.Reason` value); a
request whose KV is missing or does not match its prompt is `decode.failed`.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from mooncake.cache import TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.pool import PagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.engine.config import PRESETS
from mooncake.engine.decode import DecodeConfig, DecodeEngine, TokenEvent
from mooncake.engine.kv import KvLayout
from mooncake.engine.model import LlamaModel
from mooncake.engine.prefill import MessengerSink, PrefillConfig, PrefillEngine
from mooncake.engine.sampling import SamplingParams
from mooncake.errors import MooncakeError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey, InstanceId, RequestId
from serving.config import ClusterConfig
from serving.models import cost_models
from serving.wire import event_to_wire

__all__ = ["Worker", "WorkerSpec", "run_worker"]

TIMEOUT_S = 30.0


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """What a worker process (or Ray actor) is started with; pickled to it, config and all."""

    role: str  # "prefill" or "decode"
    instance_id: str
    config: ClusterConfig
    secret: bytes


class Worker:
    """One engine node; `start()` returns how to reach it, `wait()` blocks until it is told to stop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        config = spec.config
        self.instance_id = InstanceId(spec.instance_id)
        torch.set_num_threads(1)  # many engines share this machine's cores
        self.model = LlamaModel(PRESETS[config.model.preset], seed=config.model.seed, dtype=config.model.dtype)
        block = config.model.block_tokens
        self.hasher = BlockHasher(model=config.model.preset, block_size_tokens=block)
        self.layout = KvLayout(config=self.model.config, block_tokens=block, dtype=config.model.dtype)
        self.engine = TransferEngine(
            # No polling for answers (spin_us=0): engines share the machine's cores, and polling threads
            # starve each other of the GIL (a layer's batch of small slices took ~0.5 ms a slice).
            secret=spec.secret,
            config=EngineConfig(transports=("tcp", "shm"), io_timeout_s=5.0, spin_us=0),
        )
        pool, region = shared_dram_pool(self.engine, self.layout.page_bytes, config.cache.dram_blocks)
        pools: list[PagePool] = [pool]
        self._ssd_dir: tempfile.TemporaryDirectory[str] | None = None
        if config.cache.ssd_blocks:
            folder = config.cache.ssd_dir
            if not folder:
                self._ssd_dir = tempfile.TemporaryDirectory(prefix="mooncake-ssd-")
                folder = self._ssd_dir.name
            path = Path(folder) / f"{spec.instance_id}.pool"
            pools.append(SsdPagePool(path, self.layout.page_bytes, config.cache.ssd_blocks))
        self.cache = TieredCache(pools, source=self.instance_id, epoch=time.time_ns())
        self.messenger = Messenger(self.engine, self.cache, region=region)
        self._jobs: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._peers: dict[str, str] = {}  # instance id → peer name (connected lazily)
        self._addresses: dict[str, str] = {}
        self._gateway: str | None = None
        self._prefill: PrefillEngine | None = None
        self._decode: DecodeEngine | None = None
        if spec.role == "prefill":
            self._prefill = PrefillEngine(
                self.model, self.cache, self.hasher, PrefillConfig(chunk_tokens=config.prefill.chunk_tokens)
            )
            loop = self._prefill_loop
        else:
            self._decode = DecodeEngine(
                self.model,
                self.cache,
                block_tokens=block,
                config=DecodeConfig(
                    max_batch_size=config.decode.max_batch_size,
                    max_context_tokens=config.decode.max_context_tokens,
                    tbt_slo_s=config.slo.tbt_s,
                ),
                step_model=cost_models(config)[1],  # the decode rule as the Conductor asks it
            )
            loop = self._decode_loop
        for method, handler in {
            "worker.connect": self._on_connect,
            "worker.health": self._on_health,
            "worker.stop": self._on_stop,
            "prefill.submit": self._on_job,
            "decode.join": self._on_job,
            "decode.cancel": self._on_cancel,
        }.items():
            self.engine.register_handler(method, handler)
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
        self._thread.join(timeout=10)
        for closer in (self.messenger.close, self.engine.close, self.cache.close):
            with contextlib.suppress(Exception):
                closer()
        if self._prefill is not None:
            self._prefill.close()
        if self._ssd_dir is not None:
            self._ssd_dir.cleanup()

    # ------------------------------------------------------------------ control calls (server threads)

    def _on_connect(self, args: dict[str, Any]) -> dict[str, Any]:
        self._addresses = dict(args["peers"])
        self._gateway = self.engine.connect(args["gateway"], transport="tcp")
        return {"ok": True}

    def _on_health(self, _args: Any) -> dict[str, Any]:
        active = self._decode.num_active if self._decode is not None else 0
        return {"ok": not self._stop.is_set(), "queued": self._jobs.qsize(), "active": active}

    def _on_stop(self, _args: Any) -> dict[str, Any]:
        self._stop.set()
        return {"ok": True}

    def _on_cancel(self, args: dict[str, Any]) -> dict[str, Any]:
        self._jobs.put({"cancel": args["request_id"]})  # applied by the decode loop, the engine's only user
        return {"queued": True}

    def _on_job(self, args: dict[str, Any]) -> dict[str, Any]:
        self._jobs.put(args)
        return {"queued": True}

    # ------------------------------------------------------------------ helpers

    def _peer(self, instance_id: str) -> str:
        if instance_id not in self._peers:
            self._peers[instance_id] = self.engine.connect(self._addresses[instance_id])
        return self._peers[instance_id]

    def _tell_gateway(self, method: str, args: dict[str, Any]) -> None:
        if self._gateway is not None:
            with contextlib.suppress(MooncakeError, OSError):  # a gateway gone is a cluster shutting down
                self.engine.call(self._gateway, method, args)

    def _guarded(self, loop: Any) -> None:
        try:
            loop()
        finally:
            self._stop.set()

    # ------------------------------------------------------------------ prefill

    def _prefill_loop(self) -> None:
        assert self._prefill is not None
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            request_id = job["request_id"]
            self._tell_gateway("prefill.started", {"request_id": request_id})
            try:
                done, join = self._run_prefill(job)
            except (MooncakeError, OSError, RuntimeError) as error:
                events = [event_to_wire(e) for e in self.cache.take_events()]
                self._tell_gateway("prefill.failed", {"request_id": request_id, "error": str(error), "events": events})
                continue
            done["events"] = [event_to_wire(e) for e in self.cache.take_events()]
            # Reported before the hand-off: the decode node's tokens (another connection) must not overtake it,
            # or a short request ends before the gateway learns its prefix hit.
            self._tell_gateway("prefill.done", done)
            try:
                self.engine.call(self._peer(job["decode"]), "decode.join", join)
            except (MooncakeError, OSError) as error:
                failed = {"request_id": request_id, "error": f"hand-off to {job['decode']}: {error}", "events": []}
                self._tell_gateway("prefill.failed", failed)

    def _run_prefill(self, job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fetch the planned prefix, prefill streaming the KV to the decode node; returns (stats, its join call)."""
        assert self._prefill is not None
        tokens: list[int] = job["tokens"]
        fetched = 0
        fetch = job.get("fetch")
        if fetch:  # the transfer plan: bring the prefix from its holder first, and keep the copy
            keys = self.hasher.block_keys(tokens)[: fetch["blocks"]]
            try:
                fetched = len(self.messenger.fetch(keys, self._peer(fetch["source"])).finish(TIMEOUT_S))
            except (MooncakeError, OSError, KeyError):
                fetched = 0  # the holder is gone or busy: compute the prefix instead
        sink = MessengerSink(self.messenger, self._peer(job["decode"]), num_layers=self.model.config.num_layers)
        sampling = SamplingParams(temperature=job["temperature"], seed=job["seed"])
        result = self._prefill.prefill(tokens, sampling=sampling, sink=sink)
        join = {
            "request_id": job["request_id"],
            "keys": [int(k) for k in result.keys],
            "prompt_tokens": len(tokens),
            "first_token": result.first_token,
            "max_tokens": job["max_tokens"],
            "temperature": job["temperature"],
            "seed": job["seed"],
        }
        done = {
            "request_id": job["request_id"],
            "prefix_tokens": result.prefix_tokens,
            "computed_tokens": result.computed_tokens,
            "fetched_blocks": fetched,
            "streamed_blocks": len(sink.committed),
        }
        return done, join

    # ------------------------------------------------------------------ decode

    def _decode_loop(self) -> None:
        decode = self._decode
        assert decode is not None
        while not self._stop.is_set():
            joins: list[dict[str, Any]] = []
            try:
                joins.append(self._jobs.get(timeout=0.0 if decode.num_active else 0.05))
                while True:
                    joins.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            tokens: list[TokenEvent] = []  # every token, the joins' first ones included, via on_token
            for job in joins:
                if "cancel" in job:
                    decode.cancel(RequestId(job["cancel"]))
                else:
                    self._join(job, tokens.append)
            if decode.num_active:
                for event in decode.step():
                    tokens.append(event)
            if tokens:
                wire = [[int(e.request_id), e.token, e.index, e.finished] for e in tokens]
                self._tell_gateway("decode.tokens", {"tokens": wire, "step_s": decode.last_step_s})

    def _join(self, job: dict[str, Any], first_token: Callable[[TokenEvent], None]) -> None:
        assert self._decode is not None
        request_id = RequestId(job["request_id"])
        try:
            joined = self._decode.try_join(
                request_id,
                [BlockKey(k) for k in job["keys"]],
                prompt_tokens=job["prompt_tokens"],
                first_token=job["first_token"],
                max_new_tokens=job["max_tokens"],
                sampling=SamplingParams(temperature=job["temperature"], seed=job["seed"]),
                on_token=None,
            )
        except MooncakeError as error:
            # Its KV is not here (evicted, or the stream failed) or does not match the prompt: a failure,
            # not the decode rule's decision.
            self._tell_gateway("decode.failed", {"request_id": request_id, "error": str(error)})
            return
        if not joined.accepted:
            assert joined.reason is not None
            self._tell_gateway("decode.rejected", {"request_id": request_id, "reason": joined.reason.value})
            return
        self._tell_gateway(
            "decode.joined",
            {"request_id": request_id, "context_tokens": job["prompt_tokens"], "output_tokens": job["max_tokens"]},
        )
        # The prefill's token is the request's first output token (the engine does not report it without on_token).
        first_token(
            TokenEvent(request_id=request_id, token=job["first_token"], index=0, finished=job["max_tokens"] == 1)
        )


def run_worker(spec: WorkerSpec, connection: Any) -> None:
    """A worker process's main: start, report how to reach it, serve until stopped (or SIGTERM/SIGINT)."""
    worker = Worker(spec)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    try:
        connection.send(worker.start())
        while not worker.wait(0.5):
            pass
    finally:
        worker.close()
