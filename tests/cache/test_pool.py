"""Tests of mooncake.cache.pool: the page allocator and the DRAM, VRAM and metadata pools.

Three layers: examples for the edge contracts (double free, unallocated pages,
oversized data, zero-copy views, alignment, pinned memory); properties of the
DRAM pool against a dict of pages; a state machine that drives the
allocator against a set-based reference with `check_invariants()` after every
step, and one per pool (DRAM, metadata, SSD with reopening) against its
allocated and written pages. O(1) allocation is checked by structure (lazy hand-out, a free stack),
never by timing: performance is measured in `benchmarks/`.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache.pool import ALIGNMENT_BYTES, DramPagePool, MetadataPagePool, PageAllocator, VramPagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.errors import CapacityError, ConfigError, DiskError, InvalidRequestError
from mooncake.types import BlockKey, Tier
from tests.strategies import page_payloads, page_pool_ops, page_sizes

KEY = BlockKey(1)
BAD_PAGES = [-1, 8, 10**9, True, 1.0, "0", None]  # for a pool of 8 pages
NO_PAGES = [True, False, 1.0, "0", None]  # no page number, whatever the pool (a bool would index page 0 or 1)


def handed_out(allocator: PageAllocator) -> tuple[set[int], set[int], set[int]]:
    """(free, allocated, handed out) from the allocator's own state: the pages it knows of."""
    known = set(range(allocator._next_unused))
    allocated = {page for page in known if allocator.is_allocated(page)}
    return set(allocator._free), allocated, known


# --------------------------------------------------------------------------- PageAllocator examples


def test_allocator_hands_out_every_page_once_then_none() -> None:
    """A fresh allocator hands out each of its pages exactly once, then None."""
    allocator = PageAllocator(5)
    pages = [allocator.try_allocate() for _ in range(5)]
    assert sorted(pages) == list(range(5))  # type: ignore[type-var]
    assert allocator.try_allocate() is None
    assert allocator.num_free == 0
    allocator.check_invariants()


def test_allocator_reuses_the_last_freed_page() -> None:
    """Freed pages go on a stack: the next allocation takes the most recently freed one."""
    allocator = PageAllocator(4)
    for _ in range(3):
        allocator.try_allocate()
    allocator.free(0)
    allocator.free(2)
    assert allocator.try_allocate() == 2
    assert allocator.try_allocate() == 0
    assert allocator.try_allocate() == 3  # then the never-used pages
    allocator.check_invariants()


def test_allocator_is_lazy() -> None:
    """A pool of 10**12 pages keeps state only for the pages handed out so far."""
    allocator = PageAllocator(10**12)
    pages = [allocator.try_allocate() for _ in range(100)]
    assert pages == list(range(100))
    assert allocator.num_free == 10**12 - 100
    assert len(allocator._allocated) == 100
    allocator.free(50)
    assert allocator.num_free == 10**12 - 99
    allocator.check_invariants()


def test_double_free_raises() -> None:
    """Freeing a page twice raises InvalidRequestError and leaves the state intact."""
    allocator = PageAllocator(4)
    page = allocator.try_allocate()
    assert page is not None
    allocator.free(page)
    with pytest.raises(InvalidRequestError, match=f"page {page} is not allocated"):
        allocator.free(page)
    allocator.check_invariants()
    assert allocator.num_free == 4


def test_free_of_a_never_allocated_page_raises() -> None:
    """Freeing an in-range page that was never handed out raises InvalidRequestError."""
    allocator = PageAllocator(4)
    allocator.try_allocate()
    with pytest.raises(InvalidRequestError, match="page 3 is not allocated"):
        allocator.free(3)
    allocator.check_invariants()


@pytest.mark.parametrize("page", BAD_PAGES, ids=repr)
def test_out_of_range_pages_raise(page: Any) -> None:
    """free and claim of a page outside [0, num_pages) (or not an int) raise InvalidRequestError naming it."""
    allocator = PageAllocator(8)
    for _ in range(8):
        allocator.try_allocate()
    with pytest.raises(InvalidRequestError, match=r"\[0, 8\)"):
        allocator.free(page)
    with pytest.raises(InvalidRequestError, match=r"\[0, 8\)"):
        allocator.claim(page)
    allocator.check_invariants()


