"""Edges of trace assembly, statistics, record parsing, the capacity replay, cache events, `build_conductor` and
`mooncake trace ...` that the other tests of these modules leave open, each found by a mutant they let live.

Made-up keys are checked against the docstring's formula written out here with xxhash; statistics against their
definitions; the capacity replay against a cache that can refuse to evict, and the command line's capacity sweep
against the reference policies of `tests.reference.policy`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncake.cache.capacity import simulate_prefix_hits
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake.cache.policy import LruPolicy
from mooncake.cli import main
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.build import build_conductor
from mooncake.sched.cost import HARDWARE, MODELS
from mooncake.sched.step import DecodeCostModel
from mooncake.types import BlockKey, InstanceId, Request, RequestId, Tier
from mooncake.workload import trace_stats
from mooncake.workload.assembly import TraceAssembler, made_up_keys
from mooncake.workload.trace_record import parse_record
from tests.reference.policy import ReferencePolicy, reference_prefix_hits
from tests.strategies import chained_workloads


def formula_keys(label: str, parent: int | None, count: int, first_index: int) -> tuple[int, ...]:
    """The docstring's made-up rule: key_i = XXH3-64(label ":" key_{i-1} ":" i), key_{-1} = "" (decimal)."""
    keys: list[int] = []
    previous = "" if parent is None else str(parent)
    for index in range(first_index, first_index + count):
        keys.append(xxhash.xxh3_64_intdigest(f"{label}:{previous}:{index}".encode()))
        previous = str(keys[-1])
    return tuple(keys)


def run_cli(*argv: str) -> tuple[int, str, str]:
    """main(argv) with stdout and stderr captured: (status, stdout, stderr); argparse's exit is a status too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exit:
            status = exit.code  # type: ignore[assignment]
    return status, out.getvalue(), err.getvalue()


def write_keyed_trace(path: Path, chains: Sequence[Sequence[int]]) -> None:
    """One Mooncake line per chain in 1-token blocks, a millisecond apart."""
    lines = [
        json.dumps({"timestamp": i, "input_length": len(keys), "output_length": 1, "hash_ids": list(keys)})
        for i, keys in enumerate(chains)
    ]
    path.write_text("".join(line + "\n" for line in lines))


# --------------------------------------------------------------------------- assembly


@st.composite
def sessions_of_made_up_turns(draw: st.DrawFn) -> tuple[int, list[dict[str, Any]]]:
    """A block size and lines of a few sessions (ids that look like labels too), no times, prompts by length."""
    block = draw(st.integers(1, 6))
    ids = st.none() | st.sampled_from(["a", "b", 'a" turn 2', "line 1"])
    lines = []
    for _ in range(draw(st.integers(1, 10))):
        fields: dict[str, Any] = {"input_length": draw(st.integers(1, 3 * block + 2))}
        fields["output_length"] = draw(st.integers(1, 2 * block + 1))
        session = draw(ids)
        if session is not None:
            fields["session_id"] = session
        lines.append(fields)
    return block, lines


@settings(max_examples=80)
@given(trace=sessions_of_made_up_turns())
def test_made_up_keys_are_the_documented_chain(trace: tuple[int, list[dict[str, Any]]]) -> None:
    """Keys made up for a line follow key_i = H(label:key_{i-1}:i) with key_{-1} = "": a start's from "" with the
    label naming its line, a later turn's from the previous prompt's last full-block key, numbered on from it, with
    the label naming the session turn (`session <id as JSON> turn <n>`): a trace converted today keys its blocks as
    one converted by any other release of the rule does."""
    block, lines = trace
    assembler = TraceAssembler(block)
    previous: dict[str, tuple[int, int, tuple[int, ...], int]] = {}  # session → input, output, keys, turns
    for number, fields in enumerate(lines, start=1):
        turn = assembler.place(parse_record(fields, block), number)
        session = fields.get("session_id")
        if session is None or session not in previous:
            expected = formula_keys(f"line {number}", None, -(-fields["input_length"] // block), 0)
            turns = 1
        else:
            before_input, before_output, before_keys, turns = previous[session]
            turns += 1
            length = before_input + before_output + fields["input_length"]
            shared = before_input // block
            parent = before_keys[shared - 1] if shared else None
            label = f"session {json.dumps(session)} turn {turns}"
            expected = before_keys[:shared] + formula_keys(label, parent, -(-length // block) - shared, shared)
        assert turn.block_keys == expected, (number, fields)
        if session is not None:
            previous[session] = (turn.input_length, turn.output_length, turn.block_keys, turns)
    assembler.check_invariants()


@given(
    label=st.text(max_size=8),
    parent=st.none() | st.integers(0, 2**64 - 1),
    count=st.integers(0, 5),
    first_index=st.integers(0, 5),
)
def test_made_up_keys_function_is_the_formula(label: str, parent: int | None, count: int, first_index: int) -> None:
    """`made_up_keys` is the docstring's rule exactly, parent None meaning key_{-1} = "" (not "None")."""
    assert made_up_keys(label, None if parent is None else BlockKey(parent), count, first_index=first_index) == (
        formula_keys(label, parent, count, first_index)
    )


