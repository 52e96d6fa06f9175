"""`FittedStepModel`: one rule for the coefficients its fit makes and `from_json` reads, and its samples checked by
name.

`from_json` took negative or all-zero coefficients (a hand-edited profile timing a large batch at 0 s), bools
and numeric strings (through float()), and named `{"coefficients": null}` or a list as Python's bare TypeError;
`fit` read "1" and True as counts (np.array(dtype=float64)) and a dict's keys as a sample.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncake.errors import ConfigError
from mooncake.sched.step import FittedStepModel, check_step_points

SAMPLES = [(b, b * (n + 2), 2e-3 + 1e-4 * b + 3e-7 * b * (n + 2)) for b in (1, 2, 4, 8) for n in (64, 128, 256)]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"coefficients": [1e-3, -1e-4, 0]}', "coefficient c1 must be a finite number >= 0, got -0.0001"),
        ('{"coefficients": [-1, 0, 0]}', "coefficient c0 must be a finite number >= 0, got -1"),
        ('{"coefficients": [true, 0, 0]}', "coefficient c0 must be a finite number >= 0, got True"),
        ('{"coefficients": ["1e-3", 0, 0]}', "coefficient c0 must be a finite number >= 0, got '1e-3'"),
        ('{"coefficients": [1e-3, 0, NaN]}', "coefficient c2 must be a finite number >= 0, got nan"),
        ('{"coefficients": [0, 0, 0]}', r"coefficients c0=0.0, c1=0.0, c2=0.0: c0 \+ c1 must be > 0"),
        (
            '{"coefficients": [0, 0, 1e-6]}',
            r"coefficients c0=0.0, c1=0.0, c2=1e-06: c0 \+ c1 must be > 0 \(a step of one request takes time\)",
        ),
        ('{"coefficients": null}', r"coefficients must be three numbers \[c0, c1, c2\], got None"),
        ('{"coefficients": [1, 2]}', r"coefficients must be three numbers \[c0, c1, c2\], got \[1, 2\]"),
        ('{"coefficients": {"a": 1, "b": 2, "c": 3}}', "coefficients must be three numbers"),
        ("[1, 2, 3]", r"must be a JSON object, got \[1, 2, 3\]"),
        ('{"coefs": [1, 2, 3]}', "it has no 'coefficients'"),
        ('{"coefficients": [1e308, 1e308, 0.0]}', "coefficient c0=1e[+]308 is too large"),
    ],
)
def test_from_json_refuses_coefficients_its_fit_would_never_make(text: str, named: str) -> None:
    """A ConfigError naming the coefficient and its value (or the shape, or the rule), never a bare TypeError."""
    with pytest.raises(ConfigError, match=f"^not a fitted step model: {named}"):
        FittedStepModel.from_json(text)


def test_fit_and_from_json_share_one_rule_and_the_constructor_stays_open() -> None:
    """What the fit makes reads back; what from_json refuses the fit never makes (every coefficient >= 0 and
    c0 + c1 > 0); the constructor still takes any finite model (examples/vllm_fleet's zero one, a calibration's)."""
    fitted = FittedStepModel.fit(SAMPLES)
    assert FittedStepModel.from_json(fitted.to_json()) == fitted
    assert min(fitted.coefficients) >= 0 and fitted.coefficients[0] + fitted.coefficients[1] > 0
    assert FittedStepModel(coefficients=(0.0, 0.0, 0.0)).step_s(4, 100) == 0.0
    assert FittedStepModel(coefficients=(1e-3, -1e-4, 0.0)).step_s(1, 0) == pytest.approx(9e-4)


@pytest.mark.parametrize(
    "bad",
    [
        ("1", 10, 1e-3),
        (True, 10, 1e-3),
        (1, False, 1e-3),
        (1.5, 10, 1e-3),
        (1, 10, "1e-3"),
        (1, 10),
        {1: 0, 2: 0, 3: 0},
    ],
    ids=repr,
)
def test_fit_refuses_a_sample_that_is_no_counts_and_seconds(bad: Any) -> None:
    """Text and bools were read as numbers, a fraction as a batch, and a dict's keys as a sample: a ConfigError
    naming the item."""
    samples = [bad, *SAMPLES]
    with pytest.raises(ConfigError, match=r"samples must be \(batch_size, context_tokens, seconds\) numbers") as raised:
        FittedStepModel.fit(samples)
    assert repr(bad)[:20] in str(raised.value)


def test_fit_refuses_counts_out_of_range_before_converting_them() -> None:
    """A context past 2**63 (10**400 would not even convert to a float) is named, not an OverflowError."""
    with pytest.raises(ConfigError, match=r"context_tokens >= 0 .*up to 2\*\*63"):
        FittedStepModel.fit([(1, 10**400, 1e-3), *SAMPLES])


def test_check_step_points_is_the_fits_check() -> None:
    """One prompt length (context a fixed multiple of the batch) cannot fit; what the check passes, the fit fits."""
    with pytest.raises(ConfigError, match="vary enough"):
        check_step_points([1, 2, 4], [66, 132, 264])
    with pytest.raises(ConfigError, match="vary enough"):
        FittedStepModel.fit([(1, 66, 1e-3), (2, 132, 2e-3), (4, 264, 3e-3)])
    with pytest.raises(ConfigError, match="at least 3 samples, got 2"):
        check_step_points([1, 2], [66, 130])
    check_step_points([b for b, _, _ in SAMPLES], [c for _, c, _ in SAMPLES])
    assert json.loads(FittedStepModel.fit(SAMPLES).to_json())["coefficients"]
