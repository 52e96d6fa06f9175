"""Tests for `mooncake.sched.cost`.

Example tests pin the paper's figures (Eq. 2 on 8×A800 and 8×H800, 320 KiB of
KV per token for LLaMA3-70B) and compare the analytic prefill time with the
profile-based simulator Vidur; properties cover the FLOPs model, the fitted
model (recovery of known coefficients, JSON round trip, rejected inputs),
transfer congestion, decode step time (the roofline: memory-bound in small
batches, compute-bound in large ones, equal to its `RooflineStep` to the bit)
and capacity.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import (
    HARDWARE,
    MODELS,
    ChunkedPipelineCost,
    FittedPrefillModel,
    Hardware,
    ModelShape,
    PrefillCostModel,
    PrefillSample,
    TransferCostModel,
    prefill_flops,
    reuse_bandwidth_bytes_per_s,
    transfers_in_flight,
)
from mooncake.sched.step import AnalyticStepModel, DecodeCostModel, FittedStepModel, RooflineStep, StepBranch
from mooncake.types import Tier

LLAMA3 = MODELS["llama3-70b"]
VIDUR_PREFILL_8192_ON_8XA100_S = 0.99  # Vidur's profile-based prediction for a 70B model, 8,192 tokens, 8×A100
TRUE_COEFFICIENTS = (0.012, 4.0e-5, 3.0e-9)  # c0 s, c1 s/token, c2 s/token² of the synthetic "measurements"

models = st.sampled_from(sorted(MODELS.values(), key=lambda m: m.name))
hardware = st.sampled_from(sorted(HARDWARE.values(), key=lambda h: h.name))
token_counts = st.integers(min_value=0, max_value=200_000)


def synthetic_samples(coefficients: tuple[float, float, float], *, noise: float, seed: int) -> list[PrefillSample]:
    """Prefill "measurements" of the fitted model's form, with multiplicative noise."""
    rng = random.Random(seed)
    c0, c1, c2 = coefficients
    samples = []
    for n in (128, 512, 1024, 2048, 4096, 8192, 16384, 32768):
        for p in (0, n // 4, n // 2, n - 64):
            exact = c0 + c1 * (n - p) + c2 * (n * n - p * p)
            samples.append(
                PrefillSample(num_tokens=n, prefix_tokens=p, seconds=exact * (1 + rng.uniform(-noise, noise)))
            )
    return samples


# ---------------------------------------------------------------------------- paper figures


def test_kv_bytes_per_token_of_llama3_70b_is_320_kib() -> None:
    """LLaMA3-70B (80 layers, d 8,192, GQA 8, bf16) holds 320 KiB of KV per token."""
    assert LLAMA3.kv_bytes_per_token == 320 * 1024


@pytest.mark.parametrize(("preset", "expected_gb_per_s"), [("8xA800", 6.0), ("8xH800", 19.0)])
def test_reuse_bandwidth_matches_the_paper(preset: str, expected_gb_per_s: float) -> None:
    """Eq. 2 for LLaMA3-70B at prefix 8,192 is within 5 % of the paper's 6 GB/s (8×A800) and 19 GB/s (8×H800)."""
    bandwidth = reuse_bandwidth_bytes_per_s(LLAMA3, HARDWARE[preset], 8192)
    assert bandwidth / 1e9 == pytest.approx(expected_gb_per_s, rel=0.05)


def test_analytic_prefill_is_close_to_vidur() -> None:
    """Analytic prefill of 8,192 tokens of a 70B model on 8×A100 (default MFU) is within 15 % of Vidur's 0.99 s."""
    cost = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA100"])
    analytic_s = cost.prefill_s(8192)
    gap = analytic_s / VIDUR_PREFILL_8192_ON_8XA100_S - 1
    print(f"\nprefill 8192 tokens, 70B, 8xA100, MFU {cost.mfu}: analytic {analytic_s:.3f} s, Vidur 0.99 s ({gap:+.1%})")
    assert analytic_s == pytest.approx(VIDUR_PREFILL_8192_ON_8XA100_S, rel=0.15)


def test_reuse_bandwidth_is_kv_size_over_peak_compute_time() -> None:
    """Eq. 2 is KV(p) / (FLOPs(p) / peak): it scales with peak FLOPs and is independent of MFU."""
    a800, h800 = HARDWARE["8xA800"], HARDWARE["8xH800"]
    ratio = reuse_bandwidth_bytes_per_s(LLAMA3, h800, 8192) / reuse_bandwidth_bytes_per_s(LLAMA3, a800, 8192)
    assert ratio == pytest.approx(h800.peak_flops / a800.peak_flops)
    compute_s = prefill_flops(LLAMA3, 8192) / a800.peak_flops
    assert reuse_bandwidth_bytes_per_s(LLAMA3, a800, 8192) == pytest.approx(
        8192 * LLAMA3.kv_bytes_per_token / compute_s
    )


# ---------------------------------------------------------------------------- FLOPs and analytic prefill


def test_prefill_flops_hand_example() -> None:
    """FLOPs(n, p) = l·(4·(n² − p²)·d + 22·(n − p)·d²) on a tiny shape."""
    shape = ModelShape(name="tiny", num_layers=2, hidden_size=3, gqa=1, num_params=1.0)
    assert prefill_flops(shape, 5, 2) == 2 * (4 * (25 - 4) * 3 + 22 * 3 * 9)
    assert prefill_flops(shape, 5) == 2 * (4 * 25 * 3 + 22 * 5 * 9)


def test_prefill_flops_and_reuse_bandwidth_count_numpy_integers_exactly() -> None:
    """A numpy count squares in Python ints, as `prefill_s`'s does (`_prefill_tokens`): at 2 M tokens of LLaMA3-70B
    numpy's int64 wrapped, to negative FLOPs and a negative bandwidth."""
    n = 2_097_152
    assert prefill_flops(LLAMA3, np.int64(n)) == prefill_flops(LLAMA3, n) > 0
    assert prefill_flops(LLAMA3, np.int64(n), np.int32(1024)) == prefill_flops(LLAMA3, n, 1024)
    a800 = HARDWARE["8xA800"]
    assert reuse_bandwidth_bytes_per_s(LLAMA3, a800, np.int64(n)) == reuse_bandwidth_bytes_per_s(LLAMA3, a800, n) > 0


@pytest.mark.parametrize("bad", [math.nan, 1.5, 8.0, -10, "8", None, True, 2**40 + 1], ids=repr)
def test_prefill_flops_and_reuse_bandwidth_refuse_counts_by_name(bad: Any) -> None:
    """FLOPs of NaN, 1.5 or -10 tokens were NaN, a fraction or 0: each count is refused naming it and the value, as
    `prefill_s` refuses it (`_prefill_tokens`); a prefix may still be 0 or negative (none cached). Eq. 2's prefix is
    a token count too (a ConfigError, as it was for one below 1)."""
    with pytest.raises(InvalidRequestError, match=r"num_tokens must be an integer in \[1, 2\*\*40\], got"):
        prefill_flops(LLAMA3, bad)
    if bad not in (-10, 2**40 + 1):  # fewer than no tokens cached is none; more than the prompt, all of it
        with pytest.raises(InvalidRequestError, match=r"prefix_tokens must be an integer, got"):
            prefill_flops(LLAMA3, 100, bad)
    with pytest.raises(ConfigError, match=r"prefix_tokens must be an integer in \[1, 2\*\*40\], got"):
        reuse_bandwidth_bytes_per_s(LLAMA3, HARDWARE["8xA800"], bad)
    assert prefill_flops(LLAMA3, 0) == 0 and prefill_flops(LLAMA3, 100, -10) == prefill_flops(LLAMA3, 100)


@given(
    st.sampled_from(sorted(MODELS)),
    st.sampled_from(sorted(HARDWARE)),
    st.floats(0.05, 1.0),
    st.floats(0.0, 0.1),
    st.sampled_from([Tier.DRAM, Tier.VRAM]),
    st.integers(1, 2**20),
    st.integers(-4, 2**20 + 4),
)
def test_prefill_s_is_its_formula_bit_for_bit(
    model: str, hardware: str, mfu: float, overhead_s: float, tier: Tier, n: int, p: int
) -> None:
    """`prefill_s` (which reads the shape's figures once) is `prefill_flops` / (peak · MFU), with the cached
    prefix's load overlapped layer by layer, to the bit: no edit of `prefill_flops` can leave it behind."""
    cost = PrefillCostModel(
        model=MODELS[model], hardware=HARDWARE[hardware], mfu=mfu, overhead_s=overhead_s, prefix_tier=tier
    )
    shape, gpus = MODELS[model], HARDWARE[hardware]
    if n <= p:
        assert cost.prefill_s(n, p) == 0.0
        return
    compute = prefill_flops(shape, n, p) / (gpus.peak_flops * mfu)
    expected = overhead_s + compute
    if p > 0 and tier is not Tier.VRAM:
        load = p * shape.kv_bytes_per_token / gpus.host_to_device_bytes_per_s
        layers = shape.num_layers
        expected = overhead_s + max(load / layers + compute, load + compute / layers)
    assert cost.prefill_s(n, p) == expected


def test_token_flops_hand_example() -> None:
    """One token: 2 FLOPs per multiplied weight (an embedding lookup is none), 4 · l · d per context token."""
    shape = ModelShape(name="tiny", num_layers=2, hidden_size=3, gqa=1, num_params=100.0, lookup_params=30.0)
    assert shape.flops_per_token() == 140.0
    assert shape.flops_per_token(5) == 140.0 + 5 * 4 * 2 * 3
    with pytest.raises(ConfigError, match="lookup_params=100"):
        ModelShape(name="tiny", num_layers=2, hidden_size=3, gqa=1, num_params=100.0, lookup_params=100.0)


@given(models, token_counts, token_counts)
def test_prefill_flops_monotone_in_tokens(model: ModelShape, n: int, extra: int) -> None:
    """More tokens (same prefix) never cost fewer FLOPs; strictly more once past the prefix."""
    p = n // 2
    assert prefill_flops(model, n + extra, p) >= prefill_flops(model, n, p)
    if extra and n + extra > p:
        assert prefill_flops(model, n + extra, p) > prefill_flops(model, n, p)


@given(models, st.integers(min_value=1, max_value=200_000), st.data())
def test_prefill_flops_decreasing_in_prefix(model: ModelShape, n: int, data: st.DataObject) -> None:
    """A longer cached prefix strictly lowers the FLOPs while it is shorter than the prompt."""
    p = data.draw(st.integers(min_value=0, max_value=n - 1))
    q = data.draw(st.integers(min_value=p + 1, max_value=n))
    assert prefill_flops(model, n, q) < prefill_flops(model, n, p)


@given(models, token_counts, st.integers(min_value=0, max_value=10_000))
def test_prefill_flops_zero_when_prefix_covers_prompt(model: ModelShape, n: int, extra: int) -> None:
    """Nothing is computed when the prefix covers the prompt, and the analytic time is then zero."""
    assert prefill_flops(model, n, n + extra) == 0
    cost = PrefillCostModel(model=model, hardware=HARDWARE["8xA800"], overhead_s=0.01)
    assert cost.prefill_s(n, n + extra) == 0.0


@given(models, hardware, st.integers(min_value=1, max_value=100_000), st.floats(min_value=0.05, max_value=1.0))
def test_analytic_prefill_is_flops_over_effective_compute(model: ModelShape, hw: Hardware, n: int, mfu: float) -> None:
    """prefill_s = overhead + FLOPs / (G · peak · MFU), the cached prefix's load from DRAM overlapping
    the compute layer by layer; half the MFU doubles the compute time."""
    cost = PrefillCostModel(model=model, hardware=hw, mfu=mfu, overhead_s=0.002)
    compute = prefill_flops(model, n, n // 3) / (hw.num_gpus * hw.peak_flops_per_gpu * mfu)
    load = (n // 3) * model.kv_bytes_per_token / hw.host_to_device_bytes_per_s
    layers = model.num_layers
    expected = 0.002 + (max(load / layers + compute, load + compute / layers) if n // 3 else compute)
    assert cost.prefill_s(n, n // 3) == pytest.approx(expected)
    half = PrefillCostModel(model=model, hardware=hw, mfu=mfu / 2)
    assert half.prefill_s(n) == pytest.approx(2 * (cost.prefill_s(n) - 0.002))


def test_cached_prefix_load_hides_under_compute_layer_by_layer() -> None:
    """A prefix loaded from DRAM costs only its first layer's load while compute is the bottleneck;
    over a slow host link the load is the bottleneck and the compute hides under it instead."""
    fast = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    compute = prefill_flops(LLAMA3, 9000, 8192) / (HARDWARE["8xA800"].peak_flops * 0.5)
    load = 8192 * LLAMA3.kv_bytes_per_token / 128e9  # 21 ms
    assert compute > load
    assert fast.prefill_s(9000, 8192) == pytest.approx(load / 80 + compute)
    slow_link = attrs.evolve(HARDWARE["8xA800"], host_to_device_bytes_per_s=1e9)
    slow = PrefillCostModel(model=LLAMA3, hardware=slow_link)
    slow_load = 8192 * LLAMA3.kv_bytes_per_token / 1e9  # 2.7 s
    assert slow.prefill_s(9000, 8192) == pytest.approx(slow_load + compute / 80)
    assert slow.prefill_s(9000) == fast.prefill_s(9000)  # nothing cached: nothing loaded


@pytest.mark.parametrize("field", ["mfu", "overhead_s"])
def test_prefill_cost_model_rejects_bad_fields(field: str) -> None:
    """A non-positive MFU or a negative overhead is a ConfigError."""
    with pytest.raises(ConfigError):
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], **{field: -1.0})


@pytest.mark.parametrize("tier", ["vram", "VRAM", None, 3, 0.0])
def test_a_prefix_tier_that_is_no_tier_is_refused(tier: object) -> None:
    """A tier from a config file or a CLI ("vram"), None or a number is no `Tier`: a ConfigError naming the field
    and showing the value (it once priced as a load from DRAM, silently)."""
    with pytest.raises(ConfigError, match=r"PrefillCostModel\.prefix_tier") as caught:
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], prefix_tier=tier)  # type: ignore[arg-type]
    assert repr(tier) in str(caught.value)
    for valid in Tier:
        assert PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], prefix_tier=valid).prefix_tier is valid


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], mfu=7.0), "mfu"),
        (
            lambda: DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], memory_efficiency=3.0),
            "memory_efficiency",
        ),
        (
            lambda: DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], compute_efficiency=1.5),
            "compute_efficiency",
        ),
        (
            lambda: DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], kv_memory_fraction=2.0),
            "kv_memory_fraction",
        ),
        (lambda: attrs.evolve(LLAMA3, hidden_size=4, gqa=8), "gqa=8"),
        (lambda: attrs.evolve(LLAMA3, gqa=3), "gqa=3"),
        (lambda: FittedPrefillModel(coefficients=(math.nan, 1.0, 1.0)), "c0"),
        (
            lambda: FittedPrefillModel.from_json(
                '{"coefficients": [NaN, 1, 1], "mean_relative_error": 0, "max_relative_error": 0}'
            ),
            "c0",
        ),
        (
            lambda: FittedPrefillModel.fit(
                [PrefillSample(num_tokens=n, prefix_tokens=0, seconds=math.nan) for n in (1, 2, 3)]
            ),
            "finite",
        ),
        (lambda: FittedStepModel(coefficients=(1.0, 1.0)), "coefficients"),  # type: ignore[arg-type]
        (lambda: FittedStepModel.fit([(1, 2, "x"), (2, 3, 1.0), (3, 5, 2.0)]), "numbers"),  # type: ignore[list-item]
        (lambda: FittedStepModel.fit(None), "samples must be an iterable"),  # type: ignore[arg-type]
        (lambda: FittedStepModel.fit([(0, 10, 1.0), (1, 20, 2.0), (2, 5, 3.0)]), "batch_size >= 1"),
        (lambda: FittedStepModel.fit([(1, -10, 1.0), (1, 20, 2.0), (2, 5, 3.0)]), "context_tokens >= 0"),
        (lambda: FittedStepModel.fit([(1, 10, -1.0), (2, 20, -2.0), (3, 5, -3.0)]), "seconds > 0"),
        (lambda: FittedStepModel.fit([(1, 10, 0.0), (2, 20, 2.0), (3, 5, 3.0)]), "seconds > 0"),
        (lambda: FittedStepModel(coefficients=(0.0, -1e308, 1e308)), "coefficient c1=-1e\\+308 is too large"),
        (lambda: FittedStepModel.from_json('{"coefficients": [1e308, 1e308, 0.0]}'), "coefficient c0"),
        (lambda: StepBranch(0.0, 0.0, 1e300), "per_context_token_s"),
        (lambda: reuse_bandwidth_bytes_per_s(LLAMA3, HARDWARE["8xA800"], 0), "prefix_tokens"),
    ],
)
def test_out_of_range_shapes_fractions_and_coefficients_are_refused(make: Any, field: str) -> None:
    """A share of a peak above 1, a head grouping that does not divide the width (a silent zero KV size
    once), or a coefficient or sample that is not a finite number: a ConfigError naming it."""
    with pytest.raises(ConfigError, match=field):
        make()


