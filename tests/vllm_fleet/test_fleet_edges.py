"""Edges of the vLLM router (examples/vllm_fleet) that its main tests leave open, without real vLLM.

The config's remaining one-line refusals; the online prefill model's refit cadence, window and calibration;
the `Fleet`'s bookkeeping at its edges (what a prefill teaches the model and when, an overdue head of queue,
the backlog of several foreign requests, a decode server's reconcile, a server going down restarting its
events' epoch, unreadable batches logged once each); the probe's and calibration's refusals against
stand-in servers (`fake.FakeVllm` and variants of it that serve what a misconfigured vLLM would); the
proxy's smaller rules (retries counted, /health and /metrics, the API key on /v1/models, chat paths,
batches, hidden usage chunks leaving no stray blank line); and `VllmFleet.start` failing cleanly with a
stand-in for the vLLM command. Every server, router, socket and process is stopped; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("transformers")

import aiohttp
from aiohttp import web
from serving.api import DECODE_HEADER, PREFILL_HEADER, vllm_prompt_logprobs
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import RouterConfig, parse_router_config
from vllm_fleet.fleet import Fleet
from vllm_fleet.model import words
from vllm_fleet.online import OnlinePrefillModel
from vllm_fleet.proxy import VllmRouter, _cached_tokens, _subscriber
from vllm_fleet.servers import VllmFleet, VllmServer, free_port
from vllm_fleet.upstream import InstanceInfo, InstanceState, calibrate, probe

from mooncake.cache.events import BlockStored
from mooncake.cache.vllm_events import VllmEventEncoder
from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError
from mooncake.sched import PrefillSample, Reason
from mooncake.types import InstanceId, Tier, prefix_reusable
from tests.vllm_fleet.fake import FakeVllm
from tests.vllm_fleet.http import fetch
from tests.vllm_fleet.test_proxy import router_config
from tests.waiting import is_running, wait_for

BLOCK = 32
INFO = InstanceInfo(model="tiny", max_model_len=2048, block_size=BLOCK, prefix_caching=True, kv_capacity_tokens=65_536)
MODEL = "tiny"
ENGINES = ("vllm-0", "vllm-1")


# ---------------------------------------------------------------------------------------------- helpers


def fleet_config(folder: Path, *, roles: tuple[str, ...] = ("both", "both"), **router: Any) -> RouterConfig:
    """A config of `roles` servers on ports nobody serves (the `Fleet` alone never calls them)."""
    (folder / "tokenizer.json").write_text("{}")
    data: dict[str, Any] = {
        "router": {"block_size": BLOCK, "tokenizer": str(folder), "ttft_slo_s": 5.0, **router},
        "instances": [
            {"url": f"http://127.0.0.1:{8100 + i}", "kv_events": f"tcp://127.0.0.1:{free_port()}", "role": role}
            for i, role in enumerate(roles)
        ],
    }
    return parse_router_config(data, "router.toml")


def stored(fleet: Fleet, instance: str, tokens: list[int], seq: int) -> None:
    keys = fleet.hasher.block_keys(tokens)[: len(tokens) // BLOCK]
    fleet.conductor.apply_cache_event(BlockStored(source=InstanceId(instance), seq=seq, keys=keys, tier=Tier.VRAM))


def proxy_config(
    servers: list[FakeVllm], tokenizer_dir: Path, roles: tuple[str, ...] = (), **router: Any
) -> RouterConfig:
    """test_proxy's configuration, with no health pass unless a test asks for one and no calibration."""
    return router_config(
        servers, tokenizer_dir, roles, **{"health_interval_s": 30.0, "calibration_tokens": 0, **router}
    )


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    answer = fetch(url, body, headers)
    return answer.status_code, answer.headers, answer.text


def sample(router: BackgroundRouter, name: str, labels: dict[str, str]) -> float:
    """One series of the router's own metrics (0 where it does not exist yet)."""
    value = router.read(lambda r: r.metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels}))
    return float(value or 0.0)


@contextlib.contextmanager
def serving(*servers: FakeVllm) -> Iterator[tuple[FakeVllm, ...]]:
    try:
        for server in servers:
            server.start()
        yield servers
    finally:  # stop() of a server that never started does nothing
        for server in servers:
            server.stop()


