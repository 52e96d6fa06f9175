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
    "cost_models",
    "decode_limits",
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


def model_shape(config: ClusterConfig) -> ModelShape:
    """The served model's shape in its dtype (a checkpoint's from its config.json; no weights read)."""
    return config.model.config.shape(config.model.dtype)


def read_profile(path: str) -> tuple[FittedPrefillModel, FittedStepModel]:
    """The prefill and decode models of a profile `examples/profile_engine.py` wrote.

    Raises:
        ConfigError: the file is not JSON, or lacks a valid "prefill" or "decode" section.
    """
    try:
        with open(path) as stream:
            profile = json.load(stream)
    except (OSError, ValueError) as error:  # ValueError: no JSON (or an integer past 4,300 digits)
        raise ConfigError(f"[prefill] profile = {path!r}: {error}") from error
    except RecursionError as error:  # arrays or objects nested past the interpreter's stack
        raise ConfigError(f"[prefill] profile = {path!r}: JSON nested too deeply") from error
    sections = {}
    for name in ("prefill", "decode"):
        if not isinstance(profile, dict) or name not in profile:
            raise ConfigError(f"[prefill] profile = {path!r} has no {name!r} section")
        sections[name] = json.dumps(profile[name])
    try:
        return FittedPrefillModel.from_json(sections["prefill"]), FittedStepModel.from_json(sections["decode"])
    except ConfigError as error:
        raise ConfigError(f"[prefill] profile = {path!r}: {error}") from error


def cost_models(config: ClusterConfig) -> tuple[PrefillModel, AnalyticStepModel]:
    """The prefill model and the decode step model of the config's engines (see the module docstring).

    Raises:
        ConfigError: a profile that cannot be read (see `read_profile`).
    """
    if config.prefill.profile:
        return read_profile(config.prefill.profile)
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
    )
