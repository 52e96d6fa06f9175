"""The library's eviction policies under test, by the reference's kind names, and every
(kind, prefix-aware) pair as pytest parameters: the policy and capacity tests share them."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake.cache.policy import LengthAwarePolicy, LfuPolicy, LruPolicy, SievePolicy

POLICIES: dict[str, Any] = {
    "lru": LruPolicy,
    "lfu": LfuPolicy,
    "length_aware": LengthAwarePolicy,
    "sieve": SievePolicy,
}
ALL_POLICIES = [
    pytest.param(kind, prefix_aware, id=f"{kind}-{'prefix' if prefix_aware else 'flat'}")
    for kind in POLICIES
    for prefix_aware in (True, False)
]
