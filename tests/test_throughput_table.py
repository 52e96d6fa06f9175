"""The throughput experiment's effective-capacity table (`paper.throughput._effective_line`): the gain over the
stronger coupled baseline, and "n/a" where that baseline served nothing (never "inf%")."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("row", "gain"),
    [
        ({"mooncake": 120, "coupled": 80, "coupled_chunked": 100}, "20%"),
        ({"mooncake": 90, "coupled": 100, "coupled_chunked": 60}, "-10%"),
        ({"mooncake": 0, "coupled": 0, "coupled_chunked": 0}, "n/a"),  # no gain over nothing, nor a loss
        ({"mooncake": 5, "coupled": 0, "coupled_chunked": 0}, "n/a"),
    ],
)
def test_the_gain_is_over_the_stronger_baseline_and_none_over_nothing(
    monkeypatch: pytest.MonkeyPatch, row: dict[str, int], gain: str
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from paper.throughput import _effective_line

    line = _effective_line(0.1, row)
    assert line.split() == ["100ms", str(row["mooncake"]), str(row["coupled"]), str(row["coupled_chunked"]), gain]
    assert "inf" not in line
