"""The transfer engine against a byte model: real engines on 127.0.0.1, random batches, every byte checked.

`EngineMachine` runs two or three engines in this process, each connected to the others over a drawn
transport (tcp or shm), and keeps a bytearray model of every region they registered. Its rules register,
allocate and unregister regions, write into them as a user would, refresh peers, restart an engine on its
address (and connect to it again), and move random batches (zero-length requests, edge offsets, ranges
past either end, unknown regions and peers, peers restarted since they were described) with
`submit`/`wait` and `transfer_sync`, sometimes with their slices held back so that a wait must time out.

Between the engine and its transports sits a `Gate`: it records every slice the engine hands over (so a
refused batch provably started nothing), holds submitted slices while closed, and counts those whose
outcome has not come back (so every rule ends with nothing in flight and the model is exact).

The requests of one batch never overlap where one writes (a batch's requests have no order), so what a
DONE batch leaves is well defined. A request past the end of a remote region its engine knows (the peer
described it) is refused whole by `submit`, before any slice starts. Only one past the end of a region the
peer registered since it was last described fails slice by slice at the peer, so it may have delivered the
slices inside the region: its destination is unknown to the model until read back, every other byte is
still checked. A request to a peer restarted since it was described moves nothing: over tcp it fails with
PeerUnavailable naming the restart (the new engine's region ids start at 1 again, and it must never receive
bytes meant for the old one's), over shm (the engines share this process: the pid check cannot tell) with the
old engine's segments gone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.errors import ConfigError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.rdma import buffer_address
from mooncake.transfer.region import RegionDescriptor
from mooncake.transfer.request import (
    MAX_OFFSET,
    MAX_REGION_ID,
    EngineConfig,
    RequestState,
    RequestStatus,
    Slice,
    TransferOp,
    TransferRequest,
    Transport,
)
from tests.transfer.conftest import ROOT, SECRET, engine_on, request
from tests.waiting import wait_for

T = TypeVar("T")
SLACK_S = 2.0  # how far past its timeout a wait may return on a loaded machine (it takes milliseconds)
LONG_S = 30.0  # a wait that must not time out
UNKNOWN_PEER = "127.0.0.1:1"  # no engine listens on port 1
UNKNOWN_REGION = 4_000_000  # region ids count up from 1 per engine
SIZES = st.one_of(st.sampled_from([0, 1, 64, 65, 333, 334, 1000, 3000]), st.integers(0, 3000))


def own_segments() -> set[str]:
    """The mooncake shared-memory segments this process created and has not unlinked."""
    prefix = f"mooncake-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


def within(seconds: float, call: Callable[[], T]) -> T:
    """What `call()` returns or raises; the test fails if it has not after `seconds` (a call that would block
    for good fails its test instead of hanging the run: it runs in a thread of its own)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="within", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        pytest.fail(f"still blocked after {seconds} s")
    returned, value = outcome[0]
    if returned:
        return value  # type: ignore[no-any-return]
    raise value


# --------------------------------------------------------------------------- the gate between engine and transports


@attrs.frozen
class SliceRecord:
    """One slice as the engine handed it to a transport."""

    peer: str
    op: TransferOp
    remote_region: int
    remote_offset: int
    local_address: int
    nbytes: int


