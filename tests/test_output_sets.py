"""The --out set of replay.py, experiments.py and demo.py (`simulation.output_set`): checked before the run
(writable, matplotlib there), put in place whole after it, never mixed with an older run's, the user's own files
untouched; and the results printed even when the files cannot be written."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.errors import ConfigError
from mooncake.sim import report
from tests.test_examples import ROOT, SMALL, example, run

REPLAY = [*SMALL, "--prefill", "1", "--decode", "1", "--no-progress"]
REPLAY_SET = ("requests.csv", "summary.json", "ttft_cdf.png", "tbt_cdf.png", "load.png")
THRESHOLD = ["threshold", *SMALL, "--thresholds", "1.5", "--no-progress"]


def old_set(out: Path, names: tuple[str, ...]) -> None:
    """`out` holding an older run's set (each file "OLD") and a file of the user's own."""
    out.mkdir()
    for name in (*names, "mine.txt"):
        (out / name).write_text("OLD")


def contents(out: Path) -> dict[str, str]:
    """Every entry of `out` (hidden ones too): "OLD", "mine", "folder", or "new" for whatever this run wrote."""
    found = {}
    for path in out.iterdir():
        text = "folder" if path.is_dir() else path.read_bytes().decode("latin-1")
        found[path.name] = text if text in ("OLD", "mine", "folder") else "new"
    return found


def bad_trace(tmp_path: Path) -> Path:
    """A trace whose first line is malformed: a run that starts reports it, so a check that comes first shows."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{oops\n")
    return trace


def without_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An environment whose `import matplotlib` fails, as a base install without the plot extra."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('no matplotlib here', name='matplotlib')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))}


def test_require_pyplot_names_the_plot_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public check the commands make before their work: pyplot, or a ConfigError naming the extra."""
    assert "require_pyplot" in report.__all__
    assert report.require_pyplot().__name__ == "matplotlib.pyplot"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"a plot needs matplotlib: the plot extra"):
        report.require_pyplot()


@pytest.mark.parametrize(
    "argv",
    [
        ("replay.py", "--trace", "BAD", "--out", "OUT"),
        ("experiments.py", "scheduling", "--trace", "BAD", "--no-plots", "--out", "OUT"),
        ("demo.py", "--num-requests", "5", "--out", "OUT"),
    ],
    ids=["replay", "experiments", "demo"],
)
@pytest.mark.parametrize("unwritable", ["/proc/out", "TOO_LONG", "READ_ONLY"])
def test_an_out_that_cannot_be_written_is_refused_before_the_run(
    argv: tuple[str, ...], unwritable: str, tmp_path: Path
) -> None:
    """An --out whose folder cannot be made or written in was found only after the whole run, which was lost; it
    is one line naming --out before the run now (the bad trace, which a run would read first, is never reached;
    demo.py printed its tables first)."""
    if unwritable == "READ_ONLY":
        if os.geteuid() == 0:
            pytest.skip("root writes in a read-only folder")
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(stat.S_IRUSR | stat.S_IXUSR)
        unwritable = str(tmp_path / "ro" / "out")
    elif unwritable == "TOO_LONG":
        unwritable = str(tmp_path / ("x" * 300))
    script, *rest = (str(bad_trace(tmp_path)) if a == "BAD" else unwritable if a == "OUT" else a for a in argv)
    done = run(script, *rest, check=False, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"{Path(script).stem}: --out {unwritable} cannot be written: ")
    assert len(done.stderr.splitlines()) == 1


def test_a_refused_run_leaves_no_folder_behind(tmp_path: Path) -> None:
    """--out is made (with its parents) to check it before the run: a run refused after that takes them away."""
    done = run("replay.py", *REPLAY, "--seed", "-1", "--out", str(tmp_path / "new" / "out"), check=False)
    assert done.returncode == 2 and "--seed must be >= 0" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [("replay.py", *REPLAY, "--out", "OUT"), ("demo.py", "--num-requests", "5", "--out", "OUT")],
    ids=["replay", "demo"],
)
def test_plots_without_matplotlib_are_refused_before_the_run(argv: tuple[str, ...], tmp_path: Path) -> None:
    """replay.py --out and demo.py ran first and then failed on the plots, leaving part of the set (and the demo's
    whole sweep for nothing); they refuse at once now, as experiments.py does, writing nothing."""
    out = tmp_path / "out"
    script, *rest = (str(out) if a == "OUT" else a for a in argv)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *rest],
        capture_output=True,
        text=True,
        timeout=60,
        env=without_matplotlib(tmp_path),
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr
        == f"{Path(script).stem}: a plot needs matplotlib: the plot extra (pip install -e '.[plot]' in the checkout)\n"
    )
    assert not out.exists()


def test_replay_replaces_the_set_whole_and_leaves_the_users_files(tmp_path: Path) -> None:
    """Each file of the older run's set is replaced, the user's own file is kept, no hidden folder is left."""
    out = tmp_path / "out"
    old_set(out, REPLAY_SET)
    (out / "mine.txt").write_text("mine")
    run("replay.py", *REPLAY, "--out", str(out))
    assert contents(out) == {**dict.fromkeys(REPLAY_SET, "new"), "mine.txt": "mine"}


def test_replay_interrupted_while_writing_leaves_the_older_set_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the set was written left the new requests.csv and summary.json beside the older run's plots;
    the older set is untouched now, and nothing of the new one is left."""
    replay = example("replay")
    out = tmp_path / "out"
    old_set(out, REPLAY_SET)

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(replay, "plot_load", interrupted)  # the last file written
    assert replay.main([*REPLAY, "--out", str(out)]) == 130
    assert capsys.readouterr().err == "replay: interrupted\n"
    assert contents(out) == dict.fromkeys((*REPLAY_SET, "mine.txt"), "OLD")


