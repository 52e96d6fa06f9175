"""The coupled baseline: vLLM-style instances that prefill and decode on the same GPUs.

Each instance runs iterations back to back over one `ContinuousBatch`, with
prefix caching in its own HBM only (a metadata-only `TieredCache` of the KV
tokens its HBM holds, LRU, prefix-aware), and requests are spread over the
instances by least outstanding requests (ties: the lowest index), as a load
balancer in front of vLLM replicas does. No request is rejected, except one
whose KV could never fit an instance.

An iteration, at a step boundary, is chosen as vLLM's scheduler does:

- without chunked prefill, a waiting request whose KV fits is prefilled
  alone, and the whole batch stalls for it (prefill first); otherwise the
  batch decodes, a stretch at a time between membership changes, until a new
  request arrives (it is taken at the next step boundary);
- with chunked prefill (Sarathi style), every iteration carries one decode
  token per running request plus a chunk of the prefill in progress that fills
  the rest of the `token_budget`, and takes the decode step's time plus the
  chunk's prefill time (the chunk attends to everything before it).

Times come from the same cost models as the disaggregated simulator, so the
two are compared on equal terms.
"""

from __future__ import annotations

from collections import deque

import attrs

from mooncake.cache.policy import LruPolicy
from mooncake.cache.pool import MetadataPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import ConfigError
from mooncake.sched.cost import DecodeCostModel, Hardware, ModelShape, PrefillCostModel
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.sim.metrics import Outcome, RequestRecord, top_mean
from mooncake.sim.replayer import Replayer
from mooncake.types import InstanceId, Request, Slo, Tier

__all__ = ["CoupledCluster", "CoupledSpec"]


@attrs.frozen(kw_only=True)
class CoupledSpec:
    """A cluster of coupled (prefill-and-decode) instances.

    Attributes:
        num_instances: instances, each `hardware`.
        block_size_tokens: tokens per block key.
        cache_capacity_tokens: each instance's HBM prefix cache (default: its KV capacity).
        chunked_prefill: Sarathi-style chunked prefill under `token_budget` tokens per iteration.
        mfu: model FLOPs utilisation of prefill.
        analytic_decode: advance decode stretches analytically (False: step by step).
        sample_interval_s: how often load over time is sampled.
    """

    num_instances: int
    model: ModelShape
    hardware: Hardware
    block_size_tokens: int = 512
    cache_capacity_tokens: int | None = None
    chunked_prefill: bool = False
    token_budget: int = 512  # vLLM's max_num_batched_tokens with chunked prefill
    mfu: float = 0.5
    analytic_decode: bool = True
    sample_interval_s: float = 1.0

    def __attrs_post_init__(self) -> None:
        for name in ("num_instances", "block_size_tokens", "token_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CoupledSpec.{name} must be an integer >= 1, got {value!r}")

    @property
    def prefill_cost(self) -> PrefillCostModel:
        return PrefillCostModel(model=self.model, hardware=self.hardware, mfu=self.mfu)

    @property
    def decode_cost(self) -> DecodeCostModel:
        return DecodeCostModel(model=self.model, hardware=self.hardware)


@attrs.define(eq=False)
class _Waiting:
    request: Request
    record: RequestRecord
    done_tokens: int = 0  # prompt tokens whose KV exists (the cached prefix, then computed chunks)


@attrs.define(frozen=True)
class _Plan:
    """An iteration (or a stretch of decode steps) in progress."""

    steps: int  # decode steps it runs
    stall_s: float  # prefill work it carries before the steps
    completes: _Waiting | None  # the request whose prefill it finishes
    interruptible: bool  # a pure decode stretch: an arrival cuts it at the next step boundary


@attrs.define(eq=False)
class _Instance:
    instance_id: InstanceId
    cache: TieredCache
    batch: ContinuousBatch
    waiting: deque[_Waiting] = attrs.field(factory=deque)
    prefilling: _Waiting | None = None
    plan: _Plan | None = None
    version: int = 0

    @property
    def prefills(self) -> int:
        """Requests waiting for or in prefill (the one the current iteration completes included)."""
        completing = self.plan is not None and self.plan.completes is not None
        return len(self.waiting) + (self.prefilling is not None) + completing

    @property
    def outstanding(self) -> int:
        return self.prefills + len(self.batch)


