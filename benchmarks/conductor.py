"""Conductor throughput: scheduling decisions per second with a large index.

    python benchmarks/conductor.py [--json] [--keys 1000000] [--decisions 20000]

For 16 prefill + 16 decode instances, and for 256 + 256 (512 instances), the
index holds `--keys` block keys, rounded down to whole chains of 64 (each held by
one to three prefill instances, as in benchmarks/index.py), and requests of 64
blocks (a quarter of them diverging halfway, as a new turn would) are scheduled
with the KV-cache-centric router and early rejection. Only `schedule` is timed,
in rounds of 1,000 decisions (a quarter of `--decisions` if that is fewer); the
first round of each configuration is an untimed warm-up (numba loads its
compiled kernels on the first decision). Between rounds the accepted requests
are ended by events (untimed), so queues and VRAM stay in a steady state.

Every configuration is built first, then their timed rounds alternate (the
order rotating each round), each round scheduling the same requests in every
configuration, so that a shared machine's slow moments hit all of them alike;
rates are the median over rounds (the fastest round beside it), and ratios the
median of per-round ratios. The two indexed configurations at 16 + 16 share one
index (scheduling only reads it). Once everything is built the process freezes
its heap as a server does after startup (`gc.freeze()`, as vLLM's
`freeze_gc_heap`), so that the garbage collector's full passes skip it; the
requests and all that scheduling makes stay collectable.

Configurations (16 + 16 unless named):
- the headline, with a 30 s TTFT objective;
- the same index and no TTFT objective (every request accepted);
- an empty index and no TTFT objective, the peer: its lookup runs and finds
  nothing (routing on empty prefixes). With nothing cached its 32 k-token
  prompts would miss the objective and be rejected before most of the work an
  accepted one costs, hence no objective here, and for like with like the run it
  is compared with has none either;
- 256 + 256 with a 30 s objective, for at least 4 timed rounds (a tenth of the
  others' if that is more).

What a cache hit costs is reported two ways. `match_share` times the index's
match itself: after each round, the same requests' `index.prefix_lengths` (the
call `schedule` makes, on key arrays converted beforehand) run on their own,
and their time is divided by the round's time in the configuration without an
objective. `hit_path_share` is 1 - (rate without objective) / (rate with the
empty index): the match and everything a hit then triggers (the pending-block
walk over a found prefix, transfer planning and routing on non-empty prefixes),
all of which the empty index skips. Both are per-round medians; the second is a
difference of two timings and may come out below zero on a busy machine.

JSON keys (rates in decisions per second, fractions in [0, 1]):
- keys: block keys indexed (`--keys` rounded down to whole 64-block chains);
  blocks_per_request: 64;
- decisions_per_s, decisions_per_s_fastest_round, accepted_fraction: the
  headline;
- decisions_per_s_without_ttft_objective (and _fastest_round),
  accepted_fraction_without_ttft_objective;
- decisions_per_s_without_index (and _fastest_round),
  accepted_fraction_without_index: the peer;
- decisions_per_s_512_instances (and _fastest_round),
  accepted_fraction_512_instances, decisions_512_instances (scheduled there,
  warm-up included);
- timed_rounds, timed_rounds_512_instances, decisions_per_round;
- match_share, hit_path_share: above.
Goal: >= 20 k decisions/s at 16 + 16 instances.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import numpy as np
import numpy.typing as npt

from mooncake.cache.events import BlockStored
from mooncake.cache.index import BlockIndex, key_array
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
ROUND_DECISIONS = 1000
MIN_LARGE_TIMED_ROUNDS = 4  # at 512 instances: a tenth of the others' timed rounds, but at least this many


def build(
    num_prefill: int,
    num_decode: int,
    num_keys: int,
    *,
    use_index: bool,
    ttft_s: float,
    index: BlockIndex | None = None,
) -> tuple[Conductor, list[list[int]]]:
    """A Conductor and the key chains; with `use_index`, the chains are announced to its index, unless `index`
    (already holding them, from another Conductor with the same prefill instances) is given to share."""
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
        index=index,
    )
    for i in range(num_prefill):
        conductor.add_prefill_instance(InstanceId(f"prefill-{i}"))
    for i in range(num_decode):
        conductor.add_decode_instance(InstanceId(f"decode-{i}"), DecodeLimits(kv_capacity_tokens=10**9))
    rng = np.random.default_rng(0)
    num_chains = num_keys // BLOCKS
    chains = rng.integers(0, 2**63, size=(num_chains, BLOCKS), dtype=np.uint64).tolist()
    if use_index and index is None:
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


def make_requests(chains: list[list[int]], count: int) -> list[Request]:
    rng = np.random.default_rng(1)
    requests = []
    for n in range(count):
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
    return requests


class Timed:
    """One configuration's Conductor and what its timed rounds measured."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.round_s: list[float] = []
        self.decided = 0
        self.accepted = 0

    def run(self, batch: list[Request], *, timed: bool = True) -> None:
        conductor = self.conductor
        begin = time.perf_counter()
        for request in batch:
            conductor.schedule(request, request.arrival_s)
        elapsed = time.perf_counter() - begin
        if timed:
            self.round_s.append(elapsed)
            self.decided += len(batch)
            self.accepted += len(conductor.in_flight)
        for request_id in conductor.in_flight:  # untimed: end them, keeping a steady state
            conductor.handle(RequestAborted(request_id=request_id, now=batch[-1].arrival_s))

    def rates(self, batches: list[list[Request]]) -> list[float]:
        """Decisions per second in each timed round (`batches`: the timed rounds' requests, in order)."""
        return [len(batch) / s for batch, s in zip(batches, self.round_s, strict=True)]


