"""Routers: which prefill instance serves a request (the paper's Algorithm 1 and its ablations).

KV-cache-centric routing (FAST'25, Algorithm 1): let best_len be the longest
prefix any instance holds (the best holder). For each prefill instance with its
own prefix prefix_len:

    if best_len / prefix_len > kvcache_balancing_threshold:     (prefix_len 0: ratio ∞)
        plan a transfer of the missing blocks from the best holder; use best_len
    else:
        use prefix_len, no transfer
    TTFT = max(T_transfer, T_queue) + T_prefill(input, prefix)

(on a chunked-pipeline group also no less than T_drain + T_occupancy, the work ahead's end on its last
stage plus the prompt's first-stage time: `sched.cost.prefill_end_s`; every group is then planned, as the
queue alone does not order them) and pick the instance with the smallest TTFT (ties: the shorter queue, then the
longer prefix of its own, then the highest rendezvous weight of the prompt's
first block the tied instances lack, then id). Algorithm 1 leaves ties open. A
prefill model that says a cached prefix saves nothing (a flat fit) ties its
holder with the others: the holder keeps the prompt, as a prefix-aware router
(vLLM's, SGLang's) would. Ties are the rule whenever the instances are idle and
none holds the prompt. Sending them all to the smallest id fills
its cache alone (it thrashes while the others sit empty); rendezvous hashing
(`spread_weights`) gives each prompt a home among the tied instances instead, a
function of the prompt and the instance ids only: new prompts spread evenly, a
prompt evicted everywhere goes back to its home, and the same prompt on the same
tie goes to the same instance in a simulation as in the real cluster.
The transfer runs while the request waits in the instance's queue, so the two
overlap (the simulated and real prefill nodes start when both are over).

Hot-spot replication (§6.2): a transfer is chosen only when the holders of the
prefix are busier than the receiver, so the prefix is in demand; the receiver
keeps the copy while fewer than `max_replicas(n) = max(2, ⌈replica_fraction ·
n⌉)` of the n instances hold it (`keep_local_copy`), so that a hot prefix
spreads over several instances without filling every cache; past that it uses
the blocks for this prefill and drops them.

The ablations of the paper's Fig. 5 share the code: `local_cache_aware` is the
same router with transfers forbidden (an infinite threshold), `load_balancing`
picks the shortest queue, `random` a random instance; `round_robin` (the
default of vLLM's production-stack router and of most load balancers) takes
the instances up in id order, one after another; each reports its own TTFT
estimate so that admission can use it.

`AdaptiveThreshold` (ours, off by default) tunes the threshold online: it
compares observed TTFT with the estimate, separately for decisions that moved
KV and those that did not, and raises the threshold when transfers turn out
worse than predicted relative to staying local (and lowers it otherwise).
"""

from __future__ import annotations

import functools
import math
import numbers
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from mooncake._checks import int_at_least, require_int, require_number, shown
from mooncake.cache._compiled import kernels
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.index import key_array
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import ChunkedPipelineCost, PrefillModel, TransferCostModel, occupancy_s, prefill_end_s
from mooncake.sched.view import PrefillBoard, PrefillView, check_one_view_each
from mooncake.types import BlockKey, InstanceId

__all__ = [
    "AdaptiveThreshold",
    "DEFAULT_THRESHOLD",
    "KvCacheCentricRouter",
    "LoadBalancingRouter",
    "PrefixBlocks",
    "RandomRouter",
    "RoundRobinRouter",
    "RouteDecision",
    "RouteQuery",
    "Router",
    "TransferPlan",
    "TtftEstimator",
    "is_threshold",
    "local_cache_aware_router",
    "spread_weights",
]

DEFAULT_THRESHOLD = 1.5
"""Algorithm 1's kvcache_balancing_threshold where none is given: the paper's, the router's and every tool's."""