@pytest.mark.parametrize(
    "model",
    [
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"], prefix_tier=Tier.VRAM),
        ChunkedPipelineCost(
            base=PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]), group_size=2, chunk_tokens=64
        ),
        FittedPrefillModel(coefficients=(0.0, 1e-3, 1e-7)),
    ],
    ids=["analytic", "analytic_vram", "chunked_pipeline", "fitted"],
)
@given(st.integers(1, 20_000), st.integers(-(10**6), -1))
def test_fewer_than_no_tokens_cached_is_none(model: Any, num_tokens: int, prefix_tokens: int) -> None:
    """A negative prefix is read as `prefill_flops` reads one, as none: it adds no compute for tokens before the
    prompt's first (priced as is, (n - p) and n² - p² counted tokens that do not exist)."""
    assert model.prefill_s(num_tokens, prefix_tokens) == model.prefill_s(num_tokens, 0)
    assert prefill_flops(LLAMA3, num_tokens, prefix_tokens) == prefill_flops(LLAMA3, num_tokens)


# ---------------------------------------------------------------------------- fitted model


def test_fitted_model_recovers_exact_coefficients() -> None:
    """Noise-free samples of the model's own form give back its coefficients and a near-zero error."""
    fitted = FittedPrefillModel.fit(synthetic_samples(TRUE_COEFFICIENTS, noise=0.0, seed=0))
    for got, want in zip(fitted.coefficients, TRUE_COEFFICIENTS, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert fitted.mean_relative_error < 1e-9
    assert fitted.max_relative_error < 1e-9


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_fitted_model_with_noise_reports_small_error(seed: int) -> None:
    """With ±2 % noise the fit's reported errors stay within the noise and it predicts unseen points closely."""
    fitted = FittedPrefillModel.fit(synthetic_samples(TRUE_COEFFICIENTS, noise=0.02, seed=seed))
    assert 0 < fitted.mean_relative_error <= fitted.max_relative_error < 0.05
    c0, c1, c2 = TRUE_COEFFICIENTS
    for n, p in [(3000, 0), (12000, 6000), (20000, 100)]:
        truth = c0 + c1 * (n - p) + c2 * (n * n - p * p)
        assert fitted.prefill_s(n, p) == pytest.approx(truth, rel=0.03)


def test_fitted_model_matches_analytic_when_fed_analytic_samples() -> None:
    """Fitted to the analytic model's own times, the fit reproduces them (both share their features once
    loading the cached prefix costs nothing: an infinitely fast host link)."""
    instant_load = attrs.evolve(HARDWARE["8xH800"], host_to_device_bytes_per_s=1e30)
    analytic = PrefillCostModel(model=LLAMA3, hardware=instant_load, overhead_s=0.003)
    samples = [
        PrefillSample(num_tokens=n, prefix_tokens=p, seconds=analytic.prefill_s(n, p))
        for n in (256, 1024, 4096, 8192, 16384)
        for p in (0, n // 2)
    ]
    fitted = FittedPrefillModel.fit(samples)
    assert fitted.max_relative_error < 1e-6
    assert fitted.prefill_s(6000, 1000) == pytest.approx(analytic.prefill_s(6000, 1000), rel=1e-6)
    assert fitted.prefill_s(100, 100) == 0.0


def test_a_fitted_prefill_never_costs_more_for_a_cached_prefix() -> None:
    """Six noisy start-up timings of three lengths (the vLLM router's calibration on a loaded CPU) fit
    exactly by the unconstrained curve give it a negative linear term: a short cached prefix then *raised*
    the estimate, and at some lengths the curve went below zero (clamped: every server tied at 0 s, so the
    prefix holder lost half the time). The fit keeps every coefficient >= 0."""
    timings = [(64, 0.050), (256, 0.046), (512, 0.081), (64, 0.052), (256, 0.047), (512, 0.079)]
    n = np.array([t[0] for t in timings], dtype=np.float64)
    y = np.array([t[1] for t in timings])
    unconstrained = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], axis=1) / y[:, None], y / y, rcond=None)[0]
    assert unconstrained[1] < 0  # the case this test is about
    fitted = FittedPrefillModel.fit([PrefillSample(num_tokens=a, prefix_tokens=0, seconds=b) for a, b in timings])
    assert min(fitted.coefficients) >= 0
    assert fitted.prefill_s(530, 480) < fitted.prefill_s(530, 100) < fitted.prefill_s(530, 0)


