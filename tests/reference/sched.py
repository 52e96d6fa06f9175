"""Brute-force models of the scheduling rules, for tests.

- `should_transfer`: the ratio rule of Algorithm 1 as the issue states it
  (transfer iff best_len / own > threshold, own == 0 counting as an infinite
  ratio when best_len > 0, and only from another instance with more blocks);
  `reference_route` applies it to prefixes counted as far as a prefill reuses
  them (`usable_blocks`: never the block holding the prompt's last token).
- `reference_route`: every candidate's decision under that rule with the
  router's own estimator, and the minimum by (TTFT, queue, longest own usable
  prefix, heaviest rendezvous weight of the first block the instance lacks, id).
- `reference_local_route`: the local-cache-aware ablation (never a transfer).
- `reference_decode`: the decode rule on each instance that is up, against
  the load asked about, and the lowest committed step time among those it
  lets in, ties by id.
- `reference_verdict`: the decode rule itself, check by check.
- `HoldingsModel`: which keys each instance's cache holds, and each one's
  contiguous prefix of a chain (what the index's match should say).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from mooncake.sched.decode import DecodeChoice
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict, check_join
from mooncake.sched.outcome import Reason
from mooncake.sched.router import RouteDecision, RouteQuery, TtftEstimator, spread_weights
from mooncake.sched.step import StepModel
from mooncake.sched.view import DecodeView, PrefillView
from mooncake.types import BlockKey, InstanceId

__all__ = [
    "HoldingsModel",
    "reference_decode",
    "reference_local_route",
    "reference_route",
    "reference_verdict",
    "should_transfer",
    "usable_blocks",
]


def should_transfer(
    *, instance: InstanceId, own_blocks: int, best_instance: InstanceId | None, best_blocks: int, threshold: float
) -> bool:
    """Algorithm 1's choice for one instance: move the best holder's prefix here?"""
    if best_instance is None or best_instance == instance or best_blocks <= own_blocks:
        return False
    ratio = math.inf if own_blocks == 0 else best_blocks / own_blocks
    return ratio > threshold


def usable_blocks(query: RouteQuery, blocks: int) -> int:
    """`blocks` cached blocks as far as the prefill reuses them: the blocks before the one holding the
    prompt's last token (computed for the first token's logits)."""
    return min(blocks, (query.input_tokens - 1) // query.block_size_tokens)


def _key(decision: RouteDecision, query: RouteQuery) -> tuple[float, float, int, float, str]:
    instance = decision.prefill_instance
    held = query.prefix_blocks.get(instance, 0)
    own = np.array([held], dtype=np.int64)
    weight = float(spread_weights(query.block_keys, own, [instance])[0])  # one instance at a time
    return (decision.ttft_s, decision.queue_s, -usable_blocks(query, held), -weight, instance)


def reference_route(
    estimator: TtftEstimator,
    candidates: Sequence[PrefillView],
    query: RouteQuery,
    now: float,
    *,
    threshold: float,
    replica_fraction: float = 0.5,
) -> tuple[RouteDecision | None, list[RouteDecision]]:
    """The chosen decision and every candidate's decision, computed one by one."""
    best = query.best_instance
    congestion = query.best_transfers_in_flight
    best_blocks = usable_blocks(query, query.best_blocks)
    decisions = []
    for view in candidates:
        own = usable_blocks(query, query.prefix_blocks.get(view.instance_id, 0))
        if should_transfer(
            instance=view.instance_id,
            own_blocks=own,
            best_instance=best,
            best_blocks=best_blocks,
            threshold=threshold,
        ):
            keep = query.best_holders < max(2, math.ceil(replica_fraction * len(candidates)))
            decision = estimator.decide(
                view,
                query,
                now,
                prefix_blocks=best_blocks,
                transfer_from=best,
                congestion=congestion,
                keep_copy=keep,
            )
        else:
            decision = estimator.decide(view, query, now, prefix_blocks=own, transfer_from=None)
        decisions.append(decision)
    chosen = min(decisions, key=lambda d: _key(d, query)) if decisions else None
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
    return min(decisions, key=lambda d: _key(d, query)) if decisions else None


