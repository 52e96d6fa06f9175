"""The gateway's admission wait (`Dispatcher.admit`), without workers: a real Conductor over one prefill and
one decode instance of one batch slot, driven on an event loop as the gateway drives it.

What the end-to-end burst in test_cluster.py cannot pin down: first come, first served (a later arrival never
overtakes), a client leaving as its turn came passes the turn on, a wait's deadline ends it in a 429 naming the
bound, and shutting down answers every waiter, and every later request, with a 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.api import ApiError, SamplingOptions
from serving.config import load_config
from serving.dispatch import Dispatcher, LiveRequest, WorkerState
from serving.gateway import build_conductor

from mooncake.sched.join import DecodeLimits
from mooncake.sched.outcome import Outcome
from mooncake.types import InstanceId
from tests.serving.conftest import EXAMPLES

TINY = EXAMPLES / "configs" / "tiny.toml"
PREFILL, DECODE, SPARE = InstanceId("prefill-0"), InstanceId("decode-0"), InstanceId("prefill-1")
STEP_S = 0.01  # how long the tests let the loop run between steps (nothing here waits on I/O)


@asynccontextmanager
async def dispatcher(
    admission_wait_s: float = 30.0,
    kv_tokens: int | None = None,
    request_timeout_s: float = 60.0,
    spare_prefill: bool = False,
) -> AsyncIterator[Dispatcher]:
    """A dispatcher with no workers, its Conductor knowing one prefill instance (two with `spare_prefill`) and
    one decode instance of one batch slot (`kv_tokens`: of unlimited slots and that much KV), all up; what it
    would send the workers is recorded (`Calls`)."""
    config = load_config(TINY).with_overrides(
        "limits", admission_wait_s=admission_wait_s, request_timeout_s=request_timeout_s
    )
    conductor = build_conductor(config)
    prefills = (PREFILL, SPARE) if spare_prefill else (PREFILL,)
    conductor.add_prefill_instances(prefills)
    limits = DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=1)
    if kv_tokens is not None:
        limits = DecodeLimits(kv_capacity_tokens=kv_tokens)
    conductor.add_decode_instance(DECODE, limits)
    found = Dispatcher(config, conductor, secret=bytes(32), workers=[], is_alive=lambda _: True, block_bytes=1)
    roles = {instance: "prefill" for instance in prefills} | {DECODE: "decode"}
    found.workers = {instance: WorkerState(instance, role) for instance, role in roles.items()}
    found._calls = {instance: Calls() for instance in roles}  # type: ignore[misc]
    found._unsent = {instance: set() for instance in roles}
    found._stale = {instance: [] for instance in roles}
    try:
        yield found
    finally:
        found.close()


@attrs.define
class Calls:
    """Stands in for a worker's control-call thread: records what would be sent."""

    sent: list[Any] = attrs.field(factory=list)

    def submit(self, _function: Any, _instance: str, message: Any) -> concurrent.futures.Future[None]:
        self.sent.append(type(message).__name__)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def shutdown(self, **_options: Any) -> None:
        pass


def admitting(d: Dispatcher, first_token: int, length: int = 40) -> Callable[[], Coroutine[Any, Any, LiveRequest]]:
    """A request of its own prompt (no shared prefix) of `length` tokens, 4 tokens out."""
    prompt = list(range(first_token, first_token + length))
    return lambda: d.admit(prompt, SamplingOptions(max_tokens=4), d.now())


def sent(d: Dispatcher, instance: InstanceId) -> list[str]:
    return d._calls[instance].sent  # type: ignore[attr-defined, no-any-return]


async def settle() -> None:
    await asyncio.sleep(STEP_S)


