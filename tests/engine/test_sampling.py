"""Tests for `mooncake.engine.sampling`: greedy is argmax, sampling is a per-request seeded stream.

Properties: greedy picks the argmax of any logits; a seed fixes the whole
token sequence, whatever other samplers draw in between (a request's tokens do
not depend on its batch); a token of zero probability is never drawn; a very
low temperature is greedy; no stop token is drawn before `min_tokens`. Nucleus sampling: the mask equals its definition
(the mass strictly above a token is below top_p) computed by brute force, a draw
never leaves the nucleus, top_p = 1 draws exactly what plain sampling draws. A draw is
the token at a uniform of the cumulative distribution (`invert`, by brute force in
exact fractions); seeded draws over 64 tokens follow their probabilities.
Log-probabilities: the float32 log-softmax of the raw logits, the rank and the
k most probable by their definitions; asking for them changes no draw.
Non-finite logits: from finite logits any params draw a token of the vocabulary
(biases clamped, a repetition penalty that overflows leaves the +inf tokens);
a model's NaN is an EngineError naming it, greedy or sampled.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch
import xxhash

from mooncake.engine.sampling import (
    MAX_SEED,
    Sampler,
    SamplingParams,
    invert,
    nucleus,
    rows_logprobs,
    stream_seed,
    token_logprobs,
)
from mooncake.errors import ConfigError, EngineError, InvalidRequestError

seeds = st.integers(min_value=0, max_value=2**32)
temperatures = st.sampled_from([0.5, 1.0, 2.0]) | st.floats(min_value=0.05, max_value=10.0)


def logits_of(seed: int, vocab: int = 32) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=64, unique=True))
def test_greedy_is_argmax(values: list[float]) -> None:
    """Temperature 0 (the default) returns the index of the largest logit, every time."""
    sampler = Sampler(SamplingParams())
    logits = torch.tensor(values, dtype=torch.float64)
    assert sampler.next_token(logits) == sampler.next_token(logits) == values.index(max(values))


@settings(max_examples=30)
@given(seeds, temperatures, st.lists(seeds, min_size=1, max_size=8), seeds)
def test_a_seed_fixes_the_tokens_whatever_else_draws(
    seed: int, temperature: float, steps: list[int], other: int
) -> None:
    """Two samplers with one seed draw the same tokens, even when a third sampler draws between their draws."""
    params = SamplingParams(temperature=temperature, seed=seed)
    alone, batched, neighbour = Sampler(params), Sampler(params), Sampler(SamplingParams(temperature=1.0, seed=other))
    for step in steps:
        logits = logits_of(step)
        neighbour.next_token(logits)
        assert alone.next_token(logits) == batched.next_token(logits)


@settings(max_examples=30)
@given(seeds, temperatures, st.lists(seeds, min_size=2, max_size=8), st.integers(min_value=1, max_value=7))
def test_a_stream_resumed_at_a_position_draws_what_one_sampler_draws(
    seed: int, temperature: float, steps: list[int], split: int
) -> None:
    """A request's stream is its (seed, position): a sampler started at position k (a decode engine after
    the prefill drew token 0) draws what one sampler would from its k-th draw on."""
    params = SamplingParams(temperature=temperature, seed=seed)
    split = min(split, len(steps) - 1)
    whole = Sampler(params)
    expected = [whole.next_token(logits_of(step)) for step in steps]
    first, rest = Sampler(params), Sampler(params, position=split)
    drawn = [first.next_token(logits_of(step)) for step in steps[:split]]
    drawn += [rest.next_token(logits_of(step)) for step in steps[split:]]
    assert drawn == expected and rest.position == len(steps)


def test_a_numpy_seed_is_its_integer() -> None:
    """A seed drawn with numpy (np.int64) streams as the same Python int (it had no `to_bytes`)."""
    import numpy as np

    logits = logits_of(0)
    ours, plain = (
        Sampler(SamplingParams(temperature=1.0, seed=np.int64(5))),
        Sampler(SamplingParams(temperature=1.0, seed=5)),
    )
    assert [ours.next_token(logits) for _ in range(5)] == [plain.next_token(logits) for _ in range(5)]


def test_the_draws_of_one_request_are_independent() -> None:
    """Consecutive tokens of one request are separate draws: over near-uniform logits of 1,024 tokens the first
    two agree about 1 time in 1,024 (two fresh samplers of one seed once repeated the first draw every time)."""
    uniform = torch.zeros(1024)
    same = 0
    for seed in range(300):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        same += sampler.next_token(uniform) == sampler.next_token(uniform)
    assert same <= 4  # expected 0.3; P(>= 5) < 1e-4
    with pytest.raises(ConfigError, match="position"):
        Sampler(SamplingParams(), position=-1)


@settings(max_examples=30)
@given(seeds, temperatures, st.sets(st.integers(min_value=0, max_value=31), min_size=1, max_size=31))
def test_a_token_of_zero_probability_is_never_drawn(seed: int, temperature: float, banned: set[int]) -> None:
    """Tokens whose logit is -inf never come out."""
    logits = logits_of(seed)
    logits[sorted(banned)] = float("-inf")
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
    assert all(sampler.next_token(logits) not in banned for _ in range(20))


@settings(max_examples=30)
@given(seeds)
def test_a_tiny_temperature_is_greedy(seed: int) -> None:
    """With a clear winner, temperature 1e-4 (raised to vLLM's floor, 0.01: the rest then have e^-100 of the
    winner's probability) puts all the mass on the argmax."""
    logits = logits_of(seed)
    logits[seed % 32] = logits.max() + 1.0
    assert Sampler(SamplingParams(temperature=1e-4, seed=seed)).next_token(logits) == seed % 32


@settings(max_examples=50)
@given(
    seeds,
    st.sampled_from([0.0, 0.7, 1.0]),
    st.sets(st.integers(min_value=0, max_value=40), min_size=1, max_size=8),  # 32 and up: past the vocabulary
    st.integers(min_value=0, max_value=6),
    st.integers(min_value=0, max_value=4),
)
def test_no_stop_token_is_drawn_before_min_tokens(
    seed: int, temperature: float, stop: set[int], min_tokens: int, start: int
) -> None:
    """vLLM's `min_tokens`: the positions before it never draw a stop token, even its most probable one; from it
    on the draws are those of the same stream without `min_tokens` (a stop's logit the largest: greedy draws it)."""
    logits = logits_of(seed)
    inside = sorted(t for t in stop if t < 32)
    if inside:
        logits[inside[0]] = logits.max() + 50.0  # a stop token all but certain to be drawn
    params = SamplingParams(temperature=temperature, seed=seed, stop_token_ids=frozenset(stop), min_tokens=min_tokens)
    plain = Sampler(attrs.evolve(params, min_tokens=0), position=start)
    held = Sampler(params, position=start)  # resumed mid-stream, as the decode engine's sampler at position 1
    for position in range(start, start + 8):
        token, unheld = held.next_token(logits), plain.next_token(logits)
        if position < min_tokens:
            assert token not in stop
        else:
            assert token == unheld
            if inside and temperature == 0.0:
                assert token == inside[0]


def test_sampling_draws_from_the_distribution() -> None:
    """Different seeds give different streams, and the draws follow softmax(logits / T) roughly."""
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    draws = [Sampler(SamplingParams(temperature=1.0, seed=seed)).next_token(logits) for seed in range(2000)]
    assert draws.count(0) / 2000 == pytest.approx(0.7, abs=0.05)
    assert draws.count(2) / 2000 == pytest.approx(0.1, abs=0.03)
    stream = Sampler(SamplingParams(temperature=1.0, seed=1))
    assert len({stream.next_token(logits_of(0)) for _ in range(50)}) > 1  # the stream advances


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"seed": -1},
        {"seed": 1.5},
        {"seed": True},
        {"seed": 2**64},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"top_p": "0.5"},
        {"min_tokens": -1},
        {"min_tokens": 1.5},
    ],
)
def test_params_are_validated(fields: dict[str, object]) -> None:
    """Negative or non-finite temperatures, non-integer seeds outside [0, 2**64) and top_p outside (0, 1] are
    ConfigErrors."""
    with pytest.raises(ConfigError):
        SamplingParams(**fields)  # type: ignore[arg-type]


