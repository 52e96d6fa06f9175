"""Choosing the next token: greedy, or temperature sampling (optionally nucleus) from a per-request seeded stream.

Each request owns its random stream (seeded from its `seed`), so the tokens it
gets do not depend on which other requests share its batch.

Nucleus (top-p) sampling draws only from the most probable tokens whose mass
reaches `top_p`. Token i belongs to the nucleus iff the probability mass of
the tokens strictly more probable than i is below `top_p`: the most probable
token always belongs, tokens tied at the boundary all belong or none does, and
`top_p = 1` keeps every token of non-zero probability (the draws are then the
plain temperature sampler's, bit for bit: the filter is skipped).
"""

from __future__ import annotations

import attrs
import torch

from mooncake._checks import require_int, require_number
from mooncake.errors import ConfigError

__all__ = ["Sampler", "SamplingParams", "nucleus"]

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        temperature: 0 for greedy (the default), else logits are divided by it.
        top_p: the nucleus' probability mass, in (0, 1]; 1 (the default) samples from every token.
        seed: the request's random stream (temperature > 0), in [0, 2**64).
        stop_token_ids: tokens that end the generation once sampled (the model's EOS and the like, as
            vLLM's `stop_token_ids`): the token is emitted, as the request's last.
    """

    temperature: float = attrs.field(default=0.0)
    top_p: float = attrs.field(default=1.0)
    seed: int = attrs.field(default=0)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)

    @temperature.validator
    def _check_temperature(self, _attribute: object, value: float) -> None:
        require_number("temperature", value, minimum=0.0)

    @top_p.validator
    def _check_top_p(self, _attribute: object, value: float) -> None:
        if require_number("top_p", value, minimum=0.0, strict=True) > 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {value!r}")

    @seed.validator
    def _check_seed(self, _attribute: object, value: int) -> None:
        if require_int("seed", value, minimum=0) > MAX_SEED:
            raise ConfigError(f"seed must be below 2**64, got {value!r}")

    @stop_token_ids.validator
    def _check_stop_token_ids(self, _attribute: object, value: frozenset[int]) -> None:
        for token in value:
            require_int("stop_token_ids", token, minimum=0)


def nucleus(probabilities: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of `probabilities` [vocab]: a bool mask, True for token i iff the mass of the tokens
    strictly more probable than i is below `top_p` (computed in float64)."""
    exact = probabilities.double()
    ordered = torch.sort(exact, descending=True).values
    before = torch.cumsum(ordered, dim=0) - ordered  # mass ahead of each sorted position (0 for the first)
    # The kept sorted positions are a prefix; ties after it share its last value, so `>=` keeps them too.
    threshold = ordered[before < top_p][-1]
    return exact >= threshold


class Sampler:
    """Draws one request's tokens; keeps its random stream between calls."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        if params.temperature > 0:
            self._generator = torch.Generator().manual_seed(params.seed)

    def next_token(self, logits: torch.Tensor) -> int:
        """The token chosen from float `logits` [vocab]."""
        if self._generator is None:
            return int(torch.argmax(logits))
        # Shifted so the largest logit is 0 before dividing: a tiny temperature then gives -inf for the rest
        # (probability 0), never inf - inf = nan.
        logits = logits.double().cpu()  # float64: a temperature as small as 1e-300 is not 0 there
        probabilities = torch.softmax((logits - logits.max()) / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probabilities = torch.where(nucleus(probabilities, self.params.top_p), probabilities, 0.0)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))
