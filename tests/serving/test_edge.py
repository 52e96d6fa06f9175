"""Tests of the gateway's connections (`serving.protocol`) with real sockets against a real gateway.

The gateway here has no engines (a worker-less `Gateway` served by `Gateway.start` on 127.0.0.1): what is tested
happens before a request reaches the Conductor. Clients spread over loopback addresses (127.0.0.2, ...) to act as
several hosts. Sizes follow the open-file limit (client and server sockets share this process) and every wait has
a deadline.

What each test proves: aiohttp's own answers (404, 405, 413, an unparsable request) are OpenAI JSON; a body that
does not arrive is a 408; 1,000+ slowloris connections are all closed within the header timeout while /health
answers; a client over its share gets a 429 JSON and another client is served; over the total a 503 JSON; a flood
of refusals holds a bounded number of descriptors and leaves the gateway serving; a flood of bad requests and
refusals logs a handful of lines, not one per request; the guard's counts follow a model under any sequence of
connections (a state machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mooncake

pytest.importorskip("aiohttp")

from serving.config import ClusterConfig
from serving.gateway import Gateway
from serving.protocol import (
    MAX_LINGERING,
    ConnectionGuard,
    EdgeLimits,
    LogLimiter,
    loop_exception_handler,
)

HOST = "127.0.0.1"
DEADLINE_S = 30.0


@contextlib.contextmanager
def served(edge: EdgeLimits, config: ClusterConfig | None = None) -> Iterator[tuple[Gateway, int]]:
    """A worker-less gateway with `edge` (and `config`), served on 127.0.0.1 by an event loop thread; yields it
    and its port."""
    config = config or ClusterConfig(source="test_edge")
    gateway = Gateway(config, bytes(32), [], lambda _instance: True, edge=edge)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="edge-gateway", daemon=True)
    thread.start()
    runner = None
    try:
        runner = asyncio.run_coroutine_threadsafe(gateway.start(HOST, 0), loop).result(DEADLINE_S)
        yield gateway, runner.addresses[0][1]
    finally:
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(DEADLINE_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE_S)
        loop.close()


def connect(port: int, source: str = HOST) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=DEADLINE_S, source_address=(source, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # no TIME_WAIT pile-up
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """Read one HTTP answer until EOF (the requests here say `Connection: close`): status, headers, JSON body."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1."), data[:200]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def ask(port: int, raw: bytes, source: str = HOST) -> tuple[int, dict[str, str], Any]:
    with connect(port, source) as sock:
        sock.sendall(raw)
        return read_answer(sock)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def post(path: str, body: bytes, **headers: str) -> bytes:
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def wait_for(predicate: Any, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.02)


def is_openai_error(body: Any, status: int) -> bool:
    error = body["error"]
    return set(error) == {"message", "type", "param", "code"} and error["code"] in (status, error["code"])


def fd_budget() -> int:
    """How many connections a test may open: both their ends live in this process."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, (soft - 256) // 2)


# ---------------------------------------------------------------------------------------------- JSON everywhere


def test_aiohttp_own_errors_are_openai_json() -> None:
    """Unknown route 404, wrong method 405, body over the cap 413, unparsable request lines, headers and chunks
    400, an unknown expectation 417, malformed bodies 400: all JSON with OpenAI's error fields."""
    with served(EdgeLimits(max_body_bytes=1024)) as (_gateway, port):
        cases = [
            (get("/v1/nope"), 404),
            (get("/v1/completions"), 405),
            (post("/v1/completions", b"x" * 5000), 413),
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20000 + b"\r\n\r\n", 400),
            (post("/v1/completions", b'{"prompt":"a\\ud800"}'), 400),
            (post("/v1/completions", b"\x1f\x8b garbage", Content_Encoding="gzip"), 400),
            (post("/v1/completions", b'{"prompt":"hi"}', Content_Type="application/json; charset=nope"), 400),
            (post("/v1/completions", b"{}", Expect="200-ok"), 417),
            (post("/v1/nope", b"{}", Expect="200-ok"), 417),
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", 400),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
        ]
        for raw, status in cases:
            answer, headers, body = ask(port, raw)
            assert answer in (status, 431 if status == 400 else status), (raw[:40], answer)
            assert headers["content-type"].startswith("application/json"), (raw[:40], headers)
            assert is_openai_error(body, answer), body
        assert ask(port, get("/v1/completions"))[1]["allow"] == "POST"
        assert ask(port, get("/v1/nope"))[2]["error"]["message"] == "Invalid URL (GET /v1/nope)"


