"""vLLM KV events over ZeroMQ: a subscriber that feeds a `BlockIndex`, and a publisher of this library's cache events.

Start vLLM with

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'

and run ``python examples/vllm_events.py subscribe --model <name> --block-size 16``.

Wire (vLLM's ``ZmqEventPublisher``): a PUB socket sends each batch as three
frames, [topic, seq as 8 bytes big-endian, payload] (`mooncake.cache.vllm_wire`
reads the payload). With a host in its endpoint vLLM *connects*, so the
subscriber *binds* (with ``*`` vLLM binds; then pass ``--connect``). PUB/SUB
drops what a subscriber misses (a slow joiner loses the first batches), so the
subscriber watches the sequence: when batches wait behind a missing one it asks
the replay endpoint, a ROUTER socket, for the batches from the missing one on,
and it asks the same at its first poll and after each quiet second (a lost last
batch leaves nothing waiting). A request is one frame, the
start seq (8 bytes big-endian); the answer is one message per buffered batch,
[seq, payload] (recent vLLM puts the topic first), then [-1 as 8 signed bytes,
b""]. vLLM's own example asks with a REQ socket, which keeps only the first
reply; the subscriber uses DEALER and writes the empty delimiter frame itself,
and reads the answer over its next polls, a bounded share each (its caller's
loop never waits on it). A batch that an answer beginning past it shows the
buffer no longer has, or that three asks did not bring, is lost: the decoder
starts a new epoch and the index forgets the source's holdings (they refill as
vLLM stores blocks).

Subcommands:

    subscribe   bind (or --connect), feed a BlockIndex, print its counters
    publish     a TieredCache takes synthetic prompts; its events go out in vLLM's format
    loopback    both in one process on 127.0.0.1; checks the two indexes agree (exit 1 if not)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mooncake.cache import BlockHasher, BlockIndex, CacheEvent, MetadataPagePool, SequenceGap, TieredCache
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import WireLayout
from mooncake.cli import OneLineParser, integer, one_line, run_interruptible
from mooncake.errors import MooncakeError, UnknownBlockError, VllmEventError
from mooncake.types import InstanceId, Tier

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("vllm_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@attrs.define
class SubscriberStats:
    """What the subscriber has seen.

    num_batches/num_events: batches applied (live or replayed) and the events they made; num_gaps: times a
    batch was found missing behind later ones (a run of missing batches counts once; each missing batch is
    asked of the replay socket, or counted lost without one);
    num_replayed: batches applied from replay answers (a gap filled, a catch-up, a running server's
    history); num_lost: batches given up (their numbers skipped: a new epoch, the source's holdings
    forgotten); num_errors/last_error: unreadable messages and batches.
    """

    num_batches: int = 0
    num_events: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_lost: int = 0
    num_errors: int = 0
    last_error: str = ""  # what the last unreadable batch said (a block size other than the hasher's, ...)


MAX_ASKS = 3  # asks for one missing batch before it is given up (an answer can lose messages on the way)
APPLY_BUDGET_S = 0.005  # how long one poll applies batches (one at least): a long history spreads over polls
READ_PER_POLL = 256  # replay messages one poll reads at most (the rest wait in the socket's unbounded queue)


@attrs.define
class _Ask:
    """A replay request: the seq it asked from, which ask it is for that batch, when its answer last moved, the
    first seq its answer brought, and whether the answer has ended."""

    start: int
    heard_at: float
    tries: int = 1
    first: int | None = None
    ended: bool = False


class KvEventSubscriber:
    """Receives one vLLM instance's batches and applies them to `index` in order, a bounded amount per poll.

    Algorithm. Every batch received, live or from a replay answer, waits in `pending` by its seq; a poll
    reads the live messages waiting and up to `READ_PER_POLL` replay messages (the rest wait in the replay
    socket's unbounded queue, so vLLM's ROUTER does not drop them for a full send buffer), then applies the
    batches next in order for at most `APPLY_BUDGET_S` past the first (a long history spreads over polls of
    a few milliseconds each). When batches wait behind a missing one, the replay socket is asked for the
    batches from the missing one on; its answer streams in over later polls. Once the answer has ended
    (or stayed silent for `replay_timeout_s`: abandoned, on a fresh socket so that a late answer cannot
    end the next) without the missing batch, the batch is given up (counted lost, a new epoch, the
    source's holdings forgotten; they refill as vLLM stores blocks) if the answer began past it (the
    buffer no longer has it), else asked for again, up to `MAX_ASKS` asks for that batch (it was published
    after the answer, or a message was dropped on the way). Unless `catch_up_s` is None the subscriber also
    asks after every quiet `catch_up_s` and at its first poll: PUB/SUB drops what it sends before a
    subscription arrives or while a connection is down, and a lost *last* batch shows no gap until the
    server's next batch, so an idle server's newest blocks stayed unknown to the index for as long as it
    stayed idle. An ask that finds nothing new is one short message each way.

    A decoder put in a new epoch behind the subscriber's back (the fleet's `skip_to(0)` when a server goes
    down; a live batch below the expected seq that is no redelivery: vLLM restarted) makes everything
    pending and any ask in flight stale: they are dropped and the replay socket is asked at once from the
    new expected seq (a server that only blipped gives back what its replay buffer still holds: vLLM keeps
    the last 10,000 batches). Not detected: a vLLM that restarts, loses every new batch on the wire and
    then stays idle (its new numbers never reach the expected one, so catch-up asks find nothing); the
    fleet's health checks mark such a server down, which starts it afresh.

    Invariants: every pending batch is numbered at or above the decoder's expected seq in its current
    epoch; at most one ask is in flight; a batch is applied once (a replayed copy of one applied is
    dropped, a live one is a redelivery the decoder ignores).

    Args:
        endpoint: where vLLM publishes (bound unless `bind` is False; port ``*`` picks one).
        decoder: translates the batches (its source is the instance's id in `index`).
        index: the index fed.
        replay_endpoint: vLLM's replay socket, or None (gaps are then losses).
        topic: the topic subscribed to ("" is every topic).
        replay_timeout_s: how long a replay's answer may stay silent (it streams one message per batch: a long
            one, thousands of batches from a server that ran before this subscriber, is not cut off while its
            batches keep coming).
        catch_up_s: after this long with no live batch, nothing pending and no ask, ask the replay socket for
            what came since (None: only for a gap).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        decoder: VllmEventDecoder,
        index: BlockIndex,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = True,
        replay_timeout_s: float = 2.0,
        catch_up_s: float | None = 1.0,
    ) -> None:
        import zmq  # lazy: the library does not depend on pyzmq

        self._zmq = zmq
        self.decoder, self.index = decoder, index
        self.replay_timeout_s, self.catch_up_s = replay_timeout_s, catch_up_s
        self.stats = SubscriberStats()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._replay: zmq.Socket[bytes] | None = None
        self._replay_endpoints: list[str] = []
        self._ask: _Ask | None = None
        self._pending: dict[int, tuple[bytes, bool]] = {}  # seq → (payload, whether a replay brought it)
        self._epoch = decoder.epoch  # the decoder's epoch that `_pending` and `_ask` are numbered in
        self._missing: int | None = None  # the seq last found missing behind pending batches (counted once)
        self._quiet_since = -math.inf  # when the last live batch came or the last ask ended
        try:
            if bind:
                self._sub.bind(endpoint)
                endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self.connect_replay(replay_endpoint)
        except BaseException:
            self.close()
            raise
        self.endpoint = endpoint

    def connect_replay(self, replay_endpoint: str) -> None:
        """Ask `replay_endpoint` for missed batches from now on."""
        self._replay_endpoints.append(replay_endpoint)
        if self._replay is None:
            self._open_replay()
        else:
            self._replay.connect(replay_endpoint)

    def poll(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for messages (not at all while batches are ready), read the live ones waiting
        and up to `READ_PER_POLL` replay answers, and apply the batches next in order; returns how many batches
        it applied or dropped unread."""
        if self.decoder.epoch != self._epoch:
            self._forget_numbering()
        self._maybe_catch_up(time.monotonic())
        ready = self.decoder.expected_seq in self._pending
        handled = 0
        if self._poller.poll(0 if ready else int(timeout_s * 1000)):
            self._read_replay()
            handled = self._read_live()
        return handled + self._settle(time.monotonic())

    @property
    def closed(self) -> bool:
        """Whether `close` ran (the sockets are closed and the ZeroMQ context terminated)."""
        return bool(self._ctx.closed)

    def close(self) -> None:
        """Close the sockets (unsent and unread messages are dropped); again: nothing."""
        if self._ctx.closed:
            return
        for socket in (self._sub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _open_replay(self) -> None:
        """A fresh DEALER connected to every replay endpoint (an abandoned ask's answer goes to the old one)."""
        if self._replay is not None:
            self._poller.unregister(self._replay)
            self._replay.close(linger=0)
        self._replay = self._ctx.socket(self._zmq.DEALER)
        self._replay.setsockopt(self._zmq.LINGER, 0)
        self._replay.setsockopt(self._zmq.RCVHWM, 0)  # a long answer queues here rather than being dropped
        for replay_endpoint in self._replay_endpoints:
            self._replay.connect(replay_endpoint)
        self._poller.register(self._replay, self._zmq.POLLIN)

    def _forget_numbering(self) -> None:
        """The decoder's numbering changed under `_pending` and the ask: drop both, and ask again at once."""
        self._epoch = self.decoder.epoch
        self._pending.clear()
        self._missing = None
        if self._replay is not None:
            if self._ask is not None:
                self._open_replay()
            self._send_ask(tries=1)

    def _read_live(self) -> int:
        """Take every live batch waiting: those below the expected seq to the decoder at once (a redelivery, or
        vLLM restarted), the others into `_pending`; returns how many were applied or dropped."""
        handled = 0
        while True:
            try:
                frames = self._sub.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return handled
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("dropping a message of %d frames: not [topic, seq, payload]", len(frames))
                self.stats.num_errors += 1
                handled += 1
                continue
            self._quiet_since = time.monotonic()
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]
            if seq >= self.decoder.expected_seq:
                self._pending[seq] = (payload, False)
                continue
            handled += 1
            applied = self._apply(seq, payload)
            if self.decoder.epoch != self._epoch:  # a restart: batch `seq` of the new numbering
                self._forget_numbering()
                if not applied:  # its batches before it were lost on the wire: they are asked for
                    self._pending[seq] = (payload, False)

    def _read_replay(self) -> None:
        """Take up to `READ_PER_POLL` replay messages waiting into `_pending` (read, not applied)."""
        if self._replay is None:
            return
        for _ in range(READ_PER_POLL):
            try:
                frames = self._replay.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            ask = self._ask
            if ask is None or ask.ended:
                continue  # cannot happen: an abandoned ask's socket is replaced
            ask.heard_at = time.monotonic()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the delimiter DEALER leaves in
            if len(frames) == 3:
                frames = frames[1:]  # the topic recent vLLM sends first
            if len(frames) != 2 or len(frames[0]) != 8:
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq < 0 or not frames[1]:
                ask.ended = True
                continue
            ask.first = seq if ask.first is None else ask.first
            if seq >= self.decoder.expected_seq and seq not in self._pending:
                self._pending[seq] = (frames[1], True)

    def _settle(self, now: float) -> int:
        """Apply what is next in order (for `APPLY_BUDGET_S`), then decide about a missing batch: wait for
        the answer, ask (again), or give it up; returns how many batches were applied."""
        applied, deadline = 0, now + APPLY_BUDGET_S
        while True:
            while (seq := self.decoder.expected_seq) in self._pending and (applied == 0 or time.monotonic() < deadline):
                payload, replayed = self._pending.pop(seq)
                self._apply(seq, payload)
                self.stats.num_replayed += replayed
                applied += 1
            if self.decoder.expected_seq in self._pending:
                return applied  # the rest at the next poll
            ask = self._ask
            if ask is not None and not ask.ended and now - ask.heard_at > self.replay_timeout_s:
                # Only a loss is worth a warning: an idle server that is down leaves every catch-up ask unanswered.
                level = logging.WARNING if self._pending else logging.DEBUG
                log.log(
                    level, "the replay socket of %s was silent for %.1f s", self.decoder.source, self.replay_timeout_s
                )
                self._open_replay()
                ask.ended = True
            if not self._pending:
                if ask is not None and ask.ended:
                    self._ask, self._quiet_since = None, now
                return applied
            expected = self.decoder.expected_seq  # missing, with later batches waiting
            if self._missing != expected:
                self._missing = expected
                self.stats.num_gaps += 1
            if self._replay is not None:
                if ask is None:
                    self._send_ask(tries=1)
                    return applied
                if not ask.ended:
                    return applied
                self._ask = None
                tries = ask.tries if ask.start == expected else 0  # the asks are counted for one missing batch
                if (ask.first is None or ask.first <= expected) and tries < MAX_ASKS:
                    self._send_ask(tries=tries + 1)  # published after the answer, or dropped on the way
                    return applied
            self._lose(min(self._pending))

    def _maybe_catch_up(self, now: float) -> None:
        if self.catch_up_s is None or self._replay is None or self._ask is not None or self._pending:
            return
        if now - self._quiet_since >= self.catch_up_s:
            self._send_ask(tries=1)

    def _send_ask(self, *, tries: int) -> None:
        """Ask the replay socket for the batches from the expected one on (an ask that cannot be queued ends at
        once, with no try left)."""
        assert self._replay is not None
        start = self.decoder.expected_seq
        try:
            self._replay.send_multipart([b"", start.to_bytes(8, "big")], self._zmq.NOBLOCK)
        except self._zmq.Again:
            self._ask = _Ask(start, time.monotonic(), tries=MAX_ASKS, ended=True)
        else:
            self._ask = _Ask(start, time.monotonic(), tries=tries)

    def _apply(self, seq: int, payload: bytes) -> bool:
        """Apply batch `seq`; False (nothing applied) when it is past the expected one, which only a live batch
        that told the decoder of a restart can be."""
        redelivered = self.decoder.num_redelivered
        try:
            result = self.decoder.decode(payload, seq=seq)
        except (VllmEventError, UnknownBlockError) as error:
            log.warning("batch %d of %s is unreadable, skipped (a new epoch): %s", seq, self.decoder.source, error)
            self.stats.num_errors += 1
            self.stats.last_error = str(error)
            if seq >= self.decoder.expected_seq:  # (a bad copy of a batch applied before changes nothing)
                self._lose(seq + 1, count=False)
            return True
        if isinstance(result, SequenceGap):
            return False
        if self.decoder.num_redelivered != redelivered:
            return True  # applied before (a replay overlapped what came live)
        for event in result:  # in order: the decoder numbers them (the index raises a gap, never returns one)
            self.index.apply(event)
        self.stats.num_batches += 1
        self.stats.num_events += len(result)
        return True

    def _lose(self, next_seq: int, *, count: bool = True) -> None:
        """Give up the batches before `next_seq`: a new epoch, and the source's holdings forgotten."""
        if count:
            self.stats.num_lost += next_seq - self.decoder.expected_seq
        self.decoder.skip_to(next_seq)
        self._epoch = self.decoder.epoch
        self.index.resync(self.decoder.source, {}, epoch=self.decoder.epoch, seq=-1)
        self._pending = {seq: batch for seq, batch in self._pending.items() if seq >= next_seq}


class KvEventPublisher:
    """Publishes this library's cache events as vLLM does: PUB frames and a ROUTER replay buffer.

    One thread publishes; a thread of its own answers replay requests.

    Args:
        endpoint: bound when it has ``*`` (or is ipc/inproc), else connected, as vLLM decides.
        encoder: writes the events (its `register` must have seen the stored blocks' tokens).
        replay_endpoint: bound ROUTER answering replay requests from a thread, or None.
        topic: the first frame of every message.
        buffer_batches: how many recent batches the replay buffer keeps.
        event_layout: "map" (vLLM after 0.23) or "array".
    """

    def __init__(
        self,
        endpoint: str,
        *,
        encoder: VllmEventEncoder,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        event_layout: WireLayout = "map",
    ) -> None:
        import zmq

        self._zmq = zmq
        self.encoder, self.event_layout = encoder, event_layout
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        if self._router is not None:
            # The ROUTER is used by this thread only from here on (sockets are not thread-safe).
            self._thread = threading.Thread(target=self._serve_replay, name="vllm-events-replay", daemon=True)
            self._thread.start()

    def publish(self, events: Sequence[CacheEvent], *, ts: float | None = None) -> int:
        """Send `events` as one batch; returns its seq."""
        payload = self.encoder.encode(events, ts=time.time() if ts is None else ts, event_layout=self.event_layout)
        with self._lock:  # the replay thread reads the buffer
            seq, self._seq = self._seq, self._seq + 1
            self._buffer.append((seq, payload))
        self._send([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    @property
    def next_seq(self) -> int:
        """The seq the next batch gets (the number published so far)."""
        return self._seq

    def close(self) -> None:
        """Stop the replay thread and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # it polls in short steps, so it sees the stop promptly
        elif self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(self, frames: list[bytes]) -> None:
        self._pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not [identity, b"", start seq]
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
                for seq, payload in batches:
                    router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([identity, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)


# ---------------------------------------------------------------------- the command line


def synthetic_prompts(num_prompts: int, *, seed: int, vocab: int = 32_000) -> list[list[int]]:
    """Prompts that share one of a few system prompts, then differ."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randrange(16, 96))] for _ in range(4)]
    return [
        rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 64))] for _ in range(num_prompts)
    ]


