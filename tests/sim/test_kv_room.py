"""The simulated clusters' decode nodes must hold some KV: `ClusterSpec` (disaggregated) and `CoupledCluster`
ask the one check `build_conductor` asks, `DecodeCostModel.require_capacity_tokens`, and refuse what it refuses
with its message under their own field's name."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.join import DecodeLimits
from mooncake.sched.step import DecodeCostModel
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.spec import ClusterSpec


def _refusal(cost: DecodeCostModel, field: str) -> str | None:
    """The one check's message for `field`, or None where the KV fits."""
    try:
        cost.require_capacity_tokens(field)
    except ConfigError as error:
        return str(error)
    return None


@given(st.sampled_from(sorted(MODELS)), st.sampled_from(sorted(HARDWARE)), st.integers(1, 4), st.floats(10e9, 90e9))
def test_both_simulated_clusters_refuse_exactly_what_the_one_check_refuses(
    model: str, hardware: str, num_gpus: int, hbm_bytes: float
) -> None:
    """Decode hardware with no room for one token of KV beside the weights is a ConfigError carrying the check's
    message (weights against G · HBM · kv_memory_fraction) under `ClusterSpec.decode_hardware` /
    `CoupledSpec.hardware`; hardware with room sizes a node to the check's capacity."""
    hw = attrs.evolve(HARDWARE[hardware], num_gpus=num_gpus, hbm_bytes=hbm_bytes)
    cost = DecodeCostModel(model=MODELS[model], hardware=hw)
    fields: dict[str, Any] = {
        "num_prefill": 1,
        "num_decode": 1,
        "model": MODELS[model],
        "prefill_hardware": HARDWARE["8xA800"],
        "decode_hardware": hw,
    }
    refusal = _refusal(cost, "ClusterSpec.decode_hardware")
    coupled_refusal = _refusal(cost, "CoupledSpec.hardware")
    if refusal is None:
        assert ClusterSpec(**fields).decode_limits == DecodeLimits(kv_capacity_tokens=cost.capacity_tokens())
        assert CoupledCluster(CoupledSpec(num_instances=1, model=MODELS[model], hardware=hw)).capacity_tokens == (
            cost.capacity_tokens()
        )
        return
    assert "kv_memory_fraction" in refusal and coupled_refusal is not None
    with pytest.raises(ConfigError) as caught:
        ClusterSpec(**fields)
    assert str(caught.value) == refusal
    with pytest.raises(ConfigError) as caught:
        CoupledCluster(CoupledSpec(num_instances=1, model=MODELS[model], hardware=hw))
    assert str(caught.value) == coupled_refusal
    limits = DecodeLimits(kv_capacity_tokens=1000)  # a node sized by its engine's own budget needs no HBM check
    assert ClusterSpec(**fields, decode_node_limits=limits).decode_limits == limits
