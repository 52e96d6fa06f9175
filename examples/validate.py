"""Validate the simulator against the real example cluster: one workload through both, and the per-request error.

    python examples/validate.py [--config examples/configs/tiny.toml] [--profile FILE]
        [--trace FILE | --preset conversation] [--num-requests 200] [--rate 2] [--overload-speedup 8]
        [--overload-slo 0.9] [--no-overload] [--repeat-real] [--json] [--out build/validate]

1. Profile: unless `--profile` names one, `examples/profile_engine.py --config`
   fits the prefill and decode cost models to the cluster's own engines
   (`OUT/profile.json`, lengths up to the config's `max_prompt_tokens`).
2. Each run (the workload at its own pace, "serviceable"; then the same
   workload `--overload-speedup` times faster, "overload", with the TTFT
   objective the `--overload-slo` quantile of the TTFTs the Conductor
   estimated for the serviceable run's requests, so that it rejects the
   longest prompts and what queues push over): the workload
   (replay.py's options; default a generated conversation workload) is scaled
   as load.py sends it (`examples/scaling.py`), then
   - real: a fresh cluster of `--config`, its Conductor on the profile. First
     a warm-up and a calibration: lone requests of prompts of their own (a
     cluster's first requests pay for first connections and first calls: up
     to seconds each), whose TTFT and TBT, set against the fitted prefill and
     step times, give the serving path's overheads (`Calibration`: the
     reports, the decode join, the gateway and the client) and how much slower
     a prefill runs among the cluster's other processes than alone. Then the
     workload, replayed over HTTP by load.py (TTFT and every token interval
     measured at the client, cached tokens from the usage, the instances from
     the answers' headers);
   - simulated: replay.py's `--config` twin of the same cluster (its own
     Conductor, estimating with the profile as the real one does), charging
     the profile's models as calibrated (the prefill scaled, the typical
     step's excess added to the step, `ClusterSpec.first_token_overhead_s`),
     on the same scaled requests; its TBTs are those a client would measure:
     as many of the simulated intervals as the calibration's client saw
     events per token, each with a delay drawn from the calibration's jitter
     (`observed_tbt`).
   - with `--repeat-real`, the real run again on a fresh cluster: the same
     errors between two real runs, how far this machine's cluster is from
     itself (`real_repeat` in the JSON), the floor under the simulator's.
3. Side by side: TTFT and TBT (mean, p50, p90), cache hit ratio, rejections;
   per request (by id, those completed in both): the relative TTFT error
   |sim − real| / real (median, p90), the relative error of the mean TBT, and
   the fraction of requests both ran on the same prefill and decode instances;
   and by bands of output and of prompt length (`by_output_tokens`,
   `by_prompt_tokens`): each band's mean TBT in both runs and median signed
   TTFT error, which show where a mean's agreement comes from.
   With `--out`, CDF plots of both runs' TTFT and TBT (`ttft_cdf_RUN.png`,
   `tbt_cdf_RUN.png`) and `validate.json`.

`--json` prints `ttft_median_rel_error`, `ttft_p90_rel_error`,
`tbt_mean_rel_error`, `same_route_fraction`, `hit_ratio_real`, `hit_ratio_sim`,
`rejected_real`, `rejected_sim` for the serviceable run, and the same under
`overload`. docs/simulation.md ("How accurate is the simulator") has the
measured table and what the error is made of on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attrs
import load
import numpy as np
import simulation
from scaling import WORKLOAD_BLOCK_TOKENS, Scaling, add_scaling_options, scaling_of
from serving.config import ClusterConfig, load_config
from serving.launch import start_cluster
from serving.models import cost_models

from mooncake.errors import ConfigError, EngineError, MooncakeError
from mooncake.sched.conductor import ScheduleDecision
from mooncake.sched.cost import FittedPrefillModel
from mooncake.sched.outcome import Outcome
from mooncake.sched.step import FittedStepModel
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import RequestRecord, Summary, summarize
from mooncake.sim.report import plot_cdfs, write_json
from mooncake.types import Request, RequestId, Slo

HERE = Path(__file__).resolve().parent
PROFILE_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)
CALIBRATION_GAP_S = 0.3  # between calibration requests: each runs alone (a lone one takes under 0.1 s here)
# Measured lone requests per length: on 2 each the fit's fixed latency varied by 5 ms between runs (a third
# of a TTFT here) and the jitter had ~600 intervals; 6 each (42 requests, 13 s) give the fit three times the
# points and the jitter ~1,800 intervals. 12 each (~3,500) did not steady the jitter's 90th percentile, which
# moves between runs with the machine (1.2-1.5 ms on 6 each, 1.4-1.6 ms on 12), so it costs 13 s for nothing.
CALIBRATION_REPEATS = 6
CALIBRATION_OUTPUT = 64  # tokens each calibration request asks for: intervals for the jitter's tail
CALIBRATION_IDS = 10**9  # calibration request ids (numbers, as load.py seeds by id) far above a workload's
# The overload run's TTFT objective: this quantile of the TTFTs the Conductor estimated for the serviceable
# run's requests (the simulated twin's, which estimates as the real one does: the same profile, the same
# events). The Conductor rejects on its estimates, and those leave out the serving path's latency, so an
# objective in measured TTFTs (the config's 30 s, or twice the real median) is never reached: both runs
# rejected nothing. At this one, the longest tenth of the prompts are refused on an idle cluster, and what
# the faster pace's queues add on top is the part that tells the two runs apart (`rejected_sim_unloaded`:
# the simulated twin's rejections under the same objective at the serviceable pace).
OVERLOAD_OBJECTIVE_QUANTILE = 0.9
# Bands (lower edges, tokens) of the errors by size: where the mean's agreement comes from. A short answer's
# TBT is the longest of its few intervals, a long one's the tail of many; long prompts prefill longest.
OUTPUT_BANDS = (1, 5, 10, 20, 40)
PROMPT_BANDS = (1, 128, 512, 1024)


@attrs.frozen
class Band:
    """The requests (completed in both runs) whose size falls in [`low`, `high`) tokens: how many, the
    real and simulated mean TBT, and the median signed relative TTFT error (sim − real) / real."""

    low: int
    high: int | None  # None: no upper edge
    count: int
    tbt_real_s: float
    tbt_sim_s: float
    ttft_signed_error: float

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def ttft_error(real: RequestRecord, sim: RequestRecord) -> float:
    """The simulated TTFT's relative error, signed: (sim − real) / real, of a request both completed."""
    assert real.ttft_s and sim.ttft_s is not None  # completed in both
    return (sim.ttft_s - real.ttft_s) / real.ttft_s