top_ps = st.floats(min_value=0.01, max_value=1.0)


def mass_above(probabilities: list[float], token: int) -> float:
    """The probability mass of the tokens strictly more probable than `token` (the nucleus' definition)."""
    return math.fsum(p for p in probabilities if p > probabilities[token])


@settings(max_examples=100)
@given(
    st.lists(st.integers(min_value=-8, max_value=8), min_size=1, max_size=24)
    | st.lists(st.integers(-3, 3), min_size=33, max_size=300),
    top_ps,
)
def test_nucleus_is_its_definition(values: list[int], top_p: float) -> None:
    """The mask keeps token i iff the mass strictly above it is below top_p, by brute force; small integer logits
    give ties, which are kept or dropped together; the most probable token is always kept. Vocabularies past
    one octave of probability, with flat logits, put many candidates in the octave where the nucleus ends."""
    probabilities = torch.softmax(torch.tensor(values, dtype=torch.float32), dim=-1)
    mask = nucleus(probabilities, top_p).tolist()
    exact = probabilities.double().tolist()
    for token, kept in enumerate(mask):
        above = mass_above(exact, token)
        if abs(above - top_p) > 1e-9:  # away from the boundary, where summation order could tip it
            assert kept == (above < top_p), (token, above, top_p)
    assert mask[int(torch.argmax(probabilities))]
    for token, kept in enumerate(mask):
        for other, also in enumerate(mask):
            if exact[token] == exact[other]:
                assert kept == also


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.5, [True, False, False, False]), (0.75, [True, True, False, False]), (1.0, [True, True, True, True])],
)
def test_a_token_whose_mass_above_is_exactly_top_p_is_dropped(top_p: float, kept: list[bool]) -> None:
    """At the boundary, represented exactly: a token with exactly top_p of mass above it is out, as vLLM's and
    transformers' top-p drop it (the ascending cumulative at or below 1 - top_p is removed); tied tokens go
    together."""
    assert nucleus(torch.tensor([0.5, 0.25, 0.125, 0.125]), top_p).tolist() == kept


