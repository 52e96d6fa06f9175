"""A prefill instance as a chunked pipeline group: `[prefill] pipeline_size = X` processes, one instance.

The worker of such an instance stays the instance — its gateway connection,
transfer engine, tiered cache and health answer are the same as a single
process's — and is stage 0 of a `mooncake.engine.pipeline.PipelineGroup`
whose X − 1 other stages are processes it starts, each holding a contiguous
slice of the layers (`stage_layers`). The Conductor and the gateway see one
prefill instance.

Its prefills are `PrefillEngine`'s — prefix reuse, pages reserved then
committed once every layer is stored, a `KvSink` that hears of each layer once
its bytes are final — with `GroupForward` as the forward pass:

1. The prefix's KV is read out of the pinned pages for every layer before the
   group starts: each stage needs its own layers' prefix at its first chunk.
2. The group computes the new rows; `LayerwiseKvIo.store` writes each layer's
   rows into the reserved pages as they become final in stage 0's buffers —
   stage 0's layers chunk by chunk as it computes them, the other stages'
   layers when their KV comes back — and the sink hears of each layer after
   its last store, so the decode instance receives the layers of the first
   stages while the last ones still compute.

Only this process touches the cache: the stages send their KV back rather than
writing the shared pages themselves (see `mooncake.engine.pipeline`), so a page
given back after a failure is never written afterwards.

Invariant: the pages hold the bytes a single-process `PrefillEngine` stores
for the same prompt and cache (the engine's own invariants hold as for any
forward pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mooncake.cache.hashing import BlockHasher
from mooncake.cache.tiered import TieredCache
from mooncake.engine.config import ModelConfig
from mooncake.engine.layerwise import LayerwiseKvIo
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import PrefillConfig, PrefillEngine
from mooncake.errors import Cancelled

if TYPE_CHECKING:
    from serving.config import ClusterConfig

__all__ = ["GroupForward", "group_prefill_engine"]


class GroupForward:
    """A pipeline group as a prefill's `ForwardPass` (this process its stage 0; its owner closes it)."""

    def __init__(self, group: PipelineGroup) -> None:
        self.group = group

    @property
    def model_config(self) -> ModelConfig:
        return self.group.config

    @property
    def dtype(self) -> torch.dtype:
        return self.group.model.dtype

    @property
    def device(self) -> torch.device:
        return self.group.model.device

    def run(
        self,
        ids: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        io: LayerwiseKvIo,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Raises EngineError when a stage fails (the group has failed: every later prefill raises it too), and
        Cancelled when `cancelled` stops it before a chunk (the group goes on)."""
        if cancelled is not None and cancelled():  # before the prefix is loaded and sent to every stage
            raise Cancelled(f"prefill cancelled with {io.prefix_tokens} of its {len(ids)} prompt tokens cached")
        for layer in range(self.group.config.num_layers):  # every stage needs its prefix before its first chunk
            io.wait_for_prefix(layer)
        return self.group.prefill(
            ids.tolist(), kv=kv, prefix_tokens=io.prefix_tokens, on_rows=io.store, cancelled=cancelled
        )


def start_group(
    config: ClusterConfig, *, timeout_s: float, on_failure: Callable[[str], None] | None = None
) -> PipelineGroup:
    """This process as stage 0 of a chunked pipeline group of the config's `[prefill] pipeline_size` processes, as
    a prefill worker runs it (and `profile_engine.py --config` times it): each stage reads its own layers' tensors,
    on one thread (many engines share the machine's cores); `timeout_s` bounds any one transfer between stages."""
    return PipelineGroup(
        config.model.config,
        num_stages=config.prefill.pipeline_size,
        chunk_tokens=config.prefill.chunk_tokens,
        seed=config.model.seed,
        dtype=config.model.dtype,
        checkpoint=config.model.checkpoint,
        threads_per_stage=1,
        timeout_s=timeout_s,
        on_failure=on_failure,
    )


def group_prefill_engine(
    group: PipelineGroup, cache: TieredCache, hasher: BlockHasher, *, layerwise: bool = True
) -> PrefillEngine:
    """A prefill engine over this node's cache whose forward pass is `group` (`layerwise`: store each layer's
    KV while later layers compute; off, every store after the forward pass)."""
    return PrefillEngine(GroupForward(group), cache, hasher, PrefillConfig(layerwise=layerwise))
