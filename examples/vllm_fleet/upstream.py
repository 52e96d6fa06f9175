"""What the router reads from a vLLM server: its model and geometry at start-up, its state at each health check.

`probe` asks `/v1/models` (the served names, `max_model_len`; every card
without a `parent` is a name of the served model, as `--served-model-name a b`
lists both, and one with a `parent` is a LoRA adapter's), `/metrics`
(`vllm:cache_config_info`: block size, prefix caching, KV capacity) and
`/tokenize` (a probe text, to compare with the router's tokenizer), and refuses
what would make the router's index or estimates wrong, each in a line that
names the instance, the value it serves and what to change (`reprobe`, for a
server that answers again, refuses another model than it served at start-up
too, and says what else changed):

- a block size other than `[router] block_size` (the router's block keys would
  never match the server's blocks);
- prefix caching off (the server caches nothing to route to);
- a tokenizer that gives the probe text other ids than the router's.

`calibrate` times a few prefills of random token ids (streamed, `max_tokens`
1, after one warm-up request; a seed of its caller's, so that no server has
them cached) so that the router's prefill model starts from
what the server measures rather than a guess.

`scrape` reads the gauges and counters the router follows from the Prometheus
text (`vllm:num_requests_running`, `_waiting`, `kv_cache_usage_perc`,
`prefix_cache_queries_total`, `prefix_cache_hits_total`), summed over engines.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs

from mooncake import _json
from mooncake._checks import shown
from mooncake.errors import ConfigError
from mooncake.sched import PrefillSample

__all__ = ["PROBE_TEXT", "InstanceInfo", "InstanceState", "calibrate", "lines", "probe", "reprobe", "scrape"]

PROBE_TEXT = "The quick brown fox jumps over the lazy dog: 0123456789, naïve café."
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@attrs.frozen(kw_only=True)
class InstanceInfo:
    """A vLLM server as probed at start-up. `model` is its first served name, `served_names` all of them (the
    cards of its /v1/models without a `parent`: `--served-model-name a b`), `cards` every card it lists, LoRA
    adapters' (with their base model as `parent`) included."""

    model: str
    max_model_len: int
    card: dict[str, Any] = attrs.field(factory=dict, eq=False)  # its /v1/models entry, as the server gave it
    cards: tuple[dict[str, Any], ...] = attrs.field(default=(), eq=False)
    served_names: tuple[str, ...] = ()
    block_size: int
    prefix_caching: bool
    kv_capacity_tokens: int