def test_a_session_lost_twice_names_the_first_skipped_line() -> None:
    """Two of a session's lines skipped: its next turn is refused naming the first of them, where it broke."""
    assembler = TraceAssembler(4)
    assembler.place(parse_record({"session_id": "a", "input_length": 4, "output_length": 1}, 4), 1)
    assembler.lose("a", 2)
    assembler.lose("a", 5)
    with pytest.raises(ValueError, match=r"session 'a' lost its turn on line 2, which was skipped"):
        assembler.place(parse_record({"session_id": "a", "input_length": 4, "output_length": 1}, 4), 6)
    assembler.check_invariants()


# --------------------------------------------------------------------------- statistics


@given(arrivals_ms=st.lists(st.integers(0, 10**8), min_size=1, max_size=20))
@example(arrivals_ms=[1, 42743])
def test_the_duration_of_millisecond_arrivals_is_exact(arrivals_ms: list[int]) -> None:
    """Arrivals read from milliseconds (ms / 1000 s): the duration is the milliseconds' span / 1000 exactly, as it
    prints (42.742, not the 42.742000000000004 that subtracting the seconds gives); the rate is (n - 1) over it."""
    workload = [
        Request(request_id=RequestId(str(i)), arrival_s=ms / 1000, input_length=1, output_length=1, block_keys=(i,))
        for i, ms in enumerate(arrivals_ms)
    ]
    stats = trace_stats(workload)
    span = (max(arrivals_ms) - min(arrivals_ms)) / 1000
    assert stats.duration_s == span
    assert stats.mean_rate_per_s == ((len(workload) - 1) / span if span else 0.0)


@pytest.mark.parametrize("junk", [object(), {"input_length": 1}, None])
def test_a_non_request_is_an_invalid_request_naming_its_place(junk: object) -> None:
    """Anything but a Request in the stream is an InvalidRequestError naming its 0-based place and the value,
    not an AttributeError from deep inside."""
    good = Request(request_id=RequestId("0"), arrival_s=0.0, input_length=1, output_length=1, block_keys=(1,))
    with pytest.raises(InvalidRequestError, match=r"^request 2: expected a mooncake\.types\.Request, got "):
        trace_stats([good, good, junk])  # type: ignore[list-item]


# --------------------------------------------------------------------------- one trace line


@pytest.mark.parametrize("field", ["input_length", "output_length"])
@pytest.mark.parametrize("value", [5.5, True, 1e-9, "5"])
def test_an_integer_field_refuses_fractions_and_bools(field: str, value: object) -> None:
    """A token count is an integer: a fraction (5.5) is refused, not truncated, and a bool is no number (JSON's
    true is not 1), each naming the field and value."""
    line = {"timestamp": 0, "input_length": 4, "output_length": 3, field: value}
    with pytest.raises(ValueError, match=rf"field '{field}' must be an integer, got {value!r}"):
        parse_record(line, 4)


@pytest.mark.parametrize("element", [1.5, True, None, "1"])
def test_a_hash_id_that_is_no_integer_is_refused(element: object) -> None:
    """A hash id is an integer: a fraction, a bool, a null or a string among them is refused, naming it."""
    line = {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, element]}
    with pytest.raises(ValueError, match=rf"field 'hash_ids' must be a list of integers, got an element {element!r}"):
        parse_record(line, 4)


