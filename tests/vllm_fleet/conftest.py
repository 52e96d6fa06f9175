"""Tests of the vLLM router's parts (examples/vllm_fleet): its modules import as `vllm_fleet.*`, the cluster's as
`serving.*`."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
