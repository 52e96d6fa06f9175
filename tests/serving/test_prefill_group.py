"""A prefill instance as a chunked pipeline group (`[prefill] pipeline_size`): one instance, X processes, the
same tokens.

The engine, without a cluster: `group_prefill_engine` on a group of 2 and a single-process `PrefillEngine` fed the
same prompts (sharing prefixes, so later ones start after a cached prefix) agree on everything a prefill
returns and store the same bytes in every page (a property over random prompts); the sink hears each layer
once, in order, when its bytes are final in every page, the other stage's layers included; a stage killed
mid-prefill fails it with EngineError and leaves no pin, no reservation and a sink told to abort.

The cluster: greedy requests (fresh prompts and prompts sharing a cached prefix) served by a cluster whose
prefill instance is a group of 2 get the very tokens (ids, not only text) of the same cluster with one
process per instance; the decode instance computes them from the KV the group pushed, so every layer's KV
arrived right. A stage process killed takes its instance down (the gateway reports one prefill instance
fewer within a bounded time) and leaves no process of that instance; a group's worker killed leaves no stage.
The config key is checked like every other: an integer from 1 to the model's layers, one line naming it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from serving import wire  # noqa: E402
from serving.config import ClusterConfig, load_config  # noqa: E402
from serving.launch import RunningCluster, start_cluster  # noqa: E402
from serving.prefill_group import group_prefill_engine  # noqa: E402

from mooncake.cache.tiered import TieredCache  # noqa: E402
from mooncake.engine.pipeline import PipelineGroup  # noqa: E402
from mooncake.engine.prefill import PrefillConfig, PrefillEngine, PrefillResult  # noqa: E402
from mooncake.errors import ConfigError, EngineError  # noqa: E402
from mooncake.types import BlockKey  # noqa: E402
from tests.engine.support import (  # noqa: E402
    TINY,
    TOLERANCE,
    assert_nothing_held,
    dram_cache,
    hasher,
    layout,
    page_bytes,
    tiny_model,
)
from tests.homes import prompt_homed_on  # noqa: E402
from tests.waiting import is_running, stop_process, wait_for  # noqa: E402

TINY_TOML = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
BLOCK = 4
CHUNK = 5  # chunks that do not divide the blocks
TIMEOUT_S = 60.0


def children(pid: int) -> list[int]:
    """The running processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and is_running(int(entry.name)):
                found.append(int(entry.name))
    return found


def stages_of(pid: int) -> list[int]:
    """The pipeline stage processes a worker started (its other children are multiprocessing's helpers)."""
    stages = []
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command:
            stages.append(child)
    return stages


# ---------------------------------------------------------------------------------------------- the config


def tiny(**sections: dict[str, Any]) -> ClusterConfig:
    config = load_config(TINY_TOML).with_overrides("cluster", port=0)
    for section, values in sections.items():
        config = config.with_overrides(section, **values)
    return config


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (0, "must be >= 1"),
        (-2, "must be >= 1"),
        (3, "must be <= the 2 layers of [model] preset = 'tiny'"),
        (2000, "must be <= 1024"),
        ("2", "expected int"),
        (2.0, "expected int"),
        (True, "expected int"),
    ],
)
def test_pipeline_size_must_be_an_integer_from_one_to_the_models_layers(value: Any, reason: str) -> None:
    """A pipeline of no stage, more stages than layers, or anything but an integer is a one-line ConfigError
    naming the key and the value."""
    with pytest.raises(ConfigError) as raised:
        tiny(prefill={"pipeline_size": value})
    message = str(raised.value)
    assert f"[prefill] pipeline_size = {value!r}" in message and reason in message and "\n" not in message


def test_pipeline_size_in_a_file_and_its_default(tmp_path: Path) -> None:
    """The default is 1; a file's value is checked against its own model (the small preset has 12 layers)."""
    assert load_config(TINY_TOML).prefill.pipeline_size == 1
    assert tiny(prefill={"pipeline_size": 2}).prefill.pipeline_size == 2
    assert tiny(model={"preset": "small"}, prefill={"pipeline_size": 12}).prefill.pipeline_size == 12
    path = tmp_path / "cluster.toml"
    path.write_text('[model]\npreset = "tiny"\n[prefill]\npipeline_size = 4\n')
    with pytest.raises(ConfigError, match=r"cluster\.toml: \[prefill\] pipeline_size = 4: must be <= the 2 layers"):
        load_config(path)


