"""Validate the simulator against the real example cluster: one workload through both, and the per-request error.

    python examples/validate.py [--config examples/configs/tiny.toml] [--profile FILE]
        [--trace FILE | --preset conversation] [--num-requests 200] [--rate 2] [--overload-speedup 4]
        [--overload-batch 1] [--no-overload] [--repeat-real] [--json] [--out build/validate]

1. Profile: unless `--profile` names one, `examples/profile_engine.py --config`
   fits the prefill and decode cost models to the cluster's own engines
   (`OUT/profile.json`, lengths up to the config's `max_prompt_tokens`).
2. Each run (the workload at its own pace, "serviceable"; then the same
   workload `--overload-speedup` times faster, "overload", on the cluster
   with its decode batch limited to `--overload-batch` sequences, so that the
   decode side binds and the Conductor rejects what the decode engine could
   not take by the time it arrives: rejections the load makes, not the
   lengths): the workload
   (replay.py's options; default a generated conversation workload) is scaled
   as load.py sends it (`examples/scaling.py`), then
   - real: a fresh cluster of `--config`, its Conductor on the profile, its
     engines pinned to cores of their own where the machine has enough. First
     a warm-up and a calibration: lone requests of prompts of their own (a
     cluster's first requests pay for first connections and first calls: up
     to seconds each), whose TTFT and TBT, set against the fitted prefill and
     step times, give the serving path's overheads (`Calibration`: the
     reports, the decode join, the gateway and the client) and how much slower
     a prefill runs among the cluster's other processes than alone. Then the
     workload, replayed over HTTP by load.py (TTFT and every interval between
     events measured at the client, the tokens each event carried and the
     cached tokens from the usage, the instances from the answers' headers);
   - simulated: replay.py's `--config` twin of the same cluster (its own
     Conductor, estimating with the profile as the real one does), charging
     the profile's models as calibrated (the prefill scaled, the typical
     step's excess added to the step, `ClusterSpec.first_token_overhead_s`),
     on the same scaled requests; its TBTs are those a client would measure:
     the simulated tokens cut into events of the sizes the calibration's
     client saw, each event's interval with a delay drawn from the
     calibration's jitter (`observed_tbt`).
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
   `tbt_cdf_RUN.png`; the simulated TBTs those the table compares) and
   `validate.json`, with the profile, written as one set
   (`simulation.output_set`: validate.json last, there only beside the rest of
   its run); `--out` is checked before any work. Without `--out` a profile
   fitted now is removed after the run (the JSON's `profile` is null).

Prompts are cut at `--max-prompt-tokens`, which may not exceed the config's
`[limits] max_prompt_tokens`. Requests the real cluster answered with an error
or not in time are `failed_real` (they are in neither summary's outcomes).
Exit status: 0; 1 when a run compared no request (none completed in both); 2
with one line on stderr for an error found before or instead of the run; 130
after Ctrl-C, 143 after SIGTERM.

`--json` prints `ttft_median_rel_error`, `ttft_p90_rel_error`,
`tbt_mean_rel_error`, `same_route_fraction`, `hit_ratio_real`, `hit_ratio_sim`,
`rejected_real`, `rejected_sim` for the serviceable run, and the same under
`overload`. docs/simulation.md ("How accurate is the simulator") has the
measured table and what the error is made of on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from scaling import Scaling, add_scaling_options, scaling_of
from serving.config import ClusterConfig, load_config
from serving.machine import Machine, check_machine
from serving.models import cost_models

from mooncake.cli import OneLineParser, error_message, file_path, folder_path, one_line, run_interruptible
from mooncake.errors import ConfigError, EngineError, MooncakeError
from mooncake.sched.cost import FittedPrefillModel
from mooncake.sched.outcome import Outcome
from mooncake.sched.step import AnalyticStepModel, FittedStepModel
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import RequestRecord, Summary, has_tbt, summarize, top_mean_of
from mooncake.sim.report import plot_cdfs, require_pyplot, write_json
from mooncake.types import Request, RequestId, Slo, block_count
from mooncake.workload import TRACE_BLOCK_SIZE_TOKENS

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
# The overload run's decode batch limit and pace. With the tiny config's batch of 8 the decode side never
# binds before this machine's two cores do (from ~64x, a contention the simulator does not model): a batch of
# one sequence makes the decode engine the bottleneck at a pace the cores sustain, the paper's overload
# (decode-bound, §7), and its rejections come from the load (`rejected_sim_unloaded`: the simulated twin's
# rejections of the serviceable workload under the same limit, what it refuses without the faster pace).
OVERLOAD_BATCH = 1
OVERLOAD_SPEEDUP = 4.0
# Bands (lower edges, tokens) of the errors by size: where the mean's agreement comes from. A short answer's
# TBT is the longest of its few intervals, a long one's the tail of many; long prompts prefill longest.
OUTPUT_BANDS = (1, 5, 10, 20, 40)
PROMPT_BANDS = (1, 128, 512, 1024)
# The files of `--out`'s set, validate.json (the marker) last. The overload plots are in it with --no-overload too:
# a previous run's are then removed, not left beside this run's JSON as if from it.
OUT_FILES = (
    "profile.json",
    *(f"{kind}_cdf_{name}.png" for name in ("serviceable", "overload") for kind in ("ttft", "tbt")),
    "validate.json",
)


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
    slo: Slo  # the run's objectives
    decode_max_batch: int  # the run's decode batch limit
    rejected_sim_unloaded: int | None = None  # the simulated rejections of the serviceable workload, same config
    by_output_tokens: tuple[Band, ...] = ()
    by_prompt_tokens: tuple[Band, ...] = ()
    failed_real: int = 0  # real requests that got no answer (an HTTP error, a timeout): in neither summary's outcomes
    # The simulated records as compared, their TBTs those a client would measure: what the plots draw, so that they
    # show the figures the table does (not in the JSON).
    sim_records: tuple[RequestRecord, ...] = attrs.field(default=(), repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_median_rel_error": self.ttft_median_rel_error,
            "ttft_p90_rel_error": self.ttft_p90_rel_error,
            "tbt_mean_rel_error": self.tbt_mean_rel_error,
            "same_route_fraction": self.same_route_fraction,
            "hit_ratio_real": self.real.cache_hit_ratio,
            "hit_ratio_sim": self.sim.cache_hit_ratio,
            "rejected_real": self.real.rejected,
            "rejected_sim": self.sim.rejected,
            "failed_real": self.failed_real,
            "compared_requests": self.compared,
            "ttft_slo_s": self.slo.ttft_s,
            "decode_max_batch": self.decode_max_batch,
            **({} if self.rejected_sim_unloaded is None else {"rejected_sim_unloaded": self.rejected_sim_unloaded}),
            "by_output_tokens": [band.to_json() for band in self.by_output_tokens],
            "by_prompt_tokens": [band.to_json() for band in self.by_prompt_tokens],
            "calibration": self.calibration.to_json(),
            "real": self.real.to_json(),
            "sim": self.sim.to_json(),
        }


def compare(
    real: Sequence[RequestRecord],
    sim: Sequence[RequestRecord],
    slo: Slo,
    decode_max_batch: int,
    calibration: Calibration,
) -> Comparison:
    """The errors of `sim` against `real`, request by request (module docstring). The simulated TBTs are
    those a client would measure (`observed_tbt`, with the calibration's jitter)."""
    rng = np.random.default_rng(0)
    sim = [attrs.evolve(r, tbt_s=observed_tbt(r, calibration.jitter_s, rng, calibration.event_sizes)) for r in sim]
    simulated = {r.request_id: r for r in sim}
    ttft_errors, real_tbt, sim_tbt, same_route, routed = [], [], [], 0, 0
    pairs: list[tuple[RequestRecord, RequestRecord]] = []
    for r in real:
        s = simulated.get(r.request_id)
        if s is None:
            continue
        if r.outcome is not Outcome.COMPLETED or s.outcome is not Outcome.COMPLETED:
            continue  # per request, those completed in both: a simulated rejection names the instance it chose
        if r.prefill_instance is not None and s.prefill_instance is not None:
            routed += 1
            same_route += (r.prefill_instance, r.decode_instance) == (s.prefill_instance, s.decode_instance)
        if r.ttft_s and s.ttft_s is not None:
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
        decode_max_batch=decode_max_batch,
        by_output_tokens=bands([r.output_tokens for r, _ in pairs], pairs, OUTPUT_BANDS),
        by_prompt_tokens=bands([r.input_tokens for r, _ in pairs], pairs, PROMPT_BANDS),
        failed_real=sum(1 for r in real if r.outcome is None),
        sim_records=tuple(sim),
    )


