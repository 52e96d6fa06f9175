"""The gateway decodes and tokenizes a body off its event loop (examples/serving/gateway.py), with real sockets
against a worker-less gateway on 127.0.0.1 (test_edge's `served`).

A tokenizer held by the test (`Held`) stands for a large prompt through a checkpoint's BPE, which takes seconds:
while it tokenizes, /health answers within a bound (on the loop, it could not before the tokenizing ended); a
client that leaves meanwhile cancels its handler, nothing of its request is admitted or left in the dispatcher, and
the gateway serves the next request. With a real BPE (`tokenizers`), /health answers while a /tokenize of megabytes
is encoded: the encoding lets go of the GIL (`tokenizers`' `encode` holds it for its whole run, which a thread alone
does not help). Every wait has a deadline; the held tokenizer lets go after `HOLD_S` whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from serving.protocol import EdgeLimits
from serving.tokenizer import ByteTokenizer

from tests.serving.test_edge import DEADLINE_S, ask, connect, get, post, read_answer, served

HOLD_S = 5.0  # the longest the held tokenizer holds a text (the loop, where it runs on it)
ANSWER_S = 2.0  # the longest /health may take to answer while a body is tokenized
BODY = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()


class Held(ByteTokenizer):
    """Bytes, whose tokenizing of a text begins (`started`), waits until the test lets it go (`release`, at most
    HOLD_S), and ends (`finished`)."""

    def __init__(self) -> None:
        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.started.set()
        try:
            self.release.wait(HOLD_S)
            return super().encode(text, add_special_tokens=add_special_tokens)
        finally:
            self.finished.set()


def test_the_gateway_answers_while_a_body_is_tokenized() -> None:
    """While a completion's prompt is being tokenized, /health answers within ANSWER_S; the completion, tokenized,
    then reaches admission (refused there: this gateway has no engines)."""
    tokenizer = Held()
    with served(EdgeLimits()) as (gateway, port):
        gateway.tokenizer = tokenizer
        answers: list[tuple[int, dict[str, str], Any]] = []
        client = threading.Thread(target=lambda: answers.append(ask(port, post("/v1/completions", BODY))))
        client.start()
        try:
            assert tokenizer.started.wait(DEADLINE_S)
            with connect(port) as sock:
                sock.settimeout(ANSWER_S)
                sock.sendall(get("/health"))
                status, _, health = read_answer(sock)
            assert (status, health["status"]) == (503, "unavailable")  # it answered: no engine is up here
            assert not tokenizer.finished.is_set()  # ... while the prompt was being tokenized
        finally:
            tokenizer.release.set()
            client.join(DEADLINE_S)
        ((status, _, body),) = answers
        assert (status, body["error"]["code"]) == (503, "no_prefill_instance")


def test_a_client_that_leaves_while_its_body_is_tokenized_leaves_nothing_behind() -> None:
    """A client that resets its connection while its prompt is tokenized: its handler is cancelled during the
    tokenizing; once the tokenizing ends, nothing was admitted and the dispatcher holds nothing; the next request is
    served as any."""
    tokenizer = Held()
    with served(EdgeLimits()) as (gateway, port):
        gateway.tokenizer = tokenizer
        dispatcher = gateway.dispatcher
        admitted: list[Any] = []
        admit, serve = dispatcher.admit, gateway._serve

        async def recording_admit(*args: Any, **kwargs: Any) -> Any:
            admitted.append(args)
            return await admit(*args, **kwargs)

        cancelled = threading.Event()

        async def watched_serve(request: Any, *, chat: bool) -> Any:
            try:
                return await serve(request, chat=chat)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        dispatcher.admit = recording_admit  # type: ignore[method-assign]
        gateway._serve = watched_serve  # type: ignore[method-assign]
        try:
            with connect(port) as sock:  # closed with a reset (no linger)
                sock.sendall(post("/v1/completions", BODY))
                assert tokenizer.started.wait(DEADLINE_S)
            assert cancelled.wait(ANSWER_S) and not tokenizer.finished.is_set()
        finally:
            tokenizer.release.set()
        assert tokenizer.finished.wait(DEADLINE_S)
        loop = dispatcher._loop
        assert loop is not None

        async def left() -> tuple[int, int, int]:
            return len(admitted), len(dispatcher.live), len(dispatcher._waiting)

        # A turn of the loop after the tokenizing ended: its result, had anyone awaited it, would have been taken.
        assert asyncio.run_coroutine_threadsafe(left(), loop).result(DEADLINE_S) == (0, 0, 0)
        status, _, body = ask(port, post("/v1/completions", BODY))
        assert (status, body["error"]["code"]) == (503, "no_prefill_instance") and len(admitted) == 1


def test_the_gateway_answers_while_a_real_bpe_encodes_megabytes() -> None:
    """A /tokenize of 3 MB of text through a byte-level BPE (about a second of encoding here): /health is answered
    within the first half of the encoding. An encoding that held the GIL (`tokenizers`' `encode` does) would hold
    the event loop, and this test's thread, until its end, whatever thread it ran on."""
    pytest.importorskip("tokenizers")
    from serving.tokenizer import CheckpointTokenizer
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers, trainers
    from tokenizers.models import BPE

    from mooncake.engine.tokenizer import SpecialTokens, Tokenizer

    backend = Backend(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    started = threading.Event()
    stamps: dict[str, float] = {}

    class Watched(CheckpointTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            stamps["start"] = time.perf_counter()
            started.set()
            try:
                return super().encode(text, add_special_tokens=add_special_tokens)
            finally:
                stamps["end"] = time.perf_counter()

    text = " ".join(f"The quick brown fox {i} jumps over the lazy dog." for i in range(60_000))
    with served(EdgeLimits()) as (gateway, port):
        gateway.tokenizer = Watched(Tokenizer(backend, special=SpecialTokens(), chat_template=None))
        answers: list[tuple[int, dict[str, str], Any]] = []
        body = json.dumps({"prompt": text}).encode()
        client = threading.Thread(target=lambda: answers.append(ask(port, post("/tokenize", body))))
        client.start()
        try:
            assert started.wait(DEADLINE_S)
            status, _, _ = ask(port, get("/health"))
            answered = time.perf_counter()
        finally:
            client.join(DEADLINE_S)
        ((tokenized_status, _, tokenized),) = answers
    assert status == 503 and tokenized_status == 200 and tokenized["count"] > 100_000
    encoding_s = stamps["end"] - stamps["start"]
    assert answered - stamps["start"] < encoding_s / 2, (answered - stamps["start"], encoding_s)
