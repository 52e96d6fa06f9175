"""Properties of the `mooncake trace` command line (mooncake/cli.py), beyond tests/test_cli.py's examples.

- A fuzzed trace (valid lines, malformed lines of every kind, blank lines; plain, gzip, or gzip cut short)
  through `stats`, `convert` and `capacity`: strict, status 2 with one line naming the *first* malformed line,
  or status 0 with exactly the valid lines' requests; with --skip-invalid, every malformed line named in order
  and the rest used. A failed run writes nothing: a target that was there is left as it was, no temporary
  sibling stays behind.
- Any value of --seed, --num-requests, --rate, --cv, --block-size, --capacity-blocks, --time-unit or --plot:
  status 2 with one line naming that argument exactly when the value is out of its documented range, else the
  command runs and writes what it says.
- `convert` Mooncake -> aiperf -> Mooncake (plain or gzip) keeps every request; `stats --json` equals
  `trace_stats` of the same requests, built here.
- `generate` is a function of its options (the same bytes twice) and writes exactly --num-requests requests.
- A conversion stopped by SIGTERM or Ctrl-C at any request leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import signal
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mooncake import cli
from mooncake.cli import PLOT_FORMATS, main
from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload import ARRIVAL_RANGE, PRESETS, TIME_UNITS, load_trace, trace_stats
from mooncake.workload.trace_record import MAX_LINE_MS, MAX_LINE_TOKENS

# (timestamp ms, input_length, output_length, hash_ids): what a Mooncake-form line says, and all a round trip keeps.
Record = tuple[int, int, int, tuple[int, ...]]

# The fields the two trace formats define (written out here, not read from the module under test): any other is
# ignored, with one caution for the first line that has one.
KNOWN_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids", "session_id", "delay", "text_input"}

# One key per block: 2**24 is the largest input, so a 2**24-token block lets a line reach it with one key.
BLOCK_SIZES = st.sampled_from([1, 3, 16, 512, MAX_LINE_TOKENS])


def run(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr); argparse's and SIGTERM's SystemExit are a status too.

    Anything else main lets out (a traceback) fails the calling test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code  # type: ignore[assignment]
    return status, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def scratch(factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh folder per Hypothesis example under pytest's temporary root, removed afterwards."""
    with tempfile.TemporaryDirectory(dir=factory.getbasetemp()) as folder:
        yield Path(folder)


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def requests_of(records: list[Record], block_size: int) -> list[Request]:
    """The requests a reader should make of `records`, built here (not read)."""
    return [
        Request(
            request_id=RequestId(str(index)),
            arrival_s=stamp / 1000.0,
            input_length=input_length,
            output_length=output_length,
            block_keys=tuple(BlockKey(key) for key in keys),
            block_size_tokens=block_size,
        )
        for index, (stamp, input_length, output_length, keys) in enumerate(records)
    ]


def reference_reuse(chains: list[tuple[int, ...]]) -> float:
    """Brute force: the share of keys whose whole prefix chain appeared in an earlier request."""
    seen: set[int] = set()
    hits = total = 0
    for keys in chains:
        prefix = 0
        while prefix < len(keys) and keys[prefix] in seen:
            prefix += 1
        hits += prefix
        total += len(keys)
        seen.update(keys)
    return hits / total if total else 0.0