@given(
    st.lists(st.tuples(st.integers(1, 40_000), st.floats(0.0, 0.99), st.floats(1e-4, 10.0)), min_size=3, max_size=24),
    st.integers(2, 40_000),
    st.integers(0, 40_000),
    st.integers(0, 40_000),
)
def test_a_fitted_prefill_is_monotone_in_its_uncached_tokens(
    timings: list[tuple[int, float, float]], n: int, p: int, q: int
) -> None:
    """Whatever the timings: every coefficient is >= 0, so a longer cached prefix never makes a prefill of the
    same prompt slower, nor a longer prompt with the same prefix faster (Algorithm 1 relies on both)."""
    samples = [
        PrefillSample(num_tokens=tokens, prefix_tokens=int(tokens * cached), seconds=seconds)
        for tokens, cached, seconds in timings
    ]
    try:
        fitted = FittedPrefillModel.fit(samples)
    except ConfigError as error:
        assert "vary" in str(error)
        return
    assert min(fitted.coefficients) >= 0
    shorter, longer = sorted((min(p, n - 1), min(q, n - 1)))
    assert fitted.prefill_s(n, longer) <= fitted.prefill_s(n, shorter) <= fitted.prefill_s(n + 1, shorter)


def test_fitted_model_round_trips_through_json() -> None:
    """from_json(to_json(m)) == m, errors included."""
    fitted = FittedPrefillModel.fit(synthetic_samples(TRUE_COEFFICIENTS, noise=0.05, seed=3))
    assert FittedPrefillModel.from_json(fitted.to_json()) == fitted


