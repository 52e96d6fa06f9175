"""Files written whole or not at all: a temporary sibling, renamed onto the target once complete.

The sibling, `.NAME.PID.UUID.tmp` beside the target, is created exclusively, so
two writers of one target (two runs sharing an `--out`) never share it; NAME is
the target's name cut to `NAME_BYTES` bytes, so that any name the system takes
(up to 255 bytes) has a sibling it takes too; a longer name is refused before
anything is written. The sibling is removed however the write ends (an error, Ctrl-C, the SystemExit the command
lines make of SIGTERM, SIGHUP or SIGQUIT), and a failure to write it is reported against the
target: the hidden name means nothing to the user who asked for the target.

Whole also after a crash or a power cut: the sibling is synced to the disk
before the rename, and the folder after it (a rename is an entry of the folder,
which the file's own sync does not write), so the target is the old file or the
whole new one, never an empty or torn one. A file replaced keeps its permission
bits (a 0600 trace stays 0600); a new one gets the umask's, as `open` makes it.
This is the one place that does it: every writer of a whole file calls
`atomic_path`.

What is already at the target decides where the bytes go, so that nothing but
a regular file is ever replaced: a symbolic link stays and the file it leads to
is replaced (the sibling beside that file, where the rename stays within one
file system); a stream (a FIFO, a terminal, /dev/null, any file that is not a
regular one) and an open descriptor's name (/dev/stdout, /dev/fd/N,
/proc/PID/fd/N, or a link to one) are written directly, as a shell's `>` writes
them, since a rename would replace the device node or the link and no reader
would see a byte (a stream cannot be replaced whole anyway); a folder is refused
before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "names_a_file"]

# The sibling adds at most 49 bytes (two dots, a pid of up to 10 digits, 32 hex digits, ".tmp") to its NAME part:
# cut to this, it stays within NAME_MAX (255 bytes on every Linux file system).
NAME_BYTES = 200
NAME_MAX = 255

# Where a process's descriptors are named, after links (/dev/fd is /proc/self/fd; /proc/thread-self/fd a task's).
_DESCRIPTOR_FOLDER = re.compile(r"/proc/[^/]+(?:/task/[^/]+)?/fd")
_MAX_LINKS = 40  # Linux's own limit on links followed in one lookup (MAXSYMLINKS)


def names_a_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path`, as written, can name a file: its last component is not "", "." or "..". pathlib drops a
    trailing slash or "/.", so "out/" and "out.jsonl/." (POSIX: a folder, or nothing) would name `out` and
    `out.jsonl` to it, and a writer would replace them."""
    text = os.fspath(path)
    for separator in {"/", os.sep}:
        text = text.rsplit(separator, 1)[-1]
    return text not in ("", ".", "..")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """The path to write the whole file at `path` to, in place when the block ends.

    For a new path or a regular file: a fresh temporary sibling, renamed onto
    `path` when the block ends. For a symbolic link (to a file or to nothing
    yet): a sibling of the file it leads to, renamed onto that file; the link
    stays. For a stream (a FIFO, a terminal, any file that is not a regular one)
    or an open descriptor's name (/dev/stdout, /dev/fd/N): `path` itself, written
    as it goes. The sibling is created empty with "x" (not mkstemp), so a new
    file gets the usual umask permissions rather than 0600; a file replaced
    keeps its own. Reopen it to write, and close it before the block ends.

    When the block ends, what it wrote is synced to the disk (os.fsync) before
    the rename, and the folder after it; a descriptor's name that leads to a
    regular file (`- > out.jsonl`) is synced too; a FIFO, a terminal or a
    device has nothing to sync.

    Yields:
        The path to open and write whole.

    Raises:
        OSError: the file cannot be written, named by `path`; a folder at `path` (IsADirectoryError) before the
            block runs; an error the block raises about another file (one it reads) passes unchanged. Nothing is
            left behind either way.
    """
    target = Path(path)
    if _is_descriptor(target) or _is_stream(target):
        with _named(target, target):
            yield target
            _sync_if_regular(target)
        return
    # A link stays: its file is replaced, the sibling beside that file (a rename cannot cross file systems).
    real = Path(os.path.realpath(target)) if target.is_symlink() else target
    _check_name(real, target)
    temporary = real.with_name(f".{_cut(real.name)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with _named(target, temporary):
            with open(temporary, "xb"):
                pass
            yield temporary
            _sync(temporary)
            _keep_mode(real, temporary)
            os.replace(temporary, real)
            _sync_folder(real.parent)
    finally:
        _remove(temporary)


def _sync(path: Path) -> None:
    """Write `path`'s data to the disk: the block has closed its own descriptor, and an fsync through any descriptor
    of the file syncs the file (a read-only one needs no write permission the file may not grant)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_if_regular(target: Path) -> None:
    """Sync a regular file reached by a descriptor's name (a shell's `> out.jsonl`); a stream is never reopened (a
    FIFO's open would wait for a writer)."""
    if stat.S_ISREG(os.stat(target).st_mode):
        _sync(target)


def _keep_mode(real: Path, temporary: Path) -> None:
    """Give the sibling the permission bits of the file it replaces (as click's atomic write does); a new file keeps
    the umask's."""
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return
    os.chmod(temporary, stat.S_IMODE(mode))


def _sync_folder(folder: Path) -> None:
    """Sync the folder's entries, so that the rename itself survives a crash."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno != errno.EINVAL:  # a file system that cannot sync a folder (some network ones) says EINVAL
            raise
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _named(target: Path, written: Path) -> Iterator[None]:
    """An OSError about `written` (or about no file: a failed write, fsync or rename) as one about `target`."""
    try:
        yield
    except OSError as error:
        if error.filename not in (None, os.fspath(written), os.fspath(target)):
            raise  # about another file (the block's source)
        # io's own errors have a message and no errno (a PNG's writer seeks, which a FIFO cannot).
        raise type(error)(error.errno, error.strerror or str(error), os.fspath(target)) from error


def _is_stream(target: Path) -> bool:
    """Whether `target` is there and no regular file (a FIFO, a device), which is written in place.

    Raises:
        IsADirectoryError: `target` is a folder (or a link to one).
        OSError: `target` cannot be looked up (a loop of links, a file where a folder should be), named by it.
    """
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:  # nothing there yet, or a link to nothing yet: a new file
        return False
    except OSError as error:
        raise type(error)(error.errno, error.strerror, os.fspath(target)) from error
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(target))
    return not stat.S_ISREG(mode)


def _is_descriptor(target: Path) -> bool:
    """Whether `target`, following its links, names an open descriptor (/dev/stdout, /dev/fd/1, /proc/PID/fd/N).

    Such a name leads on to whatever the descriptor holds, which for a shell's
    `> out.jsonl` is a regular file: replacing that file by a rename would leave
    the shell's descriptor on the old one, and a descriptor of a deleted file
    resolves to no path at all (`NAME (deleted)`)."""
    try:
        current = os.path.abspath(target)
    except OSError:  # a relative name in a folder since deleted: no descriptor, and the write will say why
        return False
    for _ in range(_MAX_LINKS):
        folder = os.path.realpath(os.path.dirname(current))
        if _DESCRIPTOR_FOLDER.fullmatch(folder):
            return True
        try:
            link = os.readlink(current)
        except OSError:  # no link (or nothing there): the end of the chain
            return False
        current = os.path.join(folder, link)  # an absolute link replaces the folder
    return False


def _check_name(real: Path, target: Path) -> None:
    """Refuse a name longer than its folder takes before anything is written (named by `target`, the path asked
    for): the sibling's name is cut to fit, so the rename would be the first to fail, after the whole file had been
    written for nothing."""
    try:
        limit = os.pathconf(real.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such folder (the sibling's open names that), or no limit to ask for
        limit = NAME_MAX
    if len(os.fsencode(real.name)) > limit:
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), os.fspath(target))


def _remove(temporary: Path) -> None:
    # Removing it may fail as the write did (its folder is no folder): that must not replace the write's error.
    with contextlib.suppress(OSError):
        temporary.unlink(missing_ok=True)


def _cut(name: str) -> str:
    """The longest start of `name` whose file-system encoding has at most `NAME_BYTES` bytes."""
    name = name[:NAME_BYTES]
    while len(os.fsencode(name)) > NAME_BYTES:
        name = name[:-1]
    return name