def records_in(path: Path) -> list[Record]:
    """The four Mooncake fields of each line of a written trace (gzip by its name)."""
    data = path.read_bytes()
    assert (data[:2] == b"\x1f\x8b") is path.name.endswith(".gz"), "gzip exactly when the name ends in .gz"
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    return [(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"])) for r in rows]


def mooncake_line(record: Record) -> bytes:
    """The record as a Mooncake-form line, as the published traces spell it."""
    stamp, input_length, output_length, keys = record
    fields = {"timestamp": stamp, "input_length": input_length, "output_length": output_length}
    return json.dumps({**fields, "hash_ids": list(keys)}).encode()


# --------------------------------------------------------------------------- fuzzed trace files

# Whole milliseconds that do not survive ms -> s -> ms in floats exactly (1001 / 1000 * 1000 < 1001): a writer
# that truncates instead of rounding changes them.
INEXACT_MS = [stamp for stamp in range(100_000) if stamp / 1000 * 1000 != stamp]


@st.composite
def records(draw: st.DrawFn, block_size: int, earliest_ms: int) -> Record:
    """A valid line's fields, arriving no earlier than `earliest_ms`; keys from a small universe recur as prefixes."""
    later_inexact = [stamp for stamp in INEXACT_MS if stamp >= earliest_ms]
    stamp = draw(
        st.one_of(
            st.just(earliest_ms),
            st.integers(earliest_ms, min(earliest_ms + 10_000, MAX_LINE_MS)),
            st.integers(earliest_ms, MAX_LINE_MS),
            st.sampled_from(later_inexact or [earliest_ms]),
            st.just(MAX_LINE_MS),
        )
    )
    input_length = draw(st.integers(1, min(8 * block_size, MAX_LINE_TOKENS)))
    output_length = draw(st.one_of(st.integers(1, 500), st.just(MAX_LINE_TOKENS)))
    count = -(-input_length // block_size)
    # Distinct: a line that repeats a chained id is malformed (`trace_record.check_distinct_ids`).
    keys = draw(
        st.lists(st.one_of(st.integers(0, 6), st.integers(0, 2**80)), min_size=count, max_size=count, unique=True)
    )
    return stamp, input_length, output_length, tuple(keys)


@st.composite
def valid_lines(draw: st.DrawFn, record: Record) -> bytes:
    """`record` spelled as a trace may spell it: any key order and spacing, whole-number floats, unknown fields,
    `null` for an absent optional field, CRLF."""
    stamp, input_length, output_length, keys = record
    fields: dict[str, Any] = {
        "timestamp": float(stamp) if draw(st.booleans()) else stamp,
        "input_length": float(input_length) if draw(st.booleans()) else input_length,
        "output_length": output_length,
        "hash_ids": [float(k) if k < 2**53 and draw(st.booleans()) else k for k in keys],
    }
    if draw(st.booleans()):
        fields[draw(st.sampled_from(["other", "delay", "text_input", "session_id"]))] = None
    if draw(st.booleans()):
        fields["note"] = draw(st.one_of(st.text(max_size=5), st.integers(), st.lists(st.integers(), max_size=2)))
    order = draw(st.permutations(list(fields)))
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]))
    text = json.dumps({name: fields[name] for name in order}, separators=separators)
    return draw(st.sampled_from(["", " ", "\t"])).encode() + text.encode() + draw(st.sampled_from([b"", b" ", b"\r"]))


# A value in place of `"__RAW__"`: written as raw JSON text (or not JSON at all).
RAW = '"__RAW__"'
NOT_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "9" * 5000]


MALFORMED_KINDS = (
    *("cut", "not an object", "wrong type", "bool", "not JSON", "range", "missing", "count", "negative id"),
    *("bytes", "prompt", "earlier"),
)


@st.composite
def malformed_lines(draw: st.DrawFn, block_size: int, last_ms: int, kind: str | None = None) -> bytes:
    """A line no reader may take, whatever the valid lines around it (they arrive in order, the latest at
    `last_ms`): bad JSON, not an object, a wrong type (a bool too), NaN/Infinity, a time or length out of range,
    a missing or null field, a wrong key count, a negative key, an earlier arrival, bytes that are not UTF-8,
    another compression's magic, a prompt form aiperf has but the reader refuses. An earlier arrival needs
    `last_ms` > 0."""
    stamp, input_length, output_length, keys = draw(records(block_size, last_ms))
    line: dict[str, Any] = {
        "timestamp": stamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": list(keys),
    }
    raw: str | None = None
    if kind is None:
        kind = draw(st.sampled_from(MALFORMED_KINDS if last_ms > 0 else MALFORMED_KINDS[:-1]))
    if kind == "cut":
        text = json.dumps(line)
        return text[: draw(st.integers(1, len(text) - 1))].encode()
    if kind == "not an object":
        return draw(
            st.sampled_from(
                [b"[]", b"null", b"42", b'"x"', b"true", b"[" + json.dumps(line).encode() + b"]", b"[" * 3000, b"{"]
            )
        )
    if kind == "wrong type":
        field = draw(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]))
        wrong: list[Any] = ["5", [], {}]
        if field == "hash_ids":
            wrong += [5, [*keys[:-1], "a"], [*keys[:-1], 1.5], [*keys[:-1], None]]
        elif field != "timestamp":
            wrong += [1.5]
        line[field] = draw(st.sampled_from(wrong))
    elif kind == "bool":  # JSON's true is no number, though Python's True is an int: the line is otherwise valid
        field = draw(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]))
        if field == "hash_ids":
            line[field] = [*keys[:-1], True]
        elif field == "input_length":  # true would be 1 token: one key
            line.update(input_length=True, hash_ids=list(keys[:1]))
        else:
            line[field] = True if field == "output_length" or last_ms > 0 else draw(st.booleans())
    elif kind == "negative id":
        line["hash_ids"] = [*keys[:-1], draw(st.integers(max_value=-1))]
    elif kind == "not JSON":
        line[draw(st.sampled_from(["timestamp", "input_length", "output_length"]))] = "__RAW__"
        raw = draw(st.sampled_from(NOT_JSON_NUMBERS))
    elif kind == "range":
        field = draw(st.sampled_from(["timestamp", "input_length", "output_length"]))
        if field == "timestamp":
            line[field] = draw(st.one_of(st.integers(max_value=-1), st.integers(MAX_LINE_MS + 1), st.just(-0.5)))
        else:
            line[field] = draw(st.one_of(st.integers(max_value=0), st.integers(MAX_LINE_TOKENS + 1)))
        if draw(st.booleans()):
            line[field], raw = "__RAW__", "1e400"
    elif kind == "missing":
        field = draw(st.sampled_from(["input_length", "output_length"]))
        if draw(st.booleans()):
            del line[field]
        else:
            line[field] = None
    elif kind == "count":
        line["hash_ids"] = [*keys, 0] if draw(st.booleans()) else list(keys[:-1])
    elif kind == "earlier":
        line["timestamp"] = draw(st.integers(0, last_ms - 1))
    elif kind == "prompt":
        extra = draw(
            st.sampled_from(
                [{"messages": [{"role": "user", "content": "hi"}]}, {"session_id": 5}, {"text_input": "hello"}]
            )
        )
        line.update(extra)
    elif kind == "bytes":
        text = json.dumps({**line, "note": "__RAW__"}).encode()
        bad = draw(st.sampled_from([b"\xff", b"\x80", b"\xc3(", b"\xed\xa0\x80", b"\xfd7zXZ\x00"]))
        return text.replace(RAW.encode(), b'"' + bad + b'"')
    text = json.dumps(line)
    return (text.replace(RAW, raw) if raw is not None else text).encode()


