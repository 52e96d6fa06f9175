"""Properties of `peers`: descriptors survive the wire or are refused, and `Peers` against a reference model.

`PeerDescriptor.from_json` is what stands between a peer's word and the shm and RDMA
transports, which trust a stored descriptor for bounds: a valid descriptor comes back
equal after a JSON round trip, and one with any field out of range is refused with
`TransferError`. `Peers` is stateful (the peers it dialled, their descriptors and
transports, the handlers it serves, the RDMA queue pairs it accepted, its listener);
`PeersMachine` runs three of them in this process on 127.0.0.1 against dicts and lists
of what each should know, moving real bytes through the transports it picks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
from multiprocessing import shared_memory
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.errors import ConfigError, PeerUnavailable, TransferError
from mooncake.transfer.peers import PeerDescriptor, Peers, host_id
from mooncake.transfer.region import Region, RegionDescriptor, bounds_error, create_shared
from mooncake.transfer.request import EngineConfig, Slice, TransferOp, Transport
from mooncake.transfer.wire import Json
from tests.transfer.conftest import SECRET
from tests.transfer.fake_verbs import FakeFabric, FakeQueuePair, FakeVerbs
from tests.waiting import wait_for

U64 = 2**64

# --------------------------------------------------------------------------- host_id


def test_host_id_is_stable_and_names_this_host() -> None:
    """Equal ids must mean shared memory is shared: the id is the same on every call (Peers compares its own
    with each peer's, so one that varied would never offer shm) and is this machine's hostname and boot id, then
    the device of its /dev/shm and the inode of its PID namespace."""
    first = host_id()
    assert all(host_id() == first for _ in range(5))
    hostname, boot_id, shm, pid = first.split("/")
    assert hostname == socket.gethostname()
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
        assert boot_id == boot.read().strip()
    with contextlib.suppress(OSError):
        assert shm == f"shm:{os.stat('/dev/shm').st_dev}"
    with contextlib.suppress(OSError):
        assert pid == f"pid:{os.stat('/proc/self/ns/pid').st_ino}"


@pytest.mark.skipif(
    not (os.path.isdir("/proc/self/ns") and os.path.isdir("/dev/shm")),
    reason="reads /dev/shm and /proc/self/ns (Linux)",
)
def test_host_id_differs_with_the_shm_folder_or_the_pid_namespace() -> None:
    """Two processes of one machine whose /dev/shm are different mounts (a tmpfs device of its own), or whose PID
    namespaces differ, get different ids, so neither takes the other for same-host (the shm transport would fail
    every copy: the segments or the pids it is told are not its own). A path that cannot be read leaves its field
    empty, and the id stable. (Namespaces for real: tests/transfer/test_shm.py.)"""
    other_shm, other_pid = "/proc", "/proc/self/ns/mnt"  # another filesystem; a namespace inode of another kind
    assert os.stat(other_shm).st_dev != os.stat("/dev/shm").st_dev
    assert os.stat(other_pid).st_ino != os.stat("/proc/self/ns/pid").st_ino
    assert host_id(shm_folder=other_shm) != host_id()
    assert host_id(pid_namespace=other_pid) != host_id()
    assert host_id(shm_folder="/dev/shm", pid_namespace="/proc/self/ns/pid") == host_id()
    missing = host_id(shm_folder="/nonexistent/shm", pid_namespace="/nonexistent/ns")
    assert missing.endswith("/shm:/pid:") and missing == host_id(
        shm_folder="/nonexistent/shm", pid_namespace="/nonexistent/ns"
    )


# --------------------------------------------------------------------------- PeerDescriptor

pids = st.integers(min_value=1, max_value=2**22)
u64s = st.integers(min_value=0, max_value=U64 - 1)


@st.composite
def region_descriptors(draw: st.DrawFn, pid: int) -> RegionDescriptor:
    """Valid region descriptors of process `pid`: ints in [0, 2**64), a shm name of pid's own, or none."""
    shm_name = draw(st.none() | st.binary(min_size=1, max_size=6).map(lambda b: f"mooncake-{pid}-{b.hex()}"))
    return RegionDescriptor(
        region_id=draw(u64s),
        length=draw(u64s),
        shm_name=shm_name,
        rdma_address=draw(st.none() | u64s),
        rdma_rkey=draw(st.none() | u64s),
    )


@st.composite
def peer_descriptors(draw: st.DrawFn, *, min_regions: int = 0) -> PeerDescriptor:
    pid = draw(pids)
    return PeerDescriptor(
        name=draw(st.text(max_size=12)),
        host_id=draw(st.text(max_size=12)),
        pid=pid,
        regions=tuple(draw(st.lists(region_descriptors(pid), min_size=min_regions, max_size=4))),
        rdma=draw(st.booleans()),
        max_frame_bytes=draw(st.none() | st.integers(1, 2**63 - 1)),
    )


@settings(max_examples=50, deadline=None)
@given(descriptor=peer_descriptors())
def test_a_valid_descriptor_survives_the_wire(descriptor: PeerDescriptor) -> None:
    """What an engine describes of itself (`to_json`, then JSON text as `describe` sends it) is read back
    equal: the validation that guards the transports never refuses an honest peer or alters its fields."""
    assert PeerDescriptor.from_json(json.loads(json.dumps(descriptor.to_json()))) == descriptor


# A region field and values it must never take: out of [0, 2**64), or not an int (bools and floats included).
_INTEGER_FIELDS = ("region_id", "length", "rdma_address", "rdma_rkey")
# Values a region's integer field must never take: out of [0, 2**64), or not an int (bools and floats included).
_bad_integers = (
    st.integers(max_value=-1) | st.integers(min_value=U64) | st.booleans() | st.floats(allow_nan=False) | st.text()
)


@st.composite
def foreign_shm_names(draw: st.DrawFn, pid: int) -> list[str]:
    """Shared-segment names that are not a mooncake segment of process `pid`, one of each kind: another
    process's, another prefix, a suffix that is not hex, none, and any other text."""
    other_pid = draw(pids.filter(lambda p: p != pid), label="other pid")
    suffix = draw(st.binary(min_size=1, max_size=4), label="suffix").hex()
    anything = draw(st.text(max_size=20).filter(lambda name: re.fullmatch(rf"mooncake-{pid}-[0-9a-f]+", name) is None))
    return [
        f"mooncake-{other_pid}-{suffix}",
        f"other-{pid}-{suffix}",
        f"mooncake-{pid}-xyz",
        f"mooncake-{pid}",
        anything,
    ]


@settings(max_examples=50, deadline=None)
@given(descriptor=peer_descriptors(min_regions=1), data=st.data())
def test_a_descriptor_with_an_implausible_region_is_refused(descriptor: PeerDescriptor, data: st.DataObject) -> None:
    """One bad field in one region of an otherwise valid descriptor makes `from_json` raise TransferError:
    each integer field out of [0, 2**64) or not an int, and each kind of shared segment that is not a
    mooncake segment of the peer's own process. The shm and RDMA transports trust a stored descriptor for
    bounds and segment names."""
    raw = json.loads(json.dumps(descriptor.to_json()))
    index = data.draw(st.integers(0, len(raw["regions"]) - 1), label="region")
    corruptions = [(field, data.draw(_bad_integers, label=field)) for field in _INTEGER_FIELDS]
    corruptions += [("shm_name", name) for name in data.draw(foreign_shm_names(descriptor.pid), label="shm_name")]
    for field, value in corruptions:
        corrupted = json.loads(json.dumps(raw))
        corrupted["regions"][index][field] = value
        with pytest.raises(TransferError, match="malformed segment descriptor"):
            PeerDescriptor.from_json(corrupted)


@settings(max_examples=50, deadline=None)
@given(descriptor=peer_descriptors(min_regions=1), data=st.data())
def test_a_descriptor_field_of_another_type_is_refused_not_coerced(
    descriptor: PeerDescriptor, data: st.DataObject
) -> None:
    """Each field is taken as sent or refused: a pid that is text, a fraction, a switch or no process id, an
    `rdma` that is not a switch, a name that is not text, regions that are not a list, and a segment name
    whose pid has a leading zero or non-ASCII digits are all TransferError, never read as something else."""
    raw = json.loads(json.dumps(descriptor.to_json()))
    pid, segment = descriptor.pid, data.draw(st.binary(min_size=1, max_size=4), label="suffix").hex()
    corruptions: list[tuple[str, Any]] = [
        ("pid", str(pid)),
        ("pid", pid + 0.5),
        ("pid", True),
        ("pid", data.draw(st.integers(max_value=0) | st.integers(min_value=2**31), label="pid")),
        ("pid", math.inf),
        ("rdma", data.draw(st.sampled_from(["false", 0, 1, None]), label="rdma")),
        ("name", data.draw(st.integers() | st.none(), label="name")),
        ("host_id", 5),
        ("regions", {}),
    ]
    for field, value in corruptions:
        corrupted = json.loads(json.dumps(raw))
        corrupted[field] = value
        with pytest.raises(TransferError, match="malformed segment descriptor"):
            PeerDescriptor.from_json(corrupted)
    arabic = str(pid).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    for name in (f"mooncake-0{pid}-{segment}", f"mooncake-{arabic}-{segment}"):
        corrupted = json.loads(json.dumps(raw))
        corrupted["regions"][0]["shm_name"] = name
        with pytest.raises(TransferError, match="malformed segment descriptor"):
            PeerDescriptor.from_json(corrupted)


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:131071", "127.0.0.1:²", "h:", ":80"])
def test_a_peer_address_must_name_a_tcp_port(address: str) -> None:
    """A port outside 1..65535 (the OS would take it modulo 2**16 and dial another) or not in ASCII digits is a
    ConfigError naming the address, before anything is dialled."""
    engine = make_engine(None)
    try:
        with pytest.raises(ConfigError, match="host:port"):
            engine.peers.connect(address)
    finally:
        engine.peers.close()


# Any JSON a peer could send, Infinity and NaN included (Python's json reads them).
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_descriptor_keys = ("name", "host_id", "pid", "rdma")  # and "regions"
_region_keys = ("region_id", "length", "shm_name", "rdma_address", "rdma_rkey")


@st.composite
def descriptor_shaped_json(draw: st.DrawFn) -> Any:
    """JSON that looks like a descriptor (its keys, some missing, values of any type) or is anything at all."""
    region = st.dictionaries(st.sampled_from(_region_keys), _json_values | u64s, max_size=5)
    shaped = st.fixed_dictionaries(
        {},
        optional={
            "regions": st.lists(region | _json_values, max_size=3),
            **dict.fromkeys(_descriptor_keys, _json_values),
        },
    )
    return draw(shaped | _json_values)


@settings(max_examples=50, deadline=None)
@given(data=descriptor_shaped_json())
def test_any_json_is_a_valid_descriptor_or_a_transfer_error(data: Any) -> None:
    """Whatever JSON a peer answers "describe" with, `from_json` returns a descriptor whose every region is
    plausible (integers in [0, 2**64), shm segments named for the peer's pid), or raises TransferError:
    never another exception, which `connect` would not report as a failed peer."""
    try:
        descriptor = PeerDescriptor.from_json(data)
    except TransferError:
        return
    for region in descriptor.regions:
        for name in ("region_id", "length", "rdma_address", "rdma_rkey"):
            value = getattr(region, name)
            assert value is None or (type(value) is int and 0 <= value < U64), (name, value)
        if region.shm_name is not None:
            match = re.fullmatch(r"mooncake-([1-9][0-9]*)-[0-9a-f]+", region.shm_name)
            assert match is not None and int(match.group(1)) == descriptor.pid, region.shm_name


# --------------------------------------------------------------------------- Peers as a state machine

NUM_ENGINES = 3
ENGINE_INDEXES = st.integers(min_value=0, max_value=NUM_ENGINES - 1)
# max_connections bounds both the served TCP connections and the accepted RDMA queue pairs: high enough that
# the machine's own connections never hear "busy", low enough that bursts of rdma_connect evict queue pairs.
CONFIG = EngineConfig(  # transports: all three, the default
    streams_per_peer=1,
    max_connections=24,
    io_timeout_s=5.0,
    connect_timeout_s=5.0,
    spin_us=0,
)
HANDLER_METHODS = ("ping", "stats")


class CountingVerbs(FakeVerbs):
    """The in-memory fabric's verbs, remembering the queue pairs this engine created (newest last)."""

    def __init__(self, fabric: FakeFabric) -> None:
        super().__init__(fabric)
        self.created: list[FakeQueuePair] = []

    def create_queue_pair(self) -> FakeQueuePair:
        queue_pair = super().create_queue_pair()
        self.created.append(queue_pair)
        return queue_pair


@attrs.define(eq=False)
class Engine:
    """One `Peers` and the memory it registers: the real regions and the bytes each should hold."""

    peers: Peers
    verbs: CountingVerbs | None
    regions: dict[int, Region]
    expected: dict[int, bytearray]
    segments: list[shared_memory.SharedMemory]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.peers.port}"

    def descriptor(self) -> PeerDescriptor:
        """What this engine says of itself now."""
        return PeerDescriptor(
            name=self.peers.name,
            host_id=host_id(),
            pid=os.getpid(),
            regions=tuple(region.descriptor for region in self.regions.values()),
            rdma=self.verbs is not None,
            max_frame_bytes=self.peers.config.max_frame_bytes,
        )


