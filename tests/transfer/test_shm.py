"""The shared-memory transport on its own: a peer whose process is gone, a descriptor that overstates its segment,
and the mappings of segments the peer let go; and which same-host peers it is chosen for (not one in a container
with a /dev/shm or PID namespace of its own, started here with `unshare`).

The engine-level tests (tests/transfer/test_engine.py) run it between processes; these pin its own checks, which
those reach only when nothing else notices first.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.peers import host_id
from mooncake.transfer.region import RegionDescriptor, create_shared
from mooncake.transfer.request import EngineConfig, RequestState, Slice, TransferOp
from mooncake.transfer.shm import ShmTransport
from tests.transfer.conftest import ROOT, SECRET, request
from tests.transfer.peer_process import pattern

SIZE = 1 << 16


def gone_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(child.stdout)


@pytest.mark.parametrize("overstated", [False, True])
def test_a_copy_checks_the_peer_is_alive_and_the_segment_holds_the_region(overstated: bool) -> None:
    """Into a live peer's segment a WRITE lands; a peer whose process is gone is PeerUnavailable (its segment may
    outlive it: writing there would deliver to no one), and a descriptor longer than its segment a TransferError,
    nothing written either way."""
    segment, memory = create_shared(SIZE)
    try:
        length = SIZE * 2 if overstated else SIZE
        descriptor = RegionDescriptor(region_id=7, length=length, shm_name=segment.name)
        data = np.arange(256, dtype=np.uint8).tobytes() * 4
        for pid, expected in ((gone_pid(), PeerUnavailable), (os.getpid(), TransferError if overstated else None)):
            transport = ShmTransport(lambda region: descriptor if region == 7 else None, peer_pid=pid, workers=1)
            try:
                error = transport.run_inline(
                    Slice(TransferOp.WRITE, memoryview(data), 7, SIZE - len(data), lambda _e: None)
                )
            finally:
                transport.close()
            if expected is None:
                assert error is None and bytes(memory[SIZE - len(data) :]) == data
            else:
                assert isinstance(error, expected) and not memory.any()
    finally:
        del memory
        segment.close()
        segment.unlink()


def test_a_peer_that_exited_but_is_not_yet_reaped_is_gone() -> None:
    """A peer process that has exited is gone even while its parent has not reaped it (a zombie, which a
    signal still reaches): a copy to it is PeerUnavailable, not a TransferError about an unregistered region."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; left unreaped (a zombie)
        descriptor = RegionDescriptor(region_id=7, length=64, shm_name=f"mooncake-{child.pid}-000000000000")
        transport = ShmTransport(lambda region: descriptor if region == 7 else None, peer_pid=child.pid, workers=1)
        try:
            error = transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(64)), 7, 0, lambda _e: None))
        finally:
            transport.close()
        assert isinstance(error, PeerUnavailable), error
    finally:
        child.wait(timeout=10)


def test_a_pidfd_numbered_past_select_s_limit_still_tells_a_live_peer_from_a_gone_one() -> None:
    """A busy process holds over 1,024 descriptors: a peer's pidfd numbered past that was refused by select (a
    ValueError that failed every copy: seen in CI, a decode worker never got its KV); poll takes any number."""
    gc.collect()  # an earlier test's object closing its descriptor late would open a hole below 1,024
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        segment, memory = create_shared(SIZE)
        try:
            descriptor = RegionDescriptor(region_id=7, length=SIZE, shm_name=segment.name)
            for pid, expected in ((os.getpid(), None), (gone_pid(), PeerUnavailable)):
                for _attempt in range(100):  # bounded: each try fills the hole a late close opened
                    transport = ShmTransport(
                        lambda region: descriptor if region == 7 else None, peer_pid=pid, workers=1
                    )
                    if not 0 <= transport._pidfd < 1024:
                        break
                    transport.close()
                    spare.append(os.open(os.devnull, os.O_RDONLY))
                try:
                    assert transport._pidfd >= 1024 or transport._pidfd == -1
                    error = transport.run_inline(Slice(TransferOp.WRITE, memoryview(b"x" * 8), 7, 0, lambda _e: None))
                finally:
                    transport.close()
                assert error is None if expected is None else isinstance(error, expected), error
            assert bytes(memory[:8]) == b"x" * 8
        finally:
            del memory
            segment.close()
            segment.unlink()
    finally:  # whatever failed above: 1,100 descriptors left open fail every later select() in the process
        for fd in spare:
            os.close(fd)


