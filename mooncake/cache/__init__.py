"""Block keys, the global block index, eviction policies, capacity analysis, page pools and the tiered cache.

Importing this package stays light: numpy, attrs and xxhash only. numba (the
`accel` extra), where installed, is loaded on the first batch hash or index
operation; without it the same work runs in plain Python and numpy with the same
keys. torch is loaded only by the pools that need it (pinned DRAM, VRAM), msgpack
only by the vLLM event codec.
"""

from mooncake.cache.capacity import CapacityPoint, hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.hashing import BlockHasher, HashAlgorithm, KeyBatch, reusable_prefix_tokens
from mooncake.cache.index import BlockIndex, Holder, IndexSnapshot, PrefixMatch, SourceSnapshot, key_array
from mooncake.cache.policy import EvictionPolicy, LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy
from mooncake.cache.pool import DramPagePool, MetadataPagePool, PagePool, VramPagePool
from mooncake.cache.ssd import SsdPagePool
from mooncake.cache.tiered import CacheStats, TieredCache
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import VllmEventBatch, decode_batch, encode_batch
from mooncake.errors import VllmEventError
from mooncake.types import Tier

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CacheStats",
    "CapacityPoint",
    "DramPagePool",
    "EvictionPolicy",
    "HashAlgorithm",
    "Holder",
    "IndexSnapshot",
    "KeyBatch",
    "LengthAwarePolicy",
    "LfuPolicy",
    "LruPolicy",
    "MetadataPagePool",
    "PagePool",
    "PrefixMatch",
    "SequenceGap",
    "SievePolicy",
    "SourceSnapshot",
    "SsdPagePool",
    "Tier",
    "TieredCache",
    "VllmEventBatch",
    "VllmEventDecoder",
    "VllmEventEncoder",
    "VllmEventError",
    "VramPagePool",
    "decode_batch",
    "encode_batch",
    "hit_ratio_curve",
    "key_array",
    "reusable_prefix_tokens",
    "simulate_prefix_hits",
]
