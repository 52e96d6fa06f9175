"""Edge contracts of `mooncake.sim.metrics.summarize` and the rules the simulators share with it.

- Goodput's span runs from the first arrival to the last answer of any kind, a refusal included, as vLLM's
  benchmark divides by its whole run (`benchmark_duration`, taken once every request was answered): a
  cluster that refuses the tail does not shorten its span by it. A refusal's record holds its time.
- `summarize` (exported, and called on hand-made records by examples/load.py and examples/validate.py)
  names what it cannot read: an `slo` that is no `Slo` (the one check every replay entry point uses), and a
  record field no column holds, naming the request and the field.
- One rule decides which requests have a TBT (`has_tbt`), and one whether a request's first token is its
  last (`sched.join.takes_slot`): the simulators consult it rather than restate it.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest

from mooncake.errors import ConfigError, InvalidRequestError
from mooncake.sched.outcome import Outcome, Reason
from mooncake.sim import coupled, disaggregated
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.disaggregated import replay
from mooncake.sim.metrics import RecordTable, RequestRecord, has_tbt, summarize
from mooncake.sim.replayer import ReplayContext
from mooncake.sim.report import write_records_csv
from mooncake.types import RequestId, Slo, require_slo
from tests.sim.test_coupled import make_request as coupled_request
from tests.sim.test_coupled import make_spec as coupled_spec
from tests.sim.test_disaggregated import make_request, make_spec, num_blocks

# --------------------------------------------------------------------------- goodput's span


def test_goodput_spans_to_a_refusal_after_the_last_completion_coupled() -> None:
    """Ten requests complete within seconds; an eleventh, too long for any instance, is refused at 100 s: the
    span runs to that refusal (vLLM's benchmark waits for every answer), so goodput is 10 / 100 s, not 10 over
    the seconds the completions took."""
    spec = coupled_spec()
    capacity = CoupledCluster(spec).capacity_tokens
    requests = [coupled_request(f"r{i}", float(i), 1024, 16, first_key=i * 10_000) for i in range(10)]
    requests.append(coupled_request("too-long", 100.0, capacity, 16, first_key=10**6))
    result = CoupledCluster(spec).run(requests)
    refused = result.records[-1]
    assert (refused.outcome, refused.reason) == (Outcome.REJECTED_BEFORE_PREFILL, Reason.CONTEXT_TOO_LONG)
    assert refused.finish_s == 100.0  # refused on arrival: its client's answer came then
    summary = result.summary
    assert summary.completed == 10 and summary.slo_attainment * summary.num_requests == pytest.approx(10)
    assert summary.goodput_rps == pytest.approx(10 / 100.0)


def test_goodput_spans_to_a_refusal_after_the_last_completion_disaggregated() -> None:
    """The same on the disaggregated cluster: the Conductor refuses a prompt no decode instance holds at 100 s."""
    requests = [make_request(f"r{i}", float(i), 1024, 16, range(i * 100, i * 100 + 2)) for i in range(5)]
    length = 2_000_000
    requests.append(make_request("too-long", 100.0, length, 16, range(10**6, 10**6 + num_blocks(length))))
    result = replay(make_spec(), requests)
    refused = result.records[-1]
    assert refused.outcome is Outcome.REJECTED_BEFORE_PREFILL and refused.finish_s == 100.0
    assert result.summary.completed == 5
    assert result.summary.goodput_rps == pytest.approx(result.summary.slo_attainment * 6 / 100.0)


def test_summarize_span_ends_at_the_latest_answer_of_any_kind() -> None:
    """Hand-made records: a refusal after prefill at 9 s, later than the last completion (3 s), ends the span;
    a record with no answer (a real run's failure: no `finish_s`) leaves it alone."""
    slo = Slo(ttft_s=10.0, tbt_s=1.0)
    records = [
        RequestRecord(RequestId("a"), 1.0, 10, 2, outcome=Outcome.COMPLETED, first_token_s=1.5, finish_s=3.0),
        RequestRecord(RequestId("b"), 2.0, 10, 2, outcome=Outcome.REJECTED_AFTER_PREFILL, finish_s=9.0),
        RequestRecord(RequestId("c"), 2.5, 10, 2, outcome=None),
    ]
    assert summarize(records, slo).goodput_rps == pytest.approx(1 / 8.0)
    assert summarize(records[::2], slo).goodput_rps == pytest.approx(1 / 2.0)


# --------------------------------------------------------------------------- what summarize refuses


def good_record(**changes: Any) -> RequestRecord:
    record = RequestRecord(RequestId("r"), 0.0, 100, 10, outcome=Outcome.COMPLETED, first_token_s=1.0, finish_s=2.0)
    for name, value in changes.items():
        setattr(record, name, value)
    return record


@pytest.mark.parametrize("slo", [None, 0.1, {"ttft_s": 1.0}])
def test_summarize_refuses_an_slo_that_is_no_slo(slo: object) -> None:
    """A ConfigError naming the argument, the one check every replay entry point makes (not an AttributeError)."""
    with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo"):
        summarize([good_record()], slo)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "entry",
    [
        lambda slo: require_slo(slo),
        lambda slo: ReplayContext(slo, sample_interval_s=1.0),
        lambda slo: CoupledCluster(coupled_spec(), slo=slo),
        lambda slo: replay(make_spec(), [], slo=slo),
    ],
)
def test_every_entry_point_refuses_an_slo_alike(entry: Any) -> None:
    """The replay context, both clusters and `summarize` word the refusal alike: they share `require_slo`."""
    with pytest.raises(ConfigError, match=r"slo must be a mooncake\.types\.Slo, got 0\.1$"):
        entry(0.1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"outcome": "completed"}, "outcome='completed'"),
        ({"reason": "kv_budget"}, "reason='kv_budget'"),
        ({"arrival_s": None}, "arrival_s=None"),
        ({"arrival_s": "0.0"}, "arrival_s='0.0'"),
        ({"finish_s": "2"}, "finish_s='2'"),
        ({"tbt_s": None}, "tbt_s=None"),
        ({"input_tokens": 100.0}, "input_tokens=100.0"),
        ({"output_tokens": None}, "output_tokens=None"),
        ({"prefix_tokens": 2**63}, "prefix_tokens=9223372036854775808"),
        ({"prefill_instance": ["p"]}, "prefill_instance=['p']"),
        ({"inline_prefill": "yes"}, "inline_prefill='yes'"),
    ],
)
def test_summarize_names_the_request_and_the_field_it_cannot_read(changes: dict[str, Any], field: str) -> None:
    """An InvalidRequestError naming the request and the field with its value, not a bare KeyError or
    TypeError from deep in the columns."""
    with pytest.raises(InvalidRequestError, match=re.escape(f"request 'r': {field} is ")):
        summarize([good_record(**changes)], Slo())


