"""Edge contracts of the simulated clusters and their metrics that the module tests leave open.

A mutation round over `mooncake.sim.disaggregated`, `mooncake.sim.coupled` and
`mooncake.sim.metrics`: each test pins a rule the module docstrings state and
that some plausible slip in the code broke unnoticed by the other tests.

- Disaggregated: a planned KV transfer delays the prefill by the transfer
  model's time, slowed by the transfers in flight from the same source, and
  overlaps the queue wait; prefill instances are FIFO (a property); inline
  prefill at exactly its limit, never for one output token; a CPP group caches
  X nodes' worth; a decode node frees the KV of ended requests and counts its
  joiners' batch slots; it checks a KV arriving mid-step at that step's end,
  after the members it finished left, in order of arrival, and cuts a stretch
  there; a rejection after prefill tries the waiting line; load
  samples and `decode_load` count what the cluster holds; `replay`'s default
  t_d comes from the SLO it is given.
- Coupled: `cache_capacity_tokens` and `max_batch_size` bind; a chunked prefill
  computes its last token; instances are FIFO (a property).
- Metrics: `Summary.rejected` and `to_json`.

Scripted routers and admission policies make the Conductor's choices known in
advance, so the expected times follow from the cost models alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings

from mooncake.errors import InvalidRequestError
from mooncake.sched.admission import AdmissionDecision, BaselineAdmission, EarlyRejection
from mooncake.sched.join import DecodeLimits, DecodeLoad
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim.coupled import CoupledCluster, CoupledSpec
from mooncake.sim.disaggregated import DisaggregatedCluster, replay
from mooncake.sim.metrics import RequestRecord, Summary, summarize
from mooncake.sim.spec import ClusterSpec, build_conductor
from mooncake.types import InstanceId, Request, RequestId, Slo
from mooncake.workload.trace_record import MAX_ARRIVAL_S
from tests.sim.test_coupled import coupled_specs, small_hbm
from tests.sim.test_disaggregated import (
    A800,
    BLOCK,
    H800,
    INFINITE_CACHE_TOKENS,
    LLAMA3,
    cluster_specs,
    conductor_options,
    make_request,
    make_spec,
    workloads,
)

PATIENT = Slo(ttft_s=1000.0, tbt_s=1.0)  # nothing is refused for time: the scripted routes all run


@attrs.define
class _Script:
    """A test router that routes the n-th request as `routes[n]` says: (target index, source index or None, keep the
    moved copy, congestion the estimate counts). A source means: move the source's prefix of the prompt to the target."""

    estimator: Any
    routes: Sequence[tuple[int, int | None, bool, int]]
    routed: int = 0

    def route(self, candidates: Any, query: Any, now: float, rng: Any) -> Any:
        target, source, keep, congestion = self.routes[self.routed]
        self.routed += 1
        view = candidates[target]
        if source is None:
            return self.estimator.decide_local(view, query, now)
        holder = candidates[source].instance_id
        return self.estimator.decide(
            view,
            query,
            now,
            prefix_blocks=query.prefix_blocks.get(holder, 0),
            transfer_from=holder,
            keep_copy=keep,
            congestion=congestion,
        )

    def observe(self, *, had_transfer: bool, estimated_ttft_s: float, observed_ttft_s: float) -> None:
        pass


def scripted(routes: Sequence[tuple[int, int | None, bool, int]]) -> Any:
    """A router factory (what `replay` takes) for `_Script`."""
    return lambda estimator: _Script(estimator, routes)


# --------------------------------------------------------------------------- disaggregated: transfers


def test_a_moved_prefix_delays_the_prefill_by_its_transfer_slowed_by_those_in_flight() -> None:
    """A's prompt is prefilled on node 0. Later B and C, continuing it, arrive together and are sent to idle nodes 1
    and 2 with A's prefix moved from node 0: B's prefill starts when its transfer has arrived (the transfer model's
    time for the prefix's bytes), C's when its own has, slowed by B's still in flight from the same source; D, moved
    from node 0 once both have arrived, is slowed by neither. Each TTFT is that wait plus the cost model's prefill."""
    spec = make_spec(num_prefill=3, cache_capacity_tokens=INFINITE_CACHE_TOKENS, network_bytes_per_s=1e9)
    prefix_blocks, blocks = 8, 10
    requests = [
        make_request("a", 0.0, prefix_blocks * BLOCK, 2, range(prefix_blocks)),
        make_request("b", 100.0, blocks * BLOCK, 2, range(blocks)),
        make_request("c", 100.0, blocks * BLOCK, 2, [*range(prefix_blocks), 500, 501]),
        make_request("d", 200.0, blocks * BLOCK, 2, [*range(prefix_blocks), 600, 601]),
    ]
    routes = [(0, None, True, 0), (1, 0, False, 0), (2, 0, False, 1), (1, 0, False, 0)]
    records = {r.request_id: r for r in replay(spec, requests, router=scripted(routes), slo=PATIENT).records}
    moved_bytes = prefix_blocks * BLOCK * spec.model.kv_bytes_per_token
    prefill_s = spec.prefill_cost.prefill_s(blocks * BLOCK, prefix_blocks * BLOCK)
    transfer = spec.transfer_cost
    for name, in_flight in (("b", 0), ("c", 1), ("d", 0)):
        record = records[RequestId(name)]
        assert record.outcome == Outcome.COMPLETED and record.prefix_tokens == prefix_blocks * BLOCK, name
        expected = transfer.transfer_s(moved_bytes, in_flight_from_source=in_flight) + prefill_s
        assert record.ttft_s is not None and math.isclose(record.ttft_s, expected, rel_tol=1e-9), name
    assert transfer.transfer_s(moved_bytes, in_flight_from_source=1) > transfer.transfer_s(moved_bytes) + 1.0