# ---------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def group() -> Iterator[PipelineGroup]:
    with PipelineGroup(TINY, num_stages=2, chunk_tokens=CHUNK, threads_per_stage=1) as running:
        yield running


def pages_of(cache: TieredCache, keys: tuple[BlockKey, ...]) -> np.ndarray:
    return np.frombuffer(b"".join(page_bytes(cache, key) for key in keys), dtype=np.float32)


def assert_same_prefill(ours: PrefillResult, theirs: PrefillResult) -> None:
    assert ours.keys == theirs.keys and ours.stored_keys == theirs.stored_keys
    assert (ours.prefix_tokens, ours.computed_tokens) == (theirs.prefix_tokens, theirs.computed_tokens)
    assert ours.first_token == theirs.first_token
    assert torch.allclose(ours.logits, theirs.logits, **TOLERANCE)


@settings(max_examples=10, deadline=None)  # each example runs a few prefills across two processes
@given(
    stem=st.lists(st.integers(0, TINY.vocab_size - 1), min_size=0, max_size=14),
    tails=st.lists(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=1, max_size=9), min_size=1, max_size=3),
    layerwise=st.booleans(),
)
def test_a_group_prefills_as_one_process_does(
    group: PipelineGroup, stem: list[int], tails: list[list[int]], layerwise: bool
) -> None:
    """Prompts sharing a stem, prefilled in turn by the group and by one process, each over its own cache: the
    same prefix reuse, stored blocks, first token and logits, the same bytes in every page (every layer's KV),
    and no pin or reservation left."""
    ours_cache, theirs_cache = dram_cache(BLOCK), dram_cache(BLOCK)
    ours = group_prefill_engine(group, ours_cache, hasher(BLOCK), layerwise=layerwise)
    theirs = PrefillEngine(tiny_model(), theirs_cache, hasher(BLOCK), PrefillConfig(chunk_tokens=CHUNK))
    keys: tuple[BlockKey, ...] = ()
    try:
        for tail in tails:
            tokens = stem + tail
            mine, reference = ours.prefill(tokens), theirs.prefill(tokens)
            assert_same_prefill(mine, reference)
            keys += mine.keys
        assert np.allclose(pages_of(ours_cache, keys), pages_of(theirs_cache, keys), **TOLERANCE)
    finally:
        ours.close()
        theirs.close()
    assert_nothing_held(ours_cache, keys)


class RecordingSink:
    """Records its calls; at `layer_ready(l)` copies layer l of every block of the request from the DRAM pages."""

    def __init__(self, cache: TieredCache, num_tokens: int) -> None:
        self.cache, self.layout, self.num_tokens = cache, layout(BLOCK), num_tokens
        self.calls: list[object] = []
        self.keys: tuple[BlockKey, ...] = ()
        self.snapshots: dict[int, list[bytes]] = {}
        self.first_layer = threading.Event()

    def begin(self, keys: tuple[BlockKey, ...]) -> None:
        self.calls.append("begin")
        self.keys = keys

    def layer_ready(self, layer: int) -> None:
        self.calls.append(layer)
        self.snapshots[layer] = [self.layer_bytes(i, key, layer) for i, key in enumerate(self.keys)]
        self.first_layer.set()

    def end(self) -> None:
        self.calls.append("end")

    def abort(self) -> None:
        self.calls.append("abort")

    def layer_bytes(self, index: int, key: BlockKey, layer: int) -> bytes:
        location = self.cache.location(key)
        assert location is not None
        size = self.layout.layer_bytes(min(BLOCK, self.num_tokens - index * BLOCK))
        start = location.page * self.cache.page_bytes + layer * size
        return bytes(self.cache.pools[0].buffer[start : start + size])  # type: ignore[attr-defined]


PROMPT = [(7 * i + 3) % TINY.vocab_size for i in range(23)]