def time_matches(index: BlockIndex, instances: tuple[InstanceId, ...], keys: list[npt.NDArray[np.uint64]]) -> float:
    """Seconds the index's match takes for each of `keys`, as `Conductor.schedule` calls it."""
    begin = time.perf_counter()
    for k in keys:
        index.prefix_lengths(k, instances)
    return time.perf_counter() - begin


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
        help=f"at 16 + 16 instances, in rounds of {ROUND_DECISIONS:,} (a quarter of it if fewer), the first a "
        f"warm-up; at 512 instances a tenth of the timed rounds, but at least {MIN_LARGE_TIMED_ROUNDS}",
    )
    args = parser.parse_args()
    if args.keys < BLOCKS:
        parser.error(f"--keys must be at least {BLOCKS} (one chain of {BLOCKS} blocks), got {args.keys}")
    if args.decisions < 2:
        parser.error(f"--decisions must be at least 2 (the first round is a warm-up), got {args.decisions}")
    round_size = max(1, min(ROUND_DECISIONS, args.decisions // 4))
    num_rounds = -(-args.decisions // round_size)  # the last may be short
    large_rounds = 1 + max(MIN_LARGE_TIMED_ROUNDS, (num_rounds - 1) // 10)

    indexed, chains = build(16, 16, args.keys, use_index=True, ttft_s=TTFT_OBJECTIVE_S)
    matched, _ = build(16, 16, args.keys, use_index=True, ttft_s=NO_TTFT_OBJECTIVE_S, index=indexed.index)
    bare, _ = build(16, 16, args.keys, use_index=False, ttft_s=NO_TTFT_OBJECTIVE_S)
    large, _ = build(256, 256, args.keys, use_index=True, ttft_s=TTFT_OBJECTIVE_S)
    num_keys = len(indexed.index)  # what the index holds: whole chains
    # As a server does once started (vLLM's freeze_gc_heap): what startup built moves to the permanent
    # generation, which collections skip. The requests made below stay collectable.
    gc.collect()
    gc.freeze()
    requests = make_requests(chains, max(args.decisions, large_rounds * round_size))
    batches = [requests[start : start + round_size] for start in range(0, len(requests), round_size)]
    small_batches, large_batches = batches[:num_rounds], batches[:large_rounds]
    runs = {
        name: Timed(c) for name, c in (("indexed", indexed), ("matched", matched), ("bare", bare), ("large", large))
    }
    instances = tuple(view.instance_id for view in matched.prefill_views)
    match_s: list[float] = []
    for n in range(max(num_rounds, large_rounds)):
        names = list(runs)
        names = names[n % len(names) :] + names[: n % len(names)]  # no configuration always runs first
        for name in names:
            if n >= (large_rounds if name == "large" else num_rounds):
                continue
            runs[name].run(batches[n], timed=n > 0)  # the first round warms up (numba's kernels loaded, queues filled)
        if 0 < n < num_rounds:
            keys = [key_array(request.block_keys, integers=True) for request in batches[n]]  # untimed, as schedule
            match_s.append(time_matches(matched.index, instances, keys))
    gc.unfreeze()
    timed_small, timed_large = small_batches[1:], large_batches[1:]
    rates = {name: run.rates(timed_large if name == "large" else timed_small) for name, run in runs.items()}
    match_share = statistics.median(m / s for m, s in zip(match_s, runs["matched"].round_s, strict=True))
    hit_path_share = statistics.median(
        1 - b / m for b, m in zip(runs["bare"].round_s, runs["matched"].round_s, strict=True)
    )
    result: dict[str, float | int] = {"keys": num_keys, "blocks_per_request": BLOCKS}
    for name, suffix in (("indexed", ""), ("bare", "_without_index"), ("matched", "_without_ttft_objective")):
        result[f"decisions_per_s{suffix}"] = statistics.median(rates[name])
        result[f"decisions_per_s{suffix}_fastest_round"] = max(rates[name])
        result[f"accepted_fraction{suffix}"] = runs[name].accepted / runs[name].decided
    result.update(
        {
            "decisions_per_s_512_instances": statistics.median(rates["large"]),
            "decisions_per_s_512_instances_fastest_round": max(rates["large"]),
            "accepted_fraction_512_instances": runs["large"].accepted / runs["large"].decided,
            "decisions_512_instances": sum(map(len, large_batches)),
            "timed_rounds": len(timed_small),
            "timed_rounds_512_instances": len(timed_large),
            "decisions_per_round": round_size,
            "match_share": match_share,  # of a decision with the index and no TTFT objective
            "hit_path_share": hit_path_share,  # 1 - (with the index) / (with an empty one), both without an objective
        }
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(
        f"{num_keys:,} keys indexed, {BLOCKS}-block requests, KV-cache-centric routing, early rejection; "
        f"medians of {len(timed_small)} timed rounds of {round_size:,} (fastest round in parentheses)"
    )
    for label, suffix in (
        ("16 prefill + 16 decode   ", ""),
        ("  no TTFT objective      ", "_without_ttft_objective"),
        ("  and an empty index     ", "_without_index"),
    ):
        print(
            f"{label} {r[f'decisions_per_s{suffix}'] / 1e3:8.1f} k decisions/s "
            f"({r[f'decisions_per_s{suffix}_fastest_round'] / 1e3:.1f} k; {r[f'accepted_fraction{suffix}']:.0%} accepted)"
            + ("   (goal: >= 20 k)" if not suffix else "")
        )
    print(f"  the index's match       {match_share:8.3f} of a decision (no TTFT objective), timed on its own")
    print(f"  a hit's whole path      {hit_path_share:8.3f} of it (1 - indexed / empty index, per-round median)")
    print(
        f"256 prefill + 256 decode  {r['decisions_per_s_512_instances'] / 1e3:8.1f} k decisions/s "
        f"({r['decisions_per_s_512_instances_fastest_round'] / 1e3:.1f} k; "
        f"{r['accepted_fraction_512_instances']:.0%} accepted, {len(timed_large)} timed rounds of {round_size:,})"
    )


if __name__ == "__main__":
    main()