@pytest.mark.parametrize(
    ("argv", "taken", "printed", "kept"),
    [
        (("replay.py", *REPLAY), "load.png", "SLO attainment", ("requests.csv", "ttft_cdf.png", "tbt_cdf.png")),
        (
            ("replay.py", *REPLAY, "--json"),
            "load.png",
            '"slo_attainment"',
            ("requests.csv", "ttft_cdf.png", "tbt_cdf.png"),
        ),
        # its older plot is removed (--no-plots) before the marker, which fails
        (("experiments.py", *THRESHOLD, "--no-plots"), "threshold.json", "mean TTFT", ()),
    ],
    ids=["replay", "replay-json", "experiments"],
)
def test_files_that_cannot_be_written_after_the_run_do_not_lose_its_results(
    argv: tuple[str, ...], taken: str, printed: str, kept: tuple[str, ...], tmp_path: Path
) -> None:
    """A set's name taken by a folder: the run's summary (table or JSON) was lost with the error; it is printed,
    then the error names the file, status 2. The older set loses its marker (summary.json), so it does not pass
    for a whole one; nothing of it was replaced before the failure."""
    out = tmp_path / "out"
    names = REPLAY_SET if argv[0] == "replay.py" else ("threshold.json", "threshold.png")
    old_set(out, tuple(name for name in names if name != taken))
    (out / taken).mkdir()
    script, *rest = argv
    done = run(script, *rest, "--out", str(out), check=False)
    assert done.returncode == 2 and printed in done.stdout and "written to" not in done.stdout
    assert done.stderr == f"{Path(script).stem}: {out / taken}: Is a directory\n"
    assert contents(out) == {**dict.fromkeys(kept, "OLD"), taken: "folder", "mine.txt": "OLD"}


def test_an_experiment_without_plots_removes_an_older_runs_plots_only(tmp_path: Path) -> None:
    """--no-plots after a run with plots left that run's plots beside the new JSON; they are removed with the rest
    of the older set now, and a file of another name (the user's) stays."""
    out = tmp_path / "out"
    old_set(out, ("threshold.json", "threshold.png", "threshold_mine.png"))
    run("experiments.py", *THRESHOLD, "--no-plots", "--out", str(out))
    assert contents(out) == {"threshold.json": "new", "threshold_mine.png": "OLD", "mine.txt": "OLD"}


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_link_or_a_fifo_at_a_sets_name_is_written_through(kind: str, tmp_path: Path) -> None:
    """As every writer here does (`mooncake._files.atomic_path`): a link stays and its file gets the summary; a
    FIFO stays and its reader gets it."""
    out = tmp_path / "out"
    out.mkdir()
    marker = out / "summary.json"
    if kind == "link":
        (tmp_path / "kept").mkdir()
        marker.symlink_to(tmp_path / "kept" / "real.json")
        done = run("replay.py", *REPLAY, "--json", "--out", str(out))
        assert marker.is_symlink() and (tmp_path / "kept" / "real.json").read_text().strip() == done.stdout.strip()
        return
    os.mkfifo(marker)
    reader = os.open(marker, os.O_RDONLY | os.O_NONBLOCK)  # there before the writer, which then never blocks
    try:
        done = run("replay.py", *REPLAY, "--json", "--out", str(out))
        received = os.read(reader, 1 << 16).decode()
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(marker).st_mode) and received.strip() == done.stdout.strip()
