"""Decode-load prediction: how busy a decode instance will be when a request reaches it.

`UniformDecodePredictor` is the paper's system-level prediction: at time t the
instance holds the requests decoding now that will not have decoded longer than
a uniform t_d by then, plus the requests heading to it (accepted, in prefill)
whose prefill ends before t and that have not been decoding for t_d by t
(a request that ends at its first token never joins: `join.takes_slot`).
Those make the predicted batch and the context its steps read; their whole
reservations (prompt + output each) make the predicted KV (`kv_tokens`).

`ExpectedOutputPredictor` is the same rule per request: each decodes for its
own expected output (the tokens the Conductor reserves KV for: a trace's output
length, a server's `max_tokens`, or a length predictor's guess) at a fixed pace,
the TBT objective by default; with every output equal it is the uniform rule.
It matters where prompt and output lengths are correlated: on the synthetic
trace they run against each other (long prompts, short answers), so a batch
holds mostly short prompts while a uniform t_d keeps every request as long, and
predicts about twice the context a step really reads.

`OutputLengthPredictor` is ours: it keeps the observed output lengths and, for
each request, the probability that it is still generating at t given how many
tokens it has produced (its survival under the empirical distribution), with
tokens produced at the decode step time; the load is the expectation.

`score_predictor` replays recorded (state, future load) pairs and reports each
predictor's mean absolute error, so predictors are compared on what happened.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from mooncake._checks import require_number
from mooncake.sched.join import DecodeLoad, takes_slot
from mooncake.sched.view import ActiveDecode, QueuedPrefill

__all__ = [
    "DEFAULT_DECODE_S",
    "ExpectedOutputPredictor",
    "LoadPredictor",
    "LoadSnapshot",
    "OutputLengthPredictor",
    "PredictorScore",
    "UniformDecodePredictor",
    "score_predictor",
    "uniform_decode_s",
]

DEFAULT_DECODE_S = 10.0
"""The uniform t_d (seconds) where nothing is known of the workload: the Conductor's and the simulator's default."""


def uniform_decode_s(output_lengths: Iterable[int], tbt_slo_s: float) -> float:
    """The uniform t_d for a workload: its mean output length times the TBT objective, how long an average
    request decodes when its batch runs at the objective, the slowest an accepted request is meant to go
    (`DEFAULT_DECODE_S` for no requests). The experiments, the replay tool and the twin all take it from here."""
    lengths = list(output_lengths)
    require_number("tbt_slo_s", tbt_slo_s, minimum=0, strict=True)
    return statistics.mean(lengths) * tbt_slo_s if lengths else DEFAULT_DECODE_S


class LoadPredictor(Protocol):
    """Predicts a decode instance's load at a future time, and may learn from finished requests."""

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        """Load at `at_s` of an instance decoding `active` now, with `incoming` prefills routed to it."""

    def observe(self, output_tokens: int) -> None:
        """A request finished with `output_tokens` generated (a predictor that does not learn ignores it)."""


@attrs.frozen(kw_only=True)
class UniformDecodePredictor:
    """Every request decodes for `decode_s` seconds (the paper's t_d)."""

    decode_s: float

    def __attrs_post_init__(self) -> None:
        require_number("decode_s", self.decode_s, minimum=0, strict=True)

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        batch = 0
        tokens = 0
        kv = 0
        for request in active:
            if at_s - request.start_s < self.decode_s:
                batch += 1
                tokens += request.context_tokens
                kv += request.context_tokens + request.output_tokens
        for queued in incoming:
            if not takes_slot(queued.output_tokens):
                continue  # it ends at its first token: it never joins the batch
            if queued.finish_s <= at_s and at_s - queued.finish_s < self.decode_s:
                batch += 1
                tokens += queued.input_tokens
                kv += queued.input_tokens + queued.output_tokens
        return DecodeLoad(batch, tokens, kv)

    def observe(self, output_tokens: int) -> None:
        """Nothing to learn: every request decodes for `decode_s`."""


