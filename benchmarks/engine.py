"""Real engines on this machine: prefill against the roofline, decode steps, layer-wise I/O, CPP, peers.

    python benchmarks/engine.py [--json] [--model small] [--prefill-tokens 1024]
        [--decode-context 2048] [--decode-batches 1,8,32] [--layerwise-tokens 2048,8192,32768]
        [--cpp-tokens 2048] [--checkpoint DIR] [--dtype float32|bfloat16] [--threads N]
        [--peer-batches 1,8,32] [--peer-prompt-tokens 128] [--peer-new-tokens 32] [--repeats 3]
        [--peers-only]

Sections 1-4 in fp32 on the CPU (the GPU figures come from benchmarks/gpu.sh);
`--threads` (default: torch's, all cores) holds for every section (section 4
splits them between its stages).

1. `prefill_tokens_per_s`: the prefill engine on a `--prefill-tokens` prompt of
   the `--model` preset (no cached prefix: the warm-up prefills another prompt;
   KV stored layer-wise). The peer is the roofline: the prefill's FLOPs (each
   token's forward at the mean context n/2, the LM head once, as a prefill
   computes the last position's logits only) against the FLOP/s of a plain
   matmul of the model's MLP shape measured in the same run
   (`roofline_tokens_per_s`); `prefill_vs_roofline` is their ratio (goal ≥ 0.6).
2. `decode_step_ms` at each batch size with `--decode-context` tokens of context
   per request, ours (grouped matmul) and torch SDPA (`decode_step_ms_sdpa`); and
   one layer's attention alone (`decode_attention_ms`, `decode_attention_ms_sdpa`)
   over slot tensors shaped as the engine's.
3. `layerwise_speedup`: the store time exposed to the compute (the prefill's
   wait for its KV stores) when storing after the forward pass ÷ the same with
   layer-wise stores, at each `--layerwise-tokens` length (goal ≥ 3 at the
   longest). This runs the `tiny` preset (its prefill at 32 K tokens takes
   seconds here; `small` would take minutes) with 4 K-token chunks. The exposed
   waits are in `layerwise_exposed_store_s`. Where the layer-wise wait is under
   1 ms (a prompt of one chunk leaves microseconds, timer noise) the ratio is
   taken to 1 ms instead, a lower bound, and its length is listed in
   `layerwise_speedup_bounds`.
4. `cpp_speedup`: one prefill of `--cpp-tokens` in one process (`--threads`
   threads) ÷ the same prompt through a 2-stage chunked pipeline, each stage on
   half of them (`cpp_threads_per_stage`; at least one, so `--threads 1` gives
   the pipeline two). On 2 cores the pipeline has no spare hardware to win with:
   the figure says what 2 cores allow.
5. `peers`: one checkpoint (`--checkpoint`, default a random LlamaForCausalLM
   of about 16 M parameters that transformers generates and saves in a
   temporary directory: hidden 512, 4 layers, 8 heads / 4 KV heads, MLP 1408,
   vocab 4096) in `--dtype`, at each `--peer-batches` size of
   `--peer-prompt-tokens` prompts. Prefill tokens/s: this engine's
   `PrefillEngine.prefill_batch` of the prompts (packed into shared passes,
   KV stored layer-wise), transformers' forward of the [batch, prompt] ids
   (the last position's logits, its KV kept in a `DynamicCache`). Decode tokens/s: `--peer-new-tokens` steps of this
   engine's `DecodeEngine` with the batch joined (continuous batching), and
   transformers' greedy `generate` from its first token to its last (times
   stamped by a stopping criterion, so its prefill is left out). vLLM's CPU
   build is measured the same way when `import vllm` works (prefill: one
   generated token; decode: the rest), skipped with the reason otherwise.
   Each figure is the median of `--repeats` runs after a warm-up, and
   `prefill_vs_transformers`, `decode_vs_transformers` (and `*_vs_vllm`) are
   this engine's rate ÷ the peer's (goal ≥ 1.0 on prefill, ≥ 1.5 on batched
   decode; reported, not asserted). `--peers-only` runs this section alone.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake.cache import DramPagePool, TieredCache
from mooncake.cache.hashing import BlockHasher
from mooncake.cli import comma_separated
from mooncake.engine.config import PRESETS, ModelConfig
from mooncake.types import BlockKey, RequestId, block_count

# torch and the engines (seconds to import) are imported where they are used: options are checked first, and a
# run refused for a bad one never needs them.
if TYPE_CHECKING:
    import torch

    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel

BLOCK_TOKENS = 16
LAYERWISE_MIN_WAIT_S = 1e-3  # a layer-wise exposed wait below this is timer noise: a ratio is taken to this instead


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()  # type: ignore[no-any-return]


def cache_for(layout: KvLayout, tokens: int) -> TieredCache:
    """A DRAM cache for `tokens`, its pages touched up front as a serving node's are after warm-up."""
    return TieredCache([DramPagePool(layout.page_bytes, block_count(tokens, layout.block_tokens) + 1, prefault=True)])


