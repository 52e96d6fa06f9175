"""An in-memory RDMA fabric: the test double behind the `Verbs` and `QueuePair` protocols.

Registration remembers each buffer's real address and hands out keys; a work
request posted on a connected queue pair copies real bytes with ctypes.memmove
after checking the rkey and the remote bounds (as a NIC would), and its
completion appears at the next poll. `fail_next` injects failed completions;
`stall` makes work requests vanish (posted, never completed: a wedged NIC);
`hold` keeps completions back from polls until it is cleared (a busy NIC).
Each queue pair's send queue holds `max_send_wr` work requests (the fabric's,
by default what a real queue pair is created with): a work request takes a slot
when posted and frees it when its completion is polled (a swallowed one never
does), and a post with no slot free is refused with ENOMEM, as ibv_post_send
refuses it. `peak_outstanding` is the most a queue pair ever held.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import threading
from typing import Any

from mooncake.transfer.rdma import MAX_SEND_WR, buffer_address
from mooncake.transfer.request import TransferOp


class FakeFabric:
    def __init__(self, *, max_send_wr: int = MAX_SEND_WR) -> None:
        self.max_send_wr = max_send_wr
        self.peak_outstanding = 0
        self.memory: dict[int, tuple[int, int, memoryview]] = {}  # rkey -> (address, length, keepalive)
        self.local: dict[int, tuple[int, int]] = {}  # lkey -> (address, length)
        self.queue_pairs: dict[int, FakeQueuePair] = {}
        self.keys = itertools.count(100)
        self.fail_next = 0
        self.stall = False
        self.hold = False
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
        self.max_send_wr = fabric.max_send_wr
        self.outstanding = 0  # posted, completion not yet polled: the send-queue slots taken
        self.lock = threading.Lock()

    def endpoint(self) -> dict[str, Any]:
        return {"qp_num": self.number, "lid": 1, "gid": "fe80::1", "psn": 0}

    def connect(self, remote: dict[str, Any]) -> None:
        self.remote = self.fabric.queue_pairs[int(remote["qp_num"])]

    def post(
        self, wr_id: int, op: TransferOp, address: int, length: int, lkey: int, remote_address: int, rkey: int
    ) -> None:
        assert self.remote is not None, "post on an unconnected queue pair"
        with self.lock:
            if self.outstanding >= self.max_send_wr:
                raise OSError(errno.ENOMEM, f"ibv_post_send: send queue full ({self.max_send_wr} outstanding)")
            self.outstanding += 1
            held = self.outstanding
        fabric = self.fabric
        with fabric.lock:
            fabric.peak_outstanding = max(fabric.peak_outstanding, held)
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
        if self.fabric.hold:
            return []
        with self.lock:
            done, self.completions = self.completions, []
            self.outstanding -= len(done)
        return done

    def close(self) -> None:
        self.fabric.queue_pairs.pop(self.number, None)
