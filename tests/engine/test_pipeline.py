"""Chunked pipeline parallelism: X stage processes give one process's logits; stages split layers evenly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mooncake.engine.config import PRESETS  # noqa: E402
from mooncake.engine.model import LlamaModel  # noqa: E402
from mooncake.engine.pipeline import PipelineGroup, stage_layers  # noqa: E402
from mooncake.errors import ConfigError, InvalidRequestError  # noqa: E402

TINY = PRESETS["tiny"]


@given(num_layers=st.integers(1, 100), data=st.data())
def test_stages_partition_the_layers_evenly(num_layers: int, data: st.DataObject) -> None:
    """The stages' layer ranges are contiguous, cover every layer once, and differ in size by at most one."""
    num_stages = data.draw(st.integers(1, num_layers))
    ranges = [stage_layers(num_layers, num_stages, s) for s in range(num_stages)]
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_two_stage_pipeline_equals_one_process() -> None:
    """CPP with X = 2 processes (gloo) gives the logits of a single-process forward pass, chunked or not."""
    model = LlamaModel(TINY, seed=5)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=generator).tolist() for n in (1, 37, 100)]
    with torch.inference_mode():
        expected = [model(torch.tensor(p))[-1] for p in prompts]
    with PipelineGroup(TINY, num_stages=2, chunk_tokens=16, seed=5, threads_per_stage=1) as group:
        for prompt, reference in zip(prompts, expected, strict=True):
            logits = group.prefill(prompt)
            assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-5)
            assert int(logits.argmax()) == int(reference.argmax())
        with pytest.raises(InvalidRequestError):
            group.prefill([TINY.vocab_size])
        assert torch.allclose(group.prefill(prompts[1]), expected[1], atol=1e-5, rtol=1e-5)  # still serving
    assert all(not p.is_alive() for p in group._processes)  # every stage process stopped


def test_pipeline_options_are_checked() -> None:
    """More stages than layers, or a device other than cpu/cuda, is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="num_stages"):
        PipelineGroup(TINY, num_stages=3)
    with pytest.raises(ConfigError, match="device"):
        PipelineGroup(TINY, num_stages=1, device="tpu")
