"""A sampled token's log-probabilities: a plain record (no torch), so the processes that only carry it (a
gateway, the wire between workers) need not load the engines. `sampling.token_logprobs` computes it.

`completed_text` is the text shown beside a log-probability for a token that is part of a character (a byte
token), as vLLM (0.32, `LogprobsProcessor._correct_decoded_token`) shows it: the token's lone text ends in U+FFFD;
decoded after the last 1, 2, 3, then 4 tokens sampled before it, the first decode that no longer ends in U+FFFD
gives the text (less that of the context's tokens before its run of byte tokens, which showed ""), and none gives
"" (the character is not whole yet). So "龘" in three byte tokens shows "", "", "龘".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

__all__ = ["CONTEXT_TOKENS", "TokenLogprobs", "completed_text"]

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character
CONTEXT_TOKENS = 4  # the sampled tokens before a token vLLM decodes it after: enough for any UTF-8 character


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


def completed_text(text: str, token_id: int, context: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str:
    """A token's text beside its log-probability: `text` (its lone text) unless that ends in U+FFFD, then the text
    it completes after `context` (the tokens sampled before it, oldest first; its last `CONTEXT_TOKENS` count),
    or "" where it completes none, as vLLM corrects it (the module's docstring).

    Args:
        text: the token's text decoded alone (with any leading space restored).
        token_id: the token (the sampled one or an alternative at the same place).
        context: the sampled tokens before it, never alternatives.
        decode: the tokenizer's decode of ids, special tokens kept.
    """
    if not text.endswith(REPLACEMENT):
        return text
    recent = list(context)[-CONTEXT_TOKENS:]
    for count in range(1, len(recent) + 1):
        before = recent[-count:]
        whole = decode([*before, token_id])
        if whole.endswith(REPLACEMENT):
            continue
        # The context's trailing byte tokens showed "" when they came: their bytes belong to this token's text.
        clean = len(before)
        while clean > 0 and decode([before[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(before[:clean]) if clean else ""
        if whole.startswith(prefix):
            return whole[len(prefix) :]
        common = 0  # a normalizing decoder changed the prefix: cut at what the two share
        for a, b in zip(prefix, whole, strict=False):
            if a != b:
                break
            common += 1
        return whole[common:]
    return ""
