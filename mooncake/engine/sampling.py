"""Choosing the next token: greedy, or temperature sampling (optionally min-p, top-k, nucleus) from a per-request
seeded stream, after vLLM's repetition, frequency and presence penalties.

Each request owns its random stream (seeded from its `seed`), so the tokens it
gets do not depend on which other requests share its batch. The stream is
counter-based: output token k is drawn from a generator seeded with
XXH3-64(seed, k) (its first float64 uniform u, and the token at u of the
cumulative distribution, `invert`), so a request's draws are independent of each other and the
same wherever each token is sampled. The prefill engine draws token 0 and a
decode engine, in another process, goes on at token 1 (`Sampler(params,
position=1)`) with no generator state to hand over; vLLM keeps one generator
per request for the same effect within one engine.

Temperature 0 is greedy; one in (0, 0.01) is raised to 0.01 with a warning,
as vLLM 0.32's `SamplingParams` raises it, so no draw is made at a tinier one.

Nucleus (top-p) sampling draws only from the most probable tokens whose mass
reaches `top_p`. Token i belongs to the nucleus iff the probability mass of
the tokens strictly more probable than i is below `top_p`: the most probable
token always belongs, tokens tied at the boundary all belong or none does, and
`top_p = 1` keeps every token of non-zero probability (the draws are then the
plain temperature sampler's, bit for bit: the filter is skipped).

The order is vLLM's: `allowed_token_ids` (every other token's logit -inf); the
`min_tokens` mask; `logit_bias`; the penalties, on the logits (a token of the prompt or of the output so far has a positive logit divided by
`repetition_penalty` and a negative one multiplied; each output token's logit
loses `frequency_penalty` times its count and `presence_penalty` once); then
greedy takes the argmax, and sampling divides by the temperature, drops the
tokens less probable than `min_p` times the most probable, keeps the `top_k`
largest logits (ties with the k-th kept), renormalizes and applies the nucleus.
Each filter at its neutral value (`min_p` 0, `top_k` 0 or -1, penalties 0 and 1) is
skipped, so the draws are then bit for bit those without it.

Invariant: every draw is a token in [0, vocab), or a named error. A bias is
clamped to [-100, 100] (vLLM's and OpenAI's range), so it cannot overflow a
logit; a repetition penalty may still (1e-40 divides a positive logit past
float32's range): +inf logits take all the probability, shared equally (the
limit of softmax as they grow; greedy takes the first). A NaN among the logits
the draw sees (a model fault), or nothing but -inf, has no token: an
`EngineError` naming the tokens (an `InvalidRequestError` where finite logits
were taken to -inf by the params). The check is one scalar per draw (the
largest logit, NaN where any is; greedy reads its argmax's logit), not a scan.

Log-probabilities (`SamplingParams.logprobs`, as vLLM's and OpenAI's) are of
the model's own distribution: the log-softmax of the raw logits in float32,
before temperature, nucleus or `min_tokens` shape the draw (vLLM's default
`raw_logprobs`), so they do not depend on how a token was chosen. With them a
token comes with its log-probability, its rank (the tokens at least as probable,
itself included, as vLLM counts it) and the `k` most probable tokens.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
import xxhash

from mooncake._checks import is_finite_number, plain_int, require_int, require_number, shown
from mooncake.engine.logprobs import TokenLogprobs
from mooncake.errors import ConfigError, EngineError, InvalidRequestError, MooncakeError

__all__ = ["Sampler", "SamplingParams", "invert", "nucleus", "rows_logprobs", "token_logprobs"]

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_LOGIT_BIAS = 100.0  # a bias's magnitude, clamped to it: OpenAI's logit_bias range, [-100, 100], as vLLM's
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a temperature in (0, MIN_TEMPERATURE) is raised to it
LOG = logging.getLogger(__name__)


def _raised_temperature(value: Any) -> Any:
    """An attrs converter: a temperature in (0, `MIN_TEMPERATURE`) becomes `MIN_TEMPERATURE`, with a warning naming
    it, as vLLM 0.32's `SamplingParams.__post_init__` raises it (anything else is left as given, for the validator).

    Raised, not sampled at as given: a request then draws here from the distribution it draws from on vLLM, which
    never samples below 0.01 (tinier ones risk inf and NaN in its float32 kernels); 0 stays greedy, in both."""
    if is_finite_number(value) and 0 < value < MIN_TEMPERATURE:
        LOG.warning(
            "temperature %r is below %r, which may cause numerical errors; raised to %r, as vLLM does",
            value,
            MIN_TEMPERATURE,
            MIN_TEMPERATURE,
        )
        return MIN_TEMPERATURE
    return value


def _clamped(bias: Any) -> Any:
    """A finite bias clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (anything else is left for the validator)."""
    if not is_finite_number(bias) or abs(bias) <= MAX_LOGIT_BIAS:
        return bias
    return math.copysign(MAX_LOGIT_BIAS, bias)


def _pairs(value: Any) -> Any:
    """An attrs converter: a dict or pairs of (token, bias) become pairs sorted by token, each finite bias clamped
    to [-100, 100]; None (vLLM's default: not set) becomes no pairs (anything else is left for the validator)."""
    if value is None:
        return ()
    try:
        pairs = sorted(dict(value).items())
    except (TypeError, ValueError):
        return value
    # Clamped, not refused: vLLM's `SamplingParams.from_optional` (which its OpenAI server builds every request
    # with) and the example server's HTTP layer both clamp, so a client's 1e39 means "always" there and here. A
    # bias past float32's range would otherwise make its logit +inf, and inf - inf a NaN, in the draw.
    return tuple((token, _clamped(bias)) for token, bias in pairs)


def _token_set(value: Any) -> Any:
    """An attrs converter: token ids become a frozenset; None (vLLM's default: not set) becomes the empty one
    (anything else, an int say, is left for the validator)."""
    if value is None:
        return frozenset()
    try:
        return frozenset(value)
    except TypeError:  # not iterable, or unhashable items
        return value


def _all_tokens(value: Any) -> Any:
    """An attrs converter: vLLM's top_k -1 ("all tokens") is 0 here (anything else is left for the validator)."""
    return 0 if type(value) is int and value == -1 else value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        temperature: 0 for greedy (the default), else logits are divided by it. One in (0, 0.01) is raised to
            0.01 (`MIN_TEMPERATURE`) with a warning on this module's logger, as vLLM 0.32 raises it: the draw is
            then sampled at 0.01, never at the tiny value, and only 0 is greedy.
        top_p: the nucleus' probability mass, in (0, 1]; 1 (the default) samples from every token.
        seed: the request's random stream (temperature > 0), in [0, 2**64); None (the default): a fresh random
            stream for each `Sampler`, as vLLM samples without a seed (a fixed default repeated one text).
        stop_token_ids: tokens that end the generation once sampled (the model's EOS and the like, as
            vLLM's `stop_token_ids`): the token is emitted, as the request's last. None: none (vLLM's default).
        min_tokens: the output positions before it that never draw a stop token (their logits are -inf there),
            as vLLM's `min_tokens`: the generation runs at least that long unless `max_tokens` ends it first. Where
            nothing but stop tokens could be drawn (every token of the vocabulary, or every one of
            `allowed_token_ids`, is a stop token), none is held back and a stop token is drawn; the decode engine
            (and the gateway's text stream) still end a request at a stop token only from `min_tokens` on
            (`mooncake.engine.tokenizer.can_stop_at`, vLLM's `check_stop`).
        logprobs: None (the default): no log-probabilities; k >= 0: each token comes with its log-probability
            and the k most probable tokens' (`TokenLogprobs`), as vLLM's `logprobs`.
        top_k: sample among the k largest logits only (ties with the k-th too); 0 (the default) or -1 (vLLM's
            spelling, kept as 0): all.
        min_p: sample only tokens at least this share of the most probable one's probability, in [0, 1].
        repetition_penalty: finite and > 0 (vLLM's bounds); a token already in the prompt or the output has its
            logit divided by it when positive, multiplied when not (1, the default: none; > 1 discourages
            repeats). Needs the prompt. A tiny one can overflow a logit to +inf: such tokens then share all the
            probability (the limit of their logits growing without bound), and greedy takes the first.
        presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of each token the output
            holds, once / per occurrence (OpenAI's definitions; 0, the default: none).
        logit_bias: (token, bias) pairs (or a dict) added to those tokens' logits before anything else shapes
            them but the `min_tokens` mask (OpenAI's `logit_bias`; vLLM's order); each finite bias is clamped to
            [-100, 100] as vLLM and OpenAI clamp it (a non-finite one is refused); a token outside the
            vocabulary is refused where the logits are known (`check_vocabulary`). None: none (vLLM's default).
        allowed_token_ids: the only tokens that may be drawn (vLLM's `allowed_token_ids`: every other logit is
            -inf before anything else shapes them); empty (the default) or None (vLLM's default): every token. A
            token outside the vocabulary is refused where the logits are known (`check_vocabulary`).
        prompt_logprobs: None (the default): none; k >= 0: the prefill scores every prompt token after the first
            (its log-probability given the tokens before it, and the k most probable there), as vLLM's
            `prompt_logprobs`; the whole prompt is then computed, no cached prefix reused.
    """

    temperature: float = attrs.field(default=0.0, converter=_raised_temperature)
    top_p: float = attrs.field(default=1.0)
    seed: int | None = attrs.field(default=None, converter=plain_int)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_token_set)
    min_tokens: int = attrs.field(default=0)
    logprobs: int | None = attrs.field(default=None)
    top_k: int = attrs.field(default=0, converter=_all_tokens)
    min_p: float = attrs.field(default=0.0)
    repetition_penalty: float = attrs.field(default=1.0)
    presence_penalty: float = attrs.field(default=0.0)
    frequency_penalty: float = attrs.field(default=0.0)
    prompt_logprobs: int | None = attrs.field(default=None)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_pairs)
    allowed_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_token_set)

    @property
    def needs_prompt(self) -> bool:
        """Whether drawing needs the prompt's token ids (a repetition penalty counts them)."""
        return self.repetition_penalty != 1.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty reshapes the logits (each at its neutral value otherwise)."""
        return self.needs_prompt or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @temperature.validator
    def _check_temperature(self, _attribute: object, value: float) -> None:
        require_number("temperature", value, minimum=0.0)

    @top_p.validator
    def _check_top_p(self, _attribute: object, value: float) -> None:
        if require_number("top_p", value, minimum=0.0, strict=True) > 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {shown(value)}")

    @seed.validator
    def _check_seed(self, _attribute: object, value: int | None) -> None:
        if value is not None:
            require_int("seed", value, minimum=0, below=MAX_SEED + 1)

    @stop_token_ids.validator
    @allowed_token_ids.validator
    def _check_token_ids(self, attribute: attrs.Attribute[frozenset[int]], value: frozenset[int]) -> None:
        if not isinstance(value, frozenset):
            raise ConfigError(f"{attribute.name} must be a collection of token ids, got {shown(value)}")
        for token in value:
            require_int(attribute.name, token, minimum=0)

    @min_tokens.validator
    def _check_min_tokens(self, _attribute: object, value: int) -> None:
        require_int("min_tokens", value, minimum=0)

    @logprobs.validator
    def _check_logprobs(self, _attribute: object, value: int | None) -> None:
        if value is not None:
            require_int("logprobs", value, minimum=0)

    @logit_bias.validator
    def _check_logit_bias(self, _attribute: object, value: tuple[tuple[int, float], ...]) -> None:
        if type(value) is not tuple:
            raise ConfigError(f"logit_bias must map token ids to biases, got {shown(value)}")
        for token, bias in value:
            require_int("logit_bias token", token, minimum=0)
            require_number("logit_bias", bias, minimum=-math.inf)

    def check_vocabulary(self, vocab: int) -> None:
        """That every token id the params name lies in a `vocab`-token vocabulary (an engine checks a request
        before it runs it: a bad id would fail only once its logits exist).

        Raises:
            InvalidRequestError: naming the field and the id.
        """
        named = (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
        )
        for name, ids in named:
            _within(name, ids, vocab)

    @prompt_logprobs.validator
    def _check_prompt_logprobs(self, _attribute: object, value: int | None) -> None:
        if value is not None:
            require_int("prompt_logprobs", value, minimum=0)

    @top_k.validator
    def _check_top_k(self, _attribute: object, value: int) -> None:
        if type(value) is int and value < 0:  # -1 became 0 above
            raise ConfigError(f"top_k must be an integer >= 0, or -1 (all tokens), got {shown(value)}")
        require_int("top_k", value, minimum=0)

    @min_p.validator
    def _check_min_p(self, _attribute: object, value: float) -> None:
        if require_number("min_p", value, minimum=0.0) > 1.0:
            raise ConfigError(f"min_p must lie in [0, 1], got {shown(value)}")

    @repetition_penalty.validator
    def _check_repetition_penalty(self, _attribute: object, value: float) -> None:
        require_number("repetition_penalty", value, minimum=0.0, strict=True)

    @presence_penalty.validator
    @frequency_penalty.validator
    def _check_penalty(self, attribute: attrs.Attribute[float], value: float) -> None:
        if abs(require_number(attribute.name, value, minimum=-math.inf)) > 2.0:
            raise ConfigError(f"{attribute.name} must lie in [-2, 2], got {shown(value)}")


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """`token`'s entry under float `logits` [vocab]: the log-softmax in float32 (vLLM's precision), its rank, and
    the `min(k, vocab)` most probable tokens, most probable first (of equal log-probabilities, the lower id first).

    Raises:
        InvalidRequestError: `token` outside the vocabulary, or `k` not an integer >= 0.
    """
    require_int("token", token, minimum=0, below=logits.shape[-1], error=InvalidRequestError)
    return rows_logprobs(logits.unsqueeze(0), [int(token)], k)[0]


def rows_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """`token_logprobs` of each row of `logits` [rows, vocab] and its token, in one pass over the rows (a
    prompt's positions, each scored by the token after it).

    Raises:
        InvalidRequestError: a token outside the vocabulary, one token per row not given, or `k` not an integer
            >= 0.
    """
    require_int("k", k, minimum=0, error=InvalidRequestError)
    vocab = logits.shape[-1]
    if len(tokens) != logits.shape[0] or not all(0 <= t < vocab for t in tokens):
        raise InvalidRequestError(f"one token in [0, {vocab}) per row of logits is needed, got {len(tokens)}")
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)  # on the logits' device: only k values move
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    # vLLM's count (`batched_count_greater_than`): the tokens at least as probable, itself included.
    ranks = (logprobs >= chosen).sum(dim=1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if k:
        # The k-th largest per row (O(vocab), not a sort of the vocabulary), then the tokens at or above it in
        # order, equal ones by id: exact where ties straddle the k-th place too.
        kth = torch.topk(logprobs, min(k, vocab), dim=1).values[:, -1:]
        tops = []
        for row, bound in zip(logprobs, kth, strict=True):
            ids = torch.nonzero(row >= bound).squeeze(1)
            pairs = sorted(zip(ids.tolist(), row[ids].tolist(), strict=True), key=lambda pair: (-pair[1], pair[0]))
            tops.append(tuple(pairs[:k]))
    return [
        TokenLogprobs(logprob=logprob, rank=rank, top=top)
        for logprob, rank, top in zip(chosen[:, 0].tolist(), ranks, tops, strict=True)
    ]


def stream_seed(seed: int, position: int) -> int:
    """The generator seed of output token `position` of a request seeded `seed`: XXH3-64 of both (little-endian
    64-bit words), so nearby seeds and positions give unrelated streams."""
    return xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little") + position.to_bytes(8, "little"))


def nucleus(probabilities: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of `probabilities` [vocab]: a bool mask, True for token i iff the mass of the tokens
    strictly more probable than i is below `top_p` (computed in float64).

    Only the most probable tokens are sorted. One pass sums the mass of each octave [2^-j, 2^(1-j)) of
    probability (a token's octave is its binary exponent); the candidates are the tokens at or above the
    first octave whose cumulative mass reaches `top_p`. They hold the whole nucleus: the tokens at least as
    probable as any value whose mass reaches `top_p` are a prefix of the sorted vocabulary that contains
    it. So a nucleus costs O(vocab) and a sort of its candidates (about 1 ms at 128 k tokens on one core),
    not a sort of the vocabulary (12 ms). The prefix sums are those of the whole sorted vocabulary, so the
    mask is too; should rounding leave the candidates' sum under `top_p`, the next octave joins them.
    """
    exact = probabilities.double()
    vocab = exact.shape[-1]
    octave = 1 - torch.frexp(exact).exponent  # p in [2^-octave, 2^(1 - octave)): 0 for p = 1, up to 1,074
    reached = torch.cumsum(torch.bincount(octave, weights=exact), dim=0)
    first = int(torch.searchsorted(reached, reached.new_tensor(top_p)))
    while True:
        candidates = exact[exact >= 2.0**-first] if first < len(reached) else exact  # 2.0**-1075 would be 0
        ordered = torch.sort(candidates, descending=True).values
        # The mass ahead of each sorted position (0 for the first), summed exclusively: `cumsum - ordered` rounds,
        # and can put a token whose mass ahead is exactly top_p just below it.
        summed = torch.cumsum(ordered, dim=0)
        if len(ordered) == vocab or summed[-1] >= top_p:  # every position past these has at least top_p ahead: out
            break
        first += 1
    before = torch.cat((exact.new_zeros(1), summed[:-1]))
    # The kept sorted positions are a prefix; ties after it share its last value, so `>=` keeps them too.
    threshold = ordered[before < top_p][-1]
    return exact >= threshold


def _no_token(raw: torch.Tensor, shaped: torch.Tensor, params: SamplingParams) -> MooncakeError:
    """The error of a draw that found no token in the `shaped` logits (made from the model's `raw` ones): the
    model's fault where its logits hold a NaN, a +inf (which a -inf mask turns into NaN) or nothing but -inf (the
    tokens named), else the params'. Only on the error path: the scans here cost O(vocab)."""
    vocab = raw.shape[-1]

    def named(mask: torch.Tensor) -> str:
        ids = torch.nonzero(mask).squeeze(1).tolist()
        return f"{ids[:8]}{' and more' if len(ids) > 8 else ''}"

    nan, positive = torch.isnan(raw), raw == math.inf
    faults = [f"NaN at tokens {named(nan)}"] if bool(nan.any()) else []
    faults += [f"+inf at tokens {named(positive)}"] if bool(positive.any()) else []
    if not faults and not bool((raw > -math.inf).any()):
        faults = ["every one -inf"]
    if faults:
        return EngineError(f"the model's {vocab} logits are not finite ({'; '.join(faults)}): no token can be drawn")
    if bool(torch.isnan(shaped).any()):  # not made from finite logits by any params: named should it ever be
        return EngineError(
            f"shaping the logits by {shown(params, limit=400)} made NaN at tokens {named(torch.isnan(shaped))}"
        )
    return InvalidRequestError(
        f"the sampling params leave every one of the {vocab} logits -inf: {shown(params, limit=400)}"
    )


def _within(name: str, ids: Iterable[int], vocab: int) -> None:
    """That every one of `ids` (the params' field `name`) is below `vocab` (`SamplingParams.check_vocabulary`'s
    rule, and the `Sampler`'s where it makes a [vocab] mask of them: a larger id would be a bare IndexError).

    Raises:
        InvalidRequestError: naming the field and the largest id.
    """
    largest = max(ids, default=-1)
    if largest >= vocab:
        raise InvalidRequestError(f"{name}: token {largest} is outside the {vocab}-token vocabulary")


def invert(probabilities: torch.Tensor, uniform: float) -> int:
    """The token at `uniform` (in [0, 1)) of the cumulative distribution of `probabilities` [vocab] (float64,
    >= 0, not all 0): the first whose cumulative mass exceeds `uniform` times the total. A token of zero
    probability is never the one. One prefix sum and a binary search: 0.1 ms at 128 k tokens on one core,
    where `torch.multinomial` takes 4 ms.

    Returns:
        a token in [0, vocab).

    Raises:
        InvalidRequestError: the total is not finite and > 0 (a NaN or an inf among the probabilities, or all
            0): no token is the one, where the search would give `vocab` (outside the vocabulary).
    """
    cumulative = torch.cumsum(probabilities, dim=0)
    total = cumulative[-1]
    # One check of a scalar: a NaN anywhere makes the total NaN, an inf makes it inf.
    if not 0.0 < float(total) < math.inf:
        raise InvalidRequestError(f"probabilities must sum to a finite number > 0 to draw from, got {float(total)}")
    token = int(torch.searchsorted(cumulative, total * uniform, right=True))
    if token == len(cumulative):  # uniform * total rounded up to the total: the last token of non-zero mass
        token = int(torch.searchsorted(cumulative, total))
    return token


class Sampler:
    """Draws one request's tokens, from output position `position` on (0: the first token).

    Args:
        params: how to draw.
        position: the output position of the next draw.
        prompt: the prompt's token ids (a repetition penalty counts them; unused otherwise).
        output: the tokens the request generated before `position` (drawn by another sampler: the prefill
            engine's first token, say), which the penalties count; the sampler adds each token it draws.

    Raises:
        ConfigError: `position` is not an integer >= 0, or `output` does not hold `position` tokens while a
            penalty would count them, or no `prompt` for a repetition penalty.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        position: int = 0,
        prompt: Sequence[int] | None = None,
        output: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.position = require_int("position", position, minimum=0)
        self._generator: torch.Generator | None = None
        self._seed = secrets.randbits(64) if params.seed is None else params.seed
        if params.temperature > 0:
            self._generator = torch.Generator()
        self._stop_ids = sorted(params.stop_token_ids)
        if params.needs_prompt and prompt is None:
            raise ConfigError("a repetition penalty needs the prompt's token ids (prompt=)")
        if params.penalized and len(output) != self.position:
            raise ConfigError(f"the penalties count the output so far: {self.position} tokens, got {len(output)}")
        self._prompt = list(prompt or ()) if params.needs_prompt else []
        self._output = list(output) if params.penalized else []
        # The penalties' state over the vocabulary, made at the first draw (the vocabulary and device are the
        # logits'): tokens of the prompt or the output so far, and each token's count in the output.
        self._seen: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._allowed: torch.Tensor | None = None  # 0 for an allowed token, -inf for the others [vocab]

    def next_token(self, logits: torch.Tensor) -> int:
        """The token chosen from float `logits` [vocab], at the next position (a stop token only from
        `min_tokens` on, unless nothing else could be drawn: see `SamplingParams.min_tokens`).

        Returns:
            a token in [0, vocab).

        Raises:
            EngineError: the logits hold a NaN (or +inf and -inf that the params' masks meet): a model fault;
                the message names the tokens.
            InvalidRequestError: finite logits that the params leave no token to draw from (every one -inf: a
                huge repetition penalty over a vocabulary the prompt holds whole); a token of `allowed_token_ids`
                or `logit_bias` outside the logits' vocabulary (checked at the first draw, where their masks are
                made; the engines refuse it before, `SamplingParams.check_vocabulary`).
            Either way the sampler is as before the call: its position and the penalties' counts do not move.
        """
        raw = logits
        allowed = self.params.allowed_token_ids
        if allowed:
            if self._allowed is None:  # [vocab] once, on the logits' device
                _within("allowed_token_ids", allowed, logits.shape[-1])
                self._allowed = torch.full((logits.shape[-1],), -math.inf, dtype=logits.dtype, device=logits.device)
                self._allowed[sorted(allowed)] = 0.0
            logits = logits + self._allowed
        if self.position < self.params.min_tokens and self._stop_ids:
            banned = [token for token in self._stop_ids if token < logits.shape[-1]]
            # Only while something else may be drawn: a vocabulary (or an allowed set) of stop ids cannot wait.
            if (len(allowed - set(banned)) if allowed else logits.shape[-1] - len(banned)) > 0:
                logits = logits.clone()
                logits[banned] = -math.inf
        if self.params.logit_bias:
            if self._bias is None:  # [vocab] once, on the logits' device
                ids, biases = zip(*self.params.logit_bias, strict=True)
                _within("logit_bias", ids, logits.shape[-1])
                self._bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
                self._bias[list(ids)] = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            logits = logits + self._bias
        if self.params.penalized:
            logits = self._penalize(logits)
        token = self._draw(logits)
        if token is None:
            raise _no_token(raw, logits, self.params)
        # Only a drawn token takes its position: a failed draw leaves the sampler as it was, so the next draw at
        # this position (retried, say) is the one a sampler that never failed makes.
        self.position += 1
        if self._seen is not None and self._counts is not None:
            self._seen[token] = True
            self._counts[token] += 1
        return token

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with vLLM's penalties applied: a new tensor, in the logits' dtype, on their device, in O(vocab)
        per token (the seen tokens and the counts are kept as vocabulary-wide tensors, as vLLM's masks)."""
        params, vocab = self.params, logits.shape[-1]
        if self._seen is None or self._counts is None:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=logits.device)  # exact counts to 2**24
            self._seen[torch.tensor([t for t in self._prompt if 0 <= t < vocab], dtype=torch.long)] = True
            output = torch.tensor([t for t in self._output if 0 <= t < vocab], dtype=torch.long)
            ones = torch.ones(len(output), dtype=torch.float32, device=logits.device)
            self._counts.index_add_(0, output.to(logits.device), ones)
            self._seen |= self._counts > 0
        if params.repetition_penalty != 1.0:
            # Capped at the dtype's largest: torch casts the factor to the logits' dtype, where a penalty past it
            # (1e300 in float32) is inf, and a logit of 0 times inf is NaN; a penalty within the range is as given.
            rp = min(params.repetition_penalty, torch.finfo(logits.dtype).max)
            logits = torch.where(self._seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if params.frequency_penalty or params.presence_penalty:
            logits = logits - (params.frequency_penalty * self._counts + params.presence_penalty * (self._counts > 0))
        return logits

    def logprobs_of(self, logits: torch.Tensor, token: int) -> TokenLogprobs | None:
        """`token`'s log-probabilities under the raw `logits` it was drawn from, as the params ask (None: not
        asked)."""
        k = self.params.logprobs
        return None if k is None else token_logprobs(logits, token, k)

    def _draw(self, logits: torch.Tensor) -> int | None:
        """The token drawn from the shaped `logits`, or None where they hold no largest value to draw by (a NaN,
        or every one -inf). Greedy's argmax is its token; sampling's the token at the position's uniform (the
        position is `next_token`'s to advance, once a token is drawn)."""
        position = self.position
        if self._generator is None:
            token = int(torch.argmax(logits))  # a NaN is the argmax where there is one; all -inf: token 0
            # One scalar read, not a scan: NaN fails every comparison, and the argmax is -inf only if all are.
            return token if float(logits[token]) > -math.inf else None
        self._generator.manual_seed(stream_seed(self._seed, position))
        # float64 on the CPU, though no temperature is below 0.01 (MIN_TEMPERATURE) any more, which float32 would
        # hold: the inverse-CDF draw sums the whole vocabulary, and a float32 prefix sum over 128 k tokens drifts by
        # ~4e-6 (the mass of many whole tokens, so their draws would be biased), and on the CPU a request's draws
        # are the same bit for bit wherever its logits were computed (its first token in prefill, the rest in decode).
        logits = logits.double().cpu()
        top = float(logits.max())  # NaN where any logit is (torch's max propagates it)
        if not top > -math.inf:
            return None
        if top == math.inf:
            # +inf logits (a positive logit divided by a tiny repetition penalty overflows float32): the limit of
            # softmax as they grow without bound puts all the mass on them, equally; `logits - top` would be NaN.
            scaled = torch.where(logits == math.inf, 0.0, -math.inf).to(torch.float64)
        else:
            # Shifted so the largest logit is 0 before dividing: whatever the logits' range, the rest divide to at
            # worst -inf (probability 0), never inf - inf = nan.
            scaled = (logits - top) / self.params.temperature
        probabilities = torch.softmax(scaled, dim=-1)
        if self.params.min_p > 0.0 or 0 < self.params.top_k < scaled.shape[-1]:
            if self.params.min_p > 0.0:
                scaled = scaled.masked_fill(probabilities < self.params.min_p * probabilities.max(), -math.inf)
            if 0 < self.params.top_k < scaled.shape[-1]:
                kth = torch.topk(scaled, self.params.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, -math.inf)
            probabilities = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1.0:
            probabilities = torch.where(nucleus(probabilities, self.params.top_p), probabilities, 0.0)
        return invert(probabilities, float(torch.rand((), dtype=torch.float64, generator=self._generator)))
