"""Registered memory: the regions a transfer engine reads from and writes to.

A region is a contiguous, writable byte buffer with an id. Regions allocated by
the engine (`allocate_shared`) live in a POSIX shared-memory segment whose name
is part of the region's descriptor, so a peer on the same host can map it and
copy directly (the `shm` transport); any other buffer can be registered too and
is then reachable over TCP or RDMA only.

Every access goes through `Region.slice`, which checks the bounds: a request
for bytes outside a region is refused before any byte is touched.

A segment's mapping lives as long as any array over it (`shared_array`): numpy's
own arrays over a `SharedMemory`'s buffer keep a reference to the mapping but no
claim on it, so the segment closed or collected under one unmapped the memory it
still pointed to (a segmentation fault at its next access).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # what SharedMemory maps segments with (POSIX)
import mmap
import os
import secrets
import sys
import weakref
from multiprocessing import shared_memory
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from mooncake._checks import require_int
from mooncake.errors import TransferError

__all__ = [
    "MAX_SEGMENT_BYTES",
    "Region",
    "RegionDescriptor",
    "attach_shared",
    "bounds_error",
    "create_shared",
    "shared_array",
]

MAX_SEGMENT_BYTES = 2**63  # a shared segment is a file: its size is an off_t, a signed 64-bit integer


@attrs.frozen(kw_only=True)
class RegionDescriptor:
    """What a peer needs to address a region: its id, size and how to reach it.

    Attributes:
        region_id: unique within its engine, never reused.
        length: bytes.
        shm_name: the POSIX shared-memory segment holding it, if any.
        rdma_address, rdma_rkey: where RDMA reaches it, if registered with a device.
    """

    region_id: int
    length: int
    shm_name: str | None = None
    rdma_address: int | None = None
    rdma_rkey: int | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RegionDescriptor:
        return cls(**data)


def bounds_error(offset: int, length: int, size: int) -> str | None:
    """Why [offset, offset + length) is not inside a region of `size` bytes, or None."""
    if offset < 0 or length < 0 or offset + length > size:
        return f"bytes [{offset}, {offset + length}) are outside the region of {size} bytes"
    return None


@attrs.define(eq=False)
class Region:
    """A registered local buffer."""

    descriptor: RegionDescriptor
    view: memoryview
    keepalive: Any = None  # the object that owns the memory (array, shared segment)

    def slice(self, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length), bounds-checked.

        Raises:
            TransferError: the range is not inside the region.
        """
        problem = bounds_error(offset, length, self.descriptor.length)
        if problem is not None:
            raise TransferError(f"region {self.descriptor.region_id}: {problem}")
        return self.view[offset : offset + length]


def as_writable_bytes(buffer: Any) -> memoryview:
    """`buffer` as a flat, writable byte view (numpy arrays of any dtype included).

    Raises:
        TransferError: `buffer` exposes no bytes (a list, a str, an array of Python objects), or they are read-only
            or not contiguous.
    """
    if isinstance(buffer, np.ndarray):
        if buffer.dtype.hasobject:  # its items are pointers to Python objects: no bytes a peer may read or write
            raise TransferError(f"a registered buffer must hold plain data, got a numpy array of dtype {buffer.dtype}")
        if not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise TransferError("a registered buffer must be contiguous and writable")
        return buffer.reshape(-1).view(np.uint8).data
    try:
        view = memoryview(buffer)
    except TypeError:  # a list, a str, a torch tensor: no buffer to hand out
        raise TransferError(
            f"a registered buffer must expose its bytes (bytearray, numpy array, mmap), got {type(buffer).__name__}"
        ) from None
    if view.readonly or not view.c_contiguous:
        raise TransferError("a registered buffer must be contiguous and writable")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def create_shared(nbytes: int, *, prefix: str = "mooncake") -> tuple[shared_memory.SharedMemory, npt.NDArray[np.uint8]]:
    """A new shared-memory segment of `nbytes` and a uint8 array over it.

    Names carry the creating pid, so leftovers of a crashed process can be found in /dev/shm.

    Raises:
        ConfigError: `nbytes` is not an integer in [0, `MAX_SEGMENT_BYTES`) (nothing is made).
        TransferError: the system would not create (size or map) it: too large, no memory, no /dev/shm. Nothing
            is left behind (`SharedMemory` unlinks a segment it could not size or map).
    """
    # Checked before the segment exists: past off_t, os.ftruncate raises OverflowError, after which SharedMemory
    # does not unlink the segment it has just created (it does so only on OSError).
    require_int("nbytes", nbytes, minimum=0, below=MAX_SEGMENT_BYTES)
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        segment = _Created(name, max(1, nbytes))
    except OSError as error:
        raise TransferError(f"cannot create a shared segment of nbytes={nbytes}: {error}") from error
    return segment, shared_array(segment, nbytes)


