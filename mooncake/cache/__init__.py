"""Block keys, the global block index, eviction policies and capacity analysis.

Importing this package stays light: numpy, attrs and xxhash only. numba is
loaded on the first batch hash, torch only by the pools that need it.
"""

from mooncake.cache.capacity import CapacityPoint, hit_ratio_curve, simulate_prefix_hits
from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, SequenceGap
from mooncake.cache.hashing import BlockHasher, HashAlgorithm, KeyBatch
from mooncake.cache.index import BlockIndex, Holder, IndexSnapshot, PrefixMatch, SourceSnapshot
from mooncake.cache.policy import EvictionPolicy, LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CapacityPoint",
    "EvictionPolicy",
    "HashAlgorithm",
    "Holder",
    "IndexSnapshot",
    "KeyBatch",
    "LengthAwarePolicy",
    "LfuPolicy",
    "LruPolicy",
    "PrefixMatch",
    "SequenceGap",
    "SievePolicy",
    "SourceSnapshot",
    "hit_ratio_curve",
    "simulate_prefix_hits",
]