def small_cache(source: InstanceId, *, vram_blocks: int, dram_blocks: int) -> TieredCache:
    """A metadata-only VRAM + DRAM cache: it evicts and demotes as a real one would."""
    pools = [MetadataPagePool(Tier.VRAM, 4096, vram_blocks), MetadataPagePool(Tier.DRAM, 4096, dram_blocks)]
    return TieredCache(pools, source=source, epoch=time.time_ns())


def hasher_from(args: argparse.Namespace) -> BlockHasher:
    return BlockHasher(model=args.model, block_size_tokens=args.block_size, salt=args.salt, algorithm=args.algorithm)


def subscribe(args: argparse.Namespace) -> dict[str, Any]:
    """Feed a BlockIndex from one vLLM instance until --duration ends, or Ctrl-C / SIGTERM."""
    stop = threading.Event()
    # Both signals stop the loop, so the sockets close (SIGINT too: a background job starts with it ignored).
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    source = InstanceId(args.source)
    decoder = VllmEventDecoder(hasher_from(args), source, epoch=time.time_ns(), strict=args.strict)
    index = BlockIndex()
    end = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    try:
        with KvEventSubscriber(
            args.endpoint,
            decoder=decoder,
            index=index,
            replay_endpoint=args.replay,
            topic=args.topic,
            bind=not args.connect,
        ) as subscriber:
            log.info("listening on %s (replay %s)", subscriber.endpoint, args.replay)
            next_report = time.monotonic() + args.report_every
            while not stop.is_set() and time.monotonic() < end:
                subscriber.poll(0.1)
                if time.monotonic() >= next_report:
                    next_report += args.report_every
                    print(
                        json.dumps({"blocks": index.num_blocks(source), **attrs.asdict(subscriber.stats)}), flush=True
                    )
            stats = attrs.asdict(subscriber.stats)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return {"blocks": index.num_blocks(source), "skipped": decoder.num_skipped, **stats}


