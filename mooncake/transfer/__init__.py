"""Moving bytes between processes and machines: the transfer engine and the messenger.

`TransferEngine` registers memory, finds peers and moves batches of reads and
writes over shm, TCP or RDMA; `Messenger` moves KV blocks between two nodes'
tiered caches over it.
"""

from __future__ import annotations

from mooncake.transfer.engine import PeerDescriptor, TransferEngine
from mooncake.transfer.messenger import Fetch, Messenger, Push
from mooncake.transfer.region import RegionDescriptor
from mooncake.transfer.request import EngineConfig, RequestState, RequestStatus, TransferOp, TransferRequest, Transport

__all__ = [
    "EngineConfig",
    "Fetch",
    "Messenger",
    "PeerDescriptor",
    "Push",
    "RegionDescriptor",
    "RequestState",
    "RequestStatus",
    "TransferEngine",
    "TransferOp",
    "TransferRequest",
    "Transport",
]