def matmul_flops_per_s(config: ModelConfig, rows: int) -> float:
    import torch

    a = torch.randn(rows, config.hidden_size)
    b = torch.randn(config.hidden_size, 2 * config.intermediate_size)
    torch.mm(a, b)
    runs, started = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - started < 1.0:
        torch.mm(a, b)
        runs += 1
    return 2.0 * rows * config.hidden_size * 2 * config.intermediate_size * runs / (time.perf_counter() - started)


def prefill_flops(config: ModelConfig, n: int) -> float:
    """FLOPs of an `n`-token prefill: each token's forward at the mean context n/2 (`flops_per_token`), but the
    LM head once, since a prefill computes the logits of its last position only."""
    head = 2.0 * config.vocab_size * config.hidden_size
    return n * (config.flops_per_token(n // 2) - head) + head


def layerwise_speedup(waits: dict[str, float]) -> tuple[float, bool]:
    """(Exposed store time serialized ÷ layer-wise, whether that is only a lower bound): where the layer-wise wait
    is below `LAYERWISE_MIN_WAIT_S` the ratio is taken to that instead (a ratio to timer noise means nothing)."""
    bound = waits["layerwise"] < LAYERWISE_MIN_WAIT_S
    return waits["serialized"] / max(waits["layerwise"], LAYERWISE_MIN_WAIT_S), bound


def bench_prefill(config: ModelConfig, n: int) -> dict[str, float]:
    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel
    from mooncake.engine.prefill import PrefillEngine

    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    tokens = prompt(n, config.vocab_size)
    with PrefillEngine(model, cache_for(layout, 2 * n), hasher) as engine:
        # Warm up on another prompt: one sharing this prompt's first blocks would leave them cached for it.
        engine.prefill(prompt(64, config.vocab_size, seed=1))
        result = engine.prefill(tokens)
    assert result.prefix_tokens == 0, result.prefix_tokens
    measured = n / result.seconds
    roofline = matmul_flops_per_s(config, min(n, 4096)) / (prefill_flops(config, n) / n)
    return {
        "prefill_tokens_per_s": measured,
        "roofline_tokens_per_s": roofline,
        "prefill_vs_roofline": measured / roofline,
    }


def bench_decode(config: ModelConfig, context: int, batches: list[int], steps: int = 5) -> dict[str, Any]:
    """Step times with every request holding `context` tokens of (random) KV loaded from the cache."""
    from mooncake.engine.attention import sdpa_decode_attention
    from mooncake.engine.decode import DecodeConfig, DecodeEngine
    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel

    model = LlamaModel(config, seed=0)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    cache = cache_for(layout, context)
    keys = [BlockKey(i + 1) for i in range(block_count(context, BLOCK_TOKENS))]
    rng = np.random.default_rng(0)
    for b, key in enumerate(keys):
        tokens = min(BLOCK_TOKENS, context - b * BLOCK_TOKENS)
        cache.put(key, (rng.standard_normal(layout.block_bytes(tokens) // 4) * 0.5).astype(np.float32))
    ours: dict[str, float] = {}
    sdpa: dict[str, float] = {}
    for batch in batches:
        for attention, into in ((None, ours), (sdpa_decode_attention, sdpa)):
            options: dict[str, Any] = {"max_batch_size": batch, "max_context_tokens": context + steps + 2}
            if attention is not None:
                options["attention"] = attention
            engine = DecodeEngine(model, cache, block_tokens=BLOCK_TOKENS, config=DecodeConfig(**options))
            for r in range(batch):
                engine.try_join(RequestId(r), keys, prompt_tokens=context, first_token=r, max_new_tokens=steps + 2)
            engine.step()  # warm-up
            times = []
            for _ in range(steps):
                engine.step()
                times.append(engine.last_step_s)
            into[str(batch)] = 1e3 * float(np.median(times))
            del engine
    kernel = {str(b): attention_ms(config, context, b) for b in batches}
    return {
        "decode_step_ms": ours,
        "decode_step_ms_sdpa": sdpa,
        "decode_sdpa_over_ours": {b: sdpa[b] / ours[b] for b in ours},
        "decode_attention_ms": {b: k[0] for b, k in kernel.items()},
        "decode_attention_ms_sdpa": {b: k[1] for b, k in kernel.items()},
    }


def attention_ms(config: ModelConfig, context: int, batch: int, repeats: int = 20) -> tuple[float, float]:
    """One layer's decode attention alone, ours and SDPA, over slots shaped as the decode engine's."""
    import torch

    from mooncake.engine.attention import decode_attention, sdpa_decode_attention

    q = torch.randn(batch, config.num_heads, config.head_dim)
    k = torch.randn(batch, config.num_kv_heads, context + 64, config.head_dim)[:, :, :context]
    v = torch.randn_like(k)
    lengths = torch.full((batch,), context)
    times = []
    for kernel in (decode_attention, sdpa_decode_attention):
        kernel(q, k, v, lengths)
        started = time.perf_counter()
        for _ in range(repeats):
            kernel(q, k, v, lengths)
        times.append(1e3 * (time.perf_counter() - started) / repeats)
    return times[0], times[1]


def bench_layerwise(lengths: list[int]) -> dict[str, Any]:
    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel
    from mooncake.engine.prefill import PrefillConfig, PrefillEngine

    config = PRESETS["tiny"]
    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    exposed: dict[str, dict[str, float]] = {}
    speedup: dict[str, float] = {}
    bounds: list[str] = []
    for n in lengths:
        tokens = prompt(n, config.vocab_size, seed=n)
        waits = {}
        for layerwise in (False, True):
            options = PrefillConfig(chunk_tokens=4096, layerwise=layerwise)
            with PrefillEngine(model, cache_for(layout, n), hasher, options) as engine:
                result = engine.prefill(tokens)
            waits["layerwise" if layerwise else "serialized"] = result.store_wait_s
        exposed[str(n)] = waits
        speedup[str(n)], bound = layerwise_speedup(waits)
        if bound:
            bounds.append(str(n))
    return {"layerwise_exposed_store_s": exposed, "layerwise_speedup": speedup, "layerwise_speedup_bounds": bounds}


def bench_cpp(config: ModelConfig, n: int, chunk: int = 256) -> dict[str, float]:
    import torch

    from mooncake.engine.kv import KvLayout
    from mooncake.engine.model import LlamaModel
    from mooncake.engine.pipeline import PipelineGroup
    from mooncake.engine.prefill import PrefillConfig, PrefillEngine

    tokens = prompt(n, config.vocab_size)
    model = LlamaModel(config, seed=0)
    hasher = BlockHasher(model=config.name, block_size_tokens=BLOCK_TOKENS)
    layout = KvLayout(config=config, block_tokens=BLOCK_TOKENS)
    with PrefillEngine(model, cache_for(layout, n), hasher, PrefillConfig(chunk_tokens=chunk, store=False)) as engine:
        engine.prefill(tokens[:64])
        single = engine.prefill(tokens).seconds
    del model
    # The single process's threads, split between the stages: stage 0 runs on this process's threads, stage 1 in
    # its own process (which would otherwise take half the CPUs, whatever --threads says).
    threads = torch.get_num_threads()
    per_stage = max(1, threads // 2)
    torch.set_num_threads(per_stage)
    try:
        with PipelineGroup(config, num_stages=2, chunk_tokens=chunk, seed=0, threads_per_stage=per_stage) as group:
            group.prefill(tokens[:64])
            started = time.perf_counter()
            group.prefill(tokens)
            piped = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)  # the peers' section runs on all of them again
    return {
        "cpp_single_s": single,
        "cpp_pipeline_s": piped,
        "cpp_speedup": single / piped,
        "cpp_threads_per_stage": per_stage,
    }


# --------------------------------------------------------------------------- peers on one checkpoint

PEER_SHAPE = {  # the generated checkpoint: 8 heads of 64, 4 KV heads, SwiGLU 1408 (about 16 M parameters)
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


GENERATED = "generated LlamaForCausalLM (hidden 512, 4 layers, 8 heads / 4 KV heads, MLP 1408, vocab 4096)"


def generate_checkpoint(directory: str) -> str:
    """A random LlamaForCausalLM of `PEER_SHAPE` saved with transformers' `save_pretrained` under `directory`."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**PEER_SHAPE)).eval()
    with torch.no_grad():  # weights at a trained model's scale, so greedy decoding does not collapse onto one token
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed_tokens" not in name:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[1] ** 0.5)
    path = os.path.join(directory, "bench-llama")
    model.save_pretrained(path)
    return path


# A peer at one checkpoint: seconds of one prefill run and of one decode run, at a batch size.
Timer = Callable[[int], float]


def batch_prompts(batch: int, prompt_tokens: int, vocab: int) -> list[list[int]]:
    return [prompt(prompt_tokens, vocab, seed=1 + r) for r in range(batch)]


def prefill_prompts(model: LlamaModel, cache: TieredCache, prompts: list[list[int]]) -> list[Any]:
    """The prompts as one `PrefillEngine.prefill_batch` (packed into shared passes), KV stored layer-wise."""
    from mooncake.engine.prefill import PrefillEngine

    hasher = BlockHasher(model=model.config.name, block_size_tokens=BLOCK_TOKENS)
    with PrefillEngine(model, cache, hasher) as engine:
        return engine.prefill_batch(prompts)


def decode_steps_s(model: LlamaModel, cache: TieredCache, prefilled: list[Any], new_tokens: int) -> float:
    """The prefilled requests join one `DecodeEngine` (a slot each); the seconds of `new_tokens` steps."""
    from mooncake.engine.decode import DecodeConfig, DecodeEngine

    prompt_tokens = max(len(r.keys) for r in prefilled) * BLOCK_TOKENS
    options = DecodeConfig(max_batch_size=len(prefilled), max_context_tokens=prompt_tokens + new_tokens + 2)
    engine = DecodeEngine(model, cache, block_tokens=BLOCK_TOKENS, config=options)
    for r, result in enumerate(prefilled):
        engine.try_join(
            RequestId(r),
            result.keys,
            prompt_tokens=result.computed_tokens + result.prefix_tokens,
            first_token=result.first_token,
            max_new_tokens=new_tokens + 2,
        )
    started = time.perf_counter()
    for _ in range(new_tokens):
        engine.step()
    return time.perf_counter() - started


def ours(directory: str, dtype: str, prompt_tokens: int, new_tokens: int) -> tuple[Timer, Timer]:
    """This engine. Prefill: the batch's prompts through one `PrefillEngine.prefill_batch`, KV stored
    layer-wise into a fresh cache. Decode: the prompts' KV joins a `DecodeEngine` of
    `batch` slots and `new_tokens` continuous-batching steps are timed (the joins are not)."""
    from mooncake.engine.checkpoint import load_model
    from mooncake.engine.kv import KvLayout

    model = load_model(directory, dtype=dtype)
    layout = KvLayout(config=model.config, block_tokens=BLOCK_TOKENS, dtype=dtype)
    prefilled: dict[int, tuple[TieredCache, list[Any]]] = {}

    def prefill_s(batch: int) -> float:
        prompts = batch_prompts(batch, prompt_tokens, model.config.vocab_size)
        cache = cache_for(layout, batch * (prompt_tokens + BLOCK_TOKENS))
        started = time.perf_counter()
        prefill_prompts(model, cache, prompts)
        return time.perf_counter() - started

    def decode_s(batch: int) -> float:
        if batch not in prefilled:
            cache = cache_for(layout, batch * (prompt_tokens + BLOCK_TOKENS))
            prompts = batch_prompts(batch, prompt_tokens, model.config.vocab_size)
            prefilled[batch] = cache, prefill_prompts(model, cache, prompts)
        return decode_steps_s(model, *prefilled[batch], new_tokens)

    return prefill_s, decode_s


def transformers_peer(directory: str, dtype: str, prompt_tokens: int, new_tokens: int) -> tuple[Timer, Timer]:
    """transformers. Prefill: one forward of the [batch, prompt] ids keeping its KV cache (the last
    position's logits and the KV, as a server's prefill). Decode: greedy `generate` of new_tokens + 1 tokens; a stopping criterion stamps
    the time as each token lands, and the decode steps are the time from the first token to the last."""
    import torch
    import transformers

    from mooncake.engine.model import dtype_of

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype_of(dtype)).eval()
    vocab = model.config.vocab_size

    class Stamps(transformers.StoppingCriteria):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    @torch.inference_mode()
    def prefill_s(batch: int) -> float:
        ids = torch.tensor(batch_prompts(batch, prompt_tokens, vocab))
        started = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started

    @torch.inference_mode()
    def decode_s(batch: int) -> float:
        ids = torch.tensor(batch_prompts(batch, prompt_tokens, vocab))
        stamps = Stamps()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens + 1,
            min_new_tokens=new_tokens + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=transformers.StoppingCriteriaList([stamps]),
        )
        return stamps.times[-1] - stamps.times[0]

    return prefill_s, decode_s


def vllm_peer(directory: str, dtype: str, prompt_tokens: int, new_tokens: int) -> tuple[Timer, Timer] | str:
    """vLLM's CPU build, or why it was skipped. Prefill: `generate` of one token per prompt;
    decode: of new_tokens + 1 tokens less of one, greedy, EOS ignored."""
    try:
        import vllm  # type: ignore[import-not-found,unused-ignore]
    except ImportError as error:
        return f"vllm is not installed ({error}); its CPU build is the peer where it is"
    from mooncake.engine.checkpoint import read_model_config

    llm = vllm.LLM(model=directory, skip_tokenizer_init=True, dtype=dtype, seed=0)
    vocab = read_model_config(directory).vocab_size

    def generate_s(batch: int, tokens: int) -> float:
        prompts = [{"prompt_token_ids": p} for p in batch_prompts(batch, prompt_tokens, vocab)]
        params = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    return (
        lambda batch: generate_s(batch, 1),
        lambda batch: max(generate_s(batch, new_tokens + 1) - generate_s(batch, 1), 1e-9),
    )


def bench_peers(
    directory: str | None, dtype: str, batches: list[int], prompt_tokens: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """This engine, transformers and vLLM (when installed) on one checkpoint: prefill and decode tokens/s.

    The peers' runs interleave (each repeat runs every peer once), so a change in the machine's load
    falls on all of them alike; each figure is the median of `repeats` runs after a warm-up run.
    """
    import torch

    from mooncake.engine.checkpoint import read_model_config

    with tempfile.TemporaryDirectory(prefix="mooncake-bench-") as scratch:
        path = directory or generate_checkpoint(scratch)
        config = read_model_config(path)
        shape = (path, dtype, prompt_tokens, new_tokens)
        peers: dict[str, tuple[Timer, Timer]] = {"mooncake": ours(*shape), "transformers": transformers_peer(*shape)}
        vllm = vllm_peer(*shape)
        if not isinstance(vllm, str):
            peers["vllm"] = vllm
        rates: dict[str, dict[str, dict[str, float]]] = {"prefill": {}, "decode": {}}
        for phase, index, tokens_per_sequence in (("prefill", 0, prompt_tokens), ("decode", 1, new_tokens)):
            for name in peers:
                rates[phase][name] = {}
            for batch in batches:
                seconds: dict[str, list[float]] = {name: [] for name in peers}
                for timers in peers.values():
                    timers[index](batch)  # warm-up
                for _ in range(repeats):
                    for name, timers in peers.items():
                        seconds[name].append(timers[index](batch))
                for name in peers:
                    rates[phase][name][str(batch)] = batch * tokens_per_sequence / float(np.median(seconds[name]))
    result: dict[str, Any] = {
        "checkpoint": directory or GENERATED,
        "parameters": config.num_parameters,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "prefill_tokens_per_s": rates["prefill"],
        "decode_tokens_per_s": rates["decode"],
        "vllm_skipped": vllm if isinstance(vllm, str) else None,
    }
    for phase in ("prefill", "decode"):
        mine = rates[phase]["mooncake"]
        for name in peers:
            if name != "mooncake":
                result[f"{phase}_vs_{name}"] = {b: mine[b] / rates[phase][name][b] for b in mine}
    return result


def print_peers(peers: dict[str, Any]) -> None:
    print(
        f"peers     {peers['checkpoint']} ({peers['parameters'] / 1e6:.0f} M parameters), {peers['dtype']}, "
        f"{peers['prompt_tokens']}-token prompts, {peers['new_tokens']} new tokens, {peers['threads']} threads"
    )
    names = list(peers["prefill_tokens_per_s"])
    print(f"          {'batch':>5}  " + "".join(f"{name + ' tok/s':>20}" for name in names) + "   ratios")
    for phase, goal in (("prefill", 1.0), ("decode", 1.5)):
        rates = peers[f"{phase}_tokens_per_s"]
        for batch in rates["mooncake"]:
            ratios = "  ".join(
                f"this/{name} {peers[f'{phase}_vs_{name}'][batch]:.2f}" for name in names if name != "mooncake"
            )
            line = "".join(f"{rates[name][batch]:20.0f}" for name in names)
            target = "" if phase == "decode" and batch == "1" else f" (goal >= {goal} vs transformers)"
            print(f"{phase:<9} {batch:>5}  {line}   {ratios}{target}")
    if peers["vllm_skipped"]:
        print(f"vllm      skipped: {peers['vllm_skipped']}")


def counts(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """`text`, the value of `option`, as comma-separated integers >= 1, each once (the results are keyed by them),
    read by the command line's one rule for lists (`mooncake.cli.comma_separated`); else `parser`'s usage error
    naming the option and the value. Before, a bad item was a ValueError traceback once the sections before it ran."""
    try:
        return comma_separated(at_least_one)(text)
    except argparse.ArgumentTypeError as error:
        parser.error(f"{option} must be distinct comma-separated integers >= 1, got {text} ({error})")


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def options() -> argparse.Namespace:
    """The command line, every option checked before any work (and before torch is imported): a bad one ends in
    the usage error naming it and its value. The lists are parsed into lists of ints."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--layerwise-tokens", default="2048,8192,32768")
    parser.add_argument("--cpp-tokens", type=int, default=2048)
    parser.add_argument("--checkpoint", default=None, help="a Hugging Face checkpoint (default: generate one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the peer comparison")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, for every section (default: torch's, all cores; the CPP pipeline's stages get half each)",
    )
    parser.add_argument("--peer-batches", default="1,8,32")
    parser.add_argument("--peer-prompt-tokens", type=int, default=128)
    parser.add_argument("--peer-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="of each peer measurement (the median)")
    parser.add_argument("--peers-only", action="store_true", help="only the comparison with transformers and vLLM")
    args = parser.parse_args()
    # Each at least 1: --threads 0 was torch's RuntimeError, --repeats 0 the median of nothing (NaN in the JSON),
    # a prompt or context of 0 tokens nothing to time.
    for option in (
        "prefill_tokens",
        "decode_context",
        "cpp_tokens",
        "peer_prompt_tokens",
        "peer_new_tokens",
        "repeats",
    ):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        parser.error(f"--checkpoint must be a checkpoint's directory, got {args.checkpoint}")
    for option in ("decode_batches", "layerwise_tokens", "peer_batches"):
        setattr(args, option, counts(parser, f"--{option.replace('_', '-')}", getattr(args, option)))
    return args


def main() -> None:
    args = options()
    import torch

    config = PRESETS[args.model]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "model": config.name,
        "parameters": config.num_parameters,
        "threads": torch.get_num_threads(),
    }
    result["cpus"] = os.cpu_count()
    if not args.peers_only:
        result.update(bench_prefill(config, args.prefill_tokens))
        result.update(bench_decode(config, args.decode_context, args.decode_batches))
        result.update(bench_layerwise(args.layerwise_tokens))
        result.update(bench_cpp(config, args.cpp_tokens))
    shape = (args.peer_prompt_tokens, args.peer_new_tokens, args.repeats)
    result["peers"] = bench_peers(args.checkpoint, args.dtype, args.peer_batches, *shape)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if not args.peers_only:
        print_engine(result)
    print_peers(result["peers"])


def print_engine(result: dict[str, Any]) -> None:
    print(f"{result['model']} ({result['parameters'] / 1e6:.0f} M parameters), fp32, {result['threads']} threads")
    print(
        f"prefill   {result['prefill_tokens_per_s']:10.0f} tokens/s  roofline {result['roofline_tokens_per_s']:.0f}  "
        f"ratio {result['prefill_vs_roofline']:.2f} (goal >= 0.6)"
    )
    for batch, ms in result["decode_step_ms"].items():
        print(
            f"decode    batch {batch:>3}  ours {ms:8.2f} ms  sdpa {result['decode_step_ms_sdpa'][batch]:8.2f} ms  "
            f"sdpa/ours {result['decode_sdpa_over_ours'][batch]:.2f}   attention alone (one layer): ours "
            f"{result['decode_attention_ms'][batch]:.2f} ms, sdpa {result['decode_attention_ms_sdpa'][batch]:.2f} ms"
        )
    for n, waits in result["layerwise_exposed_store_s"].items():
        ratio = result["layerwise_speedup"][n]
        bound = n in result["layerwise_speedup_bounds"]
        shown = f"speedup >= {ratio:.1f} (layer-wise wait < 1 ms)" if bound else f"speedup {ratio:.1f}"
        print(
            f"layerwise {int(n):>6} tokens  exposed store {waits['serialized'] * 1e3:8.1f} ms serialized, "
            f"{waits['layerwise'] * 1e3:6.3f} ms layer-wise  {shown} (goal >= 3 at the longest)"
        )
    print(
        f"cpp       X=2  single {result['cpp_single_s']:.2f} s ({result['threads']} threads)  pipeline "
        f"{result['cpp_pipeline_s']:.2f} s ({result['cpp_threads_per_stage']} per stage)  "
        f"speedup {result['cpp_speedup']:.2f}"
    )


if __name__ == "__main__":
    main()
