"""The ZeroMQ subscriber and publisher of `examples/vllm_events.py`, on 127.0.0.1 only.

A publisher that drops batches on the wire (a test double) makes gaps happen on
purpose; the subscriber must fill them from the replay socket, or, without one,
count them lost and forget the source's holdings. A hand-driven XPUB socket and
ROUTER thread speak vLLM's wire format, including the topic frame recent vLLM puts
first in replay answers. Every wait is a bounded poll.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from mooncake.cache.events import BlockStored, CacheEvent
from mooncake.cache.hashing import BlockHasher
from mooncake.cache.index import BlockIndex
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.types import InstanceId, Tier
from tests.test_vllm_events_cli import load_example

zmq = pytest.importorskip("zmq", reason="pyzmq (the kv-events extra) is not installed: the ZMQ example is not tested")
pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")

LOOPBACK = "tcp://127.0.0.1:*"  # bind on loopback, on a port the OS picks
HASHER = BlockHasher(model="zmq-test", block_size_tokens=16)
SOURCE = InstanceId("vllm-0")


example = load_example("vllm_events_example")


class LossyPublisher(example.KvEventPublisher):  # type: ignore[misc, name-defined]
    """Buffers every batch for replay but does not send those numbered in `dropped`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dropped: frozenset[int] = frozenset()

    def drop_ahead(self, *offsets: int) -> None:
        """Drop the batches `offsets` after the next one (numbers are relative: probes came first)."""
        self.dropped = frozenset(self.next_seq + offset for offset in offsets)

    def _send(self, frames: list[bytes]) -> None:
        if int.from_bytes(frames[1], "big") not in self.dropped:
            super()._send(frames)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    assert example.wait_until(condition, timeout_s=timeout_s), f"timed out after {timeout_s} s waiting for {what}"


def poll_until(subscriber: Any, condition: Callable[[], bool], what: str) -> None:
    """Poll `subscriber` (20 ms at a time) until `condition` holds (the test fails after 10 s)."""
    wait_for(lambda: subscriber.poll(0.02) >= 0 and condition(), what)


def connect(publisher: Any, subscriber: Any) -> None:
    """Send empty batches until one arrives: PUB drops what it sends before the subscription reaches it."""
    wait_for(lambda: publisher.publish([]) >= 0 and subscriber.poll(0.05) > 0, "the subscription")


@pytest.fixture
def setup() -> Iterator[Callable[..., tuple[Any, Any, BlockIndex, BlockIndex, Any]]]:
    """Makes (publisher, subscriber, direct index, fed index, cache) and closes them afterwards."""
    opened: list[Any] = []

    def make(*, replay: bool = True, catch_up_s: float | None = None) -> tuple[Any, Any, BlockIndex, BlockIndex, Any]:
        fed, direct = BlockIndex(), BlockIndex()
        subscriber = example.KvEventSubscriber(
            LOOPBACK, decoder=VllmEventDecoder(HASHER, SOURCE, strict=False), index=fed, catch_up_s=catch_up_s
        )
        opened.append(subscriber)
        publisher = LossyPublisher(
            subscriber.endpoint,
            encoder=VllmEventEncoder(HASHER),
            replay_endpoint=LOOPBACK if replay else None,
        )
        opened.append(publisher)
        if replay:
            subscriber.connect_replay(publisher.replay_endpoint)
        cache = example.small_cache(InstanceId("cache"), vram_blocks=24, dram_blocks=24)
        return publisher, subscriber, direct, fed, cache

    yield make
    for thing in reversed(opened):
        thing.close()


def publish_prompts(publisher: Any, subscriber: Any, cache: Any, direct: BlockIndex, num_prompts: int) -> list[Any]:
    """Each prompt's events go to `direct` and, as one batch, to the subscriber; returns the key chains."""
    chains = []
    for prompt in example.synthetic_prompts(num_prompts, seed=3):
        chains.append(publisher.encoder.register(prompt))
        cache.put_chain(chains[-1])
        events: list[CacheEvent] = cache.take_events()
        for event in events:
            assert direct.apply(event) is None
        publisher.publish(events)
    wait_for(
        lambda: subscriber.poll(0.05) >= 0 and subscriber.decoder.expected_seq == publisher.next_seq,
        "the subscriber to read every batch",
    )
    return chains


def answers(index: BlockIndex, source: InstanceId, chains: list[Any]) -> list[list[int]]:
    return [index.prefix_lengths(keys, [source]).tolist() for keys in chains]


