"""Tests for `mooncake.sched.outcome`: the one vocabulary of how requests end.

Properties: every reason read back by its value is itself and anything else is a refusal without a known
why; every rejection reason has one HTTP status, and the statuses mean what the docstring says (503 only
when no instance of a role is up, 400 only for what no instance could ever take); a `RequestEnd` has a
reason exactly when it did not complete.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.errors import InvalidRequestError
from mooncake.sched.outcome import (
    DECODE_REFUSALS,
    Outcome,
    Reason,
    RequestEnd,
    http_status,
    reason_named,
    refusal_named,
)
from mooncake.types import RequestId


@given(st.sampled_from(Reason))
def test_a_reason_reads_back_from_its_value(reason: Reason) -> None:
    assert reason_named(reason.value) is reason


@given(st.one_of(st.text(), st.integers(), st.none()).filter(lambda v: v not in {r.value for r in Reason}))
def test_a_value_no_reason_has_is_a_refusal_without_a_known_why(value: object) -> None:
    """A peer of another version may send a reason this one does not know: still a refusal."""
    assert reason_named(value) is Reason.DECODE_REJECTED


@given(st.sampled_from(Reason))
def test_every_reason_has_one_status_of_its_meaning(reason: Reason) -> None:
    status = http_status(reason)
    assert status in (400, 429, 503)
    assert (status == 503) == (reason in (Reason.NO_PREFILL_INSTANCE, Reason.NO_DECODE_INSTANCE))
    assert (status == 400) == (reason is Reason.CONTEXT_TOO_LONG)


@given(st.sampled_from(Outcome), st.one_of(st.none(), st.sampled_from(Reason)))
def test_a_request_end_has_a_reason_iff_it_did_not_complete(outcome: Outcome, reason: Reason | None) -> None:
    if (outcome is Outcome.COMPLETED) == (reason is None):
        assert RequestEnd(RequestId("r"), outcome, reason).reason is reason
    else:
        with pytest.raises(InvalidRequestError, match=outcome.value):
            RequestEnd(RequestId("r"), outcome, reason)


def test_the_values_are_the_documented_wire_vocabulary() -> None:
    """Outcome and reason values travel between processes (a worker's refusal, a gateway's error code, the
    simulator's CSV, metric labels) and versions: each is its name in lower case, and the set is fixed."""
    assert [o.value for o in Outcome] == [
        "completed",
        "rejected_before_prefill",
        "rejected_after_prefill",
        "aborted",
    ]
    assert [r.value for r in Reason] == [
        "no_prefill_instance",
        "no_decode_instance",
        "ttft_slo",
        "context_too_long",
        "batch_full",
        "kv_budget",
        "tbt_slo",
        "decode_rejected",
        "instance_down",
        "client_gone",
        "timeout",
        "failed",
    ]
    assert all(member.value == member.name.lower() for member in [*Outcome, *Reason])


@given(value=st.one_of(st.sampled_from([reason.value for reason in Reason]), st.text(max_size=12), st.none()))
def test_a_refusal_is_named_as_one_of_the_decode_refusals(value: object) -> None:
    """`refusal_named` reads a decode worker's refusal: its reason where it is one of `DECODE_REFUSALS`, else
    DECODE_REJECTED (a refusal without a known why), never a reason `RequestRejected` would refuse."""
    named = refusal_named(value)
    assert named in DECODE_REFUSALS
    known = reason_named(value)
    assert named is (known if known in DECODE_REFUSALS else Reason.DECODE_REJECTED)
