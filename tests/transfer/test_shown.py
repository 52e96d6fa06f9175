"""The transfer engine's entry points quote what they were given through `_checks.shown`, however large or long.

Python refuses to repr an integer past 4,300 digits, so a message that quoted one with `!r` (or formatted it) was a
bare ValueError ("Exceeds the limit (4300 digits) ..."), not the named error, and a 500-character string was
printed whole. Each entry below, given such a value, raises its own `MooncakeError` with a message of at most
`BOUND` characters. What a peer sends (a descriptor, an RDMA endpoint, a block-protocol reply) is quoted the same
way. (The style of tests/test_shown_everywhere.py, for the entries of `mooncake.transfer`.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from mooncake.cache.tiered import TieredCache
from mooncake.errors import ConfigError, MooncakeError, ProtocolError, TransferError
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.messenger import Messenger, shared_dram_pool
from mooncake.transfer.peers import PeerDescriptor
from mooncake.transfer.rdma import check_endpoint
from mooncake.transfer.request import EngineConfig, TransferOp, TransferRequest
from tests.shown_cases import ALL, HUGE, NEGATIVE, TEXT, entry_params, refused_briefly
from tests.transfer.conftest import SECRET

NUMBERS = (HUGE, NEGATIVE)


@attrs.frozen
class Setup:
    """An engine connected to another (`peer`), and a messenger over it."""

    engine: TransferEngine
    peer: str
    messenger: Messenger


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    config = EngineConfig(transports=("tcp",), streams_per_peer=1)
    with TransferEngine(secret=SECRET, config=config) as here, TransferEngine(secret=SECRET, config=config) as there:
        pool, region = shared_dram_pool(here, 4096, 2)
        messenger = Messenger(here, TieredCache([pool]), region=region, sweep_interval_s=0)
        yield Setup(here, here.connect(there.address), messenger)
        messenger.close()


def transfer_request(**fields: Any) -> TransferRequest:
    given = {
        "op": TransferOp.WRITE,
        "local_region": 1,
        "local_offset": 0,
        "peer": "127.0.0.1:1",
        "remote_region": 1,
        "remote_offset": 0,
        "length": 16,
    }
    return TransferRequest(**(given | fields))


def descriptor(**fields: Any) -> PeerDescriptor:
    return PeerDescriptor.from_json({"name": "p", "host_id": "h", "pid": 7, "regions": []} | fields)


def region(**fields: Any) -> PeerDescriptor:
    return descriptor(regions=[{"region_id": 1, "length": 64} | fields])


ENDPOINT = {"qp_num": 1, "lid": 1, "gid": "fe80::1", "psn": 0}

# (id, call, the error it names, the values it refuses: each is refused, not taken)
ENTRIES: list[tuple[str, Callable[[Any, Setup], object], type[MooncakeError], tuple[Any, ...]]] = [
    *(
        (f"TransferRequest.{name}", lambda v, _s, name=name: transfer_request(**{name: v}), ConfigError, ALL)
        for name in ("op", "local_region", "local_offset", "remote_region", "remote_offset", "length")
    ),
    ("TransferRequest.peer", lambda v, _s: transfer_request(peer=v), ConfigError, NUMBERS),
    ("EngineConfig.host", lambda v, _s: EngineConfig(host=v), ConfigError, NUMBERS),
    *(
        (f"EngineConfig.{name}", lambda v, _s, name=name: EngineConfig(**{name: v}), ConfigError, ALL)
        for name in ("port", "slice_bytes", "max_frame_bytes", "io_timeout_s", "checksums")
    ),
    ("EngineConfig.max_staging_bytes", lambda v, _s: EngineConfig(max_staging_bytes=v), ConfigError, (NEGATIVE, TEXT)),
    ("EngineConfig.transports", lambda v, _s: EngineConfig(transports=v), ConfigError, ALL),
    ("EngineConfig.transports item", lambda v, _s: EngineConfig(transports=[v]), ConfigError, ALL),
    ("TransferEngine config", lambda v, _s: TransferEngine(secret=SECRET, config=v), ConfigError, ALL),
    ("TransferEngine rdma", lambda v, _s: TransferEngine(secret=SECRET, rdma=v), ConfigError, ALL),
    ("TransferEngine name", lambda v, _s: TransferEngine(secret=SECRET, name=v), ConfigError, NUMBERS),
    (
        "TransferEngine host",
        lambda v, _s: TransferEngine(secret=SECRET, config=EngineConfig(host=v)),
        TransferError,
        (TEXT,),
    ),
    ("engine.submit item", lambda v, s: s.engine.submit([v]), ConfigError, ALL),
    ("engine.submit", lambda v, s: s.engine.submit(v), ConfigError, NUMBERS),
    ("engine.transfer_sync item", lambda v, s: s.engine.transfer_sync([v], timeout=1), ConfigError, ALL),
    ("engine.status", lambda v, s: s.engine.status(v), ConfigError, (NEGATIVE, TEXT)),
    ("engine.status unknown batch", lambda v, s: s.engine.status(v), TransferError, (HUGE,)),
    ("engine.wait", lambda v, s: s.engine.wait(v, 1), ConfigError, (NEGATIVE, TEXT)),
    ("engine.wait unknown batch", lambda v, s: s.engine.wait(v, 1), TransferError, (HUGE,)),
    ("engine.wait timeout", lambda v, s: s.engine.wait(1, v), ConfigError, ALL),
    ("engine.forget", lambda v, s: s.engine.forget(v), ConfigError, (NEGATIVE, TEXT)),
    ("engine.allocate_shared", lambda v, s: s.engine.allocate_shared(v), ConfigError, ALL),
    ("engine.register_memory", lambda v, s: s.engine.register_memory(v), TransferError, ALL),
    ("engine.unregister_memory", lambda v, s: s.engine.unregister_memory(v), ConfigError, (NEGATIVE, TEXT)),
    ("engine.connect", lambda v, s: s.engine.connect(v), ConfigError, ALL),
    ("engine.disconnect", lambda v, s: s.engine.disconnect(v), ConfigError, NUMBERS),
    ("engine.disconnect unknown peer", lambda v, s: s.engine.disconnect(v), TransferError, (TEXT,)),
    ("engine.peer_regions unknown peer", lambda v, s: s.engine.peer_regions(v), TransferError, (TEXT,)),
    ("engine.call unknown peer", lambda v, s: s.engine.call(v, "describe", None), TransferError, (TEXT,)),
    ("engine.call args", lambda v, s: s.engine.call(s.peer, "describe", v), ConfigError, NUMBERS),
    ("engine.call args in a list", lambda v, s: s.engine.call(s.peer, "describe", [v]), ConfigError, NUMBERS),
    ("engine.register_handler method", lambda v, s: s.engine.register_handler(v, print), ConfigError, NUMBERS),
    ("engine.register_handler handler", lambda v, s: s.engine.register_handler("m", v), ConfigError, ALL),
    ("engine.handle_call unknown method", lambda v, s: s.engine.handle_call(v, None), TransferError, (TEXT,)),
    ("Messenger.release_owner", lambda v, s: s.messenger.release_owner(v), TransferError, NUMBERS),
    ("Messenger.fetch parts", lambda v, s: s.messenger.fetch([], s.peer, parts=v), ConfigError, (NEGATIVE, TEXT)),
    # What a peer sends.
    ("PeerDescriptor.name", lambda v, _s: descriptor(name=v), TransferError, NUMBERS),
    ("PeerDescriptor.pid", lambda v, _s: descriptor(pid=v), TransferError, ALL),
    ("PeerDescriptor.regions", lambda v, _s: descriptor(regions=v), TransferError, ALL),
    ("PeerDescriptor.max_frame_bytes", lambda v, _s: descriptor(max_frame_bytes=v), TransferError, ALL),
    ("PeerDescriptor region", lambda v, _s: descriptor(regions=[v]), TransferError, ALL),
    ("PeerDescriptor region field", lambda v, _s: descriptor(regions=[{"region_id": 1, v: 1}]), TransferError, (TEXT,)),
    *(
        (f"PeerDescriptor region.{name}", lambda v, _s, name=name: region(**{name: v}), TransferError, ALL)
        for name in ("region_id", "length", "shm_name", "rdma_address", "rdma_rkey")
    ),
    ("RDMA endpoint", lambda v, _s: check_endpoint(v, sender="p"), ProtocolError, ALL),
    *(
        (
            f"RDMA endpoint.{name}",
            lambda v, _s, name=name: check_endpoint(ENDPOINT | {name: v}, sender="p"),
            ProtocolError,
            ALL,
        )
        for name in ("qp_num", "lid", "psn")
    ),
    ("RDMA endpoint.gid", lambda v, _s: check_endpoint(ENDPOINT | {"gid": v}, sender="p"), ProtocolError, NUMBERS),
]


@pytest.mark.parametrize(("call", "error", "value"), entry_params(ENTRIES))
def test_a_huge_or_long_value_is_the_named_error_in_a_short_message(
    setup: Setup, call: Callable[[Any, Setup], object], error: type[MooncakeError], value: Any
) -> None:
    """10**5000 and -10**5000 (whose repr Python refuses) and a 500-character string: each is the entry's own
    error (a `MooncakeError`), its message at most `BOUND` characters, the value shown cut or named by its size."""
    refused_briefly(lambda: call(value, setup), error)
