"""Tests for `mooncake.sched.predictor`.

Example tests check the paper's uniform rule and the survival model on
hand-made cases and `score_predictor` on a hand example; properties check that
survival is a probability, monotone in the horizon; a replay of a small decode
simulation, with output lengths that vary a lot, shows the output-length
predictor beating the uniform one.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.join import DecodeLoad
from mooncake.sched.predictor import (
    DEFAULT_DECODE_S,
    ExpectedOutputPredictor,
    LoadSnapshot,
    OutputLengthPredictor,
    PredictorScore,
    UniformDecodePredictor,
    score_predictor,
    uniform_decode_s,
)
from mooncake.sched.view import ActiveDecode, QueuedPrefill, Reservation
from mooncake.types import RequestId

STEP_S = 0.02  # seconds per generated token in the replay


def active(name: str, start_s: float, context: int) -> ActiveDecode:
    return ActiveDecode(request_id=RequestId(name), start_s=start_s, context_tokens=context, output_tokens=1000)


def incoming(name: str, finish_s: float, tokens: int, output: int = 1000) -> QueuedPrefill:
    return QueuedPrefill(
        request_id=RequestId(name), start_s=finish_s - 1.0, finish_s=finish_s, input_tokens=tokens, output_tokens=output
    )


# ---------------------------------------------------------------------------- uniform (the paper's rule)


def test_uniform_keeps_requests_younger_than_decode_time() -> None:
    """At t, a decoding request counts iff it will have decoded for less than t_d by t (its whole
    reservation, prompt + output, toward the KV)."""
    predictor = UniformDecodePredictor(decode_s=10.0)
    batch = [active("young", 0.0, 100), active("old", -20.0, 200), active("exactly-td", -5.0, 400)]
    assert predictor.predict(batch, [], now=1.0, at_s=5.0) == DecodeLoad(1, 100, 1100)


def test_uniform_adds_prefills_that_finish_before_t() -> None:
    """An incoming prefill counts (batch, context, its reservation toward the KV) iff it finishes by t
    and has not decoded for t_d by then."""
    predictor = UniformDecodePredictor(decode_s=10.0)
    queue = [incoming("done-by-t", 3.0, 50), incoming("at-t", 5.0, 60), incoming("after-t", 6.0, 70)]
    queue.append(incoming("long-done", -8.0, 80))  # finished 13 s before t: decoded t_d already
    assert predictor.predict([], queue, now=0.0, at_s=5.0) == DecodeLoad(2, 110, 2110)


@pytest.mark.parametrize(
    "predictor", [UniformDecodePredictor(decode_s=10.0), OutputLengthPredictor(step_s=1.0, lengths=[10, 20])]
)
def test_a_request_ending_at_its_first_token_is_never_predicted_to_decode(
    predictor: UniformDecodePredictor | OutputLengthPredictor,
) -> None:
    """Output 1 (the prefill's token only): the decode rule gives it no slot and no KV (`takes_slot`), so no
    prediction counts it, as the committed load (`Reservation`) does not."""
    queue = [incoming("one-token", 3.0, 500, output=1), incoming("two-tokens", 3.0, 70, output=2)]
    with_it = predictor.predict([], queue, now=0.0, at_s=5.0)
    assert with_it == predictor.predict([], queue[1:], now=0.0, at_s=5.0)
    assert Reservation(500, 1).tokens == 0 and not Reservation(500, 1).takes_slot


def test_uniform_now_is_the_current_batch_when_young() -> None:
    """Predicting for now counts every request that started within t_d."""
    predictor = UniformDecodePredictor(decode_s=4.0)
    batch = [active(str(i), 10.0 - i, 10 * i) for i in range(8)]  # ages 0..7 s
    assert predictor.predict(batch, [], now=10.0, at_s=10.0) == DecodeLoad(4, 0 + 10 + 20 + 30, 4060)


@pytest.mark.parametrize("bad", ["x", -1, 1.5, None])
def test_an_output_length_that_is_no_count_is_refused_and_learned_from_nothing(bad: object) -> None:
    """`observe` takes a count of tokens: anything else is an InvalidRequestError, and the predictor goes on as if
    it had not come (one bad length used to break every later prediction)."""
    predictor = OutputLengthPredictor(step_s=1.0, lengths=[10, 20])
    with pytest.raises(InvalidRequestError, match="output_tokens"):
        predictor.observe(bad)  # type: ignore[arg-type]
    predictor.observe(30)
    assert predictor.lengths == [10, 20, 30] and predictor.survival(15.0, 1.0) == 1.0


def test_uniform_requires_positive_decode_time() -> None:
    """t_d must be positive."""
    with pytest.raises(ConfigError):
        UniformDecodePredictor(decode_s=0.0)


@given(
    st.lists(st.integers(1, 100_000), min_size=1, max_size=50),
    st.floats(0.001, 10.0),
    st.integers(1, 100_000),
)
def test_workload_decode_time_is_mean_output_at_the_objective(lengths: list[int], tbt_s: float, extra: int) -> None:
    """t_d = mean output x TBT objective: positive (a valid predictor), within the shortest and longest
    request's time at the objective, and longer when a longer request joins the workload."""
    t_d = uniform_decode_s(lengths, tbt_s)
    assert t_d == pytest.approx(statistics.mean(lengths) * tbt_s)
    assert min(lengths) * tbt_s * (1 - 1e-9) <= t_d <= max(lengths) * tbt_s * (1 + 1e-9)
    UniformDecodePredictor(decode_s=t_d)
    if extra > max(lengths):
        assert uniform_decode_s([*lengths, extra], tbt_s) > t_d


@pytest.mark.parametrize("bad", [-50, 0, True, 2.5, "3", None])
def test_workload_output_lengths_must_be_counts_of_at_least_one(bad: object) -> None:
    """An output length is a request's `output_length`, an integer >= 1: anything else (a negative one made t_d
    negative, a bool passed as 1) is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=f"output length must be an integer >= 1, got {bad!r}"):
        uniform_decode_s([100, bad], 0.1)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="output_lengths"):
        uniform_decode_s(None, 0.1)  # type: ignore[arg-type]


def test_workload_decode_time_without_requests_or_with_a_bad_objective() -> None:
    """No requests: the default t_d. A TBT objective that is not a positive number: a ConfigError naming it."""
    assert uniform_decode_s([], 0.1) == DEFAULT_DECODE_S
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="tbt_slo_s"):
            uniform_decode_s([100], bad)


# ---------------------------------------------------------------------------- expected output (t_d per request)


def test_expected_output_keeps_a_request_for_its_decode_steps_only() -> None:
    """Output includes the prefill's first token: a request of output 2 decodes one step, of output 11 ten. Each is
    predicted there until that many steps have passed, not one step more."""
    predictor = ExpectedOutputPredictor(step_s=0.1)
    one_step = ActiveDecode(request_id=RequestId("a"), start_s=0.0, context_tokens=1000, output_tokens=2)
    assert predictor.predict((one_step,), (), 0.0, 0.05).batch_size == 1  # its one step ends at 0.1
    assert predictor.predict((one_step,), (), 0.0, 0.15) == DecodeLoad(0, 0.0, 0)
    queued = incoming("b", 1.0, 1000, output=11)  # its first token at 1.0, ten steps: it ends at 2.0
    assert predictor.predict((), (queued,), 0.0, 1.95).batch_size == 1
    assert predictor.predict((), (queued,), 0.0, 2.05) == DecodeLoad(0, 0.0, 0)


def test_expected_output_keeps_each_request_for_its_own_output() -> None:
    """At t, a request counts iff it will have decoded for less than its own output x step_s by then."""
    predictor = ExpectedOutputPredictor(step_s=0.1)
    batch = [
        attrs.evolve(active("long", 0.0, 100), output_tokens=200),  # 20 s: still there at t = 5
        attrs.evolve(active("short", 0.0, 300), output_tokens=20),  # 2 s: gone
    ]
    queue = [incoming("joins", 4.0, 50, output=30), incoming("joins-and-ends", 1.0, 70, output=30)]  # 3 s each
    # "long" has generated 50 tokens by t, "joins" 10 (one every 0.1 s).
    assert predictor.predict(batch, queue, now=1.0, at_s=5.0) == DecodeLoad(2, 150 + 60, 380)


times = st.floats(-100.0, 100.0, allow_nan=False)
contexts = st.integers(1, 100_000)


@given(
    st.lists(st.tuples(times, contexts), max_size=20),
    st.lists(st.tuples(times, contexts), max_size=20),
    st.integers(2, 5000),
    st.floats(0.001, 1.0),
    times,
    st.floats(0.0, 100.0),
)
def test_expected_output_with_equal_outputs_is_the_uniform_rule(
    decoding: list[tuple[float, int]],
    queued: list[tuple[float, int]],
    output: int,
    step_s: float,
    now: float,
    ahead_s: float,
) -> None:
    """The reference model: with every expected output equal to n, each request's t_d is (n - 1) x step_s (its
    decode: the prefill made its first token), and the batch and KV predicted are the paper's uniform rule's with
    that t_d, exactly; the context is its (prompts only) plus fewer than n - 1 generated tokens per member."""
    batch = [
        ActiveDecode(request_id=RequestId(f"a{i}"), start_s=start, context_tokens=context, output_tokens=output)
        for i, (start, context) in enumerate(decoding)
    ]
    queue = [incoming(f"q{i}", finish, tokens, output=output) for i, (finish, tokens) in enumerate(queued)]
    own = ExpectedOutputPredictor(step_s=step_s).predict(batch, queue, now, now + ahead_s)
    uniform = UniformDecodePredictor(decode_s=(output - 1) * step_s).predict(batch, queue, now, now + ahead_s)
    assert (own.batch_size, own.kv_tokens) == (uniform.batch_size, uniform.kv_tokens)
    most = own.batch_size * (output - 1) * (1 + 1e-9)
    assert uniform.context_tokens <= own.context_tokens <= uniform.context_tokens + most


def test_expected_output_requires_positive_step() -> None:
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="step_s"):
            ExpectedOutputPredictor(step_s=bad)


# ---------------------------------------------------------------------------- output-length survival


def test_survival_hand_cases() -> None:
    """P(L > produced + horizon | L > produced) under the observed lengths."""
    predictor = OutputLengthPredictor(step_s=1.0, lengths=[40, 10, 30, 20])
    assert predictor.lengths == [10, 20, 30, 40]
    assert predictor.survival(0, 15) == 3 / 4
    assert predictor.survival(15, 10) == 2 / 3
    assert predictor.survival(10, 0) == 1.0
    assert predictor.survival(40, 1) == 0.0  # no observed request was ever this long, and it has no cap
    assert OutputLengthPredictor(step_s=1.0).survival(5, 100) == 1.0  # nothing observed: assume alive
    # A running request is there now, however long it ran; past every observed length, its cap is all that is known.
    assert predictor.survival(50, 0) == 1.0
    assert predictor.survival(50, 10, cap=100) == 1.0 and predictor.survival(50, 50, cap=100) == 0.0
    assert predictor.survival(0, 15, cap=15) == 0.0  # it cannot outlive its max_tokens


def test_a_request_running_past_every_observed_length_is_still_in_the_batch() -> None:
    """The Conductor knows it decodes: predicted now, and on to its cap, it counts (it was predicted gone, so
    predictive admission put a second request onto a one-slot instance already full)."""
    predictor = OutputLengthPredictor(step_s=0.1, lengths=[10, 20])
    running = ActiveDecode(request_id=RequestId("r"), context_tokens=100, output_tokens=200, start_s=0.0)
    assert predictor.predict((running,), (), 5.0, 5.0).batch_size == 1.0  # 50 tokens out: past 10 and 20
    assert predictor.predict((running,), (), 5.0, 10.0).batch_size == 1.0  # 100 tokens: below its 200
    assert predictor.predict((running,), (), 5.0, 30.0).batch_size == 0.0  # 300: past its cap


def test_observe_keeps_lengths_sorted() -> None:
    """Observed lengths are inserted in order and change the survival."""
    predictor = OutputLengthPredictor(step_s=1.0, lengths=[10, 30])
    predictor.observe(20)
    assert predictor.lengths == [10, 20, 30]
    assert predictor.survival(0, 15) == 2 / 3


def test_output_length_predict_hand_case() -> None:
    """Expected batch and KV: survival weights for active requests and for prefills finishing before t."""
    predictor = OutputLengthPredictor(step_s=1.0, lengths=[10, 20])
    load = predictor.predict([active("a", 0.0, 100)], [incoming("b", 10.0, 50), incoming("c", 16.0, 70)], 5.0, 15.0)
    # a: produced 5, horizon 10 → P(L > 15 | L > 5) = 1/2, holding 100 + 15 tokens then.
    # b: decoded 5 by t → P(L > 5) = 1, holding 50 + 5; c finishes after t.
    assert load.batch_size == pytest.approx(0.5 + 1.0)
    assert load.context_tokens == pytest.approx(0.5 * 115 + 55)
    assert load.kv_tokens == pytest.approx(0.5 * 1100 + 1050)
    # A prefill finishing at t has joined by t, as with the uniform rule: it counts, with nothing decoded yet.
    at_t = predictor.predict([], [incoming("d", 15.0, 40)], 5.0, 15.0)
    assert (at_t.batch_size, at_t.context_tokens, at_t.kv_tokens) == (1.0, 40.0, 1040.0)


def test_output_length_counts_the_prefills_token_as_produced() -> None:
    """Observed lengths and caps count the prefill's first token: where every request seen had output 2 (one decode
    step), a request that has decoded one step is predicted done, as is one whose cap of 2 it has reached; one
    that has decoded half a step is not."""
    predictor = OutputLengthPredictor(step_s=1.0, lengths=[2, 2, 2])
    joined = incoming("b", 10.0, 50, output=1000)
    assert predictor.predict([], [joined], 10.0, 10.5).batch_size == 1.0
    assert predictor.predict([], [joined], 10.0, 11.0).batch_size == 0.0
    running = attrs.evolve(active("a", 0.0, 100), output_tokens=1000)
    assert predictor.predict([running], [], 0.5, 0.5).batch_size == 1.0  # there now, half a step decoded
    assert predictor.predict([running], [], 0.5, 1.0).batch_size == 0.0
    capped = OutputLengthPredictor(step_s=1.0)  # nothing observed: only the cap ends it
    assert capped.predict([], [incoming("c", 10.0, 50, output=2)], 10.0, 10.5).batch_size == 1.0
    assert capped.predict([], [incoming("c", 10.0, 50, output=2)], 10.0, 11.0).batch_size == 0.0


def test_output_length_requires_positive_step() -> None:
    """The decode step time must be positive."""
    with pytest.raises(ConfigError):
        OutputLengthPredictor(step_s=0.0)


@given(
    st.lists(st.integers(min_value=1, max_value=5000), max_size=50),
    st.floats(min_value=0, max_value=6000),
    st.floats(min_value=0, max_value=6000),
    st.floats(min_value=0, max_value=6000),
)
def test_survival_is_a_probability_monotone_in_horizon(
    lengths: list[int], produced: float, horizon: float, more: float
) -> None:
    """Survival lies in [0, 1], is 1 at horizon 0 for a possible state, and never rises with the horizon."""
    predictor = OutputLengthPredictor(step_s=0.05, lengths=lengths)
    near, far = predictor.survival(produced, horizon), predictor.survival(produced, horizon + more)
    assert 0.0 <= far <= near <= 1.0
    if not lengths or max(lengths) > produced:
        assert predictor.survival(produced, 0.0) == 1.0


# ---------------------------------------------------------------------------- scoring


@attrs.frozen
class FixedPredictor:
    load: DecodeLoad

    def predict(
        self, active: Sequence[ActiveDecode], incoming: Sequence[QueuedPrefill], now: float, at_s: float
    ) -> DecodeLoad:
        return self.load

    def observe(self, output_tokens: int) -> None:
        pass


def test_score_predictor_hand_example() -> None:
    """Mean absolute errors over snapshots: |2 − 1| and |2 − 4| in batch, |100 − 50| and |100 − 300| in KV."""
    snapshots = [
        LoadSnapshot(active=(), incoming=(), now=0.0, at_s=1.0, actual=DecodeLoad(1, 50)),
        LoadSnapshot(active=(), incoming=(), now=1.0, at_s=2.0, actual=DecodeLoad(4, 300)),
    ]
    score = score_predictor(FixedPredictor(DecodeLoad(2, 100)), snapshots)
    assert score == PredictorScore(batch_size_mae=1.5, context_tokens_mae=125.0, samples=2)


def test_score_predictor_feeds_each_snapshot() -> None:
    """The predictor sees each snapshot's state and times (the uniform rule, scored by hand)."""
    snapshot = LoadSnapshot(
        active=(active("a", 0.0, 100), active("b", -50.0, 300)),
        incoming=(incoming("c", 2.0, 40),),
        now=1.0,
        at_s=3.0,
        actual=DecodeLoad(1, 100),
    )
    score = score_predictor(UniformDecodePredictor(decode_s=10.0), [snapshot])
    # predicted (2, 140, 2140): a's reservation and c's
    assert score == PredictorScore(batch_size_mae=1.0, context_tokens_mae=40.0, samples=1, kv_tokens_mae=2140.0)


