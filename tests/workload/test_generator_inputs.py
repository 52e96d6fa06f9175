"""The generator's inputs at their edges: whole numbers where floats are expected, skews that overflow a float,
and lengths or arrivals past what a trace holds (a generated workload can always be written as a trace)."""

from __future__ import annotations

import warnings

import attrs
import numpy as np
import pytest

from mooncake.errors import ConfigError
from mooncake.types import Request
from mooncake.workload import ArrivalProcess, WorkloadSpec, fixed_length_requests, generate_requests, preset
from mooncake.workload.trace_record import MAX_ARRIVAL_S, MAX_LINE_TOKENS


def _workload(spec: WorkloadSpec, count: int = 200, seed: int = 0) -> list[Request]:
    return list(generate_requests(spec, num_requests=count, seed=seed))


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("conversation", "popularity_skew", 9),  # int64 power wrapped to negative weights
        ("conversation", "popularity_skew", 30),  # ... or to a zero sum
        ("synthetic", "popularity_skew", 7),  # ... or silently to the wrong popularity
        ("conversation", "chat_weight", 2**64),  # past int64: an object array numpy could not draw from
        ("toolagent", "mean_turns", 3),
        ("conversation", "think_time_s", 30),
    ],
)
def test_a_whole_number_gives_the_workload_of_its_float(name: str, field: str, value: int) -> None:
    """A parameter given as an int draws the workload its float draws: numpy sees a float either way."""
    spec = preset(name)
    assert _workload(attrs.evolve(spec, **{field: value})) == _workload(attrs.evolve(spec, **{field: float(value)}))


@pytest.mark.parametrize("skew", [800.0, 1e300])
def test_a_skew_past_a_float_puts_every_draw_on_the_most_popular_member(skew: float) -> None:
    """n ** skew overflows to infinity for every member but the first: their weight is 0, the Zipf law's limit,
    without a warning, and the workload draws the first system prompt for every session that has one."""
    spec = attrs.evolve(preset("conversation"), popularity_skew=skew, num_system_prompts=5)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        requests = _workload(spec)
    assert len({r.block_keys[0] for r in requests}) == 1  # every conversation opens with a system prompt


def test_session_weights_whose_float_sum_overflows_are_refused() -> None:
    """Integers each within a float's range but summing past it are refused as their floats are, at the spec."""
    with pytest.raises(ConfigError, match="session weights"):
        WorkloadSpec(chat_weight=10**308, document_weight=10**308)
    with pytest.raises(ConfigError, match="session weights"):
        WorkloadSpec(chat_weight=1e308, document_weight=1e308)


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens"])
def test_fixed_length_requests_refuse_a_length_no_trace_line_holds(field: str) -> None:
    """input_tokens and output_tokens are at most MAX_LINE_TOKENS, refused by name before anything is drawn."""
    lengths = {"input_tokens": 1024, "output_tokens": 16}
    with pytest.raises(ConfigError, match=f"{field} must be an integer in \\[1, "):
        fixed_length_requests(**{**lengths, field: MAX_LINE_TOKENS + 1}, num_requests=1)
    (request,) = fixed_length_requests(**{**lengths, field: MAX_LINE_TOKENS}, num_requests=1)
    assert getattr(request, "input_length" if field == "input_tokens" else "output_length") == MAX_LINE_TOKENS


def test_generate_requests_refuses_arrivals_a_replay_cannot_time_at_the_call() -> None:
    """9,000 arrivals at one per 11.6 days pass MAX_ARRIVAL_S: refused when asked, naming the first request
    past it, not streamed until then; the same process with fewer requests is drawn as it was."""
    slow = ArrivalProcess(rate_per_s=1e-6)
    with pytest.raises(ConfigError, match=r"request (\d+) of num_requests=9000 .*rate_per_s=1e-06") as raised:
        generate_requests(preset("synthetic"), num_requests=9000, arrivals=slow)
    first_late = int(raised.value.args[0].split("request ")[1].split()[0])
    kept = list(generate_requests(preset("synthetic"), num_requests=first_late, arrivals=slow))
    assert kept[-1].arrival_s <= MAX_ARRIVAL_S
    with pytest.raises(ConfigError, match=f"request {first_late} of num_requests={first_late + 1} "):
        generate_requests(preset("synthetic"), num_requests=first_late + 1, arrivals=slow)


def test_fixed_length_requests_refuse_arrivals_a_replay_cannot_time() -> None:
    """fixed_length_requests holds its arrivals to the same bound, by the same message."""
    with pytest.raises(ConfigError, match=r"request \d+ of num_requests=9000 .* past the"):
        fixed_length_requests(
            input_tokens=1024, output_tokens=16, num_requests=9000, arrivals=ArrivalProcess(rate_per_s=1e-6)
        )