@settings(max_examples=30)
@given(seeds, temperatures, top_ps)
def test_a_draw_never_leaves_the_nucleus(seed: int, temperature: float, top_p: float) -> None:
    """Every token drawn with top_p lies in the nucleus of softmax(logits / T)."""
    logits = logits_of(seed)
    probabilities = torch.softmax(logits / temperature, dim=-1)
    allowed = set(torch.nonzero(nucleus(probabilities, top_p)).flatten().tolist())
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed))
    assert all(sampler.next_token(logits) in allowed for _ in range(20))


@settings(max_examples=30)
@given(seeds, temperatures)
def test_top_p_one_is_plain_sampling(seed: int, temperature: float) -> None:
    """top_p = 1 draws the tokens plain temperature sampling draws, with the same seed."""
    plain = Sampler(SamplingParams(temperature=temperature, seed=seed))
    whole = Sampler(SamplingParams(temperature=temperature, top_p=1.0, seed=seed))
    for step in range(10):
        assert plain.next_token(logits_of(step)) == whole.next_token(logits_of(step))


def test_top_p_narrows_the_draws() -> None:
    """With probabilities 0.5, 0.3, 0.2: top_p 0.45 always draws token 0; top_p 0.7 draws 0 and 1, never 2."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    narrow = {Sampler(SamplingParams(temperature=1.0, top_p=0.45, seed=s)).next_token(logits) for s in range(200)}
    assert narrow == {0}
    wider = {Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=s)).next_token(logits) for s in range(200)}
    assert wider == {0, 1}


def test_a_tokens_stream_is_seeded_by_the_documented_bytes() -> None:
    """XXH3-64 of the request's seed then the token's position, each a little-endian 64-bit word: the layout a
    prefill and a decode process (or two releases) must share to draw one request's tokens alike."""
    word = bytes([1, 0, 0, 0, 0, 0, 0, 0]), bytes([2, 0, 0, 0, 0, 0, 0, 0])
    assert stream_seed(1, 2) == xxhash.xxh3_64_intdigest(word[0] + word[1]) != stream_seed(2, 1)


def test_the_largest_seed_is_accepted() -> None:
    """Seeds lie in [0, 2**64): 2**64 - 1, torch's largest, is a valid seed that draws."""
    params = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert params.seed == MAX_SEED
    assert 0 <= Sampler(params).next_token(torch.zeros(8)) < 8


def test_output_token_k_is_drawn_from_a_generator_seeded_with_stream_seed_of_k() -> None:
    """The documented stream: token k is the token at u of the cumulative softmax(logits / T), u the first
    float64 uniform of a generator seeded stream_seed(seed, k); over uniform logits of 1,024 tokens that is
    floor(1024 u). A stream shifted by one position disagrees."""
    seed = 1234
    uniform = torch.zeros(1024)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    for k in range(4):
        generator = torch.Generator().manual_seed(stream_seed(seed, k))
        expected = math.floor(1024 * float(torch.rand((), dtype=torch.float64, generator=generator)))
        assert sampler.next_token(uniform) == expected


