"""Tests of `mooncake.sim.report`'s files: strict JSON, the per-request CSV, and how each is written.

Properties: `json_safe` of any nesting of floats (NaN and infinities included) is what a strict JSON
encoder takes, with every finite value kept and every other one null; `write_json` writes it. The CSV's
outcome and reason columns hold the values `Outcome(...)` and `reason_named` read back.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.sched.outcome import Outcome, Reason, reason_named
from mooncake.sim.metrics import RequestRecord
from mooncake.sim.report import json_safe, plot_cdfs, plot_lines, plot_load, write_json, write_records_csv
from mooncake.types import InstanceId, RequestId

leaves = st.floats(allow_nan=True, allow_infinity=True) | st.integers() | st.text(max_size=3) | st.none()
nested = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)  # summaries hold tuples (a CDF's points) as well as lists
        | st.dictionaries(st.text(max_size=3), inner)
    ),
)


def same_but_non_finite_as_none(original: Any, safe: Any) -> bool:
    if isinstance(original, float):
        return safe == original if math.isfinite(original) else safe is None
    if isinstance(original, dict):
        return original.keys() == safe.keys() and all(
            same_but_non_finite_as_none(original[k], safe[k]) for k in original
        )
    if isinstance(original, list | tuple):
        return len(original) == len(safe) and all(map(same_but_non_finite_as_none, original, safe))
    return bool(original == safe)


@given(nested)
def test_json_safe_is_strict_json_with_only_the_non_finite_values_nulled(data: Any) -> None:
    safe = json_safe(data)
    assert same_but_non_finite_as_none(data, safe)
    assert json.loads(json.dumps(safe, allow_nan=False)) == safe


def test_write_json_writes_a_ratio_over_nothing_as_null(tmp_path: Path) -> None:
    """`experiments.py cache` wrote `"ratio": Infinity`, which strict parsers refuse."""
    write_json({"ratio": {"4x100": math.inf, "4x200": math.nan, "8x100": 1.5}}, tmp_path / "cache.json")
    text = (tmp_path / "cache.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"ratio": {"4x100": None, "4x200": None, "8x100": 1.5}}


def test_the_csv_names_outcomes_and_reasons_by_the_values_that_read_back(tmp_path: Path) -> None:
    records = [
        RequestRecord(
            request_id=RequestId("0"), arrival_s=0.0, input_tokens=8, output_tokens=2, outcome=Outcome.COMPLETED
        ),
        RequestRecord(
            request_id=RequestId("1"),
            arrival_s=1.0,
            input_tokens=8,
            output_tokens=2,
            outcome=Outcome.REJECTED_BEFORE_PREFILL,
            reason=Reason.TTFT_SLO,
        ),
    ]
    write_records_csv(records, tmp_path / "requests.csv")
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert [row["reason"] for row in rows] == ["", "ttft_slo"]
    assert reason_named(rows[1]["reason"]) is Reason.TTFT_SLO
    assert [Outcome(row["outcome"]) for row in rows] == [Outcome.COMPLETED, Outcome.REJECTED_BEFORE_PREFILL]


def test_each_csv_column_holds_the_field_it_names(tmp_path: Path) -> None:
    """Every column of a row reads back as the record's field of that name (times to the microsecond)."""
    record = RequestRecord(
        request_id=RequestId("r"),
        arrival_s=1.5,
        input_tokens=8,
        output_tokens=3,
        outcome=Outcome.COMPLETED,
        prefill_instance=InstanceId("prefill-1"),
        decode_instance=InstanceId("decode-2"),
        prefix_tokens=4,
        prefill_s=0.25,
        inline_prefill=True,
        first_token_s=2.0,
        finish_s=3.0,
        tbt_s=0.125,
    )
    write_records_csv([record], tmp_path / "requests.csv")
    (row,) = csv.DictReader((tmp_path / "requests.csv").open())
    assert row == {
        "request_id": "r",
        "arrival_s": "1.500000",
        "input_tokens": "8",
        "output_tokens": "3",
        "outcome": "completed",
        "reason": "",
        "prefill_instance": "prefill-1",
        "decode_instance": "decode-2",
        "prefix_tokens": "4",
        "prefill_s": "0.250000",
        "inline_prefill": "1",
        "ttft_s": "0.500000",
        "tbt_s": "0.125000",
        "finish_s": "3.000000",
    }


