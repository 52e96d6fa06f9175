"""The messenger: fetch and push of KV blocks between two nodes' caches, whole or part by part."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.cache.pool import DramPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.errors import (
    BlockPinnedError,
    ConfigError,
    MooncakeError,
    PeerUnavailable,
    TransferError,
    UnknownBlockError,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, part_range, shared_dram_pool
from mooncake.transfer.request import EngineConfig
from mooncake.transfer.wire import ProtocolError
from mooncake.types import BlockKey
from tests.transfer.conftest import SECRET

PAGE = 4096


def block(key: int) -> bytes:
    return (xxhash.xxh3_64_digest(key.to_bytes(8, "little")) * (PAGE // 8))[: 100 + key * 37 % (PAGE - 100)]


@attrs.define
class Node:
    engine: TransferEngine
    cache: TieredCache
    messenger: Messenger
    now: list[float]


def make_node(pages: int, transport: str, *, max_leases: int = 4096) -> Node:
    engine = TransferEngine(secret=SECRET, config=EngineConfig(transports=(transport,), slice_bytes=1024))
    pool, region = shared_dram_pool(engine, PAGE, pages)
    cache = TieredCache([pool])
    now = [0.0]
    messenger = Messenger(
        engine, cache, region=region, lease_s=10.0, sweep_interval_s=0, max_leases=max_leases, clock=lambda: now[0]
    )
    return Node(engine, cache, messenger, now)


@pytest.fixture(params=["tcp", "shm"])
def nodes(request: pytest.FixtureRequest) -> Iterator[tuple[Node, Node, str]]:
    """Two nodes over one transport; the first is connected to the second."""
    a, b = make_node(16, request.param), make_node(16, request.param)
    peer = a.engine.connect(b.engine.address)
    yield a, b, peer
    a.engine.close()
    b.engine.close()


def test_fetch_replicates_the_leading_blocks(nodes: tuple[Node, Node, str]) -> None:
    """Fetch copies the held prefix of the keys, byte-exact, stops at the first missing key, releases pins."""
    a, b, peer = nodes
    for key in (1, 2, 3, 5):
        b.cache.put(BlockKey(key), block(key))
    fetch = a.messenger.fetch([BlockKey(k) for k in (1, 2, 3, 4, 5)], peer)
    assert fetch.keys == (1, 2, 3)
    assert fetch.finish(timeout=10) == (1, 2, 3)
    for key in (1, 2, 3):
        assert bytes(a.cache.get(BlockKey(key))) == block(key)
    assert BlockKey(5) not in a.cache
    for key in (1, 2, 3):
        b.cache.remove(BlockKey(key))  # raises if a pin leaked


def test_fetched_blocks_are_chained_to_their_parents(nodes: tuple[Node, Node, str]) -> None:
    """Each fetched block names the one before it as its parent (the first none), as a prefill's stored blocks do:
    prefix-aware eviction takes the chain's leaves first."""
    a, b, peer = nodes
    for key in (1, 2, 3):
        b.cache.put(BlockKey(key), block(key))
    assert a.messenger.fetch([BlockKey(k) for k in (1, 2, 3)], peer).finish(timeout=10) == (1, 2, 3)
    assert [a.cache._entries[BlockKey(k)].parent for k in (1, 2, 3)] == [None, 1, 2]  # the chain the cache keeps


def test_fetch_skips_blocks_already_held(nodes: tuple[Node, Node, str]) -> None:
    """Blocks the fetcher holds are not moved again."""
    a, b, peer = nodes
    for key in (1, 2):
        b.cache.put(BlockKey(key), block(key))
    a.cache.put(BlockKey(1), block(1))
    fetch = a.messenger.fetch([BlockKey(1), BlockKey(2)], peer)
    assert fetch.keys == (2,)
    assert fetch.finish(timeout=10) == (2,)


