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


@pytest.mark.parametrize("exits_meanwhile", [False, True])
def test_a_segment_gone_is_an_unregistered_region_unless_the_peer_is_gone_too(
    exits_meanwhile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live peer's segment that cannot be mapped was unregistered: a TransferError, not PeerUnavailable. A peer
    that exits between the liveness check and the mapping took its segments with it: PeerUnavailable."""
    answers = iter([True, not exits_meanwhile])  # alive at the copy's check; then alive, or exited
    monkeypatch.setattr("mooncake.transfer.shm._alive", lambda _pid: next(answers))
    descriptor = RegionDescriptor(region_id=7, length=64, shm_name=f"mooncake-{os.getpid()}-000000000000")
    transport = ShmTransport(lambda region: descriptor if region == 7 else None, peer_pid=os.getpid(), workers=1)
    try:
        error = transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(64)), 7, 0, lambda _e: None))
    finally:
        transport.close()
    if exits_meanwhile:
        assert isinstance(error, PeerUnavailable), error
    else:
        assert type(error) is TransferError and "no longer shared" in str(error), error
