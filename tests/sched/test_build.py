"""Tests for `mooncake.sched.build`: one library-level way to build a Conductor, with documented defaults."""

from __future__ import annotations

import functools

import pytest

from mooncake.cache.hashing import BlockHasher
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.admission import BaselineAdmission, EarlyRejection
from mooncake.sched.build import build_conductor, ttft_estimator
from mooncake.sched.cost import HARDWARE, MODELS, PrefillCostModel, TransferCostModel
from mooncake.sched.join import DecodeLimits
from mooncake.sched.predictor import UniformDecodePredictor
from mooncake.sched.router import KvCacheCentricRouter, LoadBalancingRouter
from mooncake.sched.step import DecodeCostModel
from mooncake.types import Request, RequestId, Slo

LLAMA3, A800, H800 = MODELS["llama3-70b"], HARDWARE["8xA800"], HARDWARE["8xH800"]
HASHER = BlockHasher(model="llama3-70b", block_size_tokens=512)


def test_defaults_are_the_documented_ones() -> None:
    """Algorithm 1 at threshold 1.5, early rejection, the uniform predictor at 10 s, SLOs 30 s / 100 ms,
    the analytic cost models on the hardware, the block size of the hasher, the HBM's KV per decode instance."""
    conductor = build_conductor(
        model=LLAMA3, hardware=A800, prefill_instances=["p0", "p1"], decode_instances=["d0"], hasher=HASHER
    )
    router = conductor.router
    assert isinstance(router, KvCacheCentricRouter) and router.threshold == 1.5
    assert router.estimator == ttft_estimator(LLAMA3, A800)
    assert router.estimator.prefill == PrefillCostModel(model=LLAMA3, hardware=A800)
    assert router.estimator.transfer == TransferCostModel(bandwidth_bytes_per_s=A800.nic_bytes_per_s)
    assert isinstance(conductor.admission, EarlyRejection) and not conductor.admission.predictive
    assert conductor.predictor == UniformDecodePredictor(decode_s=10.0)
    assert conductor.slo == Slo(ttft_s=30.0, tbt_s=0.1)
    assert conductor.step_model == DecodeCostModel(model=LLAMA3, hardware=A800)
    assert conductor.block_size_tokens == 512 and conductor.transfers
    assert [v.instance_id for v in conductor.prefill_views] == ["p0", "p1"]
    (decode,) = conductor.decode_views
    assert decode.limits == DecodeLimits(
        kv_capacity_tokens=DecodeCostModel(model=LLAMA3, hardware=A800).capacity_tokens()
    )


def test_every_part_can_be_replaced() -> None:
    """Routers by factory, policies and models by object, decode on other GPUs, no global pool."""
    limits = DecodeLimits(kv_capacity_tokens=10_000, max_batch_size=8)
    conductor = build_conductor(
        model=LLAMA3,
        hardware=A800,
        decode_hardware=H800,
        prefill_instances=["p0"],
        decode_instances=["d0", "d1"],
        block_size_tokens=16,
        router=functools.partial(KvCacheCentricRouter, threshold=4.0),
        admission=BaselineAdmission(),
        slo=Slo(ttft_s=5.0, tbt_s=0.05),
        decode_limits=limits,
        transfers=False,
    )
    assert isinstance(conductor.router, KvCacheCentricRouter) and conductor.router.threshold == 4.0
    assert isinstance(conductor.admission, BaselineAdmission) and not conductor.transfers
    assert conductor.step_model == DecodeCostModel(model=LLAMA3, hardware=H800)
    assert all(v.limits == limits for v in conductor.decode_views) and conductor.block_size_tokens == 16
    other = build_conductor(
        model=LLAMA3,
        hardware=A800,
        prefill_instances=[],
        decode_instances=[],
        hasher=HASHER,
        router=LoadBalancingRouter,
    )
    assert isinstance(other.router, LoadBalancingRouter)


@pytest.mark.parametrize("geometry", [{}, {"hasher": HASHER, "block_size_tokens": 512}])
def test_the_block_geometry_is_given_once(geometry: dict[str, object]) -> None:
    """Neither or both of a hasher and a block size is a ConfigError naming both."""
    with pytest.raises(ConfigError, match=r"hasher.*block_size_tokens"):
        build_conductor(model=LLAMA3, hardware=A800, prefill_instances=["p"], decode_instances=["d"], **geometry)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        (
            {"model": "llama3-70b"},
            r"model must be a ModelShape \(e\.g\. mooncake\.sched\.MODELS\[name\]\), got 'llama3-70b'",
        ),
        ({"hardware": "8xA800"}, r"hardware must be a Hardware .*got '8xA800'"),
        ({"decode_hardware": 8}, r"decode_hardware must be a Hardware .*got 8"),
    ],
)
def test_a_preset_name_for_a_model_or_hardware_is_a_clear_error(parts: dict[str, object], named: str) -> None:
    """A name where the object belongs says which object and where presets are, not an AttributeError."""
    options: dict[str, object] = {"model": LLAMA3, "hardware": A800, **parts}
    with pytest.raises(ConfigError, match=named):
        build_conductor(prefill_instances=["p"], decode_instances=["d"], block_size_tokens=512, **options)  # type: ignore[arg-type]


def test_requests_keyed_with_another_hasher_are_refused() -> None:
    """A request keyed in 16-token blocks meets a Conductor built with 512-token blocks: refused, naming both."""
    conductor = build_conductor(
        model=LLAMA3, hardware=A800, prefill_instances=["p"], decode_instances=["d"], hasher=HASHER
    )
    small = BlockHasher(model="llama3-70b", block_size_tokens=16)
    tokens = list(range(100))
    request = Request(
        request_id=RequestId("r"),
        arrival_s=0.0,
        input_length=len(tokens),
        output_length=4,
        block_keys=small.block_keys(tokens),
        block_size_tokens=small.block_size_tokens,
    )
    with pytest.raises(InvalidRequestError, match=r"16-token blocks.*512 tokens"):
        conductor.schedule(request, 0.0)


def test_instances_must_be_unique() -> None:
    """An instance listed twice (or as both kinds) is a ConfigError."""
    with pytest.raises(ConfigError, match="p"):
        build_conductor(model=LLAMA3, hardware=A800, prefill_instances=["p"], decode_instances=["p"], hasher=HASHER)


class _NeedsDepth:
    def __init__(self, estimator: object, depth: int) -> None:
        pass


@pytest.mark.parametrize(
    ("router", "named"),
    [
        (_NeedsDepth, r"router factory _NeedsDepth\(estimator, depth\) cannot be called with the TTFT estimator"),
        (LoadBalancingRouter(estimator=ttft_estimator(LLAMA3, A800)), "cannot be called|router class or factory"),
        ("kvcache_centric", "router must be a router class or factory"),
        (dict, "router class dict has no route"),
    ],
)
def test_a_router_factory_that_cannot_take_the_estimator_is_a_clear_error(router: object, named: str) -> None:
    """The factory is checked against the one argument it will get (a router instance in its place, a
    constructor wanting more, a class that is no router) before anything is built, with a ConfigError
    instead of a TypeError."""
    with pytest.raises(ConfigError, match=named):
        build_conductor(
            model=LLAMA3,
            hardware=A800,
            prefill_instances=["p0"],
            decode_instances=["d0"],
            hasher=HASHER,
            router=router,  # type: ignore[arg-type]
        )