def reference_decode(
    views: Sequence[DecodeView],
    *,
    prompt_tokens: int,
    output_tokens: int,
    step_model: StepModel,
    tbt_slo_s: float,
    loads: Mapping[InstanceId, DecodeLoad] | None = None,
    now: float | None = None,
) -> DecodeChoice:
    """Brute force: the decode rule on each instance that is up, one at a time, against the load asked
    about (`loads`, rounded; default: what it is committed to); among those it lets in, TBT included, the
    lowest step time on the committed load with the request added, ties by id; where the TBT check refuses
    it on every instance the other checks let it into, the lowest of those, with the rule's verdict on the
    asked load (the TBT refusal); none: the reason most instances up give (ties: the earlier check) leaving out
    CONTEXT_TOO_LONG; with no other reason, NO_DECODE_INSTANCE when some instance, up or down, could hold the
    request alone or none is up, else CONTEXT_TOO_LONG. With `now`, the committed context (ranked, and asked about by
    default) counts the tokens the decoding requests generated: their decoding seconds over the step
    their batch runs, rounded down."""
    options = []
    reasons: collections.Counter[Reason] = collections.Counter()
    for view in views:
        if not view.is_up:
            continue
        asked = view.load() if loads is None else loads[view.instance_id]
        asked = DecodeLoad(round(asked.batch_size), round(asked.context_tokens), round(asked.kv_tokens))
        structural = check_join(view.limits, asked, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        if not structural.accepted:
            assert structural.reason is not None
            reasons[structural.reason] += 1
            continue
        committed = view.load()
        generated = _generated(view, step_model, now)
        if loads is None:
            asked = DecodeLoad(asked.batch_size, asked.context_tokens + generated, asked.kv_tokens)
        context = int(committed.context_tokens) + generated
        step = step_model.step_s(int(committed.batch_size) + 1, context + prompt_tokens)
        verdict = check_join(
            view.limits,
            asked,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            step_model=step_model,
            tbt_slo_s=tbt_slo_s,
        )
        options.append((not verdict.accepted, step, view.instance_id, verdict))
    if not options:
        reasons.pop(Reason.CONTEXT_TOO_LONG, None)  # the reasons of those that could take it once room frees
        order = list(Reason)
        if reasons:
            reason = min(reasons, key=lambda r: (-reasons[r], order.index(r)))
        else:
            empty = DecodeLoad(0, 0, 0)
            ever = any(
                check_join(v.limits, empty, prompt_tokens=prompt_tokens, output_tokens=output_tokens).accepted
                for v in views
            )
            up = any(v.is_up for v in views)
            reason = Reason.NO_DECODE_INSTANCE if ever or not up else Reason.CONTEXT_TOO_LONG
        return DecodeChoice(decode_instance=None, verdict=JoinVerdict(accepted=False, reason=reason))
    _, _, instance, verdict = min(options, key=lambda option: option[:3])
    return DecodeChoice(decode_instance=instance, verdict=verdict)


def _generated(view: DecodeView, step_model: StepModel, now: float | None) -> int:
    """Tokens the view's decoding requests generated by `now`, at the step their batch runs, at most their
    expected outputs (0 without `now`)."""
    batch = len(view.active)
    if now is None or not batch:
        return 0
    decoded_s, step_s = batch * now - view.started_s_sum, step_model.step_s(batch, view.context_tokens)
    return min(math.floor(decoded_s / step_s), view.output_tokens) if decoded_s > 0 and step_s > 0 else 0


def reference_verdict(
    limits: DecodeLimits,
    load: DecodeLoad,
    *,
    prompt_tokens: int,
    output_tokens: int,
    step_model: StepModel | None,
    tbt_slo_s: float | None,
) -> Reason | None:
    """The decode rule as its docstring states it, check by check: the first failing check's reason."""
    need = prompt_tokens + output_tokens
    if limits.max_context_tokens is not None and need > limits.max_context_tokens:
        return Reason.CONTEXT_TOO_LONG
    if output_tokens == 1:
        return None  # no slot taken, no KV kept
    if need > limits.kv_capacity_tokens:
        return Reason.CONTEXT_TOO_LONG  # more KV than the instance holds empty
    if limits.max_batch_size is not None and load.batch_size + 1 > limits.max_batch_size:
        return Reason.BATCH_FULL
    if load.kv_tokens + need > limits.kv_capacity_tokens:
        return Reason.KV_BUDGET
    if step_model is not None and tbt_slo_s is not None and load.batch_size > 0:
        step = step_model.step_s(round(load.batch_size) + 1, round(load.context_tokens) + prompt_tokens)
        if step > tbt_slo_s:
            return Reason.TBT_SLO
    return None


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
