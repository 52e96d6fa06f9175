"""The cost models of the cluster's engines, one answer for the gateway and the workers (no torch).

Without a profile they are the analytic models on `CPU`, a rough idea of one
CPU engine; with `[prefill] profile` (the JSON `examples/profile_engine.py`
writes) they are the models fitted to this machine's engines. The gateway's
Conductor routes and admits with them, and each decode worker's own join
check asks the same decode rule with the same step model and TBT objective.
"""

from __future__ import annotations

import json

from mooncake.errors import ConfigError
from mooncake.sched.cost import FittedPrefillModel, Hardware, ModelShape, PrefillCostModel, PrefillModel
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel, FittedStepModel
from serving.config import ClusterConfig

__all__ = ["CPU", "cost_models", "model_shape", "read_profile"]

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
    except (OSError, ValueError) as error:
        raise ConfigError(f"[prefill] profile = {path!r}: {error}") from error
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
    return PrefillCostModel(model=shape, hardware=CPU), DecodeCostModel(model=shape, hardware=CPU, overhead_s=0.0)
