"""The vLLM router's TOML config: `[router]` and one `[[instances]]` table per vLLM server.

    [router]
    host = "127.0.0.1"        # where the router listens
    port = 0                  # 0: any free port
    policy = "kvcache_centric" # a router by name (serving.registry.ROUTERS), or FILE.py:FACTORY
    admission = "early_rejection"
    block_size = 32           # the servers' --block-size
    tokenizer = "/models/x"   # a directory with the served model's tokenizer
    ttft_slo_s = 2.0          # estimated TTFT above this: 429 with Retry-After
    api_key = ""              # "": none; else clients send `Authorization: Bearer KEY`
    server_api_key = ""       # the servers' --api-key ("": none; else sent to them in place of the client's)
    ...                       # timeouts and the rest: `RouterSection`

    [[instances]]
    url = "http://10.0.0.5:8000"       # the vLLM server
    kv_events = "tcp://0.0.0.0:5557"   # where the router binds for its KV events (vLLM connects)
    replay = "tcp://10.0.0.5:5558"     # its replay socket ("": none: a missed batch is lost)
    role = "both"                      # both | prefill | decode
    kv_group = 0                       # the KV-cache group whose events are read: a full-attention one

`kv_group`: vLLM publishes each KV-cache group's blocks; a hybrid model with
sliding-window layers has several groups, which lose blocks independently, and
only a full-attention group's say which prefixes vLLM can reuse. vLLM numbers
the groups in the order of each layer kind's first layer: 0 for a model of one
kind, 1 for gpt-oss and Gemma 2 (layer 0 slides), 5 for Gemma-3-12B and 6 for
Gemma 3's 1B, 4B and 27B (docs/vllm.md says how to find it for another model;
the router logs the group to set when the one read is not full attention).

Checked as `serving.config` checks the cluster's (the same field rules): an
unknown key, a value of the wrong type or out of range, a `kv_events` without a
port or a `replay` without a host and port (`*`: only vLLM's side binds there),
a ZeroMQ port outside 1..65535 (ZeroMQ would bind or reach another one), two
instances with one URL, one events endpoint or one replay socket (`""`, none,
may repeat), a role mix that cannot serve (a prefill instance without a decode
one), a tokenizer directory without a tokenizer: a one-line `ConfigError`
naming the file, the table and key, and the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import attrs
from serving.config import _SHOWN, _api_key, _document, _host, _name, _path, _seconds, _setting
from serving.registry import ADMISSIONS, router_problem
from vllm_events import zmq_port_problem

from mooncake._checks import shown
from mooncake.errors import ConfigError
from mooncake.sched.router import DEFAULT_THRESHOLD
from mooncake.types import Slo

__all__ = ["InstanceSection", "RouterConfig", "RouterSection", "load_router_config", "parse_router_config"]

ROLES = ("both", "prefill", "decode")
_ZMQ = re.compile(r"tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):(\*|\d{1,5})")


def _url(text: str) -> str | None:
    """`url`: a server's root, to which the router appends its paths (`/v1/completions`): a query, a fragment or
    credentials would end up before them or be dropped, and port 0 names no server."""
    try:
        parts = urlsplit(text)
        parts.hostname  # noqa: B018  (read: a bracketed host that is no IPv6 address raises here)
    except ValueError as error:  # an unclosed or bad IPv6 bracket: urllib's "Invalid IPv6 URL"
        return f"is not a URL ({error}): write http://HOST:PORT, an IPv6 host in brackets (http://[::1]:8000)"
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return "must be an http:// or https:// URL of a server (http://HOST:PORT, no path)"
    if parts.query or parts.fragment or text.endswith(("?", "#")) or parts.username is not None:
        return "must be the server's root, http://HOST:PORT: no query (?), fragment (#) or user@"
    try:
        port = parts.port
    except ValueError:
        return "has a port that is not a number in 1..65535"
    if port == 0:
        return "has port 0, which names no server: the port must be in 1..65535"
    return None


def _endpoint(text: str) -> str | None:
    """`kv_events`: an endpoint the router binds (host `*`: every interface), at the port vLLM connects to."""
    match = _ZMQ.fullmatch(text)
    if match is None:
        return "must be a ZeroMQ TCP endpoint, tcp://HOST:PORT (the address vLLM's kv-events-config names)"
    if match[2] == "*":
        return "needs a port: vLLM connects to the one its kv-events-config endpoint names (`*` binds a random one)"
    return zmq_port_problem(match[2])


def _replay_endpoint(text: str) -> str | None:
    """`replay`: the server's replay socket, which the router connects to: a host and a port, not `*`."""
    if not text:
        return None
    match = _ZMQ.fullmatch(text)
    if match is None:
        return 'must be a ZeroMQ TCP endpoint, tcp://HOST:PORT (the server\'s replay socket), or "" for none'
    if "*" in (match[1], match[2]):
        return (
            "names where the router connects to the server's replay socket: its host and port (vLLM's "
            "replay_endpoint tcp://*:PORT is where vLLM binds; here write tcp://SERVER_HOST:PORT)"
        )
    return zmq_port_problem(match[2])