class Gate:
    """Records every slice an engine hands to its transports; holds submitted ones while `held`; counts the
    slices whose outcome has not come back."""

    def __init__(self) -> None:
        self.records: list[SliceRecord] = []
        self._parked: list[tuple[Transport, Slice]] = []
        self._held = False
        self._outstanding = 0
        self._changed = threading.Condition()

    def record(self, peer: str, piece: Slice) -> None:
        self.records.append(
            SliceRecord(
                peer,
                piece.op,
                piece.remote_region,
                piece.remote_offset,
                buffer_address(piece.local),
                piece.local.nbytes,
            )
        )

    def pass_on(self, transport: Transport, piece: Slice) -> None:
        """Submit `piece` to `transport` now, or when released if held; count it until its outcome comes."""

        def done(error: TransferError | None) -> None:
            try:
                piece.on_done(error)
            finally:
                with self._changed:
                    self._outstanding -= 1
                    self._changed.notify_all()

        tracked = Slice(piece.op, piece.local, piece.remote_region, piece.remote_offset, done)
        with self._changed:
            self._outstanding += 1
            if self._held:
                self._parked.append((transport, tracked))
                return
        transport.submit(tracked)

    def hold(self) -> None:
        with self._changed:
            self._held = True

    def release(self) -> None:
        with self._changed:
            self._held = False
            parked, self._parked = self._parked, []
        for transport, piece in parked:
            transport.submit(piece)

    @property
    def num_parked(self) -> int:
        with self._changed:
            return len(self._parked)

    def drain(self) -> None:
        """Wait until every slice passed on has its outcome (fail the test after LONG_S)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._outstanding == 0, timeout=LONG_S):
                pytest.fail(f"{self._outstanding} slices still without an outcome after {LONG_S} s")


class GatedTransport:
    """A real transport seen through a `Gate`."""

    def __init__(self, gate: Gate, peer: str, inner: Transport) -> None:
        self.name = inner.name
        self._gate, self._peer, self._inner = gate, peer, inner

    def submit(self, piece: Slice) -> None:
        self._gate.record(self._peer, piece)
        self._gate.pass_on(self._inner, piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        self._gate.record(self._peer, piece)
        return self._inner.run_inline(piece, deadline=deadline)

    def close(self) -> None:
        self._inner.close()


def install_gate(engine: TransferEngine, gate: Gate) -> None:
    """Route every slice `engine` plans through `gate` (the engine picks a transport per request here)."""
    choose = engine._peers.transport_for

    def transport_for(peer: str, region_id: int) -> Transport:
        return GatedTransport(gate, peer, choose(peer, region_id))

    engine._peers.transport_for = transport_for  # type: ignore[method-assign]


# --------------------------------------------------------------------------- the model


Key = tuple[int, int]  # (engine index, region id)


@attrs.frozen
class Span:
    key: Key
    start: int
    end: int

    def overlaps(self, other: Span) -> bool:
        return self.key == other.key and self.start < other.end and other.start < self.end


@attrs.define(eq=False)
class ModelRegion:
    """A registered region: the bytes the engine serves, and what they must hold."""

    descriptor: RegionDescriptor
    shared: bool
    view: np.ndarray  # uint8 over the engine's memory; never read once unregistered (its mapping may be gone)
    keepalive: Any
    data: bytearray

    def actual(self, start: int = 0, end: int | None = None) -> bytes:
        return self.view[start:end].tobytes()

    def write(self, offset: int, payload: bytes) -> None:
        self.view[offset : offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self.data[offset : offset + len(payload)] = payload


@attrs.frozen
class Expected:
    """What the model expects of one request that `submit` accepts."""

    state: RequestState
    transport: str
    source: Span | None
    target: Span | None  # the bytes it writes (clipped to its region); None when it can write nothing
    unsure: bool  # FAILED past the end of a region not yet described: the slices inside it may have landed
    restarted: bool = False  # FAILED, moving nothing: the peer restarted since it was described

    def spans(self) -> list[Span]:
        return [span for span in (self.source, self.target) if span is not None and span.end > span.start]


def conflict(one: Expected, other: Expected) -> bool:
    """One of the two requests writes bytes the other reads or writes."""
    return any(
        mine.overlaps(theirs)
        for mine, theirs in itertools.product(one.spans(), other.spans())
        if mine == one.target or theirs == other.target
    )


@attrs.define(eq=False)
class Node:
    engine: TransferEngine
    gate: Gate
    transports: dict[int, str] = attrs.field(factory=dict)  # peer index -> the transport forced at connect
    known: dict[int, dict[int, RegionDescriptor]] = attrs.field(factory=dict)  # peer index -> its regions as learnt
    stale: set[int] = attrs.field(factory=set)  # peers restarted since this engine connected to them
    dead: list[int] = attrs.field(factory=list)  # region ids unregistered here
    last_region_id: int = 0


def edge_offset(hi: int) -> st.SearchStrategy[int]:
    """An offset in [0, hi], often one of its ends."""
    return st.one_of(st.sampled_from([0, hi]), st.integers(0, hi)) if hi > 0 else st.just(0)


def beyond(size: int, length: int) -> st.SearchStrategy[int]:
    """An offset where `length` bytes do not fit in a region of `size` (often by one byte)."""
    low = max(0, size - length + 1)
    return st.one_of(st.just(low), st.integers(low, size + 3))


class EngineMachine(RuleBasedStateMachine):
    """Engines on 127.0.0.1 against a byte model of their regions: after every batch the bytes are the model's, a
    batch refused for its local range (or an unknown region or peer) starts no slice, each request ends once and
    keeps its status, waits return within their timeout, unregistered regions are out of reach, close leaves
    nothing running."""

    def __init__(self) -> None:
        super().__init__()
        self.threads_before = set(threading.enumerate())
        self.segments_before = own_segments()
        self.nodes: list[Node] = []
        self.addresses: dict[str, int] = {}
        self.regions: dict[Key, ModelRegion] = {}
        self.finished: list[tuple[int, int, tuple[RequestStatus, ...]]] = []  # (engine, batch, final statuses)
        self.slice_bytes = 0
        self.config = EngineConfig()

    # ------------------------------------------------------------------ set-up

    @initialize(
        num_engines=st.integers(2, 3),
        slice_bytes=st.sampled_from([16, 64, 333]),
        streams=st.integers(1, 2),
        data=st.data(),
    )
    def start(self, num_engines: int, slice_bytes: int, streams: int, data: st.DataObject) -> None:
        self.slice_bytes = slice_bytes
        self.config = EngineConfig(slice_bytes=slice_bytes, streams_per_peer=streams, io_timeout_s=10.0)
        for index in range(num_engines):
            self._start_engine(index, data, engine=TransferEngine(secret=SECRET, config=self.config))
        for i in range(num_engines):
            for j in range(num_engines):
                if i != j:
                    self._connect(i, j, data.draw(st.sampled_from(["tcp", "shm"]), label=f"transport {i}->{j}"))

    def _start_engine(self, index: int, data: st.DataObject, *, engine: TransferEngine) -> None:
        """`engine` as engine `index`, seen through a gate, with a shared and a plain region."""
        gate = Gate()
        install_gate(engine, gate)
        node = Node(engine, gate)
        if index < len(self.nodes):
            self.nodes[index] = node
        else:
            self.nodes.append(node)
        self.addresses[engine.address] = index
        self._allocate(index, data.draw(SIZES, label="shared region"), seed=index)
        self._register(index, data.draw(SIZES, label="plain region"), "bytearray", seed=index + 10)

    def _connect(self, i: int, j: int, transport: str) -> None:
        """Engine `i` connects to engine `j` over `transport` alone, and learns its regions as they are now."""
        node, address = self.nodes[i], self.nodes[j].engine.address
        assert node.engine.connect(address, transport=transport) == address
        assert node.engine.transport_names(address) == (transport,)
        node.transports[j] = transport
        node.known[j] = {d.region_id: d for d in node.engine.peer_regions(address)}
        assert node.known[j] == {d.region_id: d for d in self.nodes[j].engine.regions()}
        node.stale.discard(j)

    def teardown(self) -> None:
        try:
            for node in self.nodes:
                node.gate.release()
            for node in self.nodes:
                node.engine.close()
            # Closing ends only what was still moving: a request that had ended keeps its status.
            for index, batch, statuses in self.finished:
                assert self.nodes[index].engine.status(batch) == statuses
        finally:
            for node in self.nodes:
                node.engine.close()
            self.regions.clear()  # their memory may be unmapped now: never touched again
        wait_for(
            lambda: not set(threading.enumerate()) - self.threads_before,
            timeout=10,
            what="the closed engines' threads to end",
        )
        assert own_segments() == self.segments_before, "a closed engine left a shared segment behind"

    # ------------------------------------------------------------------ memory

    def _allocate(self, index: int, size: int, seed: int) -> None:
        descriptor, array = self.nodes[index].engine.allocate_shared(size)
        assert descriptor.length == size
        self._added(index, descriptor, shared=True, view=array, keepalive=array)
        self.regions[(index, descriptor.region_id)].write(0, random.Random(seed).randbytes(size))

    def _added(
        self, index: int, descriptor: RegionDescriptor, *, shared: bool, view: np.ndarray, keepalive: Any
    ) -> None:
        node = self.nodes[index]
        assert descriptor.region_id > node.last_region_id, "region ids are never reused"
        node.last_region_id = descriptor.region_id
        assert (descriptor.shm_name is not None) == shared
        self.regions[(index, descriptor.region_id)] = ModelRegion(
            descriptor, shared, view, keepalive, bytearray(view.tobytes())
        )

    @rule(data=st.data(), size=SIZES, seed=st.integers(0, 99))
    def allocate(self, data: st.DataObject, size: int, seed: int) -> None:
        """A region in shared memory (reachable over shm and tcp)."""
        self._allocate(data.draw(st.integers(0, len(self.nodes) - 1), label="engine"), size, seed)

    @rule(data=st.data(), size=SIZES, form=st.sampled_from(["bytearray", "uint8", "uint32"]), seed=st.integers(0, 99))
    def register(self, data: st.DataObject, size: int, form: str, seed: int) -> None:
        """Any writable buffer (reachable over tcp only): a bytearray, or numpy arrays of one or four bytes."""
        self._register(data.draw(st.integers(0, len(self.nodes) - 1), label="engine"), size, form, seed)

    def _register(self, index: int, size: int, form: str, seed: int) -> None:
        payload = random.Random(seed).randbytes(size - size % 4 if form == "uint32" else size)
        buffer: Any
        if form == "bytearray":
            buffer = bytearray(payload)
            view = np.frombuffer(buffer, dtype=np.uint8)
        else:
            buffer = np.frombuffer(payload, dtype=np.uint8 if form == "uint8" else np.uint32).copy()
            view = buffer.reshape(-1).view(np.uint8)
        descriptor = self.nodes[index].engine.register_memory(buffer)
        assert descriptor.length == len(payload)
        self._added(index, descriptor, shared=False, view=view, keepalive=buffer)

    @precondition(lambda self: self.regions)
    @rule(data=st.data(), twice=st.booleans())
    def unregister(self, data: st.DataObject, twice: bool) -> None:
        """An unregistered region is out of reach; peers over shm refresh (over tcp they need not)."""
        index, region_id = data.draw(st.sampled_from(sorted(self.regions)), label="region")
        node = self.nodes[index]
        node.engine.unregister_memory(region_id)
        if twice:
            node.engine.unregister_memory(region_id)  # nothing left to stop: a no-op
        del self.regions[(index, region_id)]
        node.dead.append(region_id)
        for peer in self.nodes:
            if peer is not node and peer.transports[index] == "shm":
                # A peer that copied from the segment before still has it mapped; the refresh keeps the model's
                # descriptors in step (that such copies fail is test_an_unregistered_shared_region_...'s).
                self._refresh(self.nodes.index(peer), index)

    def _refresh(self, i: int, j: int) -> None:
        node, peer = self.nodes[i], self.nodes[j]
        if j in node.stale:  # another engine answers there now: what it has is no news about the one described
            described = node.engine.peer_regions(peer.engine.address)
            with pytest.raises(PeerUnavailable, match="restarted"):
                node.engine.refresh(peer.engine.address)
            assert node.engine.peer_regions(peer.engine.address) == described
            return
        descriptor = node.engine.refresh(peer.engine.address)
        learnt = {d.region_id: d for d in descriptor.regions}
        assert learnt == {d.region_id: d for d in peer.engine.regions()}
        assert node.engine.peer_regions(peer.engine.address) == descriptor.regions
        node.known[j] = learnt

    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        """A peer's descriptor, refreshed, lists exactly the regions it has now."""
        i, j = data.draw(
            st.sampled_from([(i, j) for i in range(len(self.nodes)) for j in range(len(self.nodes)) if i != j]),
            label="engine, peer",
        )
        self._refresh(i, j)

    @precondition(lambda self: any(region.descriptor.length for region in self.regions.values()))
    @rule(data=st.data())
    def scribble(self, data: st.DataObject) -> None:
        """The owner writes into its memory directly, as a model runner writes its KV cache."""
        key = data.draw(st.sampled_from(sorted(k for k, r in self.regions.items() if r.descriptor.length)))
        region = self.regions[key]
        offset = data.draw(st.integers(0, region.descriptor.length - 1), label="offset")
        payload = data.draw(st.binary(min_size=1, max_size=region.descriptor.length - offset), label="bytes")
        region.write(offset, payload)

    # ------------------------------------------------------------------ restarts

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """An engine closes and a new one starts on its address, with regions of its own whose ids start at 1
        again: requests its peers aimed at the old one move nothing (see `_expect`) until they connect again.
        The new engine connects to the others."""
        j = data.draw(st.integers(0, len(self.nodes) - 1), label="restarted engine")
        event("restart")
        old = self.nodes[j].engine
        old.close()
        for index, batch, statuses in self.finished:  # closing ends only what was still moving
            if index == j:
                assert old.status(batch) == statuses
        self.finished = [entry for entry in self.finished if entry[0] != j]
        for key in [key for key in self.regions if key[0] == j]:
            del self.regions[key]  # never touched again: the memory may be unmapped
        self._start_engine(j, data, engine=engine_on(old.port, self.config))
        for i in range(len(self.nodes)):
            if i != j:
                self.nodes[i].stale.add(j)
                self._connect(j, i, data.draw(st.sampled_from(["tcp", "shm"]), label=f"transport {j}->{i}"))

    @rule(data=st.data())
    def reconnect(self, data: st.DataObject) -> None:
        """Connecting again to a peer learns the engine that answers now, restarted or not: its regions, as they
        are (and its connections replace the old ones)."""
        pairs = [(i, j) for i in range(len(self.nodes)) for j in range(len(self.nodes)) if i != j]
        i, j = data.draw(st.sampled_from(pairs), label="engine, peer")
        event(f"reconnect to a {'restarted' if j in self.nodes[i].stale else 'known'} peer")
        self._connect(i, j, data.draw(st.sampled_from(["tcp", "shm"]), label=f"transport {i}->{j}"))

    # ------------------------------------------------------------------ requests

    def _remote_view(self, i: int, j: int) -> tuple[list[int], list[int], dict[int, int]]:
        """Engine `j`'s regions as engine `i` should aim at them: the live ones, the dead ones, and their sizes
        (for a peer restarted since `i` connected, those `i` was told of: the new engine's are out of its reach)."""
        if j in self.nodes[i].stale:
            described = self.nodes[i].known[j]
            return sorted(described), [], {r: d.length for r, d in described.items()}
        live = {r: region.descriptor.length for (owner, r), region in self.regions.items() if owner == j}
        return sorted(live), self.nodes[j].dead, live

    def _draw_request(self, data: st.DataObject, i: int) -> TransferRequest:
        node = self.nodes[i]
        j = data.draw(st.sampled_from([j for j in range(len(self.nodes)) if j != i]), label="peer")
        peer = self.nodes[j].engine.address
        op = data.draw(st.sampled_from(TransferOp), label="op")
        # Mostly a request that fits both regions; one in four breaks one thing.
        anomaly = data.draw(st.integers(0, 23), label="anomaly") - 17
        local_ids = sorted(r for (owner, r) in self.regions if owner == i)
        live, dead, sizes = self._remote_view(i, j)
        reachable = live if node.transports[j] == "tcp" else [r for r in live if self._over_shm(i, j, r)]
        local = data.draw(st.sampled_from(local_ids), label="local") if local_ids else UNKNOWN_REGION
        remote = data.draw(st.sampled_from(reachable), label="remote") if reachable else UNKNOWN_REGION
        if anomaly == 1:
            local = data.draw(st.sampled_from([*node.dead, UNKNOWN_REGION]), label="unknown local")
        elif anomaly == 2:
            remote = data.draw(st.sampled_from([*dead, UNKNOWN_REGION]), label="unknown remote")
        elif anomaly == 3 and live:  # over shm: a plain region, or one allocated since the last refresh
            remote = data.draw(st.sampled_from(live), label="any remote")
        elif anomaly == 4:
            peer = data.draw(st.sampled_from([UNKNOWN_PEER, node.engine.address]), label="unknown peer")
        local_size = self._size(i, local)
        remote_size = sizes.get(remote, 0)
        if anomaly == 5:  # past the local end
            length = data.draw(st.integers(0, local_size + 3), label="length")
            local_offset = data.draw(beyond(local_size, length), label="local offset")
            remote_offset = data.draw(edge_offset(max(0, remote_size - length)), label="remote offset")
        elif anomaly == 6:  # past the remote end
            length = data.draw(st.integers(0, local_size), label="length")
            local_offset = data.draw(edge_offset(local_size - length), label="local offset")
            remote_offset = data.draw(beyond(remote_size, length), label="remote offset")
        else:
            fits = min(local_size, remote_size)
            length = data.draw(st.one_of(st.sampled_from([0, fits]), st.integers(0, fits)), label="length")
            local_offset = data.draw(edge_offset(local_size - length), label="local offset")
            remote_offset = data.draw(edge_offset(remote_size - length), label="remote offset")
        return request(op, local, peer, remote, length, local_offset=local_offset, remote_offset=remote_offset)

    def _over_shm(self, i: int, j: int, region_id: int) -> bool:
        """Whether engine `i` knows region `region_id` of engine `j` as a shared one (what shm reaches)."""
        learnt = self.nodes[i].known[j].get(region_id)
        return learnt is not None and learnt.shm_name is not None

    def _size(self, index: int, region_id: int) -> int:
        region = self.regions.get((index, region_id))
        return region.descriptor.length if region is not None else 0

    def _expect(self, i: int, request: TransferRequest) -> Expected | str:
        """What `request` from engine `i` must do, or the message (a regex) of the TransferError refusing it."""
        local = self.regions.get((i, request.local_region))
        if local is None:
            return "no local region"
        if request.local_offset + request.length > local.descriptor.length:
            return r"^requests\[[0-9]+\]: local region [0-9]+: bytes \[[0-9]+, [0-9]+\) are outside"
        j = self.addresses.get(request.peer)
        if j is None or j == i:
            return "unknown peer"
        node = self.nodes[i]
        transport = node.transports[j]
        if transport == "shm" and not self._over_shm(i, j, request.remote_region):
            return "no transport reaches"
        end = request.remote_offset + request.length
        described = node.known[j].get(request.remote_region)
        if described is not None and end > described.length:
            # The peer described the region: refused whole, before any slice starts (none lands).
            return r"^remote region [0-9]+ of .*: remote_offset [0-9]+ \+ length [0-9]+ is past its end"
        local_span = Span((i, request.local_region), request.local_offset, request.local_offset + request.length)
        if j in node.stale:  # another engine answers there now: nothing moves, in either direction
            target = local_span if request.op == TransferOp.READ else None
            source = local_span if request.op == TransferOp.WRITE else None
            return Expected(RequestState.FAILED, transport, source, target, unsure=False, restarted=True)
        remote = self.regions.get((j, request.remote_region))
        if remote is None:  # unregistered (the tcp peer refuses it) or never there
            assert transport == "tcp", "shm peers refresh on every unregister"
            target = local_span if request.op == TransferOp.READ else None
            source = local_span if request.op == TransferOp.WRITE else None
            return Expected(RequestState.FAILED, transport, source, target, unsure=False)
        size = remote.descriptor.length
        remote_span = Span((j, request.remote_region), min(request.remote_offset, size), min(end, size))
        source, target = (local_span, remote_span) if request.op == TransferOp.WRITE else (remote_span, local_span)
        if end <= size:
            return Expected(RequestState.DONE, transport, source, target, unsure=False)
        # Past the end of a region registered since the peer was described (over tcp: shm reaches described ones
        # only): the peer refuses it slice by slice, and the slices inside the region may have landed.
        assert transport == "tcp" and described is None
        return Expected(RequestState.FAILED, transport, source, target, unsure=True)

    def _draw_batch(
        self, data: st.DataObject, i: int, *, min_size: int = 0
    ) -> tuple[list[TransferRequest], list[Expected | str]]:
        """Requests of engine `i` of which none writes where another reads or writes."""
        requests: list[TransferRequest] = []
        expected: list[Expected | str] = []
        for _ in range(data.draw(st.integers(min_size, 4), label="requests")):
            request = self._draw_request(data, i)
            outcome = self._expect(i, request)
            if isinstance(outcome, Expected) and any(
                isinstance(other, Expected) and conflict(outcome, other) for other in expected
            ):
                continue  # the first request is always kept
            requests.append(request)
            expected.append(outcome)
        return requests, expected

    @staticmethod
    def _refusal(expected: list[Expected | str]) -> str | None:
        """Submit checks the requests in order: the first refused one names the error."""
        return next((outcome for outcome in expected if isinstance(outcome, str)), None)

    def _refused(self, i: int, expected: list[Expected | str], attempt: Any) -> None:
        gate = self.nodes[i].gate
        gate.records.clear()
        with pytest.raises(TransferError, match=self._refusal(expected)) as refused:
            attempt()
        assert not isinstance(refused.value, PeerUnavailable | TransferTimeout)
        assert gate.records == [], "a refused batch started slices"
        event(f"refused: {self._refusal(expected)}")

    def _settle(self, i: int, expected: list[Expected | str], statuses: tuple[RequestStatus, ...]) -> None:
        """Check the statuses against the model, then apply the batch to it."""
        outcomes = [outcome for outcome in expected if isinstance(outcome, Expected)]
        assert len(statuses) == len(outcomes)
        sources = {
            n: bytes(self.regions[o.source.key].data[o.source.start : o.source.end])
            for n, o in enumerate(outcomes)
            if o.state == RequestState.DONE and o.source is not None
        }
        for n, (status, outcome) in enumerate(zip(statuses, outcomes, strict=True)):
            assert (status.state, status.transport) == (outcome.state, outcome.transport), (n, status, outcome)
            note = " past the end" if outcome.unsure else " (restarted peer)" if outcome.restarted else ""
            event(f"{status.transport} {status.state.value}{note}")
            if status.state == RequestState.DONE:
                assert status.error is None
                if outcome.target is not None:
                    self.regions[outcome.target.key].data[outcome.target.start : outcome.target.end] = sources[n]
            else:
                assert isinstance(status.error, TransferError)
                assert not isinstance(status.error, TransferTimeout), status.error
                if outcome.restarted and outcome.transport == "tcp":  # (over shm: the old engine's segments are gone)
                    assert type(status.error) is PeerUnavailable and "restarted" in str(status.error), status.error
                self._forget_target(outcome)
        self.nodes[i].gate.drain()

    def _forget_target(self, outcome: Expected) -> None:
        """A failed request's destination may hold some of its slices: read it back into the model."""
        if outcome.unsure and outcome.target is not None:
            region = self.regions[outcome.target.key]
            region.data[outcome.target.start : outcome.target.end] = region.actual(
                outcome.target.start, outcome.target.end
            )

    @rule(data=st.data(), probe=st.sampled_from([None, 0.0, 0.002, 0.02]), forget=st.booleans())
    def submit(self, data: st.DataObject, probe: float | None, forget: bool) -> None:
        """A batch through submit and wait: statuses and bytes as the model says; a wait returns within its
        timeout whether or not the batch has ended by then."""
        i = data.draw(st.integers(0, len(self.nodes) - 1), label="engine")
        engine = self.nodes[i].engine
        requests, expected = self._draw_batch(data, i)
        if self._refusal(expected) is not None:
            self._refused(i, expected, lambda: engine.submit(requests))
            return
        batch = engine.submit(requests)
        if probe is not None:
            start = time.monotonic()
            try:
                within(probe + SLACK_S, lambda: engine.wait(batch, probe))
                event("the probing wait saw the batch end")
            except TransferTimeout:
                event("the probing wait timed out")
            assert time.monotonic() - start <= probe + SLACK_S
        statuses = engine.wait(batch, LONG_S)
        self._settle(i, expected, statuses)
        if forget:
            engine.forget(batch)
            with pytest.raises(TransferError, match="unknown batch"):
                engine.status(batch)
            with pytest.raises(TransferError, match="unknown batch"):
                engine.wait(batch, 0)
        else:
            self.finished.append((i, batch, statuses))

    @rule(data=st.data())
    def transfer_sync(self, data: st.DataObject) -> None:
        """The same through transfer_sync (one-slice requests move inline, the others as a batch)."""
        i = data.draw(st.integers(0, len(self.nodes) - 1), label="engine")
        engine = self.nodes[i].engine
        requests, expected = self._draw_batch(data, i)
        if self._refusal(expected) is not None:
            self._refused(i, expected, lambda: engine.transfer_sync(requests, timeout=LONG_S))
            return
        self._settle(i, expected, engine.transfer_sync(requests, timeout=LONG_S))

    @rule(data=st.data(), timeout=st.sampled_from([0.0, 0.01, 0.05]))
    def held(self, data: st.DataObject, timeout: float) -> None:
        """With its slices held back a batch stays PENDING and `wait` raises TransferTimeout on time; let go,
        each request ends once and keeps that status."""
        i = data.draw(st.integers(0, len(self.nodes) - 1), label="engine")
        node = self.nodes[i]
        engine, gate = node.engine, node.gate
        requests, expected = self._draw_batch(data, i, min_size=1)
        gate.hold()
        try:
            if self._refusal(expected) is not None:
                self._refused(i, expected, lambda: engine.submit(requests))
                assert gate.num_parked == 0
                return
            batch = engine.submit(requests)
            assert {s.state for s in engine.status(batch)} == {RequestState.PENDING}
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                within(timeout + SLACK_S, lambda: engine.wait(batch, timeout))
            elapsed = time.monotonic() - start
            assert 0.9 * timeout <= elapsed <= timeout + SLACK_S, elapsed
            event("held: the wait timed out")
            assert {s.state for s in engine.status(batch)} == {RequestState.PENDING}
        finally:
            gate.release()
        ended: dict[int, RequestStatus] = {}

        def all_ended() -> bool:
            for n, status in enumerate(engine.status(batch)):
                if n in ended:
                    assert status == ended[n], "an ended request changed its status"
                elif status.state != RequestState.PENDING:
                    ended[n] = status
            return len(ended) == len(requests)

        wait_for(all_ended, timeout=LONG_S, what="the released batch to end", poll_s=0.001)
        statuses = engine.wait(batch, 0.0)  # all ended: no waiting, no timeout
        assert statuses == tuple(ended[n] for n in range(len(requests)))
        self._settle(i, expected, statuses)
        self.finished.append((i, batch, statuses))

    @rule(data=st.data(), timeout=st.sampled_from([0.0, 0.02]))
    def transfer_sync_held(self, data: st.DataObject, timeout: float) -> None:
        """transfer_sync returns within its timeout; what it did not finish is FAILED with TransferTimeout, never
        DONE (a request of several slices waits for held ones); slices let go later still land as the model says."""
        i = data.draw(st.integers(0, len(self.nodes) - 1), label="engine")
        node = self.nodes[i]
        engine, gate = node.engine, node.gate
        requests, expected = self._draw_batch(data, i, min_size=1)
        gate.hold()
        try:
            if self._refusal(expected) is not None:
                self._refused(i, expected, lambda: engine.transfer_sync(requests, timeout=timeout))
                return
            start = time.monotonic()
            statuses = within(timeout + SLACK_S, lambda: engine.transfer_sync(requests, timeout=timeout))
            assert time.monotonic() - start <= timeout + SLACK_S
            held_back = any(request.length > self.slice_bytes for request in requests)
            event(f"transfer_sync held: {'a batch' if held_back else 'inline'}")
        finally:
            gate.release()
        gate.drain()  # what was held has landed now
        outcomes = [outcome for outcome in expected if isinstance(outcome, Expected)]
        sources = {
            n: bytes(self.regions[o.source.key].data[o.source.start : o.source.end])
            for n, o in enumerate(outcomes)
            if o.state == RequestState.DONE and o.source is not None
        }
        for n, (status, outcome) in enumerate(zip(statuses, outcomes, strict=True)):
            late = status.state == RequestState.FAILED and isinstance(status.error, TransferTimeout)
            if held_back:
                assert late, status  # held: not one of them can have ended in time
            elif not late:
                assert (status.state, status.transport) == (outcome.state, outcome.transport), (n, status, outcome)
                if status.state == RequestState.FAILED:
                    assert isinstance(status.error, TransferError)
            if outcome.target is None:
                continue
            if held_back or status.state == RequestState.DONE:
                # Let go, a held request moved as it would have: what it wrote is exact, or unknown if it failed.
                if outcome.state == RequestState.DONE:
                    self.regions[outcome.target.key].data[outcome.target.start : outcome.target.end] = sources[n]
                else:
                    self._forget_target(outcome)
            elif late or outcome.unsure:
                # Inline, timed out or failed midway: the destination may hold part of it.
                region = self.regions[outcome.target.key]
                region.data[outcome.target.start : outcome.target.end] = region.actual(
                    outcome.target.start, outcome.target.end
                )

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bytes_are_the_models(self) -> None:
        for (index, region_id), region in self.regions.items():
            assert region.actual() == bytes(region.data), f"engine {index} region {region_id} differs from the model"

    @invariant()
    def regions_are_the_models(self) -> None:
        for index, node in enumerate(self.nodes):
            served = {d.region_id: d for d in node.engine.regions()}
            mine = {r: region.descriptor for (owner, r), region in self.regions.items() if owner == index}
            assert served == mine
            assert all(node.engine.region(r) is None for r in node.dead)
            node.engine.check_invariants()

    @invariant()
    def ended_requests_keep_their_status(self) -> None:
        for index, batch, statuses in self.finished:
            engine = self.nodes[index].engine
            assert engine.status(batch) == statuses
            assert engine.wait(batch, 0.0) == statuses


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