@pytest.mark.parametrize("queue_longer", [True, False])
def test_a_transfer_overlaps_the_wait_in_the_queue(queue_longer: bool) -> None:
    """The prefill of a request whose prefix moves starts when both its transfer and the request ahead of it are
    done: A's prefix moves to node 1 for B while node 1 prefills X; B's TTFT is the longer of the two plus its own
    prefill (a long X hides the transfer, a short one does not)."""
    spec = make_spec(num_prefill=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS, network_bytes_per_s=1e9)
    x_tokens = 30_000 if queue_longer else 600
    requests = [
        make_request("a", 0.0, 8 * BLOCK, 2, range(8)),
        make_request("x", 100.0, x_tokens, 2, range(5000, 5000 + -(-x_tokens // BLOCK))),
        make_request("b", 100.0, 10 * BLOCK, 2, range(10)),
    ]
    routes = [(0, None, True, 0), (1, None, True, 0), (1, 0, False, 0)]
    records = {r.request_id: r for r in replay(spec, requests, router=scripted(routes), slo=PATIENT).records}
    x, b = records[RequestId("x")], records[RequestId("b")]
    transfer_s = spec.transfer_cost.transfer_s(8 * BLOCK * spec.model.kv_bytes_per_token)
    assert (x.prefill_s > transfer_s) == queue_longer  # both cases are met
    expected = max(transfer_s, x.prefill_s) + spec.prefill_cost.prefill_s(10 * BLOCK, 8 * BLOCK)
    assert b.ttft_s is not None and math.isclose(b.ttft_s, expected, rel_tol=1e-9)


# --------------------------------------------------------------------------- disaggregated: inline prefill, limits


def test_inline_prefill_takes_a_prompt_of_exactly_the_limit_and_never_a_one_token_request() -> None:
    """`inline_prefill_tokens` n: a prompt of n tokens is prefilled inside its decode batch, one of n + 1 is not;
    a request of one output token (nothing to decode) always goes to a prefill node and ends with its first token."""
    spec = make_spec(inline_prefill_tokens=512, decode_hardware=H800)
    (at_limit,) = replay(spec, [make_request("at", 2.0, 512, 5, [1])]).records
    assert at_limit.outcome == Outcome.COMPLETED and at_limit.inline_prefill and at_limit.prefill_instance is None
    (past_limit,) = replay(spec, [make_request("past", 2.0, 513, 5, [1, 2])]).records
    assert past_limit.outcome == Outcome.COMPLETED and not past_limit.inline_prefill
    (one_token,) = replay(spec, [make_request("one", 2.0, 300, 1, [1])]).records
    assert one_token.outcome == Outcome.COMPLETED and not one_token.inline_prefill
    assert one_token.prefill_instance is not None and one_token.finish_s == one_token.first_token_s
    assert one_token.intervals.count == 0


def test_inline_prefills_waiting_for_one_step_keep_its_tbt_together() -> None:
    """Six short prompts arrive at once beside a long decode: each inline prefill is checked with those already
    waiting for the same step (the step stalls for all of them), so no token interval passes the TBT objective;
    checked alone, each fit and the step carrying them took 245 ms against 100. Those that do not fit go to a
    prefill node, and every request completes."""
    slo = Slo(ttft_s=30.0, tbt_s=0.1)
    requests = [make_request("long", 0.0, 2000, 400, range(4))]
    requests += [make_request(f"short{i}", 1.0, 400, 5, [100 * i]) for i in range(1, 7)]
    records = replay(make_spec(num_prefill=4, inline_prefill_tokens=500), requests, slo=slo).records
    assert all(r.outcome == Outcome.COMPLETED for r in records)
    inline = [r for r in records if r.inline_prefill]
    # Exactly as many as fit one step's objective together: the plain step plus k stalls within it, one more past it.
    (long,) = [r for r in records if r.request_id == "long"]
    step_s, stall_s = min(long.intervals.listed()), inline[0].prefill_s
    assert step_s + len(inline) * stall_s <= slo.tbt_s < step_s + (len(inline) + 1) * stall_s
    assert max(max(r.intervals.listed()) for r in records) <= slo.tbt_s


def test_a_prompt_computed_whole_is_simulated_whole() -> None:
    """A request that does not reuse a prefix (prompt log-probabilities) is routed and estimated as computed whole
    by the Conductor; the simulated instance computes it whole too, in both clusters, though the prefix is cached."""
    shared = list(range(30))
    requests = [make_request("first", 0.0, 15_360, 2, shared)]
    requests.append(attrs.evolve(make_request("again", 100.0, 15_360, 2, shared), reuses_prefix=False))
    first, again = replay(make_spec(), requests, slo=PATIENT).records
    assert again.prefix_tokens == 0 and again.prefill_s == pytest.approx(first.prefill_s)
    _, again = CoupledCluster(coupled_spec()).run(requests).records
    assert again.prefix_tokens == 0


def test_the_coupled_baseline_refuses_requests_keyed_in_another_block_size() -> None:
    """Keys of 64-token blocks given to a cluster of 512-token blocks: the disaggregated cluster's Conductor
    refuses them, and so does the coupled baseline (it used to match them as 512-token blocks: a hit ratio
    nearly twice the true one)."""
    request = attrs.evolve(make_request("small", 0.0, 640, 2, range(10)), block_size_tokens=64)
    for run in (lambda: replay(make_spec(), [request]), lambda: CoupledCluster(coupled_spec()).run([request])):
        with pytest.raises(InvalidRequestError, match="keyed in 64-token blocks, this cluster's blocks are 512"):
            run()


def test_both_clusters_refuse_an_arrival_past_what_a_replay_times() -> None:
    """An arrival past 2**43 ms (MAX_ARRIVAL_S, the bound on a trace's timestamps) is refused by name: out there a
    step added to the clock barely moves it, and a replay once ran on, its figures of no meaning (goodput 0)."""
    late = make_request("late", 1e12, 640, 2, range(2))
    for run in (lambda: replay(make_spec(), [late]), lambda: CoupledCluster(coupled_spec()).run([late])):
        with pytest.raises(InvalidRequestError, match=r"request late arrives at 1e\+12 s, past the 8.796e\+09 s"):
            run()
    on_time = attrs.evolve(late, arrival_s=MAX_ARRIVAL_S)  # the bound itself is a time a replay takes
    assert replay(make_spec(), [on_time]).records[0].outcome is Outcome.COMPLETED


def test_a_decode_node_frees_the_kv_of_the_requests_that_ended() -> None:
    """A decode node of 3,000 KV tokens serves requests of 2,050 (prompt + output) one after another: each ends
    before the next arrives, so each finds the room the one before left, whichever admission decides."""
    spec = make_spec(
        decode_node_limits=DecodeLimits(kv_capacity_tokens=3000), cache_capacity_tokens=INFINITE_CACHE_TOKENS
    )
    requests = [make_request(f"r{i}", 60.0 * i, 2000, 50, range(100 * i, 100 * i + 4)) for i in range(4)]
    for admission in (BaselineAdmission(), EarlyRejection()):
        records = replay(spec, requests, admission=admission, slo=PATIENT).records
        assert [r.outcome for r in records] == [Outcome.COMPLETED] * 4
        assert all(r.finish_s is not None and r.finish_s < 60.0 * (i + 1) for i, r in enumerate(records))


def test_joiners_count_against_the_batch_slots() -> None:
    """A decode node of one batch slot: two requests whose KV arrives within one decode step of each other (the
    first has not joined the batch yet, it waits for the step boundary) cannot both join: the second is refused by
    the node's own check, after its prefill, for the full batch."""
    spec = make_spec(
        num_prefill=2,
        decode_node_limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1),
        cache_capacity_tokens=INFINITE_CACHE_TOKENS,
    )
    requests = [make_request("a", 0.0, 1000, 50, [1, 2]), make_request("b", 0.0, 1000, 50, [3, 4])]
    routes = [(0, None, True, 0), (1, None, True, 0)]
    a, b = replay(spec, requests, router=scripted(routes), admission=BaselineAdmission(), slo=PATIENT).records
    assert a.outcome == Outcome.COMPLETED
    assert (b.outcome, b.reason) == (Outcome.REJECTED_AFTER_PREFILL, Reason.BATCH_FULL)


def kv_arriving_at(spec: ClusterSpec, name: str, arrives_s: float, keys: Sequence[int]) -> Request:
    """A request of 1,000 prompt tokens whose KV reaches its decode node at `arrives_s`, when it is prefilled at once
    (an idle prefill node, nothing cached): its prefill and what the prefill does not hide of the KV stream."""
    prefill_s = spec.prefill_cost.prefill_s(1000, 0)
    handoff_s = spec.transfer_cost.handoff_s(1000 * spec.model.kv_bytes_per_token, prefill_s)
    return make_request(name, arrives_s - prefill_s - handoff_s, 1000, 10, keys)


@pytest.mark.parametrize("limit", ["batch slots", "kv"])
@pytest.mark.parametrize("analytic", [True, False])
def test_kv_arriving_mid_step_is_checked_after_the_members_that_step_finishes(limit: str, analytic: bool) -> None:
    """A decode node with room for one of A and B (one batch slot, or KV for one reservation). B's KV arrives in
    the middle of A's last step: the node decides between steps, as the example cluster's decode worker does
    (`DecodeEngine.try_join` after `step()` retired its finished requests), so B joins when A leaves, and its
    first decode token comes one step of B alone later; stepping one by one gives the same."""
    limits = (
        DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1)
        if limit == "batch slots"
        else DecodeLimits(kv_capacity_tokens=(1000 + 20) + (1000 + 10) - 1)
    )
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, decode_node_limits=limits, analytic_decode=analytic)
    first = make_request("a", 0.0, 1000, 20, [1, 2])
    (alone,) = replay(spec, [first], admission=BaselineAdmission(), slo=PATIENT).records
    before_last, last = token_times(alone)[-2:]
    second = kv_arriving_at(spec, "b", (before_last + last) / 2, [10, 11])
    a, b = replay(spec, [first, second], admission=BaselineAdmission(), slo=PATIENT).records
    assert a.outcome == b.outcome == Outcome.COMPLETED, (b.outcome, b.reason)
    assert a.finish_s == pytest.approx(last, rel=1e-12)
    assert token_times(b)[0] == pytest.approx(last + spec.decode_cost.step_s(1, 1000), rel=1e-9)