def test_claim_marks_a_specific_page_allocated() -> None:
    """claim takes a page never handed out; the pages below it become free, and it is never allocated again."""
    allocator = PageAllocator(6)
    allocator.claim(3)
    assert allocator.is_allocated(3)
    assert allocator.num_free == 5
    free, allocated, known = handed_out(allocator)
    assert (free, allocated, known) == ({0, 1, 2}, {3}, {0, 1, 2, 3})
    others = {allocator.try_allocate() for _ in range(5)}
    assert others == {0, 1, 2, 4, 5}
    assert allocator.try_allocate() is None
    allocator.check_invariants()


def test_claim_of_a_freed_page_takes_it_off_the_free_stack() -> None:
    """claim of a page that was freed makes it allocated; allocation then never returns it."""
    allocator = PageAllocator(3)
    for _ in range(3):
        allocator.try_allocate()
    allocator.free(1)
    allocator.free(2)
    allocator.claim(1)
    assert allocator.try_allocate() == 2
    assert allocator.try_allocate() is None
    allocator.check_invariants()


def test_claim_of_an_allocated_page_raises() -> None:
    """claim of a page already allocated raises InvalidRequestError naming it."""
    allocator = PageAllocator(3)
    allocator.claim(1)
    with pytest.raises(InvalidRequestError, match="page 1 is already allocated"):
        allocator.claim(1)
    page = allocator.try_allocate()
    with pytest.raises(InvalidRequestError, match=f"page {page} is already allocated"):
        allocator.claim(page)  # type: ignore[arg-type]
    allocator.check_invariants()


def test_every_page_check_takes_numpy_integers_and_refuses_bools() -> None:
    """`is_allocated`, `free` and `claim` apply one rule (`is_page`): a numpy integer is a page number, and the
    page freed is kept as a plain int; a bool is none (`is_allocated(True)` used to say page 1, while `free(True)`
    was refused, and an SSD pool acted on the first before the second refused)."""
    allocator = PageAllocator(4)
    for _ in range(3):
        allocator.try_allocate()
    assert allocator.is_allocated(np.int64(1)) and allocator.is_page(np.uint8(3))
    for page in NO_PAGES:
        assert not allocator.is_page(page) and not allocator.is_allocated(page)
    allocator.free(np.int64(1))
    assert allocator._free == [1] and type(allocator._free[0]) is int
    allocator.claim(np.int32(1))
    allocator.check_invariants()


# --------------------------------------------------------------------------- PageAllocator properties

allocator_ops = st.lists(
    st.one_of(
        st.just(("allocate", 0)),
        st.tuples(st.just("free"), st.integers(-1, 9)),
        st.tuples(st.just("claim"), st.integers(-1, 9)),
    ),
    max_size=60,
)


@given(num_pages=st.integers(1, 8), ops=allocator_ops)
def test_free_and_allocated_partition_the_pages_handed_out(num_pages: int, ops: list[tuple[str, int]]) -> None:
    """After any operations, free ⊎ allocated = the pages handed out, and errors change nothing."""
    allocator = PageAllocator(num_pages)
    allocated: set[int] = set()
    for name, page in ops:
        if name == "allocate":
            got = allocator.try_allocate()
            if len(allocated) == num_pages:
                assert got is None
            else:
                assert got is not None and 0 <= got < num_pages and got not in allocated
                allocated.add(got)
        elif (page in allocated) if name == "free" else (0 <= page < num_pages and page not in allocated):
            getattr(allocator, name)(page)  # a valid free or claim flips the page
            allocated ^= {page}
        else:
            with pytest.raises(InvalidRequestError):
                getattr(allocator, name)(page)
        free, actual, known = handed_out(allocator)
        assert actual == allocated
        assert free.isdisjoint(actual) and free | actual == known
        assert allocator.num_free == num_pages - len(allocated)
        allocator.check_invariants()


