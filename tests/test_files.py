"""`mooncake._files.atomic_path`: a file is replaced whole or not at all, and its errors name it; a link stays
(the file it leads to is replaced), a stream (a FIFO, a device, a descriptor's name) is written in place, a folder is
refused.

The writers built on it are tested with it: `write_trace` in tests/workload/test_trace.py, the simulator's
reports in tests/sim/test_report.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
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


def write_or_stop(path: Path, content: bytes, stopped: bool) -> None:
    """Write `content` whole through `atomic_path(path)`, or half of it and stop there (Ctrl-C) when `stopped`."""
    with contextlib.suppress(KeyboardInterrupt), atomic_path(path) as temporary:
        temporary.write_bytes(content[: len(content) // 2])
        if stopped:
            raise KeyboardInterrupt
        temporary.write_bytes(content)


@given(writes=st.lists(st.tuples(st.binary(max_size=64), st.booleans()), max_size=8))
def test_the_file_is_always_the_last_write_that_finished(writes: list[tuple[bytes, bool]]) -> None:
    """Over any sequence of writes, some stopped midway: the target holds the last whole write's bytes (or does
    not exist before the first), and nothing else is ever left in the folder."""
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "out.json"
        last: bytes | None = None
        for content, stopped in writes:
            write_or_stop(target, content, stopped)
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


# --------------------------------------------------------------------------- what is already at the target


def test_a_symlink_stays_and_the_file_it_leads_to_is_replaced_whole(tmp_path: Path) -> None:
    """A link at the target was replaced by a regular file, its file never written: now the link stays and the
    file it leads to is replaced, by a sibling written beside that file (a rename stays within its folder)."""
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "target.jsonl"
    real.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to("real/target.jsonl")
    with atomic_path(link) as temporary:
        assert temporary.parent == real.parent and temporary.name.startswith(".target.jsonl.")
        temporary.write_text("new")
        assert real.read_text() == "old"
    assert os.readlink(link) == "real/target.jsonl" and real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real"]
    assert [p.name for p in real.parent.iterdir()] == ["target.jsonl"]


@given(
    writes=st.lists(st.tuples(st.binary(max_size=64), st.booleans()), min_size=1, max_size=4),
    hops=st.integers(1, 3),
    absolute=st.booleans(),
    file_there=st.booleans(),
)
def test_writing_through_links_keeps_every_link_and_fills_the_file_at_their_end(
    writes: list[tuple[bytes, bool]], hops: int, absolute: bool, file_there: bool
) -> None:
    """Through a chain of links (relative or absolute, to a file or to none yet), any writes, some stopped
    midway: every link stays as it was, the file at the chain's end holds the last whole write (or what it held),
    and no temporary sibling is left in either folder."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        (base / "data").mkdir()
        real = base / "data" / "trace.jsonl"
        last: bytes | None = None
        if file_there:
            last = b"as it was"
            real.write_bytes(last)
        links = [base / f"link{hop}" for hop in range(hops)]
        for hop, link in enumerate(links):  # link0 -> link1 -> ... -> data/trace.jsonl
            after = links[hop + 1] if hop + 1 < hops else real
            link.symlink_to(after if absolute else after.relative_to(base))
        before = {link: os.readlink(link) for link in links}
        for content, stopped in writes:
            write_or_stop(links[0], content, stopped)
            if not stopped:
                last = content
            assert {link: os.readlink(link) for link in links} == before
            assert (real.read_bytes() if real.exists() else None) == last
            assert sorted(p.name for p in base.iterdir()) == sorted(["data", *(link.name for link in links)])
            assert [p.name for p in real.parent.iterdir()] == ([real.name] if last is not None else [])


