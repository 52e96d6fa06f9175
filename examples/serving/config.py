"""The cluster's TOML config: one frozen record per section, every field checked.

    [model]    preset, path, served_model_name, seed, dtype, block_tokens
    [cluster]  num_prefill, num_decode, host, port, api_key
    [cache]    dram_blocks, ssd_blocks, ssd_dir          (per node)
    [policy]   router, admission, threshold              (router: a name, or FILE.py:FACTORY)
    [slo]      ttft_s, tbt_s
    [prefill]  chunk_tokens, profile, pipeline_size      (profile: JSON from examples/profile_engine.py)
    [decode]   max_batch_size, max_context_tokens
    [limits]   max_prompt_tokens, default_max_tokens, request_timeout_s, health_interval_s,
               header_timeout_s, body_timeout_s, max_connections, max_connections_per_client,
               health_probe_backoff_max_s, admission_wait_s

Each section is a frozen attrs record (`ModelSection`, ..., `LimitsSection`)
whose fields carry their rule: the type is the default's (an int given for a
float field becomes a float), numbers are finite and within bounds (durations
above zero and at most a day, `admission_wait_s` zero too, ports 0..65535, integers below 2**63), strings
from a set or of a shape (a host name or address, an API key of visible ASCII,
a path without NUL). `ClusterConfig` holds one record per section and the file
it came from, and checks the rules across sections:

    max_prompt_tokens + default_max_tokens <= max_context_tokens   (a longest prompt and its default output fit)
    max_context_tokens <= the model's max_context_tokens            (a checkpoint's bound, where it sets one)
    pipeline_size <= the layers of the model                        (a stage holds at least one layer)
    ceil(max_prompt_tokens / block_tokens) <= dram_blocks          (a node's cache holds a longest prompt pinned)
    health_interval_s <= health_probe_backoff_max_s

`load_config` reads a file (UTF-8 TOML), checks it in two passes (first that
every section and key is known, then every value in declaration order), reads
the cost-model profile it names, and checks that the cluster fits this machine
(`serving.machine`: shared memory, RAM, open files, SSD space, the host).

Anything wrong — an unreadable, binary or non-TOML file, an unknown section or
key, a value of the wrong type or range, a rule across sections, a missing
profile, a cluster larger than the machine — is a one-line ConfigError naming
the file, the section and key, and the value (a record built directly names
the section, key and value); nothing else escapes.

The records pickle (the worker processes and Ray actors receive the config
inside their `WorkerSpec`) and are never mutated: `with_overrides` makes a
checked copy.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import math
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import attrs

from mooncake._checks import ceil_div, shown
from mooncake.cache.hashing import BlockHasher
from mooncake.engine.checkpoint import CONFIG_FILE, read_model_config
from mooncake.engine.config import PRESETS, ModelConfig
from mooncake.errors import ConfigError
from mooncake.sched.router import DEFAULT_THRESHOLD
from mooncake.types import Slo
from serving.machine import Machine, check_machine
from serving.registry import ADMISSIONS, router_problem

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

MAX_INT = 2**63 - 1  # what torch, numpy and the wire formats hold; no count or size comes near it
DAY_S = 86_400.0
_SHOWN = 240  # characters of a value quoted in a message (`mooncake._checks.shown`)
_SAMPLE_BYTES = 1 << 20  # of each weight file's head and tail, in a checkpoint's namespace digest
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _name(key: str) -> str:
    """A TOML key as written: bare when it can be, else quoted (so the message stays one line)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]{1,60}", key) else shown(key, limit=_SHOWN)


def _host(text: str) -> str | None:
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return "must be an IP address or a host name (letters, digits, '-' and '.')"
    return None


def _api_key(text: str) -> str | None:
    if len(text) > 4096 or any(not "!" <= char <= "~" for char in text):
        return "must be at most 4096 visible ASCII characters (no spaces): it travels in an HTTP header"
    return None


def _path(text: str) -> str | None:
    if "\0" in text or len(text) > 4096:
        return "must be a path (no NUL character, at most 4096 characters)"
    return None


def _served_name(text: str) -> str | None:
    if len(text) > 256 or any(not "!" <= char <= "~" for char in text):
        return "must be at most 256 visible ASCII characters (no spaces): clients send it as `model`"
    return None


