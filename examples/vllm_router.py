"""A KV-cache-centric router in front of vLLM servers: Algorithm 1 and early rejection over their KV events.

    python examples/vllm_router.py --config router.toml

Prints the router's URL once every server has been probed and the KV-event
endpoints are bound; Ctrl-C or SIGTERM stops it. Point any OpenAI client at
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
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_fleet.config import load_router_config
from vllm_fleet.proxy import VllmRouter

from mooncake.cli import OneLineParser
from mooncake.errors import MooncakeError

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
"""`--log-level`'s choices: logging's level names (basicConfig refuses another, with a traceback)."""


async def serve(config_path: Path, port: int | None) -> None:
    config = load_router_config(config_path)
    if port is not None:
        config = attrs.evolve(config, router=attrs.evolve(config.router, port=port))
    router = VllmRouter(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    url = await router.start()
    try:
        names = ", ".join(f"{i.instance_id}={i.url} ({i.section.role})" for i in router.fleet.instances.values())  # type: ignore[union-attr]
        print(f"vllm router ready: {url}  (model {router.model}; {names}; OpenAI API at {url}/v1)", flush=True)
        await stop.wait()
    finally:
        print("stopping...", flush=True)
        await router.close()


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--port", type=int, default=None, help="override [router] port (0: any free port)")
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