def test_a_body_that_does_not_arrive_is_a_408() -> None:
    """Headers promise 100 bytes, 10 come: after the body timeout the answer is a 408 JSON and the connection closes."""
    with served(EdgeLimits(body_timeout_s=0.5)) as (_gateway, port), connect(port) as sock:
        sock.sendall(post("/v1/completions", b"x" * 100)[:-90])
        started = time.monotonic()
        status, _headers, body = read_answer(sock)
        assert status == 408 and body["error"]["type"] == "timeout_error"
        assert time.monotonic() - started < DEADLINE_S


# ---------------------------------------------------------------------------------------------- slowloris


def test_slowloris_connections_are_closed_within_the_header_timeout() -> None:
    """Up to 1,200 connections (fewer under a low open-file limit) that trickle their headers a byte at a time
    are all closed by the gateway within the header timeout (plus slack), and /health answers meanwhile."""
    count = min(1200, fd_budget() - 64)
    if count < 100:
        pytest.skip(f"the open-file limit allows only {count} connections")
    timeout_s, slack_s = 1.5, 3.0
    edge = EdgeLimits(header_timeout_s=timeout_s, max_connections=count + 64, max_connections_per_client=count + 64)
    with served(edge) as (gateway, port):
        selector = selectors.DefaultSelector()
        opened: dict[socket.socket, float] = {}
        try:
            for _ in range(count):
                sock = connect(port)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
                opened[sock] = time.monotonic()
            health, _headers, body = ask(port, get("/health"))
            assert health == 503 and body["status"] == "unavailable"  # answered (no engines here)
            closed: dict[socket.socket, float] = {}
            deadline = time.monotonic() + timeout_s + slack_s + 5.0
            next_byte = time.monotonic()
            while len(closed) < count and time.monotonic() < deadline:
                if time.monotonic() >= next_byte:  # the slow part: one more header byte on every open connection
                    for sock in opened:
                        if sock not in closed:
                            with contextlib.suppress(OSError):
                                sock.send(b"X")
                    next_byte = time.monotonic() + 0.3
                for key, _events in selector.select(timeout=0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        closed[sock] = time.monotonic()
                        selector.unregister(sock)
            assert len(closed) == count, f"{count - len(closed)} slow connections still open"
            lifetimes = [closed[s] - opened[s] for s in opened]
            assert max(lifetimes) < timeout_s + slack_s, max(lifetimes)
            wait_for(lambda: gateway.site is not None and gateway.site.guard.total == 0, "the guard to count none")
        finally:
            selector.close()
            for sock in opened:
                sock.close()


# ---------------------------------------------------------------------------------------------- caps


def idle_connections(port: int, count: int, source: str) -> list[socket.socket]:
    return [connect(port, source) for _ in range(count)]


def test_vllms_side_routes_answer_as_vllms_do() -> None:
    """HEAD on every GET route answers its status without a body, /ping is /health (503 here: no engine is up),
    /version names this version, /v1/models says when it answered (vLLM's `created`, not 0), and /tokenize and
    /detokenize turn a prompt or a chat into tokens and back, as vLLM's do."""
    with served(EdgeLimits()) as (_gateway, port):
        with connect(port) as sock:
            sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and rest == b""
        assert ask(port, get("/ping"))[0] == ask(port, post("/ping", b""))[0] == 503
        status, _headers, version = ask(port, get("/version"))
        assert status == 200 and version == {"version": mooncake.__version__}
        before = int(time.time())
        status, _headers, models = ask(port, get("/v1/models"))
        assert status == 200 and before <= models["data"][0]["created"] <= int(time.time())
        status, _headers, tokens = ask(port, post("/tokenize", b'{"prompt": "hi"}'))
        assert status == 200 and (tokens["count"], tokens["tokens"]) == (2, [104, 105])  # the tiny model's bytes
        assert tokens["max_model_len"] == models["data"][0]["max_model_len"] and tokens["token_strs"] is None
        pieces = ask(port, post("/tokenize", b'{"prompt": "hi", "return_token_strs": true}'))[2]
        assert pieces["token_strs"] == ["h", "i"]
        chat = ask(port, post("/tokenize", b'{"messages": [{"role": "user", "content": "hi"}]}'))[2]
        assert chat["count"] > 2 and bytes(chat["tokens"]).endswith(b"<|assistant|>\n")  # the chat template's
        assert ask(port, post("/detokenize", b'{"tokens": [104, 105]}'))[2] == {"prompt": "hi"}
        status, _headers, error = ask(port, post("/detokenize", b'{"tokens": [104, 1000000]}'))
        assert status == 400 and error["error"]["param"] == "tokens"


def test_a_client_over_its_share_gets_a_429_and_others_are_served() -> None:
    """Four idle connections from 127.0.0.1 fill its share: a fifth gets a 429 JSON with Retry-After before it
    sends anything; 127.0.0.2 is served; once one of the four closes, 127.0.0.1 is served again."""
    edge = EdgeLimits(header_timeout_s=60.0, max_connections=16, max_connections_per_client=4)
    with served(edge) as (gateway, port):
        assert gateway.site is not None
        guard = gateway.site.guard
        held = idle_connections(port, 4, HOST)
        try:
            wait_for(lambda: guard.per_client.get(HOST) == 4, "four connections counted")
            with connect(port) as refused:
                status, headers, body = read_answer(refused)  # answered without a request
            assert status == 429 and int(headers["retry-after"]) > 0 and headers["connection"] == "close"
            assert body["error"]["type"] == "rate_limit_error" and "4" in body["error"]["message"]
            refusals = gateway.metrics.registry.get_sample_value
            labels = {"model_name": gateway.served.name}
            assert refusals("mooncake:connections_refused_total", {**labels, "status": "429"}) == 1
            assert refusals("mooncake:connections_refused_total", {**labels, "status": "503"}) == 0
            assert ask(port, get("/v1/models"), source="127.0.0.2")[0] == 200
            held.pop().close()
            wait_for(lambda: guard.per_client.get(HOST) == 3, "the closed connection forgotten")
            assert ask(port, get("/v1/models"))[0] == 200
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: guard.total == 0, "every connection forgotten")
        guard.check_invariants()


