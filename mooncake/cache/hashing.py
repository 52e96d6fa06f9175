"""Prefix-chained block keys.

A prompt is cut into blocks of `block_size_tokens` tokens; the last block may be
partial and is keyed too. Each block's key hashes its parent's key with its own
tokens, so a key stands for the whole prefix up to and including its block:

    root    = H(namespace)                   namespace = (algorithm, model, block size, salt)
    key_i   = H(le(key_{i-1}) || le32(tokens of block i))      key_{-1} = root

with H = XXH3-64 (default) or XXH3-128 under an explicit `seed`, or SHA-256 for
tenants that must not be able to craft collisions (the seed then joins the
namespace). `le(key)` is the key as a little-endian integer of the algorithm's
width (8, 16 or 32 bytes); keys are returned as Python ints (SHA-256 digests
read big-endian, like their hex form).

Invariants:
- Two token sequences get equal keys for block i iff their first i+1 blocks are
  equal (up to hash collisions): keys agree exactly up to the first differing block.
- Keys depend only on the config and the tokens: no Python `hash()`, no
  per-process randomness, so every process and machine computes the same keys.
- Hashers whose namespaces differ (model, block size, salt, algorithm, seed)
  never share a root, hence never share keys.

For XXH3-64, `block_keys` and `hash_batch` run a numba-compiled loop around
xxhash's own C routine (`_xxh3_kernel`, cached on disk by numba). Without numba
(or with `_compiled.use_compiled(False)`) they run a plain loop over xxhash's
Python API on the same bytes: the same keys, several times slower. The other
algorithms always use the plain chain.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from mooncake._checks import (
    int_at_least,
    is_int,
    plain_int,
    require_int,
    require_iterable,
    require_str,
    shown,
)
from mooncake.cache._compiled import is_compiled
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import BlockKey, as_token_array, block_count, key_tuple

__all__ = ["BlockHasher", "HashAlgorithm", "KeyBatch", "reusable_prefix_tokens"]

HashAlgorithm = Literal["xxh3_64", "xxh3_128", "sha256"]


def reusable_prefix_tokens(num_tokens: int, cached_blocks: int, block_size_tokens: int) -> int:
    """Prompt tokens a prefill reuses when the first `cached_blocks` blocks of its `num_tokens`-token
    prompt are cached: whole blocks only, and never the block that holds the last prompt token, which
    is computed for the first output token's logits (vLLM does the same: a prompt cached whole
    recomputes its last block). A partial last block is keyed, but its key covers only the tokens it
    had, so it is never a longer prompt's prefix. The one answer to "how much does a cached prefix
    save": the engine's prefill reuses this many tokens, the router estimates with it and the
    simulators charge it.

    Raises:
        InvalidRequestError: a count that is not an integer (a float would make a fractional token count), a
            negative token or block count, or a block size below 1.
    """
    if type(num_tokens) is not int or type(cached_blocks) is not int or type(block_size_tokens) is not int:
        for name, value in (
            ("num_tokens", num_tokens),
            ("cached_blocks", cached_blocks),
            ("block_size_tokens", block_size_tokens),
        ):
            if not is_int(value):
                raise InvalidRequestError(f"{name} must be an integer, got {shown(value)}")
        num_tokens, cached_blocks, block_size_tokens = int(num_tokens), int(cached_blocks), int(block_size_tokens)
    if num_tokens < 0 or cached_blocks < 0 or block_size_tokens < 1:  # comparisons only: routing asks per request
        raise InvalidRequestError(
            f"reusable_prefix_tokens needs num_tokens >= 0, cached_blocks >= 0 and block_size_tokens >= 1, got "
            f"{shown(num_tokens)}, {shown(cached_blocks)} and {shown(block_size_tokens)}"
        )
    return min(cached_blocks, max(num_tokens - 1, 0) // block_size_tokens) * block_size_tokens


_KEY_BYTES: dict[str, int] = {"xxh3_64": 8, "xxh3_128": 16, "sha256": 32}
_U64 = 2**64
_NAMESPACE_TAG = "mooncake.block/1"


@functools.cache
def _compiled_kernels() -> Any:
    """The numba kernels module (compiled, or loaded from numba's cache, once per process), or None.

    None where numba or xxhash's C symbol is missing.
    """
    try:
        from mooncake.cache import _xxh3_kernel
    except ImportError:
        return None
    return _xxh3_kernel


@attrs.frozen(eq=False)
class KeyBatch:
    """Keys of many requests in one flat array: request r owns ``keys[offsets[r]:offsets[r+1]]``.

    `keys` is uint64 for 64-bit keys and an object array of ints for wider ones.
    """

    keys: npt.NDArray[Any]
    offsets: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def __getitem__(self, r: int) -> tuple[BlockKey, ...]:
        """Request `r`'s keys (from the end for r < 0, as a sequence indexes).

        Raises:
            IndexError: no request `r`.
        """
        n = len(self)
        if not -n <= r < n:
            raise IndexError(f"request {r} of a batch of {n}")
        r %= n
        return key_tuple(self.keys[self.offsets[r] : self.offsets[r + 1]].tolist())


@attrs.frozen(kw_only=True)
class BlockHasher:
    """Computes chained block keys for one namespace.

    Args:
        model: the model the KV belongs to (part of the namespace).
        block_size_tokens: tokens per block.
        salt: extra namespace, e.g. a tenant or LoRA id; tenants with different
            salts never share blocks.
        seed: 0 <= seed < 2**64, the hash seed (XXH3) or an extra namespace part (SHA-256).
        algorithm: "xxh3_64" (default), "xxh3_128" or "sha256".
    """

    # Both are part of every key's namespace (JSON-encoded): a number or None would key another namespace than its text.
    model: str = attrs.field(validator=lambda _self, _attribute, value: require_str("model", value))
    block_size_tokens: int = attrs.field(converter=plain_int, validator=int_at_least(1))
    salt: str = attrs.field(
        default="", validator=lambda _self, _attribute, value: require_str("salt", value, empty=True)
    )
    seed: int = attrs.field(default=0, converter=plain_int)
    algorithm: HashAlgorithm = attrs.field(default="xxh3_64")
    root_key: BlockKey = attrs.field(init=False)
    _seed64: np.uint64 = attrs.field(init=False, repr=False, eq=False)

    @seed.validator
    def _check_seed(self, _attribute: object, value: int) -> None:
        require_int("seed", value, minimum=0, below=_U64)

    @algorithm.validator
    def _check_algorithm(self, _attribute: object, value: str) -> None:
        if not isinstance(value, str) or value not in _KEY_BYTES:  # a list is unhashable: no dict lookup for it
            raise ConfigError(f"algorithm must be one of {sorted(_KEY_BYTES)}, got {shown(value)}")

    def __attrs_post_init__(self) -> None:
        namespace = json.dumps(
            [_NAMESPACE_TAG, self.algorithm, self.model, self.block_size_tokens, self.salt],
            ensure_ascii=True,
            separators=(",", ":"),
        ).encode()
        if self.algorithm == "sha256":
            root = self._digest(namespace + self.seed.to_bytes(8, "little"))
        else:
            root = self._digest(namespace)
        object.__setattr__(self, "root_key", root)
        object.__setattr__(self, "_seed64", np.uint64(self.seed))

    @property
    def key_bytes(self) -> int:
        """Width of a key in bytes (8, 16 or 32)."""
        return _KEY_BYTES[self.algorithm]

    def salted(self, cache_salt: str | None) -> BlockHasher:
        """This hasher in the namespace of a request's cache salt (vLLM's `cache_salt`): its keys share no block
        with this hasher's or another salt's, so only requests of the same salt reuse each other's prefixes.
        None: this hasher. The gateway, its engines and the vLLM router key a salted request through this one
        rule, so their keys agree.

        Raises:
            InvalidRequestError: `cache_salt` is no string.
        """
        if cache_salt is None or cache_salt == "":  # vLLM salts with a non-empty salt only
            return self
        if not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {shown(cache_salt)}")
        # NUL never occurs in a salt vLLM accepts: the namespace parts cannot run into each other.
        return attrs.evolve(self, salt=f"{self.salt}\x00cache_salt:{cache_salt}")

    def for_lora(self, adapter: str | None) -> BlockHasher:
        """This hasher in the namespace of a LoRA adapter (vLLM's `lora_name`, the `model` a request names): an
        adapter's KV differs from the base model's, so its keys share no block with this hasher's or another
        adapter's (vLLM keys an adapter's blocks with ``("lora", name, path)``). None: this hasher. The vLLM event
        decoder keys an adapter's blocks and the vLLM router an adapter's prompts through this one rule; a salted
        request of an adapter is `for_lora(name).salted(salt)`.

        Raises:
            InvalidRequestError: `adapter` is no string, or is empty.
        """
        if adapter is None:
            return self
        if not isinstance(adapter, str) or not adapter:
            raise InvalidRequestError(f"a LoRA adapter's name must be a non-empty string, got {shown(adapter)}")
        # NUL never occurs in a name vLLM serves: the namespace parts cannot run into each other.
        return attrs.evolve(self, salt=f"{self.salt}\x00lora:{adapter}")

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks (the partial last one included) that `num_tokens` tokens make.

        Raises:
            InvalidRequestError: `num_tokens` is not an integer >= 0.
        """
        if type(num_tokens) is not int or num_tokens < 0:
            num_tokens = require_int("num_tokens", num_tokens, minimum=0, error=InvalidRequestError)
        return block_count(num_tokens, self.block_size_tokens)

    def block_keys(self, tokens: Any, *, parent: BlockKey | None = None) -> tuple[BlockKey, ...]:
        """Keys of every block of `tokens`, chained from `parent` (default: the root).

        Args:
            tokens: token ids (int32-representable).
            parent: key of the block before `tokens[0]`, to extend an existing chain.

        Returns:
            One key per block, ``ceil(len(tokens) / block_size_tokens)`` in all.
        """
        array = as_token_array(tokens)
        if parent is None:
            start = self.root_key
        elif not is_int(parent) or not 0 <= parent < 1 << (8 * self.key_bytes):
            raise InvalidRequestError(f"parent must be a {8 * self.key_bytes}-bit key, got {shown(parent)}")
        else:
            start = BlockKey(int(parent))
        kernels = self._kernels()
        if kernels is None or array.size == 0:
            return tuple(self._chain_plain(array, start))
        out = np.empty(self.num_blocks(array.size), dtype=np.uint64)
        kernels.single(array, np.uint64(start), self.block_size_tokens, self._seed64, out)
        return key_tuple(out.tolist())

    def hash_batch(self, tokens: Any, offsets: Any) -> KeyBatch:
        """Keys of many requests at once, hashed in parallel where compiled.

        Args:
            tokens: all requests' tokens concatenated (int32-representable).
            offsets: ``num_requests + 1`` non-decreasing indices into `tokens`,
                starting at 0 and ending at ``len(tokens)``.

        Returns:
            A `KeyBatch` whose request r equals ``block_keys(tokens[offsets[r]:offsets[r+1]])``.
        """
        array = as_token_array(tokens)
        given = np.asarray(offsets)
        if given.size and given.dtype.kind not in "iu":
            raise InvalidRequestError(f"offsets must be integers, got dtype {given.dtype}")
        bounds = np.ascontiguousarray(given, dtype=np.int64)
        if (
            bounds.ndim != 1
            or bounds.size < 1
            or bounds[0] != 0
            or bounds[-1] != array.size
            or np.any(np.diff(bounds) < 0)
        ):
            raise InvalidRequestError(
                f"offsets must rise from 0 to len(tokens)={array.size}, got {bounds[:4].tolist()}...{bounds[-2:].tolist()}"
            )
        lengths = np.diff(bounds)
        key_offsets = np.zeros(bounds.size, dtype=np.int64)
        np.cumsum(-(-lengths // self.block_size_tokens), out=key_offsets[1:])  # `block_count`, vectorised
        kernels = self._kernels()
        if kernels is None:
            keys = [
                k
                for r in range(lengths.size)
                for k in self._chain_plain(array[bounds[r] : bounds[r + 1]], self.root_key)
            ]
            # Keys wider than 64 bits live in an object array of Python ints.
            dtype = np.uint64 if self.key_bytes == 8 else object
            return KeyBatch(np.array(keys, dtype=dtype) if keys else np.empty(0, dtype), key_offsets)
        out = np.empty(int(key_offsets[-1]), dtype=np.uint64)
        parents = np.full(lengths.size, self.root_key, dtype=np.uint64)
        kernels.parallel(array, bounds, parents, self.block_size_tokens, self._seed64, out, key_offsets)
        return KeyBatch(out, key_offsets)

    def block_keys_many(self, requests: Sequence[Any]) -> list[tuple[BlockKey, ...]]:
        """`block_keys` of each token sequence in `requests`, through the batch path.

        Raises:
            InvalidRequestError: `requests` is not iterable, or one of them is no token sequence (`block_keys`).
        """
        arrays = [as_token_array(t) for t in require_iterable("requests", requests, error=InvalidRequestError)]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.empty(0, np.int32)
        batch = self.hash_batch(flat, offsets)
        return [batch[r] for r in range(len(batch))]

    @property
    def is_compiled(self) -> bool:
        """Whether the numba path serves this hasher (XXH3-64, compiled kernels on, xxhash's C symbol found)."""
        return self._kernels() is not None

    def _kernels(self) -> Any:
        return _compiled_kernels() if self.algorithm == "xxh3_64" and is_compiled() else None

    def _digest(self, data: bytes) -> BlockKey:
        if self.algorithm == "xxh3_64":
            return BlockKey(xxhash.xxh3_64_intdigest(data, seed=self.seed))
        if self.algorithm == "xxh3_128":
            return BlockKey(xxhash.xxh3_128_intdigest(data, seed=self.seed))
        return BlockKey(int.from_bytes(hashlib.sha256(data).digest(), "big"))

    def _chain_plain(self, tokens: npt.NDArray[np.int32], parent: int) -> list[BlockKey]:
        """The chain without numba: for XXH3-64 a streaming state over slices of one buffer, else `_chain_python`."""
        if self.algorithm != "xxh3_64":
            return list(self._chain_python(tokens, parent))
        # Feeding the parent and a view of the block separately copies no token bytes.
        data = np.ascontiguousarray(tokens, dtype="<i4").data.cast("B")
        step = 4 * self.block_size_tokens
        state = xxhash.xxh3_64(seed=self.seed)
        keys: list[BlockKey] = []
        for start in range(0, len(data), step):
            state.reset()
            state.update(parent.to_bytes(8, "little"))
            state.update(data[start : start + step])
            parent = state.intdigest()
            keys.append(BlockKey(parent))
        return keys

    def _chain_python(self, tokens: npt.NDArray[np.int32], parent: int) -> tuple[BlockKey, ...]:
        data = tokens.astype("<i4", copy=False).tobytes()
        step = 4 * self.block_size_tokens
        width = self.key_bytes
        keys: list[BlockKey] = []
        for start in range(0, len(data), step):
            parent = self._digest(parent.to_bytes(width, "little") + data[start : start + step])
            keys.append(BlockKey(parent))
        return tuple(keys)
