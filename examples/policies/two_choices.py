"""A router in a dozen lines: the power of two choices, with cache affinity (docs/simulation.md).

    python examples/experiments.py scheduling \
        --routers kvcache_centric,load_balancing,examples/policies/two_choices.py:TwoChoices
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs

from mooncake.sched.router import RouteDecision, RouteQuery, TtftEstimator
from mooncake.sched.view import PrefillView


@attrs.define
class TwoChoices:
    """Draw two prefill instances at random; keep the one whose own cache gives the lower estimated TTFT."""

    estimator: TtftEstimator

    def route(
        self, candidates: Sequence[PrefillView], query: RouteQuery, now: float, rng: random.Random
    ) -> RouteDecision | None:
        if not candidates:
            return None
        drawn = rng.sample(list(candidates), min(2, len(candidates)))
        decisions = [self.estimator.decide_local(v, query, now) for v in drawn]
        return min(decisions, key=lambda d: (d.ttft_s, d.prefill_instance))

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        """It does not learn."""