def _checkpoint(text: str) -> str | None:
    """Why `text` is not a checkpoint directory the loader serves (None: it is, or it is "": none)."""
    if not text:
        return None
    if (reason := _path(text)) is not None:
        return reason
    directory = Path(text)
    try:
        if not directory.is_dir():
            return "is not a directory (a checkpoint in Hugging Face layout)"
        if not (directory / CONFIG_FILE).is_file():
            return f"holds no {CONFIG_FILE} (a checkpoint in Hugging Face layout)"
        _checkpoint_config(str(directory.resolve()))
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    except ConfigError as error:
        return f"not a checkpoint this engine serves: {error}"
    return None


@functools.cache
def _checkpoint_config(directory: str) -> ModelConfig:
    return read_model_config(directory)


@functools.cache
def _checkpoint_digest(directory: str) -> str:
    """A short digest of what identifies a checkpoint without reading all its weights: its config.json, and
    each weight file's name, size and first and last MiB (two fine-tunes of one shape differ there)."""
    root = Path(directory)
    digest = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    for file in sorted(root.glob("*.safetensors*")):
        size = file.stat().st_size
        digest.update(f"\0{file.name}\0{size}\0".encode())
        with file.open("rb") as stream:
            digest.update(stream.read(_SAMPLE_BYTES))
            stream.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(stream.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:12]


@attrs.frozen
class _Rule:
    """What a field accepts: its type, bounds (finite numbers), allowed values or a shape of text."""

    kind: type[Any]
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False  # the minimum is excluded
    allowed: tuple[str, ...] = ()
    text: Callable[[str], str | None] | None = None

    def check(self, where: str, value: Any) -> Any:
        """`value` as the field stores it; `where` (`[section] key = value`) opens the ConfigError."""
        value = self.convert(value)
        if not isinstance(value, self.kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected {self.kind.__name__}")
        if self.allowed and value not in self.allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(self.allowed)}")
        if self.text is not None and (reason := self.text(value)) is not None:
            raise ConfigError(f"{where}: {reason}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number")
        low, high = self.minimum, self.maximum
        if low is not None and (value < low or (self.above and value == low)):
            raise ConfigError(f"{where}: must be {'>' if self.above else '>='} {low}")
        if high is not None and value > high:
            raise ConfigError(f"{where}: must be <= {high}")
        return value

    def convert(self, value: Any) -> Any:
        """An int for a float field becomes a float (an int too large for one stays, for `check`)."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                return math.inf
        return value

    def validate(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        self.check(f"[{instance.NAME}] {attribute.name} = {shown(value, limit=_SHOWN)}", value)


def _setting(
    default: T,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: bool = False,
    allowed: Sequence[str] = (),
    text: Callable[[str], str | None] | None = None,
) -> T:
    """A checked field of the default's type (integers at most MAX_INT unless a maximum is given)."""
    if maximum is None and isinstance(default, int):
        maximum = MAX_INT
    rule = _Rule(type(default), minimum, maximum, above, tuple(allowed), text)
    return attrs.field(default=default, converter=rule.convert, validator=rule.validate, metadata={"rule": rule})


def _seconds(default: float, *, minimum: float = 0.0, maximum: float = DAY_S) -> float:
    """A duration: above `minimum` (0: strictly positive) and at most a day."""
    return _setting(default, minimum=minimum, maximum=maximum, above=minimum == 0.0)


