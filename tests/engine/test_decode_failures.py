"""Tests for `mooncake.engine.decode.DecodeEngine` when something fails: the batch stays whole.

A request whose draw fails mid-step (params that leave no token, or the
model's NaN logits) is dropped alone, named in the error, and every other
request takes its token, retires and is called back as in a step that did not
fail. Non-finite KV that a request leaves in its slot (cancelled, refused
midway through its copy, failed, or moved out of) never reaches the request
that takes the slot next, whatever longer request shares its batch. A callback
that cancels a request finishing in the same step holds its last token back,
as the docstring says. Malformed joins (an id that is no request id, a callback
that cannot be called included) are InvalidRequestErrors naming the field. A
stop token never ends a request before its `min_tokens`, even one the sampler
cannot hold back (every allowed token a stop token).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from mooncake.cache.tiered import TieredCache
from mooncake.engine.decode import DecodeConfig, DecodeEngine, TokenEvent
from mooncake.engine.prefill import PrefillEngine, PrefillResult
from mooncake.engine.sampling import SamplingParams
from mooncake.errors import EngineError, InvalidRequestError
from mooncake.types import BlockKey, RequestId
from tests.engine.support import TINY, assert_nothing_held, dram_cache, hasher, layout, reference_logits, tiny_model

BLOCK = 4
PROMPTS = {"a": 7, "b": 6, "c": 9, "y": 2, "z": 12}  # request id: prompt length


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * i + i * i) % TINY.vocab_size for i in range(length)]


def prompt_of(name: str) -> list[int]:
    return tokens_of(ord(name), PROMPTS[name])


@pytest.fixture
def prefilled() -> Iterator[tuple[TieredCache, dict[str, PrefillResult]]]:
    cache = dram_cache(BLOCK)
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK)) as engine:
        yield cache, {name: engine.prefill(prompt_of(name)) for name in PROMPTS}


def new_engine(cache: TieredCache) -> DecodeEngine:
    return DecodeEngine(
        tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=4, max_context_tokens=32)
    )


def join(engine: DecodeEngine, result: PrefillResult, name: str, max_new_tokens: int, **options: Any) -> None:
    verdict = engine.try_join(
        RequestId(name),
        result.keys,
        prompt_tokens=PROMPTS[name],
        first_token=result.first_token,
        max_new_tokens=max_new_tokens,
        **options,
    )
    assert verdict.accepted, verdict


def greedy(prompt: list[int], first_token: int, count: int) -> list[int]:
    """The model's greedy continuation: `count` tokens from `first_token` on."""
    tokens = [first_token]
    while len(tokens) < count:
        tokens.append(int(torch.argmax(reference_logits(prompt + tokens)[-1])))
    return tokens


def hopeless(name: str, first_token: int) -> SamplingParams:
    """Params under which `name`'s first decode draw has no token: its only allowed token, one of its prompt's
    with a logit below -1 there, is multiplied past float32's range to -inf by a repetition penalty at float32's
    largest value (an InvalidRequestError)."""
    prompt = prompt_of(name)
    row = reference_logits([*prompt, first_token])[-1]
    bad = min(set(prompt), key=lambda t: float(row[t]))
    assert float(row[bad]) < -1.01  # else the product stays finite and the token is drawn
    return SamplingParams(allowed_token_ids=[bad], repetition_penalty=float(torch.finfo(torch.float32).max))


@pytest.mark.parametrize("ending", ["max_new_tokens", "stop"])
def test_a_request_whose_draw_fails_is_dropped_alone_and_named(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], ending: str
) -> None:
    """a (slot 0) reaches its last token, by `max_new_tokens` or a stop token, in the step where b's draw (slot
    1) has no token; c (slot 2) comes after b. The step raises b's error, named, after every callback: b is
    dropped with its first token only, a is retired with its last token `finished`, c has its token; the next
    steps decode c to its end as alone (no IndexError past a slot, nothing past a's end). The error's `request_id`
    is b's, for a caller that ends b alone without parsing the message."""
    cache, r = prefilled
    engine = new_engine(cache)
    got: dict[str, list[TokenEvent]] = {name: [] for name in "abc"}
    a_tokens = greedy(prompt_of("a"), r["a"].first_token, 6)
    a_options: dict[str, Any] = (
        {"max_new_tokens": 2}
        if ending == "max_new_tokens"
        else {"max_new_tokens": 6, "sampling": SamplingParams(stop_token_ids=[a_tokens[1]])}
    )
    assert a_tokens[1] != a_tokens[0]  # the stop token is a's second, not its first
    join(engine, r["a"], "a", on_token=got["a"].append, **a_options)
    join(
        engine,
        r["b"],
        "b",
        6,
        sampling=hopeless("b", r["b"].first_token),
        prompt=prompt_of("b"),
        on_token=got["b"].append,
    )
    join(engine, r["c"], "c", 4, on_token=got["c"].append)
    with pytest.raises(InvalidRequestError, match=r"^request b: the sampling params leave every one") as raised:
        engine.step()
    assert raised.value.request_id == "b"  # by value too, for a caller that ends b's stream
    engine.check_invariants()
    assert engine.active_ids == (RequestId("c"),)
    assert [(e.index, e.token, e.finished) for e in got["a"]] == [(0, a_tokens[0], False), (1, a_tokens[1], True)]
    assert [e.index for e in got["b"]] == [0] and len(got["c"]) == 2
    engine.run(max_steps=10)
    engine.check_invariants()
    assert engine.num_active == 0 and len(got["a"]) == 2 and len(got["b"]) == 1
    assert [e.token for e in got["c"]] == greedy(prompt_of("c"), r["c"].first_token, 4)
    assert [e.finished for e in got["c"]] == [False, False, False, True]


