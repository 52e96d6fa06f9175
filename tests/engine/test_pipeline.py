"""Chunked pipeline parallelism: X stage processes give one process's logits and KV; stages split layers evenly.

Properties: the stages partition the layers; a group of 2 (this process and one stage process) prefilling
after any cached prefix gives the logits and every layer's KV of a single process's forward pass, and reports
each layer's rows once each, in order, when they are final (stage 0's chunk by chunk, the other stage's when
its KV arrives). Examples: one stage runs in this process alone; a listener's error waits for the prefill's
end and leaves the group usable; bad arguments (malformed `kv`, callbacks that cannot be called included) are
refused by name before any stage is asked, the group unharmed; the group's sockets listen on loopback only, and
its stages hold no named semaphore. Failures: a stage killed while the driver waits on it fails the prefill at
once, not at the timeout, and fails the group (`on_failure` called once, every stage ended); a stage that stops
answering fails it at the timeout; a stage whose driver process is SIGKILLed exits by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import attrs  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mooncake.engine.attention import prefill_attention_into  # noqa: E402
from mooncake.engine.config import PRESETS  # noqa: E402
from mooncake.engine.model import LlamaModel  # noqa: E402
from mooncake.engine.pipeline import PARENT_WATCH_S, PipelineGroup, stage_layers  # noqa: E402
from mooncake.errors import Cancelled, ConfigError, EngineError, InvalidRequestError  # noqa: E402
from tests.engine.support import CancelAfter  # noqa: E402
from tests.waiting import is_running, stop_process, wait_for  # noqa: E402

TINY = PRESETS["tiny"]
ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
SEED = 5
CHUNK = 3  # small, so prompts of a few tokens already take several chunks through the pipeline

KV = list[tuple["torch.Tensor", "torch.Tensor"]]


def reference(tokens: list[int], model: LlamaModel | None = None) -> tuple[torch.Tensor, KV]:
    """The whole model (default: the groups' seed) in this process, one chunk: the last logits and every layer's
    K and V."""
    model = model or whole_model()
    n = len(tokens)
    shape = (n, TINY.num_kv_heads, TINY.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(TINY.num_layers)]
    with torch.inference_mode():
        cos, sin = model.rope(torch.arange(n))
        x = model.embed(torch.tensor(tokens))
        for layer, (k, v) in zip(model.layers, kv, strict=True):
            x = layer(x, cos, sin, prefill_attention_into(k, v, 0, n))
        return model.logits(x[-1:])[0], kv


_WHOLE: dict[int, LlamaModel] = {}


def whole_model() -> LlamaModel:
    if SEED not in _WHOLE:
        _WHOLE[SEED] = LlamaModel(TINY, seed=SEED)
    return _WHOLE[SEED]


def with_prefix(full: KV, n: int, prefix: int) -> KV:
    """Buffers for a prompt of n tokens whose first `prefix` rows hold `full`'s, the rest garbage."""
    out = []
    for k, v in full:
        k_new, v_new = torch.full((n, *k.shape[1:]), float("nan")), torch.full((n, *v.shape[1:]), float("nan"))
        k_new[:prefix], v_new[:prefix] = k[:prefix], v[:prefix]
        out.append((k_new, v_new))
    return out


@pytest.fixture(scope="module")
def group() -> Iterator[PipelineGroup]:
    """Two stages (this process and one more), tiny chunks; shared by the tests that leave it working."""
    with PipelineGroup(TINY, num_stages=2, chunk_tokens=CHUNK, seed=SEED, threads_per_stage=1) as running:
        yield running
    assert all(not p.is_alive() for p in running._processes)


@given(num_layers=st.integers(1, 100), data=st.data())
def test_stages_partition_the_layers_evenly(num_layers: int, data: st.DataObject) -> None:
    """The stages' layer ranges are contiguous, cover every layer once, and differ in size by at most one."""
    num_stages = data.draw(st.integers(1, num_layers))
    ranges = [stage_layers(num_layers, num_stages, s) for s in range(num_stages)]
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_two_stage_pipeline_equals_one_process(group: PipelineGroup) -> None:
    """CPP with X = 2 processes (gloo) gives the logits of a single-process forward pass, chunked or not."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=generator).tolist() for n in (1, 37, 100)]
    with torch.inference_mode():
        expected = [whole_model()(torch.tensor(p))[-1] for p in prompts]
    for prompt, wanted in zip(prompts, expected, strict=True):
        logits = group.prefill(prompt)
        assert torch.allclose(logits, wanted, **TOLERANCE)
        assert int(logits.argmax()) == int(wanted.argmax())
    with pytest.raises(InvalidRequestError):
        group.prefill([TINY.vocab_size])
    assert torch.allclose(group.prefill(prompts[1]), expected[1], **TOLERANCE)  # still serving
    group.check_invariants()


@settings(max_examples=20, deadline=None)  # each example is a prefill across two processes
@given(
    tokens=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=20),
    data=st.data(),
)
def test_after_any_cached_prefix_logits_and_every_layers_kv_equal_one_process(
    group: PipelineGroup, tokens: list[int], data: st.DataObject
) -> None:
    """Given rows [0, p) of every layer's KV, the group computes rows [p, n) of every layer (both stages') as a
    single process does, and the same last logits; `on_rows` hears each layer's rows once, in order, covering
    [p, n) exactly, each when its rows are final (stage 0's per chunk, stage 1's all at once)."""
    n = len(tokens)
    prefix = data.draw(st.integers(0, n - 1), label="prefix")
    wanted_logits, wanted_kv = reference(tokens)
    kv = with_prefix(wanted_kv, n, prefix)
    heard: dict[int, list[tuple[int, int]]] = {layer: [] for layer in range(TINY.num_layers)}
    snapshots: list[tuple[int, int, int, torch.Tensor]] = []

    def on_rows(layer: int, start: int, end: int) -> None:
        heard[layer].append((start, end))
        snapshots.append((layer, start, end, kv[layer][0][start:end].clone()))

    logits = group.prefill(tokens, kv=kv, prefix_tokens=prefix, on_rows=on_rows)
    assert torch.allclose(logits, wanted_logits, **TOLERANCE)
    for (k, v), (k_wanted, v_wanted) in zip(kv, wanted_kv, strict=True):
        assert torch.allclose(k, k_wanted, **TOLERANCE) and torch.allclose(v, v_wanted, **TOLERANCE)
    chunked = [(s, min(n, s + CHUNK)) for s in range(prefix, n, CHUNK)]
    for layer in stage_layers(TINY.num_layers, 2, 0):
        assert heard[layer] == chunked
    for layer in stage_layers(TINY.num_layers, 2, 1):
        assert heard[layer] == [(prefix, n)]
    for layer, start, end, rows in snapshots:
        assert torch.equal(rows, kv[layer][0][start:end])  # final when heard


def test_one_stage_is_this_process_alone() -> None:
    """X = 1 starts no process and gives the same logits and KV, after a prefix too."""
    tokens = [(11 * i + 2) % TINY.vocab_size for i in range(10)]
    wanted_logits, wanted_kv = reference(tokens)
    with PipelineGroup(TINY, num_stages=1, chunk_tokens=CHUNK, seed=SEED) as single:
        assert single._processes == [] and single.pids == ()
        kv = with_prefix(wanted_kv, len(tokens), 4)
        logits = single.prefill(tokens, kv=kv, prefix_tokens=4)
        single.check_invariants()
    assert torch.allclose(logits, wanted_logits, **TOLERANCE)
    assert all(torch.allclose(k, kw, **TOLERANCE) for (k, _), (kw, _) in zip(kv, wanted_kv, strict=True))


def test_a_listeners_error_comes_after_the_prefill_and_the_group_stays_usable(group: PipelineGroup) -> None:
    """An `on_rows` that raises is not called again; its error is raised once the stages are done, and the next
    prefill is right (the links are still in step)."""
    tokens = [(3 * i + 1) % TINY.vocab_size for i in range(12)]
    calls: list[int] = []

    def failing(layer: int, _start: int, _end: int) -> None:
        calls.append(layer)
        raise ConnectionError("the listener went away")

    with pytest.raises(ConnectionError):
        group.prefill(tokens, kv=with_prefix(reference(tokens)[1], 12, 0), on_rows=failing)
    assert calls == [0]
    assert torch.allclose(group.prefill(tokens), reference(tokens)[0], **TOLERANCE)
    assert group.failure is None


@pytest.mark.parametrize("stages", [2, 3])
def test_a_cancel_stops_every_stage_at_the_same_chunk_and_the_group_goes_on(stages: int) -> None:
    """Stage 0 asks the flag before each of the 4 chunks of a 12-token prompt and the go flag travels ahead of the
    chunk, through a middle stage too: cancelled before chunk k, `Cancelled` says 3(k - 1) tokens were done, stage
    0 reported only the rows of the chunks before, no stage sends KV or logits back, and the next prefills give a
    single process's logits (every link still in step); a flag still False after the last chunk changes nothing."""
    config = attrs.evolve(TINY, num_layers=stages)
    model = LlamaModel(config, seed=SEED)
    tokens = [(5 * i + 3) % TINY.vocab_size for i in range(12)]
    with torch.inference_mode():
        wanted = model(torch.tensor(tokens))[-1]
    with PipelineGroup(config, num_stages=stages, chunk_tokens=CHUNK, seed=SEED, threads_per_stage=1) as running:
        rows: list[tuple[int, int, int]] = []
        for asks in (1, 2, 4, 5):
            rows.clear()
            flag = CancelAfter(asks)
            if asks <= 4:
                with pytest.raises(Cancelled, match=f"with {3 * (asks - 1)} of its 12 prompt tokens"):
                    running.prefill(tokens, on_rows=lambda *row: rows.append(row), cancelled=flag)
                assert flag.read == asks and rows == [(0, s, s + 3) for s in range(0, 3 * (asks - 1), 3)]
            else:
                logits = running.prefill(tokens, cancelled=flag)
                assert flag.read == 4 and torch.allclose(logits, wanted, **TOLERANCE)
            assert torch.allclose(running.prefill(tokens), wanted, **TOLERANCE)

        # A caller's flag that breaks at its second reading: its error, once every stage has stopped (the links
        # stay in step), whatever its type; a RuntimeError is no failed link.
        for kind in (KeyError, RuntimeError):
            readings = iter((False, kind("the flag's table is gone")))

            def failing(readings: Iterator[object] = readings) -> bool:
                reading = next(readings)
                if isinstance(reading, Exception):
                    raise reading
                return bool(reading)

            with pytest.raises(kind, match="table is gone"):
                running.prefill(tokens, cancelled=failing)
            assert running.failure is None
            assert torch.allclose(running.prefill(tokens), wanted, **TOLERANCE)
        running.check_invariants()


