"""What the `test_shown` files share: the values Python cannot quote, and the check each entry point is put to.

An entry is `(name, call, error, values)`: `call(value)` must raise `error`, a `MooncakeError`, whose message is at
most `BOUND` characters and does not hold the long string whole (`_checks.shown` cut it, or named an integer by
its size where its repr would have failed past 4,300 digits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

from mooncake.errors import MooncakeError

BOUND = 300
"""The longest message an entry may give (its own words plus one quoted value of `shown`'s 60 characters)."""

HUGE, NEGATIVE, TEXT = 10**5000, -(10**5000), "x" * 500
ALL = (HUGE, NEGATIVE, TEXT)

Entry = tuple[str, Callable[..., object], type[MooncakeError], tuple[Any, ...]]


def entry_params(entries: Iterable[Entry]) -> list[Any]:
    """One `pytest.param(call, error, value)` an entry and value, with an id naming both (never the value's repr,
    which fails for `HUGE`)."""
    return [
        pytest.param(call, error, value, id=f"{name}-{type(value).__name__}{'-neg' if value is NEGATIVE else ''}")
        for name, call, error, values in entries
        for value in values
    ]


def refused_briefly(call: Callable[[], object], error: type[MooncakeError], *, bound: int = BOUND) -> str:
    """`call()` raises `error` with a message of at most `bound` characters that does not hold `TEXT` whole: the
    message."""
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert len(message) <= bound, message
    assert TEXT not in message
    return message