def is_threshold(value: object) -> bool:
    """Whether `value` is a kvcache_balancing_threshold: a ratio of prefix lengths, so a number >= 1 (below 1 it
    would mean what 1 means), or math.inf (never transfer). NaN is not."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and (value == math.inf or float(value) >= 1)


_KERNELS = "mooncake.sched._kernels"
_UNWEIGHED = np.zeros(0)  # `shortest_by_length` without weights: ties go to the smallest slot
_INT64 = np.dtype(np.int64)
_MAX_BLOCKS = 2**63  # block counts live in int64 arrays


def _block_counts(name: str, counts: Any, instances: Sequence[object]) -> npt.NDArray[np.int64]:
    """`counts`, one per instance of `instances` in its order, as an int64 array of block counts: integers in
    [0, 2**63). The router's kernels index a prompt's keys by them (`rendezvous_weights`), so a negative count
    would read before the first key (garbage, or a crash, on the compiled path) and a float would be truncated.

    Raises:
        InvalidRequestError: naming `name[instance]` and the value of the first count that is not one, or `name`
            and the lengths where there is not one count per instance.
    """
    # The Conductor's own int64 array, per request: a few tests and an argmin (a third of min's reduction).
    if (
        type(counts) is np.ndarray
        and counts.dtype == _INT64  # equal, not identical: a numba kernel's arrays carry dtypes of their own
        and counts.ndim == 1
        and len(counts) == len(instances)
        and (not len(counts) or counts.item(counts.argmin()) >= 0)
    ):
        return counts
    try:
        values = counts.tolist() if isinstance(counts, np.ndarray) and counts.ndim == 1 else list(counts)
    except TypeError:
        raise InvalidRequestError(f"{name} must be a sequence of block counts, got {shown(counts)}") from None
    if len(values) != len(instances):
        raise InvalidRequestError(
            f"{name} must hold one block count per instance ({len(instances)}), got {len(values)}"
        )
    for instance, value in zip(instances, values, strict=True):
        require_int(f"{name}[{shown(instance)}]", value, minimum=0, below=_MAX_BLOCKS, error=InvalidRequestError)
    return np.array(values, dtype=np.int64)


class PrefixBlocks(Mapping[InstanceId, int]):
    """Instance → leading blocks of a prompt it holds, kept as an array over a board's
    instances (`blocks[i]` for `instance_ids[i]`, `position` the inverse of `instance_ids`);
    instances holding none are absent.

    Raises:
        InvalidRequestError: `blocks` is not one integer in [0, 2**63) per instance (`_block_counts`).
    """

    def __init__(
        self,
        instance_ids: tuple[InstanceId, ...],
        blocks: npt.NDArray[np.int64],
        position: Mapping[InstanceId, int] | None = None,
    ) -> None:
        self.instance_ids = instance_ids
        self.blocks = _block_counts("prefix_blocks", blocks, instance_ids)
        self._position = position if position is not None else {i: n for n, i in enumerate(instance_ids)}

    def get(self, instance: InstanceId, default: int | None = None) -> int | None:  # type: ignore[override]
        position = self._position.get(instance)
        held = 0 if position is None else int(self.blocks[position])
        return held if held else default

    def __getitem__(self, instance: InstanceId) -> int:
        held = self.get(instance)
        if held is None:
            raise KeyError(instance)
        return held

    def __iter__(self) -> Iterator[InstanceId]:
        return iter([self.instance_ids[i] for i in np.flatnonzero(self.blocks).tolist()])

    def __len__(self) -> int:
        return int(np.count_nonzero(self.blocks))


@functools.lru_cache(maxsize=256)
def _seeds(instances: tuple[InstanceId, ...]) -> npt.NDArray[np.uint64]:
    """Each instance's id hash, in order (a board's ids are one tuple for its lifetime: computed once)."""
    seeds = np.array([xxhash.xxh3_64_intdigest(instance.encode()) for instance in instances], dtype=np.uint64)
    seeds.flags.writeable = False
    return seeds


def spread_weights(
    keys: Sequence[BlockKey] | npt.NDArray[np.uint64], own: npt.NDArray[np.int64], instances: Sequence[InstanceId]
) -> npt.NDArray[np.float64]:
    """Each instance's rendezvous weight for a prompt, in `instances`' order: splitmix64 of the key of
    the first block it lacks (`keys[own[i]]`, the last key if it holds them all) xor a hash of its id,
    scaled to [0, 1). Instances that hold the same prefix weigh the same key, so among them the prompt's
    home is the heaviest: a function of the prompt's keys and the instance ids only, uniform over
    instances across prompts, and unchanged for the others when one leaves. No keys: all weigh 0.
    Keys wider than 64 bits weigh as the index stores them (`key_array`).

    Raises:
        InvalidRequestError: `own` is not one integer in [0, 2**63) per instance, naming `own[instance]` and the
            value (`_block_counts`); keys that are no block keys (`key_array`).
    """
    return _spread_weights(keys, _block_counts("own", own, instances), instances)


def _spread_weights(
    keys: Sequence[BlockKey] | npt.NDArray[np.uint64], own: npt.NDArray[np.int64], instances: Sequence[InstanceId]
) -> npt.NDArray[np.float64]:
    """`spread_weights` on counts already checked (a `RouteQuery`'s, which checked them when it was built)."""
    if not len(keys):
        return np.zeros(len(instances))
    weights: npt.NDArray[np.float64] = kernels(_KERNELS).rendezvous_weights(
        key_array(keys), own, _seeds(tuple(instances))
    )
    return weights


def _check_prefix_blocks(value: object) -> None:
    """`RouteQuery.prefix_blocks`: a mapping of instance → blocks held, each an integer in [0, 2**63) (a
    `PrefixBlocks` checked its array when it was built)."""
    if isinstance(value, PrefixBlocks):
        return
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"prefix_blocks must be a mapping of instance -> blocks held, got {shown(value)}")
    if value:
        _block_counts("prefix_blocks", list(value.values()), list(value))