# --------------------------------------------------------------------------- slicing, with a transport twin


class HeldTransport:
    """A transport twin that keeps every slice; the test ends each when it likes."""

    name = "held"

    def __init__(self) -> None:
        self.pieces: list[Slice] = []

    def submit(self, piece: Slice) -> None:
        self.pieces.append(piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        raise AssertionError("submit only")

    def close(self) -> None:
        pass


@contextlib.contextmanager
def engine_with_twin(slice_bytes: int) -> Iterator[tuple[TransferEngine, HeldTransport]]:
    """An engine whose every request goes to one `HeldTransport` (no peer needed, nor any remote region described:
    the remote ranges are the transport's to check)."""
    twin = HeldTransport()
    frame = max(slice_bytes, 64 << 20)
    config = EngineConfig(slice_bytes=slice_bytes, max_frame_bytes=frame, max_staging_bytes=max(frame, 256 << 20))
    with TransferEngine(secret=SECRET, config=config) as engine:
        engine._peers.transport_for = lambda _peer, _region: twin  # type: ignore[method-assign]
        engine._peers.remote_region = lambda _peer, _region: None  # type: ignore[method-assign]
        yield engine, twin


@st.composite
def sliced_batches(draw: st.DrawFn) -> tuple[int, int, list[tuple[TransferOp, int, int, int]]]:
    """slice_bytes, a region size and requests (op, local offset, length, remote offset) inside it."""
    slice_bytes = draw(st.integers(1, 70))
    size = draw(st.integers(0, 300))
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.one_of(st.sampled_from([0, size]), st.integers(0, size)))
        local_offset = draw(edge_offset(size - length))
        requests.append((draw(st.sampled_from(TransferOp)), local_offset, length, draw(st.integers(0, MAX_OFFSET))))
    return slice_bytes, size, requests