@pytest.mark.parametrize(
    "text",
    ["", "not json", "null", "[]", "{}", '{"coefficients": [1, 2]}', '{"coefficients": ["a", 1, 2]}'],
)
def test_fitted_model_from_json_rejects_other_text(text: str) -> None:
    """Text that is not a saved fitted model is a ConfigError."""
    with pytest.raises(ConfigError):
        FittedPrefillModel.from_json(text)


def test_fitted_model_rejects_too_few_samples() -> None:
    """Fewer than three samples cannot fit three coefficients."""
    two = synthetic_samples(TRUE_COEFFICIENTS, noise=0.0, seed=0)[:2]
    with pytest.raises(ConfigError, match="at least 3"):
        FittedPrefillModel.fit(two)
    with pytest.raises(ConfigError):
        FittedPrefillModel.fit([])


@pytest.mark.parametrize(
    "samples",
    [
        [PrefillSample(num_tokens=1000, prefix_tokens=0, seconds=0.1)] * 5,  # one point repeated
        [PrefillSample(num_tokens=1000 + k, prefix_tokens=k, seconds=0.1) for k in (0, 0, 0, 0)],
        [PrefillSample(num_tokens=n, prefix_tokens=0, seconds=0.1 * n) for n in (100, 200)] * 3,  # two points
    ],
    ids=["repeated", "same-point", "two-points"],
)
def test_fitted_model_rejects_degenerate_samples(samples: list[PrefillSample]) -> None:
    """Samples that do not vary in both n − p and n² − p² are a ConfigError."""
    with pytest.raises(ConfigError, match="vary"):
        FittedPrefillModel.fit(samples)


@pytest.mark.parametrize(
    "bad",
    [
        PrefillSample(num_tokens=100, prefix_tokens=100, seconds=0.1),
        PrefillSample(num_tokens=100, prefix_tokens=0, seconds=0.0),
    ],
    ids=["nothing-computed", "zero-time"],
)
def test_fitted_model_rejects_impossible_samples(bad: PrefillSample) -> None:
    """A measurement the fit cannot use (nothing computed, no time) is a ConfigError from the fit."""
    with pytest.raises(ConfigError):
        FittedPrefillModel.fit([*synthetic_samples(TRUE_COEFFICIENTS, noise=0.0, seed=0), bad])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"num_tokens": 100.0}, "num_tokens"),
        ({"num_tokens": 2**40 + 1}, "num_tokens"),
        ({"prefix_tokens": -4096}, "prefix_tokens"),
        ({"prefix_tokens": None}, "prefix_tokens"),
        ({"seconds": math.nan}, "seconds"),
        ({"seconds": math.inf}, "seconds"),
        ({"seconds": -1.0}, "seconds"),
        ({"seconds": "0.1"}, "seconds"),
    ],
    ids=repr,
)
def test_a_sample_that_is_no_measurement_is_refused(fields: dict[str, object], named: str) -> None:
    """A bool or negative token count, or seconds that are not a finite time >= 0, is no measured prefill: a
    ConfigError naming `PrefillSample.<field>` and showing the value at construction (the fit once took a NaN
    time and a negative prefix as data)."""
    with pytest.raises(ConfigError, match=rf"PrefillSample\.{named}\b") as caught:
        PrefillSample(**{"num_tokens": 100, "prefix_tokens": 0, "seconds": 0.1, **fields})  # type: ignore[arg-type]
    assert repr(next(iter(fields.values()))) in str(caught.value)
    numpy_sample = PrefillSample(num_tokens=np.int64(100), prefix_tokens=np.int64(0), seconds=0.1)  # type: ignore[arg-type]
    assert numpy_sample.num_tokens == 100  # a measurement read from an array is one


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([(1000, 0, 0.1), (2000, 0, 0.3), (4000, 0, 0.9)], "PrefillSample items"),
        ([PrefillSample(num_tokens=n, prefix_tokens=0, seconds=5e-324 * n) for n in (1, 2, 4, 8)], "too small"),
        ([PrefillSample(num_tokens=n, prefix_tokens=0, seconds=1.7e308) for n in (1, 2, 4, 8)], "coefficient c0="),
    ],
    ids=["tuples", "subnormal-seconds", "overflowing-fit"],
)
def test_a_fit_that_floats_cannot_hold_is_refused(samples: list[Any], message: str) -> None:
    """Items that are no samples, times so small that their weight (1 / seconds) is inf (LAPACK once failed on
    them with a bare LinAlgError), or a fit whose coefficient would time a long prompt past float's range: a
    ConfigError saying which."""
    with pytest.raises(ConfigError, match=message):
        FittedPrefillModel.fit(samples)


