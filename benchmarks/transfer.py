"""Transfer throughput and latency on loopback, against a raw socket, memcpy and the upstream engine.

    python benchmarks/transfer.py [--json] [--repeats 5] [--no-upstream]

Measured in one run, each between two processes (this one initiates, a peer
process owns the target memory):
- ours over tcp and over shm: one WRITE of 1, 16 and 64 MiB (median of repeats
  of the mean over enough writes to move 64 MiB, the same for every peer),
  a batch of 32 × 1 MiB, and the median latency of a synchronous 4 KiB write;
- a raw two-process socket stream: sendall of the same sizes into a receiver
  that recv_into's a buffer and acknowledges, on one connection;
- memcpy: one np.copyto of the same sizes, in one thread;
- the upstream Mooncake Transfer Engine over its tcp transport (PyPI
  mooncake-transfer-engine-non-cuda, installed into build/upstream-te-venv on
  first use; it needs Debian's libibverbs1), driven the same way by
  benchmarks/upstream_te.py;
- the cost of verifying a checksummed WRITE before it becomes visible: a sender
  process sends checksummed WRITEs of 4 and 64 KiB, 1, 4 (the default slice)
  and 64 MiB (the largest frame), one at a time,
  to a connection served here by the engine's own `tcp.serve_connection`
  (staged: received aside, hashed, then copied into the region) and, on
  another connection, by the path it replaced, reproduced below (received
  straight into the region, then hashed: a payload that fails lands anyway);
  samples alternate between the two connections, and `staged_vs_in_place`
  is the median throughput ratio of paired samples, per size.
Every figure is the median over `--rounds` whole rounds (each measures every
peer once).

The raw socket and memcpy are single-stream references, not ceilings: ours
cuts a request into slices of 4 MiB (`EngineConfig.slice_bytes`) spread over
several streams (tcp) or copy threads (shm), so at 16 and 64 MiB it does in
parallel what they do in one stream, and may pass them. Only at 1 MiB (one
slice: one stream, one copy) do both sides do the same work, so the ratios
`tcp_vs_raw_socket` and `shm_vs_memcpy` are taken there (`peer_ratios_at`);
the larger sizes' figures are printed beside them for what they are. The
upstream engine slices and spreads its own way: `tcp_vs_upstream`, engine
against engine, is the lowest ratio over the sizes.

Goals: tcp_vs_upstream >= 1.5, tcp_vs_raw_socket >= 0.8, shm_vs_memcpy >= 0.7,
tcp_4kib_median_us <= upstream_4kib_median_us.

JSON keys (GB/s are 10^9 bytes per second; per-size dicts keyed "1MiB_gbps",
"16MiB_gbps", "64MiB_gbps", the checksum ones "4KiB_gbps" to "64MiB_gbps"):
- tcp_gbps, shm_gbps, raw_socket_gbps, memcpy_gbps: one WRITE (one send, one
  copy) per size;
- tcp_batch_32x1mib_gbps, shm_batch_32x1mib_gbps; tcp_4kib_median_us,
  shm_4kib_median_us;
- tcp_vs_raw_socket, shm_vs_memcpy (at 1 MiB), peer_ratios_at ("1MiB");
- checksummed_write_staged_gbps, checksummed_write_in_place_gbps (per size),
  staged_vs_in_place (per size: the median paired ratio);
- with the upstream engine: upstream_te_gbps (per size),
  upstream_batch_32x1mib_gbps, upstream_4kib_median_us, tcp_vs_upstream;
  without it, upstream_te: why it was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from mooncake.errors import TransferError
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.region import Region, RegionDescriptor
from mooncake.transfer.request import EngineConfig, RequestState, TransferOp, TransferRequest
from mooncake.transfer.staging import StagingPool
from mooncake.transfer.wire import Frame, Json, Kind, bind_checksum, recv_exact, recv_frame, send_frame

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
SIZES = [MIB, 16 * MIB, 64 * MIB]
EQUAL_WORK = "1MiB_gbps"  # under the engine's 4 MiB slice: ours moves it as the single-stream peers do
SECRET = os.urandom(32)
UPSTREAM_VENV = ROOT / "build" / "upstream-te-venv"


def median_time(run: Callable[[], None], repeats: int, *, calls: int = 1) -> float:
    """Median over `repeats` samples of the mean time of `calls` consecutive runs."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def calls_for(size: int) -> int:
    """Runs per sample, so that each sample moves about 64 MiB whatever the size."""
    return max(1, (64 * MIB) // size)


def ours(repeats: int, samples: int) -> dict[str, dict[str, float]]:
    space = max(SIZES)
    peer = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "transfer_peer.py"), SECRET.hex(), str(space)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict[str, dict[str, float]] = {}
    try:
        info = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
        for transport in ("tcp", "shm"):
            with TransferEngine(secret=SECRET, config=EngineConfig(transports=(transport,))) as engine:
                local, buffer = engine.allocate_shared(space)
                buffer[:] = 7
                name = engine.connect(info["address"])

                def write(
                    length: int,
                    count: int = 1,
                    engine: TransferEngine = engine,
                    name: str = name,
                    region: int = local.region_id,
                ) -> None:
                    # One request: the synchronous path (as upstream's transfer_sync_write);
                    # a batch: submit and wait (as upstream's batch_transfer_sync_write).
                    requests = [
                        TransferRequest(
                            op=TransferOp.WRITE,
                            local_region=region,
                            local_offset=i * length,
                            peer=name,
                            remote_region=info["region"],
                            remote_offset=i * length,
                            length=length,
                        )
                        for i in range(count)
                    ]
                    if count == 1:
                        statuses = engine.transfer_sync(requests, timeout=60)
                    else:
                        batch = engine.submit(requests)
                        statuses = engine.wait(batch, timeout=60)
                        engine.forget(batch)
                    assert all(s.state == RequestState.DONE for s in statuses), statuses

                figures = {
                    f"{size // MIB}MiB_gbps": size
                    / median_time(lambda size=size: write(size), repeats, calls=calls_for(size))
                    / 1e9
                    for size in SIZES
                }
                figures["batch_32x1mib_gbps"] = 32 * MIB / median_time(lambda: write(MIB, 32), repeats, calls=2) / 1e9
                latencies = []
                for _ in range(samples):
                    start = time.perf_counter()
                    write(4096)
                    latencies.append(time.perf_counter() - start)
                figures["4kib_median_us"] = statistics.median(latencies) * 1e6
                results[transport] = figures
    finally:
        peer.stdin.close()  # type: ignore[union-attr]
        peer.wait(timeout=30)
    return results


