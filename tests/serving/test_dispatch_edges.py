"""Edge contracts of the gateway's `Dispatcher` (examples/serving/dispatch.py) that the other serving tests leave
open, without workers: a real Conductor over prefill and decode instances, the workers' control calls recorded
(`Recorder`) and their health answers given by the test (`Answers`), all driven on an event loop as the gateway
drives them.

A mutation round found them: each test here failed on a plausible change of the dispatcher that the other tests
pass. Properties against small references: a request's end reports one finish reason, cancels its decode and its
prefill exactly when the rules say so, and counts once; the engines' loads follow the phases the reports reached;
the probe's backoff doubles up to its cap. Examples: the prefill job carries the request's sampling, decode node
and stop ids; a failed send marks its worker down and reroutes; a worker marked down cancels its unsent jobs; the
reroute limit's boundary; a whole answer's request rerouted mid-generation starts again from its first token; a
worker down for good is probed at the cap, its backoff never overflowing; the request timeout bounds each wait for a token, from arrival for the first; a probe
that finds a worker answering again marks it up, tells it the abandoned jobs and the deaths it missed, cancels the
requests it decodes for nobody; a dead worker is announced once, to the others that are up; the health loop
probes only the workers due and not already being probed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import make_mocked_request
from serving import dispatch, wire
from serving.api import ApiError, SamplingOptions
from serving.config import load_config
from serving.dispatch import Dispatcher, LiveRequest, WorkerState
from serving.gateway import Gateway, build_conductor

from mooncake.cache.events import BlockStored
from mooncake.errors import PeerUnavailable
from mooncake.sched.conductor import ScheduleDecision
from mooncake.sched.join import DecodeLimits
from mooncake.sched.outcome import ABORT_REASONS, DECODE_REFUSALS, Outcome, Reason
from mooncake.sched.router import TransferPlan
from mooncake.sched.view import InstanceUp
from mooncake.types import BlockKey, InstanceId, Tier
from tests.serving.conftest import EXAMPLES

TINY = EXAMPLES / "configs" / "tiny.toml"
MODEL = "tiny"
STEP_S = 0.01  # how long the tests let the loop run between steps (nothing here waits on I/O)


@attrs.define
class Recorder:
    """Stands in for a worker's control-call thread: records each message that would be sent, in order. A send
    `fails` (the worker unreachable) or is `held` (still queued: its future stays pending) when asked."""

    sent: list[Any] = attrs.field(factory=list)
    futures: list[concurrent.futures.Future[None]] = attrs.field(factory=list)
    held: bool = False
    fails: bool = False

    def submit(self, _function: Any, _instance: str, message: Any) -> concurrent.futures.Future[None]:
        self.sent.append(message)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self.fails:
            future.set_exception(PeerUnavailable("the worker does not answer"))
        elif not self.held:
            future.set_result(None)
        self.futures.append(future)
        return future

    def shutdown(self, **_options: Any) -> None:
        pass


@attrs.define
class Answers:
    """Stands in for the workers' health answers: an instance's `Health`, or None for no answer; the calls made."""

    health: dict[str, wire.Health | None] = attrs.field(factory=dict)
    asked: list[str] = attrs.field(factory=list)

    def __call__(self, instance: str) -> wire.Health:
        self.asked.append(instance)
        answer = self.health.get(instance)
        if answer is None:
            raise PeerUnavailable(f"{instance} does not answer")
        return answer


def healthy(*active: int, kv_usage: float = 0.25) -> wire.Health:
    return wire.Health(ok=True, pid=1, queued=0, active=active, generated_tokens=0, kv_usage=kv_usage)


@asynccontextmanager
async def dispatching(
    num_prefill: int = 1,
    num_decode: int = 1,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    **limits: Any,
) -> AsyncIterator[Dispatcher]:
    """A worker-less dispatcher whose Conductor knows `num_prefill` prefill and `num_decode` decode instances
    (8 batch slots, 10,000 KV tokens each), all up; its control calls are `Recorder`s, its health answers
    `Answers` (every worker answering healthy), its liveness checks a set of dead instances (`d.dead`)."""
    config = load_config(TINY).with_overrides("limits", **limits)
    conductor = build_conductor(config)
    roles = {InstanceId(f"prefill-{i}"): "prefill" for i in range(num_prefill)}
    roles |= {InstanceId(f"decode-{i}"): "decode" for i in range(num_decode)}
    conductor.add_prefill_instances([i for i, role in roles.items() if role == "prefill"])
    limits_each = DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=8)
    conductor.add_decode_instances([i for i, role in roles.items() if role == "decode"], limits_each)
    dead: set[str] = set()
    found = Dispatcher(
        config,
        conductor,
        secret=bytes(32),
        workers=[],
        is_alive=lambda instance: instance not in dead,
        block_bytes=1,
        stop_token_ids=stop_token_ids,
    )
    found.dead = dead  # type: ignore[attr-defined]
    found.roles = dict(roles)
    found.workers = {instance: WorkerState(instance, role) for instance, role in roles.items()}
    found._calls = {instance: Recorder() for instance in roles}  # type: ignore[misc]
    found._probe_calls = {instance: ThreadPoolExecutor(1) for instance in roles}
    found._unsent = {instance: set() for instance in roles}
    found._stale = {instance: [] for instance in roles}
    found._addresses = {instance: f"127.0.0.1:{7000 + n}" for n, instance in enumerate(roles)}
    answers = Answers({instance: healthy() for instance in roles})
    found.health = answers  # type: ignore[method-assign]
    try:
        yield found
    finally:
        found.close()
        for pool in found._probe_calls.values():
            pool.shutdown(wait=True)


def sent(d: Dispatcher, instance: str) -> list[Any]:
    """What the dispatcher sent the worker, in order."""
    return d._calls[instance].sent  # type: ignore[attr-defined, no-any-return]


def recorder(d: Dispatcher, instance: str) -> Recorder:
    return d._calls[instance]  # type: ignore[return-value]


def answers(d: Dispatcher) -> Answers:
    return d.health  # type: ignore[return-value]


async def settle() -> None:
    await asyncio.sleep(STEP_S)


async def admitted(d: Dispatcher, first_token: int = 0, **sampling: Any) -> LiveRequest:
    """A request of its own 40-token prompt, 4 tokens out (unless `sampling` says otherwise)."""
    options = SamplingOptions(**({"max_tokens": 4} | sampling))
    return await d.admit(list(range(first_token, first_token + 40)), options, d.now())


def ids(live: LiveRequest, instance: str) -> dict[str, Any]:
    return {"instance_id": instance, "request_id": int(live.request_id), "attempt": live.attempt}


def prefilled(d: Dispatcher, live: LiveRequest) -> None:
    """The prefill worker's reports that it started and finished the request."""
    d._dispatch(wire.PrefillStarted(**ids(live, live.prefill)))
    done = {"prefix_tokens": 16, "computed_tokens": 24, "fetched_blocks": 3, "streamed_blocks": 5, "events": ()}
    d._dispatch(wire.PrefillDone(**ids(live, live.prefill), **done))


def joined(d: Dispatcher, live: LiveRequest) -> None:
    d._dispatch(wire.DecodeJoined(**ids(live, live.decode), context_tokens=40, output_tokens=4))