def test_kvs_waiting_for_a_step_boundary_are_checked_in_their_order_of_arrival() -> None:
    """One batch slot; the KV of B, then of C, arrives during A's last step (from two prefill nodes): at the step's
    end A has left, B takes the slot, and C, checked after B, finds it full: refused after its prefill."""
    spec = make_spec(
        num_prefill=2,
        cache_capacity_tokens=INFINITE_CACHE_TOKENS,
        decode_node_limits=DecodeLimits(kv_capacity_tokens=10**6, max_batch_size=1),
    )
    first = make_request("a", 0.0, 1000, 20, [1, 2])
    (alone,) = replay(spec, [first], admission=BaselineAdmission(), slo=PATIENT).records
    before_last, last = token_times(alone)[-2:]
    step_s = last - before_last
    second = kv_arriving_at(spec, "b", before_last + step_s / 3, [10, 11])
    third = kv_arriving_at(spec, "c", before_last + 2 * step_s / 3, [20, 21])
    a, b, c = replay(spec, [first, second, third], admission=BaselineAdmission(), slo=PATIENT).records
    assert b.prefill_instance != c.prefill_instance  # both prefilled at once, as `kv_arriving_at` times them
    assert a.outcome == b.outcome == Outcome.COMPLETED
    assert (c.outcome, c.reason) == (Outcome.REJECTED_AFTER_PREFILL, Reason.BATCH_FULL)
    assert token_times(b)[0] == pytest.approx(last + spec.decode_cost.step_s(1, 1000), rel=1e-9)


