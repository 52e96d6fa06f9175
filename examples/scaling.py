"""A workload scaled to what the example cluster serves: the prompts load.py sends, the requests a simulation replays.

Every 512-token block of a workload (a trace's, or a generated one's) becomes
`512 × length_scale` characters of text derived from its key, so requests that
share blocks share a prefix exactly as in the workload; a prompt is cut to
`input_length × length_scale` characters, at most `max_prompt_tokens`. A
request's output is `output_length × output_scale` tokens, at least 1 and at
most `max_output_tokens`. Arrival times are left as they are (load.py and
replay.py each have a `--speedup`).

`scale(requests, scaling, encode=..., hasher=...)` gives, per request, the
prompt text and the `Request` the cluster sees: the ids its tokenizer makes of
the prompt, their block keys in its hasher (the keys its Conductor indexes, so
a simulated Conductor sees the same blocks the real one does), the scaled
output, the same id and arrival.
"""

from __future__ import annotations

import argparse
import random
import string
from collections.abc import Callable, Iterable

import attrs

from mooncake._checks import require_int, require_number
from mooncake.cache.hashing import BlockHasher
from mooncake.types import Request
from mooncake.workload import TRACE_BLOCK_SIZE_TOKENS

__all__ = ["Scaled", "Scaling", "add_scaling_options", "block_text", "output_of", "prompt_of", "scale", "scaling_of"]

ALPHABET = string.ascii_letters + string.digits + "      "


def _positive(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    require_number(f"--{attribute.name.replace('_', '-')}", value, minimum=0, strict=True)


def _count(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    require_int(f"--{attribute.name.replace('_', '-')}", value, minimum=1)  # a count: slicing by 2.5 would fail


@attrs.frozen(kw_only=True)
class Scaling:
    """How a workload's lengths shrink to the example cluster's (module docstring)."""

    length_scale: float = attrs.field(default=1 / 32, validator=_positive)
    output_scale: float = attrs.field(default=1 / 16, validator=_positive)
    max_prompt_tokens: int = attrs.field(default=1024, validator=_count)
    max_output_tokens: int = attrs.field(default=64, validator=_count)


@attrs.frozen
class Scaled:
    """One request as sent (`prompt`, `request.output_length` as max_tokens) and as the cluster sees it."""

    prompt: str
    request: Request


def add_scaling_options(parser: argparse.ArgumentParser) -> None:
    defaults = Scaling()
    parser.add_argument("--length-scale", type=float, default=defaults.length_scale)
    parser.add_argument("--output-scale", type=float, default=defaults.output_scale)
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    parser.add_argument("--max-output-tokens", type=int, default=defaults.max_output_tokens)


def scaling_of(args: argparse.Namespace) -> Scaling:
    """The `Scaling` of `add_scaling_options`' options.

    Raises:
        ConfigError: an option that is not a number > 0.
    """
    return Scaling(
        length_scale=args.length_scale,
        output_scale=args.output_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )


def block_text(key: int, size: int) -> str:
    """`size` characters determined by `key` (equal keys, equal text)."""
    return "".join(random.Random(key).choices(ALPHABET, k=size))


def prompt_of(request: Request, scaling: Scaling) -> str:
    """The text standing for `request`'s prompt."""
    # A block of the workload's keys (the published traces' 512 tokens where a request does not say).
    size = max(1, round((request.block_size_tokens or TRACE_BLOCK_SIZE_TOKENS) * scaling.length_scale))
    text = "".join(block_text(int(key), size) for key in request.block_keys)
    length = max(1, min(scaling.max_prompt_tokens, round(request.input_length * scaling.length_scale), len(text)))
    return text[:length]


def output_of(request: Request, scaling: Scaling) -> int:
    """The tokens to ask for (max_tokens) for `request`."""
    return max(1, min(scaling.max_output_tokens, round(request.output_length * scaling.output_scale)))


def scale(
    requests: Iterable[Request], scaling: Scaling, *, encode: Callable[[str], list[int]], hasher: BlockHasher
) -> list[Scaled]:
    """Each request's prompt text and the request the cluster of `encode` and `hasher` sees (module docstring)."""
    scaled = []
    for request in requests:
        prompt = prompt_of(request, scaling)
        tokens = encode(prompt)
        seen = Request(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            input_length=len(tokens),
            output_length=output_of(request, scaling),
            block_keys=hasher.block_keys(tokens),
            tokens=tokens,
            block_size_tokens=hasher.block_size_tokens,
        )
        scaled.append(Scaled(prompt, seen))
    return scaled
