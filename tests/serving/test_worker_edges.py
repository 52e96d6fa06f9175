"""Edges of the example cluster's engine worker (`serving.worker`) and machine check (`serving.machine`) that their
own tests leave unchecked.

- The KV stream's blame (`_DecodeStream`): a step of the stream that fails because the decode node does not answer
  (a timeout, a peer unavailable, a socket error) marks the stream `unreachable`; any other failure does not;
  either way the error reaches the caller (a property over the step and the error, against a push double).
- The health answer: ok until the worker is told to stop (then `wait` returns), the jobs queued, a prefill node's
  share of its DRAM pages that hold blocks, a decode node's tokens generated so far; a loop that dies on an error
  it does not expect stops the worker; a decode message sent to a prefill node is skipped, not the end of its loop.
- The gateway's side: a worker reports nothing before `worker.connect` names the gateway, then every report
  reaches it, a prefill's PrefillDone before its hand-off; `worker.peer_gone` ends the leases the gone peer's
  pushes held here.
- Prefill reports: the cache events and the blocks fetched (only those planned; an unknown holder computed
  instead), a failure after a fetch still carrying its events; a failed hand-off names the decode node only when
  it did not answer.
- Decode: a cancel stops a request at once and drops a hand-off still waiting for blocks; a waiting hand-off gives
  way to a later attempt only, and a later attempt replaces the one decoding; a hand-off that comes after its
  request's cancel, or of an attempt that ended there, is dropped, a later attempt still joins (and the node's
  memory of what ended keeps to its bounds, and to a reference model within them); a request's sampling options
  (stop ids, min_tokens, max_tokens = 1, temperature and top_p) reach the engines.
- Lifecycle: closing removes the SSD folder (named for the launcher's sweep) and closes its pool and the prefill
  engine's threads; SIGTERM stops a worker process cleanly; the decode engine applies the config's TBT objective.
- `serving.machine`: a port in TIME_WAIT is free; a hard file limit below the reserve still grants one connection;
  a demand equal to the shared memory or file limit there is is taken, one more refused; RAM grows by a process per
  pipeline stage and by a context of KV per decode slot; /proc/meminfo's kB are KiB; an SSD folder is checked for
  writing only when a tier uses it.
- `serving.prefill_group`: a group forward pass waits for every layer's prefix before the group starts and hands
  it the prompt, the prefix and the store (against group and I/O doubles); its engine is layer-wise unless told.

Real workers of the tiny config, in-process, on loopback (one in a process of its own); every wait is bounded, and
workers, engines, pushes and processes are closed at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

import torch
from serving import wire
from serving.api import SamplingOptions
from serving.config import load_config
from serving.launch import SSD_FOLDER_NAME
from serving.machine import (
    FD_RESERVE,
    MAX_LINGERING,
    PROCESS_BYTES,
    Machine,
    _meminfo_bytes,
    check_machine,
    check_port_free,
)
from serving.prefill_group import GroupForward, group_prefill_engine
from serving.worker import (
    EVERY_ATTEMPT,
    Worker,
    WorkerSpec,
    _DecodeStream,
    _EndedAttempts,
    _sampling_params,
    run_worker,
    ssd_file_name,
    ssd_label,
)

from mooncake.cache.events import BlockStored
from mooncake.engine.kv import KvLayout
from mooncake.engine.sampling import SamplingParams
from mooncake.errors import (
    ConfigError,
    IntegrityError,
    PeerUnavailable,
    TransferError,
    TransferTimeout,
    UnknownBlockError,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.request import EngineConfig
from mooncake.types import BlockKey, RequestId, Tier
from tests.engine.support import TINY as TINY_MODEL
from tests.engine.support import dram_cache
from tests.engine.support import hasher as support_hasher
from tests.serving.test_worker import SAMPLING, TINY, Pair, job, reported, workers
from tests.waiting import wait_for

PROMPT = tuple((i * 7) % 256 for i in range(64))  # 4 blocks of the tiny config's 16 tokens


@pytest.fixture
def pair() -> Iterator[Pair]:
    """`workers` of the tiny config."""
    with workers(load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)) as made:
        yield made


def control(worker: Worker, message: wire.Message) -> Any:
    """`message` served as the gateway's control call to `worker` would be: its JSON answer."""
    return worker.engine.handle_call(*wire.encode(message))


def health(worker: Worker) -> wire.Health:
    return wire.decode_as(wire.Health, control(worker, wire.HealthCheck()))


# ---------------------------------------------------------------------------------------------- the KV stream


class _Push:
    """A push double whose step `failing` raises `error`."""

    def __init__(self, failing: str, error: Exception) -> None:
        self.failing, self.error = failing, error

    def _step(self, name: str) -> None:
        if name == self.failing:
            raise self.error

    def send_part(self, _layer: int) -> None:
        self._step("layer_ready")

    def finish(self, _timeout_s: float) -> tuple[BlockKey, ...]:
        self._step("end")
        return ()

    def abort(self) -> None:
        pass


class _Messenger:
    def __init__(self, push: _Push) -> None:
        self._push = push

    def push(self, _keys: Any, _peer: str, *, parts: int) -> _Push:
        self._push._step("begin")
        return self._push


UNREACHABLE_ERRORS = [TransferTimeout("timed out"), PeerUnavailable("gone"), ConnectionResetError("reset")]
OWN_ERRORS = [IntegrityError("checksum"), TransferError("refused"), UnknownBlockError(7), RuntimeError("bug")]


@settings(max_examples=40, deadline=None)
@given(step=st.sampled_from(["begin", "layer_ready", "end"]), error=st.sampled_from(UNREACHABLE_ERRORS + OWN_ERRORS))
def test_the_stream_blames_the_decode_node_only_when_it_does_not_answer(step: str, error: Exception) -> None:
    """Whatever step of the stream fails, the error reaches the caller, and the stream is `unreachable` exactly
    when the error is the decode node not answering (a timeout, a peer unavailable, a socket error)."""
    sink = _DecodeStream(_Messenger(_Push(step, error)), "decode-0", num_layers=2)  # type: ignore[arg-type]
    assert not sink.unreachable
    with pytest.raises(type(error)):
        sink.begin((BlockKey(1),))
        sink.layer_ready(0)
        sink.layer_ready(1)
        sink.end()
    assert sink.unreachable is any(error is e for e in UNREACHABLE_ERRORS), (step, error)