class AllocatorMachine(RuleBasedStateMachine):
    """PageAllocator against a set of allocated pages."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator: PageAllocator | None = None
        self.allocated: set[int] = set()
        self.num_pages = 0

    @precondition(lambda self: self.allocator is None)
    @rule(num_pages=st.integers(1, 12))
    def create(self, num_pages: int) -> None:
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages

    @precondition(lambda self: self.allocator is not None)
    @rule()
    def allocate(self) -> None:
        assert self.allocator is not None
        page = self.allocator.try_allocate()
        if len(self.allocated) == self.num_pages:
            assert page is None, "allocated past capacity"
        else:
            assert page is not None, "None while pages are free"
            assert 0 <= page < self.num_pages and page not in self.allocated, f"handed out page {page} twice"
            self.allocated.add(page)

    @precondition(lambda self: self.allocator is not None and self.allocated)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        assert self.allocator is not None
        page = data.draw(st.sampled_from(sorted(self.allocated)))
        self.allocator.free(page)
        self.allocated.remove(page)

    @precondition(lambda self: self.allocator is not None)
    @rule(page=st.integers(-2, 14))
    def free_unallocated(self, page: int) -> None:
        assert self.allocator is not None
        if page in self.allocated:
            return
        with pytest.raises(InvalidRequestError):
            self.allocator.free(page)

    @precondition(lambda self: self.allocator is not None)
    @rule(page=st.integers(-2, 14))
    def claim(self, page: int) -> None:
        assert self.allocator is not None
        if 0 <= page < self.num_pages and page not in self.allocated:
            self.allocator.claim(page)
            self.allocated.add(page)
        else:
            with pytest.raises(InvalidRequestError):
                self.allocator.claim(page)

    @invariant()
    def matches_reference(self) -> None:
        if self.allocator is None:
            return
        self.allocator.check_invariants()
        assert self.allocator.num_free == self.num_pages - len(self.allocated)
        for page in range(-1, self.num_pages + 1):
            assert self.allocator.is_allocated(page) == (page in self.allocated), f"page {page}"
        free, allocated, known = handed_out(self.allocator)
        assert free.isdisjoint(allocated) and free | allocated == known, "free ⊎ allocated ≠ handed out"


TestAllocatorMachine = AllocatorMachine.TestCase


# --------------------------------------------------------------------------- geometry


@pytest.mark.parametrize("pool_class", [DramPagePool, MetadataPagePool], ids=["dram", "metadata"])
@pytest.mark.parametrize(
    ("page_bytes", "num_pages"), [(0, 4), (-1, 4), (4096, 0), (True, 4), (4096, 2.0), (1.5, 4)], ids=repr
)
def test_invalid_geometry_raises(pool_class: Any, page_bytes: Any, num_pages: Any) -> None:
    """A page size or count that is not a positive integer raises ConfigError naming it."""
    args = (page_bytes, num_pages) if pool_class is DramPagePool else (Tier.DRAM, page_bytes, num_pages)
    with pytest.raises(ConfigError, match="must be a positive integer"):
        pool_class(*args)


# --------------------------------------------------------------------------- DramPagePool examples


def allocated_page(pool: Any) -> int:
    page = pool.try_allocate()
    assert page is not None
    return int(page)


@pytest.mark.parametrize(
    "data",
    [
        b"hello, pages",
        bytearray(b"\x00\xff" * 100),
        memoryview(b"view of bytes"),
        b"",
        np.arange(24, dtype=np.float32),
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.array([1.5, -2.25], dtype=np.float16),
        np.array([True, False, True]),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.arange(6, dtype=">i4"),
        np.array(3.25),  # zero-dimensional
    ],
    ids=lambda d: type(d).__name__ + (f"-{d.dtype}-{d.shape}" if isinstance(d, np.ndarray) else f"-{len(d)}"),
)
def test_dram_round_trip(data: Any) -> None:
    """Any contiguous buffer written to a page reads back as exactly its bytes."""
    pool = DramPagePool(4096, 3)
    page = allocated_page(pool)
    expected = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    pool.write(page, data, key=KEY)
    assert bytes(pool.read(page, len(expected))) == expected
    if isinstance(data, np.ndarray):
        back = np.frombuffer(pool.read(page, data.nbytes), dtype=data.dtype).reshape(data.shape)
        assert back.tobytes() == data.tobytes()


def test_dram_read_is_a_zero_copy_view() -> None:
    """read returns a view of the pool's buffer: writes through the buffer or the pool show in it."""
    pool = DramPagePool(64, 4)
    pool.try_allocate()
    page = allocated_page(pool)
    pool.write(page, b"a" * 64, key=KEY)
    view = pool.read(page, 64)
    assert isinstance(view, memoryview)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), pool.buffer)
    pool.buffer[page * 64] = ord("z")
    assert bytes(view[:2]) == b"za"
    pool.write(page, b"xyz", key=KEY)
    assert bytes(view[:4]) == b"xyza"