def test_over_the_total_a_503() -> None:
    """Six connections from two clients fill the total: a third client gets a 503 JSON; with a request sent
    before the answer is read, the answer still arrives whole (no reset)."""
    edge = EdgeLimits(header_timeout_s=60.0, max_connections=6, max_connections_per_client=4)
    with served(edge) as (gateway, port):
        held = idle_connections(port, 4, HOST) + idle_connections(port, 2, "127.0.0.2")
        try:
            assert gateway.site is not None
            wait_for(lambda: gateway.site is not None and gateway.site.guard.total == 6, "six connections counted")
            for _ in range(5):
                status, headers, body = ask(port, post("/v1/completions", b'{"prompt": "hi"}'), source="127.0.0.3")
                assert status == 503 and headers["retry-after"] == "1"
                assert body["error"]["type"] == "server_error"
        finally:
            for sock in held:
                sock.close()


def test_a_flood_of_refusals_holds_few_descriptors_and_logs_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    """With the total full, 600 more connections (and 300 unparsable requests before that) are refused; the
    gateway never holds more than its lingering bound of refused sockets, stays serving once a slot frees, and
    logs a handful of lines in all (one per kind per interval), not one per connection."""
    budget = fd_budget()
    if budget < 700:
        pytest.skip(f"the open-file limit allows only {budget} connections")
    caplog.set_level(logging.DEBUG)
    edge = EdgeLimits(header_timeout_s=60.0, max_connections=8, max_connections_per_client=8, log_interval_s=60.0)
    with served(edge) as (gateway, port):
        assert gateway.site is not None
        guard = gateway.site.guard
        for _ in range(300):
            assert ask(port, b"NOT HTTP AT ALL\r\n\r\n")[0] == 400
        held = idle_connections(port, 8, HOST)
        try:
            wait_for(lambda: guard.total == 8, "eight connections counted")
            most_lingering = 0
            flood = []
            for i in range(600):
                flood.append(connect(port, f"127.0.1.{1 + i % 200}"))
                most_lingering = max(most_lingering, guard.lingering)
            wait_for(lambda: guard.refused >= 600, "the flood to be refused")
            for sock in flood:
                sock.close()
            assert most_lingering <= MAX_LINGERING
            held.pop().close()
            wait_for(lambda: guard.total == 7, "a slot to free")
            assert ask(port, get("/v1/models"), source="127.0.0.9")[0] == 200
        finally:
            for sock in held:
                sock.close()
    ours = [r for r in caplog.records if r.name.startswith(("serving", "aiohttp", "asyncio"))]
    assert len(ours) <= 6, [r.getMessage() for r in ours]
    assert not any(r.exc_info for r in ours)


