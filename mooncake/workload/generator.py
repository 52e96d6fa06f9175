"""Synthetic workloads with the prefix structure of real LLM traffic.

A prompt is a list of segments, each a run of tokens with an identity:
- a system prompt, shared by every session that uses it (a few, Zipf-popular;
  a share of chat and document sessions may open without one);
- a long document, shared by the several users asking about it (Zipf-popular);
- a tool/agent preamble (tool schemas, instructions), long and fixed;
- user messages, model outputs and tool observations, unique to a session.

Sessions are conversations (system prompt, then turns), document Q&A (system
prompt + document, then turns) or agent runs (preamble + task, then steps that
append the previous output and an observation). Each turn's prompt extends the
previous turn's prompt with that turn's output and a new message, so turns share
every block up to the previous turn's last full block.

Block ids are chained like real keys: a block's id is determined by its parent's
id and the segment pieces it covers, so equal ids mean equal prefixes, the last
(partial) block included.

Arrivals come from a Poisson or a bursty (gamma inter-arrival, coefficient of
variation > 1) process. After each turn a session thinks (an exponential time,
mean `think_time_s`) unless it has used all its turns, when it ends at once. An
arrival is the next turn of the session whose think time ended first, if one
has; otherwise it opens a new session. So the workload is stationary: a
session has its turns (mean `mean_session_turns`), a share
1 - 1/mean_session_turns of arrivals continue a session, and a turn follows its
session's previous one after the think time (longer only while arrivals lull),
whatever the number of requests. Only the edges differ: the first think time
opens sessions only, and sessions still thinking at the end are cut short, so a
workload a few think times long continues sessions a little less often.

Everything is drawn from one seeded numpy Generator: the same spec, count and
seed give the same workload. A workload streams in bounded memory (arrival times
drawn a chunk at a time, a finished session's block ids dropped) and can always
be written as a trace (a spec or count that would pass a trace line's bounds is
refused).

The presets reproduce the average input/output lengths published with the
Mooncake traces (FAST'25): conversation 12,035 / 343, tool&agent 8,596 / 182,
synthetic 15,325 / 149 (within a few percent at a few thousand requests).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import numpy as np

from mooncake._checks import int_at_least, require_int, require_number, shown
from mooncake.errors import ConfigError
from mooncake.types import BlockKey, Request, RequestId
from mooncake.workload.trace import TRACE_BLOCK_SIZE_TOKENS
from mooncake.workload.trace_record import MAX_LINE_TOKENS, arrival_problem

__all__ = [
    "ARRIVAL_RANGE",
    "ArrivalProcess",
    "DEFAULT_WORKLOAD",
    "DefaultWorkload",
    "LengthDistribution",
    "PRESETS",
    "WorkloadSpec",
    "fixed_length_requests",
    "generate_requests",
    "preset",
]


@attrs.frozen
class DefaultWorkload:
    """The built-in default workload: what `make demo`, `mooncake trace generate` and the experiments generate
    when given no trace or option, so that they replay alike."""

    preset: str = "synthetic"
    num_requests: int = 4000
    rate_per_s: float = 4.0  # mean arrivals per second


DEFAULT_WORKLOAD = DefaultWorkload()

_ARRIVAL_CHUNK = 1 << 16
"""Arrival times drawn at a time (512 KiB of them): a streamed workload holds one chunk, not all its times."""

ARRIVAL_RANGE = (1e-6, 1e6)
"""Bounds of `ArrivalProcess.rate_per_s` (per second) and `.cv`: beyond them the gamma gaps underflow or
overflow a float (a cv of 1e200 squares to infinity)."""


def _number_in(low: float, high: float) -> Any:
    def check(_instance: object, attribute: Any, value: Any) -> None:
        number = require_number(attribute.name, value, minimum=low)
        if number > high:
            raise ConfigError(f"{attribute.name} must be a number in [{low:g}, {high:g}], got {shown(value)}")

    return check


def _number_at_least(minimum: float, *, strict: bool = False) -> Any:
    def check(_instance: object, attribute: Any, value: Any) -> None:
        require_number(attribute.name, value, minimum=minimum, strict=strict)

    return check


@attrs.frozen(kw_only=True)
class LengthDistribution:
    """Log-normal token counts with a given mean, clipped to [min_tokens, max_tokens].

    `sigma` is the log-space standard deviation (0 gives a constant). The clip
    shifts the mean slightly; the presets are tuned with it in place.
    """

    mean_tokens: float = attrs.field(validator=_number_at_least(0, strict=True))
    sigma: float = attrs.field(default=0.8, validator=_number_in(0, 10))  # beyond 10 the tail overflows a float
    min_tokens: int = attrs.field(default=1, validator=int_at_least(1))
    max_tokens: int = attrs.field(default=1 << 20, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens {shown(self.min_tokens)} exceeds max_tokens {shown(self.max_tokens)}")

    def sample(self, rng: np.random.Generator) -> int:
        """One token count drawn from `rng`."""
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        value = rng.lognormal(mu, self.sigma) if self.sigma else self.mean_tokens
        return round(min(max(value, self.min_tokens), self.max_tokens))  # clipped first: a huge draw stays a number


@attrs.frozen(kw_only=True)
class ArrivalProcess:
    """Request arrivals at `rate_per_s` on average.

    `cv` is the coefficient of variation of inter-arrival gaps: 1 is a Poisson
    process, above 1 bursty (gamma gaps: clusters separated by lulls). Both lie
    in `ARRIVAL_RANGE`.
    """

    rate_per_s: float = attrs.field(default=1.0, validator=_number_in(*ARRIVAL_RANGE))
    cv: float = attrs.field(default=1.0, validator=_number_in(*ARRIVAL_RANGE))

    def times_s(self, rng: np.random.Generator, count: int) -> np.ndarray[Any, np.dtype[np.float64]]:
        """`count` non-decreasing arrival times in seconds, starting at 0, rounded to milliseconds."""
        return np.concatenate([np.zeros(0), *self._chunks_s(rng, count)])

    def _chunks_s(self, rng: np.random.Generator, count: int) -> Iterator[np.ndarray[Any, np.dtype[np.float64]]]:
        """`times_s(rng, count)` in consecutive chunks of at most `_ARRIVAL_CHUNK`, drawn as they are asked for.

        The same times to the bit, and the same draws from `rng`, as one gamma draw of `count` gaps and one cumsum:
        numpy draws a size-n gamma one variate after another, and a cumsum adds left to right, so a chunk whose
        first gap carries the sum so far continues it exactly."""
        shape = 1.0 / self.cv**2
        scale = 1.0 / (self.rate_per_s * shape)
        total = 0.0
        for start in range(0, count, _ARRIVAL_CHUNK):
            gaps = rng.gamma(shape, scale, size=min(_ARRIVAL_CHUNK, count - start))
            gaps[0] = total if start == 0 else gaps[0] + total  # the first arrival is at 0
            sums = np.cumsum(gaps)
            total = float(sums[-1])
            yield np.round(sums * 1000.0) / 1000.0


@attrs.frozen(kw_only=True)
class WorkloadSpec:
    """Shape of a synthetic workload; see the module docstring for the model.

    Session kinds are mixed by weight. Shared segments (system prompts,
    documents, agent preambles) are drawn from pools whose popularity is Zipf
    with exponent `popularity_skew`. A share `system_prompt_share` (in [0, 1])
    of chat and document sessions open with a system prompt; the others open
    with their document or, a chat, with its first message, so a one-turn chat
    without one shares no block with any other request. A session has 1 + Poisson turns, mean
    `mean_session_turns`: `mean_turns`, or 1 / (1 - `continue_probability`) where
    that is fewer (a session of m turns continues m - 1 arrivals in m, so the two
    say one thing; `continue_probability` None, the default, leaves `mean_turns`
    alone). Between its turns it thinks for an exponential time, mean
    `think_time_s`; an arrival is the next turn of the session whose think time
    ended first, or opens a session when none has. A session ends after its
    turns, at once, or when its next prompt would exceed `max_input_tokens` (at
    most 2**24, what a trace line holds, as `output_tokens.max_tokens` is).
    """

    name: str = attrs.field(default="custom")
    block_size_tokens: int = attrs.field(default=TRACE_BLOCK_SIZE_TOKENS, validator=int_at_least(1))
    chat_weight: float = attrs.field(default=1.0, validator=_number_at_least(0))
    document_weight: float = attrs.field(default=0.0, validator=_number_at_least(0))
    agent_weight: float = attrs.field(default=0.0, validator=_number_at_least(0))
    num_system_prompts: int = attrs.field(default=8, validator=int_at_least(1))
    system_prompt_share: float = attrs.field(default=1.0, validator=_number_in(0, 1))
    system_prompt_tokens: LengthDistribution = LengthDistribution(mean_tokens=1500, sigma=0.5)
    num_documents: int = attrs.field(default=200, validator=int_at_least(1))
    document_tokens: LengthDistribution = LengthDistribution(mean_tokens=20000, sigma=0.6)
    num_agent_preambles: int = attrs.field(default=6, validator=int_at_least(1))
    agent_preamble_tokens: LengthDistribution = LengthDistribution(mean_tokens=6000, sigma=0.3)
    popularity_skew: float = attrs.field(default=1.0, validator=_number_at_least(0))
    user_message_tokens: LengthDistribution = LengthDistribution(mean_tokens=800, sigma=1.0)
    observation_tokens: LengthDistribution = LengthDistribution(mean_tokens=600, sigma=1.0)
    output_tokens: LengthDistribution = LengthDistribution(mean_tokens=300, sigma=1.0, max_tokens=8192)
    mean_turns: float = attrs.field(default=3.0, validator=_number_in(1, 10_000))
    continue_probability: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_number_at_least(0))
    )
    think_time_s: float = attrs.field(default=60.0, validator=_number_in(0, 1e9))
    # At most what a trace line holds: a generated workload can always be written as a trace.
    max_input_tokens: int = attrs.field(default=131072, validator=int_at_least(1, below=MAX_LINE_TOKENS + 1))

    def __attrs_post_init__(self) -> None:
        weights = (self.chat_weight, self.document_weight, self.agent_weight)
        # Summed as the floats they are drawn with: integers each within a float's range may sum past it.
        if not 0 < sum(float(weight) for weight in weights) < math.inf:
            raise ConfigError(
                f"session weights (chat, document, agent) must have a positive, finite sum, got {shown(weights)}"
            )
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {shown(self.name)}")
        for field in attrs.fields(WorkloadSpec):
            if field.type in ("LengthDistribution", LengthDistribution):
                value = getattr(self, field.name)
                if not isinstance(value, LengthDistribution):
                    raise ConfigError(f"{field.name} must be a LengthDistribution, got {shown(value)}")
        if self.output_tokens.max_tokens > MAX_LINE_TOKENS:
            # Refused, not clipped: a clip would move the distribution's mean from what the spec says.
            raise ConfigError(
                f"output_tokens.max_tokens must be at most {MAX_LINE_TOKENS} (2**24, what a trace line holds), "
                f"got {shown(self.output_tokens.max_tokens)}"
            )
        if self.continue_probability is not None and self.continue_probability >= 1:
            raise ConfigError(f"continue_probability must be < 1, got {shown(self.continue_probability)}")

    @property
    def mean_session_turns(self) -> float:
        """Mean turns of a session: `mean_turns`, or 1 / (1 - `continue_probability`) where that is fewer."""
        if self.continue_probability is None:
            return self.mean_turns
        return min(self.mean_turns, 1.0 / (1.0 - self.continue_probability))

    @property
    def continuation_share(self) -> float:
        """The share of arrivals that continue a session, over a long workload: 1 - 1 / `mean_session_turns`."""
        return 1.0 - 1.0 / self.mean_session_turns


PRESETS: dict[str, WorkloadSpec] = {
    "conversation": WorkloadSpec(
        name="conversation",
        chat_weight=0.75,
        document_weight=0.25,
        system_prompt_tokens=LengthDistribution(mean_tokens=2000, sigma=0.3),
        document_tokens=LengthDistribution(mean_tokens=17500, sigma=0.4),
        user_message_tokens=LengthDistribution(mean_tokens=2670, sigma=0.6),
        output_tokens=LengthDistribution(mean_tokens=343, sigma=1.0, max_tokens=8192),
        mean_turns=2.4,
    ),
    "toolagent": WorkloadSpec(
        name="toolagent",
        chat_weight=0.15,
        agent_weight=0.85,
        system_prompt_tokens=LengthDistribution(mean_tokens=1500, sigma=0.3),
        agent_preamble_tokens=LengthDistribution(mean_tokens=5900, sigma=0.3),
        user_message_tokens=LengthDistribution(mean_tokens=1000, sigma=0.6),
        observation_tokens=LengthDistribution(mean_tokens=2110, sigma=0.6),
        output_tokens=LengthDistribution(mean_tokens=182, sigma=0.9, max_tokens=4096),
        mean_turns=2.6,
    ),
    # Fitted to the shape of the public synthetic trace, not only its means (see docs/workloads.md for the fit).
    "synthetic": WorkloadSpec(
        name="synthetic",
        # 28 % of the trace's prompts are under 512 tokens, nearly all with a first block no other request has:
        # one-off questions, here chats with no system prompt.
        chat_weight=0.3,
        # Every other shared prefix in the trace is one long context re-asked by 2-24 requests, all but the last
        # block shared; nothing like a growing tool transcript, so no agent runs.
        document_weight=0.7,
        agent_weight=0.0,
        # No first block is common across contexts (the most common opens 24 of 3,993 requests): no shared
        # system prompt in front of them.
        system_prompt_share=0.0,
        # About 2,900 long prompts over about 1,100 distinct contexts, the most re-asked 24 times: a large,
        # nearly flat pool (Zipf 0.3 gives its top document 0.6 % of the draws).
        num_documents=1000,
        popularity_skew=0.3,
        # The re-asked contexts run 3 K to 45 K tokens (10th to 90th percentile), 18 K at the median.
        document_tokens=LengthDistribution(mean_tokens=21500, sigma=0.8),
        # Short prompts are a few dozen tokens at the median, with a tail to a few thousand.
        user_message_tokens=LengthDistribution(mean_tokens=150, sigma=1.4),
        # Outputs have a median under half their mean and stop under 900 tokens, as a 1 K generation cap
        # leaves them.
        output_tokens=LengthDistribution(mean_tokens=162, sigma=1.2, max_tokens=1024),
        # Re-asks of a context cluster in time (a median 55 s apart, where independent draws over the
        # 17-minute trace would be minutes apart): a third of arrivals continue a session, asking its context
        # again, after a think time of 40 s mean. This sets the hit ratio of a cache that holds a minute of
        # traffic or less.
        mean_turns=1.5,
        think_time_s=40.0,
    ),
}
"""Presets named after the published Mooncake traces. Their sessions have 2.4, 2.6 and 1.5 turns on average
(continuation shares 0.58, 0.62 and 0.33), and their message lengths are tuned, with those turns, to the published
mean input. `synthetic`, the default workload, is fitted to the public synthetic trace's shape as well: its share of
short unshared prompts, its flat pool of re-asked contexts, and its LRU hit ratio at 100 to 20,000 blocks of cache
(docs/workloads.md gives the figures)."""


def preset(name: str) -> WorkloadSpec:
    """The preset called `name` (see `PRESETS`)."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name, such as a list
        raise ConfigError(f"unknown workload preset {shown(name)}; choose one of {sorted(PRESETS)}") from None


