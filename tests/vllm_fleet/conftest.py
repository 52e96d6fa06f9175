"""Tests of the vLLM router's parts (examples/vllm_fleet): its modules import as `vllm_fleet.*`, the cluster's as
`serving.*`."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.vllm_fleet.fake import FakeVllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The environment with vLLM (`make test-vllm` sets it: the Makefile's `.venv-vllm/bin/python`)."""
    python = os.environ.get("MOONCAKE_VLLM_PYTHON", "")
    if not python:
        pytest.fail("MOONCAKE_VLLM_PYTHON is not set: run these tests with `make test-vllm`")
    return python


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small local model the real vLLM servers serve (`vllm_fleet.model`)."""
    from vllm_fleet.model import make_model

    return make_model(tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The servers' tokenizer, as the stand-in servers and the router load it."""
    from vllm_fleet.model import make_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return directory


@pytest.fixture
def fakes(tokenizer_dir: Path) -> Iterator[list[FakeVllm]]:
    """Two stand-in vLLM servers (`tests/vllm_fleet/fake.py`), started; stopped at the end."""
    from mooncake.engine.tokenizer import load_tokenizer
    from tests.vllm_fleet.fake import FakeVllm

    tokenizer = load_tokenizer(tokenizer_dir)
    servers: list[FakeVllm] = []
    try:
        for _ in range(2):
            servers.append(FakeVllm(tokenizer).start())
        yield servers
    finally:
        for server in servers:
            server.stop()
