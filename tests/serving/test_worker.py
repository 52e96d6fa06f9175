"""A prefill worker's jobs, in-process, against a real decode worker: cancellations, and a decode node that does
not answer.

Each test proves: a job the gateway cancels while it is queued is dropped (never started), one cancelled while it
runs is prefilled but not handed on (the decode node never joins it), the jobs around them are served as usual;
a decode node that does not answer (a listener that never completes the handshake, as a stopped process's
kernel would) fails the job with a report that names that node (`PrefillFailed.peer`), not the prefill; the
gateway cancels the prefill of a request whose client left or that it rerouted; a decode node's hand-off waits for
blocks another push is still filling there, and joins once they land (or is refused for KV once that push aborts);
a decode node's health answer lists a request before its first token goes out.

The workers' reports to the gateway are captured instead of sent (no gateway runs). Every wait is bounded
(`wait_for`); workers and sockets are closed at the end, even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving import wire
from serving.api import SamplingOptions
from serving.config import ClusterConfig, load_config
from serving.dispatch import Dispatcher
from serving.gateway import build_conductor
from serving.worker import Worker, WorkerSpec

from mooncake.errors import BlockPinnedError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.types import BlockKey, InstanceId
from tests.waiting import wait_for

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
SAMPLING = wire.Sampling(max_tokens=3, temperature=0.0, top_p=1.0, seed=0, stop_ids=())


def job(request_id: int, decode: str = "decode-0") -> wire.PrefillJob:
    tokens = tuple(range(request_id * 10, request_id * 10 + 24))  # each its own prompt: no prefix shared
    return wire.PrefillJob(
        request_id=request_id, attempt=0, tokens=tokens, decode=decode, fetch=None, sampling=SAMPLING
    )


def reported(told: list[Any], kind: type[Any]) -> list[int]:
    """The request ids of the reports of `kind`, in order."""
    return [m.request_id for m in list(told) if isinstance(m, kind)]


def ended(decoded: list[Any]) -> set[int]:
    """The request ids whose last token the decode node reported. One step's message carries its whole batch's
    tokens, so requests that end in the same step end in one message: count requests, not messages."""
    return {t.request_id for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens if t.finished}


Pair = tuple[Worker, Worker, list[Any], list[Any]]


@contextlib.contextmanager
def workers(config: ClusterConfig) -> Iterator[Pair]:
    """A prefill and a decode worker of `config` (neither started), the prefill's address book naming the decode
    worker, and the lists their reports go to instead of a gateway; both closed at the end."""
    secret = secrets.token_bytes(32)
    prefill = Worker(WorkerSpec(role="prefill", instance_id="prefill-0", config=config, secret=secret))
    try:
        decode = Worker(WorkerSpec(role="decode", instance_id="decode-0", config=config, secret=secret))
    except BaseException:
        prefill.close()
        raise
    told: list[Any] = []
    decoded: list[Any] = []
    prefill._tell_gateway = told.append  # type: ignore[method-assign]
    decode._tell_gateway = decoded.append  # type: ignore[method-assign]
    prefill._addresses = {"decode-0": decode.engine.address}
    try:
        yield prefill, decode, told, decoded
    finally:
        prefill.close()
        decode.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    """`workers` of the tiny config."""
    with workers(load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)) as made:
        yield made


@pytest.fixture
def silent() -> Iterator[str]:
    """An address whose listener never completes a handshake (the connection waits in its backlog)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        yield f"{host}:{port}"


