"""A peer engine in its own process, for tests: `python -m tests.transfer.peer_process SECRET_HEX SIZE`.

It registers one shared-memory region and one plain region of SIZE bytes, fills
both with a deterministic pattern, serves "digest" (XXH3 of a range) and
"fill" control calls, prints one JSON line (address, region ids, pid) and runs
until its stdin closes.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import xxhash

from mooncake.transfer.engine import TransferEngine


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def main() -> None:
    secret, size = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
    engine = TransferEngine(secret=secret)
    shared, shared_array = engine.allocate_shared(size)
    plain_array = pattern(size, 2)
    plain = engine.register_memory(plain_array)
    shared_array[:] = pattern(size, 1)
    arrays = {shared.region_id: shared_array, plain.region_id: plain_array}

    def digest(args: dict[str, int]) -> str:
        array = arrays[args["region"]]
        return f"{xxhash.xxh3_64_intdigest(array[args['offset'] : args['offset'] + args['length']].data):016x}"

    engine.register_handler("digest", digest)
    print(json.dumps({"address": engine.address, "shared": shared.region_id, "plain": plain.region_id}), flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    engine.close()


if __name__ == "__main__":
    main()