# ---------------------------------------------------------------------------------------------- health


def test_health_counts_queued_jobs_and_turns_not_ok_once_told_to_stop(pair: Pair) -> None:
    """Before its loop runs, a prefill worker's health answer counts the jobs queued and no KV in use; after
    `worker.stop`, it answers not ok and `wait` returns."""
    prefill, _decode, _told, _decoded = pair
    assert health(prefill) == wire.Health(
        ok=True, pid=health(prefill).pid, queued=0, active=(), generated_tokens=0, kv_usage=0.0
    )
    for request_id in (1, 2, 3):
        control(prefill, job(request_id))
    assert health(prefill).queued == 3
    assert not prefill.wait(0)
    control(prefill, wire.Stop())
    assert not health(prefill).ok
    assert prefill.wait(0)


def test_health_gives_a_prefill_nodes_cache_use_and_a_decode_nodes_tokens(pair: Pair) -> None:
    """The prefill node's kv_usage is the share of its DRAM pages that hold blocks; the decode node's
    generated_tokens counts every token it reported, two hand-offs joined at once (their first tokens, the
    prefills', in one report) included."""
    prefill, decode, _told, decoded = pair
    engine = prefill._prefill
    assert engine is not None and health(prefill).kv_usage == 0.0
    engine.prefill(list(PROMPT))
    used = prefill.cache.used_bytes(Tier.DRAM) / prefill.cache.capacity_bytes(Tier.DRAM)
    assert used > 0 and health(prefill).kv_usage == pytest.approx(used)
    keys = prefill.hasher.block_keys(list(PROMPT))
    prefill.messenger.push(keys, prefill._peer("decode-0"), parts=1).finish(30.0)  # the KV both hand-offs need
    for request_id in (1, 2):  # queued before the decode loop starts: joined in its first round
        handed = wire.DecodeJob(
            request_id=request_id, attempt=0, keys=tuple(keys), prompt_tokens=64, first_token=5, sampling=SAMPLING
        )
        control(decode, handed)
    decode.start()
    wait_for(lambda: finished(decoded) == 2, timeout=30.0, what="both requests to finish")
    tokens = sum(len(m.tokens) for m in decoded if isinstance(m, wire.DecodeTokens))
    assert tokens == 2 * SAMPLING.max_tokens
    assert health(decode).generated_tokens == tokens
    assert health(decode).active == () and health(decode).ok


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_decode_message_is_skipped_and_an_unexpected_error_stops_the_worker(pair: Pair) -> None:
    """A decode message sent to a prefill node is skipped: the next prefill job runs; an error the prefill loop
    does not expect ends the loop, and the worker with it (its health answer turns not ok, `wait` returns)."""
    prefill, _decode, told, _decoded = pair
    ran: list[int] = []

    def broken(job: wire.PrefillJob, _sink: Any) -> Any:
        ran.append(job.request_id)
        raise ValueError("a bug in the prefill")

    prefill._run_prefill = broken  # type: ignore[method-assign]
    control(prefill, wire.CancelDecode(request_id=9))
    control(
        prefill, wire.DecodeJob(request_id=9, attempt=0, keys=(1,), prompt_tokens=4, first_token=1, sampling=SAMPLING)
    )
    control(prefill, job(1))
    prefill.start()
    wait_for(lambda: prefill.wait(0), timeout=30.0, what="the worker to stop")
    assert ran == [1] and reported(told, wire.PrefillStarted) == [1]
    assert not health(prefill).ok


# ---------------------------------------------------------------------------------------------- the gateway's side


