"""examples/profile_engine.py: its grid checked by the fits' own checks before anything is timed, each rounded
point timed once, and an untimed warm-up prefill before the grid.

The grid pre-check only counted samples: one prompt length (every decode context a fixed multiple of its batch)
or lengths so short that every prefix rounds down to no block failed in a fit only after the whole profiling
run. Fractions that round to the same prefix were timed twice (weighing double in the fit), and the first
grid point paid for the engine's first use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "profile_engine.py"), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (
            ["--lengths", "64", "--batches", "1,2,4"],
            "decode (each batch at each length): the samples do not vary enough in batch size and context",
        ),
        (
            ["--lengths", "8,12", "--prefix-fractions", "0,0.5", "--batches", "1,2"],
            "prefill (each length, its prefixes rounded down to blocks of 16 tokens): fitting needs at least 3 "
            "samples, got 2",
        ),
    ],
    ids=["one-length", "prefixes-round-to-none"],
)
def test_a_grid_the_fits_cannot_use_is_refused_before_profiling(grid: list[str], message: str, tmp_path: Path) -> None:
    """Exit 2 with the fit's reason on one line, and nothing timed (no line of the profiling on stdout)."""
    pytest.importorskip("torch")
    done = run(*grid, "--repeats", "1", "--out", str(tmp_path / "p.json"))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert not (tmp_path / "p.json").exists()


def profile_counting_prefills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fractions: list[float]
) -> tuple[list[tuple[int, int]], list[int]]:
    """Profile the tiny model in this process over lengths 32, 64, 96 (blocks of 16) at `fractions`: the (n, p)
    points written, and the length of every prompt the prefill engines were given, in order."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import profile_engine

    from mooncake.engine.prefill import PrefillEngine

    calls: list[int] = []
    original = PrefillEngine.prefill

    def counted(self: PrefillEngine, tokens: list[int], *args: Any, **kwargs: Any) -> Any:
        calls.append(len(tokens))
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(PrefillEngine, "prefill", counted)
    out = tmp_path / "tiny.json"
    grid = {"lengths": [32, 64, 96], "prefix_fractions": fractions, "batches": [1, 2], "repeats": 1}
    profile_engine.run(argparse.Namespace(model="tiny", config=None, dtype="float32", out=out, **grid))
    return [(n, p) for n, p, _ in json.loads(out.read_text())["prefill_samples"]], calls


def grid_calls(points: list[tuple[int, int]]) -> list[int]:
    """Per point, its prefix's own prefill (when it has one: the prefix and a token) and the timed one."""
    return [length for n, p in points for length in ([p + 1] if p else []) + [n]]


def test_an_untimed_warm_up_prefill_comes_before_the_grid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first prefill is a warm-up of the longest length, before any grid point's (as decode's first step is
    untimed); then the grid's, then decode's prompts."""
    points, calls = profile_counting_prefills(monkeypatch, tmp_path, [0.0, 0.5])
    assert points == [(32, 0), (32, 16), (64, 0), (64, 32), (96, 0), (96, 48)]
    assert calls == [96, *grid_calls(points), 32, 64, 96]


def test_fractions_that_round_to_one_prefix_time_it_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With blocks of 16, the fraction 0.1 of 32, 64 and 96 tokens rounds to no prefix, as 0 does: each length is
    timed at two prefixes, not three (a repeat would weigh double in the fit)."""
    points, calls = profile_counting_prefills(monkeypatch, tmp_path, [0.0, 0.1, 0.5])
    assert points == [(32, 0), (32, 16), (64, 0), (64, 32), (96, 0), (96, 48)]
    assert calls[1:] == [*grid_calls(points), 32, 64, 96]
