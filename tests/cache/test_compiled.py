"""Tests for `mooncake.cache._compiled.jit`: a kernel numba cannot cache on disk is compiled in memory.

numba caches a `cache=True` kernel beside its source file or under the user's cache folder; a read-only
install run by a user without a writable home has neither, and numba then raises at decoration time. A
function compiled from source text has no file at all, the same "no locator" case on any machine.
"""

from __future__ import annotations

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
