"""The gateway's connections: caps, header and body deadlines, JSON for aiohttp's own errors, quiet logs.

`GuardedSite` serves an aiohttp runner on a TCP socket through a guard:

- Caps. Each accepted connection is counted, in all and per client address.
  One beyond `max_connections` (503) or beyond `max_connections_per_client`
  (429) is answered at once with an OpenAI-style JSON error, `Connection:
  close` and `Retry-After`, before anything of it is read, then closed: the
  answer is followed by a FIN and what the client sends meanwhile is dropped for
  at most `REFUSAL_LINGER_S` (so its request does not turn the close into a
  reset that loses the answer). At most `MAX_LINGERING` refusals linger; beyond
  that a refused connection is reset at once. The total cap is what
  `machine.connection_budget` grants (the soft open-file limit raised to hold it
  and the gateway's own descriptors), so a flood never exhausts descriptors.
- Deadlines. A client has `header_timeout_s` from its connection, or from its
  previous answer, to send a request's headers (aiohttp's keep-alive timer,
  which also closes a connection whose headers trickle in: slowloris); the
  gateway gives its body `body_timeout_s` (a 408).
- Errors. What aiohttp answers by itself (a malformed request line or header:
  400, 431...) is OpenAI's JSON error body, not plain text (`JsonRequestHandler`).
- Logs. `LogLimiter` lets one record per kind (logger, message template,
  exception type) through per `log_interval_s`, saying how many it dropped;
  below ERROR a record's traceback becomes its last line. `install_log_limits`
  puts it on aiohttp's, asyncio's and the gateway's loggers, and
  `loop_exception_handler` routes the event loop's errors (accept() out of file
  descriptors, say) through it.

Invariant: the guard's counts equal the connections it admitted and that are
not yet lost (`check_invariants`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from serving.api import ApiError
from serving.machine import MAX_LINGERING, connection_budget

__all__ = [
    "ConnectionGuard",
    "EdgeLimits",
    "GuardedSite",
    "JsonRequestHandler",
    "LogLimiter",
    "http_url",
    "install_log_limits",
    "loop_exception_handler",
]

LOG = logging.getLogger("serving.protocol")


def http_url(host: str, port: int) -> str:
    """The http:// URL of a server at `host` and `port`: an IPv6 address in brackets (RFC 3986), else a client
    reads the address's last group as the port."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


LOGGERS = (
    "asyncio",
    "aiohttp.access",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "serving.dispatch",
    "serving.gateway",
    "serving.protocol",
)
REFUSAL_LINGER_S = 1.0
MAX_LOG_KINDS = 1024


@attrs.frozen(kw_only=True)
class EdgeLimits:
    """What one client and all clients may hold of the gateway, and the deadlines they have."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_client: int = 1024
    max_body_bytes: int = 8 << 20
    log_interval_s: float = 10.0

    @classmethod
    def from_config(cls, limits: Any, **overrides: Any) -> EdgeLimits:
        """The `[limits]` section's connection keys (`header_timeout_s` ... `max_connections_per_client`)."""
        names = ("header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_client")
        return cls(**{name: getattr(limits, name) for name in names}, **overrides)

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's per-connection options: the header deadline, a cancelled handler when its client leaves,
        bodies left compressed (the API decodes them within its cap), a short linger after an unread body."""
        return {
            "keepalive_timeout": self.header_timeout_s,
            "handler_cancellation": True,
            "auto_decompress": False,
            "lingering_time": min(1.0, self.body_timeout_s),
            "max_headers": 64,
        }


class ConnectionGuard:
    """Counts the open connections, in all and per client address, and says which to refuse.

    Invariants: `total == sum(per_client.values())`; no client has a zero entry; `lingering >= 0`.
    """

    def __init__(self, limits: EdgeLimits, *, on_refusal: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        self.max_connections = connection_budget(limits.max_connections)
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.lingering = 0
        self.refused = 0
        self._on_refusal = on_refusal  # told each refusal's status (the gateway counts them in its metrics)

    def admit(self, client: str) -> ApiError | None:
        """Count a new connection from `client`; or the error that refuses it (counting nothing)."""
        held = self.per_client.get(client, 0)
        if self.total >= self.max_connections:
            refusal = ApiError(
                503, f"the gateway holds {self.total} connections, its limit", headers={"Retry-After": "1"}
            )
        elif held >= self.limits.max_connections_per_client:
            limit = self.limits.max_connections_per_client
            refusal = ApiError(429, f"{held} connections from {client}, the limit per client is {limit}",
                               headers={"Retry-After": "1"})  # fmt: skip
        else:
            self.total += 1
            self.per_client[client] = held + 1
            return None
        self.refused += 1
        if self._on_refusal is not None:
            self._on_refusal(refusal.status)
        return refusal

    def release(self, client: str) -> None:
        """Forget an admitted connection of `client` (it closed)."""
        self.total -= 1
        held = self.per_client[client] - 1
        if held:
            self.per_client[client] = held
        else:
            del self.per_client[client]

    def check_invariants(self) -> None:
        assert self.total == sum(self.per_client.values()), (self.total, self.per_client)
        assert all(count > 0 for count in self.per_client.values())
        assert self.lingering >= 0


def refusal_bytes(error: ApiError) -> bytes:
    """A whole HTTP/1.1 answer carrying `error`, for a connection closed without reading its request."""
    body = json.dumps(error.body()).encode()
    lines = [
        f"HTTP/1.1 {error.status} {'Too Many Requests' if error.status == 429 else 'Service Unavailable'}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in error.headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Refusal(asyncio.Protocol):
    """Answers a refused connection at once, drops what it sends for a moment, closes it."""

    def __init__(self, guard: ConnectionGuard, error: ApiError) -> None:
        self._guard, self._error = guard, error
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._guard.lingering >= MAX_LINGERING:
            transport.abort()  # a flood of refusals: a reset, without holding a descriptor
            return
        self._guard.lingering += 1
        transport.write(refusal_bytes(self._error))
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request of a refused connection: never read

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._guard.lingering -= 1


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler when the guard admits it, a `_Refusal` otherwise."""

    __slots__ = ("_client", "_guard", "_inner", "_make")

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self._guard, self._make = guard, make
        self._inner: asyncio.Protocol | None = None
        self._client: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refusal = self._guard.admit(client)
        if refusal is None:
            self._client, self._inner = client, self._make()
        else:
            LOG.warning("refused a connection from %s: %s", client, refusal.message)
            self._inner = _Refusal(self._guard, refusal)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        assert self._inner is not None
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        assert self._inner is not None
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        assert self._inner is not None
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        assert self._inner is not None
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._inner.connection_lost(exc)
        if self._client is not None:
            self._guard.release(self._client)
            self._client = None


