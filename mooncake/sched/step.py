"""Decode step models: how long one decode iteration of a batch takes, and how much KV fits.

Decode (a roofline): one step of a batch of B requests holding C tokens of KV
in all is bound by HBM bandwidth or by compute, whichever is slower,

    step(B, C) = overhead + max((W + kv · C) / (G · HBM · memory_efficiency),
                                (2 · N · B + 4 · l · d · C) / (G · peak · compute_efficiency))

(W the bytes of the weights a step reads and N their number: all but an untied
embedding, whose rows are looked up; kv the KV bytes per token. Compute is a
multiply-add per weight per sequence, and q·k and the weighted sum of v per
context token and layer: `ModelShape.flops_per_token`, the engines' FLOPs
count.) Small batches are memory-bound (the weights' read
dominates); the compute term grows with B, so large batches are compute-bound
and raise TBT as on real GPUs. A request's TBT is its batch's step time.
Every analytic step model (`AnalyticStepModel`: this one, `RooflineStep`,
the engines' fitted model) gives its step as a `RooflineStep`: an overhead plus
the max of a few affine branches in (B, C), which is what the simulator's
analytic batch integrates in closed form.

`StepModel` is the protocol every TBT check asks (`step_s(batch_size,
context_tokens)`); `AnalyticStepModel` adds `roofline()`, the form the
simulator integrates and the Conductor evaluates over many instances at once.
`FittedStepModel` is a plane fitted to a real engine's measured steps
(`examples/profile_engine.py`), least squares with numpy, no torch.

All functions are pure; units are in the names (seconds, bytes, tokens).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import (
    fraction,
    is_finite_number,
    is_int,
    non_negative,
    require_int,
    require_iterable,
    require_number,
    shown,
)
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.cost import (
    DEFAULT_MFU,
    Hardware,
    ModelShape,
    fitted_coefficients,
    json_object,
    nonnegative_least_squares,
    require_coefficients,
)

__all__ = [
    "AnalyticStepModel",
    "DecodeCostModel",
    "FittedStepModel",
    "MAX_STEP_FEATURE",
    "RooflineStep",
    "StepBranch",
    "StepModel",
    "check_step_points",
]


class StepModel(Protocol):
    """Predicts one decode step's seconds for a batch (`DecodeCostModel` is one; the real
    engines' `FittedStepModel` another)."""

    def step_s(self, batch_size: int, context_tokens: int) -> float: ...


MAX_STEP_FEATURE = 2.0**63
"""The largest batch size or context (in tokens) a step is timed for: what the decode selection's int64 arrays
hold. Each term of a branch stays within a quarter of a float's range up to it, so a branch is finite and a step
never NaN."""
_TERM_LIMIT = sys.float_info.max / 4
_LARGEST_FEATURES = (1.0, MAX_STEP_FEATURE, MAX_STEP_FEATURE)  # of a branch's fixed, per-sequence, per-token terms
_FEATURE_BOUND = 2**63  # a feature is below it: what an int64 holds


def _step_features(batch_size: Any, context_tokens: Any) -> tuple[int, int]:
    """A step's features as Python ints, the one rule of every step model (as `cost._prefill_tokens` is of the
    prefill models'): `batch_size` an integer below 2**63 (one below 1 is an empty batch, which takes no time),
    `context_tokens` an integer in [0, 2**63). A step model calls it where its one inline test fails.

    Raises:
        InvalidRequestError: naming the feature and its value: a NaN (timed at NaN, where the compiled
            `roofline_step` gave -inf), a negative context (timed faster than none), a fraction, text or None (a
            bare TypeError).
    """
    if not is_int(batch_size) or batch_size >= _FEATURE_BOUND:
        raise InvalidRequestError(
            f"batch_size must be an integer below 2**63 (below 1: an empty batch), got {shown(batch_size)}"
        )
    context_tokens = require_int(
        "context_tokens", context_tokens, minimum=0, below=_FEATURE_BOUND, error=InvalidRequestError
    )
    return int(batch_size), context_tokens