def test_lost_batches_are_replayed(setup: Callable[..., Any]) -> None:
    """Batches dropped on the wire come back from the replay socket: nothing is lost and the fed index
    answers as the cache's own does."""
    publisher, subscriber, direct, fed, cache = setup()
    connect(publisher, subscriber)
    publisher.drop_ahead(5, 6, 9)
    replayed_before = subscriber.stats.num_replayed
    chains = publish_prompts(publisher, subscriber, cache, direct, num_prompts=20)
    assert subscriber.stats.num_replayed - replayed_before >= 3
    assert subscriber.stats.num_lost == 0 and subscriber.stats.num_errors == 0
    assert answers(fed, SOURCE, chains) == answers(direct, cache.source, chains)
    assert fed.snapshot().sources[0].keys_by_tier == direct.snapshot().sources[0].keys_by_tier


def test_without_replay_a_loss_forgets_the_source(setup: Callable[..., Any]) -> None:
    """With no replay socket a gap is a loss: counted, a new epoch, and the fed index holds only what
    later batches stored (never a block the cache does not hold)."""
    publisher, subscriber, direct, fed, cache = setup(replay=False)
    connect(publisher, subscriber)
    publisher.drop_ahead(8)
    lost_before, epoch_before = subscriber.stats.num_lost, subscriber.decoder.epoch
    chains = publish_prompts(publisher, subscriber, cache, direct, num_prompts=20)
    assert subscriber.stats.num_lost - lost_before == 1
    assert subscriber.decoder.epoch == epoch_before + 1
    held = {tier: set(keys) for tier, keys in direct.snapshot().sources[0].keys_by_tier}
    for tier, keys in fed.snapshot().sources[0].keys_by_tier:
        assert set(keys) <= held[tier]
    assert all(f <= d for f, d in zip(answers(fed, SOURCE, chains), answers(direct, cache.source, chains), strict=True))


def test_an_idle_servers_lost_last_batch_comes_by_catching_up(setup: Callable[..., Any]) -> None:
    """The wire drops a server's last batch and the server then stays idle: no later batch shows the gap, so
    the subscriber's ask after a quiet `catch_up_s` brings the batch from the replay socket; nothing is lost
    and the fed index answers as the cache's own does (without the ask it waited for the next request)."""
    publisher, subscriber, direct, fed, cache = setup(catch_up_s=0.2)
    connect(publisher, subscriber)
    publisher.drop_ahead(2)  # the last of three
    chains = publish_prompts(publisher, subscriber, cache, direct, num_prompts=3)
    # A subscription that lands late on a loaded machine misses the first batch and counts a gap, replayed when
    # the second arrives; the last batch no later one follows, so only the quiet ask can bring it.
    assert (subscriber.stats.num_lost, subscriber.stats.num_errors) == (0, 0)
    assert answers(fed, SOURCE, chains) == answers(direct, cache.source, chains)


def test_the_replay_socket_answers_as_vllms_does(setup: Callable[..., Any]) -> None:
    """A request [b"", start seq] gets [b"", seq, payload] for each buffered batch from start on, then
    [b"", -1 as 8 signed bytes, b""]."""
    publisher, *_ = setup()
    payloads = [publisher.publish([], ts=float(i)) for i in range(4)]
    assert payloads == [0, 1, 2, 3]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            replies.append(dealer.recv_multipart())
            if replies[-1][1] == example.END_SEQ:
                break
    finally:
        dealer.close(linger=0)
    assert [r[:2] for r in replies] == [
        [b"", (2).to_bytes(8, "big")],
        [b"", (3).to_bytes(8, "big")],
        [b"", example.END_SEQ],
    ]
    assert replies[-1][2] == b"" and all(len(r) == 3 and r[2] for r in replies[:-1])


