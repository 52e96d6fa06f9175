"""The vLLM router's config, probe parsing, online prefill model and fleet, without a server.

Example tests for the config's one-line errors; properties of `scrape` (sums over engines, whatever the
text around) and of `OnlinePrefillModel` (it recovers a model it observes; estimates never negative); and a
`RuleBasedStateMachine` that drives a `Fleet` through arrivals, first tokens, ends, failures, servers going
down and up, and servers' caches storing prompts, against a model of what must be in flight where: every
accepted request is in flight until exactly one end; a coupled server decodes what it prefilled; nothing is
routed to a server that is down; a request sharing a cached prefix goes where the prefix is when that
server is idle.
"""

from __future__ import annotations

import math
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vllm_fleet.config import RouterConfig, parse_router_config
from vllm_fleet.fleet import Fleet, Flight
from vllm_fleet.online import OnlinePrefillModel
from vllm_fleet.upstream import InstanceInfo, InstanceState, scrape

from mooncake.cache.events import BlockStored
from mooncake.errors import ConfigError
from mooncake.sched import Reason
from mooncake.types import InstanceId, Tier

BLOCK = 32
INFO = InstanceInfo(model="tiny", max_model_len=2048, block_size=BLOCK, prefix_caching=True, kv_capacity_tokens=65_536)


def router_config(tmp_path: Any, *, roles: tuple[str, ...] = ("both", "both"), **router: Any) -> RouterConfig:
    (tmp_path / "tokenizer.json").write_text("{}")
    settings_ = {"block_size": BLOCK, "tokenizer": str(tmp_path), "ttft_slo_s": 5.0, **router}
    data: dict[str, Any] = {
        "router": settings_,
        "instances": [
            {"url": f"http://127.0.0.1:{8100 + i}", "kv_events": f"tcp://127.0.0.1:{5600 + i}", "role": role}
            for i, role in enumerate(roles)
        ],
    }
    return parse_router_config(data, "router.toml")


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[router]\nport = 70000\n", r"router.toml: \[router\] port = 70000: must be <= 65535"),
        ("[router]\npolicy = 'fastest'\n", r"\[router\] policy = 'fastest': must be one of random, "),
        ("[router]\nblock = 32\n", r"\[router\] block = 32: unknown key \(known: host, port,"),
        ("[route]\n", r"unknown section \[route\]"),
        ("[[instances]]\nurl = 'ftp://x'\nkv_events = 'tcp://127.0.0.1:1'\n", r"\[\[instances\]\] 0 url = 'ftp://x'"),
        (
            "[[instances]]\nurl = 'http://x:1'\nkv_events = '127.0.0.1:1'\n",
            r"kv_events = '127.0.0.1:1': must be a ZeroMQ",
        ),
        ("[[instances]]\nkv_events = 'tcp://127.0.0.1:1'\n", r"\[\[instances\]\] 0: url is required"),
        # The router appends its paths to the url: a query or fragment would swallow them; port 0 is no server.
        *(
            (
                f"[[instances]]\nurl = '{url}'\nkv_events = 'tcp://127.0.0.1:1'\n",
                rf"\[\[instances\]\] 0 url = '{re.escape(url)}': {message}",
            )
            for url, message in [
                ("http://x:8000?token=1", "must be the server's root"),
                ("http://x:8000/#frag", "must be the server's root"),
                ("http://x:8000?", "must be the server's root"),
                ("http://u:p@x:8000", "must be the server's root"),
                ("http://x:0", "has port 0, which names no server"),
            ]
        ),
        # ZeroMQ binds port 0 at random and 99999 as 34463 (modulo 65536): neither is the port named.
        *(
            (
                f"[[instances]]\nurl = 'http://x:1'\n{key} = 'tcp://{host}:{port}'\n",
                rf"\[\[instances\]\] 0 {key} = 'tcp://{host}:{port}': has port {port}: must be in 1\.\.65535",
            )
            for key, host, port in [
                ("kv_events", "127.0.0.1", "99999"),
                ("kv_events", "0.0.0.0", "0"),
                ("replay", "10.0.0.5", "70000"),
                ("replay", "10.0.0.5", "00000"),
            ]
        ),
        ("[[instances]]\nurl = 'http://x:1'\nkv_events = 'tcp://a:1'\nrole = 'prefill'\n", "come in pairs"),
        (
            "[[instances]]\nurl = 'http://x:1'\nkv_events = 'tcp://a:1'\n[[instances]]\nurl = 'http://x:1/'\n"
            "kv_events = 'tcp://a:2'\n",
            r"\[\[instances\]\] 1 url = 'http://x:1': the same as instance 0's",
        ),
        ("[router]\n", "no \\[\\[instances\\]\\]"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key_and_value(tmp_path: Any, text: str, message: str) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    data = tomllib.loads(text)
    data.setdefault("router", {}).setdefault("tokenizer", str(tmp_path))
    with pytest.raises(ConfigError, match=message) as caught:
        parse_router_config(data, "router.toml")
    assert "\n" not in str(caught.value)


def test_the_policy_may_name_a_router_file(tmp_path: Any) -> None:
    """`[router] policy` takes FILE.py:FACTORY as the cluster's `[policy] router` and `--router` do (one check,
    `serving.registry.router_problem`); a file without the factory is refused naming key and value."""
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "mine.py").write_text("from mooncake.sched.router import LoadBalancingRouter as Mine\n")
    instances = [{"url": "http://x:1", "kv_events": "tcp://127.0.0.1:1"}]
    modules, path = set(sys.modules), list(sys.path)
    try:
        for name in ("Mine", "Theirs"):
            policy = f"{tmp_path / 'mine.py'}:{name}"
            data = {"router": {"tokenizer": str(tmp_path), "policy": policy}, "instances": instances}
            if name == "Mine":
                assert parse_router_config(data, "router.toml").router.policy == policy
            else:
                with pytest.raises(ConfigError, match=re.escape(f"policy = {policy!r}: ") + ".*no callable 'Theirs'"):
                    parse_router_config(data, "router.toml")
    finally:
        for added in set(sys.modules) - modules:
            del sys.modules[added]
        sys.path[:] = path