_RECEIVER = """
import socket, sys
size = int(sys.argv[1]); buffer = memoryview(bytearray(size))
server = socket.create_server(("127.0.0.1", 0)); print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
while True:
    header = connection.recv(8, socket.MSG_WAITALL)
    if len(header) < 8:
        break
    want, got = int.from_bytes(header, "little"), 0
    while got < want:
        got += connection.recv_into(buffer[got:want], want - got)
    connection.sendall(b"k")
"""


def raw_socket(repeats: int) -> dict[str, float]:
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(max(SIZES))], stdout=subprocess.PIPE, text=True)
    try:
        port = int(receiver.stdout.readline())  # type: ignore[union-attr]
        payload = memoryview(np.full(max(SIZES), 7, dtype=np.uint8).data)
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def send(size: int) -> None:
                connection.sendall(size.to_bytes(8, "little"))
                connection.sendall(payload[:size])
                connection.recv(1)

            return {
                f"{size // MIB}MiB_gbps": size
                / median_time(lambda size=size: send(size), repeats, calls=calls_for(size))
                / 1e9
                for size in SIZES
            }
    except BaseException:
        receiver.kill()  # it may still be blocked in accept(): nothing connected
        raise
    finally:
        receiver.wait(timeout=30)


def memcpy(repeats: int) -> dict[str, float]:
    source = np.full(max(SIZES), 7, dtype=np.uint8)
    target = np.zeros_like(source)
    return {
        f"{size // MIB}MiB_gbps": size
        / median_time(lambda size=size: np.copyto(target[:size], source[:size]), repeats, calls=calls_for(size))
        / 1e9
        for size in SIZES
    }