@contextlib.contextmanager
def driven_by_hand(
    index: BlockIndex, serve: Callable[[Any, threading.Event], None], **options: Any
) -> Iterator[tuple[Any, Any]]:
    """A subscriber fed `index` as vLLM would feed it: from an XPUB socket (so the test sees the subscription
    arrive) and a ROUTER replay socket that `serve(router, stop)` answers on a thread until `stop` is set;
    yields (subscriber, xpub) once the subscription shows. `options` go to the subscriber (its `topic`, its
    `replay_timeout_s`; `catch_up_s` is None unless given, so that only a gap asks the replay socket)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    # No high-water mark: a ROUTER drops what passes it, so a long answer would lose messages whenever the
    # machine is slow to read them; the tests that want a message lost say which (`first_drops`).
    router.setsockopt(zmq.SNDHWM, 0)
    xpub = ctx.socket(zmq.XPUB)
    stop = threading.Event()
    try:
        router.bind(LOOPBACK)
        server = threading.Thread(target=serve, args=(router, stop))
        server.start()
        try:
            with example.KvEventSubscriber(
                LOOPBACK,
                decoder=VllmEventDecoder(HASHER, SOURCE),
                index=index,
                replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT),
                **{"catch_up_s": None, **options},
            ) as subscriber:
                xpub.connect(subscriber.endpoint)
                # A bound SUB takes a new peer while its owner calls into it: poll both until the subscription shows.
                wait_for(lambda: subscriber.poll(0.01) >= 0 and xpub.poll(50) > 0, "the subscription")
                assert xpub.recv() == b"\x01" + options.get("topic", "").encode()
                yield subscriber, xpub
        finally:
            stop.set()
            server.join(timeout=10)
    finally:
        for socket in (router, xpub):
            socket.close(linger=0)
        ctx.term()


def test_the_subscriber_reads_vllms_frames_and_a_topic_first_replay() -> None:
    """Driven by hand as vLLM would: batch 1 of topic "kv" is published; the subscriber asks the replay socket
    for batch 0, which answers with the topic frame first; both batches reach the index in order."""
    encoder = VllmEventEncoder(HASHER)
    prompt = example.synthetic_prompts(1, seed=1)[0]
    keys = encoder.register(prompt)
    first = encoder.encode([BlockStored(source=SOURCE, seq=0, keys=keys[:2], tier=Tier.VRAM)], ts=1.0)
    second = encoder.encode([BlockStored(source=SOURCE, seq=1, keys=keys[2:], tier=Tier.DRAM)], ts=2.0)
    requests: list[int] = []
    index = BlockIndex()

    def serve_one(router: Any, _stop: threading.Event) -> None:
        if router.poll(10_000):
            identity, _, start = router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            router.send_multipart([identity, b"", b"kv", (0).to_bytes(8, "big"), first])
            router.send_multipart([identity, b"", b"", example.END_SEQ, b""])

    with driven_by_hand(index, serve_one, topic="kv") as (subscriber, xpub):
        xpub.send_multipart([b"kv", (1).to_bytes(8, "big"), second])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 2, "both batches")
        assert (subscriber.stats.num_gaps, subscriber.stats.num_replayed, subscriber.stats.num_lost) == (1, 1, 0)
    assert requests == [0]
    assert index.match(keys).length(SOURCE) == len(keys)


def test_a_replay_longer_than_its_timeout_is_read_whole_while_it_keeps_coming() -> None:
    """A replay answer streams (a long-lived server's buffer can be thousands of batches): batches 0, 1, 2 and
    the end marker each come 1 s apart, 4 s in all, past the 2.8 s timeout, which bounds a silence, not the
    answer; all reach the index and nothing is lost (cut off at 2.8 s, batch 2 was lost and the source's
    holdings forgotten). Each silence is 1.8 s short of the timeout, so that a slow machine's stall is no cut."""
    encoder = VllmEventEncoder(HASHER)
    prompt = example.synthetic_prompts(1, seed=2)[0]
    keys = encoder.register(prompt)
    batches = [
        encoder.encode([BlockStored(source=SOURCE, seq=i, keys=keys[i : i + 1], tier=Tier.VRAM)], ts=float(i))
        for i in range(4)
    ]
    index = BlockIndex()

    def serve_slowly(router: Any, _stop: threading.Event) -> None:
        if router.poll(10_000):
            identity, _, _start = router.recv_multipart()
            for seq in (0, 1, 2):
                time.sleep(1.0)
                router.send_multipart([identity, b"", seq.to_bytes(8, "big"), batches[seq]])
            time.sleep(1.0)
            router.send_multipart([identity, b"", example.END_SEQ, b""])

    with driven_by_hand(index, serve_slowly, replay_timeout_s=2.8) as (subscriber, xpub):
        xpub.send_multipart([b"", (3).to_bytes(8, "big"), batches[3]])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 4, "the batches")
        assert (subscriber.stats.num_replayed, subscriber.stats.num_lost) == (3, 0)
    assert index.match(keys).length(SOURCE) == len(keys) >= 3  # batches 0-2 stored one block each