def tokens(live: LiveRequest, *tokens: tuple[int, int, bool]) -> wire.DecodeTokens:
    """A decode step's report of (token, index, finished) for `live`, from its decode engine and attempt."""
    step = tuple(wire.Token(int(live.request_id), live.attempt, t, i, f) for t, i, f in tokens)
    return wire.DecodeTokens(instance_id=live.decode, tokens=step)


def sample(d: Dispatcher, name: str, **labels: str) -> float:
    value = d.metrics.registry.get_sample_value(f"mooncake:{name}", {"model_name": MODEL, **labels})
    return 0.0 if value is None else value


def finished(d: Dispatcher, engine: str, reason: str) -> float:
    return sample(d, "request_success_total", engine=engine, finished_reason=reason)


def counted(d: Dispatcher, engine: str) -> dict[str, float]:
    """The engine's requests counted, by finish reason (those counted only)."""
    every = {reason: finished(d, engine, reason) for reason in ("stop", "length", "abort", "error")}
    return {reason: n for reason, n in every.items() if n}


# ---------------------------------------------------------------------------------------------- ends


REASONS = (None, Reason.CLIENT_GONE, Reason.TIMEOUT, Reason.FAILED, Reason.KV_BUDGET)
# What the gateway ends a request with: an abort for a failure or its client, a rejection after prefill for the
# decode instance's refusal (a completion's reason, which none passes, is read only for its cancel).
KINDS = {Outcome.ABORTED: ABORT_REASONS, Outcome.REJECTED_AFTER_PREFILL: DECODE_REFUSALS}


def expected_finish(outcome: Outcome, reason: Reason | None, finish_reason: str | None) -> str | None:
    """The reference: the finish reason a request's end counts (None: not counted, a rejection is counted as one;
    a completion without its reader's judgement waits for it)."""
    if outcome is Outcome.REJECTED_AFTER_PREFILL:
        return None
    if outcome is Outcome.COMPLETED:
        return finish_reason
    return "abort" if reason in (Reason.CLIENT_GONE, Reason.TIMEOUT) else "error"


@settings(max_examples=40, deadline=None)
@given(
    outcome=st.sampled_from([Outcome.COMPLETED, Outcome.ABORTED, Outcome.REJECTED_AFTER_PREFILL]),
    reason=st.sampled_from(REASONS),
    cancel=st.booleans(),
    finish_reason=st.sampled_from([None, "stop", "length"]),
    has_joined=st.booleans(),
    decode_up=st.booleans(),
    prefill_up=st.booleans(),
)
def test_an_end_counts_once_and_cancels_as_the_rules_say(
    outcome: Outcome,
    reason: Reason | None,
    cancel: bool,
    finish_reason: str | None,
    has_joined: bool,
    decode_up: bool,
    prefill_up: bool,
) -> None:
    """Any end of a live request: its finish reason is counted once (none for a rejection after prefill; a
    completion's is its reader's judgement, counted when given, once); its decode is cancelled iff it was ended with `cancel` or its client left or timed out, and its decode engine is
    up; its prefill is cancelled (or kept for when its engine answers again) iff its client left or timed out
    before it joined; the Conductor hears of the end with its reason, and a second end does nothing."""

    assume(reason is None or reason in KINDS.get(outcome, REASONS))

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            prefill, decode = live.prefill, live.decode
            if has_joined:
                prefilled(d, live)
                joined(d, live)
            d.workers[decode].up, d.workers[prefill].up = decode_up, prefill_up
            before_decode, before_prefill = len(sent(d, decode)), len(sent(d, prefill))
            ends = d.end(live, outcome, reason, cancel=cancel, finish_reason=finish_reason)
            assert d.end(live, outcome, reason, cancel=cancel, finish_reason=finish_reason) == ()
            assert [(e.request_id, e.outcome) for e in ends] == [(live.request_id, outcome)]
            if outcome is Outcome.ABORTED:
                assert ends[0].reason is (reason or Reason.FAILED)
            if outcome is Outcome.REJECTED_AFTER_PREFILL:
                assert ends[0].reason is (reason or Reason.DECODE_REJECTED)
            counted = {r: finished(d, decode, r) for r in ("stop", "length", "abort", "error")}
            want = expected_finish(outcome, reason, finish_reason)
            assert counted == {r: float(r == want) for r in counted}
            if outcome is Outcome.COMPLETED and finish_reason is None:  # its reader judges it now, once
                d.finish(live, "length")
                d.finish(live, "stop")
                counted = {r: finished(d, decode, r) for r in ("stop", "length", "abort", "error")}
                assert counted == {r: float(r == "length") for r in counted}
            left = reason in (Reason.CLIENT_GONE, Reason.TIMEOUT)
            cancels_decode = (cancel or left) and decode_up
            assert sent(d, decode)[before_decode:] == (
                [wire.CancelDecode(request_id=int(live.request_id), every_attempt=True)] * cancels_decode
            )
            abandon = wire.CancelPrefill(request_id=int(live.request_id), attempt=0)
            abandons = left and not has_joined
            assert sent(d, prefill)[before_prefill:] == ([abandon] if abandons and prefill_up else [])
            assert d._stale[prefill] == ([abandon] if abandons and not prefill_up else [])
            assert d.conductor.in_flight == () and not d.live
            d.conductor.check_invariants()

    asyncio.run(run())