def test_the_tokenizer_must_be_a_directory_holding_one(tmp_path: Any) -> None:
    data = {"router": {"tokenizer": str(tmp_path)}, "instances": [{"url": "http://x:1", "kv_events": "tcp://a:1"}]}
    with pytest.raises(ConfigError, match=r"tokenizer = .*: holds no tokenizer"):
        parse_router_config(data, "router.toml")
    data["router"] = {}
    with pytest.raises(ConfigError, match=r"\[router\]: tokenizer is required"):
        parse_router_config(data, "router.toml")


# ---------------------------------------------------------------------------------------------- scrape


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.floats(0, 1e6)), min_size=0, max_size=4),
    st.booleans(),
)
def test_scrape_sums_each_counter_over_the_engines(engines: list[tuple[int, int, float]], noise: bool) -> None:
    lines = ["# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge"]
    for number, (running, waiting, hits) in enumerate(engines):
        labels = f'{{engine="{number}",model_name="tiny"}}'
        lines += [
            f"vllm:num_requests_running{labels} {running}.0",
            f"vllm:num_requests_waiting{labels} {waiting}.0",
            f"vllm:prefix_cache_hits_total{labels} {hits!r}",
            f"vllm:prefix_cache_hits_created{labels} 1.7e9",
        ]
        if noise:
            lines += [f"vllm:num_requests_runningx{labels} 99", "garbage line", f"vllm:kv_cache_usage_perc{labels} NaN"]
    state = scrape("\n".join(lines))
    assert state.running == sum(e[0] for e in engines) and state.waiting == sum(e[1] for e in engines)
    assert state.prefix_hits == pytest.approx(sum(e[2] for e in engines))
    assert state.kv_usage == 0.0


# ---------------------------------------------------------------------------------------------- online model


@settings(deadline=None)
@given(
    st.tuples(st.floats(1e-3, 0.1), st.floats(1e-6, 1e-3), st.floats(0, 1e-8)),
    st.lists(st.tuples(st.integers(16, 4000), st.floats(0, 0.9)), min_size=12, max_size=60, unique_by=lambda s: s[0]),
)
def test_the_online_model_learns_the_prefill_it_observes(
    truth: tuple[float, float, float], prompts: list[tuple[int, float]]
) -> None:
    c0, c1, c2 = truth
    model = OnlinePrefillModel(refit_every=4)
    for tokens, share in prompts:
        prefix = int(tokens * share)
        model.observe(tokens, prefix, c0 + c1 * (tokens - prefix) + c2 * (tokens * tokens - prefix * prefix))
    assert model.num_fits >= 1
    for tokens, prefix in ((100, 0), (2000, 1000), (3000, 0)):
        want = c0 + c1 * (tokens - prefix) + c2 * (tokens * tokens - prefix * prefix)
        assert model.prefill_s(tokens, prefix) == pytest.approx(want, rel=1e-3)
        assert model.prefill_s(tokens, tokens) == 0.0


