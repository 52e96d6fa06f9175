#!/usr/bin/env bash
# The GPU checks of issue #7, as one prepared script for an H200 (or any CUDA) machine:
#   bash benchmarks/gpu.sh            # prints JSON; about 5 minutes including installs
# 1. flash-attn prefill MFU of the llama3-8b preset (bf16) at 8 K, 16 K and 32 K tokens (goal >= 0.5);
# 2. layer-wise KV stores on a CUDA side stream: exposed store time serialized / layer-wise;
# 3. decode step times at batch 1 / 8 / 32 with 2 K tokens of context.
# Nothing in CI needs it. flash-attn is optional: without a wheel for this torch, SDPA serves
# (the JSON says which backend ran).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet torch==2.13.0
  "$VENV/bin/python" -m pip install --quiet -e .
  "$VENV/bin/python" -m pip install --quiet --no-build-isolation flash-attn || echo "flash-attn unavailable: SDPA serves" >&2
fi
exec "$VENV/bin/python" benchmarks/gpu.py "$@"