def bands(
    sizes: Sequence[int], pairs: Sequence[tuple[RequestRecord, RequestRecord]], edges: Sequence[int]
) -> tuple[Band, ...]:
    """`pairs` (real, simulated) grouped by `sizes` into the bands starting at `edges` (empty bands left out)."""
    found = []
    for low, high in zip(edges, [*edges[1:], None], strict=True):
        members = [
            pair for size, pair in zip(sizes, pairs, strict=True) if size >= low and (high is None or size < high)
        ]
        if not members:
            continue
        found.append(
            Band(
                low=low,
                high=high,
                count=len(members),
                tbt_real_s=float(np.mean([r.tbt_s for r, _ in members])),
                tbt_sim_s=float(np.mean([s.tbt_s for _, s in members])),
                ttft_signed_error=float(np.median([ttft_error(r, s) for r, s in members])),
            )
        )
    return tuple(found)


@attrs.frozen
class Comparison:
    """One run's two summaries and the per-request errors (module docstring)."""

    real: Summary
    sim: Summary
    ttft_median_rel_error: float
    ttft_p90_rel_error: float
    tbt_mean_rel_error: float
    same_route_fraction: float
    compared: int  # requests completed in both runs
    calibration: Calibration
    slo: Slo  # the run's objectives (the overload run's TTFT objective is validate's)
    rejected_sim_unloaded: int | None = None  # the simulated rejections under `slo` at the serviceable pace
    by_output_tokens: tuple[Band, ...] = ()
    by_prompt_tokens: tuple[Band, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_median_rel_error": self.ttft_median_rel_error,
            "ttft_p90_rel_error": self.ttft_p90_rel_error,
            "tbt_mean_rel_error": self.tbt_mean_rel_error,
            "same_route_fraction": self.same_route_fraction,
            "hit_ratio_real": self.real.cache_hit_ratio,
            "hit_ratio_sim": self.sim.cache_hit_ratio,
            "rejected_real": rejected(self.real),
            "rejected_sim": rejected(self.sim),
            "compared_requests": self.compared,
            "ttft_slo_s": self.slo.ttft_s,
            **({} if self.rejected_sim_unloaded is None else {"rejected_sim_unloaded": self.rejected_sim_unloaded}),
            "by_output_tokens": [band.to_json() for band in self.by_output_tokens],
            "by_prompt_tokens": [band.to_json() for band in self.by_prompt_tokens],
            "calibration": self.calibration.to_json(),
            "real": self.real.to_json(),
            "sim": self.sim.to_json(),
        }


