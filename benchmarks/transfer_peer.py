"""A transfer-benchmark peer: an engine with one shared region, in its own process.

python benchmarks/transfer_peer.py SECRET_HEX SIZE   (prints {"address", "region"}; runs until stdin closes)
"""

from __future__ import annotations

import json
import sys

from mooncake.transfer.engine import TransferEngine


def main() -> None:
    engine = TransferEngine(secret=bytes.fromhex(sys.argv[1]))
    region, buffer = engine.allocate_shared(int(sys.argv[2]))
    buffer[:] = 0  # fault the pages in before anything is timed
    print(json.dumps({"address": engine.address, "region": region.region_id}), flush=True)
    sys.stdin.read()
    engine.close()


if __name__ == "__main__":
    main()
