"""What this machine offers a cluster, and whether a config fits in it.

A config can be sound and still impossible here: `[cache] dram_blocks =
4000000` asks every node for 4,000,000 pages of shared memory. `Machine`
holds the figures that bound a local cluster — free shared memory
(`/dev/shm`), available RAM (`MemAvailable`), the open-file limit — read once
by `Machine.here()`; a figure that cannot be read is `None` and its check is
skipped. `check_machine` compares a config's demands against them, every node
on this machine (the local backend, and a Ray cluster started here):

    shared memory   nodes × dram_blocks × page bytes              <= /dev/shm free
    RAM             that + nodes × weight bytes
                    + decode nodes × max_batch_size × max_context_tokens × KV bytes per token
                    + processes (nodes and CPP stages) × PROCESS_BYTES
                                                                  <= MemAvailable
    file limit      limits.max_connections + FD_RESERVE           <= RLIMIT_NOFILE (hard)
    SSD             nodes × ssd_blocks × page bytes               <= free disk in ssd_dir
    host            the gateway can bind [cluster] host

(page bytes = the model's KV bytes per token × block_tokens, what a worker's
`KvLayout.page_bytes` is). Each failure is a ConfigError naming the file, the
key, its value, the bytes asked and the bytes there are.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from mooncake.errors import ConfigError

if TYPE_CHECKING:
    from serving.config import ClusterConfig

__all__ = [
    "FD_RESERVE",
    "MAX_LINGERING",
    "Machine",
    "check_machine",
    "check_port_free",
    "connection_budget",
    "page_bytes",
]

MAX_LINGERING = 256
"""Refused connections the gateway keeps open for a moment, so their answer arrives before the close."""
FD_RESERVE = 128 + MAX_LINGERING
"""File descriptors the gateway keeps beside its clients' connections: its own (workers' sockets, logs,
libraries: 128) and the refused connections still lingering."""

PROCESS_BYTES = 256 << 20
"""What one engine process holds besides its weights and caches: an interpreter with torch imported."""
SHM = "/dev/shm"


def connection_budget(max_connections: int) -> int:
    """The client connections the gateway in this process may hold: `max_connections`, with the soft
    RLIMIT_NOFILE raised (up to the hard limit) to hold them and `FD_RESERVE` more.

    The one answer to "how many connections fit the file limit": `check_machine` refuses a config whose
    `max_connections + FD_RESERVE` exceeds the hard limit, so a checked config gets all it asks for; an
    unchecked one (a hard limit lowered since) gets what fits, never a number that exhausts descriptors.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - FD_RESERVE))


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as stream:
            for line in stream:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@attrs.frozen(kw_only=True)
class Machine:
    """Resources a local cluster draws on; `None` where unknown (that check is skipped).

    Attributes:
        shm_free_bytes: free space of /dev/shm, where every node's DRAM pool lives.
        ram_available_bytes: the kernel's MemAvailable.
        open_files_limit: the hard RLIMIT_NOFILE (the gateway may raise its soft limit to it).
        is_here: the figures are this machine's, so the folders a config names
            (`[cache] ssd_dir`) and its `[cluster] host` are checked as well.
    """

    shm_free_bytes: int | None = None
    ram_available_bytes: int | None = None
    open_files_limit: int | None = None
    is_here: bool = False

    @classmethod
    def here(cls) -> Machine:
        """This machine's figures, read now."""
        try:
            stat = os.statvfs(SHM)
            shm: int | None = stat.f_bavail * stat.f_frsize
        except OSError:
            shm = None
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        files = None if hard == resource.RLIM_INFINITY else hard
        return cls(
            shm_free_bytes=shm, ram_available_bytes=_meminfo_bytes("MemAvailable"), open_files_limit=files, is_here=True
        )


def page_bytes(config: ClusterConfig) -> int:
    """Bytes of one KV page (a block of `[model] block_tokens` tokens, every layer's K and V)."""
    shape = config.model.config.shape(config.model.dtype)
    return shape.kv_bytes_per_token * config.model.block_tokens


def _bytes(count: float) -> str:
    return f"{count:,.0f} bytes"


