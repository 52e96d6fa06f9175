"""A worker's SSD pool file: labelled with what its pages mean, and named for that label.

The pool's label is the block keys' namespace (model, weights, dtype), the block size and the KV page layout
(`serving.worker.ssd_label`), and the file in `[cache] ssd_dir` is `<instance>-<xxh3 of the label>.pool`
(`ssd_file_name`). So a cluster restarted over the same folder with another dtype, seed or block size starts on a
file of its own, sharing no page with the first (before, both opened `<instance>.pool`: another page size failed to
start, the same one adopted the other's pages), and a restart with the first config finds its pages again. The
label in the file stays the guard (`SsdPagePool` refuses a file of another label: tests/cache/test_ssd.py).

Real workers of the tiny config, in-process, over a temporary folder; each is closed at the end.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.config import ClusterConfig, load_config
from serving.worker import Worker, WorkerSpec, ssd_file_name, ssd_label

from mooncake.cache.ssd import SsdPagePool
from mooncake.types import BlockKey

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
KEY = BlockKey(12345)


def tiny(ssd_dir: Path, **model: Any) -> ClusterConfig:
    """The tiny config with an SSD tier of 8 blocks in `ssd_dir`, some `[model]` keys replaced."""
    config = load_config(TINY).with_overrides("cache", ssd_blocks=8, ssd_dir=str(ssd_dir))
    return config.with_overrides("model", **model) if model else config


@contextlib.contextmanager
def worker(config: ClusterConfig) -> Iterator[Worker]:
    started = Worker(WorkerSpec(role="prefill", instance_id="prefill-0", config=config, secret=secrets.token_bytes(32)))
    try:
        yield started
    finally:
        started.close()


def ssd_pool(node: Worker) -> SsdPagePool:
    [pool] = [p for p in node.cache.pools if isinstance(p, SsdPagePool)]
    return pool


@pytest.mark.parametrize(("field", "value"), [("dtype", "bfloat16"), ("seed", 1), ("block_tokens", 8)])
def test_configs_differing_in_what_a_page_means_keep_files_of_their_own(tmp_path: Path, field: str, value: Any) -> None:
    """A worker of the tiny config writes a page to its SSD pool and stops; one whose config differs only in
    `field` starts over the same folder, on a file of its own that holds no page of the first; the first config,
    started again, finds its page, byte for byte. Each file carries its own label."""
    first, second = tiny(tmp_path), tiny(tmp_path, **{field: value})
    with worker(first) as node:
        pool = ssd_pool(node)
        assert pool.label == ssd_label(first, node.layout) and Path(pool.path).parent == tmp_path
        data = bytes(i % 251 for i in range(pool.page_bytes))
        page = pool.try_allocate()
        assert page is not None
        pool.write(page, data, key=KEY)
        first_label = pool.label
    with worker(second) as node:
        assert KEY not in node.cache and not ssd_pool(node).recovered
        second_label = ssd_pool(node).label
    assert first_label != second_label and first.model.namespace in first_label
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(ssd_file_name("prefill-0", label) for label in (first_label, second_label)), files
    with worker(first) as node:
        assert KEY in node.cache
        found = node.cache.get(KEY)
        assert found is not None and bytes(memoryview(found).cast("B")) == data
