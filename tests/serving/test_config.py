"""The cluster config refuses every impossible value with one line naming file, section, key and value.

Example tests name each attack (a cache larger than /dev/shm, a block of 10^8 tokens, a prompt limit
the cache cannot hold pinned, zero intervals and timeouts, a port past 65535, binary and non-UTF-8
files, a missing profile); property tests write random TOML documents (random types and values for
the known keys) and random bytes, and check that `load_config` returns a config or raises
ConfigError, nothing else; a few go through `examples/cluster.py` in a subprocess.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving.config import SECTIONS, ClusterConfig, LimitsSection, ModelSection, load_config
from serving.machine import FD_RESERVE, Machine

from mooncake.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny.toml"
GIB = 2**30
# A machine with room for the tiny cluster and not much more (its figures, not this machine's).
SMALL = Machine(shm_free_bytes=23 * 10**9, ram_available_bytes=23 * 10**9, open_files_limit=4096)
TINY_PAGE_BYTES = 8192  # the tiny model's KV block of 16 tokens in float32


def refusal(tmp_path: Path, text: str | bytes, machine: Machine = SMALL) -> str:
    """The one-line ConfigError message load_config gives for a file holding `text`."""
    path = tmp_path / "cluster.toml"
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path, machine=machine)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


def test_tiny_toml_documents_every_key_with_its_default() -> None:
    """examples/configs/tiny.toml names every key of every section, each at its default."""
    text = TINY.read_text()
    for name, section in SECTIONS.items():
        assert f"[{name}]" in text
        for field in attrs.fields(section):
            assert re.search(rf"^{field.name} = ", text, re.MULTILINE), f"[{name}] {field.name}"
    assert attrs.evolve(load_config(TINY), source="") == ClusterConfig(source="")


def test_the_gateway_limits_have_their_defaults() -> None:
    """The connection and probe limits the gateway reads: header/body timeouts, connection caps, backoff."""
    limits = LimitsSection()
    assert (limits.header_timeout_s, limits.body_timeout_s) == (10.0, 30.0)
    assert (limits.max_connections, limits.max_connections_per_client) == (1024, 1024)
    assert limits.health_probe_backoff_max_s == 5.0


ATTACKS: dict[str, tuple[str, list[str]]] = {
    "a block of 1e8 tokens (a float)": ("[model]\nblock_tokens = 1e8\n", ["[model] block_tokens = 100000000.0", "int"]),
    "a block of 10^8 tokens": ("[model]\nblock_tokens = 100000000\n", ["[model] block_tokens = 100000000", "65536"]),
    "a prompt the cache cannot hold pinned": (
        "[cache]\ndram_blocks = 16\n[limits]\nmax_prompt_tokens = 2000\n",
        ["[limits] max_prompt_tokens = 2000", "125 blocks", "[cache] dram_blocks = 16"],
    ),
    "health_interval_s = 0 (a busy loop)": ("[limits]\nhealth_interval_s = 0\n", ["[limits] health_interval_s = 0"]),
    "request_timeout_s = 0 (every request 504)": (
        "[limits]\nrequest_timeout_s = 0\n",
        ["[limits] request_timeout_s = 0", "> 0"],
    ),
    "port 70000": ("[cluster]\nport = 70000\n", ["[cluster] port = 70000", "65535"]),
    "port -1": ("[cluster]\nport = -1\n", ["[cluster] port = -1", ">= 0"]),
    "ttft_s = nan": ("[slo]\nttft_s = nan\n", ["[slo] ttft_s = nan", "finite"]),
    "tbt_s = inf": ("[slo]\ntbt_s = inf\n", ["[slo] tbt_s = inf", "finite"]),
    "threshold = -inf": ("[policy]\nthreshold = -inf\n", ["[policy] threshold = -inf"]),
    "a seed of 10^400 (as hex)": (f"[model]\nseed = {hex(10**400)}\n", ["[model] seed = an integer of 1329 bits"]),
    "an int of 5,000 digits": ("[model]\nseed = " + "7" * 5000 + "\n", ["not valid TOML", "4300 digits"]),
    "200,000-deep nesting": ("x = " + "[" * 200_000 + "\n", ["not valid TOML", "nested too deeply"]),
    "a float for an int": ("[decode]\nmax_batch_size = 8.5\n", ["[decode] max_batch_size = 8.5", "int"]),
    "a table for a string": ("[model]\npreset = {a = 1}\n", ["[model] preset = {'a': 1}", "str"]),
    "a date for a float": ("[slo]\nttft_s = 2024-01-01\n", ["[slo] ttft_s = datetime.date(2024, 1, 1)"]),
    "a host with a space": ('[cluster]\nhost = "my host"\n', ["[cluster] host = 'my host'", "host name"]),
    "an API key with a newline": ('[cluster]\napi_key = "a\\nb"\n', ["[cluster] api_key = 'a\\nb'", "ASCII"]),
    "a NUL in a path": ('[cache]\nssd_dir = "a\\u0000b"\n', ["[cache] ssd_dir = 'a\\x00b'", "NUL"]),
    "a key with a newline": ('[model]\n"a\\nb" = 1\n', ["[model] 'a\\nb' = 1", "unknown key"]),
    "a backoff below the probe period": (
        "[limits]\nhealth_interval_s = 2\nhealth_probe_backoff_max_s = 1\n",
        ["[limits] health_probe_backoff_max_s = 1.0", "health_interval_s = 2.0"],
    ),
    "header_timeout_s = 0": ("[limits]\nheader_timeout_s = 0\n", ["[limits] header_timeout_s = 0"]),
    "body_timeout_s = -1": ("[limits]\nbody_timeout_s = -1\n", ["[limits] body_timeout_s = -1"]),
    "max_connections = 0": ("[limits]\nmax_connections = 0\n", ["[limits] max_connections = 0"]),
    "a checkpoint path that is no directory": (
        '[model]\npath = "/nonexistent/llama"\n',
        ["[model] path = '/nonexistent/llama'", "not a directory"],
    ),
    "a checkpoint path without config.json": ('[model]\npath = "/"\n', ["[model] path = '/'", "no config.json"]),
    "a served name with a space": ('[model]\nserved_model_name = "my model"\n', ["[model] served_model_name"]),
    "a timeout of a year": ("[limits]\nrequest_timeout_s = 31536000\n", ["[limits] request_timeout_s", "86400"]),
}


@pytest.mark.parametrize(("text", "named"), ATTACKS.values(), ids=ATTACKS.keys())
def test_an_impossible_value_is_one_line_naming_file_section_key_value(
    tmp_path: Path, text: str, named: list[str]
) -> None:
    """Each value that cannot work is a ConfigError: one line, the file first, then section, key and value."""
    message = refusal(tmp_path, text)
    for part in named:
        assert part in message, (part, message)


def test_a_decode_slot_past_a_checkpoints_context_bound_is_refused(tmp_path: Path) -> None:
    """A Mistral checkpoint whose window (64) is no shorter than its max_position_embeddings (64) computes as
    transformers only within them (`ModelConfig.max_context_tokens`): a decode slot of 2048 is refused at load,
    naming both, not when a worker builds its engine."""
    model = tmp_path / "mistral"
    model.mkdir()
    shape = {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "sliding_window": 64,
        "max_position_embeddings": 64,
    }
    (model / "config.json").write_text(json.dumps(shape), encoding="utf-8")
    message = refusal(tmp_path, f'[model]\npath = "{model}"\n[decode]\nmax_context_tokens = 2048\n')
    assert "[decode] max_context_tokens = 2048" in message and "max_context_tokens = 64" in message


def test_a_cache_larger_than_shared_memory_names_the_bytes_asked_and_free(tmp_path: Path) -> None:
    """dram_blocks = 4,000,000 asks 3 nodes × 4e6 pages × 8 KiB of /dev/shm: refused with both figures."""
    message = refusal(tmp_path, "[cache]\ndram_blocks = 4000000\n")
    asked = 3 * 4_000_000 * TINY_PAGE_BYTES
    assert "[cache] dram_blocks = 4000000" in message
    assert f"{asked:,} bytes of shared memory asked" in message and "23,000,000,000 bytes free in /dev/shm" in message


def test_ram_counts_pools_weights_and_decode_slots(tmp_path: Path) -> None:
    """Within /dev/shm but not RAM: the message names the largest demand, then asked and available bytes."""
    machine = attrs.evolve(SMALL, ram_available_bytes=GIB)
    message = refusal(tmp_path, "[decode]\nmax_batch_size = 1000\nmax_context_tokens = 4096\n", machine)
    slots = 1000 * 4096 * (TINY_PAGE_BYTES // 16)
    assert "[decode] max_batch_size = 1000, max_context_tokens = 4096" in message
    assert f"{slots:,} bytes of decode KV slots" in message and f"{GIB:,} bytes available" in message
    assert "[cache] dram_blocks = 100000" in refusal(tmp_path, "[cache]\ndram_blocks = 100000\n", machine)
    assert "[model] preset = 'llama3-8b'" in refusal(tmp_path, '[model]\npreset = "llama3-8b"\n', machine)


def test_connections_must_fit_the_open_file_limit(tmp_path: Path) -> None:
    """max_connections plus the gateway's own files must fit RLIMIT_NOFILE."""
    over = SMALL.open_files_limit - FD_RESERVE + 1  # type: ignore[operator]
    message = refusal(tmp_path, f"[limits]\nmax_connections = {over}\n")
    assert f"[limits] max_connections = {over}" in message and "RLIMIT_NOFILE" in message
    path = tmp_path / "fits.toml"
    path.write_text(f"[limits]\nmax_connections = {over - 1}\n")
    assert load_config(path, machine=SMALL).limits.max_connections == over - 1