@pytest.mark.parametrize(("page_bytes", "num_pages"), [(1, 1), (7, 3), (4096, 2), (5000, 3), (1 << 20, 2)])
@pytest.mark.parametrize("prefault", [False, True])
def test_dram_buffer_is_aligned_and_zeroed(page_bytes: int, num_pages: int, prefault: bool) -> None:
    """The buffer is one zeroed uint8 array of page_bytes * num_pages bytes starting on a 4 KiB boundary."""
    pool = DramPagePool(page_bytes, num_pages, prefault=prefault)
    assert pool.buffer.ctypes.data % ALIGNMENT_BYTES == 0
    assert pool.buffer.dtype == np.uint8 and pool.buffer.nbytes == page_bytes * num_pages
    assert not pool.buffer.any()
    assert pool.capacity_bytes == page_bytes * num_pages
    assert (pool.tier, pool.holds_bytes, pool.zero_copy, pool.num_free) == (Tier.DRAM, True, True, num_pages)


def test_dram_data_larger_than_a_page_raises_naming_both_sizes() -> None:
    """Writing more than page_bytes raises CapacityError naming the data size and the page size."""
    pool = DramPagePool(100, 2)
    page = allocated_page(pool)
    pool.write(page, b"k" * 100, key=KEY)
    with pytest.raises(CapacityError, match=r"101 bytes do not fit a page of 100 bytes"):
        pool.write(page, b"x" * 101, key=KEY)
    with pytest.raises(CapacityError, match=r"104 bytes do not fit a page of 100 bytes"):
        pool.write(page, np.zeros(13, dtype=np.float64), key=KEY)
    assert bytes(pool.read(page, 100)) == b"k" * 100  # nothing written


def test_dram_unallocated_pages_raise() -> None:
    """write and read of a page not allocated (never, freed, out of range) raise InvalidRequestError."""
    pool = DramPagePool(64, 2)
    page = allocated_page(pool)
    pool.free(page)
    for bad in (page, 1, 2, -1):
        with pytest.raises(InvalidRequestError, match="not allocated"):
            pool.write(bad, b"x", key=KEY)
        with pytest.raises(InvalidRequestError, match="not allocated"):
            pool.read(bad, 1)


def test_dram_rejects_none_non_contiguous_data_and_bad_lengths() -> None:
    """None data, a strided array and a read length outside [0, page_bytes] raise InvalidRequestError."""
    pool = DramPagePool(64, 1)
    page = allocated_page(pool)
    with pytest.raises(InvalidRequestError, match="must not be None"):
        pool.write(page, None, key=KEY)
    with pytest.raises(InvalidRequestError, match="contiguous"):
        pool.write(page, np.arange(10, dtype=np.uint8)[::2], key=KEY)
    for length in (-1, 65):
        with pytest.raises(InvalidRequestError, match=r"\[0, 64\]"):
            pool.read(page, length)
    assert bytes(pool.read(page, 0)) == b""


@pytest.mark.parametrize("length", [2.0, "8", True, None])
def test_dram_refuses_a_length_that_is_no_integer_by_name(length: object) -> None:
    """A read length that is no integer (a float, a str, a bool, None) is an InvalidRequestError naming it, as
    a negative one is (a float was a bare TypeError from the slice, and True read one byte)."""
    pool = DramPagePool(64, 1)
    page = allocated_page(pool)
    with pytest.raises(InvalidRequestError, match=rf"length must be an integer in \[0, 64\], got {length!r}"):
        pool.read(page, length)  # type: ignore[arg-type]


def test_dram_empty_multidimensional_array_writes_zero_bytes() -> None:
    """An empty 2-D array is a contiguous buffer of zero bytes: writing it stores nothing and does not raise."""
    pool = DramPagePool(64, 1)
    page = allocated_page(pool)
    pool.write(page, np.zeros((0, 3), dtype=np.float32), key=KEY)
    assert bytes(pool.read(page, 0)) == b""