def _term_problem(name: str, value: float, largest: float, feature: str, *, what: str = "") -> str | None:
    """Why a coefficient's term (`value` times a feature up to `largest`) could leave a float's range, or None.
    Past it, a step takes inf seconds, or NaN where an inf term meets a -inf one; `RooflineStep.step_s` (Python's
    max) and the compiled scan (`sched._kernels.roofline_step`, which skips a NaN) would then disagree."""
    if abs(value) * largest <= _TERM_LIMIT:
        return None
    return (
        f"{what}{name}={shown(value)} is too large: {feature} must stay within a quarter of a float's range"
        f" (|{name}| <= {_TERM_LIMIT / largest:.3g}), else a step takes inf or NaN seconds"
    )


def _term(largest: float, feature: str) -> Any:
    """An attrs validator: a finite coefficient whose term stays finite (`_term_problem`)."""

    def check(_instance: object, attribute: Any, value: Any) -> None:
        require_number(attribute.name, value, minimum=-math.inf)
        problem = _term_problem(attribute.name, value, largest, feature)
        if problem is not None:
            raise ConfigError(problem)

    return check


@attrs.frozen
class StepBranch:
    """One resource's time for a decode step: `fixed_s + per_sequence_s · B + per_context_token_s · C`
    seconds for B requests holding C tokens of KV (any finite coefficients, a fitted one may be negative, whose
    terms stay within a quarter of a float's range for B and C up to `MAX_STEP_FEATURE`: a step is then finite,
    never NaN)."""

    fixed_s: float = attrs.field(validator=_term(1.0, "the fixed term"))
    per_sequence_s: float = attrs.field(validator=_term(MAX_STEP_FEATURE, "per_sequence_s · B up to 2**63"))
    per_context_token_s: float = attrs.field(validator=_term(MAX_STEP_FEATURE, "per_context_token_s · C up to 2**63"))


def _branch_tuple(branches: Iterable[StepBranch]) -> tuple[StepBranch, ...]:
    return tuple(branches)


def _some_branches(_instance: object, _attribute: Any, value: tuple[StepBranch, ...]) -> None:
    if not value or not all(isinstance(branch, StepBranch) for branch in value):
        raise ConfigError(f"a roofline step needs at least one StepBranch, got {shown(value)}")


