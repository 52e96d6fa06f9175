"""examples/experiments.py's options: checked by name before any replay, none ignored, and the answers they give.

Most run the command in a subprocess whose replays are forbidden (`GUARDED`): an option that is checked only
after a replay, or not at all, shows as the guard's exit instead of the option's one-line error.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake.sched.join import DecodeLoad
from tests.test_examples import SMALL, reject_all_router, run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
REPLAYED = 99  # the guard's exit status: a replay started

# experiments.py with every replay (disaggregated and coupled) an exit, and matplotlib importable or not.
GUARDED = """
import sys
from mooncake.sim.coupled import CoupledCluster
from mooncake.sim.disaggregated import DisaggregatedCluster

def replayed(*_args, **_kwargs):
    print("a replay started", file=sys.stderr)
    sys.exit({replayed})

DisaggregatedCluster.run = CoupledCluster.run = replayed
if {no_matplotlib}:
    sys.modules["matplotlib"] = None
sys.path.insert(0, {examples!r})
sys.argv[0] = "experiments.py"
import experiments
sys.exit(experiments.main(sys.argv[1:]))
"""


def _memory_cap() -> None:
    """Under the old code an extra zero built lists of instance names until the machine ran out of memory."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def guarded(*argv: str, out: Path, no_matplotlib: bool = False) -> subprocess.CompletedProcess[str]:
    """experiments.py `argv` (--out `out`, no progress bars) with replays forbidden."""
    code = GUARDED.format(replayed=REPLAYED, no_matplotlib=no_matplotlib, examples=str(EXAMPLES))
    return subprocess.run(
        [sys.executable, "-c", code, *argv, "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=_memory_cap,
    )


def experiments(*argv: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "experiments.py"), *argv, "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def refused(done: subprocess.CompletedProcess[str], message: str) -> bool:
    return done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        # the workload's and the cluster's options, once checked only after minutes of long-context search
        (("--trace", "MISSING"), "No such file or directory"),
        (("--prefill", "-3"), "--prefill must be >= 0, got -3"),
        # ... or named by the library's fields
        (("--tbt-slo", "-1"), "--tbt-slo must be a finite number > 0, got -1.0"),
        (("--cache-blocks", "-5"), "--cache-blocks must be >= 0, got -5"),
        (("--block-size", "0"), "--block-size must be >= 1, got 0"),
        (("--seed", "-1"), "--seed must be >= 0, got -1"),
        # the long-context clusters take --cpp now: 3P+1D and 2P+2D cannot both be whole groups of 2
        (("--cpp", "2"), "--cpp 2 must divide 3P+1D's 3 prefill nodes (whole groups of prefill nodes)"),
        # a prompt no decode node holds: its block keys were generated for ever
        (("--lengths", "99999999999999999999"), "--lengths must be at most 1,456,299 tokens"),
    ],
)
def test_throughput_checks_every_option_before_the_long_context_search(
    option: tuple[str, str], message: str, tmp_path: Path
) -> None:
    """throughput ran its whole long-context sweep before it read the workload or built the cluster."""
    name, value = option
    value = str(tmp_path / "missing.jsonl") if value == "MISSING" else value
    workload = [] if name == "--trace" else ["--num-requests", "50"]
    done = guarded("throughput", *workload, name, value, "--tbt-thresholds", "0.1", "--no-plots", out=tmp_path)
    assert refused(done, message), done.stderr


@pytest.mark.parametrize(
    ("cluster", "nodes"),
    [(("--cpp", "2", "--prefill", "6"), ["12", "2", "6"]), (("--cpp", "3", "--prefill", "3"), ["3", "6"])],
)
def test_cache_sweeps_whole_cpp_groups_by_default(cluster: tuple[str, ...], nodes: list[str], tmp_path: Path) -> None:
    """Half, as many and twice the prefill nodes, each rounded down to whole CPP groups: half of 6 nodes in groups
    of 2 (3) and of 3 in groups of 3 (1) made the experiment fail on its own defaults."""
    argv = ["cache", "--preset", "synthetic", "--num-requests", "40", "--rate", "2", *cluster, "--capacities", "100"]
    report = json.loads(experiments(*argv, "--no-plots", "--json", out=tmp_path).stdout)
    assert sorted(report["ratio"]) == [f"{n}x100" for n in nodes]


