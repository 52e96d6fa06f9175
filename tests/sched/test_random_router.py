"""RandomRouter draws among the candidates in id order: the order instances were added in changes nothing."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache import BlockHasher
from mooncake.sched import HARDWARE, MODELS, RandomRouter, build_conductor
from mooncake.sched.cost import PrefillCostModel, TransferCostModel
from mooncake.sched.router import RouteQuery, TtftEstimator
from mooncake.sched.view import PrefillBoard, PrefillView
from mooncake.types import InstanceId, Request, RequestId

MODEL, GPUS = MODELS["llama3-70b"], HARDWARE["8xA800"]
HASHER = BlockHasher(model="llama3-70b", block_size_tokens=512)
IDS = ["p0", "p1", "p2", "p3", "p4"]


def choices(order: list[str], seed: int) -> list[str | None]:
    c = build_conductor(
        model=MODEL,
        hardware=GPUS,
        prefill_instances=order,
        decode_instances=["d0"],
        hasher=HASHER,
        router=RandomRouter,
        seed=seed,
    )
    out = []
    for i in range(8):
        tokens = list(range(i * 10**5, i * 10**5 + 3000))
        r = Request(
            request_id=RequestId(str(i)),
            arrival_s=0.0,
            input_length=3000,
            output_length=10,
            block_keys=HASHER.block_keys(tokens),
            block_size_tokens=512,
        )
        out.append(c.schedule(r, now=float(i)).prefill_instance)
    return out


@settings(max_examples=25, deadline=None)
@given(st.permutations(IDS), st.integers(0, 2**16))
def test_conductors_differing_only_in_insertion_order_route_alike(order: list[str], seed: int) -> None:
    """Two Conductors with the same instances and seed, added in different orders, make the same random choices
    (as every other router does): before, the draw indexed the insertion order."""
    assert choices(order, seed) == choices(sorted(IDS), seed)


def test_a_board_and_a_list_in_any_order_draw_the_same_instance() -> None:
    """The router's candidates as a board (the Conductor's) or as a plain sequence, in any order: the same
    generator state picks the same instance."""
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=MODEL, hardware=GPUS),
        transfer=TransferCostModel(bandwidth_bytes_per_s=GPUS.nic_bytes_per_s),
        kv_bytes_per_token=MODEL.kv_bytes_per_token,
    )
    router = RandomRouter(estimator)
    query = RouteQuery(input_tokens=1000, block_size_tokens=512, prefix_blocks={})
    views = [PrefillView(InstanceId(i)) for i in IDS]
    picked = set()
    for seed in range(20):
        answers = {
            router.route(candidates, query, 0.0, random.Random(seed)).prefill_instance  # type: ignore[union-attr]
            for candidates in (views, views[::-1], PrefillBoard(views[::-1]), PrefillBoard(views[2:] + views[:2]))
        }
        assert len(answers) == 1
        picked |= answers
    assert len(picked) > 1  # the draw still draws