Segment = tuple[int, int]  # (segment id, tokens)


class _BlockIds:
    """Chained ids for prompts made of segments: id = f(parent id, pieces of the block), numbered in the order
    blocks are first seen.

    A block's id is kept while its content can recur. With `owned_from`, segments numbered from it on belong to
    one session each (a message, an answer): once `forget` is told that session's segments, its blocks can never
    recur (a block holding a piece of one of them is in no other prompt), so their entries go and the table holds
    only the shared prefixes' blocks and the live sessions'. With its arrival times drawn a chunk at a time
    (`ArrivalProcess._chunks_s`), a generated workload then streams in bounded memory; the ids are the same as if
    nothing were forgotten.
    """

    def __init__(self, block_size_tokens: int, *, owned_from: int | None = None) -> None:
        self._block_size = require_int("block_size_tokens", block_size_tokens, minimum=1)
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}
        self._next = 0  # not len(self._ids): forgotten entries keep their ids spent
        self._owned_from = owned_from
        # A session's segment -> the entries whose last piece is of it (every block that holds a piece of an owned
        # segment ends in one: a session's prompt has its shared segments first).
        self._owned: dict[int, list[tuple[int, tuple[tuple[int, int, int], ...]]]] = {}

    def of(self, segments: list[Segment]) -> tuple[BlockKey, ...]:
        keys: list[BlockKey] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        room = self._block_size
        for segment_id, length in segments:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                pieces.append((segment_id, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    keys.append(BlockKey(parent))
                    pieces, room = [], self._block_size
        if pieces:
            keys.append(BlockKey(self._id(parent, pieces)))
        return tuple(keys)

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        known = self._ids.get(key)
        if known is not None:
            return known
        self._ids[key] = new = self._next
        self._next += 1
        last_segment = pieces[-1][0]
        if self._owned_from is not None and last_segment >= self._owned_from:
            self._owned.setdefault(last_segment, []).append(key)
        return new

    def forget(self, segments: Iterable[Segment]) -> None:
        """Drop the entries of blocks holding a piece of `segments`, a finished session's (see the class)."""
        for segment_id, _ in segments:
            for key in self._owned.pop(segment_id, ()):
                del self._ids[key]


@attrs.define
class _Session:
    prompt: list[Segment]
    kind: str
    turns_left: int
    last_output: Segment | None = None


class _Generator:
    def __init__(self, spec: WorkloadSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self.next_segment = 0
        # Shared pools are drawn up front and rescaled so that their popularity-
        # weighted mean length is the distribution's mean: otherwise the one draw
        # that the most popular member gets would swing the workload's mean.
        self.pools: dict[str, tuple[list[Segment], np.ndarray[Any, Any]]] = {}
        for kind, size, lengths in (
            ("system", spec.num_system_prompts, spec.system_prompt_tokens),
            ("document", spec.num_documents, spec.document_tokens),
            ("preamble", spec.num_agent_preambles, spec.agent_preamble_tokens),
        ):
            # Floats, whatever the spec was given: an int64 power wraps (9 members ** 30 goes negative). A finite
            # skew large enough (the spec refuses any other) overflows n ** skew to infinity for all but the first
            # member, whose weight 1 then takes every draw: the Zipf law's limit, not an error.
            with np.errstate(over="ignore"):
                weights = 1.0 / np.arange(1, size + 1, dtype=np.float64) ** float(spec.popularity_skew)
            weights /= weights.sum()
            drawn = np.array([lengths.sample(rng) for _ in range(size)], dtype=np.float64)
            scaled = np.clip(
                np.round(drawn * lengths.mean_tokens / float(weights @ drawn)), lengths.min_tokens, lengths.max_tokens
            )
            self.pools[kind] = ([self.segment(int(n)) for n in scaled], weights)
        kinds = np.array([spec.chat_weight, spec.document_weight, spec.agent_weight], dtype=np.float64)
        self.kind_weights = kinds / kinds.sum()
        # Every segment made from here on is a session's own: the pools above are all that sessions share.
        self.ids = _BlockIds(spec.block_size_tokens, owned_from=self.next_segment + 1)

    def segment(self, length: int) -> Segment:
        self.next_segment += 1
        return (self.next_segment, length)

    def shared(self, kind: str) -> Segment:
        members, weights = self.pools[kind]
        return members[int(self.rng.choice(len(members), p=weights))]

    def new_session(self) -> _Session:
        spec = self.spec
        kind = ("chat", "document", "agent")[int(self.rng.choice(3, p=self.kind_weights))]
        turns = 1 + int(self.rng.poisson(spec.mean_session_turns - 1.0))
        if kind == "agent":
            prompt = [self.shared("preamble"), self.segment(spec.user_message_tokens.sample(self.rng))]
        else:
            prompt = [self.shared("system")] if self.opens_with_system_prompt() else []
            if kind == "document":
                prompt.append(self.shared("document"))
            prompt.append(self.segment(spec.user_message_tokens.sample(self.rng)))
        return _Session(prompt=prompt, kind=kind, turns_left=turns)

    def opens_with_system_prompt(self) -> bool:
        """Whether a new chat or document session opens with a system prompt (`system_prompt_share`).

        At a share of 0 or 1 nothing is drawn for it: a spec at the default 1 consumes the generator as it did
        before the share existed, so the other presets' workloads are unchanged by it."""
        share = self.spec.system_prompt_share
        return share >= 1 or (share > 0 and float(self.rng.random()) < share)

    def next_turn(self, session: _Session) -> bool:
        """Extend `session` by its last output and a new message; False if that passes `max_input_tokens` (the
        session then ends)."""
        assert session.last_output is not None and session.turns_left > 0
        lengths = self.spec.observation_tokens if session.kind == "agent" else self.spec.user_message_tokens
        message = self.segment(lengths.sample(self.rng))
        extended = [*session.prompt, session.last_output, message]
        if sum(length for _, length in extended) > self.spec.max_input_tokens:
            return False
        session.prompt = extended
        return True

    def clip(self, session: _Session) -> None:
        """Cut a first prompt that exceeds the context limit (its tail goes)."""
        total, kept = 0, []
        for segment_id, length in session.prompt:
            length = min(length, self.spec.max_input_tokens - total)
            if length > 0:
                kept.append((segment_id, length))
                total += length
        session.prompt = kept


def generate_requests(
    spec: WorkloadSpec,
    *,
    num_requests: int,
    arrivals: ArrivalProcess = ArrivalProcess(),
    seed: int = 0,
) -> Iterator[Request]:
    """Draw a workload: `num_requests` requests in arrival order.

    Args:
        spec: the workload shape (see `PRESETS`).
        num_requests: how many requests.
        arrivals: the arrival process.
        seed: the seed of the only random generator used.

    Yields:
        Requests with ids "0", "1", ..., arrival times in whole milliseconds and
        chained `block_keys` at `spec.block_size_tokens`.

    Raises:
        ConfigError: a spec or arrival process of the wrong type, a negative count or seed, or arrivals that run
            past what a replay can time (`arrival_problem`).
    """
    if not isinstance(spec, WorkloadSpec):
        raise ConfigError(f"spec must be a WorkloadSpec (see workload.preset), got {shown(spec)}")
    if not isinstance(arrivals, ArrivalProcess):
        raise ConfigError(f"arrivals must be an ArrivalProcess, got {shown(arrivals)}")
    num_requests = require_int("num_requests", num_requests, minimum=0)
    seed = require_int("seed", seed, minimum=0)
    # The arrivals come first from the one generator, the rest of the workload from where they leave it. Drawn
    # here a chunk at a time, they are checked at the call and leave `rng` there; `_generate` draws them again,
    # from the seed, as it reaches them: memory for a chunk, not for every request's time.
    rng = np.random.default_rng(seed)
    start = 0
    for times in arrivals._chunks_s(rng, num_requests):
        _check_arrivals(times, start, num_requests, arrivals)
        start += len(times)
    return _generate(spec, arrivals._chunks_s(np.random.default_rng(seed), num_requests), rng)


def _check_arrivals(times: np.ndarray[Any, Any], start: int, num_requests: int, arrivals: ArrivalProcess) -> None:
    """Refuse arrival times (requests `start`, `start + 1`, ..., non-decreasing) of which one passes
    `arrival_problem`'s bound, naming the first that does: a generated workload can always be written as a
    trace and replayed."""
    if len(times) == 0 or arrival_problem(float(times[-1])) is None:
        return
    late, problem = next((i, p) for i, arrival_s in enumerate(times.tolist()) if (p := arrival_problem(arrival_s)))
    raise ConfigError(
        f"request {start + late} of num_requests={num_requests} would arrive at {times[late]:.6g} s "
        f"(rate_per_s={arrivals.rate_per_s:g}, cv={arrivals.cv:g}), {problem}: ask fewer requests or a higher rate"
    )


def _generate(
    spec: WorkloadSpec, arrival_chunks: Iterator[np.ndarray[Any, Any]], rng: np.random.Generator
) -> Iterator[Request]:
    generator = _Generator(spec, rng)
    # Sessions with turns left, by when their think time ends (then by when they thought: ties go first come).
    # A session that used its turns is in no list: a finished session never takes an arrival.
    thinking: list[tuple[float, int, _Session]] = []
    arrivals_s = (arrival_s for times in arrival_chunks for arrival_s in times.tolist())  # one per request
    for index, now in enumerate(arrivals_s):
        session = None
        while session is None and thinking and thinking[0][0] <= now:
            candidate = heapq.heappop(thinking)[2]
            if generator.next_turn(candidate):
                session = candidate
            else:  # past the context limit: the session ends, its blocks with it
                generator.ids.forget(candidate.prompt)
        if session is None:
            session = generator.new_session()
            generator.clip(session)
        session.turns_left -= 1
        output = spec.output_tokens.sample(rng)
        session.last_output = generator.segment(output)
        block_keys = generator.ids.of(session.prompt)
        if session.turns_left > 0:
            ready_s = now + float(rng.exponential(spec.think_time_s))
            heapq.heappush(thinking, (ready_s, index, session))
        else:  # its last turn: no prompt will hold its own blocks again
            generator.ids.forget(session.prompt)
        yield Request(
            request_id=RequestId(str(index)),
            arrival_s=now,
            input_length=sum(length for _, length in session.prompt),
            output_length=output,
            block_keys=block_keys,
            block_size_tokens=spec.block_size_tokens,
        )


def fixed_length_requests(
    *,
    input_tokens: int,
    output_tokens: int,
    num_requests: int,
    cache_ratio: float = 0.5,
    num_prefixes: int = 8,
    arrivals: ArrivalProcess = ArrivalProcess(),
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    seed: int = 0,
) -> list[Request]:
    """Requests of one prompt and output length whose prompts share prefixes (the arXiv
    paper's long-context workloads: 16 K to 128 K-token prompts, 512 outputs, 50 % cache ratio).

    Each prompt starts with one of `num_prefixes` shared prefixes (chosen
    uniformly) of `cache_ratio · input_tokens` tokens rounded down to whole
    blocks, then a part of its own; with a cache that holds the prefixes, the
    share of prompt tokens found cached tends to that rounded share,
    `floor(cache_ratio · input_tokens / block_size_tokens) · block_size_tokens / input_tokens`:
    `cache_ratio` itself where it falls on a block boundary (the paper's
    prompts at 50 %), less by under a block otherwise (nothing for a prompt
    whose share is under one block).

    Raises:
        ConfigError: a length, prefix count or block size below 1, a length past `MAX_LINE_TOKENS` (what a trace
            line holds), a negative request count or seed, `cache_ratio` outside [0, 1), `arrivals` no
            `ArrivalProcess`, or arrivals that run past what a replay can time (`arrival_problem`).
    """
    input_tokens = require_int("input_tokens", input_tokens, minimum=1, below=MAX_LINE_TOKENS + 1)
    output_tokens = require_int("output_tokens", output_tokens, minimum=1, below=MAX_LINE_TOKENS + 1)
    num_requests = require_int("num_requests", num_requests, minimum=0)
    num_prefixes = require_int("num_prefixes", num_prefixes, minimum=1)
    block_size_tokens = require_int("block_size_tokens", block_size_tokens, minimum=1)
    seed = require_int("seed", seed, minimum=0)
    cache_ratio = require_number("cache_ratio", cache_ratio, minimum=0)
    if cache_ratio >= 1:
        raise ConfigError(f"cache_ratio must be in [0, 1), got {cache_ratio}")
    if not isinstance(arrivals, ArrivalProcess):
        raise ConfigError(f"arrivals must be an ArrivalProcess, got {shown(arrivals)}")
    rng = np.random.default_rng(seed)
    times = arrivals.times_s(rng, num_requests)
    _check_arrivals(times, 0, num_requests, arrivals)
    ids = _BlockIds(block_size_tokens)
    # Whole blocks: the tokens of a partial last block are keyed with the prompt's own, so a cache could not share them.
    prefix_tokens = int(cache_ratio * input_tokens) // block_size_tokens * block_size_tokens
    prefixes = [(-1 - i, prefix_tokens) for i in range(num_prefixes)]  # negative ids: never a unique part's
    requests = []
    for index in range(num_requests):
        segments = [prefixes[int(rng.integers(num_prefixes))]] if prefix_tokens else []
        segments.append((index, input_tokens - prefix_tokens))
        requests.append(
            Request(
                request_id=RequestId(str(index)),
                arrival_s=float(times[index]),
                input_length=input_tokens,
                output_length=output_tokens,
                block_keys=ids.of(segments),
                block_size_tokens=block_size_tokens,
            )
        )
    return requests
