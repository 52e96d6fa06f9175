"""A sorted read (`sort=True`, `--sort`) of a trace slightly out of order, and the wording of a cut-off line's error.

Logs merged with jitter put a few lines a little before the one above them. The reader refused such a trace
(strict), left each such line out (lenient: 220 of 3,993 lines of a jittered synthetic trace), and `trace convert`
could not even write a sorted copy. `sort=True` reads the whole file and stable-sorts its lines by timestamp
before placing them (as SGLang's Mooncake loader sorts), naming each line by its place in the file; it refuses a
trace with sessions, whose line order decides its turns, and a line without a timestamp, whose place decides its
arrival. The strict error at a line out of order says that a sorted read takes it.

A line cut off inside a string read "Unterminated string starting at at column 18": json's message ends in "at".
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError, TraceFormatError
from mooncake.types import Request
from mooncake.workload import SkippedLine, iter_trace, load_trace, write_trace
from tests.workload.test_trace import chained_requests

BLOCK = 4
HINT = "sort=True / --sort"


def record(timestamp: int | None, key: int = 1, **fields: Any) -> dict[str, Any]:
    """A line of 5 tokens whose first block id is `key` (to tell lines apart); `timestamp` None leaves it out."""
    line = {"timestamp": timestamp, "input_length": 5, "output_length": 3, "hash_ids": [key, 1000 + key], **fields}
    return {name: value for name, value in line.items() if value is not None}


def write(path: Path, lines: list[Any]) -> Path:
    """One line per item: a dict as JSON, a str as it is."""
    path.write_text("".join((text if isinstance(text, str) else json.dumps(text)) + "\n" for text in lines))
    return path


def jittered(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` lines 100 ms apart, each timestamp moved by up to ±150 ms: out of order here and there."""
    generator = random.Random(seed)
    return [record(max(0, 100 * index + generator.randint(-150, 150)), key=index) for index in range(count)]


def shape(workload: list[Request]) -> list[tuple[str, float, tuple[int, ...]]]:
    return [(r.request_id, r.arrival_s, r.block_keys) for r in workload]


# --------------------------------------------------------------------------- sorted reads


def test_a_jittered_trace_reads_sorted_whole_and_in_order(tmp_path: Path) -> None:
    """A jittered trace is refused strict and loses lines lenient; sorted, every line is a request, in timestamp
    order (file order among equal ones), the requests of the file written sorted."""
    lines = jittered(200, seed=1)
    path = write(tmp_path / "jittered.jsonl", lines)
    with pytest.raises(TraceFormatError):
        load_trace(path, block_size_tokens=BLOCK)
    skipped: list[SkippedLine] = []
    assert len(load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)) < 200
    assert skipped  # the defect: lenient reading dropped them
    workload = load_trace(path, block_size_tokens=BLOCK, sort=True)
    ordered = sorted(lines, key=lambda line: line["timestamp"])  # stable
    assert shape(workload) == shape(load_trace(write(tmp_path / "sorted.jsonl", ordered), block_size_tokens=BLOCK))
    assert [r.block_keys[0] for r in workload] == [line["hash_ids"][0] for line in ordered]
    assert [r.request_id for r in workload] == [str(index) for index in range(200)]
    streamed = list(iter_trace(path, block_size_tokens=BLOCK, sort=True, strict=False, on_skip=skipped.append))
    assert shape(streamed) == shape(workload)


def test_equal_timestamps_keep_their_file_order_when_sorted(tmp_path: Path) -> None:
    """The sort is stable: lines of one timestamp come out as the file has them, wherever they were."""
    path = write(tmp_path / "t.jsonl", [record(50, key=1), record(10, key=2), record(50, key=3), record(10, key=4)])
    workload = load_trace(path, block_size_tokens=BLOCK, sort=True)
    assert [r.block_keys[0] for r in workload] == [2, 4, 1, 3]
    assert [r.arrival_s for r in workload] == [0.01, 0.01, 0.05, 0.05]


@pytest.mark.parametrize(
    ("lines", "line", "reason"),
    [
        ([record(5), record(1, session_id="a"), record(2, session_id="a")], 2, "names session 'a'"),
        ([record(0), record(3), {"session_id": "s", "input_length": 5, "output_length": 1}], 3, "names session 's'"),
        ([record(0), record(None, delay=5)], 2, "has no timestamp"),
    ],
    ids=["session turns", "session without timestamp", "delay"],
)
@pytest.mark.parametrize("strict", [True, False])
def test_a_sorted_read_refuses_lines_whose_place_decides_them(
    tmp_path: Path, lines: list[Any], line: int, reason: str, strict: bool
) -> None:
    """A line that names a session (the order of a trace's lines decides its turns) or has no timestamp (its
    place decides its arrival) is a TraceFormatError naming it, strict or lenient; read unsorted, the same
    trace reads (when in order)."""
    path = write(tmp_path / "t.jsonl", lines)
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK, sort=True, strict=strict, on_skip=lambda _: None)
    assert caught.value.line == line and reason in caught.value.reason
    if reason == "has no timestamp":
        assert "sort=True / --sort" in caught.value.reason
    else:
        assert "a trace with sessions cannot be read sorted (sort=True / --sort)" in caught.value.reason


