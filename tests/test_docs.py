"""Every ```python block of README.md and docs/*.md runs, as written, in a fresh interpreter.

A block runs in its own subprocess with a temporary working directory (files it
writes are thrown away) and must exit 0 within `TIMEOUT_S`. A block preceded by
``<!-- docs-test: cluster -->`` talks to the example cluster: it runs while a
tiny cluster serves, with the documented address ``http://127.0.0.1:8000``
replaced by the cluster's own (the suite never takes a fixed port). Nothing else
is substituted, so a snippet that drifts from the library fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300.0  # the slowest block builds a cluster's worth of models; far above what any needs
DOCUMENTED_URL = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- docs-test: (\w+) -->\s*$")


@attrs.frozen
class Snippet:
    path: Path
    line: int
    code: str
    needs: str | None  # "cluster" or None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets() -> list[Snippet]:
    """Every python block of the docs, with its file, first line and marker."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            needs = marker.group(1) if marker else None
            if needs not in (None, "cluster"):
                raise AssertionError(f"{path}: unknown docs-test marker {needs!r}")
            found.append(Snippet(path, text.count("\n", 0, match.start()) + 2, match.group(1), needs))
    return found


ALL = snippets()


def run(snippet: Snippet, cwd: Path, *, url: str | None = None) -> None:
    code = snippet.code if url is None else snippet.code.replace(DOCUMENTED_URL, url)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{snippet.name} failed:\n{done.stdout}\n{done.stderr}"


def test_the_docs_have_snippets_and_every_doc_is_read() -> None:
    assert len(ALL) >= 10
    assert {s.path.name for s in ALL} >= {"README.md", "cache.md", "scheduling.md", "simulation.md", "transfer.md"}


@pytest.mark.parametrize("snippet", [s for s in ALL if s.needs is None], ids=lambda s: s.name)
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    run(snippet, tmp_path)


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    """A tiny cluster on a free port, for the blocks that talk to one."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    pytest.importorskip("openai")
    sys.path.insert(0, str(ROOT / "examples"))
    from serving.config import load_config
    from serving.launch import start_cluster

    config = load_config(ROOT / "examples" / "configs" / "tiny.toml").with_overrides("cluster", port=0)
    with start_cluster(config) as running:
        yield running.url


@pytest.mark.parametrize("snippet", [s for s in ALL if s.needs == "cluster"], ids=lambda s: s.name)
def test_cluster_snippet_runs(snippet: Snippet, cluster_url: str, tmp_path: Path) -> None:
    assert DOCUMENTED_URL in snippet.code, f"{snippet.name}: a cluster block talks to {DOCUMENTED_URL}"
    run(snippet, tmp_path, url=cluster_url)


def test_the_guides_router_is_the_examples_router() -> None:
    """docs/simulation.md shows examples/policies/two_choices.py's class, not a copy that could drift."""

    def class_text(text: str) -> str:
        start = text.index("@attrs.define\nclass TwoChoices")
        end = text.index('"""It does not learn."""', start)
        return text[start:end]

    guide = (ROOT / "docs" / "simulation.md").read_text()
    assert class_text(guide) == class_text((ROOT / "examples" / "policies" / "two_choices.py").read_text())


def test_the_api_reference_is_what_the_code_exports() -> None:
    """docs/api.md's tables are `python docs/make_api.py`'s output for the current `__all__`s and docstrings."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_api_reference_covers_every_subpackage() -> None:
    """docs/api.md has a table for `mooncake`, each subpackage, and the errors and types modules (whose errors
    and values the docs' examples import, so that "anything not listed is internal" holds for them)."""
    text = (ROOT / "docs" / "api.md").read_text()
    packages = {
        "mooncake",
        "mooncake.errors",
        "mooncake.types",
        *(f"mooncake.{p.name}" for p in (ROOT / "mooncake").iterdir() if (p / "__init__.py").exists()),
    }
    assert {m for m in re.findall(r"<!-- api: ([\w.]+) -->", text)} == packages


def test_the_quick_figures_are_what_the_code_gives() -> None:
    """The figures docs/make_figures.py makes in seconds (the trace's where ../shared has it) are current;
    the experiments' figures are regenerated by running it in full."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_figures.py"), "--check", "--fast"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
