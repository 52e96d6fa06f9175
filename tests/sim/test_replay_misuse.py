"""How both simulated clusters refuse a call they cannot take, each with a named error that says why.

- A cluster replays one workload: its clock, records and scheduler state would carry into a second, so a
  second `run` is refused before anything changes (the first result's records stay as they were); a run
  refused for a bad argument leaves the cluster fresh.
- `requests` that are no iterable (None) and a `progress` that is not callable are refused up front, naming
  the argument and its value, not a bare TypeError from the loop or at the first arrival.
- `DisaggregatedCluster.decode_load` on an instance it does not have names the instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from mooncake.errors import ConfigError, InvalidRequestError, UnknownInstanceError
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.disaggregated import DisaggregatedCluster, replay
from mooncake.sim.spec import build_conductor
from mooncake.types import InstanceId, Request, RequestId
from tests.sim.test_coupled import make_request
from tests.sim.test_coupled import make_spec as coupled_spec
from tests.sim.test_disaggregated import make_spec

Cluster = DisaggregatedCluster | CoupledCluster


def disaggregated() -> DisaggregatedCluster:
    spec = make_spec()
    return DisaggregatedCluster(spec, build_conductor(spec))


def coupled() -> CoupledCluster:
    return CoupledCluster(coupled_spec(num_instances=2))


CLUSTERS: list[Callable[[], Cluster]] = [disaggregated, coupled]


def workload(prefix: str = "", shift_s: float = 0.0) -> list[Request]:
    return [
        attrs.evolve(
            make_request(str(k), 0.5 * k, 2048, 8), request_id=RequestId(prefix + str(k)), arrival_s=shift_s + 0.5 * k
        )
        for k in range(3)
    ]


@pytest.mark.parametrize("make", CLUSTERS)
@pytest.mark.parametrize("shift_s", [100.0, 0.0])  # after the first ends, or before
def test_a_cluster_refuses_a_second_workload_and_its_first_result_stays(
    make: Callable[[], Cluster], shift_s: float
) -> None:
    """A second `run` (arriving after the first workload ended, or back at its times) is an InvalidRequestError saying the cluster has
    replayed a workload already, raised before any arrival: the records, the clock and the first result are as
    the first run left them (not a summary over both workloads, nor "arrivals out of order")."""
    cluster = make()
    first = cluster.run(workload())
    rows, now = list(cluster.replay.records), cluster.loop.now
    told: list[int] = []
    with pytest.raises(InvalidRequestError, match="replayed a workload already"):
        cluster.run(workload("b", shift_s), progress=told.append)
    assert list(cluster.replay.records) == rows and cluster.loop.now == now and not told
    assert len(first.records) == first.summary.num_requests == 3
    with pytest.raises(InvalidRequestError, match="replayed a workload already"):  # and again
        cluster.run(workload("c", shift_s))


@pytest.mark.parametrize("make", CLUSTERS)
@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"requests": None}, InvalidRequestError),
        ({"requests": 3}, InvalidRequestError),
        ({"progress": "x"}, ConfigError),
        ({"progress": 0}, ConfigError),
        ({"keep_intervals": "no"}, ConfigError),
    ],
)
def test_a_bad_argument_is_refused_naming_it_and_leaves_the_cluster_fresh(
    make: Callable[[], Cluster], options: dict[str, Any], error: type[Exception]
) -> None:
    """`requests` that are no iterable, a `progress` that is not callable (else a TypeError at the first arrival)
    or a `keep_intervals` that is no switch: a named error with the argument and its value, before any arrival;
    the cluster then replays a workload as a fresh one does."""
    cluster = make()
    (name, value), *_ = options.items()
    arguments: dict[str, Any] = {"requests": workload(), **options}
    with pytest.raises(error, match=f"{name} must be .*, got {value!r}"):
        cluster.run(**arguments)
    assert not cluster.replay.records
    assert cluster.run(workload()).summary.num_requests == 3


@pytest.mark.parametrize("options", [{}, {"decode_s": 1.0}])
def test_replay_refuses_requests_that_are_no_iterable(options: dict[str, Any]) -> None:
    """With or without a `decode_s` (without, `replay` reads the requests into a list for t_d first)."""
    with pytest.raises(InvalidRequestError, match="requests must be an iterable, got None"):
        replay(make_spec(), None, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{}, {"decode_s": 1.0}])
def test_replay_refuses_a_progress_that_is_not_callable(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="progress must be a callable or None, got 'x'"):
        replay(make_spec(), workload(), progress="x", **options)  # type: ignore[arg-type]


def test_decode_load_of_an_unknown_instance_names_it() -> None:
    """An UnknownInstanceError (an InvalidRequestError) naming `decode_instance` and the value, not a KeyError."""
    with pytest.raises(UnknownInstanceError, match="decode_instance 'nope'"):
        disaggregated().decode_load(InstanceId("nope"), 0.0)