@settings(max_examples=60)
@given(
    batch=sliced_batches(),
    bad_at=st.integers(0, 4),
    bad_by=st.integers(1, 3),
    rnd=st.randoms(use_true_random=False),
    close_at=st.one_of(st.none(), st.integers(0, 50)),
)
def test_a_request_is_its_slices_and_ends_with_its_last(
    batch: tuple[int, int, list[tuple[TransferOp, int, int, int]]],
    bad_at: int,
    bad_by: int,
    rnd: random.Random,
    close_at: int | None,
) -> None:
    """A request's slices tile its local and remote ranges exactly, each at most slice_bytes (a zero-length one
    is one empty slice); it is PENDING until its last slice ends, then DONE, or FAILED with the first slice error
    in time; closing the engine fails what is still pending and changes nothing that had ended; a batch with one
    request past its local end is refused before any slice starts."""
    slice_bytes, size, specs = batch
    with engine_with_twin(slice_bytes) as (engine, twin):
        buffer = bytearray(size)
        region = engine.register_memory(buffer)
        base = buffer_address(memoryview(buffer))
        requests = [
            # remote region n + 1: which request a slice belongs to
            request(
                op,
                region.region_id,
                "127.0.0.1:9",
                n + 1,
                length,
                local_offset=local_offset,
                remote_offset=remote_offset,
            )
            for n, (op, local_offset, length, remote_offset) in enumerate(specs)
        ]
        bad = attrs.evolve(requests[0], local_offset=size + bad_by - min(size, requests[0].length), remote_region=99)
        assert bad.local_offset + bad.length > size
        with pytest.raises(TransferError, match="outside"):
            engine.submit([*requests[:bad_at], bad, *requests[bad_at:]])
        assert twin.pieces == [], "a refused batch started slices"

        batch_id = engine.submit(requests)
        pieces = twin.pieces
        for n, one in enumerate(requests):
            mine = sorted((p for p in pieces if p.remote_region == n + 1), key=lambda p: p.remote_offset)
            assert all(p.op == one.op and p.local.nbytes <= slice_bytes for p in mine)
            if one.length == 0:
                assert [(p.remote_offset, p.local.nbytes) for p in mine] == [(one.remote_offset, 0)]
                continue
            mine = [p for p in mine if p.local.nbytes]
            at = 0
            for piece in mine:  # contiguous, in step on both sides, from the first byte to the last
                assert piece.remote_offset == one.remote_offset + at
                assert buffer_address(piece.local) == base + one.local_offset + at
                at += piece.local.nbytes
            assert at == one.length
        assert all(p.remote_region <= len(requests) for p in pieces)

        remaining = [sum(1 for p in pieces if p.remote_region == n + 1) for n in range(len(requests))]
        first_error: dict[int, TransferError] = {}
        closed_error: dict[int, TransferError | None] = {}
        order = list(range(len(pieces)))
        rnd.shuffle(order)
        for step, k in enumerate(order):
            if step == close_at:
                engine.close()
                for n in range(len(requests)):
                    if remaining[n]:
                        closed_error[n] = first_error.get(n)
            piece = pieces[k]
            n = piece.remote_region - 1
            error = TransferError(f"slice {k}") if rnd.random() < 0.15 else None
            piece.on_done(error)
            if n not in closed_error:
                remaining[n] -= 1
                if error is not None:
                    first_error.setdefault(n, error)
            statuses = engine.status(batch_id)
            for n, status in enumerate(statuses):
                if n in closed_error:  # ended by the close, with its first error if it had one
                    assert status.state == RequestState.FAILED
                    known = closed_error[n]
                    assert status.error is known if known is not None else isinstance(status.error, PeerUnavailable)
                elif remaining[n]:
                    assert status.state == RequestState.PENDING
                elif n in first_error:
                    assert status.state == RequestState.FAILED and status.error is first_error[n]
                else:
                    assert status == RequestStatus(RequestState.DONE, None, "held")
            if step == 0 and any(remaining[n] and n not in closed_error for n in range(len(requests))):
                with pytest.raises(TransferTimeout):
                    within(SLACK_S, lambda: engine.wait(batch_id, 0.0))
        assert engine.wait(batch_id, 0.0) == engine.status(batch_id)