def profile(config_path: Path, config: ClusterConfig, out: Path) -> Path:
    """Fit the cost models to the cluster's engines (profile_engine.py --config) into `out`."""
    lengths = [n for n in PROFILE_LENGTHS if n <= config.limits.max_prompt_tokens]
    batches = [b for b in (1, 2, 4, 8, 16, 32) if b <= config.decode.max_batch_size]
    command = [sys.executable, str(HERE / "profile_engine.py"), "--config", str(config_path), "--out", str(out)]
    command += ["--lengths", ",".join(map(str, lengths)), "--batches", ",".join(map(str, batches))]
    command += ["--prefix-fractions", "0,0.5", "--repeats", "3"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:  # its last line says why (the whole command line would bury it)
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise EngineError(f"profiling failed: {lines[-1]}")
    return out


@attrs.frozen
class Calibration:
    """How the real cluster differs from its engines' profile, measured on lone calibration requests:
    `prefill_scale`, how much slower a prefill runs among the cluster's other processes than alone (engines
    share the machine's cores), and `first_token_s`, the serving path's fixed latency to the first token
    (the reports, the decode join, the gateway, the client): a least-squares line of their TTFTs over the
    profile's prefill times. Of every interval between the events the client saw, the excess over the
    profile's steps of the tokens the event carried (load.py's `event_tokens`): `step_s`, the median excess
    of the events of one token, what a typical decode step takes beyond the profile's (the simulated steps
    carry it); `jitter_s`, each event's excess less `step_s` per token it carried, the spread the client sees
    around its steps (the serving path's and the operating system's delays), which a simulated client adds
    to each event it sees (`observed_tbt`). `event_sizes`: the tokens each of those events carried: the
    detokenizer sends no event for a token that adds no text yet (a byte of a character not yet whole), so
    its interval merges into the next event's, and the paper's metric takes the longest tenth of fewer,
    longer intervals."""

    first_token_s: float
    prefill_scale: float
    step_s: float
    jitter_s: tuple[float, ...] = ()
    event_sizes: tuple[int, ...] = (1,)

    @property
    def events_per_token(self) -> float:
        """Events the client saw per token generated (after the first event's)."""
        return len(self.event_sizes) / sum(self.event_sizes)

    def to_json(self) -> dict[str, Any]:
        jitter = np.asarray(self.jitter_s)
        spread = {f"p{q}": float(np.percentile(jitter, q)) for q in (50, 90, 99)} if jitter.size else {}
        return {
            "first_token_s": self.first_token_s,
            "prefill_scale": self.prefill_scale,
            "step_s": self.step_s,
            "jitter_s": {"intervals": int(jitter.size), **spread},
            "events_per_token": self.events_per_token,
            "event_sizes": {str(n): self.event_sizes.count(n) for n in sorted(set(self.event_sizes))},
        }


def calibration_requests(config: ClusterConfig, scaling: Scaling, *, first_id: int, repeats: int = 2) -> list[Request]:
    """Lone requests (one every `CALIBRATION_GAP_S`) of prompts sharing nothing with any workload's, their
    lengths spread over what the cluster takes, `repeats` of each, each asking for `CALIBRATION_OUTPUT` tokens."""
    lengths = [n for n in PROFILE_LENGTHS if n <= min(config.limits.max_prompt_tokens, scaling.max_prompt_tokens)]
    requests = []
    for i, tokens in enumerate(lengths * repeats):
        length = max(1, round(tokens / scaling.length_scale))
        keys = [2**62 + (first_id + i) * 10_000 + b for b in range(block_count(length, TRACE_BLOCK_SIZE_TOKENS))]
        output = max(1, round(CALIBRATION_OUTPUT / scaling.output_scale))
        requests.append(
            Request(
                request_id=RequestId(str(CALIBRATION_IDS + first_id + i)),
                arrival_s=i * CALIBRATION_GAP_S,
                input_length=length,
                output_length=output,
                block_keys=keys,
                block_size_tokens=TRACE_BLOCK_SIZE_TOKENS,
            )
        )
    return requests


def fit_overheads(profiled: np.ndarray, ttft: np.ndarray) -> tuple[float, float]:
    """The line TTFT = scale · profiled + fixed, least squares, with scale >= 1 and fixed >= 0. A bound that binds
    fixes that coefficient and the other is fitted again with it (clamping one of a joint fit alone leaves the
    other fitted to the slope or intercept given up, and biases every simulated TTFT)."""
    if len(set(profiled.tolist())) > 1:
        scale, fixed = (float(c) for c in np.polyfit(profiled, ttft, 1))
    else:  # one length: no slope to fit
        scale, fixed = 1.0, float(np.median(ttft - profiled))
    if scale < 1.0:
        scale, fixed = 1.0, float(np.median(ttft - profiled))
    if fixed < 0.0:  # through the origin
        fixed = 0.0
        scale = max(1.0, float(np.dot(profiled, ttft) / np.dot(profiled, profiled))) if profiled.any() else 1.0
    return scale, fixed


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
    scale, fixed = fit_overheads(profiled, ttft)
    excess, carried = event_excess(done, step)
    single = excess[carried == 1]
    typical = max(0.0, float(np.median(single))) if single.size else 0.0
    return Calibration(
        first_token_s=fixed,
        prefill_scale=scale,
        step_s=typical,
        jitter_s=tuple((excess - typical * carried).tolist()),
        event_sizes=tuple(carried.tolist()) or (1,),
    )


def event_excess(records: Sequence[load.ClientRecord], step: AnalyticStepModel) -> tuple[np.ndarray, np.ndarray]:
    """Of every interval between events the client saw: its excess over the profile's steps of the tokens the
    event carried, and how many it carried. Token t of an answer (from 0) was decoded with input + t tokens in
    its context; a request's first event carried the tokens the later ones did not. Events that carried no
    token (text a stop flushed at the end) are left out; without `event_tokens` (a server that sends no usage
    per chunk) every event counts as one token."""
    excess, carried = [], []
    for r in records:
        intervals = r.intervals.values().tolist()
        tokens = r.event_tokens if len(r.event_tokens) == len(intervals) else [1] * len(intervals)
        t = max(1, r.output_tokens - sum(tokens))  # the first token of the first interval's event
        for interval, n in zip(intervals, tokens, strict=True):
            if n > 0:
                excess.append(interval - sum(step.step_s(1, r.input_tokens + t + i) for i in range(n)))
                carried.append(n)
            t += n
    return np.array(excess), np.array(carried)


OBSERVATION_DRAWS = 32  # simulated clients per request whose TBT `observed_tbt` averages


def observed_tbt(
    record: RequestRecord,
    jitter_s: Sequence[float],
    rng: np.random.Generator,
    event_sizes: Sequence[int] = (1,),
    draws: int = OBSERVATION_DRAWS,
) -> float:
    """The TBT a client would measure of a simulated request: the paper's metric (the mean of the longest
    10 % intervals, as load.py computes it) of the intervals between the events the client sees, averaged
    over `draws` draws. The tokens come in events of sizes drawn from `event_sizes` (the calibration's
    events, so that a character of two bytes is two tokens in one event as often as there), the first
    event from the first token, the last ending at the last token (cut short where a size overruns it): an
    event's interval is the sum of the simulated intervals since the previous event's. Each interval seen
    gets a delay drawn from the calibration's `jitter_s` (never below zero). A draw with one event has no
    interval: its TBT is 0, as load.py records it. Without jitter, or without intervals, the record's own
    TBT."""
    count = record.intervals.count
    if not count or not len(jitter_s):
        return record.tbt_s
    jitter = np.asarray(jitter_s)
    times = np.concatenate(([0.0], np.cumsum(record.intervals.values())))  # each token's, from the first's
    total = 0.0
    for sizes in rng.choice(np.asarray(event_sizes), size=(draws, count + 1)):  # sizes >= 1: enough for every token
        ends = np.cumsum(sizes) - 1  # the token each event ends at
        last = int(np.searchsorted(ends, count))  # the first event reaching the last token ends there
        seen = np.diff(times[np.append(ends[:last], count)])
        if seen.size:
            total += top_mean_of(np.maximum(seen + rng.choice(jitter, size=seen.size), 0.0))
    return total / draws


def run_real(
    config: ClusterConfig, requests: list[Request], args: argparse.Namespace
) -> tuple[list[RequestRecord], Calibration]:
    """The requests over HTTP through a fresh cluster of `config` (load.py's replay), after its calibration. Its
    engines run on cores of their own where the machine has enough (`[cluster] pin_cores = "auto"`), as the
    profile timed each alone; on this development machine's two cores they share them."""
    # Imported here, as load.py does: the launcher brings torch (seconds), which a run refused before any work
    # (a bad option, a config) never needs.
    from serving.launch import start_cluster

    scaling = scaling_of(args)
    with start_cluster(config.with_overrides("cluster", port=0, pin_cores="auto")) as cluster:
        calibration = calibrate(cluster.url, config, scaling, args.timeout)
        records, _wall = asyncio.run(load.replay_http(cluster.url, requests, scaling, timeout_s=args.timeout))
    return records, calibration


def run_sim(
    config: ClusterConfig,
    requests: list[Request],
    args: argparse.Namespace,
    calibration: Calibration,
) -> list[RequestRecord]:
    """The same requests, scaled and keyed as the cluster sees them, through its simulated twin with the
    calibrated overheads (the twin's Conductor still estimates with the profile alone, as the real one, and its
    decode nodes judge a join by the profile, as the real decode workers do: the calibration is their speed)."""
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
        join_step_model=step,
        first_token_overhead_s=calibration.first_token_s,
    )
    scaled = simulation.cluster_requests(config, requests, scaling_of(args))
    conductor = simulation.config_conductor(config, spec)
    return list(DisaggregatedCluster(spec, conductor).run(scaled).records)


