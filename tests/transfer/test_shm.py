"""The shared-memory transport on its own: a peer whose process is gone, and a descriptor that overstates its segment.

The engine-level tests (tests/transfer/test_engine.py) run it between processes; these pin its own checks, which
those reach only when nothing else notices first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.region import RegionDescriptor, create_shared
from mooncake.transfer.request import Slice, TransferOp
from mooncake.transfer.shm import ShmTransport

SIZE = 1 << 16


def gone_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(child.stdout)


@pytest.mark.parametrize("overstated", [False, True])
def test_a_copy_checks_the_peer_is_alive_and_the_segment_holds_the_region(overstated: bool) -> None:
    """Into a live peer's segment a WRITE lands; a peer whose process is gone is PeerUnavailable (its segment may
    outlive it: writing there would deliver to no one), and a descriptor longer than its segment a TransferError,
    nothing written either way."""
    segment, memory = create_shared(SIZE)
    try:
        length = SIZE * 2 if overstated else SIZE
        descriptor = RegionDescriptor(region_id=7, length=length, shm_name=segment.name)
        data = np.arange(256, dtype=np.uint8).tobytes() * 4
        for pid, expected in ((gone_pid(), PeerUnavailable), (os.getpid(), TransferError if overstated else None)):
            transport = ShmTransport(lambda region: descriptor if region == 7 else None, peer_pid=pid, workers=1)
            try:
                error = transport.run_inline(
                    Slice(TransferOp.WRITE, memoryview(data), 7, SIZE - len(data), lambda _e: None)
                )
            finally:
                transport.close()
            if expected is None:
                assert error is None and bytes(memory[SIZE - len(data) :]) == data
            else:
                assert isinstance(error, expected) and not memory.any()
    finally:
        del memory
        segment.close()
        segment.unlink()
