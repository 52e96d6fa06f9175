"""Page pools: fixed-size pages of one storage tier.

A pool hands out page numbers (`try_allocate` / `free`, both O(1)) and moves
bytes in and out of pages (`write` / `read`). The tiered cache (`tiered`) maps
block keys to pages across an ordered list of pools; the transfer engine
registers a pool's whole `buffer` once and addresses pages by
``page * page_bytes``.

- `DramPagePool`: one preallocated, 4 KiB-aligned host buffer (numpy, or pinned
  torch memory when asked and CUDA exists); `read` is a zero-copy view.
- `VramPagePool`: one torch CUDA tensor; `read` is a zero-copy tensor slice.
- `SsdPagePool` (module `ssd`): a preallocated file with checksummed pages.
- `MetadataPagePool`: page accounting with no bytes at all, so simulators run
  the same cache code at cluster scale.

Every pool, the SSD one included, is an `AllocatingPool`: its geometry and one
`PageAllocator`, so all of them hand out the same page numbers in the same order.

Invariants (`PageAllocator.check_invariants`): a page is either free or
allocated, never both; allocated + free = all pages handed out so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from mooncake._checks import is_int, require_int, shown
from mooncake._extras import needs_extra
from mooncake.cache.events import parse_tier
from mooncake.errors import CapacityError, ConfigError, InvalidRequestError
from mooncake.types import BlockKey, Tier

if TYPE_CHECKING:  # torch is loaded only by the pools that need it
    import torch

__all__ = [
    "AllocatingPool",
    "Buffer",
    "DramPagePool",
    "MetadataPagePool",
    "PageAllocator",
    "PageBytes",
    "PagePool",
    "VramPagePool",
    "check_geometry",
]

Buffer: TypeAlias = Any
"""What pages are written from: bytes, bytearray, memoryview, a numpy array, any
object with the buffer protocol (typed loosely: numpy arrays are not `Buffer`s
to Python 3.11's type checker)."""

PageBytes: TypeAlias = "memoryview | torch.Tensor"
"""What pages are read as: a flat byte memoryview of host memory (a DRAM page
itself; a verified copy of an SSD page), or a flat uint8 torch tensor (a VRAM
page itself)."""

ALIGNMENT_BYTES = 4096  # O_DIRECT and DMA engines want page-aligned buffers


def check_geometry(page_bytes: int, num_pages: int) -> None:
    """Raise ConfigError unless both are positive integers."""
    for name, value in (("page_bytes", page_bytes), ("num_pages", num_pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {shown(value)}")


class PagePool(Protocol):
    """Fixed-size pages of one tier. Attributes `tier`, `page_bytes`, `num_pages`,
    `num_free`, `holds_bytes` and `zero_copy` describe it."""

    tier: Tier
    page_bytes: int
    num_pages: int
    holds_bytes: bool
    zero_copy: bool  # `read` returns a view of the page itself, not a copy

    @property
    def num_free(self) -> int: ...

    def try_allocate(self) -> int | None:
        """A free page, or None when every page is in use."""

    def free(self, page: int) -> None:
        """Return an allocated page."""

    def write(self, page: int, data: Buffer | None, *, key: BlockKey, checksum: int | None = None) -> None:
        """Store `data` (at most `page_bytes`) in `page`; `key` and `checksum`
        label it where the medium keeps labels (SSD). Every pool takes zero bytes
        (an empty block), copying nothing."""

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> PageBytes | None:
        """The first `length` bytes of `page`: a zero-copy view where the medium allows
        (None where the pool holds no bytes); `key`, the block expected there, is checked
        where the medium keeps labels (SSD)."""

    def close(self) -> None:
        """Release the pool's resources."""


class PageAllocator:
    """O(1) page allocation: a bump pointer over never-used pages plus a free stack.

    Pages are handed out lazily, so a pool of a billion metadata pages costs one
    byte per page only once it has been used.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._next_unused = 0
        self._free: list[int] = []
        self._allocated = bytearray()

    @property
    def num_free(self) -> int:
        return self.num_pages - self._next_unused + len(self._free)

    def try_allocate(self) -> int | None:
        if self._free:
            page = self._free.pop()
        elif self._next_unused < self.num_pages:
            page = self._next_unused
            self._next_unused += 1
            self._allocated.append(0)
        else:
            return None
        self._allocated[page] = 1
        return page

    def claim(self, page: int) -> None:
        """Mark a specific free page allocated (used when reopening a persistent pool)."""
        page = self._check_page(page)
        if page >= self._next_unused:
            # The pages skipped become free; the claimed one never enters the free list.
            self._free.extend(range(self._next_unused, page))
            self._allocated.extend(bytes(page + 1 - self._next_unused))
            self._next_unused = page + 1
        elif self._allocated[page]:
            raise InvalidRequestError(f"page {page} is already allocated")
        else:
            self._free.remove(page)  # O(free), but recovery claims pages in rising order: not reached
        self._allocated[page] = 1

    def free(self, page: int) -> None:
        page = self._check_page(page)
        if page >= self._next_unused or not self._allocated[page]:
            raise InvalidRequestError(f"page {page} is not allocated")
        self._allocated[page] = 0
        self._free.append(page)

    def is_page(self, page: Any) -> bool:
        """Whether `page` is one of this allocator's page numbers: an integer in [0, num_pages), as `is_int` has
        it. The one rule of every page check (a pool's too): a numpy integer is a page number; a bool, which a
        bytearray index would take as page 0 or 1, is none, nor is a float or a str."""
        return is_int(page) and 0 <= page < self.num_pages

    def is_allocated(self, page: Any) -> bool:
        """Whether `page` is a page number (`is_page`) now allocated; never raises."""
        return self.is_page(page) and page < self._next_unused and bool(self._allocated[page])

    def check_invariants(self) -> None:
        assert len(self._allocated) == self._next_unused <= self.num_pages
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert all(not self._allocated[p] for p in self._free), "a free page is marked allocated"
        assert sum(self._allocated) + len(self._free) == self._next_unused, "pages lost"

    def _check_page(self, page: Any) -> int:
        """`page` as an int (`is_page`), or InvalidRequestError naming it."""
        if not self.is_page(page):
            raise InvalidRequestError(f"page must be an integer in [0, {self.num_pages}), got {shown(page)}")
        return int(page)


def as_bytes_view(data: Buffer, page_bytes: int) -> memoryview:
    """`data` as a flat byte view, checked to fit one page (no copy)."""
    if isinstance(data, np.ndarray):  # any shape and dtype, zero-size included
        if not data.flags.c_contiguous:
            raise InvalidRequestError("page data must be a contiguous buffer")
        view = data.reshape(-1).view(np.uint8).data
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise InvalidRequestError(
                f"page data must be bytes-like (bytes, bytearray, memoryview, a numpy array), got {type(data).__name__}"
            ) from None
        if not view.c_contiguous:
            raise InvalidRequestError("page data must be a contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    if view.nbytes > page_bytes:
        raise CapacityError(f"{view.nbytes} bytes do not fit a page of {page_bytes} bytes")
    return view


def check_checksum(checksum: object) -> int:
    """`checksum` as an XXH3-64 value (an integer in [0, 2**64)), or InvalidRequestError naming it."""
    return require_int("checksum (an XXH3-64 value)", checksum, minimum=0, below=1 << 64, error=InvalidRequestError)


def aligned_buffer(num_bytes: int, *, prefault: bool = False) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A zeroed uint8 array whose first byte is `ALIGNMENT_BYTES`-aligned."""
    raw = np.zeros(num_bytes + ALIGNMENT_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT_BYTES
    buffer = raw[start : start + num_bytes]
    if prefault:  # touch every OS page now rather than on first write
        buffer[::4096] = 0
        buffer.fill(0)
    return buffer


class AllocatingPool:
    """What every pool shares: its geometry, one `PageAllocator`, and the check that a page
    is allocated. A pool adds `write` and `read` (and `close`, when it holds more than memory).

    Invariants: those of `allocator` (free ⊎ allocated = all pages handed out so far).
    """

    tier: Tier
    holds_bytes = True
    zero_copy = True

    def __init__(self, tier: Tier, page_bytes: int, num_pages: int) -> None:
        check_geometry(page_bytes, num_pages)
        self.tier = parse_tier(tier)  # ConfigError naming the tiers, not Tier's bare ValueError
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def capacity_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    def try_allocate(self) -> int | None:
        return self.allocator.try_allocate()

    def free(self, page: int) -> None:
        self.allocator.free(self._check_allocated(page))

    def close(self) -> None:
        """Nothing to release beyond memory."""

    def _check_allocated(self, page: Any) -> int:
        """`page` as the int of an allocated page (`PageAllocator.is_page`), or InvalidRequestError naming it: every
        pool call checks its page here first, before anything changes."""
        if not self.allocator.is_allocated(page):
            what = "is not allocated" if is_int(page) else "is no page number (an integer; a bool is none)"
            raise InvalidRequestError(f"{self.tier.name} page {shown(page)} {what}")
        return int(page)

    def _check_length(self, length: int) -> int:
        """`length` as a byte count that one page holds, or InvalidRequestError naming it (a float or a
        str would otherwise fail deep in a slice or a buffer allocation, and a count past the page would
        read the next page's bytes)."""
        if not is_int(length) or not 0 <= length <= self.page_bytes:
            raise InvalidRequestError(f"length must be an integer in [0, {self.page_bytes}], got {shown(length)}")
        return int(length)

    def _span(self, page: int, length: int) -> slice:
        """Where `page`'s first `length` bytes lie in a buffer of all pages (page and length checked)."""
        page = self._check_allocated(page)
        if type(length) is not int or not 0 <= length <= self.page_bytes:  # the common case in one test: per get
            length = self._check_length(length)
        start = page * self.page_bytes
        return slice(start, start + length)


class DramPagePool(AllocatingPool):
    """Pages in one preallocated, 4 KiB-aligned host buffer.

    Args:
        page_bytes, num_pages: the geometry.
        pinned: back the buffer with page-locked torch memory (needs torch and CUDA).
        prefault: touch every page at construction (steady performance, full RSS at once).
        buffer: use this uint8 array of exactly page_bytes * num_pages bytes instead of
            allocating (e.g. a transfer engine's shared-memory region).
    """

    def __init__(
        self,
        page_bytes: int,
        num_pages: int,
        *,
        pinned: bool = False,
        prefault: bool = False,
        tier: Tier = Tier.DRAM,
        buffer: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> None:
        super().__init__(tier, page_bytes, num_pages)
        if buffer is not None:
            if (
                not isinstance(buffer, np.ndarray)
                or buffer.dtype != np.uint8
                or buffer.ndim != 1
                or buffer.size != page_bytes * num_pages
            ):
                raise ConfigError(
                    f"buffer must be a flat uint8 array of {page_bytes * num_pages} bytes, got "
                    + (f"{buffer.dtype} {buffer.shape}" if isinstance(buffer, np.ndarray) else type(buffer).__name__)
                )
            self.buffer = buffer
        elif pinned:
            self.buffer = _pinned_buffer(page_bytes * num_pages)
        else:
            try:
                self.buffer = aligned_buffer(page_bytes * num_pages, prefault=prefault)
            except (ValueError, MemoryError) as error:  # numpy's "maximum allowed dimension exceeded", or no memory
                raise ConfigError(
                    f"cannot allocate {num_pages} DRAM pages of {page_bytes} bytes ({page_bytes * num_pages} bytes): "
                    f"{error}"
                ) from error
        self._view = self.buffer.data

    def write(self, page: int, data: Buffer | None, *, key: BlockKey, checksum: int | None = None) -> None:
        page = self._check_allocated(page)
        if data is None:
            raise InvalidRequestError("a DRAM pool stores bytes: data must not be None")
        source = as_bytes_view(data, self.page_bytes)
        start = page * self.page_bytes
        self._view[start : start + source.nbytes] = source

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> memoryview:
        return self._view[self._span(page, length)]


def _pinned_buffer(num_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    with needs_extra("pinned=True"):
        import torch
    if not torch.cuda.is_available():
        raise ConfigError("pinned=True needs CUDA: page-locked memory only helps transfers to a GPU")
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True).numpy()  # type: ignore[no-any-return,unused-ignore]


class VramPagePool(AllocatingPool):
    """Pages in one CUDA tensor; `read` returns a zero-copy tensor slice.

    Args:
        page_bytes, num_pages: the geometry.
        device: a CUDA device ("cuda", "cuda:1", ...).
    """

    def __init__(self, page_bytes: int, num_pages: int, *, device: str = "cuda") -> None:
        super().__init__(Tier.VRAM, page_bytes, num_pages)
        with needs_extra("a VRAM pool"):
            import torch
        if not torch.cuda.is_available():
            raise ConfigError("a VRAM pool needs CUDA, and torch sees no CUDA device here")
        self._torch = torch
        self.buffer = torch.empty(page_bytes * num_pages, dtype=torch.uint8, device=device)

    def write(self, page: int, data: Buffer | None, *, key: BlockKey, checksum: int | None = None) -> None:
        page = self._check_allocated(page)
        if data is None:
            raise InvalidRequestError("a VRAM pool stores bytes: data must not be None")
        start = page * self.page_bytes
        if isinstance(data, self._torch.Tensor):
            source = data.reshape(-1).view(self._torch.uint8)
        else:
            view = as_bytes_view(data, self.page_bytes)
            if not view.nbytes:
                return  # an empty block, as every pool takes it (torch.frombuffer refuses an empty buffer)
            if view.readonly:
                # torch borrows only writable memory (else it warns that its tensor could write into `bytes`):
                # a copy for this host-to-device copy to read.
                view = memoryview(bytearray(view))
            source = self._torch.frombuffer(view, dtype=self._torch.uint8)
        if source.numel() > self.page_bytes:
            raise CapacityError(f"{source.numel()} bytes do not fit a page of {self.page_bytes} bytes")
        self.buffer[start : start + source.numel()].copy_(source)

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> torch.Tensor:
        return self.buffer[self._span(page, length)]


class MetadataPagePool(AllocatingPool):
    """Page accounting without bytes: `write` checks sizes only, `read` returns None."""

    holds_bytes = False
    zero_copy = False

    def write(self, page: int, data: Buffer | None, *, key: BlockKey, checksum: int | None = None) -> None:
        self._check_allocated(page)
        if data is not None:
            as_bytes_view(data, self.page_bytes)

    def read(self, page: int, length: int, *, key: BlockKey | None = None) -> None:
        self._check_allocated(page)
        return None
