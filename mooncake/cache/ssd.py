"""The SSD page pool: checksummed pages in one preallocated file, reopened after a crash.

File layout (all integers little-endian):

    offset 0            superblock, 4 KiB: magic "MCSSD\\0v1", format version (2), page_bytes, num_pages,
                        the label (length, UTF-8 bytes), xxh3 of the fields
    4096 + i * slot     slot i: a 4 KiB header, then the page (page_bytes rounded up to 4 KiB)

    slot header: magic "MCPG", data length, xxh3-64 of the data, generation,
                 key (32 bytes), xxh3-64 of the header fields

A page is written in two calls: its data behind a zeroed header (which
invalidates whatever header stood there), then, once that call wrote every
byte, its header. A write that fails (an I/O error, a short write) therefore
never leaves a header over bytes it did not write, and a page freed is never
adopted with another block's bytes under its old header. (The kernel may still
put the two on the disk in either order: a power cut between them, with the
fsync policy below, can leave a header over torn data, which fails its checksum
on read.) Freeing a page zeroes its header. Reopening reads every slot header
and adopts the valid ones without reading their data (a header that is torn,
foreign or unreadable, a bad sector, leaves its page free: an unreadable one is
logged as a warning); for a key found twice (a
freed copy whose zeroing was lost beside a newer one), it reads both and keeps
the newest whose data verifies, so a torn newest copy never costs the block its
good older one. Data is verified on every read, so a torn or corrupted page
raises `IntegrityError` and is never returned, and so is a valid page of another
key in the slot (a misdirected write): a read checks that the header holds the
key this pool wrote there, and the key the caller asks for, where it names one.
Stale pages that survive a crash are harmless: keys are content hashes, so a
page valid for its key holds the right bytes, as long as the bytes mean what
the reader takes them to mean. That is the pool's `label` (the hasher's
namespace, the KV dtype and layout), kept in the superblock: a file written
under another label is refused on opening (the same tokens' KV in bf16 and in
fp16 has one key where the namespace omits the dtype, and one page size). A
file of format version 1 (before labels) reads as label "".
A pool holds an exclusive `flock` on its file: a second pool on a file in use,
in this process or another, is refused (both would hand out the same free
pages). The lock belongs to the open file, so a child forked without exec
holds it too: after the parent dies the file stays refused until that child
exits or closes it. `close()` releases file and lock; a pool collected without
it is closed then, with a ResourceWarning (as an unclosed file is).
A new file gets its superblock (fsynced) before it is preallocated, and a file
found shorter than its pages (a process killed while preallocating, a cut file)
is preallocated again on opening: no page write later meets a full disk (a
file system without the room raises CapacityError, at any step). A failed
page read or write raises DiskError (an OSError) naming the file, page and
block. A page whose header cannot be zeroed (a write error) is raised and
released all the same, so a failing disk never shrinks the pool.

fsync policy: `fsync_every=N` calls fdatasync after every N page writes (0:
leave it to the OS; a killed process loses nothing the kernel has, a power cut
may lose recent pages, which then fail their checksum or vanish); `flush()`
syncs now.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import warnings
import weakref
from typing import Any

import attrs
import numpy as np
import xxhash

from mooncake._checks import require_bool, require_str, shown
from mooncake.cache.pool import (
    ALIGNMENT_BYTES,
    AllocatingPool,
    Buffer,
    aligned_buffer,
    as_bytes_view,
    check_checksum,
)
from mooncake.errors import CapacityError, ConfigError, DiskError, IntegrityError, InvalidRequestError
from mooncake.types import BlockKey, Tier

__all__ = ["MAX_LABEL_BYTES", "RecoveredPage", "SsdPagePool"]

LOG = logging.getLogger("mooncake.cache")

_SUPER = struct.Struct("<8sIQQ")
_SUPER_MAGIC = b"MCSSD\0v1"
_SUPER_VERSION = 2  # 1: no label (read as label ""); 2: a label after the geometry
_LABEL_LENGTH = struct.Struct("<I")
MAX_LABEL_BYTES = 1024  # of UTF-8; the superblock's 4 KiB would hold more, no label needs it
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_HEADER = struct.Struct("<4sIQQQ32s")
_HEADER_MAGIC = b"MCPG"
_CHECK = struct.Struct("<Q")
_KEY_BYTES = 32
HEADER_BYTES = ALIGNMENT_BYTES
READ_CHUNK_BYTES = 512 * 1024  # half a core's L2 here; a multiple of the O_DIRECT alignment


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _close_unclosed(fd: int, path: str) -> None:
    """Release the file (and its lock) of a pool collected without `close()`, and say so."""
    os.close(fd)  # first: a warnings filter that raises must not keep the file locked
    warnings.warn(f"SSD page pool on {path} was never closed", ResourceWarning, stacklevel=1)


def _describe(buffer: object) -> str:
    """A buffer as an error message names it: its type, and a numpy array's dtype and shape."""
    if isinstance(buffer, np.ndarray):
        return f"a {buffer.dtype} array of shape {buffer.shape}"
    return repr(buffer) if isinstance(buffer, int | float) else type(buffer).__name__


