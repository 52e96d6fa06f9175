"""The error tree of `mooncake`.

Every exception the library raises on purpose derives from `MooncakeError`, so a
server can catch the library's failures in one place. Expected outcomes (a cache
miss, a full pool on `try_*`) are return values, not exceptions; exceptions mean
a broken contract, lost events or failed I/O and carry the offending values in
their message. Where a consumer expects losses and handles them itself, the
call says so explicitly (`BlockIndex.apply(event, strict=False)` returns the
gap instead of raising it).

    MooncakeError
    ├── ConfigError(ValueError)           a config field has an invalid value
    │   └── UnknownInstanceError          an instance nobody added (events, views); also an
    │                                     InvalidRequestError: the call that names it is bad input
    ├── InvalidRequestError(ValueError)   a request or its tokens break the contract
    ├── TraceFormatError(ValueError)      a trace line is malformed (file, line)
    ├── VllmEventError(ValueError)        a vLLM KV-event payload breaks its layout
    ├── SequenceGapError                  a consumer of cache events missed some
    ├── CapacityError                     a structure cannot hold what was asked
    ├── BlockPinnedError                  an operation would drop a pinned block
    ├── UnknownBlockError(KeyError)       a block key is not where it must be
    ├── IntegrityError                    a checksum does not match
    ├── DiskError(OSError)                a read or write of a pool file failed (file, page, block)
    ├── EngineError                       an engine process failed or stopped answering
    ├── Cancelled                         work its caller cancelled stopped early, all it held given back
    ├── TransferError                     moving bytes failed
    │   ├── TransferTimeout
    │   ├── PeerUnavailable
    │   ├── AuthenticationError
    │   └── ProtocolError                 a peer sent something the wire protocol does not allow
    └── RejectedError                     admission control refused a request (for callers that raise on one)
"""

from __future__ import annotations

import os

__all__ = [
    "AuthenticationError",
    "BlockPinnedError",
    "Cancelled",
    "CapacityError",
    "ConfigError",
    "DiskError",
    "EngineError",
    "IntegrityError",
    "InvalidRequestError",
    "MooncakeError",
    "PeerUnavailable",
    "ProtocolError",
    "RejectedError",
    "SequenceGapError",
    "TraceFormatError",
    "TransferError",
    "TransferTimeout",
    "UnknownBlockError",
    "UnknownInstanceError",
    "VllmEventError",
]


class MooncakeError(Exception):
    """Base of every error `mooncake` raises on purpose.

    Attributes:
        request_id: the request the error concerns, where one request's failure is raised among others' work
            (`DecodeEngine.step`: the request whose token draw failed, dropped while the rest of the batch went
            on), so its caller ends that request alone; None where the error names no one request.
    """

    request_id: str | None = None


class ConfigError(MooncakeError, ValueError):
    """A configuration field has an invalid value; the message names field and value."""


class InvalidRequestError(MooncakeError, ValueError):
    """A request, or the tokens given for one, breaks its contract."""


class UnknownInstanceError(ConfigError, InvalidRequestError):
    """An event or call names an instance that was never added (or not of the kind it needs): a server that
    catches bad input as InvalidRequestError catches this too, one that catches ConfigError as before."""


class TraceFormatError(MooncakeError, ValueError):
    """A line of a Mooncake-format trace is malformed.

    Attributes:
        path: the trace file.
        line: 1-based line number of the offending line.
        reason: what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], line: int, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        # Exception's own reduce calls the class with `args` (the message alone), which this __init__ cannot take:
        # a worker's error would fail to cross a process boundary (multiprocessing) as a bare TypeError.
        return type(self), (self.path, self.line, self.reason), self.__dict__


class VllmEventError(MooncakeError, ValueError):
    """A vLLM KV-event payload breaks the layout (or does not fit the decoder's hasher)."""


class SequenceGapError(MooncakeError):
    """Cache events from a source were lost: the consumer's view of it is stale.

    Attributes:
        gap: the `mooncake.cache.SequenceGap` (source, expected and received
            epoch and seq). Nothing of the offending event was applied; the
            source's events are refused until `BlockIndex.resync` installs a
            snapshot of its holdings.
    """

    def __init__(self, gap: object) -> None:
        self.gap = gap
        source = getattr(gap, "source", "?")
        expected = (getattr(gap, "expected_seq", "?"), getattr(gap, "expected_epoch", "?"))
        received = (getattr(gap, "received_seq", "?"), getattr(gap, "received_epoch", "?"))
        if expected == received:  # the next event in order, refused because an earlier gap left the source stale
            what = f"cache events from {source} are refused since an earlier gap (received seq {received[0]} of "
            what += f"epoch {received[1]}, the next in order)"
        else:
            what = f"lost cache events from {source}: expected seq {expected[0]} of epoch {expected[1]}, "
            what += f"received seq {received[0]} of epoch {received[1]}"
        super().__init__(
            f"{what}; resync the source from a snapshot of its holdings (BlockIndex.resync), "
            "or pass strict=False to receive the gap as a value"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Made again from the gap, not from the message in `args` (which this __init__ would read as a gap).
        return type(self), (self.gap,), self.__dict__


class CapacityError(MooncakeError):
    """A structure cannot hold what was asked of it."""


class EngineError(MooncakeError):
    """An engine process (a pipeline stage, a prefill or decode worker) failed or stopped answering."""


class Cancelled(MooncakeError):
    """Work its caller cancelled (a prefill whose client left) stopped at its next boundary; everything it held
    (pins, reserved pages, a KV stream) was given back, and nothing it half-wrote was kept."""


class BlockPinnedError(MooncakeError):
    """An operation would drop or overwrite a pinned block; unpin it first."""


class UnknownBlockError(MooncakeError, KeyError):
    """A block key is not present where the caller's contract says it must be."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class IntegrityError(MooncakeError):
    """Stored or received bytes do not match their checksum."""


class DiskError(MooncakeError, OSError):
    """A read or write of a pool file failed (a device error, a full disk): the message names the file, the page,
    the block and the cause's text, and `errno` is the cause's. An OSError too, so a caller that handles failed
    I/O as OSError handles it as before."""


class TransferError(MooncakeError):
    """Moving bytes between memories or peers failed."""


class TransferTimeout(TransferError):
    """A transfer did not complete within its deadline."""


class PeerUnavailable(TransferError):
    """The remote peer is dead or unreachable."""


class AuthenticationError(TransferError):
    """A peer failed the shared-secret handshake."""


class ProtocolError(TransferError):
    """The peer sent something the protocol does not allow (a malformed frame, call or reply)."""


class RejectedError(MooncakeError):
    """Admission control refused a request: for callers that raise on a rejected `ScheduleDecision` (the Conductor
    returns rejections as decisions, never raises this; the example gateway answers 429 from the decision)."""
