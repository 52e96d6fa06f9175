"""Numba-compiled chained XXH3-64 (the compiled path of `hashing`), imported on first use.

The hash itself is the xxhash library's own C routine (`XXH3_64bits_withSeed`,
runtime-dispatched to the best SIMD width): its shared object is loaded into
LLVM's symbol table and the kernels call it by name, so the compiled path cannot
drift from the per-request Python path (both run the same function on the same
bytes) and numba can cache the kernels on disk. What numba adds is the loop: per
block it writes the parent key and the block's tokens into a scratch buffer
(``le64(parent) || le32(tokens)``) and hashes it, with no Python object per
block, and `parallel` spreads requests over threads (chains are sequential
within a request, independent across requests).

Importing this module raises ImportError where numba (an optional dependency,
the `accel` extra) or the xxhash C symbols are missing; `hashing` then runs its
plain loop over xxhash's Python API, which gives the same keys.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import llvmlite.binding
import numba
import numpy as np
from numba import types

__all__ = ["parallel", "single"]


def _load_xxh3() -> str:
    """Load a library exporting XXH3-64 into LLVM's symbol table; the symbol's name."""
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
        for name in ("XXH3_64bits_withSeed_dispatch", "XXH3_64bits_withSeed"):
            if hasattr(library, name):
                llvmlite.binding.load_library_permanently(path)
                return name
    raise ImportError("no library exporting XXH3_64bits_withSeed was found")


# Pointers travel as uintp: the C ABI passes them like size_t on every 64-bit target.
_xxh3 = types.ExternalFunction(_load_xxh3(), types.uint64(types.uintp, types.uintp, types.uint64))
_memmove = types.ExternalFunction("memmove", types.uintp(types.uintp, types.uintp, types.uintp))


@numba.njit(cache=True, nogil=True)
def _chain(tokens, start, stop, parent, block_size, seed, out, k):  # type: ignore[no-untyped-def]
    # Scratch holds le64(parent) followed by one block of le32 tokens; numpy's
    # native order is little-endian on every platform numba targets here.
    scratch = np.empty(8 + 4 * block_size, np.uint8)
    parent_slot = scratch[:8].view(np.uint64)
    base = scratch.ctypes.data
    source = tokens.ctypes.data
    while start < stop:
        end = min(start + block_size, stop)
        parent_slot[0] = parent
        _memmove(base + 8, source + 4 * start, 4 * (end - start))
        parent = _xxh3(base, 8 + 4 * (end - start), seed)
        out[k] = parent
        k += 1
        start = end


@numba.njit(cache=True, nogil=True)
def single(tokens, parent, block_size, seed, out):  # type: ignore[no-untyped-def]
    """Hash one request's tokens in blocks of `block_size` (the last may be partial), chaining from `parent`."""
    _chain(tokens, 0, tokens.size, parent, block_size, seed, out, 0)


@numba.njit(cache=True, nogil=True, parallel=True)
def parallel(tokens, token_offsets, parents, block_size, seed, out, out_offsets):  # type: ignore[no-untyped-def]
    """Request r = ``tokens[token_offsets[r]:token_offsets[r+1]]`` from ``parents[r]`` into ``out[out_offsets[r]:]``."""
    for r in numba.prange(token_offsets.size - 1):
        _chain(tokens, token_offsets[r], token_offsets[r + 1], parents[r], block_size, seed, out, out_offsets[r])
