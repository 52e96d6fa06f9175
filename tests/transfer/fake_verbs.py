"""An in-memory RDMA fabric: the test double behind the `Verbs` and `QueuePair` protocols.

Registration remembers each buffer's real address and hands out keys; a work
request posted on a connected queue pair copies real bytes with ctypes.memmove
after checking the rkey and the remote bounds (as a NIC would), and its
completion appears at the next poll. `fail_next` injects failed completions;
`stall` makes work requests vanish (posted, never completed: a wedged NIC).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

from mooncake.transfer.rdma import buffer_address
from mooncake.transfer.request import TransferOp


class FakeFabric:
    def __init__(self) -> None:
        self.memory: dict[int, tuple[int, int, memoryview]] = {}  # rkey -> (address, length, keepalive)
        self.local: dict[int, tuple[int, int]] = {}  # lkey -> (address, length)
        self.queue_pairs: dict[int, FakeQueuePair] = {}
        self.keys = itertools.count(100)
        self.fail_next = 0
        self.stall = False
        self.posted = 0
        self.lock = threading.Lock()


class FakeVerbs:
    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        self.closed = False
        self.rkeys: dict[int, int] = {}  # lkey -> rkey of each memory region registered here

    def register(self, view: memoryview) -> tuple[int, int, int]:
        address = buffer_address(view)
        lkey, rkey = next(self.fabric.keys), next(self.fabric.keys)
        self.fabric.local[lkey] = (address, view.nbytes)
        self.fabric.memory[rkey] = (address, view.nbytes, view)
        self.rkeys[lkey] = rkey
        return address, lkey, rkey

    def deregister(self, lkey: int) -> None:
        """Revoke one memory region (by its lkey), as a NIC does: others over the same memory keep working."""
        self.fabric.local.pop(lkey, None)
        rkey = self.rkeys.pop(lkey, None)
        if rkey is not None:
            self.fabric.memory.pop(rkey, None)

    def create_queue_pair(self) -> FakeQueuePair:
        return FakeQueuePair(self.fabric)

    def close(self) -> None:
        self.closed = True


class FakeQueuePair:
    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        self.number = next(fabric.keys)
        fabric.queue_pairs[self.number] = self
        self.remote: FakeQueuePair | None = None
        self.completions: list[tuple[int, str | None]] = []
        self.lock = threading.Lock()

    def endpoint(self) -> dict[str, Any]:
        return {"qp_num": self.number, "lid": 1, "gid": "fe80::1", "psn": 0}

    def connect(self, remote: dict[str, Any]) -> None:
        self.remote = self.fabric.queue_pairs[int(remote["qp_num"])]

    def post(
        self, wr_id: int, op: TransferOp, address: int, length: int, lkey: int, remote_address: int, rkey: int
    ) -> None:
        assert self.remote is not None, "post on an unconnected queue pair"
        fabric = self.fabric
        with fabric.lock:
            fabric.posted += 1
            failing = fabric.fail_next > 0
            fabric.fail_next -= failing
            if fabric.stall:
                return
        error = "injected failure" if failing else self._check(address, length, lkey, remote_address, rkey)
        if error is None:
            if op == TransferOp.WRITE:
                ctypes.memmove(remote_address, address, length)
            else:
                ctypes.memmove(address, remote_address, length)
        with self.lock:
            self.completions.append((wr_id, error))

    def _check(self, address: int, length: int, lkey: int, remote_address: int, rkey: int) -> str | None:
        local = self.fabric.local.get(lkey)
        if local is None or not (local[0] <= address and address + length <= local[0] + local[1]):
            return "local protection error"
        remote = self.fabric.memory.get(rkey)
        if remote is None or not (remote[0] <= remote_address and remote_address + length <= remote[0] + remote[1]):
            return "remote access error"
        return None

    def poll(self) -> list[tuple[int, str | None]]:
        with self.lock:
            done, self.completions = self.completions, []
        return done

    def close(self) -> None:
        self.fabric.queue_pairs.pop(self.number, None)
