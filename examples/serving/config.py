"""The cluster's TOML config: one frozen record per section, every field checked.

    [model]    preset, seed, dtype, block_tokens
    [cluster]  num_prefill, num_decode, host, port, api_key
    [cache]    dram_blocks, ssd_blocks, ssd_dir          (per node)
    [policy]   router, admission, threshold
    [slo]      ttft_s, tbt_s
    [prefill]  chunk_tokens, profile                     (profile: JSON from examples/profile_engine.py)
    [decode]   max_batch_size, max_context_tokens
    [limits]   max_prompt_tokens, default_max_tokens, request_timeout_s, health_interval_s

An unknown section or key, or a value of the wrong type or range, is a
ConfigError naming the file, the section and key, and the value.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs

from mooncake.errors import ConfigError

__all__ = ["ClusterConfig", "load_config"]

ROUTERS = ("kvcache_centric", "local_cache_aware", "load_balancing", "random")
ADMISSIONS = ("baseline", "early_rejection", "predictive_early_rejection")

# section → key → (type, default, minimum or allowed values)
SCHEMA: dict[str, dict[str, tuple[type, Any, Any]]] = {
    "model": {
        "preset": (str, "tiny", None),
        "seed": (int, 0, 0),
        "dtype": (str, "float32", ("float32", "bfloat16")),
        "block_tokens": (int, 16, 1),
    },
    "cluster": {
        "num_prefill": (int, 2, 1),
        "num_decode": (int, 1, 1),
        "host": (str, "127.0.0.1", None),
        "port": (int, 8000, 0),
        "api_key": (str, "", None),
    },
    "cache": {"dram_blocks": (int, 512, 4), "ssd_blocks": (int, 0, 0), "ssd_dir": (str, "", None)},
    "policy": {
        "router": (str, "kvcache_centric", ROUTERS),
        "admission": (str, "early_rejection", ADMISSIONS),
        "threshold": (float, 1.5, 1.0),
    },
    "slo": {"ttft_s": (float, 30.0, 0.0), "tbt_s": (float, 0.5, 0.0)},
    "prefill": {"chunk_tokens": (int, 512, 1), "profile": (str, "", None)},
    "decode": {"max_batch_size": (int, 8, 1), "max_context_tokens": (int, 2048, 2)},
    "limits": {
        "max_prompt_tokens": (int, 1024, 1),
        "default_max_tokens": (int, 16, 1),
        "request_timeout_s": (float, 60.0, 0.0),
        "health_interval_s": (float, 0.5, 0.0),
    },
}


@attrs.frozen
class ClusterConfig:
    """The whole config: `config.section["key"]`, defaults filled in; `source` names the file."""

    source: str
    sections: dict[str, dict[str, Any]]

    def __getattr__(self, name: str) -> dict[str, Any]:
        try:
            return self.sections[name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(name) from None

    def with_overrides(self, section: str, **values: Any) -> ClusterConfig:
        """A copy with some keys of `section` replaced (checked like the file's)."""
        merged = {name: dict(keys) for name, keys in self.sections.items()}
        merged.setdefault(section, {}).update(values)  # an unknown section is parse's ConfigError
        return parse(merged, self.source)


def _check(source: str, section: str, key: str, value: Any) -> Any:
    kind, _default, rule = SCHEMA[section][key]
    where = f"{source}: [{section}] {key} = {value!r}"
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where}: expected {kind.__name__}")
    if isinstance(rule, tuple) and value not in rule:
        raise ConfigError(f"{where}: must be one of {', '.join(rule)}")
    if isinstance(rule, int | float) and not isinstance(rule, bool) and value < rule:
        raise ConfigError(f"{where}: must be >= {rule}")
    return value


def parse(data: dict[str, Any], source: str) -> ClusterConfig:
    """Check `data` (a parsed TOML document) against the schema and fill in defaults."""
    sections: dict[str, dict[str, Any]] = {}
    for section, keys in data.items():
        if section not in SCHEMA:
            raise ConfigError(f"{source}: unknown section [{section}] (known: {', '.join(SCHEMA)})")
        if not isinstance(keys, dict):
            raise ConfigError(f"{source}: [{section}] = {keys!r}: must be a table")
        for key, value in keys.items():
            if key not in SCHEMA[section]:
                raise ConfigError(
                    f"{source}: [{section}] {key} = {value!r}: unknown key (known: {', '.join(SCHEMA[section])})"
                )
    for section, fields in SCHEMA.items():
        given = data.get(section, {})
        sections[section] = {
            key: _check(source, section, key, given[key]) if key in given else default
            for key, (_kind, default, _rule) in fields.items()
        }
    from mooncake.engine.config import PRESETS

    if sections["model"]["preset"] not in PRESETS:
        raise ConfigError(
            f"{source}: [model] preset = {sections['model']['preset']!r}: must be one of {', '.join(PRESETS)}"
        )
    limits, decode = sections["limits"], sections["decode"]
    if limits["max_prompt_tokens"] + limits["default_max_tokens"] > decode["max_context_tokens"]:
        raise ConfigError(
            f"{source}: [limits] max_prompt_tokens + default_max_tokens = {limits['max_prompt_tokens']} + "
            f"{limits['default_max_tokens']} exceed [decode] max_context_tokens = {decode['max_context_tokens']}"
        )
    return ClusterConfig(source, sections)


def load_config(path: str | Path) -> ClusterConfig:
    """Read and check a cluster config file.

    Raises:
        ConfigError: unreadable, not TOML (with its line), or a field out of bounds.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
    return parse(data, str(path))
