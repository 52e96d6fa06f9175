"""vLLM events of hybrid models' KV-cache groups and of LoRA adapters, recorded from vLLM 0.32's own
KVCacheManager (`vllm_0_32_hybrid.json`, `vllm_0_32_lora.json` say how), and the wire's message for a payload
that is not msgpack.

The hybrid recording has group 0 a sliding window and group 1 full attention (vLLM's order for gpt-oss): read
at group 1, the index's prefix is vLLM's full-attention group's hit exactly, an upper bound of vLLM's own hit;
read at group 0 it is not vLLM's hit. The LoRA recording's adapter blocks are keyed in the namespace
`BlockHasher.for_lora` gives, so a prompt keyed there matches them and a base-model prompt does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgpack")

from mooncake.cache import BlockHasher, BlockIndex
from mooncake.cache.hashing import reusable_prefix_tokens
from mooncake.cache.vllm_events import VllmEventDecoder
from mooncake.cache.vllm_wire import decode_batch
from mooncake.errors import InvalidRequestError, VllmEventError
from mooncake.types import InstanceId

SOURCE = InstanceId("vllm-0")


def recording(name: str) -> dict[str, Any]:
    return json.loads((Path(__file__).parent / name).read_text())


def replayed(capture: dict[str, Any], decoder: VllmEventDecoder, probe: Any) -> list[Any]:
    """Apply the recording's batches in order; before each, `probe(index, capture's probe)`, as vLLM was probed."""
    index = BlockIndex()
    answers = []
    for seq, payload in enumerate(capture["batches"]):
        answers.append(probe(index, capture["probes"][seq]))
        for event in decoder.decode(bytes.fromhex(payload), seq=seq):
            index.apply(event)
        decoder.check_invariants()
        index.check_invariants()
    return answers


def estimate(hasher: BlockHasher, index: BlockIndex, tokens: list[int]) -> int:
    """The prompt tokens the index says `SOURCE` would reuse, as the router estimates them."""
    blocks = index.match(hasher.block_keys(tokens)).length(SOURCE)
    return reusable_prefix_tokens(len(tokens), blocks, hasher.block_size_tokens)


def test_a_hybrid_models_full_attention_group_gives_vllms_full_attention_hit() -> None:
    """Read at the full-attention group, every probe's estimate is vLLM's full-attention group's hit, and never
    below vLLM's own (which also needs the window's blocks of the sliding-window group)."""
    capture = recording("vllm_0_32_hybrid.json")
    hasher = BlockHasher(model="hybrid", block_size_tokens=capture["block_size"])
    decoder = VllmEventDecoder(hasher, SOURCE, kv_group=capture["full_attention_group"])
    answers = replayed(capture, decoder, lambda index, probe: (estimate(hasher, index, probe["tokens"]), probe))
    assert [mine for mine, _ in answers] == [probe["full_attention_hit"] for _, probe in answers]
    assert all(mine >= probe["hit"] for mine, probe in answers)
    assert any(probe["hit"] > 0 for _, probe in answers), "the recording has no hit to compare"
    assert decoder.group_kinds == {0: "sliding_window", 1: "full_attention"}


def test_a_hybrid_models_sliding_window_group_is_not_vllms_hit() -> None:
    """Read at group 0, the sliding-window group (the decoder's default, which the router used for every model),
    the estimates part from vLLM's hits: the window frees a running request's early blocks, which go first."""
    capture = recording("vllm_0_32_hybrid.json")
    hasher = BlockHasher(model="hybrid", block_size_tokens=capture["block_size"])
    decoder = VllmEventDecoder(hasher, SOURCE)
    answers = replayed(capture, decoder, lambda index, probe: (estimate(hasher, index, probe["tokens"]), probe))
    assert any(mine != probe["hit"] for mine, probe in answers)


def test_lora_blocks_are_keyed_in_the_adapters_namespace() -> None:
    """vLLM keys an adapter's blocks apart from the base model's (`("lora", name, path)` extra keys): a prompt
    keyed with `BlockHasher.for_lora(name)` finds what vLLM finds for that adapter, a base-model prompt what
    vLLM finds for the base model; each probe of the recording agrees."""
    capture = recording("vllm_0_32_lora.json")
    hasher = BlockHasher(model="base", block_size_tokens=capture["block_size"])
    decoder = VllmEventDecoder(hasher, SOURCE)
    index = BlockIndex()
    for seq, payload in enumerate(capture["batches"]):
        for event in decoder.decode(bytes.fromhex(payload), seq=seq):
            index.apply(event)
    found = [estimate(hasher.for_lora(probe["lora"]), index, probe["tokens"]) for probe in capture["probes"]]
    assert found == [probe["hit"] for probe in capture["probes"]]
    assert {probe["lora"] for probe in capture["probes"] if probe["hit"]} == {None, capture["adapter"]}


def test_for_lora_is_a_namespace_of_its_own() -> None:
    """None is the hasher itself; adapters share no root with the base model, each other, or a cache salt; the
    salt composes; a name that is no non-empty string is refused."""
    hasher = BlockHasher(model="m", block_size_tokens=4)
    assert hasher.for_lora(None) is hasher
    roots = {
        hasher.root_key,
        hasher.for_lora("a").root_key,
        hasher.for_lora("b").root_key,
        hasher.salted("a").root_key,
        hasher.for_lora("a").salted("s").root_key,
        hasher.salted("s").root_key,
    }
    assert len(roots) == 6
    assert hasher.for_lora("a") == hasher.for_lora("a")
    for bad in ("", 3, b"a"):
        with pytest.raises(InvalidRequestError, match="LoRA adapter's name"):
            hasher.for_lora(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [b"\xc1garbage", b"\xc1"])
def test_a_payload_that_is_not_msgpack_says_why(payload: bytes) -> None:
    """msgpack's FormatError has no text of its own: the message names it rather than ending in nothing."""
    with pytest.raises(VllmEventError, match=r"is not one msgpack value \(\d+ bytes\): FormatError$"):
        decode_batch(payload)