@pytest.mark.parametrize(
    ("coefficients", "named"),
    [
        ((1e308, 0.0, 0.0), "c0"),
        ((0.0, 1e300, 0.0), "c1"),
        ((0.0, -1e300, 0.0), "c1"),
        ((0.0, 0.0, 1e300), "c2"),
        ((0.0, 1e300, -1e300), "c1"),
    ],
)
def test_a_fitted_model_that_would_time_a_prompt_past_floats_is_refused(
    coefficients: tuple[float, float, float], named: str
) -> None:
    """Finite coefficients too large for their feature (c2 = 1e300 at 10^5 tokens) timed a prompt at inf, or at
    0 s where an inf term met a -inf one (max(0, NaN) is 0), and a chunked pipeline over such a model timed a
    chunk at inf - inf = NaN, on which the router found no instance: a ConfigError naming the coefficient, at
    construction and from JSON. Any accepted model times every prompt up to MAX_TOKENS finitely."""
    with pytest.raises(ConfigError, match=f"coefficient {named}="):
        FittedPrefillModel(coefficients=coefficients)
    text = json.dumps({"coefficients": coefficients, "mean_relative_error": 0.0, "max_relative_error": 0.0})
    # from JSON a negative coefficient is refused first, as the fit's rule refuses it
    negative = next((f"c{i}" for i, c in enumerate(coefficients) if c < 0), None)
    refused = f"coefficient {named}=" if negative is None else f"coefficient {negative} must be a finite number >= 0"
    with pytest.raises(ConfigError, match=refused):
        FittedPrefillModel.from_json(text)
    largest = (4.4e307, 4.0e295, 3.7e283)  # each just under its bound
    edge = FittedPrefillModel(coefficients=largest)
    for n, p in ((2**40, 0), (2**40, 2**39), (1, 0)):
        assert math.isfinite(edge.prefill_s(n, p))
    pipelined = ChunkedPipelineCost(base=edge, group_size=2, chunk_tokens=2**38)
    assert math.isfinite(pipelined.prefill_s(2**40))


# ---------------------------------------------------------------------------- transfer


@given(
    st.floats(min_value=1.0, max_value=1e12),
    st.floats(min_value=1e6, max_value=1e12),
    st.floats(min_value=0.0, max_value=0.01),
    st.integers(min_value=0, max_value=64),
)
def test_transfer_time_grows_linearly_with_congestion(
    num_bytes: float, bandwidth: float, latency: float, in_flight: int
) -> None:
    """Each transfer already in flight from the source adds one more bytes / bandwidth."""
    model = TransferCostModel(bandwidth_bytes_per_s=bandwidth, latency_s=latency)
    alone = model.transfer_s(num_bytes)
    assert alone == pytest.approx(latency + num_bytes / bandwidth)
    assert model.transfer_s(num_bytes, in_flight_from_source=in_flight) == pytest.approx(
        latency + (1 + in_flight) * num_bytes / bandwidth
    )
    step = model.transfer_s(num_bytes, in_flight_from_source=in_flight + 1) - model.transfer_s(
        num_bytes, in_flight_from_source=in_flight
    )
    assert step == pytest.approx(num_bytes / bandwidth)


def test_transfer_of_nothing_is_free() -> None:
    """Zero bytes take zero seconds, latency and congestion notwithstanding."""
    assert TransferCostModel(bandwidth_bytes_per_s=1e9, latency_s=0.5).transfer_s(0, in_flight_from_source=9) == 0.0


@pytest.mark.parametrize(
    ("num_bytes", "in_flight", "named"),
    [
        (math.nan, 0, "num_bytes"),
        (math.inf, 0, "num_bytes"),
        (-math.inf, 0, "num_bytes"),
        ("1e9", 0, "num_bytes"),
        (None, 0, "num_bytes"),
        (1e9, -1, "in_flight_from_source"),
        (0, -1, "in_flight_from_source"),
        (1e9, True, "in_flight_from_source"),
        (1e9, 1.5, "in_flight_from_source"),
        (1e9, None, "in_flight_from_source"),
        (1e300, 10**10, "takes longer than a float holds"),
    ],
    ids=repr,
)
def test_a_transfer_of_no_size_or_congestion_is_refused(num_bytes: Any, in_flight: Any, named: str) -> None:
    """A NaN size timed a transfer at NaN (and the router then found no fastest instance); -1 transfers in
    flight made a transfer cheaper than alone: a ConfigError naming the argument and showing the value. A numpy
    count is a count."""
    model = TransferCostModel(bandwidth_bytes_per_s=1e9)
    with pytest.raises(ConfigError, match=named) as caught:
        model.transfer_s(num_bytes, in_flight_from_source=in_flight)
    assert repr(num_bytes if named == "num_bytes" else in_flight) in str(caught.value)
    count: Any = np.int64(1)
    assert model.transfer_s(1e9, in_flight_from_source=count) == model.transfer_s(1e9, in_flight_from_source=1)
    assert model.transfer_s(-5.0, in_flight_from_source=count) == 0.0  # fewer than no bytes take none


def test_transfer_model_rejects_zero_bandwidth() -> None:
    """Bandwidth must be positive."""
    with pytest.raises(ConfigError):
        TransferCostModel(bandwidth_bytes_per_s=0)


# ---------------------------------------------------------------------------- decode


@given(
    models,
    hardware,
    st.integers(min_value=0, max_value=512),
    st.integers(min_value=0, max_value=512),
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=10**6),
)
def test_decode_step_monotone_in_batch_and_context(
    model: ModelShape, hw: Hardware, batch: int, more_batch: int, context: int, more_context: int
) -> None:
    """A bigger batch or more context never makes a decode step faster; more context makes it slower."""
    cost = DecodeCostModel(model=model, hardware=hw)
    base = cost.step_s(batch, context)
    assert cost.step_s(batch + more_batch, context) >= base
    assert cost.step_s(batch, context + more_context) >= base
    if batch and more_context:
        assert cost.step_s(batch, context + more_context) > base


def test_decode_step_is_the_slower_of_hbm_reads_and_compute() -> None:
    """step = overhead + max((weights read + C · KV/token) / (G · HBM · memory_efficiency),
    (2 · (N − lookups) · B + 4 · l · d · C) / (G · peak · compute_efficiency)); empty batch: 0."""
    hw = HARDWARE["8xH800"]
    cost = DecodeCostModel(model=LLAMA3, hardware=hw)
    bandwidth = hw.num_gpus * hw.hbm_bytes_per_s * cost.memory_efficiency
    flops = hw.num_gpus * hw.peak_flops_per_gpu * cost.compute_efficiency
    for batch, context in ((4, 10_000), (2000, 10_000), (300, 10**6)):
        memory = (LLAMA3.streamed_weight_bytes + context * LLAMA3.kv_bytes_per_token) / bandwidth
        multiplied = LLAMA3.num_params - LLAMA3.lookup_params
        compute = (2 * multiplied * batch + 4 * LLAMA3.num_layers * LLAMA3.hidden_size * context) / flops
        assert cost.step_s(batch, context) == pytest.approx(cost.overhead_s + max(memory, compute))
    assert cost.step_s(0, 10_000) == 0.0


