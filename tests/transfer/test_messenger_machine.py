"""The messenger as a state machine: three nodes put, fetch and push blocks, let leases expire and release
gone owners, checked after every step against a reference model of what each cache holds and pins.

The model knows each node's cached keys (with losses: an eviction is observed, and must be of an unpinned
block), its reserved keys (fetches into it, pushes into it), every lease each node serves (its owner, pins,
reservations, deadline, and whether it is open, quarantined or gone), the pushers' own pins and the pins the
test takes itself. Blocks are content-addressed: key k always has the bytes `block(k)`.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import BlockPinnedError, CapacityError, TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Fetch, Messenger, Push, _owner, part_range, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey
from tests.transfer.conftest import SECRET

PAGE = 1024
NUM_PAGES = 5  # a small budget: puts, fetches and pushes evict
NUM_NODES = 3
NUM_KEYS = 12
T = TypeVar("T")
LEASE_S = 10.0
MAX_LEASES = 2  # leases a node serves at once (quarantined ones count)
MAX_OPS = 6  # fetches and pushes in flight at once
TIMEOUT_S = 30.0  # a bound on waits, never reached on a healthy run
NOBODY = "127.0.0.1:1"  # an engine address that owns nothing anywhere

nodes_ = st.integers(0, NUM_NODES - 1)
others = st.integers(1, NUM_NODES - 1)  # the other node, as an offset
key_lists = st.lists(st.integers(1, NUM_KEYS), unique=True, min_size=1, max_size=5)
parts_ = st.integers(1, 4)


def pick(data: st.DataObject, options: Sequence[T], label: str) -> T:
    """One of `options` (not empty), by an index drawn from a fixed range: the strategy does not depend on the
    options, which come from what the real caches hold and may differ between Hypothesis' runs of one example
    (a strategy that did was a FlakyStrategyDefinition under CI's load)."""
    return options[data.draw(st.integers(0, 255), label=label) % len(options)]


def block(key: int) -> bytes:
    """The bytes of block `key`: lengths differ per key, two keys fill a whole page."""
    length = PAGE if key % 5 == 0 else 1 + key * 389 % PAGE
    return (xxhash.xxh3_64_digest(key.to_bytes(8, "little")) * (PAGE // 8))[:length]


def is_subsequence(small: Sequence[int], big: Sequence[int]) -> bool:
    rest = iter(big)
    return all(any(x == y for y in rest) for x in small)


@attrs.define(eq=False)
class Node:
    engine: TransferEngine
    cache: TieredCache
    pool: DramPagePool
    messenger: Messenger
    now: list[float]
    peers: dict[int, str] = attrs.field(factory=dict)

    def ready(self) -> set[int]:
        return {int(k) for k, e in self.cache._entries.items() if e.ready}

    def has_no_room(self) -> bool:
        """No free page and no eviction candidate (every cached block pinned or the parent of a cached one)."""
        if self.pool.num_free:
            return False
        ready = {k: e for k, e in self.cache._entries.items() if e.ready}
        parents = {e.parent for e in ready.values()}
        return all(e.pins or k in parents for k, e in ready.items())


def make_node(transport: str) -> Node:
    engine = TransferEngine(secret=SECRET, config=EngineConfig(transports=(transport,), slice_bytes=256))
    pool, region = shared_dram_pool(engine, PAGE, NUM_PAGES)
    cache = TieredCache([pool])
    now = [0.0]
    messenger = Messenger(
        engine,
        cache,
        region=region,
        lease_s=LEASE_S,
        sweep_interval_s=0,
        max_leases=MAX_LEASES,
        clock=lambda: now[0],
    )
    return Node(engine, cache, pool, messenger, now)


@attrs.define(eq=False)
class Lease:
    """The model of a lease node `server` holds for node `owner`."""

    server: int
    owner: int
    deadline: float
    pinned: list[int]
    reserved: list[int]
    state: str = "open"  # open | quarantined | gone
    fetch: FetchOp | None = None


@attrs.define(eq=False)
class FetchOp:
    fetch: Fetch
    src: int
    dst: int
    keys: tuple[int, ...]
    parts: int
    lease: Lease | None
    found: tuple[int, ...]  # the leading run the source held
    waited: set[int] = attrs.field(factory=set)
    # The source's page claims when its pins ended before every part was waited for, and when every part had been.
    unpinned_at: int | None = None
    arrived_at: int | None = None

    def is_uncertain(self, claims: int) -> bool:
        """The pins ended before the bytes surely arrived, and the source has claimed a page since (for
        another block, which may have been written where a read of this fetch was still going on)."""
        return (
            self.unpinned_at is not None and (claims if self.arrived_at is None else self.arrived_at) > self.unpinned_at
        )


@attrs.define(eq=False)
class PushOp:
    push: Push
    src: int
    dst: int
    keys: list[int]  # pinned at the pusher until finish/abort
    targets: list[int]  # reserved at the receiver
    parts: int
    lease: Lease
    dead: bool = False  # its owner was said gone: it may only abort


class MessengerMachine(RuleBasedStateMachine):
    """Three real nodes on 127.0.0.1 (one transport per run) against the reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.held: list[set[int]] = [set() for _ in range(NUM_NODES)]
        self.test_pins: list[Counter[int]] = [Counter() for _ in range(NUM_NODES)]
        self.leases: list[Lease] = []
        self.fetches: list[FetchOp] = []
        self.pushes: list[PushOp] = []
        self.claims = [0] * NUM_NODES  # pages each node has claimed for a block (put, fetched into, pushed into)

    @initialize(
        transport=st.sampled_from(["tcp", "shm"]),
        contents=st.lists(
            st.lists(st.integers(1, NUM_KEYS), unique=True, max_size=NUM_PAGES), min_size=NUM_NODES, max_size=NUM_NODES
        ),
    )
    def start(self, transport: str, contents: list[list[int]]) -> None:
        """Three nodes, each connected to the others, each caching a chain of blocks to begin with."""
        for _ in range(NUM_NODES):
            self.nodes.append(make_node(transport))
        for i, node in enumerate(self.nodes):
            for j, other in enumerate(self.nodes):
                if i != j:
                    node.peers[j] = node.engine.connect(other.engine.address)
        for n, keys in enumerate(contents):
            self.put(n, keys, chained=True)

    def teardown(self) -> None:
        failing = sys.exc_info()[0] is not None  # a step failed (or was cut short): report that, not the drain
        try:
            if self.nodes and not failing:
                self.drain()
        finally:
            for node in self.nodes:
                node.messenger.close()
                node.engine.close()

    # ------------------------------------------------------------------ the model

    def live_leases(self, server: int) -> list[Lease]:
        return [lease for lease in self.leases if lease.server == server and lease.state != "gone"]

    def end_lease(self, lease: Lease) -> None:
        if lease.fetch is not None and lease.state == "open" and len(lease.fetch.waited) < lease.fetch.parts:
            lease.fetch.unpinned_at = self.claims[lease.server]
        lease.pinned, lease.reserved, lease.state = [], [], "gone"
        self.leases = [other for other in self.leases if other.state != "gone"]

    def model_sweep(self, n: int) -> None:
        """What `Messenger.sweep` does at node n: expired leases lose their pins; those with reservations
        stay quarantined, the others end."""
        now = self.nodes[n].now[0]
        for lease in self.live_leases(n):
            if lease.state == "open" and lease.deadline < now:
                if lease.reserved:
                    lease.pinned, lease.state = [], "quarantined"
                else:
                    self.end_lease(lease)

    def expected_pins(self, n: int) -> Counter[int]:
        pins = Counter(self.test_pins[n])
        for lease in self.live_leases(n):
            pins.update(lease.pinned)
        for op in self.pushes:
            if op.src == n:
                pins.update(op.keys)
        return +pins

    def expected_reserved(self, n: int) -> list[int]:
        reserved = [k for op in self.fetches if op.dst == n for k in op.keys]
        reserved += [k for lease in self.live_leases(n) for k in lease.reserved]
        return sorted(reserved)

    def observe(self, n: int, added: Sequence[int] = ()) -> None:
        """Take the node's cached keys into the model: nothing appears that was not added, and what went
        was evictable (unpinned)."""
        actual = self.nodes[n].ready()
        allowed = self.held[n] | set(added)
        assert actual <= allowed, f"node {n} caches blocks nobody put there: {actual - allowed}"
        pins = self.expected_pins(n)
        lost = self.held[n] - actual
        assert not [k for k in lost if pins[k]], f"node {n} lost pinned blocks {lost}"
        self.held[n] = actual

    def op_count(self) -> int:
        return len(self.fetches) + len(self.pushes)

    # ------------------------------------------------------------------ local rules

    @rule(n=nodes_, keys=key_lists, chained=st.booleans())
    def put(self, n: int, keys: list[int], chained: bool) -> None:
        """Put blocks locally (a chain, or loose): evicts under the small budget, refused only when all
        is pinned."""
        node, reserved = self.nodes[n], set(self.expected_reserved(n))
        added: list[int] = []
        parent = None
        for key in keys:
            self.claims[n] += BlockKey(key) not in node.cache._entries
            try:
                node.cache.put(BlockKey(key), block(key), parent=parent if chained else None)
            except CapacityError:
                assert node.has_no_room(), f"node {n} refused a put with room to spare"
                break
            except BlockPinnedError:  # a put of a block being filled is refused and changes nothing
                assert key in reserved, f"node {n} refused a put of block {key}, which is not being filled"
                parent = BlockKey(key)
                continue
            added.append(key)
            parent = BlockKey(key)
        self.observe(n, added)
        assert not added or added[-1] in self.held[n], "the block put last is gone already"

    @precondition(lambda self: any(self.held))
    @rule(data=st.data())
    def pin_or_unpin(self, data: st.DataObject) -> None:
        """The node's own engine pins a cached block (which nothing may then evict), or lets one go."""
        n = pick(data, [i for i in range(NUM_NODES) if self.held[i]], "node")
        if self.test_pins[n] and (sum(self.test_pins[n].values()) > 1 or data.draw(st.booleans(), label="unpin")):
            key = data.draw(st.sampled_from(sorted(self.test_pins[n])), label="key")
            self.nodes[n].cache.unpin(BlockKey(key))
            self.test_pins[n][key] -= 1
            self.test_pins[n] = +self.test_pins[n]
        else:
            key = pick(data, sorted(self.held[n]), "key")
            self.nodes[n].cache.pin(BlockKey(key))
            self.test_pins[n][key] += 1

    @rule(dt=st.sampled_from([0.5, 9.5, 10.0, 10.5, 30.0]), sweeps=st.lists(nodes_, unique=True, max_size=NUM_NODES))
    def time_passes(self, dt: float, sweeps: list[int]) -> None:
        """Every node's clock moves on; some sweepers run (elsewhere expired leases end at the next call)."""
        for node in self.nodes:
            node.now[0] += dt
        for n in sweeps:
            self.model_sweep(n)
            self.nodes[n].messenger.sweep()

    @rule(data=st.data(), nobody=st.booleans())
    def release_owner(self, data: st.DataObject, nobody: bool) -> None:
        """A node's process is said gone: every lease it holds at another node ends, quarantined or not (an
        address that owns nothing ends nothing)."""
        pairs = sorted({(lease.server, lease.owner) for lease in self.leases if lease.state != "gone"})
        if nobody or not pairs:
            n = data.draw(nodes_, label="node")
            assert self.nodes[n].messenger.release_owner(NOBODY) == 0
            return
        n, owner = data.draw(st.sampled_from(pairs), label="node, owner")
        ended = [lease for lease in self.live_leases(n) if lease.owner == owner]
        for op in self.pushes:
            if op.src == owner and op.dst == n and not op.dead:
                # A gone process writes nothing more: let the slices it started end first, and send no more.
                for batch in op.push._batches.values():
                    self.nodes[owner].engine.wait(batch, timeout=TIMEOUT_S)
                op.dead = True
        assert self.nodes[n].messenger.release_owner(self.nodes[owner].engine.address) == len(ended)
        for lease in ended:
            self.end_lease(lease)

    # ------------------------------------------------------------------ fetch

    def start_fetch(self, src: int, dst: int, keys: list[int], parts: int) -> FetchOp | None:
        source, sink = self.nodes[src], self.nodes[dst]
        self.model_sweep(dst)  # fetch() sweeps here, then the lookup sweeps at the source
        self.model_sweep(src)
        found: list[int] = []
        for key in keys:
            if key not in self.held[src]:
                break
            found.append(key)
        held_before, reserved_before = set(self.held[dst]), set(self.expected_reserved(dst))
        wanted = [BlockKey(k) for k in keys]
        if len(self.live_leases(src)) >= MAX_LEASES:
            with pytest.raises(TransferError, match="max_leases"):
                sink.messenger.fetch(wanted, sink.peers[src], parts=parts)
            return None
        fetch = sink.messenger.fetch(wanted, sink.peers[src], parts=parts)
        got = [int(k) for k in fetch.keys]
        assert is_subsequence(got, found), f"fetched {got}, the peer's leading run is {found}"
        assert not set(got) & reserved_before, "a block already being filled was fetched again"
        skipped = [k for k in found if k not in got and k not in held_before and k not in reserved_before]
        if skipped:  # only for want of room, and then the fetch stops there
            cut = found.index(skipped[0])
            assert all(found.index(k) < cut for k in got), f"fetched {got} past block {skipped[0]}"
            assert sink.has_no_room(), f"fetched {got} of {found}, leaving {skipped[0]} with room to spare"
        lease = None
        if found:
            lease = Lease(src, dst, source.now[0] + LEASE_S, list(found), [])
            self.leases.append(lease)
        op = FetchOp(fetch, src, dst, tuple(got), parts, lease, tuple(found))
        self.claims[dst] += len(got)
        if lease is not None:
            lease.fetch = op
        self.fetches.append(op)
        self.observe(dst)
        return op

    def finish_fetch(self, op: FetchOp) -> list[int]:
        self.fetches.remove(op)
        done = [int(k) for k in op.fetch.finish(timeout=TIMEOUT_S)]
        assert op.fetch.finish(timeout=TIMEOUT_S) == tuple(done), "a second finish answers differently"
        if op.lease is not None and op.lease.state != "gone":
            self.end_lease(op.lease)
        self.observe(op.dst, done)
        assert set(done) <= self.held[op.dst], "a committed block is not cached"
        entries = self.nodes[op.dst].cache._entries
        for key in done:  # chained as the source's run: prefix-aware eviction takes the leaves first
            index = op.found.index(key)
            assert entries[BlockKey(key)].parent == (op.found[index - 1] if index else None), f"block {key}"
        return done

    def draw_wanted(self, data: st.DataObject, src: int) -> list[int]:
        """Keys to fetch from src: mostly a run of blocks it caches, then perhaps keys it may lack."""
        # Drawn from every key, then kept where cached: a strategy over what the real cache holds (which timing
        # may change between Hypothesis' runs of one example) is flaky data generation to Hypothesis.
        picked = data.draw(st.lists(st.integers(1, NUM_KEYS), unique=True, max_size=NUM_KEYS), label="cached keys")
        head = [key for key in picked if key in self.held[src]]
        tail = data.draw(st.lists(st.integers(1, NUM_KEYS), unique=True, max_size=3), label="other keys")
        keys = list(dict.fromkeys(head + tail))
        return keys or tail or [1]

    @precondition(lambda self: self.op_count() < MAX_OPS)
    @rule(src=nodes_, other=others, parts=parts_, data=st.data())
    def fetch(self, src: int, other: int, parts: int, data: st.DataObject) -> None:
        """Start a fetch: the peer pins the leading run it holds, we reserve pages and READ into them."""
        self.start_fetch(src, (src + other) % NUM_NODES, self.draw_wanted(data, src), parts)

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def fetch_wait_part(self, data: st.DataObject) -> None:
        """Any part, in any order: once it returns, that byte range of every block is in place."""
        op = self.fetches[data.draw(st.integers(0, len(self.fetches) - 1), label="fetch")]
        part = data.draw(st.integers(0, op.parts - 1), label="part")
        op.fetch.wait_part(part, timeout=TIMEOUT_S)
        op.waited.add(part)
        if len(op.waited) == op.parts and op.arrived_at is None:
            op.arrived_at = self.claims[op.src]
        if op.is_uncertain(self.claims[op.src]):
            return
        node = self.nodes[op.dst]
        for key in op.keys:
            location = node.cache.location(BlockKey(key))
            assert location is not None and not location.ready
            start, end = part_range(len(block(key)), op.parts, part)
            page = node.pool.buffer[location.page * PAGE :]
            assert bytes(page[start:end]) == block(key)[start:end], f"part {part} of block {key} did not arrive"

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def fetch_finish(self, data: st.DataObject) -> None:
        """Every block fetched is committed (unless the peer's pins expired before its bytes arrived: then
        some may be dropped, never committed wrong)."""
        op = self.fetches[data.draw(st.integers(0, len(self.fetches) - 1), label="fetch")]
        uncertain = op.is_uncertain(self.claims[op.src])
        done = self.finish_fetch(op)
        if uncertain:
            assert is_subsequence(done, op.keys)
        else:
            assert done == list(op.keys)

    @precondition(lambda self: self.op_count() < MAX_OPS)
    @rule(src=nodes_, other=others, parts=parts_, data=st.data())
    def fetch_a_corrupted_block(self, src: int, other: int, parts: int, data: st.DataObject) -> None:
        """A block's bytes at the source change after its checksum was taken: the fetcher drops it and
        commits the others."""
        source, dst = self.nodes[src], (src + other) % NUM_NODES
        keys = self.draw_wanted(data, src)
        busy = {k for op in self.fetches if op.src == src and len(op.waited) < op.parts for k in op.keys}
        busy |= {k for op in self.pushes if op.src == src for k in op.keys}
        found: list[int] = []
        for key in keys:
            if key not in self.held[src]:
                break
            found.append(key)
        candidates = [k for k in found if k not in busy]
        if not candidates:
            return
        victim = data.draw(st.sampled_from(candidates), label="victim")
        source.cache.checksum(BlockKey(victim))  # taken (and remembered) while the bytes are right
        location = source.cache.location(BlockKey(victim))
        assert location is not None
        offset = location.page * PAGE + data.draw(st.integers(0, len(block(victim)) - 1), label="byte")
        source.pool.buffer[offset] ^= 0xFF
        try:
            op = self.start_fetch(src, dst, keys, parts)
            if op is None:
                return
            done = self.finish_fetch(op)
        finally:
            source.pool.buffer[offset] ^= 0xFF
        assert done == [k for k in op.keys if k != victim], f"victim {victim}: committed {done} of {op.keys}"

    # ------------------------------------------------------------------ push

    def start_push(self, data: st.DataObject, other: int, parts: int) -> PushOp | None:
        src = data.draw(st.sampled_from([i for i in range(NUM_NODES) if self.held[i]]), label="src")
        dst = (src + other) % NUM_NODES
        lacking = sorted(self.held[src] - self.held[dst])  # mostly push what the receiver lacks
        prefer_lacking: bool = bool(lacking) and data.draw(st.booleans(), label="lacking")
        choice = lacking if prefer_lacking else sorted(self.held[src])
        keys = data.draw(st.lists(st.sampled_from(choice), unique=True, min_size=1, max_size=4), label="keys")
        source, sink = self.nodes[src], self.nodes[dst]
        self.model_sweep(src)  # push() sweeps here, then the reservation sweeps at the receiver
        self.model_sweep(dst)
        wanted = [BlockKey(k) for k in keys]
        if len(self.live_leases(dst)) >= MAX_LEASES:
            with pytest.raises(TransferError, match="max_leases"):
                source.messenger.push(wanted, source.peers[dst], parts=parts)
            return None
        reserved_before = set(self.expected_reserved(dst))
        push = source.messenger.push(wanted, source.peers[dst], parts=parts)
        targets = [int(k) for k in push.keys]
        assert is_subsequence(targets, keys)
        assert not set(targets) & reserved_before, "a block already being filled was reserved again"
        now_ready = sink.ready()
        for key in keys:
            if key not in targets and key not in now_ready and key not in reserved_before:
                assert sink.has_no_room(), f"block {key} was not reserved though there was room"
        holds = [k for k in keys if k not in targets and k in now_ready]
        lease = Lease(dst, src, sink.now[0] + LEASE_S, holds, targets)
        self.claims[dst] += len(targets)
        self.leases.append(lease)
        op = PushOp(push, src, dst, list(keys), targets, parts, lease)
        self.pushes.append(op)
        self.observe(dst)
        return op

    @precondition(lambda self: any(self.held) and self.op_count() < MAX_OPS)
    @rule(data=st.data(), other=others, parts=parts_)
    def push(self, data: st.DataObject, other: int, parts: int) -> None:
        """Start a push of cached blocks: the receiver reserves pages for those it lacks (if room), holds
        those it has, and we pin ours."""
        self.start_push(data, other, parts)

    @precondition(lambda self: any(self.held) and self.op_count() < MAX_OPS)
    @rule(data=st.data(), other=others, parts=parts_, sent=st.sets(st.integers(0, 3)))
    def push_then_pause(self, data: st.DataObject, other: int, parts: int, sent: set[int]) -> None:
        """A pusher sends some parts, then stops (SIGSTOP) past its lease: the receiver's sweeper releases
        the blocks it held for it and quarantines the pages it reserved."""
        op = self.start_push(data, other, parts)
        if op is None:
            return
        for part in sorted(sent):
            op.push.send_part(part % parts)
        self.nodes[op.dst].now[0] += LEASE_S + 0.5
        self.model_sweep(op.dst)
        self.nodes[op.dst].messenger.sweep()

    @precondition(lambda self: any(not op.dead for op in self.pushes))
    @rule(data=st.data())
    def push_send_part(self, data: st.DataObject) -> None:
        """Ship one part (again: a no-op) into the receiver's reserved pages, quarantined ones included."""
        live = [op for op in self.pushes if not op.dead]
        op = live[data.draw(st.integers(0, len(live) - 1), label="push")]
        op.push.send_part(data.draw(st.integers(0, op.parts - 1), label="part"))

    @precondition(lambda self: any(not op.dead for op in self.pushes))
    @rule(data=st.data())
    def push_finish(self, data: st.DataObject) -> None:
        """An open lease commits every reserved block; an expired one is refused (its pages then free)."""
        live = [op for op in self.pushes if not op.dead]
        op = live[data.draw(st.integers(0, len(live) - 1), label="push")]
        self.pushes.remove(op)
        state = op.lease.state
        done: list[int] = []
        if state == "open":
            done = [int(k) for k in op.push.finish(timeout=TIMEOUT_S)]
            assert done == op.targets, f"committed {done} of the reserved {op.targets}"
        else:
            match = "expired lease" if state == "quarantined" else "unknown or expired lease"
            with pytest.raises(TransferError, match=match):
                op.push.finish(timeout=TIMEOUT_S)
        assert op.push.finish(timeout=TIMEOUT_S) == tuple(done), "a second finish answers differently"
        if state != "gone":
            self.end_lease(op.lease)
        self.observe(op.dst, done)
        assert set(done) <= self.held[op.dst], "a committed block is not cached"

    @precondition(lambda self: self.pushes)
    @rule(data=st.data())
    def push_abort(self, data: st.DataObject) -> None:
        """Give up: the receiver releases what it held and reserved (quarantined or not), we unpin ours."""
        op = self.pushes.pop(data.draw(st.integers(0, len(self.pushes) - 1), label="push"))
        op.push.abort()
        if op.lease.state != "gone":
            self.end_lease(op.lease)
        self.observe(op.dst)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def caches_match_the_model(self) -> None:
        """Cached keys, their bytes, reserved keys, pins, page accounting and leases are the model's."""
        for n, node in enumerate(self.nodes):
            node.cache.check_invariants()
            node.pool.allocator.check_invariants()
            entries = dict(node.cache._entries)
            assert node.pool.num_pages - node.pool.num_free == len(entries), "pages leaked"
            ready = {int(k): e for k, e in entries.items() if e.ready}
            assert set(ready) == self.held[n]
            assert sorted(int(k) for k, e in entries.items() if not e.ready) == self.expected_reserved(n)
            pins = self.expected_pins(n)
            assert set(pins) <= set(ready), f"node {n}: pins on blocks it does not cache: {pins}"
            for key, entry in ready.items():
                start = entry.page * PAGE
                assert bytes(node.pool.buffer[start : start + entry.length]) == block(key), f"node {n}: {key}"
                assert entry.pins == pins[key], f"node {n}: block {key} pinned {entry.pins}, want {pins[key]}"
            states = Counter(lease.state for lease in self.live_leases(n))
            assert len(node.messenger._leases) == states["open"], f"node {n}: open leases"
            assert node.messenger.quarantined == states["quarantined"], f"node {n}: quarantined leases"

    def drain(self) -> None:
        """Abort every push, finish every fetch, drop our pins: nothing stays pinned, reserved or leased, and
        every cached block has its own bytes."""
        for push in self.pushes:
            push.push.abort()
        for fetch in self.fetches:
            fetch.fetch.finish(timeout=TIMEOUT_S)
        for n, pins in enumerate(self.test_pins):
            for key, count in pins.items():
                for _ in range(count):
                    self.nodes[n].cache.unpin(BlockKey(key))
        for n, node in enumerate(self.nodes):
            entries = node.cache._entries
            assert all(e.ready and e.pins == 0 for e in entries.values()), f"node {n}: {entries}"
            for key, entry in entries.items():
                start = entry.page * PAGE
                assert bytes(node.pool.buffer[start : start + entry.length]) == block(key), f"node {n}: {key}"
            assert not node.messenger._leases and node.messenger.quarantined == 0, f"node {n}: leases left"
            assert node.pool.num_pages - node.pool.num_free == len(entries)


MessengerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
TestMessengerMachine = MessengerMachine.TestCase


# ---------------------------------------------------------------------- pure helpers


@given(length=st.integers(0, 1 << 20), parts=st.integers(1, 64), beyond=st.integers(0, 8))
def test_parts_tile_a_block_in_order(length: int, parts: int, beyond: int) -> None:
    """The parts tile [0, length) in order; every non-empty part but the last is ceil(length / parts) bytes,
    the last at most that; empty parts come only at the end, and parts past the last are empty."""
    ranges = [part_range(length, parts, p) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(ranges))
    sizes = [end - start for start, end in ranges]
    assert all(size >= 0 for size in sizes)
    step = -(-length // parts)
    filled = [size for size in sizes if size]
    assert sizes[: len(filled)] == filled, f"an empty part before a filled one: {sizes}"
    assert all(size == step for size in filled[:-1]) and all(0 < size <= step for size in filled[-1:])
    assert part_range(length, parts, parts + beyond) == (length, length)


@given(layer_bytes=st.integers(0, 1 << 14), parts=st.integers(1, 64), part=st.integers(0, 63))
def test_a_block_laid_out_layer_by_layer_moves_a_layer_per_part(layer_bytes: int, parts: int, part: int) -> None:
    """When the length is `parts` equal layers, part p is exactly layer p."""
    part %= parts
    assert part_range(layer_bytes * parts, parts, part) == (part * layer_bytes, (part + 1) * layer_bytes)


@given(
    args=st.one_of(
        st.fixed_dictionaries({"owner": st.builds(str.__mul__, st.characters(), st.integers(250, 260))}),
        st.fixed_dictionaries(
            {"owner": st.one_of(st.text(max_size=30), st.integers(), st.none(), st.lists(st.text()))}
        ),
        st.fixed_dictionaries({}),
        st.one_of(st.none(), st.integers(), st.lists(st.text(), max_size=3), st.text(max_size=5)),
    )
)
def test_a_lease_owner_is_an_address_of_at_most_256_characters(args: object) -> None:
    """A call's owner is its string of at most 256 characters, "" when absent (or the args are no object);
    any other value is refused with a TransferError, never passed on."""
    owner = args.get("owner", "") if isinstance(args, dict) else ""
    if isinstance(owner, str) and len(owner) <= 256:
        assert _owner(args) == owner
    else:
        with pytest.raises(TransferError, match="at most 256"):
            _owner(args)


def test_lease_ids_are_refused_past_64_characters() -> None:
    """A lookup under an id of up to 64 characters opens a lease and pins; a longer id is refused before
    anything is pinned or opened."""
    node = make_node("tcp")
    try:
        node.cache.put(BlockKey(1), block(1))
        for length in range(60, 70):
            lease = "x" * length
            if length <= 64:
                found: Any = node.engine.handle_call("blocks.lookup", {"lease": lease, "keys": [1]})
                assert [entry[0] for entry in found["blocks"]] == [1]
                assert len(node.messenger._leases) == 1 and node.cache._entries[BlockKey(1)].pins == 1
                node.engine.handle_call("blocks.release", {"lease": lease})
            else:
                with pytest.raises(TransferError, match="at most 64"):
                    node.engine.handle_call("blocks.lookup", {"lease": lease, "keys": [1]})
            assert not node.messenger._leases and node.cache._entries[BlockKey(1)].pins == 0
    finally:
        node.messenger.close()
        node.engine.close()