def readable_lines(packed: bytes) -> int:
    """How many whole lines a gzip stream cut short holds: the newlines in all it decompresses to."""
    return zlib.decompressobj(wbits=31).decompress(packed).count(b"\n")


@attrs.frozen
class FuzzedTrace:
    data: bytes  # the file's uncompressed bytes
    block_size: int
    good: list[Record]  # the valid lines' records, in file order
    bad: list[int]  # the malformed lines' numbers, ascending
    strange: list[int]  # the valid lines with a field neither format defines, ascending

    @property
    def num_lines(self) -> int:
        return self.data.count(b"\n") + (1 if self.data and not self.data.endswith(b"\n") else 0)


@st.composite
def fuzzed_traces(draw: st.DrawFn) -> FuzzedTrace:
    """Lines that are valid, malformed or blank, each one's fate known by construction."""
    block_size = draw(BLOCK_SIZES)
    lines: list[bytes] = []
    good: list[Record] = []
    bad: list[int] = []
    strange: list[int] = []
    last_ms = 0
    for number, kind in enumerate(draw(st.lists(st.sampled_from(["good", "good", "bad", "blank"]), max_size=8)), 1):
        if kind == "good":
            record = draw(records(block_size, last_ms))
            last_ms = record[0]
            good.append(record)
            lines.append(draw(valid_lines(record)))
            if json.loads(lines[-1]).keys() - KNOWN_FIELDS:
                strange.append(number)
        elif kind == "bad":
            bad.append(number)
            lines.append(draw(malformed_lines(block_size, last_ms)))
        else:
            lines.append(draw(st.sampled_from([b"", b"  ", b"\t", b"\r"])))
    data = b"\n".join(lines) + (b"\n" if lines and draw(st.booleans()) else b"")
    return FuzzedTrace(data=data, block_size=block_size, good=good, bad=bad, strange=strange)


@attrs.frozen
class Invocation:
    argv: list[str]
    command: str
    source: Path
    target: Path | None  # convert's
    before: bytes | None  # the target's bytes before the run, when it was there
    cut: int  # bytes cut off the gzip file's end (0: whole)
    readable: int  # the whole lines before the cut (all lines when whole)
    target_is_folder: bool = False  # convert's target is a folder: refused before the trace is read

    @property
    def folder_error(self) -> str:
        return f"mooncake: error: {self.target}: Is a directory"


@st.composite
def invocations(draw: st.DrawFn, trace: FuzzedTrace, folder: Path, *, skip_invalid: bool) -> Invocation:
    """The trace written (plain, gzip or gzip cut short) and a stats, convert or capacity command line for it."""
    packing = draw(st.sampled_from(["plain", "gzip", "gzip cut short"]))
    source = folder / draw(st.sampled_from(["t.jsonl", "t.jsonl.gz", "t"]))
    data, cut, readable = trace.data, 0, trace.num_lines
    if packing != "plain":
        data = gzip.compress(data, mtime=0)
        if packing == "gzip cut short":  # into the deflate stream or only its trailer; the header stays
            cut = draw(st.integers(1, min(40, len(data) - 12)))
            data = data[:-cut]
            readable = readable_lines(data)
    source.write_bytes(data)
    command = draw(st.sampled_from(["stats", "convert", "capacity"]))
    argv = ["trace", command, str(source), "--block-size", str(trace.block_size)]
    target, before, target_is_folder = None, None, False
    if command == "stats":
        argv += ["--json"] if draw(st.booleans()) else []
    elif command == "convert":
        target = folder / draw(st.sampled_from(["out.jsonl", "out.jsonl.gz", "t.jsonl.aiperf.gz"]))
        argv.insert(3, str(target))
        argv += ["--to", draw(st.sampled_from(["mooncake", "aiperf"]))]
        state = draw(st.sampled_from(["absent", "file", "folder"]))
        if state == "file":
            before = b"the target as it was\n"
            target.write_bytes(before)
        elif state == "folder":
            target.mkdir()
            target_is_folder = True
    else:
        capacities = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
        argv += ["--capacity-blocks", ",".join(map(str, [*capacities, 10**6])), "--jobs", "1", "--json"]
        argv += ["--policy", draw(st.sampled_from(sorted(cli.POLICIES)))]
        argv += ["--prefix-aware"] if draw(st.booleans()) else []
    if skip_invalid:
        argv.append("--skip-invalid")
    return Invocation(argv, command, source, target, before, cut, readable, target_is_folder=target_is_folder)


