"""The key table behind the index, against a dict model (probe runs wrap in small tables), on both paths.

The model-based machine runs on the default path (numba where installed, else
the plain-Python kernels); a second machine drives a compiled and a plain table
in lockstep and checks that their arrays stay identical, so the plain path lays
out entries exactly as the compiled one does and answers as the model does.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.cache._key_table import SLOTS_PER_WORD, KeyTable

_RANDOM = random.Random(7)
UNIVERSE = [0, 1, 2**64 - 1, *(_RANDOM.getrandbits(64) for _ in range(37))]
NUM_SLOTS = 20  # two words of holder nibbles

keys = st.sampled_from(UNIVERSE)
slots = st.integers(0, NUM_SLOTS - 1)
tiers = st.integers(0, 2)


def as_array(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


class KeyTableMachine(RuleBasedStateMachine):
    """Random adds, discards and clears on a table that starts at 16 entries, so runs wrap and it resizes."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(capacity=16, num_slots=NUM_SLOTS)
        self.model: dict[int, set[tuple[int, int]]] = {}  # key -> {(slot, tier)}

    @rule(batch=st.lists(keys, max_size=8), slot=slots, tier=tiers)
    def add(self, batch: list[int], slot: int, tier: int) -> None:
        self.table.add(as_array(batch), slot, tier)
        for key in batch:
            self.model.setdefault(key, set()).add((slot, tier))

    @rule(batch=st.lists(keys, max_size=8), slot=slots, tier=tiers)
    def discard(self, batch: list[int], slot: int, tier: int) -> None:
        self.table.discard(as_array(batch), slot, tier)
        for key in batch:
            held = self.model.get(key)
            if held is not None:
                held.discard((slot, tier))
                if not held:
                    del self.model[key]

    @rule(slot=slots)
    def clear(self, slot: int) -> None:
        self.table.clear_slot(slot)
        for key in list(self.model):
            self.model[key] = {(s, t) for s, t in self.model[key] if s != slot}
            if not self.model[key]:
                del self.model[key]

    @rule(query=st.lists(keys, max_size=10))
    def match(self, query: list[int]) -> None:
        lengths = self.table.match(as_array(query))
        for slot in range(NUM_SLOTS):
            expected = 0
            for key in query:
                if not any(s == slot for s, _ in self.model.get(key, ())):
                    break
                expected += 1
            assert lengths[slot] == expected, f"slot {slot}: {lengths[slot]} != {expected}"

    @invariant()
    def contents_equal_the_model(self) -> None:
        table = self.table
        assert table.size == len(self.model)
        assert int(table.occupied().sum()) == len(self.model)
        for key in UNIVERSE:
            entry = table.find(key)
            held = self.model.get(key, set())
            assert (entry >= 0) == bool(held), f"key {key}: found at {entry}, model {held}"
            for slot in range(NUM_SLOTS):
                nibble = table.nibble(entry, slot) if entry >= 0 else 0
                tiers_held = {t for s, t in held if s == slot}
                assert nibble & 7 == sum(1 << t for t in tiers_held), f"key {key} slot {slot}"
                assert bool(nibble & 8) == bool(tiers_held), f"key {key} slot {slot}: presence bit"
        for slot in range(NUM_SLOTS):
            assert table.counts[slot] == sum(1 for held in self.model.values() if any(s == slot for s, _ in held))

    @invariant()
    def every_stored_key_is_reachable(self) -> None:
        for entry in np.flatnonzero(self.table.occupied()).tolist():
            assert self.table.find(int(self.table.keys[entry])) == entry


KeyTableMachine.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestKeyTable = KeyTableMachine.TestCase


class LockstepMachine(RuleBasedStateMachine):
    """A compiled and a plain table take the same operations; their arrays and answers stay identical."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled = KeyTable(capacity=16, num_slots=1)
        with compiled_path(False):
            self.plain = KeyTable(capacity=16, num_slots=1)
        assert self.compiled.is_compiled and not self.plain.is_compiled

    @rule(batch=st.lists(keys, max_size=8), slot=slots, tier=tiers)
    def add(self, batch: list[int], slot: int, tier: int) -> None:
        for table in (self.compiled, self.plain):
            table.ensure_slots(slot + 1)
            table.add(as_array(batch), slot, tier)

    @rule(batch=st.lists(keys, max_size=8), slot=slots, tier=tiers)
    def discard(self, batch: list[int], slot: int, tier: int) -> None:
        for table in (self.compiled, self.plain):
            if slot < table.num_slots:
                table.discard(as_array(batch), slot, tier)

    @rule(slot=slots)
    def clear(self, slot: int) -> None:
        for table in (self.compiled, self.plain):
            if slot < table.num_slots:
                table.clear_slot(slot)

    @rule(query=st.lists(keys, max_size=10), key=keys)
    def match_and_find(self, query: list[int], key: int) -> None:
        assert self.compiled.match(as_array(query)).tolist() == self.plain.match(as_array(query)).tolist()
        assert self.compiled.find(key) == self.plain.find(key)

    @invariant()
    def arrays_are_identical(self) -> None:
        assert self.compiled.size == self.plain.size
        for name in ("keys", "words", "counts"):
            assert np.array_equal(getattr(self.compiled, name), getattr(self.plain, name)), name


LockstepMachine.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestLockstep = pytest.mark.skipif(
    not numba_available(), reason="numba (the accel extra) is not installed: there is no compiled table to compare"
)(LockstepMachine.TestCase)


def test_slots_grow_past_one_word() -> None:
    """Slots beyond the first 16 live in a second word, and matches see them."""
    table = KeyTable(capacity=16, num_slots=1)
    table.ensure_slots(SLOTS_PER_WORD + 3)
    table.add(as_array([5, 6]), SLOTS_PER_WORD + 2, 1)
    table.add(as_array([5]), 0, 0)
    lengths = table.match(as_array([5, 6, 7]))
    assert lengths[SLOTS_PER_WORD + 2] == 2 and lengths[0] == 1


def test_full_wrap_around_deletion() -> None:
    """Filling a 16-entry table to 3/4 with random keys and deleting each in turn keeps all others reachable."""
    rng = random.Random(3)
    for _ in range(200):
        table = KeyTable(capacity=16)
        batch = [rng.getrandbits(64) for _ in range(12)]
        table.add(as_array(batch), 0, 1)
        assert table.keys.size == 16
        for i, key in enumerate(batch):
            table.discard(as_array([key]), 0, 1)
            assert table.find(key) == -1
            for other in batch[i + 1 :]:
                assert table.find(other) >= 0