def print_comparison(name: str, result: Comparison) -> None:
    print(f"{name}: {result.real.num_requests} requests, {result.compared} completed in both")
    print(
        f"  {'':10}{'TTFT mean':>10}{'p50':>8}{'p90':>8} s {'TBT mean':>10}{'p50':>8}{'p90':>8} ms  hit ratio  rejected"
        "  failed"
    )
    for label, s, failed in (("real", result.real, result.failed_real), ("simulated", result.sim, 0)):
        ttft = "".join(f"{s.ttft_s[k]:>{w}.3f}" for k, w in (("mean", 10), ("p50", 8), ("p90", 8)))
        tbt = "".join(f"{s.tbt_s[k] * 1000:>{w}.2f}" for k, w in (("mean", 10), ("p50", 8), ("p90", 8)))
        print(f"  {label:<10}{ttft}   {tbt}    {s.cache_hit_ratio:>9.3f} {s.rejected:>9} {failed:>7}")
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
            f"  decode batch of {result.decode_max_batch}: the simulated twin rejects {result.rejected_sim_unloaded} "
            f"of these requests at the serviceable pace"
        )


def plot(name: str, real: Sequence[RequestRecord], sim: Sequence[RequestRecord], out: Path) -> None:
    """The CDFs of both runs' TTFT and TBT into `out`; `sim` the records as compared (`Comparison.sim_records`)."""

    def done(records: Sequence[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.outcome is Outcome.COMPLETED and r.ttft_s is not None]

    def tbt_ms(records: Sequence[RequestRecord]) -> list[float]:
        # A one-token answer has no interval (its TBT is 0): left out, as `summarize` leaves it out of the table's TBT.
        return [r.tbt_s * 1000 for r in done(records) if has_tbt(r)]

    ttft = {"real": [r.ttft_s or 0.0 for r in done(real)], "simulated": [r.ttft_s or 0.0 for r in done(sim)]}
    tbt = {"real": tbt_ms(real), "simulated": tbt_ms(sim)}
    plot_cdfs(ttft, out / f"ttft_cdf_{name}.png", xlabel="TTFT (s)", title=f"TTFT, {name}")
    plot_cdfs(tbt, out / f"tbt_cdf_{name}.png", xlabel="TBT (ms)", title=f"TBT, {name}")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=file_path, default=HERE / "configs" / "tiny.toml")
    p.add_argument("--profile", type=file_path, help="fitted cost models to use (default: profile the engines now)")
    load.add_workload_options(p, preset="conversation", num_requests=200, rate=2.0)
    add_scaling_options(p)
    p.add_argument(
        "--overload-speedup", type=float, default=OVERLOAD_SPEEDUP, help="the overload run's arrivals, this much faster"
    )
    p.add_argument(
        "--overload-batch",
        type=int,
        default=OVERLOAD_BATCH,
        help="the overload run's decode batch limit, [decode] max_batch_size (0: the config's)",
    )
    p.add_argument("--no-overload", action="store_true", help="only the serviceable run")
    p.add_argument(
        "--repeat-real", action="store_true", help="run the serviceable workload on a second real cluster and compare"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per request over HTTP, seconds")
    p.add_argument("--out", type=folder_path, help="write validate.json, the profile and CDF plots here")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line: 0, 2 and one line on stderr for an error, 130 after Ctrl-C; SIGTERM stops the
    clusters it started as Ctrl-C does (`run_interruptible`)."""
    return run_interruptible("validate", lambda: validate(argv))


def run_config(config: ClusterConfig, name: str, args: argparse.Namespace) -> ClusterConfig:
    """The cluster config of run `name`, checked against this machine (`with_overrides` does not check it, and an
    overload batch too large to allocate would otherwise kill a worker after the serviceable run's minutes)."""
    if name == "overload":  # the paper's overload: refused at once, not held for decode room
        config = config.with_overrides("limits", admission_wait_s=0.0)
        if args.overload_batch:
            config = config.with_overrides("decode", max_batch_size=args.overload_batch)
    check_machine(config, Machine.here())
    return config


def validate(argv: list[str] | None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        load.check_options(p, args, "validate.py")
        scaling_of(args)
        if args.overload_batch < 0:
            raise ConfigError(
                f"--overload-batch must be a batch size, or 0 for the config's, got {args.overload_batch}"
            )
        if args.no_overload:
            given = simulation.given_options(parser, argv)
            simulation.refuse_unused(
                p, args, ("overload_speedup", "overload_batch"), "with --no-overload (no overload run)", given=given
            )
        # Both workloads before any work (profiling and a real cluster take minutes): their options are named. One
        # read, sped up for each (a trace's skipped lines named once).
        base = simulation.load_workload(args, speedup=1.0)
        workloads = {"serviceable": simulation.sped_up(args, base, args.speedup)}
        if not args.no_overload:
            simulation.check_positive("--overload-speedup", args.overload_speedup)
            speedup = args.speedup * args.overload_speedup
            workloads["overload"] = simulation.sped_up(args, base, speedup, option="--speedup × --overload-speedup")
        serviceable = workloads["serviceable"]
        config = load_config(args.config)
        if args.max_prompt_tokens > config.limits.max_prompt_tokens:
            # The profile is fitted up to the config's limit, and the real cluster answers a longer prompt with a
            # 400 (a failure) where the simulated twin would serve it: the two runs would compare different requests.
            raise ConfigError(
                f"--max-prompt-tokens {args.max_prompt_tokens} is over {args.config}'s [limits] max_prompt_tokens = "
                f"{config.limits.max_prompt_tokens}: its cluster refuses longer prompts (raise the limit there)"
            )
        # Every run's config before any work, the profile (if given) read now: not found wrong by a worker later.
        if args.profile is not None:
            simulation.check_profile(args.profile)  # named by its option, not blamed on the config
        config = load.served_config(config, profile=args.profile, max_prompt_tokens=args.max_prompt_tokens)
        for name in workloads:
            run_config(config, name, args)
        with contextlib.ExitStack() as files:
            if args.out is not None:
                require_pyplot()  # the plots come last: without matplotlib the whole run would be for nothing
                out = files.enter_context(simulation.output_set(args.out, OUT_FILES))  # --out checked now
            else:
                out = Path(files.enter_context(tempfile.TemporaryDirectory(prefix="mooncake-validate-")))
            fitted = args.profile or profile(args.config, config, out / "profile.json")
            config = config.with_overrides("prefill", profile=str(fitted))
            results: dict[str, Comparison] = {}
            repeat: Comparison | None = None
            for name, requests in workloads.items():
                unloaded = None
                this = run_config(config, name, args)
                real, calibration = run_real(this, requests, args)
                sim = run_sim(this, requests, args, calibration)
                if name == "overload" and args.overload_batch:  # what the limit alone refuses, at the serviceable pace
                    unloaded = summarize(run_sim(this, serviceable, args, calibration), Slo()).rejected
                slo = this.slo.objectives()
                results[name] = attrs.evolve(
                    compare(real, sim, slo, this.decode.max_batch_size, calibration),
                    rejected_sim_unloaded=unloaded,
                )
                if name == "serviceable" and args.repeat_real:
                    again, _ = run_real(this, requests, args)
                    repeat = compare(
                        real,
                        again,
                        slo,
                        this.decode.max_batch_size,
                        Calibration(first_token_s=0.0, prefill_scale=1.0, step_s=0.0),
                    )
                if args.out is not None:
                    plot(name, real, results[name].sim_records, out)
            summary = results["serviceable"].to_json()
            if "overload" in results:
                summary["overload"] = results["overload"].to_json()
            if repeat is not None:
                summary["real_repeat"] = {
                    key: getattr(repeat, key)
                    for key in ("ttft_median_rel_error", "ttft_p90_rel_error", "tbt_mean_rel_error")
                }
            # Where the profile is once the run is over: one fitted without --out is removed with its scratch folder.
            kept = args.profile or (args.out / "profile.json" if args.out is not None else None)
            summary["profile"] = None if kept is None else str(kept)
            if args.out is not None:
                write_json(summary, out / "validate.json")
    except (MooncakeError, OSError, subprocess.CalledProcessError) as error:
        print(one_line(f"validate: {error_message(error)}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        shown = kept if kept is not None else "fitted now (temporary, removed: --out keeps it)"
        print(f"validate: {args.config}, {simulation.workload_name(args)}, profile {shown}")
        for name, result in results.items():
            print_comparison(name, result)
        if repeat is not None:
            print(
                f"real against real (a second cluster, the same workload): TTFT error median "
                f"{repeat.ttft_median_rel_error:.1%}, p90 {repeat.ttft_p90_rel_error:.1%}; "
                f"mean TBT error {repeat.tbt_mean_rel_error:.1%}"
            )
    empty = [name for name, result in results.items() if not result.compared]
    if empty:  # errors of nothing are no measurement, whatever the table says
        print(f"validate: no request completed in both runs of {', '.join(empty)}: nothing compared", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
