"""Start and stop vLLM servers on this machine (loopback), for the integration tests and the benchmark.

    with VllmFleet.start(python=".venv-vllm/bin/python", model=DIR, count=2) as fleet:
        fleet.router_config(...)   # the [[instances]] tables of a router in front of them

Each server is `python -m vllm.entrypoints.openai.api_server` from the vLLM
environment (`make test-vllm` builds it) with the recipe vLLM's CPU build needs
(`VLLM_TARGET_DEVICE=cpu`, `--kv-cache-memory-bytes` of KV cache, nothing
downloaded), prefix caching, `--block-size`, prompt-token details in usage, and
KV events to an endpoint the router binds (vLLM connects to it) with a replay
socket vLLM binds; its compute threads on a core of its own (vLLM pins every
server to core 0 otherwise); without torch.compile (`-O0`), in float32, and reserving a fifth of the
memory each (`--gpu-memory-utilization`: vLLM's CPU backend refuses to start
when less than its share is free). Each runs in a process group of its own; `stop` sends the
group SIGTERM, then SIGKILL after a grace period, so no engine process or port
outlives it, and unlinks the shared memory the group mapped, which a killed
engine leaves behind. Start-up takes about a minute for two servers on two cores;
`start` waits for every `/health`, bounded by `timeout_s`, and on failure
stops them all and raises with the tail of the failed server's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["SERVED_DTYPE", "VllmFleet", "VllmServer", "free_port"]

# The weights' and the KV cache's dtype the servers run in. In eager mode bfloat16 (vLLM's CPU default) is
# several times slower than float32 on a CPU without bfloat16 units.
SERVED_DTYPE = "float32"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listen_port(attempts: int = 200) -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range, for a listener its peers connect to
    before it binds: vLLM's event publisher connects from its server's start, retrying every 100 ms, and a port in
    the ephemeral range can meanwhile become the source port of one of those very attempts (TCP's simultaneous
    open connects a socket to itself) or of any other connection, and the listener then finds it taken. The
    kernel's pick where no port below the range is free."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    draw = random.Random()  # a fresh seed: parallel test runs do not race for the same ports
    for _ in range(attempts if low > 11_000 else 0):
        port = draw.randrange(10_000, low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@attrs.define(eq=False)
class VllmServer:
    """One server: its process, HTTP port, the events endpoint it connects to, its replay port and log, and the
    folder of its processes' ZeroMQ sockets (`VLLM_RPC_BASE_PATH`; None: vLLM's default, the temporary folder)."""

    process: subprocess.Popen[bytes]
    port: int
    events_port: int
    replay_port: int
    log: Path
    core: int
    rpc_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def group(self) -> list[int]:
        """The live processes of the server's process group (zombies, which hold nothing, left out)."""
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it just exited
            if int(fields[2]) == self.process.pid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
                alive.append(int(stat.parent.name))
        return alive

    def shared_memory(self) -> set[Path]:
        """The /dev/shm files the server's processes map: vLLM's message queues between its API server and
        engine core (hundreds of MB each, created without a name of ours) and their semaphores."""
        found = set()
        for pid in self.group():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue  # it just exited
            for line in maps.splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    found.add(Path(fields[5].removesuffix(" (deleted)")))
        return found

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL to what is left of it after `grace_s`; then the shared memory
        its processes mapped is unlinked, and the folder of its sockets removed. A process killed cannot unlink
        what it created: without this a killed server's queues stayed in /dev/shm (about 400 MB of it per server)
        until the machine restarted, and its sockets in /tmp (two per server) for good."""
        segments = self.shared_memory()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            self._wait_for_group(grace_s)  # the engine core too, which cleans up after the API server exits
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._wait_for_group(10.0)  # SIGKILL lands at once, but not in no time
        for path in segments:  # a group's own: nothing outside it maps vLLM's queues
            with contextlib.suppress(OSError):
                path.unlink()
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def _wait_for_group(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.process.poll()  # reaps the server itself once it exits (a zombie counts as gone)
            if not self.group() or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@attrs.define(eq=False)
class VllmFleet:
    """Servers started together; a context manager that stops them all."""

    servers: list[VllmServer]
    model: Path
    block_size: int

    @classmethod
    def start(
        cls,
        *,
        python: str | Path,
        model: Path,
        count: int,
        log_dir: Path,
        block_size: int = 32,
        kv_cache_bytes: int = 1 << 30,
        max_model_len: int = 2048,
        timeout_s: float = 420.0,
        extra_args: Sequence[str] = (),
    ) -> VllmFleet:
        """`count` servers of `model`, each healthy (or RuntimeError after stopping them all)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        fleet = cls([], model, block_size)
        try:
            for number in range(count):
                fleet.servers.append(
                    _launch(
                        python,
                        model,
                        log_dir / f"vllm-{number}.log",
                        block_size,
                        kv_cache_bytes,
                        max_model_len,
                        extra_args,
                        core=number % (os.cpu_count() or 1),
                    )
                )
            fleet.wait_healthy(timeout_s)
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            while not server.healthy():
                if server.process.poll() is not None:
                    raise RuntimeError(f"vLLM server on port {server.port} exited:\n{server.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM server on port {server.port} not healthy in {timeout_s:g} s:\n{server.tail()}"
                    )
                time.sleep(1.0)

    def instances_toml(self, *, roles: Sequence[str] | None = None) -> str:
        """The router's `[[instances]]` tables for these servers."""
        tables = []
        for number, server in enumerate(self.servers):
            role = roles[number] if roles is not None else "both"
            tables.append(
                f'[[instances]]\nurl = "{server.url}"\nkv_events = "tcp://127.0.0.1:{server.events_port}"\n'
                f'replay = "tcp://127.0.0.1:{server.replay_port}"\nrole = "{role}"\n'
            )
        return "\n".join(tables)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> VllmFleet:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[VllmServer]:
        return iter(self.servers)


def _environment(core: int, rpc_dir: Path) -> dict[str, Any]:
    return {
        **os.environ,
        # vLLM's API server and engine core talk over sockets it names in this folder (the temporary folder by
        # default); a folder of the server's own is removed with it, sockets a killed process left included.
        "VLLM_RPC_BASE_PATH": str(rpc_dir),
        # vLLM pins every server's compute threads to core 0 by default: two servers would then share one
        # core, spinning in each other's way (multi-second stalls); each gets a core of its own.
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache (the benchmark empties the caches between policies)
    }


def _launch(
    python: str | Path,
    model: Path,
    log: Path,
    block_size: int,
    kv_cache_bytes: int,
    max_model_len: int,
    extra_args: Sequence[str],
    core: int,
    memory_share: float = 0.2,
) -> VllmServer:
    port, events_port, replay_port = free_port(), listen_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        model.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        # vLLM's CPU backend reserves this share of the machine's memory and refuses to start when less is
        # free (0.92 by default: a second server, or a restarted one beside the first, would not start).
        "--gpu-memory-utilization",
        str(memory_share),
        # No torch.compile: start-up in about half the time.
        "-O0",
        "--dtype",
        SERVED_DTYPE,
        "--kv-events-config",
        json.dumps(events),
        *extra_args,
    ]
    # Short (a socket's path has at most 107 bytes, and a test's log folder can be long), in the temporary folder.
    rpc_dir = Path(tempfile.mkdtemp(prefix="mooncake-vllm-"))
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=_environment(core, rpc_dir), start_new_session=True
            )
    except BaseException:
        shutil.rmtree(rpc_dir, ignore_errors=True)
        raise
    return VllmServer(process, port, events_port, replay_port, log, core, rpc_dir)
