"""curl against a real tiny cluster: the streaming and whole answers a shell user sees.

curl is the other client the issue names beside the `openai` package (tests/test_cluster.py): it sends
the bytes a person types, with no SDK smoothing over the wire format. Greedy decoding makes the text of a
streamed answer comparable with a whole one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.config import load_config
from serving.launch import RunningCluster, start_cluster

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
CURL = shutil.which("curl")
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(CURL is None, reason="curl is not installed here")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    with start_cluster(config) as running:
        yield running


def curl(cluster: RunningCluster, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """Run curl (no buffering, like `curl -N`); the HTTP status and the body."""
    assert CURL is not None
    command = [CURL, "-sS", "-N", "--max-time", str(TIMEOUT_S), "-w", "\n%{http_code}", f"{cluster.url}{path}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S + 10, check=True)
    text, _, status = done.stdout.rpartition("\n")
    return int(status), text


def events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body; checks it ends with `data: [DONE]` and has nothing but events."""
    lines = [line for line in text.split("\n") if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_curl_streams_the_same_text_as_a_whole_answer(cluster: RunningCluster) -> None:
    """A streamed completion's chunks join into the whole answer's text; the last text chunk carries the
    finish reason, and the usage chunk (asked for) counts the tokens of both alike."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    status, whole = curl(cluster, "/v1/completions", body)
    assert status == 200, whole
    answer = json.loads(whole)
    status, streamed = curl(
        cluster, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200, streamed
    chunks = events(streamed)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == answer["usage"]
    texts = [chunk["choices"][0]["text"] or "" for chunk in chunks[:-1]]
    assert "".join(texts) == answer["choices"][0]["text"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]][-1] == answer["choices"][0]["finish_reason"]
    assert all(chunk["object"] == "text_completion" for chunk in chunks[:-1])


def test_curl_streams_a_chat(cluster: RunningCluster) -> None:
    """A streamed chat opens with the assistant's role, sends content deltas and ends with a finish reason."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    status, streamed = curl(cluster, "/v1/chat/completions", body)
    assert status == 200, streamed
    chunks = events(streamed)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_curl_sees_json_errors_and_the_model_list(cluster: RunningCluster) -> None:
    """What a shell user gets wrong is a JSON error naming it; /v1/models lists the served model."""
    status, text = curl(cluster, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == ["tiny"]
    status, text = curl(cluster, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    status, text = curl(cluster, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