@pytest.mark.parametrize("exits_meanwhile", [False, True])
def test_a_segment_gone_is_an_unregistered_region_unless_the_peer_is_gone_too(
    exits_meanwhile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live peer's segment that cannot be mapped was unregistered: a TransferError, not PeerUnavailable. A peer
    that exits between the liveness check and the mapping took its segments with it: PeerUnavailable."""
    answers = iter([True, not exits_meanwhile])  # alive at the copy's check; then alive, or exited
    monkeypatch.setattr(ShmTransport, "_peer_alive", lambda _self: next(answers))
    descriptor = RegionDescriptor(region_id=7, length=64, shm_name=f"mooncake-{os.getpid()}-000000000000")
    transport = ShmTransport(lambda region: descriptor if region == 7 else None, peer_pid=os.getpid(), workers=1)
    try:
        error = transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(64)), 7, 0, lambda _e: None))
    finally:
        transport.close()
    if exits_meanwhile:
        assert isinstance(error, PeerUnavailable), error
    else:
        assert type(error) is TransferError and "no longer shared" in str(error), error


def mapped_here(name: str) -> bool:
    """Whether this process maps the shared segment `name` (or holds a descriptor of it)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        if any(f"/dev/shm/{name}" in line for line in maps):
            return True
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/dev/shm/{name}"):
                return True
    return False


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="reads which segments are mapped from /proc and /dev/shm")
def test_mapping_a_new_segment_lets_go_of_those_the_peer_unlinked() -> None:
    """A segment the peer unlinked (it unregistered the region) is unmapped, and its descriptors closed, when the
    transport maps another: the memory of an unlinked segment is freed only with its last mapping. (Mappings
    used to stay until a copy named that very segment again, which none does: two descriptors and the
    segment's memory per region the peer ever let go.)"""
    first, first_array = create_shared(SIZE)
    second, second_array = create_shared(SIZE)
    descriptors = {
        1: RegionDescriptor(region_id=1, length=SIZE, shm_name=first.name),
        2: RegionDescriptor(region_id=2, length=SIZE, shm_name=second.name),
    }
    del first_array, second_array  # only the transport maps them now
    first.close()
    second.close()
    transport = ShmTransport(descriptors.get, peer_pid=os.getpid(), workers=1)
    try:
        assert transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(64)), 1, 0, lambda _e: None)) is None
        assert mapped_here(first.name)
        first.unlink()  # the peer unregistered region 1
        assert transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(64)), 2, 0, lambda _e: None)) is None
        gc.collect()
        assert not mapped_here(first.name)
        assert transport.mapped == (second.name,)
        transport.retain([])  # the peer lists no segment now
        transport.check_invariants()
        gc.collect()
        assert transport.mapped == () and not mapped_here(second.name)
    finally:
        transport.close()
        second.unlink()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="reads which segments are mapped from /proc and /dev/shm")
def test_the_initiator_lets_go_of_segments_its_peer_unregistered() -> None:
    """A same-host peer allocates regions, is written to over shm, and unregisters them: once the initiator has
    refreshed the peer's descriptor, it maps none of their segments any more."""
    config = EngineConfig(io_timeout_s=5.0)
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        local, _ = here.allocate_shared(SIZE)
        peer = here.connect(there.address, transport="shm")
        names = []
        for _ in range(3):
            remote, array = there.allocate_shared(SIZE)
            here.refresh(peer)
            (status,) = here.transfer_sync(
                [request(TransferOp.WRITE, local.region_id, peer, remote.region_id, SIZE)], timeout=10
            )
            assert status.state is RequestState.DONE, status
            assert remote.shm_name is not None
            names.append(remote.shm_name)
            del array
            there.unregister_memory(remote.region_id)
        here.refresh(peer)
        gc.collect()
        assert [name for name in names if mapped_here(name)] == []


@pytest.fixture(scope="module")
def four_segments() -> Iterator[list[str]]:
    """Four shared segments of 256 bytes (their names), unlinked at the end."""
    made = [create_shared(256) for _ in range(4)]
    yield [segment.name for segment, _array in made]
    for segment, _array in made:
        segment.unlink()


@settings(max_examples=30, deadline=None)
@given(copied=st.sets(st.integers(0, 3)), listed=st.sets(st.integers(0, 3)))
def test_retain_keeps_exactly_the_mappings_still_listed(
    four_segments: list[str], copied: set[int], listed: set[int]
) -> None:
    """Against a model (the segments copied into): the transport maps exactly those, and after `retain(listed)`
    exactly those of them still listed."""
    descriptors = {i: RegionDescriptor(region_id=i, length=256, shm_name=name) for i, name in enumerate(four_segments)}
    transport = ShmTransport(descriptors.get, peer_pid=os.getpid(), workers=1)
    try:
        for region in sorted(copied):
            assert (
                transport.run_inline(Slice(TransferOp.WRITE, memoryview(bytes(8)), region, 0, lambda _e: None)) is None
            )
        assert set(transport.mapped) == {four_segments[i] for i in copied}
        transport.retain({four_segments[i] for i in listed})
        transport.check_invariants()
        assert set(transport.mapped) == {four_segments[i] for i in copied & listed}
    finally:
        transport.close()