@pytest.mark.parametrize(
    ("soft", "hard", "asked", "granted", "soft_after"),
    [
        (600, 20_000, 1024, 1024, 1024 + FD_RESERVE),  # raised to hold them all
        (600, 1000, 1024, 1000 - FD_RESERVE, 1000),  # a hard limit below the need: what fits
        (5000, 20_000, 1024, 1024, 5000),  # already enough: left alone
    ],
)
def test_the_gateway_raises_its_file_limit_to_hold_its_connections(
    soft: int, hard: int, asked: int, granted: int, soft_after: int
) -> None:
    """One rule for the connections a gateway holds: the config check's (`max_connections + FD_RESERVE` within
    the hard limit) is what the gateway gets, raising its soft limit; in a child, so this process' limit stays."""
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT / "examples")!r})
from serving.machine import connection_budget
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
print(connection_budget({asked}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this process' hard open-file limit is below {hard}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(granted), str(soft_after)]


def test_an_unknown_machine_checks_nothing(tmp_path: Path) -> None:
    """Machine() knows no figure, so a cluster bound for other machines is only checked for sense."""
    path = tmp_path / "big.toml"
    path.write_text("[cache]\ndram_blocks = 4000000\n")
    assert load_config(path, machine=Machine()).cache.dram_blocks == 4_000_000


def test_this_machine_refuses_a_cache_past_its_shared_memory(tmp_path: Path) -> None:
    """On this machine (figures read now), one page per node more than /dev/shm holds is refused."""
    here = Machine.here()
    if here.shm_free_bytes is None:
        pytest.skip("no /dev/shm on this machine")
    blocks = here.shm_free_bytes // (3 * TINY_PAGE_BYTES) + 1
    assert "shared memory asked" in refusal(tmp_path, f"[cache]\ndram_blocks = {blocks}\n", here)


def test_this_machine_checks_folders_and_host(tmp_path: Path) -> None:
    """ssd_dir must be a writable folder with room; the host must be one the gateway can listen on."""
    here = Machine.here()
    assert "not a folder" in refusal(tmp_path, f'[cache]\nssd_dir = "{tmp_path / "absent"}"\n', here)
    message = refusal(tmp_path, f'[cache]\nssd_blocks = {10**12}\nssd_dir = "{tmp_path}"\n', here)
    assert f"[cache] ssd_blocks = {10**12}" in message and "bytes of disk asked" in message
    assert "[cluster] host = '192.0.2.1'" in refusal(tmp_path, '[cluster]\nhost = "192.0.2.1"\n', here)  # TEST-NET-1
    path = tmp_path / "ssd.toml"
    path.write_text(f'[cache]\nssd_blocks = 8\nssd_dir = "{tmp_path}"\n[cluster]\nhost = "localhost"\n')
    assert load_config(path, machine=here).cache.ssd_blocks == 8


def test_a_file_that_is_not_a_toml_text(tmp_path: Path) -> None:
    """A binary file, a non-UTF-8 one, a folder and a missing file: each one line naming the path."""
    assert "not a UTF-8 text file: byte 0x89 on line 1" in refusal(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00")
    assert "byte 0xe9 on line 2" in refusal(tmp_path, b'[cluster]\napi_key = "caf\xe9"\n')
    assert "not valid TOML" in refusal(tmp_path, b"\x00\x01\x02")
    for path in (tmp_path, tmp_path / "missing.toml"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: cannot read the config: "):
            load_config(path, machine=SMALL)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "No such file"),
        ("{", "Expecting"),
        ("[" * 200_000 + "]" * 200_000, "nested deeper than 128 levels"),
        (json.dumps({"prefill": {}}), "no 'decode' section"),
        (json.dumps({"prefill": 5, "decode": 5}), "not a fitted prefill model"),
        (b"\xff\xfe", "codec"),
    ],
    ids=["missing", "not JSON", "deep", "no decode", "wrong shape", "binary"],
)
def test_a_profile_that_cannot_be_read(tmp_path: Path, content: str | bytes | None, reason: str) -> None:
    """[prefill] profile must name a readable profile; otherwise one line naming the config and the profile."""
    profile = tmp_path / "profile.json"
    if isinstance(content, str):
        profile.write_text(content)
    elif isinstance(content, bytes):
        profile.write_bytes(content)
    message = refusal(tmp_path, f'[prefill]\nprofile = "{profile}"\n')
    assert f"[prefill] profile = '{profile}'" in message and reason in message


def test_overrides_are_checked_like_the_file() -> None:
    """with_overrides applies the same rules, the rules across sections included."""
    config = load_config(TINY, machine=SMALL)
    with pytest.raises(ConfigError, match=r"\[cluster\] port = 65536"):
        config.with_overrides("cluster", port=65536)
    with pytest.raises(ConfigError, match=r"does not fit pinned"):
        config.with_overrides("cache", dram_blocks=4)
    with pytest.raises(ConfigError, match=r"\[limits\] health_interval_s = 0"):
        LimitsSection(health_interval_s=0)
    with pytest.raises(ConfigError, match=r"\[slo\] ttft_s = an integer of 1329 bits"):
        config.with_overrides("slo", ttft_s=10**400)


# ------------------------------------------------------------------------------------------ properties


def toml_value(value: Any) -> str:
    """`value` as a TOML literal (a small writer: strings, numbers, booleans, dates, arrays, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return hex(value) if value >= 0 and value.bit_length() > 4000 else str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


NUMBERS = st.one_of(
    st.integers(),
    st.integers(-5, 70_000),
    st.sampled_from([0, 1, 4, 16, 2048, 65_535, 65_536, 2**63, 10**400, 4_000_000]),
    st.floats(),
    st.floats(-1.0, 100.0),
)
SCALARS = st.one_of(
    NUMBERS,
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["tiny", "float32", "bfloat16", "kvcache_centric", "baseline", "127.0.0.1", "localhost", "."]),
    st.dates(),
    st.datetimes(),
    st.times(),
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
)
KEYS = {name: [field.name for field in attrs.fields(record)] for name, record in SECTIONS.items()}


def value_of(section: str, key: str) -> st.SearchStrategy[Any]:
    """Mostly a value of the key's type near its bounds or among its choices; now and then anything."""
    if section not in SECTIONS or key not in attrs.fields_dict(SECTIONS[section]):
        return VALUES
    field = attrs.fields_dict(SECTIONS[section])[key].metadata["rule"]
    if field.allowed:
        typed: st.SearchStrategy[Any] = st.sampled_from(field.allowed)
    elif field.kind is str:
        typed = st.sampled_from(["", "127.0.0.1", "localhost", "secret", "/tmp"])
    else:
        edges = [edge for edge in (field.minimum, field.maximum) if edge is not None]
        near = [edge + step for edge in edges for step in (-1, 0, 1)] + [field.minimum or 0, 1, 16, 512, 4096]
        typed = st.sampled_from([field.kind(number) for number in near if math.isfinite(number)])
    return st.one_of(typed, typed, typed, st.floats() if field.kind is float else typed, VALUES)


@st.composite
def documents(draw: st.DrawFn) -> str:
    """A TOML document: some known sections (now and then an unknown one), known keys with random values."""
    rarely = st.integers(0, 19).map(lambda n: n == 19)  # an unknown name would hide the values' checks
    lines: list[str] = []
    names = draw(st.lists(st.sampled_from(list(KEYS)), unique=True, max_size=4)) + (["bogus"] if draw(rarely) else [])
    for section in names:
        lines.append(f"[{section}]")
        keys = draw(st.lists(st.sampled_from(KEYS.get(section, ["x"])), unique=True, max_size=4))
        keys += ["unknown"] if draw(rarely) else []
        lines += [f"{key} = {toml_value(draw(value_of(section, key)))}" for key in keys]
    return "\n".join(lines) + "\n"


def loads_or_refuses(path: Path) -> None:
    """load_config returns a config or raises a one-line ConfigError starting with the path; nothing else."""
    try:
        config = load_config(path, machine=SMALL)
    except ConfigError as error:
        assert str(error).startswith(f"{path}: ") and "\n" not in str(error), str(error)
    else:
        assert isinstance(config, ClusterConfig)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(document=documents())
def test_any_toml_document_loads_or_is_one_config_error(tmp_path: Path, document: str) -> None:
    """Random types and values for the known keys: a config or a ConfigError, never another exception."""
    path = tmp_path / "random.toml"
    path.write_text(document, encoding="utf-8")
    loads_or_refuses(path)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=200), documents().map(lambda text: text.encode()[::-1])))