def test_first_come_first_served() -> None:
    """A holds 44 of the 100 KV tokens; B (64) waits, and so does C (44), which would fit beside A but came
    after B. A's end lets B in, not C (no room beside B); B's end lets C in."""

    async def run() -> None:
        async with dispatcher(kv_tokens=100) as d:
            a = await admitting(d, 0)()
            b = asyncio.create_task(admitting(d, 1000, length=60)())
            await settle()
            c = asyncio.create_task(admitting(d, 2000)())
            await settle()
            assert not b.done() and not c.done() and len(d._waiting) == 2
            assert d.metrics.admission_waiting._value.get() == 2  # type: ignore[attr-defined]
            d.end(a, Outcome.COMPLETED)
            await settle()
            assert b.done() and not c.done()
            d.end(b.result(), Outcome.COMPLETED)
            await settle()
            assert c.done() and set(d.conductor.in_flight) == {c.result().request_id}
            assert len(d._waiting) == 0

    asyncio.run(run())


@pytest.mark.parametrize("leaves_first", [False, True], ids=["admitted-then-leaves", "leaves-then-admitted"])
def test_a_client_leaving_as_its_turn_came_passes_the_turn_on(leaves_first: bool) -> None:
    """A's end admits B from the line while B's client leaves, in either order within one turn of the loop
    (before B's coroutine runs again): B is ended (client gone, cancelled on both its engines) and C, behind it,
    gets the slot, with nothing escaping into the loop. A client leaving while waiting leaves the line and
    nothing is scheduled for it; it counts as an abort (it was counted nowhere)."""

    async def run() -> None:
        async with dispatcher() as d:
            a = await admitting(d, 0)()
            b = asyncio.create_task(admitting(d, 1000)())
            await settle()
            c = asyncio.create_task(admitting(d, 2000)())
            await settle()
            if leaves_first:
                b.cancel()
                d.end(a, Outcome.COMPLETED)
            else:
                d.end(a, Outcome.COMPLETED)
                b.cancel()
            await settle()
            assert b.cancelled() and c.done() and not c.cancelled()
            assert set(d.conductor.in_flight) == {c.result().request_id}
            assert (sent(d, DECODE), sent(d, PREFILL)) == (["CancelDecode"], ["CancelPrefill"])  # B's, never sent
            e = asyncio.create_task(admitting(d, 3000)())
            await settle()
            assert len(d._waiting) == 1
            e.cancel()
            await settle()
            assert len(d._waiting) == 0 and set(d.conductor.in_flight) == {c.result().request_id}
            # Every end counts once: B's (admitted as it left, in either order) and E's as aborts, E's, which left
            # the line, on no engine yet (`engine=""`).
            aborts = {engine: d.metrics.success[engine, "abort"]._value.get() for engine in ("", DECODE)}  # type: ignore[attr-defined]
            assert aborts == {"": 1, DECODE: 1}

    asyncio.run(run())


def test_a_wait_ends_at_its_deadline_in_a_429_naming_the_bound() -> None:
    async def run() -> None:
        async with dispatcher(admission_wait_s=0.2) as d:
            await admitting(d, 0)()
            started = d.now()
            with pytest.raises(ApiError) as caught:
                await admitting(d, 1000)()
            assert 0.2 <= d.now() - started < 5.0  # a loaded machine fires the timer late
            assert (caught.value.status, caught.value.code) == (429, "batch_full")
            assert len(d._waiting) == 0

    asyncio.run(run())


def test_a_wait_never_outlasts_the_request_timeout() -> None:
    """A TTFT objective (30 s) and a wait (30 s) past the request timeout (0.3 s): the wait ends by the first
    token's deadline, in a 429, not in a 504 after it."""

    async def run() -> None:
        async with dispatcher(request_timeout_s=0.3) as d:
            assert d.config.slo.ttft_s == 30.0 and d.conductor.slo.ttft_s == 0.3
            await admitting(d, 0)()
            started = d.now()
            with pytest.raises(ApiError) as caught:
                await admitting(d, 1000)()
            # About 0.3 s (a loaded machine fires the timer late), far from the 30 s an uncapped wait takes.
            assert d.now() - started < 5.0 and (caught.value.status, caught.value.code) == (429, "ttft_slo")
            # Refused for the time it waited (its estimate is under the objective): the message says so.
            assert "s waited for room, objective 0.3 s" in caught.value.message, caught.value.message

    asyncio.run(run())