# --------------------------------------------------------------------------- peers in other namespaces

# How a peer is started on this host, and whether it shares this process's shared memory: unshare's arguments,
# then a shell command run inside before the peer's own (`exec "$@"` runs the peer as that process).
NAMESPACES = {
    "own /dev/shm (mount + ipc namespace, a tmpfs of its own)": (
        ["--mount", "--ipc"],
        "mount -t tmpfs tmpfs /dev/shm",
        False,
    ),
    "own pid namespace (the same /dev/shm)": (["--pid", "--fork", "--kill-child"], "true", False),
    "own mount namespace only (the same /dev/shm, bound through)": (["--mount"], "true", True),
}


@functools.cache
def unshare_refusal() -> str | None:
    """Why peers cannot be started in namespaces of their own here, or None when they can."""
    if shutil.which("unshare") is None or not os.path.isdir("/dev/shm"):
        return "no unshare(1) or no /dev/shm here"
    probe = ["unshare", "--mount", "--ipc", "--pid", "--fork", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "unshare did not return within 30 s"
    if result.returncode != 0:
        return f"unshare is not permitted here (needs CAP_SYS_ADMIN): {result.stderr.strip()}"
    return None


def in_namespace(setup: str, command: list[str]) -> list[str]:
    """`command` run as a process of its own namespaces, as `setup` names them."""
    flags, prepare, _shared = NAMESPACES[setup]
    return ["unshare", *flags, "sh", "-c", f'{prepare} && exec "$@"', "sh", *command]


@pytest.mark.parametrize("setup", list(NAMESPACES))
def test_host_id_tells_apart_a_process_with_its_own_shm_or_pid_namespace(setup: str) -> None:
    """A process on this host (same hostname and boot id) with a /dev/shm of its own, or a PID namespace of its
    own, has another host id, so an engine there is not offered shm; one in another mount namespace that still
    sees this /dev/shm has the same id. (The id was hostname and boot id alone: equal in all three.)"""
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    code = "from mooncake.transfer.peers import host_id; print(host_id())"
    child = subprocess.run(
        in_namespace(setup, [sys.executable, "-c", code]), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    theirs = child.stdout.strip()
    assert theirs.split("/")[:2] == host_id().split("/")[:2]  # the same machine
    assert (theirs == host_id()) is NAMESPACES[setup][2], (theirs, host_id())


@pytest.mark.parametrize("setup", list(NAMESPACES))
def test_a_peer_that_does_not_share_our_shared_memory_is_reached_over_tcp(setup: str) -> None:
    """A same-host peer in a container with its own /dev/shm (or its own PID namespace) is connected with tcp
    only, and reading and writing its shared region work; one that shares our /dev/shm and pids still gets shm.
    (It got shm, and every copy to its shared region failed: "no longer shared (unregistered)" for a
    /dev/shm of its own, "peer process N is gone" for pids of its own; auto never fell back to tcp.)"""
    refusal = unshare_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    command = [sys.executable, "-m", "tests.transfer.peer_process", SECRET.hex(), str(SIZE)]
    process = subprocess.Popen(
        in_namespace(setup, command), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "the peer in its namespace did not start within 60 s"
        line = process.stdout.readline()
        assert line, f"the peer in its namespace exited with {process.poll()}"
        info = json.loads(line)
        expected = ("shm", "tcp") if NAMESPACES[setup][2] else ("tcp",)
        with TransferEngine(secret=SECRET, config=EngineConfig(io_timeout_s=5.0)) as engine:
            memory = np.zeros(SIZE, np.uint8)
            local = engine.register_memory(memory)
            peer = engine.connect(info["address"])
            assert engine.transport_names(peer) == expected
            (status,) = engine.transfer_sync(
                [request(TransferOp.READ, local.region_id, peer, info["shared"], SIZE)], timeout=10
            )
            assert status.state is RequestState.DONE and status.transport == expected[0], status
            assert np.array_equal(memory, pattern(SIZE, 1))
            memory[:] = pattern(SIZE, 5)
            (status,) = engine.transfer_sync(
                [request(TransferOp.WRITE, local.region_id, peer, info["shared"], SIZE)], timeout=10
            )
            assert status.state is RequestState.DONE and status.transport == expected[0], status
            digest = engine.call(peer, "digest", {"region": info["shared"], "offset": 0, "length": SIZE})
            assert digest == f"{xxhash.xxh3_64_intdigest(memory.data):016x}"
    finally:
        if process.stdin is not None:
            process.stdin.close()  # the peer closes its engine and exits
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