@attrs.frozen(kw_only=True)
class ExpectedOutputPredictor:
    """Every request decodes for its expected output tokens × `step_s` (its own t_d), generating a token every
    `step_s`: the context a step reads at t is each present request's prompt plus what it has generated by
    then (as the decode rule's check at the instance sees it).

    Args:
        step_s: seconds per generated token: the TBT objective, the slowest an accepted request is meant to go
            (so a request is kept at least as long as it may stay), or a measured step time.
    """

    step_s: float

    def __attrs_post_init__(self) -> None:
        require_number("step_s", self.step_s, minimum=0, strict=True)

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        # The uniform rule's comparisons, written alike, with t_d per request: equal outputs give its batch and KV
        # exactly. A request present at t has decoded for less than its output's time, so it generated fewer tokens.
        step = self.step_s
        batch = 0
        tokens = 0.0
        kv = 0
        for request in active:
            decoded_s = at_s - request.start_s
            if decoded_s < request.output_tokens * step:
                batch += 1
                tokens += request.context_tokens + max(0.0, decoded_s) / step
                kv += request.context_tokens + request.output_tokens
        for queued in incoming:
            if not takes_slot(queued.output_tokens):
                continue  # it ends at its first token: it never joins the batch
            decoded_s = at_s - queued.finish_s
            if queued.finish_s <= at_s and decoded_s < queued.output_tokens * step:
                batch += 1
                tokens += queued.input_tokens + decoded_s / step
                kv += queued.input_tokens + queued.output_tokens
        return DecodeLoad(batch, tokens, kv)

    def observe(self, output_tokens: int) -> None:
        """Nothing to learn: each request's expected output is given with it."""


@attrs.define
class OutputLengthPredictor:
    """Survival of each request under the observed output-length distribution.

    Args:
        step_s: seconds per generated token (the decode step time).
        lengths: output lengths seen so far (more can be `observe`d).
    """

    step_s: float
    lengths: list[int] = attrs.field(factory=list, converter=sorted)

    def __attrs_post_init__(self) -> None:
        require_number("step_s", self.step_s, minimum=0, strict=True)

    def observe(self, output_tokens: int) -> None:
        """Record a finished request's output length."""
        bisect.insort(self.lengths, output_tokens)

    def survival(self, produced: float, horizon: float) -> float:
        """P(output > produced + horizon | output > produced) under the observed lengths."""
        if not self.lengths:
            return 1.0
        alive_now = len(self.lengths) - bisect.bisect_right(self.lengths, produced)
        if alive_now == 0:
            return 0.0
        alive_then = len(self.lengths) - bisect.bisect_right(self.lengths, produced + horizon)
        return alive_then / alive_now

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        batch = 0.0
        tokens = 0.0
        kv = 0.0
        for request in active:
            produced = max(0.0, (now - request.start_s) / self.step_s)
            horizon = max(0.0, (at_s - now) / self.step_s)
            alive = self.survival(produced, horizon)
            batch += alive
            tokens += alive * (request.context_tokens + produced + horizon)
            kv += alive * (request.context_tokens + request.output_tokens)
        for queued in incoming:
            if queued.finish_s > at_s or not takes_slot(queued.output_tokens):
                continue  # it joins after t, or never (it ends at its first token)
            decoded = (at_s - queued.finish_s) / self.step_s
            alive = self.survival(0.0, decoded)
            batch += alive
            tokens += alive * (queued.input_tokens + decoded)
            kv += alive * (queued.input_tokens + queued.output_tokens)
        return DecodeLoad(batch, tokens, kv)


@attrs.frozen(kw_only=True)
class LoadSnapshot:
    """A recorded moment: an instance's state at `now` and the load it really had at `at_s`."""

    active: tuple[ActiveDecode, ...]
    incoming: tuple[QueuedPrefill, ...]
    now: float
    at_s: float
    actual: DecodeLoad


@attrs.frozen(kw_only=True)
class PredictorScore:
    """Mean absolute errors of a predictor over a replay."""

    batch_size_mae: float
    context_tokens_mae: float
    samples: int
    kv_tokens_mae: float = 0.0


def score_predictor(predictor: LoadPredictor, snapshots: Sequence[LoadSnapshot]) -> PredictorScore:
    """How far `predictor` was from what happened, over recorded snapshots."""
    if not snapshots:
        return PredictorScore(batch_size_mae=0.0, context_tokens_mae=0.0, samples=0)
    batch_error = tokens_error = kv_error = 0.0
    for snapshot in snapshots:
        predicted = predictor.predict(snapshot.active, snapshot.incoming, snapshot.now, snapshot.at_s)
        batch_error += abs(predicted.batch_size - snapshot.actual.batch_size)
        tokens_error += abs(predicted.context_tokens - snapshot.actual.context_tokens)
        kv_error += abs(predicted.kv_tokens - snapshot.actual.kv_tokens)
    count = len(snapshots)
    return PredictorScore(
        batch_size_mae=batch_error / count,
        context_tokens_mae=tokens_error / count,
        samples=count,
        kv_tokens_mae=kv_error / count,
    )