def test_fetch_part_by_part(nodes: tuple[Node, Node, str]) -> None:
    """With parts, each byte range can be waited for alone; the blocks commit once all arrived."""
    a, b, peer = nodes
    b.cache.put(BlockKey(7), block(7))
    fetch = a.messenger.fetch([BlockKey(7)], peer, parts=4)
    for part in range(4):
        fetch.wait_part(part, timeout=10)
        start, end = part_range(len(block(7)), 4, part)
        location = a.cache.location(BlockKey(7))
        assert location is not None and not location.ready  # still reserved: readable by the engine, not served
        page = a.cache.pools[0].buffer[location.page * PAGE :]  # type: ignore[attr-defined]
        assert bytes(page[start:end]) == block(7)[start:end]
    assert fetch.finish(timeout=10) == (7,)


def test_push_streams_blocks_layer_by_layer(nodes: tuple[Node, Node, str]) -> None:
    """A block being filled can be pushed part by part as its bytes become final; the peer commits it verified."""
    a, b, peer = nodes
    data = block(11)
    view = a.cache.reserve(BlockKey(11), len(data))
    push = a.messenger.push([BlockKey(11)], peer, parts=2)
    half = part_range(len(data), 2, 0)[1]
    view[:half] = data[:half]
    push.send_part(0)
    view[half:] = data[half:]
    assert push.finish(timeout=10) == (11,)
    assert bytes(b.cache.get(BlockKey(11))) == data
    a.cache.commit(BlockKey(11))


def test_push_of_cached_blocks_and_unknown_ones(nodes: tuple[Node, Node, str]) -> None:
    """Cached blocks are pinned while pushed and released after; a key not held raises before anything moves."""
    a, b, peer = nodes
    a.cache.put(BlockKey(3), block(3))
    assert a.messenger.push([BlockKey(3)], peer).finish(timeout=10) == (3,)
    assert bytes(b.cache.get(BlockKey(3))) == block(3)
    a.cache.remove(BlockKey(3))  # no pin left behind
    with pytest.raises(UnknownBlockError):
        a.messenger.push([BlockKey(99)], peer)


@pytest.mark.parametrize("held_first", [True, False], ids=["held-block-is-a-parent", "held-block-is-a-leaf"])
def test_a_pushed_block_the_peer_holds_already_is_kept_until_the_commit(held_first: bool) -> None:
    """A block the receiver caches already is not sent again, and not evicted while the push runs: other
    blocks arriving meanwhile evict around it, and at the commit it becomes the last to go (also as the chain's
    leaf, which prefix-aware eviction does not protect as it does a parent of what was sent)."""
    a, b = make_node(8, "tcp"), make_node(4, "tcp")
    try:
        peer = a.engine.connect(b.engine.address)
        held, sent = BlockKey(1), BlockKey(2)
        for key in (held, sent):
            a.cache.put(key, block(key))
        b.cache.put(held, block(held))  # the oldest block there
        push = a.messenger.push([held, sent] if held_first else [sent, held], peer)
        for key in (10, 11, 12, 13):  # two free pages, then two evictions, while the push runs
            b.cache.put(BlockKey(key), block(key))
        assert held in b.cache and BlockKey(10) not in b.cache and BlockKey(11) not in b.cache
        assert push.finish(timeout=10) == (sent,)
        b.cache.put(BlockKey(14), block(14))  # evicts the least recently used: not the block just used
        assert held in b.cache and bytes(b.cache.get(held)) == block(held)
        b.cache.remove(held)  # no pin left behind
    finally:
        a.engine.close()
        b.engine.close()


def test_a_corrupted_block_is_not_committed(nodes: tuple[Node, Node, str]) -> None:
    """If the bytes change between lookup and transfer, the peer's checksum catches it and the block is dropped."""
    a, b, peer = nodes
    b.cache.put(BlockKey(4), block(4))
    b.cache.put(BlockKey(5), block(5))
    fetch = a.messenger.fetch([BlockKey(4), BlockKey(5)], peer)
    fetch.wait_part(0, timeout=10)
    location = a.cache.location(BlockKey(4))
    assert location is not None
    a.cache.pools[0].buffer[location.page * PAGE] ^= 0xFF  # type: ignore[attr-defined]
    assert fetch.finish(timeout=10) == (5,)
    assert BlockKey(4) not in a.cache