A800_CROSSOVER_BATCH = 166  # LLaMA3-70B on 8×A800, 2,048 tokens a request


def test_llama3_on_a800_is_memory_bound_in_small_batches_and_compute_bound_in_large_ones() -> None:
    """LLaMA3-70B on 8×A800, 2,048 tokens of context a request: memory-bound up to 165 requests (the weights'
    and KV's read: 15.7 ms at B = 1, 18.9 ms at B = 64), compute-bound from 166 on (34.6 ms at B = 256,
    123 ms at B = 1,024), so a large batch's TBT grows with its size, not only with its KV."""
    cost = DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    memory, compute = cost.roofline().branches

    def bound(batch: int) -> str:
        context = 2048 * batch
        m = memory.fixed_s + memory.per_sequence_s * batch + memory.per_context_token_s * context
        c = compute.fixed_s + compute.per_sequence_s * batch + compute.per_context_token_s * context
        assert cost.step_s(batch, context) == cost.overhead_s + max(m, c)
        return "memory" if m >= c else "compute"

    assert [bound(b) for b in (1, 64, A800_CROSSOVER_BATCH - 1)] == ["memory"] * 3
    assert [bound(b) for b in (A800_CROSSOVER_BATCH, 256, 1024)] == ["compute"] * 3
    steps_ms = [1e3 * cost.step_s(b, 2048 * b) for b in (1, 64, 256, 1024)]
    assert steps_ms == pytest.approx([15.70, 18.94, 34.62, 123.46], abs=0.01)
    # Under a 100 ms TBT SLO, large batches of short requests now bind (the memory branch alone would not).
    assert (
        cost.step_s(1024, 2048 * 1024)
        > 0.1
        > cost.overhead_s + memory.fixed_s + memory.per_context_token_s * (cost.capacity_tokens())
    )


def test_llama3_on_h800_stays_memory_bound_for_requests_of_2k_tokens_that_fit() -> None:
    """An H800's peak is 3.2× an A800's against 1.6× the bandwidth: with 2,048 tokens a request, the
    compute branch would overtake only beyond 1,248 requests, more than the instance's HBM holds."""
    cost = DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xH800"])
    memory, compute = cost.roofline().branches
    most = cost.capacity_tokens() // 2048
    assert most < 1249
    for batch in (1, 64, 256, most, 1248):
        context = 2048 * batch
        assert memory.fixed_s + memory.per_context_token_s * context > compute.per_sequence_s * batch + (
            compute.per_context_token_s * context
        )
    assert compute.per_sequence_s * 1249 + compute.per_context_token_s * 2048 * 1249 > (
        memory.fixed_s + memory.per_context_token_s * 2048 * 1249
    )


@given(
    models,
    hardware,
    st.integers(min_value=-2, max_value=4096),
    st.integers(min_value=0, max_value=4 * 10**6),
    st.floats(min_value=0.05, max_value=1.0),
)
def test_decode_step_is_its_roofline_to_the_bit(
    model: ModelShape, hw: Hardware, batch: int, context: int, compute_efficiency: float
) -> None:
    """DecodeCostModel.step_s(B, C) == roofline().step_s(B, C) exactly, and step_times gives the same
    floats element by element; the roofline is two branches (memory, compute) and the overhead."""
    cost = DecodeCostModel(model=model, hardware=hw, compute_efficiency=compute_efficiency)
    roofline = cost.roofline()
    assert cost.step_s(batch, context) == roofline.step_s(batch, context)
    assert roofline.overhead_s == cost.overhead_s and len(roofline.branches) == 2
    times = roofline.step_times(np.array([batch, batch + 1]), np.array([context, context]))
    assert times.tolist() == [cost.step_s(batch, context), cost.step_s(batch + 1, context)]


branches = st.builds(
    StepBranch,
    st.floats(min_value=-0.1, max_value=0.1),
    st.floats(min_value=-1e-3, max_value=1e-3),
    st.floats(min_value=-1e-6, max_value=1e-6),
)


@given(
    st.lists(branches, min_size=1, max_size=4),
    st.floats(min_value=0.0, max_value=0.01),
    st.lists(st.tuples(st.integers(-2, 1000), st.integers(0, 10**6)), min_size=1, max_size=20),
)
def test_roofline_step_is_the_overhead_plus_the_slowest_branch(
    drawn: list[StepBranch], overhead: float, shapes: list[tuple[int, int]]
) -> None:
    """step_s(B, C) = overhead + max_j (fixed_j + per_sequence_j · B + per_context_token_j · C) for B > 0, 0 otherwise;
    step_times is step_s element by element, exactly; a roofline is its own roofline."""
    roofline = RooflineStep(drawn, overhead_s=overhead)
    for batch, context in shapes:
        slowest = max(b.fixed_s + b.per_sequence_s * batch + b.per_context_token_s * context for b in drawn)
        assert roofline.step_s(batch, context) == (overhead + slowest if batch > 0 else 0.0)
    sizes, contexts = np.array([b for b, _ in shapes]), np.array([c for _, c in shapes])
    assert roofline.step_times(sizes, contexts).tolist() == [roofline.step_s(b, c) for b, c in shapes]
    assert roofline.roofline() is roofline


def test_roofline_step_rejects_bad_branches() -> None:
    """No branch, a branch that is not a StepBranch, a non-finite coefficient or a negative overhead: ConfigError."""
    with pytest.raises(ConfigError, match="at least one"):
        RooflineStep(())
    with pytest.raises(ConfigError, match="at least one"):
        RooflineStep([(0.1, 0.0, 0.0)])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="per_context_token_s"):
        StepBranch(0.1, 0.0, math.inf)
    with pytest.raises(ConfigError, match="overhead_s"):
        RooflineStep([StepBranch(0.1, 0.0, 0.0)], overhead_s=-1.0)


def analytic(model: AnalyticStepModel) -> RooflineStep:
    return model.roofline()


def test_the_analytic_step_models_give_their_roofline() -> None:
    """DecodeCostModel and RooflineStep are AnalyticStepModels (the type checker holds them to it)."""
    cost = DecodeCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    assert analytic(cost) is cost.roofline()
    assert analytic(cost.roofline()) is cost.roofline()


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("hardware_name", sorted(HARDWARE))
def test_decode_capacity_positive_for_presets(model_name: str, hardware_name: str) -> None:
    """Every preset pair leaves room for KV beside the weights (and no more than the HBM holds)."""
    model, hw = MODELS[model_name], HARDWARE[hardware_name]
    capacity = DecodeCostModel(model=model, hardware=hw).capacity_tokens()
    assert capacity > 0
    assert capacity * model.kv_bytes_per_token <= hw.num_gpus * hw.hbm_bytes - model.weight_bytes


