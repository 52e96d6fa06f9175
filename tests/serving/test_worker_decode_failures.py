"""A decode worker whose step fails for some of its requests: those fail alone, the batch decodes on.

A request whose token draw has no token (`allowed_token_ids = [t]` with a repetition penalty at float32's largest
value, where `t`'s logit at that position is below -1: the penalty takes it to -inf; a client can ask for that over
HTTP) makes `DecodeEngine.step` raise after the others took their tokens. The decode worker reports it as
`decode.failed` naming the cause (the gateway's 500 "decode failed: ..."), and every other request of that step
as usual, forgets it (its health answer no longer lists it), and goes on decoding: before, the step's error ended
the decode loop, and with it the worker, losing every token of that step.

Real workers of the tiny config, in-process, on loopback; their reports go to lists (no gateway runs); and once
end to end, a tiny cluster over HTTP. Every wait is bounded, and the workers and the cluster are closed at the end.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

import attrs
import torch
from serving import wire
from serving.config import load_config
from serving.launch import start_cluster
from serving.worker import build_model

from mooncake.engine.model import LlamaModel
from mooncake.errors import EngineError
from tests.serving.test_worker import SAMPLING, job, reported, workers
from tests.waiting import wait_for

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
HUGE_PENALTY = float(torch.finfo(torch.float32).max)


def last_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(tokens, dtype=torch.long))[-1]


def greedy(model: LlamaModel, prompt: list[int], count: int) -> list[int]:
    """The model's first `count` greedy tokens after `prompt` (the prefill's, then the decode's)."""
    tokens: list[int] = []
    while len(tokens) < count:
        tokens.append(int(torch.argmax(last_logits(model, prompt + tokens))))
    return tokens


def hopeless(model: LlamaModel, prompt: list[int]) -> wire.Sampling:
    """Greedy sampling that lets only one token `t` be drawn, under a repetition penalty at float32's largest value:
    the prefill draws `t` (not in the prompt, so not penalised there), then the first decode step has no token (`t`,
    now an output token, has a logit below -1 there, which the penalty takes to -inf)."""
    after = {t: float(last_logits(model, [*prompt, t])[t]) for t in range(model.config.vocab_size) if t not in prompt}
    chosen = min(after, key=after.__getitem__)
    assert after[chosen] < -1.5, after[chosen]  # else its penalised logit stays finite and the step draws it
    return attrs.evolve(SAMPLING, max_tokens=8, repetition_penalty=HUGE_PENALTY, allowed_token_ids=(chosen,))


def tokens_of(decoded: list[Any], request_id: int) -> list[wire.Token]:
    return [
        t for m in list(decoded) if isinstance(m, wire.DecodeTokens) for t in m.tokens if t.request_id == request_id
    ]