def test_the_online_model_ignores_what_it_cannot_fit() -> None:
    model = OnlinePrefillModel(refit_every=1)
    before = model.current
    for _ in range(5):
        model.observe(100, 100, 0.5)  # nothing uncached
        model.observe(100, 0, 0.0)  # no time
    assert not model.samples and model.current == before
    for _ in range(5):
        model.observe(100, 0, 0.01)  # no variety: the fit fails, the prior stays
    assert model.current == before and model.num_fits == 0
    with pytest.raises(ConfigError):
        OnlinePrefillModel(window=2)


# ---------------------------------------------------------------------------------------------- fleet


def stored(fleet: Fleet, instance: str, tokens: list[int], seq: int, epoch: int = 0) -> None:
    keys = fleet.hasher.block_keys(tokens)[: len(tokens) // BLOCK]
    fleet.conductor.apply_cache_event(
        BlockStored(source=InstanceId(instance), seq=seq, keys=keys, tier=Tier.VRAM, epoch=epoch)
    )


def test_a_prompt_goes_to_the_server_holding_its_prefix_and_decodes_there(tmp_path: Any) -> None:
    fleet = Fleet(router_config(tmp_path), [INFO, INFO])
    document = list(range(1, 1001))
    stored(fleet, "vllm-1", document, 0)
    _, decision = fleet.schedule([*document, 5, 6, 7], 16, now=0.0)
    assert decision.accepted and decision.prefill_instance == decision.decode_instance == "vllm-1"
    assert decision.prefix_tokens == 992  # 31 whole blocks
    flight = fleet.flights[decision.request_id]
    fleet.first_token(flight, 0.05)
    fleet.finished(flight, 0.2, generated_tokens=16)
    assert not fleet.flights and fleet.prefill_model.samples[-1].seconds == pytest.approx(0.05)
    fleet.conductor.check_invariants()


def test_the_prefill_model_learns_the_prefix_the_server_found_not_the_one_expected(tmp_path: Any) -> None:
    """A timed prefill is learnt from once: with the cached prefix its server's usage reports (at the stream's
    end, or with a disaggregated prefill's answer), else, for a server that never says, the router's expectation."""
    fleet = Fleet(router_config(tmp_path), [INFO, INFO])
    document = list(range(1, 1001))
    stored(fleet, "vllm-1", document, 0)
    for reported, learnt in ((320, 320), (None, 992)):
        _, decision = fleet.schedule([*document, 5, 6, 7], 16, now=0.0)
        assert decision.prefix_tokens == 992  # what the router expects
        flight = fleet.flights[decision.request_id]
        fleet.first_token(flight, 0.05)
        count = len(fleet.prefill_model.samples)
        fleet.finished(flight, 0.2, generated_tokens=16, cached_tokens=reported)  # the usage chunk, at the end
        assert len(fleet.prefill_model.samples) == count + 1
        assert fleet.prefill_model.samples[-1].prefix_tokens == learnt
    _, decision = fleet.schedule([*document, 8, 9], 16, now=1.0)
    flight = fleet.flights[decision.request_id]
    fleet.prefilled(flight, 1.05, cached_tokens=640)  # a disaggregated prefill's one-token answer says it
    assert fleet.prefill_model.samples[-1].prefix_tokens == 640
    count = len(fleet.prefill_model.samples)
    fleet.finished(flight, 1.2, generated_tokens=16, cached_tokens=1000)  # the decode server's own count: not it
    assert len(fleet.prefill_model.samples) == count and flight.cached_tokens == 640
    fleet.conductor.check_invariants()


def test_a_prompt_over_a_servers_context_is_refused_before_it_is_sent(tmp_path: Any) -> None:
    fleet = Fleet(router_config(tmp_path), [INFO, INFO])
    _, decision = fleet.schedule(list(range(2000)), 100, now=0.0)
    assert not decision.accepted and decision.reason is Reason.CONTEXT_TOO_LONG and not fleet.flights


def test_a_request_answered_while_the_count_was_asked_for_is_not_another_clients(tmp_path: Any) -> None:
    """The server counted the router's request as waiting, and the router had its answer before the count
    came back: that request is the router's own, so there is no backlog. A waiting request the router never
    had is another client's: a backlog of one typical prefill."""
    fleet = Fleet(router_config(tmp_path), [INFO, INFO])
    _, decision = fleet.schedule(list(range(1, 301)), 4, now=0.0)
    assert decision.prefill_instance is not None
    instance = decision.prefill_instance
    asked = fleet.unprefilled(instance)
    assert asked == {decision.request_id}
    fleet.first_token(fleet.flights[decision.request_id], 0.1)  # answered while the count was on its way
    assert fleet.unprefilled(instance) == frozenset()
    counted = InstanceState(running=0, waiting=1)
    assert fleet.reconcile(instance, counted, 0.2, asked=asked) == 0.0
    assert fleet.reconcile(instance, counted, 0.3) == pytest.approx(fleet.prefill_model.prefill_s(300, 0))


def test_a_failed_start_closes_the_subscribers_it_bound(tmp_path: Any) -> None:
    """The second server's events endpoint is taken: the start fails naming it, and the first server's
    subscriber, already bound, is closed (its port free again, its ZeroMQ context terminated: one left to
    the garbage collector once hung the test run in `Context.term`)."""
    zmq = pytest.importorskip("zmq")
    from vllm_fleet.proxy import _subscriber
    from vllm_fleet.servers import free_port

    first, taken = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    try:
        squatter = context.socket(zmq.PUB)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.bind(taken)
        config = router_config(tmp_path)
        instances = tuple(
            attrs.evolve(section, kv_events=endpoint)
            for section, endpoint in zip(config.instances, (first, taken), strict=True)
        )
        made: list[Any] = []

        def subscribe(section: Any, decoder: Any, index: Any) -> Any:
            made.append(_subscriber(section, decoder, index))
            return made[-1]

        with pytest.raises(ConfigError, match=f"kv_events = '{taken}' cannot be bound"):
            Fleet(attrs.evolve(config, instances=instances), [INFO, INFO], subscribe=subscribe)
        assert len(made) == 1 and made[0].closed
        again = context.socket(zmq.SUB)
        again.setsockopt(zmq.LINGER, 0)
        again.bind(first)  # the failed start's subscriber let go of it
    finally:
        context.destroy(linger=0)  # closes its sockets first: a bare term() would wait for them forever


class FleetMachine(RuleBasedStateMachine):
    """A fleet of two coupled servers under random traffic, against a model of flights and server states."""

    @initialize(slo=st.sampled_from([0.05, 5.0]))
    def start(self, slo: float) -> None:
        import tempfile

        self.folder = tempfile.TemporaryDirectory()
        from pathlib import Path

        self.fleet = Fleet(router_config(Path(self.folder.name), ttft_slo_s=slo), [INFO, INFO])
        self.now = 0.0
        self.up = {"vllm-0": True, "vllm-1": True}
        self.live: dict[str, Flight] = {}
        self.seq = {"vllm-0": 0, "vllm-1": 0}
        self.epoch = {"vllm-0": 0, "vllm-1": 0}
        self.documents = [list(range(1000 * d + 1, 1000 * d + 1 + 320)) for d in range(3)]

    def teardown(self) -> None:
        if hasattr(self, "folder"):
            self.folder.cleanup()

    @rule(document=st.integers(0, 2), tail=st.integers(1, 40), max_tokens=st.integers(1, 64))
    def arrive(self, document: int, tail: int, max_tokens: int) -> None:
        self.now += 0.01
        tokens = [*self.documents[document], *range(tail)]
        conductor = self.fleet.conductor
        idle = all(not view.queue for view in conductor.prefill_views)
        up = [InstanceId(i) for i, is_up in sorted(self.up.items()) if is_up]
        held = conductor.index.prefix_lengths(self.fleet.hasher.block_keys(tokens), up) if up else []
        _, decision = self.fleet.schedule(tokens, max_tokens, self.now)
        if decision.accepted and idle:  # nothing queued anywhere: the longest cached prefix wins
            assert decision.prefix_tokens == min(int(max(held)) * BLOCK, len(tokens) - 1)
        if not decision.accepted:
            assert decision.reason is not None
            if not any(self.up.values()):
                assert decision.reason is Reason.NO_PREFILL_INSTANCE
            return
        assert decision.prefill_instance == decision.decode_instance  # coupled
        assert self.up[decision.prefill_instance]
        self.live[decision.request_id] = self.fleet.flights[decision.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        flight = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.now += 0.01
        self.fleet.first_token(flight, self.now)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), outcome=st.sampled_from(["finished", "client_gone", "failed"]))
    def end(self, data: st.DataObject, outcome: str) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        flight = self.live.pop(request_id)
        self.now += 0.01
        if outcome == "finished":
            self.fleet.finished(flight, self.now, generated_tokens=3)
        else:
            self.fleet.failed(flight, self.now, Reason.CLIENT_GONE if outcome == "client_gone" else Reason.FAILED)
        assert request_id not in self.fleet.flights
        self.fleet.finished(flight, self.now, None)  # a second end is ignored

    @rule(instance=st.sampled_from(["vllm-0", "vllm-1"]), up=st.booleans())
    def server(self, instance: str, up: bool) -> None:
        self.now += 0.01
        ends = self.fleet.set_up(InstanceId(instance), up, self.now)
        if not up:
            for end in ends:
                assert self.live.pop(end.request_id).instance_id == instance
            assert not any(f.instance_id == instance for f in self.live.values())
        else:
            assert ends == ()
            if not self.up[instance]:  # back: its events are a new epoch (its decoder is put on one)
                self.epoch[instance] += 1
                self.seq[instance] = 0
        self.up[instance] = up

    @precondition(lambda self: any(self.up.values()))
    @rule(instance=st.sampled_from(["vllm-0", "vllm-1"]), document=st.integers(0, 2))
    def cache_stores(self, instance: str, document: int) -> None:
        if not self.up[instance]:
            return
        stored(self.fleet, instance, self.documents[document], self.seq[instance], self.epoch[instance])
        self.seq[instance] += 1

    @invariant()
    def flights_are_the_models(self) -> None:
        if hasattr(self, "fleet"):
            assert set(self.fleet.flights) == set(self.live)
            assert {i: inst.up for i, inst in self.fleet.instances.items()} == self.up
            self.fleet.conductor.check_invariants()
            assert set(self.fleet.conductor.in_flight) == set(self.live)

    @invariant()
    def estimates_are_finite(self) -> None:
        if hasattr(self, "fleet"):
            assert math.isfinite(self.fleet.prefill_model.prefill_s(1000, 0))