@attrs.frozen
class RooflineStep:
    """A decode step as a roofline: `overhead_s + max_j (fixed_j + per_sequence_j · B + per_context_token_j · C)`
    seconds for a batch of B > 0 requests holding C tokens (0 for B <= 0), one branch per resource
    (HBM reads, compute) or per fitted piece. B and C are integers below 2**63, C >= 0 (`_step_features`).

    Over a stretch of steps at constant membership each branch grows linearly in
    the step index (C grows by B per step), so the step time is a convex,
    piecewise-linear envelope that the simulator's `ContinuousBatch` sums in
    closed form. The step is computed the same way here, in `step_times` and in
    every model whose `roofline()` this is, so that they agree to the bit.
    """

    branches: tuple[StepBranch, ...] = attrs.field(converter=_branch_tuple, validator=_some_branches)
    overhead_s: float = attrs.field(default=0.0, kw_only=True, validator=non_negative)
    # One row per branch: (fixed_s, per_sequence_s, per_context_token_s), for `sched._kernels.roofline_step`.
    coefficients: np.ndarray = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        rows = [(b.fixed_s, b.per_sequence_s, b.per_context_token_s) for b in self.branches]
        coefficients = np.array(rows, dtype=np.float64).reshape(len(rows), 3)
        coefficients.flags.writeable = False
        object.__setattr__(self, "coefficients", coefficients)

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch_size` requests holding `context_tokens` in all.

        Raises:
            InvalidRequestError: a feature `_step_features` refuses (a NaN, a negative context, a fraction, text).
        """
        # The TBT check asks this per decision: two plain ints in range are one test, anything else is looked into.
        if (
            type(batch_size) is not int
            or type(context_tokens) is not int
            or batch_size >= _FEATURE_BOUND
            or not 0 <= context_tokens < _FEATURE_BOUND
        ):
            batch_size, context_tokens = _step_features(batch_size, context_tokens)
        if batch_size <= 0:
            return 0.0
        return self.overhead_s + max(
            [
                branch.fixed_s + branch.per_sequence_s * batch_size + branch.per_context_token_s * context_tokens
                for branch in self.branches
            ]
        )

    def step_times(self, batch_sizes: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """`step_s` of each (batch size, context) pair of two equal-length arrays, element by element
        (the same float64 operations in the same order, so each equals `step_s` exactly).

        Raises:
            InvalidRequestError: what `step_s` refuses, naming the first pair's feature that it refuses.
        """
        sizes = np.asarray(batch_sizes)
        contexts = np.asarray(context_tokens)
        # step_s's rule, on whole arrays where they pass; the first pair that fails it raises its error.
        passes = all(
            array.dtype.kind in "iu" and (not array.size or least <= array.min() <= array.max() < _FEATURE_BOUND)
            for array, least in ((sizes, -_FEATURE_BOUND), (contexts, 0))
        )
        if not passes:
            for batch_size, context in zip(sizes.ravel().tolist(), contexts.ravel().tolist(), strict=False):
                _step_features(batch_size, context)
        slowest: np.ndarray | None = None
        for branch in self.branches:
            seconds = branch.fixed_s + branch.per_sequence_s * sizes + branch.per_context_token_s * contexts
            slowest = seconds if slowest is None else np.maximum(slowest, seconds)
        assert slowest is not None  # a roofline has at least one branch
        times: np.ndarray = np.where(sizes > 0, self.overhead_s + slowest, 0.0)
        return times

    def roofline(self) -> RooflineStep:
        return self


class AnalyticStepModel(StepModel, Protocol):
    """A `StepModel` whose step is a `RooflineStep` (`roofline().step_s` equals its own `step_s`):
    what the simulator's analytic batch and the vectorised decode selection need."""

    def roofline(self) -> RooflineStep: ...


@attrs.frozen(kw_only=True)
class DecodeCostModel:
    """Decode step time and KV capacity of one decode instance: a two-branch roofline.

    A step reads the weights (all but the embedding's lookups) and the batch's KV from HBM once (the memory
    branch, at `memory_efficiency` of the instance's HBM bandwidth) and does
    2 · N FLOPs per request plus 4 · l · d per context token (the compute
    branch, at `compute_efficiency` of its dense bf16 peak); it takes the slower
    of the two plus `overhead_s`. Small batches are memory-bound; the compute
    branch grows faster with the batch and, for LLaMA3-70B on 8×A800, overtakes
    from 166 requests of 2,048 tokens each (96 with no context). An H800's
    peak is 3.2× an A800's against 1.6× the bandwidth, so on 8×H800 that takes
    about 1,250 such requests, more than its HBM holds.

    `compute_efficiency` defaults to 0.5: a decode GEMM has only B rows, so it
    reaches a fraction of peak, and tensor-parallel all-reduces and launch gaps
    take more. It is `PrefillCostModel`'s default MFU too (which counts the
    paper's prefill FLOPs, within 15 % of these); it is a round figure, not a
    measurement (fit a `FittedStepModel` to an engine where it matters).
    `memory_efficiency` 0.8 is what streaming kernels reach of the datasheet
    HBM bandwidth.
    """

    model: ModelShape
    hardware: Hardware
    overhead_s: float = attrs.field(default=0.005, validator=non_negative)
    memory_efficiency: float = attrs.field(default=0.8, validator=fraction)
    compute_efficiency: float = attrs.field(default=DEFAULT_MFU, validator=fraction)
    kv_memory_fraction: float = attrs.field(default=0.9, validator=fraction)

    _roofline: RooflineStep = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # step_s runs on every simulated decode stretch: build the roofline once.
        hardware, model = self.hardware, self.model
        bandwidth = hardware.num_gpus * hardware.hbm_bytes_per_s * self.memory_efficiency
        flops = hardware.peak_flops * self.compute_efficiency
        memory = StepBranch(model.streamed_weight_bytes / bandwidth, 0.0, model.kv_bytes_per_token / bandwidth)
        # Per sequence, the FLOPs of its one new token (the same count as the engines' MFU).
        compute = StepBranch(0.0, model.flops_per_token(0) / flops, model.attention_flops_per_context_token / flops)
        object.__setattr__(self, "_roofline", RooflineStep((memory, compute), overhead_s=self.overhead_s))

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode iteration of `batch_size` requests holding `context_tokens` in all (its roofline's
        step: InvalidRequestError on a feature `RooflineStep.step_s` refuses)."""
        return self._roofline.step_s(batch_size, context_tokens)

    def roofline(self) -> RooflineStep:
        """The step as its two branches: memory (index 0) and compute (index 1)."""
        return self._roofline

    def capacity_tokens(self) -> int:
        """KV tokens that fit in the instance's HBM beside the weights: ⌊(G · HBM · kv_memory_fraction − weights)
        / KV bytes per token⌋, 0 (never negative) where the weights leave no room for one token."""
        return max(0, math.floor((self._kv_budget_bytes() - self.model.weight_bytes) / self.model.kv_bytes_per_token))

    def require_capacity_tokens(self, field: str) -> int:
        """`capacity_tokens()`, at least 1: the one check of whether this model's KV fits beside its weights on
        this hardware, for every caller that sizes a decode node by its HBM.

        Args:
            field: the caller's name for the hardware (`ClusterSpec.decode_hardware`, say), for the message.

        Raises:
            ConfigError: no room for one token of KV (every request would be refused as too long for the node),
                naming `field`, the hardware and the model, with the weights' bytes against G · HBM ·
                kv_memory_fraction.
        """
        capacity = self.capacity_tokens()
        if capacity <= 0:
            hardware, model = self.hardware, self.model
            raise ConfigError(
                f"{field}={shown(hardware.name)} (num_gpus={hardware.num_gpus}, {hardware.hbm_bytes / 2**30:.4g} GiB "
                f"of HBM each) leaves no HBM for the KV of model={shown(model.name)}: its weights take "
                f"{model.weight_bytes / 1e9:.4g} GB of the G · HBM · kv_memory_fraction = {hardware.num_gpus} x "
                f"{hardware.hbm_bytes / 1e9:.4g} GB x {self.kv_memory_fraction:g} = {self._kv_budget_bytes() / 1e9:.4g} "
                f"GB that hold weights and KV, which need {model.kv_bytes_per_token} bytes more per token: give "
                "more GPUs, larger ones, or explicit decode limits"
            )
        return capacity

    def _kv_budget_bytes(self) -> float:
        """The HBM the weights and KV may take: G · HBM · kv_memory_fraction."""
        return self.hardware.num_gpus * self.hardware.hbm_bytes * self.kv_memory_fraction


def check_step_points(batch_sizes: Sequence[int], context_tokens: Sequence[int]) -> None:
    """That steps of these batch sizes and contexts can fit a `FittedStepModel`: at least three, varying enough to
    separate its per-sequence and per-token costs (the rank of (1, batch_size, context_tokens) is 3; a context
    that is a fixed multiple of the batch, as one prompt length gives, is not). `FittedStepModel.fit`'s check,
    which examples/profile_engine.py also asks of its grid before it times anything.

    Raises:
        ConfigError: fewer than three points, or too little variety (saying which).
    """
    if len(batch_sizes) < 3:
        raise ConfigError(f"fitting needs at least 3 samples, got {len(batch_sizes)}")
    x = np.array([[1.0, float(b), float(t)] for b, t in zip(batch_sizes, context_tokens, strict=True)])
    if int(np.linalg.matrix_rank(x)) < 3:
        raise ConfigError("the samples do not vary enough in batch size and context to fit the model")


@attrs.frozen(kw_only=True)
class FittedStepModel:
    """Decode step time fitted to measured steps: c0 + c1·batch_size + c2·context_tokens seconds,
    never below 0 (and 0 for an empty batch).

    A `StepModel` for the TBT check, fitted by `examples/profile_engine.py`, and
    an `AnalyticStepModel`: its roofline has the fitted plane and the zero plane
    as branches and no overhead, and gives the same step on every input.

    Raises:
        ConfigError: coefficients that are not three finite numbers, or one whose term could leave a float's
            range for a batch or context up to `MAX_STEP_FEATURE` (naming it: the step would be inf or NaN).
    """

    coefficients: tuple[float, float, float]

    _roofline: RooflineStep = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        require_coefficients(self.coefficients)
        features = ("c0", "c1 · batch_size up to 2**63", "c2 · context_tokens up to 2**63")
        for name, c, largest, feature in zip(
            ("c0", "c1", "c2"), self.coefficients, _LARGEST_FEATURES, features, strict=True
        ):
            problem = _term_problem(name, c, largest, feature, what="coefficient ")
            if problem is not None:
                raise ConfigError(problem)
        c0, c1, c2 = self.coefficients
        roofline = RooflineStep((StepBranch(c0, c1, c2), StepBranch(0.0, 0.0, 0.0)))
        object.__setattr__(self, "_roofline", roofline)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> FittedStepModel:
        """Least squares over (batch_size, context_tokens, seconds) samples, every coefficient >= 0.

        A step never gets faster as the batch or its context grows, and takes time for one request
        (what the simulator's analytic batch relies on); timing noise on a step that barely grows (a
        tiny model) can tilt the unconstrained plane the other way. So the fit is the best of the
        planes whose coefficients are all >= 0 (`cost.nonnegative_least_squares`, exact in 3 unknowns).

        Raises:
            ConfigError: samples that are no iterable, an item that is no (batch_size, context_tokens, seconds)
                tuple or list of two integers and a finite number (a bool, text or a fraction is no count; a
                dict's keys are no sample), a batch size below 1, a context below 0 or either past
                `MAX_STEP_FEATURE`, seconds that are not > 0 (a measured step takes time), fewer than three
                samples, too little variety to fit, no step taking time, or a fit whose coefficients would
                time a step beyond a float's range.
        """
        samples = list(require_iterable("samples", samples))
        for sample in samples:
            # Checked before numpy sees them: np.array(dtype=float64) reads "1" and True as 1.0, and unpacking a
            # dict yields its keys.
            if not (
                isinstance(sample, (tuple, list))
                and len(sample) == 3
                and is_int(sample[0])
                and is_int(sample[1])
                and is_finite_number(sample[2])
            ):
                raise ConfigError(
                    "samples must be (batch_size, context_tokens, seconds) numbers: two integers and a finite"
                    f" number, got {shown(sample)}"
                )
            if not (1 <= sample[0] <= MAX_STEP_FEATURE and 0 <= sample[1] <= MAX_STEP_FEATURE):
                raise ConfigError(
                    "every sample needs a batch_size >= 1 and context_tokens >= 0 (both up to 2**63): a step of no"
                    f" request, or fewer than no tokens, is no step; got {shown(sample)}"
                )
        y = np.array([float(s) for _, _, s in samples], dtype=np.float64)
        if np.any(y <= 0):
            raise ConfigError(
                f"every sample needs seconds > 0 (a measured step takes time), got {shown(float(y.min()))}"
            )
        check_step_points([b for b, _, _ in samples], [t for _, t, _ in samples])
        x = np.array([[1.0, float(b), float(t)] for b, t, _ in samples], dtype=np.float64)
        best = nonnegative_least_squares(x, y, _one_request_takes_time)
        if best is None:
            raise ConfigError("no step in the samples takes time: cannot fit a decode step model")
        return cls(coefficients=_fitted_step_coefficients([float(c) for c in best]))

    def to_json(self) -> str:
        return json.dumps({"coefficients": list(self.coefficients)})

    @classmethod
    def from_json(cls, text: str) -> FittedStepModel:
        """A model written by `to_json` (or a profile's "decode" section), its coefficients held to its fit's rule
        (`_fitted_step_coefficients`: a hand-edited c1 < 0 timed a large batch at 0 s).

        Raises:
            ConfigError: "not a fitted step model", naming what is wrong: no JSON object, no "coefficients", not
                three of them, one that is no finite number >= 0 (a bool or text is none), c0 + c1 not > 0, or
                one too large for its term.
        """
        data = json_object(text, "fitted step model", ("coefficients",))
        try:
            return cls(coefficients=_fitted_step_coefficients(data["coefficients"]))
        except ConfigError as error:
            raise ConfigError(f"not a fitted step model: {error}") from error

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        """max(c0 + c1·batch_size + c2·context_tokens, 0) seconds, 0 for an empty batch (its roofline's step:
        InvalidRequestError on a feature `RooflineStep.step_s` refuses)."""
        return self._roofline.step_s(batch_size, context_tokens)

    def roofline(self) -> RooflineStep:
        """max(c0 + c1·B + c2·C, 0): the fitted plane, clamped by the zero plane."""
        return self._roofline


def _one_request_takes_time(coefficients: Sequence[float] | npt.NDArray[np.float64]) -> bool:
    """The fitted step model's rule beyond c >= 0: c0 + c1 > 0, so a step of one request takes time (what the
    simulator's analytic batch relies on)."""
    return bool(coefficients[0] + coefficients[1] > 0)


def _fitted_step_coefficients(value: Any) -> tuple[float, float, float]:
    """`FittedStepModel`'s coefficients as its fit and `from_json` take them (`cost.fitted_coefficients`)."""
    return fitted_coefficients(
        value, takes_time=_one_request_takes_time, rule="c0 + c1 must be > 0 (a step of one request takes time)"
    )
