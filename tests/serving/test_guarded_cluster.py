"""The cluster `start_cluster` launches (what examples/cluster.py serves) is behind the guarded site.

tests/serving/test_edge.py proves the guard on a gateway it serves itself; this checks that the launcher
serves through it too, with the config's `[limits]`: a client past its connection cap is refused with a
JSON 429, a slowloris connection is closed at the header deadline, and aiohttp's own errors are JSON.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.config import load_config
from serving.launch import RunningCluster, start_cluster

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
PER_CLIENT = 4
HEADER_TIMEOUT_S = 1.0
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    config = config.with_overrides(
        "limits", max_connections_per_client=PER_CLIENT, header_timeout_s=HEADER_TIMEOUT_S, health_interval_s=1.0
    )
    with start_cluster(config) as running:
        yield running


def address(cluster: RunningCluster) -> tuple[str, int]:
    host, port = cluster.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes (bounded by the socket's timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_client_past_its_connection_cap_gets_a_json_429(cluster: RunningCluster) -> None:
    """With PER_CLIENT idle connections open, one more from the same address is answered 429 in JSON and
    closed; once one closes, a new connection is served again."""
    with ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(address(cluster), timeout=DEADLINE_S))]
        held += [stack.enter_context(socket.create_connection(address(cluster), timeout=DEADLINE_S))
                 for _ in range(PER_CLIENT - 1)]  # fmt: skip
        guard = cluster.gateway.site.guard  # type: ignore[union-attr]
        deadline = time.monotonic() + DEADLINE_S
        while guard.total < PER_CLIENT:  # the guard counts a connection when the event loop accepts it
            assert time.monotonic() < deadline, f"the gateway accepted {guard.total} of {PER_CLIENT} connections"
            time.sleep(0.01)
        with socket.create_connection(address(cluster), timeout=DEADLINE_S) as extra:
            answer = read_all(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), answer[:200]
        assert json.loads(body)["error"]["type"] == "rate_limit_error"
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the held ones are closed: the count falls back and a request is served
        with socket.create_connection(address(cluster), timeout=DEADLINE_S) as again:
            again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if read_all(again).startswith(b"HTTP/1.1 200"):
                break
        assert time.monotonic() < deadline, "the gateway never served again after the held connections closed"
        time.sleep(0.05)


def test_a_slowloris_connection_is_closed_at_the_header_deadline(cluster: RunningCluster) -> None:
    """Headers that trickle in are cut off within a few header deadlines, not held open."""
    with socket.create_connection(address(cluster), timeout=DEADLINE_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 10 * HEADER_TIMEOUT_S:
            try:
                sock.sendall(b"X-a: b\r\n")
            except OSError:
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:  # reset: closed while the last header line was unread (a race, seen once in CI)
                closed = True
                break
        assert closed, "a connection whose headers never end stayed open past 10 header deadlines"


def test_aiohttp_own_errors_are_json_on_the_cluster(cluster: RunningCluster) -> None:
    """A request line aiohttp cannot parse gets OpenAI's JSON error body, not aiohttp's plain text."""
    with socket.create_connection(address(cluster), timeout=DEADLINE_S) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", head  # HTTP/1.0: the request line had no version to echo
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