@pytest.mark.parametrize("layerwise", [True, False])
def test_the_sink_hears_each_layer_once_in_order_when_final(group: PipelineGroup, layerwise: bool) -> None:
    """begin, layer_ready(0 … L−1), end: at layer_ready(l), layer l of every block (the cached prefix's and the
    other stage's layers included) already holds its final bytes."""
    cache = dram_cache(BLOCK)
    engine = group_prefill_engine(group, cache, hasher(BLOCK), layerwise=layerwise)
    try:
        engine.prefill(PROMPT[:9])
        sink = RecordingSink(cache, len(PROMPT))
        result = engine.prefill(PROMPT, sink=sink)
    finally:
        engine.close()
    assert sink.calls == ["begin", *range(TINY.num_layers), "end"]
    assert result.prefix_tokens == 8 and sink.keys == result.keys
    for layer, snapshot in sink.snapshots.items():
        assert snapshot == [sink.layer_bytes(i, key, layer) for i, key in enumerate(result.keys)]


def test_a_stage_killed_mid_prefill_fails_it_and_leaves_nothing_held() -> None:
    """Stage 1 stopped, a prefill streaming to a sink until its first layer (stage 0's) is out, then stage 1
    killed: the prefill raises EngineError, the sink is told to abort, nothing is pinned or reserved, no new block
    is cached; later prefills raise EngineError at once and hold nothing either."""
    cache = dram_cache(BLOCK)
    with PipelineGroup(TINY, num_stages=2, chunk_tokens=CHUNK, threads_per_stage=1, timeout_s=300.0) as doomed:
        engine = group_prefill_engine(doomed, cache, hasher(BLOCK))
        prefix = engine.prefill(PROMPT[:9])
        (pid,) = doomed.pids
        stop_process(pid)
        sink = RecordingSink(cache, len(PROMPT))
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                engine.prefill(PROMPT, sink=sink)
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            assert sink.first_layer.wait(TIMEOUT_S), "stage 0's layer never became final"
        finally:
            os.kill(pid, signal.SIGKILL)
        thread.join(timeout=30.0)  # well before the group's 300 s timeout
        assert not thread.is_alive() and isinstance(outcome[0], EngineError)
        assert sink.calls == ["begin", 0, "abort"]
        with pytest.raises(EngineError):
            engine.prefill([*PROMPT[:9], 1, 2, 3])
        engine.close()
    keys = hasher(BLOCK).block_keys(PROMPT)
    assert all(key in cache for key in prefix.keys[:2]) and not any(key in cache for key in keys[2:])
    assert_nothing_held(cache, keys + prefix.keys)


# ---------------------------------------------------------------------------------------------- the cluster


def cluster_config(pipeline_size: int, **limits: Any) -> ClusterConfig:
    """1 prefill + 1 decode on any free port, chunks of 8 tokens (a prompt crosses the pipeline in several)."""
    return tiny(
        cluster={"num_prefill": 1, "num_decode": 1},
        prefill={"pipeline_size": pipeline_size, "chunk_tokens": 8},
        limits={"max_prompt_tokens": 256, **limits},
    )


def client(cluster: RunningCluster) -> Any:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


STEM = "Chunked pipeline parallelism splits the layers of one prefill across processes. "


def serve(config: ClusterConfig) -> list[tuple[list[int], int]]:
    """Greedy requests in turn, each a fresh prompt then one sharing its prefix: (token ids, cached tokens) each."""
    answers = []
    with start_cluster(config) as cluster:
        pid = cluster.gateway.dispatcher.health("prefill-0").pid
        assert len(stages_of(pid)) == config.prefill.pipeline_size - 1
        dispatcher = cluster.gateway.dispatcher
        heard: list[wire.Token] = []
        passed_on = dispatcher._on_tokens

        def tap(report: wire.DecodeTokens) -> None:  # observes the decode engine's tokens, then hands them on
            heard.extend(report.tokens)
            passed_on(report)

        dispatcher._on_tokens = tap  # type: ignore[method-assign]
        api = client(cluster)
        for i in range(3):
            for prompt in (f"{i}: {STEM}", f"{i}: {STEM}and a question sharing its prefix?"):
                answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
                assert answer.usage.completion_tokens == 10
                tokens = [t.token for t in sorted(heard, key=lambda t: t.index)]
                heard.clear()
                answers.append((tokens, answer.usage.prompt_tokens_details.cached_tokens))
    return answers


