"""Transfer requests, their status, the slices transports move, and the engine's config."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from mooncake._checks import int_at_least, plain_int, require_bool, require_int, require_number, require_str, shown
from mooncake.errors import ConfigError, TransferError

TRANSPORTS = ("shm", "rdma", "tcp")  # the kinds an engine can move bytes by, fastest first

__all__ = [
    "EngineConfig",
    "RequestState",
    "RequestStatus",
    "Slice",
    "TransferOp",
    "TransferRequest",
    "Transport",
]


class TransferOp(enum.Enum):
    """A transfer's direction: READ pulls a peer's bytes into a local region, WRITE pushes local bytes to a peer."""

    READ = "read"  # remote → local
    WRITE = "write"  # local → remote


MAX_REGION_ID = 2**32 - 1  # the wire's region field
MAX_OFFSET = 2**62  # far beyond any memory, and safe from overflow in offset + length


def _region_id(_instance: object, attribute: Any, value: Any) -> None:
    if require_int(attribute.name, value, minimum=0) > MAX_REGION_ID:
        raise ConfigError(f"{attribute.name} must be at most {MAX_REGION_ID}, got {shown(value)}")


def _offset(_instance: object, attribute: Any, value: Any) -> None:
    if require_int(attribute.name, value, minimum=0) > MAX_OFFSET:
        raise ConfigError(f"{attribute.name} must be at most 2**62, got {shown(value)}")


def _op(_instance: object, attribute: Any, value: Any) -> None:
    # An op that is no TransferOp was sent as a READ whose answer nobody read: DONE with nothing moved.
    if not isinstance(value, TransferOp):
        raise ConfigError(f"{attribute.name} must be TransferOp.READ or TransferOp.WRITE, got {shown(value)}")


def _peer(_instance: object, attribute: Any, value: Any) -> None:
    require_str(attribute.name, value, what="peer name (an engine's address)")


@attrs.frozen(kw_only=True)
class TransferRequest:
    """Move `length` bytes between a local region and a peer's region."""

    # Integers are kept as Python ints (numpy's too): a numpy int64 offset + length would wrap in the bounds checks.
    op: TransferOp = attrs.field(validator=_op)
    local_region: int = attrs.field(converter=plain_int, validator=_region_id)
    local_offset: int = attrs.field(converter=plain_int, validator=_offset)
    peer: str = attrs.field(validator=_peer)
    remote_region: int = attrs.field(converter=plain_int, validator=_region_id)
    remote_offset: int = attrs.field(converter=plain_int, validator=_offset)
    length: int = attrs.field(converter=plain_int, validator=_offset)


