"""The upstream Mooncake Transfer Engine, measured like ours (run with its own venv's Python).

    <upstream venv>/bin/python benchmarks/upstream_te.py --sizes 1048576,... --repeats N

Starts a target process, then writes to it over the upstream TCP transport
(`initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`, `transfer_sync_write`,
`batch_transfer_sync_write`) and prints one JSON object. Never imports our
package: the upstream wheel installs a package also named `mooncake`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def engine():  # type: ignore[no-untyped-def]
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("upstream TransferEngine.initialize failed")
    return te


def target(size: int) -> None:
    te = engine()
    address = te.allocate_managed_buffer(size)
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "address": address}), flush=True)
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="1048576,16777216,67108864")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-samples", type=int, default=500)
    args = parser.parse_args()
    if args.target:
        target(args.target)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    space = max(max(sizes), 32 << 20)
    child = subprocess.Popen(
        [sys.executable, __file__, "--target", str(space)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        info = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        te = engine()
        source = te.allocate_managed_buffer(space)
        session, remote = info["session"], info["address"]

        def timed(run, calls: int = 1) -> float:  # type: ignore[no-untyped-def]
            run()  # warm-up
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    if run() != 0:
                        raise SystemExit("an upstream transfer failed")
                samples.append((time.perf_counter() - start) / calls)
            return statistics.median(samples)

        result = {"gbps": {}}
        for size in sizes:
            seconds = timed(
                lambda size=size: te.transfer_sync_write(session, source, remote, size), max(1, (64 << 20) // size)
            )
            result["gbps"][str(size)] = size / seconds / 1e9
        latencies = []
        for _ in range(args.latency_samples):
            start = time.perf_counter()
            if te.transfer_sync_write(session, source, remote, 4096) != 0:
                raise SystemExit("an upstream 4 KiB transfer failed")
            latencies.append(time.perf_counter() - start)
        result["4kib_median_us"] = statistics.median(latencies) * 1e6
        mib = 1 << 20
        seconds = timed(
            lambda: te.batch_transfer_sync_write(
                session, [source + i * mib for i in range(32)], [remote + i * mib for i in range(32)], [mib] * 32
            ),
            2,
        )
        result["batch_32x1mib_gbps"] = 32 * mib / seconds / 1e9
        print(json.dumps(result))
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=30)


if __name__ == "__main__":
    main()
