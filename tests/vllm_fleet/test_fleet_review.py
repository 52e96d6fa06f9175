"""The vLLM router's config, start-up and sessions at their edges, against stand-in servers.

What each test proves: two instances naming one `replay` socket are a one-line ConfigError (the second server's
index would fill with the first's blocks), as a shared URL or events endpoint is, while any number of instances
may have none; a `start` cancelled while calibrating a slow server closes what it had opened (its sessions, the
KV-event sockets) and leaves no task behind; `examples/vllm_router.py` stopped by SIGINT while it starts exits at
once, with status 0 and without printing ready; the health checks' connection pool has no cap, as the
requests' has. Every server, router and process is stopped; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("transformers")

from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import parse_router_config
from vllm_fleet.proxy import VllmRouter
from vllm_fleet.servers import free_port

from mooncake.engine.tokenizer import load_tokenizer
from mooncake.errors import ConfigError
from tests.vllm_fleet.fake import FakeVllm
from tests.waiting import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "vllm_router.py"


def _instance(**fields: Any) -> dict[str, Any]:
    return {"url": f"http://10.0.0.{len(fields)}:8000", "kv_events": f"tcp://127.0.0.1:{free_port()}", **fields}


def test_two_instances_naming_one_replay_socket_are_refused(tmp_path: Path) -> None:
    """A `replay` copied into a second table is refused, naming the file, the instance, the key and the value;
    instances without a replay socket (`""`) never collide."""
    router = {"tokenizer": str(tmp_path)}
    (tmp_path / "tokenizer.json").write_text("{}")
    shared = "tcp://10.0.0.5:5558"
    instances = [
        _instance(url="http://10.0.0.5:8000", replay=shared),
        _instance(url="http://10.0.0.6:8000", replay=shared),
    ]
    with pytest.raises(ConfigError) as raised:
        parse_router_config({"router": router, "instances": instances}, "router.toml")
    assert str(raised.value) == (
        "router.toml: [[instances]] 1 replay = 'tcp://10.0.0.5:5558': the same as instance 0's "
        "(each server is listed once, with its own endpoint)"
    )
    none = [_instance(url=f"http://10.0.0.{n}:8000", replay="") for n in (5, 6, 7)]
    config = parse_router_config({"router": router, "instances": none}, "router.toml")
    assert [instance.replay for instance in config.instances] == ["", "", ""]


def _slow_config(tokenizer_dir: Path, server: FakeVllm) -> dict[str, Any]:
    return {
        "router": {"port": 0, "block_size": 32, "tokenizer": str(tokenizer_dir), "calibration_tokens": 1024},
        "instances": [{"url": server.url, "kv_events": f"tcp://127.0.0.1:{free_port()}"}],
    }


def test_a_start_cancelled_while_calibrating_closes_what_it_opened(tokenizer_dir: Path) -> None:
    """Cancelled in calibration (a 1024-token prefill takes seconds here), `start` closes both sessions and the
    KV-event sockets, binds nothing, and leaves no task pending."""
    server = FakeVllm(load_tokenizer(tokenizer_dir), seconds_per_token=0.02).start()
    try:
        router = VllmRouter(parse_router_config(_slow_config(tokenizer_dir, server), "router.toml"))

        async def run() -> set[asyncio.Task[Any]]:
            async with asyncio.timeout(20):
                starting = asyncio.create_task(router.start())
                while not server.received:
                    await asyncio.sleep(0.01)
                assert not starting.done()
                starting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await starting
            return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

        left = asyncio.run(run())
        assert left == set()
        assert router._session is None and router._checks is None and router._runner is None
        assert router.url == ""
        assert router.fleet is not None
        assert all(instance.subscriber.closed for instance in router.fleet.instances.values())
    finally:
        server.stop()


def test_sigint_while_starting_stops_the_command_at_once(tokenizer_dir: Path, tmp_path: Path) -> None:
    """SIGINT while the router calibrates a slow server (the whole calibration would take half a minute) stops
    it within seconds, with status 0 as a SIGTERM once serving does, without printing ready, and without a
    traceback, a task destroyed pending or a session left unclosed."""
    server = FakeVllm(load_tokenizer(tokenizer_dir), seconds_per_token=0.02).start()
    config = _slow_config(tokenizer_dir, server)
    path = tmp_path / "router.toml"
    path.write_text(
        f'[router]\nport = 0\nblock_size = 32\ntokenizer = "{tokenizer_dir}"\ncalibration_tokens = 1024\n'
        f'[[instances]]\nurl = "{server.url}"\nkv_events = "{config["instances"][0]["kv_events"]}"\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-W", "always::ResourceWarning", str(SCRIPT), "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: bool(server.received), timeout=30, what="the router's first calibration prefill")
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=15)
        assert time.monotonic() - sent < 5, out
        assert process.returncode == 0, out
        assert "ready" not in out
        for bad in ("Traceback", "destroyed but it is pending", "Unclosed", "unclosed"):
            assert bad not in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        server.stop()


def test_the_health_checks_pool_has_no_cap(tokenizer_dir: Path) -> None:
    """More than aiohttp's default 100 connections: the health checks' session, like the requests', has no
    limit, so a fleet of hundreds of servers is checked at once and none waits for a connection."""
    server = FakeVllm(load_tokenizer(tokenizer_dir)).start()
    try:
        config = _slow_config(tokenizer_dir, server)
        config["router"]["calibration_tokens"] = 0
        with BackgroundRouter(parse_router_config(config, "router.toml")) as background:
            limits = background.read(lambda router: [s.connector.limit for s in (router._session, router._checks)])  # type: ignore[union-attr]
        assert limits == [0, 0]
    finally:
        server.stop()