def _blocks_of(held: Mapping[InstanceId, int], board: PrefillBoard) -> npt.NDArray[np.int64]:
    """The leading blocks each of `board`'s instances holds, in the board's order."""
    if isinstance(held, PrefixBlocks) and held.instance_ids is board.instance_ids:
        return held.blocks
    if not held:
        return np.zeros(len(board), dtype=np.int64)
    return np.array([held.get(instance, 0) for instance in board.instance_ids], dtype=np.int64)


@attrs.frozen(kw_only=True)
class RouteQuery:
    """What a router needs to know of one request. Its counts are checked when it is built, once for every router
    that reads it (the KV-centric router's kernels index by the prefix counts).

    Attributes:
        input_tokens: prompt length.
        block_size_tokens: tokens per block key.
        prefix_blocks: instance → leading blocks of the prompt it holds (from the index), each an integer in
            [0, 2**63).
        best_instance, best_blocks: the instance a transfer would come from and the longest prefix
            any instance holds. The Conductor names, of the instances holding as much of that prefix as
            a prefill reuses, the one with the fewest transfers already leaving it (ties: the smallest id).
        best_holders: instances (up) holding as much of that prefix as a prefill reuses, the best holder included.
        best_transfers_in_flight: transfers already leaving the best holder (congestion).
        block_keys: the prompt's block keys (the tie-break's: `spread_weights`; none: ties go by id).

    Raises:
        InvalidRequestError: a count that is no integer or is below 0 (prefix_blocks: naming
            `prefix_blocks[instance]`), prefix_blocks that is no mapping, a best_instance that is no id string,
            or token counts `reusable_prefix_tokens` refuses; each naming the field and the value.
    """

    input_tokens: int
    block_size_tokens: int
    prefix_blocks: Mapping[InstanceId, int]
    best_instance: InstanceId | None = None
    best_blocks: int = 0
    best_holders: int = 0
    best_transfers_in_flight: int = 0
    block_keys: Sequence[BlockKey] | npt.NDArray[np.uint64] = attrs.field(default=(), eq=False)
    # The most a prefill of this prompt reuses, whatever is cached (asked once: routing asks per instance).
    reusable_tokens: int = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(
            lambda self: reusable_prefix_tokens(self.input_tokens, self.input_tokens, self.block_size_tokens),
            takes_self=True,
        ),
    )

    def __attrs_post_init__(self) -> None:
        # The Conductor builds one per request: its plain ints and its `PrefixBlocks` (checked when built) pass
        # one test each (three attrs validators cost as much as the rest of the query); the rest is looked into.
        blocks, holders, in_flight = self.best_blocks, self.best_holders, self.best_transfers_in_flight
        if (
            type(blocks) is not int
            or type(holders) is not int
            or type(in_flight) is not int
            or blocks < 0
            or holders < 0
            or in_flight < 0
        ):
            for name in ("best_blocks", "best_holders", "best_transfers_in_flight"):
                require_int(name, getattr(self, name), minimum=0, error=InvalidRequestError)
        if type(self.prefix_blocks) is not PrefixBlocks:
            _check_prefix_blocks(self.prefix_blocks)
        best = self.best_instance
        if best is not None and (type(best) is not str or not best):
            raise InvalidRequestError(f"best_instance must be None or an instance id string, got {shown(best)}")

    def prefix_tokens(self, blocks: int) -> int:
        """Cached tokens a prefix of `blocks` blocks saves (`cache.hashing.reusable_prefix_tokens`: whole
        blocks, up to what a prefill of this prompt reuses at most)."""
        return min(blocks * self.block_size_tokens, self.reusable_tokens) if blocks > 0 else 0


