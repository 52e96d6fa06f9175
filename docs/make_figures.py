"""Write the figures quoted in README.md and docs/ from the code that produces them.

    python docs/make_figures.py                 # regenerate every figure (the experiments take minutes)
    python docs/make_figures.py decode-step     # only these
    python docs/make_figures.py --check --fast  # exit 1 if a fast figure differs (tests/test_docs.py)

A figure is the text between ``<!-- figure: NAME -->`` and ``<!-- /figure -->`` in a document
(inside a sentence, or a table set off by blank lines); everything around it is prose written by
hand. Where that prose draws a conclusion from the
figures (an ordering, a "never"), the figure's function checks it and fails, naming the claim,
when the numbers stop supporting it: then the prose must be rewritten, not the figure.

Figures that need the public synthetic trace read it from ../shared/traces (or --trace) and are
left alone, with a note, where it is absent.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs

from mooncake.sched.step import StepBranch

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
SPAN = re.compile(r"(<!-- figure: ([\w-]+) -->)(.*?)(<!-- /figure -->)", re.DOTALL)


class ClaimBroken(Exception):
    """The figures no longer support what the prose around them says."""


def claim(holds: bool, what: str) -> None:
    if not holds:
        raise ClaimBroken(f"the docs claim {what}, which the new figures do not support: rewrite the prose")


@attrs.frozen
class Figure:
    document: str
    make: Callable[[Path], str]
    fast: bool
    needs_trace: bool
    block: bool = False  # a table between blank lines, not words inside a sentence


def _experiment(*argv: str) -> dict[str, object]:
    """An experiment's JSON report, as it prints it. The file it also writes goes to a folder of this run's own,
    removed after: its default, build/experiments, holds the user's runs, which a figure (even a --check) would
    replace."""
    with tempfile.TemporaryDirectory(prefix="make_figures-") as out:
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "experiments.py"),
                *argv,
                "--json",
                "--no-plots",
                "--no-progress",
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
    report: dict[str, object] = json.loads(done.stdout)
    return report


def _seconds(branch: StepBranch, batch: int, context_tokens: int) -> float:
    return branch.fixed_s + branch.per_sequence_s * batch + branch.per_context_token_s * context_tokens


def decode_step(_trace: Path) -> str:
    from mooncake.sched import HARDWARE, MODELS, DecodeCostModel

    context = 2_048
    cells = {}
    for gpus in ("8xA800", "8xH800"):
        model = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE[gpus])
        cells[gpus] = [model.step_s(b, b * context) * 1e3 for b in (1, 64, 256, 1_024)]
    a800 = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"]).roofline()
    memory, compute = a800.branches
    crossover = next(
        b for b in range(1, 100_000) if _seconds(compute, b, b * context) > _seconds(memory, b, b * context)
    )
    h800 = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xH800"])
    fits = h800.capacity_tokens() // context
    # The A800's 80 GB is 81,920 MiB, the H800's 81,559 (nvidia-smi): each HBM holds its own count.
    fits_a800 = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"]).capacity_tokens() // context
    mem_h, comp_h = h800.roofline().branches
    claim(
        all(_seconds(comp_h, b, b * context) <= _seconds(mem_h, b, b * context) for b in range(1, fits + 1)),
        "8xH800 stays memory-bound for 2 K requests within its HBM",
    )

    def ms(values: list[float]) -> list[str]:
        return [f"{v:.3g}" if v >= 100 else f"{v:.1f}" for v in values]

    a, h = ms(cells["8xA800"]), ms(cells["8xH800"])
    return (
        f"{a[0]} ms at B = 1, {a[1]} at 64, {a[2]} at 256 and {a[3]} at 1,024, compute-bound from B = {crossover}\n"
        f"(the A800s' HBM holds {fits_a800} such requests, the H800s' {fits}; the model prices larger batches all the\n"
        f"same);\n"
        f"8×H800 (3.2× the compute, 1.6× the bandwidth) stays memory-bound for every batch of them its HBM holds:\n"
        f"{h[0]}, {h[1]}, {h[2]} and {h[3]} ms"
    )


def _hit_ratios(trace: Path, policy: str, prefix_aware: bool, capacities: list[int]) -> list[float]:
    from mooncake.cli import capacity_sweep
    from mooncake.workload import load_trace

    keys = [r.block_keys for r in load_trace(trace)]
    points = capacity_sweep(keys, policy, prefix_aware=prefix_aware, capacities_blocks=capacities, jobs=1)
    return [p.hit_ratio for p in points]


def trace_summary(trace: Path) -> str:
    from mooncake.workload import load_trace, trace_stats

    stats = trace_stats(load_trace(trace))
    lru = _hit_ratios(trace, "lru", False, [1_000, 10_000, 50_000])
    aware = _hit_ratios(trace, "lru", True, [1_000, 10_000, 50_000])
    return (
        f"On the public FAST'25 synthetic trace: {stats.num_requests:,} requests, mean input "
        f"{stats.mean_input_length:,.1f} and output {stats.mean_output_length:.1f} tokens,\n"
        f"prefix reuse ratio {stats.prefix_reuse_ratio:.4f}; LRU hit ratio {' / '.join(f'{r:.4f}' for r in lru)} "
        f"at 1 k / 10 k / 50 k blocks\n(prefix-aware LRU {' / '.join(f'{r:.4f}' for r in aware)})."
    )


def capacity_table(trace: Path) -> str:
    capacities = [1_000, 10_000, 50_000]
    rows = [("LRU", "lru", False), ("LRU, prefix-aware", "lru", True), ("LFU", "lfu", False)]
    rows += [("length-aware", "length_aware", False), ("SIEVE", "sieve", False), ("SIEVE, prefix-aware", "sieve", True)]
    ratios = {label: _hit_ratios(trace, policy, aware, capacities) for label, policy, aware in rows}
    claim(len({r[-1] for r in ratios.values()}) == 1, "every policy reaches the reuse ratio at 50 k blocks")
    lines = ["| capacity (blocks) | " + " | ".join(f"{c:,}" for c in capacities) + " |"]
    lines.append("| --- |" + " --- |" * len(capacities))
    lines += [f"| {label} | " + " | ".join(f"{r:.4f}" for r in values) + " |" for label, values in ratios.items()]
    return "\n".join(lines)


def two_choices(_trace: Path) -> str:
    routers = ["kvcache_centric", "load_balancing", "examples/policies/two_choices.py:TwoChoices"]
    report = _experiment("scheduling", "--routers", ",".join(routers))
    ttft, p99, hits = (report[k] for k in ("mean_ttft_s", "p99_ttft_s", "cache_hit_ratio"))
    assert isinstance(ttft, dict) and isinstance(p99, dict) and isinstance(hits, dict)
    kv, lb, two = routers
    claim(hits[two] > hits[lb], "TwoChoices gets more cache hits than load balancing")
    claim(abs(ttft[two] / ttft[lb] - 1) < 0.3, "TwoChoices and load balancing are close on mean TTFT")
    claim(ttft[kv] < 0.5 * min(ttft[lb], ttft[two]), "the KV-cache-centric router is far ahead of both")
    return (
        f"On the default generated workload (4,000 requests of the synthetic preset, seed 0, {report['cluster']}) "
        "it gets\nmore cache hits than load balancing "
        f"({hits[two]:.3f} vs {hits[lb]:.3f}), and the two trade places on mean TTFT with the seed\n(here "
        f"{ttft[two]:.2f} s vs {ttft[lb]:.2f} s, p99 {p99[two]:.1f} s vs {p99[lb]:.1f} s): two instances drawn at "
        "random\nbalance the load worse than the shortest queue of all, which its extra hits offset about as "
        "often as\nnot; both are far behind the "
        f"KV-cache-centric router ({ttft[kv]:.2f} s, hit ratio {hits[kv]:.3f})"
    )


def overload_table(trace: Path) -> str:
    report = _experiment("overload", "--trace", str(trace), "--speedups", "2,4")
    policies = {
        "baseline": "baseline",
        "early_rejection": "early rejection",
        "predictive_early_rejection": "predictive",
    }

    def at(key: str, policy: str, speedup: str) -> float:
        table = report[key]
        assert isinstance(table, dict)
        return float(table[policy][speedup])

    lines = [
        "| speed-up | policy | rejected | after prefill | wasted prefill | SLO attainment | goodput | decode swing |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for speedup in ("2.0", "4.0"):
        for policy, label in policies.items():
            wasted = at("wasted_prefill_s", policy, speedup)
            lines.append(
                f"| {speedup[0]}× | {label} | {at('rejected', policy, speedup):,.0f} "
                f"| {at('rejected_after_prefill', policy, speedup):,.0f} | {f'{wasted:.2g} s' if wasted else '0'} "
                f"| {at('slo_attainment', policy, speedup):.3f} | {at('goodput_rps', policy, speedup):.2f} "
                f"| {at('oscillation', policy, speedup):.0f} |"
            )
        rejected = {p: at("rejected", p, speedup) for p in policies}
        claim(rejected["baseline"] == min(rejected.values()), f"the baseline rejects the fewest at {speedup}×")
        claim(at("wasted_prefill_s", "early_rejection", speedup) == 0, f"early rejection wastes nothing at {speedup}×")
        for key, what in (("slo_attainment", "attainment"), ("goodput_rps", "goodput")):
            values = [at(key, p, speedup) for p in policies]
            if speedup == "2.0":  # the decode side barely binds: the prose says the three are close
                claim(min(values) >= 0.95 * max(values), f"the three policies' {what} are within 5 % at 2×")
            else:
                claim(at(key, "early_rejection", speedup) == max(values), f"early rejection has the best {what} at 4×")
        swing = min(at("oscillation", p, speedup) for p in policies)
        claim(at("oscillation", "early_rejection", speedup) == swing, f"early rejection swings least at {speedup}×")
    claim(
        rejected["predictive_early_rejection"] > rejected["early_rejection"],
        "predictive rejects more than early rejection at 4×",
    )
    return "\n".join(lines)


FIGURES = {
    "decode-step": Figure("docs/scheduling.md", decode_step, fast=True, needs_trace=False),
    "trace-summary": Figure("README.md", trace_summary, fast=True, needs_trace=True),
    "capacity-table": Figure("docs/cache-foundations.md", capacity_table, fast=False, needs_trace=True, block=True),
    "two-choices": Figure("docs/simulation.md", two_choices, fast=False, needs_trace=False),
    "overload-table": Figure("docs/scheduling.md", overload_table, fast=False, needs_trace=True, block=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("names", nargs="*", help=f"figures to make (default: all): {', '.join(FIGURES)}")
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    parser.add_argument("--fast", action="store_true", help="only the figures that take seconds")
    parser.add_argument("--trace", type=Path, default=SHARED_TRACE, help="the public synthetic trace")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; choose from {sorted(FIGURES)}")
    chosen = [n for n in (args.names or FIGURES) if not args.fast or FIGURES[n].fast]
    stale = []
    for name in chosen:
        figure = FIGURES[name]
        if figure.needs_trace and not args.trace.exists():
            print(f"{name}: skipped, {args.trace} is absent", file=sys.stderr)
            continue
        path = ROOT / figure.document
        text = path.read_text()
        spans = [m for m in SPAN.finditer(text) if m.group(2) == name]
        if len(spans) != 1:
            raise SystemExit(f"{figure.document}: expected one figure span {name!r}, found {len(spans)}")
        (span,) = spans
        made = figure.make(args.trace)
        made = f"\n\n{made}\n\n" if figure.block else made
        if made == span.group(3):
            continue
        if args.check:
            stale.append(f"{name} ({figure.document}):\n  docs: {span.group(3).strip()!r}\n  code: {made.strip()!r}")
        else:
            path.write_text(text[: span.start(3)] + made + text[span.end(3) :])
            print(f"{name}: rewritten in {figure.document}")
    if stale:
        print("figures out of date (run python docs/make_figures.py):\n" + "\n".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