def publish(args: argparse.Namespace) -> dict[str, Any]:
    """Send a small cache's events for synthetic prompts, one batch per prompt."""
    encoder = VllmEventEncoder(hasher_from(args))
    cache = small_cache(InstanceId("publisher"), vram_blocks=args.vram_blocks, dram_blocks=args.dram_blocks)
    with KvEventPublisher(args.endpoint, encoder=encoder, replay_endpoint=args.replay, topic=args.topic) as publisher:
        for prompt in synthetic_prompts(args.num_prompts, seed=args.seed):
            cache.put_chain(encoder.register(prompt))
            publisher.publish(cache.take_events())
            time.sleep(args.interval_s)  # pacing for a human watching, not synchronisation
        return {"batches": args.num_prompts, "blocks": len(cache)}


def loopback(args: argparse.Namespace) -> dict[str, Any]:
    """A publisher and a subscriber on 127.0.0.1: does the subscriber's index answer as the cache's own does?"""
    hasher = hasher_from(args)
    encoder = VllmEventEncoder(hasher)
    cache = small_cache(InstanceId("cache"), vram_blocks=args.vram_blocks, dram_blocks=args.dram_blocks)
    source = InstanceId("vllm-0")
    direct, fed = BlockIndex(), BlockIndex()
    chains = []
    with (
        KvEventSubscriber("tcp://127.0.0.1:*", decoder=VllmEventDecoder(hasher, source), index=fed) as subscriber,
        KvEventPublisher(subscriber.endpoint, encoder=encoder, replay_endpoint="tcp://127.0.0.1:*") as publisher,
    ):
        assert publisher.replay_endpoint is not None
        subscriber.connect_replay(publisher.replay_endpoint)
        is_connected = wait_until(lambda: publisher.publish([]) >= 0 and subscriber.poll(0.05) > 0, timeout_s=10.0)
        for prompt in synthetic_prompts(args.num_prompts, seed=args.seed):
            chains.append(encoder.register(prompt))
            cache.put_chain(chains[-1])
            events = cache.take_events()
            for event in events:
                direct.apply(event)
            publisher.publish(events)
            subscriber.poll(0.0)
        is_caught_up = wait_until(
            lambda: subscriber.poll(0.05) >= 0 and subscriber.decoder.expected_seq == publisher.next_seq, timeout_s=10.0
        )
        stats = attrs.asdict(subscriber.stats)
    match = all(
        direct.prefix_lengths(keys, [cache.source]).tolist() == fed.prefix_lengths(keys, [source]).tolist()
        for keys in chains
    )
    holdings = [s.keys_by_tier for s in direct.snapshot().sources] == [s.keys_by_tier for s in fed.snapshot().sources]
    return {
        "match": bool(is_connected and is_caught_up and match and holdings),
        "connected": is_connected,
        "caught_up": is_caught_up,
        "batches_published": publisher.next_seq,
        "blocks": fed.num_blocks(source),
        **stats,
    }


