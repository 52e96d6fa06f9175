"""The cluster's TOML config: one frozen record per section, every field checked.

    [model]    preset, seed, dtype, block_tokens
    [cluster]  num_prefill, num_decode, host, port, api_key
    [cache]    dram_blocks, ssd_blocks, ssd_dir          (per node)
    [policy]   router, admission, threshold
    [slo]      ttft_s, tbt_s
    [prefill]  chunk_tokens, profile                     (profile: JSON from examples/profile_engine.py)
    [decode]   max_batch_size, max_context_tokens
    [limits]   max_prompt_tokens, default_max_tokens, request_timeout_s, health_interval_s

Each section is a frozen attrs record (`ModelSection`, ..., `LimitsSection`)
whose fields carry their rule: the type is the default's (an int given for a
float field becomes a float), with a minimum or a set of allowed values.
`ClusterConfig` holds one record per section and the file it came from; it
checks the one rule across sections (a longest prompt plus its default output
fits the decode context). `parse` checks a TOML document in two passes: first
that every section and key is known, then every value in declaration order.

An unknown section or key, or a value of the wrong type or range, is a
ConfigError naming the file, the section and key, and the value (a record
built directly names the section, key and value).

The records pickle (the worker processes and Ray actors receive the config
inside their `WorkerSpec`) and are never mutated: `with_overrides` makes a
checked copy.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import attrs

from mooncake.engine.config import PRESETS
from mooncake.errors import ConfigError
from serving.registry import ADMISSIONS, ROUTERS

__all__ = [
    "CacheSection",
    "ClusterConfig",
    "ClusterSection",
    "DecodeSection",
    "LimitsSection",
    "ModelSection",
    "PolicySection",
    "PrefillSection",
    "SloSection",
    "load_config",
]


T = TypeVar("T")


@attrs.frozen
class _Rule:
    """What a field accepts: its type, and a minimum or the allowed values."""

    kind: type[Any]
    minimum: float | None = None
    allowed: tuple[str, ...] = ()

    def check(self, where: str, value: Any) -> Any:
        """`value` as the field stores it; `where` (`[section] key = value`) opens the ConfigError."""
        value = self.convert(value)
        if not isinstance(value, self.kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected {self.kind.__name__}")
        if self.allowed and value not in self.allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(self.allowed)}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{where}: must be >= {self.minimum}")
        return value

    def convert(self, value: Any) -> Any:
        """An int for a float field becomes a float; anything else is left for `check`."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    def validate(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        self.check(f"[{instance.NAME}] {attribute.name} = {value!r}", value)


def _setting(default: T, *, minimum: float | None = None, allowed: Sequence[str] = ()) -> T:
    """A checked field of the default's type."""
    rule = _Rule(type(default), minimum, tuple(allowed))
    return attrs.field(default=default, converter=rule.convert, validator=rule.validate, metadata={"rule": rule})


@attrs.frozen(kw_only=True)
class ModelSection:
    """`[model]`: the preset (mooncake.engine.config.PRESETS), its weights' seed and dtype, tokens per KV block."""

    NAME: ClassVar[str] = "model"
    preset: str = _setting("tiny", allowed=tuple(PRESETS))
    seed: int = _setting(0, minimum=0)
    dtype: str = _setting("float32", allowed=("float32", "bfloat16"))
    block_tokens: int = _setting(16, minimum=1)


@attrs.frozen(kw_only=True)
class ClusterSection:
    """`[cluster]`: engine counts, the gateway's host and port (0: any free port), the API key ("": none)."""

    NAME: ClassVar[str] = "cluster"
    num_prefill: int = _setting(2, minimum=1)
    num_decode: int = _setting(1, minimum=1)
    host: str = _setting("127.0.0.1")
    port: int = _setting(8000, minimum=0)
    api_key: str = _setting("")


@attrs.frozen(kw_only=True)
class CacheSection:
    """`[cache]`, per node: DRAM blocks, SSD blocks (0: no SSD tier) and their folder ("": a temporary one)."""

    NAME: ClassVar[str] = "cache"
    dram_blocks: int = _setting(512, minimum=4)
    ssd_blocks: int = _setting(0, minimum=0)
    ssd_dir: str = _setting("")


@attrs.frozen(kw_only=True)
class PolicySection:
    """`[policy]`: the router and admission policy by name, and the cache-aware router's threshold."""

    NAME: ClassVar[str] = "policy"
    router: str = _setting("kvcache_centric", allowed=tuple(ROUTERS))
    admission: str = _setting("early_rejection", allowed=tuple(ADMISSIONS))
    threshold: float = _setting(1.5, minimum=1.0)


