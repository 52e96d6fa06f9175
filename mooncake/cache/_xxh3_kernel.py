"""Numba-compiled chained XXH3-64 over many requests (the batch path of `hashing`).

The hash itself is the xxhash library's own C routine (`XXH3_64bits_withSeed`,
runtime-dispatched to the best SIMD width), reached through ctypes from
nopython code, so the compiled path cannot drift from the per-request Python
path: both call the same function on the same bytes. What numba adds is the
loop: per block it writes the parent key and the block's tokens into a scratch
buffer (``le64(parent) || le32(tokens)``) and hashes it, with no Python object
per block, and it spreads requests over threads (chains are sequential within
a request, independent across requests).

Compilation is lazy (first use) and not cached on disk: a function that calls a
ctypes pointer cannot be cached by numba. `load_kernels()` returns None where
the xxhash C symbols cannot be found; `hashing` then uses its Python path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["Kernels", "load_kernels"]

_SYMBOLS = ("XXH3_64bits_withSeed_dispatch", "XXH3_64bits_withSeed")


def _find_xxh3_64() -> Any | None:
    """The C function XXH3_64bits_withSeed from the xxhash extension or a system libxxhash."""
    candidates: list[str] = []
    try:
        import xxhash._xxhash as extension

        candidates.append(str(extension.__file__))
    except ImportError:  # pragma: no cover - xxhash is a core dependency
        pass
    system = ctypes.util.find_library("xxhash")
    if system:
        candidates.append(system)
    for path in candidates:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SYMBOLS:
            function = getattr(library, name, None)
            if function is not None:
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
                function.restype = ctypes.c_uint64
                return function
    return None


class Kernels:
    """The compiled chain kernels.

    ``single(tokens, parent, block_size, seed, out)`` hashes one request's tokens
    in blocks of `block_size` (the last may be partial), chaining from `parent`,
    into `out`. ``parallel(tokens, token_offsets, parents, block_size, seed, out,
    out_offsets)`` does the same for request r = ``tokens[token_offsets[r]:
    token_offsets[r+1]]`` from ``parents[r]`` into ``out[out_offsets[r]:]``, with
    requests spread over threads.
    """

    def __init__(self, single: Callable[..., None], parallel: Callable[..., None]) -> None:
        self.single = single
        self.parallel = parallel


@functools.cache
def load_kernels() -> Kernels | None:
    """Compile (once per process) and return the kernels, or None without the C symbol."""
    xxh3 = _find_xxh3_64()
    if xxh3 is None:
        return None
    import numba
    import numpy as np

    memmove = ctypes.memmove  # a ctypes function pointer numba can call, like xxh3

    def chain(tokens, start, stop, parent, block_size, seed, out, k):  # type: ignore[no-untyped-def]
        # Scratch holds le64(parent) followed by one block of le32 tokens; numpy's
        # native order is little-endian on every platform numba targets here.
        scratch = np.empty(8 + 4 * block_size, np.uint8)
        parent_slot = scratch[:8].view(np.uint64)
        base = scratch.ctypes.data
        source = tokens.ctypes.data
        while start < stop:
            end = min(start + block_size, stop)
            parent_slot[0] = parent
            memmove(base + 8, source + 4 * start, 4 * (end - start))
            parent = xxh3(base, 8 + 4 * (end - start), seed)
            out[k] = parent
            k += 1
            start = end

    chain_jit = numba.njit(nogil=True)(chain)

    @numba.njit(nogil=True)
    def single(tokens, parent, block_size, seed, out):  # type: ignore[no-untyped-def]
        chain_jit(tokens, 0, tokens.size, parent, block_size, seed, out, 0)

    @numba.njit(nogil=True, parallel=True)
    def parallel(tokens, token_offsets, parents, block_size, seed, out, out_offsets):  # type: ignore[no-untyped-def]
        for r in numba.prange(token_offsets.size - 1):
            chain_jit(tokens, token_offsets[r], token_offsets[r + 1], parents[r], block_size, seed, out, out_offsets[r])

    return Kernels(single=single, parallel=parallel)