def rejected(summary: Summary) -> int:
    return summary.rejected_before_prefill + summary.rejected_after_prefill


def compare(
    real: Sequence[RequestRecord], sim: Sequence[RequestRecord], slo: Slo, calibration: Calibration
) -> Comparison:
    """The errors of `sim` against `real`, request by request (module docstring). The simulated TBTs are
    those a client would measure (`observed_tbt`, with the calibration's jitter)."""
    rng = np.random.default_rng(0)
    sim = [attrs.evolve(r, tbt_s=observed_tbt(r, calibration.jitter_s, rng, calibration.events_per_token)) for r in sim]
    simulated = {r.request_id: r for r in sim}
    ttft_errors, real_tbt, sim_tbt, same_route, routed = [], [], [], 0, 0
    pairs: list[tuple[RequestRecord, RequestRecord]] = []
    for r in real:
        s = simulated.get(r.request_id)
        if s is None:
            continue
        if r.prefill_instance is not None and s.prefill_instance is not None:
            routed += 1
            same_route += (r.prefill_instance, r.decode_instance) == (s.prefill_instance, s.decode_instance)
        if r.outcome is Outcome.COMPLETED and s.outcome is Outcome.COMPLETED and r.ttft_s and s.ttft_s is not None:
            ttft_errors.append(abs(ttft_error(r, s)))
            real_tbt.append(r.tbt_s)
            sim_tbt.append(s.tbt_s)
            pairs.append((r, s))
    nan = float("nan")
    real_mean, sim_mean = (float(np.mean(v)) if v else nan for v in (real_tbt, sim_tbt))
    return Comparison(
        real=summarize(real, slo),
        sim=summarize(sim, slo),
        ttft_median_rel_error=float(np.median(ttft_errors)) if ttft_errors else nan,
        ttft_p90_rel_error=float(np.percentile(ttft_errors, 90)) if ttft_errors else nan,
        tbt_mean_rel_error=abs(sim_mean - real_mean) / real_mean if real_mean else nan,
        same_route_fraction=same_route / routed if routed else nan,
        compared=len(ttft_errors),
        calibration=calibration,
        slo=slo,
        by_output_tokens=bands([r.output_tokens for r, _ in pairs], pairs, OUTPUT_BANDS),
        by_prompt_tokens=bands([r.input_tokens for r, _ in pairs], pairs, PROMPT_BANDS),
    )