def test_requests_whose_draw_fails_fail_alone_and_the_batch_decodes_on() -> None:
    """Requests 1 (healthy, 8 tokens), 2 and 4 (hopeless: their first decode step has no token) join in one
    iteration of the decode loop, so they share their first step. 2 and 4 are reported failed, each with its
    attempt, 2 naming the cause (the step raises its error only: 4 is reported as failed in that step too); each
    has only its first token (the prefill's). 1 gets all 8 tokens, the model's greedy ones, its second from the
    step that failed; a request sent afterwards (3) is served. The worker stays up and no longer lists 2 or 4."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with workers(config) as (prefill, decode, _told, decoded):
        model = decode.model
        sent = {
            1: attrs.evolve(job(1), sampling=attrs.evolve(SAMPLING, max_tokens=8)),
            2: attrs.evolve(job(2), sampling=hopeless(model, list(job(2).tokens))),
            4: attrs.evolve(job(4), sampling=hopeless(model, list(job(4).tokens))),
        }
        prefill.start()
        for message in sent.values():
            prefill._on_job(message)
        # The decode loop is not started: the three hand-offs wait in its queue, and join in one iteration.
        wait_for(lambda: decode._jobs.qsize() == 3, timeout=60.0, what="the three hand-offs at the decode node")
        decode.start()

        def failed() -> list[wire.DecodeFailed]:
            return [m for m in list(decoded) if isinstance(m, wire.DecodeFailed)]

        def settled() -> bool:
            ended = any(t.finished for t in tokens_of(decoded, 1))
            return (ended and len(failed()) == 2) or decode.wait(0)

        wait_for(settled, timeout=60.0, what="request 1 to finish and 2 and 4 to fail (or the worker to stop)")
        assert not decode.wait(0), "the decode worker stopped"
        assert sorted((m.request_id, m.attempt) for m in failed()) == [(2, 0), (4, 0)]
        errors = {m.request_id: m.error for m in failed()}
        first, other = (2, 4) if errors[2].startswith("request 2: the sampling") else (4, 2)
        assert errors[first].startswith(f"request {first}: the sampling params leave every one of the 256 logits")
        assert errors[other].startswith(f"request {other}: its token draw failed in the step that raised request")
        for bad in (2, 4):
            [only] = tokens_of(decoded, bad)
            assert (only.index, only.token, only.finished) == (0, sent[bad].sampling.allowed_token_ids[0], False)
        healthy = tokens_of(decoded, 1)
        assert [t.index for t in healthy] == list(range(8)) and [t.finished for t in healthy] == [False] * 7 + [True]
        assert [t.token for t in healthy] == greedy(model, list(job(1).tokens), 8)
        assert not decode._attempts and decode._decode is not None and decode._decode.num_active == 0

        prefill._on_job(job(3))
        wait_for(
            lambda: any(t.finished for t in tokens_of(decoded, 3)) or decode.wait(0),
            timeout=60.0,
            what="a later request to be served",
        )
        assert [t.token for t in tokens_of(decoded, 3)] == greedy(model, list(job(3).tokens), SAMPLING.max_tokens)
        assert reported(decoded, wire.DecodeJoined) == [1, 2, 4, 3]
        health = wire.decode_as(wire.Health, decode.engine.handle_call(*wire.encode(wire.HealthCheck())))
        assert health.ok and health.active == ()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("error", [RuntimeError("a kernel failed"), EngineError("the batch's KV is gone")])
def test_a_step_error_that_names_no_request_still_stops_the_worker(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """A step that fails as a whole (an error naming no one request: the engine's own state is in doubt) ends the
    decode loop and so the worker, as before: the gateway finds it not ok and reroutes its requests."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with workers(config) as (prefill, decode, _told, _decoded):
        engine = decode._decode
        assert engine is not None

        def failing() -> Any:
            raise error

        monkeypatch.setattr(engine, "step", failing)
        decode.start()
        prefill.start()
        prefill._on_job(job(1))
        wait_for(lambda: decode.wait(0), timeout=60.0, what="the decode worker to stop")
        assert not decode._on_health(wire.HealthCheck()).ok


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON answer) of a POST of `body` as JSON."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60.0) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


@pytest.mark.slow
def test_over_http_a_hopeless_request_is_a_500_naming_the_cause_and_the_others_are_served() -> None:
    """A tiny cluster (one prefill, one decode engine): a completion whose params leave its first decode step no
    token, sent while a long one decodes, is a 500 "decode failed" naming the request and the cause; the long one
    completes with all its tokens, and a completion sent afterwards is served (the decode engine is still up)."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    config = config.with_overrides("limits", request_timeout_s=20.0)  # bounds a run on code that loses the engine
    prompt = [(i * 7 + 3) % 256 for i in range(20)]
    sampling = hopeless(build_model(config), prompt)  # the model the engines serve
    bad = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    bad |= {"allowed_token_ids": list(sampling.allowed_token_ids), "repetition_penalty": HUGE_PENALTY}
    with start_cluster(config) as cluster:
        url = f"{cluster.url}/v1/completions"
        answers: dict[str, tuple[int, Any]] = {}
        long = threading.Thread(
            target=lambda: answers.setdefault(
                "long", post(url, {"prompt": prompt, "max_tokens": 200, "temperature": 0})
            )
        )
        long.start()
        try:
            answers["bad"] = post(url, bad)
        finally:
            long.join(timeout=90.0)
        status, body = answers["bad"]
        assert status == 500, body
        message = body["error"]["message"]
        assert message.startswith("decode failed: request ") and "the sampling params leave every one" in message
        status, body = answers["long"]
        assert status == 200 and body["usage"]["completion_tokens"] == 200, body
        status, body = post(url, {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
