"""A prefill cost model the router fits online from the TTFTs it observes.

The router times a few prefills on each server at start-up (`calibrate`;
without them it starts from a prior: 10 ms plus 20 µs per uncached token),
and refits the same model, c0 + c1·(n − p) + c2·(n² − p²), by
`FittedPrefillModel.fit` over the last `window` observations, every
`refit_every` new ones. An observation is a request that found its instance
idle of the router's other requests when it was dispatched (nothing queued
ahead of it), so its TTFT is its prefill plus the server's own overhead (HTTP,
tokenization, scheduling, the decode steps it shares): what the next request's
prefill will cost on that fleet. A refit that fails (too little variety yet)
keeps the model in use.

Invariant: `prefill_s` is what the current coefficients give; they change only
in `observe`.
"""

from __future__ import annotations

from collections import deque

import attrs

from mooncake.errors import ConfigError
from mooncake.sched.cost import FittedPrefillModel, PrefillSample

__all__ = ["OnlinePrefillModel"]


@attrs.define
class OnlinePrefillModel:
    """A `PrefillModel` refitted from observed prefills (see the module docstring)."""

    current: FittedPrefillModel = attrs.field(factory=lambda: FittedPrefillModel(coefficients=(0.01, 2e-5, 0.0)))
    window: int = 256
    refit_every: int = 8
    samples: deque[PrefillSample] = attrs.field(init=False)
    num_fits: int = 0
    _since_fit: int = 0

    def __attrs_post_init__(self) -> None:
        if self.window < 3 or self.refit_every < 1:
            raise ConfigError(f"window must be >= 3 and refit_every >= 1, got {self.window} and {self.refit_every}")
        self.samples = deque(maxlen=self.window)

    def prefill_s(self, num_tokens: int, prefix_tokens: int = 0) -> float:
        return self.current.prefill_s(num_tokens, prefix_tokens)

    def calibrate(self, samples: list[PrefillSample]) -> None:
        """Start from a fit of `samples` (timed at start-up) when they vary enough, and keep them."""
        for sample in samples:
            self.observe(sample.num_tokens, sample.prefix_tokens, sample.seconds)
        if len(self.samples) >= 3:
            try:
                self.current = FittedPrefillModel.fit(list(self.samples))
                self.num_fits += 1
            except ConfigError:
                pass

    def observe(self, num_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """A prefill of `num_tokens` with `prefix_tokens` cached took `seconds` (samples that cannot be fitted
        — no time, nothing uncached — are dropped)."""
        if seconds <= 0 or num_tokens <= prefix_tokens:
            return
        self.samples.append(PrefillSample(num_tokens=num_tokens, prefix_tokens=prefix_tokens, seconds=seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self.samples) >= 3:
            self._since_fit = 0
            try:
                fitted = FittedPrefillModel.fit(list(self.samples))
            except ConfigError:
                return  # not enough variety yet: keep the model in use
            self.current = fitted
            self.num_fits += 1
