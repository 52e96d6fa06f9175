"""The shared-memory transport: same-host peers, copied directly by the initiator.

A peer on the same host publishes, for each region it allocated in shared
memory, the segment's name. The initiator maps the segment once and performs
every slice as one memory copy (numpy, which releases the GIL, so the worker
threads copy in parallel). Bounds are checked against the peer's descriptor
before any byte moves, and a peer whose process has gone (exited, reaped by its
parent or not yet) fails the slice with `PeerUnavailable` (its segment may
outlive it; writing there would deliver to no one). A region the peer
unregistered (its segment unlinked) fails the slice with `TransferError`, as
over TCP, also (on Linux, where /dev/shm shows the names) where it was mapped
before: a mapping outlives the name, and copying into it would deliver to no
one either. (A slice already running when the peer unregisters may still
complete, as over every transport.)

Mappings are let go once their segment is: each one holds two descriptors and
the segment's memory (an unlinked segment is freed only when its last mapping
goes). `retain` drops the mappings of segments the peer no longer lists (the
engine calls it whenever it installs a fresh descriptor), and mapping a new
segment first drops those whose names are gone from /dev/shm, so the mappings
held are about the segments the peer still shares, not every one it ever did.

Invariants:
- Each mapped segment has one array over it and one handle (`check_invariants`);
  after `retain(listed)`, every mapped segment is in `listed` until a copy maps
  another.
- A copy holds its own view of the mapping: dropping one never unmaps memory
  a copy is using (`region.shared_array`).
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Collection
from multiprocessing import shared_memory

import numpy as np

from mooncake.errors import PeerUnavailable, TransferError
from mooncake.transfer.region import RegionDescriptor, attach_shared, bounds_error, shared_array
from mooncake.transfer.request import Slice, TransferOp
from mooncake.transfer.workers import Workers, attempt

__all__ = ["ShmTransport"]


class ShmTransport:
    """Slices to and from one same-host peer, by memory copy.

    Args:
        describe: the peer's descriptor of a region (refreshed by the engine), or None.
        peer_pid: the peer's process id, to notice that it is gone.
        workers: copy threads.
        peer: the peer's address ("host:port"), named in every error ("": not known).
    """

    name = "shm"

    def __init__(
        self, describe: Callable[[int], RegionDescriptor | None], *, peer_pid: int, workers: int, peer: str = ""
    ) -> None:
        self._describe = describe
        self._peer_pid = peer_pid
        self._pidfd = _open_pidfd(peer_pid)  # -1: none (no pidfd_open here, or the peer is gone already)
        # Asked by poll, not select: select refuses a descriptor numbered 1024 or more (a busy process has them).
        self._pidfd_poll = select.poll()
        if self._pidfd >= 0:
            self._pidfd_poll.register(self._pidfd, select.POLLIN)
        # Held while the pidfd is asked and while it is closed (a poll of a number close() just freed would ask
        # whatever file took it next; and one poll object is asked by one thread at a time). Its own lock, as
        # `_map` asks with `_lock` held.
        self._pidfd_lock = threading.Lock()
        # Who the errors are about: the address where known, and the process either way.
        self._who = f"peer {peer} (process {peer_pid})" if peer else f"peer process {peer_pid}"
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._arrays: dict[str, np.ndarray] = {}  # one view per mapped segment
        self._lock = threading.Lock()
        self._workers = Workers(
            self._work,
            count=workers,
            name=f"shm-{peer_pid}",
            closed_message=f"the shm transport to {self._who} is closed",
            join_timeout_s=10,
        )

    def submit(self, piece: Slice) -> None:
        self._workers.submit(piece)

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        """Copy `piece` now, in the calling thread."""
        if self._workers.is_closed:
            return self._workers.closed_error()
        return attempt(self._copy, piece, action=f"shm copy with {self._who}")

    def close(self) -> None:
        self._workers.close()
        with self._lock:  # each segment is closed when collected: once no copy holds a view of it (`shared_array`)
            self._arrays.clear()
            self._segments.clear()
        with self._pidfd_lock:
            if self._pidfd >= 0:
                self._pidfd_poll.unregister(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = -1

    def _peer_alive(self) -> bool:
        """Whether the peer's process still runs: its pidfd turns readable once it exits, reaped or not (a
        poll of one descriptor, about a microsecond: asked before every slice); without one, `_alive`."""
        with self._pidfd_lock:
            if self._pidfd >= 0:
                return not self._pidfd_poll.poll(0)
        return _alive(self._peer_pid)

    def check_invariants(self) -> None:
        with self._lock:
            assert set(self._arrays) == set(self._segments), (sorted(self._arrays), sorted(self._segments))

    @property
    def mapped(self) -> tuple[str, ...]:
        """The names of the segments mapped now."""
        with self._lock:
            return tuple(self._segments)

    def retain(self, listed: Collection[str]) -> None:
        """Let go of the mappings of every segment not in `listed` (the shm names of the peer's current
        descriptor): the peer unregistered those regions, and a later copy to them fails anyway."""
        with self._lock:
            for name in [name for name in self._segments if name not in listed]:
                self._forget(name)

    def _work(self, workers: Workers) -> None:
        while (piece := workers.take()) is not None:
            piece.on_done(attempt(self._copy, piece, action=f"shm copy with {self._who}"))

    def _copy(self, piece: Slice) -> None:
        if not self._peer_alive():
            raise PeerUnavailable(f"{self._who} is gone")
        descriptor = self._describe(piece.remote_region)
        if descriptor is None or descriptor.shm_name is None:
            raise TransferError(f"{self._who} has no shared region {piece.remote_region}")
        length = piece.local.nbytes
        problem = bounds_error(piece.remote_offset, length, descriptor.length)
        if problem is not None:
            raise TransferError(f"region {piece.remote_region} of {self._who}: {problem}")
        mapped = self._map(descriptor.shm_name, piece.remote_region)
        if descriptor.length > mapped.size:
            raise TransferError(f"{self._who} describes region {piece.remote_region} larger than its segment")
        remote = mapped[piece.remote_offset : piece.remote_offset + length]
        local = np.frombuffer(piece.local, dtype=np.uint8)
        if piece.op == TransferOp.WRITE:
            np.copyto(remote, local)
        else:
            np.copyto(local, remote)

    def _map(self, name: str, region_id: int) -> np.ndarray:
        array = self._arrays.get(name)
        if array is not None:
            if not _unlinked(name):
                return array
            with self._lock:  # let the mapping go (once no copy holds a view of it)
                self._forget(name)
        with self._lock:
            array = self._arrays.get(name)
            if array is None:
                # A new mapping: first let go of those whose segments the peer has unlinked since (one stat each),
                # so that a peer that keeps allocating and unregistering regions does not pile them up here.
                for other in [other for other in self._segments if _unlinked(other)]:
                    self._forget(other)
                try:
                    segment = self._segments[name] = attach_shared(name)
                except FileNotFoundError as error:
                    if not self._peer_alive():  # it exited since the check: its segments went with it
                        raise PeerUnavailable(f"{self._who} is gone") from error
                    raise TransferError(
                        f"region {region_id} of {self._who} is no longer shared (unregistered)"
                    ) from error
                array = self._arrays[name] = shared_array(segment, segment.size)
            return array

    def _forget(self, name: str) -> None:
        """Drop the mapping of `name` (the caller holds the lock); it is unmapped once no copy holds a view of it."""
        self._arrays.pop(name, None)
        self._segments.pop(name, None)


# Where Linux keeps POSIX shared memory by name (elsewhere an unlinked segment mapped before is still copied into).
_SHM_FOLDER = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _unlinked(name: str) -> bool:
    """Whether the segment `name` has been unlinked (its owner unregistered it): one stat."""
    return _SHM_FOLDER is not None and not os.path.exists(os.path.join(_SHM_FOLDER, name))


def _open_pidfd(pid: int) -> int:
    """A pidfd of process `pid` (Linux 5.3 and later), or -1 where there is none to open (another system, or
    the process is gone: `_alive` then says so)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs. One that exited is gone even before its parent reaps it: a zombie,
    which a signal still reaches, so Linux's /proc is asked first; elsewhere, whether a signal reaches it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]  # the state follows the name (which may hold ")")
    except (OSError, IndexError):
        pass  # no such process, or no /proc: the signal tells
    else:
        return state not in (b"Z", b"X")  # a zombie, or dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
