"""Choosing the next token: greedy, or temperature sampling (optionally nucleus) from a per-request seeded stream.

Each request owns its random stream (seeded from its `seed`), so the tokens it
gets do not depend on which other requests share its batch. The stream is
counter-based: output token k is drawn from a generator seeded with
XXH3-64(seed, k), so a request's draws are independent of each other and the
same wherever each token is sampled. The prefill engine draws token 0 and a
decode engine, in another process, goes on at token 1 (`Sampler(params,
position=1)`) with no generator state to hand over; vLLM keeps one generator
per request for the same effect within one engine.

Nucleus (top-p) sampling draws only from the most probable tokens whose mass
reaches `top_p`. Token i belongs to the nucleus iff the probability mass of
the tokens strictly more probable than i is below `top_p`: the most probable
token always belongs, tokens tied at the boundary all belong or none does, and
`top_p = 1` keeps every token of non-zero probability (the draws are then the
plain temperature sampler's, bit for bit: the filter is skipped).

Log-probabilities (`SamplingParams.logprobs`, as vLLM's and OpenAI's) are of
the model's own distribution: the log-softmax of the raw logits in float32,
before temperature, nucleus or `min_tokens` shape the draw (vLLM's default
`raw_logprobs`), so they do not depend on how a token was chosen. With them a
token comes with its log-probability, its rank (1 + the tokens strictly more
probable) and the `k` most probable tokens.
"""

from __future__ import annotations

import math
import secrets

import attrs
import torch
import xxhash

from mooncake._checks import plain_int, require_int, require_number
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.errors import ConfigError, InvalidRequestError

__all__ = ["Sampler", "SamplingParams", "nucleus", "token_logprobs"]

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        temperature: 0 for greedy (the default), else logits are divided by it.
        top_p: the nucleus' probability mass, in (0, 1]; 1 (the default) samples from every token.
        seed: the request's random stream (temperature > 0), in [0, 2**64); None (the default): a fresh random
            stream for each `Sampler`, as vLLM samples without a seed (a fixed default repeated one text).
        stop_token_ids: tokens that end the generation once sampled (the model's EOS and the like, as
            vLLM's `stop_token_ids`): the token is emitted, as the request's last.
        min_tokens: the output positions before it that never draw a stop token (their logits are -inf there),
            as vLLM's `min_tokens`: the generation runs at least that long unless `max_tokens` ends it first.
        logprobs: None (the default): no log-probabilities; k >= 0: each token comes with its log-probability
            and the k most probable tokens' (`TokenLogprobs`), as vLLM's `logprobs`.
    """

    temperature: float = attrs.field(default=0.0)
    top_p: float = attrs.field(default=1.0)
    seed: int | None = attrs.field(default=None, converter=plain_int)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    min_tokens: int = attrs.field(default=0)
    logprobs: int | None = attrs.field(default=None)

    @temperature.validator
    def _check_temperature(self, _attribute: object, value: float) -> None:
        require_number("temperature", value, minimum=0.0)

    @top_p.validator
    def _check_top_p(self, _attribute: object, value: float) -> None:
        if require_number("top_p", value, minimum=0.0, strict=True) > 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {value!r}")

    @seed.validator
    def _check_seed(self, _attribute: object, value: int | None) -> None:
        if value is not None:
            require_int("seed", value, minimum=0, below=MAX_SEED + 1)

    @stop_token_ids.validator
    def _check_stop_token_ids(self, _attribute: object, value: frozenset[int]) -> None:
        for token in value:
            require_int("stop_token_ids", token, minimum=0)

    @min_tokens.validator
    def _check_min_tokens(self, _attribute: object, value: int) -> None:
        require_int("min_tokens", value, minimum=0)

    @logprobs.validator
    def _check_logprobs(self, _attribute: object, value: int | None) -> None:
        if value is not None:
            require_int("logprobs", value, minimum=0)


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """`token`'s entry under float `logits` [vocab]: the log-softmax in float32 (vLLM's precision), its rank, and
    the `min(k, vocab)` most probable tokens (a stable sort: of equal log-probabilities, the lower id first).

    Raises:
        InvalidRequestError: `token` outside the vocabulary, or `k` not an integer >= 0.
    """
    require_int("token", token, minimum=0, below=logits.shape[-1], error=InvalidRequestError)
    require_int("k", k, minimum=0, error=InvalidRequestError)
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)  # on the logits' device: only k values move
    chosen = logprobs[int(token)]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.sort(logprobs, descending=True, stable=True)
        top = tuple(zip(ids[:k].tolist(), values[:k].tolist(), strict=True))
    return TokenLogprobs(logprob=float(chosen), rank=int((logprobs > chosen).sum()) + 1, top=top)


def stream_seed(seed: int, position: int) -> int:
    """The generator seed of output token `position` of a request seeded `seed`: XXH3-64 of both (little-endian
    64-bit words), so nearby seeds and positions give unrelated streams."""
    return xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little") + position.to_bytes(8, "little"))


def nucleus(probabilities: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of `probabilities` [vocab]: a bool mask, True for token i iff the mass of the tokens
    strictly more probable than i is below `top_p` (computed in float64)."""
    exact = probabilities.double()
    ordered = torch.sort(exact, descending=True).values
    # The mass ahead of each sorted position (0 for the first), summed exclusively: `cumsum - ordered` rounds, and
    # can put a token whose mass ahead is exactly top_p just below it.
    before = torch.cat((exact.new_zeros(1), torch.cumsum(ordered, dim=0)[:-1]))
    # The kept sorted positions are a prefix; ties after it share its last value, so `>=` keeps them too.
    threshold = ordered[before < top_p][-1]
    return exact >= threshold


class Sampler:
    """Draws one request's tokens, from output position `position` on (0: the first token).

    Raises:
        ConfigError: `position` is not an integer >= 0.
    """

    def __init__(self, params: SamplingParams, *, position: int = 0) -> None:
        self.params = params
        self.position = require_int("position", position, minimum=0)
        self._generator: torch.Generator | None = None
        self._seed = secrets.randbits(64) if params.seed is None else params.seed
        if params.temperature > 0:
            self._generator = torch.Generator()
        self._stop_ids = sorted(params.stop_token_ids)

    def next_token(self, logits: torch.Tensor) -> int:
        """The token chosen from float `logits` [vocab], at the next position (a stop token only from
        `min_tokens` on)."""
        if self.position < self.params.min_tokens and self._stop_ids:
            banned = [token for token in self._stop_ids if token < logits.shape[-1]]
            logits = logits.clone()
            logits[banned] = -math.inf
        return self._draw(logits)

    def logprobs_of(self, logits: torch.Tensor, token: int) -> TokenLogprobs | None:
        """`token`'s log-probabilities under the raw `logits` it was drawn from, as the params ask (None: not
        asked)."""
        k = self.params.logprobs
        return None if k is None else token_logprobs(logits, token, k)

    def _draw(self, logits: torch.Tensor) -> int:
        position = self.position
        self.position += 1
        if self._generator is None:
            return int(torch.argmax(logits))
        self._generator.manual_seed(stream_seed(self._seed, position))
        # Shifted so the largest logit is 0 before dividing: a tiny temperature then gives -inf for the rest
        # (probability 0), never inf - inf = nan.
        logits = logits.double().cpu()  # float64: a temperature as small as 1e-300 is not 0 there
        probabilities = torch.softmax((logits - logits.max()) / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probabilities = torch.where(nucleus(probabilities, self.params.top_p), probabilities, 0.0)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))