def test_any_bytes_load_or_are_one_config_error(tmp_path: Path, data: bytes) -> None:
    """Arbitrary bytes (and TOML reversed): a config or a ConfigError, never another exception."""
    path = tmp_path / "random.toml"
    path.write_bytes(data)
    loads_or_refuses(path)


# ---------------------------------------------------------------------------------------- command line

LAUNCHER_ATTACKS = {
    "shared memory": b"[cache]\ndram_blocks = 4000000000\n",  # 3 × 32.8 TB: past any machine's /dev/shm
    "binary": b"\x89PNG\r\n\x1a\n\x00\xff",
    "missing profile": b'[prefill]\nprofile = "no/such/profile.json"\n',
    "busy loop": b"[limits]\nhealth_interval_s = 0\n",
}


@pytest.mark.parametrize("content", LAUNCHER_ATTACKS.values(), ids=LAUNCHER_ATTACKS.keys())
def test_the_launcher_prints_one_line_and_no_traceback(tmp_path: Path, content: bytes) -> None:
    """examples/cluster.py with a bad config: exit status 1, one `error: FILE: ...` line, no traceback."""
    config = tmp_path / "bad.toml"
    config.write_bytes(content)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cluster.py"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.startswith(f"error: {config}: ") and done.stderr.count("\n") == 1, done.stderr


@given(
    seeds=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    dtypes=st.tuples(st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["float32", "bfloat16"])),
)
def test_presets_of_other_weights_or_dtypes_key_blocks_apart(seeds: tuple[int, int], dtypes: tuple[str, str]) -> None:
    """A preset's weights are its seed's, and the KV is the dtype's: two models share a block-key namespace (so a
    cache, an SSD pool reopened after a restart included, serves one's KV to the other) iff both are the same."""
    from mooncake.cache.hashing import BlockHasher

    first, second = (ModelSection(seed=s, dtype=d) for s, d in zip(seeds, dtypes, strict=True))
    same = seeds[0] == seeds[1] and dtypes[0] == dtypes[1]
    assert (first.namespace == second.namespace) == same
    keys = [BlockHasher(model=c.namespace, block_size_tokens=16).block_keys(list(range(32))) for c in (first, second)]
    assert (keys[0] == keys[1]) == same
