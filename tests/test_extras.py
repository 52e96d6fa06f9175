"""Tests for `mooncake._extras`: a missing optional package is a `ConfigError` naming it and its extra.

Each public entry point that lazily imports an extra's package is run in a fresh interpreter whose
`sys.modules` maps that package to None (Python then refuses to import it, as if it were not installed),
and its message is checked word for word. The helper itself: unrelated import errors pass through, and
its table agrees with pyproject.toml's extras.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake._extras import EXTRAS, missing_extra, needs_extra, script_needs_extra
from mooncake.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def without(packages: tuple[str, ...], body: str, cwd: Path) -> str:
    """The stdout of `body` run in a fresh interpreter in `cwd` where none of `packages` can be imported."""
    script = f"import sys\nfor name in {packages!r}:\n    sys.modules[name] = None\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


def message(package: str, needed_by: str) -> str:
    extra = EXTRAS[package]
    return f"{needed_by} needs {package}: the {extra} extra (pip install -e '.[{extra}]' in the checkout)\n"


def test_vllm_wire_without_msgpack_names_the_kv_events_extra(tmp_path: Path) -> None:
    """`import mooncake.cache` needs no msgpack; encoding or decoding a vLLM batch without it names the extra."""
    out = without(
        ("msgpack",),
        """
        from mooncake.cache import VllmEventBatch, decode_batch, encode_batch
        from mooncake.errors import ConfigError
        for call in (lambda: encode_batch(VllmEventBatch(ts=0.0, events=())), lambda: decode_batch(b"\\x90")):
            try:
                call()
            except ConfigError as error:
                print(error)
        """,
        tmp_path,
    )
    assert out == message("msgpack", "encode_batch") + message("msgpack", "decode_batch")


def test_load_tokenizer_without_tokenizers_names_the_hf_extra(tmp_path: Path) -> None:
    """`load_tokenizer` without the tokenizers package names the hf extra (before it reads any file)."""
    out = without(
        ("tokenizers",),
        f"""
        from mooncake.engine import load_tokenizer
        from mooncake.errors import ConfigError
        try:
            load_tokenizer({str(tmp_path)!r})
        except ConfigError as error:
            print(error)
        """,
        tmp_path,
    )
    assert out == message("tokenizers", "load_tokenizer")


def test_a_chat_template_without_jinja2_names_the_hf_extra(tmp_path: Path) -> None:
    """A tokenizer with a chat template needs jinja2; without it the message names the checkpoint and the extra."""
    out = without(
        ("jinja2",),
        """
        from mooncake.engine import SpecialTokens, Tokenizer
        from mooncake.errors import ConfigError
        Tokenizer(None, special=SpecialTokens(), chat_template=None)  # no template: no jinja2 needed
        try:
            Tokenizer(None, special=SpecialTokens(), chat_template="{{ messages }}", source="ckpt")
        except ConfigError as error:
            print(error)
        """,
        tmp_path,
    )
    assert out == message("jinja2", "ckpt: the chat template")


def test_engine_names_without_torch_name_the_engine_extra(tmp_path: Path) -> None:
    """`import mooncake.engine` and its torch-free names load without torch; a torch name says to install the
    engine extra."""
    out = without(
        ("torch",),
        """
        import mooncake.engine
        from mooncake.engine import PRESETS, ModelConfig, read_model_config
        from mooncake.errors import ConfigError
        for name in ("LlamaModel", "PrefillEngine", "DecodeEngine"):
            try:
                getattr(mooncake.engine, name)
            except ConfigError as error:
                print(error)
        """,
        tmp_path,
    )
    assert out == "".join(
        message("torch", f"mooncake.engine.{name}") for name in ("LlamaModel", "PrefillEngine", "DecodeEngine")
    )


def test_an_unknown_engine_name_is_still_an_attribute_error() -> None:
    """A name `mooncake.engine` does not export is an AttributeError, as for any module."""
    import mooncake.engine

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mooncake.engine.Nope  # noqa: B018


def test_an_import_error_of_no_extra_passes_through() -> None:
    """A module that no extra provides (a typo, a module of this package), or a name an installed extra's package
    lacks, fails as Python says, not as a missing extra."""
    with pytest.raises(ModuleNotFoundError, match="mooncake_no_such_module"), needs_extra("a test"):
        import mooncake_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    with pytest.raises(ModuleNotFoundError), needs_extra("a test"):
        import mooncake.no_such_module  # type: ignore[import-not-found]  # noqa: F401
    # An extra's package that is there but lacks a name (too old, broken) is not blamed on a missing extra.
    with pytest.raises(ImportError, match="no_such_name") as raised, needs_extra("a test"):
        from msgpack import no_such_name  # type: ignore[attr-defined]  # noqa: F401
    assert type(raised.value) is ImportError


@given(
    package=st.sampled_from(sorted(EXTRAS)),
    inner=st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), max_size=2),
    needed_by=st.text(min_size=1, max_size=20),
)
def test_a_missing_package_or_its_submodule_names_its_extra(package: str, inner: list[str], needed_by: str) -> None:
    """An import error naming a package of `EXTRAS`, or a module inside it, becomes `missing_extra`'s ConfigError,
    caused by the import error."""
    cause = ModuleNotFoundError("not installed", name=".".join([package, *inner]))
    with pytest.raises(ConfigError) as caught, needs_extra(needed_by):
        raise cause
    assert str(caught.value) == str(missing_extra(needed_by, package))
    assert f"{needed_by} needs {package}: the {EXTRAS[package]} extra" in str(caught.value)
    assert caught.value.__cause__ is cause


@given(package=st.sampled_from(sorted(EXTRAS)), program=st.from_regex(r"[a-z_]{1,12}", fullmatch=True))
def test_a_script_lacking_an_extra_exits_with_one_line_naming_it(package: str, program: str) -> None:
    """`script_needs_extra` ends the script with "PROGRAM: " and `needs_extra`'s message, traceback suppressed;
    an import error no extra explains passes through."""
    with pytest.raises(SystemExit) as caught, script_needs_extra(program):
        raise ModuleNotFoundError("not installed", name=package)
    assert caught.value.code == f"{program}: {missing_extra(f'examples/{program}.py', package)}"
    assert caught.value.__suppress_context__
    with pytest.raises(ModuleNotFoundError), script_needs_extra(program):
        import mooncake_no_such_module  # type: ignore[import-not-found]  # noqa: F401


def test_every_package_is_listed_in_its_extra() -> None:
    """`EXTRAS` agrees with pyproject.toml: each package's distribution is a requirement of the extra it names."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    distributions = metadata.packages_distributions()
    for package, extra in EXTRAS.items():
        assert extra in extras, f"{package}: no extra {extra!r} in pyproject.toml"
        listed = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in extras[extra]}
        if package not in distributions:
            continue  # not installed here: its distribution's name is unknown
        provided = {name.lower().replace("_", "-") for name in distributions[package]}
        assert provided & listed, f"{package} (from {sorted(provided)}) is not a requirement of extra {extra!r}"


def test_dir_of_the_engine_lists_its_lazy_names() -> None:
    """`dir(mooncake.engine)` (completion, `help`) lists every exported name, the lazily imported ones too."""
    import mooncake.engine

    assert set(mooncake.engine.__all__) <= set(dir(mooncake.engine))
    assert "__getattr__" in dir(mooncake.engine)