def answering(
    batches: dict[int, bytes],
    asked: list[int],
    *,
    waits_for: Sequence[threading.Event] = (),
    first_drops: frozenset[int] = frozenset(),
) -> Callable[[Any, threading.Event], None]:
    """A replay socket as vLLM's: each request's answer is the batches of `batches` from its start seq as they
    stand when it comes (a test may add later ones), then the end marker; each start seq goes to `asked`. With
    `waits_for`, answer i is sent only once event i is set (its content is fixed when the request comes); the seqs
    in `first_drops` are left out of the first answer (lost on the way, as a full send buffer drops them)."""

    def serve(router: Any, stop: threading.Event) -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            identity, _, start = router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            dropped = first_drops if len(asked) == 1 else frozenset()
            answer = [(seq, batches[seq]) for seq in sorted(batches) if seq >= asked[-1] and seq not in dropped]
            if len(asked) <= len(waits_for):
                while not waits_for[len(asked) - 1].wait(0.02):
                    if stop.is_set():
                        return
            for seq, payload in answer:
                router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([identity, b"", example.END_SEQ, b""])

    return serve


def one_block_batches(count: int, seed: int, ts: float = 0.0) -> tuple[list[Any], list[bytes]]:
    """A prompt's keys and `count` batches, batch i storing block i (published at `ts` + i)."""
    encoder = VllmEventEncoder(HASHER)
    keys = encoder.register(example.synthetic_prompts(1, seed=seed)[0])
    assert len(keys) >= count
    batches = [
        encoder.encode([BlockStored(source=SOURCE, seq=i, keys=keys[i : i + 1], tier=Tier.VRAM)], ts=ts + i)
        for i in range(count)
    ]
    return keys[:count], batches


def test_a_subscriber_started_late_learns_what_the_server_holds_before_its_next_batch() -> None:
    """The server published batches 0 and 1 before the subscriber started and publishes nothing after: the
    subscriber's first poll asks the replay socket, and both reach the index with no gap seen."""
    keys, batches = one_block_batches(2, seed=4)
    asked: list[int] = []
    index = BlockIndex()
    with driven_by_hand(index, answering(dict(enumerate(batches)), asked), catch_up_s=5.0) as (subscriber, _xpub):
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 2, "the history")
        assert (subscriber.stats.num_gaps, subscriber.stats.num_replayed, subscriber.stats.num_lost) == (0, 2, 0)
    assert asked == [0]
    assert index.match(keys).length(SOURCE) == len(keys)


def test_a_gap_never_blocks_the_poll() -> None:
    """Batch 0 is lost on the wire and the replay socket answers only when the test lets it: meanwhile every
    poll returns at once (a router's event loop goes on serving), batches 1 and 2 wait, and once the answer
    comes all three apply in order."""
    keys, batches = one_block_batches(3, seed=5)
    asked: list[int] = []
    go = threading.Event()
    index = BlockIndex()
    with driven_by_hand(index, answering({0: batches[0]}, asked, waits_for=[go])) as (subscriber, xpub):
        for seq in (1, 2):
            xpub.send_multipart([b"", seq.to_bytes(8, "big"), batches[seq]])
        slowest, end = 0.0, time.monotonic() + 0.5
        while time.monotonic() < end or subscriber.stats.num_gaps == 0:
            started = time.monotonic()
            subscriber.poll(0)
            slowest = max(slowest, time.monotonic() - started)
            assert time.monotonic() < end + 10, "the gap was never seen"
        assert slowest < 0.5 and subscriber.decoder.expected_seq == 0  # nothing applied out of order (blocked: 2 s)
        go.set()
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 3, "the batches")
        assert (subscriber.stats.num_gaps, subscriber.stats.num_replayed, subscriber.stats.num_lost) == (1, 1, 0)
        assert subscriber.stats.num_batches == 3
    assert asked == [0]
    assert index.match(keys).length(SOURCE) == 3


def test_a_gap_seen_while_an_ask_is_out_is_asked_for_again() -> None:
    """The subscriber's first ask reaches the server before batch 0 is published, and its answer comes after
    batch 1 arrived live past the lost batch 0: that answer could not hold batch 0, so the subscriber asks
    again rather than count it lost."""
    keys, batches = one_block_batches(2, seed=6)
    asked: list[int] = []
    published: dict[int, bytes] = {}
    go = threading.Event()
    index = BlockIndex()
    serve = answering(published, asked, waits_for=[go])
    with driven_by_hand(index, serve, catch_up_s=5.0) as (subscriber, xpub):
        poll_until(subscriber, lambda: asked == [0], "the first ask")
        published[0] = batches[0]  # lost on the wire
        xpub.send_multipart([b"", (1).to_bytes(8, "big"), batches[1]])
        poll_until(subscriber, lambda: subscriber.stats.num_gaps == 1, "the gap")
        go.set()
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 2, "both batches")
        assert (subscriber.stats.num_replayed, subscriber.stats.num_lost) == (1, 0)
    assert asked == [0, 0]
    assert index.match(keys).length(SOURCE) == 2