class ConfiguredVllm(FakeVllm):
    """A stand-in serving what a differently configured vLLM would: another model name, prefix caching off,
    another KV capacity, another tokenizer, no models at all; and vLLM's refusal of a prompt that leaves no
    room for an output token in `max_model_len`. `paths` holds each completion's path."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        model: str = MODEL,
        prefix_caching: bool = True,
        cache_info: str = 'kv_cache_size_tokens="65536",num_gpu_blocks="2048"',
        shifted_tokens: bool = False,
        no_models: bool = False,
        deep_models: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(tokenizer, **options)
        self.model, self.prefix_caching, self.cache_info = model, prefix_caching, cache_info
        self.shifted_tokens, self.no_models, self.deep_models = shifted_tokens, no_models, deep_models
        self.paths: list[str] = []

    async def _models(self, _request: web.Request) -> web.Response:
        if self.deep_models:  # JSON nested past the interpreter's stack
            return web.Response(text='{"data": ' + "[" * 100_000 + "]" * 100_000 + "}", content_type="application/json")
        data = [] if self.no_models else [{"id": self.model, "max_model_len": self.max_model_len}]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="{self.prefix_caching}",'
            f'engine="0",{self.cache_info}}} 1.0\n'
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        tokens = self.tokenizer.encode((await request.json())["prompt"])
        return web.json_response({"tokens": [t + 1 for t in tokens] if self.shifted_tokens else tokens})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            wanted = len(prompt) + int(body.get("max_tokens") or 16)
            if wanted > self.max_model_len:  # vLLM's 400: the prompt and its output must fit the context
                return web.json_response({"error": {"message": "maximum context length"}}, status=400)
        # The body was read: the base class reads it again from the cache aiohttp keeps.
        return await super()._completions(request)


# ---------------------------------------------------------------------------------------------- config


def _instance(**fields: Any) -> dict[str, Any]:
    return {"url": "http://x:1", "kv_events": "tcp://a:1", **fields}


@pytest.mark.parametrize(
    ("router", "instances", "message"),
    [
        ({}, [_instance(url="http://x:1/v1")], r"url = 'http://x:1/v1': must be an http:// or https:// URL"),
        ({}, [_instance(url="http://x:99999")], r"url = 'http://x:99999': has a port that is not a number"),
        ({}, [_instance(kv_events="tcp://a:123456")], r"kv_events = 'tcp://a:123456': must be a ZeroMQ"),
        ({}, [_instance(replay="a:1")], r"replay = 'a:1': must be a ZeroMQ"),
        # `*` is where only vLLM binds: the router connects to a replay socket, and vLLM to its events port.
        ({}, [_instance(replay="tcp://*:5558")], r"router.toml: \[\[instances\]\] 0 replay = 'tcp://\*:5558': names"),
        ({}, [_instance(replay="tcp://a:*")], r"0 replay = 'tcp://a:\*': names where the router connects"),
        ({}, [_instance(kv_events="tcp://*:*")], r"0 kv_events = 'tcp://\*:\*': needs a port"),
        ({}, [_instance(), _instance(url="http://y:1")], r"1 kv_events = 'tcp://a:1': the same as instance 0's"),
        ({}, [_instance(role="decode")], r"roles \['decode'\]: prefill and decode instances come in pairs"),
        ({}, [{"url": "http://x:1"}], r"\[\[instances\]\] 0: kv_events is required"),
        (5, [_instance()], r"router.toml: \[router\] = 5: must be a table"),
        ({}, [5], r"router.toml: instances = \[5\]: must be \[\[instances\]\] tables"),
    ],
)
def test_more_bad_configs_are_one_line_naming_the_key(
    tmp_path: Path, router: Any, instances: list[Any], message: str
) -> None:
    """A URL with a path or a bad port, an endpoint with a port of six digits, a bad replay endpoint (`*` for its
    host or port too), an events endpoint with port `*`, two
    servers sharing an events endpoint, a decode server without a prefill one, a missing events endpoint, a
    `[router]` or `instances` of the wrong shape: each a ConfigError of one line naming it."""
    (tmp_path / "tokenizer.json").write_text("{}")
    if isinstance(router, dict):
        router = {**router, "tokenizer": str(tmp_path)}
    with pytest.raises(ConfigError, match=message) as caught:
        parse_router_config({"router": router, "instances": instances}, "router.toml")
    assert "\n" not in str(caught.value)


def test_the_subscriber_names_the_key_whose_endpoint_zeromq_refuses() -> None:
    """A replay endpoint ZeroMQ cannot connect to is named as `replay` (it was blamed on `kv_events`), with its
    instance; the events port the subscriber had bound is let go of."""
    from mooncake.cache import BlockHasher, BlockIndex
    from mooncake.cache.vllm_events import VllmEventDecoder

    decoder = VllmEventDecoder(BlockHasher(model="m", block_size_tokens=32), InstanceId("vllm-0"))
    # Past the config's check (which refuses this endpoint first), as a section the router could be given.
    section = types.SimpleNamespace(
        base_url="http://x:1", kv_events=f"tcp://127.0.0.1:{free_port()}", replay="tcp://*:5558"
    )
    with pytest.raises(ConfigError, match=r"^instance vllm-0 \(http://x:1\): replay = 'tcp://\*:5558' cannot be conn"):
        _subscriber(section, decoder, BlockIndex())
    section.replay = ""
    _subscriber(section, decoder, BlockIndex()).close()  # its port is free again
    taken = _subscriber(section, decoder, BlockIndex())
    try:
        with pytest.raises(
            ConfigError, match=r"^instance vllm-0 \(http://x:1\): kv_events = 'tcp://127.0.0.1:\d+' cannot be b"
        ):
            _subscriber(section, decoder, BlockIndex())
    finally:
        taken.close()


def test_the_tokenizer_may_be_sentencepiece_but_not_a_file(tmp_path: Path) -> None:
    """A directory with only `tokenizer.model` (a SentencePiece model) holds a tokenizer; a file is refused as
    not a directory; an empty replay endpoint means none."""
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    config = parse_router_config(
        {"router": {"tokenizer": str(tmp_path)}, "instances": [_instance(replay="")]}, "router.toml"
    )
    assert config.instances[0].replay == ""
    with pytest.raises(ConfigError, match="is not a directory"):
        parse_router_config(
            {"router": {"tokenizer": str(tmp_path / "tokenizer.model")}, "instances": [_instance()]}, "router.toml"
        )


# ---------------------------------------------------------------------------------------------- online model


def linear(tokens: int) -> PrefillSample:
    return PrefillSample(num_tokens=tokens, prefix_tokens=0, seconds=0.01 + 1e-4 * tokens)


def test_the_online_model_refits_every_refit_every_samples() -> None:
    """With `refit_every` 4 the model is refitted at the 4th and the 8th sample, not before, not between."""
    model = OnlinePrefillModel(refit_every=4)
    fits = []
    for number in range(1, 9):
        point = linear(100 * number)
        model.observe(point.num_tokens, 0, point.seconds)
        fits.append(model.num_fits)
    assert fits == [0, 0, 0, 1, 1, 1, 1, 2]
    assert model.prefill_s(1000) == pytest.approx(0.01 + 1e-4 * 1000, rel=1e-6)
    with pytest.raises(ConfigError):
        OnlinePrefillModel(refit_every=0)


def test_the_online_model_keeps_only_its_window() -> None:
    model = OnlinePrefillModel(window=3, refit_every=100)
    for tokens in (10, 20, 30, 40, 50):
        model.observe(tokens, 0, 0.1)
    assert [s.num_tokens for s in model.samples] == [30, 40, 50]


def test_calibration_fits_three_samples_and_survives_ones_it_cannot_fit() -> None:
    """Three timed prefills of different lengths (one server's calibration) are enough for a fit; three of
    one length cannot be fitted, and the prior stays."""
    model = OnlinePrefillModel()
    model.calibrate([linear(64), linear(256), linear(1024)])
    assert model.num_fits == 1 and model.prefill_s(512) == pytest.approx(0.01 + 1e-4 * 512, rel=1e-6)
    same = OnlinePrefillModel()
    prior = same.current
    same.calibrate([linear(64), linear(64), linear(64)])
    assert same.num_fits == 0 and same.current == prior and len(same.samples) == 3


# ---------------------------------------------------------------------------------------------- fleet


def test_what_a_prefill_teaches_the_model(tmp_path: Path) -> None:
    """An idle server's first token teaches the time since dispatch (not since time zero); an answer that came
    whole (not timed) teaches nothing; a request that fails after its first token still teaches its prefill;
    a prompt that asks for no output is planned for one token; a request queued behind another teaches
    nothing (its TTFT holds the other's prefill)."""
    fleet = Fleet(fleet_config(tmp_path, roles=("both",)), [INFO])
    model = fleet.prefill_model
    _, decision = fleet.schedule(list(range(1, 301)), 4, now=10.0)
    flight = fleet.flights[decision.request_id]
    fleet.first_token(flight, 10.05)
    fleet.finished(flight, 10.2, generated_tokens=4, cached_tokens=0)
    assert [(s.num_tokens, s.seconds) for s in model.samples] == [(300, pytest.approx(0.05))]

    _, decision = fleet.schedule(list(range(1, 401)), 4, now=11.0)
    fleet.finished(fleet.flights[decision.request_id], 11.5, generated_tokens=4, cached_tokens=0)  # came whole
    assert len(model.samples) == 1

    _, decision = fleet.schedule(list(range(1, 501)), 4, now=12.0)
    flight = fleet.flights[decision.request_id]
    fleet.first_token(flight, 12.08)
    fleet.failed(flight, 12.1, Reason.CLIENT_GONE)
    assert len(model.samples) == 2 and model.samples[-1].seconds == pytest.approx(0.08)
    assert not fleet.flights

    request, decision = fleet.schedule(list(range(1, 101)), 0, now=13.0)
    assert decision.accepted and request.output_length == 1
    fleet.failed(fleet.flights[decision.request_id], 13.01, Reason.CLIENT_GONE)

    _, ahead = fleet.schedule(list(range(1, 601)), 4, now=20.0)
    _, behind = fleet.schedule(list(range(1001, 1601)), 4, now=20.0)  # queued behind: its TTFT is not a prefill
    for decision, now in ((ahead, 20.05), (behind, 20.1)):
        flight = fleet.flights[decision.request_id]
        fleet.first_token(flight, now)
        fleet.finished(flight, now + 0.1, generated_tokens=4, cached_tokens=0)
    assert len(model.samples) == 3 and model.samples[-1].num_tokens == 600
    fleet.conductor.check_invariants()


def test_a_disaggregated_prefill_is_timed_by_its_answer_once(tmp_path: Path) -> None:
    """The prefill server's answer ends the prefill and teaches the model; the decode server's first token
    later does not end it again, and a first token said twice counts once."""
    fleet = Fleet(fleet_config(tmp_path, roles=("prefill", "decode")), [INFO, INFO])
    _, decision = fleet.schedule(list(range(1, 301)), 8, now=0.0)
    assert (decision.prefill_instance, decision.decode_instance) == ("vllm-0", "vllm-1")
    flight = fleet.flights[decision.request_id]
    fleet.prefilled(flight, 0.05, cached_tokens=0)
    fleet.first_token(flight, 0.3)
    fleet.first_token(flight, 0.4)  # said twice: the first stands
    assert flight.first_token_s == 0.3 and flight.prefilled_s == 0.05
    fleet.finished(flight, 0.5, generated_tokens=8)
    assert [s.seconds for s in fleet.prefill_model.samples] == [pytest.approx(0.05)]
    assert not fleet.flights
    fleet.conductor.check_invariants()


def test_an_overdue_head_of_queue_is_taken_to_start_now(tmp_path: Path) -> None:
    """A request still without its first token long after its predicted prefill keeps its server busy: the
    next request on that server waits a whole prefill of it again, not nothing."""
    fleet = Fleet(fleet_config(tmp_path, roles=("both",), ttft_slo_s=60.0), [INFO])
    _, first = fleet.schedule(list(range(1, 2001)), 4, now=0.0)
    whole = fleet.prefill_model.prefill_s(2000, 0)
    due = fleet.conductor.prefill_views[0].queue[0].finish_s
    _, on_time = fleet.schedule(list(range(3001, 3101)), 4, now=due)  # due now, not yet overdue
    assert on_time.accepted and on_time.ttft_s is not None and on_time.ttft_s < whole
    _, later = fleet.schedule(list(range(5001, 5101)), 4, now=100 * whole)
    assert first.accepted and later.accepted and later.ttft_s is not None
    assert later.ttft_s >= whole
    fleet.conductor.check_invariants()


def test_reconcile_counts_each_foreign_request_and_only_on_prefill_servers(tmp_path: Path) -> None:
    """Three requests waiting on a server that the router never sent are three typical prefills of backlog,
    from `now`; the router's requests on the other server are not this one's; a decode server is not
    reconciled (it prefills nothing the router routes)."""
    fleet = Fleet(fleet_config(tmp_path), [INFO, INFO])
    document = list(range(1, 301))
    stored(fleet, "vllm-1", document, 0)
    _, decision = fleet.schedule([*document, 7], 4, now=0.0)
    assert decision.prefill_instance == "vllm-1"
    assert fleet.unprefilled(InstanceId("vllm-0")) == frozenset()
    assert fleet.unprefilled(InstanceId("vllm-1")) == {decision.request_id}
    backlog = fleet.reconcile(InstanceId("vllm-0"), InstanceState(waiting=3), 100.0)
    assert backlog == pytest.approx(3 * fleet.prefill_model.prefill_s(301, 0))
    view = next(v for v in fleet.conductor.prefill_views if v.instance_id == "vllm-0")
    assert view.backlog_until_s == pytest.approx(100.0 + backlog)
    assert fleet.cached_blocks(InstanceId("vllm-1")) == 9 and fleet.cached_blocks(InstanceId("vllm-0")) == 0

    pair = Fleet(fleet_config(tmp_path, roles=("prefill", "decode")), [INFO, INFO])
    assert pair.reconcile(InstanceId("vllm-1"), InstanceState(waiting=5), 1.0) == 0.0
    pair.conductor.check_invariants()


def test_a_server_down_starts_a_new_epoch_of_its_events(tmp_path: Path) -> None:
    """Marking a server down starts its decoder on a new epoch from batch 0 (its next events, a restarted
    server's or a replay's, are a new epoch) and keeps its hash translations (a replayed block whose parent came
    before the replay buffer's window is still understood); the other's is untouched; marking it down again
    does nothing."""
    fleet = Fleet(fleet_config(tmp_path), [INFO, INFO], subscribe=_subscriber)
    try:
        decoders = {i: x.subscriber.decoder for i, x in fleet.instances.items()}
        encoder = VllmEventEncoder(fleet.hasher)
        keys = encoder.register(list(range(1, 101)))
        stored_batch = encoder.encode(
            [BlockStored(source=InstanceId("vllm-0"), seq=0, keys=keys[:2], tier=Tier.VRAM)], ts=1.0
        )
        assert len(decoders["vllm-0"].decode(stored_batch, seq=0)) == 1
        before = {i: d.epoch for i, d in decoders.items()}
        fleet.set_up(InstanceId("vllm-0"), False, 1.0)
        assert decoders["vllm-0"].epoch == before["vllm-0"] + 1 and decoders["vllm-1"].epoch == before["vllm-1"]
        assert decoders["vllm-0"].expected_seq == 0 and decoders["vllm-0"].key_of(keys[1]) == keys[1]
        assert fleet.set_up(InstanceId("vllm-0"), False, 2.0) == ()
        assert decoders["vllm-0"].epoch == before["vllm-0"] + 1
    finally:
        fleet.close()
    assert all(x.subscriber.closed for x in fleet.instances.values())


def test_unreadable_event_batches_are_counted_and_logged_once_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A message that is not `[topic, seq, payload]` is handled (counted in what `poll_events` returns), counted
    as the instance's event error, and logged once; polls that find nothing new log nothing."""
    zmq = pytest.importorskip("zmq")
    fleet = Fleet(fleet_config(tmp_path), [INFO, INFO], subscribe=_subscriber)
    context = zmq.Context()
    try:
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.connect(fleet.instances[InstanceId("vllm-0")].section.kv_events)
        caplog.set_level(logging.ERROR, logger="vllm_router")
        handled = 0
        deadline = time.monotonic() + 10
        while handled == 0:  # PUB drops what it sends before the subscription reaches it
            assert time.monotonic() < deadline, "no message reached the subscriber"
            publisher.send_multipart([b"", b"short"])
            time.sleep(0.02)
            handled = fleet.poll_events()
        publisher.close(linger=0)  # nothing more is sent; what is on its way is let arrive, until quiet for 0.5 s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5:  # one empty poll is no proof: a message may be 20 ms behind
            assert time.monotonic() < deadline + 10, "the messages in flight never stopped"
            if fleet.poll_events():
                quiet_since = time.monotonic()
            time.sleep(0.02)
        instance = fleet.instances[InstanceId("vllm-0")]
        errors = instance.subscriber.stats.num_errors
        assert errors >= handled >= 1 and instance.event_errors == errors
        logged = len(caplog.records)
        # One line per poll that found new errors (several batches in one poll: one line), each with the count so far.
        counts = [int(re.search(r"(\d+) KV-event batches", record.getMessage()).group(1)) for record in caplog.records]
        assert counts == sorted(set(counts)) and counts[-1] == errors, counts
        for _ in range(3):
            assert fleet.poll_events() == 0
        assert len(caplog.records) == logged and fleet.instances[InstanceId("vllm-1")].event_errors == 0
    finally:
        context.destroy(linger=0)
        fleet.close()


def test_a_gap_in_a_servers_events_is_asked_of_its_replay_socket(tmp_path: Path) -> None:
    """The subscriber connects to the instance's `replay` endpoint: a batch numbered past the next expected one
    makes it ask there for the missed batches, from the first missed."""
    zmq = pytest.importorskip("zmq")
    context = zmq.Context()
    fleet = None
    try:
        replay = context.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        port = replay.bind_to_random_port("tcp://127.0.0.1")
        config = fleet_config(tmp_path, roles=("both",))
        section = attrs.evolve(config.instances[0], replay=f"tcp://127.0.0.1:{port}")
        fleet = Fleet(attrs.evolve(config, instances=(section,)), [INFO], subscribe=_subscriber)
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.connect(section.kv_events)
        payload = VllmEventEncoder(fleet.hasher).encode([], ts=1.0)
        deadline = time.monotonic() + 10
        while fleet.poll_events() == 0:  # PUB drops what it sends before the subscription reaches it
            assert time.monotonic() < deadline, "no batch reached the subscriber"
            publisher.send_multipart([b"", (5).to_bytes(8, "big"), payload])
            time.sleep(0.02)
        assert replay.poll(5000), "the subscriber asked nothing of the replay socket"
        assert replay.recv_multipart()[1:] == [b"", (0).to_bytes(8, "big")]
    finally:
        context.destroy(linger=0)
        if fleet is not None:
            fleet.close()


# ---------------------------------------------------------------------------------------------- probe


@given(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.floats(allow_nan=False),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
    )
)
def test_cached_tokens_are_a_count_or_none(value: Any) -> None:
    """`prompt_tokens_details.cached_tokens` is read only where it is a count (an int >= 0, not a bool);
    anything else, or a usage without it, says nothing."""
    got = _cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": value}})
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        assert got == value
    else:
        assert got is None
    assert _cached_tokens({"prompt_tokens": 9}) is None and _cached_tokens(None) is None


def probed(server: FakeVllm, tokenizer: Any, *, block_size: int = BLOCK) -> InstanceInfo:
    async def run() -> InstanceInfo:
        async with aiohttp.ClientSession() as session:
            return await probe(session, "vllm-0", server.url, block_size=block_size, tokenizer=tokenizer, timeout_s=5)

    return asyncio.run(run())


def test_the_probe_reads_the_capacity_and_refuses_what_it_cannot_use(tokenizer_dir: Path) -> None:
    """The KV capacity is `kv_cache_size_tokens` where the server gives it, else its blocks times the block
    size; another block size, prefix caching off, another tokenizer, no models listed (or a list nested past the
    stack), or no server at all is a ConfigError naming the instance."""
    tokenizer = load_tokenizer(tokenizer_dir)
    given_ = ConfiguredVllm(tokenizer, cache_info='kv_cache_size_tokens="1000",num_gpu_blocks="2048"')
    blocks = ConfiguredVllm(tokenizer, cache_info='num_gpu_blocks="100"')
    no_caching = ConfiguredVllm(tokenizer, prefix_caching=False)
    shifted = ConfiguredVllm(tokenizer, shifted_tokens=True)
    empty = ConfiguredVllm(tokenizer, no_models=True)
    deep = ConfiguredVllm(tokenizer, deep_models=True)
    with serving(given_, blocks, no_caching, shifted, empty, deep):
        assert probed(given_, tokenizer).kv_capacity_tokens == 1000
        assert probed(blocks, tokenizer).kv_capacity_tokens == 100 * BLOCK
        with pytest.raises(ConfigError, match=r"stores blocks of 32 tokens, \[router\] block_size = 16"):
            probed(given_, tokenizer, block_size=16)
        with pytest.raises(ConfigError, match=r"instance vllm-0 .* runs without prefix caching"):
            probed(no_caching, tokenizer)
        with pytest.raises(ConfigError, match=r"tokenizer does not match the served model 'tiny'"):
            probed(shifted, tokenizer)
        with pytest.raises(ConfigError, match="does not answer as a vLLM server does"):
            probed(empty, tokenizer)
        with pytest.raises(ConfigError, match=r"does not answer as a vLLM server does.*nested deeper than 128"):
            probed(deep, tokenizer)  # a bare RecursionError before
        gone = given_.url
    with pytest.raises(ConfigError, match=f"instance vllm-0 \\({gone}\\) is unreachable"):
        probed(given_, tokenizer)


def test_the_probe_names_a_count_it_cannot_read(tokenizer_dir: Path) -> None:
    """A block size, KV capacity or context length that is no whole number is a ConfigError naming the
    instance, the field and the value (it was int()'s bare ValueError or TypeError, which the router's start
    and its re-probe of a server coming back do not catch); an unset one (vLLM labels it "None") is unknown, 0."""
    tokenizer = load_tokenizer(tokenizer_dir)
    unset = ConfiguredVllm(tokenizer, cache_info='num_gpu_blocks="None"')
    blocks_only = ConfiguredVllm(tokenizer, cache_info='kv_cache_size_tokens="None",num_gpu_blocks="10"')
    bad_blocks = ConfiguredVllm(tokenizer, cache_info='num_gpu_blocks="many"')
    bad_capacity = ConfiguredVllm(tokenizer, cache_info='kv_cache_size_tokens="1e6"')
    bad_block_size = ConfiguredVllm(tokenizer, block_size="sixteen")  # type: ignore[arg-type]
    bad_length = ConfiguredVllm(tokenizer, max_model_len={"n": 1})  # type: ignore[arg-type]
    huge_length = ConfiguredVllm(tokenizer, max_model_len="9" * 5000)  # type: ignore[arg-type]
    with serving(unset, blocks_only, bad_blocks, bad_capacity, bad_block_size, bad_length, huge_length):
        assert probed(unset, tokenizer).kv_capacity_tokens == 0
        assert probed(blocks_only, tokenizer).kv_capacity_tokens == 10 * blocks_only.block_size
        for server, field, value in (
            (bad_blocks, "num_gpu_blocks", "'many'"),
            (bad_capacity, "kv_cache_size_tokens", "'1e6'"),
            (bad_block_size, "block_size", "'sixteen'"),
            (bad_length, "max_model_len", "{'n': 1}"),
            (huge_length, "max_model_len", "'9999"),
        ):
            with pytest.raises(ConfigError, match=f"instance vllm-0 .*: .*{field} is {re.escape(value)}"):
                probed(server, tokenizer, block_size=server.block_size if field != "block_size" else BLOCK)


def test_calibration_times_each_length_after_one_warm_up(fakes: list[FakeVllm]) -> None:
    """One streamed request per length, after a warm-up of the first length that is not counted; a server
    that refuses one is a ConfigError."""
    server = fakes[0]

    async def run() -> list[PrefillSample]:
        async with aiohttp.ClientSession() as session:
            return await calibrate(
                session, server.url, MODEL, vocab_size=500, lengths=[4, 16, 64], seed=1, timeout_s=10
            )

    samples = asyncio.run(run())
    assert [s.num_tokens for s in samples] == [4, 16, 64] and all(s.seconds > 0 for s in samples)
    assert [len(body["prompt"]) for body in server.received] == [4, 4, 16, 64]
    assert all(body["max_tokens"] == 1 and body["stream"] for body in server.received)
    server.status = 500
    with pytest.raises(ConfigError, match="a calibration prefill of 4 tokens answered 500"):
        asyncio.run(run())


# ---------------------------------------------------------------------------------------------- router start


def test_servers_of_different_models_are_refused(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    other = ConfiguredVllm(fakes[0].tokenizer, model="other")
    with serving(other), pytest.raises(ConfigError, match=r"the instances serve different models: \['other', 'tiny'\]"):
        BackgroundRouter(proxy_config([fakes[0], other], tokenizer_dir))


def test_calibration_uses_the_context_and_the_smallest_length(tokenizer_dir: Path) -> None:
    """The longest calibration prompt leaves a token of the smallest context for the output (vLLM refuses a
    prompt that fills it); a calibration of 8 tokens still runs (three lengths on each server)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    servers = [ConfiguredVllm(tokenizer, max_model_len=64), ConfiguredVllm(tokenizer, max_model_len=128)]
    with serving(*servers):
        config = proxy_config(list(servers), tokenizer_dir, calibration_tokens=1024)
        with BackgroundRouter(config) as router:
            assert router.read(lambda r: len(r.fleet.prefill_model.samples)) == 6
        assert max(len(body["prompt"]) for body in servers[1].received) == 63
        with BackgroundRouter(proxy_config(list(servers), tokenizer_dir, calibration_tokens=8)) as router:
            assert router.read(lambda r: [s.num_tokens for s in r.fleet.prefill_model.samples]) == [1, 4, 8] * 2


def test_a_failed_start_and_a_close_let_go_of_everything(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """A start that fails once the fleet exists (a calibration prefill refused) closes its KV-event
    subscribers, and so does `close` after a start that worked; a `BackgroundRouter` whose start fails
    stops its thread."""

    async def start_then_close(config: RouterConfig) -> VllmRouter:
        router = VllmRouter(config)
        try:
            await router.start()
        finally:
            await router.close()
        return router

    router = asyncio.run(start_then_close(proxy_config(fakes, tokenizer_dir)))
    assert router.fleet is not None and all(i.subscriber.closed for i in router.fleet.instances.values())

    fakes[1].status = 500
    failing = VllmRouter(proxy_config(fakes, tokenizer_dir, calibration_tokens=64))
    with pytest.raises(ConfigError, match="calibration prefill"):
        asyncio.run(failing.start())
    assert failing.fleet is not None and all(i.subscriber.closed for i in failing.fleet.instances.values())

    threads = {t for t in threading.enumerate() if t.name == "vllm-router"}
    for fake in fakes:  # one server answering would start the router (the other joins later)
        fake.stop()
    with pytest.raises(ConfigError, match=r"no instance can be reached: .* is unreachable"):
        BackgroundRouter(proxy_config(fakes, tokenizer_dir))
    assert {t for t in threading.enumerate() if t.name == "vllm-router" and t.is_alive()} <= threads


# ---------------------------------------------------------------------------------------------- proxy


def test_each_failed_attempt_is_one_server_and_retries_are_bounded(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """With `max_retries` 1 a request is tried on two servers at most, each marked down after its 503."""
    for fake in fakes:
        fake.status = 503
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir, max_retries=1)) as router:
        status, _, text = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada", "max_tokens": 2})
        assert status == 502 and "failed on 2 servers" in text
        assert sorted(len(f.received) for f in fakes) == [1, 1]
        assert router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [False, False]
        assert router.read(lambda r: len(r.fleet.flights)) == 0


def test_health_follows_the_servers_and_the_metrics_say_so(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """A server whose /health fails, or that refuses connections, is marked down by the health pass (its
    `engine_up` 0) and up again when it answers; the router's /health is 200 while any server is up, 503
    when none is."""
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir, health_interval_s=0.05)) as router:
        health = fetch(f"{router.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        fakes[0].healthy = False
        wait_for(lambda: not router.read(lambda r: r.fleet.instances["vllm-0"].up), timeout=10, what="vllm-0 down")
        assert sample(router, "mooncake:engine_up", {"engine": "vllm-0"}) == 0.0
        health = fetch(f"{router.url}/health")
        assert health.status_code == 200 and health.json()["instances"]["vllm-0"]["up"] is False
        fakes[1].stop()  # refuses connections: down too
        wait_for(lambda: fetch(f"{router.url}/health").status_code == 503, timeout=10, what="no server up")
        assert fetch(f"{router.url}/health").json()["status"] == "unavailable"
        fakes[0].healthy = True
        fakes[1].start()  # the same port again
        wait_for(
            lambda: router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [True, True],
            timeout=10,
            what="both up again",
        )
        assert sample(router, "mooncake:engine_up", {"engine": "vllm-0"}) == 1.0


def test_a_server_that_comes_back_is_probed_again(tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A down server that answers /health again is probed as at start-up (it was marked up with its start-up
    limits): restarted with another block size, then serving another model, it stays down, each reason's
    ConfigError line logged once and shown in /health; restarted with another max_model_len it comes back and
    the router plans by it (a prompt over the new context is refused before the server sees it)."""
    caplog.set_level(logging.WARNING, logger="vllm_router")
    server = ConfiguredVllm(load_tokenizer(tokenizer_dir))
    with serving(server), BackgroundRouter(proxy_config([server], tokenizer_dir, health_interval_s=0.05)) as router:

        def state() -> tuple[bool, str]:
            return router.read(lambda r: (r.fleet.instances["vllm-0"].up, r.fleet.instances["vllm-0"].refused))

        server.healthy = False
        wait_for(lambda: not state()[0], timeout=10, what="vllm-0 down")
        server.block_size, server.healthy = 16, True
        wait_for(lambda: "blocks of 16 tokens" in state()[1], timeout=10, what="the block size refused")
        assert state()[0] is False
        assert "blocks of 16 tokens" in fetch(f"{router.url}/health").json()["instances"]["vllm-0"]["refused"]
        server.model = "other"  # still refused for its blocks until these are right again
        server.block_size = BLOCK
        wait_for(lambda: "serving model 'other'" in state()[1], timeout=10, what="the model refused")
        assert state()[0] is False
        server.max_model_len, server.model = 64, MODEL
        wait_for(lambda: state() == (True, ""), timeout=10, what="vllm-0 up again")
        assert router.read(lambda r: r.fleet.instances["vllm-0"].info.max_model_len) == 64
        assert fetch(f"{router.url}/v1/models").json()["data"][0]["max_model_len"] == 64
        status, _, text = post(
            f"{router.url}/v1/completions", {"model": MODEL, "prompt": list(range(60)), "max_tokens": 8}
        )
        assert status == 400 and "maximum context" in text and not server.received
    lines = [r.getMessage() for r in caplog.records]
    assert sum("blocks of 16 tokens" in line for line in lines) == 1, lines
    assert sum("serving model 'other'" in line for line in lines) == 1, lines
    assert any("max_model_len 2048 -> 64" in line for line in lines), lines


def test_responses_are_counted_by_status(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """The router's own 400s, a server's 400, a whole answer and a stream each count once under their status;
    a stream's first token is in the TTFT histogram; /v1/models wants the API key too."""
    key = {"Authorization": "Bearer secret"}
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir, api_key="secret")) as router:
        assert fetch(f"{router.url}/v1/models").status_code == 401
        assert fetch(f"{router.url}/v1/models", headers=key).json()["data"][0]["id"] == MODEL
        assert post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": ""}, key)[0] == 400
        assert sample(router, "mooncake:http_responses_total", {"status": "400"}) == 1
        body = {"model": MODEL, "prompt": "bada", "max_tokens": 2}
        assert post(f"{router.url}/v1/completions", body, key)[0] == 200
        assert post(f"{router.url}/v1/completions", {**body, "stream": True}, key)[0] == 200
        assert sample(router, "mooncake:http_responses_total", {"status": "200"}) == 2
        counts = [sample(router, "mooncake:time_to_first_token_seconds_count", {"engine": e}) for e in ENGINES]
        assert sum(counts) == 1
        for fake in fakes:
            fake.status = 400  # the server's own refusal: passed on, and the request ends
        status, headers, _ = post(f"{router.url}/v1/completions", body, key)
        assert status == 400 and headers[PREFILL_HEADER] in ENGINES
        assert sample(router, "mooncake:http_responses_total", {"status": "400"}) == 2
        assert router.read(lambda r: len(r.fleet.flights)) == 0
        assert router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [True, True]


def test_the_metrics_show_a_request_waiting_for_its_first_token(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """While a request waits for its first token its server's `num_requests_waiting` (the router's queue there)
    is 1; once it is answered, 0."""
    for fake in fakes:
        fake.seconds_per_token = 0.05  # some twenty tokens: a prefill of about a second
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir)) as router:

        def waiting() -> float:
            fetch(f"{router.url}/metrics")  # a scrape sets the engines' gauges
            return sum(sample(router, "mooncake:num_requests_waiting", {"engine": e}) for e in ENGINES)

        body = {"model": MODEL, "prompt": words(10, seed=4), "max_tokens": 2}
        answer: list[int] = []
        client = threading.Thread(target=lambda: answer.append(post(f"{router.url}/v1/completions", body)[0]))
        client.start()
        try:
            wait_for(lambda: waiting() == 1 or not client.is_alive(), timeout=10, what="the request queued")
            assert client.is_alive(), "answered before it was seen waiting"
        finally:
            client.join(30)
        assert answer == [200] and waiting() == 0


