"""Compile (or load from numba's disk cache) every numba kernel: the index's and hasher's
(`mooncake.cache.warm_up`) and the Conductor's scans (`mooncake.sched._kernels`).

    python -m mooncake.sched.warm_up

`make` runs it once after installing, so no process pays compilation later.
Without numba there is nothing to compile and it returns at once.
"""

from __future__ import annotations

import random

import numpy as np

from mooncake.cache import warm_up as cache_warm_up
from mooncake.cache._compiled import is_compiled
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.decode import choose_decode
from mooncake.sched.join import DecodeLimits
from mooncake.sched.pending import PendingBlocks
from mooncake.sched.router import KvCacheCentricRouter, PrefixBlocks, RouteQuery, TtftEstimator
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import DecodeBoard, DecodeView, PrefillBoard, PrefillView
from mooncake.types import BlockKey, InstanceId

__all__ = ["main"]


def main() -> None:
    """Exercise each compiled kernel once, through the calls that use it, on a two-instance board."""
    cache_warm_up.main()
    if not is_compiled():
        return
    model, hardware = MODELS["llama3-70b"], HARDWARE["8xA800"]
    decode = DecodeBoard([DecodeView(InstanceId(f"d{i}"), DecodeLimits(kv_capacity_tokens=10**6)) for i in range(2)])
    step = DecodeCostModel(model=model, hardware=hardware)
    choose_decode(decode, prompt_tokens=8, output_tokens=4, step_model=step, tbt_slo_s=1.0)
    prefill = PrefillBoard([PrefillView(InstanceId(f"p{i}")) for i in range(2)])
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=model, hardware=hardware),
        transfer=TransferCostModel(bandwidth_bytes_per_s=hardware.nic_bytes_per_s),
        kv_bytes_per_token=model.kv_bytes_per_token,
    )
    held = PrefixBlocks(prefill.instance_ids, np.ones(2, dtype=np.int64), prefill.slot)  # a tie: the weighed scan too
    query = RouteQuery(input_tokens=8, block_size_tokens=4, prefix_blocks=held, block_keys=(BlockKey(1), BlockKey(2)))
    KvCacheCentricRouter(estimator=estimator).route(prefill, query, 0.0, random.Random(0))
    pending = PendingBlocks(capacity=1)
    keys = np.arange(1, 40, dtype=np.uint64)
    pending.add(0, keys)  # also grows: rehash
    pending.walk(keys, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
    pending.count(0, 1)
    pending.remove(0, keys)


if __name__ == "__main__":
    main()
