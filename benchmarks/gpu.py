"""GPU figures of the real engines (run through benchmarks/gpu.sh on a CUDA machine).

    python benchmarks/gpu.py [--model llama3-8b] [--lengths 8192,16384,32768] [--peak-tflops 989]

1. `prefill_mfu`: FLOPs of a prefill (the model's FLOPs per token at the mean
   context n/2, times n, with the LM head counted once: a prefill computes the
   last position's logits only; `engine.prefill_flops`) over its time, against
   `--peak-tflops` (H200 dense bf16: 989). Goal ≥ 0.5. Backend: flash-attn when
   it imports, else SDPA.
2. `layerwise_speedup`: the store time exposed to the compute with stores after
   the forward pass ÷ with layer-wise stores on a side stream, into a host DRAM
   cache; where the layer-wise wait is under 1 ms, taken to 1 ms, a lower bound
   (listed in `layerwise_speedup_bounds`), as in benchmarks/engine.py.
3. `decode_step_ms` at batch 1 / 8 / 32 with 2 K tokens of context each.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np
from engine import counts, layerwise_speedup, prefill_flops  # benchmarks/engine.py: one count for CPU and GPU figures

from mooncake.cache import DramPagePool, TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.engine.config import PRESETS
from mooncake.sched.cost import HARDWARE
from mooncake.types import BlockKey, RequestId, block_count

BLOCK_TOKENS = 256


def options() -> argparse.Namespace:
    """The command line, every option checked before torch is imported and the model built on the GPU (a bad
    --lengths or --decode-batches was a ValueError only then, or after the prefill section); the lists parsed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--peak-tflops", type=float, default=HARDWARE["8xH200"].peak_flops_per_gpu / 1e12)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-batches", default="1,8,32")
    args = parser.parse_args()
    if not 0 < args.peak_tflops < math.inf:  # the MFU's denominator
        parser.error(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops:g}")
    if args.decode_context < 1:
        parser.error(f"--decode-context must be at least 1, got {args.decode_context}")
    args.lengths = counts(parser, "--lengths", args.lengths)
    args.decode_batches = counts(parser, "--decode-batches", args.decode_batches)
    return args


def main() -> None:
    args = options()
    # torch and the engines (seconds to import) only now: a run refused above never needs them.
    import torch

    from mooncake.engine.attention import flash_attention_available
    from mooncake.engine.decode import DecodeConfig, DecodeEngine
    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel
    from mooncake.engine.prefill import PrefillConfig, PrefillEngine

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs CUDA")
    config = PRESETS[args.model]
    model = LlamaModel(config, seed=0, dtype="bfloat16", device="cuda")
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS, dtype="bfloat16")
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "model": config.name,
        "attention": "flash-attn" if flash_attention_available() else "sdpa",
        "prefill_s": {},
        "prefill_mfu": {},
        "layerwise_exposed_store_s": {},
        "layerwise_speedup": {},
        "layerwise_speedup_bounds": [],
    }
    for n in args.lengths:
        tokens = rng.integers(0, config.vocab_size, size=n).tolist()
        cache = TieredCache([DramPagePool(layout.page_bytes, n // BLOCK_TOKENS + 2)])
        with PrefillEngine(model, cache, hasher, PrefillConfig(chunk_tokens=n, store=False)) as engine:
            engine.prefill(tokens[:1024])
            torch.cuda.synchronize()
            seconds = engine.prefill(tokens).seconds
        flops = prefill_flops(config, n)
        result["prefill_s"][n] = seconds
        result["prefill_mfu"][n] = flops / seconds / (args.peak_tflops * 1e12)
        waits = {}
        for layerwise in (False, True):
            cache = TieredCache([DramPagePool(layout.page_bytes, n // BLOCK_TOKENS + 2)])
            with PrefillEngine(model, cache, hasher, PrefillConfig(chunk_tokens=n, layerwise=layerwise)) as engine:
                waits["layerwise" if layerwise else "serialized"] = engine.prefill(tokens).store_wait_s
        result["layerwise_exposed_store_s"][n] = waits
        result["layerwise_speedup"][n], bound = layerwise_speedup(waits)
        if bound:
            result["layerwise_speedup_bounds"].append(n)
        print(json.dumps({n: [result["prefill_mfu"][n], result["layerwise_speedup"][n], bound]}), flush=True)

    context = args.decode_context
    cache = TieredCache([DramPagePool(layout.page_bytes, context // BLOCK_TOKENS + 2)])
    keys = [BlockKey(i + 1) for i in range(block_count(context, BLOCK_TOKENS))]
    for b, key in enumerate(keys):
        size = layout.block_bytes(min(BLOCK_TOKENS, context - b * BLOCK_TOKENS))
        cache.put(key, (rng.standard_normal(size // 2) * 0.5).astype(np.float16).view(np.uint8))
    result["decode_step_ms"] = {}
    for batch in args.decode_batches:
        engine = DecodeEngine(
            model,
            cache,
            block_tokens=BLOCK_TOKENS,
            config=DecodeConfig(max_batch_size=batch, max_context_tokens=context + 16),
        )
        for r in range(batch):
            engine.try_join(RequestId(r), keys, prompt_tokens=context, first_token=r, max_new_tokens=12)
        engine.step()
        times = []
        for _ in range(8):
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        result["decode_step_ms"][batch] = 1e3 * float(np.median(times))
        del engine
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