def test_a_message_dropped_from_an_answer_is_asked_for_again() -> None:
    """The first answer (a running server's history of five batches, asked at the first poll) loses batch 2 on
    the way: the answer began at or before it, so the buffer still has it; the subscriber asks again from 2
    instead of giving it up, and nothing is lost."""
    keys, batches = one_block_batches(5, seed=10)
    asked: list[int] = []
    index = BlockIndex()
    serve = answering(dict(enumerate(batches)), asked, first_drops=frozenset({2}))
    with driven_by_hand(index, serve, catch_up_s=5.0) as (subscriber, _xpub):
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 5, "the history")
        assert (subscriber.stats.num_gaps, subscriber.stats.num_replayed, subscriber.stats.num_lost) == (1, 5, 0)
    assert asked == [0, 2]
    assert index.match(keys).length(SOURCE) == 5


def test_a_long_history_is_applied_over_many_polls() -> None:
    """A history of 2,000 batches, asked at the first poll, is applied in order over many polls (each reads and
    applies a bounded share, so a router's event loop goes on between them) and wholly."""
    encoder = VllmEventEncoder(HASHER)
    history = {seq: encoder.encode([], ts=float(seq)) for seq in range(2000)}
    asked: list[int] = []
    applied: list[int] = []
    with driven_by_hand(BlockIndex(), answering(history, asked), catch_up_s=5.0) as (subscriber, _xpub):
        wait_for(
            lambda: applied.append(subscriber.poll(0.01)) is None and subscriber.decoder.expected_seq == 2000,
            "the history",
        )
        assert (subscriber.stats.num_batches, subscriber.stats.num_lost) == (2000, 0)
    assert asked == [0] and 0 < max(applied) < 1000 and sum(map(bool, applied)) > 2


def test_a_decoder_restarted_while_an_ask_is_out_asks_again_from_its_start() -> None:
    """The fleet restarts the decoder (it marked the server down) while an ask for the lost batch 1 is out:
    the ask is dropped, its answer unread, and the replay socket asked again from batch 0, so a server that only
    blipped is whole again in the index and nothing is counted lost."""
    keys, batches = one_block_batches(3, seed=7)
    asked: list[int] = []
    go = threading.Event()
    index = BlockIndex()
    serve = answering(dict(enumerate(batches)), asked, waits_for=[go])
    with driven_by_hand(index, serve) as (subscriber, xpub):
        xpub.send_multipart([b"", (0).to_bytes(8, "big"), batches[0]])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 1, "batch 0")
        xpub.send_multipart([b"", (2).to_bytes(8, "big"), batches[2]])  # batch 1 is lost on the wire
        poll_until(subscriber, lambda: asked == [1], "the ask for batch 1")
        index.remove_instance(SOURCE)  # what the fleet's set_up(down) does
        subscriber.decoder.restart()
        go.set()
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 3, "the batches again")
        assert (subscriber.stats.num_lost, subscriber.stats.num_replayed) == (0, 3)
    assert asked == [1, 0]
    assert index.match(keys).length(SOURCE) == 3


def test_a_restarted_servers_lost_first_batch_is_asked_for() -> None:
    """vLLM restarts (its numbers start again) and its new batch 0 is lost on the wire: new batch 1, below the
    expected seq and no redelivery, tells the decoder of the restart, and batch 0 comes from the replay socket
    rather than being counted lost."""
    _, old = one_block_batches(3, seed=11)
    new_keys, new = one_block_batches(2, seed=9, ts=100.0)
    asked: list[int] = []
    buffered: dict[int, bytes] = {}  # the restarted server's replay buffer
    index = BlockIndex()
    with driven_by_hand(index, answering(buffered, asked)) as (subscriber, xpub):
        for seq, payload in enumerate(old):
            xpub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 3, "the old batches")
        epoch = subscriber.decoder.epoch
        buffered.update(enumerate(new))
        xpub.send_multipart([b"", (1).to_bytes(8, "big"), new[1]])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 2, "the new batches")
        assert subscriber.decoder.epoch == epoch + 1 and subscriber.stats.num_lost == 0
    assert asked == [0]
    assert index.match(new_keys).length(SOURCE) == 2