# --------------------------------------------------------------------------- request fields

LIMITS = {
    "local_region": MAX_REGION_ID,
    "remote_region": MAX_REGION_ID,
    "local_offset": MAX_OFFSET,
    "remote_offset": MAX_OFFSET,
    "length": MAX_OFFSET,
}
VALID: dict[str, Any] = {
    "op": TransferOp.READ,
    "local_region": 1,
    "local_offset": 0,
    "peer": "127.0.0.1:9",
    "remote_region": 1,
    "remote_offset": 0,
    "length": 1,
}


@st.composite
def bad_fields(draw: st.DrawFn) -> tuple[str, object]:
    field = draw(st.sampled_from(sorted(LIMITS)))
    limit = LIMITS[field]
    value = draw(
        st.one_of(
            st.integers(max_value=-1),
            st.integers(min_value=limit + 1),
            st.booleans(),
            st.floats(allow_nan=True),
            st.text(max_size=3),
            st.none(),
            st.sampled_from([np.int64(-1), np.uint64(limit + 1), np.float64(1.0)]),
        )
    )
    return field, value


@given(bad=bad_fields())
def test_a_request_field_out_of_its_range_is_refused_by_name(bad: tuple[str, object]) -> None:
    """A region id, offset or length that is negative, past its bound (2**32 - 1, 2**62), a bool, a float, a
    string or None is a ConfigError naming the field."""
    field, value = bad
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        TransferRequest(**{**VALID, field: value})