@pytest.mark.parametrize(
    "bad",
    [
        '{"session_id": "s", "input_length": 5, "output_length": 0}',  # a record, invalid
        '{"timestamp": 3, "session_id": "s", "input_le',  # no JSON, its session read from its text
        '{"timestamp": 3, "session_id": "s',  # no JSON, its session cut short
    ],
)
def test_a_lenient_sorted_read_refuses_a_skipped_line_of_a_session(tmp_path: Path, bad: str) -> None:
    """A line left out lenient that still shows a session_id tells of a trace with sessions: refused, named."""
    path = write(tmp_path / "t.jsonl", [record(5), record(1), bad, record(2)])
    with pytest.raises(TraceFormatError, match="a trace with sessions cannot be read sorted") as caught:
        load_trace(path, block_size_tokens=BLOCK, sort=True, strict=False, on_skip=lambda _: None)
    assert caught.value.line == 3


def test_a_sorted_read_names_lines_by_their_place_in_the_file(tmp_path: Path) -> None:
    """Strict, lenient, a speedup past the bound and a caution: each names the line where the file has it."""
    path = write(tmp_path / "t.jsonl", [record(300), record(100), "{oops", record(200, key=7, extra=1)])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK, sort=True)
    assert (caught.value.line, caught.value.reason.startswith("invalid JSON")) == (3, True)
    skipped: list[SkippedLine] = []
    cautions: list[str] = []
    workload = load_trace(
        path, block_size_tokens=BLOCK, sort=True, strict=False, on_skip=skipped.append, on_caution=cautions.append
    )
    assert [r.arrival_s for r in workload] == [0.1, 0.2, 0.3]
    assert [s.line for s in skipped] == [3]
    assert len(cautions) == 1 and cautions[0].startswith(f"{path}:4: not a trace field: 'extra'")
    # Sorted, line 2 (100 ms) is the first arrival past 0; at this speedup it is past the bound.
    with pytest.raises(TraceFormatError, match="arrival 100 ms at speedup") as caught:
        load_trace(path, block_size_tokens=BLOCK, sort=True, strict=False, on_skip=skipped.append, speedup=1e-100)
    assert caught.value.line == 2


def test_sort_must_be_a_bool(tmp_path: Path) -> None:
    """An option that is no bool is a ConfigError at the call, as `strict` is."""
    path = write(tmp_path / "t.jsonl", [record(0)])
    with pytest.raises(ConfigError, match="sort must be a bool, got 'yes'"):
        iter_trace(path, sort="yes")  # type: ignore[arg-type]


def test_the_out_of_order_error_says_a_sorted_read_takes_the_trace(tmp_path: Path) -> None:
    """Strict, the error at a line earlier than the one above says to read it sorted, and so does each line a
    lenient read leaves out for it; in a trace with sessions, where sorting is refused, it does not."""
    path = write(tmp_path / "t.jsonl", [record(0), record(100), record(99), record(200)])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert caught.value.line == 3
    assert caught.value.reason == (
        "timestamp 99 is earlier than the previous line's 100 (is the trace unsorted? sort=True / --sort reads it "
        "sorted by timestamp)"
    )
    skipped: list[SkippedLine] = []
    load_trace(path, block_size_tokens=BLOCK, strict=False, on_skip=skipped.append)
    assert [s.line for s in skipped] == [3] and HINT in skipped[0].reason
    sessions = write(tmp_path / "s.jsonl", [record(0, session_id="a"), record(100), record(99)])
    with pytest.raises(TraceFormatError, match="earlier than") as caught:
        load_trace(sessions, block_size_tokens=BLOCK)
    assert HINT not in caught.value.reason


@given(workload=chained_requests, order=st.randoms(use_true_random=False))
def test_a_sorted_read_of_any_permutation_is_the_sorted_file(
    tmp_path_factory: pytest.TempPathFactory, workload: list[Request], order: random.Random
) -> None:
    """Any permutation of the lines of a valid trace without sessions, read sorted, gives the requests of the
    file of those lines stable-sorted by timestamp (a strict read of a file in order); the same requests as the
    original trace, up to the order of equal arrivals."""
    folder = tmp_path_factory.mktemp("sort")
    original = folder / "original.jsonl"
    write_trace(original, workload, block_size_tokens=BLOCK)
    lines = original.read_text().splitlines()
    order.shuffle(lines)
    shuffled = write(folder / "shuffled.jsonl", lines)
    ordered = write(folder / "ordered.jsonl", sorted(lines, key=lambda line: json.loads(line)["timestamp"]))
    workload_sorted = load_trace(shuffled, block_size_tokens=BLOCK, sort=True)
    assert workload_sorted == load_trace(ordered, block_size_tokens=BLOCK)

    def content(requests: list[Request]) -> list[tuple[float, int, int, tuple[int, ...]]]:
        return sorted((r.arrival_s, r.input_length, r.output_length, r.block_keys) for r in requests)

    assert content(workload_sorted) == content(load_trace(original, block_size_tokens=BLOCK))


# --------------------------------------------------------------------------- a cut-off line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"timestamp": 0, "x": "abc', "invalid JSON: Unterminated string starting at column 23"),
        ('{"timestamp": 0, "x": "a\tb"}', "invalid JSON: Invalid control character at column 25"),
    ],
)
def test_a_cut_off_line_is_reported_in_plain_words(tmp_path: Path, text: str, message: str) -> None:
    """json's messages that end in "at" are followed by the column once: not "starting at at column 18"."""
    path = write(tmp_path / "t.jsonl", [record(0), text])
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, block_size_tokens=BLOCK)
    assert caught.value.line == 2 and caught.value.reason == message
    assert " at at " not in str(caught.value)