# ---------------------------------------------------------------------------------------------- logs and the guard


def test_log_limiter_lets_one_line_per_kind_per_interval() -> None:
    """Per kind one record per interval; the next one says how many were dropped; tracebacks below ERROR become
    their last line; too many kinds fold into one per logger and level."""
    now = [0.0]
    limiter = LogLimiter(10.0, clock=lambda: now[0])

    def record(message: str, *args: Any, level: int = logging.WARNING, exc: BaseException | None = None) -> Any:
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("serving.gateway", level, __file__, 1, message, args, info)

    passed = [limiter.filter(record("refused %s", i)) for i in range(100)]
    assert passed == [True] + [False] * 99
    assert limiter.filter(record("another kind"))
    now[0] = 10.0
    later = record("refused %s", 100)
    assert limiter.filter(later) and later.getMessage() == "refused 100 [99 alike dropped]"
    failed = record("read failed", exc=OSError(24, "Too many open files"))
    assert limiter.filter(failed) and failed.exc_info is None and "Too many open files" in failed.getMessage()
    for i in range(3000):
        limiter.filter(record(f"no template {i}"))  # kinds without bound fold
    assert len(limiter._seen) <= 1025


def test_loop_errors_are_one_line_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    """A storm of event-loop errors (accept() out of descriptors) through the gateway's handler and limiter is one
    line, without a traceback."""
    caplog.set_level(logging.DEBUG)
    limiter = LogLimiter(60.0)
    logger = logging.getLogger("serving.protocol")
    logger.addFilter(limiter)
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(loop_exception_handler)
        for _ in range(500):
            loop.call_exception_handler(
                {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
            )
    finally:
        loop.close()
        logger.removeFilter(limiter)
    lines = [r for r in caplog.records if r.name == "serving.protocol"]
    assert len(lines) == 1 and "accept()" in lines[0].getMessage() and not lines[0].exc_info


class GuardModel(RuleBasedStateMachine):
    """The guard against a dict of open connections per client: admitted iff under both caps; counts equal."""

    def __init__(self) -> None:
        super().__init__()
        self.limits = EdgeLimits(max_connections=6, max_connections_per_client=3)
        self.guard = ConnectionGuard(self.limits)
        self.model: dict[str, int] = {}

    @rule(client=st.sampled_from(["a", "b", "c", "d"]))
    def open(self, client: str) -> None:
        total, held = sum(self.model.values()), self.model.get(client, 0)
        refusal = self.guard.admit(client)
        if total >= 6:
            assert refusal is not None and refusal.status == 503
        elif held >= 3:
            assert refusal is not None and refusal.status == 429
        else:
            assert refusal is None
            self.model[client] = held + 1

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        client = data.draw(st.sampled_from(sorted(self.model)))
        self.guard.release(client)
        self.model[client] -= 1
        if not self.model[client]:
            del self.model[client]

    @invariant()
    def counts_match(self) -> None:
        self.guard.check_invariants()
        assert self.guard.per_client == self.model


TestGuard = GuardModel.TestCase
TestGuard.settings = settings(max_examples=50, stateful_step_count=30)


def test_echo_with_logprobs_is_a_400_where_the_prefill_is_a_pipeline() -> None:
    """A pipelined prefill computes the last position's logits only: a completion asking for the prompt's
    log-probabilities (`echo` with `logprobs`) is refused at once with a 400 naming `echo`, before any engine
    is asked; echo alone is taken (here: no engine is up, a 503)."""
    config = ClusterConfig(source="test_edge").with_overrides("prefill", pipeline_size=2)
    with served(EdgeLimits(), config) as (_gateway, port):
        body = json.dumps({"prompt": "hi", "echo": True, "logprobs": 1}).encode()
        status, _, answer = ask(port, post("/v1/completions", body, Content_Type="application/json"))
        assert (status, answer["error"]["param"]) == (400, "echo") and "pipeline" in answer["error"]["message"]
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2}),
        ]:
            status, _, answer = ask(port, post(path, json.dumps(body).encode(), Content_Type="application/json"))
            assert (status, answer["error"]["param"]) == (400, "prompt_logprobs"), answer
        body = json.dumps({"prompt": "hi", "echo": True}).encode()
        assert ask(port, post("/v1/completions", body, Content_Type="application/json"))[0] == 503
