"""A `VllmRouter` served from a thread of its own (its own event loop): for tests and benchmarks that call it
over HTTP from synchronous code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from vllm_fleet.config import RouterConfig
from vllm_fleet.proxy import VllmRouter

__all__ = ["BackgroundRouter"]

T = TypeVar("T")


class BackgroundRouter:
    """Starts the router (probes, binds, serves) and stops it on `close` or at the end of a `with`."""

    def __init__(self, config: RouterConfig, *, timeout_s: float = 60.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-router", daemon=True)
        self.thread.start()
        self.router = VllmRouter(config)
        try:
            self.url = asyncio.run_coroutine_threadsafe(self.router.start(), self.loop).result(timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    def read(self, function: Callable[[VllmRouter], T], timeout_s: float = 10.0) -> T:
        """`function(router)` run on the router's loop (its state is not thread-safe)."""

        async def call() -> T:
            return function(self.router)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout_s)

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.router.close(), self.loop).result(30)
        finally:
            self._stop_loop()
            if self.router.fleet is not None:  # a close that ran out of time still lets go of the sockets
                self.router.fleet.close()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def __enter__(self) -> BackgroundRouter:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()