@attrs.frozen(kw_only=True)
class TransferPlan:
    """Move `num_blocks` blocks (`num_bytes`) from `source` before prefill; keep the copy there
    afterwards (hot-spot replication) or drop it once used."""

    source: InstanceId
    num_blocks: int
    num_bytes: int
    transfer_s: float
    keep_local_copy: bool = True


@attrs.frozen(kw_only=True)
class RouteDecision:
    """A router's choice with its own estimate of the time to first token."""

    prefill_instance: InstanceId
    prefix_tokens: int
    transfer: TransferPlan | None
    transfer_s: float
    queue_s: float
    prefill_s: float
    overhead_s: float = 0.0  # the serving path's fixed latency from the prefill's end to the first token
    # How long the prefill holds the instance before the next may start (a chunked-pipeline group's first
    # stage; the whole prefill elsewhere): `sched.cost.occupancy_s`.
    occupancy_s: float = attrs.field(default=attrs.Factory(lambda self: self.prefill_s, takes_self=True))
    # Until the work queued ahead has ended (on a chunked-pipeline group: left its last stage), from now.
    drain_s: float = 0.0
    # Until the prefill ends, from now (`sched.cost.prefill_end_s`: a chunked-pipeline group's prefill also
    # leaves its last stage no sooner than its occupancy after the work ahead; elsewhere that never binds);
    # and the estimated TTFT, that plus the overhead. Worked out once: a decision reads them several times.
    prefill_end_s: float = attrs.field(init=False)
    ttft_s: float = attrs.field(init=False)
    # From the first token until the request reaches its decode instance: the KV stream's tail that the prefill
    # did not hide (`TransferCostModel.handoff_s`). The decode side is asked about the load then.
    handoff_s: float = 0.0
    # Until the prefill can start: the transfer runs while the request waits in the queue.
    wait_s: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        wait = self.transfer_s if self.transfer_s > self.queue_s else self.queue_s  # max(), without its call
        end = prefill_end_s(wait, self.prefill_s, self.occupancy_s, self.drain_s)
        object.__setattr__(self, "wait_s", wait)
        object.__setattr__(self, "prefill_end_s", end)
        object.__setattr__(self, "ttft_s", end + self.overhead_s)


def _require_method(name: str, part: object, method: str) -> None:
    """A part given by its name or class (say "fitted") is refused here, not at the first request's AttributeError."""
    if isinstance(part, type) or not callable(getattr(part, method, None)):
        raise ConfigError(f"{name} must be a model with a {method}() method, got {shown(part)}")


