"""The RDMA transport: reliable-connection queue pairs, one-sided RDMA WRITE and READ.

Each engine with an RDMA device registers every region with it (a memory region
per registered region: address, lkey, rkey; deregistered by its lkey, so two
regions at one address never share one) and advertises address and rkey in
its region descriptors. When two such engines connect, the initiator creates a
reliable-connection (RC) queue pair, sends its endpoint (QP number, LID, GID,
PSN) in an "rdma_connect" control call, and gets the peer's back; both move their
QPs through INIT, RTR and RTS. A slice is then one signalled work request:
RDMA WRITE from the local region into the remote address, or RDMA READ back,
with the remote offset checked against the peer's descriptor first (the NIC
enforces the memory region's bounds too). A poller thread turns completions
into slice outcomes; a failed completion puts an RC queue pair in the error
state, so every outstanding slice then fails with `PeerUnavailable`.

A send queue holds at most `max_send_wr` work requests whose completions have
not been polled (ibv_post_send refuses the next with ENOMEM), and one request
can be thousands of slices. So, as Mooncake's endpoints do, each transport
posts at most that many and keeps the rest in a FIFO of slices waiting for a
slot: the submitting thread posts while slots are free, the poller posts more
as completions free them. A waiting slice ends as a posted one would: with
`PeerUnavailable` when the transport closes or the queue pair breaks, and with
`TransferTimeout` when no slot has been freed for `io_timeout_s` (a wedged NIC).

Invariants (`RdmaTransport.check_invariants`): work requests posted and not
yet polled never exceed `max_send_wr` (one that expired still holds its slot
until its completion comes), and every posted slice not yet ended is among them.

The device sits behind two small protocols (`Verbs`, `QueuePair`): `PyverbsDevice`
implements them with pyverbs (Debian's python3-pyverbs; the PyPI build does not
compile), and tests drive the transport logic with an in-memory double. What was
verified where: the transport and engine logic against the double, in CI; the
pyverbs calls only where `ibv_devices` lists a device (an integration test skips
elsewhere, saying so).
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np

from mooncake._checks import shown
from mooncake.errors import ConfigError, PeerUnavailable, ProtocolError, TransferError, TransferTimeout
from mooncake.transfer.region import RegionDescriptor, bounds_error
from mooncake.transfer.request import EngineConfig, Slice, TransferOp
from mooncake.transfer.workers import attempt

__all__ = [
    "MAX_SEND_WR",
    "PyverbsDevice",
    "QueuePair",
    "RdmaTransport",
    "Verbs",
    "buffer_address",
    "check_endpoint",
    "open_device",
]

_DEBIAN_PACKAGES = "/usr/lib/python3/dist-packages"
MAX_SEND_WR = 1024  # the send-queue depth each queue pair is created with


def buffer_address(view: memoryview) -> int:
    """The virtual address of the first byte of `view`."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class QueuePair(Protocol):
    """One connected reliable-connection queue pair.

    `max_send_wr`: how many work requests may be posted and not yet polled; `post` refuses one past it.
    """

    max_send_wr: int

    def endpoint(self) -> dict[str, Any]:
        """What the peer needs to connect to this QP (JSON-able)."""

    def connect(self, remote: dict[str, Any]) -> None:
        """Move to RTS, connected to the peer's endpoint."""

    def post(
        self, wr_id: int, op: TransferOp, address: int, length: int, lkey: int, remote_address: int, rkey: int
    ) -> None:
        """Post one signalled RDMA WRITE or READ; raises (ENOMEM) when `max_send_wr` are posted and not polled."""

    def poll(self) -> list[tuple[int, str | None]]:
        """Completed work requests: (wr_id, None) or (wr_id, error text)."""

    def close(self) -> None: ...


_ENDPOINT_BITS = {"qp_num": 24, "lid": 16, "psn": 24}  # the widths of these fields in the verbs