def test_bad_arguments_are_refused_before_any_stage_is_asked(group: PipelineGroup) -> None:
    """No tokens, a prefix not shorter than the prompt, a prefix without its KV, or buffers of the wrong number,
    shape or dtype are InvalidRequestErrors; the group then serves as before."""
    tokens = [1, 2, 3, 4]
    good = with_prefix(reference(tokens)[1], 4, 0)
    bad = [
        {"tokens": []},
        {"tokens": tokens, "kv": good, "prefix_tokens": 4},
        {"tokens": tokens, "prefix_tokens": 2},
        {"tokens": tokens, "kv": good[:1]},
        {"tokens": tokens, "kv": with_prefix(reference([1, 2, 3])[1], 3, 0)},
        {"tokens": tokens, "kv": [(k.double(), v.double()) for k, v in good]},
        {"tokens": [-1]},
    ]
    for arguments in bad:
        with pytest.raises(InvalidRequestError):
            group.prefill(**arguments)  # type: ignore[arg-type]
    assert torch.allclose(group.prefill(tokens), reference(tokens)[0], **TOLERANCE)


def test_malformed_kv_and_callbacks_are_refused_by_name_and_the_group_goes_on(group: PipelineGroup) -> None:
    """`kv` that is no sequence of (K, V) pairs (a number, a generator, triples, singletons, a pair holding no
    tensor) and an `on_rows` or `cancelled` that cannot be called are InvalidRequestErrors naming the argument,
    raised before any stage hears of the job: the group has not failed and serves as before (a triple once
    reached stage 0's unpacking mid-job and failed the group, killing its stages)."""
    tokens = [1, 2, 3, 4]
    good = with_prefix(reference(tokens)[1], 4, 0)
    bad: list[tuple[dict[str, object], str]] = [
        ({"kv": 5}, "kv must"),
        ({"kv": (pair for pair in good)}, "kv must"),
        ({"kv": [(k, v, v) for k, v in good]}, "kv must"),
        ({"kv": [(k,) for k, _ in good]}, "kv must"),
        ({"kv": [(k, v.numpy()) for k, v in good]}, "kv must"),
        ({"kv": [5] * len(good)}, "kv must"),
        ({"on_rows": 5}, "on_rows must be callable or None, got 5"),
        ({"cancelled": "yes"}, "cancelled must be callable or None, got 'yes'"),
    ]
    for arguments, named in bad:
        with pytest.raises(InvalidRequestError, match=named):
            group.prefill(tokens, **arguments)  # type: ignore[arg-type]
        assert group.failure is None
    assert torch.allclose(group.prefill(tokens), reference(tokens)[0], **TOLERANCE)
    group.check_invariants()