TestFleetMachine = FleetMachine.TestCase
TestFleetMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_an_events_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """The port a server's event publisher connects to before the router binds it is drawn below the kernel's
    ephemeral range, where no connection's source port (one of the publisher's own retries, connected to itself
    by TCP's simultaneous open) can take it meanwhile; it is free to bind."""
    import socket

    from vllm_fleet.servers import listen_port

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    if low <= 11_000:
        pytest.skip(f"this host's ephemeral range starts at {low}: no room below it, the kernel picks")
    for _ in range(20):
        port = listen_port()
        assert 10_000 <= port < low
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_clients_full_report_mode_leaves_no_evicted_block_believed_cached(tmp_path: Any) -> None:
    """A client may ask vLLM for `kv_cache_report_mode: "full"` (`vllm_xargs`): vLLM then re-announces the cached
    blocks each of its requests reuses, from block 0 with no parent. Those are no new copies: once vLLM evicts the
    one copy it holds (one BlockRemoved), the router's index holds the blocks no more."""
    pytest.importorskip("msgpack", reason="msgpack (the kv-events extra) is not installed")
    from tests.cache.test_vllm_events import BLOCK as WIRE_BLOCK
    from tests.cache.test_vllm_events import payload, removed_wire
    from tests.cache.test_vllm_events_copies import gpu_stored, maybe_convert_block_hash, vllm_hashes

    decoders: list[Any] = []
    fleet = Fleet(
        router_config(tmp_path, block_size=WIRE_BLOCK),
        [attrs.evolve(INFO, block_size=WIRE_BLOCK)] * 2,
        subscribe=lambda _section, decoder, _index: decoders.append(decoder),
    )
    decoder = decoders[0]
    tokens = list(range(100, 100 + 3 * WIRE_BLOCK))

    def send(*events: dict[str, Any]) -> None:
        batch = decoder.decode(payload(list(events)), seq=decoder.expected_seq)
        for event in batch:
            fleet.conductor.apply_cache_event(event)

    send(gpu_stored(tokens, 0, 3))  # the first request computes three blocks
    send(gpu_stored(tokens, 0, 3, parent=False))  # a second, "full" mode, reuses them: re-announced
    send(gpu_stored(tokens, 0, 3, parent=False))  # and a third
    assert fleet.cached_blocks(InstanceId("vllm-0")) == 3
    send(removed_wire([maybe_convert_block_hash(h) for h in vllm_hashes(tokens)]))  # vLLM evicts its one copy
    assert fleet.cached_blocks(InstanceId("vllm-0")) == 0
    fleet.conductor.check_invariants()