def check_endpoint(value: Any, *, sender: str) -> dict[str, Any]:
    """`value`, a queue pair's endpoint as `sender` sent it (its `QueuePair.endpoint`), once it has the shape
    `QueuePair.connect` reads: a JSON object whose qp_num, lid and psn are unsigned integers of their 24, 16 and
    24 bits (never coerced: "7" or true is a lie or a bug) and whose gid is a string.

    Raises:
        ProtocolError: it has not; the message names `sender`, the field and what was sent (cut short).
    """
    if type(value) is not dict:
        raise ProtocolError(f"{sender} sent a malformed RDMA endpoint: not a JSON object, got {shown(value)}")
    for field, bits in _ENDPOINT_BITS.items():
        number = value.get(field)
        if type(number) is not int or not 0 <= number < 1 << bits:
            raise ProtocolError(
                f"{sender} sent a malformed RDMA endpoint: {field} must be an unsigned {bits}-bit integer,"
                f" got {shown(number)}"
            )
    if type(value.get("gid")) is not str:
        raise ProtocolError(
            f"{sender} sent a malformed RDMA endpoint: gid must be a string, got {shown(value.get('gid'))}"
        )
    return value


class Verbs(Protocol):
    """An RDMA device, opened."""

    def register(self, view: memoryview) -> tuple[int, int, int]:
        """Register memory for local and remote access; returns (address, lkey, rkey). Each call makes a memory
        region of its own, with keys of its own, even for memory registered already."""

    def deregister(self, lkey: int) -> None:
        """Revoke the registration whose local key is `lkey`: its rkey stops working; another registration of the
        same memory (or of memory at the same address) keeps working."""

    def create_queue_pair(self) -> QueuePair: ...

    def close(self) -> None: ...


def open_device(name: str | None = None) -> Verbs | None:
    """The named (or first) RDMA device through pyverbs, or None where there is none."""
    if importlib.util.find_spec("pyverbs") is None:
        # Debian's python3-pyverbs, built for this Python ABI: import the package
        # from there without leaving Debian's folder on the path for anything else.
        sys.path.append(_DEBIAN_PACKAGES)
        try:
            importlib.import_module("pyverbs.device")
        except ImportError:
            return None
        finally:
            sys.path.remove(_DEBIAN_PACKAGES)
    try:
        return PyverbsDevice(name)
    except Exception:  # no device, no permission, no driver: RDMA is simply not offered
        return None


class PyverbsDevice:
    """`Verbs` over pyverbs: one context and protection domain per device; a completion queue per QP."""

    def __init__(self, name: str | None = None, *, port: int = 1, gid_index: int = 0) -> None:
        import pyverbs.device as device
        import pyverbs.enums as enums
        from pyverbs.pd import PD

        names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in device.get_device_list()]
        if not names:
            raise ConfigError("no RDMA device")
        chosen = name or names[0]
        if chosen not in names:
            raise ConfigError(f"no RDMA device {shown(chosen)}; found {names}")
        self._enums = enums
        self.context = device.Context(name=chosen)
        self.pd = PD(self.context)
        self.port = port
        self.gid_index = gid_index
        self._regions: dict[int, tuple[Any, memoryview]] = {}  # by lkey: unique per memory region, unlike addresses

    def register(self, view: memoryview) -> tuple[int, int, int]:
        from pyverbs.mr import MR

        e = self._enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        address = buffer_address(view)
        region = MR(self.pd, view.nbytes, access, address=address)
        self._regions[region.lkey] = (region, view)  # the view keeps the memory alive while registered
        return address, region.lkey, region.rkey

    def deregister(self, lkey: int) -> None:
        entry = self._regions.pop(lkey, None)
        if entry is not None:
            entry[0].close()

    def create_queue_pair(self) -> QueuePair:
        return _PyverbsQueuePair(self)

    def close(self) -> None:
        for region, _view in self._regions.values():
            region.close()
        self.pd.close()
        self.context.close()


class _PyverbsQueuePair:
    def __init__(self, device: PyverbsDevice) -> None:
        import random

        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        e = device._enums
        self._device, self._enums = device, e
        self.cq = CQ(device.context, 4096)
        self.max_send_wr = MAX_SEND_WR  # the device may round it up: the transport keeps to what was asked
        capacity = QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(device.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=capacity))
        self.psn = random.getrandbits(24)

    def endpoint(self) -> dict[str, Any]:
        port = self._device.context.query_port(self._device.port)
        gid = self._device.context.query_gid(self._device.port, self._device.gid_index)
        return {"qp_num": self.qp.qp_num, "lid": port.lid, "gid": str(gid), "psn": self.psn}

    def connect(self, remote: dict[str, Any]) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._enums
        attr = QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.port_num = self._device.port
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.qp.to_init(attr)
        attr = QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(remote["qp_num"])
        attr.rq_psn = int(remote["psn"])
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        route = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=self._device.gid_index)
        attr.ah_attr = AHAttr(dlid=int(remote["lid"]), is_global=1, gr=route, port_num=self._device.port)
        self.qp.to_rtr(attr)
        attr.qp_state = e.IBV_QPS_RTS
        attr.sq_psn = self.psn
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, 16
        self.qp.to_rts(attr)

    def post(
        self, wr_id: int, op: TransferOp, address: int, length: int, lkey: int, remote_address: int, rkey: int
    ) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self._enums
        opcode = e.IBV_WR_RDMA_WRITE if op == TransferOp.WRITE else e.IBV_WR_RDMA_READ
        request = SendWR(
            wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(address, length, lkey)], send_flags=e.IBV_SEND_SIGNALED
        )
        request.set_wr_rdma(rkey, remote_address)
        self.qp.post_send(request)

    def poll(self) -> list[tuple[int, str | None]]:
        count, completions = self.cq.poll(64)
        success = self._enums.IBV_WC_SUCCESS
        return [
            (wc.wr_id, None if wc.status == success else f"completion status {wc.status}") for wc in completions[:count]
        ]

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


