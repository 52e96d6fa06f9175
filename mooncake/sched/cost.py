"""Cost models: model and hardware shapes, how long prefill and KV transfer take.

Prefill (the paper's FLOPs model): computing tokens p..n of an n-token prompt
whose first p tokens are cached costs

    FLOPs(n, p) = l · (a · (n² − p²) · d + b · (n − p) · d²),    a = 4, b = 22

(the attention term counts every new token attending to the whole context),
and takes C = FLOPs / (G · peak · MFU) on G GPUs. The cached prefix's KV is
loaded from host DRAM into HBM layer by layer while earlier layers compute, as
the engines do: with L = KV(p) / host-to-device bandwidth, each of the l
layers loads in L/l and computes in C/l, so the prefill takes

    T(n, p) = max(L/l + C, L + C/l)

(the load of the first layer, then whichever of compute and load is the
bottleneck; T = C with nothing cached, or with the prefix already in HBM). `FittedPrefillModel` replaces the
analytic form with a least-squares fit of measured runs on the same features
(the real engines' loads included).

Reuse criterion (the paper's Eq. 2): loading a cached p-token prefix beats
recomputing it when the bandwidth exceeds KV(p) / T_prefill(p, 0) at peak;
for LLaMA3-70B at p = 8,192 that is about 6 GB/s on 8×A800 and 19 GB/s on 8×H800.

Transfer: bytes / (bandwidth / (1 + transfers already in flight from the same
source)) + latency.

Decode: `mooncake.sched.step` (the step models).

All functions are pure; units are in the names (seconds, bytes, tokens).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from mooncake import _json
from mooncake._checks import (
    fraction,
    int_at_least,
    is_finite_number,
    is_int,
    non_negative,
    positive,
    require_int,
    require_iterable,
    require_number,
    shown,
)
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import MAX_TOKENS, Tier, check_token_count

__all__ = [
    "ChunkedPipelineCost",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_MFU",
    "FittedPrefillModel",
    "HARDWARE",
    "Hardware",
    "MODELS",
    "ModelShape",
    "PrefillCostModel",
    "PrefillModel",
    "PrefillSample",
    "TransferCostModel",
    "check_prefill_points",
    "occupancy_s",
    "prefill_end_s",
    "prefill_flops",
    "reuse_bandwidth_bytes_per_s",
    "transfers_in_flight",
]

_INF, _NAN = math.inf, math.nan  # module globals: read faster than math's on the router's path
ATTENTION_COEFFICIENT = 4  # the paper's a
LINEAR_COEFFICIENT = 22  # the paper's b
TOKEN_ATTENTION_FLOPS = 4  # per context token, layer and hidden unit: q·k and Σ p·v, a multiply-add each


@attrs.frozen(kw_only=True)
class ModelShape:
    """The shape that sets a model's compute and KV size.

    Attributes:
        num_layers: l. hidden_size: d. gqa: query heads per KV head.
        bytes_per_element: 2 for bf16. num_params: every weight (what they take of HBM; a step's
            FLOPs and weight reads leave out `lookup_params`).
        lookup_params: the weights a forward pass looks up instead of multiplying: an untied input
            embedding (vocabulary × d); 0 when the embedding is tied to the LM head.
    """

    name: str
    num_layers: int = attrs.field(validator=int_at_least(1))
    hidden_size: int = attrs.field(validator=int_at_least(1))
    gqa: int = attrs.field(validator=int_at_least(1))
    bytes_per_element: int = attrs.field(default=2, validator=int_at_least(1))
    num_params: float = attrs.field(validator=positive)
    lookup_params: float = attrs.field(default=0.0, validator=non_negative)

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.gqa:
            raise ConfigError(
                f"ModelShape {shown(self.name, quote=str)}: gqa={shown(self.gqa)} query heads per KV head must divide "
                f"hidden_size={shown(self.hidden_size)}"
            )
        if self.lookup_params >= self.num_params:
            raise ConfigError(
                f"ModelShape {shown(self.name, quote=str)}: lookup_params={self.lookup_params} must be below "
                f"num_params={self.num_params}"
            )

    @property
    def attention_flops_per_context_token(self) -> float:
        """4 · l · d: one token's q·k and weighted sum of v over one context token, a multiply-add each, in every layer."""
        return TOKEN_ATTENTION_FLOPS * self.num_layers * self.hidden_size

    def flops_per_token(self, context_tokens: float = 0) -> float:
        """Forward FLOPs of one token attending to `context_tokens`: 2 · (N − lookups) + 4 · l · d · context.

        A multiply-add per multiplied weight, plus attention. This is the decode
        step's compute (per sequence) and the engines' FLOPs count for their MFU;
        the prefill cost model keeps the paper's fitted form (`prefill_flops`).
        """
        return 2.0 * (self.num_params - self.lookup_params) + self.attention_flops_per_context_token * context_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """l · 2 · (d / gqa) · s: a key and a value per layer."""
        return self.num_layers * 2 * (self.hidden_size // self.gqa) * self.bytes_per_element

    @property
    def weight_bytes(self) -> float:
        """Every weight's bytes: what the weights take of HBM."""
        return self.num_params * self.bytes_per_element

    @property
    def streamed_weight_bytes(self) -> float:
        """The weight bytes one forward step reads: all but the lookups (an embedding row per token)."""
        return (self.num_params - self.lookup_params) * self.bytes_per_element


@attrs.frozen(kw_only=True)
class Hardware:
    """One prefill or decode instance's accelerators.

    Attributes:
        num_gpus: G.
        peak_flops_per_gpu: dense bf16 tensor-core peak (the datasheets' figures "with sparsity" are twice this).
        hbm_bytes_per_s, hbm_bytes: HBM bandwidth and size, per GPU.
        host_to_device_bytes_per_s: PCIe, host to the instance's GPUs, in all (one direction).
        nic_bytes_per_s: the instance's network, all its NICs together.
    """

    name: str
    num_gpus: int = attrs.field(validator=int_at_least(1))
    peak_flops_per_gpu: float = attrs.field(validator=positive)
    hbm_bytes_per_s: float = attrs.field(validator=positive)
    hbm_bytes: float = attrs.field(validator=positive)
    host_to_device_bytes_per_s: float = attrs.field(validator=positive)
    nic_bytes_per_s: float = attrs.field(validator=positive)

    @property
    def peak_flops(self) -> float:
        return self.num_gpus * self.peak_flops_per_gpu


# Parameters counted from the architecture (80 layers, d = 8,192, 64 query and 8 KV heads, MLP width
# 28,672, untied embedding and LM head, vocabulary 32,000 / 128,256), as `ModelConfig.num_parameters`
# counts them: the engine's "llama3-70b" preset has this very shape (tests check it).
MODELS: dict[str, ModelShape] = {
    "llama2-70b": ModelShape(
        name="llama2-70b",
        num_layers=80,
        hidden_size=8192,
        gqa=8,
        num_params=68_976_648_192,
        lookup_params=32_000 * 8192,
    ),
    "llama3-70b": ModelShape(
        name="llama3-70b",
        num_layers=80,
        hidden_size=8192,
        gqa=8,
        num_params=70_553_706_496,
        lookup_params=128_256 * 8192,
    ),
}
"""Model shapes by name (LLaMA-2/3-70B: 80 layers, d = 8,192, GQA 8, bf16: 320 KiB of KV per token)."""

_GBPS = 1e9 / 8  # bytes per second in one Gbit/s
_MIB = 2**20  # bytes in one MiB, the unit nvidia-smi reports memory in
# Sources, per GPU (SXM modules, NVIDIA's datasheets):
#   A100 / A800 80GB: 312 TFLOPS dense bf16, 80 GB HBM2e at 2,039 GB/s, PCIe Gen4 x16 (32 GB/s each way);
#     the A800 is the A100 with NVLink cut to 400 GB/s, which none of these models reads.
#   H100 / H800: 989 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s, PCIe Gen5 x16 (64 GB/s each way);
#     the H800 differs in NVLink (400 GB/s) and FP64, neither of which these models reads.
#   H200: 989 TFLOPS dense bf16 (the H100's compute), 141 GB HBM3e at 4.8 TB/s.
# HBM size is the device's total as nvidia-smi reports it (MiB x 2**20), not the datasheet's rounded decimal GB:
# vLLM sizes its KV cache from the device's total bytes x gpu_memory_utilization, as `DecodeCostModel` does with
# its kv_memory_fraction. A100 / A800 80GB: 81,920 MiB; H100 / H800 80GB HBM3: 81,559 MiB; H200: 143,771 MiB.
# Per instance: host_to_device 128 GB/s is four PCIe Gen4 x16 host links (HGX A100 boards hang their
# eight GPUs off four PCIe switches), kept for the Hopper presets as a conservative figure; the
# prefill model loads cached prefixes from DRAM at that rate. NICs are the Mooncake paper's and its transfer engine's setups: 4 x 200 Gbit/s RDMA
# on the Ampere nodes, 8 x 400 Gbit/s RoCE on the Hopper ones.
_A800 = Hardware(
    name="8xA800",
    num_gpus=8,
    peak_flops_per_gpu=312e12,
    hbm_bytes_per_s=2.039e12,
    hbm_bytes=81_920 * _MIB,
    host_to_device_bytes_per_s=128e9,
    nic_bytes_per_s=800 * _GBPS,
)
_H800 = Hardware(
    name="8xH800",
    num_gpus=8,
    peak_flops_per_gpu=989e12,
    hbm_bytes_per_s=3.35e12,
    hbm_bytes=81_559 * _MIB,
    host_to_device_bytes_per_s=128e9,
    nic_bytes_per_s=3200 * _GBPS,
)
# The export parts differ from their originals only where no model here reads (above): one set of figures each.
_H100 = attrs.evolve(_H800, name="8xH100")
HARDWARE: dict[str, Hardware] = {
    "8xA800": _A800,
    "8xA100": attrs.evolve(_A800, name="8xA100"),
    "8xH800": _H800,
    "8xH100": _H100,
    "8xH200": attrs.evolve(_H100, name="8xH200", hbm_bytes_per_s=4.8e12, hbm_bytes=143_771 * _MIB),
}
"""Instances by name (eight GPUs each): dense bf16 peak, HBM bandwidth and size per GPU, PCIe and NIC
per instance; the sources are in the comment above."""


DEFAULT_MFU = 0.5
"""The model FLOPs utilization a prefill reaches where none is given (the analytic model's, the simulated
clusters'), counted in the paper's prefill FLOPs (`prefill_flops`). Those are 0.86× the exact count
(`ModelShape.flops_per_token`, which `benchmarks/gpu.py` measures MFU in) at 1 K tokens of LLaMA3-70B,
0.93× at 8 K and 1.12× at 32 K: convert an MFU measured there before using it here."""


def prefill_flops(model: ModelShape, num_tokens: int, prefix_tokens: int = 0) -> float:
    """FLOPs to compute tokens [prefix_tokens, num_tokens) with the prefix's KV cached (a prefix is read within
    [0, num_tokens]: fewer than no tokens cached is none).

    Raises:
        InvalidRequestError: counts the prefill models refuse (`_prefill_tokens`: a `num_tokens` that is no
            integer in [0, 2**40], a `prefix_tokens` that is no integer), naming the count and its value.
    """
    num_tokens, prefix_tokens = _prefill_tokens(num_tokens, prefix_tokens)  # Python ints: numpy's n * n wraps
    n, p, d = num_tokens, min(max(prefix_tokens, 0), num_tokens), model.hidden_size
    return model.num_layers * (ATTENTION_COEFFICIENT * (n * n - p * p) * d + LINEAR_COEFFICIENT * (n - p) * d * d)


def reuse_bandwidth_bytes_per_s(model: ModelShape, hardware: Hardware, prefix_tokens: int) -> float:
    """The paper's Eq. 2: above this bandwidth, loading a cached prefix beats recomputing it (at peak).

    Raises:
        ConfigError: a `prefix_tokens` that is not a token count, an integer in [1, 2**40] (`types.check_token_count`:
            no prefix takes no time to recompute), naming it and its value.
    """
    try:
        prefix_tokens = check_token_count("prefix_tokens", prefix_tokens)  # a Python int: prefill_flops squares it
    except InvalidRequestError as error:  # an argument of an analysis, as it always raised: no request's
        raise ConfigError(str(error)) from None
    compute_s = prefill_flops(model, prefix_tokens) / hardware.peak_flops
    return prefix_tokens * model.kv_bytes_per_token / compute_s


def _prefill_tokens(num_tokens: Any, prefix_tokens: Any) -> tuple[int, int]:
    """A prefill's token counts as Python ints (numpy's squared would wrap): `num_tokens` a token count
    (`types.check_token_count`) or 0 (nothing to compute), `prefix_tokens` an integer (fewer than none cached is
    none: `prefill_flops`). The prefill models call it where the common case, two plain ints, fails their one
    inline test.

    Raises:
        InvalidRequestError: naming the count and its value (a NaN, a float, a negative prompt: each was timed
            silently, at NaN or 0 s, and the router then found no instance or a free one).
    """
    num_tokens = 0 if is_int(num_tokens) and num_tokens == 0 else check_token_count("num_tokens", num_tokens)
    if not is_int(prefix_tokens):
        raise InvalidRequestError(f"prefix_tokens must be an integer, got {shown(prefix_tokens)}")
    return num_tokens, int(prefix_tokens)


@attrs.frozen(kw_only=True)
class PrefillCostModel:
    """Analytic prefill time: FLOPs / (G · peak · MFU), with the cached prefix's KV loaded from DRAM
    layer by layer under the compute (see the module docstring)."""

    model: ModelShape
    hardware: Hardware
    mfu: float = attrs.field(default=DEFAULT_MFU, validator=fraction)
    overhead_s: float = attrs.field(default=0.0, validator=non_negative)
    # Where a cached prefix waits: VRAM (a coupled instance's prefix cache) loads nothing.
    prefix_tier: Tier = attrs.field(default=Tier.DRAM)
    # The shape's figures, read once: routing asks prefill_s for every decision, and each attribute chain and
    # property (a product) cost about as much as the arithmetic.
    _shape: tuple[int, int, int, float, float] = attrs.field(init=False, repr=False, eq=False)

    @prefix_tier.validator
    def _check_tier(self, _attribute: object, value: Any) -> None:
        # Checked once here, not per prefill_s: anything but Tier.VRAM (a string from a config, None) would
        # silently price as a load from DRAM.
        if not isinstance(value, Tier):
            raise ConfigError(f"PrefillCostModel.prefix_tier must be a mooncake.types.Tier, got {shown(value)}")

    def __attrs_post_init__(self) -> None:
        model, hardware = self.model, self.hardware
        shape = (model.num_layers, model.hidden_size, model.kv_bytes_per_token, hardware.peak_flops * self.mfu)
        object.__setattr__(self, "_shape", (*shape, hardware.host_to_device_bytes_per_s))

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        """Seconds to prefill `num_tokens` tokens with `prefix_tokens` of them cached (as `prefill_flops` reads
        it: fewer than no tokens cached is none).

        Raises:
            InvalidRequestError: a count that is no integer, or a `num_tokens` outside [0, MAX_TOKENS]
                (`_prefill_tokens`).
        """
        # Routing asks this per candidate: two plain ints in range are one test, anything else is looked into.
        if type(num_tokens) is not int or type(prefix_tokens) is not int or not 0 <= num_tokens <= MAX_TOKENS:
            num_tokens, prefix_tokens = _prefill_tokens(num_tokens, prefix_tokens)
        if prefix_tokens < 0:  # priced as is, it would add compute for tokens before the prompt's first
            prefix_tokens = 0
        if num_tokens <= prefix_tokens:
            return 0.0
        layers, d, kv_bytes_per_token, flops_per_s, host_to_device_bytes_per_s = self._shape
        n, p = num_tokens, prefix_tokens
        # `prefill_flops` (p < n here), inlined: the same operations in the same order.
        flops = layers * (ATTENTION_COEFFICIENT * (n * n - p * p) * d + LINEAR_COEFFICIENT * (n - p) * d * d)
        compute = flops / flops_per_s
        if prefix_tokens <= 0 or self.prefix_tier is Tier.VRAM:
            return self.overhead_s + compute
        load = prefix_tokens * kv_bytes_per_token / host_to_device_bytes_per_s
        return self.overhead_s + max(load / layers + compute, load + compute / layers)


class PrefillModel(Protocol):
    """Anything that times a prefill (analytic, fitted, chunked-pipeline)."""

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float: ...


DEFAULT_CHUNK_TOKENS = 4096
"""Tokens per chunk of a chunked prefill where none is given: the engines' (`engine.prefill.PrefillConfig`,
`engine.pipeline.PipelineGroup`), the chunked-pipeline cost model's and the simulated cluster's default."""


@attrs.frozen(kw_only=True)
class ChunkedPipelineCost:
    """Prefill time on a chunked-pipeline-parallel (CPP) group of `group_size` instances.

    The group splits the model's L layers into X = `group_size` stages, one per
    instance, as the engine does (`engine.pipeline.stage_layers`: the first L mod X
    stages hold ⌈L/X⌉ layers, the rest ⌊L/X⌋), and feeds the new tokens through
    them in chunks of `chunk_tokens`. A chunk's time is what the base model adds
    for it, T(end, p) − T(start, p) (its FLOPs with everything before it as
    context; the cached prefix's load and any fixed cost counted once, in the first
    chunk), and on one stage that stage's share of the layers. The slowest stage
    paces the pipeline, so every stage is priced at its share, ⌈L/X⌉/L
    (`stage_share`): every chunk then takes the same time on every stage and the
    makespan is exact in closed form (a proportionate flow shop): Σ chunk times +
    (stages − 1) · the longest chunk time.

    Exact where X divides L (the chunks add up to the base model's time).
    Otherwise an upper bound of the real pipeline, whose later stages are faster
    (a flow shop's makespan grows with its stage times): at most ⌈L/X⌉/⌊L/X⌋
    times it, in practice a few per cent (+2 % for 64 K tokens of LLaMA3-70B's 80
    layers on 6 or 7 stages, where pricing an even split was 3 % low); the first
    stage's busy time (`occupancy_s`) stays exact, as that stage holds ⌈L/X⌉
    layers. L is `num_layers`, by default the base model's (`PrefillCostModel`'s
    shape); with a base that knows none (a fitted model) and no `num_layers`,
    every stage is priced at an even 1/X.

    One chunk (a short prompt) gains nothing; a long one approaches an
    L/⌈L/X⌉× speed-up (X× for an even split). Successive prompts pipeline too:
    the next may enter the first stage once the previous one's chunks have all
    left it (`occupancy_s`).

    Raises:
        ConfigError: a `base` without a `prefill_s` method, a `group_size` or `chunk_tokens` that is no
            integer >= 1, a `num_layers` neither None nor an integer >= 1, or more stages than layers (naming both).
    """

    base: PrefillModel = attrs.field()
    group_size: int = attrs.field(validator=int_at_least(1))
    chunk_tokens: int = attrs.field(default=DEFAULT_CHUNK_TOKENS, validator=int_at_least(1))
    num_layers: int | None = attrs.field(
        default=attrs.Factory(lambda self: _model_layers(self.base), takes_self=True),
        validator=attrs.validators.optional(int_at_least(1)),
    )
    # L / ⌈L/X⌉: the divisor of a chunk's time on the slowest stage; X itself (exactly) for an even split.
    _stage_divisor: float = attrs.field(init=False, repr=False, eq=False)

    @base.validator
    def _check_base(self, _attribute: object, value: Any) -> None:
        # Checked here: a base without one built fine and failed at the first prefill_s with an AttributeError.
        if not callable(getattr(value, "prefill_s", None)):
            raise ConfigError(
                f"ChunkedPipelineCost.base must have a prefill_s method (a prefill model), got {shown(value)}"
            )

    def __attrs_post_init__(self) -> None:
        layers, stages = self.num_layers, self.group_size
        if layers is None:
            object.__setattr__(self, "_stage_divisor", stages)
            return
        if stages > layers:
            raise ConfigError(
                f"ChunkedPipelineCost.group_size={stages} exceeds num_layers={layers}: a stage holds at least one layer"
            )
        object.__setattr__(self, "_stage_divisor", layers / -(-layers // stages))

    @property
    def stage_share(self) -> float:
        """The slowest stage's share of a chunk's time: ⌈L/X⌉ / L (1/X for an unknown L)."""
        layers = self.num_layers
        return 1 / self.group_size if layers is None else -(-layers // self.group_size) / layers

    def _stages(self, num_tokens: int, prefix_tokens: int) -> tuple[float, float]:
        """(Σ chunk times on one stage, the longest chunk time)."""
        num_tokens, prefix_tokens = _prefill_tokens(num_tokens, prefix_tokens)  # a NaN would time no chunk: 0 s
        prefix_tokens = max(prefix_tokens, 0)  # as `prefill_flops` reads it: fewer than no tokens cached is none
        total, longest, done, before = 0.0, 0.0, prefix_tokens, 0.0
        while done < num_tokens:
            end = min(num_tokens, done + self.chunk_tokens)
            upto = self.base.prefill_s(end, prefix_tokens)
            stage = (upto - before) / self._stage_divisor
            total += stage
            longest = max(longest, stage)
            done, before = end, upto
        return total, longest

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        """The prefill's latency: until the last chunk leaves the last stage."""
        total, longest = self._stages(num_tokens, prefix_tokens)
        return total + (self.group_size - 1) * longest

    def occupancy_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        """How long the prefill holds the first stage: the next one may start after that."""
        return self._stages(num_tokens, prefix_tokens)[0]


def _model_layers(base: Any) -> int | None:
    """The layers of the model a prefill model prices, where it says (the analytic model's shape)."""
    model = getattr(base, "model", None)
    return model.num_layers if isinstance(model, ModelShape) else None


def require_coefficients(value: Any) -> None:
    """A fitted model's (c0, c1, c2): a tuple of three finite numbers (the fitted prefill and step models').

    Raises:
        ConfigError: anything else, naming the coefficient.
    """
    if not isinstance(value, tuple) or len(value) != 3:
        raise ConfigError(f"coefficients must be a tuple (c0, c1, c2), got {shown(value)}")
    for name, c in zip(("c0", "c1", "c2"), value, strict=True):
        require_number(f"coefficient {name}", c, minimum=-math.inf)


def fitted_coefficients(
    value: Any, *, takes_time: Callable[[Sequence[float]], bool], rule: str
) -> tuple[float, float, float]:
    """A fitted model's (c0, c1, c2) as its fit makes them and a saved fit (`from_json`) must hold them: three
    real numbers (a bool or text is none), each finite and >= 0 (a cost never falls as the work grows, the bound
    `nonnegative_least_squares` fits under), and `takes_time` of them true: the model's own rule, `rule` in
    words, which its fit also picks its solution by. Each fitted model's one check of its fit and of
    `from_json`; the constructors take any finite numbers (a caller's own model, a zero one included).

    Raises:
        ConfigError: naming the coefficient and its value (or the shape, or the rule and the three).
    """
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ConfigError(f"coefficients must be three numbers [c0, c1, c2], got {shown(value)}")
    c0, c1, c2 = (
        require_number(f"coefficient {name}", c, minimum=0) for name, c in zip(("c0", "c1", "c2"), value, strict=True)
    )
    if not takes_time((c0, c1, c2)):
        raise ConfigError(f"coefficients c0={shown(c0)}, c1={shown(c1)}, c2={shown(c2)}: {rule}")
    return c0, c1, c2


def json_object(text: Any, what: str, keys: Sequence[str]) -> dict[str, Any]:
    """The JSON object `text` holds, with every one of `keys` (a saved fitted model's `from_json`).

    Raises:
        ConfigError: "not a {what}: ..." when it is no JSON, no object, or lacks a key (naming it).
    """
    try:
        data = _json.loads(text)
    # ValueError: no JSON, or nested too deep (NestingError); TypeError: no text (None, a number)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"not a {what}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"not a {what}: must be a JSON object, got {shown(data)}")
    for key in keys:
        if key not in data:
            raise ConfigError(f"not a {what}: it has no {key!r}")
    return data


def nonnegative_least_squares(
    x: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
    usable: Callable[[npt.NDArray[np.float64]], bool] = lambda _solution: True,
) -> npt.NDArray[np.float64] | None:
    """min ‖x·c − y‖² over c ≥ 0 among the `usable` solutions, or None when none is (the fitted prefill and
    step models' fit: a cost never falls as the work grows, whatever the timing noise says).

    Exact for the few unknowns of a cost model: the non-negative optimum is the unconstrained least-squares
    solution on its own support (its nonzero columns), so the best of those solutions over every support that
    come out >= 0 is it. 2^k − 1 small solves for k columns.
    """
    best: tuple[float, npt.NDArray[np.float64]] | None = None
    columns = range(x.shape[1])
    for size in range(len(columns), 0, -1):
        for free in itertools.combinations(columns, size):
            solution = np.zeros(x.shape[1])
            solution[list(free)] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
            if np.all(solution >= 0) and usable(solution):
                residual = float(np.sum((x @ solution - y) ** 2))
                if best is None or residual < best[0]:
                    best = (residual, solution)
    return None if best is None else best[1]


def occupancy_s(
    model: PrefillModel, num_tokens: int, prefix_tokens: int = 0, *, prefill_s: float | None = None
) -> float:
    """How long a prefill holds its instance before the next may start: a chunked-pipeline group's first
    stage (`ChunkedPipelineCost.occupancy_s`), any other instance's whole prefill (`prefill_s`, if the
    caller has it). The simulator frees an instance and the Conductor predicts its queue by this one answer."""
    if isinstance(model, ChunkedPipelineCost):
        return model.occupancy_s(num_tokens, prefix_tokens)
    return model.prefill_s(num_tokens, prefix_tokens) if prefill_s is None else prefill_s


def prefill_end_s(start_s: float, prefill_s: float, occupancy_s: float, ahead_end_s: float) -> float:
    """When a prefill that starts at `start_s` ends, on an instance whose work ahead of it ends at `ahead_end_s`:
    max(start + prefill, ahead end + occupancy). The simulator times a prefill, and the Conductor predicts it
    (the estimate of TTFT and the queue's times), by this one answer.

    On a chunked-pipeline group a prefill enters the first stage once the one ahead has left it (`occupancy_s`),
    but it cannot leave the last stage before the one ahead has: a short prompt behind a long one waits for it
    there. Exact for the group (`ChunkedPipelineCost`: each chunk takes the same time on every stage, a
    proportionate flow shop): the work ahead leaves stage s at a time convex in s, so the latest of the new
    prefill's paths through the stages begins on the first stage (start + its own makespan, `prefill_s`) or on
    the last (the work ahead's end + its chunks there, `occupancy_s`). Elsewhere a prefill
    starts once the one ahead has ended and holds the instance throughout (occupancy = prefill): start + prefill.
    """
    return max(start_s + prefill_s, ahead_end_s + occupancy_s)


def _sample_tokens(minimum: int) -> Any:
    """An attrs validator: a token count in [minimum, MAX_TOKENS] (the fit squares it: past that, its features
    leave a float's range)."""

    def check(_instance: object, attribute: Any, value: Any) -> None:
        if not is_int(value) or not minimum <= value <= MAX_TOKENS:
            raise ConfigError(
                f"PrefillSample.{attribute.name} must be an integer in [{minimum}, MAX_TOKENS = 2**40], got "
                f"{shown(value)}"
            )

    return check


@attrs.frozen(kw_only=True)
class PrefillSample:
    """One measured prefill: `num_tokens` with `prefix_tokens` cached took `seconds`.

    Raises:
        ConfigError: a token count that is not an integer in range (a bool is none), or `seconds` that are not a
            finite time >= 0 (a sample the fit cannot use, with nothing computed or no time, is its to refuse).
    """

    num_tokens: int = attrs.field(validator=_sample_tokens(1))
    prefix_tokens: int = attrs.field(validator=_sample_tokens(0))
    seconds: float = attrs.field()

    @seconds.validator
    def _check_seconds(self, attribute: Any, value: Any) -> None:
        require_number(f"PrefillSample.{attribute.name}", value, minimum=0)


_TERMS = ("c0", "c1 · (n - p)", "c2 · (n² - p²)")  # FittedPrefillModel's, by coefficient
_LARGEST_FEATURES = (1.0, float(MAX_TOKENS), float(MAX_TOKENS) ** 2)
_TERM_LIMIT = sys.float_info.max / 4


def _features(num_tokens: np.ndarray, prefix_tokens: np.ndarray) -> np.ndarray:
    n, p = num_tokens.astype(np.float64), np.minimum(prefix_tokens, num_tokens).astype(np.float64)
    # The analytic model's terms (quadratic attention, linear projections) plus a fixed cost.
    return np.stack([np.ones_like(n), n - p, n * n - p * p], axis=1)


def check_prefill_points(num_tokens: npt.ArrayLike, prefix_tokens: npt.ArrayLike) -> None:
    """That prefills of these (num_tokens, prefix_tokens) can fit a `FittedPrefillModel`: at least three, varying
    enough in n − p and n² − p² to separate its three terms (their rank is 3). `FittedPrefillModel.fit`'s check,
    which examples/profile_engine.py also asks of its grid before it times anything.

    Raises:
        ConfigError: fewer than three points, or too little variety (saying which).
    """
    n, p = np.asarray(num_tokens), np.asarray(prefix_tokens)
    if len(n) < 3:
        raise ConfigError(f"fitting needs at least 3 samples, got {len(n)}")
    if int(np.linalg.matrix_rank(_features(n, p))) < 3:
        raise ConfigError("the samples do not vary enough (in n - p and n² - p²) to fit the model")


@attrs.frozen(kw_only=True)
class FittedPrefillModel:
    """Prefill time fitted to measured runs: c0 + c1·(n − p) + c2·(n² − p²) seconds.

    Attributes:
        coefficients: (c0, c1, c2).
        mean_relative_error, max_relative_error: of the fit on its own samples.
    """

    coefficients: tuple[float, float, float] = attrs.field()
    mean_relative_error: float = attrs.field(default=0.0, validator=non_negative)
    max_relative_error: float = attrs.field(default=0.0, validator=non_negative)

    @coefficients.validator
    def _check_coefficients(self, _attribute: object, value: Any) -> None:
        # A NaN coefficient would time every prefill at 0 s (max(0, NaN) is 0). A finite one too large for its
        # feature would time a prompt at inf, or at 0 s where an inf term meets a -inf one (inf - inf is NaN): a
        # chunked pipeline over it then times a chunk at inf - inf, and the router finds no instance. Each term
        # stays below a quarter of float's range up to MAX_TOKENS tokens, so the three add up finite.
        require_coefficients(value)
        for name, c, term, largest in zip(("c0", "c1", "c2"), value, _TERMS, _LARGEST_FEATURES, strict=True):
            if abs(c) * largest > _TERM_LIMIT:
                raise ConfigError(
                    f"coefficient {name}={shown(c)} is too large: {term} up to MAX_TOKENS = 2**40 tokens must stay"
                    f" within a quarter of a float's range (|{name}| <= {_TERM_LIMIT / largest:.3g}), else a prefill"
                    " takes inf or NaN seconds"
                )

    @classmethod
    def fit(cls, samples: Sequence[PrefillSample]) -> FittedPrefillModel:
        """Least squares with every coefficient >= 0 (`nonnegative_least_squares`), weighted so that relative
        (not absolute) error is minimised.

        Raises:
            ConfigError: an item that is no `PrefillSample`, fewer than three samples, not enough distinct ones to
                fit, times too far apart to weigh in floats, or a fit whose coefficients would time a prompt
                beyond a float's range (naming the coefficient).
        """
        samples = list(require_iterable("samples", samples))
        for sample in samples:
            if not isinstance(sample, PrefillSample):
                raise ConfigError(f"samples must be PrefillSample items, got {shown(sample)}")
        n = np.array([s.num_tokens for s in samples])
        p = np.array([s.prefix_tokens for s in samples])
        check_prefill_points(n, p)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        if not np.all(np.isfinite(y)) or np.any(y <= 0) or np.any(n <= p):
            raise ConfigError("every sample needs finite seconds > 0 and num_tokens > prefix_tokens")
        x = _features(n, p)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            weights = 1.0 / y
            weighted_x, weighted_y = x * weights[:, None], y * weights
        # A time of a few 1e-309 s weighs inf (1 / y), and least squares on it fails in LAPACK.
        if not (np.all(np.isfinite(weighted_x)) and np.all(np.isfinite(weighted_y))):
            raise ConfigError(
                f"the samples' seconds (down to {shown(float(y.min()))}) are too small to weigh in floats: cannot fit"
            )
        # Every coefficient >= 0: a cached prefix never makes a prefill slower, nor a longer prompt faster
        # (a few noisy timings fit exactly, as the vLLM router's start-up calibration does, can tilt the
        # unconstrained curve so that the server holding a prompt's prefix looks the slower one).
        try:
            solution = nonnegative_least_squares(weighted_x, weighted_y, _a_prompt_takes_time)
        except np.linalg.LinAlgError as error:
            raise ConfigError(f"the samples cannot be fitted: {error}") from error
        if solution is None:
            raise ConfigError("no prefill in the samples takes time: cannot fit a prefill model")
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing fit is refused by its coefficient
            predicted = x @ solution
            relative = np.abs(predicted - y) / y
        return cls(
            coefficients=_fitted_prefill_coefficients([float(c) for c in solution]),
            mean_relative_error=float(relative.mean()),
            max_relative_error=float(relative.max()),
        )

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        """c0 + c1·(n − p) + c2·(n² − p²) seconds, never below 0; 0 with the whole prompt cached.

        Raises:
            InvalidRequestError: a count that is no integer, or a `num_tokens` outside [0, MAX_TOKENS]
                (`_prefill_tokens`).
        """
        if type(num_tokens) is not int or type(prefix_tokens) is not int or not 0 <= num_tokens <= MAX_TOKENS:
            num_tokens, prefix_tokens = _prefill_tokens(num_tokens, prefix_tokens)
        if num_tokens <= prefix_tokens:
            return 0.0
        c0, c1, c2 = self.coefficients
        # The prefix as `prefill_flops` reads it: fewer than no tokens cached is none.
        n, p = float(num_tokens), float(min(max(prefix_tokens, 0), num_tokens))
        return max(0.0, c0 + c1 * (n - p) + c2 * (n * n - p * p))

    def to_json(self) -> str:
        """The model as JSON (to save it; `sched` itself does no I/O)."""
        return json.dumps(attrs.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> FittedPrefillModel:
        """A model `to_json` wrote, its coefficients held to its fit's rule (`_fitted_prefill_coefficients`: a
        hand-edited c2 < 0 timed a long prompt at 0 s).

        Raises:
            ConfigError: "not a fitted prefill model", naming what is wrong: no JSON object, a key missing, a
                coefficient that is no finite number >= 0 (a bool or text is none), none > 0, or a relative error
                that is no finite number >= 0.
        """
        keys = ("coefficients", "mean_relative_error", "max_relative_error")
        data = json_object(text, "fitted prefill model", keys)
        try:
            return cls(
                coefficients=_fitted_prefill_coefficients(data["coefficients"]),
                # as floats (JSON's 0 is an int), refused by name as the fields' validators refuse them
                mean_relative_error=require_number("mean_relative_error", data["mean_relative_error"], minimum=0),
                max_relative_error=require_number("max_relative_error", data["max_relative_error"], minimum=0),
            )
        except ConfigError as error:
            raise ConfigError(f"not a fitted prefill model: {error}") from error


def _a_prompt_takes_time(coefficients: Sequence[float] | npt.NDArray[np.float64]) -> bool:
    """The fitted prefill model's rule beyond c >= 0: some coefficient > 0, so a prompt takes time."""
    return any(c > 0 for c in coefficients)


def _fitted_prefill_coefficients(value: Any) -> tuple[float, float, float]:
    """`FittedPrefillModel`'s coefficients as its fit and `from_json` take them (`fitted_coefficients`)."""
    return fitted_coefficients(value, takes_time=_a_prompt_takes_time, rule="one must be > 0 (a prompt takes time)")


def transfers_in_flight(finishes: list[float], now: float) -> int:
    """How many transfers from one source, ending at `finishes` (a heap of times), still move at `now`: those
    ending after it (the ended ones are popped). The congestion `TransferCostModel.transfer_s` charges, counted
    alike by the Conductor's estimate and the simulator's links."""
    while finishes and finishes[0] <= now:
        heapq.heappop(finishes)
    return len(finishes)


def _refuse_transfer(num_bytes: Any, in_flight_from_source: Any, seconds: float) -> float:
    """`seconds` if `transfer_s`'s arguments hold after all (a numpy count), else the ConfigError naming the one
    that does not."""
    require_int("in_flight_from_source", in_flight_from_source, minimum=0)
    if not is_finite_number(num_bytes):
        raise ConfigError(f"num_bytes must be a finite number, got {shown(num_bytes)}")
    if not seconds < _INF:
        raise ConfigError(
            f"moving {shown(num_bytes)} bytes with {shown(in_flight_from_source)} other transfers in flight takes"
            " longer than a float holds"
        )
    return seconds


@attrs.frozen(kw_only=True)
class TransferCostModel:
    """KV transfer time between instances, with congestion at the source."""

    bandwidth_bytes_per_s: float = attrs.field(validator=positive)
    latency_s: float = attrs.field(default=1e-4, validator=non_negative)

    def transfer_s(self, num_bytes: float, *, in_flight_from_source: int = 0) -> float:
        """Seconds to move `num_bytes` while `in_flight_from_source` other transfers share the source's link
        (nothing to move, or fewer than no bytes, takes none).

        Raises:
            ConfigError: `num_bytes` that are no finite number (a NaN timed the transfer at NaN, and the router then
                found no fastest instance), an `in_flight_from_source` that is no integer >= 0, or a time past
                float's range.
        """
        # The router asks this per candidate, so the common case is checked by its answer: a finite time (NaN
        # and inf bytes fail that) from a plain int count >= 0; anything else is looked into by `_refuse_transfer`.
        try:
            if num_bytes <= 0:
                seconds = 0.0 if num_bytes > -_INF else _NAN
            else:
                seconds = self.latency_s + num_bytes * (1 + in_flight_from_source) / self.bandwidth_bytes_per_s
        except (TypeError, OverflowError):  # a string, None; a count past float's range
            seconds = _NAN
        if seconds < _INF and type(in_flight_from_source) is int and in_flight_from_source >= 0:
            return seconds
        return _refuse_transfer(num_bytes, in_flight_from_source, seconds)

    def handoff_s(self, num_bytes: float, prefill_s: float) -> float:
        """How long after a prefill of `prefill_s` seconds its `num_bytes` of KV reach the decode instance: they
        stream layer by layer while it runs, so only what the prefill did not hide remains, and at least one
        latency. The simulator delivers a prefilled request to its decode instance by this, and the router
        predicts that arrival (`RouteDecision.handoff_s`) by it too."""
        return max(self.latency_s, self.transfer_s(num_bytes) - prefill_s)
