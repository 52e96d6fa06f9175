"""The parts both simulated clusters build their nodes from: a metadata-only KV cache and a decode node.

`metadata_cache` is a node's KV cache as the simulator keeps it: block keys
and their chain, no bytes (a `MetadataPagePool`), one tier, prefix-aware LRU,
promoted on first access. The disaggregated cluster gives one to each prefill
node (DRAM, fed to the Conductor's index), the coupled baseline one to each
instance (its HBM prefix cache).

A `DecodeNode` is a `ContinuousBatch` (built from the roofline of the node's
`AnalyticStepModel`) and the plan of its next step boundary. Its owner plans a
boundary after an optional stall (a prefill holding the GPU) and some steps at
constant membership (`plan`, which returns when it falls), schedules its
handler there, and at that time ends the stretch (`end_stretch`: the stall and
steps happen, finished members leave). Planning again voids the earlier plan: a
boundary whose version is no longer current is ignored (`is_current`), which
is how an arrival cuts a long stretch at the next step boundary
(`steps_to_next_boundary`).

Invariants: only the boundary of the latest plan is current; between
boundaries the batch's `start_s` is a step boundary and `grown(now)` counts the
tokens its members gained since then (none while a planned stall lasts).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mooncake.cache.policy import LruPolicy
from mooncake.cache.pool import MetadataPagePool
from mooncake.cache.tiered import TieredCache
from mooncake.sched.step import AnalyticStepModel
from mooncake.sim.batch import ContinuousBatch, Member
from mooncake.types import BlockKey, InstanceId, Tier

__all__ = ["DecodeNode", "metadata_cache", "shared_prefix_blocks"]


def shared_prefix_blocks(keys: Sequence[BlockKey], other: Sequence[BlockKey]) -> int:
    """How many leading blocks two prompts' chains share (a key names its whole prefix): what a prompt reuses of
    one computed beside it in the same batch, whose blocks a node caches as it schedules them."""
    count = 0
    for key, theirs in zip(keys, other, strict=False):
        if key != theirs:
            break
        count += 1
    return count


def metadata_cache(source: InstanceId, tier: Tier, *, page_bytes: int, num_pages: int) -> TieredCache:
    """A simulated node's KV cache: `num_pages` metadata-only pages of `page_bytes` in `tier`,
    evicted by prefix-aware LRU; its events carry `source`."""
    return TieredCache(
        [MetadataPagePool(tier, page_bytes, num_pages)],
        source=source,
        policy=lambda: LruPolicy(prefix_aware=True),
        promote_after=0,
    )


@attrs.define(eq=False)
class DecodeNode:
    """A simulated node's continuous decode batch and the plan of its next step boundary."""

    instance_id: InstanceId
    batch: ContinuousBatch
    version: int = 0  # of the current plan: boundaries planned under another are void
    planned_steps: int = 0
    planned_stall_s: float = 0.0

    @classmethod
    def of(cls, instance_id: InstanceId, step_model: AnalyticStepModel) -> DecodeNode:
        """An idle node whose steps take what `step_model` says (its roofline).

        Raises:
            ConfigError: a roofline the analytic batch cannot run (see `ContinuousBatch`).
        """
        return cls(instance_id, ContinuousBatch(step_model.roofline()))

    def grown(self, now: float) -> int:
        """Tokens the batch gained in the steps of its current stretch done by `now` (none during its stall)."""
        batch = self.batch
        return batch.steps_within(now - batch.start_s - self.planned_stall_s) * len(batch) if len(batch) else 0

    def steps_to_next_boundary(self, now: float) -> int:
        """Steps of the current stretch until the first boundary after `now` (the first step after a stall: a
        plan cut there must pass the stall again, as `plan(steps)` without one drops it)."""
        batch = self.batch
        return batch.steps_within(now - batch.start_s - self.planned_stall_s) + 1

    def plan(self, steps: int, stall_s: float = 0.0) -> float:
        """Plan the next boundary after a `stall_s` stall and `steps` steps; returns when it falls.

        Earlier plans are void from now on.
        """
        self.version += 1
        self.planned_steps = steps
        self.planned_stall_s = stall_s
        batch = self.batch
        return batch.start_s + stall_s + batch.stretch_s(steps)

    def void_plans(self) -> None:
        """No boundary is planned any more (an idle batch, or one woken up at once)."""
        self.version += 1
        self.planned_steps = 0
        self.planned_stall_s = 0.0

    def is_current(self, version: int) -> bool:
        return version == self.version

    def end_stretch(self, now: float) -> list[Member]:
        """At the current plan's boundary (`now`): the stall and the steps happen; returns the
        members that finished, which have left the batch."""
        batch = self.batch
        if self.planned_stall_s:
            batch.stall(self.planned_stall_s)
            self.planned_stall_s = 0.0  # it has happened: the steps from here start at the batch's start_s
        if batch.members:
            batch.advance(self.planned_steps)
        else:
            batch.start_s = now
        return batch.take_finished()
