"""Per-token cost of the sampler's options against the plain draw, on one logits row of a real vocabulary.

    python benchmarks/sampling.py [--json] [--vocab V] [--prompt-tokens N] [--tokens T]

Each case draws T tokens, one `Sampler.next_token` per token over a fixed
float32 row of V logits (LLaMA 3's 128,256 by default), the way the decode
engine calls it for one request of its batch: greedy; temperature 1 with top_p
0.9 (the plain draw, the baseline); with vLLM's top_k 50 and min_p 0.05 as
well; with a repetition penalty of 1.05 and a frequency penalty of 0.2 over a
prompt of N distinct tokens (Qwen's generation_config sets the first); and the
log-probabilities a request with `logprobs: 5` adds per token
(`token_logprobs`), beside a peer that takes its top 5 by a stable sort of the
whole vocabulary (what the first version did). The plain draw has a peer too:
the draw as this sampler made it before (the nucleus found among the k largest
probabilities, k = 32 doubling, then `torch.multinomial`), where it now sums
octaves of probability to find the candidates and draws by inverting the
cumulative distribution. Ratios are to the plain draw, measured in the same
run. CPU only; the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch (seconds to import) only once the options are checked
    import torch


def per_token_ms(draw: Callable[[], object], tokens: int, repeats: int) -> float:
    draw()  # the first call builds what a sampler keeps (penalty masks): outside the timing
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(tokens):
            draw()
        runs.append((time.perf_counter() - start) / tokens * 1e3)
    return statistics.median(runs)


def sorted_top(logits: torch.Tensor, token: int, k: int) -> object:
    """The peer: log-softmax, then the top k by a stable sort of the whole vocabulary."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.sort(logprobs, descending=True, stable=True)
    return float(logprobs[token]), ids[:k].tolist(), values[:k].tolist()


def previous_draw(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """The plain draw's peer: the nucleus among the k largest probabilities (k = 32, doubling), then
    torch.multinomial."""
    import torch

    exact = logits.double()
    probabilities = torch.softmax(exact - exact.max(), dim=-1)
    k = min(32, len(probabilities))
    while (ordered := torch.topk(probabilities, k).values).sum() < top_p and k < len(probabilities):
        k = min(2 * k, len(probabilities))
    summed = torch.cumsum(ordered, dim=0)
    before = torch.cat((summed.new_zeros(1), summed[:-1]))
    kept = probabilities >= ordered[before < top_p][-1]
    return int(torch.multinomial(torch.where(kept, probabilities, 0.0), 1, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for option in ("vocab", "prompt_tokens", "tokens", "repeats"):  # no prompt: the penalties' case would have none
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    import torch

    from mooncake.engine.sampling import Sampler, SamplingParams, token_logprobs

    torch.set_num_threads(1)  # one decode step's share: the comparison, not the machine's thread count
    logits = torch.randn(args.vocab, generator=torch.Generator().manual_seed(0)) * 4
    prompt = list(range(0, 2 * args.prompt_tokens, 2))
    cases = {
        "greedy": SamplingParams(),
        "plain": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
        "top_k_min_p": SamplingParams(temperature=1.0, top_p=0.9, seed=1, top_k=50, min_p=0.05),
        "penalties": SamplingParams(temperature=1.0, top_p=0.9, seed=1, repetition_penalty=1.05, frequency_penalty=0.2),
    }
    ms = {}
    for name, params in cases.items():
        sampler = Sampler(params, prompt=prompt if params.needs_prompt else None)
        ms[name] = per_token_ms(lambda s=sampler: s.next_token(logits), args.tokens, args.repeats)
    generator = torch.Generator().manual_seed(1)
    ms["plain_previous_peer"] = per_token_ms(lambda: previous_draw(logits, 0.9, generator), args.tokens, args.repeats)
    # The token whose log-probability a `logprobs: 5` request reports: the one its draw picked (in the vocabulary
    # whatever --vocab is; a fixed id 7 was a library error under --vocab 7).
    token = Sampler(cases["plain"]).next_token(logits)
    ms["logprobs_5"] = per_token_ms(lambda: token_logprobs(logits, token, 5), args.tokens, args.repeats)
    ms["logprobs_5_sorted_peer"] = per_token_ms(lambda: sorted_top(logits, token, 5), args.tokens, args.repeats)
    result = {
        "vocab": args.vocab,
        "prompt_tokens": args.prompt_tokens,
        "ms_per_token": {name: round(value, 4) for name, value in ms.items()},
        "ratio_to_plain": {name: round(value / ms["plain"], 3) for name, value in ms.items()},
        "logprobs_speedup_over_sorted_peer": round(ms["logprobs_5_sorted_peer"] / ms["logprobs_5"], 2),
        "plain_speedup_over_previous_peer": round(ms["plain_previous_peer"] / ms["plain"], 2),
    }
    if args.json:
        print(json.dumps(result))
        return
    for name, value in ms.items():
        print(f"{name:>24}: {value:8.3f} ms/token  ({value / ms['plain']:.2f}x the plain draw)")
    print(f"top-5 logprobs: {result['logprobs_speedup_over_sorted_peer']}x faster than sorting the vocabulary")
    print(f"plain draw: {result['plain_speedup_over_previous_peer']}x faster than the previous draw")


if __name__ == "__main__":
    main()
