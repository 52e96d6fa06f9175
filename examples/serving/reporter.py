"""A worker's reports to the gateway, sent in order by a thread of their own.

A report is a control call to the gateway (`serving.wire`), a round trip. Made
by the engine's own thread it would stall the engine for that round trip on
every report: a prefill would wait for `prefill.started` to be acknowledged
before computing, a decode batch for each step's `decode.tokens` before the
next step. `Reporter.send` queues the message instead, and one sender thread
makes the calls, so:

- order is kept: the gateway receives a worker's reports in the order `send`
  was called (one thread, one connection);
- token reports that queue up behind a slow call travel as one: consecutive
  `DecodeTokens` of one worker merge into a single message (their tokens in
  order), so a gateway that falls behind gets fewer, larger reports, not a
  growing queue; each token keeps its own step's time (`Token.at_s`), by
  which the gateway times it, so merging loses no timing;
- `flush(timeout)` waits until everything sent so far has been delivered (or
  dropped): the prefill engine flushes `prefill.done` before handing the
  request to a decode node, whose token reports travel on another connection
  and must not overtake it;
- the queue is bounded (`capacity` messages): past it `send` waits, the
  backpressure the direct call gave;
- a call that fails (the gateway is gone: the cluster is shutting down) drops
  that report, as the direct call did.

Invariants: every message given to `send` before `flush` returns True was
delivered or dropped, in order; a merged report's tokens are its parts'
tokens, in order, unchanged (their `at_s` included).
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable

import attrs

from mooncake.errors import MooncakeError
from serving import wire

__all__ = ["Reporter"]


class Reporter:
    """Sends messages with `call` (blocking, one at a time) on a thread of its own; see the module docstring.

    Args:
        call: delivers one message to the gateway (raises `MooncakeError` or `OSError` when it cannot).
        capacity: the most messages waiting; `send` blocks beyond it.
        name: the sender thread's name.
    """

    def __init__(self, call: Callable[[wire.Message], None], *, capacity: int = 1024, name: str = "reporter") -> None:
        self._call, self._capacity = call, capacity
        self._queue: collections.deque[tuple[wire.Message, int]] = collections.deque()  # (message, sends in it)
        self._lock = threading.Condition()
        self._sent = 0  # messages taken off the queue and delivered (or dropped)
        self._queued = 0  # messages ever given to `send`, merged ones counted
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: wire.Message) -> None:
        """Queue `message` for the gateway (after everything sent before it); after `close` (or while
        waiting for room when `close` comes) it is dropped, as a report the gone gateway refuses is."""
        with self._lock:
            while len(self._queue) >= self._capacity and not self._closed:
                self._lock.wait()
            if self._closed:
                return
            last, sends = self._queue[-1] if self._queue else (None, 0)
            if (
                isinstance(message, wire.DecodeTokens)
                and isinstance(last, wire.DecodeTokens)
                and last.instance_id == message.instance_id
            ):
                self._queue[-1] = (attrs.evolve(message, tokens=last.tokens + message.tokens), sends + 1)
            else:
                self._queue.append((message, 1))
            self._queued += 1
            self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every message sent so far was delivered or dropped; False if `timeout` passed first."""
        with self._lock:
            target = self._queued
            return self._lock.wait_for(lambda: self._sent >= target or self._closed, timeout=timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sender after the messages already queued (at most `timeout` seconds)."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                message, sends = self._queue.popleft()
                self._lock.notify_all()  # room for a blocked `send`
            try:
                self._call(message)
            except (MooncakeError, OSError):
                pass  # a gateway gone is a cluster shutting down
            except Exception as error:  # never let the sender die: `flush` and a full `send` would wait forever
                print(f"{self._thread.name}: dropped a {type(message).__name__}: {error!r}", file=sys.stderr)
            with self._lock:
                self._sent += sends
                self._lock.notify_all()
