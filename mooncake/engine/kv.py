"""KV pages: how one block's KV for every layer is laid out in a cache page.

A page holds the K and V of `t` ≤ `block_tokens` consecutive tokens for every
layer, layer-major: `[num_layers][2 (K, V)][t][num_kv_heads][head_dim]` in the
model's dtype, so the bytes of layer `l` are one contiguous range, the same
range for every full block. That is what lets the prefill engine store a
layer's KV as soon as the layer is computed and stream it part by part (part
`l` of a block cut into `num_layers` equal parts is exactly layer `l`).

A page is any byte buffer (a DRAM page's memoryview, an SSD read's copy) or a
flat uint8 tensor (a VRAM page, on its device).

Invariants: `block_bytes(t) == num_layers * layer_bytes(t)`; a view returned by
`layer_kv` shares the page's memory (but a read-only buffer's).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from mooncake._checks import int_at_least, is_int, shown
from mooncake.cache.pool import Buffer
from mooncake.engine.config import ModelConfig, check_dtype
from mooncake.engine.model import dtype_of
from mooncake.errors import ConfigError

__all__ = ["KvLayout"]


def _model_config(_instance: object, _attribute: object, value: Any) -> None:
    if not isinstance(value, ModelConfig):  # else the first size asked for is a bare AttributeError
        raise ConfigError(f"config must be a ModelConfig, got {shown(value)}")


def _dtype(_instance: object, _attribute: object, value: Any) -> None:
    check_dtype(value)


@attrs.frozen(kw_only=True)
class KvLayout:
    """Page geometry of one model's KV at one block size and dtype.

    Attributes:
        config: the model (a `ModelConfig`).
        block_tokens: tokens per block, >= 1.
        dtype: a name `config.check_dtype` takes ("float32", "bfloat16", "float16").

    Raises:
        ConfigError: a field that is none of these, naming it.
    """

    config: ModelConfig = attrs.field(validator=_model_config)
    block_tokens: int = attrs.field(validator=int_at_least(1))
    dtype: str = attrs.field(default="float32", validator=_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def element_bytes(self) -> int:
        return self.torch_dtype.itemsize

    def layer_bytes(self, tokens: int) -> int:
        """Bytes of one layer's K and V for `tokens` tokens."""
        return 2 * tokens * self.config.kv_width * self.element_bytes

    def block_bytes(self, tokens: int) -> int:
        """Bytes of a page holding `tokens` tokens (all layers)."""
        return self.config.num_layers * self.layer_bytes(tokens)

    @property
    def page_bytes(self) -> int:
        """Bytes of a full block: the page size to give the cache's pools."""
        return self.block_bytes(self.block_tokens)

    def tokens_in(self, num_bytes: int) -> int:
        """How many tokens a page of `num_bytes` bytes holds.

        Raises:
            ConfigError: `num_bytes` is not a whole number of tokens.
        """
        per_token = self.block_bytes(1)
        if not is_int(num_bytes) or num_bytes < 0 or num_bytes % per_token or num_bytes > self.page_bytes:
            raise ConfigError(f"a KV page of {shown(num_bytes)} bytes is not a whole number of {per_token}-byte tokens")
        return num_bytes // per_token

    def page_tokens(self, page: Buffer | torch.Tensor) -> int:
        """How many tokens `page` (a buffer or flat uint8 tensor of `block_bytes(t)` bytes) holds.

        Raises:
            ConfigError: its size is not a whole number of tokens.
        """
        return self.tokens_in(_flat_bytes(page).nbytes if isinstance(page, torch.Tensor) else memoryview(page).nbytes)

    def page_kv(self, page: Buffer | torch.Tensor) -> torch.Tensor:
        """The whole of `page` (a buffer or flat uint8 tensor of `block_bytes(t)` bytes) as a
        [num_layers, 2, t, kv_heads, head_dim] view, on the page's device (a copy when the buffer is read-only:
        torch wants writable memory); `[l, 0]` is layer l's K."""
        if isinstance(page, torch.Tensor):  # a VRAM page: viewed where it lies (memoryview cannot take a tensor)
            flat = _flat_bytes(page)
            tokens = self.tokens_in(flat.numel())
        else:
            view = memoryview(page).cast("B")
            tokens = self.tokens_in(view.nbytes)
            array = np.frombuffer(view, dtype=np.uint8)
            if view.readonly:  # an SSD read's copy is copied once more
                array = array.copy()
            flat = torch.from_numpy(array)
        shape = (self.config.num_layers, 2, tokens, self.config.num_kv_heads, self.config.head_dim)
        return flat.view(self.torch_dtype).view(shape)

    def layer_kv(self, page: Buffer, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` in `page` as [t, kv_heads, head_dim] views (see `page_kv`)."""
        kv = self.page_kv(page)[layer]
        return kv[0], kv[1]


def _flat_bytes(page: torch.Tensor) -> torch.Tensor:
    """A page tensor as the flat uint8 view of its memory (a pool's pages are contiguous uint8 slices)."""
    if not page.is_contiguous():
        raise ConfigError("a KV page tensor must be contiguous")
    return page.reshape(-1).view(torch.uint8)