def test_cancelled_jobs_are_dropped_stopped_or_not_handed_on_and_a_silent_decode_node_is_named(silent: str) -> None:
    """Seven jobs of 24 tokens in chunks of 8, queued before the prefill loop starts: 3 cancelled while queued, 2
    after its first chunk (stopped before the second: reported failed as cancelled, no cache kept, its stream
    aborted on the decode node), 7 once its prefill is done (reported done, not handed on), a cancel of another
    attempt of 4 (ignored), 5 for a silent decode node; 1, 4 and 6 are joined by the decode worker."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with workers(config.with_overrides("prefill", chunk_tokens=8)) as (prefill, decode, told, decoded):
        prefill._addresses = {"decode-0": decode.start()["address"], "decode-9": silent}
        run, asked = prefill._run_prefill, prefill._cancel_asked
        asks: list[tuple[int, int]] = []

        def cancel_after_the_first_chunk(key: tuple[int, int]) -> bool:
            answer = asked(key)
            asks.append(key)
            if key == (2, 0):  # the gateway's cancel arrives while the first chunk computes
                prefill._on_cancel_prefill(wire.CancelPrefill(request_id=2, attempt=0))
            return answer

        def cancelled_once_computed(job: wire.PrefillJob, sink: Any) -> Any:
            done = run(job, sink)
            if job.request_id == 7:
                prefill._on_cancel_prefill(wire.CancelPrefill(request_id=7, attempt=0))
            return done

        prefill._cancel_asked = cancel_after_the_first_chunk  # type: ignore[method-assign]
        prefill._run_prefill = cancelled_once_computed  # type: ignore[method-assign]
        for message in (job(1), job(2), job(3), job(4), job(5, decode="decode-9"), job(7), job(6)):
            prefill._on_job(message)
        prefill._on_cancel_prefill(wire.CancelPrefill(request_id=3, attempt=0))  # still queued: the loop is not
        prefill._on_cancel_prefill(wire.CancelPrefill(request_id=4, attempt=1))  # started; another attempt's
        prefill.start()
        wait_for(lambda: 6 in reported(decoded, wire.DecodeJoined), timeout=60.0, what="the last job to be joined")
        assert reported(told, wire.PrefillStarted) == [1, 2, 4, 5, 7, 6]  # 3 dropped unstarted
        assert reported(told, wire.PrefillDone) == [1, 4, 7, 6]
        assert reported(decoded, wire.DecodeJoined) == [1, 4, 6]  # 7 prefilled, not handed on
        assert asks.count((2, 0)) == 2 and asks.count((1, 0)) == 3  # asked before each chunk; 2 stopped at its 2nd
        cancelled, silenced = [m for m in told if isinstance(m, wire.PrefillFailed)]
        assert (cancelled.request_id, cancelled.peer) == (2, "") and "cancelled with 8 of its 24" in cancelled.error
        assert (silenced.request_id, silenced.peer) == (5, "decode-9"), silenced
        keys = prefill.hasher.block_keys(list(job(2).tokens))
        assert all(prefill.cache.location(k) is None and decode.cache.location(k) is None for k in keys)
        assert not prefill._prefill_jobs  # every job left the table: a cancel of a finished job finds nothing
        prefill._on_cancel_prefill(wire.CancelPrefill(request_id=1, attempt=0))
        assert not prefill._prefill_jobs


@contextlib.contextmanager
def dispatching(num_prefill: int, num_decode: int) -> Iterator[tuple[Dispatcher, dict[str, Worker]]]:
    """Real workers of the tiny config whose loops are not started (their jobs stay queued) and a real dispatcher
    over them, no gateway; all closed at the end."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=num_prefill, num_decode=num_decode)
    secret = secrets.token_bytes(32)
    roles = {f"prefill-{i}": "prefill" for i in range(num_prefill)} | {
        f"decode-{i}": "decode" for i in range(num_decode)
    }
    workers = {
        i: Worker(WorkerSpec(role=role, instance_id=i, config=config, secret=secret)) for i, role in roles.items()
    }
    infos = [{"instance_id": i, "role": roles[i], "address": w.engine.address} for i, w in workers.items()]
    dispatcher = Dispatcher(
        config, build_conductor(config), secret=secret, workers=infos, is_alive=lambda _: True, block_bytes=1
    )
    try:
        yield dispatcher, workers
    finally:
        dispatcher.close()
        for worker in workers.values():
            worker.close()