def make_engine(verbs: CountingVerbs | None) -> Engine:
    regions: dict[int, Region] = {}

    def no_local_key(_view: memoryview) -> tuple[int, int]:
        raise TransferError("no RDMA-registered local memory in this test")

    peers = Peers(
        secret=SECRET,
        config=CONFIG,
        name=None,
        rdma=verbs,
        regions=lambda: tuple(region.descriptor for region in regions.values()),
        region=regions.get,
        local_key=no_local_key,
    )
    return Engine(peers, verbs, regions, {}, [])


@attrs.define
class Known:
    """What a source engine should know of one peer it dialled."""

    target: int
    descriptor: PeerDescriptor
    transports: tuple[str, ...]
    issued: list[Transport] = attrs.field(factory=list)  # transports `transport_for` handed out


def probe(transport: Transport) -> TransferError | None:
    return transport.run_inline(Slice(TransferOp.READ, memoryview(bytearray(1)), 1, 0, lambda _error: None))


def assert_open(transports: list[Transport]) -> None:
    for transport in transports:
        if transport.name == "rdma":
            continue  # a probe's failed completion would take the queue pair down; its kept one is counted instead
        error = probe(transport)
        assert error is None or "closed" not in str(error), (transport.name, error)


def assert_closed(transports: list[Transport]) -> None:
    for transport in transports:
        error = probe(transport)
        assert isinstance(error, PeerUnavailable) and "closed" in str(error), (transport.name, error)


