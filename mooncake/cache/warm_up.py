"""Compile (or load from numba's disk cache) every numba kernel of `mooncake.cache`.

    python -m mooncake.cache.warm_up

`make` runs it once after installing, so no process pays compilation later.
Without numba there is nothing to compile and it returns at once.
"""

from __future__ import annotations

import numpy as np

from mooncake.cache import _key_table
from mooncake.cache._compiled import is_compiled
from mooncake.cache.hashing import BlockHasher

__all__ = ["main"]


def main() -> None:
    """Exercise each compiled kernel once on tiny inputs."""
    if not is_compiled():
        return
    _key_table.warm_up()
    hasher = BlockHasher(model="warm-up", block_size_tokens=4)
    tokens = np.arange(10, dtype=np.int32)
    hasher.block_keys(tokens)
    hasher.hash_batch(tokens, np.array([0, 4, 10]))


if __name__ == "__main__":
    main()
