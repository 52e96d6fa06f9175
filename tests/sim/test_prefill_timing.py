"""Prefill timing that the simulator and the Conductor must agree on (found by a review, each pinned here):

- a chunked-pipeline group: a short prompt that entered behind a long one cannot leave the last stage first
  (`sched.cost.prefill_end_s`), still so once the one ahead has left the Conductor's queue, and a prompt
  repeating one still in the group reuses its blocks stage by stage (the Conductor's pending blocks);
- a moved prefix: what the transfer brought when it arrived, no more than the plan reuses.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mooncake.sched.admission import predictive_early_rejection
from mooncake.sched.cost import occupancy_s
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.view import DecodeJoined, PrefillFinished, PrefillStarted, RequestAborted
from mooncake.sim.disaggregated import DisaggregatedCluster, replay
from mooncake.sim.spec import build_conductor
from mooncake.types import InstanceId, Request
from tests.sim.test_cluster_edges import PATIENT, scripted
from tests.sim.test_disaggregated import BLOCK, INFINITE_CACHE_TOKENS, REPLAY_SETTINGS, make_request, make_spec


def estimates_and_records(spec: Any, requests: list[Request], **options: Any) -> tuple[list[float], list[Any]]:
    """The Conductor's TTFT estimate of each request as it was scheduled in the replay, and the records."""
    conductor = build_conductor(spec, slo=PATIENT, **options)
    estimates: dict[str, float] = {}
    schedule = conductor.schedule

    def spying(request: Request, now: float, *args: Any, **kwargs: Any) -> Any:
        decision = schedule(request, now, *args, **kwargs)
        estimates[request.request_id] = decision.ttft_s
        return decision

    conductor.schedule = spying  # type: ignore[method-assign]
    records = list(DisaggregatedCluster(spec, conductor).run(requests).records)
    return [estimates[r.request_id] for r in records], records


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("lengths", [(4096, 512), (32_768, 20_000, 9_000, 600), (20_000, 300, 20_000, 300)])
def test_in_a_pipeline_no_prompt_overtakes_the_one_ahead(group_size: int, lengths: tuple[int, ...]) -> None:
    """Prompts arriving together on one group, long ones ahead of short ones: each leaves the group (its first
    token) no sooner than the one ahead of it, and the Conductor's estimates are the TTFTs the simulator gives.
    A short prompt behind a long one used to end first, timed as if the pipeline were empty, on both sides."""
    spec = make_spec(num_prefill=group_size, cpp_group_size=group_size, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    requests = [
        make_request(f"r{i}", 0.0, tokens, 4, range(1000 * i, 1000 * i + -(-tokens // BLOCK)))
        for i, tokens in enumerate(lengths)
    ]
    estimates, records = estimates_and_records(spec, requests)
    firsts = [r.first_token_s for r in records]
    assert all(f is not None for f in firsts)
    assert firsts == sorted(firsts)
    assert [r.ttft_s for r in records] == pytest.approx(estimates, rel=1e-9)


def predicted_and_actual_ends(
    spec: Any, requests: list[Request]
) -> tuple[list[tuple[str, str, float]], dict[str, float], list[float], list[Any]]:
    """Replay `requests`, and after each event the Conductor handles note each queued prefill's predicted end
    (event, request, end); also each prefill's simulated end (its PrefillFinished), the TTFT estimates and the
    records."""
    conductor = build_conductor(spec, slo=PATIENT)
    estimates: dict[str, float] = {}
    predicted: list[tuple[str, str, float]] = []
    ended: dict[str, float] = {}
    schedule, handle = conductor.schedule, conductor.handle

    def scheduling(request: Request, now: float, *args: Any, **kwargs: Any) -> Any:
        decision = schedule(request, now, *args, **kwargs)
        estimates[request.request_id] = decision.ttft_s
        return decision

    def handling(event: Any) -> Any:
        ends = handle(event)
        if isinstance(event, PrefillFinished):
            ended[event.request_id] = event.now
        label = f"{type(event).__name__}({getattr(event, 'request_id', '')}) at {event.now}"
        predicted.extend((label, q.request_id, q.finish_s) for view in conductor.prefill_views for q in view.queue)
        return ends

    conductor.schedule = scheduling  # type: ignore[method-assign]
    conductor.handle = handling  # type: ignore[method-assign]
    records = list(DisaggregatedCluster(spec, conductor).run(requests).records)
    return predicted, ended, [estimates[r.request_id] for r in records], records


def test_the_one_ahead_still_holds_back_the_next_once_it_has_left() -> None:
    """A 32 k and a 16 k prompt at once on a group of two, and a 1 k one arriving just after the first has left
    (while the second is still in the group). The second leaves the last stage when the first left it plus its
    own time there, as predicted while the first was queued; the Conductor keeps that once the first reported its
    end (and at each event after, the third's start among them), and the third's TTFT estimate (behind the second) is the TTFT simulated. The Conductor used to retime the
    second as if the group had been empty (its end 0.14 s early), and estimated the third as much too soon."""
    spec = make_spec(num_prefill=2, cpp_group_size=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    first = make_request("first", 0.0, 32_768, 2, range(64))
    second = make_request("second", 0.0, 16_384, 2, range(1000, 1032))
    _, ended, _, _ = predicted_and_actual_ends(spec, [first, second])
    # The second is held back at the last stage: it leaves when the first has, plus its own time there.
    assert ended["second"] == pytest.approx(ended["first"] + occupancy_s(spec.prefill_cost, 16_384), rel=1e-12)
    third = make_request("third", round(ended["first"] + 0.01, 3), 1024, 2, range(2000, 2002))
    predicted, ended, estimates, records = predicted_and_actual_ends(spec, [first, second, third])
    assert [r.ttft_s for r in records] == pytest.approx(estimates, rel=1e-9)
    left = next(i for i, (label, _, _) in enumerate(predicted) if label.startswith("PrefillFinished(first)"))
    seconds = [(label, end) for label, request_id, end in predicted[left:] if request_id == "second"]
    assert len(seconds) > 1  # the third's start retimed the queue too, the second still at its head
    assert seconds == [(label, pytest.approx(ended["second"], rel=1e-12)) for label, _ in seconds]


@pytest.mark.parametrize("leaves", ["finished", "aborted"])
def test_the_head_s_end_holds_back_the_next_only_if_it_ended(leaves: str) -> None:
    """Two prompts running together on a group, the long one ahead. Reported finished on time, the long one
    leaves the short one's predicted end as it was (the long one's end plus the short one's time on the last
    stage), through later retimes too (a repeated start report). Aborted at the same moment, it leaves no time
    behind: the short one is alone in the group and ends its own prefill after its start (an engine drops an
    aborted prompt's chunks; the simulator aborts none)."""
    spec = make_spec(num_prefill=2, cpp_group_size=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    conductor = build_conductor(spec, slo=PATIENT)
    group = InstanceId("prefill-0")
    for name, tokens, base in (("long", 32_768, 0), ("short", 16_384, 1000)):
        decision = conductor.schedule(make_request(name, 0.0, tokens, 2, range(base, base + tokens // BLOCK)), 0.0)
        assert decision.accepted and decision.prefill_instance == group
    (view,) = conductor.prefill_views
    long, short = view.queue
    assert short.finish_s == long.finish_s + short.occupancy_s > short.start_s + short.prefill_s  # held back
    conductor.handle(PrefillStarted(request_id=long.request_id, instance_id=group, now=long.start_s))
    conductor.handle(PrefillStarted(request_id=short.request_id, instance_id=group, now=short.start_s))
    if leaves == "finished":
        conductor.handle(PrefillFinished(request_id=long.request_id, instance_id=group, now=long.finish_s))
        expected = long.finish_s + short.occupancy_s
    else:
        conductor.handle(RequestAborted(request_id=long.request_id, now=long.finish_s))
        expected = short.start_s + short.prefill_s
    assert [q.finish_s for q in view.queue] == [expected]
    conductor.handle(PrefillStarted(request_id=short.request_id, instance_id=group, now=short.start_s))
    assert [q.finish_s for q in view.queue] == [expected]
    conductor.check_invariants()


@st.composite
def pipeline_workloads(draw: st.DrawFn) -> tuple[int, int, list[Request]]:
    """Prefill nodes, their group size (one or two groups) and a few requests: prompts of 1 to 80 blocks, distinct
    or repeating the one before (a prefix reused in the group), arriving together or apart."""
    group_size = draw(st.sampled_from([2, 3, 4]))
    num_groups = draw(st.integers(1, 2))
    requests: list[Request] = []
    now = 0.0
    for i in range(draw(st.integers(2, 7))):
        now += draw(st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0, 3.0]))
        blocks = draw(st.integers(1, 80))
        tokens = blocks * BLOCK - draw(st.integers(0, BLOCK - 1))
        repeats = draw(st.booleans()) and requests
        base = int(requests[-1].block_keys[0]) if repeats else 1000 * i
        requests.append(make_request(f"r{i}", now, tokens, draw(st.integers(2, 6)), range(base, base + blocks)))
    return group_size * num_groups, group_size, requests


@REPLAY_SETTINGS
@given(pipeline_workloads())
@example(
    (2, 2, [make_request("a", 0.0, 32_768, 2, range(64)), make_request("b", 0.0, 16_384, 2, range(1000, 1032))])
).via("a short prompt behind a long one, retimed once the long one has left")
def test_on_a_pipeline_the_predicted_ends_are_the_simulated_ones(workload: tuple[int, int, list[Request]]) -> None:
    """On chunked-pipeline groups, after every event the Conductor handles, each queued prefill's predicted end is
    the end the simulator gives it, and each TTFT estimate is the TTFT simulated (the two time prefills by one
    rule, `prefill_end_s`). They drifted once a prefill ahead left the Conductor's queue."""
    num_prefill, group_size, requests = workload
    spec = make_spec(num_prefill=num_prefill, cpp_group_size=group_size, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    predicted, ended, estimates, records = predicted_and_actual_ends(spec, requests)
    assert [r.ttft_s for r in records] == pytest.approx(estimates, rel=1e-9)
    for label, request_id, end in predicted:
        if request_id in ended:  # else never prefilled there (rejected before its prefill)
            assert end == pytest.approx(ended[request_id], rel=1e-12), f"{request_id} after {label}"


def test_a_prompt_repeating_one_still_in_the_pipeline_reuses_its_blocks() -> None:
    """Two identical 40-block prompts at once on one group: the second enters once the first has left the first
    stage, whose KV of the prompt is computed by then (and so on, stage by stage): it reuses all but its last
    block, as the Conductor counted (the first's blocks pending there), and its TTFT is the estimate. It used to
    be charged the whole prompt, though estimated at the cached one."""
    spec = make_spec(num_prefill=2, cpp_group_size=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    requests = [make_request(name, 0.0, 40 * BLOCK, 4, range(40)) for name in ("first", "again")]
    estimates, (first, again) = estimates_and_records(spec, requests)
    assert (first.prefix_tokens, again.prefix_tokens) == (0, 39 * BLOCK)
    assert [first.ttft_s, again.ttft_s] == pytest.approx(estimates, rel=1e-9)


def test_a_moved_prefix_is_what_the_transfer_brought() -> None:
    """B is planned to fetch the 4 blocks node 0 holds of its prompt while it waits behind a long prompt on node 1;
    meanwhile node 0 computes the whole of B's prompt for another request. B reuses the 4 blocks moved (and its
    estimate's prefill), not the 39 node 0 holds when B starts: the plan moved 4."""
    spec = make_spec(num_prefill=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    prompt = list(range(5000, 5040))
    requests = [
        make_request("a", 0.0, 4 * BLOCK, 2, prompt[:4]),  # node 0 holds 4 blocks of the prompt
        make_request("long", 10.0, 60 * BLOCK, 2, range(9000, 9060)),  # node 1 is busy for seconds
        make_request("b", 10.01, 40 * BLOCK, 2, prompt),  # on node 1, moving node 0's 4 blocks
        make_request("whole", 10.02, 40 * BLOCK - 1, 2, prompt),  # node 0 computes the whole prompt meanwhile
    ]
    routes = [(0, None, True, 0), (1, None, True, 0), (1, 0, True, 0), (0, None, True, 0)]
    records = {r.request_id: r for r in replay(spec, requests, router=scripted(routes), slo=PATIENT).records}
    assert records["whole"].first_token_s is not None and records["b"].first_token_s is not None
    assert records["whole"].first_token_s < records["b"].first_token_s - records["b"].prefill_s  # done before B starts
    assert records["b"].prefix_tokens == 4 * BLOCK
    assert records["b"].prefill_s == spec.prefill_cost.prefill_s(40 * BLOCK, 4 * BLOCK)


@pytest.mark.parametrize("network_bytes_per_s", [2e9, 100e9])
def test_the_decode_load_is_asked_for_when_the_request_reaches_its_decode_instance(network_bytes_per_s: float) -> None:
    """A 20 k-token prompt on a slow link: its KV, streamed during the prefill, is still arriving after it. The
    Conductor asks the predictor about the decode load at the moment the simulator delivers the request to its
    (idle) decode instance, the KV's tail included (`TransferCostModel.handoff_s`); it asked at the first token."""
    spec = make_spec(network_bytes_per_s=network_bytes_per_s, first_token_overhead_s=0.01)
    asked: list[float] = []
    inner = UniformDecodePredictor(decode_s=10.0)

    class Recording:
        def predict(self, active: Any, incoming: Any, now: float, at_s: float) -> Any:
            asked.append(at_s)
            return inner.predict(active, incoming, now, at_s)

        def observe(self, output_tokens: int) -> None:
            inner.observe(output_tokens)

    conductor = build_conductor(
        spec,
        admission=predictive_early_rejection(),
        predictor=Recording(),
        slo=PATIENT,  # type: ignore[arg-type]
    )
    joined: list[float] = []
    handle = conductor.handle

    def spying(event: Any) -> Any:
        if isinstance(event, DecodeJoined):
            joined.append(event.now)
        return handle(event)

    conductor.handle = spying  # type: ignore[method-assign]
    (record,) = DisaggregatedCluster(spec, conductor).run([make_request("r", 0.0, 40 * BLOCK, 8, range(40))]).records
    assert record.first_token_s is not None and joined and asked
    assert asked[0] == pytest.approx(joined[0], rel=1e-9)
    if network_bytes_per_s < 1e10:  # the tail shows
        assert joined[0] > record.first_token_s + 0.1
