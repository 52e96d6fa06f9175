"""`mooncake._json`: JSON read from outside with its nesting bounded before it is parsed.

Properties: text nesting at most `MAX_DEPTH` levels reads exactly as `json.loads` reads it (str or bytes, brackets
inside strings included); a value nested deeper is refused with `NestingError` (a ValueError), whatever follows it
or precedes it in strings. The regression: a line nested past the interpreter's stack used to drive the reading
thread to its recursion limit, where a finalizer that the parse's allocations set off failed as an unraisable
exception (CI, `test_cli_properties`); now no finalizer fails while such a trace is read.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._json import MAX_DEPTH, NestingError, check_depth, loads
from mooncake.errors import TraceFormatError
from mooncake.workload.trace import iter_trace

# Strings full of what a depth scan could mistake for nesting: brackets, quotes, escapes.
tricky_text = st.text(alphabet='[]{}"\\ab:,\n', max_size=12)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=20,
)


def nested(depth: int, inner: Any) -> Any:
    """`inner` inside `depth` levels of lists and objects, alternating."""
    for level in range(depth):
        inner = [inner] if level % 2 else {"k": inner}
    return inner


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


@given(values, st.booleans())
def test_text_within_the_bound_reads_as_json_reads_it(value: Any, as_bytes: bool) -> None:
    text = json.dumps(value)
    assert loads(text.encode() if as_bytes else text) == json.loads(text)


@given(st.integers(0, MAX_DEPTH + 40), values, st.booleans())
def test_a_value_is_refused_exactly_when_it_nests_past_the_bound(depth: int, inner: Any, as_bytes: bool) -> None:
    value = nested(depth, inner)
    text = json.dumps(value)
    data = text.encode() if as_bytes else text
    if depth_of(value) > MAX_DEPTH:
        with pytest.raises(NestingError, match=f"nested deeper than {MAX_DEPTH} levels"):
            loads(data)
    else:
        assert loads(data) == value


@given(st.integers(MAX_DEPTH + 1, 5000), st.sampled_from(["[", "{", '{"a":']))
def test_an_unclosed_value_past_the_bound_is_refused_before_it_is_parsed(depth: int, opening: str) -> None:
    """Cut short, as a truncated write leaves it: json would recurse as deep as it goes before failing."""
    with pytest.raises(NestingError):
        loads(opening * depth)


@given(tricky_text, st.integers(MAX_DEPTH + 1, 400))
def test_the_value_at_a_position_is_judged_alone(before: str, depth: int) -> None:
    """`check_depth(text, start)` judges the one value at `start`: a string or a number there does not nest,
    whatever deep value follows it (json reads no further); a deep value there is refused."""
    scalar = json.dumps(before)
    deep = "[" * depth + "]" * depth
    text = f"{scalar}, {deep}"
    check_depth(text, 0)
    with pytest.raises(NestingError):
        check_depth(text, len(scalar) + 2)
    with pytest.raises(NestingError):
        check_depth(f"  {deep}")


def test_it_is_a_value_error_as_jsons_own_errors_are() -> None:
    with pytest.raises(ValueError):
        loads("[" * 200_000)


def few_frames(n: int = 10) -> int:
    return 0 if n == 0 else few_frames(n - 1)


@pytest.fixture
def unraisable() -> Iterator[list[BaseException]]:
    """What failed in a garbage-collector callback, the collector run at every allocation with a callback that
    takes a few frames (as a finalizer closing a file does): one it runs at the parser's depth fails when that
    depth is the interpreter's limit, as pytest's unraisable hook failed in CI."""
    failed: list[BaseException] = []

    def callback(_phase: str, _info: dict[str, int]) -> None:
        few_frames()

    hook, thresholds = sys.unraisablehook, gc.get_threshold()
    sys.unraisablehook = lambda caught: failed.append(caught.exc_value or RuntimeError())
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        yield failed
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(callback)
        sys.unraisablehook = hook


def test_reading_a_trace_nested_past_the_stack_fails_nothing_else(
    tmp_path: Path, unraisable: list[BaseException]
) -> None:
    """Before the bound, each read of this trace failed the callback some twenty times (json.loads recursed to
    the limit, and the collector ran there)."""
    path = tmp_path / "deep.jsonl"
    line = '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
    path.write_text(line + "[" * 3000 + "\n")
    for _ in range(3):
        with pytest.raises(
            TraceFormatError, match=f":2: invalid JSON: arrays or objects nested deeper than {MAX_DEPTH}"
        ):
            list(iter_trace(path))
    assert unraisable == []
