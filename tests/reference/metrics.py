"""The replay summary computed record by record, for tests.

`reference_summary` is `summarize` as a loop over `RequestRecord`s with Python
sums in record order: the columnar `summarize` must give exactly these figures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mooncake.sched.outcome import Outcome
from mooncake.sim.metrics import RequestRecord, Summary
from mooncake.types import Slo

__all__ = ["reference_summary"]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def reference_summary(records: Sequence[RequestRecord], slo: Slo, *, sim_wall_s: float = 0.0) -> Summary:
    completed = [r for r in records if r.outcome == Outcome.COMPLETED]
    # Refused after its prefill: no first token (its client got none), but prefilled.
    prefilled = [r for r in records if r.first_token_s is not None or r.outcome == Outcome.REJECTED_AFTER_PREFILL]
    # A completion without a first token has no TTFT to meet.
    within = [r for r in completed if r.ttft_s is not None and r.ttft_s <= slo.ttft_s and r.tbt_s <= slo.tbt_s]
    arrivals = [r.arrival_s for r in records]
    ends = [r.finish_s for r in records if r.finish_s is not None]  # the last answer of any kind
    span = (max(ends) if ends else 0.0) - (min(arrivals) if arrivals else 0.0)
    input_tokens = sum(r.input_tokens for r in prefilled)
    return Summary(
        num_requests=len(records),
        completed=len(completed),
        rejected_before_prefill=sum(1 for r in records if r.outcome == Outcome.REJECTED_BEFORE_PREFILL),
        rejected_after_prefill=sum(1 for r in records if r.outcome == Outcome.REJECTED_AFTER_PREFILL),
        wasted_prefill_s=sum(r.prefill_s for r in records if r.outcome == Outcome.REJECTED_AFTER_PREFILL),
        ttft_s=_percentiles([r.ttft_s for r in completed if r.ttft_s is not None]),
        tbt_s=_percentiles([r.tbt_s for r in completed if r.output_tokens > 1]),  # one token has no interval
        slo_attainment=len(within) / len(records) if records else 0.0,
        goodput_rps=len(within) / span if span > 0 else 0.0,
        cache_hit_ratio=sum(r.prefix_tokens for r in prefilled) / input_tokens if input_tokens else 0.0,
        mean_prefill_s=float(np.mean([r.prefill_s for r in prefilled])) if prefilled else 0.0,
        sim_wall_s=sim_wall_s,
    )