WRITERS: dict[str, Callable[[Path], None]] = {
    "json": lambda path: write_json({"a": 1}, path),
    "csv": lambda path: write_records_csv([], path),
    "plot": lambda path: plot_cdfs({"TTFT": [1.0, 2.0]}, path, xlabel="TTFT (s)"),
}


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_write_leaves_another_runs_temporary_alone(tmp_path: Path, writer: Callable[[Path], None]) -> None:
    """Two runs writing one --out each write through a temporary of their own: the fixed name each used
    (`.summary.json.tmp`) was shared, one run renaming or removing the other's half-written file."""
    target = tmp_path / "out.png"
    theirs = {tmp_path / ".out.png.tmp": "another run's", tmp_path / ".out.tmp.png": "another run's plot"}
    for path, text in theirs.items():
        path.write_text(text, encoding="utf-8")
    writer(target)
    assert {path.name for path in tmp_path.iterdir()} == {"out.png", *(path.name for path in theirs)}
    assert all(path.read_text(encoding="utf-8") == text for path, text in theirs.items())


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
def test_a_failed_write_names_the_file_asked_for(tmp_path: Path, writer: Callable[[Path], None]) -> None:
    """A write that fails (here onto a folder) names the output, not the hidden temporary, and leaves nothing."""
    target = tmp_path / "out.png"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as caught:
        writer(target)
    assert caught.value.filename == str(target)
    assert [path.name for path in tmp_path.iterdir()] == ["out.png"] and not any(target.iterdir())