@attrs.frozen(kw_only=True)
class InstanceState:
    """A vLLM server's counters as its `/metrics` gives them (summed over its engines)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        samples.append((match["name"], dict(_LABEL.findall(match["labels"] or "")), value))
    return samples


def scrape(text: str) -> InstanceState:
    """The counters the router follows, from a `/metrics` answer (absent ones are 0)."""
    sums: dict[str, float] = {}
    for name, _labels, value in _samples(text):
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    return InstanceState(
        running=int(sums.get("vllm:num_requests_running", 0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        kv_usage=sums.get("vllm:kv_cache_usage_perc", 0.0),
        prefix_queries=sums.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits=sums.get("vllm:prefix_cache_hits_total", 0.0),
    )


async def probe(
    session: Any, instance_id: str, url: str, *, block_size: int, tokenizer: Any, timeout_s: float
) -> InstanceInfo:
    """Read and check one server (see the module docstring).

    Raises:
        ConfigError: the server cannot be reached or answers what the router cannot use.
    """
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    where = f"instance {instance_id} ({url})"
    try:
        async with session.get(f"{url}/v1/models", timeout=timeout) as answer:
            answer.raise_for_status()
            models = (await answer.json(loads=_json.loads))["data"]
        async with session.get(f"{url}/metrics", timeout=timeout) as answer:
            answer.raise_for_status()
            metrics = await answer.text(errors="replace")  # a stray byte costs one sample, not the server
        cards = tuple(dict(card) for card in models)
        # vLLM's base-model cards have `parent` None; an adapter's names its base model.
        served_names = tuple(str(card["id"]) for card in cards if not card.get("parent"))
        model = served_names[0] if served_names else str(cards[0]["id"])
        base = next(card for card in cards if str(card["id"]) == model)
        async with session.post(
            f"{url}/tokenize", json={"model": model, "prompt": PROBE_TEXT}, timeout=timeout
        ) as answer:
            answer.raise_for_status()
            served_tokens: Sequence[int] = list((await answer.json(loads=_json.loads))["tokens"])
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise ConfigError(f"{where} is unreachable: {type(error).__name__}: {error}") from error
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ConfigError(f"{where} does not answer as a vLLM server does: {error!r}") from error
    config = next((labels for name, labels, _ in _samples(metrics) if name == "vllm:cache_config_info"), None)
    if config is None:
        raise ConfigError(f"{where}: its /metrics has no vllm:cache_config_info (is it a vLLM server?)")
    served_block = _count(where, "vllm:cache_config_info block_size", config.get("block_size"))
    if served_block != block_size:
        raise ConfigError(
            f"{where} stores blocks of {served_block} tokens, [router] block_size = {block_size}: set block_size to "
            f"the servers' --block-size (the router's block keys must be the servers' blocks)"
        )
    prefix_caching = config.get("enable_prefix_caching") == "True"
    if not prefix_caching:
        raise ConfigError(f"{where} runs without prefix caching: start it with --enable-prefix-caching")
    ours = tokenizer.encode(PROBE_TEXT)
    if list(served_tokens) != list(ours):
        raise ConfigError(
            f"{where}: [router] tokenizer does not match the served model {model!r}: the probe text is "
            f"{len(served_tokens)} tokens {list(served_tokens)[:8]}... there, {len(ours)} tokens {list(ours)[:8]}... "
            f"here (point tokenizer at the served model's directory)"
        )
    capacity = config.get("kv_cache_size_tokens")
    blocks = config.get("num_gpu_blocks")
    # The capacity in tokens where the server reports one (unset reads as 0: "None" too), else its blocks.
    kv_tokens = (
        _count(where, "vllm:cache_config_info kv_cache_size_tokens", capacity)
        or _count(where, "vllm:cache_config_info num_gpu_blocks", blocks) * served_block
    )
    return InstanceInfo(
        model=model,
        max_model_len=_count(where, f"model {model!r} max_model_len", base.get("max_model_len")),
        card=base,
        cards=cards,
        served_names=served_names or (model,),
        block_size=served_block,
        prefix_caching=prefix_caching,
        kv_capacity_tokens=kv_tokens,
    )


def _count(where: str, field: str, value: object) -> int:
    """A count a server reports (a metric label's text or a JSON number); absent, null or empty is 0 (unknown).

    Raises:
        ConfigError: anything else than a whole number >= 0, naming the server, the field and the value.
    """
    if value is None or value == "" or value == "None":  # vLLM labels an unset field "None"
        return 0
    if type(value) is int and value >= 0:
        return value
    if type(value) is str and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value)
    raise ConfigError(f"{where} does not answer as a vLLM server does: {field} is {shown(value)}, not a whole number")


async def reprobe(
    session: Any,
    instance_id: str,
    url: str,
    *,
    before: InstanceInfo,
    block_size: int,
    tokenizer: Any,
    timeout_s: float,
) -> tuple[InstanceInfo, list[str]]:
    """Probe a server that answers again (restarted, perhaps with other flags) against its start-up probe.

    Returns:
        Its probe, and what changed that the router follows (`max_model_len`, `kv_capacity_tokens`), each as
        "name old -> new".

    Raises:
        ConfigError: `probe`'s refusals (another block size, prefix caching off, another tokenizer, no answer),
            or another model than `before`'s.
    """
    info = await probe(session, instance_id, url, block_size=block_size, tokenizer=tokenizer, timeout_s=timeout_s)
    if info.model != before.model:
        raise ConfigError(
            f"instance {instance_id} ({url}) came back serving model {info.model!r}, the fleet serves "
            f"{before.model!r} (start it with --served-model-name {before.model})"
        )
    names = ("max_model_len", "kv_capacity_tokens")
    changes = [
        f"{n} {getattr(before, n)} -> {getattr(info, n)}" for n in names if getattr(before, n) != getattr(info, n)
    ]
    return info, changes


async def lines(content: Any) -> AsyncIterator[bytes]:
    """An aiohttp answer's lines (`content`: its StreamReader), each with its newline, however long: aiohttp's own
    line reader refuses a line past its buffer (an SSE chunk with a long prompt's log-probabilities, or an echoed
    long prompt, is one line)."""
    pending = bytearray()
    async for chunk in content.iter_any():
        start = len(pending)
        pending += chunk
        begin = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield bytes(pending[begin : end + 1])
            begin = start = end + 1
        del pending[:begin]
    if pending:
        yield bytes(pending)


async def calibrate(
    session: Any, url: str, model: str, *, vocab_size: int, lengths: Sequence[int], seed: int, timeout_s: float
) -> list[PrefillSample]:
    """Time to first token of one streamed request per prompt length in `lengths` (random ids, nothing cached),
    after a warm-up request of the first length that is not counted.

    Raises:
        ConfigError: a request failed (the server cannot serve what the router will send it).
    """
    import aiohttp

    rng = random.Random(seed)
    samples = []
    for number, length in enumerate([lengths[0], *lengths]):
        prompt = [rng.randrange(vocab_size) for _ in range(length)]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
        sent = time.monotonic()
        first = None
        try:
            async with session.post(
                f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as answer:
                if answer.status != 200:
                    raise ConfigError(
                        f"{url}: a calibration prefill of {length} tokens answered {answer.status}: "
                        f"{(await answer.text())[:200]}"
                    )
                async for line in lines(answer.content):
                    if first is None and line.startswith(b"data:"):
                        first = time.monotonic()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ConfigError(f"{url}: a calibration prefill of {length} tokens failed: {error}") from error
        if number and first is not None:
            samples.append(PrefillSample(num_tokens=length, prefix_tokens=0, seconds=first - sent))
    return samples