def test_an_embedding_takes_hbm_but_no_step_reads_or_multiplies_it() -> None:
    """A shape whose weights are half lookups: the KV room is what all the weights leave, while the step's weight
    read and per-request FLOPs count only the other half."""
    hw = Hardware(
        name="one",
        num_gpus=1,
        peak_flops_per_gpu=1e12,
        hbm_bytes_per_s=1e12,
        hbm_bytes=1e9,
        host_to_device_bytes_per_s=1e10,
        nic_bytes_per_s=1e10,
    )
    half = ModelShape(name="half", num_layers=1, hidden_size=8, gqa=1, num_params=2e8, lookup_params=1e8)
    cost = DecodeCostModel(model=half, hardware=hw, overhead_s=0.0, kv_memory_fraction=1.0)
    assert cost.capacity_tokens() == math.floor((1e9 - 4e8) / 32)  # 2 bytes x 2e8 weights; K and V of 8 x 2 bytes
    memory, compute = cost.roofline().branches
    assert memory.fixed_s == pytest.approx(2e8 / (1e12 * cost.memory_efficiency))
    assert compute.per_sequence_s == pytest.approx(2e8 / (1e12 * cost.compute_efficiency))


def test_decode_capacity_is_zero_when_weights_do_not_fit() -> None:
    """A model bigger than the HBM leaves no KV room (not a negative one)."""
    tiny = Hardware(
        name="tiny",
        num_gpus=1,
        peak_flops_per_gpu=1e12,
        hbm_bytes_per_s=1e11,
        hbm_bytes=1e9,
        host_to_device_bytes_per_s=1e9,
        nic_bytes_per_s=1e9,
    )
    assert DecodeCostModel(model=LLAMA3, hardware=tiny).capacity_tokens() == 0


def test_presets_have_the_paper_peaks() -> None:
    """Dense bf16 peaks: 312 TFLOPS per A800/A100 GPU, 989 per H800/H100/H200 GPU; 8 GPUs an instance."""
    for name, hw in HARDWARE.items():
        assert hw.num_gpus == 8
        assert hw.peak_flops_per_gpu == (312e12 if "A" in name else 989e12)
    assert math.isclose(HARDWARE["8xA800"].peak_flops, 8 * 312e12)


# ---------------------------------------------------------------------------- chunked pipeline parallelism

cpp_bases = st.sampled_from(
    [
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"]),
        PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xH800"], mfu=0.4),
        FittedPrefillModel(coefficients=TRUE_COEFFICIENTS),  # a fixed cost per chunk, unlike the FLOPs model
    ]
)
cpp_chunks = st.sampled_from([512, 4096, 8192]) | st.integers(min_value=200, max_value=20_000)


def flow_shop(chunk_stage_s: list[float], stages: int) -> tuple[float, float]:
    """Brute force: chunks in order through `stages` stages, each taking its time on every stage, a stage
    taking a chunk once it has left the stage before and the stage is free.

    Returns:
        (when the last chunk leaves the last stage, when it leaves the first).
    """
    free_at = [0.0] * stages
    for seconds in chunk_stage_s:
        ready = 0.0
        for stage in range(stages):
            free_at[stage] = max(free_at[stage], ready) + seconds
            ready = free_at[stage]
    return free_at[-1], free_at[0]