@given(
    st.lists(st.sampled_from([0.0, 0.0, 1e-300, 0.5, 1.0, 3.0, 1e6]), min_size=1, max_size=40).filter(any),
    st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_invert_is_the_first_token_whose_cumulative_mass_exceeds_u_of_the_total(
    masses: list[float], uniform: float
) -> None:
    """By brute force in exact fractions (away from a boundary, where rounding may tip it): the first token
    whose cumulative mass exceeds u times the total; never a token of zero mass, at u = 0 the first of
    non-zero mass, and the draw never moves back as u grows."""
    probabilities = torch.tensor(masses, dtype=torch.float64)
    token = invert(probabilities, uniform)
    assert masses[token] > 0
    boundaries = list(itertools.accumulate(Fraction(mass) for mass in masses))
    target = Fraction(uniform) * boundaries[-1]
    if all(abs(boundary - target) > boundaries[-1] / 10**9 for boundary in boundaries):
        assert token == next(index for index, boundary in enumerate(boundaries) if boundary > target)
    assert invert(probabilities, 0.0) == next(index for index, mass in enumerate(masses) if mass > 0)
    assert invert(probabilities, min(uniform * 2, math.nextafter(1.0, 0.0))) >= token


def test_draws_follow_the_distribution_over_a_wide_vocabulary() -> None:
    """4,000 seeded draws over 64 tokens of unequal probability (and 64 of zero): every count within 5
    standard deviations of its expectation, and no zero-probability token drawn."""
    logits = torch.cat((torch.linspace(0.0, 3.0, 64), torch.full((64,), -math.inf)))
    probabilities = torch.softmax(logits.double(), dim=-1)
    counts = [0] * 128
    for seed in range(4000):
        counts[Sampler(SamplingParams(temperature=1.0, seed=seed)).next_token(logits)] += 1
    assert sum(counts[64:]) == 0
    for token in range(64):
        mean = 4000 * float(probabilities[token])
        assert abs(counts[token] - mean) <= 5 * math.sqrt(mean * (1 - float(probabilities[token]))), token


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_temperature_down_to_the_smallest_float_is_greedy(temperature: float) -> None:
    """float32 logits (as a model gives them) and a temperature down to the smallest float, raised to 0.01 as vLLM
    raises it: a logit 1 below the largest has e^-100 of its probability, so all the mass is on the argmax, and
    no nan."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0], dtype=torch.float32)
    for seed in range(10):
        assert Sampler(SamplingParams(temperature=temperature, seed=seed)).next_token(logits) == 1


# ---------------------------------------------------------------------------------------------- log-probabilities


@given(
    st.lists(st.floats(min_value=-50.0, max_value=50.0), min_size=1, max_size=40),
    st.integers(min_value=0, max_value=45),
    st.data(),
)
def test_token_logprobs_are_the_log_softmax_its_rank_and_the_k_most_probable(
    values: list[float], k: int, data: st.DataObject
) -> None:
    """For any logits, token and k: the token's log-probability is the float32 log-softmax's entry; its rank is the
    count of tokens at least as probable, itself included (vLLM's); `top` has min(k, vocab) entries, the k largest, most probable first and
    equal ones by id (ties are common here: the logits repeat)."""
    logits = torch.tensor(values).round()  # rounded: many equal logits, so the tie rules are exercised
    token = data.draw(st.integers(min_value=0, max_value=len(values) - 1))
    got = token_logprobs(logits, token, k)
    reference = torch.log_softmax(logits.float(), dim=-1).tolist()
    assert got.logprob == reference[token] <= 0.0
    assert got.rank == sum(value >= reference[token] for value in reference)
    expected = sorted(range(len(values)), key=lambda t: (-reference[t], t))[:k]
    assert got.top == tuple((t, reference[t]) for t in expected)


def test_a_tied_tokens_rank_counts_the_tokens_it_ties_as_vllm_does() -> None:
    """vLLM ranks a sampled token by the tokens at least as probable (`(x >= value).sum()`): of three equal
    tokens behind a more probable one, each is 4th, where counting only the strictly more probable gave 2nd."""
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5])
    assert [token_logprobs(logits, token, 0).rank for token in range(5)] == [1, 4, 4, 4, 5]


@given(st.integers(min_value=1, max_value=6), st.integers(min_value=0, max_value=40), seeds, st.data())
def test_rows_logprobs_are_each_rows_token_logprobs(rows: int, k: int, seed: int, data: st.DataObject) -> None:
    """Scoring rows at once (a prompt's positions) gives, row by row, what `token_logprobs` gives for that row
    alone: the same log-probability, rank and top list."""
    logits = torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)).round()
    tokens = data.draw(st.lists(st.integers(min_value=0, max_value=31), min_size=rows, max_size=rows))
    got = rows_logprobs(logits, tokens, k)
    assert got == [token_logprobs(logits[i], tokens[i], k) for i in range(rows)]
    with pytest.raises(InvalidRequestError, match="one token"):
        rows_logprobs(logits, [*tokens, 0], k)


@given(seeds, st.sampled_from([0.0, 0.7, 1.5]), st.integers(min_value=0, max_value=5))
def test_asking_for_logprobs_changes_no_draw_and_gives_the_raw_models(seed: int, temperature: float, k: int) -> None:
    """A sampler asked for log-probabilities draws the same tokens as one that is not (the same seed), and
    reports them under the raw logits, whatever the temperature or `min_tokens` mask (vLLM's `raw_logprobs`);
    one not asked reports None."""
    params = SamplingParams(temperature=temperature, seed=seed, stop_token_ids=frozenset({3}), min_tokens=2)
    asked, plain = Sampler(attrs.evolve(params, logprobs=k)), Sampler(params)
    for step in range(4):
        logits = logits_of(seed + step)
        token = asked.next_token(logits)
        assert token == plain.next_token(logits)
        assert plain.logprobs_of(logits, token) is None
        assert asked.logprobs_of(logits, token) == token_logprobs(logits, token, k)


def test_bad_logprobs_arguments_are_named_errors() -> None:
    """A negative count is refused where the params are made (ConfigError) and where log-probabilities are
    computed (InvalidRequestError), as is a token outside the vocabulary."""
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=True)
    logits = logits_of(0, vocab=8)
    with pytest.raises(InvalidRequestError, match=r"token must be an integer in \[0, 8\)"):
        token_logprobs(logits, 8, 1)
    with pytest.raises(InvalidRequestError, match="k must"):
        token_logprobs(logits, 0, -1)


# ---------------------------------------------------------------------------------------------- vLLM's filters and penalties


def penalized_reference(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """vLLM's penalties written out per token: the repetition penalty on every token of the prompt or the output
    (a positive logit divided, any other multiplied), then minus frequency x count and presence once."""
    out = list(logits)
    for token in range(len(out)):
        if token in prompt or token in output:
            rp = params.repetition_penalty
            out[token] = out[token] / rp if out[token] > 0 else out[token] * rp
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + (params.presence_penalty if count else 0.0)
    return out


penalties = st.builds(
    SamplingParams,
    repetition_penalty=st.sampled_from([1.0, 0.8, 1.3, 2.0]),
    presence_penalty=st.sampled_from([0.0, -1.5, 0.5, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -0.5, 1.0]),
)


@settings(max_examples=60)
@given(
    penalties,
    st.lists(st.integers(min_value=0, max_value=15), max_size=6),
    st.lists(st.integers(min_value=0, max_value=15), min_size=1, max_size=6),
    seeds,
)
def test_greedy_with_penalties_takes_the_argmax_of_vllms_penalized_logits(
    params: SamplingParams, prompt: list[int], output: list[int], seed: int
) -> None:
    """A greedy sampler that has seen `output` (its first token given at construction, as the decode engine
    is given the prefill's; the rest drawn by it) picks the argmax of the logits with the penalties applied as
    vLLM defines them; the logits it was given are left as they were (the log-probabilities are the raw ones)."""
    logits = logits_of(seed, vocab=16)
    sampler = Sampler(params, position=1, prompt=prompt, output=output[:1])
    for token in output[1:]:  # drawn by it: a row whose argmax is the token, by a margin no penalty undoes
        row = torch.full((16,), -1e4)
        row[token] = 1e4
        assert sampler.next_token(row) == token
    before = logits.clone()
    expected = penalized_reference(logits.tolist(), prompt, output, params)
    got = sampler.next_token(logits)
    assert torch.equal(logits, before)
    assert expected[got] == max(expected) or math.isclose(expected[got], max(expected), rel_tol=1e-6)


def test_neutral_filters_and_penalties_draw_exactly_what_the_plain_sampler_draws() -> None:
    """top_k 0, -1 (vLLM's "all") or >= the vocabulary, min_p 0, penalties 0 and repetition 1: the same tokens, seed
    for seed."""
    assert SamplingParams(top_k=-1) == SamplingParams()
    for neutral in (
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 32},
        {"min_p": 0.0},
        {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
    ):
        for seed in range(20):
            plain = Sampler(SamplingParams(temperature=1.0, seed=seed))
            other = Sampler(SamplingParams(temperature=1.0, seed=seed, **neutral))
            for step in range(5):
                logits = logits_of(seed * 7 + step)
                assert plain.next_token(logits) == other.next_token(logits), (neutral, seed)


@settings(max_examples=40)
@given(seeds, st.integers(min_value=1, max_value=6), st.sampled_from([0.5, 1.0, 3.0]))
def test_top_k_draws_only_among_the_k_largest_logits(seed: int, k: int, temperature: float) -> None:
    """Every draw lies among the k largest logits (ties with the k-th included); top_k 1 over distinct logits is
    greedy."""
    logits = logits_of(seed).round()  # rounded: ties at the k-th value occur
    kth = torch.sort(logits, descending=True).values[k - 1]
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, top_k=k))
    for _ in range(30):
        assert logits[sampler.next_token(logits)] >= kth
    distinct = logits_of(seed)
    one = Sampler(SamplingParams(temperature=temperature, seed=seed, top_k=1))
    assert one.next_token(distinct) == int(torch.argmax(distinct))


@settings(max_examples=40)
@given(seeds, st.sampled_from([0.05, 0.3, 0.9, 1.0]), st.sampled_from([0.5, 1.0, 2.0]))
def test_min_p_draws_only_tokens_near_enough_the_most_probable(seed: int, min_p: float, temperature: float) -> None:
    """Every draw has a probability (at the temperature) at least min_p times the most probable token's."""
    logits = logits_of(seed)
    probabilities = torch.softmax(logits.double() / temperature, dim=-1)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, min_p=min_p))
    for _ in range(30):
        assert probabilities[sampler.next_token(logits)] >= min_p * probabilities.max() * (1 - 1e-12)


def test_a_repetition_penalty_needs_the_prompt_and_the_penalties_the_output_so_far() -> None:
    """Without the prompt a repetition penalty cannot count it, and a sampler starting at position 1 must be
    told token 0: both refused by name, not drawn wrong; the ranges are vLLM's."""
    with pytest.raises(ConfigError, match="prompt"):
        Sampler(SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ConfigError, match="output so far"):
        Sampler(SamplingParams(presence_penalty=0.5), position=1)
    Sampler(SamplingParams(presence_penalty=0.5), position=1, output=[3])
    for bad in (
        {"top_k": -2},
        {"top_k": 1.5},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"frequency_penalty": math.nan},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_the_repetition_penalty_counts_the_prompts_tokens_and_the_penalties_only_the_outputs() -> None:
    """A prompt token's positive logit is divided (5 / 2 = 2.5 falls below 4) and a negative one multiplied (-1 x 2
    falls below -1.5), so greedy moves to the next token; presence and frequency penalties leave a token only
    in the prompt alone, and weigh a token the output holds (the first, given at construction) by its count."""
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0]).next_token(torch.tensor([5.0, 4.0])) == 1
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0]).next_token(torch.tensor([-1.0, -1.5])) == 1
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt=[1]).next_token(torch.tensor([5.0, 4.0])) == 0
    logits = torch.tensor([5.0, 4.0, 2.5])
    assert Sampler(SamplingParams(presence_penalty=2.0), prompt=[0]).next_token(logits) == 0
    assert Sampler(SamplingParams(presence_penalty=2.0), position=1, output=[0]).next_token(logits) == 1
    frequent = Sampler(SamplingParams(frequency_penalty=1.6), position=3, output=[0, 0, 1])
    assert frequent.next_token(logits) == 2  # 5 - 2 x 1.6 = 1.8 and 4 - 1.6 = 2.4 fall below 2.5
    assert Sampler(SamplingParams(frequency_penalty=1.6), position=3, output=[0, 1, 1]).next_token(logits) == 0


