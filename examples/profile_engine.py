"""Profile the real engines and fit the cost models the cluster's Conductor uses.

    python examples/profile_engine.py [--model tiny | --config CLUSTER.toml] [--out build/profile/tiny.json]
        [--lengths 64,128,256,512] [--prefix-fractions 0,0.25,0.5,0.75] [--batches 1,2,4,8]

With `--config` the engines are the example cluster's as its workers build
them: its model (preset and seed, or checkpoint) and dtype, its block size and
prefill chunk, one torch thread each; lengths above `[limits]
max_prompt_tokens` and batches above `[decode] max_batch_size` are left out.
With `[prefill] pipeline_size` X > 1 a prefill instance is a chunked pipeline
group, and so is the profiled one: this process as stage 0 and X − 1 stage
processes (one thread each), its prefills timed through the group's engine
(`serving.prefill_group`), so the prefill fit is the group's time (as
`ClusterSpec.prefill_model` takes it). Decode is one process either way.
Name the written file as the config's `[prefill] profile` (or pass it to
replay.py's `--profile`) and both the cluster's Conductor and its simulation
use these fits.

1. Prefill: after one untimed warm-up prefill, for every (input length, prefix
   length) of the grid (the prefix is the fraction rounded down to whole blocks;
   fractions that round to the same prefix give one point), the prefix is
   first stored in the node's cache by a prefill of its own, then the whole
   prompt is prefilled and timed (the median of `--repeats` runs, each on a
   fresh cache). `FittedPrefillModel` (c0 + c1·(n − p) + c2·(n² − p²)) is fitted.
2. Decode: step times at each batch size and context length (after an untimed
   step); `FittedStepModel` (c0 + c1·batch + c2·tokens) is fitted for the
   decode rule's TBT check.

Both fits' checks of their points (`check_prefill_points`, `check_step_points`:
enough of them, varying enough) run on the grid before anything is timed.

The JSON written holds both fits, each as its `to_json` writes it, every
sample, and what was measured: `model` (the preset's name, or with `--config`
the cluster's block-key namespace), `dtype`, `block_tokens`, `chunk_tokens` and
`pipeline_size` (the processes each prefill ran on), which the cluster checks
against its own (`serving.models.check_measured_for`):
`FittedPrefillModel.from_json` reads its "prefill" entry back and
`FittedStepModel.from_json` its "decode" entry (`json.dumps(data["decode"])`);
the example cluster's gateway reads both (`[prefill] profile`).

Exit status: 0; 2 with one line on stderr for bad input (an option, the
config, `--out`, a grid the fits cannot use), found before profiling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mooncake.cache import DramPagePool, TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.cli import OneLineParser, one_line
from mooncake.engine.config import PRESETS
from mooncake.errors import ConfigError, MooncakeError
from mooncake.sched.cost import FittedPrefillModel, PrefillSample, check_prefill_points
from mooncake.sched.step import FittedStepModel, check_step_points
from mooncake.sim.report import write_json
from mooncake.types import RequestId, block_count

GROUP_TIMEOUT_S = 120.0  # a CPP group's transfers between stages (the worker's bound is at least 60 s)


def _grid(kind: Callable[[str], float], check: Callable[[float], bool], what: str) -> Callable[[str], list[float]]:
    """An argparse type: a comma-separated list of `kind`, each passing `check`, sorted without repeats (a repeat
    would time the same point twice and weigh it double in the fit)."""

    def parse(text: str) -> list[float]:
        try:
            values = [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of {what}, got {text!r}") from None
        if not all(check(value) for value in values):
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of {what}, got {text!r}")
        return sorted(set(values))

    return parse


def _prefix_tokens(num_tokens: int, fraction: float, block: int) -> int:
    """The prefix a grid point caches: `fraction` of the prompt, rounded down to whole blocks."""
    return int(num_tokens * fraction) // block * block


def _step_point(batch: int, num_tokens: int) -> tuple[int, int]:
    """A decode sample's (batch_size, context_tokens) as the decode phase records it: `batch` requests of a
    `num_tokens` prompt, each counted with two tokens past it."""
    return batch, batch * (num_tokens + 2)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    source.add_argument("--config", type=Path, help="profile this example cluster's engines (module docstring)")
    parser.add_argument(
        "--dtype", default="float32", help="without --config (block and chunk size: a cluster's defaults)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default build/profile/MODEL.json (or CONFIG.json)")
    positive = _grid(int, lambda n: n >= 1, "integers >= 1")
    parser.add_argument("--lengths", type=positive, default="64,128,256,512")
    fractions = _grid(float, lambda f: 0 <= f < 1, "fractions in [0, 1)")
    parser.add_argument("--prefix-fractions", type=fractions, default="0,0.25,0.5,0.75")
    parser.add_argument("--batches", type=positive, default="1,2,4,8")
    parser.add_argument("--repeats", type=_at_least_one, default=3)
    args = parser.parse_args()
    try:
        run(args)
    except (MooncakeError, OSError) as error:
        print(one_line(f"profile_engine: {error}"), file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    """Profile and fit (module docstring), every input checked first.

    Raises:
        ConfigError: the config, the dtype, `--out`, or a grid too small for a fit.
        OSError: the file could not be written.
    """
    lengths: list[int] = args.lengths
    batches: list[int] = args.batches
    if args.config is not None:
        from serving.config import load_config
        from serving.machine import Machine
        from serving.worker import build_model

        cluster = load_config(args.config, machine=Machine())
        dtype, block, chunk = cluster.model.dtype, cluster.model.block_tokens, cluster.prefill.chunk_tokens
        lengths = [n for n in lengths if n <= cluster.limits.max_prompt_tokens]
        batches = [b for b in batches if b <= cluster.decode.max_batch_size]
        name, default_out = cluster.model.namespace, Path("build/profile") / f"{args.config.stem}.json"
    else:  # the engines a cluster of the preset runs by default: its [model] and [prefill] defaults
        from serving.config import ModelSection, PrefillSection

        dtype, block, chunk = args.dtype, ModelSection().block_tokens, PrefillSection().chunk_tokens
        name, default_out = args.model, Path("build/profile") / f"{args.model}.json"
    out = args.out or default_out
    # The points each fit will get, as the profiling below makes them: a prefix rounded down to whole blocks (the
    # cache holds no partial one), so two fractions can give one prefix, which is then timed once (a repeat would
    # weigh double in the fit).
    prefixes = {n: sorted({_prefix_tokens(n, f, block) for f in args.prefix_fractions}) for n in lengths}
    prefills = [(n, p) for n in lengths for p in prefixes[n]]
    steps_planned = [_step_point(b, n) for b in batches for n in lengths]
    planned: list[tuple[str, Callable[[list[int], list[int]], None], list[tuple[int, int]]]] = [
        (
            f"prefill (each length, its prefixes rounded down to blocks of {block} tokens)",
            check_prefill_points,
            prefills,
        ),
        ("decode (each batch at each length)", check_step_points, steps_planned),
    ]
    for what, check, points in planned:  # the fits' own checks, before the (possibly long) profiling, not after it
        try:
            check([a for a, _ in points], [b for _, b in points])
        except ConfigError as error:
            kept = " (of those the config takes)" if args.config is not None else ""
            raise ConfigError(
                f"--lengths {','.join(map(str, lengths)) or '(none)'}{kept}, --prefix-fractions "
                f"{','.join(map(str, args.prefix_fractions))}, --batches {','.join(map(str, batches)) or '(none)'}: "
                f"{what}: {error}"
            ) from error
    import simulation  # examples/, beside this script

    simulation.check_out_dir(out.parent)  # found before the profiling, not after it
    # The engines (and torch, seconds to import) only now: a run refused above never needs them.
    import torch

    from mooncake.engine.decode import DecodeConfig, DecodeEngine
    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel
    from mooncake.engine.prefill import PrefillConfig, PrefillEngine

    stages = 1
    if args.config is not None:
        model = build_model(cluster)
        torch.set_num_threads(1)  # as each worker runs (many engines share the machine's cores)
        stages = cluster.prefill.pipeline_size
    else:
        model = LlamaModel(PRESETS[args.model], seed=0, dtype=dtype)
    config = model.config
    hasher = BlockHasher(model=name, block_size_tokens=block)
    layout = KvLayout(config=config, block_tokens=block, dtype=dtype)
    options = PrefillConfig(chunk_tokens=chunk)
    rng = np.random.default_rng(0)

    def fresh_cache(tokens: int) -> TieredCache:
        return TieredCache([DramPagePool(layout.page_bytes, 2 * (tokens // block + 2))])

    with contextlib.ExitStack() as resources:
        if stages > 1:  # the prefill instance's engine as its worker builds it
            from serving.prefill_group import group_prefill_engine, start_group

            print(f"prefill through a chunked pipeline group of {stages} processes")
            group = resources.enter_context(start_group(cluster, timeout_s=GROUP_TIMEOUT_S))

            def prefill_engine(cache: TieredCache) -> PrefillEngine:
                return group_prefill_engine(group, cache, hasher)
        else:

            def prefill_engine(cache: TieredCache) -> PrefillEngine:
                return PrefillEngine(model, cache, hasher, options)

        # Untimed, as decode's first step is: the first prefill pays for the engine's first use (allocations,
        # kernels chosen, a group's stages connecting), which would otherwise land on the grid's first point. Its
        # own prompt (another generator), so the grid's prompts are the same with or without it.
        warm_up = np.random.default_rng(1).integers(0, config.vocab_size, size=lengths[-1]).tolist()
        with prefill_engine(fresh_cache(lengths[-1])) as engine:
            engine.prefill(warm_up)
        samples: list[PrefillSample] = []
        for n in lengths:
            tokens = rng.integers(0, config.vocab_size, size=n).tolist()
            for prefix in prefixes[n]:
                times = []
                for _ in range(args.repeats):
                    with prefill_engine(fresh_cache(n)) as engine:
                        if prefix:
                            engine.prefill([*tokens[:prefix], 0])  # stores the prefix's blocks
                        result = engine.prefill(tokens)
                    times.append(result.seconds)
                samples.append(
                    PrefillSample(num_tokens=n, prefix_tokens=result.prefix_tokens, seconds=statistics.median(times))
                )
                print(f"prefill n={n:>6} prefix={result.prefix_tokens:>6}  {samples[-1].seconds * 1e3:9.2f} ms")
    prefill = FittedPrefillModel.fit(samples)
    print(f"prefill fit: c = {prefill.coefficients}, mean relative error {prefill.mean_relative_error:.1%}")

    steps: list[tuple[int, int, float]] = []
    # Every length's prompt stays cached at once (the decoders join them all): room for each, two pages of slack
    # apiece, so that none is evicted before its decoder joins it.
    cache = TieredCache([DramPagePool(layout.page_bytes, sum(block_count(n, block) + 2 for n in lengths))])
    with PrefillEngine(model, cache, hasher, options) as engine:
        prompts = {n: engine.prefill(rng.integers(0, config.vocab_size, size=n).tolist()) for n in lengths}
    for batch in batches:
        for n, done in prompts.items():
            decoder = DecodeEngine(
                model,
                cache,
                block_tokens=block,
                config=DecodeConfig(max_batch_size=batch, max_context_tokens=n + 8),
            )
            for r in range(batch):
                decoder.try_join(
                    RequestId(r), done.keys, prompt_tokens=n, first_token=done.first_token, max_new_tokens=6
                )
            decoder.step()  # warm-up
            times = []
            for _ in range(3):
                decoder.step()
                times.append(decoder.last_step_s)
            steps.append((*_step_point(batch, n), statistics.median(times)))
            print(f"decode batch={batch:>3} context={n:>6}  {steps[-1][2] * 1e3:9.3f} ms/step")
    step_model = FittedStepModel.fit(steps)
    print(f"decode fit: c = {step_model.coefficients}")

    write_json(
        {
            "model": name,
            "dtype": dtype,
            "block_tokens": block,
            "chunk_tokens": chunk,  # a prefill's chunks: a fit is that chunking's time
            "pipeline_size": stages,  # the processes each prefill sample ran on (its fit is that group's time)
            "prefill": json.loads(prefill.to_json()),
            "decode": json.loads(step_model.to_json()),
            "prefill_samples": [[s.num_tokens, s.prefix_tokens, s.seconds] for s in samples],
            "decode_samples": [list(s) for s in steps],
        },
        out,
    )
    print(f"written {out}")


if __name__ == "__main__":
    main()
