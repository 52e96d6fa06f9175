"""Numba-compiled chained XXH3-64 (the compiled path of `hashing`), imported on first use.

The hash itself is the xxhash library's own C code (XXH3-64's streaming state:
reset with the seed, update, digest; the update runtime-dispatched to the best
SIMD width): its shared object is loaded into LLVM's symbol table and the
kernels call it by name, so the compiled path cannot drift from the per-request
Python path (both run the same function on the same bytes) and numba can cache
the kernels on disk. What numba adds is the loop: per block it feeds the state
``le64(parent)`` and then the block's tokens straight from the caller's array,
with no Python object and no copy of the block (a 2 KB copy per block into a
scratch buffer, the previous way, halved the rate once the tokens no longer fit
in cache), and `parallel` spreads requests over threads (chains are sequential
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

from mooncake.cache._compiled import jit

__all__ = ["parallel", "single"]


def _load_xxh3() -> str:
    """Load a library exporting XXH3-64's streaming API into LLVM's symbol table; the update's name."""
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
        if not all(hasattr(library, name) for name in ("XXH3_64bits_reset_withSeed", "XXH3_64bits_digest")):
            continue
        for update in ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"):
            if hasattr(library, update):
                llvmlite.binding.load_library_permanently(path)
                return update
    raise ImportError("no library exporting XXH3-64's streaming API (reset_withSeed, update, digest) was found")


# Pointers travel as uintp: the C ABI passes them like size_t on every 64-bit target.
_reset = types.ExternalFunction("XXH3_64bits_reset_withSeed", types.intc(types.uintp, types.uint64))
_update = types.ExternalFunction(_load_xxh3(), types.intc(types.uintp, types.uintp, types.uintp))
_digest = types.ExternalFunction("XXH3_64bits_digest", types.uint64(types.uintp))
# XXH3_state_t is 576 bytes, 64-byte aligned, in xxhash 0.8; room to spare for another layout.
_STATE_BYTES = 2048
_STATE_ALIGN = 64


@jit(cache=True, nogil=True)
def _chain(tokens, start, stop, parent, block_size, seed, out, k):  # type: ignore[no-untyped-def]
    # numpy's native order is little-endian on every platform numba targets here,
    # so the parent slot and the tokens are already le64 and le32.
    raw = np.empty(_STATE_BYTES + _STATE_ALIGN, np.uint8)
    parent_slot = np.empty(1, np.uint64)
    source = tokens.ctypes.data
    while start < stop:
        end = min(start + block_size, stop)
        # Taken from `raw` inside the loop so that numba keeps `raw` alive while C writes to it.
        state = (raw.ctypes.data + _STATE_ALIGN - 1) // _STATE_ALIGN * _STATE_ALIGN
        parent_slot[0] = parent
        _reset(state, seed)
        _update(state, parent_slot.ctypes.data, 8)
        _update(state, source + 4 * start, 4 * (end - start))
        parent = _digest(state)
        out[k] = parent
        k += 1
        start = end


@jit(cache=True, nogil=True)
def single(tokens, parent, block_size, seed, out):  # type: ignore[no-untyped-def]
    """Hash one request's tokens in blocks of `block_size` (the last may be partial), chaining from `parent`."""
    _chain(tokens, 0, tokens.size, parent, block_size, seed, out, 0)


@jit(cache=True, nogil=True, parallel=True)
def parallel(tokens, token_offsets, parents, block_size, seed, out, out_offsets):  # type: ignore[no-untyped-def]
    """Request r = ``tokens[token_offsets[r]:token_offsets[r+1]]`` from ``parents[r]`` into ``out[out_offsets[r]:]``."""
    for r in numba.prange(token_offsets.size - 1):
        _chain(tokens, token_offsets[r], token_offsets[r + 1], parents[r], block_size, seed, out, out_offsets[r])
