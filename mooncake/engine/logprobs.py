"""A sampled token's log-probabilities: a plain record (no torch), so the processes that only carry it (a
gateway, the wire between workers) need not load the engines. `sampling.token_logprobs` computes it."""

from __future__ import annotations

import attrs

__all__ = ["TokenLogprobs"]


@attrs.frozen(kw_only=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model, its rank, and the most probable tokens'.

    Attributes:
        logprob: the token's log-probability (<= 0; -inf where the model gives it none).
        rank: the number of tokens at least as probable, itself included, as vLLM counts it (1: the most
            probable alone; tokens of equal probability all take the last of their places).
        top: (token, log-probability) of the k most probable tokens, most probable first; equal ones by id.
    """

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