def listening_inodes() -> dict[int, str]:
    """Listening TCP sockets of this machine: inode → local address (hex, as /proc/net shows it)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[int(fields[9])] = fields[1].split(":")[0]
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net to list listening sockets")
def test_the_group_listens_on_loopback_only(group: PipelineGroup) -> None:
    """The rendezvous store and the links of the driver and its stage listen on 127.0.0.1, never on all
    interfaces (torch's store would by itself)."""
    listening = listening_inodes()
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    for pid in (os.getpid(), *group.pids):
        for inode in socket_inodes(pid) & set(listening):
            assert listening[inode] in loopback, f"process {pid} listens on {listening[inode]}"
    assert socket_inodes(group.pids[0]) & set(listening), "the stage should listen for its links"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc to list a process's mappings")
def test_a_stage_maps_no_named_semaphore(group: PipelineGroup) -> None:
    """The driver talks to its stages over pipes, not multiprocessing queues, whose named semaphores in /dev/shm
    outlive a process that is killed (a Ray actor's, say)."""
    for pid in group.pids:
        assert "/dev/shm/sem." not in Path(f"/proc/{pid}/maps").read_text()


def test_a_stage_killed_while_the_driver_waits_fails_the_prefill_at_once_and_the_group() -> None:
    """A stage stopped, a prefill waiting on it, then the stage SIGKILLed: the prefill raises EngineError long
    before the group's timeout, `on_failure` is called once with the group's failure, the group stays failed,
    and no stage process is left."""
    exits: list[str] = []
    tokens = list(range(40))
    with PipelineGroup(
        TINY, num_stages=2, chunk_tokens=CHUNK, seed=SEED, threads_per_stage=1, timeout_s=300.0, on_failure=exits.append
    ) as doomed:
        (pid,) = doomed.pids
        stop_process(pid)
        mine_done = threading.Event()
        outcome: list[BaseException | None] = []

        def on_rows(layer: int, _start: int, end: int) -> None:
            if layer == 0 and end == len(tokens):
                mine_done.set()  # stage 0 is through: the driver now waits on the stopped stage

        def run() -> None:
            try:
                doomed.prefill(tokens, kv=with_prefix(reference(tokens)[1], len(tokens), 0), on_rows=on_rows)
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(mine_done.is_set, timeout=60.0, what="stage 0 to finish its layers")
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=30.0)  # the timeout is 300 s: returning within 30 proves it did not wait for it
        assert not thread.is_alive(), "the prefill still waits on a dead stage"
        assert isinstance(outcome[0], EngineError)
        wait_for(lambda: bool(exits), timeout=10.0, what="on_failure")
        assert exits == [doomed.failure] and doomed.failure is not None
        with pytest.raises(EngineError, match="failed"):
            doomed.prefill(tokens)
        doomed.check_invariants()
    assert not is_running(pid)


