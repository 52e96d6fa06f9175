"""Tests of `serving.wire`: the gateway↔worker messages and their one encode/decode pair (no workers, no torch).

Properties: every message comes back equal from its JSON wire form; any change to a valid message's args (a
field dropped, added, or given a value of another type) and any unknown method is a `MessageError` naming the
method and the field, never a message. Examples: a malformed call raises through `handlers` (which the transfer
engine returns to the caller as the call's error) and its handler never runs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from serving import wire

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.types import BlockKey, InstanceId, Tier

ints = st.integers(min_value=0, max_value=2**63 - 1)
names = st.text(max_size=12)
floats = st.floats(allow_nan=False, allow_infinity=False)
keys = st.lists(ints, max_size=5).map(tuple)
block_keys = st.integers(min_value=0, max_value=2**64 - 1)  # 64-bit hashes, all of them
sources = st.sampled_from([InstanceId("prefill-0"), InstanceId("prefill-1")])
events = st.one_of(
    *(
        st.builds(
            kind,
            source=sources,
            seq=ints,
            keys=st.lists(block_keys, max_size=4),
            tier=st.sampled_from(Tier),
            epoch=ints,
        )
        for kind in (BlockStored, BlockRemoved)
    ),
    st.builds(AllBlocksCleared, source=sources, seq=ints, epoch=ints),
)
logprob_values = st.floats(max_value=0.0, allow_nan=False)  # -inf included: a token the model gives no chance
entries = st.builds(
    TokenLogprobs,
    logprob=logprob_values,
    rank=st.integers(min_value=1, max_value=2**31),
    top=st.lists(st.tuples(ints, logprob_values), max_size=3).map(tuple),
)
logprobs = st.none() | entries
tokens = st.builds(wire.Token, ints, ints, ints, ints, st.booleans(), logprobs)
samplings = st.builds(
    wire.Sampling,
    max_tokens=ints,
    temperature=floats,
    top_p=floats,
    seed=ints,
    stop_ids=keys,
    logprobs=st.none() | st.integers(min_value=0, max_value=20),
    top_k=ints,
    min_p=floats,
    repetition_penalty=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    prompt_logprobs=st.none() | st.integers(min_value=0, max_value=20),
    logit_bias=st.lists(st.tuples(ints, floats), max_size=3).map(tuple),
)
messages = st.one_of(
    st.builds(wire.Connect, gateway=names, peers=st.dictionaries(names, names, max_size=3)),
    st.builds(wire.HealthCheck),
    st.builds(
        wire.Health,
        ok=st.booleans(),
        pid=ints,
        queued=ints,
        active=keys,
        generated_tokens=ints,
        kv_usage=st.floats(min_value=0, max_value=1),
    ),
    st.builds(wire.Stop),
    st.builds(wire.PeerGone, address=names),
    st.builds(
        wire.PrefillJob,
        request_id=ints,
        attempt=ints,
        tokens=keys,
        decode=names,
        fetch=st.none() | st.builds(wire.Fetch, source=names, blocks=ints),
        sampling=samplings,
        cache_salt=st.none() | names,
    ),
    st.builds(wire.CancelPrefill, request_id=ints, attempt=ints),
    st.builds(wire.CancelDecode, request_id=ints),
    st.builds(
        wire.DecodeJob,
        request_id=ints,
        attempt=ints,
        keys=keys,
        prompt_tokens=ints,
        first_token=ints,
        sampling=samplings,
        first_logprobs=logprobs,
        prompt_ids=keys,
    ),
    st.builds(wire.PrefillStarted, instance_id=names, request_id=ints, attempt=ints),
    st.builds(
        wire.PrefillDone,
        instance_id=names,
        request_id=ints,
        attempt=ints,
        prefix_tokens=ints,
        computed_tokens=ints,
        fetched_blocks=ints,
        streamed_blocks=ints,
        events=st.lists(events, max_size=3).map(tuple),
        prompt_logprobs=st.none() | st.lists(entries, max_size=3).map(tuple),
    ),
    st.builds(
        wire.PrefillFailed,
        instance_id=names,
        request_id=ints,
        attempt=ints,
        error=names,
        peer=names,
        events=st.lists(events, max_size=3).map(tuple),
    ),
    st.builds(
        wire.DecodeJoined, instance_id=names, request_id=ints, attempt=ints, context_tokens=ints, output_tokens=ints
    ),
    st.builds(wire.DecodeRejected, instance_id=names, request_id=ints, attempt=ints, reason=names),
    st.builds(wire.DecodeFailed, instance_id=names, request_id=ints, attempt=ints, error=names),
    st.builds(wire.DecodeTokens, instance_id=names, tokens=st.lists(tokens, max_size=4).map(tuple)),
)


@given(messages)
def test_every_message_survives_the_wire(message: wire.Message) -> None:
    """decode(encode(m)) == m, through real JSON text."""
    method, args = wire.encode(message)
    assert wire.decode(method, json.loads(json.dumps(args))) == message


def wrong_type(value: Any) -> Any:
    """A JSON value of another type than `value`'s."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return 7
    return True  # lists, objects and null become a boolean


