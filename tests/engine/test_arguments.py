"""Tests for the engines' shared argument checks (`mooncake.engine.config.check_instance`, `check_callback`,
`switch`): an argument of the wrong kind fails by name, alike in every engine that takes it.

Each case is a call that was a bare TypeError or AttributeError (or, for a switch given "no", passed as true):
an engine's option is now a ConfigError and a request's argument an InvalidRequestError, each naming the
argument and the value, and a refused request holds nothing and leaves the engine serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

pytest.importorskip("torch")

from mooncake.cache.tiered import TieredCache
from mooncake.engine.config import PRESETS
from mooncake.engine.decode import DecodeConfig, DecodeEngine
from mooncake.engine.pipeline import PipelineGroup
from mooncake.engine.prefill import PrefillConfig, PrefillEngine, PrefillResult
from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.types import RequestId
from tests.engine.support import assert_nothing_held, dram_cache, hasher, tiny_model

BLOCK = 4
PROMPT = list(range(10))


@attrs.define
class Engines:
    cache: TieredCache
    prefill: PrefillEngine
    decode: DecodeEngine
    prefilled: PrefillResult


@pytest.fixture
def engines() -> Iterator[Engines]:
    cache = dram_cache(BLOCK)
    with PrefillEngine(tiny_model(), cache, hasher(BLOCK)) as prefill:
        decode = DecodeEngine(
            tiny_model(), cache, block_tokens=BLOCK, config=DecodeConfig(max_batch_size=2, max_context_tokens=32)
        )
        yield Engines(cache, prefill, decode, prefill.prefill(PROMPT))


def join(e: Engines, **options: Any) -> object:
    return e.decode.try_join(
        RequestId("r"),
        e.prefilled.keys,
        prompt_tokens=len(PROMPT),
        first_token=e.prefilled.first_token,
        max_new_tokens=3,
        **options,
    )


REQUESTS: list[tuple[str, Callable[[Engines], object], str]] = [
    (
        "prefill sampling dict",
        lambda e: e.prefill.prefill([1, 2, 3], sampling={"temperature": 1.0}),  # type: ignore[arg-type]
        r"^sampling must be a SamplingParams or None, got \{'temperature': 1.0\}$",
    ),
    (
        "prefill sink object",
        lambda e: e.prefill.prefill(PROMPT, sink=object()),  # type: ignore[arg-type]
        r"^sink must be a KvSink or None, got <object object at ",
    ),
    (
        "prefill cancelled 1",
        lambda e: e.prefill.prefill([5, 6, 7], cancelled=1),  # type: ignore[arg-type]
        r"^cancelled must be callable or None, got 1$",
    ),
    (
        "prefill_batch prompts None",
        lambda e: e.prefill.prefill_batch(None),  # type: ignore[arg-type]
        r"^prompts must be an iterable, got None$",
    ),
    (
        "prefill_batch prompts 5",
        lambda e: e.prefill.prefill_batch(5),  # type: ignore[arg-type]
        r"^prompts must be an iterable, got 5$",
    ),
    (
        "prefill_batch sampling 5",
        lambda e: e.prefill.prefill_batch([[1]], sampling=5),  # type: ignore[arg-type]
        r"^sampling must be an iterable, got 5$",
    ),
    (
        "prefill_batch a sampling dict",
        lambda e: e.prefill.prefill_batch([[1], [2]], sampling=[None, {"seed": 1}]),  # type: ignore[list-item]
        r"^sampling\[1\] must be a SamplingParams or None, got \{'seed': 1\}$",
    ),
    (
        "prefill_batch a sink string",
        lambda e: e.prefill.prefill_batch([[1]], sinks=["decode-0"]),  # type: ignore[list-item]
        r"^sinks\[0\] must be a KvSink or None, got 'decode-0'$",
    ),
    (
        "try_join prompt 5",
        lambda e: join(e, prompt=5),
        r"^prompt 5: tokens must be a 1-D integer sequence",
    ),
    (
        "try_join prompt id outside the vocabulary",
        lambda e: join(e, prompt=[*PROMPT[:-1], 10**6]),
        r"^prompt \[.*\]: token ids must lie in \[0, 256\), got 1000000 at position 9$",
    ),
    (
        "try_join sampling dict",
        lambda e: join(e, sampling={"temperature": 1.0}),
        r"^sampling must be a SamplingParams or None, got \{'temperature': 1.0\}$",
    ),
    (
        "try_join on_token 5",
        lambda e: join(e, on_token=5),
        r"^on_token must be callable or None, got 5$",
    ),
    (
        "run max_steps '3'",
        lambda e: e.decode.run(max_steps="3"),  # type: ignore[arg-type]
        r"^max_steps must be an integer >= 0, got '3'$",
    ),
]


@pytest.mark.parametrize(("call", "named"), [case[1:] for case in REQUESTS], ids=[case[0] for case in REQUESTS])
def test_a_request_argument_of_another_kind_is_an_invalid_request_naming_it(
    engines: Engines, call: Callable[[Engines], object], named: str
) -> None:
    """A request's sampling, sink, flag, prompt or list of the wrong kind, in either engine, is refused by name
    before anything is held (it was a bare AttributeError or TypeError, some once the prefix was pinned and pages
    reserved); both engines serve on."""
    with pytest.raises(InvalidRequestError, match=named):
        call(engines)
    assert engines.decode.num_active == 0
    engines.cache.check_invariants()
    assert engines.prefill.prefill(PROMPT).prefix_tokens == 2 * BLOCK
    assert join(engines).accepted  # type: ignore[attr-defined]
    engines.decode.run(max_steps=5)
    assert_nothing_held(engines.cache, engines.prefilled.keys)


OPTIONS: list[tuple[str, Callable[[TieredCache], object], str]] = [
    (
        "PrefillEngine cache None",
        lambda c: PrefillEngine(tiny_model(), None, hasher(BLOCK)),  # type: ignore[arg-type]
        r"^cache must be a TieredCache, got None$",
    ),
    (
        "PrefillEngine hasher None",
        lambda c: PrefillEngine(tiny_model(), c, None),  # type: ignore[arg-type]
        r"^hasher must be a BlockHasher, got None$",
    ),
    (
        "PrefillEngine config dict",
        lambda c: PrefillEngine(tiny_model(), c, hasher(BLOCK), {"chunk_tokens": 3}),  # type: ignore[arg-type]
        r"^config must be a PrefillConfig or None, got \{'chunk_tokens': 3\}$",
    ),
    (
        "PrefillConfig layerwise 'no'",
        lambda c: PrefillConfig(layerwise="no"),  # type: ignore[arg-type]
        r"^layerwise must be True or False, got 'no'$",
    ),
    (
        "PrefillConfig store 0",
        lambda c: PrefillConfig(store=0),  # type: ignore[arg-type]
        r"^store must be True or False, got 0$",
    ),
    (
        "DecodeEngine config dict",
        lambda c: DecodeEngine(tiny_model(), c, block_tokens=BLOCK, config={"max_batch_size": 2}),  # type: ignore[arg-type]
        r"^config must be a DecodeConfig or None, got \{'max_batch_size': 2\}$",
    ),
    (
        "DecodeEngine cache None",
        lambda c: DecodeEngine(tiny_model(), None, block_tokens=BLOCK),  # type: ignore[arg-type]
        r"^cache must be a TieredCache, got None$",
    ),
    (
        "PipelineGroup config None",
        lambda c: PipelineGroup(None, num_stages=1),  # type: ignore[arg-type]
        r"^config must be a ModelConfig, got None$",
    ),
    (
        "PipelineGroup on_failure 3",
        lambda c: PipelineGroup(PRESETS["tiny"], num_stages=1, on_failure=3),  # type: ignore[arg-type]
        r"^on_failure must be callable or None, got 3$",
    ),
]


@pytest.mark.parametrize(("make", "named"), [case[1:] for case in OPTIONS], ids=[case[0] for case in OPTIONS])
def test_an_engine_option_of_another_kind_is_a_config_error_naming_it(
    make: Callable[[TieredCache], object], named: str
) -> None:
    """An engine's cache, hasher, config or callback of the wrong kind is refused by name when the engine is made
    (it was an AttributeError there, or later at its first use; a switch given "no" read as true)."""
    with pytest.raises(ConfigError, match=named):
        made = make(dram_cache(BLOCK))
        getattr(made, "close", lambda: None)()  # made after all: do not leave its threads behind