@pytest.mark.parametrize("analytic", [True, False])
def test_kv_arriving_mid_stretch_joins_at_the_next_step_boundary(analytic: bool) -> None:
    """A decodes a long stretch alone; B's KV arrives in the middle of one of its steps: the stretch is cut at that
    step's end, where B joins, so B's first decode token comes with A's token of the next step."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, analytic_decode=analytic)
    first = make_request("a", 0.0, 1000, 400, [1, 2])
    (alone,) = replay(spec, [first], admission=BaselineAdmission(), slo=PATIENT).records
    times = token_times(alone)
    second = kv_arriving_at(spec, "b", (times[200] + times[201]) / 2, [10, 11])
    a, b = replay(spec, [first, second], admission=BaselineAdmission(), slo=PATIENT).records
    assert a.outcome == b.outcome == Outcome.COMPLETED
    assert np.allclose(token_times(a)[:202], times[:202], rtol=1e-12)  # alone until B joins
    assert token_times(b)[0] == pytest.approx(token_times(a)[202], rel=1e-12)


def test_a_chunked_pipeline_group_caches_what_all_its_nodes_hold() -> None:
    """With `cpp_group_size` X, a prefill instance is X nodes, and its cache holds X nodes' `cache_capacity_tokens`:
    a prompt of 12 blocks fits a group of two nodes of 8 blocks each, and its repeat reuses all but its last block."""
    spec = make_spec(num_prefill=2, cpp_group_size=2, cache_capacity_tokens=8 * BLOCK)
    requests = [make_request("a", 0.0, 12 * BLOCK, 2, range(12)), make_request("b", 100.0, 12 * BLOCK, 2, range(12))]
    first, repeat = replay(spec, requests).records
    assert (first.prefix_tokens, repeat.prefix_tokens) == (0, 11 * BLOCK)
    alone = replay(attrs.evolve(spec, num_prefill=1, cpp_group_size=1), requests).records[1]
    assert alone.prefix_tokens < 11 * BLOCK  # one node's cache does not hold it


@pytest.mark.parametrize(("capacity_blocks", "reused_blocks"), [(0, 0), (4, 4), (12, 11)])
def test_a_prompt_longer_than_a_nodes_cache_leaves_its_head_there(capacity_blocks: int, reused_blocks: int) -> None:
    """A prompt of 12 blocks on a node whose cache holds 4: its first 4 blocks stay and its repeat reuses them (the
    cache kept the last 4 before, which no prompt matches); a cache of 0 holds nothing (it held one page)."""
    spec = make_spec(num_prefill=1, cache_capacity_tokens=capacity_blocks * BLOCK)
    requests = [make_request("a", 0.0, 12 * BLOCK, 2, range(12)), make_request("b", 100.0, 12 * BLOCK, 2, range(12))]
    first, repeat = replay(spec, requests).records
    assert (first.prefix_tokens, repeat.prefix_tokens) == (0, reused_blocks * BLOCK)


# --------------------------------------------------------------------------- disaggregated: load


def token_times(record: RequestRecord) -> np.ndarray:
    """When each of a completed record's tokens after the first came out."""
    assert record.first_token_s is not None
    return record.first_token_s + np.cumsum(record.intervals.values())