@attrs.frozen(kw_only=True)
class TtftEstimator:
    """Estimates each term of TTFT for one instance: TTFT = max(transfer, queue) + prefill + overhead,
    the overhead being the serving path's fixed latency from a prefill's end to its first token (as
    measured on a real cluster: `sim.spec.ClusterSpec.first_token_overhead_s`, which the simulator charges)."""

    prefill: PrefillModel = attrs.field(validator=lambda _i, _a, value: _require_method("prefill", value, "prefill_s"))
    transfer: TransferCostModel = attrs.field(
        validator=lambda _i, _a, value: _require_method("transfer", value, "transfer_s")
    )
    kv_bytes_per_token: int = attrs.field(validator=int_at_least(1))  # prices every transfer: 0 made them free
    first_token_overhead_s: float = attrs.field(default=0.0)

    @first_token_overhead_s.validator
    def _check_overhead(self, _attribute: object, value: float) -> None:
        require_number("first_token_overhead_s", value, minimum=0)

    def decide_local(self, view: PrefillView, query: RouteQuery, now: float) -> RouteDecision:
        """The decision to prefill on `view` with the prefix it holds itself (no transfer)."""
        return self.decide(
            view, query, now, prefix_blocks=query.prefix_blocks.get(view.instance_id, 0), transfer_from=None
        )

    def decide(
        self,
        view: PrefillView,
        query: RouteQuery,
        now: float,
        *,
        prefix_blocks: int,
        transfer_from: InstanceId | None,
        congestion: int = 0,
        keep_copy: bool = True,
        transfer_s: float | None = None,
        prefill_s: float | None = None,
        queue_s: float | None = None,
    ) -> RouteDecision:
        """The decision to prefill on `view` using `prefix_blocks` (moved from `transfer_from` if given,
        the copy kept there afterwards if `keep_copy`). `transfer_s`, `prefill_s` and `queue_s`, if given,
        are those terms as the caller already computed them (with this estimator, for the same arguments
        and `view.queue_s(now)`: a router that compared plans), so that they are not computed twice."""
        prefix = query.prefix_tokens(prefix_blocks)
        plan = None
        if transfer_from is None:
            transfer_s = 0.0
        else:
            # Only the blocks the prefill will reuse move (both counts are whole blocks).
            moved_tokens = prefix - query.prefix_tokens(query.prefix_blocks.get(view.instance_id, 0))
            blocks = moved_tokens // query.block_size_tokens
            num_bytes = moved_tokens * self.kv_bytes_per_token
            if transfer_s is None:
                transfer_s = self.transfer.transfer_s(num_bytes, in_flight_from_source=congestion)
            plan = TransferPlan(
                source=transfer_from,
                num_blocks=blocks,
                num_bytes=num_bytes,
                transfer_s=transfer_s,
                keep_local_copy=keep_copy,
            )
        if prefill_s is None:
            prefill_s = self.prefill.prefill_s(query.input_tokens, prefix)
        return RouteDecision(
            prefill_instance=view.instance_id,
            prefix_tokens=prefix,
            transfer=plan,
            transfer_s=transfer_s,
            queue_s=view.queue_s(now) if queue_s is None else queue_s,
            prefill_s=prefill_s,
            overhead_s=self.first_token_overhead_s,
            occupancy_s=occupancy_s(self.prefill, query.input_tokens, prefix, prefill_s=prefill_s),
            # Only a pipeline's prefill can start before the work ahead has ended.
            drain_s=view.drain_s(now) if isinstance(self.prefill, ChunkedPipelineCost) else 0.0,
            handoff_s=self.transfer.handoff_s(query.input_tokens * self.kv_bytes_per_token, prefill_s),
        )


class Router(Protocol):
    """Chooses the prefill instance for a request, and may learn from how its choices turned out."""

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        """A decision among `candidates` (instances that are up), or None when there are none.

        Raises:
            InvalidRequestError: arguments `_check_route` refuses (each router here calls it first).
        """

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """A request it routed finished its prefill: the time from its scheduling to that end as estimated (the
        TTFT less the first token's overhead) and as observed (a router that does not learn ignores it)."""


