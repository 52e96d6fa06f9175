"""A request's and a worker's lifecycle on a real tiny cluster: clients that leave, stop strings, stalled workers.

Each test proves: a non-streaming request whose client hangs up is cancelled on its decode engine (the tokens
generated after the disconnect are counted by the worker and stay few); a stop string ends the text before it with
finish reason "stop" and cancels the decode; top_p reaches the sampler (a tiny nucleus is greedy); an unknown
model is OpenAI's 404 `model_not_found` and /v1/models lists the served one; arbitrary bodies sent to the cluster
never get a 5xx (a bounded property test); a decode worker stopped with SIGSTOP is marked down (its stream gets an
error, /health says so) and, resumed with SIGCONT, is marked up again, its orphaned request cancelled, and serves;
a stopped prefill worker under a burst takes down only itself (every request served); a stopped decode worker is
reported by the prefill that cannot reach it and every request not yet begun is rerouted (all served); the request
timeout bounds each wait for a token, not a request whose tokens keep coming.
Without workers: the dispatcher ignores reports of an earlier attempt or from an engine the request is not routed
to (what a resumed engine may still send), and refuses a malformed report back to its sender.

Every wait is bounded (`wait_for` fails naming what it waited for); every stopped process is continued in a
`finally`; clusters are closed by their context managers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from serving import wire  # noqa: E402
from serving.api import SamplingOptions  # noqa: E402
from serving.config import ClusterConfig, load_config  # noqa: E402
from serving.dispatch import Dispatcher, LiveRequest  # noqa: E402
from serving.gateway import build_conductor  # noqa: E402
from serving.launch import RunningCluster, start_cluster  # noqa: E402

from mooncake.sched.join import DecodeLimits  # noqa: E402
from mooncake.types import BlockKey, InstanceId, Request, RequestId  # noqa: E402
from tests.waiting import stop_process, wait_for  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
TIMEOUT_S = 60.0
LONG = 3000  # tokens: many seconds of decoding on the tiny model, so an end before it is a cancellation


def config(**limits: Any) -> ClusterConfig:
    """1 prefill + 1 decode on any free port, with room for long decodes."""
    base = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    base = base.with_overrides("decode", max_context_tokens=4096)
    return base.with_overrides("limits", max_prompt_tokens=256, default_max_tokens=16, **limits)


def client(cluster: RunningCluster) -> Any:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def status_of(url: str, body: bytes | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def generated(cluster: RunningCluster) -> int:
    """The tokens the decode worker generated since it started (its own count)."""
    return cluster.gateway.dispatcher.health("decode-0").generated_tokens


def decoding(cluster: RunningCluster) -> tuple[int, ...]:
    """The requests the decode worker holds in its batch."""
    return cluster.gateway.dispatcher.health("decode-0").active


def live_generated(cluster: RunningCluster) -> int:
    """Tokens the gateway received for its (single) live request; 0 when there is none."""
    lives = list(cluster.gateway.dispatcher.live.values())
    return lives[0].generated if lives else 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with start_cluster(config()) as running:
        yield running


# ---------------------------------------------------------------------------------------------- requests


def test_a_client_that_leaves_a_whole_request_stops_its_decode(cluster: RunningCluster) -> None:
    """A non-streaming request for 3,000 tokens whose client hangs up mid-decode: the gateway forgets it, the
    decode worker drops it, and it generates only a few tokens after the disconnect."""
    body = json.dumps({"prompt": "Leave me.", "max_tokens": LONG}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        wait_for(lambda: live_generated(cluster) >= 8, timeout=TIMEOUT_S, what="the request to decode")
    at_disconnect = generated(cluster)
    wait_for(lambda: not cluster.gateway.dispatcher.live, timeout=20.0, what="the gateway to forget the request")
    wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the decode worker to drop the request")
    after = generated(cluster) - at_disconnect
    assert after < 200, f"{after} tokens generated after the client left"
    assert generated(cluster) - at_disconnect == after  # and none since


def test_a_stop_string_ends_the_text_and_the_decode(cluster: RunningCluster) -> None:
    """Greedy text T; a stop string s first found at k > 0 in it: the answer is T[:k] with finish reason "stop" and
    stop reason s, streamed or not, and the decode (asked for 3,000 tokens) is cancelled right after."""
    api = client(cluster)
    prompt = "Stop me when you can."
    text = api.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0).choices[0].text
    k = next(i for i in range(1, len(text) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[k : k + 2]
    before = generated(cluster)
    answer = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=LONG, temperature=0, stop=[stop, "never\u2603"]
    )
    assert answer.choices[0].text == text[:k] and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].stop_reason == stop  # vLLM's field: the stop string that ended it
    assert answer.usage.completion_tokens < 64
    wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the stopped request to leave the batch")
    assert generated(cluster) - before < LONG // 2
    chunks = list(
        api.completions.create(model="tiny", prompt=prompt, max_tokens=LONG, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    assert all(c.choices[0].stop_reason is None for c in chunks[:-1])
    wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the stopped stream to leave the batch")


def test_top_p_reaches_the_sampler(cluster: RunningCluster) -> None:
    """A tiny nucleus keeps only the most probable token: sampling with it is greedy; the whole nucleus is not."""
    api = client(cluster)
    prompt = "Nucleus."
    greedy = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    narrow = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0, top_p=1e-9, seed=3)
    whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0, top_p=1.0, seed=3)
    assert narrow.choices[0].text == greedy
    assert whole.choices[0].text != greedy


def test_models_and_an_unknown_model(cluster: RunningCluster) -> None:
    """/v1/models lists the config's model; another name is a 404 `model_not_found` (the OpenAI client's
    NotFoundError); unimplemented parameters are 400s naming them."""
    api = client(cluster)
    assert [m.id for m in api.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as raised:
        api.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="tiny", prompt="hi", max_tokens=1, n=17)
    assert bad.value.body["param"] == "n"


bodies = (
    st.binary(max_size=200)
    | st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=8,
    ).map(lambda value: json.dumps(value).encode())
    | st.fixed_dictionaries(
        {"prompt": st.text(max_size=30)},
        optional={"max_tokens": st.integers(-2, 40), "temperature": st.floats(-1, 3), "stop": st.text(max_size=3)},
    ).map(lambda value: json.dumps(value).encode())
)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, route=st.sampled_from(["completions", "chat/completions"]))
def test_no_body_gets_a_5xx(cluster: RunningCluster, body: bytes, route: str) -> None:
    """Arbitrary bytes, arbitrary JSON and near-valid requests, posted to the real cluster: never a 5xx; every
    error answer is OpenAI's JSON."""
    status, answer = status_of(f"{cluster.url}/v1/{route}", body)
    assert status < 500, answer
    if status >= 400:
        assert set(answer["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------- a stalled worker


def health(cluster: RunningCluster) -> tuple[int, Any]:
    return status_of(f"{cluster.url}/health")


@contextlib.contextmanager
def stalled_stream(cluster: RunningCluster) -> Iterator[Iterator[Any]]:
    """A long stream that has begun, its decode worker then stopped (SIGSTOP): yields the rest of its chunks; the
    worker is continued (SIGCONT) and the stream closed when the block ends."""
    pid = cluster.gateway.dispatcher.health("decode-0").pid
    stream = client(cluster).completions.create(model="tiny", prompt="Stall.", max_tokens=LONG, stream=True)
    try:
        chunks = iter(stream)
        next(chunks)
        stop_process(pid)
        try:
            yield chunks
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        stream.close()


def _completes(api: openai.OpenAI) -> bool:
    try:
        return api.completions.create(model="tiny", prompt="Warm up.", max_tokens=2).usage.completion_tokens == 2
    except openai.APIError:  # a 504 while the engines are still cold
        return False


def test_the_request_timeout_bounds_each_wait_for_a_token_not_the_whole_request() -> None:
    """With a 1 s request timeout: a stream whose tokens keep coming runs past it to its last token, and so does a
    whole (non-streamed) answer; a stream whose decode worker is stopped (SIGSTOP, the health probes too slow to
    notice first) ends with the timeout's error about a second after its last token."""
    timeout_s = 1.0
    with start_cluster(
        config(request_timeout_s=timeout_s, health_interval_s=30.0, health_probe_backoff_max_s=30.0)
    ) as cluster:
        api = client(cluster)
        # A first request warms the engines (connections, first passes): on a busy machine it alone can take over
        # the 1 s, which would time out a request below for the wrong reason.
        wait_for(lambda: _completes(api), timeout=60.0, what="a first request to come back within the timeout")
        began = time.monotonic()
        chunks = list(
            api.completions.create(
                model="tiny", prompt="Keep going.", max_tokens=LONG, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage.completion_tokens == LONG and chunks[-2].choices[0].finish_reason == "length"
        assert time.monotonic() - began > 2 * timeout_s  # else this machine decodes too fast to show anything
        began = time.monotonic()
        assert api.completions.create(model="tiny", prompt="Go on.", max_tokens=LONG).usage.completion_tokens == LONG
        assert time.monotonic() - began > 2 * timeout_s
        with stalled_stream(cluster) as chunks:
            stopped = time.monotonic()
            with pytest.raises(openai.APIError, match=r"no token came for 1 s"):
                for _chunk in chunks:
                    pass
            assert time.monotonic() - stopped < 10 * timeout_s


def burst(url: str, prompt: str, *, count: int, every_s: float, max_tokens: int) -> list[tuple[int, Any]]:
    """`count` completions of distinct prompts, one every `every_s` seconds, all in flight at once: each
    (status, body), in order."""
    with ThreadPoolExecutor(16) as pool:
        answers = []
        for i in range(count):
            body = json.dumps({"prompt": f"{prompt} {i} " * 3, "max_tokens": max_tokens}).encode()
            answers.append(pool.submit(status_of, url, body))
            time.sleep(every_s)
        return [answer.result(timeout=120) for answer in answers]


def test_a_stopped_prefill_worker_under_load_takes_down_only_itself() -> None:
    """SIGSTOP one of two prefill workers, then 60 requests at 20/s: the Conductor sends some to it until a probe
    marks it down, their calls block there, and still every request is served (those sent to it rerouted) and the
    other workers stay up throughout (their calls and probes never wait behind the stopped one's)."""
    base = config(health_interval_s=0.5, health_probe_backoff_max_s=2.0)
    base = base.with_overrides("cluster", num_prefill=2).with_overrides("decode", max_batch_size=64)
    with start_cluster(base) as cluster:
        dispatcher = cluster.gateway.dispatcher
        url = f"{cluster.url}/v1/completions"
        assert status_of(url, json.dumps({"prompt": "warm", "max_tokens": 2}).encode())[0] == 200
        downs: list[str] = []
        failed = dispatcher._worker_failed

        def noting(instance: InstanceId) -> None:
            if dispatcher.workers[instance].up:
                downs.append(instance)
            failed(instance)

        dispatcher._worker_failed = noting  # type: ignore[method-assign]
        pid = cluster.backend.pid("prefill-0")
        stop_process(pid)
        try:
            statuses = [status for status, _body in burst(url, "burst", count=60, every_s=0.05, max_tokens=2)]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert statuses == [200] * 60
        assert downs == ["prefill-0"]
        wait_for(lambda: health(cluster)[1]["prefill_up"] == 2, timeout=30.0, what="the resumed worker to be marked up")


def test_a_stopped_decode_worker_holds_up_no_request_that_has_not_begun() -> None:
    """SIGSTOP one of two decode workers, then 12 requests at 10/s, with the health probes too slow to notice: the
    first prefill whose KV stream waits on the stopped node reports that node (not itself) as failing, the gateway
    probes it at once, marks it down and reroutes every request routed there that has no token yet, and cancels
    their queued prefill jobs. Every request is served (before, each one routed there waited out an I/O timeout in
    the prefill queue and was answered with a 500 blamed on the prefill)."""
    base = config(health_interval_s=60.0, health_probe_backoff_max_s=60.0)
    base = base.with_overrides("cluster", num_decode=2).with_overrides("decode", max_batch_size=64)
    with start_cluster(base) as cluster:
        dispatcher = cluster.gateway.dispatcher
        url = f"{cluster.url}/v1/completions"
        assert status_of(url, json.dumps({"prompt": "warm", "max_tokens": 2}).encode())[0] == 200
        pid = dispatcher.health("decode-0").pid
        stop_process(pid)
        try:
            results = burst(url, "held up", count=12, every_s=0.1, max_tokens=4)
            marked_down = not dispatcher.workers["decode-0"].up  # by the probe the prefill's report asked for
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [status for status, _body in results] == [200] * 12, [r for r in results if r[0] != 200]
        assert marked_down
        assert all(body["usage"]["completion_tokens"] == 4 for _status, body in results)


def test_a_killed_prefill_workers_reservations_end_at_once_on_the_other_nodes() -> None:
    """Pages a prefill worker reserved on the decode node to push into stay reserved while its lease is open (and
    past its expiry while the pusher may live); once the gateway finds its process dead (SIGKILL), it tells the
    other workers, and the decode node can take the block again within a probe or two, not the lease's 30 s later
    (a request rerouted after the kill was refused as a KV-budget 429 meanwhile). A decode node that was down
    (stopped) when the death was found is told when it answers again."""
    base = config(health_interval_s=0.2, health_probe_backoff_max_s=1.0).with_overrides("cluster", num_prefill=2)
    with start_cluster(base) as cluster:
        dispatcher = cluster.gateway.dispatcher
        attempts = iter(range(10_000))

        def reserve(owner: str, key: int) -> int | None:
            blocks = [[key, 64, None]]
            answer: Any = dispatcher.engine.call(
                dispatcher.peers["decode-0"],
                "blocks.reserve",
                {"lease": f"lease-{next(attempts)}", "blocks": blocks, "owner": owner},
            )
            return answer["blocks"][0][1]  # type: ignore[no-any-return]

        for key, victim in enumerate(("prefill-1", "prefill-0")):
            assert reserve(dispatcher._addresses[victim], key) is not None  # a push of the victim's
            assert reserve("127.0.0.1:1", key) is None  # the block is being filled by that push
            decode = cluster.backend.pid("decode-0")
            if victim == "prefill-0":  # the decode node is down when the death is found
                stop_process(decode)
                wait_for(lambda: not dispatcher.workers["decode-0"].up, timeout=30.0, what="decode-0 marked down")
            try:
                cluster.backend.kill(victim)
                wait_for(lambda v=victim: dispatcher.workers[v].gone, timeout=10.0, what=f"{victim} found dead")
            finally:
                os.kill(decode, signal.SIGCONT)
            wait_for(lambda: dispatcher.workers["decode-0"].up, timeout=30.0, what="decode-0 marked up")
            wait_for(
                lambda k=key: reserve("127.0.0.1:1", k) is not None,
                timeout=10.0,
                what=f"the decode node to end the dead {victim}'s reservation",
            )


def test_a_stop_with_a_request_still_running_tells_its_client_the_cluster_is_shutting_down() -> None:
    """close(grace_s) with a long stream in flight: past the grace, the stream ends with the dispatcher's 503 'the
    cluster is shutting down', sent before the workers stop (not an engine failure)."""
    cluster = start_cluster(config())
    ended: list[BaseException] = []

    def read() -> None:
        try:
            for _chunk in client(cluster).completions.create(model="tiny", prompt="Go.", max_tokens=LONG, stream=True):
                pass
        except openai.APIError as error:
            ended.append(error)

    reader = threading.Thread(target=read)
    try:
        reader.start()
        wait_for(lambda: live_generated(cluster) >= 8, timeout=TIMEOUT_S, what="the stream to decode")
    finally:
        cluster.close(grace_s=0.5)
    reader.join(timeout=TIMEOUT_S)
    assert len(ended) == 1 and "shutting down" in str(ended[0]), ended


def test_a_stopped_decode_worker_is_marked_down_and_restored() -> None:
    """SIGSTOP the decode worker mid-stream: its health probes fail, it is marked down (/health 503, the stream
    ends with an error event). SIGCONT: a later probe (with backoff) finds it answering, it is marked up, the
    request it still held is cancelled there, and it serves again."""
    with start_cluster(config(health_interval_s=0.2, health_probe_backoff_max_s=1.0)) as cluster:
        api = client(cluster)
        with stalled_stream(cluster) as chunks:
            wait_for(lambda: health(cluster)[0] == 503, timeout=30.0, what="the stopped worker to be marked down")
            assert health(cluster)[1]["decode_up"] == 0
            with pytest.raises(openai.APIError, match="decode-0"):
                for _chunk in chunks:
                    pass
        wait_for(lambda: health(cluster)[0] == 200, timeout=30.0, what="the resumed worker to be marked up")
        assert health(cluster)[1]["decode_up"] == 1
        wait_for(lambda: decoding(cluster) == (), timeout=20.0, what="the orphaned request to be cancelled")
        answer = api.completions.create(model="tiny", prompt="Back again.", max_tokens=8)
        assert answer.usage.completion_tokens == 8


# ---------------------------------------------------------------------------------------------- stale reports


def test_reports_of_another_attempt_or_engine_are_ignored() -> None:
    """A request on its second attempt: tokens and failures of attempt 0, and reports from engines it is not
    routed to, change nothing; its own attempt's tokens reach it and end it. A malformed report is refused to
    its sender (a MessageError naming the field) and changes nothing either."""
    config = load_config(TINY)
    conductor = build_conductor(config)
    for prefill in ("prefill-0", "prefill-1"):
        conductor.add_prefill_instance(InstanceId(prefill))
    for decode in ("decode-0", "decode-1"):
        conductor.add_decode_instance(InstanceId(decode), DecodeLimits(kv_capacity_tokens=4096, max_batch_size=8))
    dispatcher = Dispatcher(
        config,
        conductor,
        secret=bytes(32),
        workers=[],
        is_alive=lambda _: True,
        block_bytes=1,
    )
    try:
        request_id = RequestId(7)  # type: ignore[arg-type]
        request = Request(
            request_id=request_id,
            arrival_s=0.0,
            input_length=20,
            output_length=8,
            block_keys=(BlockKey(1), BlockKey(2)),
        )
        decision = conductor.schedule(request, dispatcher.now())
        assert decision.accepted and decision.prefill_instance and decision.decode_instance
        prefill, decode = decision.prefill_instance, decision.decode_instance
        other_prefill = ({"prefill-0", "prefill-1"} - {prefill}).pop()
        other_decode = ({"decode-0", "decode-1"} - {decode}).pop()
        live = LiveRequest(
            request_id, [0] * 20, request, SamplingOptions(max_tokens=8), 0.0, prefill=prefill, decode=decode, attempt=1
        )
        dispatcher.live[request_id] = live

        def tokens(instance: str, attempt: int, *indexes: int) -> wire.DecodeTokens:
            return wire.DecodeTokens(
                instance_id=instance,
                tokens=tuple(wire.Token(7, attempt, 60 + i, i, i == 1) for i in indexes),
            )

        ids = {"request_id": 7, "prefix_tokens": 16, "computed_tokens": 4, "fetched_blocks": 0, "streamed_blocks": 2}
        for stale in (
            tokens(decode, 0, 0, 1),
            tokens(other_decode, 1, 0, 1),
            wire.DecodeFailed(instance_id=decode, request_id=7, attempt=0, error="a stale hand-off"),
            wire.DecodeRejected(instance_id=other_decode, request_id=7, attempt=1, reason="batch_full"),
            wire.PrefillDone(instance_id=other_prefill, attempt=1, events=(), **ids),
            wire.PrefillDone(instance_id=prefill, attempt=0, events=(), **ids),
        ):
            dispatcher._dispatch(stale)
        assert live.events.empty() and live.cached_tokens == 0 and request_id in dispatcher.live
        with pytest.raises(wire.MessageError, match="tokens"):
            dispatcher.engine.handle_call("decode.tokens", {"instance_id": decode, "tokens": "oops"})
        assert request_id in dispatcher.live
        dispatcher._dispatch(wire.PrefillDone(instance_id=prefill, attempt=1, events=(), **ids))
        dispatcher._dispatch(tokens(decode, 1, 0, 1))
        assert live.cached_tokens == 16
        assert [(kind, t.token, t.finished) for kind, t in (live.events.get_nowait() for _ in range(2))] == [
            ("token", 60, False),
            ("token", 61, True),
        ]
        assert request_id not in dispatcher.live and conductor.in_flight == ()
        conductor.check_invariants()
    finally:
        dispatcher.close()


def test_a_cache_salt_keeps_a_prompts_cached_blocks_to_requests_of_the_same_salt(cluster: RunningCluster) -> None:
    """vLLM's `cache_salt`: a prompt cached under one salt is a hit for the same salt only; another salt, or none,
    computes it whole (`usage.prompt_tokens_details.cached_tokens`), so a tenant cannot learn from a hit that
    another sent it. A bad salt is vLLM's 400 naming it."""
    prompt = "Salted prompts share nothing. " * 5

    def cached(**extra: Any) -> int:
        status, answer = status_of(
            f"{cluster.url}/v1/completions",
            json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}).encode(),
        )
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="bob") == 0
    assert cached() == 0
    assert cached(cache_salt="alice") > 0 and cached(cache_salt="bob") > 0 and cached() > 0
    status, answer = status_of(f"{cluster.url}/v1/completions", json.dumps({"prompt": "x", "cache_salt": ""}).encode())
    assert status == 400 and answer["error"]["param"] == "cache_salt", answer