def test_dram_pinned_without_torch_raises_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """pinned=True where torch is not installed raises ConfigError saying torch is needed (torch hidden from the
    import here: it is installed wherever the suite runs, and the test skipped everywhere)."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ConfigError, match="needs torch"):
        DramPagePool(4096, 2, pinned=True)


def test_dram_pinned_without_cuda_raises_config_error() -> None:
    """pinned=True where torch sees no CUDA device raises ConfigError saying CUDA is needed."""
    torch = pytest.importorskip("torch", reason="torch is not installed (extra 'engine'): no torch, no pinned memory")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: pinned memory works, so there is no error to check")
    with pytest.raises(ConfigError, match="needs CUDA"):
        DramPagePool(4096, 2, pinned=True)


# --------------------------------------------------------------------------- DramPagePool properties


@given(
    array=hnp.arrays(
        dtype=hnp.integer_dtypes() | hnp.floating_dtypes() | hnp.complex_number_dtypes() | hnp.boolean_dtypes(),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=6),
    )
)
def test_dram_round_trips_numpy_arrays_of_any_dtype(array: np.ndarray) -> None:
    """A C-contiguous array of any numeric dtype, shape or byte order reads back bit for bit."""
    pool = DramPagePool(4096, 2)  # the largest array drawn: 6**3 complex128 = 3456 bytes
    page = allocated_page(pool)
    pool.write(page, array, key=KEY)
    back = np.frombuffer(pool.read(page, array.nbytes), dtype=array.dtype).reshape(array.shape)
    assert back.tobytes() == array.tobytes()


@given(page_bytes=page_sizes, num_pages=st.integers(1, 6), data=st.data())
def test_dram_pool_matches_a_dict_of_pages(page_bytes: int, num_pages: int, data: st.DataObject) -> None:
    """Under any allocate/write/free sequence each live page reads back the bytes last written to it."""
    pool = DramPagePool(page_bytes, num_pages)
    live: dict[int, bytes] = {}  # allocated page -> bytes last written (zeros when never written)
    for op in data.draw(page_pool_ops(page_bytes=page_bytes)):
        if op[0] == "allocate":
            page = pool.try_allocate()
            assert (page is None) == (len(live) == num_pages)
            if page is not None:
                live[page] = bytes(pool.read(page, page_bytes))  # a reused page keeps its old bytes
        elif op[0] == "write" and live:
            page = sorted(live)[op[1] % len(live)]  # type: ignore[operator]
            payload = op[3]
            pool.write(page, payload, key=op[2])  # type: ignore[arg-type]
            live[page] = payload + live[page][len(payload) :]  # type: ignore[operator]
        elif op[0] == "free" and live:
            page = sorted(live)[op[1] % len(live)]  # type: ignore[operator]
            pool.free(page)
            del live[page]
        for page, expected in live.items():
            assert bytes(pool.read(page, page_bytes)) == expected, f"page {page}"
        assert pool.num_free == num_pages - len(live)
        pool.allocator.check_invariants()


@given(payload=page_payloads(64))
def test_dram_full_and_partial_pages(payload: bytes) -> None:
    """A payload of any length up to a page round-trips, and read of a shorter length is its prefix."""
    pool = DramPagePool(64, 1)
    page = allocated_page(pool)
    pool.write(page, payload, key=KEY)
    assert bytes(pool.read(page, len(payload))) == payload
    assert bytes(pool.read(page, len(payload) // 2)) == payload[: len(payload) // 2]


# --------------------------------------------------------------------------- VramPagePool


@pytest.fixture
def cuda_torch() -> Any:
    torch = pytest.importorskip("torch", reason="torch is not installed (extra 'engine'): no VRAM pool without it")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: a VRAM pool needs one")
    return torch


def test_vram_without_cuda_raises_config_error() -> None:
    """Where torch or CUDA is missing, constructing a VRAM pool raises ConfigError saying which."""
    try:
        import torch
    except ImportError:
        with pytest.raises(ConfigError, match="needs torch"):
            VramPagePool(4096, 2)
        return
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the VRAM pool constructs, so there is no error to check")
    with pytest.raises(ConfigError, match="needs CUDA"):
        VramPagePool(4096, 2)


def test_vram_round_trip_and_zero_copy_slices(cuda_torch: Any) -> None:
    """Bytes and tensors written to VRAM pages read back exactly; read is a slice of the pool's tensor."""
    torch = cuda_torch
    pool = VramPagePool(4096, 4)
    assert pool.tier == Tier.VRAM and pool.buffer.is_cuda
    first, second = allocated_page(pool), allocated_page(pool)
    pool.write(first, b"\x01\x02\x03" * 100, key=KEY)
    source = torch.arange(256, dtype=torch.float32, device="cuda")
    pool.write(second, source, key=KEY)
    assert bytes(pool.read(first, 300).cpu().numpy()) == b"\x01\x02\x03" * 100
    back = pool.read(second, 1024).view(torch.float32)
    assert torch.equal(back, source)
    view = pool.read(first, 3)
    assert view.data_ptr() == pool.buffer.data_ptr() + first * 4096  # a slice, not a copy
    pool.buffer[first * 4096] = 99
    assert int(view[0]) == 99
    with pytest.raises(CapacityError, match="4097 bytes do not fit a page of 4096 bytes"):
        pool.write(first, b"x" * 4097, key=KEY)
    pool.free(second)
    with pytest.raises(InvalidRequestError, match="not allocated"):
        pool.read(second, 1)


