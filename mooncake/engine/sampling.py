"""Choosing the next token: greedy, or temperature sampling from a per-request seeded stream.

Each request owns its random stream (seeded from its `seed`), so the tokens it
gets do not depend on which other requests share its batch.
"""

from __future__ import annotations

import attrs
import torch

from mooncake._checks import require_int, require_number

__all__ = ["Sampler", "SamplingParams"]


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        temperature: 0 for greedy (the default), else logits are divided by it.
        seed: the request's random stream (temperature > 0).
    """

    temperature: float = attrs.field(default=0.0)
    seed: int = attrs.field(default=0)

    @temperature.validator
    def _check_temperature(self, _attribute: object, value: float) -> None:
        require_number("temperature", value, minimum=0.0)

    @seed.validator
    def _check_seed(self, _attribute: object, value: int) -> None:
        require_int("seed", value, minimum=0)


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
        probabilities = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))
