"""`sched.cost.prefill_end_s` against a chunked-pipeline group simulated chunk by chunk, stage by stage.

Property: for any sequence of prompts entering a group (each no earlier than its release and than the one ahead
has left the first stage), the end that `prefill_end_s` gives from the prompt's start, its own times and the end
of the one ahead is the flow shop's: chunk j of a prompt leaves stage s at max(when it left stage s - 1, when the
chunk before it left stage s) + its stage time. So a short prompt behind a long one never ends first.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.sched.cost import HARDWARE, MODELS, ChunkedPipelineCost, PrefillCostModel, occupancy_s, prefill_end_s

BASE = PrefillCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])


def chunk_stage_times(group: ChunkedPipelineCost, num_tokens: int, prefix_tokens: int) -> list[float]:
    """Each chunk's time on one stage, as the group's docstring defines it (the base model's added time, at the
    slowest stage's share of the layers, `stage_share`)."""
    times, done, before = [], prefix_tokens, 0.0
    while done < num_tokens:
        end = min(num_tokens, done + group.chunk_tokens)
        upto = BASE.prefill_s(end, prefix_tokens)
        times.append((upto - before) * group.stage_share)
        done, before = end, upto
    return times


@settings(max_examples=150)
@given(
    group_size=st.integers(1, 5),
    chunk_tokens=st.sampled_from([512, 2048, 4096]),
    prompts=st.lists(
        st.tuples(st.integers(1, 40_000), st.integers(0, 100), st.floats(0.0, 3.0)), min_size=1, max_size=6
    ),
)
def test_the_end_is_the_flow_shops(group_size: int, chunk_tokens: int, prompts: list[tuple[int, int, float]]) -> None:
    group = ChunkedPipelineCost(base=BASE, group_size=group_size, chunk_tokens=chunk_tokens)
    free = [-math.inf] * group_size  # when each stage has finished its last chunk
    release, first_stage_free, ahead_end = 0.0, -math.inf, -math.inf
    for tokens, prefix_percent, gap in prompts:
        prefix = tokens * prefix_percent // 100 if prefix_percent < 100 else tokens - 1
        release += gap
        start = max(release, first_stage_free)
        # Chunk by chunk through the stages.
        for stage_time in chunk_stage_times(group, tokens, prefix):
            leaves = start
            for stage in range(group_size):
                leaves = free[stage] = max(free[stage], leaves) + stage_time
        flow_shop_end = free[-1]
        own = group.prefill_s(tokens, prefix)
        hold = occupancy_s(group, tokens, prefix)
        end = prefill_end_s(start, own, hold, ahead_end)
        assert math.isclose(end, flow_shop_end, rel_tol=1e-9, abs_tol=1e-12), (end, flow_shop_end)
        assert end >= ahead_end  # no overtaking
        first_stage_free, ahead_end = start + hold, end
        assert math.isclose(first_stage_free, free[0], rel_tol=1e-9, abs_tol=1e-12)


@given(st.floats(0, 100), st.floats(0, 10), st.floats(-math.inf, 100))
def test_an_instance_held_throughout_ends_its_prefill_after_it(start: float, prefill: float, ahead: float) -> None:
    """Occupancy = prefill (no pipeline): a prefill that starts once the work ahead ended takes its own time."""
    if ahead <= start:
        assert prefill_end_s(start, prefill, prefill, ahead) == start + prefill