def test_finish_cancels_the_decode_and_counts_a_stop() -> None:
    """A request whose text reached a stop string (`finish`): cancelled on its decode engine, counted as "stop"."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.finish(live, "stop")
            assert sent(d, live.decode) == [wire.CancelDecode(request_id=int(live.request_id), every_attempt=True)]
            assert finished(d, live.decode, "stop") == 1 and not d.live

    asyncio.run(run())


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_last_token_ends_the_request_and_its_reader_judges_its_finish(ignore_eos: bool) -> None:
    """The decode engine's last token ends the request at once (the Conductor hears of it), a stop id or not, but
    its finish reason is its reader's judgement of its text (`finish`, the answer's), counted once and timed at that
    token, never the dispatcher's own guess; one whose reader left before judging it counts as "abort". The stop
    ids go to the prefill (none with `ignore_eos`); the tokens reach the request in order, counted, the first
    observed as its TTFT on its prefill engine."""

    async def run() -> None:
        async with dispatching(stop_token_ids=frozenset({2, 9})) as d:
            live = await admitted(d, ignore_eos=ignore_eos)
            d.submit(live)
            (job,) = sent(d, live.prefill)
            assert job.sampling.stop_ids == (() if ignore_eos else (2, 9))
            prefilled(d, live)
            joined(d, live)
            d._dispatch(report := tokens(live, (5, 0, False), (9, 1, True)))
            assert [live.events.get_nowait() for _ in range(2)] == [("token", step) for step in report.tokens]
            assert live.generated == 2 and not d.live and d.conductor.in_flight == ()
            assert counted(d, live.decode) == {}  # not judged yet
            end_s = live.unjudged_end_s
            assert end_s is not None
            await settle()
            d.finish(live, "length" if ignore_eos else "stop")
            d.finish(live, "stop")  # once
            assert counted(d, live.decode) == {"length" if ignore_eos else "stop": 1}
            assert sample(d, "e2e_request_latency_seconds_sum", engine=live.decode) == pytest.approx(
                end_s - live.arrival
            )
            assert sample(d, "request_prompt_tokens_sum", engine=live.prefill) == 40
            assert sample(d, "request_generation_tokens_sum", engine=live.decode) == 2
            assert sample(d, "generation_tokens_total", engine=live.decode) == 2
            assert sample(d, "time_to_first_token_seconds_count", engine=live.prefill) == 1
            assert sample(d, "inter_token_latency_seconds_count", engine=live.decode) == 1
            other = await admitted(d, 100)
            d.submit(other)
            prefilled(d, other)
            joined(d, other)
            d._dispatch(tokens(other, (5, 0, True)))
            d.end(other, Outcome.ABORTED, Reason.CLIENT_GONE)  # its reader left before judging it
            d.finish(other, "length")  # too late: counted
            assert counted(d, other.decode) == {"length" if ignore_eos else "stop": 1, "abort": 1}

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- the prefill job


def test_the_answer_counts_its_tokens_and_a_scored_prompt_looks_up_no_cache() -> None:
    """A request its reader ends at a stop string counts the tokens its answer holds (its usage's), not those that
    came after the stop before its cancellation landed (vLLM counts a request's tokens up to its stop); a request
    scoring its prompt (`prompt_logprobs`, computed whole) counts no prefix-cache query or hit, as vLLM's stats
    skip it, while its prompt tokens still count."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d, max_tokens=8)
            d.submit(live)
            prefilled(d, live)
            joined(d, live)
            d._dispatch(tokens(live, (5, 0, False), (6, 1, False), (7, 2, False), (8, 3, False)))
            d.finish(live, "stop", 2)  # its text reached a stop string at its second token
            assert counted(d, live.decode) == {"stop": 1}
            assert sample(d, "request_generation_tokens_sum", engine=live.decode) == 2
            queries = sample(d, "prefix_cache_queries_total", engine=live.prefill)
            assert (queries, sample(d, "prefix_cache_hits_total", engine=live.prefill)) == (40, 16)
            scored = await admitted(d, 100, prompt_logprobs=1)
            d.submit(scored)
            prefilled(d, scored)
            assert sample(d, "prefix_cache_queries_total", engine=scored.prefill) == queries
            assert sample(d, "prefix_cache_hits_total", engine=scored.prefill) == 16
            assert sample(d, "prompt_tokens_total", engine=scored.prefill) == 80

    asyncio.run(run())


@pytest.mark.parametrize("said", ["kv_budget", "ttft_slo", "client_gone", "no_such_reason"])
def test_a_decode_refusal_ends_the_request_whatever_reason_it_names(said: str) -> None:
    """A decode worker's refusal ends its request once, everywhere (the Conductor, the metrics, the client's
    429): with its reason where it names a decode refusal, else as `decode_rejected`, a refusal without a known
    why (a peer of another version). One naming a reason of another kind left the request half ended: out of
    the gateway's books, still in the Conductor's, its client never told."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            prefilled(d, live)
            d._dispatch(wire.DecodeRejected(**ids(live, live.decode), reason=said))
            reason = Reason(said) if said in {r.value for r in DECODE_REFUSALS} else Reason.DECODE_REJECTED
            assert live.request_id not in d.live and d.conductor.in_flight == ()
            kind, error = live.events.get_nowait()
            assert kind == "error" and error.status == 429
            assert sample(d, "request_rejected_total", reason=f"decode_{reason.value}") == 1

    asyncio.run(run())


def test_the_prefill_job_carries_the_requests_sampling_and_decode_node() -> None:
    """`submit` sends the prefill worker one job per attempt: the prompt, the decode node it hands on to, and the
    request's sampling as asked (temperature, top_p, min_tokens, a seed drawn once when none was given, a given
    seed kept); nothing for a request that ended before it was sent."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d, max_tokens=7, temperature=0.7, top_p=0.3, min_tokens=2, seed=11)
            d.submit(live)
            d.submit(live)  # the same attempt: not again
            (job,) = sent(d, live.prefill)
            assert (job.request_id, job.attempt, job.tokens, job.decode) == (
                int(live.request_id),
                0,
                tuple(range(40)),
                live.decode,
            )
            assert job.decode == "decode-0" and job.fetch is None
            assert job.sampling == wire.Sampling(
                max_tokens=7, temperature=0.7, top_p=0.3, seed=11, stop_ids=(), min_tokens=2
            )
            drawn = await admitted(d, 100)
            d.submit(drawn)
            assert drawn.sampling.seed is not None
            assert sent(d, drawn.prefill)[-1].sampling.seed == drawn.sampling.seed
            left = await admitted(d, 200)
            d.end(left, Outcome.ABORTED, Reason.CLIENT_GONE)  # its client left before it was sent
            d.submit(left)
            assert [m.request_id for m in sent(d, "prefill-0")] == [
                int(live.request_id),
                int(drawn.request_id),
                int(left.request_id),  # the cancel of the job never sent, nothing else
            ]
            assert isinstance(sent(d, "prefill-0")[-1], wire.CancelPrefill)

    asyncio.run(run())


def test_a_job_its_worker_does_not_take_marks_the_worker_down_and_reroutes() -> None:
    """A prefill job whose send fails (the worker unreachable): that worker is marked down (probed again no sooner
    than a health interval on) and the request is scheduled again, on the other prefill worker, as its next
    attempt."""

    async def run() -> None:
        async with dispatching(num_prefill=2) as d:
            d._worker_failed(InstanceId("prefill-1"))
            live = await admitted(d)
            assert live.prefill == "prefill-0"
            d.workers["prefill-1"].up = True  # back (as a probe would find it)
            d.conductor.handle(InstanceUp(instance_id=InstanceId("prefill-1"), now=d.now()))
            recorder(d, "prefill-0").fails = True
            failed_at = d.now()
            d.submit(live)
            await settle()
            assert not d.workers["prefill-0"].up and d.workers["prefill-1"].up
            assert d.workers["prefill-0"].next_probe_s >= failed_at + d.config.limits.health_interval_s
            assert live.attempt == 1 and live.prefill == "prefill-1" and d.live[live.request_id] is live
            assert [type(m) for m in sent(d, "prefill-1")] == [wire.PrefillJob]

    asyncio.run(run())


def test_a_worker_marked_down_cancels_its_jobs_not_sent_yet() -> None:
    """Jobs still queued for a worker when it is marked down are cancelled (their requests are rerouted); a
    job whose send ended is forgotten."""

    async def run() -> None:
        async with dispatching(num_prefill=2) as d:
            d._worker_failed(InstanceId("prefill-1"))
            recorder(d, "prefill-0").held = True
            queued = await admitted(d)
            d.submit(queued)
            await settle()
            (future,) = recorder(d, "prefill-0").futures
            assert len(d._unsent["prefill-0"]) == 1
            d._worker_failed(InstanceId("prefill-0"))
            await settle()
            assert future.cancelled() and not d._unsent["prefill-0"]

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- reroutes


@pytest.mark.parametrize("attempt", [0, 1, 2])
def test_a_request_is_rerouted_while_it_has_attempts_left(attempt: int) -> None:
    """A request whose prefill engine fails is scheduled again, as its next attempt, on the other one, unless it
    was scheduled again twice already (then it ends with a 503 naming the engine, counted as an error);
    either way the abandoned attempt is cancelled on the failed engine when it answers again."""

    async def run() -> None:
        async with dispatching(num_prefill=2) as d:
            live = await admitted(d)
            live.attempt = attempt
            d.submit(live)
            first = live.prefill
            other = ({"prefill-0", "prefill-1"} - {first}).pop()
            d._worker_failed(InstanceId(first))
            assert d._stale[first] == [wire.CancelPrefill(request_id=int(live.request_id), attempt=attempt)]
            if attempt < 2:  # twice at most (the module docstring)
                assert live.attempt == attempt + 1 and live.prefill == other and d.live[live.request_id] is live
                assert sent(d, other)[-1].attempt == attempt + 1
                assert live.events.empty()
            else:
                assert not d.live and live.attempt == attempt and sent(d, other) == []
                kind, error = live.events.get_nowait()
                assert kind == "error" and error.status == 503 and first in error.message
                assert finished(d, live.decode, "error") == 1
            d.conductor.check_invariants()

    asyncio.run(run())


def test_a_request_whose_tokens_began_is_not_rerouted() -> None:
    """A streamed request (`admit`'s default) whose decode engine fails after a token reached its client ends with a 503 (a reroute would
    send the client a second stream); one that was prefilled but not yet joined there starts again from scratch
    (its phases forgotten)."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            d._worker_failed(InstanceId("decode-1"))  # both go to decode-0 ...
            began = await admitted(d)
            d.submit(began)
            prefilled(d, began)
            joined(d, began)
            d._dispatch(tokens(began, (5, 0, False)))
            assert began.events.get_nowait() == ("token", wire.Token(int(began.request_id), began.attempt, 5, 0, False))
            waiting = await admitted(d, 100)
            d.submit(waiting)
            prefilled(d, waiting)
            assert waiting.decode == began.decode == "decode-0"
            await d._probe(d.workers["decode-1"])  # ... and decode-1 answers again
            d._worker_failed(InstanceId(began.decode))
            kind, error = began.events.get_nowait()
            assert kind == "error" and error.status == 503 and began.request_id not in d.live
            assert d.live[waiting.request_id] is waiting and waiting.attempt == 1
            assert (waiting.prefill_started_s, waiting.prefill_done_s, waiting.joined_s) == (None, None, None)
            assert d.loads()[waiting.prefill] == (0, 1)  # waiting for its prefill again

    asyncio.run(run())


def test_a_whole_answers_request_whose_tokens_began_is_rerouted_from_its_first_token() -> None:
    """A request for a whole (not streamed) answer, whose client gets nothing before its end: its decode engine
    fails after two tokens (one read, one still queued), and it is scheduled again as its next attempt on the other
    engine, the queued token dropped and its count back to 0; its reader then gets the retry's tokens from the
    first, and the end counts the retry's tokens and one time to first token."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            d._worker_failed(InstanceId("decode-1"))  # it goes to decode-0 ...
            live = await d.admit(list(range(40)), SamplingOptions(max_tokens=4), d.now(), streamed=False)
            d.submit(live)
            prefilled(d, live)
            joined(d, live)
            d._dispatch(tokens(live, (5, 0, False), (6, 1, False)))
            assert live.events.get_nowait()[1].token == 5 and live.generated == 2
            await d._probe(d.workers["decode-1"])  # ... and decode-1 answers again
            d._worker_failed(InstanceId("decode-0"))
            assert d.live[live.request_id] is live and (live.attempt, live.decode) == (1, "decode-1")
            assert live.events.empty() and live.generated == 0
            job = sent(d, live.prefill)[-1]
            assert isinstance(job, wire.PrefillJob) and (job.attempt, job.decode) == (1, "decode-1")
            prefilled(d, live)
            joined(d, live)
            d._dispatch(tokens(live, (5, 0, False), (6, 1, False), (7, 2, False), (8, 3, True)))
            read = [(t.attempt, t.token, t.index) async for t in d.tokens(live)]
            assert read == [(1, 5, 0), (1, 6, 1), (1, 7, 2), (1, 8, 3)]
            d.finish(live, "length")  # its reader's judgement of the text
            assert live.request_id not in d.live and finished(d, "decode-1", "length") == 1
            assert sample(d, "request_generation_tokens_count", engine="decode-1") == 1
            assert sample(d, "request_generation_tokens_sum", engine="decode-1") == 4
            assert sample(d, "time_to_first_token_seconds_count", engine="prefill-0") == 1
            d.conductor.check_invariants()

    asyncio.run(run())


def test_a_reroute_that_finds_no_engine_ends_with_the_conductors_answer() -> None:
    """The only decode engine fails: its request finds no decode engine up and gets the 503 saying so."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            d._worker_failed(InstanceId("decode-0"))
            kind, error = live.events.get_nowait()
            assert kind == "error" and error.status == 503 and error.code == Reason.NO_DECODE_INSTANCE.value
            assert d.num_up("decode") == 0 and d.up == {"prefill-0": True, "decode-0": False}
            assert sample(d, "request_rejected_total", reason=Reason.NO_DECODE_INSTANCE.value) == 1
            with pytest.raises(ApiError) as refused:
                await admitted(d, 100)
            assert refused.value.status == 503 and refused.value.code == Reason.NO_DECODE_INSTANCE.value
            assert sample(d, "request_rejected_total", reason=Reason.NO_DECODE_INSTANCE.value) == 2

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- tokens


def test_the_request_timeout_bounds_each_wait_for_a_token() -> None:
    """With a 1 s request timeout: tokens that keep coming, 0.2 s apart, run past it to the last one; the first
    token's wait counts from the arrival (a request that arrived 10 s ago ends at once); a request that times out
    ends with a 504, cancelled on its decode engine and, not joined, its prefill engine, counted as an abort."""

    async def run() -> None:
        async with dispatching(request_timeout_s=1.0) as d:
            live = await admitted(d)
            d.submit(live)
            prefilled(d, live)
            joined(d, live)

            async def feed() -> None:
                for index in range(8):
                    await asyncio.sleep(0.2)
                    d._dispatch(tokens(live, (index, index, index == 7)))

            feeder = asyncio.create_task(feed())
            began = d.now()
            got = [token.token async for token in d.tokens(live)]
            await feeder
            assert got == list(range(8)) and d.now() - began > 1.4

            late = await admitted(d, 100)
            d.submit(late)
            late.arrival -= 10.0
            started = d.now()
            with pytest.raises(ApiError) as caught:
                async for _token in d.tokens(late):
                    pass
            assert caught.value.status == 504 and d.now() - started < 0.9  # not the 1 s a wait from now would take
            assert late.request_id not in d.live
            assert sent(d, late.decode)[-1] == wire.CancelDecode(request_id=int(late.request_id), every_attempt=True)
            assert sent(d, late.prefill)[-1] == wire.CancelPrefill(request_id=int(late.request_id), attempt=0)
            assert finished(d, late.decode, "abort") == 1

    asyncio.run(run())


def test_an_error_ends_the_tokens_with_it() -> None:
    """A failure report ends the request's tokens with its error: a 500 naming the stage that failed."""

    async def run() -> None:
        async with dispatching() as d:
            for stage in ("prefill", "decode"):
                live = await admitted(d, 100 * (stage == "decode"))
                d.submit(live)
                if stage == "prefill":
                    d._dispatch(wire.PrefillFailed(**ids(live, live.prefill), error="disk", peer="", events=()))
                else:
                    prefilled(d, live)
                    d._dispatch(wire.DecodeFailed(**ids(live, live.decode), error="disk"))
                with pytest.raises(ApiError) as caught:
                    async for _token in d.tokens(live):
                        pass
                assert caught.value.status == 500 and caught.value.message == f"{stage} failed: disk"
                assert finished(d, live.decode, "error") == (1 if stage == "prefill" else 2)

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- reports


def test_reports_move_a_request_through_its_phases_in_the_loads() -> None:
    """An engine's (running, waiting) as the reports tell them: queued for its prefill, prefilling, handed on
    (waiting on the decode engine), joined (running there); the prefill's KV and cache figures are counted."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            assert d.loads() == {"prefill-0": (0, 1), "decode-0": (0, 0)}
            d._dispatch(wire.PrefillStarted(**ids(live, live.prefill)))
            assert d.loads() == {"prefill-0": (1, 0), "decode-0": (0, 0)}
            done = {"prefix_tokens": 16, "computed_tokens": 24, "fetched_blocks": 3, "streamed_blocks": 5}
            d._dispatch(wire.PrefillDone(**ids(live, live.prefill), **done, events=()))
            assert d.loads() == {"prefill-0": (0, 0), "decode-0": (0, 1)}
            assert live.cached_tokens == 16
            assert sample(d, "kv_transfer_bytes_total", engine="prefill-0", kind="fetch") == 3
            assert sample(d, "kv_transfer_bytes_total", engine="prefill-0", kind="push") == 5
            assert sample(d, "prefix_cache_hits_total", engine="prefill-0") == 16
            joined(d, live)
            assert d.loads() == {"prefill-0": (0, 0), "decode-0": (1, 0)}
            (view,) = d.conductor.decode_views
            assert view.active[live.request_id].context_tokens == 40  # the prompt, as the decode engine joined it

    asyncio.run(run())


def test_a_decode_nodes_failure_named_by_a_prefill_has_it_probed_once() -> None:
    """A prefill engine reports its decode node did not answer while the health loop's probe of that node is on
    its way: the node is probed once that probe is done (not two at once); it answers, so the request alone is
    scheduled again, its earlier attempt cancelled on its prefill engine."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            live = await admitted(d)
            d.submit(live)
            node = live.decode
            d.workers[node].probing = True  # the health loop's probe of it is on its way
            failed = wire.PrefillFailed(**ids(live, live.prefill), error="timed out", peer=node, events=())
            d._dispatch(failed)
            await settle()
            assert live.attempt == 0 and answers(d).asked == []  # waits for that probe's verdict
            d.workers[node].probing = False  # it answered
            await asyncio.gather(*d._probes)
            assert answers(d).asked == [node] and d.workers[node].up  # asked once it answered: still up
            assert live.attempt == 1 and d.live[live.request_id] is live
            assert sent(d, live.prefill)[-2:] == [
                wire.CancelPrefill(request_id=int(live.request_id), attempt=0),
                sent(d, live.prefill)[-1],
            ]
            assert isinstance(sent(d, live.prefill)[-1], wire.PrefillJob)

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- health


@settings(max_examples=30, deadline=None)
@given(
    interval_s=st.sampled_from([0.01, 0.5, 2.0]),
    cap_s=st.sampled_from([0.01, 1.0, 7.0, 60.0]),
    num_failures=st.integers(1, 8),
)
def test_a_probe_backs_off_doubling_up_to_its_cap(interval_s: float, cap_s: float, num_failures: int) -> None:
    """A worker that fails `n` probes in a row is probed next `min(cap, interval * 2**n)` after the n-th; the
    first failure marks it down; an answer resets the count and makes it due at once, its KV usage reported."""
    cap_s = max(cap_s, interval_s)

    async def run() -> None:
        async with dispatching(health_interval_s=interval_s, health_probe_backoff_max_s=cap_s) as d:
            state = d.workers["decode-0"]
            answers(d).health["decode-0"] = None
            for n in range(1, num_failures + 1):
                before = d.now()
                await d._probe(state)
                assert state.failures == n and not state.up
                wait = state.next_probe_s - before
                want = min(cap_s, interval_s * 2.0**n)
                assert want - 1e-6 <= wait <= want + 0.5
            answers(d).health["decode-0"] = healthy(kv_usage=0.75)
            await d._probe(state)
            assert state.up and state.failures == 0 and state.next_probe_s <= d.now()
            assert sample(d, "kv_cache_usage_perc", engine="decode-0") == 0.75

    asyncio.run(run())


@pytest.mark.parametrize("num_failures", [1022, 1023, 100_000])
def test_a_worker_down_for_good_is_probed_at_the_cap_without_end(num_failures: int) -> None:
    """A worker that has failed `num_failures` probes in a row (1,023 is 85 minutes at the default 5 s cap) is
    probed next at the cap after each further failure, its count going on; the doubling once overflowed there
    (2.0**1024), and each probe then raised before setting its next time."""

    async def run() -> None:
        async with dispatching(health_interval_s=0.5, health_probe_backoff_max_s=5.0) as d:
            state = d.workers["decode-0"]
            answers(d).health["decode-0"] = None
            state.failures = num_failures
            for n in range(1, 4):
                before = d.now()
                await d._probe(state)
                assert state.failures == num_failures + n and not state.up and not state.probing
                assert 5.0 - 1e-6 <= state.next_probe_s - before <= 5.5
            answers(d).health["decode-0"] = healthy()
            await d._probe(state)
            assert state.up and state.failures == 0

    asyncio.run(run())


def test_a_worker_that_answers_not_ok_is_marked_down() -> None:
    """A health answer that says not ok counts as a failed probe: the worker is marked down."""

    async def run() -> None:
        async with dispatching() as d:
            answers(d).health["decode-0"] = attrs.evolve(healthy(), ok=False)
            await d._probe(d.workers["decode-0"])
            assert not d.workers["decode-0"].up and d.workers["decode-0"].failures == 1

    asyncio.run(run())


def test_a_worker_answering_again_is_marked_up_told_what_it_missed_and_wakes_the_line() -> None:
    """A stopped prefill worker, probed: marked down, its request rerouted, the abandoned job kept for it. Another
    worker found dead meanwhile. It answers again: marked up (the Conductor routes to it again, a request waiting
    in line for an engine is admitted), told the abandoned job once and the death it missed; the requests its
    answer lists that the gateway no longer routes to it are cancelled there, its own left alone."""

    async def run() -> None:
        async with dispatching(num_prefill=3) as d:
            live = await admitted(d)
            d.submit(live)
            victim = live.prefill
            answers(d).health[victim] = None
            await d._probe(d.workers[victim])
            assert not d.workers[victim].up and live.attempt == 1
            dead = ({"prefill-0", "prefill-1", "prefill-2"} - {victim, live.prefill}).pop()
            d.dead.add(dead)  # type: ignore[attr-defined]
            answers(d).health[dead] = None
            await d._probe(d.workers[dead])
            assert d.workers[dead].gone and not d.workers[dead].up
            gone = wire.PeerGone(address=d._addresses[dead])
            assert gone in sent(d, live.prefill) and gone in sent(d, "decode-0")
            assert gone not in sent(d, victim) and gone not in sent(d, dead)  # down, and the dead one itself
            abandoned = wire.CancelPrefill(request_id=int(live.request_id), attempt=0)
            assert d._stale[victim] == [abandoned]

            answers(d).health[victim] = healthy(int(live.request_id), 999)
            before = len(sent(d, victim))
            await d._probe(d.workers[victim])
            assert d.workers[victim].up and d._stale[victim] == []
            assert sent(d, victim)[before:] == [
                wire.Announce(),  # marked down, its cache was forgotten
                abandoned,
                gone,
                wire.CancelDecode(request_id=int(live.request_id)),  # served elsewhere now: the attempt held there
                wire.CancelDecode(request_id=999, every_attempt=True),  # ended: every attempt
            ]
            before = len(sent(d, victim))
            await d._probe(d.workers[victim])  # up all along: nothing to tell again
            assert sent(d, victim)[before:] == [
                wire.CancelDecode(request_id=int(live.request_id)),  # served elsewhere now: the attempt held there
                wire.CancelDecode(request_id=999, every_attempt=True),  # ended: every attempt
            ]
            before_dead = sum(isinstance(m, wire.PeerGone) for m in sent(d, "decode-0"))
            await d._probe(d.workers[dead])  # still dead: announced once
            assert sum(isinstance(m, wire.PeerGone) for m in sent(d, "decode-0")) == before_dead

    asyncio.run(run())


def test_a_decode_worker_lists_its_own_requests_and_keeps_them() -> None:
    """A decode worker's health answer lists the requests it decodes: those routed to it stay, others (ended,
    or rerouted elsewhere) are cancelled there."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            mine = await admitted(d)
            d.submit(mine)
            node = mine.decode
            other = ({"decode-0", "decode-1"} - {node}).pop()
            elsewhere = await admitted(d, 100)
            while elsewhere.decode != other:  # the router's choice: admit until one lands on the other node
                elsewhere = await admitted(d, 1000 + len(d.live) * 100)
            answers(d).health[node] = healthy(int(mine.request_id), int(elsewhere.request_id))
            await d._probe(d.workers[node])
            assert sent(d, node) == [wire.CancelDecode(request_id=int(elsewhere.request_id))]

    asyncio.run(run())


def test_an_engine_coming_up_admits_a_request_waiting_in_line() -> None:
    """The one decode engine full, a request waits in line; a second decode engine answering again (it was down)
    admits it at once, not at its deadline."""

    async def run() -> None:
        async with dispatching(num_decode=2) as d:
            d._worker_failed(InstanceId("decode-1"))
            d.conductor.set_decode_limits(
                InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=1)
            )
            await admitted(d)
            waiting = asyncio.create_task(admitted(d, 100))
            await settle()
            assert not waiting.done() and len(d._waiting) == 1
            await d._probe(d.workers["decode-1"])
            await settle()
            assert waiting.done() and waiting.result().decode == "decode-1"

    asyncio.run(run())


def test_the_health_loop_probes_only_workers_due_and_not_being_probed() -> None:
    """Every interval the loop probes each worker that is due and has no probe on its way: one being probed, or
    one whose backoff runs for a minute, is not asked meanwhile; the others are."""

    async def run() -> None:
        async with dispatching(num_prefill=2, health_interval_s=0.02, health_probe_backoff_max_s=120.0) as d:
            d.workers["prefill-0"].probing = True
            d.workers["prefill-1"].next_probe_s = d.now() + 60.0
            loop = asyncio.create_task(d.health_loop())
            try:
                for _ in range(500):
                    if answers(d).asked.count("decode-0") >= 3:
                        break
                    await asyncio.sleep(0.01)
            finally:
                loop.cancel()
            assert answers(d).asked.count("decode-0") >= 3
            assert "prefill-0" not in answers(d).asked and "prefill-1" not in answers(d).asked

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- shutting down


def test_shutting_down_stops_the_deadline_timer_and_zeroes_the_line() -> None:
    """A request waits in line (its deadline timer set); shutting down answers it, zeroes the waiting gauge and
    stops the timer, and refuses a later request at once; `close` cancels the probes in flight."""

    async def run() -> None:
        async with dispatching() as d:
            d.conductor.set_decode_limits(
                InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=1)
            )
            await admitted(d)
            waiting = asyncio.create_task(admitted(d, 100))
            await settle()
            timer = d._deadline_timer
            assert timer is not None and sample(d, "num_requests_admission_waiting") == 1
            d.shut_down_requests()
            assert timer.cancelled() and sample(d, "num_requests_admission_waiting") == 0
            with pytest.raises(ApiError):
                await waiting
            with pytest.raises(ApiError) as later:  # refused at once, not left waiting for room (none is freed now)
                async with asyncio.timeout(5.0):
                    await admitted(d, 200)
            assert later.value.status == 503
            probe = asyncio.create_task(asyncio.sleep(30))
            d._probes.add(probe)
            d.close()
            await asyncio.sleep(0)
            assert probe.cancelled()

    asyncio.run(run())


def test_a_report_before_attach_is_dropped_and_after_it_applied() -> None:
    """A worker's report that arrives before the dispatcher is attached to a loop is dropped; once attached, it
    is handed to the loop."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.submit(live)
            report = {"instance_id": live.prefill, "request_id": int(live.request_id), "attempt": 0}
            d.engine.handle_call(wire.PrefillStarted.METHOD, report)
            await settle()
            assert live.prefill_started_s is None
            d.attach(asyncio.get_running_loop())
            d.engine.handle_call(wire.PrefillStarted.METHOD, report)
            await settle()
            assert live.prefill_started_s is not None

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- the admission line


def test_the_head_of_the_line_leaving_lets_the_next_in_at_once() -> None:
    """A holds 44 of the 100 KV tokens; B (64) waits at the head of the line and C (44), which fits beside A,
    behind it. B's client leaves: C is admitted at once, not at its deadline 30 s on."""

    async def run() -> None:
        async with dispatching() as d:
            d.conductor.set_decode_limits(InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=100))
            await admitted(d)
            b = asyncio.create_task(d.admit(list(range(1000, 1060)), SamplingOptions(max_tokens=4), d.now()))
            await settle()
            c = asyncio.create_task(admitted(d, 2000))
            await settle()
            assert not b.done() and not c.done() and len(d._waiting) == 2
            b.cancel()
            await settle()
            assert c.done() and c.result().request_id in d.live and len(d._waiting) == 0

    asyncio.run(run())