def upstream(repeats: int, samples: int) -> dict[str, object] | str:
    """The upstream engine's figures, or why they could not be taken."""
    if ctypes.util.find_library("ibverbs") is None:
        return "needs Debian's libibverbs1 (apt-get install libibverbs1)"
    python = UPSTREAM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(UPSTREAM_VENV)], check=True)
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "mooncake-transfer-engine-non-cuda"],
            capture_output=True,
            text=True,
        )
        if install.returncode != 0:
            shutil.rmtree(UPSTREAM_VENV, ignore_errors=True)  # so that the next run installs again
            return f"pip install mooncake-transfer-engine-non-cuda failed: {install.stderr.strip()[-300:]}"
    run = subprocess.run(
        [
            str(python),
            str(ROOT / "benchmarks" / "upstream_te.py"),
            "--sizes",
            ",".join(map(str, SIZES)),
            "--repeats",
            str(repeats),
            "--latency-samples",
            str(samples),
        ],
        capture_output=True,
        text=True,
        cwd="/",  # so that the upstream `mooncake` package, not ours, is imported
        timeout=600,
    )
    if run.returncode != 0:
        return f"upstream benchmark failed: {run.stderr.strip()[-300:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


CHECKSUM_SIZES = [4096, 64 << 10, MIB, 4 * MIB, 64 * MIB]  # 4 MiB: the default slice; 64 MiB: the largest frame

_SENDER = """
import json, socket, statistics, sys, time
import numpy as np, xxhash
from mooncake.transfer.wire import Frame, Kind, bind_checksum, recv_exact, recv_frame, send_frame
port, pairs, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # accepted in this order
for sock in connections:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
figures = {}
for size in sizes:
    payload = memoryview(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).data)
    header = Frame(Kind.WRITE, region=1, length=size)
    frame = Frame(Kind.WRITE, region=1, length=size, checksum=bind_checksum(header, xxhash.xxh3_64_intdigest(payload)))
    calls = max(1, (16 << 20) // size)
    def sample(sock):
        start = time.perf_counter()
        for _ in range(calls):
            send_frame(sock, frame, payload)
            reply = recv_frame(sock, max_length=1 << 20)
            recv_exact(sock, memoryview(bytearray(reply.length)))
            assert reply.kind == Kind.OK, reply
        return (time.perf_counter() - start) / calls
    for sock in connections:
        sample(sock)  # warm up both paths
    # Paired, interleaved samples: a busy machine's slow moments hit both paths alike.
    times = [[sample(sock) for sock in connections] for _ in range(pairs)]
    figures[size] = {
        "staged": size / statistics.median(t[0] for t in times) / 1e9,
        "in_place": size / statistics.median(t[1] for t in times) / 1e9,
        "ratio": statistics.median(t[1] / t[0] for t in times),
    }
print(json.dumps(figures))
"""


class _Served:
    """What `tcp.serve_connection` needs of an engine: one region of `size` bytes, and staging memory."""

    def __init__(self, size: int) -> None:
        self.config = EngineConfig(spin_us=0)  # both paths block for the next frame alike
        self.staging = StagingPool(self.config.max_staging_bytes)
        self.buffer = np.zeros(size, dtype=np.uint8)
        self._region = Region(RegionDescriptor(region_id=1, length=size), self.buffer.data)

    def region(self, region_id: int) -> Region | None:
        return self._region if region_id == 1 else None

    def handle_call(self, method: str, args: object) -> Json:
        raise TransferError(f"no calls here ({method})")


