"""Properties of `mooncake.engine.decode.TokenStream` over generated puts and closes, and a state machine.

The stream's contract (its docstring): events put from any thread come out
of the async iteration in the order put; the iteration ends after the first
event with `finished=True`, or at `close()` (idempotent), after the events put
before it, and stays ended; once its loop is closed, `put` and `close` drop
what they are given without raising. The reference model is a list of what
was sent (events and closes): what the consumer sees is its prefix up to the
first finished event (included) or the first close (excluded).
test_token_stream holds one example of each; here the sequences are drawn.
Loops run in asyncio's debug mode, which refuses a call from another thread
that is not thread-safe (a plain `call_soon` would only stall the consumer).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytest.importorskip("torch")

from mooncake.engine.decode import TokenEvent, TokenStream
from mooncake.types import RequestId

TIMEOUT_S = 10.0  # only a broken stream waits this long: iteration that should end never does
CLOSE = None  # a close() in a sequence of sends

Send = TokenEvent | None


def event(index: int, *, finished: bool = False, request: str = "r") -> TokenEvent:
    return TokenEvent(request_id=RequestId(request), token=1000 + index, index=index, finished=finished)


def expected(sent: Sequence[Send]) -> list[TokenEvent]:
    """The reference: the events up to the first finished one (included) or the first close (excluded)."""
    seen: list[TokenEvent] = []
    for item in sent:
        if item is CLOSE:
            break
        seen.append(item)
        if item.finished:
            break
    return seen


def send(stream: TokenStream, item: Send) -> None:
    if item is CLOSE:
        stream.close()
    else:
        stream.put(item)


def send_all(stream: TokenStream, items: Sequence[Send]) -> None:
    for item in items:
        send(stream, item)


@st.composite
def sends(draw: st.DrawFn, *, max_size: int = 12) -> list[Send]:
    """Events (some finished) and closes in any order, ending in a close or a finished event so that the
    iteration ends; the events have distinct indices, so a reordering or a duplicate shows."""
    flags = draw(st.lists(st.sampled_from(["token", "token", "token", "finished", "close"]), max_size=max_size))
    flags.append(draw(st.sampled_from(["finished", "close"])))
    return [CLOSE if flag == "close" else event(i, finished=flag == "finished") for i, flag in enumerate(flags)]


class Producer(threading.Thread):
    """A thread standing for the decode loop; `join_and_check` re-raises here what it raised there."""

    def __init__(self, target: Callable[..., object], *args: object) -> None:
        super().__init__(target=self._guarded, args=(target, *args))
        self.failure: BaseException | None = None

    def _guarded(self, target: Callable[..., object], *args: object) -> None:
        try:
            target(*args)
        except BaseException as error:  # the test's own report of what the thread raised
            self.failure = error

    def join_and_check(self) -> None:
        self.join()
        if self.failure is not None:
            raise self.failure


async def consume(stream: TokenStream) -> list[TokenEvent]:
    return [item async for item in stream]


def run_consumer(produce: Callable[[TokenStream, int], object], *, threads: int = 1) -> list[TokenEvent]:
    """Iterate a fresh stream on a fresh loop while `threads` producer threads call `produce(stream, i)`.

    The loop runs in debug mode, where asyncio refuses a call from another thread that is not thread-safe."""

    async def main() -> list[TokenEvent]:
        stream = TokenStream(asyncio.get_running_loop())
        workers = [Producer(produce, stream, i) for i in range(threads)]
        for worker in workers:
            worker.start()
        try:
            return await asyncio.wait_for(consume(stream), timeout=TIMEOUT_S)
        finally:
            for worker in workers:
                worker.join_and_check()

    return asyncio.run(main(), debug=True)


@settings(max_examples=50, deadline=None)
@given(sends(), st.booleans())
def test_the_consumer_sees_the_prefix_up_to_the_end(sent: list[Send], from_a_thread: bool) -> None:
    """Put and closed from the decode loop's thread or the consumer's own, the iteration yields exactly the
    events before the first close, or up to and including the first finished one, in order, and then ends:
    nothing after the end leaks through, nothing before it is lost or repeated."""
    if from_a_thread:
        got = run_consumer(lambda stream, _: send_all(stream, sent))
    else:

        async def main() -> list[TokenEvent]:
            stream = TokenStream(asyncio.get_running_loop())
            for item in sent:
                send(stream, item)
            return await asyncio.wait_for(consume(stream), timeout=TIMEOUT_S)

        got = asyncio.run(main(), debug=True)
    assert got == expected(sent)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=4))
def test_each_producers_events_keep_their_order(lengths: list[int]) -> None:
    """Several threads put at once (each its own events, none finished), then one closes after all have put:
    every event comes out exactly once, each thread's in the order it put them."""
    done = threading.Barrier(len(lengths))

    def produce(stream: TokenStream, producer: int) -> None:
        for i in range(lengths[producer]):
            stream.put(event(i, request=f"p{producer}"))
        if done.wait() == 0:  # the last one through closes, after every put
            stream.close()

    got = run_consumer(produce, threads=len(lengths))
    assert sorted((e.request_id, e.index) for e in got) == sorted(
        (f"p{p}", i) for p, n in enumerate(lengths) for i in range(n)
    )
    for producer, n in enumerate(lengths):
        assert [e.index for e in got if e.request_id == f"p{producer}"] == list(range(n))


