"""The cost models of the cluster's engines and its Conductor: one answer for the gateway, the workers and a
simulation of the cluster (no torch).

Without a profile they are the analytic models on `CPU`, a rough idea of one
CPU engine (a prefill instance of `pipeline_size` > 1 priced as a chunked
pipeline of that many, `ChunkedPipelineCost`); with `[prefill] profile` (the JSON `examples/profile_engine.py`
writes) they are the models fitted to this machine's engines: its "prefill"
section (`FittedPrefillModel`) for the router's TTFT estimates and its "decode"
section (`FittedStepModel`) as the Conductor's step model, which its decode
rule's TBT check and decode selection read. `build_conductor(config)` is the
Conductor of the config's policies on them, which routes and admits in the
gateway (and in replay.py's `--config` simulation of the same cluster); each
decode worker's own join check asks the same decode rule with the same step
model, limits (`decode_limits`) and TBT objective.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from mooncake import _json
from mooncake._checks import shown
from mooncake.errors import ConfigError
from mooncake.sched.build import build_conductor as build
from mooncake.sched.conductor import Conductor
from mooncake.sched.cost import (
    ChunkedPipelineCost,
    FittedPrefillModel,
    Hardware,
    ModelShape,
    PrefillCostModel,
    PrefillModel,
)
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel, FittedStepModel
from serving import registry
from serving.config import ClusterConfig

__all__ = [
    "CPU",
    "PREDICTED_DECODE_S",
    "build_conductor",
    "check_measured_for",
    "cost_models",
    "decode_limits",
    "prefill_cache_blocks",
    "model_shape",
    "read_profile",
]

# The analytic cost model's idea of one CPU engine (used without a fitted profile).
CPU = Hardware(
    name="cpu",
    num_gpus=1,
    peak_flops_per_gpu=2e10,
    hbm_bytes_per_s=1e10,
    hbm_bytes=8e9,
    host_to_device_bytes_per_s=1e10,
    nic_bytes_per_s=1e9,
)


# The Conductor's load predictor's uniform decode duration (the paper's predictor, at this cluster's pace).
PREDICTED_DECODE_S = 1.0


def decode_limits(config: ClusterConfig) -> DecodeLimits:
    """What one decode engine holds: the decode worker builds its engine's `DecodeConfig` from these, and the
    Conductor asks the same rule with them (and so does a simulation of the cluster)."""
    return DecodeLimits(
        kv_capacity_tokens=config.decode.max_batch_size * config.decode.max_context_tokens,
        max_batch_size=config.decode.max_batch_size,
        max_context_tokens=config.decode.max_context_tokens,
    )


def prefill_cache_blocks(config: ClusterConfig) -> int:
    """The blocks one prefill instance's cache holds: its DRAM and SSD pages (a chunked-pipeline group caches on
    its first stage). The Conductor counts the blocks queued prompts leave there only that far, and a simulation
    of the cluster gives each node as many."""
    return config.cache.dram_blocks + config.cache.ssd_blocks


def model_shape(config: ClusterConfig) -> ModelShape:
    """The served model's shape in its dtype (a checkpoint's from its config.json; no weights read)."""
    return config.model.config.shape(config.model.dtype)


def read_profile(path: str, *, config: ClusterConfig | None = None) -> tuple[FittedPrefillModel, FittedStepModel]:
    """The prefill and decode models of a profile `examples/profile_engine.py` wrote; with `config`, only if it
    was measured for that cluster's engines (`check_measured_for`).

    Raises:
        ConfigError: the file is not JSON, lacks a valid "prefill" or "decode" section, or (with `config`) was
            measured on other engines; naming `[prefill] profile` and the file.
    """
    try:
        with open(path) as stream:
            profile = _json.loads(stream.read())
    # ValueError: no JSON, an integer past 4,300 digits, nested too deep
    except (OSError, ValueError) as error:
        raise ConfigError(f"[prefill] profile = {path!r}: {error}") from error
    sections = {}
    for name in ("prefill", "decode"):
        if not isinstance(profile, dict) or name not in profile:
            raise ConfigError(f"[prefill] profile = {path!r} has no {name!r} section")
        sections[name] = json.dumps(profile[name])
    if config is not None:
        check_measured_for(profile, config, path=path)
    try:
        return FittedPrefillModel.from_json(sections["prefill"]), FittedStepModel.from_json(sections["decode"])
    except ConfigError as error:
        raise ConfigError(f"[prefill] profile = {path!r}: {error}") from error


def check_measured_for(profile: dict[str, Any], config: ClusterConfig, *, path: str) -> None:
    """That the profile at `path` (its parsed JSON) timed the engines of `config`'s cluster: the fields
    profile_engine.py records of what it ran, each where present equal to the cluster's. A fit of another model,
    dtype, block size or prefill group is another engine's time (a group's fit is the group's whole prefill, used
    as it is, where the unprofiled path prices a pipeline).

    - "model": the cluster's block-key namespace (`[model]` preset and seed, or checkpoint digest, and dtype), as
      `--config` writes it; or, for a cluster of a preset, that preset's bare name, as `--model` writes it (its
      seed-0 weights: the weights' values do not change the time).
    - "dtype", "block_tokens": `[model] dtype` and `block_tokens`.
    - "chunk_tokens": `[prefill] chunk_tokens` (a prefill's chunks: another chunking is another time). A profile
      without it (written before it was recorded) is taken on trust for it.
    - "pipeline_size": `[prefill] pipeline_size`. A profile without it (written before chunked pipelines) timed
      one process: 1.

    A profile without "model", "dtype" or "block_tokens" (every profile_engine.py file has them: a fit written by
    hand, say) is taken on trust for those.

    Raises:
        ConfigError: naming `[prefill] profile`, the file, and each field that differs with both values.
    """
    model = config.model
    names = [model.namespace] + ([model.preset] if model.checkpoint is None else [])
    expected: list[tuple[str, list[Any], str]] = [
        ("model", names, f"{model.namespace!r}, [model] {model.source}"),
        ("dtype", [model.dtype], f"[model] dtype = {model.dtype!r}"),
        ("block_tokens", [model.block_tokens], f"[model] block_tokens = {model.block_tokens}"),
        ("chunk_tokens", [config.prefill.chunk_tokens], f"[prefill] chunk_tokens = {config.prefill.chunk_tokens}"),
        ("pipeline_size", [config.prefill.pipeline_size], f"[prefill] pipeline_size = {config.prefill.pipeline_size}"),
    ]
    differences = []
    for field, allowed, cluster in expected:
        measured = profile.get(field, 1 if field == "pipeline_size" else None)
        # type() too: JSON's true is no 1, and 16.0 no block size
        if measured is not None and not any(type(measured) is type(a) and measured == a for a in allowed):
            differences.append(f"{field} = {shown(measured)} (this cluster: {cluster})")
    if differences:
        raise ConfigError(
            f"[prefill] profile = {path!r} was measured on other engines: {'; '.join(differences)}"
            " (profile this cluster's: examples/profile_engine.py --config)"
        )


def cost_models(config: ClusterConfig) -> tuple[PrefillModel, AnalyticStepModel]:
    """The prefill model and the decode step model of the config's engines (see the module docstring).

    Raises:
        ConfigError: a profile that cannot be read, or one measured on other engines (see `read_profile`).
    """
    if config.prefill.profile:
        return read_profile(config.prefill.profile, config=config)
    shape = model_shape(config)
    prefill: PrefillModel = PrefillCostModel(model=shape, hardware=CPU)
    stages = config.prefill.pipeline_size
    if stages > 1:  # its stages pipeline the chunks (a profile times the group itself: profile_engine.py)
        prefill = ChunkedPipelineCost(base=prefill, group_size=stages, chunk_tokens=config.prefill.chunk_tokens)
    return prefill, DecodeCostModel(model=shape, hardware=CPU, overhead_s=0.0)


def build_conductor(
    config: ClusterConfig, *, prefill_instances: Iterable[str] = (), decode_instances: Iterable[str] = (), seed: int = 0
) -> Conductor:
    """The Conductor of the config's policies and SLOs on its engines' cost models (`cost_models`), its
    decode instances registered with `decode_limits(config)` (the gateway registers none here: its workers
    join as they come up, with the same limits).

    Raises:
        ConfigError: a profile that cannot be read (see `read_profile`).
    """
    prefill, step_model = cost_models(config)
    policy = config.policy
    slo = config.objectives()
    return build(
        model=model_shape(config),
        hardware=CPU,
        prefill_instances=prefill_instances,
        decode_instances=decode_instances,
        hasher=config.model.hasher(),
        router=registry.router(policy.router, threshold=policy.threshold),
        admission=registry.admission(policy.admission),
        # contexts grown at the TBT objective's pace, as the check the predicted load meets counts them
        predictor=UniformDecodePredictor(decode_s=PREDICTED_DECODE_S, step_s=slo.tbt_s),
        slo=slo,
        prefill=prefill,
        step_model=step_model,
        decode_limits=decode_limits(config),
        seed=seed,
        prefill_cache_blocks=prefill_cache_blocks(config),
    )