def test_score_of_no_snapshots_is_zero() -> None:
    """An empty replay scores zero error over zero samples."""
    assert score_predictor(FixedPredictor(DecodeLoad(3, 3)), []) == PredictorScore(
        batch_size_mae=0.0, context_tokens_mae=0.0, samples=0
    )


# ---------------------------------------------------------------------------- replay


def output_length(rng: random.Random) -> int:
    """Bimodal: most answers are short, a fifth are very long."""
    return rng.randint(4, 16) if rng.random() < 0.8 else rng.randint(400, 1600)


def decode_replay(
    seed: int,
    *,
    duration_s: float = 300.0,
    rate_per_s: float = 4.0,
    horizon_s: float = 2.0,
    known_outputs: bool = False,
    against: bool = False,
) -> list[LoadSnapshot]:
    """Simulate one decode instance (Poisson arrivals, a prefill making the first token each, then STEP_S per
    token for the rest) and record,
    every second, its state and the load it really had `horizon_s` later. Each request's expected output
    is 2000 tokens, or with `known_outputs` its own; `against`: long answers come to short prompts (as in
    the synthetic trace), else prompt and output are independent."""
    rng = random.Random(seed)
    requests = []  # (id, arrival, prefill finish = decode start, output length, prompt tokens)
    clock = 0.0
    while clock < duration_s:
        clock += rng.expovariate(rate_per_s)
        finish = clock + rng.uniform(0.2, 1.0)
        length = output_length(rng)
        prompt = (100 if length > 100 else 2000) + rng.randint(0, 100) if against else rng.randint(100, 2000)
        requests.append((RequestId(str(len(requests))), clock, finish, length, prompt))
    expected = {rid: length if known_outputs else 2000 for rid, _, _, length, _ in requests}
    snapshots = []
    for now in range(10, int(duration_s) - 5):
        at_s = now + horizon_s
        decoding = tuple(
            ActiveDecode(request_id=rid, start_s=start, context_tokens=prompt, output_tokens=expected[rid])
            for rid, _, start, length, prompt in requests
            if start <= now < start + (length - 1) * STEP_S
        )
        prefilling = tuple(
            QueuedPrefill(
                request_id=rid, start_s=arrival, finish_s=start, input_tokens=prompt, output_tokens=expected[rid]
            )
            for rid, arrival, start, _, prompt in requests
            if arrival <= now < start
        )
        known = {r.request_id for r in decoding} | {q.request_id for q in prefilling}
        alive = [
            (at_s - start, prompt)
            for rid, _, start, length, prompt in requests
            if rid in known and start <= at_s < start + (length - 1) * STEP_S
        ]
        actual = DecodeLoad(len(alive), sum(prompt + age / STEP_S for age, prompt in alive))
        snapshots.append(LoadSnapshot(active=decoding, incoming=prefilling, now=now, at_s=at_s, actual=actual))
    return snapshots