def test_load_samples_count_a_request_in_prefill_then_in_decode_then_nowhere() -> None:
    """A long prompt alone: the samples during its prefill show it in prefill, those while it decodes show it in
    decode, and those in the idle time before a second, much later, request show an empty cluster."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, sample_interval_s=0.25)
    requests = [make_request("a", 0.0, 20_000, 100, range(40)), make_request("b", 30.0, 1000, 2, [900, 901])]
    result = replay(spec, requests, slo=PATIENT)
    a = result.records[0]
    assert a.outcome == Outcome.COMPLETED and a.first_token_s is not None and a.finish_s is not None
    assert a.first_token_s > 1.0 and a.finish_s < 20.0
    joined_s = a.first_token_s + a.intervals.values()[0]  # by then it decodes (its KV arrived before this token)
    by_phase: dict[str, set[tuple[int, int]]] = {"prefill": set(), "decode": set(), "idle": set()}
    for sample in result.load:
        counts = (sample.prefill_requests, sample.decode_requests)
        if 0.0 < sample.time_s < a.first_token_s:
            by_phase["prefill"].add(counts)
        elif joined_s < sample.time_s < a.finish_s:
            by_phase["decode"].add(counts)
        elif a.finish_s < sample.time_s < 30.0:
            by_phase["idle"].add(counts)
    assert by_phase == {"prefill": {(1, 0)}, "decode": {(0, 1)}, "idle": {(0, 0)}}


def test_decode_load_counts_the_tokens_grown_within_a_stretch() -> None:
    """`DisaggregatedCluster.decode_load` at a moment inside a long decode stretch: one request, the KV a step reads
    (its prompt plus the tokens generated by then, as the record's token times count them), and its reservation
    (prompt + output); an idle instance holds nothing."""
    spec = make_spec(num_decode=2, cache_capacity_tokens=INFINITE_CACHE_TOKENS)
    request = make_request("a", 0.0, 3000, 400, range(6))
    (reference,) = replay(spec, [request], slo=PATIENT).records
    times = token_times(reference)
    probes = [float((times[k] + times[k + 1]) / 2) for k in (3, 150, 390)]
    cluster = DisaggregatedCluster(spec, build_conductor(spec, slo=PATIENT, decode_s=5.0))
    instances = [view.instance_id for view in cluster.conductor.decode_views]
    seen: list[dict[InstanceId, DecodeLoad]] = []
    for at_s in probes:
        cluster.loop.at(at_s, lambda now: seen.append({i: cluster.decode_load(i, now) for i in instances}))
    (record,) = cluster.run([request]).records
    assert record.decode_instance is not None and np.allclose(token_times(record), times, rtol=1e-12)
    expected = [DecodeLoad(1, 3000 + int(np.sum(times <= at_s)), 3400) for at_s in probes]
    assert [loads[record.decode_instance] for loads in seen] == expected
    idle = {load for loads in seen for i, load in loads.items() if i != record.decode_instance}
    assert idle == {DecodeLoad(0, 0, 0)}


@attrs.define
class _RefuseThird:
    """A test admission policy: admits every request but the third it is asked about, which it refuses for a full
    batch (room the decode side frees), so that request waits in line if the cluster lets it."""

    asked: int = 0
    name: str = "refuse-third"
    load_at: str = "none"

    def admit(self, route: Any, decode: Any, slo: Slo) -> AdmissionDecision:
        self.asked += 1
        return AdmissionDecision(False, Reason.BATCH_FULL) if self.asked == 3 else AdmissionDecision(True)


def test_a_rejection_after_prefill_lets_the_line_in() -> None:
    """A decodes a long context; R is admitted and prefilled, then refused by its decode node (with R, A's batch
    breaks the TBT objective); W, refused for room while R was in flight, waits in line. R's refusal may have made
    room, so W is tried then (not when A ends, tens of seconds later, nor at its deadline): its first token comes
    within a second of R's refusal (at the decode step boundary after R's KV arrived, within a second of R's
    prefill; R has no first token: its client got none)."""
    spec = make_spec(cache_capacity_tokens=INFINITE_CACHE_TOKENS, admission_wait_s=100.0)
    slo = Slo(ttft_s=1000.0, tbt_s=spec.decode_cost.step_s(1, 8500))
    requests = [
        make_request("a", 0.0, 8000, 2000, range(16)),
        make_request("r", 3.0, 1000, 10, [100, 101]),
        make_request("w", 3.01, 100, 10, [200]),
    ]
    a, r, w = replay(spec, requests, admission=_RefuseThird(), slo=slo).records  # type: ignore[arg-type]
    assert a.outcome == Outcome.COMPLETED and a.first_token_s is not None and a.first_token_s < 3.0
    assert (r.outcome, r.reason) == (Outcome.REJECTED_AFTER_PREFILL, Reason.TBT_SLO)
    assert r.first_token_s is None and w.first_token_s is not None
    prefilled_s = r.arrival_s + r.prefill_s  # its prefill node was idle: A's prefill ended before 3 s
    assert prefilled_s < w.first_token_s < prefilled_s + 1.0


# --------------------------------------------------------------------------- coupled


def coupled_spec(**options: Any) -> CoupledSpec:
    return CoupledSpec(**{"num_instances": 1, "model": LLAMA3, "hardware": A800, **options})


@pytest.mark.parametrize(("capacity_blocks", "reused_blocks"), [(0, 0), (4, 4), (8, 7), (None, 7)])
def test_the_coupled_prefix_cache_holds_what_its_capacity_says(capacity_blocks: int | None, reused_blocks: int) -> None:
    """`cache_capacity_tokens` bounds a coupled instance's prefix cache: 0 caches nothing (a repeat recomputes its
    prompt), half the prompt's size holds its first half, the prompt's size all of it, and None (its KV capacity)
    too."""
    tokens = None if capacity_blocks is None else capacity_blocks * BLOCK
    spec = coupled_spec(cache_capacity_tokens=tokens)
    requests = [make_request(name, t, 8 * BLOCK, 3, range(8)) for name, t in (("a", 0.0), ("b", 60.0))]
    first, repeat = CoupledCluster(spec).run(requests).records
    assert (first.prefix_tokens, repeat.prefix_tokens) == (0, reused_blocks * BLOCK)
    assert repeat.ttft_s is not None
    assert math.isclose(repeat.ttft_s, spec.prefill_cost.prefill_s(8 * BLOCK, reused_blocks * BLOCK), rel_tol=1e-9)


@pytest.mark.parametrize("chunked_prefill", [False, True])
def test_a_coupled_instance_runs_at_most_max_batch_size_requests(chunked_prefill: bool) -> None:
    """`max_batch_size` 2 (vLLM's max_num_seqs): of four requests at once on one instance, the third is prefilled
    only once one of the first two has finished, and no three decode at once."""
    spec = coupled_spec(max_batch_size=2, chunked_prefill=chunked_prefill)
    requests = [make_request(f"r{i}", 0.0, 1000, 40, range(10 * i, 10 * i + 2)) for i in range(4)]
    records = CoupledCluster(spec).run(requests).records
    assert all(r.outcome == Outcome.COMPLETED and r.first_token_s is not None for r in records)
    finishes = sorted(r.finish_s for r in records[:2] if r.finish_s is not None)
    assert records[2].first_token_s is not None and records[2].first_token_s >= finishes[0]
    for record in records:
        assert record.first_token_s is not None
        decoding = [
            r
            for r in records
            if r.first_token_s is not None
            and r.finish_s is not None
            and r.first_token_s <= record.first_token_s < r.finish_s
        ]
        assert len(decoding) <= 2


@pytest.mark.parametrize("extra_tokens", [-1, 0, 1, 2, 257])
def test_a_chunked_prefill_computes_every_token_of_the_prompt(extra_tokens: int) -> None:
    """Chunked prefill under a budget of 256 tokens: a lone prompt of about one budget (one token short of it, on
    it, one or two past it, a budget and one past it) is done only once its last token's chunk has run: its
    TTFT is the chunks' prefill times, which add up to the whole prompt's."""
    spec = coupled_spec(chunked_prefill=True, token_budget=256)
    tokens = 256 + extra_tokens
    (record,) = CoupledCluster(spec).run([make_request("only", 0.5, tokens, 4, range(-(-tokens // BLOCK)))]).records
    chunks = [(start, min(start + 256, tokens)) for start in range(0, tokens, 256)]
    expected = sum(spec.prefill_cost.prefill_s(end, start) for start, end in chunks)
    assert record.ttft_s is not None and math.isclose(record.ttft_s, expected, rel_tol=1e-9)
    assert math.isclose(record.prefill_s, expected, rel_tol=1e-9)


def test_a_chunk_beside_one_decoding_request_is_the_budget_less_one_token() -> None:
    """Beside one decoding request, every iteration carries its token and a chunk of the rest of the 256-token
    budget, 255 tokens: a prompt of ten such chunks takes exactly ten iterations of the decoding request (its ten
    intervals that carry a chunk), and its first token comes with the tenth."""
    spec = coupled_spec(chunked_prefill=True, token_budget=256)
    prompt = 10 * 255
    requests = [make_request("a", 0.0, 100, 3000, [0]), make_request("b", 1.0, prompt, 5, range(100, 105))]
    decoding, chunked = CoupledCluster(spec).run(requests).records
    intervals = decoding.intervals.values()
    carrying = np.flatnonzero(intervals > min(intervals) + spec.prefill_cost.prefill_s(255) / 2)
    assert chunked.outcome == Outcome.COMPLETED and len(carrying) == 10
    assert chunked.first_token_s is not None  # the tenth chunk's iteration ends the prompt's prefill
    assert math.isclose(chunked.first_token_s, token_times(decoding)[carrying[-1]], rel_tol=1e-12)


def test_a_coupled_request_that_does_not_fit_holds_up_the_line() -> None:
    """HBM for about 40,000 KV tokens: A (30,050 reserved) decodes; B (20,050) does not fit beside it and waits;
    C (1,050), which would fit, arrives after B and waits behind it (first come, first served): B is let in only
    once A has ended, never on the room C would need, and C after B."""
    cluster = CoupledCluster(coupled_spec(hardware=small_hbm()))
    requests = [
        make_request("a", 0.0, 30_000, 50, range(100, 159)),
        make_request("b", 0.001, 20_000, 50, range(200, 240)),
        make_request("c", 0.002, 1000, 50, range(300, 302)),
    ]
    a, b, c = cluster.run(requests).records
    assert a.outcome == b.outcome == c.outcome == Outcome.COMPLETED
    assert a.finish_s is not None and b.first_token_s is not None and c.first_token_s is not None
    assert a.finish_s <= b.first_token_s <= c.first_token_s


def test_a_coupled_prompt_continuing_an_earlier_one_reuses_all_of_it() -> None:
    """A prefill stores its whole prompt in the instance's prefix cache: a later prompt that continues it (its 8
    blocks, then 4 of its own) reuses all 8 blocks, the last one included."""
    requests = [make_request("a", 0.0, 8 * BLOCK, 3, range(8)), make_request("b", 60.0, 12 * BLOCK, 3, range(12))]
    first, longer = CoupledCluster(coupled_spec()).run(requests).records
    assert (first.prefix_tokens, longer.prefix_tokens) == (0, 8 * BLOCK)


def test_coupled_load_samples_count_a_decoding_request_then_nothing() -> None:
    """The load samples of a coupled instance: one request in decode (none in prefill) while its tokens come out,
    then an empty cluster until a much later request arrives."""
    spec = coupled_spec(sample_interval_s=0.25)
    requests = [make_request("a", 0.0, 1000, 300, [1, 2]), make_request("b", 30.0, 1000, 2, [3, 4])]
    result = CoupledCluster(spec).run(requests)
    a = result.records[0]
    assert a.first_token_s is not None and a.finish_s is not None and a.finish_s - a.first_token_s > 2.0
    decoding = {(s.prefill_requests, s.decode_requests) for s in result.load if a.first_token_s < s.time_s < a.finish_s}
    idle = {(s.prefill_requests, s.decode_requests) for s in result.load if a.finish_s < s.time_s < 30.0}
    assert (decoding, idle) == ({(0, 1)}, {(0, 0)})


# --------------------------------------------------------------------------- metrics


def test_a_summary_counts_both_rejections_and_its_json_holds_every_figure() -> None:
    """`Summary.rejected` is the requests refused before prefill plus those refused after it, and `to_json` gives
    every field by name (the `--json` of the replay tool), the simulator's wall time included."""
    records = [
        RequestRecord(RequestId("done"), 0.0, 100, 2, outcome=Outcome.COMPLETED, first_token_s=0.5, finish_s=1.0),
        RequestRecord(RequestId("before"), 0.1, 100, 2, outcome=Outcome.REJECTED_BEFORE_PREFILL),
        RequestRecord(RequestId("after-1"), 0.2, 100, 2, outcome=Outcome.REJECTED_AFTER_PREFILL, first_token_s=0.6),
        RequestRecord(RequestId("after-2"), 0.3, 100, 2, outcome=Outcome.REJECTED_AFTER_PREFILL, first_token_s=0.7),
    ]
    summary = summarize(records, Slo(), sim_wall_s=2.5)
    assert (summary.rejected_before_prefill, summary.rejected_after_prefill, summary.rejected) == (1, 2, 3)
    as_json = summary.to_json()
    assert set(as_json) == {field.name for field in attrs.fields(Summary)}
    assert Summary(**as_json) == summary and as_json["sim_wall_s"] == 2.5


