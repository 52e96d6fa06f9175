"""Small validators shared by the value objects, so every message reads alike.

An "integer" is any `numbers.Integral` but bool (numpy integers included).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from mooncake.errors import ConfigError

__all__ = [
    "ceil_div",
    "fraction",
    "int_at_least",
    "is_finite_number",
    "is_int",
    "plain_int",
    "range_problem",
    "require_bool",
    "require_int",
    "require_iterable",
    "require_number",
    "require_str",
    "shown",
]

T = TypeVar("T")


def shown(value: object, *, limit: int = 60, quote: Callable[[object], str] = repr) -> str:
    """`value` as a one-line error message quotes it: `quote(value)` (repr; ascii for a client's text, lone
    surrogates and all), cut to `limit` characters with its closing character kept. An integer whose digits
    would not fit is named by its size in bits (its repr alone would fail past 4,300 digits); a value `quote`
    cannot render (nested too deep, or holding such an integer) by its type. Every library module's messages quote
    what they were given through it (what a peer sent included); `repr` is left to exceptions and values a module
    built itself (docs/architecture.md)."""
    # Past 4 bits a digit an integer is too long for sure (and its repr may fail); below, its repr is cheap.
    if isinstance(value, int) and (value.bit_length() > 4 * limit or len(repr(value)) > limit):
        return f"an integer of {value.bit_length()} bits"
    try:
        text = quote(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"


def is_int(value: object) -> bool:
    # The exact-type test first: isinstance against an ABC is slow, and this runs per event.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def plain_int(value: Any) -> Any:
    """An attrs converter: integers (numpy's too) become Python ints; anything else is left for the validator."""
    return int(value) if is_int(value) else value


def require_int(
    name: str, value: Any, *, minimum: int, below: int | None = None, error: type[Exception] = ConfigError
) -> int:
    """`value` as an int at least `minimum` (and less than `below`, if given), or `error` naming `name` and the
    value."""
    if not is_int(value) or value < minimum or (below is not None and value >= below):
        bound = f">= {minimum}" if below is None else f"in [{minimum}, {_power_text(below)})"
        raise error(f"{name} must be an integer {bound}, got {shown(value)}")
    return int(value)


def _power_text(n: int) -> str:
    """A bound as it is written: 2**64 rather than its twenty digits."""
    return f"2**{n.bit_length() - 1}" if n > 1 << 16 and n & (n - 1) == 0 else str(n)


def is_finite_number(value: object) -> bool:
    """Whether `value` is a real number (a bool is none) that a float holds finitely: an int past float's range
    (10**400, which JSON reads) is none, where `math.isfinite` would raise OverflowError converting it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def require_number(
    name: str, value: Any, *, minimum: float, strict: bool = False, error: type[Exception] = ConfigError
) -> float:
    """`value` as a finite float above (`strict`) or at least `minimum`, or `error`."""
    if not is_finite_number(value) or value < minimum or (strict and value == minimum):
        bound = "" if minimum == -math.inf else f" {'>' if strict else '>='} {minimum}"  # any finite number
        raise error(f"{name} must be a finite number{bound}, got {shown(value)}")
    return float(value)


def range_problem(value: float, low: float, high: float) -> str | None:
    """What is wrong with `value` as a number in [`low`, `high`] ("must be a number in [1e-06, 1e+06]"; nan and
    the infinities are out), or None: one wording for an option's range, whether an argparse type, whose error
    argparse prefixes with the option, or a ConfigError that names the option itself reports it."""
    if is_finite_number(value) and low <= value <= high:
        return None
    return f"must be a number in [{low:g}, {high:g}]"


def require_bool(name: str, value: Any) -> bool:
    """`value` as a switch, or a ConfigError naming `name` (a string such as "no", or 0, is no switch: one
    would read as true, the other is a typo)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {shown(value)}")
    return value


def require_iterable(name: str, value: Iterable[T], *, error: type[Exception] = ConfigError) -> Iterator[T]:
    """An iterator over `value`, or `error` naming `name` and the value (None, a number): else a bare TypeError
    from the loop."""
    try:
        return iter(value)
    except TypeError:
        raise error(f"{name} must be an iterable, got {shown(value)}") from None


def require_str(name: str, value: Any, *, what: str = "string", empty: bool = False) -> str:
    """`value` as a string (non-empty unless `empty`), or a ConfigError naming `name`, what it must be and the value
    (an instance id, a hash namespace: keys and sort orders would otherwise mix ints, None and text)."""
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{name} must be a {'' if empty else 'non-empty '}{what}, got {shown(value)}")
    return value


def int_at_least(minimum: int, *, below: int | None = None, error: type[Exception] = ConfigError) -> Any:
    """An attrs validator: the field is an integer >= `minimum` (and < `below`, if given)."""

    def check(_instance: object, attribute: Any, value: Any) -> None:
        require_int(attribute.name, value, minimum=minimum, below=below, error=error)

    return check


def positive(_instance: object, attribute: Any, value: Any) -> None:
    """An attrs validator: a finite number > 0 (a bool is no number)."""
    require_number(attribute.name, value, minimum=0, strict=True)


def non_negative(_instance: object, attribute: Any, value: Any) -> None:
    """An attrs validator: a finite number >= 0 (a bool is no number)."""
    require_number(attribute.name, value, minimum=0)


def fraction(_instance: object, attribute: Any, value: Any) -> None:
    """An attrs validator: a share of a peak (an efficiency, a utilisation), in (0, 1]."""
    if require_number(attribute.name, value, minimum=0, strict=True) > 1:
        raise ConfigError(f"{attribute.name} is a fraction of a peak, at most 1, got {shown(value)}")


def binding_error(function: Callable[..., Any], *args: Any, **kwargs: Any) -> TypeError | None:
    """Why `function` cannot be called with these arguments (the TypeError binding them to its signature
    raises), or None when it can, or has no signature to tell (a builtin: its call will say). Nothing is called:
    a policy or factory is checked when it is plugged in, not in the middle of a run."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        return error
    return None


def ceil_div(numerator: int, denominator: int) -> int:
    """ceil(numerator / denominator) for non-negative ints, without floats."""
    return -(-numerator // denominator)
