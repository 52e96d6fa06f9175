"""The coupled baseline: vLLM-style instances that prefill and decode on the same GPUs.

Each instance runs iterations back to back over one `ContinuousBatch`, with
prefix caching in its own HBM only (a metadata-only `TieredCache`, LRU,
prefix-aware), and requests are spread over the
instances by least outstanding requests (ties: the lowest index), as a load
balancer in front of vLLM replicas does. No request is rejected, except one
that could never run on an idle instance (the decode rule, `sched.join`).

An iteration, at a step boundary, is chosen as vLLM's v1 scheduler does (an
idle instance chooses once every request arriving at that instant is in):

- without chunked prefill, a waiting request that the decode rule's
  structural checks let in (batch slots, KV: reservations of prompt + output)
  is prefilled alone, and the whole batch stalls for it (prefill first); otherwise the
  batch decodes, a stretch at a time between membership changes, until a new
  request arrives (it is taken at the next step boundary). Prompts waiting
  together are prefilled back to back, with no decode step between them: the
  time vLLM's one batch of them takes (prefill times add up here), though the
  earlier ones get their first token sooner;
- with chunked prefill (Sarathi style), every iteration spends `token_budget`
  tokens in vLLM v1's order: one decode token per running request, then the
  prefill left partial by the last iteration, then waiting requests taken in
  order while budget is left, each through the decode rule beside the batch
  and those taken before it, each given what its prompt still needs or what
  is left of the budget (only the last taken can be left partial). The
  iteration takes the decode step's time plus its chunks' prefill times (each
  chunk attends to its own prompt's tokens before it); it may finish several
  prefills. A request taken after others in one iteration reuses their
  prompts' blocks as well as the cache's, since vLLM caches blocks when it
  schedules them.

Deliberate differences from vLLM v1: a request is let in on a reservation of
its whole prompt + output (the decode rule), where vLLM allocates blocks for
the tokens it schedules and preempts a request when it runs out; so nothing
is ever preempted here. Decodes beyond `token_budget` still run (vLLM would
defer them). Without chunked prefill a prefill stalls the running requests
(vLLM v0's prefill-first scheduling), where v1 would give them their token in
the same iteration.

The prefix cache shares the instance's one KV pool with the running
requests, as vLLM's block pool does: a running request's prompt blocks are
cached and pinned (in use: later requests share them, nothing evicts them)
and counted in its reservation (prompt + output, as the decode rule counts
it); a request taken for prefill (a chunked prefill spanning iterations
included) reserves as much and pins the cached prefix it was matched with from
then until it joins, as vLLM references the blocks it schedules; the other
cached blocks are the free part, evicted least recently used
first whenever they no longer fit beside the reservations. A prompt is cached
when its prefill ends and used again when its request ends (its blocks, freed,
stay cached and become evictable, as vLLM's do); the decode rule counts only
reservations, since unpinned blocks give way. Invariant at every step boundary:
unpinned cached blocks × block size + reservations <= KV capacity.

Times come from the same cost models as the disaggregated simulator, so the
two are compared on equal terms.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Sequence

import attrs

from mooncake._checks import require_bool, require_int, require_number, shown
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.tiered import TieredCache
from mooncake.errors import CapacityError, ConfigError
from mooncake.sched.cost import DEFAULT_MFU, Hardware, ModelShape, PrefillCostModel
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict, check_join, takes_slot
from mooncake.sched.outcome import Outcome
from mooncake.sched.step import DecodeCostModel
from mooncake.sim.batch import Member
from mooncake.sim.metrics import ReplayResult, RequestRecord
from mooncake.sim.node import DecodeNode, metadata_cache, shared_prefix_blocks
from mooncake.sim.replayer import Progress, ReplayContext
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier, require_slo
from mooncake.workload.trace import TRACE_BLOCK_SIZE_TOKENS

__all__ = ["CoupledCluster", "CoupledSpec"]


@attrs.frozen(kw_only=True)
class CoupledSpec:
    """A cluster of coupled (prefill-and-decode) instances.

    Attributes:
        num_instances: instances, each `hardware`.
        block_size_tokens: tokens per block key.
        cache_capacity_tokens: the most each instance's HBM prefix cache holds (default: its KV capacity); it
            holds less while running requests' reservations take the rest of the HBM.
        chunked_prefill: Sarathi-style chunked prefill under `token_budget` tokens per iteration.
        token_budget: tokens an iteration schedules with chunked prefill (vLLM's max_num_batched_tokens): 2048,
            vLLM 0.32's OpenAI-server default for A100s (larger budgets cost A100s throughput, vLLM PR #17885).
            The A800s of the paper's testbed are the A100's chip, though vLLM's device check, by the name
            "a100", would give them its H100/H200 default, 8192.
        max_batch_size: requests an instance runs at once (None: as many as its HBM holds).
        mfu: model FLOPs utilisation of prefill.
        analytic_decode: advance decode stretches analytically (False: step by step).
        sample_interval_s: how often load over time is sampled.
    """

    num_instances: int
    model: ModelShape
    hardware: Hardware
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS
    cache_capacity_tokens: int | None = None
    chunked_prefill: bool = False
    token_budget: int = 2048  # vLLM 0.32's max_num_batched_tokens for an OpenAI server on A100s
    max_batch_size: int | None = None  # vLLM's max_num_seqs (None: as many as the HBM holds)
    mfu: float = DEFAULT_MFU
    analytic_decode: bool = True
    sample_interval_s: float = 1.0

    def __attrs_post_init__(self) -> None:
        # Every field, as ClusterSpec checks its twins: a bad sampling interval hung a replay, a negative cache
        # silently held nothing, a model or hardware of the wrong kind failed deep in the cost models.
        for name, kind in (("model", ModelShape), ("hardware", Hardware)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigError(f"CoupledSpec.{name} must be a {kind.__name__}, got {shown(value)}")
        for name in ("num_instances", "block_size_tokens", "token_budget"):
            require_int(f"CoupledSpec.{name}", getattr(self, name), minimum=1)
        for name, minimum in (("cache_capacity_tokens", 0), ("max_batch_size", 1)):  # None: as the HBM holds
            if getattr(self, name) is not None:
                require_int(f"CoupledSpec.{name}", getattr(self, name), minimum=minimum)
        for name in ("chunked_prefill", "analytic_decode"):
            require_bool(f"CoupledSpec.{name}", getattr(self, name))
        require_number("CoupledSpec.sample_interval_s", self.sample_interval_s, minimum=0, strict=True)
        if require_number("CoupledSpec.mfu", self.mfu, minimum=0, strict=True) > 1:
            raise ConfigError(f"CoupledSpec.mfu is a fraction of the peak, at most 1, got {shown(self.mfu)}")

    @property
    def prefill_cost(self) -> PrefillCostModel:
        # The prefix cache is the instance's HBM: a cached prefix is read in place, not loaded.
        return PrefillCostModel(model=self.model, hardware=self.hardware, mfu=self.mfu, prefix_tier=Tier.VRAM)

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
    """An iteration (or a stretch of decode steps) in progress; its stall and steps are the node's plan."""

    steps: int  # decode steps it runs
    completes: tuple[_Waiting, ...]  # the requests whose prefills it finishes, in the order they were taken
    interruptible: bool  # a pure decode stretch: an arrival cuts it at the next step boundary


@attrs.define(eq=False)
class _Instance:
    cache: TieredCache
    node: DecodeNode
    waiting: deque[_Waiting] = attrs.field(factory=deque)
    prefilling: _Waiting | None = None  # a prefill the last iteration left partial (only the last taken can be)
    plan: _Plan | None = None
    kv_tokens: int = 0  # the decoding members' reservations (prompt + output each)
    # The reservations of requests taken for prefill that have not joined the batch yet (a partial prefill's, those
    # the current iteration completes): admitted by the decode rule, so their room is no cache's either.
    taken_tokens: int = 0
    # Each running request's prompt chain and the blocks of it it pins in the cache (its own blocks, in use: never
    # evicted while it runs, as vLLM's blocks with a reference are not), and how many running requests pin each;
    # a request taken for prefill pins the cached prefix it was matched with until it joins.
    running: dict[RequestId, tuple[Sequence[BlockKey], list[BlockKey]]] = attrs.field(factory=dict)
    held: dict[BlockKey, int] = attrs.field(factory=dict)

    @property
    def instance_id(self) -> InstanceId:
        return self.node.instance_id

    @property
    def prefills(self) -> int:
        """Requests waiting for or in prefill (those the current iteration completes included)."""
        completing = len(self.plan.completes) if self.plan is not None else 0
        return len(self.waiting) + (self.prefilling is not None) + completing

    @property
    def outstanding(self) -> int:
        return self.prefills + len(self.node.batch)

    def load(self, taken: Sequence[_Waiting] = ()) -> DecodeLoad:
        """What the instance holds for the decode rule: its batch and the requests `taken` for the iteration
        being chosen, which join the batch when their prefills end (asked only when no prefill is left partial:
        a request is taken only while budget is left, after the partial one)."""
        assert self.prefilling is None, "the next request is taken once the partial prefill is scheduled whole"
        batch = self.node.batch
        joining = [w.request for w in taken if takes_slot(w.request.output_length)]
        return DecodeLoad(
            len(batch) + len(joining),
            batch.context + sum(r.input_length for r in joining),
            self.kv_tokens + sum(r.input_length + r.output_length for r in joining),
        )


class CoupledCluster:
    """Replays requests through coupled instances (no Conductor: a load balancer spreads them),
    in `context` (by default its own).

    Invariants (`check_invariants`, at every step boundary): on each instance, cached KV + reserved KV <= its
    KV capacity (one pool, as vLLM's).

    Raises:
        ConfigError: a `spec` that is no `CoupledSpec`, an `slo` that is no `Slo` (else only the summary, after the
            whole replay, finds it out), or an instance whose HBM the weights fill.
    """

    def __init__(self, spec: CoupledSpec, *, slo: Slo | None = None, context: ReplayContext | None = None) -> None:
        if not isinstance(spec, CoupledSpec):
            raise ConfigError(f"spec must be a CoupledSpec, got {shown(spec)}")
        self.spec = spec
        self.slo = Slo() if slo is None else require_slo(slo)
        self.replay = (
            context if context is not None else ReplayContext(self.slo, sample_interval_s=spec.sample_interval_s)
        )
        self.loop = self.replay.loop
        self.prefill_cost = spec.prefill_cost
        decode_cost = spec.decode_cost
        self.capacity_tokens = decode_cost.require_capacity_tokens("CoupledSpec.hardware")
        self.limits = DecodeLimits(kv_capacity_tokens=self.capacity_tokens, max_batch_size=spec.max_batch_size)
        cache_tokens = self.capacity_tokens if spec.cache_capacity_tokens is None else spec.cache_capacity_tokens
        self.page_bytes = spec.block_size_tokens * spec.model.kv_bytes_per_token
        # A capacity under one block caches nothing (its cache, a page no chain is put into, stays empty).
        self._caches = cache_tokens >= spec.block_size_tokens
        pages = max(1, cache_tokens // spec.block_size_tokens)
        self._instances = [
            _Instance(
                metadata_cache(InstanceId(f"coupled-{i}"), Tier.VRAM, page_bytes=self.page_bytes, num_pages=pages),
                DecodeNode.of(InstanceId(f"coupled-{i}"), decode_cost),
            )
            for i in range(spec.num_instances)
        ]

    def run(
        self, requests: Iterable[Request], *, progress: Progress | None = None, keep_intervals: bool = True
    ) -> ReplayResult:
        """Replay `requests` (arrival order, streamed) through the instances to the end; summarize. One cluster
        replays one workload: a second `run` is refused (build a new cluster for another).

        Raises:
            InvalidRequestError: this cluster has replayed a workload already, or what `ReplayContext.run` refuses
                in `requests`.
            ConfigError: a `progress` or `keep_intervals` that `ReplayContext.run` refuses.
        """
        return self.replay.run(requests, self._arrive, self._counts, progress=progress, keep_intervals=keep_intervals)

    def _counts(self) -> tuple[int, int]:
        prefill = sum(i.prefills for i in self._instances)
        return prefill, sum(len(i.node.batch) for i in self._instances)

    def _arrive(self, now: float, request: Request) -> None:
        request.check_block_size(self.spec.block_size_tokens)  # as the disaggregated cluster's Conductor does
        record = self.replay.open(now, request)
        alone = self._verdict(DecodeLoad(0, 0, 0), request)
        if not alone.accepted:  # it could never run: it does not fit an idle instance
            assert alone.reason is not None
            self.replay.reject(now, record, Outcome.REJECTED_BEFORE_PREFILL, alone.reason)
            return
        instance = min(self._instances, key=lambda i: i.outstanding)
        record.prefill_instance = record.decode_instance = instance.instance_id
        instance.waiting.append(_Waiting(request, record))
        plan = instance.plan
        if plan is None:  # idle: choose at a boundary now, after every request arriving now (arrivals go first)
            instance.node.batch.start_s = now
            self._start(instance, _Plan(0, (), interruptible=False))
        elif plan.interruptible:  # take it at the next step boundary
            steps = instance.node.steps_to_next_boundary(now)
            if steps < plan.steps:
                self._start(instance, _Plan(steps, (), interruptible=False))

    def _verdict(self, load: DecodeLoad, request: Request) -> JoinVerdict:
        """The decode rule's structural checks (the coupled scheduler has no TBT check)."""
        return check_join(self.limits, load, prompt_tokens=request.input_length, output_tokens=request.output_length)

    def _take(self, instance: _Instance, taken: Sequence[_Waiting] = ()) -> _Waiting | None:
        """The head of the queue if the decode rule lets it in beside the batch and the requests `taken` for this
        iteration before it, with its cached prefix looked up: in the cache, or among the prompts of `taken`
        (vLLM caches a prompt's blocks as it schedules them; each of `taken` finishes its prefill in the
        iteration, as only the last taken can be left partial)."""
        if not instance.waiting or not self._verdict(instance.load(taken), instance.waiting[0].request).accepted:
            return None
        waiting = instance.waiting.popleft()
        request = waiting.request
        cached = 0
        if request.reuses_prefix and self._caches:
            cached = instance.cache.prefix_match(request.block_keys)
            for other in taken:
                cached = max(cached, shared_prefix_blocks(request.block_keys, other.request.block_keys))
        waiting.done_tokens = reusable_prefix_tokens(request.input_length, cached, self.spec.block_size_tokens)
        waiting.record.prefix_tokens = waiting.done_tokens
        if takes_slot(request.output_length):
            instance.taken_tokens += request.input_length + request.output_length
            if self._caches:
                # Its cached prefix is in use from now on (vLLM references the computed blocks it schedules with),
                # and the cache gives way to the reservation the decode rule just admitted.
                self._pin_prefix(instance, request.request_id, request.block_keys)
                self._fit(instance)
        return waiting

    def _decide(self, now: float, instance: _Instance) -> None:
        """Choose the next iteration at a step boundary (`now`)."""
        batch = instance.node.batch
        batch.start_s = now
        if self.spec.chunked_prefill:
            # vLLM v1's order within the budget: the decodes' tokens, the partial prefill, then waiting requests.
            budget = self.spec.token_budget - len(batch)
            taken: list[_Waiting] = []
            stall_s = 0.0
            while budget > 0:
                current = instance.prefilling if instance.prefilling is not None else self._take(instance, taken)
                if current is None:
                    break
                chunk = min(current.request.input_length - current.done_tokens, budget)
                # One forward pass; the prefill cost model has no fixed cost here (overhead_s 0), so the chunks'
                # times add up to the pass's, and each request is charged its own chunk's.
                chunk_s = self.prefill_cost.prefill_s(current.done_tokens + chunk, current.done_tokens)
                current.record.prefill_s += chunk_s
                stall_s += chunk_s
                current.done_tokens += chunk
                budget -= chunk
                taken.append(current)
                instance.prefilling = current if current.done_tokens < current.request.input_length else None
            if taken:
                completes = tuple(w for w in taken if w is not instance.prefilling)
                self._start(instance, _Plan(1 if len(batch) else 0, completes, interruptible=False), stall_s)
                return
        else:
            head = self._take(instance)
            if head is not None:
                head.record.prefill_s = self.prefill_cost.prefill_s(head.request.input_length, head.done_tokens)
                self._start(instance, _Plan(0, (head,), interruptible=False), head.record.prefill_s)
                return
        if len(batch):
            steps = batch.min_remaining() if self.spec.analytic_decode else 1
            self._start(instance, _Plan(steps, (), interruptible=not instance.waiting))
        else:
            instance.plan = None

    def _start(self, instance: _Instance, plan: _Plan, stall_s: float = 0.0) -> None:
        """Run `plan` after a `stall_s` prefill: its boundary replaces any planned before."""
        instance.plan = plan
        node = instance.node
        self.loop.at(node.plan(plan.steps, stall_s), self._boundary, instance, node.version)

    def _boundary(self, now: float, instance: _Instance, version: int) -> None:
        node = instance.node
        if not node.is_current(version):
            return  # replanned since
        plan = instance.plan
        assert plan is not None
        for member in node.end_stretch(now):
            instance.kv_tokens -= member.record.input_tokens + member.record.output_tokens
            self._release(instance, member.record.request_id)
            self.replay.complete(now, member.record)
        for done in plan.completes:
            record = done.record
            record.first_token_s = now
            if not takes_slot(record.output_tokens):  # the first token was the last
                self._cache(instance, done.request.block_keys)
                self.replay.complete(now, record)
            else:
                batch = node.batch
                batch.start_s = now
                batch.join(Member(record, record.output_tokens - 1, record.input_tokens))
                instance.kv_tokens += record.input_tokens + record.output_tokens
                instance.taken_tokens -= record.input_tokens + record.output_tokens
                if self._caches:
                    self._unpin(instance, record.request_id)  # pinned whole below, the prompt now stored
                self._cache(instance, done.request.block_keys, running=record.request_id)
        self._decide(now, instance)

    def _cache(self, instance: _Instance, keys: Sequence[BlockKey], *, running: RequestId | None = None) -> None:
        """Cache a prompt's chain (a use, where cached), pinned while its request `running` runs, then evict
        least-recently-used blocks until the evictable ones fit beside the reservations: called whenever either
        grows, so the pool never holds more than the HBM."""
        if not self._caches:
            return
        cache = instance.cache
        with contextlib.suppress(CapacityError):  # every page pinned by running requests: nothing more is cached
            cache.put_chain(keys, length=self.page_bytes)
        if running is not None:
            self._pin_prefix(instance, running, keys)
        self._fit(instance)

    def _pin_prefix(self, instance: _Instance, request_id: RequestId, keys: Sequence[BlockKey]) -> None:
        """Pin the cached prefix of `keys` (put_chain stops where it finds no room) for `request_id`, which uses it."""
        cache = instance.cache
        pinned = []
        for key in keys:
            if cache.location(key) is None:
                break
            cache.pin(key)
            pinned.append(key)
            instance.held[key] = instance.held.get(key, 0) + 1
        instance.running[request_id] = (keys, pinned)

    def _unpin(self, instance: _Instance, request_id: RequestId) -> Sequence[BlockKey]:
        """Unpin what `request_id` pinned (it stays cached, evictable again); its prompt's keys."""
        keys, pinned = instance.running.pop(request_id)
        for key in pinned:
            instance.cache.unpin(key)
            left = instance.held[key] - 1
            if left:
                instance.held[key] = left
            else:
                del instance.held[key]
        return keys

    def _release(self, instance: _Instance, request_id: RequestId) -> None:
        """A running request ended: its blocks are no longer in use, and stay cached (a use, as vLLM frees a
        finished request's blocks to the end of its free queue), evictable again."""
        if not self._caches:
            return
        self._cache(instance, self._unpin(instance, request_id))

    def _fit(self, instance: _Instance) -> None:
        """Evict least-recently-used unpinned blocks until they fit in the HBM the reservations leave (the running
        requests' and those taken for prefill, a prefill spanning iterations included: vLLM holds the blocks of
        the chunks it scheduled). The blocks running requests pin are their prompts', which their reservations
        count already."""
        cache = instance.cache
        reserved = instance.kv_tokens + instance.taken_tokens
        room_blocks = max(0, self.capacity_tokens - reserved) // self.spec.block_size_tokens
        excess = cache.used_bytes(Tier.VRAM) // self.page_bytes - len(instance.held) - room_blocks
        if excess > 0:
            cache.evict(excess)
        cache.take_events()  # nobody indexes a coupled instance's HBM cache

    def check_invariants(self) -> None:
        """Raise AssertionError unless, on every instance, the cached blocks no running request pins (whole blocks
        of `block_size_tokens`) and the reservations (the running requests' and those taken for prefill) fit its
        KV capacity together (true at every step boundary), and the pins counted are the running requests'."""
        block = self.spec.block_size_tokens
        for instance in self._instances:
            evictable = instance.cache.used_bytes(Tier.VRAM) // self.page_bytes - len(instance.held)
            reserved = instance.kv_tokens + instance.taken_tokens
            assert evictable * block + reserved <= self.capacity_tokens, (
                f"{instance.instance_id}: {evictable * block} evictable cached + {reserved} reserved KV"
                f" tokens > capacity {self.capacity_tokens}"
            )
            # The partial prefill and those the iteration completes (which never include it: `_decide`).
            taken = [instance.prefilling] if instance.prefilling is not None else []
            taken += instance.plan.completes if instance.plan is not None else ()
            assert instance.taken_tokens == sum(
                w.request.input_length + w.request.output_length for w in taken if takes_slot(w.request.output_length)
            ), f"{instance.instance_id}: taken reservations miscounted"

            pins: dict[BlockKey, int] = {}
            for _keys, pinned in instance.running.values():
                for key in pinned:
                    pins[key] = pins.get(key, 0) + 1
            assert pins == instance.held, f"{instance.instance_id}: pinned blocks miscounted"