def chunk_stage_s(
    base: PrefillCostModel | FittedPrefillModel, n: int, p: int, chunk: int, stages: float
) -> list[float]:
    """Each chunk's time on one stage: what the base model adds for it (T(end, p) − T(start, p)), over
    `stages` (the even split's X; L / ⌈L/X⌉ for the slowest stage of an uneven one)."""
    ends = [min(n, start + chunk) for start in range(p, n, chunk)]
    totals = [base.prefill_s(end, p) for end in ends]
    return [(total - previous) / stages for total, previous in zip(totals, [0.0, *totals][:-1], strict=True)]


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """The engine's split (`engine.pipeline.stage_layers`), as a reference: the first L mod X stages one more."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def uneven_flow_shop(chunk_s: list[float], shares: list[float]) -> tuple[float, float]:
    """Brute force with a time per stage: chunk k takes chunk_s[k] · shares[s] on stage s.

    Returns:
        (when the last chunk leaves the last stage, when it leaves the first).
    """
    free_at = [0.0] * len(shares)
    for seconds in chunk_s:
        ready = 0.0
        for stage, share in enumerate(shares):
            free_at[stage] = max(free_at[stage], ready) + seconds * share
            ready = free_at[stage]
    return free_at[-1], free_at[0]


@given(cpp_bases, st.integers(min_value=0, max_value=200_000), st.data(), cpp_chunks)
def test_cpp_group_of_one_is_the_base_model(
    base: PrefillCostModel | FittedPrefillModel, n: int, data: st.DataObject, chunk: int
) -> None:
    """One stage pipelines nothing: latency and occupancy are the base model's time (chunks add up to it)."""
    p = data.draw(st.integers(min_value=0, max_value=n + 10))
    cpp = ChunkedPipelineCost(base=base, group_size=1, chunk_tokens=chunk)
    assert math.isclose(cpp.prefill_s(n, p), base.prefill_s(n, p), rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(cpp.occupancy_s(n, p), base.prefill_s(n, p), rel_tol=1e-9, abs_tol=1e-15)


@given(
    cpp_bases, st.integers(min_value=1, max_value=300_000), st.data(), st.integers(min_value=1, max_value=8), cpp_chunks
)
def test_cpp_latency_is_the_flow_shop_makespan(
    base: PrefillCostModel | FittedPrefillModel, n: int, data: st.DataObject, stages: int, chunk: int
) -> None:
    """latency = Σ chunk times + (X − 1) · the longest, each at the slowest stage's share of the layers
    (⌈L/X⌉ of the analytic model's 80; 1/X for the fitted model, which knows no layers), as simulating the
    pipeline stage by stage gives; occupancy (the first stage's busy time) = Σ; occupancy <= latency, and
    latency <= the base model's time where the stages split the layers evenly."""
    p = data.draw(st.integers(min_value=0, max_value=n))
    cpp = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=chunk)
    layers = base.model.num_layers if isinstance(base, PrefillCostModel) else stages
    times = chunk_stage_s(base, n, p, chunk, layers / -(-layers // stages))
    makespan, first_stage = flow_shop(times, stages)
    latency, occupancy = cpp.prefill_s(n, p), cpp.occupancy_s(n, p)
    assert math.isclose(latency, makespan, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(occupancy, first_stage, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(latency, math.fsum(times) + (stages - 1) * max(times, default=0.0), rel_tol=1e-9)
    assert occupancy <= latency * (1 + 1e-12)
    if isinstance(base, PrefillCostModel) and layers % stages == 0:
        assert latency <= base.prefill_s(n, p) * (1 + 1e-9)


@settings(max_examples=200)
@given(
    st.integers(min_value=1, max_value=100),
    st.data(),
    st.integers(min_value=1, max_value=60_000),
    st.sampled_from([512, 4096]) | st.integers(min_value=200, max_value=20_000),
    st.booleans(),
)
def test_cpp_prices_the_engines_layer_split_exactly_when_even_and_from_above_otherwise(
    num_layers: int, data: st.DataObject, n: int, chunk: int, fitted: bool
) -> None:
    """Against the exact flow shop of the stages the engine builds (⌈L/X⌉ layers on the first L mod X, ⌊L/X⌋ on
    the rest, each chunk's time on a stage its share of the layers): the first stage's busy time is exact; the
    latency is exact where X divides L, else never below the real pipeline's (the slowest stage paces it: an
    even split's price was up to 14 % low for 12 layers on 5 stages) and at most ⌈L/X⌉/⌊L/X⌋ times it. The
    layers come from the analytic model's shape, or as `num_layers` for a fitted model."""
    stages = data.draw(st.integers(min_value=1, max_value=min(num_layers, 10)), label="stages")
    p = data.draw(st.integers(min_value=0, max_value=n), label="prefix")
    base: PrefillCostModel | FittedPrefillModel
    if fitted:
        base = FittedPrefillModel(coefficients=TRUE_COEFFICIENTS)
        cpp = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=chunk, num_layers=num_layers)
    else:
        base = PrefillCostModel(model=attrs.evolve(LLAMA3, num_layers=num_layers), hardware=HARDWARE["8xA800"])
        cpp = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=chunk)
    counts = stage_layer_counts(num_layers, stages)
    makespan, first_stage = uneven_flow_shop(chunk_stage_s(base, n, p, chunk, 1), [c / num_layers for c in counts])
    latency, occupancy = cpp.prefill_s(n, p), cpp.occupancy_s(n, p)
    assert cpp.num_layers == num_layers and cpp.stage_share == max(counts) / num_layers
    assert math.isclose(occupancy, first_stage, rel_tol=1e-9, abs_tol=1e-15)
    assert latency >= makespan * (1 - 1e-9) - 1e-15
    assert latency <= makespan * max(counts) / min(counts) * (1 + 1e-9) + 1e-15
    if num_layers % stages == 0:
        assert math.isclose(latency, makespan, rel_tol=1e-9, abs_tol=1e-15)


def test_cpp_twelve_layers_on_five_stages_is_paced_by_a_three_layer_stage() -> None:
    """The reviewer's case: 12 layers on 5 stages are 3, 3, 2, 2, 2; a long prompt's latency is the flow shop
    of those stages priced at 3/12 (not 1/5, which put it 14 % below the real pipeline's)."""
    shape = attrs.evolve(LLAMA3, name="12-layer", num_layers=12)
    base = PrefillCostModel(model=shape, hardware=HARDWARE["8xA800"])
    cpp = ChunkedPipelineCost(base=base, group_size=5, chunk_tokens=4096)
    times = chunk_stage_s(base, 65_536, 0, 4096, 1)
    real, first = uneven_flow_shop(times, [3 / 12, 3 / 12, 2 / 12, 2 / 12, 2 / 12])
    assert cpp.stage_share == 3 / 12
    assert math.isclose(cpp.prefill_s(65_536), math.fsum(times) / 4 + 4 * max(times) / 4, rel_tol=1e-12)
    assert real <= cpp.prefill_s(65_536) <= real * 1.1
    assert math.isclose(cpp.occupancy_s(65_536), first, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"group_size": 81}, ["group_size=81", "num_layers=80"]),
        ({"group_size": 5, "num_layers": 4}, ["group_size=5", "num_layers=4"]),
        ({"num_layers": 0}, ["num_layers"]),
        ({"num_layers": 2.5}, ["num_layers"]),
        ({"base": None}, ["base", "prefill_s", "None"]),
        ({"base": 3.0}, ["base", "prefill_s", "3.0"]),
    ],
)
def test_cpp_refuses_more_stages_than_layers_and_a_base_that_prices_nothing(
    options: dict[str, object], named: list[str]
) -> None:
    """A stage holds at least one layer (the engine refuses more stages than layers): a group_size above the
    layers is a ConfigError naming both; so is a num_layers that is no integer >= 1, and a base without a
    prefill_s (it built, then failed at the first price with an AttributeError)."""
    base = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    with pytest.raises(ConfigError) as raised:
        ChunkedPipelineCost(**{"base": base, "group_size": 2, **options})  # type: ignore[arg-type]
    for words in named:
        assert words in str(raised.value)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_cpp_one_chunk_gains_nothing(stages: int) -> None:
    """A prompt that fits one chunk goes through every stage in turn: the base model's time (stages that
    split the 80 layers evenly)."""
    base = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    cpp = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=4096)
    for n, p in ((1, 0), (4096, 0), (6000, 2000)):
        assert math.isclose(cpp.prefill_s(n, p), base.prefill_s(n, p), rel_tol=1e-12)
        assert math.isclose(cpp.occupancy_s(n, p), base.prefill_s(n, p) / stages, rel_tol=1e-12)
    assert cpp.prefill_s(100, 100) == cpp.occupancy_s(100, 200) == 0.0


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_cpp_long_prompts_approach_a_group_size_speed_up(stages: int) -> None:
    """The speed-up over one instance grows with the prompt and tends to X (0.9·X by a million tokens)."""
    base = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    cpp = ChunkedPipelineCost(base=base, group_size=stages, chunk_tokens=4096)
    lengths = [4096 * 2**k for k in range(9)]  # 4 K to 1 M tokens
    speed_ups = [base.prefill_s(n) / cpp.prefill_s(n) for n in lengths]
    assert speed_ups[0] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(speed_ups))
    assert 0.9 * stages <= speed_ups[-1] < stages


@pytest.mark.parametrize("options", [{"group_size": 0}, {"group_size": True}, {"chunk_tokens": 0}, {"group_size": 1.5}])
def test_cpp_rejects_bad_fields(options: dict[str, object]) -> None:
    """group_size and chunk_tokens are integers >= 1; the error names the field."""
    base = PrefillCostModel(model=LLAMA3, hardware=HARDWARE["8xA800"])
    with pytest.raises(ConfigError, match=next(iter(options))):
        ChunkedPipelineCost(base=base, **{"group_size": 2, **options})  # type: ignore[arg-type]


@given(
    finishes=st.lists(st.floats(0, 100, allow_nan=False), max_size=20),
    nows=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=5),
)
def test_transfers_in_flight_counts_those_ending_after_now(finishes: list[float], nows: list[float]) -> None:
    """At each (non-decreasing) `now`, the count is the transfers ending strictly after it, and the heap keeps
    exactly those: a transfer ending at `now` no longer shares the link."""
    heap = list(finishes)
    heapq.heapify(heap)
    for now in sorted(nows):
        assert transfers_in_flight(heap, now) == sum(1 for end in finishes if end > now)
        assert sorted(heap) == sorted(end for end in finishes if end > now)
