"""Edges of the transfer engine's data path that its other tests leave open (all on 127.0.0.1).

- Regions: `Region.slice` against Python's own slicing (a range outside is refused by a `TransferError` naming
  the region, the offset and the end, never wrapped around by a negative index); read-only or strided buffers
  refused at registration; mapping a segment never registers it with the resource tracker, so a sibling
  process's mapping leaves its creator's registration alone (the segment of a SIGKILLed creator goes with the
  process tree, a clean unlink prints nothing), and a segment that cannot be made leaves the tracker quiet;
  segments are unlinked by their owner only (at unregister or close), and an unregistered one is not written
  over shm.
- The staging pool: an exact-size free buffer is reused; free memory is dropped largest first, only as much
  as needed, and not at all when the request cannot fit anyway; a checksummed WRITE cut midway gives its
  buffer back; WRITEs up to 64 KiB bypass the pool.
- TCP against a scripted peer (`ScriptedPeer`): a READ failing its checksum is retried, a peer's refusal is
  not; a silent peer is a `TransferTimeout`, a peer dropping every connection a `PeerUnavailable`, both
  bounded; an inline slice is not retried past its deadline; slices taken after the close began fail closed;
  a closed transport closes every connection it made. A real peer process stopped (SIGSTOP) fails a batch
  within one slice's bound, and is dialled again once it is back.
- The engine: closing it stops its transports' threads and wakes a blocked `wait`; `transfer_sync` starts
  nothing after its timeout.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any

import attrs
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ConfigError, MooncakeError, PeerUnavailable, TransferError, TransferTimeout
from mooncake.transfer import tcp
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.region import Region, RegionDescriptor, attach_shared, create_shared
from mooncake.transfer.request import EngineConfig, RequestState, Slice, TransferOp
from mooncake.transfer.staging import StagingPool
from mooncake.transfer.wire import (
    ANSWER_BYTES,
    MAX_CONTROL_BYTES,
    Frame,
    Kind,
    bind_checksum,
    new_incarnation,
    recv_exact,
    recv_frame,
    send_frame,
    server_hello,
    server_verdict,
)
from tests.transfer.conftest import SECRET, request, start_peer
from tests.waiting import stop_process, wait_for

MIB = 1 << 20
KIB = 1 << 10


def checksum_of(request: Frame, payload: bytes) -> int:
    """The checksum a data frame of `request` carries for `payload`: the wire's, bound to the request."""
    return bind_checksum(request, xxhash.xxh3_64_intdigest(payload))


# --------------------------------------------------------------------------- regions


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(0, 64),
    offset=st.integers(-70, 70),
    length=st.integers(-70, 70),
    region_id=st.integers(1, 1000),
)
def test_a_region_slice_is_the_python_slice_inside_and_refused_by_name_outside(
    size: int, offset: int, length: int, region_id: int
) -> None:
    """`Region.slice(offset, length)` is exactly bytes[offset:offset + length] (a writable view of the same
    memory) when 0 <= offset and 0 <= length and offset + length <= size; otherwise it raises a TransferError
    naming the region id, the offset and the end (never a negative index that Python would wrap around)."""
    backing = bytearray(bytes(range(size)))
    region = Region(RegionDescriptor(region_id=region_id, length=size), memoryview(backing))
    inside = offset >= 0 and length >= 0 and offset + length <= size
    if not inside:
        with pytest.raises(TransferError) as refused:
            region.slice(offset, length)
        message = str(refused.value)
        assert isinstance(refused.value, MooncakeError)
        assert f"region {region_id}" in message and f"[{offset}, {offset + length})" in message, message
        assert backing == bytearray(bytes(range(size)))
        return
    view = region.slice(offset, length)
    assert bytes(view) == bytes(backing[offset : offset + length])
    if length:
        view[0] ^= 0xFF  # the same memory, not a copy
        assert backing[offset] == (offset ^ 0xFF)


@pytest.mark.parametrize(
    "buffer",
    [
        pytest.param(lambda: b"\x00" * 64, id="bytes"),
        pytest.param(lambda: memoryview(bytearray(64)).toreadonly(), id="readonly-view"),
        pytest.param(lambda: _readonly(), id="readonly-array"),
        pytest.param(lambda: np.zeros((8, 8), np.uint8)[:, ::2], id="strided-array"),
        pytest.param(lambda: memoryview(bytearray(64))[::2], id="strided-view"),
    ],
)
def test_a_read_only_or_strided_buffer_is_refused_and_registers_nothing(buffer: Any) -> None:
    """Registering memory a peer could not write into as one run of bytes (bytes, a read-only view or array,
    a strided one) raises a TransferError and leaves the engine's regions as they were."""
    with TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",))) as engine:
        before = engine.regions()
        with pytest.raises(TransferError, match="contiguous and writable"):
            engine.register_memory(buffer())
        assert engine.regions() == before


@pytest.mark.parametrize("buffer", [[0] * 64, "x" * 64, 64], ids=["list", "str", "int"])
def test_a_buffer_without_bytes_is_refused_by_its_type(buffer: Any) -> None:
    """Something with no buffer to hand out is a TransferError naming its type, not memoryview's TypeError."""
    with TransferEngine(secret=SECRET, config=EngineConfig(transports=("tcp",))) as engine:
        with pytest.raises(TransferError, match=f"got {type(buffer).__name__}"):
            engine.register_memory(buffer)
        assert engine.regions() == ()


def _readonly() -> np.ndarray:
    array = np.zeros(64, np.uint8)
    array.flags.writeable = False
    return array