@attrs.frozen(kw_only=True)
class SloSection:
    """`[slo]`: the time-to-first-token and time-between-tokens objectives."""

    NAME: ClassVar[str] = "slo"
    ttft_s: float = _setting(30.0, minimum=0.0)
    tbt_s: float = _setting(0.5, minimum=0.0)


@attrs.frozen(kw_only=True)
class PrefillSection:
    """`[prefill]`: tokens per prefill chunk; a fitted cost model's JSON ("": the analytic CPU model)."""

    NAME: ClassVar[str] = "prefill"
    chunk_tokens: int = _setting(512, minimum=1)
    profile: str = _setting("")


@attrs.frozen(kw_only=True)
class DecodeSection:
    """`[decode]`: requests per batch and tokens per request's context."""

    NAME: ClassVar[str] = "decode"
    max_batch_size: int = _setting(8, minimum=1)
    max_context_tokens: int = _setting(2048, minimum=2)


@attrs.frozen(kw_only=True)
class LimitsSection:
    """`[limits]`: the longest prompt, the default output, a request's deadline, the health loop's period."""

    NAME: ClassVar[str] = "limits"
    max_prompt_tokens: int = _setting(1024, minimum=1)
    default_max_tokens: int = _setting(16, minimum=1)
    request_timeout_s: float = _setting(60.0, minimum=0.0)
    health_interval_s: float = _setting(0.5, minimum=0.0)


SECTIONS: dict[str, type[Any]] = {
    section.NAME: section
    for section in (
        ModelSection,
        ClusterSection,
        CacheSection,
        PolicySection,
        SloSection,
        PrefillSection,
        DecodeSection,
        LimitsSection,
    )
}


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """The whole config: `config.section.key`, defaults filled in; `source` names the file.

    Invariant: `limits.max_prompt_tokens + limits.default_max_tokens <= decode.max_context_tokens`.
    """

    source: str
    model: ModelSection = attrs.field(factory=ModelSection)
    cluster: ClusterSection = attrs.field(factory=ClusterSection)
    cache: CacheSection = attrs.field(factory=CacheSection)
    policy: PolicySection = attrs.field(factory=PolicySection)
    slo: SloSection = attrs.field(factory=SloSection)
    prefill: PrefillSection = attrs.field(factory=PrefillSection)
    decode: DecodeSection = attrs.field(factory=DecodeSection)
    limits: LimitsSection = attrs.field(factory=LimitsSection)

    def __attrs_post_init__(self) -> None:
        limits, decode = self.limits, self.decode
        if limits.max_prompt_tokens + limits.default_max_tokens > decode.max_context_tokens:
            raise ConfigError(
                f"{self.source}: [limits] max_prompt_tokens + default_max_tokens = {limits.max_prompt_tokens} + "
                f"{limits.default_max_tokens} exceed [decode] max_context_tokens = {decode.max_context_tokens}"
            )

    def with_overrides(self, section: str, **values: Any) -> ClusterConfig:
        """A copy with some keys of `section` replaced (checked like the file's).

        Raises:
            ConfigError: an unknown section or key, or a value out of bounds.
        """
        data: dict[str, Any] = {name: attrs.asdict(getattr(self, name)) for name in SECTIONS}
        data[section] = {**data.get(section, {}), **values}  # an unknown section is parse's ConfigError
        return parse(data, self.source)


def parse(data: Mapping[str, Any], source: str) -> ClusterConfig:
    """Check `data` (a parsed TOML document) against the sections' records and fill in defaults.

    Raises:
        ConfigError: naming `source`, the section and key, and the value.
    """
    for section, keys in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if not isinstance(keys, dict):
            raise ConfigError(f"{source}: [{section}] = {keys!r}: must be a table")
        known = [field.name for field in attrs.fields(SECTIONS[section])]
        for key, value in keys.items():
            if key not in known:
                raise ConfigError(f"{source}: [{section}] {key} = {value!r}: unknown key (known: {', '.join(known)})")
    records: dict[str, Any] = {}
    for section, record in SECTIONS.items():
        given = data.get(section, {})
        values = {
            # Checked here, before the record's own validators, so that the message shows the value as written.
            field.name: field.metadata["rule"].check(
                f"{source}: [{section}] {field.name} = {given[field.name]!r}", given[field.name]
            )
            for field in attrs.fields(record)
            if field.name in given
        }
        records[section] = record(**values)
    return ClusterConfig(source=source, **records)


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