@settings(max_examples=30, deadline=None)
@given(sends(max_size=6), sends(max_size=6))
def test_a_stream_whose_loop_has_closed_drops_everything_from_any_thread(before: list[Send], after: list[Send]) -> None:
    """Whatever was sent before the loop closed, every later put and close (any mix, from the decode loop's
    thread) returns quietly: the consumer is gone, and the decode loop must not fail for it."""
    loop = asyncio.new_event_loop()
    stream = TokenStream(loop)
    for item in before:
        send(stream, item)
    loop.close()
    worker = Producer(send_all, stream, after)
    worker.start()
    worker.join_and_check()


class TokenStreamMachine(RuleBasedStateMachine):
    """A stream driven step by step (puts and closes from this thread or another, single `__anext__` calls)
    against the list of what was sent. Invariant: what has come out is a prefix of the reference, and the
    stream has ended exactly when the reference says so."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)  # a call from another thread that is not thread-safe raises
        self.stream = TokenStream(self.loop)
        self.sent: list[Send] = []
        self.received: list[TokenEvent] = []
        self.ended = False  # StopAsyncIteration seen
        self.next_index = 0

    def teardown(self) -> None:
        if not self.loop.is_closed():
            self.loop.close()

    def _send(self, item: Send, *, from_a_thread: bool) -> None:
        self.sent.append(item)
        if from_a_thread:
            worker = Producer(send, self.stream, item)
            worker.start()
            worker.join_and_check()
        else:
            send(self.stream, item)

    @rule(finished=st.booleans(), from_a_thread=st.booleans())
    def put(self, finished: bool, from_a_thread: bool) -> None:
        self._send(event(self.next_index, finished=finished), from_a_thread=from_a_thread)
        self.next_index += 1

    @rule(from_a_thread=st.booleans())
    def close(self, from_a_thread: bool) -> None:
        self._send(CLOSE, from_a_thread=from_a_thread)

    def _reference_has_an_answer(self) -> bool:
        """The next `__anext__` returns at once: an event is due, or the reference has ended."""
        reference = expected(self.sent)
        ends = any(item is CLOSE or item.finished for item in self.sent)
        return len(reference) > len(self.received) or ends

    @precondition(lambda self: not self.loop.is_closed() and self._reference_has_an_answer())
    @rule()
    def take(self) -> None:
        """One `__anext__`: the next event of the reference, or the end once the reference has ended
        (again and again: an ended stream stays ended, even with events put after its end)."""
        reference = expected(self.sent)
        try:
            got = self.loop.run_until_complete(asyncio.wait_for(self.stream.__anext__(), timeout=TIMEOUT_S))
        except StopAsyncIteration:
            assert len(self.received) == len(reference), "ended before every event due came out"
            self.ended = True
            return
        assert not self.ended, f"{got} came out after the end"
        assert len(self.received) < len(reference), f"{got} came out after the end"
        assert got == reference[len(self.received)]
        self.received.append(got)

    @precondition(lambda self: not self.loop.is_closed() and not self._reference_has_an_answer())
    @rule()
    def take_waits(self) -> None:
        """Nothing due and no end: `__anext__` waits (the loop runs a few rounds without an answer), and
        giving up on the wait loses nothing (the next `take` still sees every event)."""

        async def poll() -> bool:
            pending = asyncio.create_task(self.stream.__anext__())
            for _ in range(5):
                await asyncio.sleep(0)
            answered = pending.done()
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
            return answered

        assert not self.loop.run_until_complete(poll()), "__anext__ answered with nothing due"

    @precondition(lambda self: self.ended and not self.loop.is_closed())
    @rule()
    def close_loop(self) -> None:
        """The consumer, done with the stream, goes away: its loop closes; later puts and closes must be
        dropped quietly (a consumer gone mid-stream is the test above)."""
        self.loop.close()

    @invariant()
    def what_came_out_is_a_prefix_of_the_reference(self) -> None:
        assert self.received == expected(self.sent)[: len(self.received)]


TokenStreamMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_token_stream_machine = TokenStreamMachine.TestCase