class CoupledCluster(Replayer):
    """Replays requests through coupled instances (no Conductor: a load balancer spreads them)."""

    def __init__(self, spec: CoupledSpec, *, slo: Slo | None = None) -> None:
        self.spec = spec
        self.slo = slo or Slo()
        self.prefill_cost = spec.prefill_cost
        decode_cost = spec.decode_cost
        self.capacity_tokens = decode_cost.capacity_tokens()
        if self.capacity_tokens <= 0:
            raise ConfigError(f"{spec.model.name} leaves no HBM for KV on {spec.hardware.name}")
        step_fixed = decode_cost.step_s(1, 0)
        step_per_token = decode_cost.step_s(1, 1) - step_fixed
        cache_tokens = self.capacity_tokens if spec.cache_capacity_tokens is None else spec.cache_capacity_tokens
        self.page_bytes = spec.block_size_tokens * spec.model.kv_bytes_per_token
        pages = max(1, cache_tokens // spec.block_size_tokens)
        self._instances = [
            _Instance(
                InstanceId(f"coupled-{i}"),
                TieredCache(
                    [MetadataPagePool(Tier.VRAM, self.page_bytes, pages)],
                    source=InstanceId(f"coupled-{i}"),
                    policy=lambda: LruPolicy(prefix_aware=True),
                    promote_after=0,
                ),
                ContinuousBatch(step_fixed, step_per_token),
            )
            for i in range(spec.num_instances)
        ]
        self._start_replay(spec.sample_interval_s, self._counts)

    def _counts(self) -> tuple[int, int]:
        prefill = sum(i.prefills for i in self._instances)
        return prefill, sum(len(i.batch) for i in self._instances)

    def _arrive(self, now: float, request: Request) -> None:
        record = self._record_arrival(now, request)
        if request.input_length + request.output_length > self.capacity_tokens:
            record.outcome = Outcome.REJECTED_BEFORE_PREFILL
            record.reason = "exceeds_hbm"
            self._records.seal(record)
            return
        instance = min(self._instances, key=lambda i: i.outstanding)
        record.prefill_instance = record.decode_instance = instance.instance_id
        instance.waiting.append(_Waiting(request, record))
        plan = instance.plan
        if plan is None:
            self._decide(now, instance)
        elif plan.interruptible:  # take it at the next step boundary
            batch = instance.batch
            steps = batch.steps_within(now - batch.start_s) + 1
            if steps < plan.steps:
                self._start(instance, _Plan(steps, 0.0, None, interruptible=False))

    def _fits(self, instance: _Instance, request: Request) -> bool:
        held = instance.batch.context + sum(m.remaining for m in instance.batch.members)
        if instance.prefilling is not None:
            held += instance.prefilling.request.input_length + instance.prefilling.request.output_length
        return held + request.input_length + request.output_length <= self.capacity_tokens

    def _take(self, instance: _Instance) -> _Waiting | None:
        """The head of the queue if its KV fits, with its cached prefix looked up."""
        if not instance.waiting or not self._fits(instance, instance.waiting[0].request):
            return None
        waiting = instance.waiting.popleft()
        request = waiting.request
        cached = instance.cache.prefix_match(request.block_keys)
        waiting.done_tokens = max(0, min(cached * self.spec.block_size_tokens, request.input_length - 1))
        waiting.record.prefix_tokens = waiting.done_tokens
        return waiting

    def _decide(self, now: float, instance: _Instance) -> None:
        """Choose the next iteration at a step boundary (`now`)."""
        batch = instance.batch
        batch.start_s = now
        if self.spec.chunked_prefill:
            if instance.prefilling is None:
                instance.prefilling = self._take(instance)
            current = instance.prefilling
            if current is not None:
                chunk = min(current.request.input_length - current.done_tokens, self.spec.token_budget - len(batch))
                if chunk > 0:
                    chunk_s = self.prefill_cost.prefill_s(current.done_tokens + chunk, current.done_tokens)
                    current.record.prefill_s += chunk_s
                    current.done_tokens += chunk
                    completes = current if current.done_tokens >= current.request.input_length else None
                    if completes is not None:
                        instance.prefilling = None
                    self._start(instance, _Plan(1 if len(batch) else 0, chunk_s, completes, interruptible=False))
                    return
                self._start(instance, _Plan(1, 0.0, None, interruptible=False))  # the budget went to decodes
                return
        else:
            head = self._take(instance)
            if head is not None:
                head.record.prefill_s = self.prefill_cost.prefill_s(head.request.input_length, head.done_tokens)
                self._start(instance, _Plan(0, head.record.prefill_s, head, interruptible=False))
                return
        if len(batch):
            steps = batch.min_remaining() if self.spec.analytic_decode else 1
            self._start(instance, _Plan(steps, 0.0, None, interruptible=not instance.waiting))
        else:
            instance.plan = None

    def _start(self, instance: _Instance, plan: _Plan) -> None:
        instance.plan = plan
        instance.version += 1
        batch = instance.batch
        end = batch.start_s + plan.stall_s + (batch.stretch_s(plan.steps) if len(batch) else 0.0)
        self.loop.at(end, self._boundary, instance, instance.version)

    def _boundary(self, now: float, instance: _Instance, version: int) -> None:
        if version != instance.version:
            return  # replanned since
        plan, batch = instance.plan, instance.batch
        assert plan is not None
        batch.stall(plan.stall_s)
        if len(batch):
            batch.advance(plan.steps)
        for member in batch.take_finished():
            self._finish(now, member.record)
        done = plan.completes
        if done is not None:
            record = done.record
            record.first_token_s = now
            instance.cache.put_chain(done.request.block_keys, length=self.page_bytes)
            instance.cache.take_events()  # nobody indexes a coupled instance's HBM cache
            if record.output_tokens <= 1:
                self._finish(now, record)
            else:
                batch.start_s = now
                batch.join(Member(record, record.output_tokens - 1, record.input_tokens))
        self._decide(now, instance)

    def _finish(self, now: float, record: RequestRecord) -> None:
        record.outcome = Outcome.COMPLETED
        record.finish_s = now
        record.tbt_s = top_mean(record.intervals)
        self._records.seal(record)