class Interrupt(BaseException):
    """What a KeyboardInterrupt is to the driver: no Exception, raised from the middle of its own work."""


def test_stage_0_failing_mid_job_fails_the_group_at_once() -> None:
    """Stage 0's own work raises mid-job (here the caller's listener, with an interrupt no listener error is
    held back for): the other stage is left waiting for chunks that never come, so the group fails at once (its
    error raised, `failure` set, the stage ended) rather than sending the next prefill down links out of step,
    where it would wait out the timeout."""
    tokens = list(range(12))
    exits: list[str] = []
    with PipelineGroup(
        TINY, num_stages=2, chunk_tokens=CHUNK, seed=SEED, threads_per_stage=1, timeout_s=60.0, on_failure=exits.append
    ) as broken:
        (pid,) = broken.pids

        def interrupted(layer: int, start: int, _end: int) -> None:
            if start == CHUNK:  # the second chunk: the stage has the first and waits for more
                raise Interrupt

        with pytest.raises(Interrupt):
            broken.prefill(tokens, on_rows=interrupted)
        assert broken.failure is not None and "stage 0 failed mid-job" in broken.failure
        with pytest.raises(EngineError, match="has failed"):
            broken.prefill(tokens)
        wait_for(lambda: not is_running(pid), timeout=10.0, what="the stage to be ended")
        wait_for(lambda: bool(exits), timeout=10.0, what="on_failure")
        broken.check_invariants()