def wait_until(condition: Callable[[], bool], *, timeout_s: float) -> bool:
    """Ask `condition` (which waits a little itself) until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
    return False


def zmq_port_problem(digits: str) -> str | None:
    """Why a ZeroMQ TCP endpoint's port, as written, is not one a server can have, or None. ZeroMQ binds 0 to a
    random port, as `*`, and takes a larger number modulo 65536 (99999 binds 34463), so either would be a port
    other than the one named. The one rule for this command line's endpoints and the router's config's
    (`vllm_fleet.config`)."""
    if not 1 <= int(digits) <= 65_535:
        return f"has port {digits}: must be in 1..65535 (ZeroMQ would use another port than the one named)"
    return None


def _endpoint(text: str) -> str:
    """An argparse type: a ZeroMQ endpoint whose TCP port, where it names one, is one ZeroMQ uses as named
    (`zmq_port_problem`). The rest (`*`, ipc://, a bad address) is ZeroMQ's to check when it binds or connects."""
    match = re.fullmatch(r"tcp://.+:(\d+)", text)
    if match is not None and (problem := zmq_port_problem(match[1])) is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return text


def _seconds(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 if `positive`, else >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, got {text!r}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vllm_events", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("subscribe", "publish", "loopback"):
        sub = commands.add_parser(name)
        sub.add_argument("--model", default="demo-model", help="the model (part of the block-key namespace)")
        sub.add_argument("--block-size", type=integer(1), default=16, help="vLLM's block size in tokens")
        sub.add_argument("--salt", default="")
        sub.add_argument("--algorithm", choices=["xxh3_64", "xxh3_128", "sha256"], default="xxh3_64")
        sub.add_argument("--topic", default="")
        if name != "loopback":
            sub.add_argument("--endpoint", type=_endpoint, default="tcp://127.0.0.1:5557")
            sub.add_argument(
                "--replay", type=_endpoint, default="tcp://127.0.0.1:5558", help="replay endpoint ('' for none)"
            )
        if name == "subscribe":
            sub.add_argument("--connect", action="store_true", help="connect (vLLM's endpoint has '*')")
            sub.add_argument("--source", default="vllm-0", help="the instance's id in the index")
            sub.add_argument("--strict", action="store_true", help="stop on hashes never seen")
            sub.add_argument(
                "--duration", type=_seconds(positive=False), default=0.0, help="seconds (0: until interrupted)"
            )
            sub.add_argument(
                "--report-every", type=_seconds(positive=True), default=5.0, help="seconds between counter lines"
            )
        else:
            sub.add_argument("--num-prompts", type=integer(1), default=200)
            sub.add_argument("--seed", type=integer(0), default=0)
            sub.add_argument("--vram-blocks", type=integer(1), default=64)
            sub.add_argument("--dram-blocks", type=integer(1), default=128)
        if name == "publish":
            sub.add_argument("--interval-s", type=_seconds(positive=False), default=0.05)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0; 1 when `loopback`'s two indexes disagree; 2 and one line on stderr for a bad
    option, an endpoint ZeroMQ refuses or a missing kv-events extra; 130 after Ctrl-C (`run_interruptible`)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "replay", None) == "":
        args.replay = None
    return run_interruptible("vllm_events", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    try:
        import msgpack  # noqa: F401 - the wire format; checked here so that its absence is one line too
        import zmq
    except ImportError as error:
        print(f"vllm_events: needs {error.name}: the kv-events extra (pip install -e '.[kv-events]')", file=sys.stderr)
        return 2
    try:
        summary = {"subscribe": subscribe, "publish": publish, "loopback": loopback}[args.command](args)
    except (MooncakeError, zmq.ZMQError) as error:  # ZeroMQ's names the endpoint: Invalid argument (addr='x')
        print(one_line(f"vllm_events: error: {error}"), file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 1 if args.command == "loopback" and not summary["match"] else 0


if __name__ == "__main__":
    sys.exit(main())
