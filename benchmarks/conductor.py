"""Conductor throughput: scheduling decisions per second with a large index.

    python benchmarks/conductor.py [--json] [--keys 1000000] [--decisions 20000]

For 16 prefill + 16 decode instances, and for 256 + 256 (512 instances), the
index holds `--keys` block keys (chains of 64, each held by one to three
prefill instances, as in benchmarks/index.py), and requests of 64 blocks (a
quarter of them diverging halfway, as a new turn would) are scheduled with the
KV-cache-centric router and early rejection. Only `schedule` is timed, in rounds
of 1,000 after a first, untimed round (numba loads its compiled kernels on the
first decision); between rounds the accepted requests are ended by events
(untimed), so queues and VRAM stay in a steady state. Once the index and the
Conductor are built, the process freezes its heap as a server does after
startup (`gc.freeze()`, as vLLM's `freeze_gc_heap`), so that the garbage
collector's full passes skip them; the requests and all that scheduling makes
stay collectable.

`decisions_per_s` is the headline, with a 30 s TTFT objective. The peer in
the same run is the same Conductor with an empty index (its lookup runs and
finds nothing: routing on empty prefixes). With nothing cached its 32 k-token
prompts would miss the TTFT objective and be rejected before most of the work
an accepted one costs, so it runs with no TTFT objective; and since a rejection
skips the accept path (queue, pending blocks, decode reservation), the share of
the time the match costs, `index_share`, compares it with a third run, indexed
and also with no TTFT objective (`decisions_per_s_without_ttft_objective`), not
with the headline. Each run prints the fraction of requests it accepted.
Goal: >= 20 k decisions/s at 16 + 16 instances.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np

from mooncake.cache.events import BlockStored
from mooncake.sched.admission import EarlyRejection
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, TtftEstimator
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import RequestAborted
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Slo, Tier
from mooncake.workload import TRACE_BLOCK_SIZE_TOKENS

BLOCKS = 64
BLOCK_TOKENS = TRACE_BLOCK_SIZE_TOKENS  # the published traces' block, as the paper's cluster keys them


TTFT_OBJECTIVE_S = 30.0
NO_TTFT_OBJECTIVE_S = 1e9  # seconds: nothing is estimated to take longer
MIN_LARGE_DECISIONS = 2000  # at 512 instances: a tenth of --decisions, but at least one timed round past the warm-up


def build(
    num_prefill: int, num_decode: int, num_keys: int, *, use_index: bool, ttft_s: float
) -> tuple[Conductor, list[list[int]]]:
    model, hardware = MODELS["llama3-70b"], HARDWARE["8xA800"]
    estimator = TtftEstimator(
        prefill=PrefillCostModel(model=model, hardware=hardware),
        transfer=TransferCostModel(bandwidth_bytes_per_s=hardware.nic_bytes_per_s),
        kv_bytes_per_token=model.kv_bytes_per_token,
    )
    conductor = Conductor(
        router=KvCacheCentricRouter(estimator=estimator),
        step_model=DecodeCostModel(model=model, hardware=hardware),
        admission=EarlyRejection(),
        predictor=UniformDecodePredictor(decode_s=20.0),
        slo=Slo(ttft_s=ttft_s, tbt_s=0.2),
        block_size_tokens=BLOCK_TOKENS,
    )
    for i in range(num_prefill):
        conductor.add_prefill_instance(InstanceId(f"prefill-{i}"))
    for i in range(num_decode):
        conductor.add_decode_instance(InstanceId(f"decode-{i}"), DecodeLimits(kv_capacity_tokens=10**9))
    rng = np.random.default_rng(0)
    num_chains = num_keys // BLOCKS
    chains = rng.integers(0, 2**63, size=(num_chains, BLOCKS), dtype=np.uint64).tolist()
    if use_index:
        seq = [0] * num_prefill
        for chain in chains:
            for i, owner in enumerate(rng.choice(num_prefill, size=int(rng.integers(1, 4)), replace=False).tolist()):
                length = BLOCKS if i == 0 else int(rng.integers(1, BLOCKS + 1))
                conductor.apply_cache_event(
                    BlockStored(
                        source=InstanceId(f"prefill-{owner}"), seq=seq[owner], keys=chain[:length], tier=Tier.DRAM
                    )
                )
                seq[owner] += 1
    return conductor, chains


def decisions_per_s(
    num_prefill: int, num_decode: int, num_keys: int, decisions: int, *, use_index: bool, ttft_s: float
) -> tuple[float, float]:
    """(decisions per second, fraction accepted)."""
    conductor, chains = build(num_prefill, num_decode, num_keys, use_index=use_index, ttft_s=ttft_s)
    # As a server does once started (vLLM's freeze_gc_heap): what startup built moves to the permanent
    # generation, which collections skip. The requests made below stay collectable.
    gc.collect()
    gc.freeze()
    rng = np.random.default_rng(1)
    requests = []
    for n in range(decisions):
        keys = chains[int(rng.integers(len(chains)))]
        if n % 4 == 0:
            keys = keys[: BLOCKS // 2] + rng.integers(0, 2**63, size=BLOCKS // 2, dtype=np.uint64).tolist()
        requests.append(
            Request(
                request_id=RequestId(str(n)),
                arrival_s=n * 0.001,
                input_length=BLOCKS * BLOCK_TOKENS,
                output_length=200,
                block_keys=tuple(BlockKey(k) for k in keys),
            )
        )
    timed = 0.0
    accepted = 0
    round_size = max(1, min(1000, decisions // 2))
    for start in range(0, decisions, round_size):
        batch = requests[start : start + round_size]
        begin = time.perf_counter()
        for request in batch:
            conductor.schedule(request, request.arrival_s)
        if start:  # the first round warms up (numba's kernels loaded, queues filled) untimed
            timed += time.perf_counter() - begin
            accepted += len(conductor.in_flight)
        for request_id in conductor.in_flight:  # untimed: end them, keeping a steady state
            conductor.handle(RequestAborted(request_id=request_id, now=batch[-1].arrival_s))
    counted = decisions - round_size
    gc.unfreeze()
    return counted / timed, accepted / counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--keys", type=int, default=1_000_000, help=f"block keys indexed (at least {BLOCKS}: one chain)"
    )
    parser.add_argument(
        "--decisions",
        type=int,
        default=20_000,
        help=f"at 16 + 16 instances; at 512 instances a tenth of it, but at least {MIN_LARGE_DECISIONS:,}",
    )
    args = parser.parse_args()
    if args.keys < BLOCKS:
        parser.error(f"--keys must be at least {BLOCKS} (one chain of {BLOCKS} blocks), got {args.keys}")
    if args.decisions < 2:
        parser.error(f"--decisions must be at least 2 (the first round is a warm-up), got {args.decisions}")
    small = (16, 16, args.keys, args.decisions)
    indexed, accepted = decisions_per_s(*small, use_index=True, ttft_s=TTFT_OBJECTIVE_S)
    # Like for like with the peer, which accepts every request: the index's cost, not fewer acceptances.
    matched, accepted_matched = decisions_per_s(*small, use_index=True, ttft_s=NO_TTFT_OBJECTIVE_S)
    bare, accepted_bare = decisions_per_s(*small, use_index=False, ttft_s=NO_TTFT_OBJECTIVE_S)
    large_decisions = max(MIN_LARGE_DECISIONS, args.decisions // 10)
    large, accepted_large = decisions_per_s(
        256, 256, args.keys, large_decisions, use_index=True, ttft_s=TTFT_OBJECTIVE_S
    )
    result = {
        "keys": args.keys,
        "blocks_per_request": BLOCKS,
        "decisions_per_s": indexed,
        "accepted_fraction": accepted,
        "decisions_per_s_without_index": bare,
        "accepted_fraction_without_index": accepted_bare,
        "decisions_per_s_without_ttft_objective": matched,
        "accepted_fraction_without_ttft_objective": accepted_matched,
        "decisions_per_s_512_instances": large,
        "accepted_fraction_512_instances": accepted_large,
        "decisions_512_instances": large_decisions,
        "index_share": 1 - matched / bare,  # both without a TTFT objective
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.keys:,} keys indexed, {BLOCKS}-block requests, KV-cache-centric routing, early rejection")
    print(f"16 prefill + 16 decode      {indexed / 1e3:8.1f} k decisions/s ({accepted:.0%} accepted)   (goal: >= 20 k)")
    print(f"  no TTFT objective         {matched / 1e3:8.1f} k decisions/s ({accepted_matched:.0%} accepted)")
    print(f"  and an empty index        {bare / 1e3:8.1f} k decisions/s ({accepted_bare:.0%} accepted)")
    print(f"  index share               {result['index_share']:8.2f}   (1 - {matched / 1e3:.1f} / {bare / 1e3:.1f})")
    print(
        f"256 prefill + 256 decode    {large / 1e3:8.1f} k decisions/s ({accepted_large:.0%} accepted, "
        f"{large_decisions:,} decisions)"
    )


if __name__ == "__main__":
    main()
