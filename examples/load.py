"""Replay a Mooncake-format trace over HTTP against a real cluster; print the same summary as replay.py.

    python examples/load.py --trace ../shared/traces/synthetic_trace.jsonl --num-requests 200 \\
        [--url http://127.0.0.1:8000 | --config examples/configs/tiny.toml] \\
        [--length-scale 0.03125] [--output-scale 0.0625] [--speedup 20] [--json] [--out DIR]

Without `--url` it starts the cluster of `--config` itself (and stops it after),
its Conductor on the cost models `--profile` names if given (`examples/profile_engine.py`),
its `[limits] max_prompt_tokens` raised to `--max-prompt-tokens`, the whole
checked against this machine before it starts. With `--url` the config gives
only the objectives (not checked against this machine) and `--profile` is refused.
The workload options are replay.py's (`simulation.add_workload_options`: a
trace, or a generated preset at `--rate`, `--num-requests` of them, arrival
times divided by `--speedup`), so both replay the same requests.

Scaling (`examples/scaling.py`, which replay.py's `--config` shares), so that
a CPU model copes: every 512-token block of the trace becomes
`512 × length_scale` characters of text derived from its hash id, so requests
that share hash ids share a prefix exactly as in the trace (prompts are capped
at `--max-prompt-tokens`); outputs are `output_length × output_scale` tokens (at
least 1, at most `--max-output-tokens`).

Each request streams (with `stream_options.include_usage` and
`continuous_usage_stats`) so that TTFT and every interval between events are
measured at the client, an event being a chunk with a choice, its text empty or
not (a special token's, a stream's finish), as vLLM's benchmark counts them
(`async_request_openai_completions`; a stream with no choice fails, as it fails
there); TBT is the paper's (mean of the longest 10 % intervals), the
output tokens the usage's completion tokens. The gateway's detokenized stream sends no
chunk for a token that adds no text yet, so a client sees fewer intervals than
tokens; the usage in every chunk tells how many tokens each event carried
(`ClientRecord.event_tokens`, left empty when a server sends no such usage).
A rejection is an error whose body says so (`outcome`: before or after prefill,
as the gateway and the vLLM router answer with `sched.outcome.http_status`); its
reason is the error's `code`; other errors (a 429 or 503 that names no outcome, such as
the gateway's refusal of a connection past its limits, which is no scheduling decision)
count as failed and the first of each
kind is printed to stderr (a stream with a line that is no completion chunk
fails as a "malformed stream", one that ends without `[DONE]` or its final
usage as a "truncated stream"; `--timeout` must be > 0; a usage without `prompt_tokens_details`, vLLM's
without `--enable-prompt-tokens-details`, counts no prefix hit, and stderr says
so once). The client's connections are not capped (aiohttp's default is 100): a
request never waits in the client, where the wait would count in its TTFT.
Requests name the model the server lists at `/v1/models` (or `--model`). The summary is
`mooncake.sim.metrics.summarize`'s, as for a simulated replay, with
`sim_wall_s` the wall time of the run; `mean_prefill_s` and `wasted_prefill_s`
are not visible to a client and stay 0; `failed` counts the requests that got
no answer, which the table's outcomes line shows too.

Exit status: 0; 1 when no request completed; 2 with one line on stderr for an
error found before or instead of the run (an option, the config, `--out` naming
a file, a `--url` that is no URL, does not answer or lists no model); 130 after
Ctrl-C, 143 after SIGTERM, 141 when stdout's reader has gone (`run_interruptible`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulation
from scaling import Scaling, add_scaling_options, output_of, prompt_of, scaling_of

from mooncake import _json
from mooncake._extras import script_needs_extra
from mooncake.cli import OneLineParser, error_message, file_path, folder_path, one_line, run_interruptible
from mooncake.errors import ConfigError, MooncakeError, PeerUnavailable

with script_needs_extra("load"):  # its HTTP client: the cluster extra, named (not a traceback)
    import aiohttp
    from serving.api import DECODE_HEADER, PREFILL_HEADER
from mooncake.sched.outcome import Outcome, Reason, reason_named
from mooncake.sim.metrics import RequestRecord, summarize, top_mean
from mooncake.sim.report import summary_table, write_json
from mooncake.types import Request

if TYPE_CHECKING:
    from serving.config import ClusterConfig


@attrs.define(eq=False)
class ClientRecord(RequestRecord):
    """A request as the client saw it: with `event_tokens`, the tokens each event after the first carried (one
    per interval; from the usage in every chunk), empty when the server did not send that usage."""

    event_tokens: list[int] = attrs.field(factory=list)
    # Its usage said what the server found cached (vLLM: with --enable-prompt-tokens-details).
    has_cached_tokens: bool = False


_REJECTIONS = {Outcome.REJECTED_BEFORE_PREFILL.value, Outcome.REJECTED_AFTER_PREFILL.value}


async def _rejection(answer: aiohttp.ClientResponse) -> tuple[Outcome, Reason] | None:
    """How an error answer rejected the request, or None when it is a failure: a rejection's error body
    names the outcome (and the reason as its code); an answer that names none (a connection refused at the
    gateway's limits, a 429 or 503) was no scheduling decision, as vLLM's benchmark counts any non-200 as
    failed."""
    try:
        error = (await answer.json(content_type=None, loads=_json.loads))["error"]
    except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
        error = None
    if not isinstance(error, dict):
        error = {}
    outcome = error.get("outcome")
    if outcome in _REJECTIONS:
        return Outcome(outcome), reason_named(error.get("code"))
    return None


async def one(
    session: aiohttp.ClientSession,
    url: str,
    record: ClientRecord,
    body: dict[str, Any],
    started: float,
    timeout_s: float,
    failures: dict[str, str],
) -> None:
    """Send one request and fill `record`; a failure's message goes to `failures` under its kind."""
    last: float | None = None
    ended = False  # the stream said it was whole: `[DONE]`, or the usage-only chunk `include_usage` asked for
    carried: int | None = 0  # the completion tokens the events so far carried (None: a chunk had no usage)

    def failed(kind: str, message: str, reason: Reason = Reason.FAILED) -> None:
        record.reason = reason
        record.finish_s = time.perf_counter() - started  # answered (as the simulators record a refusal's time)
        failures.setdefault(kind, message)

    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as answer:
            if answer.status != 200:
                rejection = await _rejection(answer)
                if rejection is not None:
                    # When it was answered: goodput's span runs to the last answer of any kind, as vLLM's benchmark
                    # times the whole run (`sim.metrics.summarize`, which the simulated twin's figures come from).
                    record.outcome, record.reason = rejection
                    record.finish_s = time.perf_counter() - started
                    return
                failed(f"HTTP {answer.status}", await answer.text())
                return
            record.prefill_instance = answer.headers.get(PREFILL_HEADER)  # type: ignore[assignment]
            record.decode_instance = answer.headers.get(DECODE_HEADER)  # type: ignore[assignment]
            async for raw in answer.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                if line[5:].strip() == "[DONE]":
                    ended = True
                    continue
                data = _chunk(line[5:])
                if data is None:
                    failed("malformed stream", f"a data line that is no completion chunk: {line[:200]}")
                    return
                if "error" in data:
                    error = data["error"]
                    failed("stream error", str(error.get("message", error) if isinstance(error, dict) else error))
                    return
                now = time.perf_counter() - started
                usage, choices = data.get("usage") or {}, data["choices"]
                generated = _count(usage.get("completion_tokens"))
                if not choices:  # the last chunk, the usage alone
                    details = usage.get("prompt_tokens_details")  # vLLM: with --enable-prompt-tokens-details
                    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
                    record.input_tokens = _count(usage.get("prompt_tokens"), record.input_tokens)
                    record.prefix_tokens = cached if cached is not None else record.prefix_tokens
                    record.has_cached_tokens = cached is not None
                    if generated is not None:  # what was generated (a stop ends early)
                        record.output_tokens = generated
                    ended = True
                    continue
                # An event even without text (a special token, a lone UTF-8 lead byte, the finish of a stream that
                # ended on text): vLLM's benchmark times the first token from the first chunk with a choice.
                if last is None:
                    record.first_token_s = now
                else:
                    record.intervals.add(now - last, 0.0, 1)
                    if carried is not None and generated is not None:
                        record.event_tokens.append(generated - carried)
                carried = generated if carried is not None else None
                last = now
            if not ended:
                # A connection closed early ends the stream cleanly too: without either end mark the answer may be
                # cut short, its output count the one asked for and its TBT from a few intervals.
                failed("truncated stream", "the stream ended without [DONE] or its final usage")
                return
            if last is None:  # as vLLM's benchmark fails it: "Never received a valid chunk to calculate TTFT."
                failed("empty stream", "the stream carried no choice: no first token")
                return
            if carried is None:
                record.event_tokens.clear()
            record.finish_s = time.perf_counter() - started
            record.tbt_s = top_mean(record.intervals) if record.intervals.count else 0.0
            record.outcome = Outcome.COMPLETED
    except TimeoutError:
        failed("timeout", f"no answer within {timeout_s} s", Reason.TIMEOUT)
    except aiohttp.ClientError as error:
        failed(type(error).__name__, str(error))


def _chunk(text: str) -> dict[str, Any] | None:
    """A stream's `data:` payload as a completion chunk (an object with a list of `choices`, its `usage` an object
    or null), or an error event (an object with `error`); None for anything else (not JSON, say)."""
    try:
        data = _json.loads(text)
    except ValueError:  # no JSON, or nested too deep
        return None
    if not isinstance(data, dict):
        return None
    if "error" in data:
        return data
    if not isinstance(data.get("choices"), list) or not isinstance(data.get("usage") or {}, dict):
        return None
    return data


def _count(value: Any, default: int | None = None) -> Any:
    """A token count from a usage object: a non-negative integer, else `default`."""
    return value if type(value) is int and value >= 0 else default


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model the server lists at `/v1/models`.

    Raises:
        PeerUnavailable: nothing answers at `url`, or it answers with no model list (not a gateway, or a wrong path).
    """
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as answer:
            answer.raise_for_status()
            return str((await answer.json(content_type=None, loads=_json.loads))["data"][0]["id"])
    except aiohttp.ClientResponseError as error:
        raise PeerUnavailable(f"{url}/v1/models answered {error.status} {error.message}: is it a gateway?") from error
    except (aiohttp.ClientError, TimeoutError) as error:  # refused, unresolved, no answer in time
        raise PeerUnavailable(f"cannot reach {url}/v1/models: {str(error) or type(error).__name__}") from error
    except (ValueError, LookupError, TypeError) as error:  # JSON, but not an OpenAI model list
        raise PeerUnavailable(f"{url}/v1/models lists no model: {type(error).__name__}: {error}") from error


async def replay_http(
    url: str, requests: list[Request], scaling: Scaling, *, model: str | None = None, timeout_s: float = 120.0
) -> tuple[list[ClientRecord], float]:
    """Send `requests` scaled by `scaling` at their arrival times (the first at once), each streamed; a record
    per request (its times from this call's start) and the wall time until the last answer ended."""
    records: list[ClientRecord] = []
    first_arrival = requests[0].arrival_s if requests else 0.0
    failures: dict[str, str] = {}
    # No cap on connections (aiohttp's default is 100): a request past it would wait here for one, and that wait
    # would count in its TTFT.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await served_model(session, url)
        started = time.perf_counter()
        tasks = []
        for request in requests:
            arrival = request.arrival_s - first_arrival
            delay = arrival - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            prompt, output = prompt_of(request, scaling), output_of(request, scaling)
            record = ClientRecord(
                request_id=request.request_id,
                arrival_s=time.perf_counter() - started,
                input_tokens=len(prompt.encode()),  # the server's count replaces it (usage.prompt_tokens)
                output_tokens=output,
            )
            records.append(record)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "seed": int(request.request_id) % 2**31,
            }
            tasks.append(asyncio.create_task(one(session, url, record, body, started, timeout_s, failures)))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    for kind, message in failures.items():
        print(one_line(f"load.py: failed ({kind}): {message}"), file=sys.stderr)
    completed = [record for record in records if record.outcome is Outcome.COMPLETED]
    if completed and not any(record.has_cached_tokens for record in completed):
        print(
            "load.py: no answer's usage said what was cached (prompt_tokens_details.cached_tokens; a vLLM server "
            "needs --enable-prompt-tokens-details): the cache hit ratio counts none",
            file=sys.stderr,
        )
    return records, wall


def add_workload_options(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """replay.py's workload options (`simulation.add_workload_options`), as a cluster over HTTP takes them: the
    Conductor keeps its own seed (the config's cluster builds it), so `--seed` seeds the workload alone."""
    simulation.add_workload_options(p, **defaults)
    for action in p._actions:
        if action.dest == "seed":
            action.help = "seed of the generated workload (default %(default)s)"


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace, program: str) -> None:
    """The options load.py and validate.py share, checked before any work.

    Raises:
        ConfigError: `--timeout` not a finite number > 0 (aiohttp takes 0, a negative or nan as no timeout at all,
            and a stalled stream would then hold the run for ever); `--no-progress`, given to a program that draws
            no progress bar.
    """
    simulation.check_positive("--timeout", args.timeout)
    simulation.refuse_unused(p, args, ("no_progress",), f"to {program}: it draws no progress bar")


def served_config(config: ClusterConfig, *, profile: Path | None, max_prompt_tokens: int) -> ClusterConfig:
    """The config of a cluster started here for a workload: any free port, `profile` (if given) as its `[prefill]
    profile`, its `[limits] max_prompt_tokens` raised to the workload's (a longer prompt would get a 400 and count
    as failed, not measured); checked against this machine as `load_config` checks a file, which `with_overrides`
    does not.

    Raises:
        ConfigError: a profile that cannot be read, a limit the config cannot hold, a cluster the machine cannot.
    """
    from serving.machine import Machine, check_machine

    config = config.with_overrides("cluster", port=0)
    if profile is not None:
        config = config.with_overrides("prefill", profile=str(profile))
    config = config.with_overrides("limits", max_prompt_tokens=max(config.limits.max_prompt_tokens, max_prompt_tokens))
    check_machine(config, Machine.here())
    return config


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n")[0])
    add_workload_options(p, num_requests=100)
    p.add_argument("--url", help="a running cluster's gateway, http://HOST:PORT (default: start --config's)")
    p.add_argument("--model", help="the model to name in requests (default: the first at /v1/models)")
    p.add_argument("--config", type=file_path, default=Path(__file__).parent / "configs" / "tiny.toml")
    p.add_argument("--profile", type=file_path, help="the cluster's fitted cost models (its [prefill] profile)")
    add_scaling_options(p)
    p.add_argument("--ttft-slo", type=float, help="seconds (default: --config's [slo] ttft_s)")
    p.add_argument("--tbt-slo", type=float, help="seconds (default: --config's [slo] tbt_s)")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=folder_path, help="write summary.json here")
    return p