def _directory(text: str) -> str | None:
    if (reason := _path(text)) is not None:
        return reason
    if not text:
        return "must name the directory of the served model's tokenizer (tokenizer.json or tokenizer_config.json)"
    folder = Path(text)
    if not folder.is_dir():
        return "is not a directory"
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return "holds no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)"
    return None


@attrs.frozen(kw_only=True)
class RouterSection:
    """`[router]`: where it listens, the policies, the instances' block size and tokenizer, the objective.

    `health_interval_s`: how often each instance's `/health` and `/metrics` are read (each within
    `connect_timeout_s`); `health_failures`: the consecutive failed `/health` checks that mark an instance down
    (a `/metrics` that fails or is slow leaves its load as last read: it says nothing of the server's health; a
    request that cannot reach a server marks it down at once); `request_timeout_s`: the
    longest a request may take end to end, both steps of a disaggregated pair and any retries together (504
    after, and the server stays up: slow is not gone); `connect_timeout_s`: to reach an instance (a failure
    marks it down and the request goes elsewhere if nothing was streamed); `max_retries`: other instances tried;
    `calibration_tokens`: the longest of the prefills timed on each server at start-up (0: none, the prefill
    model starts from its prior).
    """

    NAME: ClassVar[str] = "router"
    host: str = _setting("127.0.0.1", text=_host)
    port: int = _setting(8000, minimum=0, maximum=65_535)
    policy: str = _setting("kvcache_centric", text=router_problem)
    admission: str = _setting("early_rejection", allowed=tuple(ADMISSIONS))
    threshold: float = _setting(DEFAULT_THRESHOLD, minimum=1.0)
    block_size: int = _setting(16, minimum=1, maximum=65_536)
    tokenizer: str = _setting("", text=_directory)
    ttft_slo_s: float = _seconds(Slo().ttft_s)  # the library's objective
    api_key: str = _setting("", text=_api_key)
    server_api_key: str = _setting("", text=_api_key)
    health_interval_s: float = _seconds(1.0)
    health_failures: int = _setting(2, minimum=1, maximum=1000)
    request_timeout_s: float = _seconds(600.0)
    connect_timeout_s: float = _seconds(2.0)
    max_retries: int = _setting(2, minimum=0, maximum=64)
    default_max_tokens: int = _setting(256, minimum=1)
    calibration_tokens: int = _setting(1024, minimum=0, maximum=1 << 20)


