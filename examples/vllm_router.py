"""A KV-cache-centric router in front of vLLM servers: Algorithm 1 and early rejection over their KV events.

    python examples/vllm_router.py --config router.toml

Prints the router's URL once every server has been probed and the KV-event
endpoints are bound; Ctrl-C or SIGTERM stops it (exit status 0), while it
starts too: the probes and calibration, which can take minutes, are cancelled
and it never serves. Point any OpenAI client at
`URL/v1`. Each vLLM server runs with prefix caching and KV events published to
the endpoint its `[[instances]]` table names (the router binds it; vLLM
connects):

    python -m vllm.entrypoints.openai.api_server --model DIR --enable-prefix-caching --block-size 32 \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://ROUTER_HOST:5557", "replay_endpoint": "tcp://*:5558"}'

The config (`vllm_fleet.config`), how requests are routed (`vllm_fleet.fleet`)
and served (`vllm_fleet.proxy`): docs/vllm.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_fleet.config import load_router_config
from vllm_fleet.proxy import VllmRouter

from mooncake.cli import OneLineParser, port
from mooncake.errors import MooncakeError

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
"""`--log-level`'s choices: logging's level names (basicConfig refuses another, with a traceback)."""
T = TypeVar("T")


async def serve(config_path: Path, port: int | None) -> None:
    config = load_router_config(config_path)
    if port is not None:
        config = attrs.evolve(config, router=attrs.evolve(config.router, port=port))
    router = VllmRouter(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    url = await unless_stopped(router.start(), stop)
    if url is None:  # `start` closed what it had opened (a failed start does the same): nothing to close
        print("stopped while starting", flush=True)
        return
    try:
        names = ", ".join(f"{i.instance_id}={i.url} ({i.section.role})" for i in router.fleet.instances.values())  # type: ignore[union-attr]
        print(f"vllm router ready: {url}  (model {router.model}; {names}; OpenAI API at {url}/v1)", flush=True)
        await stop.wait()
    finally:
        print("stopping...", flush=True)
        await router.close()


async def unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None when `stop` is set first: `work` is then cancelled and waited for.

    Raises:
        BaseException: whatever `work` raised, but the cancellation asked for here.
    """
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # not `await task`: its CancelledError and this coroutine's own look alike
    if not task.cancelled():
        task.result()  # it failed on its way out: that error, not a quiet stop
    return None


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--port", type=port, default=None, help="override [router] port (0: any free port)")
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default="WARNING", help="in any case: debug is DEBUG"
    )
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args.config, args.port))
    except MooncakeError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