class RequestState(enum.Enum):
    """Where a transfer request stands: PENDING until it is DONE or has FAILED (then for good)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@attrs.frozen
class RequestStatus:
    """Where one request of a batch stands; `error` is set when it failed."""

    state: RequestState
    error: TransferError | None = None
    transport: str = ""


@attrs.define(eq=False)
class Slice:
    """A contiguous piece of one request, moved by one transport in one go.

    `local` is the local bytes (read into for READ, sent for WRITE); `on_done`
    is called exactly once, with None on success or the error.
    """

    op: TransferOp
    local: memoryview
    remote_region: int
    remote_offset: int
    on_done: Callable[[TransferError | None], None]


class Transport(Protocol):
    """Moves slices to or from one peer."""

    name: str

    def submit(self, piece: Slice) -> None:
        """Start moving `piece`; its `on_done` reports the outcome."""

    def run_inline(self, piece: Slice, *, deadline: float | None = None) -> TransferError | None:
        """Move `piece` in the calling thread, giving up at `deadline` (time.monotonic); None on success."""

    def close(self) -> None:
        """Stop; slices not yet moved fail."""


def _default_streams() -> int:
    return max(2, min(8, (os.cpu_count() or 2) // 2))


MAX_TIMEOUT_S = 1e6  # about 11.6 days: poll() takes at most 2**31 - 1 ms (24.8 days); past it, OverflowError
# Counts the system takes as a C int (setsockopt's buffer sizes) or that feed float sums (retries times timeouts,
# spin microseconds): past it, setsockopt failed at the first connection and the sums overflowed.
_C_INT = 2**31


def _timeout_s(_instance: object, attribute: Any, value: Any) -> None:
    """A positive, finite number of seconds that every wait the engine makes with it can take (poll, select and
    socket timeouts overflow far below what a float holds)."""
    if require_number(attribute.name, value, minimum=0, strict=True) > MAX_TIMEOUT_S:
        raise ConfigError(f"{attribute.name} must be at most {MAX_TIMEOUT_S:g} s, got {shown(value)}")


def _port(_instance: object, attribute: Any, value: Any) -> None:
    if require_int(attribute.name, value, minimum=0) > 65535:
        raise ConfigError(f"{attribute.name} must be a TCP port, 0 (any free one) to 65535, got {shown(value)}")


def _host(_instance: object, attribute: Any, value: Any) -> None:
    require_str(attribute.name, value, what="host name or address")


def _flag(_instance: object, attribute: Any, value: Any) -> None:
    require_bool(attribute.name, value)


def _transports(value: Any) -> tuple[str, ...]:
    """Names of transports, in order of preference: a non-empty sequence of `TRANSPORTS` (a ConfigError naming the
    field for anything else; a lone "tcp" would read as t, c, p, and None or 5 failed in `tuple`)."""
    names = tuple(value) if isinstance(value, list | tuple) else None
    if not names or not all(isinstance(name, str) and name in TRANSPORTS for name in names):
        raise ConfigError(f"transports must be a non-empty sequence of {', '.join(TRANSPORTS)}; got {shown(value)}")
    return names


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How a transfer engine listens, slices, retries and checks.

    Attributes:
        host, port: where it listens (port 0: any free port); 127.0.0.1 unless told otherwise.
        streams_per_peer: TCP connections (and worker threads) per peer; by default half the
            CPUs, 2 to 8 (on loopback, more streams than cores only add contention).
        slice_bytes: large requests are cut into slices of this size, spread over the streams.
        max_frame_bytes: the largest data frame accepted from a peer.
        io_timeout_s: a socket operation that takes longer fails (and is retried); on a
            served connection, each part of a frame (header, payload) must arrive within
            this of its first byte.
        idle_timeout_s: a served connection with no frame for this long is closed.
        max_connections: authenticated connections an engine serves at once (more are
            refused with a clean "busy" verdict).
        max_unauthenticated_connections: connections still authenticating that an engine
            holds at once, apart from `max_connections`; past it the oldest is dropped,
            so a flood of silent connects cannot lock authenticated peers out.
        auth_timeout_s: a connection must complete its authentication within this
            (a few seconds: an honest peer needs one round trip).
        max_staging_bytes: memory for checksummed WRITEs, which are received and
            verified aside before they are copied into the target region; at least
            `max_frame_bytes` (kept for reuse once allocated).
        connect_timeout_s: connecting and authenticating to a peer.
        max_retries: retries of a slice on a fresh connection after a dropped one (below 2**31, as the next two).
        checksums: verify every slice end to end with XXH3-64.
        socket_buffer_bytes: SO_SNDBUF / SO_RCVBUF of every connection (0: the OS default; setsockopt takes a C int).
        spin_us: how long a connection polls for an answer (or the next request)
            before it blocks; CPU spent for latency. 0 blocks at once.
        transports: allowed transports in order of preference.

    Every timeout (`io_timeout_s`, `idle_timeout_s`, `auth_timeout_s`, `connect_timeout_s`) is a positive number
    of seconds of at most `MAX_TIMEOUT_S` (1e6): the system's waits cannot take longer ones.
    """

    host: str = attrs.field(default="127.0.0.1", validator=_host)
    port: int = attrs.field(default=0, validator=_port)
    streams_per_peer: int = attrs.field(factory=lambda: _default_streams(), validator=int_at_least(1))
    slice_bytes: int = attrs.field(default=4 << 20, validator=int_at_least(1))
    max_frame_bytes: int = attrs.field(default=64 << 20, validator=int_at_least(1))
    io_timeout_s: float = attrs.field(default=10.0, validator=_timeout_s)
    idle_timeout_s: float = attrs.field(default=600.0, validator=_timeout_s)
    max_connections: int = attrs.field(default=1024, validator=int_at_least(1))
    max_unauthenticated_connections: int = attrs.field(default=64, validator=int_at_least(1))
    auth_timeout_s: float = attrs.field(default=3.0, validator=_timeout_s)
    max_staging_bytes: int = attrs.field(default=256 << 20, validator=int_at_least(1))
    connect_timeout_s: float = attrs.field(default=2.0, validator=_timeout_s)
    max_retries: int = attrs.field(default=2, validator=int_at_least(0, below=_C_INT))
    checksums: bool = attrs.field(default=False, validator=_flag)
    spin_us: int = attrs.field(default=200, validator=int_at_least(0, below=_C_INT))
    socket_buffer_bytes: int = attrs.field(default=4 << 20, validator=int_at_least(0, below=_C_INT))
    transports: tuple[str, ...] = attrs.field(default=TRANSPORTS, converter=_transports)

    @property
    def slice_deadline_s(self) -> float:
        """The longest one slice can take before it fails for good: each try connects, sends (a WRITE's payload
        within the io timeout) and then waits for the answer's header and a READ's payload, each within the io
        timeout: `(max_retries + 1) · (connect_timeout_s + 2 · io_timeout_s)`."""
        return (self.max_retries + 1) * (self.connect_timeout_s + 2 * self.io_timeout_s)

    def __attrs_post_init__(self) -> None:
        if self.slice_bytes > self.max_frame_bytes:
            raise ConfigError(
                f"slice_bytes ({shown(self.slice_bytes)}) exceeds max_frame_bytes ({shown(self.max_frame_bytes)})"
            )
        if self.max_staging_bytes < self.max_frame_bytes:
            raise ConfigError(
                f"max_staging_bytes ({shown(self.max_staging_bytes)}) is below max_frame_bytes"
                f" ({shown(self.max_frame_bytes)}):"
                " a checksummed frame could never be staged"
            )