def test_the_gateway_cancels_the_prefill_of_a_request_that_left_or_was_rerouted() -> None:
    """Real workers whose loops are not started (their jobs stay queued), a real dispatcher: a request whose client
    leaves before its prefill is cancelled on its prefill worker; when a decode worker goes down, a request routed
    to it with no token yet is scheduled again on the other one as its next attempt, and the earlier attempt is
    cancelled on its prefill worker (the new one is queued there, not cancelled); a prefill's report that the decode
    node did not answer, when a probe finds it answering, reschedules that request alone; when the prefill worker is
    down, the cancel of the attempt abandoned then (its last) reaches it once a probe finds it answering again."""
    with dispatching(num_prefill=1, num_decode=2) as (dispatcher, workers):

        def queued(request_id: int, attempt: int) -> bool | None:
            """Whether the prefill worker holds that attempt cancelled (None: it does not hold it)."""
            return workers["prefill-0"]._prefill_jobs.get((request_id, attempt))

        async def scenario() -> None:
            sampling = SamplingOptions(max_tokens=4)
            leaving = await dispatcher.admit(list(range(24)), sampling, dispatcher.now())
            dispatcher.submit(leaving)
            wait_for(
                lambda: queued(int(leaving.request_id), 0) is False, timeout=10.0, what="the first job at the worker"
            )
            dispatcher.end(leaving, Outcome.ABORTED, Reason.CLIENT_GONE)
            wait_for(lambda: queued(int(leaving.request_id), 0), timeout=10.0, what="the cancel of the left request")

            moved = await dispatcher.admit(list(range(100, 124)), sampling, dispatcher.now())
            dispatcher.submit(moved)
            rid, first = int(moved.request_id), moved.decode
            wait_for(lambda: queued(rid, 0) is False, timeout=10.0, what="the second job at the worker")
            dispatcher._worker_failed(first)
            assert dispatcher.live[moved.request_id] is moved and moved.attempt == 1 and moved.decode != first
            wait_for(lambda: queued(rid, 0) and queued(rid, 1) is False, timeout=10.0, what="attempt 0 cancelled")

            # A prefill's report that the decode node did not answer, though it does: a probe finds it up, so it keeps
            # its streams, and the request alone is scheduled again (attempt 2), attempt 1 cancelled
            report = wire.PrefillFailed(
                instance_id="prefill-0", request_id=rid, attempt=1, error="timed out", peer=moved.decode, events=()
            )
            dispatcher._dispatch(report)
            await asyncio.gather(*dispatcher._probes)
            assert (
                dispatcher.workers[moved.decode].up
                and moved.attempt == 2
                and dispatcher.live[moved.request_id] is moved
            )
            wait_for(lambda: queued(rid, 1) and queued(rid, 2) is False, timeout=10.0, what="attempt 1 cancelled")

            dispatcher._worker_failed(InstanceId("prefill-0"))  # attempt 2 is abandoned too, its worker down
            assert moved.request_id not in dispatcher.live  # no prefill engine is left to take it (no attempt left)
            assert queued(rid, 2) is False  # not told yet: it is down
            await dispatcher._probe(dispatcher.workers["prefill-0"])  # it answers: marked up, and told
            assert dispatcher.workers["prefill-0"].up
            wait_for(lambda: queued(rid, 2), timeout=10.0, what="attempt 2 cancelled once its worker answers")

        asyncio.run(scenario())


def test_a_prefill_worker_marked_down_and_up_announces_its_cache_and_the_index_sees_it_again() -> None:
    """Marking a worker down forgets its cache in the index; the worker answering again is asked to announce what
    it holds (`wire.Announce`), and its next report's events, a new epoch, give the index every block back. Before,
    each later event was a gap and the index stayed blind to that cache for as long as the worker ran."""
    with dispatching(num_prefill=1, num_decode=1) as (dispatcher, workers):
        worker, source = workers["prefill-0"], InstanceId("prefill-0")
        index = dispatcher.conductor.index

        def report(keys: list[BlockKey]) -> None:
            """The worker's next report: blocks it stored, with the events its cache logged since the last."""
            for key in keys:
                worker.cache.put(key, bytes(worker.cache.pools[0].page_bytes))
            done = {"prefix_tokens": 0, "computed_tokens": 24, "fetched_blocks": 0, "streamed_blocks": 0}
            ids = {"instance_id": source, "request_id": 999, "attempt": 0}  # a request long ended: events only
            dispatcher._dispatch(wire.PrefillDone(**ids, **done, events=tuple(worker.cache.take_events())))

        def indexed() -> set[BlockKey]:
            return {key for key in map(BlockKey, range(1, 7)) if index.holders(key)}

        async def scenario() -> None:
            report([BlockKey(1), BlockKey(2)])
            assert indexed() == {1, 2}
            dispatcher._worker_failed(source)
            assert indexed() == set()
            epoch = worker.cache.epoch
            await dispatcher._probe(dispatcher.workers[source])  # it answers: marked up, and asked to announce
            assert dispatcher.workers[source].up
            wait_for(lambda: worker.cache.epoch > epoch, timeout=10.0, what="the announcement")
            report([BlockKey(3)])
            assert indexed() == {1, 2, 3} and source not in index.stale_sources

        asyncio.run(scenario())