def profile(config_path: Path, config: ClusterConfig, out: Path) -> Path:
    """Fit the cost models to the cluster's engines (profile_engine.py --config) into `out`."""
    lengths = [n for n in PROFILE_LENGTHS if n <= config.limits.max_prompt_tokens]
    batches = [b for b in (1, 2, 4, 8, 16, 32) if b <= config.decode.max_batch_size]
    command = [sys.executable, str(HERE / "profile_engine.py"), "--config", str(config_path), "--out", str(out)]
    command += ["--lengths", ",".join(map(str, lengths)), "--batches", ",".join(map(str, batches))]
    command += ["--prefix-fractions", "0,0.5", "--repeats", "3"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return out


@attrs.frozen
class Calibration:
    """How the real cluster differs from its engines' profile, measured on lone calibration requests:
    `prefill_scale`, how much slower a prefill runs among the cluster's other processes than alone (engines
    share the machine's cores), and `first_token_s`, the serving path's fixed latency to the first token
    (the reports, the decode join, the gateway, the client): a least-squares line of their TTFTs over the
    profile's prefill times. Of every token interval the client saw, the excess over the profile's step:
    `step_s`, their median, what a typical decode step takes beyond the profile's (the simulated steps
    carry it); `jitter_s`, each excess less that median, the spread the client sees around a step (the
    serving path's and the operating system's delays, tokens arriving together), which a simulated
    client adds to the simulated steps (`observed_tbt`). `events_per_token`: the intervals the client saw per
    token interval generated (the usage's completion tokens): the detokenizer sends no event for a token that
    adds no text yet, so the client sees fewer, and the paper's metric takes the longest tenth of fewer."""

    first_token_s: float
    prefill_scale: float
    step_s: float
    jitter_s: tuple[float, ...] = ()
    events_per_token: float = 1.0

    def to_json(self) -> dict[str, Any]:
        jitter = np.asarray(self.jitter_s)
        spread = {f"p{q}": float(np.percentile(jitter, q)) for q in (50, 90, 99)} if jitter.size else {}
        return {
            "first_token_s": self.first_token_s,
            "prefill_scale": self.prefill_scale,
            "step_s": self.step_s,
            "jitter_s": {"intervals": int(jitter.size), **spread},
            "events_per_token": self.events_per_token,
        }


def calibration_requests(config: ClusterConfig, scaling: Scaling, *, first_id: int, repeats: int = 2) -> list[Request]:
    """Lone requests (one every `CALIBRATION_GAP_S`) of prompts sharing nothing with any workload's, their
    lengths spread over what the cluster takes, `repeats` of each, each asking for `CALIBRATION_OUTPUT` tokens."""
    lengths = [n for n in PROFILE_LENGTHS if n <= min(config.limits.max_prompt_tokens, scaling.max_prompt_tokens)]
    requests = []
    for i, tokens in enumerate(lengths * repeats):
        length = max(1, round(tokens / scaling.length_scale))
        keys = [2**62 + (first_id + i) * 10_000 + b for b in range(-(-length // WORKLOAD_BLOCK_TOKENS))]
        output = max(1, round(CALIBRATION_OUTPUT / scaling.output_scale))
        requests.append(
            Request(
                request_id=RequestId(str(CALIBRATION_IDS + first_id + i)),
                arrival_s=i * CALIBRATION_GAP_S,
                input_length=length,
                output_length=output,
                block_keys=keys,
                block_size_tokens=WORKLOAD_BLOCK_TOKENS,
            )
        )
    return requests


def calibrate(url: str, config: ClusterConfig, scaling: Scaling, timeout_s: float) -> Calibration:
    """Warm the cluster up (its first requests pay for first connections and first calls), then time lone
    requests against the fitted models the simulator charges."""
    prefill, step = cost_models(config)
    asyncio.run(load.replay_http(url, calibration_requests(config, scaling, first_id=0), scaling, timeout_s=timeout_s))
    records, _ = asyncio.run(
        load.replay_http(
            url,
            calibration_requests(config, scaling, first_id=1000, repeats=CALIBRATION_REPEATS),
            scaling,
            timeout_s=timeout_s,
        )
    )
    done = [r for r in records if r.outcome is Outcome.COMPLETED and r.ttft_s is not None]
    if not done:
        raise EngineError("no calibration request completed: the cluster does not serve")
    profiled = np.array([prefill.prefill_s(r.input_tokens, 0) for r in done])
    ttft = np.array([r.ttft_s or 0.0 for r in done])
    scale, fixed = np.polyfit(profiled, ttft, 1) if len(set(profiled)) > 1 else (1.0, float(np.median(ttft - profiled)))
    # Interval k of a request follows the step that decoded with input + k + 1 tokens in its context.
    excess = np.array(
        [
            interval - step.step_s(1, r.input_tokens + k + 1)
            for r in done
            for k, interval in enumerate(r.intervals.values().tolist())
        ]
    )
    typical = float(np.median(excess)) if excess.size else 0.0
    generated = sum(max(0, r.output_tokens - 1) for r in done)
    return Calibration(
        first_token_s=max(0.0, float(fixed)),
        prefill_scale=max(1.0, float(scale)),
        step_s=max(0.0, typical),
        jitter_s=tuple((excess - typical).tolist()),
        events_per_token=min(1.0, excess.size / generated) if generated else 1.0,
    )


OBSERVATION_DRAWS = 32  # simulated clients per request whose TBT `observed_tbt` averages


def observed_tbt(
    record: RequestRecord, jitter_s: Sequence[float], rng: np.random.Generator, events_per_token: float = 1.0
) -> float:
    """The TBT a client would measure of a simulated request: the paper's metric (the mean of the longest
    10 % intervals, as load.py computes it) of the intervals the client sees, averaged over
    `OBSERVATION_DRAWS` draws. It sees `events_per_token` of the simulated intervals (rounded, at least
    one; which ones is drawn), each with a delay drawn from the calibration's `jitter_s` added (never below
    zero): the jitter was measured per interval the client saw, so it already holds the longer intervals
    of tokens that came in one event. Without jitter, or without intervals, the record's own TBT."""
    count = record.intervals.count
    if not count or not len(jitter_s):
        return record.tbt_s
    seen_count = max(1, min(count, round(count * events_per_token)))
    top = max(1, -(-seen_count // 10))
    values = record.intervals.values()
    if seen_count < count:  # each draw keeps its own `seen_count` of them
        values = values[np.argsort(rng.random((OBSERVATION_DRAWS, count)), axis=1)[:, :seen_count]]
    seen = values + rng.choice(np.asarray(jitter_s), size=(OBSERVATION_DRAWS, seen_count))
    longest = np.partition(np.maximum(seen, 0.0), seen_count - top, axis=1)[:, seen_count - top :]
    return float(longest.mean())


def run_real(
    config: ClusterConfig, requests: list[Request], args: argparse.Namespace
) -> tuple[list[RequestRecord], Calibration]:
    """The requests over HTTP through a fresh cluster of `config` (load.py's replay), after its calibration."""
    scaling = scaling_of(args)
    with start_cluster(config.with_overrides("cluster", port=0)) as cluster:
        calibration = calibrate(cluster.url, config, scaling, args.timeout)
        records, _wall = asyncio.run(load.replay_http(cluster.url, requests, scaling, timeout_s=args.timeout))
    return records, calibration


def run_sim(
    config: ClusterConfig,
    requests: list[Request],
    args: argparse.Namespace,
    calibration: Calibration,
    estimates: list[float] | None = None,
) -> list[RequestRecord]:
    """The same requests, scaled and keyed as the cluster sees them, through its simulated twin with the
    calibrated overheads (the twin's Conductor still estimates with the profile alone, as the real one);
    `estimates`, if given, receives the TTFT its Conductor estimated for each request it routed."""
    spec = simulation.config_spec(config)
    prefill, step = spec.prefill_cost, spec.decode_cost
    assert isinstance(prefill, FittedPrefillModel) and isinstance(step, FittedStepModel)  # the profile's
    c0, c1, c2 = step.coefficients
    spec = attrs.evolve(
        spec,
        prefill_model=FittedPrefillModel(
            coefficients=tuple(c * calibration.prefill_scale for c in prefill.coefficients)
        ),
        step_model=FittedStepModel(coefficients=(c0 + calibration.step_s, c1, c2)),
        first_token_overhead_s=calibration.first_token_s,
    )
    scaled = simulation.cluster_requests(config, requests, scaling_of(args))
    conductor = simulation.config_conductor(config, spec)
    if estimates is not None:
        schedule = conductor.schedule

        def recording(request: Request, now: float) -> ScheduleDecision:
            decision = schedule(request, now)
            if decision.ttft_s is not None:
                estimates.append(decision.ttft_s)
            return decision

        conductor.schedule = recording  # type: ignore[method-assign]
    return list(DisaggregatedCluster(spec, conductor).run(scaled).records)


def print_comparison(name: str, result: Comparison) -> None:
    print(f"{name}: {result.real.num_requests} requests, {result.compared} completed in both")
    print(
        f"  {'':10}{'TTFT mean':>10}{'p50':>8}{'p90':>8} s {'TBT mean':>10}{'p50':>8}{'p90':>8} ms  hit ratio  rejected"
    )
    for label, s in (("real", result.real), ("simulated", result.sim)):
        ttft = "".join(f"{s.ttft_s[k]:>{w}.3f}" for k, w in (("mean", 10), ("p50", 8), ("p90", 8)))
        tbt = "".join(f"{s.tbt_s[k] * 1000:>{w}.2f}" for k, w in (("mean", 10), ("p50", 8), ("p90", 8)))
        print(f"  {label:<10}{ttft}   {tbt}    {s.cache_hit_ratio:>9.3f} {rejected(s):>9}")
    print(
        f"  per request: TTFT error median {result.ttft_median_rel_error:.1%}, p90 {result.ttft_p90_rel_error:.1%}; "
        f"mean TBT error {result.tbt_mean_rel_error:.1%}; same route {result.same_route_fraction:.1%}"
    )
    for label, found in (("output", result.by_output_tokens), ("prompt", result.by_prompt_tokens)):
        print(
            f"  by {label} tokens: "
            + "; ".join(
                f"{band.low}{'+' if band.high is None else f'-{band.high - 1}'} ({band.count}): TBT sim/real "
                f"{band.tbt_sim_s / band.tbt_real_s if band.tbt_real_s else float('nan'):.2f}, "
                f"TTFT {band.ttft_signed_error:+.0%}"
                for band in found
            )
        )
    if result.rejected_sim_unloaded is not None:
        print(
            f"  TTFT objective {result.slo.ttft_s * 1000:.2f} ms: the simulated twin rejects "
            f"{result.rejected_sim_unloaded} of these requests at the serviceable pace"
        )


def plot(name: str, real: Sequence[RequestRecord], sim: Sequence[RequestRecord], out: Path) -> None:
    def done(records: Sequence[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.outcome is Outcome.COMPLETED and r.ttft_s is not None]

    ttft = {"real": [r.ttft_s or 0.0 for r in done(real)], "simulated": [r.ttft_s or 0.0 for r in done(sim)]}
    tbt = {"real": [r.tbt_s * 1000 for r in done(real)], "simulated": [r.tbt_s * 1000 for r in done(sim)]}
    plot_cdfs(ttft, out / f"ttft_cdf_{name}.png", xlabel="TTFT (s)", title=f"TTFT, {name}")
    plot_cdfs(tbt, out / f"tbt_cdf_{name}.png", xlabel="TBT (ms)", title=f"TBT, {name}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=HERE / "configs" / "tiny.toml")
    p.add_argument("--profile", type=Path, help="fitted cost models to use (default: profile the engines now)")
    simulation.add_workload_options(p)
    p.set_defaults(preset="conversation", num_requests=200, rate=2.0)
    add_scaling_options(p)
    p.add_argument("--overload-speedup", type=float, default=8.0, help="the overload run's arrivals, this much faster")
    p.add_argument("--no-overload", action="store_true", help="only the serviceable run")
    p.add_argument(
        "--repeat-real", action="store_true", help="run the serviceable workload on a second real cluster and compare"
    )
    p.add_argument(
        "--overload-slo",
        type=float,
        default=OVERLOAD_OBJECTIVE_QUANTILE,
        help="the overload run's TTFT objective, a quantile of the Conductor's TTFT estimates in the serviceable "
        "run (0: the config's)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per request over HTTP, seconds")
    p.add_argument("--out", type=Path, help="write validate.json, the profile and CDF plots here")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        scaling_of(args)
        if not 0 <= args.overload_slo <= 1:
            raise ConfigError(f"--overload-slo must be a quantile in [0, 1], got {args.overload_slo}")
        config = load_config(args.config)
        with tempfile.TemporaryDirectory(prefix="mooncake-validate-") as scratch:
            out = args.out if args.out is not None else Path(scratch)
            fitted = args.profile or profile(args.config, config, out / "profile.json")
            config = config.with_overrides("prefill", profile=str(fitted))
            runs = {"serviceable": 1.0} | ({} if args.no_overload else {"overload": args.overload_speedup})
            results: dict[str, Comparison] = {}
            repeat: Comparison | None = None
            estimates: list[float] = []  # the serviceable run's, from its simulated Conductor
            serviceable = simulation.load_workload(args, speedup=args.speedup)
            for name, speedup in runs.items():
                run_config, unloaded = config, None
                if name == "overload" and args.overload_slo > 0 and estimates:
                    objective = round(float(np.quantile(estimates, args.overload_slo)), 6)
                    run_config = config.with_overrides("slo", ttft_s=objective)
                requests = (
                    serviceable
                    if name == "serviceable"
                    else simulation.load_workload(args, speedup=args.speedup * speedup)
                )
                real, calibration = run_real(run_config, requests, args)
                sim = run_sim(run_config, requests, args, calibration, estimates if name == "serviceable" else None)
                if run_config is not config:  # what the objective alone refuses, at the serviceable pace
                    unloaded = rejected(summarize(run_sim(run_config, serviceable, args, calibration), Slo()))
                slo = Slo(ttft_s=run_config.slo.ttft_s, tbt_s=run_config.slo.tbt_s)
                results[name] = attrs.evolve(compare(real, sim, slo, calibration), rejected_sim_unloaded=unloaded)
                if name == "serviceable" and args.repeat_real:
                    again, _ = run_real(run_config, requests, args)
                    repeat = compare(real, again, slo, Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0))
                if args.out is not None:
                    plot(name, real, sim, args.out)
    except (MooncakeError, OSError, subprocess.CalledProcessError) as error:
        print(f"validate: {error}", file=sys.stderr)
        return 2
    summary = results["serviceable"].to_json()
    if "overload" in results:
        summary["overload"] = results["overload"].to_json()
    if repeat is not None:
        summary["real_repeat"] = {
            key: getattr(repeat, key) for key in ("ttft_median_rel_error", "ttft_p90_rel_error", "tbt_mean_rel_error")
        }
    summary["profile"] = str(fitted)
    if args.out is not None:
        write_json(summary, args.out / "validate.json")
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    print(f"validate: {args.config}, {simulation.workload_name(args)}, profile {fitted}")
    for name, result in results.items():
        print_comparison(name, result)
    if repeat is not None:
        print(
            f"real against real (a second cluster, the same workload): TTFT error median "
            f"{repeat.ttft_median_rel_error:.1%}, p90 {repeat.ttft_p90_rel_error:.1%}; "
            f"mean TBT error {repeat.tbt_mean_rel_error:.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
