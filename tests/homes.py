"""Prompts with a chosen home: the idle prefill instance Algorithm 1's ties send a prompt to.

With every prefill instance idle and none holding a prefix of the prompt, the routers break the tie by
the prompt's rendezvous home (`mooncake.sched.router.spread_weights`), a function of its block keys and
the instance ids. A test that needs a request on one instance asks for a prompt homed there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mooncake.sched.router import spread_weights

__all__ = ["prompt_homed_on"]


def prompt_homed_on(cluster: Any, instance: str, stem: str) -> str:
    """`N stem` for the first N whose home among the cluster's prefill instances is `instance` (the number
    leads: the home is the first block's, which prompts sharing it share)."""
    gateway = cluster.gateway
    hasher = gateway.dispatcher.hasher
    ids = [view.instance_id for view in gateway.dispatcher.conductor.prefill_views]
    for number in range(200):
        prompt = f"{number} {stem}"
        keys = hasher.block_keys(np.asarray(gateway.tokenizer.encode(prompt), dtype=np.int32))
        weights = spread_weights(keys, np.zeros(len(ids), dtype=np.int64), ids)
        if ids[int(np.argmax(weights))] == instance:
            return prompt
    raise AssertionError(f"no prompt N {stem!r} homed on {instance} among {ids}")