def without_caution(err: str, call: Invocation, trace: FuzzedTrace, *, stop: float) -> str:
    """`err` without its caution about fields neither format defines, which names the first valid line before
    line `stop` (where reading ends) that has one, and comes only then."""
    prefix = f"mooncake: warning: {call.source}:"
    cautions = [text for text in err.splitlines(keepends=True) if text.startswith(prefix)]
    expected = [number for number in trace.strange if number < stop][:1]
    assert [int(text[len(prefix) :].split(":")[0]) for text in cautions] == expected, err
    assert all(": not a trace field: " in text for text in cautions), err
    return "".join(text for text in err.splitlines(keepends=True) if not text.startswith(prefix))


def check_nothing_written(folder: Path, call: Invocation) -> None:
    """A failed run leaves the folder as it found it: the source, and the target only if it was there, unchanged."""
    there = call.target is not None and (call.before is not None or call.target_is_folder)
    expected = [call.source.name] + ([call.target.name] if there else [])
    assert listing(folder) == sorted(expected), "a failed run left a file (or a temporary sibling) behind"
    if call.target is not None and call.before is not None:
        assert call.target.read_bytes() == call.before
    if call.target_is_folder:
        assert call.target is not None and listing(call.target) == []


def check_success(folder: Path, call: Invocation, trace: FuzzedTrace, out: str) -> None:
    """A run that succeeded used exactly the valid lines' requests."""
    good = trace.good
    if call.command == "stats":
        if "--json" in call.argv:
            assert json.loads(out) == attrs.asdict(trace_stats(requests_of(good, trace.block_size)))
        else:
            assert f"\nrequests             {len(good):,}\n" in out
        assert listing(folder) == [call.source.name]
    elif call.command == "convert":
        assert call.target is not None
        form = call.argv[call.argv.index("--to") + 1]
        assert out == f"wrote {len(good):,} requests from {call.source} to {call.target} ({form} form)\n"
        assert records_in(call.target) == good
        assert listing(folder) == sorted({call.source.name, call.target.name})
    else:
        result = json.loads(out)
        capacities = call.argv[call.argv.index("--capacity-blocks") + 1].split(",")
        assert list(result["hit_ratio"]) == capacities
        reuse = reference_reuse([keys for *_, keys in good])
        assert result["hit_ratio"][str(10**6)] == pytest.approx(reuse, abs=1e-6), "all blocks fit: the reuse ratio"
        assert all(0 <= ratio <= reuse + 1e-6 for ratio in result["hit_ratio"].values())
        assert listing(folder) == [call.source.name]


def error_line(err: str, source: Path) -> tuple[int, str]:
    """(line number, reason) of the last stderr line, which must be `mooncake: error: SOURCE:LINE: reason`."""
    last = err.splitlines()[-1] if err else ""
    match = re.fullmatch(rf"mooncake: error: {re.escape(str(source))}:(\d+): (.+)", last)
    assert match is not None, err
    return int(match[1]), match[2]


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(trace=fuzzed_traces(), data=st.data())
def test_a_fuzzed_trace_fails_at_its_first_malformed_line_or_yields_exactly_its_valid_lines(
    tmp_path_factory: pytest.TempPathFactory, trace: FuzzedTrace, data: st.DataObject
) -> None:
    """Strict: a trace with a malformed line is status 2, nothing on stdout, one stderr line
    `mooncake: error: FILE:LINE: reason` naming the first malformed line, and nothing written (a target that
    was there unchanged, no temporary sibling); a gzip file cut short fails the same way, at the line after
    the last whole one it holds (`broken gzip stream`) or an earlier malformed one. A trace of valid and blank lines succeeds with exactly the
    valid lines: `stats --json` is `trace_stats` of them, `convert` writes them, `capacity` at a capacity
    everything fits in is their reuse ratio."""
    with scratch(tmp_path_factory) as folder:
        call = data.draw(invocations(trace, folder, skip_invalid=False), label="call")
        status, out, err = run(call.argv)
        if call.target_is_folder:  # refused before the trace is read
            assert (status, out, err) == (2, "", call.folder_error + "\n")
            check_nothing_written(folder, call)
            return
        bad_read = [number for number in trace.bad if number <= call.readable]
        err = without_caution(err, call, trace, stop=min(bad_read, default=call.readable + 1))
        if not trace.bad and not call.cut:
            assert (status, err) == (0, ""), err
            check_success(folder, call, trace, out)
            return
        assert (status, out) == (2, "")
        assert err.endswith("\n") and len(err.splitlines()) == 1, err
        line, reason = error_line(err, call.source)
        if bad_read:
            assert line == bad_read[0] and not reason.startswith("broken gzip stream"), err
        else:  # only a gzip file cut short: the lines before the cut are read as they were
            assert call.cut and line == call.readable + 1 and reason.startswith("broken gzip stream: "), err
        check_nothing_written(folder, call)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(trace=fuzzed_traces(), data=st.data())