def nan_pages(cache: TieredCache, count: int, *, short_last: bool = False) -> list[BlockKey]:
    """`count` pages of NaN KV (a faulty prefill or peer) under fresh keys; with `short_last` the last holds one
    token (a join of `count` full blocks copies the others, then is refused)."""
    keys = [BlockKey(10**6 + i) for i in range(count)]
    for i, key in enumerate(keys):
        size = layout(BLOCK).block_bytes(1 if short_last and i == count - 1 else BLOCK)
        cache.put(key, np.full(size // 4, np.nan, dtype=np.float32).tobytes())
    return keys


@pytest.mark.parametrize("leaves", ["cancelled", "refused", "failed", "moved"])
def test_non_finite_kv_a_request_leaves_in_its_slot_never_reaches_the_next(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], leaves: str
) -> None:
    """x's 12-token KV is NaN. It leaves slot 0: cancelled before a step, refused after copying two of its three
    pages, dropped when its own draw fails (an EngineError naming it), or cancelled with y decoding behind it (y
    moves into its slot). Then y (a 2-token prompt) decodes in slot 0 beside z (12 tokens), so attention reads
    slot 0 far past y's context: y and z get the model's greedy tokens, and the engine's invariant (rows past a
    slot's context are zero) holds throughout."""
    cache, r = prefilled
    engine = new_engine(cache)
    got: dict[str, list[int]] = {"y": [], "z": []}

    def record(event: TokenEvent) -> None:
        got[event.request_id].append(event.token)

    keys = nan_pages(cache, 3, short_last=leaves == "refused")
    x = {"prompt_tokens": 12, "first_token": 1, "max_new_tokens": 5}
    if leaves == "refused":
        with pytest.raises(InvalidRequestError, match="holds 1 tokens"):
            engine.try_join(RequestId("x"), keys, **x)
    else:
        assert engine.try_join(RequestId("x"), keys, **x).accepted
    if leaves in ("failed", "moved"):
        join(engine, r["y"], "y", 6, on_token=record)
    if leaves == "failed":
        with pytest.raises(EngineError, match=r"^request x: the model's 256 logits are not finite") as raised:
            engine.step()
        assert raised.value.request_id == "x"
    elif leaves in ("cancelled", "moved"):
        assert engine.cancel(RequestId("x"))
    engine.check_invariants()
    if leaves in ("cancelled", "refused"):
        join(engine, r["y"], "y", 6, on_token=record)
    assert engine.active_ids == (RequestId("y"),)
    join(engine, r["z"], "z", 6, on_token=record)
    while engine.num_active:
        engine.step()
        engine.check_invariants()
    for name in ("y", "z"):
        assert got[name] == greedy(prompt_of(name), r[name].first_token, 6)


@pytest.mark.parametrize("victim", ["b0", "b1"])
def test_a_callback_may_cancel_a_request_that_finishes_in_the_same_step(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], victim: str
) -> None:
    """b0, a, b1 decode (in that slot order); b0 and b1 reach their last token in the first step, where a's
    callback cancels `victim`. b1, not called back yet, gets no token of that step (cancel says True); b0 had its
    last token already (cancel says False). a decodes on as alone."""
    cache, r = prefilled
    engine = new_engine(cache)
    got: dict[str, list[tuple[int, bool]]] = {"a": [], "b0": [], "b1": []}
    answers: list[bool] = []

    def on_token(event: TokenEvent) -> None:
        got[event.request_id].append((event.index, event.finished))
        if event.request_id == "a" and event.index == 1:
            answers.append(engine.cancel(RequestId(victim)))

    for name, prompt, count in (("b0", "b", 2), ("a", "a", 4), ("b1", "c", 2)):
        result = r[prompt]
        verdict = engine.try_join(
            RequestId(name),
            result.keys,
            prompt_tokens=PROMPTS[prompt],
            first_token=result.first_token,
            max_new_tokens=count,
            on_token=on_token,
        )
        assert verdict.accepted
    engine.run(max_steps=10)
    engine.check_invariants()
    assert engine.num_active == 0
    assert answers == [victim == "b1"]
    assert got["a"] == [(0, False), (1, False), (2, False), (3, True)]
    assert got["b0"] == [(0, False), (1, True)]
    assert got["b1"] == ([(0, False)] if victim == "b1" else [(0, False), (1, True)])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"keys": None}, "keys must be a sequence of block keys, got None"),
        ({"keys": iter([1, 2])}, "keys must be a sequence"),
        ({"sampling": {"temperature": 1.0}}, r"sampling must be a SamplingParams or None, got \{'temperature': 1.0\}"),
        ({"max_new_tokens": 2**70}, r"max_new_tokens must be an integer in \[1, 2\*\*40\], got 1180591620717411303424"),
        ({"prompt_tokens": 2**70}, r"prompt_tokens must be an integer in \[1, 2\*\*40\], got 1180591620717411303424"),
    ],
)
def test_malformed_joins_are_invalid_requests_naming_the_field(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], options: dict[str, Any], named: str
) -> None:
    """keys that are no sequence, sampling that is no SamplingParams, and counts past 2**40 are refused by name
    (not a bare TypeError or AttributeError, nor the decode rule's `output_tokens`), and nothing is held."""
    cache, r = prefilled
    engine = new_engine(cache)
    arguments: dict[str, Any] = {
        "keys": r["a"].keys,
        "prompt_tokens": PROMPTS["a"],
        "first_token": r["a"].first_token,
        "max_new_tokens": 4,
    } | options
    with pytest.raises(InvalidRequestError, match=named) as raised:
        engine.try_join(RequestId("a"), arguments.pop("keys"), **arguments)
    assert raised.value.request_id is None  # raised to the caller that named the request: no other's failure
    assert engine.num_active == 0 and engine.reserved_tokens == 0 and engine.step() == []
    assert_nothing_held(cache, r["a"].keys)


