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

import contextlib
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Iterator, Sized
from multiprocessing import resource_tracker, shared_memory
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
        # SharedMemory registers a segment with the resource tracker once it is sized and mapped, but one it could
        # not size or map it unlinks and unregisters, and the tracker then prints a KeyError (CPython 3.11-3.13).
        with _tracker_skipping("unregister", name):
            segment = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
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
    clean unlink made the tracker print a KeyError.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
    with _tracker_skipping("register", name):  # 3.11 and 3.12 register every segment they map
        return shared_memory.SharedMemory(name=name, create=False)


@contextlib.contextmanager
def _tracker_skipping(call: str, name: str) -> Iterator[None]:
    """For the time of the block, `resource_tracker.<call>` ("register" or "unregister") skips the shared segment
    `name`; other names (other threads' segments, made meanwhile) pass through. One block at a time."""
    with _TRACKER_SWAP:
        original, skipped = getattr(resource_tracker, call), (name, "/" + name)

        def others(name: Sized, rtype: str) -> None:  # the parameters named as the tracker's
            if rtype != "shared_memory" or name not in skipped:
                original(name, rtype)

        setattr(resource_tracker, call, others)
        try:
            yield
        finally:
            setattr(resource_tracker, call, original)


_TRACKER_SWAP = threading.Lock()