def test_reports_reach_the_gateway_once_connect_names_it() -> None:
    """A decode worker reports nothing before `worker.connect` (nobody asked it anything); once connected, its
    refusal of a hand-off reaches the gateway's engine over the transport."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    secret = secrets.token_bytes(32)
    received: list[Any] = []
    gateway = TransferEngine(secret=secret, config=EngineConfig(transports=("tcp",), io_timeout_s=5.0))
    gateway.register_handler(wire.DecodeRejected.METHOD, lambda args: received.append(args))
    decode = Worker(WorkerSpec(role="decode", instance_id="decode-0", config=config, secret=secret))
    try:
        decode.start()
        handed = wire.DecodeJob(
            request_id=1, attempt=0, keys=(12345,), prompt_tokens=8, first_token=7, sampling=SAMPLING
        )
        decode._deliver(wire.DecodeRejected(instance_id="decode-0", request_id=0, attempt=0, reason="kv_budget"))
        control(decode, wire.Connect(gateway=gateway.address, peers={}))
        control(decode, handed)  # its block is not there: refused for KV
        wait_for(lambda: bool(received), timeout=30.0, what="the refusal at the gateway")
        [refusal] = [wire.decode_as(wire.DecodeRejected, args) for args in received]
        assert (refusal.request_id, refusal.reason) == (1, "kv_budget")
    finally:
        decode.close()
        gateway.close()


def test_peer_gone_ends_the_leases_of_that_peers_pushes(pair: Pair) -> None:
    """A prefill node's push reserves pages on the decode node; when the gateway says that node is gone, the decode
    node ends its leases: the reserved blocks are no longer there (their pages free for others)."""
    prefill, decode, _told, _decoded = pair
    decode.start()
    engine = prefill._prefill
    assert engine is not None
    tokens = list(job(1).tokens)
    engine.prefill(tokens)
    keys = [BlockKey(k) for k in prefill.hasher.block_keys(tokens)]
    push = prefill.messenger.push(keys, prefill._peer("decode-0"), parts=1)
    try:
        assert all(decode.cache.location(k) is not None for k in keys)
        control(decode, wire.PeerGone(address="127.0.0.1:1"))  # another peer: nothing of this push ends
        assert all(decode.cache.location(k) is not None for k in keys)
        control(decode, wire.PeerGone(address=prefill.engine.address))
        assert all(decode.cache.location(k) is None for k in keys)
    finally:
        push.abort()


# ---------------------------------------------------------------------------------------------- prefill reports


def tokens_of(decoded: list[Any], request_id: int) -> list[wire.Token]:
    """The tokens of `request_id` the decode node reported, in order."""
    return [
        t for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens if t.request_id == request_id
    ]


def finished(decoded: list[Any]) -> int:
    return sum(t.finished for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens)


def test_a_prefill_fetches_the_planned_prefix_and_reports_the_blocks_it_stored(pair: Pair) -> None:
    """A prefill's report carries its cache events (the blocks it stored) and counts the blocks it fetched from the
    holder the plan names, only those planned; a holder the worker does not know is computed instead; a job that
    fails after its fetch still reports the fetched blocks' events, so the gateway's index follows the cache."""
    prefill, decode, told, decoded = pair
    bare = TransferEngine(secret=prefill.spec.secret, config=EngineConfig(transports=("tcp",), io_timeout_s=5.0))
    try:
        prefill._addresses["decode-9"] = bare.address  # answers, but serves no blocks: its KV stream fails
        decode.start()
        prefill.start()
        keys = tuple(prefill.hasher.block_keys(list(PROMPT)))
        assert len(keys) == 4

        def send(request_id: int, decode_id: str, fetch: wire.Fetch | None) -> None:
            for key in keys:  # gone from the prefill node: only the decode node holds them
                if prefill.cache.location(key) is not None:
                    prefill.cache.remove(key)
            control(
                prefill,
                wire.PrefillJob(
                    request_id=request_id, attempt=0, tokens=PROMPT, decode=decode_id, fetch=fetch, sampling=SAMPLING
                ),
            )

        control(
            prefill,
            wire.PrefillJob(request_id=1, attempt=0, tokens=PROMPT, decode="decode-0", fetch=None, sampling=SAMPLING),
        )
        wait_for(lambda: finished(decoded) == 1, timeout=30.0, what="the first request to finish")
        [first] = [m for m in told if isinstance(m, wire.PrefillDone)]
        stored = {k for e in first.events if isinstance(e, BlockStored) for k in e.keys}
        assert stored == set(keys) and first.streamed_blocks == 4 and first.fetched_blocks == 0

        send(2, "decode-0", wire.Fetch(source="decode-0", blocks=2))
        wait_for(lambda: 2 in reported(told, wire.PrefillDone), timeout=30.0, what="the fetching prefill")
        [second] = [m for m in told if isinstance(m, wire.PrefillDone) and m.request_id == 2]
        assert second.fetched_blocks == 2 and second.prefix_tokens == 32, second

        send(3, "decode-0", wire.Fetch(source="prefill-9", blocks=2))  # a holder it cannot name: computed
        wait_for(lambda: 3 in reported(told, wire.PrefillDone), timeout=30.0, what="the prefill of an unknown holder")
        [third] = [m for m in told if isinstance(m, wire.PrefillDone) and m.request_id == 3]
        assert (third.fetched_blocks, third.prefix_tokens) == (0, 0), third

        send(4, "decode-9", wire.Fetch(source="decode-0", blocks=2))
        wait_for(lambda: 4 in reported(told, wire.PrefillFailed), timeout=30.0, what="the failed prefill")
        [failed] = [m for m in told if isinstance(m, wire.PrefillFailed)]
        assert failed.peer == ""  # it answered: the failure is not that node not answering
        assert {k for e in failed.events if isinstance(e, BlockStored) for k in e.keys} >= set(keys[:2]), failed
    finally:
        bare.close()


@pytest.mark.parametrize(("error", "peer"), [(PeerUnavailable("gone"), "decode-0"), (TransferError("refused"), "")])
def test_a_failed_hand_off_is_reported_naming_the_node_only_when_it_did_not_answer(
    pair: Pair, error: Exception, peer: str
) -> None:
    """The KV streamed, the hand-off call to the decode node fails: the prefill reports the failure (after its
    PrefillDone), naming the decode node only when that node did not answer."""
    prefill, decode, told, _decoded = pair
    decode.start()
    call = prefill.engine.call

    def handing_off_fails(peer_name: str, method: str, args: Any) -> Any:
        if method == wire.DecodeJob.METHOD:
            raise error
        return call(peer_name, method, args)

    prefill.engine.call = handing_off_fails  # type: ignore[method-assign]
    prefill.start()
    control(prefill, job(1))
    wait_for(lambda: 1 in reported(told, wire.PrefillFailed), timeout=30.0, what="the failed hand-off")
    assert reported(told, wire.PrefillDone) == [1]
    [failed] = [m for m in told if isinstance(m, wire.PrefillFailed)]
    assert failed.peer == peer and failed.error.startswith("hand-off to decode-0"), failed


def test_a_job_naming_a_decode_node_never_connected_fails_alone(pair: Pair) -> None:
    """A job for a decode node the gateway's connect did not name is reported failed, as the gateway's mistake
    (no peer to blame: that node was not asked), and the worker goes on prefilling the next job (a KeyError
    ended its prefill loop)."""
    prefill, decode, told, decoded = pair
    decode.start()
    prefill.start()
    control(prefill, job(1, decode="decode-9"))
    control(prefill, job(2))
    wait_for(lambda: 2 in reported(decoded, wire.DecodeJoined), timeout=30.0, what="the next job's join")
    [failed] = [m for m in told if isinstance(m, wire.PrefillFailed)]
    assert (failed.request_id, failed.peer) == (1, "") and "decode-9" in failed.error, failed


def test_the_prefill_report_reaches_the_gateway_before_the_hand_off(pair: Pair) -> None:
    """The decode node's reports travel on another connection: the prefill waits until the gateway has its
    PrefillDone before it hands the request on, so the decode node never joins a request the gateway has not
    seen prefilled (a short request would end before its prefix hit is known)."""
    prefill, decode, _told, decoded = pair
    del prefill._tell_gateway  # reports go to the gateway engine below, as in a cluster
    joined_first: list[bool] = []

    def on_done(_args: Any) -> None:
        deadline = time.monotonic() + 1.0  # long enough for a hand-off sent meanwhile to be joined
        while time.monotonic() < deadline and not reported(decoded, wire.DecodeJoined):
            time.sleep(0.01)
        joined_first.append(bool(reported(decoded, wire.DecodeJoined)))

    gateway = TransferEngine(secret=prefill.spec.secret, config=EngineConfig(transports=("tcp",), io_timeout_s=5.0))
    try:
        gateway.register_handler(wire.PrefillStarted.METHOD, lambda _args: None)
        gateway.register_handler(wire.PrefillDone.METHOD, on_done)
        control(prefill, wire.Connect(gateway=gateway.address, peers={"decode-0": decode.engine.address}))
        decode.start()
        prefill.start()
        control(prefill, job(1))
        wait_for(lambda: 1 in reported(decoded, wire.DecodeJoined), timeout=30.0, what="the join")
        assert joined_first == [False]
    finally:
        prefill.close()
        gateway.close()


def test_close_removes_the_ssd_folder_and_closes_its_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with an SSD tier and no `ssd_dir` keeps its pool in a temporary folder of its own: once closed,
    the folder is gone and no file of this process is open in it; its shared memory is unlinked and its prefill
    engine's I/O threads have ended."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = load_config(TINY).with_overrides("cache", ssd_blocks=8)
    before = set(threading.enumerate())
    worker = Worker(WorkerSpec(role="prefill", instance_id="prefill-0", config=config, secret=secrets.token_bytes(32)))
    try:
        info = worker.start()
        [folder] = list(tmp_path.iterdir())
        assert (folder / ssd_file_name("prefill-0", ssd_label(config, worker.layout))).is_file() and info["shm"]
        named = SSD_FOLDER_NAME.fullmatch(folder.name)  # a launcher removes it by its pid if this process is killed
        assert named and int(named["pid"]) == os.getpid(), folder.name
        assert worker._prefill is not None
        worker._prefill.prefill(list(PROMPT))  # its KV stored by the engine's I/O threads

        def io_threads() -> list[threading.Thread]:
            return [t for t in set(threading.enumerate()) - before if t.name.startswith(("kv-load", "kv-store"))]

        assert io_threads()
    finally:
        worker.close()
    assert not io_threads()
    assert not list(tmp_path.iterdir())
    opened = [os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()]
    assert not [name for name in opened if str(tmp_path) in name], opened
    assert not [name for name in info["shm"] if Path("/dev/shm", name.lstrip("/")).exists()], info["shm"]


def start_a_long_decode(prefill: Worker, decode: Worker) -> wire.Sampling:
    """Both workers started, and request 1 (attempt 0) prefilled to run 1,500 tokens on the decode node; returns
    its sampling options."""
    decode.start()
    prefill.start()
    long = attrs.evolve(SAMPLING, max_tokens=1500)
    control(
        prefill, wire.PrefillJob(request_id=1, attempt=0, tokens=PROMPT, decode="decode-0", fetch=None, sampling=long)
    )
    return long


def test_a_cancelled_decode_stops_and_a_waiting_hand_off_is_dropped(pair: Pair) -> None:
    """`decode.cancel` of a request being decoded: no token after it, it never finishes, and it leaves the health
    answer's batch; of a hand-off still waiting for blocks another push is filling: it stops waiting, lets go of
    the block it pinned and is never joined."""
    prefill, decode, _told, decoded = pair
    long = start_a_long_decode(prefill, decode)

    wait_for(lambda: len(tokens_of(decoded, 1)) >= 3, timeout=30.0, what="the long request to decode")
    control(decode, wire.CancelDecode(request_id=1))
    wait_for(lambda: health(decode).active == (), timeout=10.0, what="the cancelled request to leave the batch")
    wait_for(lambda: decode._decode is not None and not decode._decode.num_active, timeout=60.0, what="an idle engine")
    assert not any(t.finished for t in tokens_of(decoded, 1)) and len(tokens_of(decoded, 1)) < long.max_tokens

    keys = [BlockKey(k) for k in prefill.hasher.block_keys(list(PROMPT))]
    for key in keys[1:]:  # gone from the decode node but the first: the push below fills them again
        decode.cache.remove(key)
    push = prefill.messenger.push(keys, prefill._peer("decode-0"), parts=1)
    try:
        handed = wire.DecodeJob(
            request_id=2, attempt=0, keys=tuple(keys), prompt_tokens=64, first_token=5, sampling=SAMPLING
        )
        control(decode, handed)
        wait_for(lambda: bool(getattr(decode._arriving.get(2), "pinned", ())), timeout=30.0, what="the wait")
        control(decode, wire.CancelDecode(request_id=2))
        wait_for(lambda: 2 not in decode._arriving, timeout=10.0, what="the waiting hand-off to be dropped")
    finally:
        push.abort()
    decode.cache.remove(keys[0])  # pinned by neither the push (aborted) nor the hand-off (dropped)
    assert 2 not in reported(decoded, wire.DecodeJoined) + reported(decoded, wire.DecodeRejected)


def serve_a_first_request(pair: Pair) -> None:
    """Start both workers and serve request 1 (attempt 0) of `PROMPT` to its end: its blocks are then on both."""
    prefill, decode, _told, decoded = pair
    decode.start()
    prefill.start()
    control(
        prefill,
        wire.PrefillJob(request_id=1, attempt=0, tokens=PROMPT, decode="decode-0", fetch=None, sampling=SAMPLING),
    )
    wait_for(lambda: finished(decoded) == 1, timeout=30.0, what="the first request to finish")


def test_a_waiting_hand_off_gives_way_to_a_later_attempt_only(pair: Pair) -> None:
    """A hand-off waiting for blocks another push is filling holds its place against an earlier attempt's (from a
    prefill engine presumed dead that resumed): once the blocks land, the later attempt is joined, the earlier
    never."""
    prefill, decode, _told, decoded = pair
    serve_a_first_request(pair)
    keys = [BlockKey(k) for k in prefill.hasher.block_keys(list(PROMPT))]
    for key in keys[1:]:
        decode.cache.remove(key)
    push = prefill.messenger.push(keys, prefill._peer("decode-0"), parts=1)
    landed = False
    try:

        def hand_off(request_id: int, attempt: int, keys: tuple[int, ...]) -> None:
            control(
                decode,
                wire.DecodeJob(
                    request_id=request_id,
                    attempt=attempt,
                    keys=keys,
                    prompt_tokens=16 * len(keys),
                    first_token=5,
                    sampling=SAMPLING,
                ),
            )

        hand_off(8, 1, tuple(keys))
        wait_for(lambda: bool(getattr(decode._arriving.get(8), "pinned", ())), timeout=30.0, what="the wait")
        hand_off(8, 0, tuple(keys))
        hand_off(9, 0, (12345,))  # refused at once, after the earlier attempt's hand-off is taken in
        wait_for(lambda: 9 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the marker's refusal")
        push.finish(30.0)
        landed = True
    finally:
        if not landed:
            push.abort()
    wait_for(lambda: 8 in reported(decoded, wire.DecodeJoined), timeout=30.0, what="the join once the blocks land")
    assert [m.attempt for m in list(decoded) if isinstance(m, wire.DecodeJoined) and m.request_id == 8] == [1]


def test_a_later_attempt_replaces_the_one_decoding_and_a_repeat_changes_nothing(pair: Pair) -> None:
    """The decode node holds one attempt of a request: a later attempt's hand-off replaces the one decoding (the
    batch holds the later one alone), its join report gives its context and output tokens; a repeated or earlier
    hand-off of it changes nothing."""
    prefill, decode, _told, decoded = pair
    long = start_a_long_decode(prefill, decode)

    def joined() -> list[wire.DecodeJoined]:
        return [m for m in list(decoded) if isinstance(m, wire.DecodeJoined)]

    def attempts_decoded() -> set[int]:
        return {t.attempt for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens if t.index >= 2}

    wait_for(lambda: 0 in attempts_decoded(), timeout=30.0, what="attempt 0 to decode")
    keys = tuple(prefill.hasher.block_keys(list(PROMPT)))
    later = wire.DecodeJob(request_id=1, attempt=1, keys=keys, prompt_tokens=64, first_token=5, sampling=long)
    control(decode, later)
    wait_for(lambda: 1 in attempts_decoded(), timeout=30.0, what="attempt 1 to decode")
    control(decode, later)
    control(decode, attrs.evolve(later, attempt=0))
    marker = wire.DecodeJob(request_id=9, attempt=0, keys=(12345,), prompt_tokens=16, first_token=5, sampling=SAMPLING)
    control(decode, marker)  # refused at once, after the hand-offs before it are taken in
    wait_for(lambda: 9 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the marker's refusal")
    assert [(j.attempt, j.context_tokens, j.output_tokens) for j in joined()] == [(0, 64, 1500), (1, 64, 1500)]
    assert decode._decode is not None and decode._decode.num_active == 1
    assert health(decode).active == (1,)
    control(decode, wire.CancelDecode(request_id=1))


def test_a_hand_off_after_its_cancel_or_of_an_ended_attempt_is_dropped_and_a_later_attempt_joins(pair: Pair) -> None:
    """A client that leaves after the prefill's last cancellation check, before its hand-off reaches the decode node:
    the `decode.cancel` comes first and finds nothing there; the hand-off that follows is dropped (never joined nor
    refused), not decoded for nobody until a health probe. A request that finished there drops a repeat of its
    attempt and joins a later one (rerouted back to this node)."""
    prefill, decode, _told, decoded = pair
    serve_a_first_request(pair)
    keys = tuple(prefill.hasher.block_keys(list(PROMPT)))  # on the decode node now: a hand-off of them joins

    def hand_off(request_id: int, attempt: int) -> None:
        control(
            decode,
            wire.DecodeJob(
                request_id=request_id, attempt=attempt, keys=keys, prompt_tokens=64, first_token=5, sampling=SAMPLING
            ),
        )

    def taken_in(marker_id: int) -> None:
        """Wait until the decode loop has taken in what was sent before: a marker it refuses at once."""
        marker = wire.DecodeJob(
            request_id=marker_id, attempt=0, keys=(12345,), prompt_tokens=16, first_token=5, sampling=SAMPLING
        )
        control(decode, marker)
        wait_for(lambda: marker_id in reported(decoded, wire.DecodeRejected), timeout=30.0, what="a marker's refusal")

    def joined() -> list[tuple[int, int]]:
        return [(m.request_id, m.attempt) for m in list(decoded) if isinstance(m, wire.DecodeJoined)]

    control(decode, wire.CancelDecode(request_id=2))
    hand_off(2, 1)
    taken_in(90)
    hand_off(1, 0)  # a repeat of the attempt that finished here
    taken_in(91)
    assert joined() == [(1, 0)]
    hand_off(1, 1)
    wait_for(lambda: finished(decoded) == 2, timeout=30.0, what="the later attempt to finish")
    assert joined() == [(1, 0), (1, 1)]
    assert reported(decoded, wire.DecodeRejected) == [90, 91]
    assert 2 not in {t.request_id for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens}


def rid(number: int) -> RequestId:
    """A request id as the gateway's wire carries it (an integer)."""
    return RequestId(number)  # type: ignore[arg-type]