def test_a_wait_that_ends_in_a_refusal_counts_its_reason() -> None:
    """A request that waited for room and was refused at its deadline is counted under the refusal's reason."""

    async def run() -> None:
        async with dispatching(admission_wait_s=0.1) as d:
            d.conductor.set_decode_limits(
                InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=1)
            )
            await admitted(d)
            with pytest.raises(ApiError) as refused:
                async with asyncio.timeout(5.0):  # its deadline's timer ends the wait (0.1 s)
                    await admitted(d, 100)
            assert refused.value.status == 429
            assert sample(d, "request_rejected_total", reason=refused.value.code) == 1

    asyncio.run(run())


def test_a_decisions_transfer_plan_reaches_the_prefill_job() -> None:
    """A decision that moves KV from another prefill engine first: the job asks its worker to fetch those blocks
    from that engine; a decision without one fetches nothing."""

    async def run() -> None:
        async with dispatching(num_prefill=2) as d:
            live = await admitted(d)
            plan = TransferPlan(source=InstanceId("prefill-1"), num_blocks=2, num_bytes=64, transfer_s=0.01)
            decision = ScheduleDecision(
                request_id=live.request_id,
                accepted=True,
                prefill_instance=InstanceId("prefill-0"),
                decode_instance=InstanceId("decode-0"),
                transfer=plan,
            )
            d._accepted(live, decision)
            d.submit(live)
            assert sent(d, "prefill-0")[-1].fetch == wire.Fetch(source="prefill-1", blocks=2)
            d._accepted(live, attrs.evolve(decision, transfer=None))
            live.attempt += 1
            d.submit(live)
            assert sent(d, "prefill-0")[-1].fetch is None

    asyncio.run(run())