@settings(max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class PeersMachine(RuleBasedStateMachine):
    """Three `Peers` on 127.0.0.1 against a reference of what each should know.

    Reference: per engine, its regions and their bytes, the handlers it serves, whether it is closed,
    the RDMA queue pairs it accepted (oldest first, at most `max_connections`), and per dialled address
    the descriptor as of the last handshake or refresh and the transports in preference order.

    Checked after every step: `descriptor` and `transport_names` answer exactly the reference; a peer never
    dialled (or forgotten by `close`) is an unknown-peer TransferError; accepted queue pairs beyond
    `max_connections` are closed, oldest first, the rest open; every region holds exactly the bytes the
    reference says (a refused slice moves nothing); the listener's and staging pool's invariants hold.
    On a reconnect over other transports, and on close, every transport handed out for the old connection is
    closed; on one over the same transports, none is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fabric = FakeFabric()
        self.engines = [make_engine(None if index == 0 else CountingVerbs(self.fabric)) for index in range(NUM_ENGINES)]
        self.known: list[dict[str, Known]] = [{} for _ in self.engines]
        self.handlers: list[dict[str, Json]] = [{} for _ in self.engines]
        self.closed: set[int] = set()
        self.accepted: list[list[FakeQueuePair]] = [[] for _ in self.engines]
        self.released: list[FakeQueuePair] = []  # accepted queue pairs that must be closed by now

    # ------------------------------------------------------------------ the reference's expectations

    def usable_transports(self, source: int, target: int, forced: str | None) -> tuple[str, ...]:
        """The transports `connect` builds: every allowed one this pair can use, in preference order."""
        both_rdma = self.engines[source].verbs is not None and self.engines[target].verbs is not None
        usable = {"shm": True, "rdma": both_rdma, "tcp": True}  # one host: shm always reaches
        allowed = (forced,) if forced else CONFIG.transports
        return tuple(name for name in allowed if usable[name])

    def accept(self, target: int, queue_pair: FakeQueuePair) -> None:
        accepted = self.accepted[target]
        accepted.append(queue_pair)
        while len(accepted) > CONFIG.max_connections:
            self.released.append(accepted.pop(0))

    def ask_rdma_connect(self, source: int, target: int, initiator: FakeQueuePair, *, over_the_wire: bool) -> Json:
        address = self.engines[target].address
        if over_the_wire:
            return self.engines[source].peers.call(address, "rdma_connect", initiator.endpoint())
        return self.engines[target].peers.handle_call("rdma_connect", initiator.endpoint())

    def key_strategy(self, source: int) -> st.SearchStrategy[str]:
        """A peer `source` knows. Ordered by engine, not by address: ports differ from run to run, and the
        choices Hypothesis replays must name the same peers."""
        return st.sampled_from(sorted(self.known[source], key=lambda key: self.known[source][key].target))

    # ------------------------------------------------------------------ rules

    @initialize(lengths=st.lists(st.integers(min_value=1, max_value=96), min_size=NUM_ENGINES, max_size=NUM_ENGINES))
    def start_with_a_ring(self, lengths: list[int]) -> None:
        """Each engine starts with a shared region and dials the next (rules add, dial and close more)."""
        for node, length in enumerate(lengths):
            self.add_region(node, shared=True, length=length)
        for source in range(NUM_ENGINES):
            self.connect(source, (source + 1) % NUM_ENGINES, None)

    @rule(node=ENGINE_INDEXES, shared=st.booleans(), length=st.integers(min_value=1, max_value=96))
    def add_region(self, node: int, shared: bool, length: int) -> None:
        """Register more memory on an engine (what `refresh` is for); its bytes start as a pattern."""
        engine = self.engines[node]
        region_id = len(engine.regions) + 1
        initial = np.random.default_rng([node, region_id]).bytes(length)
        if shared:
            segment, array = create_shared(length)
            engine.segments.append(segment)
            array[:] = np.frombuffer(initial, np.uint8)
            descriptor = RegionDescriptor(region_id=region_id, length=length, shm_name=segment.name)
            engine.regions[region_id] = Region(descriptor, array.data, segment)
        else:
            buffer = bytearray(initial)
            engine.regions[region_id] = Region(RegionDescriptor(region_id=region_id, length=length), memoryview(buffer))
        engine.expected[region_id] = bytearray(initial)

    @rule(data=st.data(), node=ENGINE_INDEXES, forced=st.sampled_from([None, None, "tcp", "shm", "rdma"]))
    def dial(self, data: st.DataObject, node: int, forced: str | None) -> None:
        """An open engine dials any engine (itself, and a closed one, included): as `connect`."""
        source = data.draw(st.sampled_from([i for i in range(NUM_ENGINES) if i not in self.closed]), label="source")
        self.connect(source, node, forced)

    def connect(self, source: int, node: int, forced: str | None) -> None:
        """Dial an engine. A closed target is PeerUnavailable, a forced transport the pair cannot use a
        ConfigError, and either way what was known of that address stays. Otherwise a peer known over the same
        transports (the same engine: none restarts here) is kept, only its descriptor fresh, and the transports
        handed out for it stay open (no queue pair is accepted for it again); one known over others is replaced,
        its transports closed."""
        engine, other = self.engines[source], self.engines[node]
        names = self.usable_transports(source, node, forced)
        created_before = len(other.verbs.created) if other.verbs is not None else 0
        if node in self.closed:
            with pytest.raises(PeerUnavailable):
                engine.peers.connect(other.address, transport=forced)
            return
        if not names:
            with pytest.raises(ConfigError, match="no usable transport"):
                engine.peers.connect(other.address, transport=forced)
            return
        assert engine.peers.connect(other.address, transport=forced) == other.address
        old = self.known[source].pop(other.address, None)
        if old is not None and old.transports == names:
            self.known[source][other.address] = Known(node, other.descriptor(), names, old.issued)
            if other.verbs is not None:
                assert len(other.verbs.created) == created_before, "no queue pair for a peer kept"
            assert_open(old.issued)
            return
        self.known[source][other.address] = Known(node, other.descriptor(), names)
        if "rdma" in names:
            assert other.verbs is not None
            created = 2 if source == node else 1  # dialling itself, the engine creates the initiator's too
            assert len(other.verbs.created) == created_before + created, "one queue pair accepted per RDMA connect"
            self.accept(node, other.verbs.created[-1])
        if old is not None:
            assert_closed(old.issued)

    @precondition(lambda self: any(known for i, known in enumerate(self.known) if i not in self.closed))
    @rule(data=st.data(), forced=st.sampled_from([None, "tcp", "shm"]))
    def reconnect(self, data: st.DataObject, forced: str | None) -> None:
        """Dial an address already known (after moving bytes through it, often): as `connect`."""
        open_sources = [i for i, known in enumerate(self.known) if known and i not in self.closed]
        source = data.draw(st.sampled_from(open_sources), label="source")
        key = data.draw(self.key_strategy(source), label="peer")
        self.connect(source, self.known[source][key].target, forced)

    @precondition(lambda self: any(self.known))
    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        """`refresh` fetches and keeps the target's current descriptor; from a closed target it fails with
        PeerUnavailable and the stored descriptor stays."""
        source = data.draw(st.sampled_from([i for i, known in enumerate(self.known) if known]), label="source")
        key = data.draw(self.key_strategy(source), label="peer")
        known = self.known[source][key]
        if known.target in self.closed:
            with pytest.raises(PeerUnavailable):
                self.engines[source].peers.refresh(key)
            return
        current = self.engines[known.target].descriptor()
        assert self.engines[source].peers.refresh(key) == current
        known.descriptor = current

    @rule(node=ENGINE_INDEXES, method=st.sampled_from(HANDLER_METHODS), value=st.integers() | st.text(max_size=6))
    def register_handler(self, node: int, method: str, value: Json) -> None:
        """Serve `method` on an engine; a later registration of the same name replaces the handler."""

        def handler(args: Any, value: Json = value, method: str = method) -> Json:
            return {"method": method, "value": value, "args": args}

        self.engines[node].peers.register_handler(method, handler)
        self.handlers[node][method] = value

    @precondition(lambda self: any(self.known))
    @rule(
        data=st.data(),
        method=st.sampled_from([*HANDLER_METHODS, "describe", "nothing-here"]),
        args=st.none() | st.integers(-5, 5) | st.lists(st.text(max_size=3), max_size=3),
    )
    def call(self, data: st.DataObject, method: str, args: Json) -> None:
        """A control call runs the target's handler for `method` on the arguments sent and answers its value;
        "describe" is the target's current descriptor; a method nobody serves is refused (a TransferError
        that is not PeerUnavailable); a closed target is PeerUnavailable."""
        source = data.draw(st.sampled_from([i for i, known in enumerate(self.known) if known]), label="source")
        key = data.draw(self.key_strategy(source), label="peer")
        target = self.known[source][key].target
        peers = self.engines[source].peers
        if target in self.closed:
            with pytest.raises(PeerUnavailable):
                peers.call(key, method, args)
        elif method == "describe":
            assert PeerDescriptor.from_json(peers.call(key, method, args)) == self.engines[target].descriptor()
        elif method in self.handlers[target]:
            value = self.handlers[target][method]
            assert peers.call(key, method, args) == {"method": method, "value": value, "args": args}
        else:
            with pytest.raises(TransferError, match="no handler") as refused:
                peers.call(key, method, args)
            assert not isinstance(refused.value, PeerUnavailable)

    @rule(node=ENGINE_INDEXES, count=st.integers(min_value=1, max_value=30), source=ENGINE_INDEXES)
    def rdma_connect(self, node: int, count: int, source: int) -> None:
        """Call "rdma_connect" from a peer (over the control connection when the source knows the target, else
        handed to the target directly as its serving connection would): each call answers the endpoint of a
        queue pair connected to the caller's; an engine without RDMA refuses it and accepts none."""
        other = self.engines[node]
        known = self.known[source].get(other.address)
        if known is not None and node in self.closed:
            return  # covered by `call`
        for _ in range(count):
            initiator = FakeVerbs(self.fabric).create_queue_pair()
            if other.verbs is None:
                with pytest.raises(TransferError, match="no RDMA device"):
                    self.ask_rdma_connect(source, node, initiator, over_the_wire=known is not None)
                return
            endpoint = self.ask_rdma_connect(source, node, initiator, over_the_wire=known is not None)
            queue_pair = other.verbs.created[-1]
            assert isinstance(endpoint, dict) and endpoint["qp_num"] == queue_pair.number
            assert queue_pair.remote is initiator, "the accepted queue pair is connected to the caller's"
            self.accept(node, queue_pair)

    @rule(node=ENGINE_INDEXES)
    def close_queue_pairs(self, node: int) -> None:
        """`close_queue_pairs` closes every queue pair the engine accepted."""
        self.engines[node].peers.close_queue_pairs()
        self.released.extend(self.accepted[node])
        self.accepted[node].clear()

    def open_links(self) -> list[tuple[int, str]]:
        """(source, peer) pairs whose both ends are open."""
        links = [
            (source, key)
            for source, known in enumerate(self.known)
            for key, link in known.items()
            if source not in self.closed and link.target not in self.closed
        ]
        return sorted(links, key=lambda link: (link[0], self.known[link[0]][link[1]].target))

    @precondition(lambda self: self.open_links())
    @rule(data=st.data(), num_slices=st.integers(min_value=1, max_value=4))
    def move(self, data: st.DataObject, num_slices: int) -> None:
        """Move a few slices between open engines (see `move_one`)."""
        for _ in range(num_slices):
            source, key = data.draw(st.sampled_from(self.open_links()), label="link")
            op = data.draw(st.sampled_from(list(TransferOp)), label="op")
            self.move_one(data, source, key, op, data.draw(st.binary(max_size=64), label="payload"))

    def move_one(self, data: st.DataObject, source: int, key: str, op: TransferOp, payload: bytes) -> None:
        """Move bytes through the transport `transport_for` picks: the first of the peer's transports that
        reaches the region by its stored descriptor (shm only shared regions; rdma only registered ones, of
        which there are none here; tcp any). A slice inside the region lands byte-exact; one outside it, or
        to a region the target does not have, is refused with TransferError and moves nothing."""
        known = self.known[source][key]
        target = self.engines[known.target]
        region_id = data.draw(st.integers(min_value=1, max_value=len(target.regions) + 1), label="region")
        size = len(target.expected.get(region_id, b""))
        inside = st.integers(min_value=0, max_value=max(0, size - len(payload)))
        offset = data.draw(inside | st.integers(min_value=-2, max_value=size + 2), label="offset")
        stored = {region.region_id: region for region in known.descriptor.regions}.get(region_id)
        reaches = {"shm": stored is not None and stored.shm_name is not None, "rdma": False, "tcp": True}
        chosen = next((name for name in known.transports if reaches[name]), None)
        peers = self.engines[source].peers
        if chosen is None:
            with pytest.raises(TransferError, match="no transport reaches"):
                peers.transport_for(key, region_id)
            return
        transport = peers.transport_for(key, region_id)
        assert transport.name == chosen
        known.issued.append(transport)

        local = bytearray(payload) if op == TransferOp.WRITE else bytearray(b"\xa5" * len(payload))
        before = bytes(local)
        error = transport.run_inline(Slice(op, memoryview(local), region_id, offset, lambda _error: None))
        held = target.expected.get(region_id)
        if held is None or bounds_error(offset, len(payload), len(held)) is not None:
            assert isinstance(error, TransferError) and not isinstance(error, PeerUnavailable), error
            assert bytes(local) == before, "a refused READ filled the local buffer"
            return
        assert error is None, error
        if op == TransferOp.WRITE:
            held[offset : offset + len(payload)] = payload
        else:
            assert bytes(local) == bytes(held[offset : offset + len(payload)])

    @precondition(lambda self: not self.closed)  # once per run: the rest of it goes on with the others
    @rule(node=ENGINE_INDEXES)
    def close(self, node: int) -> None:
        """After `close` the engine knows no peer, every transport it handed out is closed, nobody can connect
        to it, and every connection it served ends."""
        engine = self.engines[node]
        engine.peers.close()
        self.closed.add(node)
        for known in self.known[node].values():
            assert_closed(known.issued)
        self.known[node].clear()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", engine.peers.port), timeout=5).close()
        open_engine = next((i for i in range(NUM_ENGINES) if i not in self.closed), None)
        if open_engine is not None:  # nor can it dial: a peer it kept now would outlive its close
            with pytest.raises(TransferError, match="is closed"):
                engine.peers.connect(self.engines[open_engine].address)
        wait_for(lambda: engine.peers.listener.num_served == 0, timeout=10, what="the served connections to end")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def peers_match_the_reference(self) -> None:
        for source, engine in enumerate(self.engines):
            for key, known in self.known[source].items():
                assert engine.peers.descriptor(key) == known.descriptor
                assert engine.peers.transport_names(key) == known.transports
            for other in [*self.engines, None]:
                key = other.address if other is not None else "127.0.0.1:0"
                if key in self.known[source]:
                    continue
                for ask in (engine.peers.descriptor, engine.peers.transport_names):
                    with pytest.raises(TransferError, match="unknown peer"):
                        ask(key)
                with pytest.raises(TransferError, match="unknown peer"):
                    engine.peers.transport_for(key, 1)

    @invariant()
    def accepted_queue_pairs_are_bounded_oldest_evicted(self) -> None:
        for target, engine in enumerate(self.engines):
            assert engine.peers.num_queue_pairs == len(self.accepted[target])
            assert all(qp.number in self.fabric.queue_pairs for qp in self.accepted[target]), "a kept one is closed"
        assert not any(qp.number in self.fabric.queue_pairs for qp in self.released), "an evicted one is open"

    @invariant()
    def regions_hold_what_was_moved(self) -> None:
        for engine in self.engines:
            for region_id, region in engine.regions.items():
                assert bytes(region.view) == bytes(engine.expected[region_id]), f"region {region_id}"

    @invariant()
    def components_hold_their_invariants(self) -> None:
        for engine in self.engines:
            engine.peers.listener.check_invariants()
            engine.peers.staging.check_invariants()

    def teardown(self) -> None:
        for engine in self.engines:
            engine.peers.close()
            engine.peers.close_queue_pairs()
        for engine in self.engines:
            segments = engine.segments
            engine.regions.clear()  # drop every view of the segments, so they can be unmapped
            for segment in segments:
                try:
                    with contextlib.suppress(BufferError):
                        segment.close()
                finally:
                    segment.unlink()


TestPeersMachine = PeersMachine.TestCase