def test_a_whole_answer_teaches_the_model_only_when_it_is_one_token(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """A whole answer of several tokens says nothing about its prefill; one of a single token came at its
    first token, so it times the prefill (the servers idle, no calibration: the model starts empty)."""
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir)) as router:
        body = {"model": MODEL, "prompt": words(20, seed=1), "max_tokens": 5}
        assert post(f"{router.url}/v1/completions", body)[0] == 200
        assert router.read(lambda r: len(r.fleet.prefill_model.samples)) == 0
        assert post(f"{router.url}/v1/completions", {**body, "max_tokens": 1})[0] == 200
        assert router.read(lambda r: len(r.fleet.prefill_model.samples)) == 1


def test_chats_batches_and_hidden_usage(tokenizer_dir: Path) -> None:
    """A chat goes to the servers' chat path, an empty one is a 400; a batch of prompts is routed by its first
    and passed on whole; a hidden usage chunk leaves no blank line behind (each event ends in one)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    servers = [ConfiguredVllm(tokenizer), ConfiguredVllm(tokenizer)]
    with serving(*servers), BackgroundRouter(proxy_config(list(servers), tokenizer_dir)) as router:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "bada"}], "max_tokens": 2}
        assert post(f"{router.url}/v1/chat/completions", chat)[0] == 200
        assert [p for s in servers for p in s.paths] == ["/v1/chat/completions"]
        status, _, text = post(f"{router.url}/v1/chat/completions", {**chat, "messages": []})
        assert status == 400 and json.loads(text)["error"]["param"] == "messages"
        batch = {"model": MODEL, "prompt": ["bada keli", "mo"], "max_tokens": 2}
        assert post(f"{router.url}/v1/completions", batch)[0] == 200
        assert [s.received[-1]["prompt"] for s in servers if s.paths[-1:] == ["/v1/completions"]] == [batch["prompt"]]
        status, _, text = post(f"{router.url}/v1/completions", {**batch, "prompt": "bada", "stream": True})
        events = [event for event in text.split("\n\n") if event]
        assert status == 200 and text == "".join(f"{event}\n\n" for event in events) and len(events) == 3


def test_a_failing_prefill_server_is_routed_around(tokenizer_dir: Path) -> None:
    """A prefill server that answers 503 is marked down and the request prefilled on the other one; a prefill
    server's 400 is the client's answer, counted under its status."""
    tokenizer = load_tokenizer(tokenizer_dir)
    servers = [FakeVllm(tokenizer), FakeVllm(tokenizer), FakeVllm(tokenizer)]
    with serving(*servers):
        servers[0].status = 503
        config = proxy_config(list(servers), tokenizer_dir, roles=("prefill", "prefill", "decode"))
        with BackgroundRouter(config) as router:
            for i in range(2):
                body = {"model": MODEL, "prompt": words(30, seed=i), "max_tokens": 2}
                status, headers, _ = post(f"{router.url}/v1/completions", body)
                assert status == 200 and (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("vllm-1", "vllm-2")
            assert router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [False, True, True]
            servers[1].status = 400  # its own refusal: the client's answer, counted, and the request ends
            status, _, _ = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada", "max_tokens": 2})
            assert status == 400 and sample(router, "mooncake:http_responses_total", {"status": "400"}) == 1
            assert router.read(lambda r: len(r.fleet.flights)) == 0


def test_a_decode_server_that_fails_still_lets_the_prefill_teach(tokenizer_dir: Path) -> None:
    """The prefill server answered (its time is a prefill's) and then the decode server failed: the request
    ends, the decode server is down, and the prefill still teaches the model."""
    tokenizer = load_tokenizer(tokenizer_dir)
    servers = [FakeVllm(tokenizer), FakeVllm(tokenizer)]
    with serving(*servers):
        servers[1].status = 503
        config = proxy_config(list(servers), tokenizer_dir, roles=("prefill", "decode"))
        with BackgroundRouter(config) as router:
            status, _, _ = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada", "max_tokens": 2})
            assert status == 503  # its decode server down, no other
            assert router.read(lambda r: [x.up for x in r.fleet.instances.values()]) == [True, False]
            assert router.read(lambda r: (len(r.fleet.flights), len(r.fleet.prefill_model.samples))) == (0, 1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_over_its_timeout_is_a_504_and_its_server_stays_up(
    fakes: list[FakeVllm], tokenizer_dir: Path, stream: bool
) -> None:
    """`request_timeout_s` is "the longest a request may take end to end (504 after)": a server slower than
    that is busy, not down; the client gets a 504 and the server keeps its place (and its cache in the index)."""
    for fake in fakes:
        fake.seconds_per_token = 0.05  # a prompt of twenty-odd tokens: over a second
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir, request_timeout_s=0.3)) as router:
        body = {"model": MODEL, "prompt": words(10, seed=2), "max_tokens": 2, "stream": stream}
        status, _, text = post(f"{router.url}/v1/completions", body)
        up = router.read(lambda r: [x.up for x in r.fleet.instances.values()])
        flights = router.read(lambda r: len(r.fleet.flights))
    assert (status, up, flights) == (504, [True, True], 0), text
    assert "request_timeout_s" in text


def test_a_disaggregated_pairs_two_steps_share_one_timeout(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """`request_timeout_s` is end to end: a prefill step that takes most of it leaves the decode step the rest,
    not a limit of its own, so the stream ends with the timeout event though each step alone is within it."""
    prefill, decode = fakes
    prefill.seconds_per_token = 0.1  # a prompt of 6 tokens: 0.6 s
    decode.seconds_between_tokens = 0.1  # 20 tokens: about 2 s
    config = proxy_config(fakes, tokenizer_dir, roles=("prefill", "decode"), request_timeout_s=2.0)
    with BackgroundRouter(config) as router:
        body = {"model": MODEL, "prompt": words(2, seed=5), "max_tokens": 20, "stream": True}
        status, headers, text = post(f"{router.url}/v1/completions", body)
        up = router.read(lambda r: [x.up for x in r.fleet.instances.values()])
    assert headers[PREFILL_HEADER] != headers[DECODE_HEADER]  # the pair served it
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data: {")]
    assert (status, up) == (200, [True, True]) and events[-1]["error"]["type"] == "timeout_error", text


def test_a_stream_over_its_timeout_ends_with_a_timeout_event_and_its_server_stays_up(
    fakes: list[FakeVllm], tokenizer_dir: Path
) -> None:
    """Past the first token a stream cannot turn into a 504: it ends with an error event saying the request ran
    past request_timeout_s (a timeout, not a server failure), the flight ends, and the server stays up."""
    for fake in fakes:
        fake.seconds_between_tokens = 0.1  # 30 tokens: 3 s, against a 0.5 s limit
    with BackgroundRouter(proxy_config(fakes, tokenizer_dir, request_timeout_s=0.5)) as router:
        body = {"model": MODEL, "prompt": words(3, seed=4), "max_tokens": 30, "stream": True}
        status, _, text = post(f"{router.url}/v1/completions", body)
        up = router.read(lambda r: [x.up for x in r.fleet.instances.values()])
        flights = router.read(lambda r: len(r.fleet.flights))
    assert (status, up, flights) == (200, [True, True], 0), text
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == " x" and len(events) < 30
    assert events[-1]["error"]["type"] == "timeout_error" and "request_timeout_s" in events[-1]["error"]["message"]
    # vLLM's shape of a failed stream's end (`create_streaming_error_response`): param and code, then [DONE].
    assert events[-1]["error"]["param"] is None and events[-1]["error"]["code"] == 504
    assert text.endswith("data: [DONE]\n\n"), text


# ---------------------------------------------------------------------------------------------- servers


def stand_in(tmp_path: Path, body: str) -> Path:
    """An executable that takes the place of vLLM's python (its arguments ignored)."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    """`VllmFleet.start` notices a server that exited (without waiting its whole timeout) and raises with its log."""
    python = stand_in(tmp_path, 'echo "no vLLM here" >&2\nexit 3')
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited:\nno vLLM here"):
        VllmFleet.start(python=python, model=tmp_path, count=1, log_dir=tmp_path / "logs", timeout_s=20)
    assert time.monotonic() - started < 15


def test_a_server_never_healthy_is_stopped_with_its_process_group(tmp_path: Path) -> None:
    """A server that never answers /health within the timeout is stopped, its whole process group with it
    (it runs in a session of its own)."""
    pid_file = tmp_path / "pid"
    python = stand_in(tmp_path, f'echo $$ > "{pid_file}"\nexec sleep 60')
    pid = 0
    try:
        with pytest.raises(RuntimeError, match=r"not healthy in 0.5 s"):
            VllmFleet.start(python=python, model=tmp_path, count=1, log_dir=tmp_path / "logs", timeout_s=0.5)
        pid = int(pid_file.read_text())
        assert not is_running(pid)
    finally:
        if pid and is_running(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_instances_toml_is_a_router_config(tmp_path: Path) -> None:
    """The `[[instances]]` tables of started servers parse as a router's, each `both` unless told."""
    process = subprocess.Popen(["true"])
    process.wait(10)
    servers = [
        VllmServer(process, port=p, events_port=p + 1, replay_port=p + 2, log=tmp_path, core=0) for p in (9000, 9010)
    ]
    fleet = VllmFleet(servers, tmp_path, BLOCK)
    (tmp_path / "tokenizer.json").write_text("{}")
    for roles, want in ((None, ["both", "both"]), (["prefill", "decode"], ["prefill", "decode"])):
        text = f'[router]\ntokenizer = "{tmp_path}"\n' + fleet.instances_toml(roles=roles)
        config = parse_router_config(tomllib.loads(text), "generated")
        assert [i.role for i in config.instances] == want
        first = config.instances[0]
        assert (first.url, first.kv_events, first.replay) == (
            "http://127.0.0.1:9000",
            "tcp://127.0.0.1:9001",
            "tcp://127.0.0.1:9002",
        )


def test_the_example_router_config_parses_as_documented(tmp_path: Path) -> None:
    """examples/configs/router.toml, with its tokenizer pointed at a directory that exists, is a valid router
    config: two servers on this host, each with its own events and replay endpoints, both roles."""
    path = Path(__file__).resolve().parents[2] / "examples" / "configs" / "router.toml"
    data = tomllib.loads(path.read_text())
    (tmp_path / "tokenizer.json").write_text("{}")
    data["router"]["tokenizer"] = str(tmp_path)
    config = parse_router_config(data, str(path))
    assert config.router.block_size == 32 and [i.role for i in config.instances] == ["both", "both"]
    endpoints = [(i.url, i.kv_events, i.replay) for i in config.instances]
    assert len({endpoint for triple in endpoints for endpoint in triple}) == 6  # no two servers share one


def test_close_ends_the_routers_background_tasks_at_once(fakes: list[FakeVllm], tokenizer_dir: Path) -> None:
    """The router's own loops (KV events, health) run until cancelled: `close` cancels them and returns at once,
    instead of waiting for loops that never end (BackgroundRouter's 30 s limit would be all that ended it)."""
    background = BackgroundRouter(proxy_config(fakes, tokenizer_dir))
    try:
        tasks = background.read(lambda r: list(r._tasks))
        assert tasks, "the router runs background loops"
        started = time.monotonic()
        asyncio.run_coroutine_threadsafe(background.router.close(), background.loop).result(10.0)
        assert time.monotonic() - started < 5.0
        assert background.read(lambda r: (r._tasks, all(task.done() for task in tasks))) == ([], True)
    finally:
        background.close()  # a second close finds nothing left to stop


def test_a_scored_prompt_is_planned_as_computed_whole_as_vllm_computes_it(tmp_path: Path) -> None:
    """vLLM reads no cached prefix for a request that asks for prompt log-probabilities
    (`SamplingParams.skip_reading_prefix_cache`): the router plans one as computed whole (no prefix, the whole
    prompt's prefill time), where the same prompt without them reuses the cached document."""
    fleet = Fleet(fleet_config(tmp_path), [INFO, INFO])
    document = list(range(1, 301))
    stored(fleet, "vllm-1", document, 0)
    _, reused = fleet.schedule([*document, 7], 4, now=0.0)
    _, scored = fleet.schedule([*document, 8], 4, now=0.0, reuses_prefix=False)
    assert reused.prefix_tokens == 9 * BLOCK and scored.prefix_tokens == 0


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        ({}, False, None),
        ({"prompt_logprobs": 2}, False, 2),
        ({"prompt_logprobs": 0, "echo": True, "logprobs": 3}, False, 0),  # the body's own first
        ({"echo": True}, False, None),  # a completion's logprobs: None unless given
        ({"echo": True, "logprobs": 3}, False, 3),
        ({"logprobs": 3}, False, None),  # without echo: the output's only
        ({"echo": True}, True, 0),  # a chat's top_logprobs: 0 unless given
        ({"echo": True, "top_logprobs": 5}, True, 5),
        ({"echo": True, "top_logprobs": None}, True, None),
        ({"echo": False, "top_logprobs": 5}, True, None),
        ({"echo": "false"}, True, None),  # read as vLLM's pydantic reads a bool: "false", "off", "no" are False
        ({"echo": "off", "logprobs": 2}, False, None),
        ({"echo": "yes", "logprobs": 2}, False, 2),
        ({"echo": "maybe", "logprobs": 2}, False, None),  # no bool at all: vLLM refuses it, planned as none
    ],
)
def test_the_prompt_logprobs_vllm_is_asked_for(body: dict[str, Any], chat: bool, expected: int | None) -> None:
    """vLLM's `to_sampling_params` (completion/protocol.py, chat_completion/protocol.py): `prompt_logprobs`, else
    with `echo` a completion's `logprobs` or a chat's `top_logprobs` (default 0); a scored prompt reuses no prefix."""
    assert vllm_prompt_logprobs(body, chat=chat) == expected
    assert prefix_reusable(expected) is (expected is None)
