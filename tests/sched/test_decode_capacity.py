"""Tests for a decode node's KV capacity: the hardware presets' HBM sizes (what the device reports, as vLLM
sizes its KV cache from) and `DecodeCostModel.require_capacity_tokens`, the one check that a model's KV fits
beside its weights, as `build_conductor` asks it."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError
from mooncake.sched.build import build_conductor
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.join import DecodeLimits
from mooncake.sched.step import DecodeCostModel

LLAMA3, A800 = MODELS["llama3-70b"], HARDWARE["8xA800"]
ONE_A800 = attrs.evolve(A800, num_gpus=1)  # 80 GiB under LLaMA3-70B's 141 GB of weights

NVIDIA_SMI_MIB = {"8xA800": 81_920, "8xA100": 81_920, "8xH800": 81_559, "8xH100": 81_559, "8xH200": 143_771}
"""Each GPU's memory total as nvidia-smi reports it (A100/A800 80GB, H100/H800 80GB HBM3, H200 141GB)."""


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_a_presets_hbm_is_the_devices_total_in_bytes(name: str) -> None:
    """HBM per GPU is nvidia-smi's total in MiB × 2**20 (what vLLM scales by gpu_memory_utilization), not the
    datasheet's decimal GB, which reads 8–10 % less."""
    assert set(NVIDIA_SMI_MIB) == set(HARDWARE)
    assert HARDWARE[name].hbm_bytes == NVIDIA_SMI_MIB[name] * 2**20


def test_llama3_70b_on_8xa800_holds_1_456_811_kv_tokens() -> None:
    """⌊(8 · 81,920 MiB · 0.9 − 141.1 GB of weights) / 320 KiB⌋: 711 requests of 2 K tokens (648 with decimal GB)."""
    capacity = DecodeCostModel(model=LLAMA3, hardware=A800).capacity_tokens()
    assert capacity == math.floor((8 * 81_920 * 2**20 * 0.9 - LLAMA3.weight_bytes) / LLAMA3.kv_bytes_per_token)
    assert capacity == 1_456_811 and capacity // 2048 == 711


@given(
    st.sampled_from(sorted(MODELS)),
    st.sampled_from(sorted(HARDWARE)),
    st.integers(1, 8),
    st.floats(1e9, 200e9),
    st.floats(0.05, 1.0),
)
def test_require_capacity_tokens_is_the_capacity_or_a_config_error(
    model: str, hardware: str, num_gpus: int, hbm_bytes: float, fraction: float
) -> None:
    """Where one token of KV fits beside the weights in G · HBM · kv_memory_fraction, the capacity; else a
    ConfigError naming the caller's field, the hardware, the model, and the weights against that budget."""
    hw = attrs.evolve(HARDWARE[hardware], num_gpus=num_gpus, hbm_bytes=hbm_bytes)
    cost = DecodeCostModel(model=MODELS[model], hardware=hw, kv_memory_fraction=fraction)
    room = num_gpus * hbm_bytes * fraction - MODELS[model].weight_bytes
    if room >= MODELS[model].kv_bytes_per_token:
        assert cost.require_capacity_tokens("somewhere.hw") == cost.capacity_tokens() >= 1
        return
    with pytest.raises(ConfigError) as caught:
        cost.require_capacity_tokens("somewhere.hw")
    message = str(caught.value)
    assert f"somewhere.hw={hardware!r} (num_gpus={num_gpus}," in message
    assert f"model={model!r}" in message and "kv_memory_fraction" in message
    assert f"{MODELS[model].weight_bytes / 1e9:.4g} GB" in message
    assert f"{num_gpus * hbm_bytes * fraction / 1e9:.4g} GB" in message


@pytest.mark.parametrize("where", ["hardware", "decode_hardware"])
def test_build_conductor_refuses_decode_hardware_with_no_room_for_kv(where: str) -> None:
    """A decode node whose HBM the weights fill would refuse every request as too long (HTTP 400 to every
    client): `build_conductor` refuses it, naming the argument, unless explicit `decode_limits` size the node."""
    hardware = {"hardware": ONE_A800} if where == "hardware" else {"hardware": A800, "decode_hardware": ONE_A800}
    options = {"model": LLAMA3, "prefill_instances": ["p0"], "decode_instances": ["d0"], "block_size_tokens": 512}
    with pytest.raises(ConfigError, match=rf"^{where}='8xA800' \(num_gpus=1, .*'llama3-70b'.*141\.1 GB"):
        build_conductor(**options, **hardware)  # type: ignore[arg-type]
    limits = DecodeLimits(kv_capacity_tokens=1_000)
    conductor = build_conductor(**options, **hardware, decode_limits=limits)  # type: ignore[arg-type]
    assert [view.limits for view in conductor.decode_views] == [limits]


@given(st.integers(1, 8), st.floats(10e9, 100e9))
def test_a_built_conductors_decode_node_holds_what_the_check_allows(num_gpus: int, hbm_bytes: float) -> None:
    """Sized by HBM, each decode node holds `require_capacity_tokens()` KV tokens, at least one; or the build is
    refused."""
    hw = attrs.evolve(A800, num_gpus=num_gpus, hbm_bytes=hbm_bytes)
    capacity = DecodeCostModel(model=LLAMA3, hardware=hw).capacity_tokens()
    options = {"model": LLAMA3, "hardware": hw, "prefill_instances": ["p0"], "decode_instances": ["d0", "d1"]}
    if capacity == 0:
        with pytest.raises(ConfigError, match="leaves no HBM for the KV"):
            build_conductor(**options, block_size_tokens=512)  # type: ignore[arg-type]
        return
    conductor = build_conductor(**options, block_size_tokens=512)  # type: ignore[arg-type]
    assert [view.limits for view in conductor.decode_views] == [DecodeLimits(kv_capacity_tokens=capacity)] * 2