def test_cache_names_nodes_that_are_no_whole_cpp_groups_before_running(tmp_path: Path) -> None:
    done = guarded("cache", *SMALL, "--nodes", "4,3", "--cpp", "2", "--capacities", "100", out=tmp_path)
    assert refused(done, "--cpp 2 must divide --nodes 3 (whole groups of prefill nodes)"), done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        *(
            (("cache", "--router", router), f"--router {router} does not apply to cache: it never plans a transfer")
            for router in ("random", "round_robin", "load_balancing", "local_cache_aware")
        ),
        (("cache", "--threshold", "inf"), "--threshold inf does not apply to cache: kvcache_centric then never"),
        (("threshold", "--local-cache"), "--local-cache does not apply to threshold: without a global pool nothing"),
    ],
)
def test_an_experiment_whose_replays_could_transfer_nothing_is_refused(
    argv: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    """cache compares the global pool with local caches and threshold sweeps when to transfer: with a router that
    never transfers, or no pool to transfer from, every replay was the same and the tables read as findings."""
    assert refused(guarded(*argv, *SMALL, out=tmp_path), message)


def test_cache_marks_no_largest_gain_where_the_global_pool_gained_nothing(tmp_path: Path) -> None:
    """A router file's router that plans no transfer is run (it is not known to transfer nothing), but a ratio of
    1 is no "largest" gain."""
    router = "examples/policies/two_choices.py:TwoChoices"
    argv = ["cache", *SMALL, "--router", router, "--nodes", "1,2", "--capacities", "100", "--no-plots"]
    done = subprocess.run(
        [sys.executable, "examples/experiments.py", *argv, "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    assert "<- largest" not in done.stdout and "the global pool gained nothing" in done.stdout, done.stdout
    assert json.loads((tmp_path / "cache.json").read_text())["largest_ratio"] is None


def test_cache_json_tells_an_infinite_ratio_from_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON has no infinity: an infinite gain (only the global pool hit) and none to compare (neither hit) were both
    null; the cells of the first are listed in `infinite_ratio`."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import experiments as module
    import paper.cache

    def replay(spec: Any, _requests: Any, _args: Any) -> Any:
        hits = 0.5 if spec.global_pool and spec.num_prefill == 2 else 0.0  # at 1 node neither hits
        return SimpleNamespace(summary=SimpleNamespace(cache_hit_ratio=hits, mean_prefill_s=1.0))

    monkeypatch.setattr(paper.cache, "replay", replay)
    argv = ["cache", *SMALL, "--nodes", "1,2", "--capacities", "100", "--no-plots", "--no-progress"]
    assert module.experiment([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cache.json").read_text())
    assert report["ratio"] == {"1x100": None, "2x100": None}
    assert report["infinite_ratio"] == ["2x100"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("scheduling", "--prefill", "3000000"), "--prefill must be <= 1024 (nodes of a role), got 3000000"),
        (("scheduling", "--decode", "99999999999999999999"), "--decode must be <= 1024 (nodes of a role), got 9999"),
        (("scheduling", "--cpp", "4096"), "--cpp must be <= 1024 (nodes of a role), got 4096"),
        (("cache", "--nodes", "2,99999999999999999999"), "argument --nodes: must be an integer >= 1 and <= 1024"),
    ],
)
def test_node_counts_are_bounded_by_name(argv: tuple[str, ...], message: str, tmp_path: Path) -> None:
    """An extra-zeros node count built a list of instance names until memory ran out (a MemoryError traceback)."""
    assert refused(guarded(*argv, *SMALL, "--no-plots", out=tmp_path), message)


@pytest.mark.parametrize("experiment", ["rejection", "overload"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_decode_bound_experiments_name_a_bad_tbt_slo(experiment: str, value: str, tmp_path: Path) -> None:
    """Their decode pool is sized by --tbt-slo: a bad one was blamed on the workload ("asks for nan nodes")."""
    done = guarded(experiment, *SMALL, "--tbt-slo", value, "--no-plots", out=tmp_path)
    assert refused(done, f"--tbt-slo must be a finite number > 0, got {float(value)}"), done.stderr


def test_throughput_runs_its_long_context_clusters_with_the_options_policies(tmp_path: Path) -> None:
    """The long-context part ran a fixed router, admission and global pool whatever the options said: a router
    that rejects every request now finds no rate, and the header and the JSON name what ran."""
    name = reject_all_router(tmp_path)
    argv = ["throughput", *SMALL, "--lengths", "16384", "--throughput-requests", "5", "--tbt-thresholds", "0.1"]
    argv += ["--router", name, "--admission", "baseline", "--local-cache", "--no-plots", "--json"]
    report = json.loads(experiments(*argv, out=tmp_path / "out").stdout)
    assert report["max_rps"]["3P+1D"] == report["max_rps"]["2P+2D"] == {"16384": 0.0}
    assert report["policies"] == {"router": name, "admission": "baseline"}
    assert report["clusters"]["3P+1D"].startswith("3P+1D ") and "(local caches)" in report["clusters"]["3P+1D"]
    text = experiments(*argv[:-1], out=tmp_path / "out").stdout.splitlines()[0]
    assert f"router {name}, admission baseline" in text and "(local caches)" in text, text


def test_throughput_states_the_threshold_exactly_where_a_replay_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """throughput's header and JSON list the threshold by `registry.reads_threshold`, the rule --threshold's
    refusal follows: a threshold router with a global pool. It listed one for kvcache_centric by name, with local
    caches too, where nothing reads it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from paper.throughput import _policies
    from serving import registry

    for router in [*registry.ROUTERS, "mine.py:Mine"]:
        for global_pool in (True, False):
            args = SimpleNamespace(
                router=router, admission="baseline", threshold=3.0, global_pool=global_pool, predictor="uniform"
            )
            stated = "threshold" in _policies(args)  # type: ignore[arg-type]
            assert stated == (router in registry.THRESHOLD_ROUTERS and global_pool), (router, global_pool)


def test_scheduling_json_ranks_in_tie_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON ranking was a plain order: its first entry read as the winner though several routers tied."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from paper.scheduling import tiers

    values = {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.5 + 1e-12, "e": 0.1}
    assert tiers(["a", "b", "c", "d", "e"], values) == [["a", "b"], ["c", "d"], ["e"]]
    assert tiers([], {}) == []
    routers = "random,kvcache_centric"
    argv = ["scheduling", *SMALL, "--routers", routers, "--no-plots", "--json"]
    ranking = json.loads(experiments(*argv, out=tmp_path).stdout)["ranking"]
    assert set(ranking) == {"mean_ttft", "goodput", "slo_attainment"}
    for groups in ranking.values():
        assert all(isinstance(group, list) for group in groups), groups
        assert sorted(router for group in groups for router in group) == sorted(routers.split(","))


def test_plots_without_matplotlib_are_refused_before_any_replay(tmp_path: Path) -> None:
    """The plots are drawn after every replay, before the JSON: without matplotlib the whole run was lost."""
    out = tmp_path / "out"
    done = guarded("overload", *SMALL, "--speedups", "2", out=out, no_matplotlib=True)
    assert refused(done, "a plot needs matplotlib"), done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("rejection", "--admission", "early_rejection"), "--admission does not apply to rejection"),
        (("overload", "--speedup", "1"), "--speedup does not apply to overload"),
        (("threshold", "--threshold", "1.5"), "--threshold does not apply to threshold"),
        (("scheduling", "--router", "kvcache_centric"), "--router does not apply to scheduling"),
        (("cache", "--cache-blocks", "10000"), "--cache-blocks does not apply to cache"),
        # the option as given: --global-pool and --local-cache set one value
        (("cache", "--global-pool"), "--global-pool does not apply to cache"),
        (("scheduling", "--predictor", "uniform"), "--predictor does not apply to --admission early_rejection"),
    ],
)
def test_an_option_an_experiment_sets_itself_is_refused_at_its_default_value_too(
    argv: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    """Options were compared with their defaults, so one given with its default value passed and was ignored."""
    assert refused(guarded(*argv, *SMALL, "--no-plots", out=tmp_path), message)


def test_make_figures_leaves_the_experiments_output_folder_alone(tmp_path: Path) -> None:
    """A figure's experiment wrote <repo>/build/experiments/<name>.json, over the user's own run, even with
    --check; it writes to a folder of its own now. Run on a copy of docs/ beside the real examples/."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "make_figures.py").write_text((ROOT / "docs" / "make_figures.py").read_text())
    (tmp_path / "examples").symlink_to(EXAMPLES)
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path / 'docs')!r}); import make_figures; "
        "print(sorted(make_figures._experiment('scheduling', '--preset', 'synthetic', '--num-requests', '40', "
        "'--rate', '2', '--routers', 'random')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "mean_ttft_s" in done.stdout
    assert not (tmp_path / "build").exists()


def test_predictors_scores_the_predictive_policys_own_predictor(tmp_path: Path) -> None:
    """The default uniform predictor's t_d is the workload's mean output x the TBT objective, which no fixed
    candidate (10 s, 5 s) was: the policy's own predictor was never scored. The other rows stay."""
    argv = ["predictors", *SMALL, "--horizons", "1", "--no-plots"]
    report = json.loads(experiments(*argv, "--json", out=tmp_path).stdout)
    assert report["policy_predictor"] == "uniform (policy's)"
    kept = {"current_load", "uniform_td_10s", "uniform_td_5s", "output_length", "expected_output"}
    assert set(report["mae"]) == kept | {"uniform (policy's)"}
    text = experiments(*argv, out=tmp_path).stdout
    assert "predictor: --predictor uniform, t_d = " in text and "\nuniform (policy's) " in text


@pytest.mark.parametrize("thresholds", ["3", "3,inf"])
def test_threshold_says_flat_only_across_two_finite_thresholds(thresholds: str, tmp_path: Path) -> None:
    """One finite threshold is flat on its own: the conclusion, which blames the workload, was printed anyway."""
    done = experiments("threshold", *SMALL, "--thresholds", thresholds, "--no-plots", out=tmp_path)
    assert "flat across" not in done.stdout, done.stdout


def test_cache_json_names_the_clusters_its_rows_ran(tmp_path: Path) -> None:
    """The JSON's `cluster` described the options' cluster (5P+5D, 10,000 blocks per node, global pool here), which
    no row ran: the rows sweep prefill nodes and capacities in both modes. It now says what the header says and the
    nodes and capacities swept, as the table's rows and the JSON's keys have them."""
    argv = ["cache", "--preset", "synthetic", "--num-requests", "40", "--rate", "2", "--prefill", "5"]
    argv += ["--decode", "5", "--nodes", "1,2", "--capacities", "0,100", "--no-plots"]
    table = experiments(*argv, out=tmp_path).stdout.splitlines()
    report = json.loads(experiments(*argv, "--json", out=tmp_path).stdout)
    header = table[1].removeprefix("cluster: ").split(", prefill nodes and cache blocks per node as below")[0]
    assert header == "5 decode nodes, llama3-70b on 8xA800", table[1]
    cells = [key.split("x") for key in report["ratio"]]
    nodes = ", ".join(dict.fromkeys(n for n, _ in cells))
    blocks = ", ".join(dict.fromkeys(b for _, b in cells))
    assert (nodes, blocks) == ("1, 2", "0, 100")
    swept = f"prefill nodes {nodes} x cache blocks per node {blocks}, each with a global pool and with local caches"
    assert report["cluster"] == f"{header}; {swept}"


def test_cache_names_a_capacity_of_0_not_the_workload_where_nothing_hit(tmp_path: Path) -> None:
    """With every capacity 0 nothing can hit, whatever the workload: the note blamed the workload ("shares no
    prefix") for what the options did. A workload that does share prefixes (the synthetic preset) shows it."""
    argv = ["cache", *SMALL, "--nodes", "1,2", "--capacities", "0", "--no-plots"]
    done = experiments(*argv, out=tmp_path)
    assert "shares no prefix" not in done.stdout, done.stdout
    assert "neither the global pool nor the local caches hit (every capacity is 0 blocks)" in done.stdout
    argv[argv.index("0")] = "100"  # the same workload hits once a cache holds anything
    assert json.loads(experiments(*argv, "--json", out=tmp_path).stdout)["hit_ratio"]["global"]["1x100"] > 0


@pytest.mark.parametrize(
    ("workload", "thresholds", "alike"),
    # SMALL's size and rate. The conversation preset's 1 and 2 route some requests differently (the hit ratios
    # differ, within 1 %); the synthetic preset's 1 and 1.25 route all alike (since its refit to the public trace,
    # every finite threshold from 1 to 16 routes its 150 requests alike, so it no longer shows the first case).
    [("conversation", "1,2,inf", False), ("synthetic", "1,1.25", True)],
)
def test_threshold_states_why_it_is_flat_only_where_the_replays_show_it(
    workload: str, thresholds: str, alike: bool, tmp_path: Path
) -> None:
    """The flat note stated as fact that best_len / prefix_len is 1 or infinite, so that no finite threshold falls
    between, beside a table whose 1.0 and 2.0 rows differ. It now states a cause only where every request was
    routed alike at every finite threshold, and otherwise says that the thresholds did change decisions."""
    small = [workload if arg == "synthetic" else arg for arg in SMALL]
    argv = ["threshold", *small, "--thresholds", thresholds, "--no-plots"]
    done = experiments(*argv, out=tmp_path)
    report = json.loads(experiments(*argv, "--json", out=tmp_path).stdout)
    finite = [key for key in report["cache_hit_ratio"] if key != "inf"]
    assert (len({report["cache_hit_ratio"][key] for key in finite}) == 1) == alike, report  # the premise
    assert "flat across the finite thresholds (within 1 %)" in done.stdout, done.stdout
    assert "is 1 or infinite" not in done.stdout
    if alike:
        assert "every request was routed alike at each" in done.stdout
        assert f"between {float(finite[0]):g} and {float(finite[-1]):g}" in done.stdout
    else:
        assert "though they routed requests differently" in done.stdout


@pytest.mark.parametrize("value", ["1000,,5000", "1000,", ",1000"])
def test_an_empty_item_of_a_list_is_refused_by_name_as_the_cli_refuses_it(value: str, tmp_path: Path) -> None:
    """experiments.py dropped empty items ("1000,,5000" ran 1000 and 5000) where `mooncake trace capacity` refused
    them: one rule (`mooncake.cli.comma_separated`) for both, the same words."""
    message = f"expected a comma-separated list with no empty item, got {value!r}"
    assert refused(guarded("cache", *SMALL, "--capacities", value, out=tmp_path), f"argument --capacities: {message}")
    cli = subprocess.run(
        [sys.executable, "-m", "mooncake", "trace", "capacity", "t.jsonl", "--capacity-blocks", value],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused(cli, f"argument --capacity-blocks: {message}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("scheduling", "--num-requests", "abc"), "argument --num-requests: must be an integer >= 1 and <= 1000000"),
        (("scheduling", "--routers", "random,random"), "argument --routers: 'random' is given twice"),
        (("cache", "--nodes", "2000"), "argument --nodes: must be an integer >= 1 and <= 1024, got '2000'"),
        (("threshold", "--thresholds", "0.5"), "argument --thresholds: must be a number >= 1"),
        (("predictors", "--horizons", "1e20"), "argument --horizons: must be a finite number >= 0"),
    ],
)
def test_a_bad_option_value_is_one_line_on_stderr(argv: tuple[str, ...], message: str, tmp_path: Path) -> None:
    """A value argparse refused printed the whole usage block (over 20 lines) where main's docstring and
    docs/simulation.md promise one line and status 2 (`mooncake.cli.OneLineParser`, the `mooncake` command's)."""
    done = guarded(*argv, out=tmp_path)
    assert refused(done, message), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"experiments.py {argv[0]}: error: ") and "--help" in done.stderr


def test_predictors_takes_the_predictor_it_scores(tmp_path: Path) -> None:
    """predictors scores the predictive policy's --predictor in its "(policy's)" row, yet refused the option
    under the default --admission (early_rejection predicts nothing), so only uniform could ever be scored."""
    argv = ["predictors", *SMALL, "--predictor", "expected_output", "--horizons", "1", "--no-plots", "--json"]
    report = json.loads(experiments(*argv, out=tmp_path).stdout)
    assert report["policy_predictor"] == "expected_output (policy's)"
    assert report["mae"]["expected_output (policy's)"] == report["mae"]["expected_output"]


def test_cache_blames_small_capacities_not_a_workload_that_shares_prefixes(tmp_path: Path) -> None:
    """With capacities too small to hold a prompt's prefix nothing hits, and the note said "the workload shares no
    prefix" of the synthetic preset, which shares many: it now says which is true, by the workload's prefix reuse."""
    argv = ["cache", *SMALL, "--nodes", "1", "--capacities", "0,1", "--no-plots"]
    done = experiments(*argv, out=tmp_path)
    assert "shares no prefix" not in done.stdout, done.stdout
    assert "the capacities may be too small to hold a prefix" in done.stdout, done.stdout


def test_current_load_counts_the_tokens_generated_as_decode_selection_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "The load now" summed the prompts only, while the decode rule, the Conductor and the other predictors count
    the tokens generated too: at a horizon of 0 its context was off by the whole output so far (267 tokens here)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from paper.predictors import CurrentLoad

    from mooncake.sched.cost import HARDWARE, MODELS
    from mooncake.sched.step import DecodeCostModel
    from mooncake.sched.view import ActiveDecode
    from mooncake.types import RequestId

    step = DecodeCostModel(model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"])
    active = [ActiveDecode(request_id=RequestId("a"), start_s=0.0, context_tokens=1000, output_tokens=100)]
    pace = step.step_s(1, 1000)
    assert CurrentLoad(step_model=step).predict(active, [], 10.5 * pace, 99.0) == DecodeLoad(1, 1010, 1100)
    assert CurrentLoad(step_model=step).predict(active, [], 1e6, 99.0) == DecodeLoad(
        1, 1100, 1100
    )  # at most its output
    argv = ["predictors", *SMALL, "--horizons", "0", "--no-plots", "--json"]
    now = json.loads(experiments(*argv, out=tmp_path).stdout)["mae"]["current_load"]["0.0"]
    assert now["batch_size_mae"] == now["kv_tokens_mae"] == 0
    assert now["context_tokens_mae"] < 20, now  # the estimate's pace is the batch's step now: close, not exact


@pytest.mark.parametrize("engine", ["disaggregated", "coupled"])
def test_replay_sizes_its_cluster_at_speedup_1(engine: str) -> None:
    """--speedup sized the automatic cluster from the sped-up arrivals (4P+4D became 7P+7D at 2x): the load stayed
    at the sizing rule's 0.8 instead of rising, while rejection and overload sped the workload up on the cluster sized
    for it at its own pace. One rule now (`simulation.sized_cluster`): sized at speed 1, loaded by --speedup."""
    titles = []
    for speedup in ("1", "2"):
        done = run("replay.py", *SMALL, "--engine", engine, "--speedup", speedup, "--no-progress", timeout=120)
        titles.append(done.stdout.splitlines()[0])
    assert titles[0] == titles[1], titles
    assert titles[0].startswith("4P+4D " if engine == "disaggregated" else "8 coupled "), titles


def test_an_experiment_sizes_its_cluster_at_speedup_1(tmp_path: Path) -> None:
    """As replay.py: scheduling at --speedup 2 ran on 7P+7D, the cluster sized for the sped-up arrivals."""
    argv = ["scheduling", *SMALL, "--speedup", "2", "--routers", "random", "--no-plots"]
    header = experiments(*argv, out=tmp_path).stdout.splitlines()[1]
    assert header.startswith("cluster: 4P+4D "), header