def test_a_dead_workers_abandoned_jobs_are_forgotten() -> None:
    """A stopped prefill worker (down) keeps the cancels of its abandoned jobs for when it answers again; once its
    process is found dead they are dropped (its queue died with it), and a job abandoned on it later is kept for
    nobody."""

    async def run() -> None:
        async with dispatching(num_prefill=2) as d:
            live = await admitted(d)
            d.submit(live)
            victim = live.prefill
            answers(d).health[victim] = None
            await d._probe(d.workers[victim])
            assert d._stale[victim] == [wire.CancelPrefill(request_id=int(live.request_id), attempt=0)]
            d.dead.add(victim)  # type: ignore[attr-defined]
            await d._probe(d.workers[victim])
            assert d.workers[victim].gone and d._stale[victim] == []
            later = await admitted(d, 100)
            later.prefill = InstanceId(victim)  # as if it had been routed there before the death
            d._abandon(later)
            assert d._stale[victim] == [] and sent(d, victim) == [sent(d, victim)[0]]

    asyncio.run(run())


def test_a_probe_that_gets_no_answer_in_time_marks_the_worker_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose health answer comes later than the probe's deadline (shortened here to 1.05 s; the answer
    waits until the test is done) is marked down: the probe does not wait for it."""
    monkeypatch.setattr(dispatch, "PROBE_TIMEOUT_S", 0.05)
    done = threading.Event()

    async def run() -> None:
        async with dispatching() as d:
            answer = answers(d)

            def slow(instance: str) -> wire.Health:
                done.wait(30.0)
                return answer(instance)

            d.health = slow  # type: ignore[method-assign]
            began = d.now()
            try:
                await d._probe(d.workers["decode-0"])
                assert not d.workers["decode-0"].up and d.now() - began < 10.0
            finally:
                done.set()  # the probe's thread ends before the pools shut down

    asyncio.run(run())


def test_a_gap_in_a_prefill_engines_cache_events_is_counted_and_mended() -> None:
    """The cache events a prefill report carries reach the index, even for a request that has ended; one out of
    sequence is counted as a gap of that engine, which is asked to announce its cache (once while its gaps go on,
    again after `ANNOUNCE_AGAIN_S`); the announcement, a new epoch, gives the index the engine's cache back."""

    async def run() -> None:
        async with dispatching() as d:
            live = await admitted(d)
            d.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)
            source = InstanceId("prefill-0")
            events = (
                BlockStored(source=source, seq=0, keys=(BlockKey(11),), tier=Tier.VRAM),
                BlockStored(source=source, seq=1, keys=(BlockKey(12),), tier=Tier.VRAM),
            )
            done = {"prefix_tokens": 0, "computed_tokens": 40, "fetched_blocks": 0, "streamed_blocks": 0}
            d._dispatch(wire.PrefillDone(**ids(live, "prefill-0"), **done, events=events))
            assert sample(d, "cache_index_gaps_total", engine="prefill-0") == 0
            skipped = BlockStored(source=source, seq=5, keys=(BlockKey(13),), tier=Tier.VRAM)
            d._dispatch(wire.PrefillDone(**ids(live, "prefill-0"), **done, events=(skipped,)))
            assert sample(d, "cache_index_gaps_total", engine="prefill-0") == 1
            assert sent(d, "prefill-0").count(wire.Announce()) == 1
            after = BlockStored(source=source, seq=6, keys=(BlockKey(14),), tier=Tier.VRAM)
            d._dispatch(wire.PrefillDone(**ids(live, "prefill-0"), **done, events=(after,)))  # still a gap
            assert sample(d, "cache_index_gaps_total", engine="prefill-0") == 2
            assert sent(d, "prefill-0").count(wire.Announce()) == 1, "asked again at once"
            d._announcing["prefill-0"] -= dispatch.ANNOUNCE_AGAIN_S  # the ask, or its answer, was lost
            d._dispatch(wire.PrefillDone(**ids(live, "prefill-0"), **done, events=(after,)))
            assert sent(d, "prefill-0").count(wire.Announce()) == 2
            held = (BlockKey(11), BlockKey(12), BlockKey(13))
            announced = BlockStored(source=source, seq=0, keys=held, tier=Tier.DRAM, epoch=1)
            d._dispatch(wire.PrefillDone(**ids(live, "prefill-0"), **done, events=(announced,)))
            assert sample(d, "cache_index_gaps_total", engine="prefill-0") == 3
            assert "prefill-0" not in d._announcing
            assert all(d.conductor.index.holders(key) for key in held)

    asyncio.run(run())