def test_a_stage_that_stops_answering_fails_the_prefill_at_the_timeout() -> None:
    """SIGSTOP a stage: the prefill raises EngineError once a transfer has waited `timeout_s`, the group has
    failed, its stages are ended (the stopped one too) and `on_failure` hears of it."""
    failures: list[str] = []
    with PipelineGroup(
        TINY,
        num_stages=2,
        chunk_tokens=CHUNK,
        seed=SEED,
        threads_per_stage=1,
        timeout_s=2.0,
        on_failure=failures.append,
    ) as stuck:
        (pid,) = stuck.pids
        stop_process(pid)
        try:
            with pytest.raises(EngineError, match="failed"):
                stuck.prefill(list(range(10)))
        finally:
            if is_running(pid):
                os.kill(pid, signal.SIGCONT)
        assert stuck.failure is not None and "timed out" in stuck.failure.lower()
        wait_for(lambda: bool(failures), timeout=10.0, what="on_failure")
        assert failures == [stuck.failure]
    wait_for(lambda: not is_running(pid), timeout=10.0, what="the stopped stage to end")


DRIVER = """
import sys, time
from mooncake.engine.config import PRESETS
from mooncake.engine.pipeline import PipelineGroup
if __name__ == "__main__":
    group = PipelineGroup(PRESETS["tiny"], num_stages=2, chunk_tokens=4, threads_per_stage=1)
    group.prefill([1, 2, 3])
    print(*group.pids, flush=True)
    time.sleep(120)
"""


def test_a_stage_exits_when_its_driver_process_is_killed(tmp_path: Path) -> None:
    """SIGKILL the driver's process (no close, no exit handler): its idle stage notices within a few watch
    periods and exits."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline().decode()  # bounded: the driver prints or dies within its start
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 1 and is_running(pids[0]), line
        driver.kill()
        driver.wait(timeout=10)
        wait_for(lambda: not any(map(is_running, pids)), timeout=10.0 + 10 * PARENT_WATCH_S, what="the orphan stage")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)


def test_pipeline_options_are_checked() -> None:
    """More stages than layers, a device other than cpu/cuda, or a timeout that is not positive is a
    ConfigError naming the field."""
    with pytest.raises(ConfigError, match="num_stages"):
        PipelineGroup(TINY, num_stages=3)
    with pytest.raises(ConfigError, match="device"):
        PipelineGroup(TINY, num_stages=1, device="tpu")
    with pytest.raises(ConfigError, match="timeout_s"):
        PipelineGroup(TINY, num_stages=1, timeout_s=0.0)
    with pytest.raises(ConfigError, match="start_timeout_s"):
        PipelineGroup(TINY, num_stages=1, start_timeout_s=-1.0)