@attrs.frozen(kw_only=True)
class ModelSection:
    """`[model]`: the model served, its dtype and the tokens per KV block.

    The model is a checkpoint directory in Hugging Face layout when `path` is set (then `preset` and `seed`
    are unused), else the `preset` (mooncake.engine.config.PRESETS) with seeded random weights, speaking
    bytes. `served_model_name` is its name in the API (default: the directory's name, or the preset's).
    """

    NAME: ClassVar[str] = "model"
    preset: str = _setting("tiny", allowed=tuple(PRESETS))
    path: str = _setting("", text=_checkpoint)
    served_model_name: str = _setting("", text=_served_name)
    seed: int = _setting(0, minimum=0)
    dtype: str = _setting("float32", allowed=("float32", "bfloat16"))
    block_tokens: int = _setting(16, minimum=1, maximum=65_536)

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint directory, absolute (None: the random preset)."""
        return str(Path(self.path).resolve()) if self.path else None

    @property
    def config(self) -> ModelConfig:
        """The model's shape: the checkpoint's config.json (no weights read), or the preset."""
        return PRESETS[self.preset] if self.checkpoint is None else _checkpoint_config(self.checkpoint)

    @property
    def source(self) -> str:
        """The key that decides the model, as written (`path = '...'` or `preset = '...'`), for messages."""
        return f"path = {self.path!r}" if self.path else f"preset = {self.preset!r}"

    @property
    def served_name(self) -> str:
        """The model's name in the API."""
        return self.served_model_name or (Path(self.checkpoint).name if self.checkpoint else self.preset)

    @property
    def namespace(self) -> str:
        """The block-key namespace's model: the preset's name and its weights' seed, or for a checkpoint its
        served name and a digest of its config.json and weight files (names, sizes, first and last MiB); and the
        dtype the KV is computed in. So the caches of two models never mix, not even through an SSD pool a
        restarted cluster reopens (another seed is another model's KV). The gateway and every worker ask this one
        property."""
        weights = f"seed={self.seed}" if self.checkpoint is None else _checkpoint_digest(self.checkpoint)
        model = self.preset if self.checkpoint is None else self.served_name
        return f"{model}@{weights}/{self.dtype}"

    def hasher(self) -> BlockHasher:
        """The cluster's block keys: in this namespace, of `block_tokens` tokens. The gateway, every worker, the
        Conductor and the simulated twin key prompts with this one hasher, so their keys always match."""
        return BlockHasher(model=self.namespace, block_size_tokens=self.block_tokens)


@attrs.frozen(kw_only=True)
class ClusterSection:
    """`[cluster]`: engine counts, the gateway's host and port (0: any free port), the API key ("": none), and
    `pin_cores` ("auto": each local engine process on cores of its own when this machine has enough, the
    launcher and its gateway on the rest; "off": the operating system places them)."""

    NAME: ClassVar[str] = "cluster"
    num_prefill: int = _setting(2, minimum=1, maximum=1024)
    num_decode: int = _setting(1, minimum=1, maximum=1024)
    host: str = _setting("127.0.0.1", text=_host)
    port: int = _setting(8000, minimum=0, maximum=65_535)
    api_key: str = _setting("", text=_api_key)
    pin_cores: str = _setting("off", allowed=("off", "auto"))


@attrs.frozen(kw_only=True)
class CacheSection:
    """`[cache]`, per node: DRAM blocks, SSD blocks (0: no SSD tier) and their folder ("": a temporary one)."""

    NAME: ClassVar[str] = "cache"
    dram_blocks: int = _setting(512, minimum=4)
    ssd_blocks: int = _setting(0, minimum=0)
    ssd_dir: str = _setting("", text=_path)


@attrs.frozen(kw_only=True)
class PolicySection:
    """`[policy]`: the router (by name, or FILE.py:FACTORY) and admission policy by name, and the cache-aware
    router's threshold."""

    NAME: ClassVar[str] = "policy"
    router: str = _setting("kvcache_centric", text=router_problem)
    admission: str = _setting("early_rejection", allowed=tuple(ADMISSIONS))
    threshold: float = _setting(DEFAULT_THRESHOLD, minimum=1.0)


@attrs.frozen(kw_only=True)
class SloSection:
    """`[slo]`: the time-to-first-token and time-between-tokens objectives."""

    NAME: ClassVar[str] = "slo"
    ttft_s: float = _seconds(Slo().ttft_s)  # the library's objective; the TBT one is the CPU model's pace
    tbt_s: float = _seconds(0.5)

    def objectives(self) -> Slo:
        """The section as the library's `Slo`: what the Conductor admits against and what a summary scores."""
        return Slo(ttft_s=self.ttft_s, tbt_s=self.tbt_s)


@attrs.frozen(kw_only=True)
class PrefillSection:
    """`[prefill]`: tokens per prefill chunk; a fitted cost model's JSON ("": the analytic CPU model); the
    processes of each prefill instance (> 1: a chunked pipeline group of that many stages, each a slice of the
    layers; the gateway still sees one instance)."""

    NAME: ClassVar[str] = "prefill"
    chunk_tokens: int = _setting(512, minimum=1)
    profile: str = _setting("", text=_path)
    pipeline_size: int = _setting(1, minimum=1, maximum=1024)


@attrs.frozen(kw_only=True)
class DecodeSection:
    """`[decode]`: requests per batch and tokens per request's context."""

    NAME: ClassVar[str] = "decode"
    max_batch_size: int = _setting(8, minimum=1)
    max_context_tokens: int = _setting(2048, minimum=2)