def test_a_decode_nodes_failure_report_outrun_by_other_news_reroutes_nothing() -> None:
    """A prefill engine reports its decode node did not answer; while the node's probe is on its way the request
    ends (its client left), or is rerouted as its next attempt, or joins the node after all (the call timed out
    after it was taken): the probe's end then reschedules nothing."""

    async def run() -> None:
        async with dispatching(num_prefill=2, num_decode=2) as d:
            for news in ("ended", "rerouted", "joined"):
                live = await admitted(d, 1000 * len(news))
                d.submit(live)
                node = live.decode
                d.workers[node].probing = True
                failed = wire.PrefillFailed(**ids(live, live.prefill), error="timed out", peer=node, events=())
                d._dispatch(failed)
                await settle()
                if news == "ended":
                    d.end(live, Outcome.ABORTED, Reason.CLIENT_GONE)
                elif news == "rerouted":
                    d._worker_failed(live.prefill)
                    assert live.attempt == 1
                else:
                    prefilled(d, live)
                    joined(d, live)
                attempt, route = live.attempt, (live.prefill, live.decode)
                d.workers[node].probing = False
                await asyncio.gather(*d._probes)
                assert (live.attempt, (live.prefill, live.decode)) == (attempt, route), news
                assert (live.request_id in d.live) is (news != "ended"), news
                for worker in d.workers.values():  # back to all up for the next case
                    if not worker.up:
                        await d._probe(worker)
            d.conductor.check_invariants()

    asyncio.run(run())


