"""The error tree: every error the library defines is in `mooncake.errors`, exported and drawn in its docstring.

api.md says `mooncake.errors` lists them all, so a server catching one by name finds it there; an error defined
in a submodule and raised to callers (the wire's ProtocolError was) would otherwise be listed nowhere.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import mooncake
import mooncake.errors as errors


def every_error() -> set[type[BaseException]]:
    """The MooncakeError subclasses of every mooncake module, private ones (a leading underscore) left out."""
    for module in pkgutil.walk_packages(mooncake.__path__, "mooncake."):
        importlib.import_module(module.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [errors.MooncakeError]
    while todo:
        error = todo.pop()
        found.add(error)
        todo.extend(error.__subclasses__())
    return {error for error in found if error.__module__.startswith("mooncake") and not error.__name__.startswith("_")}


def test_every_error_is_defined_exported_and_drawn_in_mooncake_errors() -> None:
    tree = errors.__doc__ or ""
    for error in every_error():
        assert error.__module__ == "mooncake.errors", f"{error.__name__} is defined in {error.__module__}"
        assert error.__name__ in errors.__all__, error.__name__
        assert f" {error.__name__}" in tree, f"{error.__name__} is not in the tree in mooncake.errors' docstring"


def _sample(name: str) -> BaseException:
    """One instance of the error named `name`, made with the arguments its constructor takes."""
    if name == "TraceFormatError":
        return errors.TraceFormatError("traces/t.jsonl", 3, "timestamp must be a number")
    if name == "SequenceGapError":
        from mooncake.cache.events import SequenceGap

        gap = SequenceGap(source="p0", expected_epoch=1, expected_seq=5, received_epoch=1, received_seq=9)
        return errors.SequenceGapError(gap)
    if name == "DiskError":
        return errors.DiskError(5, "Input/output error reading page 7", "pool.bin")
    return getattr(errors, name)(f"{name} about value 7")


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_crosses_a_process_boundary_unchanged(name: str) -> None:
    """A worker's error reaches its parent by pickle (multiprocessing, a process pool): every error comes back of
    its class, with its message, its arguments and its attributes (TraceFormatError's path, line and reason did
    not unpickle at all; SequenceGapError came back with a message of question marks)."""
    error = _sample(name)
    error.request_id = "r7"  # type: ignore[attr-defined]  # set where one request's failure is raised among others
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error) and back.request_id == "r7"  # type: ignore[attr-defined]
