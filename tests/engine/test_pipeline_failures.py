"""Chunked pipeline groups: a failure names its cause; bad arguments are refused before any stage starts.

Examples: a stage that fails or exits while the stages connect fails the group's construction at once (long
before the transfer timeout) with an EngineError naming the stage and its error, and leaves no stage process;
a stage SIGKILLed mid-prefill is named by the prefill's error and by `on_failure`, not the stage downstream
whose link to it broke; a SIGSTOPped stage is named, not whoever timed out waiting on it; stage 0 stalling
past the timeout is named by the report of the stage that timed out waiting on it ("stage 1 timed out
receiving from stage 0"); a closed group refuses a prefill as closed, recording no failure. Arguments: `threads_per_stage` that is no positive integer, `device="cuda"` without
the GPUs, and `stage_layers` outside its ranges are ConfigErrors naming the field and value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import attrs  # noqa: E402

from mooncake.engine.config import PRESETS  # noqa: E402
from mooncake.engine.pipeline import PipelineGroup, stage_layers  # noqa: E402
from mooncake.errors import ConfigError, EngineError  # noqa: E402
from tests.waiting import is_running, stop_process, wait_for  # noqa: E402

TINY = PRESETS["tiny"]
FIVE = attrs.evolve(TINY, num_layers=5, name="tiny-5")  # three stages of 2, 2 and 1 layers
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 40.0  # the transfer timeout of the groups that fail while connecting: failing at once is far less

# A driver whose stage processes fail at the rendezvous (their own TCPStore), after building their layers. The
# stage re-imports this script as __mp_main__ (spawn), so the failure is injected there only.
CONNECT_DRIVER = """
import json, multiprocessing, sys, time
from mooncake.engine.config import PRESETS
from mooncake.engine.pipeline import PipelineGroup

if __name__ == "__mp_main__":
    import os
    import torch.distributed as dist

    def unreachable(*_args, **_kwargs):
        if {exits}:
            os._exit(3)
        raise OSError("injected: cannot reach the store")

    dist.TCPStore = unreachable

if __name__ == "__main__":
    start = time.monotonic()
    try:
        PipelineGroup(PRESETS["tiny"], num_stages=2, chunk_tokens=4, threads_per_stage=1, timeout_s={timeout_s},
                      start_timeout_s={timeout_s})
        outcome = {{"error": None, "message": ""}}
    except BaseException as error:
        outcome = {{"error": type(error).__name__, "message": str(error)}}
    outcome["elapsed_s"] = time.monotonic() - start
    outcome["children"] = len(multiprocessing.active_children())
    print(json.dumps(outcome), flush=True)
