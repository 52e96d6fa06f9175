"""How well each decode-load predictor foresees a decode instance's batch (arXiv §6.3).

A replay records, every `--sample-every` seconds, each decode instance's
state (decoding, incoming) and, some horizons later, the load it really had;
each predictor is scored by its mean absolute error on those snapshots: the
current load (no prediction), fixed uniform decode times, a learnt output
length, each request's expected output, and the predictor the predictive
policy uses (`--predictor`: by default the paper's uniform t_d, the workload's
mean output times the TBT objective), in the row named "(policy's)".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import attrs
import simulation
from serving import registry

from mooncake.errors import ConfigError, MooncakeError
from mooncake.sched.join import DecodeLoad
from mooncake.sched.predictor import (
    DEFAULT_LENGTH_WINDOW,
    ExpectedOutputPredictor,
    LoadPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    UniformDecodePredictor,
    score_predictor,
)
from mooncake.sched.step import DecodeCostModel
from mooncake.sched.view import ActiveDecode, QueuedPrefill
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.report import plot_lines
from paper.common import Report, header, policy_conductor

__all__ = ["CurrentLoad", "predictors"]

MAX_SNAPSHOTS = 100_000  # sampling times per decode instance


@attrs.frozen
class CurrentLoad:
    """No prediction: the load at `at_s` is the load now (the baseline every predictor must beat)."""

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        return DecodeLoad(
            len(active),
            sum(a.context_tokens for a in active),
            sum(a.context_tokens + a.output_tokens for a in active),
        )

    def observe(self, output_tokens: int) -> None:
        """Nothing to learn."""


def predictors(args: argparse.Namespace) -> tuple[Report, str]:
    """Mean absolute error of each decode-load predictor against what the replay really did."""
    requests = simulation.load_workload(args)
    spec = simulation.cluster_spec(requests, args)
    slo = simulation.slo(args)
    conductor = policy_conductor(spec, requests, args, slo)
    cluster = DisaggregatedCluster(spec, conductor)
    horizons = args.horizons or [1.0, 5.0, 10.0, 30.0]
    snapshots: dict[float, list[LoadSnapshot]] = {h: [] for h in horizons}

    def observe(now: float) -> None:
        for view in conductor.decode_views:
            active, incoming = tuple(view.active.values()), conductor.incoming(view.instance_id)
            for horizon in horizons:
                cluster.loop.at(now + horizon, settle, horizon, view.instance_id, active, incoming, now)

    def settle(at_s: float, horizon: float, instance: Any, active: Any, incoming: Any, now: float) -> None:
        actual = cluster.decode_load(instance, at_s)
        snapshots[horizon].append(LoadSnapshot(active=active, incoming=incoming, now=now, at_s=at_s, actual=actual))

    warm_up = len(requests) // 5  # the output-length predictor learns from the first fifth
    if not requests:
        raise MooncakeError("the workload is empty")
    start, end = requests[warm_up].arrival_s, requests[-1].arrival_s
    if (end - start) / args.sample_every > MAX_SNAPSHOTS:  # a typo would otherwise look like a hang
        raise ConfigError(
            f"--sample-every {args.sample_every:g} takes {(end - start) / args.sample_every:,.0f} snapshots of "
            f"the {end - start:,.0f} s scored; at most {MAX_SNAPSHOTS:,} (a larger --sample-every)"
        )
    # By index: adding a step far below the clock's resolution would leave t where it was, for ever.
    for index in range(math.floor((end - start) / args.sample_every) + 1):
        cluster.loop.at(start + index * args.sample_every, observe)
    cluster.run(requests, progress=simulation.progress(args, len(requests), "replay"))
    step = DecodeCostModel(model=spec.model, hardware=spec.decode_hardware).step_s(1, 0)
    # Its window holds the whole warm-up (a long trace's fifth is past the default), as the paper's learns from it.
    window = max(DEFAULT_LENGTH_WINDOW, warm_up)
    learnt = OutputLengthPredictor(step_s=step, lengths=[r.output_length for r in requests[:warm_up]], window=window)
    in_use = registry.predictor(args.predictor, requests, slo)  # what predictive_early_rejection would consult
    policy = f"{args.predictor} (policy's)"
    candidates: dict[str, LoadPredictor] = {
        "current_load": CurrentLoad(),
        "uniform_td_10s": UniformDecodePredictor(decode_s=10.0, step_s=slo.tbt_s),
        "uniform_td_5s": UniformDecodePredictor(decode_s=5.0, step_s=slo.tbt_s),
        "output_length": learnt,
        "expected_output": ExpectedOutputPredictor(step_s=slo.tbt_s),
        policy: in_use,
    }
    mae = {
        name: {str(h): attrs.asdict(score_predictor(p, snapshots[h])) for h in horizons}
        for name, p in candidates.items()
    }
    t_d = f", t_d = {in_use.decode_s:.3g} s" if isinstance(in_use, UniformDecodePredictor) else ""
    lines = [
        header(args, requests, spec),
        f"snapshots every {args.sample_every} s per decode instance; the predictive policy's predictor: "
        f"--predictor {args.predictor}{t_d}",
        "",
    ]
    width = max(18, *(len(name) + 2 for name in candidates))
    lines.append(f"{'predictor':<{width}}" + "".join(f"{f'+{h:g}s':>10}" for h in horizons) + "   (MAE of batch size)")
    for name in candidates:
        lines.append(f"{name:<{width}}" + "".join(f"{mae[name][str(h)]['batch_size_mae']:>10.2f}" for h in horizons))
    # The context a step reads is what the TBT check weighs: a predictor can get the batch right and this wrong.
    lines.append(f"{'':<{width}}" + "".join(f"{f'+{h:g}s':>10}" for h in horizons) + "   (MAE of context, k tokens)")
    for name in candidates:
        lines.append(
            f"{name:<{width}}" + "".join(f"{mae[name][str(h)]['context_tokens_mae'] / 1e3:>10.1f}" for h in horizons)
        )
    if args.out:
        plot_lines(
            {n: (horizons, [mae[n][str(h)]["batch_size_mae"] for h in horizons]) for n in candidates},
            args.out / "predictors.png",
            xlabel="horizon (s)",
            ylabel="batch-size MAE",
            title="decode load prediction error",
        )
    return {"mae": mae, "policy_predictor": policy}, "\n".join(lines)
