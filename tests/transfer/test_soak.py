"""Soak: two processes, 1,000 checksummed batches of mixed reads and writes, zero bad bytes."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import xxhash

from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp, TransferRequest
from tests.transfer.conftest import SECRET, PeerProcess
from tests.transfer.peer_process import pattern

SIZE = 8 << 20
BATCHES = 1000


def test_soak_thousand_checksummed_batches(peers: Callable[..., PeerProcess]) -> None:
    """Every byte read matches a model of the peer's memory, and so does the peer's memory at the end."""
    remote = peers(SIZE)
    rng = random.Random(1234)
    config = EngineConfig(checksums=True, slice_bytes=64 << 10, streams_per_peer=4, io_timeout_s=10.0)
    with TransferEngine(secret=SECRET, config=config) as engine:
        local, buffer = engine.allocate_shared(SIZE)
        model = pattern(SIZE, 2).copy()  # the peer's plain region, as we believe it to be
        peer = engine.connect(remote.address, transport="tcp")
        bad_bytes = 0
        for _ in range(BATCHES):
            # Four requests on disjoint eighths of both regions, so their order cannot matter.
            slots = rng.sample(range(8), 4)
            requests = []
            for slot in slots:
                length = rng.randint(1, (SIZE // 8) // 4)
                offset = slot * (SIZE // 8) + rng.randint(0, SIZE // 8 - length)
                op = rng.choice([TransferOp.READ, TransferOp.WRITE])
                if op == TransferOp.WRITE:
                    buffer[offset : offset + length] = np.frombuffer(rng.randbytes(length), dtype=np.uint8)
                requests.append(
                    TransferRequest(
                        op=op,
                        local_region=local.region_id,
                        local_offset=offset,
                        peer=peer,
                        remote_region=remote.plain,
                        remote_offset=offset,
                        length=length,
                    )
                )
            statuses = engine.wait(engine.submit(requests), timeout=30)
            assert all(s.state == RequestState.DONE for s in statuses), statuses
            for request in requests:
                window = slice(request.local_offset, request.local_offset + request.length)
                if request.op == TransferOp.WRITE:
                    model[window] = buffer[window]
                else:
                    bad_bytes += int(np.count_nonzero(buffer[window] != model[window]))
        assert bad_bytes == 0
        remote_digest = engine.call(peer, "digest", {"region": remote.plain, "offset": 0, "length": SIZE})
        assert remote_digest == f"{xxhash.xxh3_64_intdigest(model.data):016x}"
