"""The gateway's answer ids, seeds and output limits as vLLM 0.32 serves them, against a real tiny cluster.

An answer's id is `cmpl-` (a chat's `chatcmpl-`) and the client's `X-Request-Id` header, else its body's
`request_id`, else a fresh uuid (vLLM's `_base_request_id`); the id is the answer's only: two requests sending
the same one at once are served apart, each its own text. A `seed` of -1 is no seed (vLLM's `SamplingParams`): two
sampled requests draw streams of their own. A `max_tokens` over the whole context is vLLM's 400 naming the field.
The cluster (one prefill, one decode engine) is stopped at the end; every request has a timeout.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.config import load_config
from serving.launch import RunningCluster, start_cluster

from tests.vllm_fleet.http import TIMEOUT_S, Answer, fetch

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with start_cluster(config) as running:
        yield running


def ask(cluster: RunningCluster, body: dict[str, Any], headers: dict[str, str] | None = None) -> Answer:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return fetch(f"{cluster.url}{path}", {"model": "tiny", **body}, headers)


def served(answer: Answer) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    whole: dict[str, Any] = answer.json()
    return whole


def stream_ids(answer: Answer) -> set[str]:
    """The ids of a stream's chunks."""
    assert answer.status_code == 200, answer.text
    lines = [line.removeprefix("data: ") for line in answer.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return {json.loads(line)["id"] for line in lines[:-1]}


def test_an_answers_id_is_the_headers_else_the_bodys_else_a_uuid(cluster: RunningCluster) -> None:
    """`X-Request-Id` wins over the body's `request_id`, which wins over a fresh uuid; a chat's answer is named
    `chatcmpl-`, and every chunk of a stream carries the id."""
    short = {"prompt": "hi", "max_tokens": 2}
    header = {"X-Request-Id": "from-header"}
    assert served(ask(cluster, short, header))["id"] == "cmpl-from-header"
    assert served(ask(cluster, {**short, "request_id": "from-body"}))["id"] == "cmpl-from-body"
    assert served(ask(cluster, {**short, "request_id": "from-body"}, header))["id"] == "cmpl-from-header"
    chat = {"messages": CHAT, "max_tokens": 2, "request_id": "from-body"}
    assert served(ask(cluster, chat))["id"] == "chatcmpl-from-body"
    assert stream_ids(ask(cluster, {**chat, "stream": True}, header)) == {"chatcmpl-from-header"}
    fresh = {served(ask(cluster, short))["id"] for _ in range(2)}
    assert len(fresh) == 2 and all(one.startswith("cmpl-") and len(one) == len("cmpl-") + 32 for one in fresh)
    refused = ask(cluster, {**short, "request_id": 7})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "request_id")


@pytest.mark.parametrize(("raw", "expected"), [(b"a\xffb", "a\xffb"), ("\u00e9".encode(), "\u00c3\u00a9")])
def test_an_x_request_id_header_is_read_as_latin_1_as_vllm_reads_it(
    cluster: RunningCluster, raw: bytes, expected: str
) -> None:
    """A header's bytes are latin-1 to vLLM's server (Starlette): a byte that is no UTF-8 (0xff) is "\u00ff", not a
    lone surrogate no strict client decodes, and UTF-8's "\u00e9" is its two bytes' "\u00c3\u00a9", as vLLM names
    the answer."""
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(head + b"X-Request-Id: " + raw + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    answer_id = json.loads(data.partition(b"\r\n\r\n")[2])["id"]
    assert answer_id == f"cmpl-{expected}"
    answer_id.encode("utf-8")  # no lone surrogate


def test_two_requests_with_the_same_request_id_at_once_are_served_apart(cluster: RunningCluster) -> None:
    """Two greedy completions of different prompts sent together with the same `X-Request-Id` both answer with
    that id, each with the text its prompt alone gets: the cluster's own ids (the dispatcher's, the engines', the
    Conductor's) stay unique, as vLLM's internal ids do (it suffixes them)."""
    prompts = ("Once upon a time", "The quick brown fox")
    base = {"max_tokens": 128, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    alone = {prompt: served(ask(cluster, {**base, "prompt": prompt}))["choices"][0]["token_ids"] for prompt in prompts}
    together = threading.Barrier(len(prompts), timeout=30)

    def at_once(prompt: str) -> Answer:
        together.wait()
        return ask(cluster, {**base, "prompt": prompt}, {"X-Request-Id": "same"})

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = [served(answer) for answer in pool.map(at_once, prompts)]
    assert [answer["id"] for answer in answers] == ["cmpl-same", "cmpl-same"]
    assert [answer["choices"][0]["token_ids"] for answer in answers] == [alone[prompt] for prompt in prompts]
    assert alone[prompts[0]] != alone[prompts[1]]  # the check could tell the two apart


def test_a_seed_of_minus_one_samples_a_fresh_stream_per_request(cluster: RunningCluster) -> None:
    """vLLM reads seed -1 as none: two sampled requests with it draw their own tokens (a fixed seed, as 5 here,
    draws the same tokens twice, so the same seed would have made them equal)."""
    body = {"prompt": "hi", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}

    def drawn(seed: int) -> list[list[int]]:
        return [served(ask(cluster, {**body, "seed": seed}))["choices"][0]["token_ids"] for _ in range(2)]

    fixed = drawn(5)
    assert fixed[0] == fixed[1] and len(fixed[0]) == 24
    unseeded = drawn(-1)
    assert unseeded[0] != unseeded[1]


def test_an_output_over_the_whole_context_is_vllms_400(cluster: RunningCluster) -> None:
    """`max_tokens` over `[decode] max_context_tokens` (2048 in tiny.toml) is refused with vLLM's words (the bound
    named as the context, not as the `max_model_len` /v1/models advertises), naming the field a chat used (test_api_edges checks that the whole context itself is trimmed instead)."""
    context = cluster.config.decode.max_context_tokens
    for body, field in (
        ({"prompt": "hi", "max_tokens": context + 1}, "max_tokens"),
        ({"messages": CHAT, "max_completion_tokens": context + 1}, "max_completion_tokens"),
    ):
        error = ask(cluster, body).json()["error"]
        assert (error["code"], error["param"]) == (400, field)
        assert error["message"] == (
            f"{field}={context + 1} cannot be greater than the context: [decode] max_context_tokens={context}. "
            "Please request fewer output tokens."
        )