@pytest.mark.parametrize(
    ("request_id", "options", "named"),
    [
        ([1], {}, r"request_id must be a non-empty string, got \[1\]"),
        ("", {}, "request_id must be a non-empty string, got ''"),
        (None, {}, "request_id must be a non-empty string, got None"),
        ("a", {"on_token": 5}, "on_token must be callable or None, got 5"),
        ("a", {"first_logprobs": {"logprob": 0.0}}, r"first_logprobs must be a TokenLogprobs or None, got \{"),
    ],
)
def test_a_join_with_a_malformed_id_or_callback_is_refused_by_name(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], request_id: object, options: dict[str, Any], named: str
) -> None:
    """An id that is no request id (`types.check_request_id`: an unhashable list, an empty string, None), an
    `on_token` that cannot be called, and `first_logprobs` that is no `TokenLogprobs` are InvalidRequestErrors
    naming the field and the value, and nothing is held. Accepted, a list id failed the step that finished it
    with a bare TypeError, after every other request had advanced: their tokens of that step were never called
    back (a gap in their streams); a number as `on_token` was a bare TypeError at the first token."""
    cache, r = prefilled
    engine = new_engine(cache)
    with pytest.raises(InvalidRequestError, match=named):
        engine.try_join(
            request_id,  # type: ignore[arg-type]
            r["a"].keys,
            prompt_tokens=PROMPTS["a"],
            first_token=r["a"].first_token,
            max_new_tokens=3,
            **options,
        )
    assert engine.num_active == 0 and engine.reserved_tokens == 0 and engine.step() == []
    assert_nothing_held(cache, r["a"].keys)
    got: list[TokenEvent] = []
    join(engine, r["b"], "b", 3, on_token=got.append)  # the engine serves as before (a's blocks were removed)
    engine.run(max_steps=5)
    assert [(e.index, e.finished) for e in got] == [(0, False), (1, False), (2, True)]


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 5])
def test_min_tokens_holds_a_request_whose_every_allowed_token_is_a_stop_token(
    prefilled: tuple[TieredCache, dict[str, PrefillResult]], min_tokens: int
) -> None:
    """A request whose only allowed token is its stop token can draw nothing else, so the sampler's `min_tokens`
    mask stands aside; the request still runs `min_tokens` tokens (that token each time, the prefill's first
    included) before the stop token ends it, as vLLM's `check_stop` never stops a request before `min_tokens`
    output tokens, and `max_new_tokens` ends it first where it is lower. It once ended at its first token."""
    cache, r = prefilled
    engine = new_engine(cache)
    token = r["a"].first_token
    got: list[TokenEvent] = []
    sampling = SamplingParams(allowed_token_ids={token}, stop_token_ids={token}, min_tokens=min_tokens)
    join(engine, r["a"], "a", 4, sampling=sampling, on_token=got.append)
    engine.run(max_steps=10)
    engine.check_invariants()
    count = min(max(min_tokens, 1), 4)
    assert [(e.index, e.token, e.finished) for e in got] == [(i, token, i == count - 1) for i in range(count)]
    assert engine.num_active == 0