def checksum(data: Buffer) -> int:
    """The page checksum: XXH3-64 of the bytes, seed 0."""
    return xxhash.xxh3_64_intdigest(data)


@attrs.frozen(kw_only=True)
class RecoveredPage:
    """A valid page found when reopening a pool file."""

    page: int
    key: BlockKey
    length: int
    checksum: int
    generation: int


class SsdPagePool(AllocatingPool):
    """Pages in a preallocated file, read and written with pread/pwrite.

    Args:
        path: the pool file; created if missing, reopened (and recovered) if it exists.
        page_bytes, num_pages: the geometry; must match an existing file's.
        label: what the pages' bytes mean: the block hasher's namespace plus the KV dtype and layout (at most
            `MAX_LABEL_BYTES` of UTF-8); must match an existing file's. A key names tokens, not the bytes their KV
            takes, so pages written under another label (bf16 KV read as fp16, of the same page size) must not
            come back as valid.
        o_direct: bypass the page cache (O_DIRECT; aligned bounce buffers are used).
        fsync_every: fdatasync after this many page writes (0: never by itself).

    Raises:
        ConfigError: the file exists but is not a pool file, or has another geometry or label; `label` is not
            a string of at most MAX_LABEL_BYTES bytes.
        CapacityError: the file system cannot hold the file.
        DiskError: the superblock of an existing file cannot be read (naming the file; a slot header that cannot
            be read, or an older duplicate's that cannot be invalidated, only leaves its page free).
    """

    zero_copy = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        page_bytes: int,
        num_pages: int,
        *,
        label: str = "",
        o_direct: bool = False,
        fsync_every: int = 0,
        tier: Tier = Tier.SSD,
    ) -> None:
        super().__init__(tier, page_bytes, num_pages)
        if isinstance(fsync_every, bool) or not isinstance(fsync_every, int) or fsync_every < 0:
            raise ConfigError(f"fsync_every must be an integer >= 0, got {shown(fsync_every)}")
        require_bool("o_direct", o_direct)
        require_str("label", label, empty=True)
        try:
            encoded = label.encode()
        except UnicodeEncodeError as error:  # a lone surrogate
            raise ConfigError(f"label must be encodable as UTF-8, got {shown(label)}") from error
        if len(encoded) > MAX_LABEL_BYTES:
            raise ConfigError(f"label must take at most {MAX_LABEL_BYTES} bytes of UTF-8, got {len(encoded)}")
        self.label = label
        self.path = os.fspath(path)
        self.slot_bytes = HEADER_BYTES + _round_up(page_bytes, ALIGNMENT_BYTES)
        self.file_bytes = HEADER_BYTES + num_pages * self.slot_bytes
        self.o_direct = o_direct
        self.fsync_every = fsync_every
        self._writes_since_sync = 0
        self._generation = 0
        self._write_lock = threading.Lock()
        self._scratch = threading.local()  # per-thread header buffers: readers run concurrently
        self._zeros = aligned_buffer(HEADER_BYTES)  # written to free a slot; never modified
        self._bounce = aligned_buffer(self.slot_bytes) if o_direct else None
        # The key this pool wrote to each page: a read checks the header holds it, so a slot overwritten
        # with another valid page (a misdirected write, another writer) is never served as this key.
        self._keys: dict[int, BlockKey] = {}
        # Per page whose last write failed, that failure: a free that then fails too names both (the caller's
        # error is the free's, raised while it gave back the page it could not fill).
        self._failed_writes: dict[int, str] = {}
        flags = os.O_RDWR | (os.O_DIRECT if o_direct else 0)
        try:
            try:  # O_EXCL: whether this call made the file is known for sure (only such a file is removed on failure)
                self._fd, created = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                self._fd, created = os.open(self.path, flags), False
        except OSError as error:
            self._raise_if_no_space(error, f"create a pool file of {self.file_bytes:,} bytes")
            raise ConfigError(f"cannot open SSD pool file {self.path}: {error.strerror}") from error
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one pool per file: two would share free pages
        except BlockingIOError as error:
            os.close(self._fd)  # and never remove it: the holder's file, even if this call made it
            raise ConfigError(
                f"SSD pool file {self.path} is in use by another pool (in this process or another); "
                "give each pool its own file"
            ) from error
        try:
            size = os.fstat(self._fd).st_size  # read under the lock: what the last holder left
            if size > 0:
                self.recovered = self._recover()
            else:
                self._write_superblock()
                self.recovered = ()
            if size < self.file_bytes:  # new, or cut short (by a crash while it was made)
                self._preallocate()
        except BaseException:
            os.close(self._fd)
            if created:  # leave nothing half-made behind (never a file, or a device, that was there before)
                os.unlink(self.path)
            raise
        # A pool dropped unclosed would hold its fd and flock until the process exits: no pool could reopen
        # the file. (At exit the OS releases both; no warning then.)
        self._finalizer = weakref.finalize(self, _close_unclosed, self._fd, self.path)
        self._finalizer.atexit = False

    # ------------------------------------------------------------------ pool protocol

    def free(self, page: int) -> None:
        """Invalidate `page`'s header on disk, then release it.

        A failed invalidation (an I/O error) is raised, and the page is released all the same: a page lost for
        good would shrink the pool. Its old header may then stand until the page is written again; reads check
        the key this pool wrote (it has none now), and a recovery that finds the header finds the block's own
        verified bytes (a key names its tokens' content): a header is written only after its data (`write`), and
        the next write of the page zeroes it before touching the data.

        Raises:
            InvalidRequestError: `page` is not allocated (before anything changes).
            DiskError: the header could not be zeroed (naming the page's failed write too, where its last write
                failed: the error a caller giving back a page it could not fill sees).
        """
        page = self._check_allocated(page)
        key = self._keys.pop(page, None)
        failed_write = self._failed_writes.pop(page, None)
        try:
            self._pwrite(self._zeros, self._slot(page))
        except OSError as error:
            raise self._disk_error(error, "zeroing the header to free it", page, key, earlier=failed_write) from error
        finally:
            super().free(page)

    def write(self, page: int, data: Buffer | None, *, key: BlockKey, checksum: int | None = None) -> None:
        """Write `data` behind a zeroed header, then, once all of it is written, its header (see the module
        docstring: a failed write never leaves a header a recovery would adopt); `checksum` is computed when not
        given.

        Raises:
            InvalidRequestError: `page` is not allocated, `data` is None, `key` is not in [0, 2**256), or
                `checksum` not in [0, 2**64) (each before anything changes).
            DiskError: a write failed or fell short. The page then serves no block; a restart never finds the
                block written (its header was not), though it may find the page's old one where nothing landed.
        """
        page = self._check_allocated(page)
        if data is None:
            raise InvalidRequestError("an SSD pool stores bytes: data must not be None")
        source = as_bytes_view(data, self.page_bytes)
        digest = xxhash.xxh3_64_intdigest(source) if checksum is None else check_checksum(checksum)
        offset = self._slot(page)
        with self._write_lock:  # the generation counter and the O_DIRECT bounce buffer are shared
            header = self._pack_header(source.nbytes, digest, self._generation + 1, key)  # checks the key first
            self._generation += 1
            self._keys.pop(page, None)  # from here on the page's old block is gone, whatever happens
            self._failed_writes.pop(page, None)
            try:
                if self._bounce is not None:
                    length = HEADER_BYTES + _round_up(source.nbytes, ALIGNMENT_BYTES)
                    self._bounce[:HEADER_BYTES] = 0
                    self._bounce[HEADER_BYTES : HEADER_BYTES + source.nbytes] = np.frombuffer(source, dtype=np.uint8)
                    self._bounce[HEADER_BYTES + source.nbytes : length] = 0
                    self._pwrite(self._bounce.data[:length], offset)
                    self._bounce[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
                    self._pwrite(self._bounce.data[:HEADER_BYTES], offset)
                else:
                    self._pwritev([self._zeros, source], offset)
                    self._pwritev([header], offset)
            except OSError as error:
                failure = self._disk_error(error, "writing the page", page, key)
                self._failed_writes[page] = failure.strerror or str(failure)  # its message, without "[Errno 5]"
                raise failure from error
            self._keys[page] = key
            self._writes_since_sync += 1
            sync = self.fsync_every and self._writes_since_sync >= self.fsync_every
        if sync:
            self.flush()

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> memoryview:
        """The page's bytes in a new buffer, verified against its header (and `key`, the block expected there,
        where given).

        Raises:
            IntegrityError: the header is invalid, holds another key, its length disagrees, or the checksum fails.
            InvalidRequestError: `page` is not allocated, or `length` is not an integer in [0, page_bytes].
        """
        page = self._check_allocated(page)
        length = self._check_length(length)  # before it sizes a buffer
        out = np.empty(_round_up(length, ALIGNMENT_BYTES) if self.o_direct else length, dtype=np.uint8)
        if self.o_direct and out.ctypes.data % ALIGNMENT_BYTES:
            out = aligned_buffer(out.size)
        self.read_into(page, length, out, key=key)
        return out.data[:length]

    def read_into(
        self,
        page: int,
        length: int,
        out: np.ndarray[Any, Any] | bytearray | memoryview,
        *,
        key: BlockKey | None = None,
    ) -> int:
        """Read the page into `out` (a writable, contiguous buffer of at least `length` bytes; with O_DIRECT,
        4 KiB-aligned and of at least `length` rounded up to 4 KiB); returns the checksum.

        Raises:
            IntegrityError: the header is invalid, holds another key than this pool wrote there (or than `key`,
                where given), its length disagrees, or the checksum fails.
            InvalidRequestError: `page` is not allocated, `length` is not an integer in [0, page_bytes], or `out`
                is no such buffer (each before any I/O: a caller's buffer is never blamed on the disk).
        """
        page = self._check_allocated(page)
        length = self._check_length(length)  # one past the page would read the next slot's header
        return self._read_verified(page, length, self._target(out, length), self._keys.get(page), key)

    def _target(self, out: object, length: int) -> memoryview:
        """`out` as a flat byte view that a read of `length` bytes can fill, or InvalidRequestError naming it."""
        if isinstance(out, np.ndarray):  # any shape and dtype: its bytes
            if not out.flags.writeable or not out.flags.c_contiguous or out.dtype.hasobject:
                raise InvalidRequestError(
                    f"out must be a writable, contiguous array of plain values (no Python objects), got {_describe(out)}"
                )
            target = out.reshape(-1).view(np.uint8).data
        else:
            try:
                target = memoryview(out)  # type: ignore[arg-type]
            except TypeError:
                raise InvalidRequestError(
                    f"out must be a writable buffer (a bytearray, a numpy array, a memoryview), got {_describe(out)}"
                ) from None
            if target.readonly or not target.c_contiguous:
                raise InvalidRequestError(f"out must be a writable, contiguous buffer, got {_describe(out)}")
            target = target.cast("B")
        size = _round_up(length, ALIGNMENT_BYTES) if self.o_direct else length
        if target.nbytes < size:
            rounded = f" (with O_DIRECT: {length} rounded up to 4 KiB)" if size != length else ""
            raise InvalidRequestError(f"buffer of {target.nbytes} bytes cannot take {size}{rounded}")
        if self.o_direct and size and np.frombuffer(target, dtype=np.uint8).ctypes.data % ALIGNMENT_BYTES:
            raise InvalidRequestError(
                f"out must start on a {ALIGNMENT_BYTES}-byte boundary with O_DIRECT (see `aligned_buffer`), got "
                f"{_describe(out)} at address {np.frombuffer(target, dtype=np.uint8).ctypes.data:#x}"
            )
        return target

    def _read_verified(
        self, page: int, length: int, target: memoryview, expected: BlockKey | None, key: BlockKey | None
    ) -> int:
        """Read `page` into `target` (checked by `_target`) and verify it: its header, holding `expected` (the
        block this pool wrote there) and `key` (where given), its length and its checksum, which it returns."""
        offset = self._slot(page)
        size = _round_up(length, ALIGNMENT_BYTES) if self.o_direct else length
        header = self._header_buffer()
        # A large page is read and hashed a chunk at a time, each chunk hashed while it is still in the
        # CPU's cache: hashing it whole after the read takes a second trip through memory (16 MiB pages:
        # 0.70 of a raw read whole, 0.85 in chunks). The streamed XXH3 equals the one-shot digest.
        first = size if size <= 2 * READ_CHUNK_BYTES else READ_CHUNK_BYTES
        got = self._preadv([header.data, target[:first]], offset, page, expected)
        if got < HEADER_BYTES + min(first, length):
            raise IntegrityError(f"{self._where(page, expected)}: short read of {got} bytes")
        stored_length, digest, _generation, found = self._unpack_header(header, page, expected)
        if found != expected:
            wanted = "nothing" if expected is None else f"block {expected:#x}"
            raise IntegrityError(
                f"{self.path} page {page}: holds block {found:#x}, but this pool wrote {wanted} there "
                "(a misdirected write, or another writer of the file)"
            )
        if key is not None and found != key:  # the caller's map of blocks to pages is wrong: never serve another's
            raise IntegrityError(f"{self.path} page {page}: holds block {found:#x}, not block {key:#x} as asked")
        if stored_length != length:
            raise IntegrityError(f"{self._where(page, expected)}: holds {stored_length} bytes, expected {length}")
        if first == size:
            actual = xxhash.xxh3_64_intdigest(target[:length])
        else:
            hasher = xxhash.xxh3_64(target[:first])
            for start in range(first, size, READ_CHUNK_BYTES):
                chunk = target[start : min(start + READ_CHUNK_BYTES, size)]
                got = self._preadv([chunk], offset + HEADER_BYTES + start, page, expected)
                if got < min(chunk.nbytes, length - start):
                    raise IntegrityError(f"{self._where(page, expected)}: short read at byte {start}: {got} bytes")
                hasher.update(chunk[: length - start])
            actual = hasher.intdigest()
        if actual != digest:
            raise IntegrityError(f"{self._where(page, expected)}: checksum {actual:#018x} != stored {digest:#018x}")
        return digest

    def flush(self) -> None:
        """Make every write so far durable (fdatasync).

        Raises:
            DiskError: the file system failed to sync (naming the file).
        """
        try:
            os.fdatasync(self._fd)
        except OSError as error:
            raise self._disk_error(error, "syncing", None, None) from error
        self._writes_since_sync = 0

    def close(self) -> None:
        """Release the file and its lock (idempotent)."""
        if self._finalizer.detach() is not None:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SsdPagePool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ on-disk format

    def _slot(self, page: int) -> int:
        return HEADER_BYTES + page * self.slot_bytes

    def _pack_header(self, length: int, digest: int, generation: int, key: int) -> bytes:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << (8 * _KEY_BYTES):
            raise InvalidRequestError(f"an SSD page key must be an integer in [0, 2**256), got {shown(key)}")
        fields = _HEADER.pack(_HEADER_MAGIC, 1, length, digest, generation, key.to_bytes(_KEY_BYTES, "little"))
        return (fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields))).ljust(HEADER_BYTES, b"\0")

    def _unpack_header(
        self, header: Any, page: int, expected: BlockKey | None = None
    ) -> tuple[int, int, int, BlockKey]:
        """The header's (length, checksum, generation, key); IntegrityError naming the page, and `expected` (the
        block meant to be there) where given, if it is invalid."""
        magic, _version, length, digest, generation, key = _HEADER.unpack_from(header)
        (check,) = _CHECK.unpack_from(header, _HEADER.size)
        if magic != _HEADER_MAGIC or check != xxhash.xxh3_64_intdigest(header.data[: _HEADER.size]):
            raise IntegrityError(f"{self._where(page, expected)}: invalid page header")
        if length > self.page_bytes:
            raise IntegrityError(
                f"{self._where(page, expected)}: header claims {length} bytes in a {self.page_bytes}-byte page"
            )
        return length, digest, generation, BlockKey(int.from_bytes(key, "little"))

    def _where(self, page: int | None, key: BlockKey | None) -> str:
        """The file, page and block an error is about, for its message."""
        where = self.path if page is None else f"{self.path} page {page}"
        return where if key is None else f"{where} (block {key:#x})"

    def _disk_error(
        self, error: OSError, doing: str, page: int | None, key: BlockKey | None, *, earlier: str | None = None
    ) -> DiskError:
        """`error` (from a page's read or write) as a DiskError naming the file, page and block (and `earlier`, a
        failure that led to this call); raise it from `error`. A full disk stays a DiskError with errno ENOSPC
        here: the file was preallocated, so this is a file system that broke that promise (copy-on-write, thin
        provisioning), not a pool too large."""
        message = f"{self._where(page, key)}: {doing} failed: {error.strerror or error}"
        if earlier is not None:
            message += f"; before that, {earlier}"
        return DiskError(error.errno, message) if error.errno is not None else DiskError(message)

    def _raise_if_no_space(self, error: OSError, doing: str) -> None:
        """Raise CapacityError from `error` where it says the file system has no room for the file (full, a
        quota, a file too large)."""
        if error.errno in _NO_SPACE:
            raise CapacityError(f"cannot {doing} for {self.path}: {error.strerror}") from error

    def _preadv(self, buffers: list[Any], offset: int, page: int, key: BlockKey | None) -> int:
        try:
            return os.preadv(self._fd, buffers, offset)
        except OSError as error:
            raise self._disk_error(error, "reading the page", page, key) from error

    def _header_buffer(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        buffer = getattr(self._scratch, "header", None)
        if buffer is None:
            buffer = self._scratch.header = aligned_buffer(HEADER_BYTES)
        return buffer

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data)
        if os.pwrite(self._fd, view, offset) != view.nbytes:
            raise OSError(errno.EIO, f"short write to {self.path}")

    def _pwritev(self, buffers: list[Any], offset: int) -> None:
        written = os.pwritev(self._fd, buffers, offset)
        expected = sum(memoryview(buffer).nbytes for buffer in buffers)
        if written != expected:
            raise OSError(errno.EIO, f"short write: {written} of {expected} bytes")

    def _write_superblock(self) -> None:
        """Mark a new file as a pool of this shape and label, durably, before it is preallocated: a process killed
        while preallocating leaves a file that the next pool recovers (and preallocates), not one it must refuse.
        (The checksum follows the label, so a reader of version 1, which expects it after the geometry, refuses
        the file rather than ignore its label.)"""
        label = self.label.encode()
        fields = _SUPER.pack(_SUPER_MAGIC, _SUPER_VERSION, self.page_bytes, self.num_pages)
        fields += _LABEL_LENGTH.pack(len(label)) + label
        superblock = aligned_buffer(HEADER_BYTES)
        superblock[: len(fields) + _CHECK.size] = np.frombuffer(
            fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields)), dtype=np.uint8
        )
        try:
            self._pwrite(superblock, 0)
            os.fsync(self._fd)
        except OSError as error:  # a full disk meets the superblock before the preallocation
            self._raise_if_no_space(error, f"write the superblock of a pool file of {self.file_bytes:,} bytes")
            raise

    def _preallocate(self) -> None:
        """Reserve the whole file on disk, so that a page write never meets a full disk."""
        try:
            os.posix_fallocate(self._fd, 0, self.file_bytes)
        except OverflowError as error:  # beyond the largest file offset
            raise CapacityError(f"cannot preallocate {self.file_bytes:,} bytes for {self.path}: too large") from error
        except OSError as error:
            self._raise_if_no_space(error, f"preallocate {self.file_bytes:,} bytes")
            raise

    def _recover(self) -> tuple[RecoveredPage, ...]:
        header = self._header_buffer()
        try:
            got = os.preadv(self._fd, [header.data], 0)
        except OSError as error:
            raise self._disk_error(error, "reading the superblock", None, None) from error
        if got < _SUPER.size + _CHECK.size:
            raise ConfigError(f"{self.path} is not a mooncake SSD pool file (too short)")
        raw = bytes(header[:got])
        magic, version, page_bytes, num_pages = _SUPER.unpack_from(raw)
        if magic == _SUPER_MAGIC and version not in (1, _SUPER_VERSION):
            raise ConfigError(
                f"{self.path} is not a mooncake SSD pool file of a format this version reads (version {version})"
            )
        label = b""  # version 1: written before labels, read as label ""
        end = _SUPER.size
        if version == _SUPER_VERSION:
            (size,) = _LABEL_LENGTH.unpack_from(raw, end)
            if size <= MAX_LABEL_BYTES:
                label = raw[end + _LABEL_LENGTH.size : end + _LABEL_LENGTH.size + size]
                end += _LABEL_LENGTH.size + size
        (check,) = _CHECK.unpack_from(raw, end) if end + _CHECK.size <= len(raw) else (None,)
        if magic != _SUPER_MAGIC or check != xxhash.xxh3_64_intdigest(raw[:end]):
            raise ConfigError(f"{self.path} is not a mooncake SSD pool file (bad superblock)")
        file_label = label.decode(errors="replace")  # checksummed: written by `_write_superblock`, valid UTF-8
        if file_label != self.label:
            before = " (format version 1, from before labels)" if version == 1 else ""
            raise ConfigError(
                # Both whole (at most MAX_LABEL_BYTES each, strings): where they differ may be past any cut.
                f"{self.path} holds pages labelled {file_label!r}{before}, but this pool is labelled {self.label!r}: "
                "their bytes mean something else (another hasher namespace, KV dtype or layout); give this pool "
                "another file, or remove that one"
            )
        if (page_bytes, num_pages) != (self.page_bytes, self.num_pages):
            raise ConfigError(
                f"{self.path} holds {num_pages} pages of {page_bytes} bytes; asked for "
                f"{self.num_pages} pages of {self.page_bytes} bytes (page size or count mismatch)"
            )
        copies: dict[BlockKey, list[RecoveredPage]] = {}
        for page in range(self.num_pages):
            try:
                if os.preadv(self._fd, [header.data], self._slot(page)) < HEADER_BYTES:
                    break
            except OSError as error:  # a bad sector costs its page, as a garbled header does, not the whole file
                LOG.warning("%s; its page is left free", self._disk_error(error, "reading the header", page, None))
                continue
            if not header[:4].any():
                continue
            try:
                length, digest, generation, key = self._unpack_header(header, page)
            except IntegrityError:
                continue  # a torn or foreign header: the slot is free
            found = RecoveredPage(page=page, key=key, length=length, checksum=digest, generation=generation)
            copies.setdefault(key, []).append(found)
            self._generation = max(self._generation, generation)
        kept: list[RecoveredPage] = []
        stale: list[int] = []
        for found_copies in copies.values():
            if len(found_copies) == 1:  # the common case: adopted by its header, its data verified on each read
                kept += found_copies
                continue
            # Rare (a freed copy whose zeroing was lost, beside a newer one): the newest copy whose data verifies
            # wins, so a newest copy torn by a crash never costs the block its good older one; none, where none does.
            newest_first = sorted(found_copies, key=lambda p: p.generation, reverse=True)
            winner = next((p for p in newest_first if self._verifies(p)), None)
            kept += [] if winner is None else [winner]
            stale += [p.page for p in found_copies if p is not winner]
        for page in stale:  # an older or torn copy of a key: invalidate it so it never comes back
            try:
                self._pwrite(self._zeros, self._slot(page))
            except OSError as error:
                # Left free all the same: a write to it zeroes its header first, and until then the next reopening
                # picks the same winner (the newest copy that verifies). One bad sector costs a page, not the tier.
                LOG.warning(
                    "%s; its page is left free", self._disk_error(error, "invalidating an older copy", page, None)
                )
        pages = tuple(sorted(kept, key=lambda p: p.page))
        for found in pages:
            self.allocator.claim(found.page)
            self._keys[found.page] = found.key
        return pages

    def _verifies(self, found: RecoveredPage) -> bool:
        """Whether a page found on reopening reads back whole and verified (an unreadable one does not)."""
        buffer = aligned_buffer(_round_up(found.length, ALIGNMENT_BYTES))  # fit for O_DIRECT too
        try:
            self._read_verified(found.page, found.length, buffer.data, found.key, None)
        except (IntegrityError, OSError):
            return False
        return True