@attrs.frozen(kw_only=True)
class LimitsSection:
    """`[limits]`: what one request and one client may take, and the gateway's clocks.

    The longest prompt, a completion's default output and how long a request may wait for a token; the
    health loop's period and the cap of its backoff for a worker that does not
    answer (`health_probe_backoff_max_s`, at least the period); the time a
    client has to send its headers and its body; open connections in all and
    per client address; how long a request the decode side has no room for may wait for it before
    its prefill (`admission_wait_s`, within its TTFT objective, first come, first served:
    `sched.waiting.AdmissionQueue`; 0 rejects it at once, as the paper's Conductor does).
    """

    NAME: ClassVar[str] = "limits"
    max_prompt_tokens: int = _setting(1024, minimum=1)
    default_max_tokens: int = _setting(16, minimum=1)
    request_timeout_s: float = _seconds(60.0)
    health_interval_s: float = _seconds(0.5, minimum=0.01, maximum=3600.0)  # shorter is a busy loop
    header_timeout_s: float = _seconds(10.0, maximum=3600.0)
    body_timeout_s: float = _seconds(30.0)
    max_connections: int = _setting(1024, minimum=1, maximum=1_000_000)
    # As many as in all: one client may use them all, as on vLLM's server, which has no per-client cap (its
    # `vllm bench serve` opens a connection per request in flight, all from one address).
    max_connections_per_client: int = _setting(1024, minimum=1, maximum=1_000_000)
    health_probe_backoff_max_s: float = _seconds(5.0, minimum=0.01, maximum=3600.0)
    admission_wait_s: float = _setting(30.0, minimum=0.0, maximum=DAY_S)


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

    Invariants (the rules across sections, checked at construction):
        `limits.max_prompt_tokens + limits.default_max_tokens <= decode.max_context_tokens`;
        `decode.max_context_tokens <= model.config.max_context_tokens` where a checkpoint sets one;
        `prefill.pipeline_size <= model.config.num_layers`;
        `ceil(limits.max_prompt_tokens / model.block_tokens) <= cache.dram_blocks`;
        `limits.health_interval_s <= limits.health_probe_backoff_max_s`.
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

    @property
    def max_output_tokens(self) -> int:
        """The most tokens one request may ask for: what a decode slot's context leaves after a one-token prompt
        (a request's prompt and `max_tokens` together fit the context, as in vLLM: the gateway checks that).
        The metrics' output buckets end there."""
        return self.decode.max_context_tokens - 1

    def __attrs_post_init__(self) -> None:
        limits, decode, source = self.limits, self.decode, self.source
        if limits.max_prompt_tokens + limits.default_max_tokens > decode.max_context_tokens:
            raise ConfigError(
                f"{source}: [limits] max_prompt_tokens + default_max_tokens = {limits.max_prompt_tokens} + "
                f"{limits.default_max_tokens} exceed [decode] max_context_tokens = {decode.max_context_tokens}"
            )
        bound = self.model.config.max_context_tokens  # a checkpoint's: vLLM's max_model_len
        if bound is not None and decode.max_context_tokens > bound:
            raise ConfigError(
                f"{source}: [decode] max_context_tokens = {decode.max_context_tokens} exceeds the "
                f"max_context_tokens = {bound} of [model] {self.model.source} (from its max_position_embeddings, as "
                "vLLM refuses a max_model_len above them)"
            )
        layers = self.model.config.num_layers
        if self.prefill.pipeline_size > layers:
            raise ConfigError(
                f"{source}: [prefill] pipeline_size = {self.prefill.pipeline_size}: must be <= the {layers} layers "
                f"of [model] {self.model.source} (a pipeline stage holds at least one layer)"
            )
        blocks = ceil_div(limits.max_prompt_tokens, self.model.block_tokens)
        if blocks > self.cache.dram_blocks:
            # Prefill pins a whole prompt's pages in its node's DRAM: a longer one could never be served.
            raise ConfigError(
                f"{source}: [limits] max_prompt_tokens = {limits.max_prompt_tokens}: a prompt of "
                f"{blocks} blocks of [model] block_tokens = {self.model.block_tokens} does not fit pinned in "
                f"[cache] dram_blocks = {self.cache.dram_blocks}"
            )
        if limits.health_probe_backoff_max_s < limits.health_interval_s:
            raise ConfigError(
                f"{source}: [limits] health_probe_backoff_max_s = {limits.health_probe_backoff_max_s}: "
                f"must be >= health_interval_s = {limits.health_interval_s}"
            )

    def objectives(self) -> Slo:
        """The objectives the gateway's Conductor admits against: `[slo]`'s, the TTFT one capped at
        `[limits] request_timeout_s` (a first token later than that is a 504, so no request is accepted, or left
        waiting for room, on a longer estimate). A summary scores `[slo]` itself (`SloSection.objectives`)."""
        slo = self.slo.objectives()
        return attrs.evolve(slo, ttft_s=min(slo.ttft_s, self.limits.request_timeout_s))

    def with_overrides(self, section: str, **values: Any) -> ClusterConfig:
        """A copy with some keys of `section` replaced (checked like the file's, without the machine: a caller
        that starts the cluster here checks it with `check_machine`).

        Raises:
            ConfigError: an unknown section or key, a value out of bounds, or a `[prefill] profile` given that
                cannot be read (found now, not by a worker at start).
        """
        data: dict[str, Any] = {name: attrs.asdict(getattr(self, name)) for name in SECTIONS}
        data[section] = {**data.get(section, {}), **values}  # an unknown section is parse's ConfigError
        config = parse(data, self.source)
        if section == "prefill" and "profile" in values:
            _check_profile(config)
        return config