def test_skip_invalid_names_each_malformed_line_and_uses_the_rest(
    tmp_path_factory: pytest.TempPathFactory, trace: FuzzedTrace, data: st.DataObject
) -> None:
    """--skip-invalid: the run succeeds unless the file itself is broken (a gzip stream cut short); stderr is
    one `mooncake: skipped FILE:LINE: reason` line per malformed line, in order, and the output is exactly
    the valid lines'. A gzip file cut short names the malformed lines among its whole ones, then fails with
    one `FILE:LINE: broken gzip stream` line for the line after them, writing nothing."""
    with scratch(tmp_path_factory) as folder:
        call = data.draw(invocations(trace, folder, skip_invalid=True), label="call")
        status, out, err = run(call.argv)
        if call.target_is_folder:  # refused before the trace is read
            assert (status, out, err) == (2, "", call.folder_error + "\n")
            check_nothing_written(folder, call)
            return
        err = without_caution(err, call, trace, stop=call.readable + 1)
        lines = err.splitlines()
        assert err == "" or err.endswith("\n")
        prefix = f"mooncake: skipped {call.source}:"
        skipped = [int(text[len(prefix) :].split(":")[0]) for text in lines if text.startswith(prefix)]
        if not call.cut:
            assert status == 0, err
            assert skipped == trace.bad and len(lines) == len(trace.bad), err
            check_success(folder, call, trace, out)
            return
        assert (status, out) == (2, "")
        line, reason = error_line(err, call.source)
        assert line == call.readable + 1 and reason.startswith("broken gzip stream: "), err
        assert skipped == [number for number in trace.bad if number <= call.readable], err
        assert len(lines) == len(skipped) + 1, err
        check_nothing_written(folder, call)


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_kind_of_malformed_line_is_named_where_it_is(
    tmp_path_factory: pytest.TempPathFactory, kind: str, data: st.DataObject
) -> None:
    """Each kind of malformed line (drawn for sure, not by chance as above) between valid lines: strict, the one
    error names it by file and line; with --skip-invalid, it is the one line skipped and the statistics are the
    valid lines'."""
    block_size = data.draw(BLOCK_SIZES, label="block_size")
    before: list[Record] = []
    for _ in range(data.draw(st.integers(1 if kind == "earlier" else 0, 3), label="before")):
        before.append(data.draw(records(block_size, before[-1][0] if before else 0)))
    last_ms = before[-1][0] if before else 0
    assume(kind != "earlier" or last_ms > 0)
    bad = data.draw(malformed_lines(block_size, last_ms, kind), label="bad line")
    after: list[Record] = []
    for _ in range(data.draw(st.integers(0, 3), label="after")):
        after.append(data.draw(records(block_size, after[-1][0] if after else last_ms)))
    with scratch(tmp_path_factory) as folder:
        path = folder / "t.jsonl"
        path.write_bytes(
            b"".join(line + b"\n" for line in [*map(mooncake_line, before), bad, *map(mooncake_line, after)])
        )
        argv = ["trace", "stats", str(path), "--json", "--block-size", str(block_size)]
        status, out, err = run(argv)
        assert (status, out) == (2, "") and err.startswith(f"mooncake: error: {path}:{len(before) + 1}: "), err
        assert len(err.splitlines()) == 1, err
        status, out, err = run([*argv, "--skip-invalid"])
        assert status == 0 and err.startswith(f"mooncake: skipped {path}:{len(before) + 1}: "), err
        assert len(err.splitlines()) == 1, err
        assert json.loads(out) == attrs.asdict(trace_stats(requests_of(before + after, block_size)))


# --------------------------------------------------------------------------- fuzzed option values


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _in_range(text: str) -> bool:
    value = _as_float(text)
    return value is not None and ARRIVAL_RANGE[0] <= value <= ARRIVAL_RANGE[1]