def shared_array(segment: shared_memory.SharedMemory, nbytes: int) -> npt.NDArray[np.uint8]:
    """A uint8 array over the first `nbytes` of `segment` that keeps its mapping alive.

    The array's base is a memoryview holding a buffer export of the mapping, so
    `SharedMemory.close` cannot unmap it under the array (it raises `BufferError`),
    and `segment` itself is held until that view is gone (no array, view or slice
    over it left), so it is not collected (and closed) under the array either.
    """
    buffer = segment.buf
    if buffer is None:
        raise TransferError(f"shared segment {segment.name} is closed")
    array = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
    weakref.finalize(array.base, _let_go, segment).atexit = False  # holds `segment` until the arrays are gone
    return array


def _let_go(segment: shared_memory.SharedMemory) -> None:
    """Nothing: the finalizer that calls this drops its reference to `segment`, which may then be collected."""


def attach_shared(name: str) -> shared_memory.SharedMemory:
    """Map a segment another process (or this one) created, without registering it with the resource tracker:
    only its creator does, so that the tracker unlinks it after a crash of the creator, and never under it.

    Not registering at all, rather than registering and then unregistering (the usual workaround before Python
    3.13's `track=False`, CPython gh-82300): processes that multiprocessing starts share one tracker, which
    keeps one set of names for them all, so an attacher's unregister dropped the creator's own entry. The
    segment of a creator killed after a peer mapped it then outlived the whole process tree, and the creator's
    clean unlink made the tracker print a KeyError. No module global is swapped for it (another library's swap,
    or a fork, could catch it half done).
    """
    return _Attached(name)


class _Created(shared_memory.SharedMemory):
    """A new segment, as `SharedMemory(name, create=True, size=...)` makes it, except that one it could not size or
    map is unlinked without asking the resource tracker to forget it: it was never registered (SharedMemory
    registers a segment once mapped), and CPython 3.11 to 3.13 ask, which makes the tracker print a KeyError."""

    _made = False

    def __init__(self, name: str, size: int) -> None:
        super().__init__(name=name, create=True, size=size)
        self._made = True

    def __reduce__(self) -> tuple[Any, ...]:  # another process maps it, untracked there
        return attach_shared, (self.name,)

    def unlink(self) -> None:
        if self._made:
            super().unlink()
        else:  # SharedMemory's own cleanup, from inside its constructor
            _posixshmem.shm_unlink("/" + self.name)


class _Attached(shared_memory.SharedMemory):
    """An existing segment mapped as `SharedMemory(name)` maps it on POSIX, less its `resource_tracker.register`:
    3.13's `track=False`; on 3.11 and 3.12, whose SharedMemory is fixed, its own mapping (these are its
    attributes). A pickled one is mapped by `attach_shared` again, untracked there too (SharedMemory's own
    pickling would map it tracked)."""

    def __init__(self, name: str) -> None:
        if sys.version_info >= (3, 13):
            super().__init__(name=name, create=False, track=False)  # type: ignore[call-arg]
            return
        # not SharedMemory's constructor: it would register the segment
        self._name, self._flags, self._mode = "/" + name, os.O_RDWR, 0o600
        self._fd = _posixshmem.shm_open(self._name, self._flags, mode=self._mode)
        try:
            self._size = os.fstat(self._fd).st_size
            self._mmap = mmap.mmap(self._fd, self._size)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self._buf = memoryview(self._mmap)

    def __reduce__(self) -> tuple[Any, ...]:
        return attach_shared, (self.name,)
