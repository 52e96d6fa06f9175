"""A small Prometheus registry: counters, gauges and histograms with labels, in the text format.

Thread-safe; `render()` gives what `GET /metrics` serves (text/plain; version=0.0.4).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

__all__ = ["Registry"]

LabelKey = tuple[tuple[str, str], ...]


def _labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = key + extra
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Registry:
    """Named metrics; each is declared once with its kind and help text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}
        self._values: dict[str, dict[LabelKey, float]] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}
        self._histograms: dict[str, dict[LabelKey, list[float]]] = {}

    def counter(self, name: str, help_text: str) -> None:
        self._declare(name, "counter", help_text)

    def gauge(self, name: str, help_text: str) -> None:
        self._declare(name, "gauge", help_text)

    def histogram(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self._declare(name, "histogram", help_text)
        self._buckets[name] = tuple(sorted(buckets))
        self._histograms[name] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            values = self._values[name]
            values[key] = values.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        buckets = self._buckets[name]
        with self._lock:
            state = self._histograms[name].setdefault(key, [0.0] * (len(buckets) + 2))  # counts…, sum, count
            index = bisect.bisect_left(buckets, value)
            if index < len(buckets):
                state[index] += 1
            state[-2] += value
            state[-1] += 1

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 if never set)."""
        with self._lock:
            return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in self._meta.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if kind != "histogram":
                    for key, value in sorted(self._values[name].items()):
                        lines.append(f"{name}{_labels(key)} {_number(value)}")
                    continue
                buckets = self._buckets[name]
                for key, state in sorted(self._histograms[name].items()):
                    cumulative = 0.0
                    for bound, count in zip(buckets, state, strict=False):
                        cumulative += count
                        lines.append(f"{name}_bucket{_labels(key, (('le', _number(bound)),))} {_number(cumulative)}")
                    lines.append(f"{name}_bucket{_labels(key, (('le', '+Inf'),))} {_number(state[-1])}")
                    lines.append(f"{name}_sum{_labels(key)} {_number(state[-2])}")
                    lines.append(f"{name}_count{_labels(key)} {_number(state[-1])}")
        return "\n".join(lines) + "\n"

    def _declare(self, name: str, kind: str, help_text: str) -> None:
        self._meta[name] = (kind, help_text)
        self._values.setdefault(name, {})