def _check_route(candidates: object, query: object, now: object) -> None:
    """What every router's `route` refuses, alike, before it reads anything: a `now` that is no finite time (a NaN
    timed every instance at a NaN TTFT, which `ttft > slo` lets through), a `query` that is no `RouteQuery` (whose
    counts were checked when it was built), `candidates` that are no sequence of `PrefillView`s (None too: no
    instance up is an empty sequence, whose decision is None) or that name an instance twice. O(1) on a
    `PrefillBoard`, the Conductor's.

    Raises:
        InvalidRequestError: naming the argument and its value.
    """
    if type(now) is not float or not math.isfinite(now):  # the common case, a finite float, is one test
        require_number("now", now, minimum=-math.inf, error=InvalidRequestError)
    if not isinstance(query, RouteQuery):
        raise InvalidRequestError(f"query must be a RouteQuery, got {shown(query)}")
    if not isinstance(candidates, PrefillBoard):  # a board checked its views when it was built
        if not isinstance(candidates, Sequence) or not all(isinstance(view, PrefillView) for view in candidates):
            raise InvalidRequestError(f"candidates must be a sequence of PrefillView, got {shown(candidates)}")
        check_one_view_each([view.instance_id for view in candidates])


@attrs.define
class AdaptiveThreshold:
    """Online tuning of `kvcache_balancing_threshold` from observed TTFT.

    Keeps an exponentially weighted mean of observed / estimated TTFT for
    decisions with a transfer and without; once both kinds have been observed,
    moves the threshold after each observation by
    ``exp(rate · (transfer_ratio − local_ratio))``, clamped to [minimum,
    maximum]. Transfers that run late push the threshold up (fewer transfers);
    transfers that beat their estimate bring it down. (Before both kinds are
    seen, one ratio is only its prior: a drift of the other would move the
    threshold with no evidence about transfers at all.)
    """

    value: float = DEFAULT_THRESHOLD
    rate: float = 0.5
    smoothing: float = 0.1
    minimum: float = 1.0
    maximum: float = 64.0
    transfer_ratio: float = 1.0
    local_ratio: float = 1.0
    transfers_observed: int = 0
    locals_observed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("rate", "smoothing"):
            require_number(name, getattr(self, name), minimum=0, strict=True)
        if self.smoothing > 1:  # a weight of the newest observation
            raise ConfigError(f"smoothing must be in (0, 1], got {shown(self.smoothing)}")
        for name in ("value", "minimum", "maximum"):  # thresholds: ratios of prefix lengths, as the router's
            require_number(name, getattr(self, name), minimum=1)
        if not self.minimum <= self.value <= self.maximum:
            raise ConfigError(
                f"value must lie in [minimum, maximum] = [{self.minimum}, {self.maximum}], got {shown(self.value)}"
            )

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """Learn from one request's outcome (an observed TTFT below 0, from a clock that stepped back, or not
        finite teaches nothing; nor does an estimate that is not a finite time > 0)."""
        if not 0 < estimated_ttft_s < math.inf or not 0 <= observed_ttft_s < math.inf:
            return
        ratio = min(observed_ttft_s / estimated_ttft_s, 100.0)
        if had_transfer:
            self.transfer_ratio += self.smoothing * (ratio - self.transfer_ratio)
            self.transfers_observed += 1
        else:
            self.local_ratio += self.smoothing * (ratio - self.local_ratio)
            self.locals_observed += 1
        if not (self.transfers_observed and self.locals_observed):
            return
        # Clamped: one wildly late request must neither overflow nor swing the threshold to a bound.
        factor = math.exp(max(-1.0, min(1.0, self.rate * (self.transfer_ratio - self.local_ratio))))
        self.value = min(self.maximum, max(self.minimum, self.value * factor))