@given(messages, st.data())
def test_a_broken_message_is_an_error_naming_its_field(message: wire.Message, data: st.DataObject) -> None:
    """A field dropped, added or of another type is a MessageError naming the method and the field."""
    method, args = wire.encode(message)
    fields = sorted(args)
    change = data.draw(st.sampled_from(["add", "drop", "retype"] if fields else ["add"]))
    if change == "add":
        broken, field = {**args, "bogus_field": 1}, "bogus_field"
    else:
        field = data.draw(st.sampled_from(fields))
        broken = dict(args)
        if change == "drop":
            del broken[field]
        else:
            broken[field] = wrong_type(broken[field])
    with pytest.raises(wire.MessageError) as raised:
        wire.decode(method, broken)
    assert method in str(raised.value) and field in str(raised.value)


@pytest.mark.parametrize(
    ("method", "args", "named"),
    [
        ("decode.token", {}, "decode.token"),  # misspelt
        ("decode.tokens", [], "decode.tokens"),
        ("decode.tokens", {"instance_id": "d", "tokens": [[1, 0, 5, 0]]}, "tokens[0]"),
        ("decode.tokens", {"instance_id": "d", "tokens": [[1, 0, 5, 0, 1]]}, "tokens[0]"),
        ("decode.tokens", {"instance_id": "d", "tokens": [[1, 0, -5, 0, True]]}, "tokens[0]"),
        ("decode.tokens", {"instance_id": "d", "tokens": [[2**64, 0, 5, 0, True]]}, "tokens[0]"),
        ("decode.tokens", {"instance_id": "d", "tokens": [[1, 0, 5, 0, True, [0.5, 1, []]]]}, "[5][0]"),
        (
            "decode.tokens",
            {"instance_id": "d", "tokens": [[1, 0, 5, 0, True, [float("nan"), 1, []]]]},
            "[5][0]",
        ),
        (
            "decode.tokens",
            {"instance_id": "d", "tokens": [[1, 0, 5, 0, True, [-0.5, 0, []]]]},
            "tokens[0][5]",
        ),
        (
            "decode.tokens",
            {"instance_id": "d", "tokens": [[1, 0, 5, 0, True, [-0.5, 1, [[3]]]]]},
            "[5][2][0]",
        ),
        ("decode.tokens", {"instance_id": "d", "tokens": [[1, 0, 5, 0, True, [-0.5, 1, {}]]]}, "[5][2]"),
        (
            "prefill.done",
            {**wire.encode(wire.PrefillStarted(instance_id="p", request_id=1, attempt=0))[1]},
            "prefix_tokens",
        ),
        ("prefill.submit", {**wire.encode(wire.CancelDecode(request_id=1))[1]}, "prefill.submit"),
        ("worker.connect", {"gateway": "a:1", "peers": {"p": 3}}, "peers"),
    ],
)
def test_malformed_calls_are_named(method: str, args: Any, named: str) -> None:
    with pytest.raises(wire.MessageError, match=named.replace("[", r"\[").replace("]", r"\]")):
        wire.decode(method, args)