def test_a_fifo_is_written_in_place(tmp_path: Path) -> None:
    """A FIFO at the target was replaced by a regular file, its reader getting nothing: now the block writes the
    FIFO itself (a stream cannot be replaced whole), and it stays a FIFO."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open before the writer, so that its open does not block
    try:
        with atomic_path(fifo) as temporary:
            assert temporary == fifo
            temporary.write_bytes(b"line 1\nline 2\n")
        assert os.read(reader, 1024) == b"line 1\nline 2\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and list(tmp_path.iterdir()) == [fifo]


def test_a_device_is_written_in_place(tmp_path: Path) -> None:
    """A character device (/dev/null's numbers, made here) stays a device: written, never replaced by a rename,
    which as root turned /dev/stdout and would turn /dev/null into regular files."""
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as error:
        pytest.skip(f"cannot make a device node here: {error}")
    with atomic_path(device) as temporary:
        assert temporary == device
        temporary.write_bytes(b"gone")
    assert stat.S_ISCHR(os.lstat(device).st_mode) and list(tmp_path.iterdir()) == [device]


@pytest.mark.parametrize("held", ["a deleted file", "a pipe"])
def test_a_descriptors_name_is_written_through_the_descriptor(tmp_path: Path, held: str) -> None:
    """A link to /proc/self/fd/N (as /dev/stdout is to fd 1) leads to what the descriptor holds: a pipe (`| head`)
    or a file a shell opened (`> out.jsonl`), deleted since here, whose path is no longer a file to replace. It is
    written through, and the link stays."""
    read: int | None = None
    if held == "a pipe":
        read, write = os.pipe()
        os.set_blocking(read, False)
    else:
        write = os.open(tmp_path / "held.jsonl", os.O_RDWR | os.O_CREAT)
        os.unlink(tmp_path / "held.jsonl")
    link = tmp_path / "out.jsonl"
    link.symlink_to(f"/proc/self/fd/{write}")
    try:
        with atomic_path(link) as temporary:
            assert temporary == link
            temporary.write_bytes(b"whole\n")
        written = os.read(read, 1024) if read is not None else os.pread(write, 1024, 0)
        assert written == b"whole\n"
    finally:
        for descriptor in (read, write):
            if descriptor is not None:
                os.close(descriptor)
    assert link.is_symlink() and list(tmp_path.iterdir()) == [link]


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_folder_is_refused_before_anything_is_written(tmp_path: Path, through_a_link: bool) -> None:
    """A folder at the target (or a link to one) is an IsADirectoryError naming the target before the block runs,
    not after the whole file was written for a rename that must fail."""
    (tmp_path / "folder").mkdir()
    target = tmp_path / "folder"
    if through_a_link:
        target = tmp_path / "link"
        target.symlink_to("folder")
    ran = False
    with pytest.raises(IsADirectoryError) as raised, atomic_path(target):
        ran = True
    assert raised.value.filename == str(target) and not ran
    assert list((tmp_path / "folder").iterdir()) == []


# --------------------------------------------------------------------------- durability and permissions


def _spy_fsync(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[tuple[str, int, bytes | None]]:
    """Record each os.fsync as (what it synced: "file" or "folder", its inode, what `target` held then)."""
    calls: list[tuple[str, int, bytes | None]] = []
    real_fsync = os.fsync

    def spy(descriptor: int) -> None:
        status = os.fstat(descriptor)
        kind = "folder" if stat.S_ISDIR(status.st_mode) else "file"
        calls.append((kind, status.st_ino, target.read_bytes() if target.exists() else None))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_the_file_is_synced_before_the_rename_and_its_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash right after the rename must find the whole new file: its bytes are synced while the target still
    holds the old ones, then the folder (the rename is an entry of the folder) once it holds the new ones."""
    target = tmp_path / "out.json"
    target.write_text("old")
    calls = _spy_fsync(monkeypatch, target)
    with atomic_path(target) as temporary:
        temporary.write_text("new")
    assert calls == [
        ("file", os.stat(target).st_ino, b"old"),
        ("folder", os.stat(tmp_path).st_ino, b"new"),
    ]


def test_a_write_stopped_midway_syncs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync belongs to a finished write: a stopped one is removed, not synced."""
    calls = _spy_fsync(monkeypatch, tmp_path / "out.json")
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "out.json") as temporary:
        temporary.write_text("half")
        raise KeyboardInterrupt
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_a_descriptors_regular_file_is_synced_and_a_pipe_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`- > out.jsonl` (a descriptor's name leading to a regular file) is synced as it was written; a pipe has
    nothing to sync, and is never reopened."""
    held = os.open(tmp_path / "held.jsonl", os.O_RDWR | os.O_CREAT)
    read, write = os.pipe()
    try:
        for descriptor, expected in ((held, 1), (write, 0)):
            link = tmp_path / f"fd{descriptor}"
            link.symlink_to(f"/proc/self/fd/{descriptor}")
            calls = _spy_fsync(monkeypatch, tmp_path / "held.jsonl")
            with atomic_path(link) as temporary:
                temporary.write_bytes(b"whole\n")
            assert [call[:2] for call in calls] == [("file", os.fstat(held).st_ino)] * expected
    finally:
        for descriptor in (held, read, write):
            os.close(descriptor)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_a_file_replaced_keeps_its_permissions(tmp_path: Path, mode: int) -> None:
    """A private 0600 trace stays private when rewritten (the sibling, made with the umask's mode, takes the old
    file's bits before the rename), through a link too."""
    target = tmp_path / "private.jsonl"
    target.write_text("old")
    os.chmod(target, mode)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target.name)
    for path in (target, link):
        with atomic_path(path) as temporary:
            temporary.write_text("new")
        assert stat.S_IMODE(os.stat(target).st_mode) == mode and target.read_text() == "new"


def test_a_new_file_gets_the_umasks_permissions(tmp_path: Path) -> None:
    """A new file is made as `open` makes one: 0666 less the umask (not mkstemp's 0600)."""
    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "new.jsonl") as temporary:
            temporary.write_text("new")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.jsonl").st_mode) == 0o640


def _write_trace(path: Path) -> None:
    from mooncake.workload import generate_requests, preset, write_trace

    write_trace(path, generate_requests(preset("synthetic"), num_requests=3, seed=0))


def _write_json(path: Path) -> None:
    from mooncake.sim.report import write_json

    write_json({"a": 1}, path)


def _write_csv(path: Path) -> None:
    from mooncake.sim.report import write_records_csv

    write_records_csv([], path)


def _plot(path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mooncake.sim.report import plot_cdfs

    plot_cdfs({"a": [1.0, 2.0]}, path, xlabel="x")


@pytest.mark.parametrize(
    ("write", "name"),
    [
        (_write_trace, "t.jsonl"),
        (_write_trace, "t.jsonl.gz"),
        (_write_json, "s.json"),
        (_write_csv, "r.csv"),
        (_plot, "p.png"),
    ],
)
def test_every_writer_of_a_whole_file_syncs_it_and_keeps_its_permissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Path], None], name: str
) -> None:
    """The trace, report and plot writers all go through `atomic_path`: the file synced once before the rename and
    the folder once after, a replaced file's 0600 kept."""
    target = tmp_path / name
    target.write_text("old")
    os.chmod(target, 0o600)
    calls = _spy_fsync(monkeypatch, target)
    write(target)
    assert [(kind, before) for kind, _, before in calls] == [("file", b"old"), ("folder", target.read_bytes())]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
