"""The vLLM router started while some of its servers cannot be reached yet (one still loading its model, one
restarting), against stand-in servers.

What each test proves: a server that cannot be reached at start-up (nothing listening, an answer that is not
HTTP, a 503 in front of it) is added down, with a warning naming it: requests go to the servers that answered,
calibration times only them, `/health` and `/metrics` show it down; once its health checks pass it is probed,
its own limits taken, and marked up, and requests reach it. One that comes up serving another model stays down,
the reason logged once and shown in `/health`. No server answering is a ConfigError naming them all, and a server
that answers what the router cannot use is one still, though another is unreachable. Every server and router
is stopped; every wait is bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("transformers")

import attrs
from aiohttp import web
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.fleet import Fleet
from vllm_fleet.servers import free_port

from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError
from mooncake.types import InstanceId
from tests.vllm_fleet.fake import FakeVllm
from tests.vllm_fleet.http import fetch
from tests.vllm_fleet.test_fleet_edges import (
    INFO,
    MODEL,
    ConfiguredVllm,
    fleet_config,
    post,
    proxy_config,
    sample,
    stored,
)
from tests.waiting import wait_for

BLOCK = 32


class Loading(FakeVllm):
    """A `FakeVllm` that answers as a server not serving yet does while `loading` is set: `"not_http"` (bytes
    that are not HTTP on every route), `"503"` (a gateway in front of a server still loading its model), or
    as no vLLM server does: `"404"` (a URL that is another service's)."""

    def __init__(self, tokenizer: Any, **options: Any) -> None:
        super().__init__(tokenizer, **options)
        self.loading = ""

    @web.middleware
    async def _keyed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.loading in ("503", "404"):
            return web.Response(status=int(self.loading))
        if self.loading == "not_http":
            await request.read()
            assert request.transport is not None
            request.transport.write(b"NOT-HTTP garbage\r\n\r\n")
            request.transport.close()
            return web.Response()
        return await super()._keyed(request, handler)


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def live(tokenizer: Any) -> Iterator[FakeVllm]:
    server = FakeVllm(tokenizer).start()
    try:
        yield server
    finally:
        server.stop()


def _late(tokenizer: Any, how: str, **options: Any) -> Loading:
    """A server that cannot be reached yet: `closed` (its port free: nothing listens until `start`), else
    started and answering as `Loading.loading` says."""
    server = Loading(tokenizer, **options)
    if how == "closed":
        server.port = free_port()
    else:
        server.loading = how
        server.start()
    return server


def _come_up(server: Loading) -> None:
    if server.loading:
        server.loading = ""
    else:
        server.start()  # on the port it was given: a stopped fake keeps its port


@pytest.mark.parametrize("roles", [("both", "both"), ("prefill", "decode")])
def test_a_fleet_adds_an_unprobed_instance_down_until_refresh_gives_its_info(
    tmp_path: Path, roles: tuple[str, str]
) -> None:
    """An instance without a probe (None) is added down under the first probe's info, never scheduled on, even
    holding the prompt; `refresh` gives its own info (and limits), and once up it is scheduled on. With no probe
    at all the fleet is a ConfigError."""
    fleet = Fleet(fleet_config(tmp_path, roles=roles), [None, INFO], now=5.0)
    first, second = InstanceId("vllm-0"), InstanceId("vllm-1")
    assert (fleet.instances[first].up, fleet.instances[first].probed) == (False, False)
    assert fleet.instances[first].info == INFO and fleet.instances[second].up
    if roles == ("both", "both"):
        prompt = list(range(1, 4 * BLOCK + 2))
        stored(fleet, "vllm-0", prompt[: 4 * BLOCK], 0)
        _, decision = fleet.schedule(prompt, 4, now=6.0)
        assert decision.accepted and decision.prefill_instance == second
        own = attrs.evolve(INFO, max_model_len=1024)
        fleet.refresh(first, own)
        assert fleet.instances[first].info == own and fleet.instances[first].probed
        fleet.set_up(first, True, 7.0)
        stored(fleet, "vllm-0", prompt[: 4 * BLOCK], 0)
        _, decision = fleet.schedule(prompt, 4, now=8.0)
        assert decision.prefill_instance == first
    else:  # no prefill server up: nothing is accepted
        assert not fleet.schedule(list(range(1, 40)), 4, now=6.0)[1].accepted
    fleet.conductor.check_invariants()
    with pytest.raises(ConfigError, match="no instance was probed"):
        Fleet(fleet_config(tmp_path), [None, None])


def _up(router: BackgroundRouter) -> dict[str, bool]:
    return router.read(lambda r: {i: instance.up for i, instance in r.fleet.instances.items()})


@pytest.mark.parametrize("how", ["closed", "not_http", "503"])
def test_a_server_unreachable_at_start_joins_when_its_health_checks_pass(
    live: FakeVllm, tokenizer: Any, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The router starts with one of two servers unreachable (it refused to start at all): that one is down
    (logged, named, in /health and /metrics), never routed to, and calibration times only the live one. Once it
    serves, a health pass probes it, takes its own `max_model_len` (the live one's was its stand-in), marks it
    up (logged as joining, not as changed), and a prompt it holds goes to it."""
    caplog.set_level(logging.WARNING, logger="vllm_router")
    late = _late(tokenizer, how, max_model_len=1024)
    try:
        config = proxy_config([live, late], tokenizer_dir, health_interval_s=0.05, calibration_tokens=64)
        with BackgroundRouter(config, timeout_s=30) as router:
            assert _up(router) == {"vllm-0": True, "vllm-1": False}
            warned = [r.getMessage() for r in caplog.records if "vllm-1" in r.getMessage()]
            assert warned and "is unreachable" in warned[0] and "starts down" in warned[0], warned
            health = fetch(f"{router.url}/health")
            assert health.status_code == 200 and health.json()["instances"]["vllm-1"]["up"] is False
            assert "refused" not in health.json()["instances"]["vllm-1"]
            fetch(f"{router.url}/metrics")
            assert sample(router, "mooncake:engine_up", {"engine": "vllm-1"}) == 0
            assert sample(router, "mooncake:engine_up", {"engine": "vllm-0"}) == 1
            assert router.read(lambda r: len(r.fleet.prefill_model.samples)) == 3  # the live server's lengths
            calibrated = len(live.received)
            assert calibrated == 4 and not late.received
            prompt = list(range(1, 4 * BLOCK + 2))
            router.read(lambda r: stored(r.fleet, "vllm-1", prompt[: 4 * BLOCK], 0))  # a down server's: not indexed
            for _ in range(3):
                status, headers, _ = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": prompt})
                assert status == 200 and headers["X-Mooncake-Decode-Instance"] == "vllm-0"
            assert len(live.received) == calibrated + 3 and not late.received
            models = fetch(f"{router.url}/v1/models").json()["data"]
            assert [card["max_model_len"] for card in models] == [2048]  # the live server's card alone

            _come_up(late)
            wait_for(lambda: _up(router)["vllm-1"], timeout=10, what="vllm-1 marked up")
            assert router.read(lambda r: r.fleet.instances["vllm-1"].info.max_model_len) == 1024
            lines = [r.getMessage() for r in caplog.records if "vllm-1" in r.getMessage()]
            assert any("is up" in line for line in lines) and not any("came back" in line for line in lines), lines
            assert fetch(f"{router.url}/health").json()["instances"]["vllm-1"]["up"] is True
            router.read(lambda r: stored(r.fleet, "vllm-1", prompt[: 4 * BLOCK], 0))
            status, headers, _ = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": prompt})
            assert status == 200 and headers["X-Mooncake-Decode-Instance"] == "vllm-1"
            assert len(late.received) == 1
    finally:
        late.stop()


def test_a_server_that_joins_serving_another_model_stays_down(
    live: FakeVllm, tokenizer: Any, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server unreachable at start-up that comes up serving another model is refused as a restarted one
    is: it stays down, the reason logged once and shown in /health, and requests stay on the live server."""
    caplog.set_level(logging.WARNING, logger="vllm_router")
    other = ConfiguredVllm(tokenizer, model="other")
    other.port = free_port()
    try:
        with BackgroundRouter(proxy_config([live, other], tokenizer_dir, health_interval_s=0.05)) as router:
            assert _up(router) == {"vllm-0": True, "vllm-1": False}
            other.start()
            wait_for(
                lambda: "refused" in fetch(f"{router.url}/health").json()["instances"]["vllm-1"],
                timeout=10,
                what="vllm-1 refused",
            )
            refused = fetch(f"{router.url}/health").json()["instances"]["vllm-1"]["refused"]
            assert "serving model 'other'" in refused, refused
            errors = [r for r in caplog.records if r.levelno == logging.ERROR and "'other'" in r.getMessage()]
            assert len(errors) == 1
            assert _up(router) == {"vllm-0": True, "vllm-1": False}
            status, headers, _ = post(f"{router.url}/v1/completions", {"model": MODEL, "prompt": "bada"})
            assert status == 200 and headers["X-Mooncake-Decode-Instance"] == "vllm-0"
            assert not other.received
    finally:
        other.stop()


def test_no_server_answering_is_a_config_error_naming_them_all(tokenizer: Any, tokenizer_dir: Path) -> None:
    """The router learns the model, block size and context from a server: with none answering it does not
    start, and the one line names every server it could not reach."""
    servers = [_late(tokenizer, "closed"), _late(tokenizer, "closed")]
    with pytest.raises(ConfigError) as raised:
        BackgroundRouter(proxy_config(list(servers), tokenizer_dir)).close()
    message = str(raised.value)
    assert "\n" not in message
    for number, server in enumerate(servers):
        assert f"instance vllm-{number} ({server.url}) is unreachable" in message, message


def test_a_server_that_answers_what_the_router_cannot_use_still_stops_the_start(
    tokenizer: Any, tokenizer_dir: Path
) -> None:
    """Only unreachability is waited out: a server that answers with prefix caching off is the ConfigError it
    was, though another server is unreachable; so is one that answers as no vLLM server does (no models
    listed), or a 404 (a URL that is another service's)."""
    refusing = ConfiguredVllm(tokenizer, prefix_caching=False).start()
    elsewhere = _late(tokenizer, "404")
    try:
        with pytest.raises(ConfigError, match=r"instance vllm-1 .* runs without prefix caching"):
            BackgroundRouter(proxy_config([_late(tokenizer, "closed"), refusing], tokenizer_dir)).close()
        refusing.no_models, refusing.prefix_caching = True, True
        with pytest.raises(ConfigError, match=r"instance vllm-1 .* does not answer as a vLLM server does"):
            BackgroundRouter(proxy_config([_late(tokenizer, "closed"), refusing], tokenizer_dir)).close()
        with pytest.raises(ConfigError, match=r"instance vllm-1 .* 404"):
            BackgroundRouter(proxy_config([_late(tokenizer, "closed"), elsewhere], tokenizer_dir)).close()
    finally:
        refusing.stop()
        elsewhere.stop()
