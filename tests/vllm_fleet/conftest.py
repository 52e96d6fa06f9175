"""Tests of the vLLM router's parts (examples/vllm_fleet): its modules import as `vllm_fleet.*`, the cluster's as
`serving.*`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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