# --------------------------------------------------------------------------- MetadataPagePool


def test_metadata_pool_accounts_without_bytes() -> None:
    """A metadata pool allocates and frees pages, checks sizes on write and holds no bytes."""
    pool = MetadataPagePool(Tier.SSD, 4096, 3)
    assert (pool.tier, pool.holds_bytes, pool.zero_copy, pool.capacity_bytes) == (Tier.SSD, False, False, 3 * 4096)
    assert not hasattr(pool, "buffer")
    pages = [allocated_page(pool) for _ in range(3)]
    assert pool.try_allocate() is None and pool.num_free == 0
    pool.write(pages[0], None, key=KEY)
    pool.write(pages[1], b"x" * 4096, key=KEY)
    assert pool.read(pages[1], 4096) is None
    with pytest.raises(CapacityError, match="4097 bytes do not fit a page of 4096 bytes"):
        pool.write(pages[2], b"x" * 4097, key=KEY)
    pool.free(pages[0])
    assert pool.num_free == 1
    with pytest.raises(InvalidRequestError, match="not allocated"):
        pool.write(pages[0], None, key=KEY)
    with pytest.raises(InvalidRequestError, match="not allocated"):
        pool.read(pages[0], 1)
    with pytest.raises(InvalidRequestError):
        pool.free(pages[0])