def test_what_a_decode_node_remembers_ending_keeps_to_its_bounds() -> None:
    """Entries go after `keep_s`, and the oldest beyond `max_entries`; a cancel of a request held nowhere ends every
    attempt of it, one of a request that ended here keeps its attempt, and a later end never lowers it."""
    ended = _EndedAttempts(keep_s=10.0, max_entries=3)
    ended.end(rid(1), 2, now=0.0)
    assert ended.has_ended(rid(1), 2, now=1.0) and not ended.has_ended(rid(1), 3, now=1.0)
    ended.cancel(rid(1), None, now=2.0)  # it ended here: its later attempts may still come
    ended.end(rid(1), 0, now=2.0)
    assert not ended.has_ended(rid(1), 3, now=2.0) and ended.has_ended(rid(1), 2, now=2.0)
    ended.cancel(rid(2), None, now=3.0)  # never here: gone in every attempt
    assert ended.has_ended(rid(2), EVERY_ATTEMPT, now=3.0)
    ended.cancel(rid(3), 1, now=4.0)
    assert ended.has_ended(rid(3), 1, now=4.0) and not ended.has_ended(rid(3), 2, now=4.0)
    ended.end(rid(4), 0, now=5.0)  # a fourth: the oldest (request 1) goes
    ended.check_invariants()
    assert not ended.has_ended(rid(1), 0, now=5.0) and ended.has_ended(rid(2), 0, now=5.0)
    assert not ended.has_ended(rid(2), 0, now=13.5)  # noted at 3 s: forgotten after 10 s
    assert ended.has_ended(rid(3), 0, now=13.5)
    ended.check_invariants()