@attrs.define
class KvCacheCentricRouter:
    """Algorithm 1 (see the module docstring). `threshold=math.inf` never transfers."""

    estimator: TtftEstimator
    threshold: float = attrs.field(default=DEFAULT_THRESHOLD)
    adaptive: AdaptiveThreshold | None = None
    replica_fraction: float = attrs.field(default=0.5)

    @threshold.validator
    def _check_threshold(self, _attribute: object, value: float) -> None:
        if not is_threshold(value):
            raise ConfigError(f"threshold must be a number >= 1, or math.inf (never transfer), got {shown(value)}")

    @replica_fraction.validator
    def _check_fraction(self, _attribute: object, value: float) -> None:
        require_number("replica_fraction", value, minimum=0, strict=True)

    def __attrs_post_init__(self) -> None:
        if self.adaptive is not None and self.threshold != DEFAULT_THRESHOLD:
            raise ConfigError(
                f"threshold {shown(self.threshold)} is not used with an adaptive threshold, which sets it: start that one"
                " at it instead (AdaptiveThreshold(value=...))"
            )

    def max_replicas(self, num_instances: int) -> int:
        """How many instances may hold a hot prefix before a receiver stops keeping its copy."""
        return max(2, math.ceil(self.replica_fraction * num_instances))

    @property
    def current_threshold(self) -> float:
        return self.adaptive.value if self.adaptive is not None else self.threshold

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """Teach the adaptive threshold, if there is one."""
        if self.adaptive is not None:
            self.adaptive.observe(
                had_transfer=had_transfer, estimated_ttft_s=estimated_ttft_s, observed_ttft_s=observed_ttft_s
            )

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        # Instances holding the same prefix length cost the same apart from their queue (the
        # plan depends on the instance only through its length, and TTFT never falls as the
        # queue grows), so one scan finds the shortest queue (ties: the highest weight, then id)
        # per length, and only those few are planned and compared. The weights are computed only
        # where a tie needs them (a busy cluster's queues seldom tie; idle instances always do).
        # Chunked-pipeline groups are all planned: there the work ahead's end counts too
        # (`RouteDecision.prefill_end_s`), which the queue alone does not order (and groups are few).
        _check_route(candidates, query, now)
        board = candidates if isinstance(candidates, PrefillBoard) else PrefillBoard(candidates)
        if not len(board):
            return None
        own = _blocks_of(query.prefix_blocks, board)
        busy = board.busy_until_s
        estimator = self.estimator
        pipelined = isinstance(estimator.prefill, ChunkedPipelineCost)
        scan = kernels(_KERNELS)
        weight: npt.NDArray[np.float64] | None = None
        if pipelined:
            shortest = np.arange(len(board))
        else:
            shortest, shared = scan.shortest_by_length(own, busy, now, _UNWEIGHED)
            if shared:
                weight = _spread_weights(query.block_keys, own, board.instance_ids)
                shortest, _ = scan.shortest_by_length(own, busy, now, weight)
        threshold = self.current_threshold
        # Prefixes count as far as a prefill reuses them (never the block of the prompt's last token), so
        # that a holder of the whole prompt and one lacking only its last block tie, and nothing moves for it.
        usable = query.reusable_tokens // query.block_size_tokens
        best, best_blocks = query.best_instance, min(query.best_blocks, usable)
        best_tokens = query.prefix_tokens(best_blocks)
        # Each planned instance holds a different prefix length, so its own prefill and transfer are
        # computed once; the prefill from the best holder's prefix, which several may use (the best
        # holder itself and those that fetch it), once per request.
        prefill_at_best = -1.0
        fastest = (math.inf, math.inf)
        # Each planned instance at the fastest (TTFT, queue): (slot, blocks, moves, transfer s, prefill s).
        tied: list[tuple[int, int, bool, float, float]] = []
        for slot in shortest.tolist():
            held = min(int(own[slot]), usable)
            # best_len / prefix_len, with an instance holding nothing at ratio ∞ (which no
            # finite threshold stops and an infinite one does: then nothing ever moves).
            moves = (
                best is not None
                and best_blocks > held
                and (best_blocks / held if held else math.inf) > threshold
                and best != board.instance_ids[slot]
            )
            blocks = best_blocks if moves else held
            if blocks != best_blocks:
                prefill = estimator.prefill.prefill_s(query.input_tokens, query.prefix_tokens(blocks))
            else:
                if prefill_at_best < 0:
                    prefill_at_best = estimator.prefill.prefill_s(query.input_tokens, best_tokens)
                prefill = prefill_at_best
            moving = 0.0
            if moves:
                moved = best_tokens - query.prefix_tokens(held)
                moving = estimator.transfer.transfer_s(
                    moved * estimator.kv_bytes_per_token, in_flight_from_source=query.best_transfers_in_flight
                )
            waiting = max(float(busy[slot]) - now, 0.0)  # view.queue_s(now), from the board
            # RouteDecision.prefill_end_s, from the board: elsewhere than on a group the work ahead ends as the
            # queue does and the prefill holds the instance throughout
            drain, hold = waiting, prefill
            if pipelined:
                drain = max(float(board.drained_s[slot]) - now, 0.0)
                hold = occupancy_s(estimator.prefill, query.input_tokens, query.prefix_tokens(blocks))
            end = prefill_end_s(max(moving, waiting), prefill, hold, drain)
            key = (end, waiting)
            if key < fastest:
                fastest, tied = key, [(slot, blocks, moves, moving, prefill)]
            elif key == fastest:
                tied.append((slot, blocks, moves, moving, prefill))
        if not tied:  # every estimate was NaN (no comparison holds): a model's fault, said here, not an IndexError
            raise ConfigError(
                f"the estimator timed no instance as a number (prefill model {shown(estimator.prefill)}, transfer model"
                f" {shown(estimator.transfer)}): a model returned NaN"
            )
        if len(tied) > 1:  # equal TTFT and queue: the longest own prefix, the heaviest weight, the smallest id
            if weight is None:
                weight = _spread_weights(query.block_keys, own, board.instance_ids)
            tied.sort(
                key=lambda entry: (
                    -min(int(own[entry[0]]), usable),
                    -float(weight[entry[0]]),
                    board.instance_ids[entry[0]],
                )
            )
        slot, blocks, moves, moving, prefill = tied[0]
        return estimator.decide(
            board.slot_views[slot],
            query,
            now,
            prefix_blocks=blocks,
            transfer_from=best if moves else None,
            congestion=query.best_transfers_in_flight,
            keep_copy=query.best_holders < self.max_replicas(len(board)),
            transfer_s=moving if moves else None,
            prefill_s=prefill,
            queue_s=fastest[1],
        )