"""


@pytest.mark.parametrize(
    ("exits", "named"),
    [
        (False, ["stage 1 failed to start", "injected: cannot reach the store"]),
        (True, ["cpp-stage-1", "exited with code 3"]),
    ],
)
def test_a_stage_failing_while_the_stages_connect_fails_the_group_at_once(
    tmp_path: Path, exits: bool, named: list[str]
) -> None:
    """A stage that raises (or exits) at the rendezvous, after it has built its layers: the construction raises
    EngineError naming the stage and its error well before the transfer timeout (the driver's own rendezvous
    would wait that long for the dead stage, then raise torch's DistStoreError), and no stage is left."""
    script = tmp_path / "driver.py"
    script.write_text(CONNECT_DRIVER.format(exits=exits, timeout_s=TIMEOUT_S))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3 * TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["error"] == "EngineError", outcome
    for words in named:
        assert words in outcome["message"], outcome
    assert outcome["elapsed_s"] < TIMEOUT_S / 2, outcome
    assert outcome["children"] == 0, outcome


def prefill_outcome(group: PipelineGroup, tokens: list[int], **options: Any) -> BaseException | None:
    try:
        group.prefill(tokens, **options)
    except BaseException as error:
        return error
    return None


@pytest.mark.parametrize("at_chunk", [5, 19])
def test_a_stage_killed_mid_prefill_is_named_not_the_stage_that_lost_its_link(at_chunk: int) -> None:
    """Three stages, stage 1 SIGKILLed as chunks flow: stage 2's link to it breaks and stage 2 reports that, and
    stage 0's does too, but the prefill's error, the group's failure and `on_failure` all name stage 1's
    process and its signal."""
    failures: list[str] = []
    tokens = list(range(40))
    with PipelineGroup(
        FIVE, num_stages=3, chunk_tokens=2, seed=1, threads_per_stage=1, timeout_s=60.0, on_failure=failures.append
    ) as group:
        pids = group.pids
        killed: list[int] = []

        def on_rows(layer: int, start: int, _end: int) -> None:
            if layer == 0 and start == 2 * at_chunk and not killed:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            if layer == 0:
                time.sleep(0.02)  # pacing, not synchronisation: the other stages are mid-chunk when the kill lands

        error = prefill_outcome(group, tokens, on_rows=on_rows)
        assert isinstance(error, EngineError), error
        assert f"cpp-stage-1 (pid {pids[0]}) exited with code -9" in str(error)
        wait_for(lambda: bool(failures), timeout=10.0, what="on_failure")
        assert failures == [group.failure]
        assert "cpp-stage-1" in failures[0] and "-9" in failures[0]
    assert not any(map(is_running, pids))


@pytest.mark.parametrize("num_stages", [1, 2])
def test_a_closed_group_refuses_a_prefill_as_closed_not_as_a_failure(num_stages: int) -> None:
    """After `close` a prefill is an EngineError saying the group is closed (as a closed prefill engine says),
    and the group records no failure and calls no `on_failure`. With stages it was the closed job pipe's OSError,
    taken for a failed transfer (the group's `failure`, blaming a transfer); with one stage it ran."""
    failures: list[str] = []
    group = PipelineGroup(
        TINY, num_stages=num_stages, chunk_tokens=3, threads_per_stage=1, timeout_s=10.0, on_failure=failures.append
    )
    try:
        assert group.prefill([1, 2, 3, 4, 5]).shape == (TINY.vocab_size,)
    finally:
        group.close()
    with pytest.raises(EngineError, match=r"^the pipeline group is closed$"):
        group.prefill([1, 2, 3])
    assert group.failure is None and failures == []


@pytest.mark.parametrize("stopped", [1, 2])
def test_a_stopped_stage_is_named_not_whoever_timed_out_waiting_on_it(stopped: int) -> None:
    """Three stages, one SIGSTOPped: the stage or driver waiting on it times out and fails the group, whose
    failure (the prefill's error and `on_failure`) names the stopped stage."""
    failures: list[str] = []
    with PipelineGroup(
        FIVE, num_stages=3, chunk_tokens=2, threads_per_stage=1, timeout_s=2.0, on_failure=failures.append
    ) as group:
        pids = group.pids
        stop_process(pids[stopped - 1])
        try:
            error = prefill_outcome(group, list(range(30)))
        finally:
            if is_running(pids[stopped - 1]):
                os.kill(pids[stopped - 1], signal.SIGCONT)
        assert isinstance(error, EngineError), error
        assert f"stage {stopped} stopped answering" in str(error)
        wait_for(lambda: bool(failures), timeout=10.0, what="on_failure")
        assert failures == [group.failure]
        assert failures[0].startswith(f"stage {stopped} stopped answering")
        assert "timed out" in failures[0]
    wait_for(lambda: not any(map(is_running, pids)), timeout=10.0, what="the stages to end")


def test_stage_0_stalling_past_the_timeout_is_named_by_the_stage_waiting_on_it() -> None:
    """Stage 0's own work (here its listener) stalls longer than the timeout: stage 1 times out receiving from
    it, reports so and exits. The group's failure names stage 0 as the stage that stopped answering, from
    stage 1's report, rather than stage 1's exit; the stalled prefill then raises it."""
    failures: list[str] = []
    heard = threading.Event()

    def on_failure(reason: str) -> None:
        failures.append(reason)
        heard.set()

    with PipelineGroup(
        TINY, num_stages=2, chunk_tokens=2, threads_per_stage=1, timeout_s=2.0, on_failure=on_failure
    ) as group:
        (pid,) = group.pids

        def on_rows(_layer: int, start: int, _end: int) -> None:
            if start == 4:
                heard.wait(timeout=60.0)  # stalled until the group has failed (bounded)

        error = prefill_outcome(group, list(range(12)), on_rows=on_rows)
        assert heard.is_set(), "the group never failed"
        assert failures == [group.failure]
        assert failures[0].startswith("stage 0 stopped answering: stage 1 timed out receiving from stage 0")
        assert isinstance(error, EngineError) and failures[0] in str(error)
    assert not is_running(pid)


@pytest.mark.parametrize("threads", [-1, 0, 1.5, True, "2"])
def test_threads_per_stage_that_is_no_positive_integer_is_refused_before_any_stage_starts(threads: object) -> None:
    """`threads_per_stage` is a count of torch threads: a ConfigError naming it and the value, raised before a
    stage process is spawned (it was an EngineError naming neither, from the stage, or 0 silently replaced)."""
    with pytest.raises(ConfigError, match=rf"threads_per_stage.*{threads!r}"):
        PipelineGroup(TINY, num_stages=2, threads_per_stage=threads, start_timeout_s=30.0).close()  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error_naming_the_device() -> None:
    """`device="cuda"` puts stage s on GPU s: without them it is a ConfigError naming the device, not torch's
    RuntimeError from building the weights."""
    with pytest.raises(ConfigError, match="device='cuda'"):
        PipelineGroup(TINY, num_stages=1, device="cuda").close()


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "stage", "field"),
    [
        (2, 3, 2, "num_stages"),  # more stages than layers: was an empty range
        (5, 2, 5, "stage"),  # no such stage: was a range past the layers
        (5, 2, -1, "stage"),
        (5, 0, 0, "num_stages"),  # was a ZeroDivisionError
        (0, 1, 0, "num_layers"),
        (5, 2.0, 0, "num_stages"),
    ],
)
def test_stage_layers_outside_their_ranges_are_config_errors(
    num_layers: int, num_stages: int, stage: int, field: str
) -> None:
    """A stage holds at least one layer and exists: anything else is a ConfigError naming the field and value."""
    value = {"num_layers": num_layers, "num_stages": num_stages, "stage": stage}[field]
    with pytest.raises(ConfigError, match=rf"{field} must be .*got {value!r}"):
        stage_layers(num_layers, num_stages, stage)