def test_a_cancel_of_a_request_the_gateway_ended_ends_every_attempt_held_or_not() -> None:
    """The gateway ended the request (its client left) while this node held attempt 0, or had ended it here: the
    cancel says so (`every_attempt`), and attempt 1's hand-off, still on its way, is dropped (the cancel ended only
    the attempt held, or added nothing to the entry, and attempt 1 joined and decoded for nobody)."""
    ended = _EndedAttempts(keep_s=10.0, max_entries=8)
    ended.cancel(rid(1), 0, now=0.0, every_attempt=True)  # held attempt 0
    assert ended.has_ended(rid(1), 1, now=0.5)
    ended.end(rid(2), 0, now=1.0)  # attempt 0 ended here (a probe's cancel, a finish)
    ended.cancel(rid(2), None, now=1.5, every_attempt=True)
    assert ended.has_ended(rid(2), 1, now=2.0)
    ended.cancel(rid(3), 0, now=2.0)  # a probe's cancel of a request served elsewhere: its later attempt may come
    assert not ended.has_ended(rid(3), 1, now=2.5)
    ended.check_invariants()


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["end", "cancel", "ask"]), st.integers(0, 3), st.none() | st.integers(0, 3)),
        max_size=40,
    )
)
def test_what_a_decode_node_remembers_ending_follows_a_reference_within_its_bounds(
    steps: list[tuple[str, int, int | None]],
) -> None:
    """Within its bounds (no entry old or many enough to go), the memory answers as a dict of each request's
    latest ended attempt, where a cancel of a request held nowhere and never ended ends every attempt."""
    ended = _EndedAttempts(keep_s=1000.0, max_entries=4)
    reference: dict[int, int] = {}
    for now, (kind, request_id, attempt) in enumerate(steps):
        if kind == "end":
            ended.end(rid(request_id), attempt or 0, float(now))
            reference[request_id] = max(reference.get(request_id, -1), attempt or 0)
        elif kind == "cancel":
            ended.cancel(rid(request_id), attempt, float(now))
            if attempt is not None:
                reference[request_id] = max(reference.get(request_id, -1), attempt)
            elif request_id not in reference:
                reference[request_id] = EVERY_ATTEMPT
        else:
            for asked in range(5):
                expected = asked <= reference.get(request_id, -1)
                assert ended.has_ended(rid(request_id), asked, float(now)) == expected
        ended.check_invariants()