def test_shutting_down_answers_waiters_and_later_requests_with_a_503() -> None:
    """Waiters and later requests get a 503; a live request keeps its 503 and is neither sent nor, when its
    engine fails after the shutdown, scheduled again."""

    async def run() -> None:
        async with dispatcher(spare_prefill=True) as d:
            a = await admitting(d, 0)()
            b = asyncio.create_task(admitting(d, 1000)())
            await settle()
            d.shut_down_requests()
            with pytest.raises(ApiError) as caught:
                await b
            assert caught.value.status == 503
            with pytest.raises(ApiError) as later:
                await admitting(d, 2000)()
            assert later.value.status == 503
            kind, error = a.events.get_nowait()
            assert kind == "error" and error.status == 503
            d.submit(a)  # sends nothing once shut down (its pools may be gone)
            assert "PrefillJob" not in sent(d, a.prefill)
            d._worker_failed(a.prefill)  # not rerouted to the spare one
            assert d.conductor.in_flight == () and not d.live

    asyncio.run(run())


def test_a_request_the_line_admitted_is_sent_once_even_if_rerouted_before_its_admit_returns() -> None:
    """A's end admits B from the line; before B's `admit` returns, B's prefill engine fails and B is rerouted
    and sent to the other one; the gateway's `submit` of what `admit` returned then sends nothing more (the
    same attempt twice, or to the engine that failed)."""

    async def run() -> None:
        async with dispatcher(spare_prefill=True) as d:
            a = await admitting(d, 0)()
            d.submit(a)
            a_instance = a.prefill
            b = asyncio.create_task(admitting(d, 1000)())
            await settle()
            d.end(a, Outcome.COMPLETED)  # B admitted here ...
            (b_live,) = d.live.values()
            first = b_live.prefill
            d._worker_failed(first)  # ... and its prefill engine fails before B's coroutine runs again
            assert b_live.attempt == 1 and b_live.prefill != first
            d.submit(await b)  # what the gateway does with what admit returned
            jobs = {instance: sent(d, instance).count("PrefillJob") for instance in (PREFILL, SPARE)}
            # A's where it was routed (the prompts' keys decide which); B's only attempt 1, once
            assert jobs == {instance: [a_instance, b_live.prefill].count(instance) for instance in (PREFILL, SPARE)}

    asyncio.run(run())


def test_an_engine_going_down_wakes_the_line() -> None:
    """The one decode engine fails: A, on it, is rerouted and finds none; B, waiting, is tried at once and
    gets its 503 then, not at its deadline 30 s on."""

    async def run() -> None:
        async with dispatcher() as d:
            a = await admitting(d, 0)()
            b = asyncio.create_task(admitting(d, 1000)())
            await settle()
            started = d.now()
            d._worker_failed(DECODE)
            with pytest.raises(ApiError) as caught:
                await b
            assert caught.value.status == 503 and d.now() - started < 5.0
            kind, error = a.events.get_nowait()
            assert kind == "error" and error.status == 503

    asyncio.run(run())


def test_the_gateways_ttft_objective_is_capped_at_the_request_timeout() -> None:
    """A request estimated (or waited) past the request timeout would get a 504 after its prefill: the
    Conductor admits against the capped objective, so it is refused before (`ClusterConfig.objectives`)."""
    config = load_config(TINY).with_overrides("limits", request_timeout_s=0.3)
    assert config.slo.ttft_s == 30.0 and config.objectives().ttft_s == 0.3
    assert build_conductor(config).slo.ttft_s == 0.3
    assert load_config(TINY).objectives() == load_config(TINY).slo.objectives()