def check_machine(config: ClusterConfig, machine: Machine) -> None:
    """Refuse a config that cannot run on `machine` (see the module docstring).

    Raises:
        ConfigError: naming the file, the key and value, what is asked and what there is.
    """
    source, cache, decode = config.source, config.cache, config.decode
    nodes = config.cluster.num_prefill + config.cluster.num_decode
    page = page_bytes(config)
    shape = config.model.config.shape(config.model.dtype)
    pools = nodes * cache.dram_blocks * page
    where = f"{source}: [cache] dram_blocks = {cache.dram_blocks}"
    if machine.shm_free_bytes is not None and pools > machine.shm_free_bytes:
        raise ConfigError(
            f"{where}: {nodes} nodes × {cache.dram_blocks:,} pages × {page:,} bytes = {_bytes(pools)} of shared "
            f"memory asked, {_bytes(machine.shm_free_bytes)} free in {SHM}"
        )
    weights = nodes * shape.weight_bytes
    # what the decode engines' KV tensors take: each allocates max_batch_size slots of max_context_tokens
    # (engine.decode), whatever budget the decode rule admits against
    slots = config.cluster.num_decode * decode.max_batch_size * decode.max_context_tokens * shape.kv_bytes_per_token
    processes = (nodes + config.cluster.num_prefill * (config.prefill.pipeline_size - 1)) * PROCESS_BYTES
    ram = pools + weights + slots + processes
    if machine.ram_available_bytes is not None and ram > machine.ram_available_bytes:
        # Name the largest demand: the key to lower first.
        largest = max(
            (pools, where),
            (
                slots,
                f"{source}: [decode] max_batch_size = {decode.max_batch_size}, "
                f"max_context_tokens = {decode.max_context_tokens}",
            ),
            (weights, f"{source}: [model] {config.model.source} on {nodes} nodes"),
            (processes, f"{source}: [prefill] pipeline_size = {config.prefill.pipeline_size} on {nodes} nodes"),
        )[1]
        raise ConfigError(
            f"{largest}: {_bytes(ram)} of RAM asked ({_bytes(pools)} of DRAM pools, {_bytes(weights)} of weights, "
            f"{_bytes(slots)} of decode KV slots, {_bytes(processes)} for the processes themselves), "
            f"{_bytes(machine.ram_available_bytes)} available"
        )
    wanted = config.limits.max_connections + FD_RESERVE
    if machine.open_files_limit is not None and wanted > machine.open_files_limit:
        raise ConfigError(
            f"{source}: [limits] max_connections = {config.limits.max_connections}: needs {wanted:,} open files "
            f"(with {FD_RESERVE} for the gateway itself and refusals), the limit (RLIMIT_NOFILE) is "
            f"{machine.open_files_limit:,}"
        )
    if machine.is_here:
        _check_ssd(config, nodes * cache.ssd_blocks * page)
        _check_host(config)


def _check_ssd(config: ClusterConfig, asked: int) -> None:
    cache = config.cache
    folder = cache.ssd_dir or tempfile.gettempdir()
    where = f"{config.source}: [cache] ssd_dir = {cache.ssd_dir!r}"
    if cache.ssd_dir and not Path(folder).is_dir():
        raise ConfigError(f"{where}: not a folder")
    if not cache.ssd_blocks:
        return
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: the folder {folder} is not writable")
    try:
        free = shutil.disk_usage(folder).free
    except OSError as error:
        raise ConfigError(f"{where}: cannot read the free space of {folder}: {error.strerror}") from error
    if asked > free:
        raise ConfigError(
            f"{config.source}: [cache] ssd_blocks = {cache.ssd_blocks}: {_bytes(asked)} of disk asked, "
            f"{_bytes(free)} free in {folder}"
        )


def check_port_free(config: ClusterConfig) -> None:
    """At launch, before any worker starts: the gateway's `[cluster] port` (unless 0, any free one) is not taken.
    Bound as the gateway will bind it (address reuse on, as aiohttp's server: a port in TIME_WAIT is free).

    Raises:
        ConfigError: naming the file, the key and the value, when something listens there already.
    """
    host, port = config.cluster.host, config.cluster.port
    if port == 0:
        return
    try:
        _bind_probe(host, port, reuse_address=True)
    except (UnicodeError, socket.gaierror):
        return  # the host is `_check_host`'s to name
    except OSError as error:
        raise ConfigError(
            f"{config.source}: [cluster] port = {port}: {host}:{port} is taken ({error.strerror}): another "
            "cluster or server listens there; give another port, or 0 for any free one"
        ) from error


def _check_host(config: ClusterConfig) -> None:
    """The gateway must be able to listen on `[cluster] host` (any port: the configured one may be busy now)."""
    host = config.cluster.host
    where = f"{config.source}: [cluster] host = {host!r}"
    try:
        _bind_probe(host, 0, reuse_address=False)
    except (UnicodeError, socket.gaierror) as error:
        raise ConfigError(f"{where}: not an address of this machine ({error})") from error
    except OSError as error:
        raise ConfigError(f"{where}: cannot listen there ({error.strerror})") from error


def _bind_probe(host: str, port: int, *, reuse_address: bool) -> None:
    """Bind, then release, every address `host` resolves to at `port`, as the gateway's server binds them all.

    Raises:
        socket.gaierror, UnicodeError: `host` names no address; OSError: one cannot be bound (taken, not ours).
    """
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with contextlib.closing(socket.socket(family, kind, proto)) as probe:
            if reuse_address:  # as aiohttp's server: a port in TIME_WAIT is free
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's server: the IPv6 socket does not take IPv4 too
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
