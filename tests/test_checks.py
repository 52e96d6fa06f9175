"""Properties of `mooncake._checks`, the argument checks every module's errors go through.

Each check accepts exactly its domain and returns the value as the caller uses it; anything else is the
error it was given, naming the argument and showing the value: integers (never a bool, a float or a
string) at least a minimum, finite numbers above or at least a minimum (never NaN, an infinity or a
bool), non-empty strings; `ceil_div` is the exact ceiling for any non-negative integers (no float rounding);
`shown` quotes any value in one line of at most its limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._checks import (
    ceil_div,
    fraction,
    int_at_least,
    is_finite_number,
    is_int,
    plain_int,
    require_bool,
    require_int,
    require_iterable,
    require_number,
    require_str,
    shown,
)
from mooncake.errors import ConfigError, InvalidRequestError

anything = st.one_of(
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.builds(np.int64, st.integers(-(2**62), 2**62)),
    st.builds(np.float64, st.floats(allow_nan=True)),
    st.fractions(),
)


@given(anything, st.integers(-5, 5))
def test_require_int_accepts_exactly_integers_at_least_the_minimum(value: object, minimum: int) -> None:
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if integral and value >= minimum:  # type: ignore[operator]
        result = require_int("count", value, minimum=minimum)
        assert type(result) is int and result == value
    else:
        with pytest.raises(ConfigError, match=rf"^count must be an integer >= {minimum}, got "):
            require_int("count", value, minimum=minimum)
    assert is_int(value) == integral
    assert plain_int(value) == value or value != value  # NaN is itself unchanged, only unequal
    if integral:
        assert type(plain_int(value)) is int


@given(
    st.one_of(anything, st.integers(2**64 - 2, 2**64 + 1)),
    st.integers(-3, 3),
    st.sampled_from([1, 3, 2**20, 2**64]),
)
def test_require_int_with_an_upper_bound_accepts_exactly_the_integers_of_the_range(
    value: object, minimum: int, below: int
) -> None:
    """[minimum, below), the bound written as a power of two where it is a large one."""
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if integral and minimum <= value < below:  # type: ignore[operator]
        assert require_int("seed", value, minimum=minimum, below=below) == value
    else:
        shown = {2**20: "2**20", 2**64: "2**64"}.get(below, str(below))
        with pytest.raises(
            InvalidRequestError, match=rf"^seed must be an integer in \[{minimum}, {re.escape(shown)}\), got "
        ):
            require_int("seed", value, minimum=minimum, below=below, error=InvalidRequestError)


def float_holds(value: object) -> bool:
    """Whether float(value) is finite: an int or fraction past float's range overflows (JSON reads 10**400)."""
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:
        return False


past_float = st.integers(2**1023, 2**1030) | st.integers(-(2**1030), -(2**1023))  # float's edge, on both sides


@given(anything | past_float, st.integers(-3, 3), st.booleans())
def test_require_number_accepts_exactly_finite_numbers_within_the_bound(
    value: object, minimum: int, strict: bool
) -> None:
    """Finite within the bound: an integer past float's range is no finite number (it was an OverflowError)."""
    real = isinstance(value, (int, float, np.integer, np.floating, Fraction)) and not isinstance(value, bool)
    finite = real and float_holds(value)
    assert is_finite_number(value) == finite
    inside = finite and (value > minimum if strict else value >= minimum)  # type: ignore[operator]
    if inside:
        assert require_number("rate", value, minimum=minimum, strict=strict) == float(value)  # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidRequestError, match=r"^rate must be a finite number .*, got "):
            require_number("rate", value, minimum=minimum, strict=strict, error=InvalidRequestError)


@given(anything | st.text(max_size=3), st.booleans())
def test_require_str_accepts_exactly_strings_non_empty_unless_allowed(value: object, empty: bool) -> None:
    if isinstance(value, str) and (empty or value):
        assert require_str("name", value, empty=empty) is value
    else:
        with pytest.raises(ConfigError, match=r"^name must be a "):
            require_str("name", value, empty=empty)


@given(st.integers(0, 2**200), st.integers(1, 2**70))
def test_ceil_div_is_the_exact_ceiling(numerator: int, denominator: int) -> None:
    assert ceil_div(numerator, denominator) == math.ceil(Fraction(numerator, denominator))


@given(anything)
def test_require_bool_accepts_exactly_the_two_booleans(value: object) -> None:
    if isinstance(value, bool):
        assert require_bool("flag", value) is value
    else:
        with pytest.raises(ConfigError, match=r"^flag must be True or False, got "):
            require_bool("flag", value)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(values, st.integers(12, 300), st.sampled_from([repr, ascii]))
def test_shown_quotes_any_value_in_one_line_within_its_limit(value: object, limit: int, quote: object) -> None:
    """A value is its quote when that fits, else the quote cut to `limit` characters keeping its last; an integer
    whose digits would not fit is named by its bits, whose count fits any limit the callers use."""
    text = shown(value, limit=limit, quote=quote)  # type: ignore[arg-type]
    full = quote(value)  # type: ignore[operator]
    assert "\n" not in text
    if isinstance(value, int) and len(repr(value)) > limit:
        assert text == f"an integer of {value.bit_length()} bits"
    elif len(full) <= limit:
        assert text == full
    else:
        assert len(text) == limit and text == full[: limit - 4] + "..." + full[-1]


def test_shown_names_what_it_cannot_render_by_its_type() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    assert shown(deep) == "a list too large to show"
    assert shown(10**5000) == "an integer of 16610 bits"
    assert shown([10**5000]) == "a list too large to show"  # repr refuses an int past 4,300 digits


HUGE, LONG = 10**5000, "x" * 500
VALIDATORS: list[tuple[str, Callable[[Any], object], tuple[object, ...]]] = [
    ("require_int", lambda v: require_int("count", v, minimum=0, below=10), (HUGE, -HUGE, LONG, [HUGE])),
    ("require_number", lambda v: require_number("rate", v, minimum=0), (HUGE, -HUGE, LONG, [HUGE])),
    ("require_bool", lambda v: require_bool("flag", v), (HUGE, -HUGE, LONG, [HUGE])),
    ("require_str", lambda v: require_str("name", v), (HUGE, -HUGE, [HUGE])),  # a long string is a string
    ("require_iterable", lambda v: require_iterable("items", v), (HUGE, -HUGE)),
    ("int_at_least", lambda v: int_at_least(1)(None, attrs.fields(_Field).count, v), (-HUGE, LONG)),
    ("fraction", lambda v: fraction(None, attrs.fields(_Field).count, v), (HUGE, -HUGE, LONG, 2)),
]


@attrs.define
class _Field:
    count: int


@pytest.mark.parametrize(
    ("check", "value"),
    [
        pytest.param(check, value, id=f"{name}-{i}")
        for name, check, refused in VALIDATORS
        for i, value in enumerate(refused)
    ],
)
def test_every_shared_validator_quotes_what_it_refuses_through_shown(
    check: Callable[[Any], object], value: object
) -> None:
    """An integer past 4,300 digits (whose repr Python refuses: the message escaped as a bare ValueError), a
    500-character string, a list holding such an integer: each shared validator refusing one raises its
    ConfigError ending with the value as `shown` quotes it, in a short message."""
    with pytest.raises(ConfigError) as raised:
        check(value)
    message = str(raised.value)
    assert message.endswith(shown(value)) and len(message) <= 120, message
