"""Tests for `mooncake.engine.kv.KvLayout`: page geometry and the layer views.

Properties over random shapes, block sizes and dtypes: sizes follow
[layers][2][tokens][kv_heads][head_dim]; `tokens_in` and `page_tokens` invert
`block_bytes`; K and V written through `layer_kv` read back equal and land
exactly where the layout says (the page is the layers' stacked K and V, byte
for byte); layer l is part l of the page cut into num_layers parts, as the
messenger cuts it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.engine.config import ModelConfig
from mooncake.engine.kv import KvLayout
from mooncake.errors import ConfigError
from mooncake.transfer.messenger import part_range
from tests.engine.strategies import model_configs
from tests.engine.support import TINY

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@st.composite
def layouts(draw: st.DrawFn) -> KvLayout:
    return KvLayout(
        config=draw(model_configs()),
        block_tokens=draw(st.integers(min_value=1, max_value=9)),
        dtype=draw(st.sampled_from(sorted(ELEMENT_BYTES))),
    )


@st.composite
def layouts_and_token_counts(draw: st.DrawFn) -> tuple[KvLayout, int]:
    layout = draw(layouts())
    return layout, draw(st.integers(min_value=0, max_value=layout.block_tokens))


# --------------------------------------------------------------------------- properties


@given(layouts_and_token_counts())
def test_sizes_follow_the_page_shape(case: tuple[KvLayout, int]) -> None:
    """layer = 2·t·kv_heads·head_dim elements; block = layers × layer; page = a full block; tokens_in (of the
    size) and page_tokens (of a page that size) invert it."""
    layout, t = case
    c = layout.config
    assert layout.element_bytes == ELEMENT_BYTES[layout.dtype]
    assert layout.layer_bytes(t) == 2 * t * c.num_kv_heads * c.head_dim * layout.element_bytes
    assert layout.block_bytes(t) == c.num_layers * layout.layer_bytes(t)
    assert layout.page_bytes == layout.block_bytes(layout.block_tokens)
    assert layout.tokens_in(layout.block_bytes(t)) == t
    assert layout.page_tokens(bytearray(layout.block_bytes(t))) == t


@given(layouts_and_token_counts())
def test_layer_l_is_part_l_of_the_page(case: tuple[KvLayout, int]) -> None:
    """Cutting a block into num_layers equal parts (as `Messenger` streams it) gives exactly the layers' ranges."""
    layout, t = case
    size, layers = layout.layer_bytes(t), layout.config.num_layers
    assert [part_range(layout.block_bytes(t), layers, part) for part in range(layers)] == [
        (layer * size, (layer + 1) * size) for layer in range(layers)
    ]


@given(layouts_and_token_counts(), st.integers(min_value=0, max_value=2**32))
def test_layer_views_round_trip_in_the_documented_layout(case: tuple[KvLayout, int], seed: int) -> None:
    """K and V written through the views read back equal, share the page's memory, and the page's bytes
    are the concatenation over layers of stack([K, V]) in [2][t][kv_heads][head_dim] order."""
    layout, t = case
    c = layout.config
    g = torch.Generator().manual_seed(seed)
    shape = (c.num_layers, 2, t, c.num_kv_heads, c.head_dim)
    kv = torch.randn(shape, generator=g).to(layout.torch_dtype)
    page = bytearray(layout.block_bytes(t))
    for layer in range(c.num_layers):
        k, v = layout.layer_kv(page, layer)
        assert k.shape == v.shape == (t, c.num_kv_heads, c.head_dim) and k.dtype == layout.torch_dtype
        k.copy_(kv[layer, 0])
        v.copy_(kv[layer, 1])
    assert bytes(page) == kv.contiguous().view(torch.uint8).numpy().tobytes()
    for layer in range(c.num_layers):
        k, v = layout.layer_kv(memoryview(page), layer)
        assert torch.equal(k, kv[layer, 0]) and torch.equal(v, kv[layer, 1])


# --------------------------------------------------------------------------- examples


def test_views_of_a_writable_page_are_zero_copy_and_of_a_read_only_one_are_copies() -> None:
    """Writes through a view of a writable page change the page; a read-only page is copied, never written."""
    layout = KvLayout(config=TINY, block_tokens=4)
    page = np.zeros(layout.page_bytes, dtype=np.uint8)
    k, v = layout.layer_kv(page, 1)
    v.fill_(1.0)
    assert np.shares_memory(k.numpy(), page)
    assert page[: layout.layer_bytes(4)].sum() == 0 and page[layout.layer_bytes(4) :].any()
    frozen = bytes(page)
    k2, v2 = layout.layer_kv(frozen, 1)
    k2.fill_(7.0)  # writable, but a copy
    assert bytes(page) == frozen and torch.equal(v2, v)


def test_a_tensor_page_is_viewed_in_place_and_a_scattered_one_refused() -> None:
    """A VRAM pool's page is a flat uint8 tensor: its views write the page itself, its token count is read from
    its size; a tensor that is not one contiguous run of bytes is refused rather than silently copied."""
    layout = KvLayout(config=TINY, block_tokens=4)
    page = torch.zeros(layout.block_bytes(3), dtype=torch.uint8)
    assert layout.page_tokens(page) == 3
    k, v = layout.layer_kv(page, 1)
    v.fill_(1.0)
    assert k.data_ptr() == page.data_ptr() + layout.layer_bytes(3)
    assert not page[: layout.layer_bytes(3)].any() and page[layout.layer_bytes(3) + layout.layer_bytes(3) // 2 :].any()
    scattered = torch.zeros(2 * layout.page_bytes, dtype=torch.uint8)[::2]
    with pytest.raises(ConfigError, match="contiguous"):
        layout.page_kv(scattered)


def test_tiny_pages_are_small() -> None:
    """tiny: 2 layers × K,V × 2 kv heads × 16 dims × 4 bytes = 512 bytes per token."""
    layout = KvLayout(config=TINY, block_tokens=4)
    assert layout.block_bytes(1) == 512 and layout.page_bytes == 2048
    assert KvLayout(config=TINY, block_tokens=4, dtype="bfloat16").page_bytes == 1024


@pytest.mark.parametrize("num_bytes", [1, 511, 513, 2048 + 512])
def test_tokens_in_rejects_sizes_that_are_not_whole_tokens_of_a_page(num_bytes: int) -> None:
    """A page size that is not a whole number of tokens, or more than a page, is a ConfigError."""
    with pytest.raises(ConfigError, match="whole number"):
        KvLayout(config=TINY, block_tokens=4).tokens_in(num_bytes)


def test_layout_validation() -> None:
    """Block sizes below one token and unknown dtypes are ConfigErrors."""
    with pytest.raises(ConfigError):
        KvLayout(config=TINY, block_tokens=0)
    with pytest.raises(ConfigError, match="dtype"):
        KvLayout(config=TINY, block_tokens=4, dtype="int8")  # refused as it is made, not at its first size
    with pytest.raises(ConfigError, match=r"dtype must be one of .*, got \[\]"):
        KvLayout(config=TINY, block_tokens=4, dtype=[])  # type: ignore[arg-type]
    for config in (None, "tiny", TINY.shape()):  # once an AttributeError at the first size asked for
        with pytest.raises(ConfigError, match="config must be a ModelConfig"):
            KvLayout(config=config, block_tokens=4)  # type: ignore[arg-type]
    config = ModelConfig(
        name="m", vocab_size=4, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=4
    )
    assert KvLayout(config=config, block_tokens=2).page_bytes == 3 * 2 * 2 * 4 * 4