def test_a_failed_send_to_a_worker_already_down_leaves_its_probes_as_they_were() -> None:
    """A job sent just before its worker was marked down fails after it (the send's own timeout): the worker is
    not marked down again, and the probe its backoff set (here the cap, one interval on) is not put off."""

    async def run() -> None:
        async with dispatching(health_interval_s=0.5, health_probe_backoff_max_s=0.5) as d:
            state = d.workers["decode-0"]
            answers(d).health["decode-0"] = None
            await d._probe(state)
            assert not state.up
            due = state.next_probe_s
            await asyncio.sleep(0.05)
            d._worker_failed(InstanceId("decode-0"))
            assert state.next_probe_s == due and not state.up

    asyncio.run(run())


def test_a_prefill_job_carries_every_sampling_option_of_its_request() -> None:
    """The dispatcher copies the request's options onto the wire by name: each `wire.Sampling` field holds the
    request's value (the seed as drawn at admission), and the stop ids are the model's with the request's own
    (none of the model's with `ignore_eos`)."""
    options = {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.8,
        "seed": 11,
        "min_tokens": 2,
        "logprobs": 3,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "presence_penalty": -0.5,
        "frequency_penalty": 0.25,
        "prompt_logprobs": 1,
        "logit_bias": ((4, 2.5),),
        "stop_token_ids": (3, 12),
        "allowed_token_ids": (1, 6),
    }
    assert {f.name for f in attrs.fields(wire.Sampling)} - {"stop_ids"} <= options.keys()

    async def run() -> None:
        async with dispatching(stop_token_ids=frozenset({2, 9})) as d:
            for ignore_eos, stops in ((False, (2, 3, 9, 12)), (True, (3, 12))):
                live = await admitted(d, 100 * ignore_eos, ignore_eos=ignore_eos, **options)
                d.submit(live)
                (job,) = sent(d, live.prefill)[-1:]
                for f in attrs.fields(wire.Sampling):
                    if f.name != "stop_ids":
                        assert getattr(job.sampling, f.name) == options[f.name], f.name
                assert job.sampling.stop_ids == stops

    asyncio.run(run())


