"""numba as an optional accelerator: the one switch between compiled and plain kernels.

The per-key loops of the index's key table (`_key_table_kernels`), the
per-block loop of the batch hasher (`_xxh3_kernel`) and the Conductor's loops
over instances and blocks (`mooncake.sched._kernels`, loaded through `kernels`)
are compiled with numba when it imports (the `accel` extra). Without numba the
same work runs in plain Python: the key-table and scan kernels are the very same
functions, left undecorated, on the same arrays; the hasher calls xxhash's
Python API on the same bytes; the Conductor's pending blocks are counted in
Python dicts. Both paths give identical keys, tables and answers; the plain one
is slower.

The path is chosen on first use: compiled iff numba imports, unless
`use_compiled` says otherwise (tests run both paths in one process; a process
may also skip numba's compile). Nothing here reads the environment.

Invariants:
- `is_compiled()` implies `numba_available()`.
- `plain_kernels(module)` calls no numba code, even where the module's functions
  are numba dispatchers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from types import FunctionType, ModuleType, SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from mooncake._checks import shown
from mooncake._extras import missing_extra

__all__ = ["compiled_path", "is_compiled", "jit", "kernels", "numba_available", "plain_kernels", "use_compiled"]

_F = TypeVar("_F", bound=Callable[..., Any])

# None: the default (compiled iff numba imports); True / False: forced by `use_compiled`.
_forced: list[bool | None] = [None]

# compiled? -> module name -> its kernels, loaded on first use of each path.
_LOADED: dict[bool, dict[str, SimpleNamespace]] = {True: {}, False: {}}


@functools.cache
def numba_available() -> bool:
    """Whether numba imports here (checked once per process)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def use_compiled(enabled: bool | None) -> bool | None:
    """Force the compiled path on (True) or off (False), or restore the default (None).

    Takes effect for hashers on their next call and for key tables created
    afterwards (a table keeps the kernels it was built with).

    Returns:
        The previous setting, to restore it.

    Raises:
        ConfigError: `enabled` is True but numba does not import.
    """
    if enabled and not numba_available():
        raise missing_extra(f"use_compiled({shown(enabled)})", "numba")
    previous = _forced[0]
    _forced[0] = enabled
    return previous


@contextlib.contextmanager
def compiled_path(enabled: bool | None) -> Iterator[None]:
    """`use_compiled(enabled)` for the duration of a with-block, then the previous setting again."""
    previous = use_compiled(enabled)
    try:
        yield
    finally:
        use_compiled(previous)


def is_compiled() -> bool:
    """Whether kernels are compiled now: as forced by `use_compiled`, else iff numba imports."""
    forced = _forced[0]
    return numba_available() if forced is None else forced


def jit(**options: Any) -> Callable[[_F], _F]:
    """`numba.njit(**options)` where numba imports; else a decorator returning the function unchanged.

    With `cache=True`, a function numba finds nowhere to cache on disk (an install it cannot write beside,
    with no writable `~/.cache` and no `NUMBA_CACHE_DIR`: a read-only container running as another user)
    is compiled without the disk cache, in memory once per process, instead of failing the import.
    """
    if not numba_available():
        return lambda function: function
    import numba

    def decorate(function: _F) -> _F:
        try:
            return numba.njit(**options)(function)  # type: ignore[no-any-return]
        except RuntimeError as error:
            if not options.get("cache") or "cannot cache" not in str(error):
                raise
            return numba.njit(**{**options, "cache": False})(function)  # type: ignore[no-any-return]

    return decorate


def plain_kernels(module: ModuleType) -> dict[str, Callable[..., Any]]:
    """The functions `module.__all__` names, as plain Python calling plain Python.

    Each of the module's functions (the `py_func` of a numba dispatcher) is
    rebound to a copy of the module's globals in which its callees are plain
    copies too (a kernel compiled from another module's function: that plain
    function itself, which calls no numba code). numba integers wrap silently
    where numpy scalars warn on overflow, so the entry points run with overflow
    warnings off.
    """
    namespace = dict(vars(module))
    for name, value in vars(module).items():
        function = getattr(value, "py_func", value)
        if isinstance(function, FunctionType) and function.__module__ == module.__name__:
            namespace[name] = FunctionType(
                function.__code__, namespace, name, function.__defaults__, function.__closure__
            )
        elif function is not value:  # compiled from another module's plain function: that function as it is
            namespace[name] = function
    return {name: _wrapping(namespace[name]) for name in module.__all__}


def _wrapping(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any) -> Any:
        with np.errstate(over="ignore"):
            return function(*args)

    return call


def kernels(module_name: str) -> Any:
    """The functions the kernel module `module_name` lists in `__all__`, on the path in use now
    (`is_compiled()`: its numba dispatchers, else `plain_kernels`), as attributes; the module is
    imported on first use, so that importing its caller does not load numba."""
    compiled = is_compiled()
    loaded = _LOADED[compiled].get(module_name)
    if loaded is None:
        module = importlib.import_module(module_name)
        functions = {name: getattr(module, name) for name in module.__all__} if compiled else plain_kernels(module)
        loaded = _LOADED[compiled][module_name] = SimpleNamespace(**functions)
    return loaded