@pytest.mark.parametrize("hash_ids", ["12", {"1": 2}, 7])
def test_hash_ids_that_are_no_list_are_refused_as_a_whole(hash_ids: object) -> None:
    """hash_ids given as a string, an object or a number: the message shows the value given, not a part of it."""
    line = {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": hash_ids}
    with pytest.raises(ValueError, match=rf"field 'hash_ids' must be a list of integers, got {hash_ids!r}$"):
        parse_record(line, 4)


# --------------------------------------------------------------------------- capacity replay


class RefusingPolicy:
    """LRU that can evict nothing (every block protected), recording each access's options."""

    def __init__(self) -> None:
        self.policy = LruPolicy(prefix_aware=False)
        self.accesses: list[tuple[BlockKey, BlockKey | None, int]] = []

    def access(self, key: BlockKey, *, parent: BlockKey | None = None, position: int = 0) -> None:
        self.policy.access(key, parent=parent, position=position)
        self.accesses.append((key, parent, position))

    def evict(self) -> BlockKey | None:
        return None

    def pin(self, key: BlockKey) -> None:
        self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.policy.unpin(key)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy


@given(
    workload=st.lists(st.lists(st.integers(0, 7).map(BlockKey), max_size=6).map(tuple), max_size=10),
    capacity=st.integers(1, 6),
)
@example(workload=[(BlockKey(0),), (BlockKey(5), BlockKey(0))], capacity=1)
def test_a_cache_that_cannot_evict_admits_no_more_than_its_capacity(
    workload: list[tuple[BlockKey, ...]], capacity: int
) -> None:
    """When nothing can be evicted a key is not admitted and ends its request's chain (put_chain's rule): the
    cache holds the first `capacity` distinct keys ever met and no more, hits are the leading keys among them, a
    cached key is accessed as a use (no parent, position 0) and a new one with the request's previous key as its
    parent at its own position, and no key after a refused one is accessed. Keys here are any lists, so a key
    already cached may follow one that was refused."""
    policy = RefusingPolicy()
    point = simulate_prefix_hits(workload, policy, capacity_blocks=capacity)  # type: ignore[arg-type]
    held: list[BlockKey] = []
    hits = 0
    expected_accesses = []
    for keys in workload:
        for key in keys:
            if key not in held:
                break
            hits += 1
        for position, key in enumerate(keys):
            if key in held:
                expected_accesses.append((key, None, 0))
            elif len(held) < capacity:
                held.append(key)
                expected_accesses.append((key, keys[position - 1] if position else None, position))
            else:
                break
    assert (point.hit_blocks, point.total_blocks) == (hits, sum(map(len, workload)))
    assert len(policy) == len(held) <= capacity
    assert policy.accesses == expected_accesses


# --------------------------------------------------------------------------- cache events


@pytest.mark.parametrize("event", [BlockStored, BlockRemoved, AllBlocksCleared])
@pytest.mark.parametrize("field", ["seq", "epoch"])
@pytest.mark.parametrize("value", [-1, -(2**70), 1.0, True, "0"])
def test_a_sequence_number_or_epoch_is_an_integer_at_least_zero(event: Any, field: str, value: object) -> None:
    """seq and epoch count from 0: a negative one, a float, a bool or a string is a ConfigError naming the field,
    on every kind of event (a consumer would otherwise see a gap that is none)."""
    fields: dict[str, Any] = {"source": InstanceId("p0"), "seq": 0}
    if event is not AllBlocksCleared:
        fields |= {"keys": (BlockKey(1),), "tier": Tier.DRAM}
    event(**fields)  # valid as it is
    with pytest.raises(ConfigError, match=field):
        event(**(fields | {field: value}))


# --------------------------------------------------------------------------- build_conductor


def test_a_step_model_given_replaces_the_default() -> None:
    """`step_model`, like every documented default, is replaced by the object given."""
    mine = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xH800"])
    conductor = build_conductor(
        model=MODELS["llama3-70b"],
        hardware=HARDWARE["8xA800"],
        prefill_instances=["p0"],
        decode_instances=["d0"],
        block_size_tokens=16,
        step_model=mine,
    )
    assert conductor.step_model is mine


def test_a_builtin_router_factory_is_called_and_its_result_checked() -> None:
    """A builtin has no signature to check before the call; `type` called with the estimator returns a class,
    not a router: a ConfigError, not the ValueError of inspecting the builtin."""
    with pytest.raises(ConfigError, match="router"):
        build_conductor(
            model=MODELS["llama3-70b"],
            hardware=HARDWARE["8xA800"],
            prefill_instances=["p0"],
            decode_instances=["d0"],
            block_size_tokens=16,
            router=type,  # type: ignore[arg-type]
        )


# --------------------------------------------------------------------------- the command line


@settings(max_examples=20)
@given(
    workload=chained_workloads(max_requests=8, max_blocks=5).map(lambda chains: [c for c in chains if c]),
    policy=st.sampled_from(["lru", "lfu", "sieve", "length_aware"]),
    prefix_aware=st.booleans(),
    capacities=st.lists(st.integers(1, 8), min_size=1, max_size=3, unique=True),
    jobs=st.sampled_from(["1", "2"]),
)
@example(workload=[(0, 1), (2,), (0, 1)], policy="lru", prefix_aware=True, capacities=[2, 3], jobs="2")
@example(workload=[(0, 1), (2,), (0, 1)], policy="lru", prefix_aware=False, capacities=[2, 3], jobs="2")
@example(workload=[(0, 1), (2,), (0, 1)], policy="lru", prefix_aware=False, capacities=[2, 3], jobs="1")
def test_capacity_json_is_the_reference_replay(
    workload: list[tuple[BlockKey, ...]], policy: str, prefix_aware: bool, capacities: list[int], jobs: str
) -> None:
    """`trace capacity --json`, in process or in forked workers: exactly the keys policy, prefix_aware and
    hit_ratio, the latter per capacity (as a string, in the order given) the reference policy's replay rounded to
    6 places, with --prefix-aware or --no-prefix-aware honoured."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.jsonl"
        write_keyed_trace(path, workload)
        flag = "--prefix-aware" if prefix_aware else "--no-prefix-aware"
        argv = ["trace", "capacity", str(path), "--block-size", "1", "--policy", policy, flag, "--json"]
        argv += ["--capacity-blocks", ",".join(map(str, capacities)), "--jobs", jobs, "--no-progress"]
        status, out, err = run_cli(*argv)
    assert (status, err) == (0, "")
    result = json.loads(out)
    expected = {}
    for capacity in capacities:
        hits, total = reference_prefix_hits(workload, ReferencePolicy(policy, prefix_aware=prefix_aware), capacity)
        expected[str(capacity)] = round(hits / total, 6) if total else 0.0
    assert result == {"policy": policy, "prefix_aware": prefix_aware, "hit_ratio": expected}
    assert list(result["hit_ratio"]) == [str(c) for c in capacities]


def test_capacity_text_names_the_policy_and_its_mode(tmp_path: Path) -> None:
    """The text table opens with the policy, `prefix-aware` when it is (not by default, as in the paper's
    Table 1), and the trace; a row per capacity."""
    path = tmp_path / "t.jsonl"
    write_keyed_trace(path, [(0, 1), (2,), (0, 1)])
    modes: list[tuple[list[str], str, tuple[float, float]]] = [
        (["--prefix-aware"], " prefix-aware", (0.2, 0.4)),
        (["--no-prefix-aware"], "", (0.0, 0.4)),
        ([], "", (0.0, 0.4)),
    ]
    for flags, mode, ratios in modes:
        argv = ("trace", "capacity", str(path), "--block-size", "1", *flags, "--capacity-blocks", "2,3", "--jobs", "1")
        status, out, err = run_cli(*argv)
        assert (status, err) == (0, "")
        assert out.splitlines() == [
            f"policy lru{mode} on {path}",
            f"{'capacity (blocks)':>18}  {'hit ratio':>9}",
            f"{2:>18,}  {ratios[0]:>9.4f}",
            f"{3:>18,}  {ratios[1]:>9.4f}",
        ]


def test_stats_text_shows_blocks_then_unique_blocks(tmp_path: Path) -> None:
    """`trace stats` prints all blocks, then the distinct ones in parentheses, and the other figures."""
    path = tmp_path / "t.jsonl"
    write_keyed_trace(path, [(0, 1, 2), (0, 1, 3), (0,)])
    status, out, err = run_cli("trace", "stats", str(path), "--block-size", "1")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"trace                {path}"
    assert "blocks (unique)      7 (4)" in lines
    assert "prefix reuse ratio   0.4286" in lines  # 2 + 1 of 7 blocks
    assert "requests             3" in lines and "max input tokens     3" in lines
    assert "mean input tokens    2.3" in lines and "mean output tokens   1.0" in lines


def test_a_plot_under_a_file_is_refused_before_the_sweep(tmp_path: Path) -> None:
    """--plot x/p.png where x is a file, not a folder: one line saying there is no folder x, status 2, no output
    and nothing written."""
    trace = tmp_path / "t.jsonl"
    write_keyed_trace(trace, [(0,)])
    blocker = tmp_path / "x"
    blocker.write_text("")
    plot = blocker / "p.png"
    status, out, err = run_cli("trace", "capacity", str(trace), "--plot", str(plot), "--jobs", "1")
    assert (status, out) == (2, "")
    assert err == f"mooncake: error: --plot {plot}: there is no folder {blocker}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl", "x"]


@pytest.mark.parametrize("target", [".", "..", "out/..", "./."])
def test_convert_to_a_dot_name_is_refused_as_no_file_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """An output named ".", ".." (or ending in one) names a folder, not a file: argparse's one-line error, status
    2, before the trace is read; nothing is written."""
    trace = tmp_path / "t.jsonl"
    write_keyed_trace(trace, [(0,)])
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli("trace", "convert", str(trace), target)
    assert (status, out) == (2, "")
    assert "argument OUT: expected a file name" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("target", ["new.jsonl/.", "t.jsonl/.", "t.jsonl/.."])
def test_convert_to_a_file_name_followed_by_a_dot_writes_nothing(tmp_path: Path, target: str) -> None:
    """`convert t.jsonl X/.`: X/. can only be a folder, so the target names no file: status 2, one line on
    stderr, the folder as it was (no new file, the source untouched)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [0], "output_length": 1, "input_length": 1, "timestamp": 0}\n')
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    status, out, err = run_cli("trace", "convert", str(trace), f"{tmp_path}/{target}", "--block-size", "1")
    assert (status, out, err.count("\n")) == (2, "", 1)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("command", ["stats", "capacity"])