def _capacities(text: str) -> bool:
    values = [_as_int(part) for part in text.split(",")]
    # each once: the JSON is keyed by capacity ("1" and "+1" are one)
    return all(value is not None and value >= 1 for value in values) and len(set(values)) == len(values)


def _image(text: str) -> bool:
    return "\0" not in text and text not in ("", ".", "..") and Path(text).suffix.lower()[1:] in PLOT_FORMATS


# What each option accepts, as its help and the module docstring say: (command, accepted?).
OPTIONS: dict[str, tuple[str, Any]] = {
    "--seed": ("generate", lambda text: (value := _as_int(text)) is not None and value >= 0),
    "--num-requests": ("generate", lambda text: (value := _as_int(text)) is not None and value >= 0),
    "--block-size": ("generate", lambda text: (value := _as_int(text)) is not None and value >= 1),
    "--rate": ("generate", _in_range),
    "--cv": ("generate", _in_range),
    "--capacity-blocks": ("capacity", _capacities),
    "--time-unit": ("stats", lambda text: text in TIME_UNITS),
    "--plot": ("capacity", _image),
}

# Text as a command line can hold it: bytes decoded as Python decodes argv (undecodable ones as surrogates).
ARGV_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=8),
    st.binary(max_size=8).map(os.fsdecode),
)
NUMBERS = st.one_of(
    st.integers(-5, 50).map(str),
    st.integers().map(str),
    st.floats().map(repr),
    st.floats(1e-7, 2e6).map(repr),
    st.sampled_from(["-0", "nan", "-inf", "1e400", "1_0", " 7 ", "+3", "\u0663", "0x10", "", "1" * 5000, "--json"]),
    ARGV_TEXT,
)
# Each range's edges, on either side (half the draws).
INTEGER_EDGES = st.sampled_from(["-1", "0", "1", "2", "+0", " 1", "1.0", "1e3", "0b1"])
RANGE_EDGES = st.sampled_from(
    ["1e-6", "0.000001", "1e6", "1000000", "9.999999999999999e-07", "1000000.0000000001", "0", "1e-7", "inf"]
)
VALUES = {
    "--seed": st.one_of(INTEGER_EDGES, NUMBERS),
    "--num-requests": st.one_of(INTEGER_EDGES, NUMBERS),
    "--block-size": st.one_of(INTEGER_EDGES, NUMBERS),
    "--rate": st.one_of(RANGE_EDGES, NUMBERS),
    "--cv": st.one_of(RANGE_EDGES, NUMBERS),
    "--capacity-blocks": st.one_of(
        st.lists(st.one_of(INTEGER_EDGES, NUMBERS), min_size=1, max_size=3).map(",".join), NUMBERS
    ),
    "--time-unit": st.one_of(st.sampled_from([*TIME_UNITS, "MS", "sec", "", "m s"]), ARGV_TEXT),
    "--plot": st.tuples(
        st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/"), max_size=6),
        st.one_of(
            st.sampled_from(PLOT_FORMATS).map(lambda suffix: f".{suffix}"),
            st.sampled_from(["", ".", ".jsonl", ".png ", ".gif", ".bmp", ".png.gz", ".svg.jsonl"]),
        ),
        st.sampled_from([str, str.upper, str.title]),
    ).map(lambda parts: parts[0] + parts[2](parts[1])),
}


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(option=st.sampled_from(sorted(OPTIONS)), data=st.data())
def test_an_option_value_is_refused_in_one_line_exactly_when_out_of_its_range(
    tmp_path_factory: pytest.TempPathFactory, option: str, data: st.DataObject
) -> None:
    """Any value for one option (given as `--option=value`, so argparse takes it whole): out of its documented
    range, status 2, nothing on stdout, one stderr line `mooncake trace CMD: error: argument OPTION: ...`, and
    nothing written; in range, status 0 and the command's output (a generated trace of --num-requests requests,
    the capacities asked for, the plot) -- never a traceback."""
    command, accepts = OPTIONS[option]
    value = data.draw(VALUES[option], label="value")
    accepted = accepts(value)
    if option == "--num-requests" and accepted:
        assume(int(value) <= 40)  # any count is fine; a large one only takes longer
    with scratch(tmp_path_factory) as folder:
        trace = folder / "t.jsonl"
        trace.write_text(
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n'
            '{"timestamp": 1, "input_length": 9, "output_length": 2, "hash_ids": [1, 2, 3]}\n'
        )
        out_path = folder / "g.jsonl"
        given_value = f"{folder}/{value}" if option == "--plot" else value
        argv = {
            "generate": ["trace", "generate", "--num-requests", "3", "--out", str(out_path)],
            "capacity": ["trace", "capacity", str(trace), "--jobs", "1", "--json", "--block-size", "4"],
            "stats": ["trace", "stats", str(trace), "--json", "--block-size", "4"],
        }[command] + [f"{option}={given_value}"]
        status, out, err = run(argv)
        if not accepted:
            assert (status, out) == (2, ""), (status, out, err)
            assert err.startswith(f"mooncake trace {command}: error: argument {option}: "), err
            assert err.endswith("\n") and len(err.splitlines()) == 1, err
            assert listing(folder) == ["t.jsonl"]
            return
        assert (status, err) == (0, ""), (status, err)
        if command == "generate":
            count = int(value) if option == "--num-requests" else 3
            block_size = int(value) if option == "--block-size" else 512
            assert out.startswith(f"wrote {count:,} requests (")
            assert len(load_trace(out_path, block_size_tokens=block_size)) == count
            assert listing(folder) == ["g.jsonl", "t.jsonl"]
        elif command == "capacity":
            capacities = (
                [int(part) for part in value.split(",")] if option == "--capacity-blocks" else [1000, 10000, 50000]
            )
            assert list(json.loads(out)["hit_ratio"]) == list(map(str, capacities))
            if option == "--plot":
                assert listing(folder) == sorted({"t.jsonl", Path(given_value).name})
                assert Path(given_value).stat().st_size > 0
        else:  # the two arrivals are 1 unit apart
            stats = json.loads(out)
            assert stats["num_requests"] == 2
            assert stats["duration_s"] == pytest.approx(TIME_UNITS[value] / 1000)