def test_a_request_prefilled_but_not_handed_on_is_rerouted_when_its_prefill_worker_goes_down() -> None:
    """A prefill worker reports PrefillDone, then calls the decode node: one that dies or stops in between never
    hands the request on. When it is marked down, such a request is scheduled again on the other prefill worker as
    its next attempt (instead of waiting out the request timeout, a 504), and the abandoned attempt is cancelled
    there once it answers. A request its decode node has joined stays where it is."""
    with dispatching(num_prefill=2, num_decode=1) as (dispatcher, _workers):

        def prefilled(live: Any) -> None:
            ids = {"instance_id": live.prefill, "request_id": int(live.request_id), "attempt": live.attempt}
            dispatcher._dispatch(wire.PrefillStarted(**ids))
            done = {"prefix_tokens": 0, "computed_tokens": 24, "fetched_blocks": 0, "streamed_blocks": 1, "events": ()}
            dispatcher._dispatch(wire.PrefillDone(**ids, **done))

        async def scenario() -> None:
            sampling = SamplingOptions(max_tokens=4)
            dispatcher._worker_failed(InstanceId("prefill-1"))  # both requests go to prefill-0
            stranded = await dispatcher.admit(list(range(24)), sampling, dispatcher.now())
            joined = await dispatcher.admit(list(range(200, 224)), sampling, dispatcher.now())
            first = "prefill-0"
            assert stranded.prefill == joined.prefill == first
            await dispatcher._probe(dispatcher.workers["prefill-1"])  # it answers: up again
            assert dispatcher.workers["prefill-1"].up
            for live in (stranded, joined):
                dispatcher.submit(live)
                prefilled(live)
            dispatcher._dispatch(
                wire.DecodeJoined(
                    instance_id=joined.decode,
                    request_id=int(joined.request_id),
                    attempt=0,
                    context_tokens=24,
                    output_tokens=4,
                )
            )
            assert stranded.prefill_done_s is not None and stranded.joined_s is None and joined.joined_s is not None
            dispatcher._worker_failed(InstanceId(first))
            assert dispatcher.live[stranded.request_id] is stranded
            assert (stranded.attempt, stranded.prefill_done_s) == (1, None) and stranded.prefill != first
            assert dispatcher.live[joined.request_id] is joined and joined.attempt == 0  # decoding: left alone
            assert wire.CancelPrefill(request_id=int(stranded.request_id), attempt=0) in dispatcher._stale[first]

        asyncio.run(scenario())


def test_a_joined_request_is_in_the_health_answer_before_its_first_token_goes_out(pair: Pair) -> None:
    """The gateway's health probe must see a request on its decode engine from the moment its client can have a
    token: a client that leaves after the first one is cancelled there, and an engine that answers "idle" meanwhile
    (its batch published only after the next step) misleads whoever watches it. Each report of a request's first
    token finds it in the health answer, with its KV counted."""
    prefill, decode, _told, decoded = pair
    seen: dict[int, tuple[tuple[int, ...], float]] = {}

    def report(message: Any) -> None:
        if isinstance(message, wire.DecodeTokens):
            for token in message.tokens:
                if token.index == 0:
                    health = decode._on_health(wire.HealthCheck())
                    seen[token.request_id] = (health.active, health.kv_usage)
        decoded.append(message)

    decode._tell_gateway = report  # type: ignore[method-assign]
    prefill._addresses = {"decode-0": decode.start()["address"]}
    prefill.start()
    for request_id in (1, 2, 3):
        prefill._on_job(job(request_id))
    wait_for(lambda: len(seen) == 3, timeout=60.0, what="the three first tokens")
    for request_id, (active, kv_usage) in seen.items():
        assert request_id in active and kv_usage > 0, (request_id, active, kv_usage)