class JsonRequestHandler(RequestHandler):
    """aiohttp's connection handler whose own error answers (a request it cannot parse) are OpenAI JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        reason = getattr(exc, "message", None) or message or (type(exc).__name__ if exc else "")
        reason = (str(reason).strip().splitlines() or [""])[0].rstrip(":")  # the parser adds the line and a caret
        if isinstance(exc, ConnectionResetError):
            # A write to a client that left, before aiohttp noticed and cancelled the handler: its request was ended
            # (aborted) on the way out, as a cancellation ends it, and nothing failed here.
            LOG.debug("client %s left mid-answer", request.remote)
        elif status >= 500:
            LOG.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            LOG.warning("unreadable request from %s: %s %s", request.remote, status, ascii(reason)[:200])
        if request.writer.output_size > 0:
            raise ConnectionError("the answer has begun: no error answer can follow")
        text = "the request could not be read" if status < 500 else "internal error"
        error = ApiError(status, f"{text}: {reason[:200]}" if status < 500 else text)
        response = web.json_response(error.body(), status=status)
        response.force_close()
        return response


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a `ConnectionGuard` to `JsonRequestHandler`s.

    Args:
        runner: a set-up `AppRunner` (its server is the request handler's manager).
        host, port: where to listen (port 0: any free port).
        limits: the caps and deadlines.
        handler_args: the handlers' options (`EdgeLimits.handler_args` and the runner's, like `access_log`).
        on_refusal: told the status of each connection refused (429 over a client's share, 503 over the total).
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limits: EdgeLimits,
        handler_args: dict[str, Any],
        on_refusal: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(runner, backlog=1024)
        self._host, self._port = host, port
        self.guard = ConnectionGuard(limits, on_refusal=on_refusal)
        self._handler_args = {k: v for k, v in handler_args.items() if k != "handler_cancellation"}

    @property
    def name(self) -> str:
        return http_url(self._host, self._port)

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        args = self._handler_args

        def make() -> asyncio.Protocol:
            return JsonRequestHandler(server, loop=loop, **args)

        self._server = await loop.create_server(
            lambda: _Guarded(self.guard, make), self._host, self._port, backlog=self._backlog, reuse_address=True
        )


class LogLimiter(logging.Filter):
    """Lets one record of each kind through per `interval_s`; a kind is the logger, the message template,
    the record's `kind` extra and the exception's type. Below ERROR a traceback becomes its last line."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self._clock = interval_s, clock
        self._seen: dict[tuple[Any, ...], list[float]] = {}  # kind → [when it last passed, records dropped since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        key: tuple[Any, ...] = (record.name, template, getattr(record, "kind", None), error)
        now = self._clock()
        with self._lock:
            if len(self._seen) >= MAX_LOG_KINDS and key not in self._seen:
                key = (record.name, record.levelno)  # too many kinds (messages built without a template)
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return False
            dropped = int(entry[1]) if entry is not None else 0
            self._seen[key] = [now, 0]
        if record.exc_info and record.levelno < logging.ERROR:
            kind, value, _ = record.exc_info
            record.msg, record.args = f"{record.getMessage()} ({getattr(kind, '__name__', kind)}: {value})", ()
            record.exc_info, record.exc_text = None, None
        if dropped:
            record.msg, record.args = f"{record.getMessage()} [{dropped} alike dropped]", ()
        return True


def install_log_limits(interval_s: float) -> Callable[[], None]:
    """Put a `LogLimiter` on the gateway's, aiohttp's and asyncio's loggers; returns what takes it off."""
    limiter = LogLimiter(interval_s)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(limiter)

    def uninstall() -> None:
        for logger in loggers:
            logger.removeFilter(limiter)

    return uninstall


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's errors as one rate-limited line each (through `LOG`, which the limiter watches)."""
    message = str(context.get("message", "event loop error"))
    error = context.get("exception")
    LOG.error(
        "event loop: %s%s", message, f" ({type(error).__name__}: {error})" if error else "", extra={"kind": message}
    )
