"""`mooncake._files.atomic_path`: a file is replaced whole or not at all, and its errors name it.

The writers built on it are tested with it: `write_trace` in tests/workload/test_trace.py, the simulator's
reports in tests/sim/test_report.py.
"""

from __future__ import annotations

import contextlib
import errno
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._files import atomic_path


def test_the_whole_file_replaces_the_old_one(tmp_path: Path) -> None:
    """The block writes the temporary sibling; at its end the target holds that, and the sibling is gone."""
    target = tmp_path / "out.json"
    target.write_text("old")
    with atomic_path(target) as temporary:
        assert temporary.parent == tmp_path and temporary.name.startswith(".out.json.")
        assert temporary.read_bytes() == b""  # created, empty, by this writer alone
        temporary.write_text("new")
        assert target.read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == ["out.json"] and target.read_text() == "new"


@pytest.mark.parametrize("stop", [SystemExit(143), KeyboardInterrupt(), ValueError("bad")])
def test_a_write_stopped_midway_leaves_the_old_file_and_nothing_else(tmp_path: Path, stop: BaseException) -> None:
    """SIGTERM's SystemExit, Ctrl-C or an error in the block: the exception passes, the target is untouched."""
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(type(stop)), atomic_path(target) as temporary:
        temporary.write_text("half")
        raise stop
    assert [path.name for path in tmp_path.iterdir()] == ["out.json"] and target.read_text() == "old"


def test_an_error_about_another_file_passes_unchanged(tmp_path: Path) -> None:
    """An OSError the block raises about a file it reads names that file, not the target."""
    source = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError) as caught, atomic_path(tmp_path / "out.jsonl"):
        source.read_text()
    assert caught.value.filename == str(source)
    assert list(tmp_path.iterdir()) == []


@given(writes=st.lists(st.tuples(st.binary(max_size=64), st.booleans()), max_size=8))
def test_the_file_is_always_the_last_write_that_finished(writes: list[tuple[bytes, bool]]) -> None:
    """Over any sequence of writes, some stopped midway: the target holds the last whole write's bytes (or does
    not exist before the first), and nothing else is ever left in the folder."""
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "out.json"
        last: bytes | None = None
        for content, stopped in writes:
            with contextlib.suppress(KeyboardInterrupt), atomic_path(target) as temporary:
                temporary.write_bytes(content[: len(content) // 2])
                if stopped:
                    raise KeyboardInterrupt
                temporary.write_bytes(content)
            if not stopped:
                last = content
            assert (target.read_bytes() if target.exists() else None) == last
            assert [p.name for p in Path(folder).iterdir()] == (["out.json"] if last is not None else [])


@given(
    text=st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), max_size=80),
    short_by=st.integers(0, 250),
    at_end=st.booleans(),
)
def test_every_name_the_system_takes_can_be_written_whole(text: str, short_by: int, at_end: bool) -> None:
    """A name of up to 255 bytes (NAME_MAX), multibyte characters included, has a temporary sibling the system takes
    too: the sibling's copy of the name is cut (at a character, not inside one) so the sibling stays within the limit."""
    padding = "r" * max(1, 255 - len(text.encode()) - short_by)  # up to 255 bytes, the characters before or after
    name = text + padding if at_end else padding + text
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / name
        with atomic_path(target) as temporary:
            assert len(temporary.name.encode()) <= 255 and temporary.name.startswith("." + name[:8])
            temporary.write_bytes(b"whole")
        assert [path.name for path in Path(folder).iterdir()] == [name] and target.read_bytes() == b"whole"


def test_a_name_longer_than_the_system_takes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A name over NAME_MAX (256 bytes) is refused with ENAMETOOLONG naming the target before the block runs: the
    whole file is not written for a rename that must fail, and nothing is left behind."""
    target = tmp_path / ("é" * 128)  # 256 bytes in UTF-8
    ran = False
    with pytest.raises(OSError) as raised, atomic_path(target):
        ran = True
    assert raised.value.errno == errno.ENAMETOOLONG and raised.value.filename == str(target)
    assert not ran and list(tmp_path.iterdir()) == []
