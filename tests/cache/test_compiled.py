"""Tests for `mooncake.cache._compiled.jit`: a kernel numba cannot cache on disk is compiled in memory.

numba caches a `cache=True` kernel beside its source file or under the user's cache folder; a read-only
install run by a user without a writable home has neither, and numba then raises at decoration time. A
function compiled from source text has no file at all, the same "no locator" case on any machine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mooncake.cache._compiled import jit, numba_available

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


def _function_without_a_file() -> object:
    namespace: dict[str, object] = {}
    exec(compile("def twice(x):\n    return 2 * x\n", "<generated>", "exec"), namespace)
    return namespace["twice"]


def test_a_kernel_with_nowhere_to_cache_is_compiled_without_the_disk_cache() -> None:
    import numba

    function = _function_without_a_file()
    with pytest.raises(RuntimeError, match="cannot cache"):
        numba.njit(cache=True)(function)  # what numba itself does: the case is real
    kernel = jit(cache=True, nogil=True)(function)
    assert isinstance(kernel, numba.core.registry.CPUDispatcher)
    assert kernel(21) == 42


def test_warm_up_compiles_every_kernel_the_cache_calls() -> None:
    """`python -m mooncake.cache.warm_up` (which make runs after installing, through the scheduler's) leaves every
    kernel the key table and the hasher call compiled, so no server pays a compilation on its first request.
    Checked in a fresh process: in this one, earlier tests may have compiled them already."""
    probe = (
        "from mooncake.cache import _key_table_kernels as table, _xxh3_kernel as hashing, warm_up\n"
        "warm_up.main()\n"
        "for module in (table, hashing):\n"
        "    for name in module.__all__:\n"
        "        print(module.__name__, name, len(getattr(module, name).signatures))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    counts = [line.split() for line in done.stdout.splitlines()]
    assert len(counts) == 8, done.stdout
    assert [line[1] for line in counts if line[2] == "0"] == [], done.stdout
