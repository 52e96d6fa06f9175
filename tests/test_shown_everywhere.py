"""Public entry points quote what they were given through `_checks.shown`: however large or long the value.

Python refuses to repr an integer past 4,300 digits, so a message that quoted one with `!r` escaped as a bare
ValueError ("Exceeds the limit (4300 digits) ..."), not the named error; a 500-character string or a 300-digit
integer was printed whole. Each entry below, given such a value, raises its own `MooncakeError` with a message
of at most `BOUND` characters that names the argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from mooncake.cache.events import BlockStored
from mooncake.cache.hashing import BlockHasher, reusable_prefix_tokens
from mooncake.cache.index import BlockIndex
from mooncake.cache.pool import DramPagePool
from mooncake.cache.vllm_events import VllmEventDecoder, VllmEventEncoder
from mooncake.cache.vllm_wire import VllmEventBatch, decode_batch, encode_batch
from mooncake.errors import ConfigError, InvalidRequestError, MooncakeError, UnknownInstanceError, VllmEventError
from mooncake.sched import HARDWARE, MODELS
from mooncake.sched.build import build_conductor
from mooncake.sched.cost import (
    FittedPrefillModel,
    PrefillCostModel,
    PrefillSample,
    TransferCostModel,
    prefill_flops,
    require_coefficients,
)
from mooncake.sched.join import DecodeLoad, check_join
from mooncake.sched.step import DecodeCostModel, StepBranch
from mooncake.sim.spec import ClusterSpec
from mooncake.types import Request, RequestId, check_block_key, check_token_count, key_tuple
from mooncake.workload.generator import (
    ArrivalProcess,
    LengthDistribution,
    fixed_length_requests,
    generate_requests,
    preset,
)
from tests.shown_cases import ALL, HUGE, NEGATIVE, TEXT, entry_params, refused_briefly

FINITE = 10**308
"""An integer a float holds (309 digits), where an entry takes one and then refuses it."""
MODEL, GPU = MODELS["llama3-70b"], HARDWARE["8xA800"]
SPEC = preset("conversation")
HASHER = BlockHasher(model="m", block_size_tokens=16)


def request(**fields: Any) -> Request:
    given = {"request_id": RequestId("r"), "arrival_s": 0.0, "input_length": 1, "output_length": 1, "block_keys": ()}
    return Request(**(given | fields))


def conductor(**options: Any) -> Any:
    given = {"model": MODEL, "hardware": GPU, "prefill_instances": ["p"], "decode_instances": ["d"]}
    return build_conductor(**(given | {"block_size_tokens": 16} | options))


def cluster(**fields: Any) -> ClusterSpec:
    return ClusterSpec(
        **(
            {"num_prefill": 1, "num_decode": 1, "model": MODEL, "prefill_hardware": GPU, "decode_hardware": GPU}
            | fields
        )
    )


def first(requests: Any) -> Any:
    return next(iter(requests))


# (id, call, the error it names, the values it refuses: each is refused, not taken)
ENTRIES: list[tuple[str, Callable[[Any], object], type[MooncakeError], tuple[Any, ...]]] = [
    ("Request.input_length", lambda v: request(input_length=v), InvalidRequestError, ALL),
    ("Request.output_length", lambda v: request(output_length=v), InvalidRequestError, ALL),
    ("Request.arrival_s", lambda v: request(arrival_s=v), InvalidRequestError, ALL),
    ("Request.block_size_tokens", lambda v: request(block_size_tokens=v), InvalidRequestError, ALL),
    ("Request.block_keys", lambda v: request(block_keys=[v]), InvalidRequestError, ALL),
    ("Request.reuses_prefix", lambda v: request(reuses_prefix=v), InvalidRequestError, ALL),
    ("check_token_count", lambda v: check_token_count("input_length", v), InvalidRequestError, ALL),
    ("check_block_key", check_block_key, InvalidRequestError, ALL),
    ("key_tuple", lambda v: key_tuple([v]), InvalidRequestError, ALL),
    (
        "generate_requests num_requests",
        lambda v: generate_requests(SPEC, num_requests=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    (
        "generate_requests seed",
        lambda v: generate_requests(SPEC, num_requests=1, seed=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    ("generate_requests spec", lambda v: generate_requests(v, num_requests=1), ConfigError, ALL),
    (
        "fixed_length_requests input_tokens",
        lambda v: fixed_length_requests(input_tokens=v, output_tokens=1, num_requests=1),
        ConfigError,
        ALL,
    ),
    ("WorkloadSpec.max_input_tokens", lambda v: attrs.evolve(SPEC, max_input_tokens=v), ConfigError, ALL),
    ("WorkloadSpec.chat_weight", lambda v: attrs.evolve(SPEC, chat_weight=v), ConfigError, ALL),
    (
        "WorkloadSpec weights summing past a float",
        lambda v: attrs.evolve(SPEC, chat_weight=v, document_weight=v),
        ConfigError,
        (FINITE,),
    ),
    ("WorkloadSpec.popularity_skew", lambda v: attrs.evolve(SPEC, popularity_skew=v), ConfigError, ALL),
    ("WorkloadSpec.name", lambda v: attrs.evolve(SPEC, name=v), ConfigError, (HUGE, NEGATIVE)),
    ("WorkloadSpec.output_tokens", lambda v: attrs.evolve(SPEC, output_tokens=v), ConfigError, ALL),
    (
        "WorkloadSpec.output_tokens.max_tokens",
        lambda v: attrs.evolve(SPEC, output_tokens=LengthDistribution(mean_tokens=300, max_tokens=v)),
        ConfigError,
        ALL,
    ),
    ("LengthDistribution.min_tokens", lambda v: LengthDistribution(mean_tokens=9, min_tokens=v), ConfigError, ALL),
    ("ArrivalProcess.rate_per_s", lambda v: ArrivalProcess(rate_per_s=v), ConfigError, ALL),
    ("preset", preset, ConfigError, ALL),
    (
        "DecodeCostModel.step_s context",
        lambda v: DecodeCostModel(model=MODEL, hardware=GPU).step_s(1, v),
        InvalidRequestError,
        ALL,
    ),
    (
        "DecodeCostModel.step_s batch",
        lambda v: DecodeCostModel(model=MODEL, hardware=GPU).step_s(v, 1),
        InvalidRequestError,
        (HUGE, TEXT),
    ),
    (
        "StepBranch.fixed_s",
        lambda v: StepBranch(fixed_s=v, per_sequence_s=0, per_context_token_s=0),
        ConfigError,
        (*ALL, FINITE),
    ),
    (
        "PrefillCostModel.prefill_s",
        lambda v: PrefillCostModel(model=MODEL, hardware=GPU).prefill_s(v),
        InvalidRequestError,
        ALL,
    ),
    (
        "PrefillCostModel.prefill_s prefix",
        lambda v: PrefillCostModel(model=MODEL, hardware=GPU).prefill_s(9, v),
        InvalidRequestError,
        (TEXT,),
    ),
    ("PrefillCostModel.mfu", lambda v: PrefillCostModel(model=MODEL, hardware=GPU, mfu=v), ConfigError, ALL),
    (
        "PrefillCostModel.prefix_tier",
        lambda v: PrefillCostModel(model=MODEL, hardware=GPU, prefix_tier=v),
        ConfigError,
        ALL,
    ),
    ("prefill_flops prefix", lambda v: prefill_flops(MODEL, 10, v), InvalidRequestError, (TEXT,)),
    ("PrefillSample.num_tokens", lambda v: PrefillSample(num_tokens=v, prefix_tokens=0, seconds=1.0), ConfigError, ALL),
    ("FittedPrefillModel.fit", lambda v: FittedPrefillModel.fit([v]), ConfigError, ALL),
    (
        "FittedPrefillModel.coefficients",
        lambda v: FittedPrefillModel(coefficients=(v, 0.0, 0.0)),
        ConfigError,
        (*ALL, FINITE),
    ),
    ("require_coefficients", require_coefficients, ConfigError, ALL),
    (
        "TransferCostModel.transfer_s",
        lambda v: TransferCostModel(bandwidth_bytes_per_s=1.0).transfer_s(v, in_flight_from_source=9),
        ConfigError,
        (TEXT, FINITE),
    ),
    ("reusable_prefix_tokens", lambda v: reusable_prefix_tokens(v, 0, 16), InvalidRequestError, (NEGATIVE, TEXT)),
    ("BlockHasher.algorithm", lambda v: BlockHasher(model="m", block_size_tokens=16, algorithm=v), ConfigError, ALL),
    ("BlockHasher.salted", lambda v: HASHER.salted(v), InvalidRequestError, (HUGE, NEGATIVE)),
    ("BlockHasher.for_lora", lambda v: HASHER.for_lora(v), InvalidRequestError, (HUGE, NEGATIVE)),
    ("BlockHasher.block_keys parent", lambda v: HASHER.block_keys([1] * 16, parent=v), InvalidRequestError, ALL),
    ("encode_batch batch", encode_batch, VllmEventError, ALL),
    ("encode_batch ts", lambda v: encode_batch(VllmEventBatch(ts=v, events=())), VllmEventError, ALL),
    (
        "encode_batch rank",
        lambda v: encode_batch(VllmEventBatch(ts=0.0, events=(), data_parallel_rank=v)),
        VllmEventError,
        ALL,
    ),
    ("encode_batch event", lambda v: encode_batch(VllmEventBatch(ts=0.0, events=(v,))), VllmEventError, ALL),
    (
        "encode_batch layout",
        lambda v: encode_batch(VllmEventBatch(ts=0.0, events=()), event_layout=v),
        ConfigError,
        ALL,
    ),
    ("decode_batch", decode_batch, VllmEventError, ALL),
    ("VllmEventDecoder hasher", lambda v: VllmEventDecoder(v, "s"), ConfigError, ALL),
    ("VllmEventDecoder tiers", lambda v: VllmEventDecoder(HASHER, "s", tiers=v), ConfigError, ALL),
    ("VllmEventDecoder report_mode", lambda v: VllmEventDecoder(HASHER, "s", report_mode=v), ConfigError, ALL),
    (
        "VllmEventDecoder kv_group",
        lambda v: VllmEventDecoder(HASHER, "s", kv_group=v),
        ConfigError,
        (NEGATIVE, TEXT),
    ),
    ("VllmEventEncoder hasher", VllmEventEncoder, ConfigError, ALL),
    ("VllmEventEncoder mediums", lambda v: VllmEventEncoder(HASHER, mediums=v), ConfigError, ALL),
    ("BlockIndex.match", lambda v: BlockIndex().match([v]), InvalidRequestError, (NEGATIVE, TEXT)),
    ("BlockIndex.remove_instance", lambda v: BlockIndex().remove_instance(v), InvalidRequestError, (HUGE, NEGATIVE)),
    ("BlockStored.tier", lambda v: BlockStored(source="a", tier=v, keys=(1,), seq=0), ConfigError, ALL),
    ("DramPagePool.free", lambda v: DramPagePool(page_bytes=8, num_pages=2).free(v), InvalidRequestError, ALL),
    ("build_conductor hardware", lambda v: conductor(hardware=v), ConfigError, ALL),
    ("Conductor.remove_instance", lambda v: conductor().remove_instance(v, 0.0), UnknownInstanceError, ALL),
    (
        "check_join limits",
        lambda v: check_join(v, DecodeLoad(0, 0), prompt_tokens=1, output_tokens=1),
        ConfigError,
        ALL,
    ),
    ("ClusterSpec.num_prefill", lambda v: cluster(num_prefill=v), ConfigError, (NEGATIVE, TEXT)),
]


@pytest.mark.parametrize(("call", "error", "value"), entry_params(ENTRIES))
def test_a_huge_or_long_value_is_the_named_error_in_a_short_message(
    call: Callable[[Any], object], error: type[MooncakeError], value: Any
) -> None:
    """10**5000 and -10**5000 (whose repr Python refuses), a 500-character string and, where an entry takes a
    number, a 309-digit integer that it refuses (`FINITE`): each is the entry's own error (a `MooncakeError`), its
    message at most `BOUND` characters, the value shown cut or named by its size."""
    assert str(FINITE) not in refused_briefly(lambda: call(value), error)