# --------------------------------------------------------------------------- round trips and generation


@st.composite
def valid_traces(draw: st.DrawFn) -> tuple[list[Record], int]:
    """Valid records in arrival order and their block size."""
    block_size = draw(BLOCK_SIZES)
    out: list[Record] = []
    for _ in range(draw(st.integers(0, 8))):
        out.append(draw(records(block_size, out[-1][0] if out else 0)))
    return out, block_size


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=valid_traces(),
    generated=st.none() | st.tuples(st.sampled_from(sorted(PRESETS)), st.integers(0, 2**64), st.integers(0, 6)),
    names=st.tuples(st.sampled_from(["a.jsonl", "a.jsonl.gz"]), st.sampled_from(["b.jsonl", "b.jsonl.gz"])),
)
def test_convert_to_aiperf_and_back_keeps_every_request_and_stats_agree(
    tmp_path_factory: pytest.TempPathFactory,
    trace: tuple[list[Record], int],
    generated: tuple[str, int, int] | None,
    names: tuple[str, str],
) -> None:
    """A valid trace (written here, or by `trace generate`) converted to aiperf's form and back to Mooncake's,
    each plain or gzip: every file holds the same (timestamp, input_length, output_length, hash_ids) per
    request, in order; `stats --json` of each equals `trace_stats` of those requests, built here, and its
    prefix reuse ratio a brute-force count."""
    records, block_size = trace
    with scratch(tmp_path_factory) as folder:
        source = folder / "source.jsonl"
        if generated is None:
            source.write_bytes(b"".join(mooncake_line(record) + b"\n" for record in records))
        else:
            name, seed, count = generated
            block_size = 512
            argv = ["trace", "generate", "--preset", name, "--seed", str(seed), "--num-requests", str(count)]
            assert run([*argv, "--out", str(source)])[0] == 0
            records = records_in(source)
            assert len(records) == count
        aiperf, back = folder / names[0], folder / names[1]
        for form, start, end in (("aiperf", source, aiperf), ("mooncake", aiperf, back)):
            status, out, err = run(
                ["trace", "convert", str(start), str(end), "--to", form, "--block-size", str(block_size)]
            )
            assert (status, err) == (0, ""), err
            assert out == f"wrote {len(records):,} requests from {start} to {end} ({form} form)\n"
        assert records_in(aiperf) == records_in(back) == records
        expected = attrs.asdict(trace_stats(requests_of(records, block_size)))
        assert expected["prefix_reuse_ratio"] == pytest.approx(reference_reuse([keys for *_, keys in records]))
        for path in (source, aiperf, back):
            status, out, err = run(["trace", "stats", str(path), "--json", "--block-size", str(block_size)])
            assert (status, err) == (0, ""), err
            assert json.loads(out) == expected


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    seed=st.one_of(st.integers(0, 2**32), st.integers(0, 10**60)),
    count=st.integers(0, 25),
    rate=st.floats(*ARRIVAL_RANGE),
    cv=st.floats(0.1, 10),
    block_size=st.sampled_from([16, 64, 512, 4096]),
    name=st.sampled_from(["g.jsonl", "g.jsonl.gz"]),
)
def test_generate_is_a_function_of_its_options_and_writes_num_requests(
    tmp_path_factory: pytest.TempPathFactory,
    preset: str,
    seed: int,
    count: int,
    rate: float,
    cv: float,
    block_size: int,
    name: str,
) -> None:
    """`trace generate` twice with the same options writes the same bytes (gzip too), says what it wrote, and
    the trace holds exactly --num-requests requests keyed in --block-size blocks, in arrival order."""
    with scratch(tmp_path_factory) as folder:
        outputs = [folder / "one" / name, folder / "two" / name]
        for path in outputs:
            path.parent.mkdir()
            argv = ["trace", "generate", "--preset", preset, "--seed", str(seed), "--num-requests", str(count)]
            argv += ["--rate", repr(rate), "--cv", repr(cv), "--block-size", str(block_size), "--out", str(path)]
            status, out, err = run(argv)
            assert (status, err) == (0, ""), err
            assert out == f"wrote {count:,} requests ({preset}, seed {seed}) to {path}\n"
        assert outputs[0].read_bytes() == outputs[1].read_bytes()
        requests = load_trace(outputs[0], block_size_tokens=block_size)
        assert len(requests) == count == len(records_in(outputs[0]))
        assert all(math.ceil(r.input_length / block_size) == len(r.block_keys) for r in requests)


