"""Write the reference tables of docs/api.md from the code: the `__all__` of each package or module
it has a section for (`mooncake`, its subpackages, `mooncake.errors`, `mooncake.types`), in order,
with each name's kind and the first sentence of its docstring (a constant: its value, or its type).

    python docs/make_api.py          # rewrite the tables in docs/api.md
    python docs/make_api.py --check  # exit 1 if they are not what the code says (tests/test_docs.py)

Only the text between ``<!-- api: PACKAGE -->`` and ``<!-- /api -->`` is generated; the prose and
the examples around it are written by hand (and run by tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

API_MD = Path(__file__).resolve().parent / "api.md"
SECTION = re.compile(r"(<!-- api: ([\w.]+) -->\n)(.*?)(<!-- /api -->)", re.DOTALL)


def kind_of(value: Any) -> str:
    if isinstance(value, type):
        if issubclass(value, BaseException):
            return "error"
        if issubclass(value, enum.Enum):
            return "enum"
        if getattr(value, "_is_protocol", False):
            return "protocol"
        return "class"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return "function"
    if isinstance(value, types.UnionType | typing.NewType) or typing.get_origin(value) is not None:
        return "type"
    if isinstance(value, dict):
        return "table"
    return "constant"


def summary_of(value: Any) -> str:
    """The docstring's first sentence; for a table, its keys; for a constant, its value."""
    if isinstance(value, dict):
        return "keys: " + ", ".join(f"`{key}`" for key in value)
    if isinstance(value, typing.NewType):
        return f"a distinct `{value.__supertype__.__name__}` (`typing.NewType`)"
    if kind_of(value) == "type":
        shown = re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", repr(value))  # names without their modules
        return f"`{shown}`" if len(shown) <= 100 else f"a union of {len(typing.get_args(value))} types"
    if kind_of(value) == "constant":
        kind = type(value).__name__
        return f"`{value!r}`" if len(repr(value)) <= 60 else f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} `{kind}`"
    doc = inspect.getdoc(value) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    return re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s", first, maxsplit=1)[0]  # "e.g." ends no sentence


def table(package: str) -> str:
    module = importlib.import_module(package)
    rows = ["| name | kind | what |", "| --- | --- | --- |"]
    for name in module.__all__:
        if name.startswith("__"):
            continue
        value = getattr(module, name)
        what = summary_of(value).replace("|", "\\|")  # a pipe would end the table's cell
        rows.append(f"| `{name}` | {kind_of(value)} | {what} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    return SECTION.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md's tables are out of date")
    args = parser.parse_args(argv)
    text = API_MD.read_text()
    wanted = render(text)
    if args.check:
        if wanted != text:
            print(f"{API_MD} is out of date: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
