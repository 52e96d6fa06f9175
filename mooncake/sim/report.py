"""Writing a replay's results: per-request CSV, summary JSON, CDF and load plots, a progress bar.

Files are written whole or not at all (to a temporary sibling of a name of its
own, then renamed), so an interrupted run never leaves a half-written result,
and two runs writing one folder never share a temporary; an error names the
file asked for. Plots need matplotlib
(the `plot` extra); it is imported only when a plot is drawn, or when a command
asks first (`require_pyplot`), so that a run whose plots could not be drawn is
refused before it starts. `summary_table`
is the text table every command prints of a run's summary, simulated or real.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from mooncake._extras import needs_extra
from mooncake._files import atomic_path
from mooncake.sim.metrics import LoadSample, RequestRecord, Summary, has_tbt

__all__ = [
    "ProgressBar",
    "json_safe",
    "plot_cdfs",
    "plot_lines",
    "plot_load",
    "require_pyplot",
    "shows_progress",
    "summary_table",
    "write_json",
    "write_records_csv",
]

RECORD_COLUMNS = (
    "request_id",
    "arrival_s",
    "input_tokens",
    "output_tokens",
    "outcome",
    "reason",
    "prefill_instance",
    "decode_instance",
    "prefix_tokens",
    "prefill_s",
    "inline_prefill",
    "ttft_s",
    "tbt_s",
    "finish_s",
)


def _make_folder(target: Path) -> None:
    """Make `target`'s folder if missing; a failure is named by `target`, as a failed write is (what the user asked
    for), and says which folder could not be made."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = f"{error.strerror} (making its folder {error.filename})"
        raise type(error)(error.errno, reason, os.fspath(target)) from error


@contextmanager
def _atomic(path: str | Path) -> Iterator[TextIO]:
    """A text file written whole at `path` (its folder made if missing); see `mooncake._files.atomic_path`."""
    target = Path(path)
    _make_folder(target)
    with atomic_path(target) as temporary, temporary.open("w", encoding="utf-8", newline="") as stream:
        yield stream


def write_records_csv(records: Sequence[RequestRecord], path: str | Path) -> None:
    """One row per request (`RECORD_COLUMNS`); times in seconds, empty where not reached (`tbt_s` too where no
    token interval was measured: a request that did not complete, or completed with one token, as the summary
    leaves them out of its TBT: `has_tbt`). `finish_s` is when its client had its answer, the last token or
    the refusal."""
    with _atomic(path) as stream:
        writer = csv.writer(stream)
        writer.writerow(RECORD_COLUMNS)
        for r in records:
            writer.writerow(
                [
                    r.request_id,
                    f"{r.arrival_s:.6f}",
                    r.input_tokens,
                    r.output_tokens,
                    r.outcome.value if r.outcome else "",
                    r.reason.value if r.reason else "",
                    r.prefill_instance or "",
                    r.decode_instance or "",
                    r.prefix_tokens,
                    f"{r.prefill_s:.6f}",
                    int(r.inline_prefill),
                    "" if r.ttft_s is None else f"{r.ttft_s:.6f}",
                    f"{r.tbt_s:.6f}" if has_tbt(r) else "",
                    "" if r.finish_s is None else f"{r.finish_s:.6f}",
                ]
            )


def summary_table(summary: Summary, *, failed: int = 0) -> list[str]:
    """The lines of a run's text table: its outcomes (completed, rejected before and after prefill, the prefill
    spent on the latter, and with `failed` the requests that got no answer, which a real run has), then TTFT in s
    and TBT in ms, mean, p50, p90 and p99, under a header. A caller adds its own line of run figures (SLO
    attainment, goodput, wall time)."""
    s = summary
    lines = [
        f"requests {s.num_requests:,}: completed {s.completed:,}, rejected before prefill "
        f"{s.rejected_before_prefill:,}, after prefill {s.rejected_after_prefill:,} "
        f"(wasted prefill {s.wasted_prefill_s:,.1f} s)" + (f", failed {failed:,} (no answer)" if failed else ""),
        f"{'':8}" + "".join(f" {column:>10}" for column in ("mean", "p50", "p90", "p99")),
    ]
    for name, values, factor, unit in (("TTFT", s.ttft_s, 1.0, "s"), ("TBT", s.tbt_s, 1000.0, "ms")):
        figures = (values[column] * factor for column in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<5}{unit:>3}" + "".join(f" {figure:>10.3f}" for figure in figures))  # apart however wide
    return lines


