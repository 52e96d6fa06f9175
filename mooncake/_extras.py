"""Optional packages and the extras that install them, so that a missing one reads the same everywhere.

The core (`mooncake`, `mooncake.cache`, `mooncake.sched`, `mooncake.workload`) needs only attrs, numpy and
xxhash; everything else is imported lazily, where it is first used. Such an import goes inside
`with needs_extra("what needs it"):`; if it fails because one of the packages of `EXTRAS` is missing, the
caller gets a `ConfigError` naming the package and the extra of pyproject.toml that installs it, instead of
a bare `ModuleNotFoundError` deep in a call. Any other import failure (a module of this package, a package
no extra lists) passes through unchanged: its own traceback says more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mooncake.errors import ConfigError

__all__ = ["EXTRAS", "missing_extra", "needs_extra", "script_needs_extra"]

# Top-level import name -> the extra of pyproject.toml's [project.optional-dependencies] that installs it.
EXTRAS = {
    "aiohttp": "cluster",
    "jinja2": "hf",
    "matplotlib": "plot",
    "msgpack": "kv-events",
    "numba": "accel",
    "prometheus_client": "cluster",
    "ray": "ray",
    "safetensors": "hf",
    "tokenizers": "hf",
    "torch": "engine",
    "zmq": "kv-events",
}


def missing_extra(needed_by: str, package: str) -> ConfigError:
    """The error for `needed_by` (what the caller was doing) lacking `package`, naming the extra to install.

    Raises:
        KeyError: `package` is not one of `EXTRAS` (a programming error here, not the user's).
    """
    extra = EXTRAS[package]
    return ConfigError(f"{needed_by} needs {package}: the {extra} extra (pip install -e '.[{extra}]' in the checkout)")


@contextlib.contextmanager
def needs_extra(needed_by: str) -> Iterator[None]:
    """Run the imports of the block; one that fails for want of an extra's package becomes a `ConfigError`.

    Args:
        needed_by: what needs the imports, the subject of the message ("encode_batch", "load_tokenizer").

    Raises:
        ConfigError: an import in the block failed and the missing module is (inside) a package of
            `EXTRAS`; the message names the package and its extra, and the import error is its cause.
    """
    try:
        yield
    except ModuleNotFoundError as error:  # a package that is there but lacks a name (too old) says so itself
        package = (error.name or "").partition(".")[0]
        if package not in EXTRAS:
            raise
        raise missing_extra(needed_by, package) from error


@contextlib.contextmanager
def script_needs_extra(program: str) -> Iterator[None]:
    """`needs_extra` for a script's top-level imports: a missing extra ends the script with a one-line message.

    Args:
        program: the script's name, the prefix of its messages ("cluster", "load").

    Raises:
        SystemExit: an import in the block failed for want of an extra's package; the message is
            "PROGRAM: " and the `ConfigError` that names the package and the extra, with no traceback.
    """
    try:
        with needs_extra(f"examples/{program}.py"):
            yield
    except ConfigError as missing:
        raise SystemExit(f"{program}: {missing}") from None
