"""The router's `kv_group` key and its LoRA keying, against vLLM 0.32's own recorded events.

The recordings (`tests/cache/vllm_0_32_hybrid.json`, `vllm_0_32_lora.json`) are published over loopback to a
`Fleet`'s real KV-event subscriber, batch by batch; before each, the Fleet schedules the prompt vLLM was probed
with, and its expected prefix is compared with vLLM's hit.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

import zmq
from vllm_fleet.config import RouterConfig, parse_router_config
from vllm_fleet.fleet import Fleet
from vllm_fleet.proxy import _subscriber
from vllm_fleet.servers import free_port
from vllm_fleet.upstream import InstanceInfo

from mooncake.errors import ConfigError
from mooncake.sched import Reason
from mooncake.types import InstanceId

RECORDINGS = Path(__file__).resolve().parents[1] / "cache"
SOURCE = InstanceId("vllm-0")


def recording(name: str) -> dict[str, Any]:
    return json.loads((RECORDINGS / name).read_text())


def config(folder: Path, block_size: int, **instance: Any) -> RouterConfig:
    (folder / "tokenizer.json").write_text("{}")
    table = {"url": "http://127.0.0.1:8100", "kv_events": f"tcp://127.0.0.1:{free_port()}", **instance}
    data = {"router": {"block_size": block_size, "tokenizer": str(folder), "ttft_slo_s": 60.0}, "instances": [table]}
    return parse_router_config(data, "router.toml")


def planned(folder: Path, capture: dict[str, Any], lora_of: Any, *, interleaved: bool, **instance: Any) -> list[int]:
    """Publish the recording to a one-server Fleet batch by batch; the prefix the Fleet expects for each prompt
    vLLM was probed with, when vLLM was (`interleaved`: probe i before batch i; else all after the last batch),
    each request ended at once, so that nothing is queued ahead of the next."""
    info = InstanceInfo(
        model="m", max_model_len=4096, block_size=capture["block_size"], prefix_caching=True, kv_capacity_tokens=1 << 20
    )
    fleet = Fleet(config(folder, capture["block_size"], **instance), [info], subscribe=_subscriber)
    context = zmq.Context()
    found = []
    try:
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.LINGER, 0)
        publisher.connect(fleet.instances[SOURCE].section.kv_events)
        decoder = fleet.instances[SOURCE].subscriber.decoder
        for seq, payload in enumerate(capture["batches"]):
            if interleaved:
                probe = capture["probes"][seq]
                _, decision = fleet.schedule(probe["tokens"], 1, 0.0, lora=lora_of(probe))
                found.append(decision.prefix_tokens)
                fleet.failed(fleet.flights[decision.request_id], 0.0, Reason.CLIENT_GONE)
            deadline = time.monotonic() + 10
            while decoder.expected_seq <= seq:  # PUB drops what it sends before the subscription reaches it
                assert time.monotonic() < deadline, f"batch {seq} never reached the subscriber"
                publisher.send_multipart([b"", seq.to_bytes(8, "big"), bytes.fromhex(payload)])  # again: redelivered
                time.sleep(0.01)
                fleet.poll_events()
        for probe in [] if interleaved else capture["probes"]:
            _, decision = fleet.schedule(probe["tokens"], 1, 0.0, lora=lora_of(probe))
            found.append(decision.prefix_tokens)
            fleet.failed(fleet.flights[decision.request_id], 0.0, Reason.CLIENT_GONE)
        assert fleet.instances[SOURCE].subscriber.stats.num_errors == 0
    finally:
        context.destroy(linger=0)
        fleet.close()
    return found


def test_kv_group_is_read_from_the_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With `kv_group` naming the hybrid model's full-attention group, the Fleet expects vLLM's full-attention
    hit for every probe; with the default (0, a sliding-window group here) it parts from vLLM's hits and logs
    the group to set."""
    capture = recording("vllm_0_32_hybrid.json")
    full = capture["full_attention_group"]
    caplog.set_level(logging.ERROR, logger="vllm_router")
    found = planned(tmp_path, capture, lambda probe: None, interleaved=True, kv_group=full)
    assert found == [probe["full_attention_hit"] for probe in capture["probes"]]
    assert not [r for r in caplog.records if "kv_group" in r.getMessage()]
    found = planned(tmp_path, capture, lambda probe: None, interleaved=True)
    assert found != [probe["hit"] for probe in capture["probes"]]
    warned = [r.getMessage() for r in caplog.records if "kv_group" in r.getMessage()]
    assert len(warned) == 1 and f"set kv_group = {full}" in warned[0] and "sliding_window" in warned[0], warned


def test_a_lora_request_is_keyed_in_its_adapters_namespace(tmp_path: Path) -> None:
    """An adapter's request expects the adapter's cached blocks only, a base-model request the base model's: as
    vLLM's hits for each say."""
    capture = recording("vllm_0_32_lora.json")
    found = planned(tmp_path, capture, lambda probe: probe["lora"], interleaved=False)
    assert found == [probe["hit"] for probe in capture["probes"]]


def test_the_model_a_request_names_is_an_adapter_unless_it_is_the_served_one() -> None:
    """The proxy's reading of `model`: the served name, none, or no string is the base model; any other name an
    adapter's (vLLM serves no other names)."""
    from vllm_fleet.proxy import _adapter

    assert _adapter({"model": "tiny"}, "tiny") is None
    assert _adapter({}, "tiny") is None
    assert _adapter({"model": None}, "tiny") is None
    assert _adapter({"model": ""}, "tiny") is None
    assert _adapter({"model": 3}, "tiny") is None
    assert _adapter({"model": "sql"}, "tiny") == "sql"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, r"kv_group = -1: must be >= 0"),
        (1024, r"kv_group = 1024: must be <= 1023"),
        ("1", r"kv_group = '1': expected int"),
        (True, r"kv_group = True: expected int"),
        (1.0, r"kv_group = 1.0: expected int"),
    ],
)
def test_a_bad_kv_group_is_one_line_naming_it(tmp_path: Path, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"router.toml: \[\[instances\]\] 0 {message}"):
        config(tmp_path, 16, kv_group=value)


def test_kv_group_defaults_to_zero(tmp_path: Path) -> None:
    assert config(tmp_path, 16).instances[0].kv_group == 0
    assert config(tmp_path, 16, kv_group=6).instances[0].kv_group == 6