def test_logit_bias_shifts_those_logits_before_the_penalties_and_leaves_the_logprobs_raw() -> None:
    """A bias is added to its token's logit (greedy moves to a token lifted past the best; -100 bans one), after
    the min_tokens mask and before the penalties (a repetition penalty then divides the biased logit), and the
    log-probabilities stay those of the raw logits; ids outside the vocabulary are refused by name where the
    engines know it."""
    logits = torch.tensor([5.0, 4.0, 1.0])
    assert Sampler(SamplingParams(logit_bias={2: 4.5})).next_token(logits) == 2
    assert Sampler(SamplingParams(logit_bias={0: -100.0})).next_token(logits) == 1
    # 1 + 4.5 = 5.5 > 5, but divided by the repetition penalty 2 it is 2.75 < 5: the penalty comes after the bias.
    assert Sampler(SamplingParams(logit_bias={2: 4.5}, repetition_penalty=2.0), prompt=[2]).next_token(logits) == 0
    biased = Sampler(SamplingParams(logit_bias={2: 4.5}, logprobs=1))
    assert biased.logprobs_of(logits, biased.next_token(logits)) == token_logprobs(logits, 2, 1)
    assert SamplingParams(logit_bias=[(7, 1.0), (3, -2.0)]).logit_bias == ((3, -2.0), (7, 1.0))
    with pytest.raises(InvalidRequestError, match="logit_bias: token 3"):
        SamplingParams(logit_bias={3: 1.0}).check_vocabulary(3)
    with pytest.raises(InvalidRequestError, match="stop_token_ids: token 5"):
        SamplingParams(stop_token_ids={5}).check_vocabulary(5)
    for bad in ({-1: 1.0}, {1: math.inf}, "12"):
        with pytest.raises(ConfigError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_a_vocabulary_of_stop_tokens_only_is_drawn_from_before_min_tokens() -> None:
    """`min_tokens` holds stop tokens back, but where every token is one there is nothing else to draw: the
    sampler draws among them (a sampled draw over all -inf logits raised "probability tensor contains nan")."""
    for temperature in (0.0, 0.8):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1, stop_token_ids={0, 1}, min_tokens=3))
        assert sampler.next_token(torch.tensor([0.0, 0.5])) in (0, 1)


