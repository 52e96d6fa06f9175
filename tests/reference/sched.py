"""Brute-force models of the scheduling rules, for tests.

- `should_transfer`: the ratio rule of Algorithm 1 as the issue states it
  (transfer iff best_len / own > threshold, own == 0 counting as an infinite
  ratio when best_len > 0, and only from another instance with more blocks).
- `reference_route`: every candidate's decision under that rule with the
  router's own estimator, and the minimum by (TTFT, queue, id).
- `reference_local_route`: the local-cache-aware ablation (never a transfer).
- `reference_decode`: the decode instance with the lowest TBT / SLO among
  those up with room, ties by id.
- `HoldingsModel`: which keys each instance's cache holds, and each one's
  contiguous prefix of a chain (what the index's match should say).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from mooncake.sched.cost import DecodeCostModel
from mooncake.sched.decode import DecodeChoice
from mooncake.sched.predictor import DecodeLoad
from mooncake.sched.router import RouteDecision, RouteQuery, TtftEstimator
from mooncake.sched.view import DecodeView, PrefillView
from mooncake.types import BlockKey, InstanceId

__all__ = [
    "HoldingsModel",
    "reference_decode",
    "reference_local_route",
    "reference_route",
    "should_transfer",
]


def should_transfer(
    *, instance: InstanceId, own_blocks: int, best_instance: InstanceId | None, best_blocks: int, threshold: float
) -> bool:
    """Algorithm 1's choice for one instance: move the best holder's prefix here?"""
    if best_instance is None or best_instance == instance or best_blocks <= own_blocks:
        return False
    ratio = math.inf if own_blocks == 0 else best_blocks / own_blocks
    return ratio > threshold


def _key(decision: RouteDecision) -> tuple[float, float, str]:
    return (decision.ttft_s, decision.queue_s, decision.prefill_instance)


def reference_route(
    estimator: TtftEstimator,
    candidates: Sequence[PrefillView],
    query: RouteQuery,
    now: float,
    *,
    threshold: float,
) -> tuple[RouteDecision | None, list[RouteDecision]]:
    """The chosen decision and every candidate's decision, computed one by one."""
    best = query.best_instance
    congestion = query.best_transfers_in_flight
    decisions = []
    for view in candidates:
        own = query.prefix_blocks.get(view.instance_id, 0)
        if should_transfer(
            instance=view.instance_id,
            own_blocks=own,
            best_instance=best,
            best_blocks=query.best_blocks,
            threshold=threshold,
        ):
            decision = estimator.decide(
                view, query, now, prefix_blocks=query.best_blocks, transfer_from=best, congestion=congestion
            )
        else:
            decision = estimator.decide(view, query, now, prefix_blocks=own, transfer_from=None)
        decisions.append(decision)
    chosen = min(decisions, key=_key) if decisions else None
    return chosen, decisions


def reference_local_route(
    estimator: TtftEstimator, candidates: Sequence[PrefillView], query: RouteQuery, now: float
) -> RouteDecision | None:
    """The local-cache-aware ablation: each instance uses only its own prefix."""
    decisions = [
        estimator.decide(
            view, query, now, prefix_blocks=query.prefix_blocks.get(view.instance_id, 0), transfer_from=None
        )
        for view in candidates
    ]
    return min(decisions, key=_key) if decisions else None


def reference_decode(
    views: Sequence[DecodeView],
    *,
    context_tokens: int,
    output_tokens: int,
    cost: DecodeCostModel,
    tbt_slo_s: float,
    loads: Mapping[InstanceId, DecodeLoad],
) -> DecodeChoice | None:
    """Brute force over the decode instances that are up with room."""
    options = []
    for view in views:
        if (
            not view.is_up
            or view.capacity_tokens - view.used_tokens - view.reserved_tokens < context_tokens + output_tokens
        ):
            continue
        load = loads[view.instance_id]
        tbt = cost.step_s(round(load.batch_size) + 1, int(load.context_tokens) + context_tokens)
        options.append((tbt / tbt_slo_s, view.instance_id, tbt))
    if not options:
        return None
    _, instance, tbt = min(options)
    return DecodeChoice(decode_instance=instance, tbt_s=tbt)


@attrs.define
class HoldingsModel:
    """Keys per instance, as the caches hold them."""

    keys: dict[InstanceId, set[BlockKey]] = attrs.field(factory=dict)

    def store(self, instance: InstanceId, keys: Iterable[BlockKey]) -> None:
        self.keys.setdefault(instance, set()).update(keys)

    def clear(self, instance: InstanceId) -> None:
        self.keys.pop(instance, None)

    def prefix_blocks(self, instance: InstanceId, chain: Sequence[BlockKey]) -> int:
        held = self.keys.get(instance, set())
        count = 0
        for key in chain:
            if key not in held:
                break
            count += 1
        return count

    def best(self, instances: Iterable[InstanceId], chain: Sequence[BlockKey]) -> tuple[InstanceId | None, int]:
        """The longest holder among `instances` (ties: smallest id) and its length; (None, 0) if none holds any."""
        lengths = {i: self.prefix_blocks(i, chain) for i in instances}
        lengths = {i: n for i, n in lengths.items() if n > 0}
        if not lengths:
            return None, 0
        best = min(lengths, key=lambda i: (-lengths[i], i))
        return best, lengths[best]