# --------------------------------------------------------------------------- stopped in the middle


@pytest.mark.usefixtures("sigterm_fails_the_test")
@settings(
    max_examples=30, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)  # the fixture only installs a SIGTERM handler that fails the test: the same for every example
@given(
    trace=valid_traces(),
    stop=st.integers(0, 8),
    how=st.sampled_from(["SIGTERM", "Ctrl-C"]),
    name=st.sampled_from(["out.jsonl", "out.jsonl.gz"]),
    existed=st.booleans(),
)
def test_a_conversion_stopped_at_any_request_leaves_the_target_as_it_was(
    tmp_path_factory: pytest.TempPathFactory,
    trace: tuple[list[Record], int],
    stop: int,
    how: str,
    name: str,
    existed: bool,
) -> None:
    """SIGTERM (status 143, nothing on stderr) or Ctrl-C (status 130, `mooncake: interrupted`) arriving while
    `convert` reads its k-th request, or once all are read: the target is as it was before (absent, or its old
    bytes), no temporary sibling is left, and the SIGTERM handler before the run is back."""
    records, block_size = trace
    stop = min(stop, len(records))
    handler = signal.getsignal(signal.SIGTERM)
    real = cli.iter_trace

    def stopping(*args: Any, **kwargs: Any) -> Iterator[Request]:
        def stop_here() -> None:
            if how == "SIGTERM":
                signal.raise_signal(signal.SIGTERM)
            else:
                raise KeyboardInterrupt

        for index, request in enumerate(real(*args, **kwargs)):
            if index == stop:
                stop_here()
            yield request
        stop_here()  # stop == len(records): after the last request, before the file is complete

    with scratch(tmp_path_factory) as folder:
        source, target = folder / "source.jsonl", folder / name
        source.write_bytes(b"".join(mooncake_line(record) + b"\n" for record in records))
        if existed:
            target.write_bytes(b"old\n")
        with mock.patch.object(cli, "iter_trace", stopping):
            status, out, err = run(["trace", "convert", str(source), str(target), "--block-size", str(block_size)])
        assert (status, out, err) == ((143, "", "") if how == "SIGTERM" else (130, "", "mooncake: interrupted\n"))
        assert listing(folder) == sorted(["source.jsonl"] + ([name] if existed else []))
        if existed:
            assert target.read_bytes() == b"old\n"
    assert signal.getsignal(signal.SIGTERM) is handler


# --------------------------------------------------------------------------- defects (xfail until fixed)


GOOD = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("situation", ["stats error", "capacity error", "convert error", "skipped line", "plot folder"])
def test_an_error_about_a_file_named_with_a_line_break_is_one_line(tmp_path: Path, situation: str) -> None:
    """Whatever a file is called (a line feed, a carriage return, U+2028 in its name), an error is one line on
    stderr, a skipped line too, as for every other error."""
    for newline in ("\n", "\r", "\u2028"):
        source = tmp_path / f"bad{newline}name.jsonl"
        source.write_text(f"{GOOD}\n{{oops\n", encoding="utf-8")
        argv = {
            "stats error": ["trace", "stats", str(source), "--block-size", "4"],
            "capacity error": ["trace", "capacity", str(source), "--block-size", "4", "--jobs", "1"],
            "convert error": ["trace", "convert", str(source), str(tmp_path / "o.jsonl"), "--block-size", "4"],
            "skipped line": ["trace", "stats", str(source), "--block-size", "4", "--skip-invalid", "--json"],
            "plot folder": ["trace", "capacity", str(source), "--plot", str(tmp_path / f"no{newline}dir" / "p.png")],
        }[situation]
        status, _, err = run(argv)
        assert status == (0 if situation == "skipped line" else 2)
        assert len(err.splitlines()) == 1, (newline, err)