@attrs.frozen(kw_only=True)
class InstanceSection:
    """One `[[instances]]` table: a vLLM server, the endpoint the router binds for its KV events, its replay
    socket, its role and the KV-cache group whose events are read (see the module docstring)."""

    NAME: ClassVar[str] = "instances"
    url: str = _setting("", text=_url)
    kv_events: str = _setting("", text=_endpoint)
    replay: str = _setting("", text=_replay_endpoint)
    role: str = _setting("both", allowed=ROLES)
    kv_group: int = _setting(0, minimum=0, maximum=1023)

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@attrs.frozen(kw_only=True)
class RouterConfig:
    """The whole file: the router and its instances (at least one), with `source` the file it came from."""

    source: str
    router: RouterSection
    instances: tuple[InstanceSection, ...]

    def __attrs_post_init__(self) -> None:
        if not self.instances:
            raise ConfigError(f"{self.source}: no [[instances]]: the router needs at least one vLLM server")
        # A replay socket shared by two tables would fill the second server's index with the first's blocks.
        for field in ("base_url", "kv_events", "replay"):
            seen: dict[str, int] = {}
            for number, instance in enumerate(self.instances):
                value = getattr(instance, field)
                if not value:  # replay "": no socket, which any number of servers may have
                    continue
                if value in seen:
                    raise ConfigError(
                        f"{self.source}: [[instances]] {number} {field.replace('base_url', 'url')} = {value!r}: "
                        f"the same as instance {seen[value]}'s (each server is listed once, with its own endpoint)"
                    )
                seen[value] = number
        roles = {instance.role for instance in self.instances}
        if ("prefill" in roles) != ("decode" in roles):
            missing = "decode" if "prefill" in roles else "prefill"
            raise ConfigError(
                f"{self.source}: [[instances]] roles {sorted(roles)}: prefill and decode instances come in pairs "
                f'(add a {missing} instance, or make them role = "both")'
            )

    @property
    def instance_ids(self) -> tuple[str, ...]:
        """The instances' ids in the router, its metrics and its logs: `vllm-0`, `vllm-1`, ... in file order."""
        return tuple(f"vllm-{number}" for number in range(len(self.instances)))


def parse_router_config(data: Mapping[str, Any], source: str) -> RouterConfig:
    """Check `data` (a parsed TOML document) and fill in defaults.

    Raises:
        ConfigError: naming `source`, the table and key, and the value.
    """
    for section in data:
        if section not in ("router", "instances"):
            raise ConfigError(f"{source}: unknown section [{_name(section)}] (known: router, [[instances]])")
    router = data.get("router", {})
    if not isinstance(router, dict):
        raise ConfigError(f"{source}: [router] = {shown(router, limit=_SHOWN)}: must be a table")
    instances = data.get("instances", [])
    if not isinstance(instances, list) or not all(isinstance(table, dict) for table in instances):
        raise ConfigError(f"{source}: instances = {shown(instances, limit=_SHOWN)}: must be [[instances]] tables")
    return RouterConfig(
        source=source,
        router=_record(RouterSection, router, f"{source}: [router]"),
        instances=tuple(
            _record(InstanceSection, table, f"{source}: [[instances]] {number}")
            for number, table in enumerate(instances)
        ),
    )


def _record(record: Any, given: Mapping[str, Any], where: str) -> Any:
    fields = attrs.fields(record)
    known = [field.name for field in fields]
    for key, value in given.items():
        if key not in known:
            raise ConfigError(
                f"{where} {_name(key)} = {shown(value, limit=_SHOWN)}: unknown key (known: {', '.join(known)})"
            )
    values = {
        field.name: field.metadata["rule"].check(
            f"{where} {field.name} = {shown(given[field.name], limit=_SHOWN)}", given[field.name]
        )
        for field in fields
        if field.name in given
    }
    for field in fields:  # required keys (those whose default no server has)
        if field.name not in given and field.name in ("url", "kv_events", "tokenizer"):
            raise ConfigError(f"{where}: {field.name} is required")
    return record(**values)


def load_router_config(path: str | Path) -> RouterConfig:
    """Read and check a router config file.

    Raises:
        ConfigError: unreadable, not UTF-8, not TOML (with its line), or any field or rule broken.
    """
    return parse_router_config(_document(path), str(path))