def test_mapping_a_segment_never_registers_it_with_the_resource_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    """`attach_shared` maps a segment (a peer's, or one of this process's own) without registering it: only its
    creator's registration stands, and the tracker is asked to forget nothing. A segment made meanwhile by
    someone else still registers."""
    segment, array = create_shared(256)
    calls: list[tuple[str, str]] = []

    def register(name: str, rtype: str) -> None:
        calls.append(("register", name))

    def unregister(name: str, rtype: str) -> None:
        calls.append(("unregister", name))

    monkeypatch.setattr(resource_tracker, "register", register)
    monkeypatch.setattr(resource_tracker, "unregister", unregister)
    again = attach_shared(segment.name)
    try:
        assert bytes(again.buf[:4]) == bytes(array[:4]) and again.size >= 256 and again.name == segment.name
        copy = pickle.loads(pickle.dumps(again))  # another process maps it untracked too
        copy.close()
        again.close()
        assert calls == []
        # Nothing is swapped for it, not even for a while (another library's swap, a fork, could catch it midway).
        assert (resource_tracker.register, resource_tracker.unregister) == (register, unregister)
    finally:
        monkeypatch.undo()
        del array
        segment.unlink()


def test_a_segment_that_cannot_be_made_leaves_the_resource_tracker_quiet() -> None:
    """A segment too large to map is a TransferError, and the resource tracker prints nothing: SharedMemory
    unregisters such a segment, which it never registered, and the tracker used to print its KeyError."""
    code = (
        "from mooncake.errors import TransferError\n"
        "from mooncake.transfer.region import create_shared\n"
        "segment, array = create_shared(64)\n"  # the tracker runs, as in a process that has made segments
        "try:\n    create_shared(2**62)\nexcept TransferError as error:\n    print(error)\n"
        "del array\nsegment.unlink()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "cannot create a shared segment of nbytes=" in done.stdout, done.stderr
    assert done.stderr == ""


_SIBLINGS = """
import multiprocessing, os, signal, sys
from mooncake.transfer.region import attach_shared, create_shared

def create(names, told):
    segment, array = create_shared(4096)
    names.put(segment.name)
    told.get()  # killed before this comes, or told to end cleanly
    del array
    segment.unlink()

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    names, told = context.Queue(), context.Queue()
    child = context.Process(target=create, args=(names, told))
    child.start()
    name = names.get(timeout=60)
    attach_shared(name).close()  # as the shm transport maps a peer's region
    print(name, flush=True)
    if sys.argv[1] == "killed":
        os.kill(child.pid, signal.SIGKILL)
    else:
        told.put(None)
    child.join(timeout=30)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="finds segments in /dev/shm")
@pytest.mark.parametrize("creator", ["killed", "clean"])
def test_a_segment_mapped_by_a_sibling_goes_once_with_its_creator(tmp_path: Any, creator: str) -> None:
    """Processes multiprocessing starts share one resource tracker. A segment one of them created and another
    mapped is gone once the tree has exited, though its creator was SIGKILLed, and a creator's clean unlink makes
    the tracker print nothing. The mapping used to unregister the creator's own entry: the killed creator's
    segment outlived everyone, and the clean unlink printed the tracker's KeyError."""
    script = tmp_path / "siblings.py"
    script.write_text(_SIBLINGS)
    done = subprocess.run([sys.executable, str(script), creator], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = os.path.join("/dev/shm", done.stdout.split()[-1])
    try:
        wait_for(lambda: not os.path.exists(path), timeout=10.0, what="the segment to be unlinked")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    assert "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- staging


def test_a_free_buffer_of_exactly_the_size_asked_is_reused() -> None:
    """A request gets the smallest free buffer that holds it, an exact fit included (not a larger one)."""
    pool = StagingPool(4 * MIB)
    now = time.monotonic()
    exact = pool.try_allocate(64 * KIB, deadline=now)
    larger = pool.try_allocate(128 * KIB, deadline=now)
    assert exact is not None and larger is not None and exact.nbytes == 64 * KIB
    pool.free(exact)
    pool.free(larger)  # freed last: the warm one, but twice the size
    assert pool.try_allocate(64 * KIB, deadline=now) is exact
    pool.check_invariants()


def test_free_memory_is_dropped_largest_first_and_only_as_much_as_needed() -> None:
    """To make room, free buffers go largest first until the new one fits; the smaller ones stay for reuse."""
    pool = StagingPool(8 * MIB)
    now = time.monotonic()
    held, small, medium = (pool.try_allocate(n, deadline=now) for n in (2 * MIB, MIB, 2 * MIB))
    assert held is not None and small is not None and medium is not None
    pool.free(small)
    pool.free(medium)  # 5 MiB held: 2 in use, 1 + 2 free
    big = pool.try_allocate(3 * MIB, deadline=now)  # 4 MiB: dropping the 2 MiB one is enough
    assert big is not None and big.nbytes == 4 * MIB
    assert pool.held_bytes == 7 * MIB
    assert pool.try_allocate(MIB, deadline=now) is small
    pool.check_invariants()


def test_free_memory_is_not_dropped_when_the_request_cannot_fit_anyway() -> None:
    """A request that cannot fit beside the buffers in use drops no free buffer (it waits, then gets None)."""
    pool = StagingPool(4 * MIB)
    now = time.monotonic()
    in_use, free = pool.try_allocate(2 * MIB, deadline=now), pool.try_allocate(MIB, deadline=now)
    assert in_use is not None and free is not None
    pool.free(free)
    assert pool.try_allocate(3 * MIB, deadline=now) is None  # 2 in use + 3 > 4, however much is dropped
    assert pool.held_bytes == 3 * MIB
    assert pool.try_allocate(MIB, deadline=now) is free
    pool.check_invariants()


@attrs.define
class _Serving:
    """What `tcp.serve_connection` needs: a config, a staging pool and one region (id 1)."""

    config: EngineConfig
    staging: StagingPool
    target: Region

    def region(self, region_id: int) -> Region | None:
        return self.target if region_id == 1 else None

    def handle_call(self, method: str, args: Any) -> Any:
        raise TransferError(f"no calls here ({method})")


def test_a_write_finding_no_staging_memory_is_refused_to_the_client_with_the_reason() -> None:
    """A checksummed 96 KiB WRITE while another connection holds the staging pool: the server waits half its io
    timeout for memory, drains the payload (the stream stays in step) and answers an ERROR naming the staging
    memory, which the client reads; the region is unchanged. (It used to drain by the deadline the wait had
    spent, so the connection dropped and the client saw a dead peer.)"""
    size = 96 * KIB
    config = EngineConfig(max_staging_bytes=128 * KIB, max_frame_bytes=size, slice_bytes=size, io_timeout_s=0.5)
    target = np.zeros(size, np.uint8)
    serving = _Serving(
        config, StagingPool(config.max_staging_bytes), Region(RegionDescriptor(region_id=1, length=size), target.data)
    )
    held = serving.staging.try_allocate(size, deadline=time.monotonic())  # in use by another connection
    assert held is not None
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    listener.close()
    server = threading.Thread(target=tcp.serve_connection, args=(served, serving), daemon=True)
    server.start()
    try:
        payload = bytes([7]) * size
        header = Frame(Kind.WRITE, tag=9, region=1, offset=0, length=size)
        header = attrs.evolve(header, checksum=checksum_of(header, payload))
        send_frame(client, header, payload)
        client.settimeout(5)
        reply = recv_frame(client, max_length=MAX_CONTROL_BYTES)
        reason = bytearray(reply.length)
        recv_exact(client, memoryview(reason))
        assert (reply.kind, reply.tag) == (Kind.ERROR, 9) and b"no staging memory" in reason, bytes(reason)
        assert not target.any()
    finally:
        client.close()
        server.join(timeout=10)
        served.close()
        serving.staging.free(held)


# --------------------------------------------------------------------------- two engines in this process

FAST = EngineConfig(
    transports=("shm", "tcp"),
    io_timeout_s=5.0,
    connect_timeout_s=5.0,
    slice_bytes=4 * KIB,
    max_frame_bytes=64 * KIB,
    streams_per_peer=2,
    spin_us=0,
)


@contextlib.contextmanager
def two_engines(config: EngineConfig = FAST) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A local engine and a peer engine on 127.0.0.1, both closed at the end."""
    with TransferEngine(secret=SECRET, config=config) as remote, TransferEngine(secret=SECRET, config=config) as local:
        yield local, remote


def transfer_threads() -> set[threading.Thread]:
    """The worker threads of transports (named by `Workers` after their transport)."""
    return {t for t in threading.enumerate() if t.name.startswith(("tcp-", "shm-"))}


def test_a_region_unregistered_after_it_was_mapped_is_not_written_over_shm() -> None:
    """Over shm, a write to a region its peer has unregistered fails with TransferError, naming the peer's
    address, even though the segment is still mapped here from an earlier copy (the bytes would reach no one),
    and moves nothing."""
    with two_engines() as (local, remote):
        shared, remote_array = remote.allocate_shared(4 * KIB)
        mine, local_array = local.allocate_shared(4 * KIB)
        peer = local.connect(remote.address, transport="shm")
        remote_array[:] = 3
        (status,) = local.transfer_sync(
            [request(TransferOp.READ, mine.region_id, peer, shared.region_id, 100)], timeout=10
        )
        assert status.state == RequestState.DONE and local_array[:100].tolist() == [3] * 100
        remote.unregister_memory(shared.region_id)
        local_array[:] = 9
        write = request(TransferOp.WRITE, mine.region_id, peer, shared.region_id, 100)
        (status,) = local.transfer_sync([write], timeout=10)
        assert status.state == RequestState.FAILED and isinstance(status.error, TransferError)
        assert "unregistered" in str(status.error) and f"peer {peer} " in str(status.error), status.error
        assert remote_array.tolist() == [3] * (4 * KIB)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_closing_an_engine_stops_its_transport_threads(transport: str) -> None:
    """After a batch over every stream, closing the engine stops each of its transport's worker threads."""
    before = transfer_threads()
    with two_engines() as (local, remote):
        shared, _ = remote.allocate_shared(64 * KIB)
        mine, _ = local.allocate_shared(64 * KIB)
        peer = local.connect(remote.address, transport=transport)
        batch = local.submit([request(TransferOp.WRITE, mine.region_id, peer, shared.region_id, 64 * KIB)])
        assert [s.state for s in local.wait(batch, timeout=30)] == [RequestState.DONE]
        started = transfer_threads() - before
        assert len(started) >= FAST.streams_per_peer
        local.close()
        wait_for(lambda: not any(t.is_alive() for t in started), timeout=15, what="transport threads to stop")


# --------------------------------------------------------------------------- a peer that misbehaves on cue

Behaviour = str  # after the first frame, "silent": never answers; "drop": closes the connection; otherwise
# every READ is answered with DATA (with its checksum when asked for): "corrupt" with a byte flipped after the
# checksum was taken, "held" once `gate` is set, "good" at once, "trickle" a byte every 0.1 s; "refuse" answers
# every frame with an ERROR
READ_BYTES = 4096
DATA = bytes(range(256)) * (READ_BYTES // 256)


class ScriptedPeer:
    """Authenticates every connection like an engine, then meets its first frame with the behaviour
    scripted for that connection (the last one for every later connection)."""

    def __init__(self, *script: Behaviour) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.script = list(script)
        self.connections = 0
        self.frames = 0  # frames received, on every connection
        self.ended = 0  # connections over (closed by the client, dropped or timed out here)
        self.gate = threading.Event()  # what "held" connections wait for before answering
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, name="scripted-accept", daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            behaviour = self.script[min(self.connections, len(self.script) - 1)]
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(connection, behaviour), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket, behaviour: Behaviour) -> None:
        try:
            self._answer(connection, behaviour)
        finally:
            with self._lock:
                self.ended += 1

    def _answer(self, connection: socket.socket, behaviour: Behaviour) -> None:
        with connection, contextlib.suppress(OSError):
            connection.settimeout(30)
            nonce, hello = server_hello()
            connection.sendall(hello)
            answer = bytearray(ANSWER_BYTES)
            recv_exact(connection, memoryview(answer))
            connection.sendall(server_verdict(SECRET, nonce, bytes(answer), incarnation=new_incarnation())[0])
            while not self._stop.is_set():
                frame = recv_frame(connection, max_length=MAX_CONTROL_BYTES)
                with self._lock:
                    self.frames += 1
                if frame.kind in (Kind.WRITE, Kind.CALL):
                    recv_exact(connection, memoryview(bytearray(frame.length)))
                if behaviour == "drop":
                    return
                if behaviour == "silent":
                    self._stop.wait(30)
                    return
                if behaviour == "refuse":
                    reason = b"region 1: bytes [0, 4096) are outside the region of 0 bytes"
                    send_frame(connection, Frame(Kind.ERROR, tag=frame.tag, length=len(reason)), reason)
                    continue
                if behaviour == "held":
                    self.gate.wait(30)
                checksum = None if frame.checksum is None else checksum_of(frame, DATA)
                sent = DATA if behaviour != "corrupt" else bytes([DATA[0] ^ 1]) + DATA[1:]
                if behaviour == "trickle":  # each byte well within the io timeout, the whole far beyond it
                    connection.sendall(Frame(Kind.OK, tag=frame.tag, length=len(DATA), checksum=checksum).pack())
                    for byte in sent:
                        if self._stop.wait(0.1):
                            return
                        connection.sendall(bytes([byte]))
                    continue
                send_frame(connection, Frame(Kind.OK, tag=frame.tag, length=len(DATA), checksum=checksum), sent)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.listener.close()
        for thread in self._threads:
            thread.join(timeout=10)


@contextlib.contextmanager
def scripted_transport(*script: Behaviour, **config: Any) -> Iterator[tuple[ScriptedPeer, tcp.TcpTransport]]:
    peer = ScriptedPeer(*script)
    settings = EngineConfig(streams_per_peer=1, connect_timeout_s=5.0, spin_us=0, **config)
    transport = tcp.TcpTransport("127.0.0.1", peer.port, secret=SECRET, config=settings)
    try:
        yield peer, transport
    finally:
        transport.close()
        peer.close()


def read_once(transport: tcp.TcpTransport, *, within_s: float) -> tuple[TransferError | None, bytearray]:
    """Submit one READ of READ_BYTES; its outcome (the test fails if none comes within `within_s`)."""
    outcomes: list[TransferError | None] = []
    done = threading.Event()
    target = bytearray(READ_BYTES)

    def record(error: TransferError | None) -> None:
        outcomes.append(error)
        done.set()

    transport.submit(Slice(TransferOp.READ, memoryview(target), 1, 0, record))
    if not done.wait(within_s):
        pytest.fail(f"no outcome within {within_s} s")
    assert len(outcomes) == 1
    return outcomes[0], target


def test_a_read_failing_its_checksum_is_retried_on_a_fresh_connection() -> None:
    """A READ whose bytes fail their end-to-end checksum is retried (like a dropped connection) and completes
    with the right bytes when the next connection delivers them."""
    with scripted_transport("corrupt", "good", checksums=True, max_retries=1, io_timeout_s=5.0) as (peer, transport):
        error, target = read_once(transport, within_s=20)
        assert error is None and bytes(target) == DATA
        assert peer.connections == 2


def test_a_peer_that_never_answers_times_out_as_a_timeout() -> None:
    """A peer that takes a slice and never answers fails it with TransferTimeout after the io timeout (each
    retry included), not with a hang or another error."""
    with scripted_transport("silent", io_timeout_s=0.3, max_retries=1) as (peer, transport):
        start = time.monotonic()
        error, target = read_once(transport, within_s=20)
        assert isinstance(error, TransferTimeout), error
        assert time.monotonic() - start < 10
        assert peer.connections == 2 and bytes(target) == bytes(READ_BYTES)


def test_a_peer_that_drops_every_connection_fails_the_slice_unavailable() -> None:
    """A peer that drops the connection mid-slice, every time, fails it with PeerUnavailable once its retries
    are spent; the local buffer is untouched."""
    with scripted_transport("drop", io_timeout_s=5.0, max_retries=2) as (peer, transport):
        error, target = read_once(transport, within_s=20)
        assert isinstance(error, PeerUnavailable) and "dropped" in str(error), error
        assert peer.connections == 3 and bytes(target) == bytes(READ_BYTES)


def test_a_peer_trickling_its_answer_times_the_slice_out_within_its_bounds() -> None:
    """A peer that sends a READ's bytes one every 0.1 s (each receive well within the 0.5 s io timeout, the whole
    answer 400 s) fails the slice TransferTimeout within its bound (slice_deadline_s), not when the last byte
    comes: the answer's header and its payload are each due within the io timeout."""
    with scripted_transport("trickle", io_timeout_s=0.5, max_retries=1) as (peer, transport):
        start = time.monotonic()
        error, _target = read_once(transport, within_s=20)
        assert isinstance(error, TransferTimeout), error
        assert time.monotonic() - start <= transport._config.slice_deadline_s + 1.0
        assert peer.connections == 2  # the retry, on a fresh connection


@pytest.mark.parametrize("behaviour", ["drop", "silent"])
def test_a_peer_lost_before_it_describes_itself_is_unavailable(behaviour: Behaviour) -> None:
    """A peer that authenticates, then drops the connection or goes silent before answering `describe`: the
    engine's connect raises PeerUnavailable naming it (a MooncakeError, not a bare socket error), within the io
    timeout, and keeps no peer."""
    peer = ScriptedPeer(behaviour)
    config = EngineConfig(transports=("tcp",), io_timeout_s=0.5, connect_timeout_s=2.0, spin_us=0)
    try:
        with TransferEngine(secret=SECRET, config=config) as engine:
            start = time.monotonic()
            with pytest.raises(PeerUnavailable, match=f"127.0.0.1:{peer.port}"):
                engine.connect(f"127.0.0.1:{peer.port}")
            assert time.monotonic() - start < 5
    finally:
        peer.close()


def test_an_inline_slice_waits_for_another_ones_connection_only_until_its_deadline() -> None:
    """A thread's inline slice holds the one inline connection to a peer that never answers: another thread's
    inline slice with a deadline 0.3 s away returns TransferTimeout by then (not once the first gives up), moving
    nothing."""
    with scripted_transport("silent", io_timeout_s=2.0, max_retries=0) as (_peer, transport):
        first = threading.Thread(
            target=transport.run_inline, args=(Slice(TransferOp.READ, memoryview(bytearray(READ_BYTES)), 1, 0, print),)
        )
        first.start()
        time.sleep(0.2)  # the first holds the inline connection, waiting on the peer
        target = bytearray(READ_BYTES)
        start = time.monotonic()
        error = transport.run_inline(
            Slice(TransferOp.READ, memoryview(target), 1, 0, lambda _error: None), deadline=start + 0.3
        )
        assert isinstance(error, TransferTimeout) and "deadline" in str(error), error
        assert time.monotonic() - start < 1.5 and bytes(target) == bytes(READ_BYTES)
        first.join(timeout=10)


def test_a_peer_reading_smaller_frames_than_this_engines_slices_is_refused_at_connect() -> None:
    """A peer whose max_frame_bytes (64 KiB) is under this engine's slice_bytes (1 MiB) would refuse every slice,
    and its connection drop looked like a dead peer, retried: connect raises ConfigError naming both settings
    instead, keeping no peer; with slices of 64 KiB the same peers move bytes."""
    small = EngineConfig(transports=("tcp",), max_frame_bytes=64 * KIB, slice_bytes=64 * KIB, io_timeout_s=2.0)
    big = attrs.evolve(small, max_frame_bytes=MIB, slice_bytes=MIB)
    with TransferEngine(secret=SECRET, config=small) as remote:
        target = np.zeros(MIB, np.uint8)
        region = remote.register_memory(target)
        with (
            TransferEngine(secret=SECRET, config=big) as local,
            pytest.raises(ConfigError, match=r"at most 65536 bytes \(its max_frame_bytes\).*1048576 \(slice_bytes\)"),
        ):
            local.connect(remote.address, transport="tcp")
        with TransferEngine(secret=SECRET, config=attrs.evolve(big, slice_bytes=64 * KIB)) as local:
            mine, source = local.allocate_shared(MIB)
            source[:] = 5
            peer = local.connect(remote.address, transport="tcp")
            (status,) = local.transfer_sync(
                [request(TransferOp.WRITE, mine.region_id, peer, region.region_id, MIB)], timeout=20
            )
            assert status.state == RequestState.DONE and (target == 5).all()


def test_an_inline_slice_is_not_retried_past_its_deadline() -> None:
    """A slice run inline against a peer that never answers gets one try once its deadline has passed, however
    many retries the config allows (each would make a connection and wait again)."""
    with scripted_transport("silent", io_timeout_s=5.0, max_retries=3) as (peer, transport):
        wait_for(lambda: peer.connections == 1, timeout=10, what="the stream's own connection")
        target = bytearray(READ_BYTES)
        start = time.monotonic()
        piece = Slice(TransferOp.READ, memoryview(target), 1, 0, lambda _error: None)
        error = transport.run_inline(piece, deadline=start + 0.3)
        assert isinstance(error, TransferTimeout), error
        assert time.monotonic() - start < 4
        assert peer.connections == 2  # the stream's and the one inline try's
        assert bytes(target) == bytes(READ_BYTES)


def test_closing_fails_the_slice_in_flight_and_those_queued_and_moves_nothing_after() -> None:
    """The transport closes while a slice waits on its peer with three queued behind it: the close shuts the
    connection down, so the slice in flight ends PeerUnavailable ("closed") at once, without its retries, and
    the queued ones too; when the peer answers after, nothing lands in any target (a slice reported failed
    never lands later)."""
    with scripted_transport("held", io_timeout_s=10.0, max_retries=0) as (peer, transport):
        outcomes: dict[int, list[TransferError | None]] = {i: [] for i in range(4)}
        targets = [bytearray(READ_BYTES) for _ in range(4)]
        for i in range(4):
            transport.submit(Slice(TransferOp.READ, memoryview(targets[i]), 1, 0, outcomes[i].append))
        wait_for(lambda: peer.frames == 1, timeout=10, what="the first slice to reach the peer")
        closer = threading.Thread(target=transport.close, name="closer")
        closer.start()
        try:
            wait_for(lambda: transport._workers.is_closed, timeout=10, what="the close to begin")
        finally:
            peer.gate.set()  # the slice in flight completes now
            closer.join(timeout=20)
        assert not closer.is_alive()
        time.sleep(0.2)  # the peer's answer to the first slice, had anything still read it
        for i in range(4):
            assert len(outcomes[i]) == 1 and isinstance(outcomes[i][0], PeerUnavailable), outcomes[i]
            assert "closed" in str(outcomes[i][0]) and bytes(targets[i]) == bytes(READ_BYTES)


def test_closing_a_tcp_transport_closes_every_connection_it_made() -> None:
    """After slices over its stream and inline, closing a TcpTransport closes both its connections (the
    peer sees them end at once, not at its own timeout)."""
    with scripted_transport("good", io_timeout_s=5.0) as (peer, transport):
        error, target = read_once(transport, within_s=10)
        assert error is None and bytes(target) == DATA
        inline = bytearray(READ_BYTES)
        assert transport.run_inline(Slice(TransferOp.READ, memoryview(inline), 1, 0, lambda _error: None)) is None
        assert bytes(inline) == DATA and peer.connections == 2 and peer.ended == 0
        transport.close()
        wait_for(lambda: peer.ended == 2, timeout=10, what="both connections to end")


def test_a_checksummed_write_cut_midway_gives_its_staging_memory_back() -> None:
    """A large checksummed WRITE whose connection drops mid-payload returns its staging buffer to the pool:
    the next WRITE needing all of the pool's memory is staged and lands (it is not refused for memory)."""
    size = 96 * KIB  # past the connection's own 64 KiB buffer, so staged in the pool (128 KiB, all of it)
    config = attrs.evolve(
        FAST, transports=("tcp",), checksums=True, max_staging_bytes=128 * KIB, slice_bytes=size, max_frame_bytes=size
    )
    with two_engines(config) as (local, remote):
        target = np.zeros(size, np.uint8)
        region = remote.register_memory(target)
        sock = tcp.connect(remote.host, remote.port, secret=SECRET, config=config)
        with sock:
            header = Frame(Kind.WRITE, tag=1, region=region.region_id, offset=0, length=size, checksum=1)
            send_frame(sock, header, bytes(size // 2))  # the frame announces `size`: half of it comes
        mine, source = local.allocate_shared(size)
        source[:] = np.arange(size) % 251
        peer = local.connect(remote.address, transport="tcp")
        write = request(TransferOp.WRITE, mine.region_id, peer, region.region_id, size)
        (status,) = local.transfer_sync([write], timeout=30)
        assert status.state == RequestState.DONE, status
        assert np.array_equal(target, source)
        remote.check_invariants()


def test_a_slice_the_peer_refuses_is_not_retried() -> None:
    """A refusal from the peer (bounds, checksum) is the slice's final outcome: a TransferError carrying the
    peer's reason and naming the peer (host:port) and the slice's region and offset, after one frame on the one
    connection (a retry could only be refused again)."""
    with scripted_transport("refuse", io_timeout_s=5.0, max_retries=2) as (peer, transport):
        error, target = read_once(transport, within_s=10)
        assert type(error) is TransferError and "outside the region" in str(error), error
        assert str(error).startswith(f"127.0.0.1:{peer.port} region 1 offset 0: "), error
        assert peer.frames == 1 and peer.connections == 1
        assert bytes(target) == bytes(READ_BYTES)


def shm_names() -> set[str]:
    """The shared-memory segments this process created and has not unlinked (other processes' are not ours)."""
    prefix = f"mooncake-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm to list shared-memory segments")
def test_shared_segments_are_unlinked_by_their_owner_only() -> None:
    """A region's segment is unlinked when its owner unregisters it or closes; a peer that mapped it (and
    closes first) unlinks nothing; arrays handed out stay readable after the unlink."""
    before = shm_names()
    with two_engines() as (local, remote):
        kept, kept_array = remote.allocate_shared(4 * KIB)
        dropped, dropped_array = remote.allocate_shared(4 * KIB)
        mine, _ = local.allocate_shared(4 * KIB)
        assert {kept.shm_name, dropped.shm_name, mine.shm_name} <= shm_names() - before
        peer = local.connect(remote.address, transport="shm")
        reads = [request(TransferOp.READ, mine.region_id, peer, r.region_id, 64) for r in (kept, dropped)]
        assert [s.state for s in local.transfer_sync(reads, timeout=10)] == [RequestState.DONE] * 2
        remote.unregister_memory(dropped.region_id)
        assert dropped.shm_name not in shm_names() and kept.shm_name in shm_names()
        local.close()  # it mapped the peer's segments: it unlinks only its own
        assert mine.shm_name not in shm_names() and kept.shm_name in shm_names()
        kept_array[:] = 5
        remote.close()
        assert shm_names() - before == set()
        assert kept_array.sum() == 5 * 4 * KIB and dropped_array.sum() == 0


def test_checksummed_writes_up_to_64_kib_bypass_the_staging_pool() -> None:
    """A checksummed WRITE of up to 64 KiB is staged in its connection's own buffer (the pool's memory stays
    untouched); a larger one takes its buffer from the pool. Both land byte-exact."""
    small = 64 * KIB
    config = attrs.evolve(FAST, transports=("tcp",), checksums=True, slice_bytes=2 * small, max_frame_bytes=2 * small)
    with two_engines(config) as (local, remote):
        target = np.zeros(2 * small, np.uint8)
        region = remote.register_memory(target)
        mine, source = local.allocate_shared(2 * small)
        source[:] = np.arange(2 * small) % 253 + 1
        peer = local.connect(remote.address, transport="tcp")
        pool = remote._peers.staging
        for length, offset in ((small, 0), (small - 1, small), (small + 1, small - 1)):
            write = request(
                TransferOp.WRITE,
                mine.region_id,
                peer,
                region.region_id,
                length,
                local_offset=offset,
                remote_offset=offset,
            )
            assert [s.state for s in local.transfer_sync([write], timeout=10)] == [RequestState.DONE]
            assert np.array_equal(target[offset : offset + length], source[offset : offset + length])
            assert (pool.held_bytes > 0) == (length > small), (length, pool.held_bytes)


class SlowFirstSlice:
    """A transport that runs its first inline slice, then returns only once that slice's deadline has passed."""

    def __init__(self, inner: Any) -> None:
        self.name, self._inner, self.calls = inner.name, inner, 0

    def submit(self, piece: Slice) -> None:
        self._inner.submit(piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        self.calls += 1
        outcome = self._inner.run_inline(piece, deadline=deadline)
        if self.calls == 1:
            assert deadline is not None
            wait_for(lambda: time.monotonic() > deadline, timeout=10, what="the clock to pass the deadline")
        return outcome

    def close(self) -> None:
        self._inner.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_transfer_sync_starts_no_request_after_its_timeout(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """transfer_sync moves one-slice requests in order; once its timeout has passed, those not yet started end
    FAILED with TransferTimeout and move nothing."""
    with two_engines() as (local, remote):
        region, target = remote.allocate_shared(4 * KIB)
        mine, source = local.allocate_shared(4 * KIB)
        source[:] = 7
        peer = local.connect(remote.address, transport=transport)
        choose = local._peers.transport_for

        def transport_for(peer: str, region_id: int) -> Any:
            return SlowFirstSlice(choose(peer, region_id))

        monkeypatch.setattr(local._peers, "transport_for", transport_for)
        writes = [
            request(TransferOp.WRITE, mine.region_id, peer, region.region_id, 100, remote_offset=o) for o in (0, 1000)
        ]
        first, second = local.transfer_sync(writes, timeout=1.0)  # ample for the first
        assert first.state == RequestState.DONE, first
        assert second.state == RequestState.FAILED and isinstance(second.error, TransferTimeout), second
        assert target[:100].tolist() == [7] * 100 and not target[100:].any()


class Parking:
    """A transport that keeps every submitted slice without moving it (a peer that never answers)."""

    name = "parking"

    def __init__(self) -> None:
        self.parked: list[Slice] = []

    def submit(self, piece: Slice) -> None:
        self.parked.append(piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        raise AssertionError("not used")

    def close(self) -> None:
        pass


def test_a_wait_blocked_on_a_batch_returns_when_the_engine_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread blocked in `wait` on a batch that cannot finish is woken by `close`: it gets the batch FAILED
    with PeerUnavailable at once, not at its timeout."""
    with two_engines() as (local, remote):
        region, _ = remote.allocate_shared(4 * KIB)
        mine, _ = local.allocate_shared(4 * KIB)
        peer = local.connect(remote.address, transport="tcp")
        parking = Parking()
        monkeypatch.setattr(local._peers, "transport_for", lambda _peer, _region: parking)
        batch = local.submit([request(TransferOp.WRITE, mine.region_id, peer, region.region_id, 4 * KIB)])
        assert len(parking.parked) == 1
        outcome: list[Any] = []
        waiter = threading.Thread(target=lambda: outcome.append(local.wait(batch, timeout=20)), name="waiter")
        waiter.start()
        wait_for(lambda: local._finished._waiters, timeout=10, what="the waiter to block")  # type: ignore[attr-defined]
        local.close()
        waiter.join(timeout=10)
        assert not waiter.is_alive(), "wait still blocked after close"
        (status,) = outcome[0]
        assert status.state == RequestState.FAILED and isinstance(status.error, PeerUnavailable), status


def test_an_array_from_allocate_shared_outlives_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The array `allocate_shared` hands out stays usable after its engine closed and was collected: the
    segment is not closed under it (no BufferError escapes a finalizer, no unmapped memory)."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    engine = TransferEngine(secret=SECRET, config=FAST)
    _, array = engine.allocate_shared(4 * KIB)
    array[:] = 3
    engine.close()
    del engine
    gc.collect()
    array += 1
    assert int(array.sum()) == 4 * 4 * KIB
    assert [repr(hook.exc_value) for hook in unraisable] == []


def test_a_connection_idle_for_less_than_the_idle_timeout_is_still_served() -> None:
    """A connection that idles between frames for a part of `idle_timeout_s` is still served; one that idles
    past it is closed by the server."""
    config = attrs.evolve(FAST, transports=("tcp",), idle_timeout_s=3.0)
    with TransferEngine(secret=SECRET, config=config) as server:
        sock = tcp.connect(server.host, server.port, secret=SECRET, config=config)
        with sock:
            assert tcp.call(sock, "describe", None) is not None
            idle_from = time.monotonic()
            wait_for(lambda: time.monotonic() - idle_from > 0.5, timeout=5, what="half a second to pass")
            assert tcp.call(sock, "describe", None) is not None
            sock.settimeout(10)
            assert sock.recv(1) == b""  # the server closes it once idle for 3 s


REMOTE_BYTES = 2 * KIB


@pytest.fixture(scope="module")
def reachable() -> Iterator[dict[str, tuple[TransferEngine, str, RegionDescriptor, np.ndarray]]]:
    """A local engine and, per transport, a peer engine it reaches only over that one, each with one shared
    region: {transport: (local engine, peer key, the peer's region, its array)}."""
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(TransferEngine(secret=SECRET, config=FAST))
        reached = {}
        for transport in ("tcp", "shm"):
            remote = stack.enter_context(TransferEngine(secret=SECRET, config=FAST))
            region, array = remote.allocate_shared(REMOTE_BYTES)
            reached[transport] = (local, local.connect(remote.address, transport=transport), region, array)
        yield reached


@settings(max_examples=40, deadline=None)
@given(
    transport=st.sampled_from(["tcp", "shm"]),
    op=st.sampled_from(list(TransferOp)),
    offset=st.integers(0, REMOTE_BYTES + 3),
    excess=st.integers(1, 100),
    data=st.data(),
)
def test_a_remote_range_out_of_bounds_is_refused_by_name_and_moves_nothing(
    reachable: dict[str, tuple[TransferEngine, str, RegionDescriptor, np.ndarray]],
    transport: str,
    op: TransferOp,
    offset: int,
    excess: int,
    data: st.DataObject,
) -> None:
    """A one-slice request whose remote range passes the end of a region the peer described is refused with a
    TransferError (not a timeout or an unavailable peer) naming the remote region and the range, over tcp and
    shm alike, and neither its local nor its remote bytes change."""
    local, peer, region, remote_array = reachable[transport]
    length = max(0, REMOTE_BYTES - offset) + excess
    mine, local_array = local.allocate_shared(length)
    try:
        local_array[:] = np.arange(length) % 241 + 1
        remote_array[:] = data.draw(st.integers(0, 255), label="remote fill")
        before_local, before_remote = local_array.copy(), remote_array.copy()
        with pytest.raises(TransferError) as refused:
            local.transfer_sync(
                [request(op, mine.region_id, peer, region.region_id, length, remote_offset=offset)], timeout=10
            )
        assert type(refused.value) is TransferError, refused.value
        message = str(refused.value)
        assert f"region {region.region_id}" in message and f"[{offset}, {offset + length})" in message, message
        assert np.array_equal(local_array, before_local) and np.array_equal(remote_array, before_remote)
    finally:
        local.unregister_memory(mine.region_id)


# --------------------------------------------------------------------------- a peer that stops


def test_a_stopped_peer_fails_a_batch_within_its_slices_bound_and_is_dialled_again_after() -> None:
    """A real peer process stopped (SIGSTOP) before a batch of 64 slices over 2 streams: the batch ends, every
    request FAILED with PeerUnavailable, within `slice_deadline_s` (one slice's bound): once a fresh connection
    failed, the slices queued behind it fail at once instead of each dialling and waiting out a connect timeout of
    its own. Resumed (SIGCONT), the peer is dialled again once `connect_timeout_s` has passed, and a WRITE lands.
    (The batch ended only after every slice had dialled: 64 / 2 connect timeouts, far past its bound.)"""
    size = 4 * MIB
    config = EngineConfig(
        transports=("tcp",),
        io_timeout_s=1.0,
        connect_timeout_s=0.5,
        slice_bytes=64 * KIB,
        streams_per_peer=2,
        spin_us=0,
    )
    process = start_peer(size)
    try:
        with TransferEngine(secret=SECRET, config=config) as engine:
            source = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy()
            local = engine.register_memory(source)
            peer = engine.connect(process.address, transport="tcp")
            write = request(TransferOp.WRITE, local.region_id, peer, process.plain, size)
            stop_process(process.pid)
            start = time.monotonic()
            batch = engine.submit([write])
            (status,) = engine.wait(batch, timeout=config.slice_deadline_s + 5)
            took = time.monotonic() - start
            engine.forget(batch)
            assert status.state is RequestState.FAILED and isinstance(status.error, PeerUnavailable), status
            assert took <= config.slice_deadline_s, f"{took:.1f} s, past the bound of {config.slice_deadline_s} s"
            os.kill(process.pid, signal.SIGCONT)
            # Within the window the peer is still taken for down; after it, it is dialled again.
            moved = RequestState.FAILED
            deadline = time.monotonic() + 20 * config.connect_timeout_s
            while moved is not RequestState.DONE and time.monotonic() < deadline:
                (status,) = engine.transfer_sync([attrs.evolve(write, length=64 * KIB)], timeout=10)
                moved = status.state
                assert moved is RequestState.DONE or isinstance(status.error, PeerUnavailable), status
            assert moved is RequestState.DONE
            expected = f"{xxhash.xxh3_64_intdigest(source[: 64 * KIB].data):016x}"
            assert engine.call(peer, "digest", {"region": process.plain, "offset": 0, "length": 64 * KIB}) == expected
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.kill()