@settings(max_examples=40)
@given(
    seeds,
    st.sampled_from([0.0, 0.7, 2.0]),
    st.sets(st.integers(min_value=0, max_value=31), min_size=1, max_size=6),
    st.sets(st.integers(min_value=0, max_value=31), max_size=6),
    st.integers(min_value=0, max_value=3),
)
def test_only_allowed_tokens_are_drawn(
    seed: int, temperature: float, allowed: set[int], stop: set[int], min_tokens: int
) -> None:
    """vLLM's `allowed_token_ids`: every draw is an allowed token, greedy the most probable of them, whatever
    biases push others up; with `min_tokens`, an allowed set of stop ids only still draws (among them), and one
    with other tokens draws those first; log-probabilities stay the raw model's."""
    logits = logits_of(seed)
    bias = {t: 100.0 for t in range(32) if t not in allowed}  # would win anywhere else
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        allowed_token_ids=allowed,
        logit_bias=bias,
        stop_token_ids=stop,
        min_tokens=min_tokens,
        logprobs=1,
    )
    sampler = Sampler(params)
    for position in range(6):
        token = sampler.next_token(logits)
        assert token in allowed
        if position < min_tokens and allowed - stop:
            assert token not in stop
        if temperature == 0 and (position >= min_tokens or not stop & allowed):
            assert token == max(allowed, key=lambda t: float(logits[t]))
        assert sampler.logprobs_of(logits, token) == token_logprobs(logits, token, 1)


