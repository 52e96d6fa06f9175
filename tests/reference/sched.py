"""Brute-force models of the scheduling rules, for tests.

- `should_transfer`: the ratio rule of Algorithm 1 as the issue states it
  (transfer iff best_len / own > threshold, own == 0 counting as an infinite
  ratio when best_len > 0, and only from another instance with more blocks);
  `reference_route` applies it to prefixes counted as far as a prefill reuses
  them (`usable_blocks`: never the block holding the prompt's last token).
- `reference_route`: every candidate's decision under that rule, each term
  from the cost models' own answers (`prefill_s`, `transfer_s`, `handoff_s`, a
  chunked group's `occupancy_s`) and the view's queue, never from the
  router's estimator; the minimum by (`documented_ttft_s`, queue, longest own
  usable prefix, heaviest `rendezvous_weight`, id).
- `documented_ttft_s`: docs/scheduling.md's TTFT of a decision's terms, max(max(T_transfer,
  T_queue) + T_prefill, T_drain + T_occupancy) + overhead.
- `rendezvous_weight`: splitmix64 of the key of the first block an instance
  lacks (the last key if it holds them all) xor XXH3-64 of its id, in Python
  integers.
- `reference_local_route`: the local-cache-aware ablation (never a transfer).
- `reference_decode`: the decode rule (`reference_verdict`) on each instance
  that is up, against the load asked about, and the lowest committed step time
  among those it lets in, ties by id.
- `reference_verdict`: the decode rule itself, check by check.
- `HoldingsModel`: which keys each instance's cache holds, and each one's
  contiguous prefix of a chain (what the index's match should say).

None of them calls what it models (`check_join`, `TtftEstimator`, `spread_weights`): a reference that did
would agree with the library whatever the library did.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import xxhash

from mooncake.sched.cost import ChunkedPipelineCost
from mooncake.sched.decode import DecodeChoice
from mooncake.sched.join import DecodeLimits, DecodeLoad, JoinVerdict
from mooncake.sched.outcome import Reason
from mooncake.sched.router import RouteDecision, RouteQuery, TransferPlan, TtftEstimator
from mooncake.sched.step import StepModel
from mooncake.sched.view import DecodeView, PrefillView
from mooncake.types import BlockKey, InstanceId

__all__ = [
    "HoldingsModel",
    "documented_ttft_s",
    "reference_decode",
    "reference_local_route",
    "reference_route",
    "reference_verdict",
    "rendezvous_weight",
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


def rendezvous_weight(key: int, instance: str) -> float:
    """An instance's rendezvous weight for `key` (a key below 2**64), written out in Python integers: splitmix64's
    finalizer of (key xor XXH3-64 of the id) plus the golden gamma, its top 53 bits as a fraction of 1."""
    mask = 2**64 - 1
    if not 0 <= key <= mask:
        raise ValueError(f"reference: keys wider than 64 bits (folded by the index) are not modelled, got {key}")
    x = ((key ^ xxhash.xxh3_64_intdigest(instance.encode())) + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return ((x ^ (x >> 31)) >> 11) / 2**53


def _weight(query: RouteQuery, instance: InstanceId) -> float:
    """The tie's rendezvous weight: of the key of the first block `instance` lacks (as many as it holds, not
    only those a prefill reuses; the last key if it holds them all); no keys: 0."""
    keys = [int(key) for key in query.block_keys]
    if not keys:
        return 0.0
    return rendezvous_weight(keys[min(query.prefix_blocks.get(instance, 0), len(keys) - 1)], instance)


def documented_ttft_s(decision: RouteDecision) -> float:
    """docs/scheduling.md's TTFT of a decision's terms: the transfer runs while the request waits in the queue,
    the prefill starts when both are over, and (a chunked-pipeline group) it cannot leave the last stage before
    the work ahead has: max(max(T_transfer, T_queue) + T_prefill, T_drain + T_occupancy) + overhead."""
    wait = max(decision.transfer_s, decision.queue_s)
    return max(wait + decision.prefill_s, decision.drain_s + decision.occupancy_s) + decision.overhead_s


def _key(decision: RouteDecision, query: RouteQuery) -> tuple[float, float, int, float, str]:
    instance = decision.prefill_instance
    held = query.prefix_blocks.get(instance, 0)
    return (
        documented_ttft_s(decision),
        decision.queue_s,
        -usable_blocks(query, held),
        -_weight(query, instance),
        instance,
    )


def _plan(
    estimator: TtftEstimator,
    view: PrefillView,
    query: RouteQuery,
    now: float,
    *,
    blocks: int,
    source: InstanceId | None = None,
    congestion: int = 0,
    keep_copy: bool = True,
) -> RouteDecision:
    """Prefilling on `view` with `blocks` usable blocks (moved from `source`, if given, but for those it holds):
    each term from the cost models and the view, as docs/scheduling.md composes them."""
    block_size = query.block_size_tokens
    own = usable_blocks(query, query.prefix_blocks.get(view.instance_id, 0))
    prefix_tokens = blocks * block_size
    kv_bytes = estimator.kv_bytes_per_token
    transfer, transfer_s = None, 0.0
    if source is not None:
        moved_bytes = (blocks - own) * block_size * kv_bytes
        transfer_s = estimator.transfer.transfer_s(moved_bytes, in_flight_from_source=congestion)
        transfer = TransferPlan(
            source=source,
            num_blocks=blocks - own,
            num_bytes=moved_bytes,
            transfer_s=transfer_s,
            keep_local_copy=keep_copy,
        )
    model = estimator.prefill
    prefill_s = model.prefill_s(query.input_tokens, prefix_tokens)
    pipelined = isinstance(model, ChunkedPipelineCost)
    return RouteDecision(
        prefill_instance=view.instance_id,
        prefix_tokens=prefix_tokens,
        transfer=transfer,
        transfer_s=transfer_s,
        queue_s=view.queue_s(now),
        prefill_s=prefill_s,
        overhead_s=estimator.first_token_overhead_s,
        # Elsewhere a prefill holds the instance throughout and starts once the work ahead has ended.
        occupancy_s=model.occupancy_s(query.input_tokens, prefix_tokens) if pipelined else prefill_s,
        drain_s=view.drain_s(now) if pipelined else 0.0,
        handoff_s=estimator.transfer.handoff_s(query.input_tokens * kv_bytes, prefill_s),
    )


def reference_route(
    estimator: TtftEstimator,
    candidates: Sequence[PrefillView],
    query: RouteQuery,
    now: float,
    *,
    threshold: float,
    replica_fraction: float = 0.5,
) -> tuple[RouteDecision | None, list[RouteDecision]]:
    """The chosen decision and every candidate's decision, computed one by one (`estimator` only holds the
    models: its own estimate is never asked)."""
    best = query.best_instance
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
            decision = _plan(
                estimator,
                view,
                query,
                now,
                blocks=best_blocks,
                source=best,
                congestion=query.best_transfers_in_flight,
                keep_copy=keep,
            )
        else:
            decision = _plan(estimator, view, query, now, blocks=own)
        decisions.append(decision)
    chosen = min(decisions, key=lambda d: _key(d, query)) if decisions else None
    return chosen, decisions


def reference_local_route(
    estimator: TtftEstimator, candidates: Sequence[PrefillView], query: RouteQuery, now: float
) -> RouteDecision | None:
    """The local-cache-aware ablation: each instance uses only its own prefix."""
    decisions = [
        _plan(estimator, view, query, now, blocks=usable_blocks(query, query.prefix_blocks.get(view.instance_id, 0)))
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
        structural = _join(view.limits, asked, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
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
        verdict = _join(
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
                _join(v.limits, empty, prompt_tokens=prompt_tokens, output_tokens=output_tokens).accepted for v in views
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


def _join(
    limits: DecodeLimits,
    load: DecodeLoad,
    *,
    prompt_tokens: int,
    output_tokens: int,
    step_model: StepModel | None = None,
    tbt_slo_s: float | None = None,
) -> JoinVerdict:
    """`reference_verdict` as the record the rule returns: refused by a check before TBT, no step predicted; else,
    with a step model, the step with the request added (on the load rounded), whether or not TBT was checked."""
    reason = reference_verdict(
        limits, load, prompt_tokens=prompt_tokens, output_tokens=output_tokens, step_model=None, tbt_slo_s=None
    )
    if reason is not None:
        return JoinVerdict(accepted=False, reason=reason)
    if step_model is None:
        return JoinVerdict(accepted=True)
    reason = reference_verdict(
        limits,
        load,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        step_model=step_model,
        tbt_slo_s=tbt_slo_s,
    )
    predicted = step_model.step_s(round(load.batch_size) + 1, round(load.context_tokens) + prompt_tokens)
    return JoinVerdict(accepted=reason is None, reason=reason, predicted_tbt_s=predicted)


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