def test_a_hand_off_waits_for_blocks_another_push_is_still_filling(pair: Pair) -> None:
    """Requests sharing a prefix, sent at once, push into the same decode node, each filling only the blocks no
    other push is filling; one whose hand-off comes first must wait for the others' blocks, not be refused for
    KV (a 429 'kv_budget' to a third of such bursts before). Real workers: a prompt's blocks are reserved on the
    decode node by a push the test holds open (the first block stays there); the hand-off waits (no report, the
    first block pinned) until the push commits, then joins; a second one waits until its push is aborted, then is
    refused for KV (the blocks never came) and lets go of the first block."""
    prefill, decode, _told, decoded = pair
    prefill._addresses = {"decode-0": decode.start()["address"]}
    prefill.start()
    first = job(1)
    prefill._on_job(first)  # prefilled here, streamed there: both caches hold its blocks
    wait_for(lambda: 1 in reported(decoded, wire.DecodeJoined), timeout=60.0, what="the first request's join")
    wait_for(lambda: not decode._attempts, timeout=60.0, what="the first request to finish decoding")
    keys = tuple(int(k) for k in prefill.hasher.block_keys(list(first.tokens)))

    def hand_off(request_id: int) -> None:
        for key in keys[1:]:  # gone from the decode node but the first: the next push fills them again
            decode.cache.remove(BlockKey(key))
        handed = wire.DecodeJob(
            request_id=request_id, attempt=0, keys=keys, prompt_tokens=24, first_token=5, sampling=SAMPLING
        )
        push = prefill.messenger.push([BlockKey(k) for k in keys], prefill._peer("decode-0"), parts=1)
        decode._on_job(handed)
        wait_for(
            lambda: bool(getattr(decode._arriving.get(request_id), "pinned", ())),
            timeout=30.0,
            what="the hand-off to wait, holding the block already there",
        )
        time.sleep(0.2)  # it goes on waiting: no join, no refusal
        assert request_id not in reported(decoded, wire.DecodeJoined) + reported(decoded, wire.DecodeRejected)
        with pytest.raises(BlockPinnedError):  # the block already there is held while the hand-off waits
            decode.cache.remove(BlockKey(keys[0]))
        pushes.append(push)

    pushes: list[Any] = []
    hand_off(2)
    pushes[0].finish(30.0)
    wait_for(lambda: 2 in reported(decoded, wire.DecodeJoined), timeout=30.0, what="the join once the push lands")
    hand_off(3)
    pushes[1].abort()
    wait_for(lambda: 3 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the refusal once it aborts")
    [refused] = [m for m in decoded if isinstance(m, wire.DecodeRejected)]
    assert refused.reason == "kv_budget"
    decode.cache.remove(BlockKey(keys[0]))  # let go once the hand-off left


def test_a_block_that_lands_while_the_hand_off_waits_for_others_is_held_too(pair: Pair) -> None:
    """A hand-off waiting on two pushes holds each block as it lands, not only those there when it began to wait:
    one push commits while the other still fills, and its block stays pinned until the hand-off leaves (it was
    left unpinned, for a burst of pushes to evict before the join). The other push aborted, the hand-off is
    refused for KV and lets go of both blocks it held."""
    prefill, decode, _told, decoded = pair
    prefill._addresses = {"decode-0": decode.start()["address"]}
    prefill.start()
    tokens = tuple(range(100, 140))  # three 16-token blocks
    prefill._on_job(
        wire.PrefillJob(request_id=1, attempt=0, tokens=tokens, decode="decode-0", fetch=None, sampling=SAMPLING)
    )
    wait_for(lambda: 1 in reported(decoded, wire.DecodeJoined), timeout=60.0, what="the first request's join")
    wait_for(lambda: not decode._attempts, timeout=60.0, what="the first request to finish decoding")
    keys = [BlockKey(int(k)) for k in prefill.hasher.block_keys(list(tokens))]
    assert len(keys) == 3
    for key in keys[1:]:  # gone from the decode node but the first: two pushes fill them again
        decode.cache.remove(key)
    first_push = prefill.messenger.push(keys[1:2], prefill._peer("decode-0"), parts=1)
    second_push = prefill.messenger.push(keys[2:], prefill._peer("decode-0"), parts=1)
    try:
        decode._on_job(
            wire.DecodeJob(
                request_id=2, attempt=0, keys=tuple(keys), prompt_tokens=40, first_token=5, sampling=SAMPLING
            )
        )
        wait_for(lambda: keys[0] in getattr(decode._arriving.get(2), "pinned", ()), timeout=30.0, what="the wait")
        first_push.finish(30.0)
        wait_for(lambda: keys[1] in decode._arriving[2].pinned, timeout=30.0, what="the landed block to be held")
        with pytest.raises(BlockPinnedError):
            decode.cache.remove(keys[1])
    finally:
        second_push.abort()
    wait_for(lambda: 2 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the refusal once it aborts")
    for key in keys[:2]:  # let go: removable
        decode.cache.remove(key)


def test_a_hand_off_whose_blocks_never_land_is_refused_for_kv(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that neither commits nor gives up (its prefill engine stopped) holds its blocks' memory: a hand-off
    waiting for them is refused for KV once the wait runs out (a 429 the client may retry; a 500 'decode failed'
    before), and lets go of what it pinned."""
    import serving.worker

    monkeypatch.setattr(serving.worker, "TIMEOUT_S", 1.5)
    prefill, decode, _told, decoded = pair
    prefill._addresses = {"decode-0": decode.start()["address"]}
    prefill.start()
    prefill._on_job(job(1))  # prefilled here (the push's source), streamed there
    wait_for(lambda: 1 in reported(decoded, wire.DecodeJoined), timeout=60.0, what="the first request's join")
    wait_for(lambda: not decode._attempts, timeout=60.0, what="the first request to finish decoding")
    keys = tuple(int(k) for k in prefill.hasher.block_keys(list(job(1).tokens)))
    for key in keys:  # gone from the decode node: the push below fills them again
        decode.cache.remove(BlockKey(key))
    push = prefill.messenger.push([BlockKey(k) for k in keys], prefill._peer("decode-0"), parts=1)
    try:
        handed = wire.DecodeJob(request_id=7, attempt=0, keys=keys, prompt_tokens=24, first_token=5, sampling=SAMPLING)
        decode._on_job(handed)
        wait_for(lambda: 7 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the refusal")
        assert not reported(decoded, wire.DecodeFailed)
        [refused] = [m for m in decoded if isinstance(m, wire.DecodeRejected)]
        assert refused.reason == "kv_budget" and not decode._arriving
    finally:
        push.abort()


def test_a_failure_is_blamed_on_the_decode_node_only_when_it_is_that_nodes(pair: Pair) -> None:
    """Past the connection (opened by a first job that is joined): the decode node gone, a job's KV stream to it
    fails and the report names it; the prefill's own failure (an OSError from the engine, the stream untouched)
    names nobody."""
    prefill, decode, told, decoded = pair
    prefill._addresses = {"decode-0": decode.start()["address"]}
    engine = prefill._prefill
    assert engine is not None
    compute = engine.prefill

    def failing(tokens: Any, **options: Any) -> Any:
        if tokens[0] == 30:  # job 3's prompt: the engine fails before it streams anything
            raise OSError("the prefill's own disk failed")
        return compute(tokens, **options)

    engine.prefill = failing  # type: ignore[method-assign]
    prefill.start()
    prefill._on_job(job(1))
    wait_for(lambda: 1 in reported(decoded, wire.DecodeJoined), timeout=60.0, what="the first join")
    decode.close()  # its engine closes: the prefill's next reserve call there fails
    prefill._on_job(job(2))
    prefill._on_job(job(3))
    wait_for(lambda: len(reported(told, wire.PrefillFailed)) == 2, timeout=60.0, what="two failures")
    failed = {m.request_id: m.peer for m in told if isinstance(m, wire.PrefillFailed)}
    assert failed == {2: "decode-0", 3: ""}, told


def test_a_decode_worker_drops_its_cache_change_log(pair: Pair) -> None:
    """A decode node's cache receives every pushed block but nobody takes its events (only prefill workers are
    indexed): its change log is drained each round of the decode loop, not kept for the worker's lifetime."""
    prefill, decode, _told, decoded = pair
    prefill._addresses = {"decode-0": decode.start()["address"]}
    prefill.start()
    for request_id in range(1, 7):
        prefill._on_job(job(request_id))
    wait_for(lambda: len(ended(decoded)) == 6, timeout=60.0, what="six requests decoded")
    wait_for(lambda: not decode.cache._log, timeout=10.0, what="the decode cache's change log drained")