@pytest.mark.parametrize("suffix", ["eps", "ps", "pdf", "svg", "png"])
def test_every_plot_writes_every_format_without_a_warning(
    tmp_path: Path, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing in a plot is transparent: the PostScript backend logged a warning about the grid's alpha, which
    reached the command line's stderr in matplotlib's words (no `mooncake:` prefix) for every `--plot x.eps`."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the dev extra)")
    from mooncake.cache.capacity import CapacityPoint
    from mooncake.cli import plot_capacity
    from mooncake.sim.metrics import LoadSample

    samples = [LoadSample(time_s=float(t), prefill_requests=t % 3, decode_requests=t % 5) for t in range(10)]
    points = [CapacityPoint(capacity_blocks=c, hit_blocks=c // 2, total_blocks=100) for c in (10, 100)]
    plots: list[Callable[[Path], None]] = [
        lambda path: plot_cdfs({"a": [1.0, 2.0], "b": [3.0]}, path, xlabel="x", title="cdfs"),
        lambda path: plot_lines(
            {"a": ([1, 2], [3, 4]), "b": ([1, 2], [4, 3])}, path, xlabel="x", ylabel="y", logx=True
        ),
        lambda path: plot_load({"a": samples, "b": samples}, path, title="loads"),
        lambda path: plot_capacity({"lru": points, "lfu": points}, path, title="capacity"),
    ]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        for number, plot in enumerate(plots):
            plot(tmp_path / f"{number}.{suffix}")
    assert [record.getMessage() for record in caplog.records] == []
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{n}.{suffix}" for n in range(len(plots))]


LONG = (
    "16P+16D llama3-70b on 8xA800, 10,000 cache blocks per prefill node (global pool); router kvcache_centric, "
    "admission early_rejection, TTFT SLO 30 s, TBT SLO 0.1 s"
)


def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the report's plots save from now on (each still written), in order."""
    import mooncake.sim.report as report

    figures: list[Any] = []
    real_save = report._save

    def keep(figure: Any, path: str | Path) -> None:
        figures.append(figure)
        real_save(figure, path)

    monkeypatch.setattr(report, "_save", keep)
    return figures


def title_texts(figure: Any) -> list[Any]:
    """A figure's title texts: its suptitle, if any, and each axes' title."""
    texts = [figure._suptitle] if figure._suptitle is not None else []
    return texts + [axes.title for axes in figure.axes]


def test_every_plot_keeps_a_long_title_inside_the_figure_and_counts_time_from_the_first_sample(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run's description as a title (the replay's is ~150 characters) is broken into lines that lie inside the
    figure: one line was clipped at both edges. A load trace stamped in epoch seconds is drawn from 0 s."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the dev extra)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from mooncake.cache.capacity import CapacityPoint
    from mooncake.cli import plot_capacity
    from mooncake.sim.metrics import LoadSample

    figures = saved_figures(monkeypatch)
    epoch = 1_733_000_000.0
    samples = [LoadSample(time_s=epoch + t, prefill_requests=t % 3, decode_requests=t % 5) for t in range(10)]
    points = [CapacityPoint(capacity_blocks=c, hit_blocks=c // 2, total_blocks=100) for c in (10, 100)]
    plot_cdfs({"TTFT": [1.0, 2.0]}, tmp_path / "cdf.png", xlabel="TTFT (s)", title=LONG)
    plot_lines({"a": ([1, 2], [3, 4])}, tmp_path / "lines.png", xlabel="x", ylabel="y", title=LONG)
    plot_load({LONG: samples}, tmp_path / "load.png", title=LONG)
    plot_capacity({"lru": points}, tmp_path / "capacity.png", title=LONG)
    for figure in figures:
        renderer = FigureCanvasAgg(figure).get_renderer()
        texts = title_texts(figure)
        assert any("global pool" in text.get_text() for text in texts)
        for text in texts:
            box = text.get_window_extent(renderer)
            assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1, text.get_text()
            assert " ".join(text.get_text().split()) in (LONG, "")  # broken at spaces, nothing lost
    assert len(figures) == 4
    (axes,) = figures[2].axes
    assert [line.get_xdata()[0] for line in axes.lines] == [0.0, 0.0]
    assert "1,733,000,000.000" in axes.get_xlabel()


@pytest.mark.parametrize("title", ["run$\\q$.jsonl", "cost $5 to $6", "a_$x^2$_b.jsonl"])
def test_a_title_with_dollar_signs_is_drawn_as_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, title: str
) -> None:
    """Titles are names (`trace capacity --plot` titles a plot with the trace's file name): `$...$` in one is
    text, not mathtext. `run$\\q$.jsonl` was a ParseFatalException and a traceback from the command line."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the dev extra)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from mooncake.cache.capacity import CapacityPoint
    from mooncake.cli import plot_capacity
    from mooncake.sim.metrics import LoadSample

    figures = saved_figures(monkeypatch)
    samples = [LoadSample(time_s=float(t), prefill_requests=t % 3, decode_requests=t % 5) for t in range(4)]
    points = [CapacityPoint(capacity_blocks=c, hit_blocks=c // 2, total_blocks=100) for c in (10, 100)]
    plot_cdfs({"TTFT": [1.0, 2.0]}, tmp_path / "cdf.png", xlabel="TTFT (s)", title=title)
    plot_load({title: samples}, tmp_path / "load.png", title=title)
    plot_capacity({"lru": points}, tmp_path / "capacity.png", title=title)
    assert len(figures) == 3
    for figure in figures:
        renderer = FigureCanvasAgg(figure).get_renderer()
        texts = title_texts(figure)
        for text in texts:
            text.get_window_extent(renderer)  # drawn: a parsed title would fail here too
            assert text.get_text() == title and not text.get_parse_math()  # `$x^2$` shown as typed


@pytest.mark.parametrize(
    ("outcome", "output_tokens", "shown"),
    [
        (Outcome.COMPLETED, 2, "0.125000"),
        (Outcome.COMPLETED, 1, ""),  # one token: no interval, as the summary's TBT leaves it out
        (Outcome.REJECTED_AFTER_PREFILL, 3, ""),
        (None, 3, ""),  # still running when the run ended
    ],
)
def test_the_csv_gives_a_tbt_only_where_an_interval_was_measured(
    tmp_path: Path, outcome: Outcome | None, output_tokens: int, shown: str
) -> None:
    record = RequestRecord(request_id="r", arrival_s=0.0, input_tokens=8, output_tokens=output_tokens, tbt_s=0.125)
    record.outcome = outcome
    write_records_csv([record], tmp_path / "requests.csv")
    (row,) = csv.DictReader((tmp_path / "requests.csv").open())
    assert row["tbt_s"] == shown