def test_a_fetch_leaves_alone_a_reservation_made_after_its_commit_failed(
    nodes: tuple[Node, Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block whose bytes fail the peer's checksum is aborted by the commit itself: the page is free at once, and
    another lease (a peer's push, served on another thread) may reserve the key before the fetch ends. The fetch
    then aborts only what is still its own: the push keeps its page and its lease still holds the key. (The fetch
    aborted every key it had not committed, so it freed the push's page under it.)"""
    a, b, peer = nodes
    key = BlockKey(1)
    b.cache.put(key, block(1))
    fetch = a.messenger.fetch([key], peer)
    fetch.wait_part(0, timeout=10)
    location = a.cache.location(key)
    assert location is not None
    a.cache.pools[0].buffer[location.page * PAGE] ^= 0xFF  # type: ignore[attr-defined]
    commit, pushed = a.cache.commit, []

    def commit_then_a_push_reserves(key: BlockKey, *, checksum: int | None = None) -> None:
        try:
            commit(key, checksum=checksum)
        finally:  # what a serving thread does meanwhile: a push from another node reserves the same key
            pushed.append(a.messenger._serve_reserve({"lease": "push", "blocks": [[key, len(block(1)), None]]}))

    monkeypatch.setattr(a.cache, "commit", commit_then_a_push_reserves)
    assert fetch.finish(timeout=10) == ()
    assert pushed[0]["blocks"][0][1] is not None, pushed  # the push got a page
    held = a.cache.location(key)
    assert held is not None and not held.ready, "the fetch gave back the page the push is writing into"
    assert a.cache.pools[0].num_free == 16 - 1
    assert a.messenger._leases["push"].reserved == [key]


def test_leases_release_pins_of_a_vanished_peer(nodes: tuple[Node, Node, str]) -> None:
    """Pins taken for a peer that never releases them go when its lease expires."""
    a, b, peer = nodes
    b.cache.put(BlockKey(8), block(8))
    a.messenger.fetch([BlockKey(8)], peer)  # and never finished
    with pytest.raises(BlockPinnedError, match="pinned"):
        b.cache.remove(BlockKey(8))
    b.now[0] += 9.0
    b.messenger.sweep()
    with pytest.raises(BlockPinnedError, match="pinned"):
        b.cache.remove(BlockKey(8))  # not yet expired
    b.now[0] += 2.0
    b.messenger.sweep()  # what the sweeper thread does, without any call arriving
    b.cache.remove(BlockKey(8))


def test_an_expired_push_keeps_its_pages_until_its_pusher_is_back_or_gone(nodes: tuple[Node, Node, str]) -> None:
    """A pusher paused past its lease (SIGSTOP) may resume mid-write: the pages reserved for it stay reserved,
    so no other block lands where it writes, until it commits (refused: expired; the pages then free) or its
    process is said gone (`release_owner`); the blocks never count as cached."""
    a, b, peer = nodes
    pool = b.cache.pools[0]
    for key in (1, 2):
        a.cache.put(BlockKey(key), block(key))
    late = a.messenger.push([BlockKey(1)], peer)  # reserved at b, nothing written yet: the pusher is paused
    b.now[0] += 11.0
    b.messenger.sweep()
    assert b.messenger.quarantined == 1 and BlockKey(1) not in b.cache
    location = b.cache.location(BlockKey(1))
    assert location is not None and not location.ready
    for key in range(100, 100 + 20):  # more blocks than pages: evictions, never of the quarantined page
        b.cache.put(BlockKey(key), block(key))
    assert b.cache.location(BlockKey(1)) == location
    held = [b.cache.location(BlockKey(k)) for k in range(100, 120)]
    assert location.page not in {h.page for h in held if h is not None}
    assert pool.allocator.is_allocated(location.page)  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match="expired lease"):
        late.finish(timeout=10)  # it resumes, writes its page, commits: refused, and its page is free again
    assert b.messenger.quarantined == 0 and BlockKey(1) not in b.cache
    assert all(bytes(b.cache.get(BlockKey(k))) == block(k) for k in range(100, 116) if BlockKey(k) in b.cache)
    gone = a.messenger.push([BlockKey(2)], peer)  # another pusher that will never come back
    b.now[0] += 11.0
    b.messenger.sweep()
    assert b.messenger.quarantined == 1
    assert b.messenger.release_owner("127.0.0.1:1") == 0  # another owner's: nothing of it here
    assert b.messenger.release_owner(a.engine.address) == 1 and b.messenger.quarantined == 0
    gone.abort()  # its release finds nothing left: harmless
    assert BlockKey(2) not in b.cache


def test_release_owner_ends_what_a_gone_peer_holds() -> None:
    """A peer's pins and reservations (leases still open) end at once when its process is said gone; another
    peer's stay; an owner that is no address is refused."""
    a, b, c = make_node(8, "tcp"), make_node(8, "tcp"), make_node(8, "tcp")
    try:
        from_a, from_c = a.engine.connect(b.engine.address), c.engine.connect(b.engine.address)
        b.cache.put(BlockKey(5), block(5))
        a.messenger.fetch([BlockKey(5)], from_a)  # pins 5 at b, never finished
        a.cache.put(BlockKey(6), block(6))
        a.messenger.push([BlockKey(6)], from_a)  # reserves 6 at b, never finished
        c.cache.put(BlockKey(7), block(7))
        kept = c.messenger.push([BlockKey(7)], from_c)
        assert b.messenger.release_owner(a.engine.address) == 2
        b.cache.remove(BlockKey(5))  # unpinned
        assert BlockKey(6) not in b.cache
        assert kept.finish(timeout=10) == (7,)  # c's lease was left alone
        with pytest.raises(TransferError, match="engine address"):
            b.messenger.release_owner("")
        with pytest.raises(TransferError, match="owner"):
            a.engine.call(from_a, "blocks.reserve", {"lease": "x", "blocks": [], "owner": 5})
    finally:
        for node in (a, b, c):
            node.engine.close()


def test_fetch_takes_only_what_fits() -> None:
    """With every local page pinned but two, a fetch brings two blocks and stops."""
    a, b = make_node(4, "tcp"), make_node(16, "tcp")
    try:
        peer = a.engine.connect(b.engine.address)
        for key in range(1, 7):
            b.cache.put(BlockKey(key), block(key))
        for key in (100, 101):
            a.cache.put(BlockKey(key), block(key))
            a.cache.pin(BlockKey(key))
        fetch = a.messenger.fetch([BlockKey(k) for k in range(1, 7)], peer)
        assert fetch.keys == (1, 2)
        assert fetch.finish(timeout=10) == (1, 2)
    finally:
        a.engine.close()
        b.engine.close()


def test_the_first_tier_must_be_dram() -> None:
    """A cache whose first tier is not a DRAM pool cannot be served by a messenger."""
    from mooncake.cache.pool import MetadataPagePool
    from mooncake.types import Tier

    with TransferEngine(secret=SECRET) as engine, pytest.raises(ConfigError):
        Messenger(engine, TieredCache([MetadataPagePool(Tier.DRAM, PAGE, 4)]))
    with TransferEngine(secret=SECRET) as engine:
        messenger = Messenger(engine, TieredCache([DramPagePool(PAGE, 4)]))  # registers the pool itself
        assert messenger.region.length == 4 * PAGE


@settings(max_examples=25, deadline=None)
@given(
    held=st.sets(st.integers(1, 12), max_size=12),
    wanted=st.lists(st.integers(1, 12), unique=True, max_size=12),
    parts=st.integers(1, 4),
)
def test_fetch_matches_a_model(held: set[int], wanted: list[int], parts: int) -> None:
    """A fetch caches exactly the leading run of wanted keys the peer holds, with the peer's bytes."""
    a, b = make_node(16, "tcp"), make_node(16, "tcp")
    try:
        peer = a.engine.connect(b.engine.address)
        for key in held:
            b.cache.put(BlockKey(key), block(key))
        expected = []
        for key in wanted:
            if key not in held:
                break
            expected.append(key)
        got = a.messenger.fetch([BlockKey(k) for k in wanted], peer, parts=parts).finish(timeout=10)
        assert list(got) == expected
        for key in expected:
            assert bytes(a.cache.get(BlockKey(key))) == block(key)
    finally:
        a.engine.close()
        b.engine.close()


def test_a_dead_peer_leaves_no_pins_behind() -> None:
    """Pushing to a peer that is gone fails, and the local blocks it pinned are released."""
    a, b = make_node(8, "tcp"), make_node(8, "tcp")
    try:
        peer = a.engine.connect(b.engine.address)
        a.cache.put(BlockKey(1), block(1))
        b.engine.close()
        # Every way the control call to a closed engine can fail (refused, reset, closed) is PeerUnavailable.
        with pytest.raises(PeerUnavailable):
            a.messenger.push([BlockKey(1)], peer)
        a.cache.remove(BlockKey(1))  # raises if the push left it pinned
        with pytest.raises(PeerUnavailable):
            a.messenger.fetch([BlockKey(2)], peer)
        assert all(not a.cache.pools[0].allocator.is_allocated(p) for p in range(8))  # type: ignore[attr-defined]
    finally:
        a.engine.close()


def test_a_peer_looping_on_lookups_cannot_grow_the_lease_table() -> None:
    """Lookups under ever new lease ids open at most max_leases leases (then are refused with
    CapacityError); lookups that pin nothing keep no lease; oversized ids are refused; once the
    leases expire, fetches work again and no pin is left behind."""
    a, b = make_node(8, "tcp"), make_node(8, "tcp", max_leases=4)
    try:
        peer = a.engine.connect(b.engine.address)
        b.cache.put(BlockKey(1), block(1))
        for i in range(20):  # nothing found: no lease kept
            found: Any = a.engine.call(peer, "blocks.lookup", {"lease": f"empty-{i}", "keys": [99]})
            assert found["blocks"] == []
        for i in range(4):
            a.engine.call(peer, "blocks.lookup", {"lease": f"flood-{i}", "keys": [1]})
        with pytest.raises(TransferError, match="max_leases"):
            a.engine.call(peer, "blocks.lookup", {"lease": "one-too-many", "keys": [1]})
        with pytest.raises(TransferError, match="at most 64"):
            a.engine.call(peer, "blocks.release", {"lease": "x"})  # releasing an unknown id is fine...
            a.engine.call(peer, "blocks.lookup", {"lease": "x" * 100_000, "keys": [1]})  # ...a huge one is not
        with pytest.raises(BlockPinnedError):
            b.cache.remove(BlockKey(1))  # the flood's pins hold, until their leases expire
        b.now[0] += 11.0
        assert a.messenger.fetch([BlockKey(1)], peer).finish(timeout=10) == (1,)
        b.cache.remove(BlockKey(1))  # no pin left behind
    finally:
        a.engine.close()
        b.engine.close()


def test_the_default_lease_outlasts_the_longest_slice_and_bad_settings_are_refused_before_anything_is_made() -> None:
    """By default a lease lasts twice the engine's slice deadline, at least 30 s; a lease or sweep interval
    that is no finite positive number is a ConfigError naming it, raised before the pool is registered."""
    for config, lease in ((EngineConfig(), 132.0), (EngineConfig(io_timeout_s=1.0, max_retries=0), 30.0)):
        assert config.slice_deadline_s == (config.max_retries + 1) * (
            config.connect_timeout_s + 2 * config.io_timeout_s
        )
        engine = TransferEngine(secret=SECRET, config=config)
        try:
            messenger = Messenger(engine, TieredCache([DramPagePool(PAGE, 4)]), sweep_interval_s=0)
            assert messenger._lease_s == lease
            for options, name in (
                ({"lease_s": 0}, "lease_s"),
                ({"lease_s": float("nan")}, "lease_s"),
                ({"lease_s": "30"}, "lease_s"),
                ({"sweep_interval_s": -1.0}, "sweep_interval_s"),
            ):
                registered = len(engine.regions())
                with pytest.raises(ConfigError, match=name):
                    Messenger(engine, TieredCache([DramPagePool(PAGE, 4)]), **options)
                assert len(engine.regions()) == registered
        finally:
            engine.close()


# Ways a peer (version skew, a bug) can garble the answers of the block protocol: each takes the real answer.
_MALFORMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "lookup-none": ("blocks.lookup", lambda _real: None),
    "lookup-a-list": ("blocks.lookup", lambda real: [real]),
    "lookup-no-blocks": ("blocks.lookup", lambda real: {"region": real["region"]}),
    "lookup-three-fields": ("blocks.lookup", lambda real: {**real, "blocks": [e[:3] for e in real["blocks"]]}),
    "lookup-region-text": ("blocks.lookup", lambda real: {**real, "region": "x"}),
    "lookup-region-true": ("blocks.lookup", lambda real: {**real, "region": True}),
    "lookup-offset-fraction": (
        "blocks.lookup",
        lambda real: {**real, "blocks": [[*e[:1], 0.5, *e[2:]] for e in real["blocks"]]},
    ),
    "reserve-a-list": ("blocks.reserve", lambda _real: []),
    "reserve-one-field": ("blocks.reserve", lambda real: {**real, "blocks": [e[:1] for e in real["blocks"]]}),
    "reserve-region-none": ("blocks.reserve", lambda real: {**real, "region": None}),
    "reserve-offset-negative": (
        "blocks.reserve",
        lambda real: {**real, "blocks": [[e[0], -1] for e in real["blocks"]]},
    ),
    "commit-empty": ("blocks.commit", lambda _real: {}),
    "commit-text": ("blocks.commit", lambda _real: {"committed": "12"}),
    "commit-none-key": ("blocks.commit", lambda real: {**real, "committed": [None]}),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_reply_is_a_protocol_error_and_everything_is_cleaned_up(
    nodes: tuple[Node, Node, str], case: str
) -> None:
    """A reply to "blocks.lookup", "blocks.reserve" or "blocks.commit" of the wrong shape (None, a list, a field
    missing, of another type or negative, an entry of the wrong arity) is a ProtocolError (a MooncakeError, as a
    worker's fallback catches) naming the peer, the method and the reply; the fetch or push cleans up as after
    any failure: no page stays reserved on either side and no pin on either side is left (every block can be
    removed). (It was a bare TypeError, KeyError or ValueError.)"""
    a, b, peer = nodes
    method, garble = _MALFORMED[case]
    for key in (1, 2):
        (b if method == "blocks.lookup" else a).cache.put(BlockKey(key), block(key))
    serve = {"blocks.lookup": b.messenger._serve_lookup, "blocks.reserve": b.messenger._serve_reserve}.get(
        method, b.messenger._serve_commit
    )
    b.engine.register_handler(method, lambda args: garble(serve(args)))  # the real answer (its pins taken), garbled
    free_a, free_b = a.cache.pools[0].num_free, b.cache.pools[0].num_free
    with pytest.raises(ProtocolError) as raised:
        if method == "blocks.lookup":
            a.messenger.fetch([BlockKey(1), BlockKey(2)], peer).finish(timeout=10)
        else:
            a.messenger.push([BlockKey(1), BlockKey(2)], peer).finish(timeout=10)
    assert isinstance(raised.value, MooncakeError)
    assert peer in str(raised.value) and method in str(raised.value), raised.value
    assert a.cache.pools[0].num_free == free_a
    if method != "blocks.commit":  # (a commit that was answered did commit the blocks at the peer)
        assert b.cache.pools[0].num_free == free_b
    for node in (a, b):
        for key in (BlockKey(1), BlockKey(2)):
            if key in node.cache:
                node.cache.remove(key)  # BlockPinnedError if a pin was left behind