def test_a_nul_in_the_trace_name_is_a_usage_error(command: str) -> None:
    """A trace name holding NUL names no file (open() would raise ValueError): argparse's one line, status 2."""
    status, out, err = run_cli("trace", command, "a\0b.jsonl", "--jobs=1" if command == "capacity" else "--json")
    assert (status, out) == (2, "")
    assert "expected a file name, got 'a\\x00b.jsonl'" in err and err.count("\n") == 1


def test_the_time_unit_warning_about_a_file_named_with_a_line_break_is_one_line(tmp_path: Path) -> None:
    """The warning that a millisecond trace has fractions of a millisecond names the file: a line break in its
    name is shown escaped, the warning stays one line, and the run succeeds."""
    path = tmp_path / "a\nb.jsonl"
    path.write_text('{"timestamp": 0.5, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n')
    status, out, err = run_cli("trace", "stats", str(path), "--block-size", "1", "--json")
    assert (status, json.loads(out)["num_requests"]) == (0, 1)
    assert err.startswith("mooncake: warning: ") and err.count("\n") == 1 and "a\\nb.jsonl" in err


def test_an_undecodable_trace_name_prints_escaped_on_a_strict_stdout(tmp_path: Path) -> None:
    """A file name that is no UTF-8 (Latin-1 caf\\xe9, read as a surrogate) is printed escaped by `trace stats`
    even where stdout is strict UTF-8: status 0, no traceback."""
    path = os.path.join(os.fsencode(tmp_path), b"caf\xe9.jsonl")
    with open(path, "w") as file:
        file.write('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n')
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict", PYTHONUTF8="0", LC_ALL="C.UTF-8")
    done = subprocess.run(
        [sys.executable, "-m", "mooncake.cli", "trace", "stats", path, "--block-size", "1"],
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert b"caf\\udce9.jsonl" in done.stdout
