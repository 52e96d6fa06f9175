"""Tests for the temperature floor: a temperature in (0, 0.01) is raised to 0.01, as vLLM 0.32 raises it.

vLLM's `SamplingParams.__post_init__` lifts any 0 < temperature < 1e-2 to 1e-2 with a warning
("may cause numerical errors"), and only temperature 0 is greedy. The sampler must draw what vLLM
draws: a request asking for 1e-6 samples at 0.01, bit for bit the draws of one asking for 0.01.
"""

from __future__ import annotations

import logging
import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from mooncake.engine.sampling import MIN_TEMPERATURE, Sampler, SamplingParams
from mooncake.errors import ConfigError

LOGGER = "mooncake.engine.sampling"
tiny = st.floats(min_value=5e-324, max_value=math.nextafter(MIN_TEMPERATURE, 0.0))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6, 1e-5, 0.005, math.nextafter(0.01, 0.0)])
def test_a_tiny_temperature_is_raised_to_the_floor_with_a_warning_naming_it(
    temperature: float, caplog: pytest.LogCaptureFixture
) -> None:
    """The params hold 0.01, and one warning on the module's logger names the value asked for; copying the
    params (attrs.evolve) neither lowers it nor warns again."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        params = SamplingParams(temperature=temperature, seed=1)
    assert params.temperature == MIN_TEMPERATURE == 0.01
    warnings = [record for record in caplog.records if record.name == LOGGER]
    assert len(warnings) == 1 and repr(temperature) in warnings[0].getMessage()
    assert "0.01" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert attrs.evolve(params, top_p=0.9).temperature == MIN_TEMPERATURE
    assert not caplog.records


@pytest.mark.parametrize("temperature", [0, 0.0, 0.01, 0.011, 0.7, 2.0])
def test_zero_and_temperatures_from_the_floor_up_are_as_given(
    temperature: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy's 0 stays 0 (only it is greedy) and 0.01 or above is untouched, with no warning."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert SamplingParams(temperature=temperature).temperature == temperature
    assert not caplog.records


@pytest.mark.parametrize("temperature", [-1e-6, -0.0001, math.nan, math.inf, "0.001", True])
def test_what_is_no_temperature_is_still_refused(temperature: object) -> None:
    """The floor raises only numbers in (0, 0.01): a negative, a NaN, an infinity, a string, a bool are still a
    ConfigError naming the field."""
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=temperature)  # type: ignore[arg-type]


@given(
    st.lists(st.floats(min_value=-3.0, max_value=3.0, width=32), min_size=2, max_size=12),
    tiny,
    st.integers(min_value=0, max_value=2**64 - 1),
)
def test_a_tiny_temperature_draws_what_the_floor_draws(values: list[float], temperature: float, seed: int) -> None:
    """For any logits and seed, the tokens drawn at a temperature below 0.01 are those drawn at 0.01, token for
    token, as vLLM draws them (before, the tiny value was used as given: all the mass on the argmax)."""
    logits = torch.tensor(values, dtype=torch.float32)
    asked = Sampler(SamplingParams(temperature=temperature, seed=seed))
    floor = Sampler(SamplingParams(temperature=MIN_TEMPERATURE, seed=seed))
    assert [asked.next_token(logits) for _ in range(4)] == [floor.next_token(logits) for _ in range(4)]


def test_close_logits_at_a_tiny_temperature_are_sampled_not_greedy() -> None:
    """Logits 0.01 apart at temperature 1e-6: at the floor the lower one has probability 1 / (1 + e) = 0.27, so
    among 200 seeds it is drawn about 54 times (more than 20 here, by far); sampling at 1e-6 never drew it."""
    logits = torch.tensor([0.0, 0.01])
    draws = [Sampler(SamplingParams(temperature=1e-6, seed=seed)).next_token(logits) for seed in range(200)]
    assert 20 < draws.count(0) < 100