def test_allowed_token_ids_are_checked_against_the_vocabulary() -> None:
    SamplingParams(allowed_token_ids=[3, 31]).check_vocabulary(32)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids: token 32 is outside the 32-token vocabulary"):
        SamplingParams(allowed_token_ids=[3, 32]).check_vocabulary(32)
    with pytest.raises(ConfigError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])


def test_none_means_not_set_for_stop_ids_allowed_ids_and_logit_bias_as_in_vllm() -> None:
    """vLLM's `SamplingParams` defaults `stop_token_ids`, `allowed_token_ids` and `logit_bias` to None, "not
    set": each is then this one's empty default (no stop id, every token allowed, no bias), all three alike; ids
    that are no collection of ids (a lone int, a list of lists) are a ConfigError naming the field."""
    assert SamplingParams(stop_token_ids=None, allowed_token_ids=None, logit_bias=None) == SamplingParams()
    for field in ("stop_token_ids", "allowed_token_ids"):
        for bad in (5, [[1]]):
            with pytest.raises(ConfigError, match=field):
                SamplingParams(**{field: bad})  # type: ignore[arg-type]


def test_a_samplers_allowed_or_biased_token_past_the_logits_is_a_named_error() -> None:
    """A `Sampler` used without an engine's `check_vocabulary` names an allowed or biased id past the logits'
    vocabulary (the field and the id) at its first draw, where its mask is made, instead of an IndexError; the
    vocabulary's last id is still one to draw."""
    logits = torch.zeros(10)
    for temperature in (0.0, 1.0):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids: token 50 is outside the 10-token"):
            Sampler(SamplingParams(allowed_token_ids=[3, 50], temperature=temperature, seed=1)).next_token(logits)
        with pytest.raises(InvalidRequestError, match="logit_bias: token 10 is outside the 10-token"):
            Sampler(SamplingParams(logit_bias={2: 1.0, 10: 1.0}, temperature=temperature, seed=1)).next_token(logits)
    assert Sampler(SamplingParams(allowed_token_ids=[9])).next_token(logits) == 9
    assert Sampler(SamplingParams(logit_bias={9: 5.0})).next_token(logits) == 9


# ---------------------------------------------------------------------------------------------- non-finite logits

finite_logits = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=24)
# Every params the draw may see: biases past float32's range (clamped), repetition penalties whose division or
# multiplication overflows float32, and the filters.
drawing_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-300, 0.7, 1.0, 5.0]),
    seed=seeds,
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    top_k=st.sampled_from([0, 1, 3]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 1e-40, 1e-300, 5e-324, 1e38, 1e300]),
    frequency_penalty=st.sampled_from([0.0, 2.0]),
    presence_penalty=st.sampled_from([0.0, -2.0]),
    logit_bias=st.dictionaries(
        st.integers(min_value=0, max_value=23), st.floats(allow_nan=False, allow_infinity=False), max_size=4
    ),
)


@settings(max_examples=200)
@given(finite_logits, drawing_params, st.lists(st.integers(min_value=0, max_value=23), max_size=8))
def test_a_draw_from_finite_logits_is_a_token_of_the_vocabulary(
    values: list[float], params: SamplingParams, prompt: list[int]
) -> None:
    """Whatever the params do to finite float32 logits (a bias of 1e39, a repetition penalty of 1e-40 that
    overflows a logit to +inf or of 1e300 that takes one to -inf), every draw is a token in [0, vocab): never
    `vocab` (the search's end, once a NaN made the cumulative sum NaN), never a bare IndexError. The one refusal
    is a named InvalidRequestError where the params leave every logit -inf, and then the model is not blamed."""
    vocab = len(values)
    params = attrs.evolve(params, logit_bias=[(t, b) for t, b in params.logit_bias if t < vocab])  # as checked
    logits = torch.tensor(values, dtype=torch.float32)
    sampler = Sampler(params, prompt=[t for t in prompt if t < vocab])
    for _ in range(3):
        try:
            token = sampler.next_token(logits)
        except InvalidRequestError as error:
            assert "leave every one" in str(error)
            return
        assert 0 <= token < vocab