def test_metadata_pool_of_a_trillion_pages_costs_nothing_until_used() -> None:
    """A metadata pool of 10**12 pages of 1 MiB (an exabyte) allocates almost no memory until pages are used."""
    tracemalloc.start()
    try:
        pool = MetadataPagePool(Tier.SSD, 1 << 20, 10**12)
        pages = [allocated_page(pool) for _ in range(1000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes for 1000 pages"
    assert pool.capacity_bytes == 10**12 << 20
    assert pool.num_free == 10**12 - 1000
    assert pages == list(range(1000))
    pool.free(pages[10])
    assert pool.try_allocate() == 10


def two_written_pages(kind: str, folder: Path) -> Any:
    """A pool of `kind` with pages 0 and 1 written (keys 10 and 11)."""
    pool = {
        "dram": lambda: DramPagePool(64, 4),
        "metadata": lambda: MetadataPagePool(Tier.SSD, 64, 4),
        "ssd": lambda: SsdPagePool(folder / "pool", 64, 4),
    }[kind]()
    for key in (10, 11):
        pool.write(allocated_page(pool), bytes([key]) * 8, key=BlockKey(key))
    return pool


@pytest.mark.parametrize("kind", ["dram", "metadata", "ssd"])
@pytest.mark.parametrize("page", NO_PAGES, ids=repr)
def test_what_is_no_page_is_refused_by_name_before_anything_changes(tmp_path: Path, kind: str, page: Any) -> None:
    """free, write and read of a bool, a float, a str or None raise InvalidRequestError naming the value, and
    change nothing: a DRAM pool used to read and overwrite page 1 for True, and an SSD pool's free(True) zeroed page
    1's header and forgot its key before the allocator refused it (the page stayed allocated, its block gone)."""
    pool = two_written_pages(kind, tmp_path)
    for call in (lambda: pool.free(page), lambda: pool.write(page, b"z" * 8, key=KEY), lambda: pool.read(page, 8)):
        with pytest.raises(InvalidRequestError, match=rf"{pool.tier.name} page {re.escape(repr(page))} is no page"):
            call()
    assert pool.num_free == 2 and pool.allocator.is_allocated(0) and pool.allocator.is_allocated(1)
    if pool.holds_bytes:
        assert [bytes(pool.read(p, 8)) for p in (0, 1)] == [b"\n" * 8, b"\x0b" * 8]
    pool.close()
    if kind == "ssd":
        with SsdPagePool(tmp_path / "pool", 64, 4) as reopened:
            assert sorted(found.key for found in reopened.recovered) == [10, 11]


@pytest.mark.parametrize("kind", ["dram", "metadata", "ssd"])
def test_a_numpy_integer_is_a_page_number_for_every_pool(tmp_path: Path, kind: str) -> None:
    """A page number may come as a numpy integer (as a length may): write, read and free take it, as the int it is
    (an SSD pool's free of np.int64(1) used to zero the header, then have the allocator refuse the page)."""
    pool = two_written_pages(kind, tmp_path)
    pool.write(np.int64(1), b"n" * 8, key=BlockKey(11))
    if pool.holds_bytes:
        assert bytes(pool.read(np.uint16(1), 8)) == b"n" * 8
    pool.free(np.int64(1))
    assert not pool.allocator.is_allocated(1) and pool.num_free == 3
    pool.allocator.check_invariants()
    pool.close()
    if kind == "ssd":
        with SsdPagePool(tmp_path / "pool", 64, 4) as reopened:
            assert [found.key for found in reopened.recovered] == [10]


# --------------------------------------------------------------------------- pools as state machines

POOL_PAGE_BYTES, POOL_PAGES = 64, 4


class PoolMachine(RuleBasedStateMachine):
    """A page pool against a reference: the set of allocated pages and, per written page, its key and bytes.
    What a pool reads back is what was last written there (None where it holds no bytes); a full pool hands
    out nothing; freeing a page not allocated is refused; `check_invariants` holds after every step.
    Subclasses make the pool (`make`); an SSD pool is also closed and reopened, recovering what was written."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: Any = self.make()
        self.allocated: set[int] = set()
        self.written: dict[int, tuple[BlockKey, bytes]] = {}
        self.order: dict[int, int] = {}  # per written page, when it was written (the SSD pool's generation)
        self.writes = itertools.count()

    def make(self) -> Any:
        raise NotImplementedError

    @rule()
    def allocate(self) -> None:
        page = self.pool.try_allocate()
        if len(self.allocated) == POOL_PAGES:
            assert page is None, "allocated past capacity"
        else:
            assert page is not None and 0 <= page < POOL_PAGES and page not in self.allocated
            self.allocated.add(page)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), key=st.integers(0, 2**64 - 1), payload=page_payloads(POOL_PAGE_BYTES))
    def write(self, data: st.DataObject, key: int, payload: bytes) -> None:
        page = data.draw(st.sampled_from(sorted(self.allocated)))
        self.pool.write(page, payload, key=BlockKey(key))
        self.written[page] = (BlockKey(key), payload)
        self.order[page] = next(self.writes)

    @precondition(lambda self: self.written)
    @rule(data=st.data(), as_numpy=st.booleans())
    def read(self, data: st.DataObject, as_numpy: bool) -> None:
        page = data.draw(st.sampled_from(sorted(self.written)))
        payload = self.written[page][1]
        got = self.pool.read(np.int64(page) if as_numpy else page, len(payload))  # a numpy integer is a page
        assert (None if got is None else bytes(got)) == (payload if self.pool.holds_bytes else None)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), as_numpy=st.booleans())
    def free(self, data: st.DataObject, as_numpy: bool) -> None:
        page = data.draw(st.sampled_from(sorted(self.allocated)))
        self.pool.free(np.int64(page) if as_numpy else page)
        self.allocated.remove(page)
        self.written.pop(page, None)

    @rule(page=st.sampled_from(NO_PAGES))
    def refuse_what_is_no_page(self, page: Any) -> None:
        """A bool, a float, a str or None is no page, whatever pages are allocated: every call refuses it by name,
        before anything changes (the reference is left as it is; the other rules and the invariant check that)."""
        for call in (
            lambda: self.pool.free(page),
            lambda: self.pool.write(page, b"x", key=KEY),
            lambda: self.pool.read(page, 0),
        ):
            with pytest.raises(InvalidRequestError, match=rf"page {re.escape(repr(page))} is no page number"):
                call()

    @rule(page=st.integers(-1, POOL_PAGES))
    def refuse_what_is_not_allocated(self, page: int) -> None:
        if page in self.allocated:
            return
        with pytest.raises(InvalidRequestError):
            self.pool.free(page)
        with pytest.raises(InvalidRequestError):
            self.pool.write(page, b"x", key=KEY)

    @invariant()
    def matches_reference(self) -> None:
        self.pool.allocator.check_invariants()
        assert self.pool.num_free == POOL_PAGES - len(self.allocated)
        assert {p for p in range(POOL_PAGES) if self.pool.allocator.is_allocated(p)} == self.allocated

    def teardown(self) -> None:
        self.pool.close()


class DramPoolMachine(PoolMachine):
    def make(self) -> Any:
        return DramPagePool(POOL_PAGE_BYTES, POOL_PAGES)


class MetadataPoolMachine(PoolMachine):
    def make(self) -> Any:
        return MetadataPagePool(Tier.SSD, POOL_PAGE_BYTES, POOL_PAGES)


class SsdPoolMachine(PoolMachine):
    def make(self) -> Any:
        self.directory = tempfile.TemporaryDirectory()
        self.path = Path(self.directory.name) / "pool"
        return SsdPagePool(self.path, POOL_PAGE_BYTES, POOL_PAGES)

    @rule()
    def reopen(self) -> None:
        """What was written (and not freed) comes back with its key, one page per key (the newest write of a key
        written to two); pages allocated but never written, or holding an older copy, are free."""
        self.pool.close()
        self.pool = SsdPagePool(self.path, POOL_PAGE_BYTES, POOL_PAGES)
        newest: dict[BlockKey, int] = {}
        for page, (key, _payload) in self.written.items():
            if key not in newest or self.order[page] > self.order[newest[key]]:
                newest[key] = page
        self.written = {page: self.written[page] for page in newest.values()}
        recovered = {page.page: (page.key, page.length) for page in self.pool.recovered}
        assert recovered == {page: (key, len(payload)) for page, (key, payload) in self.written.items()}
        self.allocated = set(self.written)

    @precondition(lambda self: self.allocated - set(self.written))
    @rule(data=st.data(), key=st.integers(0, 2**64 - 1), payload=page_payloads(POOL_PAGE_BYTES), cut=st.floats(0, 1))
    def write_fails(self, data: st.DataObject, key: int, payload: bytes, cut: float) -> None:
        """The disk fails the write of a blank page part-way (EIO after a `cut` of its bytes landed): DiskError,
        and the block never comes back (`reopen` checks; its header used to land first, and be adopted). (A page
        holding a block is left out: its old block, intact where nothing landed, may rightly come back.)"""
        page = data.draw(st.sampled_from(sorted(self.allocated - set(self.written))))
        real = os.pwritev

        def torn(fd: int, buffers: list[Any], offset: int) -> int:
            whole = b"".join(bytes(buffer) for buffer in buffers)
            os.pwrite(fd, whole[: int(cut * len(whole))], offset)
            raise OSError(errno.EIO, "Input/output error (injected)")

        os.pwritev = torn
        try:
            with pytest.raises(DiskError, match="writing the page failed"):
                self.pool.write(page, payload, key=BlockKey(key))
        finally:
            os.pwritev = real
        self.written.pop(page, None)

    def teardown(self) -> None:
        super().teardown()
        self.directory.cleanup()


TestDramPoolMachine = DramPoolMachine.TestCase
TestMetadataPoolMachine = MetadataPoolMachine.TestCase
TestSsdPoolMachine = SsdPoolMachine.TestCase


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda folder: DramPagePool(64, 2**62), "cannot allocate"),
        (lambda folder: DramPagePool(64, 1, buffer=[0] * 64), "buffer must be a flat uint8 array"),
        (lambda folder: DramPagePool(64, 1, buffer=bytearray(64)), "buffer must be a flat uint8 array"),
        (lambda folder: DramPagePool(64, 1, tier="x"), "tier must be one of"),
        (lambda folder: MetadataPagePool(None, 64, 1), "tier must be one of"),  # type: ignore[arg-type]
        (lambda folder: MetadataPagePool(True, 64, 1), "tier must be one of"),  # type: ignore[arg-type]
        (lambda folder: SsdPagePool(folder / "pool", 64, 1, tier="x"), "tier must be one of"),  # type: ignore[arg-type]
    ],
    ids=["dram-too-big", "buffer-list", "buffer-bytearray", "dram-tier", "metadata-tier-none", "tier-bool", "ssd-tier"],
)
def test_bad_pool_arguments_are_config_errors_naming_them(tmp_path: Path, make: Any, named: str) -> None:
    """A pool too big to allocate, a buffer that is no uint8 array, a tier that is none (a bool would read as
    DRAM) are ConfigErrors naming what is wrong, not numpy's ValueError, an AttributeError or Tier's ValueError."""
    with pytest.raises(ConfigError, match=named):
        make(tmp_path)


def test_a_tier_may_be_named() -> None:
    """A pool's tier is a `Tier`, its value or its name, as everywhere else in the cache."""
    assert DramPagePool(64, 1, tier="VRAM").tier is Tier.VRAM  # type: ignore[arg-type]
    assert MetadataPagePool(2, 64, 1).tier is Tier.SSD  # type: ignore[arg-type]
