"""Tests for `mooncake.sched.pending.PendingBlocks`: keys counted per owner, and the walk along a prompt.

A `RuleBasedStateMachine` adds and removes prompts (lists of keys, repeats
included) for a few owners, on both kernel paths (compiled where numba imports,
plain Python otherwise), against a `collections.Counter` of (owner, key); after
every step the table holds exactly the model's counts and keeps its invariants,
and the walk along a prompt from any prefix stops where the model's walk does.
A small table forced to grow many times keeps every count.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.cache._compiled import compiled_path, numba_available
from mooncake.errors import InvalidRequestError
from mooncake.sched.pending import PendingBlocks

OWNERS = 3
keys = st.lists(st.integers(0, 40) | st.integers(2**63, 2**64 - 1), max_size=12)


def as_array(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def model_walk(model: collections.Counter[tuple[int, int]], prompt: list[int], start: int, owner: int) -> int:
    end = start
    while end < len(prompt) and model[(owner, prompt[end])] > 0:
        end += 1
    return end


class PendingMachine(RuleBasedStateMachine):
    compiled = False

    def __init__(self) -> None:
        super().__init__()
        self.path = compiled_path(self.compiled)
        self.path.__enter__()
        self.table = PendingBlocks(capacity=4)  # small: growth is exercised
        self.model: collections.Counter[tuple[int, int]] = collections.Counter()
        self.added: list[tuple[int, list[int]]] = []

    def teardown(self) -> None:
        self.path.__exit__(None, None, None)

    @rule(owner=st.integers(0, OWNERS - 1), prompt=keys)
    def add(self, owner: int, prompt: list[int]) -> None:
        self.table.add(owner, as_array(prompt))
        self.model.update((owner, key) for key in prompt)
        self.added.append((owner, prompt))

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        owner, prompt = self.added.pop(data.draw(st.integers(0, len(self.added) - 1)))
        self.table.remove(owner, as_array(prompt))
        self.model.subtract((owner, key) for key in prompt)
        self.model = +self.model  # drop what reached zero

    @rule(prompt=keys, data=st.data())
    def walk(self, prompt: list[int], data: st.DataObject) -> None:
        lengths = [data.draw(st.integers(0, len(prompt))) for _ in range(OWNERS + 1)]
        owners = [*range(OWNERS), -1]  # the last slot has no owner: nothing comes to it
        got = self.table.walk(as_array(prompt), np.array(lengths, dtype=np.int64), np.array(owners, dtype=np.int64))
        want = [
            model_walk(self.model, prompt, start, o) if o >= 0 else start
            for start, o in zip(lengths, owners, strict=True)
        ]
        assert got.tolist() == want

    @rule(owner=st.integers(0, OWNERS - 1), key=st.integers(0, 40))
    def count(self, owner: int, key: int) -> None:
        assert self.table.count(owner, key) == self.model[(owner, key)]

    @invariant()
    def same_counts(self) -> None:
        assert self.table.counts() == dict(self.model)
        assert len(self.table) == len(self.model)
        self.table.check_invariants()


class PlainPendingMachine(PendingMachine):
    compiled = False


class CompiledPendingMachine(PendingMachine):
    compiled = True


TestPlainPending = PlainPendingMachine.TestCase
TestCompiledPending = pytest.mark.skipif(not numba_available(), reason="numba is not installed")(
    CompiledPendingMachine.TestCase
)


@settings(max_examples=20)
@given(st.lists(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64), min_size=1, max_size=30))
def test_growth_keeps_every_count(prompts: list[list[int]]) -> None:
    """Adding past half full doubles the table as often as needed; removing everything empties it."""
    table = PendingBlocks(capacity=1)
    model: collections.Counter[tuple[int, int]] = collections.Counter()
    for n, prompt in enumerate(prompts):
        table.add(n % 2, as_array(prompt))
        model.update((n % 2, key) for key in prompt)
    assert table.counts() == dict(model)
    table.check_invariants()
    for n, prompt in enumerate(prompts):
        table.remove(n % 2, as_array(prompt))
    assert len(table) == 0 and table.counts() == {}
    table.check_invariants()


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed"))],
)
def test_a_negative_owner_is_refused_and_changes_nothing(compiled: bool) -> None:
    """Owner −1 marks the table's empty slots: counting under it would corrupt the table, so `add` and
    `remove` refuse any negative owner by name, on either path, and the counts stay as they were."""
    with compiled_path(compiled):
        table = PendingBlocks(capacity=4)
        table.add(0, as_array([1, 2]))
        for method in (table.add, table.remove):
            with pytest.raises(InvalidRequestError, match="owner"):
                method(-1, as_array([1, 3]))
        assert table.counts() == {(0, 1): 1, (0, 2): 1}
        table.check_invariants()