def local_cache_aware_router(estimator: TtftEstimator) -> KvCacheCentricRouter:
    """The ablation that uses only each instance's own cache: Algorithm 1 with transfers forbidden."""
    return KvCacheCentricRouter(estimator=estimator, threshold=math.inf)


@attrs.define
class LoadBalancingRouter:
    """The instance with the shortest queue (ties: id); it uses whatever prefix it holds."""

    estimator: TtftEstimator

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        _check_route(candidates, query, now)
        if not candidates:
            return None
        view = min(candidates, key=lambda v: (v.queue_s(now), v.instance_id))
        return self.estimator.decide_local(view, query, now)

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """Nothing to learn."""


@attrs.define
class RandomRouter:
    """A uniformly random instance (drawn from the caller's seeded generator).

    The draw indexes the candidates in id order, so the same draw picks the same instance whatever order they
    were added in."""

    estimator: TtftEstimator

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        _check_route(candidates, query, now)
        if not candidates:
            return None
        ordered = (
            candidates.slot_views  # a board's slots are in id order already
            if isinstance(candidates, PrefillBoard)
            else sorted(candidates, key=lambda view: view.instance_id)
        )
        return self.estimator.decide_local(ordered[rng.randrange(len(ordered))], query, now)

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """Nothing to learn."""


@attrs.define
class RoundRobinRouter:
    """The instances up, in id order, one after another: the next one after the last chosen (by id, so an
    instance going down or coming back does not reset the turn); it uses whatever prefix it holds."""

    estimator: TtftEstimator
    last: InstanceId | None = None

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        _check_route(candidates, query, now)
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda view: view.instance_id)
        view = ordered[0]
        if self.last is not None:
            view = next((v for v in ordered if v.instance_id > self.last), ordered[0])
        self.last = view.instance_id
        return self.estimator.decide_local(view, query, now)

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """Nothing to learn."""