@attrs.frozen
class _Work:
    """A slice checked and resolved to a work request, waiting for a send-queue slot since `queued_at`."""

    piece: Slice
    address: int
    lkey: int
    remote_address: int
    rkey: int
    queued_at: float


class RdmaTransport:
    """Slices to and from one peer over one RC queue pair, at most `queue_pair.max_send_wr` posted at once.

    Args:
        queue_pair: connected to the peer.
        local_key: (address, lkey) of the registered local memory holding a view.
        describe: the peer's descriptor of a region, or None.
        config: timeouts.
    """

    name = "rdma"

    def __init__(
        self,
        queue_pair: QueuePair,
        *,
        local_key: Callable[[memoryview], tuple[int, int]],
        describe: Callable[[int], RegionDescriptor | None],
        config: EngineConfig,
    ) -> None:
        self._qp = queue_pair
        self._local_key = local_key
        self._describe = describe
        self._config = config
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Slice, float]] = {}  # posted slices not yet ended, by wr_id
        self._waiting: collections.deque[_Work] = collections.deque()  # checked slices waiting for a slot, FIFO
        self._in_flight: set[int] = set()  # wr_ids posted and not yet polled: each holds a send-queue slot
        self._freed_at = time.monotonic()  # when a slot was last freed (a completion polled)
        self._lock = threading.Lock()
        self._broken: TransferError | None = None
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="rdma-poll", daemon=True)
        self._poller.start()

    @property
    def is_broken(self) -> bool:
        """Whether the queue pair failed for good (every slice on it fails: connecting again rebuilds it)."""
        return self._broken is not None

    def submit(self, piece: Slice) -> None:
        error = attempt(self._enqueue, piece, action="RDMA post")
        if error is not None or not piece.local.nbytes:
            piece.on_done(error)  # a posted slice ends when its completion is polled; an empty one posts nothing
            return
        self._post_waiting()

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        """Post `piece` and wait for its completion in the calling thread, until `deadline` (time.monotonic) at
        the latest: past it, `TransferTimeout` (the work request may still complete later, as one that outlives
        twice the io timeout may)."""
        outcome: list[TransferError | None] = []
        done = threading.Event()

        def finished(error: TransferError | None) -> None:
            outcome.append(error)
            done.set()

        self.submit(Slice(piece.op, piece.local, piece.remote_region, piece.remote_offset, finished))
        wait_s, cut = self._config.io_timeout_s * 2, False
        if deadline is not None and deadline - time.monotonic() < wait_s:
            wait_s, cut = max(0.0, deadline - time.monotonic()), True
        if not done.wait(wait_s):
            return TransferTimeout("an RDMA work request did not complete" + (" by its deadline" if cut else ""))
        return outcome[0]

    def close(self) -> None:
        self._closed.set()
        self._poller.join(timeout=5)
        self._fail_all(PeerUnavailable("the RDMA transport is closed"))
        self._qp.close()

    def check_invariants(self) -> None:
        """Work requests posted and not yet polled are at most `max_send_wr`, and every posted slice not yet
        ended is among them."""
        with self._lock:
            assert len(self._in_flight) <= self._qp.max_send_wr, (len(self._in_flight), self._qp.max_send_wr)
            assert set(self._pending) <= self._in_flight, sorted(set(self._pending) - self._in_flight)

    def _enqueue(self, piece: Slice) -> None:
        """Check `piece` against the peer's descriptor and queue it for posting (an empty one only checked)."""
        self._raise_if_down()
        remote = self._describe(piece.remote_region)
        if remote is None:
            raise TransferError(f"the peer has no RDMA-registered region {piece.remote_region}")
        length = piece.local.nbytes
        problem = bounds_error(piece.remote_offset, length, remote.length)
        if problem is not None:
            raise TransferError(f"region {piece.remote_region}: {problem}")
        if not length:  # in bounds and nothing to move (an empty view, or an empty region, has no address to post)
            return
        if remote.rdma_address is None or remote.rdma_rkey is None:
            raise TransferError(f"the peer has no RDMA-registered region {piece.remote_region}")
        address, lkey = self._local_key(piece.local)
        work = _Work(
            piece, address, lkey, remote.rdma_address + piece.remote_offset, remote.rdma_rkey, time.monotonic()
        )
        with self._lock:  # checked again under the lock `_fail_all` takes: nothing is queued after it drained
            self._raise_if_down()
            self._waiting.append(work)

    def _raise_if_down(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed.is_set():
            raise PeerUnavailable("the RDMA transport is closed")

    def _post_waiting(self) -> None:
        """Post waiting slices, oldest first, while the send queue has free slots; a refused post ends its slice
        with a TransferError (the queue pair is still up)."""
        refused: list[tuple[Slice, TransferError]] = []
        with self._lock:  # held across each post: a slot is taken and its work request posted as one step
            while self._waiting and len(self._in_flight) < self._qp.max_send_wr:
                if self._broken is not None or self._closed.is_set():
                    break  # `_fail_all` ends the waiting ones
                work = self._waiting.popleft()
                piece = work.piece
                wr_id = next(self._ids)
                try:
                    self._qp.post(
                        wr_id, piece.op, work.address, piece.local.nbytes, work.lkey, work.remote_address, work.rkey
                    )
                except Exception as error:
                    refused.append((piece, TransferError(f"posting an RDMA {piece.op.value} failed: {error}")))
                    continue
                self._in_flight.add(wr_id)
                self._pending[wr_id] = (piece, time.monotonic())
        for piece, failure in refused:
            piece.on_done(failure)

    def _poll(self) -> None:
        while not self._closed.is_set():
            try:
                completions = self._qp.poll()
            except Exception as error:
                self._broken = PeerUnavailable(f"polling the RDMA completion queue failed: {error}")
                self._fail_all(self._broken)
                return
            for wr_id, failure in completions:
                with self._lock:
                    if wr_id in self._in_flight:  # its slot is free again, even where the slice expired before
                        self._in_flight.discard(wr_id)
                        self._freed_at = time.monotonic()
                    entry = self._pending.pop(wr_id, None)
                if entry is None:
                    continue
                if failure is None:
                    entry[0].on_done(None)
                else:
                    # An RC queue pair in error flushes everything after the failure.
                    self._broken = PeerUnavailable(f"RDMA work request failed ({failure}); the queue pair is down")
                    entry[0].on_done(self._broken)
                    self._fail_all(self._broken)
            if completions:
                self._post_waiting()
            self._expire()
            if not completions:
                time.sleep(0.0002)  # completions arrive by polling; keep the idle loop cheap

    def _expire(self) -> None:
        """End posted slices older than the io timeout, and waiting ones when no slot has freed for as long."""
        deadline = time.monotonic() - self._config.io_timeout_s
        with self._lock:
            late = [wr_id for wr_id, (_, posted) in self._pending.items() if posted < deadline]
            pieces = [self._pending.pop(wr_id)[0] for wr_id in late]  # their slots stay taken until polled
            stuck: list[Slice] = []
            full = len(self._in_flight) >= self._qp.max_send_wr
            while full and self._waiting and max(self._waiting[0].queued_at, self._freed_at) < deadline:
                stuck.append(self._waiting.popleft().piece)
        for piece in pieces:
            piece.on_done(TransferTimeout(f"an RDMA work request took over {self._config.io_timeout_s}s"))
        for piece in stuck:
            piece.on_done(
                TransferTimeout(f"no RDMA send-queue slot was freed for {self._config.io_timeout_s}s (the NIC stalls)")
            )

    def _fail_all(self, error: TransferError) -> None:
        """End every posted and every waiting slice with `error`."""
        with self._lock:
            pieces = [piece for piece, _ in self._pending.values()] + [work.piece for work in self._waiting]
            self._pending.clear()
            self._waiting.clear()
        for piece in pieces:
            piece.on_done(error)