def parse(data: Mapping[str, Any], source: str) -> ClusterConfig:
    """Check `data` (a parsed TOML document) against the sections' records and fill in defaults.

    Raises:
        ConfigError: naming `source`, the section and key, and the value.
    """
    for section, keys in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{_name(section)}] (known: {', '.join(SECTIONS)})")
        if not isinstance(keys, dict):
            raise ConfigError(f"{source}: [{section}] = {shown(keys, limit=_SHOWN)}: must be a table")
        known = [field.name for field in attrs.fields(SECTIONS[section])]
        for key, value in keys.items():
            if key not in known:
                raise ConfigError(
                    f"{source}: [{section}] {_name(key)} = {shown(value, limit=_SHOWN)}: unknown key (known: {', '.join(known)})"
                )
    records: dict[str, Any] = {}
    for section, record in SECTIONS.items():
        given = data.get(section, {})
        values = {
            # Checked here, before the record's own validators, so that the message shows the value as written.
            field.name: field.metadata["rule"].check(
                f"{source}: [{section}] {field.name} = {shown(given[field.name], limit=_SHOWN)}", given[field.name]
            )
            for field in attrs.fields(record)
            if field.name in given
        }
        records[section] = record(**values)
    return ClusterConfig(source=source, **records)


def _document(path: str | Path) -> dict[str, Any]:
    """The file's TOML document; any failure to read or parse it is a ConfigError naming the file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config: {error.strerror or error}") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(
            f"{path}: not a UTF-8 text file: byte {raw[error.start]:#04x} on line {line} (a TOML config is text)"
        ) from error
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
    except ValueError as error:  # tomllib lets int()'s digit limit through
        raise ConfigError(
            f"{path}: not valid TOML: an integer of over {sys.get_int_max_str_digits()} digits"
        ) from error
    except RecursionError as error:
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from error


def _check_profile(config: ClusterConfig) -> None:
    """The fitted cost models `[prefill] profile` names can be read, and were measured for this cluster's engines
    (`serving.models.check_measured_for`; the gateway reads them at start)."""
    if not config.prefill.profile:
        return
    from serving.models import read_profile  # models imports this module

    try:
        read_profile(config.prefill.profile, config=config)
    except ConfigError as error:
        raise ConfigError(f"{config.source}: {error}") from error


def load_config(path: str | Path, *, machine: Machine | None = None) -> ClusterConfig:
    """Read and check a cluster config file, and that the cluster fits the machine.

    Args:
        path: the TOML file.
        machine: the resources to fit (default: this machine's, read now; `Machine()` knows none and
            checks nothing, for a cluster whose nodes run elsewhere).

    Raises:
        ConfigError: unreadable, not UTF-8, not TOML (with its line), a field out of bounds, a rule across
            sections broken, an unreadable profile, or a cluster larger than the machine.
    """
    config = parse(_document(path), str(path))
    _check_profile(config)
    check_machine(config, Machine.here() if machine is None else machine)
    return config