def test_each_missing_batch_gets_its_own_asks() -> None:
    """Batches 1, 3, 5 and 7 are lost on the wire, each just after the ask for the one before was answered (so no
    answer could hold it): each is asked for in turn and brought back. The asks are counted per missing batch; a
    count carried from one to the next gave batch 7 up unasked, the source's holdings forgotten."""
    encoder = VllmEventEncoder(HASHER)
    batches = [encoder.encode([], ts=float(seq)) for seq in range(9)]
    published: dict[int, bytes] = {}
    asked: list[int] = []
    answers = [threading.Event() for _ in range(4)]
    serve = answering(published, asked, waits_for=answers)
    with driven_by_hand(BlockIndex(), serve, replay_timeout_s=30.0) as (subscriber, xpub):

        def publish(seq: int, *, lost: bool = False) -> None:
            published[seq] = batches[seq]
            if not lost:
                xpub.send_multipart([b"", seq.to_bytes(8, "big"), batches[seq]])

        publish(0)
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 1, "batch 0")
        publish(1, lost=True)
        publish(2)
        poll_until(subscriber, lambda: asked == [1], "the ask for batch 1")
        for turn, missing in enumerate((3, 5, 7)):
            publish(missing, lost=True)  # after the ask out read the buffer: its answer cannot hold it
            publish(missing + 1)
            # The batch after it waits (in `_pending`) when the answer to the ask out ends.
            poll_until(subscriber, lambda m=missing: m + 1 in subscriber._pending, "the next batch")
            answers[turn].set()
            poll_until(subscriber, lambda t=turn: len(asked) == t + 2, "the next ask")
        answers[3].set()
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 9, "every batch")
        assert subscriber.stats.num_lost == 0
    assert asked == [1, 3, 5, 7]


def test_a_server_marked_down_gets_back_what_its_buffer_holds_understood() -> None:
    """Batches 0-4 store a chain of five blocks, one each; the fleet marks the server down (`skip_to(0)`, its
    holdings out of the index) and the replay buffer now holds batches 3 and 4 only: batches 0-2 are given up,
    and 3 and 4, whose parents were stored before the buffer's window, are understood (the decoder kept its hash
    translations), so the index holds their blocks again."""
    keys, batches = one_block_batches(5, seed=12)  # block i's parent is block i - 1
    asked: list[int] = []
    index = BlockIndex()
    with driven_by_hand(index, answering({3: batches[3], 4: batches[4]}, asked)) as (subscriber, xpub):
        for seq, payload in enumerate(batches):
            xpub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 5, "the chain")
        assert index.num_blocks(SOURCE) == 5
        index.remove_instance(SOURCE)  # what the fleet's set_up(down) does
        subscriber.decoder.skip_to(0)
        poll_until(subscriber, lambda: subscriber.decoder.expected_seq == 5, "the replay")
        assert (subscriber.stats.num_lost, subscriber.decoder.num_skipped) == (3, 0)
    assert asked == [0]
    assert index.num_blocks(SOURCE) == 2 and index.match(keys[3:]).length(SOURCE) == 2  # blocks 3 and 4
    assert index.match(keys).length(SOURCE) == 0  # a prefix from block 0 is not held: 0-2 were given up


def test_loopback_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`loopback` prints a JSON summary whose indexes agree, and exits normally."""
    example.main(["loopback", "--num-prompts", "40", "--vram-blocks", "16", "--dram-blocks", "16"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        summary["match"] is True and summary["num_lost"] == 0 and summary["num_batches"] == summary["batches_published"]
    )


def test_subscribe_command_stops_after_its_duration(capsys: pytest.CaptureFixture[str]) -> None:
    """`subscribe --duration` binds, waits, closes its sockets and prints its counters."""
    args = ["subscribe", "--endpoint", LOOPBACK, "--replay", "", "--duration", "0.2", "--report-every", "60"]
    example.main(args)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_batches"] == 0 and summary["blocks"] == 0


def test_the_hasher_follows_the_flags() -> None:
    """The hasher the command line builds follows its flags."""
    args = argparse.Namespace(model="m", block_size=8, salt="s", algorithm="sha256")
    assert example.hasher_from(args) == BlockHasher(model="m", block_size_tokens=8, salt="s", algorithm="sha256")