def json_safe(data: Any) -> Any:
    """`data` with every float that is not finite (a ratio over nothing, an infinite one) as None: JSON has no
    NaN or Infinity, and strict parsers refuse Python's extension."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [json_safe(value) for value in data]
    return data


def write_json(data: Any, path: str | Path) -> None:
    """`data` as strict JSON (see `json_safe`), written atomically."""
    with _atomic(path) as stream:
        json.dump(json_safe(data), stream, indent=2, sort_keys=True, allow_nan=False)
        stream.write("\n")


def require_pyplot() -> Any:
    """matplotlib's `pyplot` on the file-only Agg backend, as every plot here draws with it. A command that plots
    after its work calls it before that work, so a run whose plots could not be drawn is refused at once.

    Returns:
        The `matplotlib.pyplot` module.

    Raises:
        ConfigError: matplotlib is not installed (the `plot` extra), naming how to install it.
    """
    with needs_extra("a plot"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    return plt


def _save(figure: Any, path: str | Path) -> None:
    target = Path(path)
    _make_folder(target)
    with atomic_path(target) as temporary:
        # The format by the target's name (the temporary's ends in .tmp); matplotlib's default without one.
        figure.savefig(temporary, dpi=110, format=target.suffix[1:] or "png")


def _fit(text: Any, figure: Any) -> None:
    """Break a title into lines that fit the figure's width: matplotlib clips a longer line at both edges (a run's
    description, say). A character of its font is taken as 0.6 of its size, wider than most are."""
    width_points = figure.get_figwidth() * 72 * 0.95
    characters = max(16, int(width_points / (0.6 * text.get_fontsize())))
    text.set_text("\n".join(textwrap.wrap(text.get_text(), characters)))


def _finish(
    plt: Any,
    figure: Any,
    axes: Any,
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    legend: bool,
    **grid: Any,
) -> None:
    """Label, grid and title one panel, then write the figure whole and release it."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(color="0.85", **grid)  # opaque, as the legends: PostScript has no transparency
    if legend:
        axes.legend(framealpha=1)
    # A title is a name (a trace file, a run): `$` in it is text, not mathtext that may not parse.
    _fit(axes.set_title(title, parse_math=False), figure)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)


def plot_cdfs(series: Mapping[str, Sequence[float]], path: str | Path, *, xlabel: str, title: str = "") -> None:
    """Empirical CDFs, one line per series (empty series are skipped)."""
    plt = require_pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name, values in series.items():
        if len(values):
            xs = np.sort(np.asarray(values, dtype=np.float64))
            axes.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
    axes.set_ylim(0, 1.01)
    _finish(plt, figure, axes, path, xlabel=xlabel, ylabel="fraction of requests", title=title, legend=len(series) > 1)


def plot_lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    ylim: tuple[float, float] | None = None,
    legend: bool | None = None,
) -> None:
    """One marked line per series of (xs, ys); `logx` puts x on a base-2 scale (minor grid lines too), `legend`
    names the series (default: where there is more than one)."""
    plt = require_pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for name, (xs, ys) in series.items():
        axes.plot(list(xs), list(ys), marker="o", label=name)
    if logx:
        axes.set_xscale("log", base=2)
    if ylim is not None:
        axes.set_ylim(*ylim)
    grid = {"which": "both"} if logx else {}
    legend = len(series) > 1 if legend is None else legend
    _finish(plt, figure, axes, path, xlabel=xlabel, ylabel=ylabel, title=title, legend=legend, **grid)


def plot_load(loads: Mapping[str, Sequence[LoadSample]], path: str | Path, *, title: str = "") -> None:
    """Prefill (queued or running) and decoding requests over time, a panel per run.

    Time is counted from the earliest sample of any run: a trace stamped in epoch milliseconds is plotted from
    0 s, not as offsets from 1.7e9 that matplotlib writes in a corner."""
    plt = require_pyplot()
    rows = max(1, len(loads))
    figure, axes = plt.subplots(rows, 1, figsize=(7.5, 2.4 * rows), sharex=True, squeeze=False)
    start = min((samples[0].time_s for samples in loads.values() if samples), default=0.0)
    for (name, samples), axis in zip(loads.items(), axes[:, 0], strict=False):
        times = [s.time_s - start for s in samples]
        axis.plot(times, [s.prefill_requests for s in samples], label="prefill (queued + running)", lw=0.9)
        axis.plot(times, [s.decode_requests for s in samples], label="decoding", lw=0.9)
        axis.set_ylabel("requests")
        _fit(axis.set_title(name, fontsize=9, parse_math=False), figure)
        axis.grid(color="0.85")
    axes[0, 0].legend(fontsize=8, loc="upper right", framealpha=1)
    axes[-1, 0].set_xlabel("simulated time (s)" if start == 0 else f"simulated time (s) since {start:,.3f} s")
    if title:
        _fit(figure.suptitle(title, parse_math=False), figure)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)


def shows_progress(stream: TextIO | None = None) -> bool:
    """Whether a progress bar belongs on `stream` (default stderr): it and stdout are both terminals.

    A bar on stderr would still garble a pager or interleave with a log when stdout
    is piped or redirected, so both must be terminals.
    """
    return (stream if stream is not None else sys.stderr).isatty() and sys.stdout.isatty()


class ProgressBar:
    """A one-line progress bar, at most ~10 redraws a second; drawn only where `shows_progress` (or `enabled`) says."""

    def __init__(
        self, total: int, *, label: str = "", stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = shows_progress(self.stream) if enabled is None else enabled
        self._last = 0.0

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = int(width * done / self.total)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done:,}/{self.total:,}")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
