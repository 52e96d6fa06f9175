"""JSON read from outside (trace lines, a peer's calls and replies, a client's body, a saved file) with its
nesting bounded before it is parsed.

Why a bound: `json.loads` recurses once per level of arrays and objects, so text nested near the interpreter's
recursion limit (about 1,000 levels; `"[" * 3000` is 3,000 bytes) drives the reading thread to that limit. The
parse then fails with a RecursionError, which callers could catch, but so does anything else that runs at that
depth meanwhile: a finalizer or a garbage-collector callback that the parse's allocations set off fails too,
wherever its object came from, as an "unraisable" exception (a CI run saw pytest's own hook fail that way). A
text nested deeper than `MAX_DEPTH` is therefore refused before any recursion, with `NestingError`.

The check costs two `count` calls on ordinary text: a text with at most `MAX_DEPTH` opening brackets cannot nest
deeper. Only text with more is scanned, its strings skipped (a bracket inside a string is no nesting).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_DEPTH", "NestingError", "check_depth", "loads"]

# serde_json's default recursion limit; far below Python's stack, far above any trace line, request body or
# saved model (a tool's JSON schema nests a dozen levels).
MAX_DEPTH = 128

# A JSON string, escapes included (one never closed runs to the end of the text, as json reads it), or a bracket.
# Unrolled (runs of plain characters, then an escape): one step per run, not one alternation per character.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_BLANKS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


class NestingError(ValueError):
    """JSON text whose arrays and objects nest deeper than `MAX_DEPTH` levels (a ValueError, as json's own
    errors are)."""


def check_depth(text: str, start: int = 0) -> None:
    """Refuse the JSON value at `start` of `text` when its arrays and objects nest deeper than `MAX_DEPTH`.

    The depth is the running count of opening brackets less closing ones, outside strings, from the value's
    first bracket to where it is back at zero (the value's end: json reads no further) or the text ends (a value
    never closed, which json reads as deep as it goes before failing). A value that opens with no bracket (a
    string, a number; or no JSON at all) does not nest. The scan stops at the first level past `MAX_DEPTH`.

    Raises:
        NestingError: it nests deeper.
    """
    start = _BLANKS.match(text, start).end()  # type: ignore[union-attr]  # `*` matches everywhere
    if not text.startswith(("[", "{"), start):
        return
    depth = 0
    for match in _TOKEN.finditer(text, start):
        bracket = match[0]
        if bracket[0] == '"':
            continue
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_DEPTH:
            raise NestingError(f"arrays or objects nested deeper than {MAX_DEPTH} levels")
        if depth <= 0:
            return


def loads(text: str | bytes | bytearray, **options: Any) -> Any:
    """`json.loads(text, **options)`, once `check_depth` passed `text`.

    Raises:
        NestingError: `text` nests deeper than `MAX_DEPTH` (nothing of it is parsed).
        ValueError, TypeError: as `json.loads` raises them (a JSONDecodeError, an integer past Python's digit
            limit, no text at all).
    """
    if isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")  # as json.loads decodes bytes
    if isinstance(text, str) and text.count("[") + text.count("{") > MAX_DEPTH:
        check_depth(text)
    return json.loads(text, **options)