# --------------------------------------------------------------------------- first come, first served


def assert_fifo(starts: list[tuple[str | None, float, float]]) -> None:
    """(instance, arrival, start) in arrival order: on each instance, starts never go back in time."""
    last: dict[str | None, float] = {}
    for instance, _arrival, start in starts:
        assert start >= last.get(instance, -math.inf) - 1e-9, (instance, start, last.get(instance))
        last[instance] = start


@settings(deadline=None)
@given(workloads(max_requests=10), cluster_specs(admission_wait_s=0.0, inline_prefill_tokens=0), conductor_options())
def test_a_prefill_instance_starts_its_requests_in_arrival_order(
    requests: list[Request], spec: ClusterSpec, options: dict[str, Any]
) -> None:
    """Prefill instances are FIFO servers (a request whose transfer is late holds up those behind it): the prefills
    of the requests one instance admitted end in their arrival order, on a chunked-pipeline group too (a short
    prompt that entered the group behind a long one cannot leave its last stage first)."""
    records = replay(spec, requests, slo=PATIENT, **options).records
    assert_fifo(
        [
            (r.prefill_instance, r.arrival_s, r.first_token_s)
            for r in records
            if r.first_token_s is not None and r.prefill_instance is not None
        ]
    )


@settings(deadline=None)
@given(workloads(max_requests=10), coupled_specs())
def test_a_coupled_instance_prefills_its_requests_in_arrival_order(requests: list[Request], spec: CoupledSpec) -> None:
    """A coupled instance takes its waiting requests first come, first served (vLLM's waiting queue), chunked or
    not: the first tokens of the requests one instance ran come in their arrival order."""
    records = CoupledCluster(spec).run(requests).records
    assert_fifo([(r.decode_instance, r.arrival_s, r.first_token_s) for r in records if r.first_token_s is not None])


@pytest.mark.parametrize("slo", [None, Slo(tbt_s=0.03), Slo(ttft_s=5.0, tbt_s=0.25)])
def test_replay_takes_t_d_from_the_workload_and_the_tbt_objective_it_is_given(
    slo: Slo | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a `decode_s` or a predictor, `replay` builds its Conductor with the workload's t_d: the mean output
    length times the TBT objective of the SLO it replays against (the default SLO's when none is given)."""
    import mooncake.sim.disaggregated as disaggregated

    built: list[Any] = []

    def spy(*args: Any, **options: Any) -> Any:
        built.append(options["decode_s"])
        return build_conductor(*args, **options)

    monkeypatch.setattr(disaggregated, "build_conductor", spy)
    requests = [make_request(str(i), 0.1 * i, 500, output, [i]) for i, output in enumerate([2, 10, 30])]
    replay(make_spec(), iter(requests), slo=slo)
    assert built == [pytest.approx(14 * (slo or Slo()).tbt_s, rel=1e-12)]
