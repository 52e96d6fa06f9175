"""The error tree: every error the library defines is in `mooncake.errors`, exported and drawn in its docstring.

api.md says `mooncake.errors` lists them all, so a server catching one by name finds it there; an error defined
in a submodule and raised to callers (the wire's ProtocolError was) would otherwise be listed nowhere.
"""

from __future__ import annotations

import importlib
import pkgutil

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