def test_summarize_refuses_records_it_cannot_iterate_or_read() -> None:
    """No iterable, an item that is no record, an unhashable request id, or an id twice: named errors."""
    with pytest.raises(InvalidRequestError, match="records must be an iterable, got None"):
        summarize(None, Slo())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="RequestRecord items, got 'r'"):
        summarize(["r"], Slo())  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match=r"request id \['d'\] is unhashable"):
        summarize([good_record(request_id=["d"])], Slo())
    with pytest.raises(InvalidRequestError, match="appears twice"):
        summarize([good_record(), good_record()], Slo())


def test_a_refused_seal_leaves_the_record_live_and_the_table_whole() -> None:
    """The named error comes before anything changes: the record stays live, read as the object it is."""
    table = RecordTable()
    record = good_record()
    table.add(record)
    record.outcome = "completed"  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="outcome='completed'"):
        table.seal(record)
    assert table[0] is record and table.num_live == 1
    table.check_invariants()
    record.outcome = Outcome.COMPLETED
    table.seal(record)
    assert table.num_live == 0 and table[0] == record


# --------------------------------------------------------------------------- one rule each


def test_has_tbt_is_the_summarys_csvs_and_plots_rule(tmp_path: Path) -> None:
    """Completed with more than one output token: the summary's TBT covers exactly those, and the CSV leaves the
    TBT cell of every other request empty."""
    records = [
        RequestRecord(
            RequestId("paced"), 0.0, 10, 3, outcome=Outcome.COMPLETED, first_token_s=1, finish_s=2, tbt_s=0.5
        ),
        RequestRecord(RequestId("one-token"), 0.0, 10, 1, outcome=Outcome.COMPLETED, first_token_s=1, finish_s=1),
        RequestRecord(RequestId("refused"), 0.0, 10, 3, outcome=Outcome.REJECTED_BEFORE_PREFILL, finish_s=0.0),
    ]
    assert [has_tbt(r) for r in records] == [True, False, False]
    summary = summarize(records, Slo())
    assert summary.tbt_s["mean"] == 0.5 and summary.tbt_s["p99"] == 0.5
    write_records_csv(records, tmp_path / "requests.csv")
    with (tmp_path / "requests.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [row["tbt_s"] != "" for row in rows] == [has_tbt(r) for r in records]


@pytest.mark.parametrize("which", ["coupled", "disaggregated"])
def test_the_simulators_ask_takes_slot_whether_the_first_token_is_the_last(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the one rule changed (here: a two-token answer takes no decode slot either), a two-token request ends
    at its first token on both simulators: none restates the rule by hand."""
    module = coupled if which == "coupled" else disaggregated
    monkeypatch.setattr(module, "takes_slot", lambda output_tokens: output_tokens > 2)
    if which == "coupled":
        result = CoupledCluster(coupled_spec()).run([coupled_request("two", 0.0, 1024, 2)])
    else:
        result = replay(make_spec(), [make_request("two", 0.0, 1024, 2, range(2))], decode_s=1.0)
    (record,) = result.records
    assert record.outcome is Outcome.COMPLETED
    assert record.finish_s == record.first_token_s and record.intervals.count == 0