def _serve_in_place(sock: socket.socket, served: _Served) -> None:
    """The WRITE path before staging: the payload lands in the region, then is hashed."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(served.config.io_timeout_s)
        while True:
            frame = recv_frame(sock, max_length=served.config.max_frame_bytes)
            target = served._region.slice(frame.offset, frame.length)
            recv_exact(sock, target)
            if frame.checksum is not None and bind_checksum(frame, xxhash.xxh3_64_intdigest(target)) != frame.checksum:
                message = b"WRITE payload failed its end-to-end checksum"
                send_frame(sock, Frame(Kind.ERROR, tag=frame.tag, length=len(message)), message)
                continue
            send_frame(sock, Frame(Kind.OK, tag=frame.tag))


def checksum_paths(repeats: int) -> dict[str, dict[str, float]]:
    """Checksummed WRITE throughput (GB/s) per size, staged and in place, and their paired ratio.

    One sender process, two connections: the first served by `tcp.serve_connection`
    (staged), the second by `_serve_in_place`; samples alternate between them.
    """
    served = _Served(max(CHECKSUM_SIZES))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = subprocess.Popen(
            [sys.executable, "-c", _SENDER, str(listener.getsockname()[1]), str(3 * repeats), _sizes(CHECKSUM_SIZES)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            connections = _accept(listener, 2, sender)
            servers = [
                threading.Thread(target=tcp.serve_connection, args=(connections[0], served), daemon=True),
                threading.Thread(target=_serve_in_place, args=(connections[1], served), daemon=True),
            ]
            for server in servers:
                server.start()
            out, _ = sender.communicate(timeout=600)
            for connection in connections:
                connection.close()
            for server in servers:
                server.join(timeout=30)
        finally:
            if sender.poll() is None:  # failed here or timed out: leave no sender behind
                sender.kill()
                sender.wait()
    if sender.returncode != 0:
        raise RuntimeError(f"the checksum sender failed with {sender.returncode}")
    measured = {int(size): figures for size, figures in json.loads(out).items()}
    return {
        name: {_size_key(size): figures[name] for size, figures in measured.items()}
        for name in ("staged", "in_place", "ratio")
    }


def _accept(
    listener: socket.socket, count: int, sender: subprocess.Popen[str], timeout_s: float = 60
) -> list[socket.socket]:
    """`count` connections from `sender`, or RuntimeError as soon as it exits without making them (or after
    `timeout_s`): accept() alone would wait for a dead sender forever."""
    listener.settimeout(1.0)
    deadline = time.monotonic() + timeout_s
    accepted: list[socket.socket] = []
    while len(accepted) < count:
        try:
            accepted.append(listener.accept()[0])
        except TimeoutError:
            if sender.poll() is None and time.monotonic() < deadline:
                continue
            for connection in accepted:
                connection.close()
            why = (
                f"it exited with {sender.returncode}" if sender.returncode is not None else f"{timeout_s:.0f} s passed"
            )
            raise RuntimeError(f"the checksum sender made {len(accepted)} of {count} connections: {why}") from None
    return accepted


def _sizes(sizes: list[int]) -> str:
    return ",".join(map(str, sizes))


def _size_key(size: int) -> str:
    return f"{size // 1024}KiB_gbps" if size < MIB else f"{size // MIB}MiB_gbps"


def _median_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(d[key] for d in dicts) for key in dicts[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-samples", type=int, default=500)
    parser.add_argument("--no-upstream", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="whole measurement rounds; medians are reported")
    args = parser.parse_args()
    for option in ("repeats", "latency_samples", "rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    # Whole rounds, each measuring every peer once, and medians over rounds: a
    # shared machine's slow minutes then hit all of them alike.
    rounds = []
    for _ in range(args.rounds):
        theirs_now = "skipped (--no-upstream)" if args.no_upstream else upstream(args.repeats, args.latency_samples)
        rounds.append(
            (
                ours(args.repeats, args.latency_samples),
                raw_socket(args.repeats),
                memcpy(args.repeats),
                theirs_now,
                checksum_paths(args.repeats),
            )
        )
    measured = {t: _median_dicts([r[0][t] for r in rounds]) for t in ("tcp", "shm")}
    raw = _median_dicts([r[1] for r in rounds])
    copy = _median_dicts([r[2] for r in rounds])
    staged = _median_dicts([r[4]["staged"] for r in rounds])
    in_place = _median_dicts([r[4]["in_place"] for r in rounds])
    paired = _median_dicts([r[4]["ratio"] for r in rounds])
    upstream_rounds = [r[3] for r in rounds if isinstance(r[3], dict)]
    if upstream_rounds:
        theirs: dict[str, object] | str = {
            "gbps": _median_dicts([u["gbps"] for u in upstream_rounds]),  # type: ignore[misc]
            "4kib_median_us": statistics.median(u["4kib_median_us"] for u in upstream_rounds),  # type: ignore[misc]
            "batch_32x1mib_gbps": statistics.median(u["batch_32x1mib_gbps"] for u in upstream_rounds),  # type: ignore[misc]
        }
    else:
        theirs = rounds[0][3]
    result: dict[str, object] = {
        "tcp_gbps": {k: v for k, v in measured["tcp"].items() if k.endswith("MiB_gbps")},
        "shm_gbps": {k: v for k, v in measured["shm"].items() if k.endswith("MiB_gbps")},
        "raw_socket_gbps": raw,
        "memcpy_gbps": copy,
        "tcp_batch_32x1mib_gbps": measured["tcp"]["batch_32x1mib_gbps"],
        "shm_batch_32x1mib_gbps": measured["shm"]["batch_32x1mib_gbps"],
        "tcp_4kib_median_us": measured["tcp"]["4kib_median_us"],
        "shm_4kib_median_us": measured["shm"]["4kib_median_us"],
        # At 1 MiB only: one slice, so one stream and one copy on both sides (see the module's docstring).
        "tcp_vs_raw_socket": measured["tcp"][EQUAL_WORK] / raw[EQUAL_WORK],
        "shm_vs_memcpy": measured["shm"][EQUAL_WORK] / copy[EQUAL_WORK],
        "peer_ratios_at": EQUAL_WORK.removesuffix("_gbps"),
        "checksummed_write_staged_gbps": staged,
        "checksummed_write_in_place_gbps": in_place,
        "staged_vs_in_place": paired,  # median of paired samples' throughput ratios
    }
    if isinstance(theirs, dict):
        upstream_gbps = {f"{int(k) // MIB}MiB_gbps": v for k, v in theirs["gbps"].items()}  # type: ignore[union-attr]
        result["upstream_te_gbps"] = upstream_gbps
        result["upstream_batch_32x1mib_gbps"] = theirs["batch_32x1mib_gbps"]
        result["upstream_4kib_median_us"] = theirs["4kib_median_us"]
        result["tcp_vs_upstream"] = min(measured["tcp"][k] / upstream_gbps[k] for k in upstream_gbps)
    else:
        result["upstream_te"] = theirs
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'':28}" + "".join(f"{s // MIB:>8} MiB" for s in SIZES))
    rows = [
        ("ours tcp", result["tcp_gbps"]),
        ("ours shm", result["shm_gbps"]),
        ("raw socket, 1 stream", raw),
        ("memcpy, 1 thread", copy),
    ]
    if "upstream_te_gbps" in result:
        rows.append(("upstream TE (tcp)", result["upstream_te_gbps"]))
    for label, figures in rows:
        print(f"{label + ' GB/s':28}" + "".join(f"{figures[f'{s // MIB}MiB_gbps']:12.2f}" for s in SIZES))  # type: ignore[index]
    print(
        f"batch 32 x 1 MiB GB/s       tcp {result['tcp_batch_32x1mib_gbps']:.2f}  shm {result['shm_batch_32x1mib_gbps']:.2f}  upstream {result.get('upstream_batch_32x1mib_gbps', float('nan')):.2f}"
    )
    print(
        f"4 KiB median latency us     tcp {result['tcp_4kib_median_us']:.1f}  shm {result['shm_4kib_median_us']:.1f}  upstream {result.get('upstream_4kib_median_us', float('nan')):.1f}"
    )
    print(
        f"ratios                      tcp/raw {result['tcp_vs_raw_socket']:.2f}  shm/memcpy {result['shm_vs_memcpy']:.2f} "
        f"(1 MiB: equal work)  tcp/upstream {result.get('tcp_vs_upstream', float('nan')):.2f} (lowest)"
    )
    if "upstream_te" in result:
        print(f"upstream: {result['upstream_te']}")
    keys = [_size_key(size) for size in CHECKSUM_SIZES]
    print()
    print(f"{'checksummed WRITE, served':28}" + "".join(f"{key.removesuffix('_gbps'):>12}" for key in keys))
    for label, figures in (("staged (now) GB/s", staged), ("in place (before) GB/s", in_place)):
        print(f"{label:28}" + "".join(f"{figures[key]:12.2f}" for key in keys))
    ratio = result["staged_vs_in_place"]
    print(f"{'ratio staged/in place':28}" + "".join(f"{ratio[key]:12.2f}" for key in keys))  # type: ignore[index]


if __name__ == "__main__":
    main()