def test_a_group_of_two_serves_the_tokens_of_one_process() -> None:
    """The same greedy requests through a cluster whose prefill instance is a group of 2 and through one whose
    instance is a single process: the same token ids and the same cached prefixes (the later prompts do reuse
    one), so the KV the group pushed to the decode instance was right in every layer."""
    single = serve(cluster_config(1))
    grouped = serve(cluster_config(2))
    assert all(len(tokens) == 10 for tokens, _ in single)
    assert [cached for _, cached in single][1::2] == [cached for _, cached in grouped][1::2]
    assert all(cached > 0 for _, cached in single[1::2])
    assert grouped == single


def health(cluster: RunningCluster) -> dict[str, Any]:
    request = urllib.request.Request(f"{cluster.url}/health")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return json.loads(answer.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        with error:
            return json.loads(error.read())  # type: ignore[no-any-return]


def prefilling_on(cluster: RunningCluster, instance: str) -> bool:
    """Whether a live request's prefill has started on `instance` (the gateway's state, read from this thread)."""
    try:
        lives = list(cluster.gateway.dispatcher.live.values())
    except RuntimeError:  # changed while copied: ask again
        return False
    return any(live.prefill == instance and live.prefill_started_s is not None for live in lives)


def test_a_dead_stage_takes_its_instance_down_and_no_process_is_left() -> None:
    """Two prefill groups of 2. A request's prefill waits on prefill-0's stopped stage, which is then SIGKILLed:
    the gateway counts one prefill instance fewer within a bounded time, the request is scheduled again and
    answered (as for a killed worker), prefill-0's worker and stage are gone, and prefill-1 still serves.
    SIGKILL prefill-1's worker: its stage exits too."""
    # Probes every 2 s: the dead group's worker must not report its request failed (a 500) before a probe finds
    # the instance down and schedules the request again.
    config = cluster_config(2, health_interval_s=2.0, health_probe_backoff_max_s=2.0).with_overrides(
        "cluster", num_prefill=2
    )
    with start_cluster(config) as cluster:
        dispatcher = cluster.gateway.dispatcher
        workers = {name: dispatcher.health(name).pid for name in ("prefill-0", "prefill-1")}
        stages = {name: stages_of(pid) for name, pid in workers.items()}
        assert all(len(found) == 1 for found in stages.values()), stages
        helpers = children(workers["prefill-0"])  # its stage and multiprocessing's own
        assert health(cluster)["prefill_up"] == 2
        doomed = stages["prefill-0"][0]
        stop_process(doomed)
        answers: list[Any] = []
        prompt = prompt_homed_on(cluster, "prefill-0", "Caught mid-way.")

        def ask() -> None:
            try:
                answers.append(client(cluster).completions.create(model="tiny", prompt=prompt, max_tokens=4))
            except Exception as error:
                answers.append(error)

        asking = threading.Thread(target=ask)
        asking.start()
        try:  # idle engines and no cached prefix: the tie goes to the prompt's home, prefill-0
            wait_for(lambda: prefilling_on(cluster, "prefill-0"), timeout=30.0, what="a prefill on prefill-0")
        finally:
            os.kill(doomed, signal.SIGKILL)
        wait_for(lambda: health(cluster)["prefill_up"] == 1, timeout=30.0, what="prefill-0 to be reported down")
        asking.join(timeout=TIMEOUT_S)
        assert not asking.is_alive() and answers[0].usage.completion_tokens == 4, answers
        wait_for(
            lambda: not any(map(is_running, [workers["prefill-0"], *helpers])),
            timeout=30.0,
            what="prefill-0's processes to exit",
        )
        answer = client(cluster).completions.create(model="tiny", prompt="Still served?", max_tokens=4)
        assert answer.usage.completion_tokens == 4
        cluster.backend.kill("prefill-1")
        wait_for(lambda: not is_running(stages["prefill-1"][0]), timeout=30.0, what="prefill-1's orphan stage to exit")
        wait_for(lambda: health(cluster)["prefill_up"] == 0, timeout=30.0, what="prefill-1 to be reported down")
