"""`FittedPrefillModel.from_json`: the coefficients its fit would make, and nothing else.

It took negative coefficients (a hand-edited c2 < 0 timed a 20,000-token prompt at 0 s, and a longer cached
prefix as slower), bools and numeric strings (through float()), and named wrong shapes as Python's bare errors.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncake.errors import ConfigError
from mooncake.sched.cost import FittedPrefillModel, PrefillSample, check_prefill_points


def saved(**changes: Any) -> str:
    data: dict[str, Any] = {"coefficients": [1e-3, 1e-5, 1e-9], "mean_relative_error": 0.1, "max_relative_error": 0.2}
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (saved(coefficients=[1e-3, -1e-5, 1e-9]), "coefficient c1 must be a finite number >= 0, got -1e-05"),
        (saved(coefficients=[1e-3, 1e-5, -1e-9]), "coefficient c2 must be a finite number >= 0, got -1e-09"),
        (saved(coefficients=[True, 0, 0]), "coefficient c0 must be a finite number >= 0, got True"),
        (saved(coefficients=["1e-3", 0, 0]), "coefficient c0 must be a finite number >= 0, got '1e-3'"),
        (
            saved(coefficients=[0, 0, 0]),
            r"coefficients c0=0.0, c1=0.0, c2=0.0: one must be > 0 \(a prompt takes time\)",
        ),
        (saved(coefficients=None), r"coefficients must be three numbers \[c0, c1, c2\], got None"),
        (saved(coefficients=[1, 2, 3, 4]), r"coefficients must be three numbers \[c0, c1, c2\], got \[1, 2, 3, 4\]"),
        (saved(max_relative_error="x"), "max_relative_error must be a finite number >= 0, got 'x'"),
        (saved(mean_relative_error=False), "mean_relative_error must be a finite number >= 0, got False"),
        ("[1, 2, 3]", r"must be a JSON object, got \[1, 2, 3\]"),
        ('{"coefficients": [1, 0, 0]}', "it has no 'mean_relative_error'"),
    ],
)
def test_from_json_refuses_what_its_fit_would_never_make(text: str, named: str) -> None:
    """A ConfigError naming the coefficient (or field) and its value, the shape, or the rule."""
    with pytest.raises(ConfigError, match=f"^not a fitted prefill model: {named}"):
        FittedPrefillModel.from_json(text)


def test_a_saved_fit_reads_back_as_floats_and_the_constructor_stays_open() -> None:
    """The fit round-trips; JSON's integer errors read as floats; the constructor takes any finite model."""
    samples = [
        PrefillSample(num_tokens=n, prefix_tokens=p, seconds=1e-3 + 1e-6 * (n - p) + 1e-9 * (n * n - p * p))
        for n in (64, 128, 256, 512)
        for p in (0, n // 4, n // 2)
    ]
    fitted = FittedPrefillModel.fit(samples)
    assert FittedPrefillModel.from_json(fitted.to_json()) == fitted
    read = FittedPrefillModel.from_json(saved(mean_relative_error=0, max_relative_error=1))
    assert type(read.mean_relative_error) is float and type(read.max_relative_error) is float
    assert FittedPrefillModel(coefficients=(1e-3, 1e-5, -1e-9)).prefill_s(20_000) == 0.0


def test_check_prefill_points_is_the_fits_check() -> None:
    """Two distinct points cannot fit three terms; one length with three prefixes can (n − p and n² − p² differ)."""
    with pytest.raises(ConfigError, match="at least 3 samples, got 2"):
        check_prefill_points([8, 12], [0, 0])
    with pytest.raises(ConfigError, match="vary enough"):
        check_prefill_points([64, 64, 64], [0, 0, 0])
    check_prefill_points([64, 64, 64], [0, 16, 32])
