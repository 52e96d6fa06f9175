"""Late reports from a removed instance, and batches of instance ids that are no collection.

A removed instance's reports still on the way race with its removal: every one of them (its requests' events,
`InstanceDown`/`InstanceUp`, the cache events a finishing prefill carries) is ignored, and a cache event is
dropped rather than applied (it would put the removed instance's blocks back in the index); an id added back is
a live instance again, whose reports count. `add_*_instances` refuses what is no collection of ids by name.
"""

from __future__ import annotations

import re

import pytest

from mooncake.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake.errors import ConfigError
from mooncake.sched.join import DecodeLimits
from mooncake.sched.view import InstanceDown, InstanceUp, PrefillFinished
from mooncake.types import BlockKey, RequestId, Tier
from tests.sched.test_conductor import D1, DOC, make_conductor, placement, request

KEYS = tuple(BlockKey(k) for k in DOC)


def test_a_prefill_that_finished_as_it_was_removed_is_ignored_whole() -> None:
    """The gateway applies a finished prefill's cache events, then reports it: from a removed instance both are
    ignored, its blocks stay out of the index, and its going down or up again changes nothing."""
    conductor = make_conductor()
    prefill, _ = placement(conductor.schedule(request("r", DOC), 0.0))
    conductor.remove_instance(prefill, 1.0)
    for late in (
        BlockStored(source=prefill, seq=0, keys=KEYS, tier=Tier.DRAM),
        BlockRemoved(source=prefill, seq=1, keys=KEYS[:1], tier=Tier.DRAM),
        AllBlocksCleared(source=prefill, seq=2),
    ):
        assert conductor.apply_cache_event(late) is None
        assert conductor.apply_cache_event(late, strict=False) is None
    assert prefill not in conductor.index.instances and conductor.index.match(KEYS).best_length == 0
    assert conductor.handle(PrefillFinished(request_id=RequestId("r"), instance_id=prefill, now=1.1)) == ()
    assert conductor.handle(InstanceDown(instance_id=prefill, now=1.2)) == ()
    assert conductor.handle(InstanceUp(instance_id=prefill, now=1.3)) == ()
    assert prefill not in {v.instance_id for v in conductor.prefill_views}
    conductor.check_invariants()


def test_an_id_added_back_is_live_again() -> None:
    """Removed then added back, the id is a new instance: its cache events are applied and its going down
    takes it down (a decode instance's ends its requests)."""
    conductor = make_conductor()
    prefill, _ = placement(conductor.schedule(request("r", DOC), 0.0))
    conductor.remove_instance(prefill, 1.0)
    conductor.remove_instance(D1, 1.0)
    conductor.add_prefill_instance(prefill)
    conductor.add_decode_instance(D1, DecodeLimits(kv_capacity_tokens=10**6))
    assert conductor.apply_cache_event(BlockStored(source=prefill, seq=0, keys=KEYS, tier=Tier.DRAM)) is None
    assert prefill in conductor.index.instances and conductor.index.match(KEYS).best_length == len(KEYS)
    assert conductor.handle(InstanceDown(instance_id=prefill, now=2.0)) == ()
    assert not next(v for v in conductor.prefill_views if v.instance_id == prefill).is_up
    assert prefill not in conductor.index.instances  # down: its cache is gone
    assert conductor.handle(InstanceUp(instance_id=prefill, now=2.1)) == ()
    assert next(v for v in conductor.prefill_views if v.instance_id == prefill).is_up
    conductor.check_invariants()


@pytest.mark.parametrize("ids", [None, 7, 2.5, object()])
def test_a_batch_of_ids_that_is_no_collection_is_refused_by_name(ids: object) -> None:
    """`add_prefill_instances(None)` is a ConfigError naming `instance_ids` and the value, not a TypeError; nothing
    is added."""
    conductor = make_conductor()
    before = (conductor.prefill_views, conductor.decode_views)
    named = re.escape(f"instance_ids must be a collection of instance ids, got {ids!r}")
    with pytest.raises(ConfigError, match=named):
        conductor.add_prefill_instances(ids)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=named):
        conductor.add_decode_instances(ids, DecodeLimits(kv_capacity_tokens=10))  # type: ignore[arg-type]
    assert (conductor.prefill_views, conductor.decode_views) == before