@settings(max_examples=100)
@given(
    finite_logits,
    st.data(),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from([0.0, 1.0]),
    st.sampled_from([1.0, 0.5]),
)
def test_non_finite_model_logits_are_an_engine_error_naming_them_or_a_token_of_the_vocabulary(
    values: list[float], data: st.DataObject, bad: float, temperature: float, top_p: float
) -> None:
    """A model's NaN logit, greedy or sampled, is an EngineError that names the token (greedy's argmax once
    returned it, sampling `vocab`); so are logits that are all -inf. A +inf logit is the limit of a growing
    one: the draw is among the +inf tokens (greedy the first). A -inf one has probability 0."""
    spoiled = data.draw(st.sets(st.integers(min_value=0, max_value=len(values) - 1), min_size=1))
    logits = torch.tensor(values, dtype=torch.float32)
    logits[sorted(spoiled)] = bad
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=1))
    if math.isnan(bad) or (len(spoiled) == len(values) and bad < 0):
        with pytest.raises(EngineError, match=r"logits are not finite \((NaN at tokens \[\d|every one -inf)"):
            sampler.next_token(logits)
        return
    for _ in range(3):
        token = sampler.next_token(logits)
        assert 0 <= token < len(values)
        if bad > 0:
            assert token in spoiled
            if temperature == 0:
                assert token == min(spoiled)
        else:
            assert token not in spoiled


@settings(max_examples=25, deadline=None)
@given(seeds, st.sampled_from([0.0, 1.0]), st.sampled_from(["nan", "no token"]))
def test_a_failed_draw_leaves_the_sampler_as_it_was(seed: int, temperature: float, failure: str) -> None:
    """A draw that fails (the model's NaN logits, an EngineError; params that leave no token, an
    InvalidRequestError) takes no position and counts no token: with a failure before each draw, the draws
    (a stop token held back by `min_tokens`, a frequency penalty counting the output, the seeded stream's
    positions) are those of a sampler that never failed, and both end at the same position."""
    rows = [logits_of(seed + i) for i in range(4)]
    stop = int(torch.argmax(rows[1]))  # greedy's second draw, were `min_tokens` not holding it back
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        stop_token_ids=[stop],
        min_tokens=3,
        frequency_penalty=1.5,
        allowed_token_ids=[0, 1, 2, stop],
    )
    # Finite logits but -inf at every allowed token: the params leave nothing to draw.
    hopeless = torch.zeros(32)
    hopeless[[0, 1, 2, stop]] = -math.inf
    spoiled, error = (torch.full((32,), math.nan), EngineError) if failure == "nan" else (hopeless, InvalidRequestError)
    steady, failing = Sampler(params), Sampler(params)
    expected = [steady.next_token(row) for row in rows]
    got = []
    for row in rows:
        with pytest.raises(error):
            failing.next_token(spoiled)
        assert failing.position == len(got)
        got.append(failing.next_token(row))
    assert got == expected and failing.position == steady.position == len(rows)


def test_a_bias_past_the_float32_range_is_clamped_as_vllm_clamps_it() -> None:
    """OpenAI's and vLLM's [-100, 100]: 1e39 (past float32's largest, so its logit was +inf, and the shifted
    logits inf - inf = NaN, drawing token `vocab`) is 100 and always drawn; -1e39 is -100; a bias within the
    range is kept exactly; a non-finite one is still refused."""
    assert SamplingParams(logit_bias={5: 1e39, 6: -1e39, 7: 3, 8: -99.5}).logit_bias == (
        (5, 100.0),
        (6, -100.0),
        (7, 3),
        (8, -99.5),
    )
    logits = logits_of(0)
    for temperature in (0.0, 1.0):
        up = Sampler(SamplingParams(temperature=temperature, seed=1, logit_bias={5: 1e39}))
        assert [up.next_token(logits) for _ in range(8)] == [5] * 8
        down = Sampler(SamplingParams(temperature=temperature, seed=1, logit_bias={5: -1e39}))
        assert 5 not in [down.next_token(logits) for _ in range(8)]
    with pytest.raises(ConfigError, match="logit_bias"):
        SamplingParams(logit_bias={5: math.nan})


def test_a_tiny_repetition_penalty_draws_among_the_overflowed_tokens() -> None:
    """vLLM accepts any finite repetition penalty > 0; 1e-40 divides the prompt's positive logits past float32's
    range (+inf). Those tokens then share all the mass, so draws are among them (it once raised a bare
    IndexError), greedy the first; the prompt's negative logits shrink towards 0 and stay drawable."""
    logits = torch.tensor([-0.5, 0.8, 2.0, 0.3, 5.0])
    for temperature, expected in ((0.0, {1}), (0.7, {1, 3})):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=3, repetition_penalty=1e-40), prompt=[0, 1, 3])
        assert {sampler.next_token(logits) for _ in range(40)} == expected


def test_invert_refuses_a_total_that_is_not_finite_and_positive() -> None:
    """The search of a NaN, infinite or zero total would give `vocab`, a token outside the vocabulary."""
    for total in ([0.5, math.nan], [math.inf, 1.0], [0.0, 0.0]):
        with pytest.raises(InvalidRequestError, match="probabilities must sum to a finite number > 0"):
            invert(torch.tensor(total, dtype=torch.float64), 0.5)