def test_output_length_predictor_beats_uniform_on_a_replay() -> None:
    """With widely varying output lengths, the survival predictor's MAEs are lower than the uniform rule's."""
    history = random.Random(1)
    observed = [output_length(history) for _ in range(2000)]
    uniform = UniformDecodePredictor(decode_s=(statistics.mean(observed) - 1) * STEP_S)  # t_d: the mean decode time
    survival = OutputLengthPredictor(step_s=STEP_S, lengths=observed)
    snapshots = decode_replay(seed=2)
    uniform_score, survival_score = score_predictor(uniform, snapshots), score_predictor(survival, snapshots)
    print(f"\nreplay of {len(snapshots)} snapshots: uniform {uniform_score}, output-length {survival_score}")
    assert survival_score.samples == uniform_score.samples == len(snapshots) > 200
    assert survival_score.batch_size_mae < uniform_score.batch_size_mae
    assert survival_score.context_tokens_mae < uniform_score.context_tokens_mae


def test_expected_output_is_exact_where_outputs_are_known_and_the_pace_is_its_own() -> None:
    """On a replay that keeps its assumptions (each request's output known, a token every `step_s`), with long
    answers to short prompts, the prediction is the load the instance really had, batch and context; the uniform
    t_d (the mean decode time) keeps short answers to long prompts as long as the rest and is far off."""
    history = random.Random(1)
    uniform = UniformDecodePredictor(
        decode_s=(statistics.mean(output_length(history) for _ in range(2000)) - 1) * STEP_S
    )
    snapshots = decode_replay(seed=2, known_outputs=True, against=True)
    uniform_score = score_predictor(uniform, snapshots)
    own_score = score_predictor(ExpectedOutputPredictor(step_s=STEP_S), snapshots)
    print(f"\nreplay of {len(snapshots)} snapshots: uniform {uniform_score}, expected output {own_score}")
    assert own_score.batch_size_mae == 0 and own_score.context_tokens_mae < 1e-6 * uniform_score.context_tokens_mae
    assert uniform_score.batch_size_mae > 1 and uniform_score.context_tokens_mae > 1000
