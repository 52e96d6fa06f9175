"""A cluster that cannot start says why in one line; a decode worker's engine checks the gateway's TBT objective.

`examples/cluster.py` over a checkpoint whose only shard is truncated (a download cut short): every worker
fails to load it, and the launcher exits with status 1, its last line of stderr naming a worker and the
loader's `ConfigError` (the shard and what is wrong with it) — not "died while starting" after a hundred lines
of tracebacks: an expected error of a worker's start is one line of its log. No process of the launch outlives
it (found by a mark in their environment, which spawned processes inherit) and no shared-memory segment of
theirs stays in /dev/shm.

A decode worker builds its engine with the TBT objective the Conductor admits against
(`ClusterConfig.objectives`): the engine's late refusal (`sched.join.check_join`) and the Conductor's early one
are the same rule on the same number.

Every wait is bounded; every process started here has ended when a test ends.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")
safetensors_torch = pytest.importorskip("safetensors.torch")

from serving.config import ClusterConfig, load_config  # noqa: E402
from serving.worker import Worker, WorkerSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny.toml"
SHM = Path("/dev/shm")
LAUNCH_S = 180.0  # three workers started (and failing) on a busy two-core machine
MARK = "MOONCAKE_TEST_START_FAILURE"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not SHM.is_dir() or not Path("/proc/self").is_dir(),
    reason="reads /proc and /dev/shm (Linux)",
)

MODEL = {  # a two-layer Llama of the loader's smallest shape
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def truncated_checkpoint(directory: Path) -> Path:
    """A checkpoint directory whose config reads and whose only shard is a safetensors file cut in half."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(MODEL))
    shard = directory / "model.safetensors"
    safetensors_torch.save_file({"model.embed_tokens.weight": torch.zeros(320, 64)}, str(shard))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return shard


def marked_processes(mark: str) -> list[int]:
    """The running processes whose environment holds `MARK=mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def test_a_truncated_shard_stops_the_launcher_with_one_line_naming_the_worker_and_the_shard(tmp_path: Path) -> None:
    """Exit status 1; stderr's last line is `error: worker <id> failed to start: shard <path> is not a readable
    safetensors file: …`; no worker printed a traceback; no process of the launch and no segment of theirs
    is left."""
    shard = truncated_checkpoint(tmp_path / "broken")
    config = tmp_path / "broken.toml"
    config.write_text(
        TINY.read_text()
        .replace('path = ""', f"path = {json.dumps(str(shard.parent))}", 1)
        .replace("port = 8000", "port = 0", 1)
    )
    assert load_config(config).model.checkpoint == str(shard.parent)  # the file reads: the workers find the shard
    mark = secrets.token_hex(8)
    before = set(os.listdir(SHM))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cluster.py"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=LAUNCH_S,
        env={**os.environ, MARK: mark},
        check=False,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(
        rf"error: worker (prefill|decode)-\d failed to start: shard {re.escape(str(shard))} "
        r"is not a readable safetensors file: .+",
        lines[-1],
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert not marked_processes(mark)
    assert not {name for name in set(os.listdir(SHM)) - before if name.startswith("mooncake-")}


def test_a_decode_worker_checks_the_tbt_objective_the_conductor_admits_against(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's `tbt_slo_s` is `ClusterConfig.objectives().tbt_s` (made to differ from `[slo] tbt_s` here,
    as a cap like the TTFT one's would), one source for the number both sides of the decode rule check."""
    objectives = ClusterConfig.objectives
    monkeypatch.setattr(
        ClusterConfig, "objectives", lambda self: attrs.evolve(objectives(self), tbt_s=self.slo.tbt_s / 2)
    )
    config = load_config(TINY).with_overrides("cluster", port=0)
    worker = Worker(WorkerSpec(role="decode", instance_id="decode-0", config=config, secret=secrets.token_bytes(32)))
    try:
        assert worker._decode is not None
        assert worker._decode.config.tbt_slo_s == config.objectives().tbt_s == config.slo.tbt_s / 2
    finally:
        worker.close()
