"""The decode engine's tokens reach an asyncio consumer through TokenStream, across threads, in order."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("torch")

from mooncake.engine.decode import TokenEvent, TokenStream
from mooncake.types import RequestId


def test_stream_yields_events_put_from_another_thread_until_finished() -> None:
    """Events put from a producer thread arrive in order, and iteration ends after the finished one."""

    async def consume() -> list[int]:
        stream = TokenStream(asyncio.get_running_loop())

        def produce() -> None:
            for i in range(5):
                stream.put(TokenEvent(request_id=RequestId(1), token=10 + i, index=i, finished=i == 4))

        threading.Thread(target=produce).start()
        return [event.token async for event in stream]

    assert asyncio.run(asyncio.wait_for(consume(), timeout=10)) == [10, 11, 12, 13, 14]


def test_a_closed_stream_ends_after_the_tokens_already_put() -> None:
    """After `DecodeEngine.cancel` no finished event comes: `close` (from any thread) ends the iteration, after
    the tokens put before it, where it would otherwise wait for ever."""

    async def consume() -> list[int]:
        stream = TokenStream(asyncio.get_running_loop())

        def produce() -> None:
            for i in range(3):
                stream.put(TokenEvent(request_id=RequestId(1), token=10 + i, index=i, finished=False))
            stream.close()
            stream.close()  # idempotent

        threading.Thread(target=produce).start()
        return [event.token async for event in stream]

    assert asyncio.run(asyncio.wait_for(consume(), timeout=10)) == [10, 11, 12]


def test_a_stream_whose_loop_has_closed_drops_what_it_is_given() -> None:
    """The consumer's loop closed (its client gone, the server stopping) before the decode loop put its last token
    or closed the stream: `put` and `close` drop it, never raising into the decode loop's thread."""
    loop = asyncio.new_event_loop()
    stream = TokenStream(loop)
    loop.close()
    stream.put(TokenEvent(request_id=RequestId(1), token=10, index=0, finished=True))
    stream.close()
