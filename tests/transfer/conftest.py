"""Peer engines in real processes on 127.0.0.1, cleaned up whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from mooncake.errors import TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig, TransferOp, TransferRequest
from tests.transfer.fake_verbs import FakeFabric, FakeVerbs

SECRET = bytes(range(32))
ROOT = Path(__file__).resolve().parents[2]


def request(
    op: TransferOp, local: int, peer: str, remote: int, length: int, *, local_offset: int = 0, remote_offset: int = 0
) -> TransferRequest:
    """A transfer request, positional where the tests vary it."""
    return TransferRequest(
        op=op,
        local_region=local,
        local_offset=local_offset,
        peer=peer,
        remote_region=remote,
        remote_offset=remote_offset,
        length=length,
    )


def engine_on(port: int, config: EngineConfig, *, timeout_s: float = 10.0) -> TransferEngine:
    """An engine listening on `port`, which another engine has just given up (tried again, for at most
    `timeout_s`, while the port is still held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return TransferEngine(secret=SECRET, config=attrs.evolve(config, port=port))
        except TransferError:  # "cannot listen on ...": the port is still held
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


@attrs.define
class PeerProcess:
    process: subprocess.Popen[str]
    address: str
    shared: int
    plain: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def start_peer(size: int, *, secret: bytes = SECRET, timeout_s: float = 60.0) -> PeerProcess:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.peer_process", secret.hex(), str(size)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            process.kill()
            process.wait()
            raise TimeoutError("the peer process did not start")
        line = process.stdout.readline()
        if line:
            info = json.loads(line)
            return PeerProcess(process, info["address"], info["shared"], info["plain"])
        if process.poll() is not None:
            raise RuntimeError(f"the peer process exited with {process.returncode}")


@pytest.fixture
def peers() -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; every one is stopped (and reaped) at the end of the test."""
    started: list[PeerProcess] = []

    def start(size: int = 1 << 22, **options: object) -> PeerProcess:
        peer = start_peer(size, **options)  # type: ignore[arg-type]
        started.append(peer)
        return peer

    yield start
    for peer in started:
        if peer.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer.pid, signal.SIGCONT)
        peer.kill()


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    """A local engine with small slices, so requests split over streams."""
    with TransferEngine(secret=SECRET, config=EngineConfig(slice_bytes=1 << 18, io_timeout_s=5.0)) as local:
        yield local


@pytest.fixture
def rdma_pair() -> Iterator[tuple[FakeFabric, TransferEngine, TransferEngine]]:
    """Two engines preferring rdma over a fake fabric (`fake_verbs`), tcp beside it; closed at the end."""
    fabric = FakeFabric()
    config = EngineConfig(transports=("rdma", "tcp"), slice_bytes=1 << 16, io_timeout_s=2.0)
    a = TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric))
    b = TransferEngine(secret=SECRET, config=config, rdma=FakeVerbs(fabric))
    yield fabric, a, b
    a.close()
    b.close()
