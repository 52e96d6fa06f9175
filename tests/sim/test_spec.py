"""`mooncake.sim.spec`: what a `ClusterSpec` builds, for any valid spec.

A property: the Conductor built on a spec has one prefill instance per CPP group and one decode instance per
decode node, each holding the spec's decode limits; its estimator charges the spec's prefill cost (a CPP group's
when grouped, a fitted model as given), its transfer model the spec's bandwidth (the NIC's by default), and its
decode selection the spec's step model. Examples: a CPP group larger than the model's layers is refused naming
both; an analytic group is priced by its largest stage's share of the layers.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.cost import HARDWARE, MODELS, ChunkedPipelineCost, FittedPrefillModel, PrefillCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.step import DecodeCostModel, FittedStepModel
from mooncake.sim.spec import ClusterSpec, build_conductor

specs = st.builds(
    lambda groups, size, decode, network, fitted, limits, batch: ClusterSpec(
        num_prefill=groups * size,
        num_decode=decode,
        model=MODELS["llama3-70b"],
        prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xH800"],
        cpp_group_size=size,
        network_bytes_per_s=network,
        prefill_model=FittedPrefillModel(coefficients=(0.01, 1e-4, 1e-9)) if fitted else None,
        step_model=FittedStepModel(coefficients=(0.001, 2e-4, 3e-7)) if fitted else None,
        decode_node_limits=DecodeLimits(kv_capacity_tokens=limits, max_batch_size=batch) if limits else None,
        max_decode_batch_size=None if limits else batch,  # the limits hold the batch slots: given once
    ),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.none() | st.floats(1e8, 1e12),
    st.booleans(),
    st.none() | st.integers(1000, 10**7),
    st.none() | st.integers(1, 256),
)


@given(specs)
def test_a_specs_conductor_is_the_spec(spec: ClusterSpec) -> None:
    conductor = build_conductor(spec)
    assert len(conductor.prefill_views) == spec.num_prefill // spec.cpp_group_size
    assert len(conductor.decode_views) == spec.num_decode
    assert all(view.limits == spec.decode_limits for view in conductor.decode_views)
    if spec.decode_node_limits is None:
        capacity = DecodeCostModel(model=spec.model, hardware=spec.decode_hardware).capacity_tokens()
        assert spec.decode_limits == DecodeLimits(
            kv_capacity_tokens=capacity, max_batch_size=spec.max_decode_batch_size
        )
    estimator = conductor.router.estimator  # type: ignore[attr-defined]
    assert estimator.prefill == spec.prefill_cost and conductor.step_model == spec.decode_cost
    if spec.prefill_model is not None:
        assert spec.prefill_cost is spec.prefill_model and spec.decode_cost is spec.step_model
    elif spec.cpp_group_size > 1:
        assert (
            isinstance(spec.prefill_cost, ChunkedPipelineCost) and spec.prefill_cost.group_size == spec.cpp_group_size
        )
    else:
        assert isinstance(spec.prefill_cost, PrefillCostModel)
    bandwidth = spec.network_bytes_per_s or spec.prefill_hardware.nic_bytes_per_s
    assert estimator.transfer.bandwidth_bytes_per_s == bandwidth
    assert estimator.kv_bytes_per_token == spec.model.kv_bytes_per_token


def test_a_cpp_group_larger_than_the_models_layers_is_refused_naming_both() -> None:
    """A CPP stage holds at least one layer (the engine refuses more stages than layers): a spec whose
    cpp_group_size exceeds the model's layers is a ConfigError naming both, not a group priced as if it ran."""
    shape = attrs.evolve(MODELS["llama3-70b"], name="4-layer", num_layers=4)
    with pytest.raises(ConfigError, match=r"cpp_group_size=5 exceeds the model's num_layers=4"):
        ClusterSpec(
            num_prefill=5,
            num_decode=1,
            model=shape,
            prefill_hardware=HARDWARE["8xA800"],
            decode_hardware=HARDWARE["8xH800"],
            cpp_group_size=5,
        )


def test_a_cpp_groups_price_is_paced_by_its_largest_stage() -> None:
    """The spec's CPP group prices the model's own layers split as the engine splits them: 80 layers on 6
    stages are paced by a 14-layer stage."""
    spec = ClusterSpec(
        num_prefill=6,
        num_decode=1,
        model=MODELS["llama3-70b"],
        prefill_hardware=HARDWARE["8xA800"],
        decode_hardware=HARDWARE["8xH800"],
        cpp_group_size=6,
    )
    cost = spec.prefill_cost
    assert isinstance(cost, ChunkedPipelineCost)
    assert cost.num_layers == 80 and cost.stage_share == 14 / 80