@pytest.mark.parametrize(
    "event",
    [
        ["stored", "p", 0, 1, 1, [5]],  # valid: comes back equal
        ["stored", "p", 0, 1, 9, [5]],  # no such tier
        ["stored", "p", -1, 1, 0, [5]],
        ["removed", "p", 0, 1, 0, ["5"]],
        ["stored", "p", 0, 1, 0, [2**64]],  # a key is 64 bits
        ["stored", "p", 0, 1, 0, [2**64 - 1]],  # valid: the largest key
        ["removed", "p", 0, 1, 0, [-1]],
        ["cleared", "p", 0],
        ["flushed", "p", 0, 1],
        "stored",
        [],
    ],
)
def test_malformed_cache_events_are_errors(event: Any) -> None:
    """A cache event of the wrong shape, kind, counts or key type is a MessageError (or, for a valid one, an event)."""
    try:
        decoded = wire.event_from_wire(event)
    except wire.MessageError as error:
        assert "event" in str(error)
    else:
        assert wire.event_to_wire(decoded) == event


def test_handlers_decode_before_serving() -> None:
    """`handlers` runs the handler on the decoded record and encodes its answer; a malformed call raises and the
    handler never runs."""
    seen: list[Any] = []

    def health(message: wire.HealthCheck) -> wire.Health:
        seen.append(message)
        return wire.Health(ok=True, pid=1, queued=0, active=(3,), generated_tokens=9, kv_usage=0.25)

    served = wire.handlers({wire.HealthCheck: health, wire.CancelDecode: seen.append})
    assert set(served) == {"worker.health", "decode.cancel"}
    answer = served["worker.health"]({})
    assert wire.decode_as(wire.Health, answer) == wire.Health(
        ok=True, pid=1, queued=0, active=(3,), generated_tokens=9, kv_usage=0.25
    )
    assert served["decode.cancel"]({"request_id": 4, "every_attempt": False}) is None
    assert seen == [wire.HealthCheck(), wire.CancelDecode(request_id=4)]
    with pytest.raises(wire.MessageError, match=r"decode\.cancel\.request_id"):
        served["decode.cancel"]({"request_id": "4"})
    assert len(seen) == 2


def test_cache_events_survive_the_wire() -> None:
    """Every kind of cache event comes back equal from its JSON wire form."""
    source = InstanceId("prefill-0")
    for event in (
        BlockStored(source=source, seq=0, keys=(BlockKey(1), BlockKey(2**63)), tier=Tier.DRAM, epoch=7),
        BlockRemoved(source=source, seq=1, keys=(BlockKey(5),), tier=Tier.SSD, epoch=7),
        AllBlocksCleared(source=source, seq=2, epoch=7),
    ):
        assert wire.event_from_wire(json.loads(json.dumps(wire.event_to_wire(event)))) == event


@pytest.mark.parametrize(
    ("path", "value"),
    [(("fetch", "blocks"), -2), (("request_id",), -1), (("sampling", "max_tokens"), -3), (("attempt",), 2**64)],
)
def test_an_integer_field_out_of_range_is_an_error_naming_it(path: tuple[str, ...], value: int) -> None:
    """Every integer on the wire is an id or a count, in [0, 2**64) as the lists of ids are: a negative one (a
    fetch of -2 blocks, which the prefill worker read as all the prompt's blocks but the last two) or a 65-bit
    one is a MessageError naming the field and the value (it decoded)."""
    sampling = wire.Sampling(max_tokens=4, temperature=0.0, top_p=1.0, seed=2**64 - 1, stop_ids=())
    job = wire.PrefillJob(
        request_id=1, attempt=0, tokens=(1,), decode="d", fetch=wire.Fetch(source="p", blocks=2), sampling=sampling
    )
    method, args = wire.encode(job)
    assert wire.decode(method, args) == job  # the largest seed is in range
    args = json.loads(json.dumps(args))
    *outer, last = path
    inner = args
    for name in outer:
        inner = inner[name]
    inner[last] = value
    with pytest.raises(wire.MessageError) as raised:
        wire.decode(method, args)
    assert str(raised.value).endswith(f"{'.'.join(path)}: expected an integer in [0, 2**64), got {value}")