def test_a_requests_sampling_options_reach_both_engines(pair: Pair) -> None:
    """A request's options decide its tokens: a stop id ends it at that token, unless min_tokens are not out yet;
    one that max_tokens = 1 ends is finished with its first token and not left in the batch; a sampled request
    (temperature 1.5, top_p 0.9) is served."""
    prefill, decode, told, decoded = pair
    decode.start()
    prefill.start()

    def served(request_id: int, sampling: wire.Sampling) -> list[wire.Token]:
        control(
            prefill,
            wire.PrefillJob(
                request_id=request_id, attempt=0, tokens=PROMPT, decode="decode-0", fetch=None, sampling=sampling
            ),
        )
        wait_for(
            lambda: any(t.finished for t in tokens_of(decoded, request_id)),
            timeout=30.0,
            what=f"request {request_id} to finish",
        )
        return sorted(tokens_of(decoded, request_id), key=lambda t: t.index)

    greedy = attrs.evolve(SAMPLING, max_tokens=8)
    tokens = [t.token for t in served(1, greedy)]
    assert len(tokens) == 8
    stop_at = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])
    stopped = served(2, attrs.evolve(greedy, stop_ids=(tokens[stop_at],)))
    assert [t.token for t in stopped] == tokens[: stop_at + 1]
    held_on = served(3, attrs.evolve(greedy, stop_ids=(tokens[stop_at],), min_tokens=stop_at + 2))
    assert len(held_on) > stop_at + 1
    [only] = served(4, attrs.evolve(greedy, max_tokens=1))
    assert (only.index, only.finished, only.token) == (0, True, tokens[0])
    assert health(decode).active == ()
    assert len(served(5, attrs.evolve(greedy, temperature=1.5, top_p=0.9, seed=3))) == 8
    assert not [m for m in told if isinstance(m, wire.PrefillFailed)]


def test_a_worker_process_stops_cleanly_on_sigterm() -> None:
    """`run_worker` in a process of its own: SIGTERM is a graceful stop (exit status 0), its engine closed and its
    shared memory unlinked, not a kill that leaves the segment behind."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    spec = WorkerSpec(role="decode", instance_id="decode-0", config=config, secret=secrets.token_bytes(32))
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=run_worker, args=(spec, child), daemon=True)
    process.start()
    segments: list[Path] = []
    try:
        assert parent.poll(60.0), "the worker never reported how to reach it"
        info = parent.recv()
        segments = [Path("/dev/shm", name.lstrip("/")) for name in info["shm"]]
        assert segments and all(s.exists() for s in segments)
        os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        process.join(30.0)
        assert process.exitcode == 0
        assert not [s for s in segments if s.exists()]
    finally:
        if process.is_alive():
            process.kill()
            process.join(10.0)
        for segment in segments:
            segment.unlink(missing_ok=True)
        parent.close()
        child.close()


# ---------------------------------------------------------------------------------------------- serving.machine


def test_a_port_whose_last_connection_waits_in_time_wait_is_free() -> None:
    """The gateway's server binds with address reuse (as aiohttp's): a port whose last connection this side closed
    first (TIME_WAIT, a plain bind refuses it for a minute) is free, as a relaunch on the same port needs."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first: its address waits in TIME_WAIT
            client.recv(1)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what makes the port look taken to a probe without reuse
    check_port_free(load_config(TINY).with_overrides("cluster", port=port))


