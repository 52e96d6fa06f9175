"""The vLLM router's disaggregated flow against real vLLM servers on this CPU (`make test-vllm`; marker `vllm`).

Two servers of the small local model with vLLM's `ExampleConnector` (`kv_both`, one shared directory: the
prefill server writes each prompt's KV there, the decode server loads it instead of computing it; the
connector of vLLM's CPU build that moves KV between two servers), declared `prefill` and `decode` to the
router. They prove the two-step flow end to end: a request is prefilled on one server and decoded on the
other, which finds its prompt's KV loaded (not computed) and answers exactly what the prefill server itself
answers for that prompt (greedy logprobs equal; a prompt that differs in its first words answers otherwise,
so the equality is the KV's, not the model's indifference); a stream passes through the same way. The
servers run for the module; every process group is stopped at the end.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from serving.api import DECODE_HEADER, PREFILL_HEADER
from vllm_fleet.background import BackgroundRouter
from vllm_fleet.config import parse_router_config
from vllm_fleet.model import words
from vllm_fleet.servers import VllmFleet

from tests.vllm_fleet.http import Answer, fetch

pytestmark = pytest.mark.vllm
BLOCK = 32


@pytest.fixture(scope="module")
def pair(vllm_python: str, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmFleet, Path]]:
    shared = tmp_path_factory.mktemp("kv")
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)},
    }
    with VllmFleet.start(
        python=vllm_python,
        model=model,
        count=2,
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_args=("--kv-transfer-config", json.dumps(connector)),
    ) as fleet:
        yield fleet, shared
    assert all(server.group() == [] for server in fleet)


def logprobs(answer: Answer) -> list[float]:
    return [float(x) for x in answer.json()["choices"][0]["logprobs"]["token_logprobs"]]


def test_a_request_is_prefilled_on_one_server_and_decoded_on_the_other(
    pair: tuple[VllmFleet, Path], model: Path
) -> None:
    fleet, shared = pair
    prefill = fleet.servers[0]
    text = (
        "[router]\nport = 0\nblock_size = 32\nttft_slo_s = 30.0\nhealth_interval_s = 0.5\ncalibration_tokens = 256\n"
        f'tokenizer = "{model}"\n' + fleet.instances_toml(roles=("prefill", "decode"))
    )
    config = parse_router_config(tomllib.loads(text), "pd.toml")
    body: dict[str, Any] = {"model": "tiny", "prompt": words(240, seed=11), "max_tokens": 8, "temperature": 0.0}
    body["logprobs"] = 1
    with BackgroundRouter(config) as router:
        routed = fetch(f"{router.url}/v1/completions", body)
        assert routed.status_code == 200, routed.text
        assert (routed.headers[PREFILL_HEADER], routed.headers[DECODE_HEADER]) == ("vllm-0", "vllm-1")
        assert any(shared.iterdir())  # the prefill server wrote the prompt's KV
        usage = routed.json()["usage"]
        prompt_tokens = usage["prompt_tokens"]
        # The decode server loaded the prompt's KV, every whole block of it, instead of computing it.
        assert prompt_tokens - BLOCK <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens
        own = fetch(f"{prefill.url}/v1/completions", body)  # the prefill server's own answer, computed there
        assert routed.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
        assert max(abs(a - b) for a, b in zip(logprobs(routed), logprobs(own), strict=True)) < 1e-4
        other = fetch(f"{prefill.url}/v1/completions", {**body, "prompt": "nota " + body["prompt"]})
        assert max(abs(a - b) for a, b in zip(logprobs(other), logprobs(own), strict=True)) > 1e-3
        streamed = fetch(f"{router.url}/v1/completions", {**body, "stream": True, "prompt": words(60, seed=12)})
        assert streamed.status_code == 200 and streamed.headers[DECODE_HEADER] == "vllm-1"
        events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
        assert sum(len(chunk["logprobs"]["tokens"]) for chunk in chunks) == 8  # every token, however batched
        assert chunks[-1]["finish_reason"] == "length"
        assert router.read(lambda r: len(r.fleet.flights)) == 0