@given(
    values=st.fixed_dictionaries(
        {
            field: st.one_of(st.sampled_from([0, limit]), st.integers(0, limit), st.integers(0, limit).map(np.int64))
            for field, limit in LIMITS.items()
        }
    )
)
def test_every_request_field_in_its_range_is_accepted(values: dict[str, int]) -> None:
    """Any integer from 0 to its bound, the bound included (numpy integers too), makes a request that keeps it."""
    request = TransferRequest(**{**VALID, **values})
    assert {field: getattr(request, field) for field in LIMITS} == values


# --------------------------------------------------------------------------- defects found here


def test_an_unregistered_shared_region_cannot_be_written_over_shm() -> None:
    """After the owner unregisters a shared region, a WRITE to it over shm fails as it does over tcp (the bytes
    would go to memory no one serves any more), whether or not the writer had copied into it before."""
    with TransferEngine(secret=SECRET) as owner, TransferEngine(secret=SECRET) as writer:
        target, _ = owner.allocate_shared(64)
        other, _ = owner.allocate_shared(64)
        local, _ = writer.allocate_shared(64)
        peer = writer.connect(owner.address, transport="shm")

        def write(region_id: int) -> RequestStatus:
            one = request(TransferOp.WRITE, local.region_id, peer, region_id, 64)
            return writer.wait(writer.submit([one]), timeout=10)[0]

        assert write(target.region_id).state == RequestState.DONE  # maps the segment
        owner.unregister_memory(target.region_id)
        owner.unregister_memory(other.region_id)
        late = write(target.region_id)
        assert late.state == RequestState.FAILED, late
        never_mapped = write(other.region_id)
        assert never_mapped.state == RequestState.FAILED
        assert not isinstance(never_mapped.error, PeerUnavailable), never_mapped.error


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_numpy_offsets_cannot_overflow_the_local_bounds_check() -> None:
    """A request accepted with numpy integers is bounds-checked like one with Python ints: 2**62 bytes at offset
    2**62 are outside a 64-byte region. (One slice of 2**62 bytes keeps the engine from cutting 2**40 of them.)"""
    huge = 1 << 62
    with engine_with_twin(huge) as (engine, twin):
        region = engine.register_memory(bytearray(64))
        request = TransferRequest(**{**VALID, "local_region": region.region_id})
        overflowing = attrs.evolve(request, local_offset=np.int64(huge), length=np.int64(huge))
        with pytest.raises(TransferError, match="outside"):
            engine.submit([overflowing])
        assert twin.pieces == []


KEEP_THE_ARRAY = """
import gc, sys
from mooncake.transfer.engine import TransferEngine
engine = TransferEngine(secret=bytes(range(32)))
region, array = engine.allocate_shared(1 << 16)
array[:] = 7
if sys.argv[1] == "unregister":
    engine.unregister_memory(region.region_id)
engine.close()
gc.collect()
array[0] = 9
print(int(array.sum()))
"""


@pytest.mark.parametrize("how", ["unregister", "close"])
def test_the_array_of_an_allocated_region_outlives_its_registration(how: str) -> None:
    """The array `allocate_shared` returned stays valid memory after the region is unregistered or the engine
    closed (only the name is unlinked). Run in a child process: the SharedMemory collected under the array
    unmapped it, and the next access killed the process with SIGSEGV."""
    result = subprocess.run(
        [sys.executable, "-c", KEEP_THE_ARRAY, how], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-500:])
    assert result.stdout.split() == [str(7 * ((1 << 16) - 1) + 9)]
