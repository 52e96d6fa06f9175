"""Mooncake-format traces: JSON Lines, one request per line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is the arrival in milliseconds from the trace start; `hash_ids` are
the chained ids of the prompt's blocks of `block_size_tokens` (512 in the
published traces), the last partial block included, so there are exactly
ceil(input_length / block_size) of them.

Reading validates every line and names file and line on the first bad one:
invalid JSON, a missing or wrongly typed field, a non-positive length, a wrong
`hash_ids` count, a timestamp earlier than the previous line's. Fields the
format does not define are ignored. `iter_trace` streams (a bad line surfaces
when reached); `load_trace` returns nothing unless the whole file is valid.
Writing goes to a temporary file renamed into place, so a trace is either
written whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mooncake._checks import ceil_div, require_int, require_number
from mooncake.errors import InvalidRequestError, TraceFormatError
from mooncake.types import Request, RequestId

__all__ = ["TRACE_BLOCK_SIZE_TOKENS", "iter_trace", "load_trace", "write_trace"]

TRACE_BLOCK_SIZE_TOKENS = 512
"""Block size of the published Mooncake traces."""


def _field(record: dict[str, Any], name: str, *, integer: bool) -> Any:
    if name not in record:
        raise ValueError(f"missing field '{name}'")
    value = record[name]
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"field '{name}' must be {kind}, got {value!r}")
    return value


def _parse(record: Any, block_size_tokens: int) -> tuple[float, int, int, list[int]]:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    timestamp = _field(record, "timestamp", integer=False)
    if not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"field 'timestamp' must be a finite number >= 0, got {timestamp!r}")
    input_length = _field(record, "input_length", integer=True)
    output_length = _field(record, "output_length", integer=True)
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if value <= 0:
            raise ValueError(f"field '{name}' must be positive, got {value}")
    if "hash_ids" not in record:
        raise ValueError("missing field 'hash_ids'")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise ValueError("field 'hash_ids' must be a list of integers")
    if hash_ids and min(hash_ids) < 0:
        raise ValueError(f"field 'hash_ids' must hold non-negative ids, got {min(hash_ids)}")
    expected = ceil_div(input_length, block_size_tokens)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}: expected "
            f"ceil({input_length}/{block_size_tokens}) = {expected}"
        )
    return timestamp, input_length, output_length, hash_ids


def iter_trace(
    path: str | os.PathLike[str],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    speedup: float = 1.0,
) -> Iterator[Request]:
    """Stream the requests of a trace, validating each line as it is read.

    Args:
        path: the JSONL trace.
        block_size_tokens: tokens per hash id.
        speedup: replay speed; 2.0 halves every timestamp.

    Yields:
        Requests with ids "0", "1", ... in file order and ``arrival_s = timestamp / 1000 / speedup``.

    Raises:
        TraceFormatError: at the first malformed line (blank lines are skipped).
        ConfigError: for invalid options.
    """
    # Checked here, not in the generator, so that bad options fail at the call.
    block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
    speedup = require_number("speedup", speedup, minimum=0, strict=True)
    return _read(path, block_size_tokens, speedup)


def _read(path: str | os.PathLike[str], block_size_tokens: int, speedup: float) -> Iterator[Request]:
    previous = -math.inf
    index = 0
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise TraceFormatError(
                    path, number, f"not UTF-8: byte {raw[error.start]:#04x} at column {error.start + 1}"
                ) from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceFormatError(path, number, f"invalid JSON: {error.msg} at column {error.colno}") from error
            try:
                timestamp, input_length, output_length, hash_ids = _parse(record, block_size_tokens)
            except ValueError as error:
                raise TraceFormatError(path, number, str(error)) from error
            if timestamp < previous:
                raise TraceFormatError(
                    path, number, f"timestamp {timestamp} is earlier than the previous line's {previous}"
                )
            previous = timestamp
            yield Request(
                request_id=RequestId(str(index)),
                arrival_s=timestamp / 1000.0 / speedup,
                input_length=input_length,
                output_length=output_length,
                block_keys=hash_ids,
            )
            index += 1


def load_trace(
    path: str | os.PathLike[str],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    speedup: float = 1.0,
) -> list[Request]:
    """All requests of a trace, or an error and nothing (see `iter_trace`)."""
    return list(iter_trace(path, block_size_tokens=block_size_tokens, speedup=speedup))


def _record(request: Request, block_size_tokens: int) -> dict[str, Any]:
    expected = ceil_div(request.input_length, block_size_tokens)
    if len(request.block_keys) != expected:
        raise InvalidRequestError(
            f"request {request.request_id}: {len(request.block_keys)} block keys for input_length "
            f"{request.input_length}, expected {expected} at block size {block_size_tokens}"
        )
    return {
        "timestamp": round(request.arrival_s * 1000),
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.block_keys),
    }


def write_trace(
    path: str | os.PathLike[str],
    requests: Iterable[Request],
    *,
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
) -> int:
    """Write requests as a Mooncake-format trace, atomically.

    Timestamps are written as whole milliseconds. Requests must arrive in
    non-decreasing order and carry ceil(input_length / block_size) keys.

    Returns:
        The number of requests written.

    Raises:
        InvalidRequestError: a request cannot be represented; the file is left untouched.
    """
    block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
    target = Path(path)
    # A unique sibling opened with "x" (not mkstemp) so the final file gets the
    # usual umask permissions rather than 0600.
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    count = 0
    previous = -math.inf
    try:
        with open(temporary, "x", encoding="utf-8") as out:
            for request in requests:
                if request.arrival_s < previous:
                    raise InvalidRequestError(
                        f"request {request.request_id} arrives at {request.arrival_s}s, before the previous one ({previous}s)"
                    )
                previous = request.arrival_s
                out.write(json.dumps(_record(request, block_size_tokens), separators=(", ", ": ")))
                out.write("\n")
                count += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return count
