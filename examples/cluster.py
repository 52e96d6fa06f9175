"""Launch the example cluster: prefill and decode engines, the Conductor, an OpenAI-compatible gateway.

    python examples/cluster.py --config examples/configs/tiny.toml [--backend local|ray] [--ray-address ADDR]
        [--ray-dashboard] [--port 8000]

Prints the gateway's URL once it is ready; Ctrl-C or SIGTERM stops everything
(no orphan process, no leftover shared memory). If the launcher dies some other
way (SIGKILL, a crash), its workers notice and exit within seconds, unlinking
their shared memory; the next launcher removes whatever a dead one left.
Point any OpenAI client at `URL/v1`:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="tiny", prompt="Hello", max_tokens=16)

`GET /metrics` serves Prometheus metrics, `GET /health` the engines' state.
`--backend ray` starts a Ray head whose servers all listen on `[cluster] host`
(127.0.0.1 by default), without Ray's dashboard unless `--ray-dashboard`; across
machines, see docs/cluster.md's Ray section.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake._extras import script_needs_extra
from mooncake.cli import OneLineParser, port
from mooncake.errors import MooncakeError

with script_needs_extra("cluster"):  # the gateway's aiohttp: the cluster extra, named (not a traceback)
    from serving.config import load_config
    from serving.launch import CLOSE_S, start_cluster
    from serving.machine import Machine

STOP_REPORT_S = CLOSE_S + 10.0  # longer than a stop of local workers takes by design, with a margin


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).parent / "configs" / "tiny.toml")
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: a local one)")
    parser.add_argument("--ray-dashboard", action="store_true", help="start Ray's dashboard (on [cluster] host)")
    parser.add_argument("--port", type=port, default=None, help="override [cluster] port (0: any free port)")
    args = parser.parse_args()
    if args.backend != "ray":  # the local backend would ignore them: a launch here, not the one asked for
        for option, value in (("--ray-address", args.ray_address), ("--ray-dashboard", args.ray_dashboard)):
            if value:
                parser.error(f"{option} needs --backend ray")
    try:
        # Against a Ray cluster elsewhere, this machine's memory and files bound nothing: check the config alone.
        remote = args.backend == "ray" and args.ray_address
        config = load_config(args.config, machine=Machine() if remote else None)
        if args.port is not None:
            config = config.with_overrides("cluster", port=args.port)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        cluster = start_cluster(
            config, backend=args.backend, ray_address=args.ray_address, ray_dashboard=args.ray_dashboard
        )
    except MooncakeError as error:
        sys.exit(f"error: {error}")
    try:
        if cluster.removed_segments:
            print(f"removed {len(cluster.removed_segments)} shared-memory segments of dead processes", flush=True)
        p, d = config.cluster.num_prefill, config.cluster.num_decode
        print(
            f"mooncake cluster ready: {cluster.url}  ({p} prefill + {d} decode, {config.model.served_name} model, "
            f"{args.backend} backend; OpenAI API at {cluster.url}/v1)",
            flush=True,
        )
        # Waited on in slices: the kernel may hand SIGTERM to any of the launcher's threads, and then CPython runs
        # the handler only when the main thread next looks, which a wait without a timeout never does (the
        # launcher once stayed up for good after a SIGTERM, about one run in a few hundred).
        while not stop.wait(0.5):
            pass
    finally:
        print("stopping...", flush=True)
        # A stop is bounded (the gateway, then every worker's grace period): if it is not done in
        # STOP_REPORT_S, say where each thread is, so that a hang shows where it hangs.
        faulthandler.dump_traceback_later(STOP_REPORT_S, exit=False)
        cluster.close()
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