def test_the_first_choice_to_fail_ends_the_others_reads() -> None:
    """A completion's choices are read together: the first read to raise cancels the others (their requests are
    then withdrawn by the gateway) and its error is the answer's; reads that all end give their results."""
    from serving.gateway import _together

    async def run() -> None:
        done: list[str] = []
        cancelled: list[str] = []

        async def read(name: str, after_s: float, error: ApiError | None = None) -> None:
            try:
                await asyncio.sleep(after_s)
            except asyncio.CancelledError:
                cancelled.append(name)
                raise
            if error is not None:
                raise error
            done.append(name)

        with pytest.raises(ApiError) as raised:
            await _together([read("slow", 5.0), read("bad", 0.01, ApiError(500, "decode failed")), read("ok", 0.0)])
        assert raised.value.message == "decode failed" and done == ["ok"] and cancelled == ["slow"]
        done.clear()
        await _together([read("a", 0.01), read("b", 0.0)])
        assert sorted(done) == ["a", "b"]

    asyncio.run(asyncio.wait_for(run(), 10.0))


# ---------------------------------------------------------------------------------------------- the gateway's reader


@asynccontextmanager
async def gateway_over(d: Dispatcher) -> AsyncIterator[Gateway]:
    """A gateway whose dispatcher is `d` (its own, unused, closed)."""
    gateway = Gateway(d.config, bytes(32), [], lambda _instance: True)
    own, gateway.dispatcher = gateway.dispatcher, d
    own.close()
    try:
        yield gateway
    finally:
        gateway._preparing.shutdown(wait=True)


async def serving(gateway: Gateway, d: Dispatcher, body: dict[str, Any]) -> tuple[Any, Any, LiveRequest]:
    """`body` being served by `gateway` (on a mocked request, whose writer records what goes out), its request
    prefilled and joined on its decode engine: the serving task, the request and the live request."""
    request = make_mocked_request("POST", "/v1/completions")

    async def read(_request: Any) -> Any:
        return lambda: body

    gateway._body = read  # type: ignore[method-assign]
    task = asyncio.ensure_future(gateway._serve(request, chat=False))
    for _ in range(1000):
        if d.live:
            break
        await asyncio.sleep(0.005)
    (live,) = d.live.values()
    prefilled(d, live)
    joined(d, live)
    return task, request, live


async def answered(gateway: Gateway, d: Dispatcher, body: dict[str, Any], out: bytes) -> tuple[str, LiveRequest]:
    """`body` served whole or streamed by `gateway` (its request's tokens `out`, the last ending it on the decode
    engine); the answer's finish reason and the request."""
    task, request, live = await serving(gateway, d, body)
    d._dispatch(tokens(live, *((token, i, i == len(out) - 1) for i, token in enumerate(out))))
    response = await task
    if not body.get("stream"):
        return json.loads(response.body)["choices"][0]["finish_reason"], live
    out_text = b"".join(call.args[0] for call in request._payload_writer.write.call_args_list).decode()
    events = [json.loads(line[6:]) for line in out_text.splitlines() if line.startswith("data: {")]
    return next(e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]), live


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_last_token_counts_as_the_answer_says(stream: bool) -> None:
    """The max_tokens-th token completes a stop string: the decode engine ended the request at its length, but its
    text stopped, and the answer says "stop"; the metrics count the same "stop" (one decision, the reader's: vLLM
    sets its finish reason from its detokenizer's stop strings before it counts it). A text that ran to its length
    counts "length", as it answers."""

    async def run() -> None:
        async with dispatching() as d, gateway_over(d) as gateway:
            for stop, want in (("cd", "stop"), ("zz", "length")):
                body = {"prompt": "hi", "max_tokens": 4, "stop": stop, "stream": stream}
                finish, live = await answered(gateway, d, body, b"abcd")
                assert finish == want
                assert counted(d, live.decode) == ({"stop": 1} if want == "stop" else {"stop": 1, "length": 1})
                assert not d.live and d.conductor.in_flight == ()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_while_a_choice_is_read_withdraws_its_request(stream: bool) -> None:
    """An error other than an API error raised while a choice's tokens are read (a bug: the error middleware's
    500), whole or in a stream's pump, withdraws the answer's requests as a client leaving does: none decodes on for nobody."""

    async def run() -> None:
        async with dispatching() as d, gateway_over(d) as gateway:

            class Broken:
                """A text stream that fails on the first token it reads."""

                def feed(self, _token: int) -> str:
                    raise RuntimeError("a bug")

            gateway._text_stream = lambda *_args: Broken()  # type: ignore[assignment, method-assign]
            task, _request, live = await serving(gateway, d, {"prompt": "hi", "max_tokens": 4, "stream": stream})
            d._dispatch(tokens(live, (97, 0, False)))
            with pytest.raises(RuntimeError, match="a bug"):
                await task
            assert not d.live and d.conductor.in_flight == ()
            assert sent(d, live.decode)[-1] == wire.CancelDecode(request_id=int(live.request_id), every_attempt=True)
            assert counted(d, live.decode) == {"abort": 1}

    asyncio.run(run())


def test_a_waiter_the_conductor_raises_for_in_line_gets_a_500_and_the_line_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Conductor raising when a request waiting for room is tried again (a bug) ends that request's `admit`
    with a 500, as an error at its first try ends in the error middleware's 500: its client does not wait for a
    decision that never comes, the `end` that freed the room is not broken off by it, and the one behind it is
    admitted."""

    async def run() -> None:
        async with dispatching() as d:
            d.conductor.set_decode_limits(
                InstanceId("decode-0"), DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=1)
            )
            first = await admitted(d)
            broken = asyncio.create_task(admitted(d, 100))
            await settle()
            behind = asyncio.create_task(admitted(d, 200))
            await settle()
            assert not broken.done() and not behind.done() and len(d._waiting) == 2
            broken_id = next(iter(d._waiting)).live.request_id
            schedule = d.conductor.schedule

            def raising(request: Any, now: float, *, waited_s: float = 0.0) -> ScheduleDecision:
                if request.request_id == broken_id:
                    raise RuntimeError("a predictor bug")
                return schedule(request, now, waited_s=waited_s)

            monkeypatch.setattr(d.conductor, "schedule", raising)
            d.end(first, Outcome.ABORTED, Reason.CLIENT_GONE)  # room freed: the line is tried
            async with asyncio.timeout(5.0):  # bounded: before the fix its `admit` waited until its client left
                with pytest.raises(ApiError) as failed:
                    await broken
                admitted_behind = await behind
            assert failed.value.status == 500
            assert len(d._waiting) == 0 and admitted_behind.request_id in d.live

    asyncio.run(run())