def test_a_hard_file_limit_below_the_reserve_still_grants_one_connection() -> None:
    """`connection_budget` never answers fewer than one connection, even when the hard open-file limit is below
    `FD_RESERVE` (a config checked elsewhere, a limit lowered since); in a child, so this process' limit stays."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    code = f"""
import resource, sys
sys.path.insert(0, {str(examples)!r})
from serving.machine import FD_RESERVE, connection_budget
resource.setrlimit(resource.RLIMIT_NOFILE, (FD_RESERVE // 2, FD_RESERVE // 2))
print(connection_budget(10))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["1"]
    assert FD_RESERVE > MAX_LINGERING  # the reserve holds the refused connections lingering, and the gateway's own


@settings(max_examples=30, deadline=None)
@given(
    dram_blocks=st.integers(64, 5000),
    num_prefill=st.integers(1, 3),
    num_decode=st.integers(1, 3),
    max_connections=st.integers(1, 5000),
)
def test_the_machine_check_takes_a_demand_equal_to_what_there_is(
    dram_blocks: int, num_prefill: int, num_decode: int, max_connections: int
) -> None:
    """Shared memory exactly the nodes' pools (pages of a worker's `KvLayout`), and an open-file limit exactly
    `max_connections + FD_RESERVE`, are enough; a byte or a file less is refused, naming the key."""
    config = load_config(TINY).with_overrides("cluster", num_prefill=num_prefill, num_decode=num_decode)
    config = config.with_overrides("cache", dram_blocks=dram_blocks)
    config = config.with_overrides("limits", max_connections=max_connections)
    model = config.model
    page = KvLayout(config=model.config, block_tokens=model.block_tokens, dtype=model.dtype).page_bytes
    pools = (num_prefill + num_decode) * dram_blocks * page
    files = max_connections + FD_RESERVE
    check_machine(config, Machine(shm_free_bytes=pools, open_files_limit=files))
    with pytest.raises(ConfigError, match=r"\[cache\] dram_blocks"):
        check_machine(config, Machine(shm_free_bytes=pools - 1, open_files_limit=files))
    with pytest.raises(ConfigError, match=r"\[limits\] max_connections"):
        check_machine(config, Machine(shm_free_bytes=pools, open_files_limit=files - 1))


def test_memory_figures_are_read_in_bytes() -> None:
    """/proc/meminfo gives kB (KiB): MemTotal read through it is the machine's pages times their size."""
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo on this machine")
    assert _meminfo_bytes("MemTotal") == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert _meminfo_bytes("NoSuchField") is None


def least_ram(config: Any) -> int:
    """The least MemAvailable `check_machine` takes for `config` (found by bisection; nothing else is checked)."""
    low, high = 0, 1 << 50
    while low < high:
        middle = (low + high) // 2
        try:
            check_machine(config, Machine(ram_available_bytes=middle))
        except ConfigError:
            low = middle + 1
        else:
            high = middle
    return low


@settings(max_examples=15, deadline=None)
@given(num_prefill=st.integers(1, 3), num_decode=st.integers(1, 3), max_batch_size=st.integers(1, 32))
def test_ram_grows_by_a_process_per_stage_and_a_slot_per_decode_node(
    num_prefill: int, num_decode: int, max_batch_size: int
) -> None:
    """The RAM a config needs grows by one process's bytes per prefill node for each more pipeline stage, by one
    context of KV (`max_context_tokens` × a worker's KV bytes per token) per decode node for each more slot of its
    batch, and a decode node needs its batch's slots more than a prefill node of one process."""
    config = load_config(TINY).with_overrides("cluster", num_prefill=num_prefill, num_decode=num_decode)
    config = config.with_overrides("decode", max_batch_size=max_batch_size)
    staged = config.with_overrides("prefill", pipeline_size=2)
    assert least_ram(staged) - least_ram(config) == num_prefill * PROCESS_BYTES
    model = config.model
    layout = KvLayout(config=model.config, block_tokens=model.block_tokens, dtype=model.dtype)
    wider = config.with_overrides("decode", max_batch_size=max_batch_size + 1)
    slot = config.decode.max_context_tokens * layout.page_bytes // model.block_tokens
    assert least_ram(wider) - least_ram(config) == num_decode * slot
    # A decode node more, rather than a prefill node more: its batch's KV slots, and no other process.
    more_decode = config.with_overrides("cluster", num_decode=num_decode + 1)
    more_prefill = config.with_overrides("cluster", num_prefill=num_prefill + 1)
    assert least_ram(more_decode) - least_ram(more_prefill) == max_batch_size * slot


def test_the_decode_node_applies_the_tbt_objective_of_its_config() -> None:
    """The decode engine checks the decode rule against `[slo] tbt_s`, as the Conductor does: with an objective no
    step can meet, a second request is refused for TBT while one decodes, not joined."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with workers(config.with_overrides("slo", tbt_s=1e-9)) as (prefill, decode, _told, decoded):
        engine = prefill._prefill
        assert engine is not None
        engine.prefill(list(PROMPT))
        keys = prefill.hasher.block_keys(list(PROMPT))
        prefill.messenger.push(keys, prefill._peer("decode-0"), parts=1).finish(30.0)
        long = attrs.evolve(SAMPLING, max_tokens=1500)
        for request_id in (1, 2):  # queued before the decode loop starts: the first joins an empty batch
            handed = wire.DecodeJob(
                request_id=request_id, attempt=0, keys=tuple(keys), prompt_tokens=64, first_token=5, sampling=long
            )
            control(decode, handed)
        decode.start()
        wait_for(lambda: 2 in reported(decoded, wire.DecodeRejected), timeout=30.0, what="the second's refusal")
        assert reported(decoded, wire.DecodeJoined) == [1]
        assert [m.reason for m in decoded if isinstance(m, wire.DecodeRejected)] == ["tbt_slo"]
        control(decode, wire.CancelDecode(request_id=1))


def test_an_ssd_folder_is_checked_for_writing_only_when_an_ssd_tier_uses_it() -> None:
    """`[cache] ssd_dir` on a read-only file system: refused as not writable once `ssd_blocks` asks for an SSD
    tier, taken while no tier uses it (nothing is written there)."""
    folder = "/proc/sys"  # a folder of a file system mounted read-only, even for root
    if not Path(folder).is_dir() or os.access(folder, os.W_OK):
        pytest.skip(f"{folder} is not a read-only folder here")
    config = load_config(TINY).with_overrides("cluster", port=0).with_overrides("cache", ssd_dir=folder)
    check_machine(config, Machine(is_here=True))
    with pytest.raises(ConfigError, match="is not writable"):
        check_machine(config.with_overrides("cache", ssd_blocks=8), Machine(is_here=True))


# ---------------------------------------------------------------------------------------------- serving.prefill_group


class _Group:
    """A pipeline group double: the tiny model's config, a half-precision stage 0, and the calls of `prefill`."""

    config = TINY_MODEL
    model = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cpu"))

    def __init__(self, io: _Io) -> None:
        self.io = io
        self.calls: list[dict[str, Any]] = []

    def prefill(self, tokens: list[int], **options: Any) -> torch.Tensor:
        self.calls.append({"tokens": tokens, "waited": list(self.io.waited), **options})
        return torch.zeros(self.config.vocab_size)


class _Io:
    """A layer-wise KV I/O double: the prefix layers waited for, in order."""

    prefix_tokens = 32

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_for_prefix(self, layer: int) -> None:
        self.waited.append(layer)

    def store(self, *_args: Any) -> None:
        pass


def test_a_group_forward_waits_for_every_layers_prefix_before_the_group_starts() -> None:
    """`GroupForward.run`: every layer's prefix is in the buffers before the group's first chunk (each stage needs
    its own layers' prefix then), and the group gets the prompt, that prefix's KV and length, and the I/O's store
    for the rows it computes; the forward pass has the group's model config, dtype and device."""
    io = _Io()
    group = _Group(io)
    forward = GroupForward(group)  # type: ignore[arg-type]
    assert (forward.model_config, forward.dtype, forward.device) == (TINY_MODEL, torch.float16, torch.device("cpu"))
    kv = [(torch.zeros(1), torch.zeros(1))]
    forward.run(torch.tensor([3, 1, 4]), kv, io)  # type: ignore[arg-type]
    [call] = group.calls
    assert call["tokens"] == [3, 1, 4] and call["kv"] is kv and call["prefix_tokens"] == 32
    assert call["on_rows"] == io.store
    assert call["waited"] == list(range(TINY_MODEL.num_layers))


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_group_prefill_engine_stores_layer_wise_unless_told_not_to(layerwise: bool) -> None:
    """`group_prefill_engine` overlaps the KV stores with the compute by default, and stores after the forward
    pass when `layerwise` is off."""
    cache = dram_cache(16)
    engines = [group_prefill_engine(_Group(_Io()), cache, support_hasher(16), layerwise=layerwise)]  # type: ignore[arg-type]
    if layerwise:
        engines.append(group_prefill_engine(_Group(_Io()), cache, support_hasher(16)))  # type: ignore[arg-type]
    try:
        assert [engine.config.layerwise for engine in engines] == [layerwise] * len(engines)
    finally:
        for engine in engines:
            engine.close()
        cache.close()


@settings(max_examples=40, deadline=None)
@given(
    st.builds(
        SamplingOptions,
        max_tokens=st.integers(1, 64),
        temperature=st.sampled_from([0.0, 0.7]),
        top_p=st.sampled_from([0.5, 1.0]),
        seed=st.integers(0, 2**64 - 1),
        min_tokens=st.integers(0, 4),
        logprobs=st.none() | st.integers(0, 20),
        top_k=st.integers(0, 50),
        min_p=st.sampled_from([0.0, 0.1]),
        repetition_penalty=st.sampled_from([1.0, 1.2]),
        presence_penalty=st.sampled_from([0.0, -1.0]),
        frequency_penalty=st.sampled_from([0.0, 2.0]),
        prompt_logprobs=st.none() | st.integers(0, 5),
        logit_bias=st.dictionaries(st.integers(0, 99), st.sampled_from([-100.0, 2.5]), max_size=3).map(
            lambda biases: tuple(sorted(biases.items()))
        ),
        allowed_token_ids=st.lists(st.integers(0, 99), max_size=3, unique=True).map(lambda ids: tuple(sorted(ids))),
    )
)
def test_every_sampling_option_reaches_the_engines(options: SamplingOptions) -> None:
    """A request's sampling options go gateway -> wire -> engine by name: every `SamplingParams` field is carried
    by the wire (the stop ids under their wire name) and arrives with the request's value, so an option added to
    the engine and the API cannot be dropped on the way."""
    carried = {f.name for f in attrs.fields(wire.Sampling)}
    assert {f.name for f in attrs.fields(SamplingParams)} == carried - {"max_tokens", "stop_ids"} | {"stop_token_ids"}
    record = wire.Sampling(stop_ids=(2,), **{name: getattr(options, name) for name in carried - {"stop_ids"}})
    job = wire.PrefillJob(request_id=1, attempt=0, tokens=(5,), decode="decode-0", fetch=None, sampling=record)
    received = wire.decode(*wire.encode(job))
    assert isinstance(received, wire.PrefillJob)
    params = _sampling_params(received.sampling)
    for name in carried - {"max_tokens", "stop_ids"}:
        sent = getattr(options, name)
        assert getattr(params, name) == (frozenset(sent) if name == "allowed_token_ids" else sent), name
    assert params.stop_token_ids == frozenset({2})