def check_url(url: str) -> None:
    """`--url` names an HTTP server (aiohttp would refuse another at the first request, in a traceback).

    Raises:
        ConfigError: `url` is not an http:// or https:// URL with a host (and a port in [0, 65535], if any).
    """
    wanted = f"--url must be an http:// or https:// URL, such as http://127.0.0.1:8000, got {url!r}"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - read for its check: urllib raises on a port that is no number in range
    except ValueError as error:  # a malformed IPv6 host, a port out of range: urllib's own ValueError
        raise ConfigError(f"{wanted}: {error}") from error
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(wanted)


def main(argv: list[str] | None = None) -> int:
    """Run the command line (the exit statuses of the module's docstring); SIGTERM stops a cluster it started,
    too (`run_interruptible`)."""
    return run_interruptible("load", lambda: load(argv))


def load(argv: list[str] | None) -> int:
    p = parser()
    args = p.parse_args(argv)
    cluster = None
    try:
        check_options(p, args, "load.py")
        if args.out is not None:  # found before the run, not after it
            simulation.check_out_dir(args.out)
        if args.url is not None:
            check_url(args.url)
            if args.profile is not None:
                raise ConfigError("--profile does not apply with --url: the running cluster has its own profile")
        if args.profile is not None:  # named by its option, before the config's [prefill] profile is blamed for it
            simulation.check_profile(args.profile)
        scaling = scaling_of(args)
        requests = simulation.load_workload(args)
        from serving.config import load_config
        from serving.machine import Machine

        # With --url the config gives the objectives alone: the cluster runs elsewhere, so this machine bounds nothing.
        config = load_config(args.config, machine=Machine() if args.url is not None else None)
        # Scored against the objectives the cluster admits against, unless the command line names others.
        objectives = (("ttft_s", "--ttft-slo", args.ttft_slo), ("tbt_s", "--tbt-slo", args.tbt_slo))
        for _, option, value in objectives:
            if value is not None:
                simulation.check_positive(option, value)
        slo = attrs.evolve(
            config.slo.objectives(), **{name: value for name, _, value in objectives if value is not None}
        )
        url = args.url
        if url is None:
            from serving.launch import start_cluster

            config = served_config(config, profile=args.profile, max_prompt_tokens=args.max_prompt_tokens)
            cluster = start_cluster(config)  # a config (or --max-prompt-tokens) it cannot serve: a MooncakeError
            url = cluster.url
        records, wall = asyncio.run(replay_http(url, requests, scaling, model=args.model, timeout_s=args.timeout))
        summary = summarize(records, slo, sim_wall_s=wall)
        failed = sum(1 for r in records if r.outcome is None)
        result = {**summary.to_json(), "failed": failed}
        if args.out:
            write_json(result, args.out / "summary.json")
    except (MooncakeError, OSError) as error:
        print(one_line(f"load: {error_message(error)}"), file=sys.stderr)
        return 2
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        s = summary
        print(url)
        print("\n".join(summary_table(s, failed=failed)))
        print(
            f"SLO attainment {s.slo_attainment:.3f}   goodput {s.goodput_rps:.3f} req/s   "
            f"cache hit ratio {s.cache_hit_ratio:.3f}   wall {s.sim_wall_s:.1f} s"
        )
    if not summary.completed:  # a run that served nothing is no measurement, whatever its table says
        print(f"load: no request completed ({failed:,} of {summary.num_requests:,} failed)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
