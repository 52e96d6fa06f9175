"""Files written whole or not at all: a temporary sibling, renamed onto the target once complete.

The sibling, `.NAME.PID.UUID.tmp` beside the target, is created exclusively, so
two writers of one target (two runs sharing an `--out`) never share it; NAME is
the target's name cut to `NAME_BYTES` bytes, so that any name the system takes
(up to 255 bytes) has a sibling it takes too; a longer name is refused before
anything is written. The sibling is removed however the write ends (an error, Ctrl-C, the SystemExit the command
lines make of SIGTERM), and a failure to write it is reported against the
target: the hidden name means nothing to the user who asked for the target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "names_a_file"]

# The sibling adds at most 49 bytes (two dots, a pid of up to 10 digits, 32 hex digits, ".tmp") to its NAME part:
# cut to this, it stays within NAME_MAX (255 bytes on every Linux file system).
NAME_BYTES = 200
NAME_MAX = 255


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
    """A fresh temporary sibling of `path` to write the whole file into, renamed onto `path` when the block ends.

    The sibling is created empty with "x" (not mkstemp), so the final file gets
    the usual umask permissions rather than 0600; reopen it to write.

    Yields:
        The temporary sibling.

    Raises:
        OSError: the file cannot be written, named by `path`; an error the block
            raises about another file (one it reads) passes unchanged. Nothing
            is left behind either way.
    """
    target = Path(path)
    _check_name(target)
    temporary = target.with_name(f".{_cut(target.name)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "xb"):
            pass
        yield temporary
        os.replace(temporary, target)
    except OSError as error:
        _remove(temporary)
        if error.filename not in (None, os.fspath(temporary)):
            raise  # about another file (the block's source)
        raise type(error)(error.errno, error.strerror, os.fspath(target)) from error
    except BaseException:
        _remove(temporary)
        raise


def _check_name(target: Path) -> None:
    """Refuse a name longer than its folder takes before anything is written: the sibling's name is cut to
    fit, so the rename would be the first to fail, after the whole file had been written for nothing."""
    try:
        limit = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such folder (the sibling's open names that), or no limit to ask for
        limit = NAME_MAX
    if len(os.fsencode(target.name)) > limit:
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
