"""Edge contracts of `serving.launch`, `protocol`, `tokenizer` and `models` that the other tests leave open.

A mutation round found them: each test here failed on a plausible change of the product that the other
files pass. In-process where the contract allows it: the sweeps on a folder of `tmp_path` (names with pids
above the kernel's `pid_max`, which name no process), `core_plan` against its "last cores first" rule, a
`RunningCluster` around an in-memory backend twin, the Ray backend's environment and signal bookkeeping.
The parent watch runs in forked children (no worker: a segment, the watch, a SIGTERM handler as the worker
would install), and two tests start real worker processes: a start that fails stops every worker and leaves
no segment; a close stops workers gracefully and unlinks what a killed one left. Then the connection
guard's refusal reports, aiohttp's own error answers, the header limit; byte tokens outside the bytes and
byte-level tokens that split a character (a `Decoder` double) against the reference cut of test_api; the
decode limits, profile errors and the Conductor's wiring of `models`.

Every wait is bounded; every process, segment and folder made here is removed at the end.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import inspect
import ipaddress
import itertools
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving import launch
from serving.config import ClusterConfig, load_config
from serving.dispatch import Dispatcher
from serving.launch import (
    PARENT_DEATH_SIGNAL,
    PID_MAX,
    LocalBackend,
    RayBackend,
    RunningCluster,
    core_plan,
    remove_stale_ssd_folders,
    start_cluster,
)
from serving.models import build_conductor, decode_limits, read_profile
from serving.protocol import LOGGERS, ConnectionGuard, EdgeLimits, JsonRequestHandler, http_url
from serving.tokenizer import ByteTokenizer, TextStream
from serving.worker import WorkerSpec

from mooncake.errors import ConfigError, EngineError, PeerUnavailable
from mooncake.transfer.region import create_shared
from mooncake.types import Request, RequestId
from tests.serving.test_api import cut
from tests.serving.test_edge import ask, served
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny.toml"
SHM = Path("/dev/shm")
START_S = 180.0  # workers started on a busy two-core machine
EXIT_S = 30.0

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not SHM.is_dir() or not Path("/proc/self").is_dir(),
    reason="reads /proc and /dev/shm (Linux)",
)


def tiny(**cluster: Any) -> ClusterConfig:
    return load_config(TINY).with_overrides("cluster", port=0, **cluster)


def unused_pids(count: int) -> list[int]:
    """Pids above the kernel's `pid_max` (so no process has them) and below `PID_MAX` (so the sweeps read them)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if pid_max + count >= PID_MAX:
        pytest.skip(f"pid_max is {pid_max}: no pid below PID_MAX is free of processes")
    return [pid_max + 1 + i for i in range(count)]


def segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir(SHM) if name.startswith(f"mooncake-{pid}-")]


def unlink_segments_of(pid: int) -> None:
    """Remove what a test's process left (through `SharedMemory`, so that the resource tracker forgets it)."""
    for name in segments_of(pid):
        with contextlib.suppress(FileNotFoundError):
            segment = shared_memory.SharedMemory(name=name, create=False)
            segment.close()
            segment.unlink()


# ---------------------------------------------------------------------------------------------- sweeps


def test_a_pid_at_pid_max_is_no_process_and_its_folder_stays(tmp_path: Path) -> None:
    """`PID_MAX` (Linux's limit) is never a pid: a name carrying it is not the sweep's, while one just below is
    (no process has it where the kernel's `pid_max` is lower, as it is by default)."""
    if int(Path("/proc/sys/kernel/pid_max").read_text()) >= PID_MAX - 1:
        pytest.skip("pid_max is at its limit: PID_MAX - 1 may be a running process")
    at_limit = tmp_path / f"mooncake-ssd-{PID_MAX}-ab_12cd3"
    below = tmp_path / f"mooncake-ssd-{PID_MAX - 1}-ab_12cd3"
    at_limit.mkdir()
    below.mkdir()
    assert remove_stale_ssd_folders(tmp_path) == [below.name]
    assert at_limit.is_dir()


def test_the_sweep_returns_the_names_sorted_and_takes_the_temporary_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several stale folders come back sorted (whatever order the directory lists them in); without a root the
    sweep reads `tempfile.gettempdir()` (where a worker's `TemporaryDirectory` goes); a missing root is none."""
    pids = unused_pids(8)
    names = [f"mooncake-ssd-{pid}-ab_12cd3" for pid in reversed(pids)]
    for name in names:
        (tmp_path / name).mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert remove_stale_ssd_folders() == sorted(names)
    assert not any(path.name.startswith("mooncake-ssd-") for path in tmp_path.iterdir())
    assert remove_stale_ssd_folders(tmp_path / "missing") == []


@given(cores=st.lists(st.integers(0, 63), min_size=2, max_size=12, unique=True).flatmap(st.permutations))
def test_a_core_plan_takes_the_last_cores_first_in_any_order_given(cores: list[int]) -> None:
    """The plan depends on the set of cores, not the order listed: the engines get the highest, the rest the
    lowest (the launcher and the system's own threads keep core 0)."""
    needs = [1] * (len(cores) // 2)
    plan = core_plan(cores, needs)
    assert plan is not None
    assert plan == core_plan(sorted(cores), needs)
    engines = [core for group in plan.engines for core in group]
    assert min(engines) > max(plan.rest)
    assert plan.engines[0] == (max(cores),)


# ---------------------------------------------------------------------------------------------- small rules


@given(address=st.ip_addresses())
def test_loopback_is_ipaddress_loopback_and_localhost(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    """A Ray head on a loopback host runs as a one-machine cluster: exactly the loopback addresses, and
    `localhost`, are loopback (a private address is not: Ray would then listen beyond this machine)."""
    assert launch._is_loopback(str(address)) == address.is_loopback
    assert launch._is_loopback("localhost")
    assert not launch._is_loopback("example.com")


def test_only_a_prefill_pipeline_group_starts_processes_of_its_own() -> None:
    """A worker is non-daemonic (it may start processes) only as a prefill group of more than one stage."""
    one = tiny()
    two = one.with_overrides("prefill", pipeline_size=2)
    secret = secrets.token_bytes(32)

    def starts(role: str, config: ClusterConfig) -> bool:
        return launch._starts_processes(WorkerSpec(role=role, instance_id=f"{role}-0", config=config, secret=secret))

    assert [starts("prefill", one), starts("prefill", two), starts("decode", two)] == [False, True, False]


def test_the_ray_backend_puts_back_the_environment_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable the backend set that was unset before is removed again, one it overrode gets its value back,
    and Ray's cluster flag is restored (a later cluster in this process starts as the first did)."""
    monkeypatch.delenv("MOONCAKE_TEST_UNSET", raising=False)
    monkeypatch.setenv("MOONCAKE_TEST_SET", "before")
    backend = object.__new__(RayBackend)
    backend._saved_env = {}
    backend._constants = type("Constants", (), {"ENABLE_RAY_CLUSTER": False})()
    backend._saved_cluster_flag = True
    backend._set_env({"MOONCAKE_TEST_UNSET": "0", "MOONCAKE_TEST_SET": "0"})
    assert os.environ["MOONCAKE_TEST_UNSET"] == os.environ["MOONCAKE_TEST_SET"] == "0"
    backend._restore_env()
    assert "MOONCAKE_TEST_UNSET" not in os.environ
    assert os.environ["MOONCAKE_TEST_SET"] == "before"
    assert backend._constants.ENABLE_RAY_CLUSTER is True


class FakeRay:
    """Ray's calls `RayBackend.start` and `stop` make, each actor's start answering as `outcomes` says: "late"
    (never ready), "dead" (its actor died), or its start message. Ray's `get` of a list raises as Ray's does."""

    class exceptions:  # Ray's module, by its name
        class RayActorError(Exception):
            pass

        class GetTimeoutError(Exception):
            pass

    def __init__(self, outcomes: dict[str, str | dict[str, Any]]) -> None:
        self.outcomes, self.killed, self.stopped, self.shut_down = outcomes, [], [], False

    def remote(self, **_options: Any) -> Any:
        ray = self

        class Actor:
            def __init__(self, spec: Any) -> None:
                self.instance_id = spec.instance_id
                self.start = types.SimpleNamespace(remote=lambda: ("start", self.instance_id))
                self.stop = types.SimpleNamespace(remote=lambda: ray.stopped.append(self.instance_id))

        return lambda _cls: types.SimpleNamespace(options=lambda **_: types.SimpleNamespace(remote=Actor))

    def wait(self, refs: list[Any], *, num_returns: int, timeout: float) -> tuple[list[Any], list[Any]]:
        late = [ref for ref in refs if self.outcomes[ref[1]] == "late"]
        return [ref for ref in refs if ref not in late], late

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if refs is None:  # a stop's
            return None
        for ref in refs if isinstance(refs, list) else [refs]:
            if self.outcomes[ref[1]] == "late":
                raise self.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")
            if self.outcomes[ref[1]] == "dead":
                raise self.exceptions.RayActorError("The actor died unexpectedly before finishing this task.")
        return [self.outcomes[ref[1]] for ref in refs] if isinstance(refs, list) else self.outcomes[refs[1]]

    def kill(self, actor: Any) -> None:
        self.killed.append(actor.instance_id)

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.mark.parametrize(
    ("outcomes", "message"),
    [
        ({"prefill-0": "late", "decode-0": "late"}, r"^worker prefill-0, decode-0 did not start within 120.0 s$"),
        ({"prefill-0": {"instance_id": "prefill-0", "shm": []}, "decode-0": "dead"}, r"^worker decode-0 died while"),
    ],
)
def test_a_ray_start_that_times_out_or_loses_an_actor_stops_everything_and_names_the_worker(
    outcomes: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor not started within START_TIMEOUT_S, or one that died while starting, is the EngineError naming
    its worker, after `stop`: every actor stopped and killed, the Ray head it owns shut down, its variables put
    back (Ray's GetTimeoutError or RayActorError came out naming no worker, and nothing was stopped)."""
    monkeypatch.delenv("MOONCAKE_TEST_UNSET", raising=False)
    ray = FakeRay(outcomes)
    backend = object.__new__(RayBackend)
    backend._ray, backend._actors, backend._shm, backend._multi_node, backend._owns_ray = ray, {}, {}, False, True
    backend._saved_env = {}
    backend._constants = type("Constants", (), {"ENABLE_RAY_CLUSTER": False})()
    backend._saved_cluster_flag = True
    backend._set_env({"MOONCAKE_TEST_UNSET": "0"})
    specs = [types.SimpleNamespace(instance_id=name) for name in ("prefill-0", "decode-0")]
    with pytest.raises(EngineError, match=message):
        backend.start(specs)  # type: ignore[arg-type]
    assert ray.stopped == ray.killed == ["prefill-0", "decode-0"] and ray.shut_down and not backend._actors
    assert "MOONCAKE_TEST_UNSET" not in os.environ and backend._constants.ENABLE_RAY_CLUSTER is True


def test_signal_handlers_are_saved_on_the_main_thread_only_and_put_back() -> None:
    """`ray.init` replaces SIGTERM's handler: the main thread's Python handlers are saved and reinstalled; a
    handler set from C (None) is left alone; another thread (which may not set handlers) saves none."""
    previous = signal.getsignal(signal.SIGTERM)

    def mine(*_: object) -> None:
        pass

    try:
        signal.signal(signal.SIGTERM, mine)
        saved = launch._python_signal_handlers()
        assert saved[signal.SIGTERM] is mine and signal.SIGINT in saved
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        launch._reinstall({signal.SIGTERM: saved[signal.SIGTERM]})
        assert signal.getsignal(signal.SIGTERM) is mine
        launch._reinstall({signal.SIGTERM: None})
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    from_thread: list[dict[int, Any]] = []
    thread = threading.Thread(target=lambda: from_thread.append(launch._python_signal_handlers()))
    thread.start()
    thread.join(timeout=10)
    assert from_thread == [{}]


# ---------------------------------------------------------------------------------------------- the parent watch


def _watched_child(lifeline: Any, writer: Any, report: Any, *, graceful: bool, wait_for_sigterm: bool) -> None:
    """A forked stand-in for a worker: a segment, the parent watch, and (if `graceful`) a SIGTERM handler that
    exits 0 as run_worker's stop would; `wait_for_sigterm`: that handler is installed only once a SIGTERM has
    reached the watch's own (a stop that came before the worker's handler)."""
    writer.close()  # the launcher holds the only write end
    _segment, _array = create_shared(64)
    done = launch._set_parent_death_signal(PARENT_DEATH_SIGNAL)
    libc = ctypes.CDLL(None, use_errno=True)
    current = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(current), 0, 0, 0)  # PR_GET_PDEATHSIG
    watch = launch._ParentWatch(os.getppid(), lifeline)
    watch.start()
    report.send((done, current.value))
    if wait_for_sigterm:
        deadline = time.monotonic() + EXIT_S
        while not watch._gone.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
    if graceful:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    else:
        signal.signal(signal.SIGTERM, lambda *_: None)  # a worker whose stop hangs
    time.sleep(EXIT_S)
    os._exit(3)


@contextlib.contextmanager
def watched(*, graceful: bool, wait_for_sigterm: bool = False) -> Iterator[tuple[Any, Any, tuple[bool, int]]]:
    """A forked child under a parent watch (grace shortened to 1 s): (process, lifeline's write end, what
    `_set_parent_death_signal` returned and the signal prctl then reads back)."""
    # The child shares our resource tracker, as a spawned worker shares its launcher's: one of its own would
    # unlink the child's segments when the child exits, doing the watch's work for it.
    resource_tracker.ensure_running()
    context = multiprocessing.get_context("fork")
    lifeline, writer = context.Pipe(duplex=False)
    answers, report = context.Pipe(duplex=False)
    process = context.Process(
        target=_watched_child,
        args=(lifeline, writer, report),
        kwargs={"graceful": graceful, "wait_for_sigterm": wait_for_sigterm},
        daemon=True,
    )
    process.start()
    lifeline.close()
    report.close()
    try:
        assert answers.poll(EXIT_S), "the child did not start its watch"
        yield process, writer, answers.recv()
    finally:
        writer.close()
        if process.is_alive():
            process.kill()
        process.join(timeout=EXIT_S)
        answers.close()
        unlink_segments_of(process.pid)


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "EXIT_GRACE_S", 1.0)


@pytest.mark.usefixtures("short_grace")
def test_a_closed_lifeline_alone_stops_a_worker_gracefully() -> None:
    """The parent-death signal is armed with SIGUSR1, and that signal alone (as when the thread that spawned the
    worker ends) stops nothing while the launcher's pid is unchanged; the lifeline's write end closing does:
    the watch asks the worker to stop (SIGTERM), which exits on its own."""
    with watched(graceful=True) as (process, writer, (armed, armed_with)):
        assert (armed, armed_with) == (True, PARENT_DEATH_SIGNAL)
        os.kill(process.pid, PARENT_DEATH_SIGNAL)
        time.sleep(3 * launch.WATCH_PERIOD_S)  # what the watch would do, it does within a period
        assert process.is_alive(), "the watch stopped a worker whose launcher lives"
        writer.close()
        process.join(timeout=EXIT_S)
        assert process.exitcode == 0


@pytest.mark.usefixtures("short_grace")
def test_a_worker_that_does_not_stop_is_ended_and_its_segments_unlinked() -> None:
    """Past the grace period the watch unlinks the segments named with the worker's pid and exits with a
    failure status."""
    with watched(graceful=False) as (process, writer, _armed):
        assert segments_of(process.pid)
        writer.close()
        process.join(timeout=EXIT_S)
        assert process.exitcode == 1
        assert not segments_of(process.pid)


@pytest.mark.usefixtures("short_grace")
def test_a_sigterm_before_the_workers_handler_is_repeated_until_it_takes_it() -> None:
    """A stop that comes while the worker starts (before run_worker's SIGTERM handler) is noted, not lost: the
    watch repeats it, and the worker, once its handler is in, stops gracefully (its lifeline still open)."""
    with watched(graceful=True, wait_for_sigterm=True) as (process, _writer, _armed):
        os.kill(process.pid, signal.SIGTERM)
        process.join(timeout=EXIT_S)
        assert process.exitcode == 0


# ---------------------------------------------------------------------------------------------- RunningCluster


class MemoryBackend:
    """An in-memory `Backend` twin: no worker (the gateway serves with none up), every call recorded."""

    node_host = "127.0.0.1"

    def __init__(self, infos: list[dict[str, Any]] | None = None) -> None:
        self.specs: list[WorkerSpec] = []
        self.infos = infos or []
        self.stops = 0

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
        self.specs = specs
        return self.infos

    def is_alive(self, instance_id: str) -> bool:
        return True

    def kill(self, instance_id: str) -> None:
        pass

    def stop(self) -> None:
        self.stops += 1


def refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(5.0)
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_cluster_serves_on_the_port_it_got_and_close_stops_it_all() -> None:
    """The URL names the port the gateway listens on (port 0: the one the system gave); each worker gets a spec
    of its role with the one secret; leaving the block closes the listening socket, ends the gateway's
    thread and stops the backend once."""
    backend = MemoryBackend()
    with RunningCluster(tiny(num_prefill=2, num_decode=1), backend) as cluster:
        port = int(cluster.url.rsplit(":", 1)[1])
        assert port != 0 and not refuses(port)
        with pytest.raises(urllib.error.HTTPError) as answer:  # no worker up
            urllib.request.urlopen(f"{cluster.url}/health", timeout=10)
        assert answer.value.code == 503
        assert [spec.instance_id for spec in backend.specs] == ["prefill-0", "prefill-1", "decode-0"]
        assert len({spec.secret for spec in backend.specs}) == 1
        began = time.monotonic()
    assert time.monotonic() - began < 10.0  # no request in flight: no grace period to wait out
    assert refuses(port)
    assert not cluster._thread.is_alive()
    assert backend.stops == 1


def test_an_ipv6_host_is_in_brackets_in_the_url_clients_reach() -> None:
    """`[cluster] host = "::1"` gives http://[::1]:PORT, which a client reaches (it gave http://::1:PORT, which
    urllib, aiohttp and load.py cannot parse); a name or an IPv4 address stays bare."""
    assert http_url("127.0.0.1", 80) == "http://127.0.0.1:80" and http_url("localhost", 8) == "http://localhost:8"
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    with RunningCluster(tiny(host="::1"), MemoryBackend()) as cluster:
        assert cluster.url.startswith("http://[::1]:")
        with pytest.raises(urllib.error.HTTPError) as answer:  # reached: no worker up
            urllib.request.urlopen(f"{cluster.url}/health", timeout=10)
        assert answer.value.code == 503


def test_the_launchers_stop_report_comes_after_the_longest_close() -> None:
    """examples/cluster.py dumps its threads when a stop takes longer than it can by design: STOP_REPORT_S is past
    close's every wait (its grace, the 503s, the workers' grace, their kill), derived from them (it was a literal
    40 s, equal to them, not past them)."""
    import cluster

    waits = (launch.CLOSE_GRACE_S, launch.CLOSE_ANSWER_S, launch.STOP_GRACE_S, launch.STOP_KILL_S)
    assert sum(waits) == launch.CLOSE_S < cluster.STOP_REPORT_S
    assert inspect.signature(RunningCluster.close).parameters["grace_s"].default == launch.CLOSE_GRACE_S


def test_a_gateway_that_cannot_be_built_stops_the_workers() -> None:
    """Workers started, then the gateway fails to build (here: start infos it cannot read): the error comes
    out and the backend is stopped (no orphan workers until exit)."""
    backend = MemoryBackend(infos=[{"not": "a start info"}])
    with pytest.raises(KeyError, match="role"):  # the workers' own start infos: a lookup, not a user's input
        RunningCluster(tiny(), backend)
    assert backend.stops == 1


@attrs.frozen
class GatewayLeftovers:
    """What a gateway started in this process may leave: threads alive, filters on its loggers."""

    threads: set[threading.Thread]
    filters: dict[str, list[Any]]

    @classmethod
    def now(cls) -> GatewayLeftovers:
        loggers = {name: list(logging.getLogger(name).filters) for name in LOGGERS}
        return cls(threads=set(threading.enumerate()), filters=loggers)


@pytest.fixture
def gateway_leftovers() -> Iterator[GatewayLeftovers]:
    """The state before the test; after it, any log filter a failed gateway start left is taken off, so that a
    regression does not silence later tests' log records."""
    before = GatewayLeftovers.now()
    yield before
    for name, filters in before.filters.items():
        logger = logging.getLogger(name)
        for extra in [f for f in logger.filters if f not in filters]:
            logger.removeFilter(extra)


def cannot_listen(backend: MemoryBackend) -> None:
    """Start a cluster on `backend` whose gateway's port is taken once the workers are up: an EngineError."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(EngineError, match="the gateway did not start"):
            RunningCluster(tiny().with_overrides("cluster", port=port), backend)


@pytest.mark.usefixtures("gateway_leftovers")
def test_a_gateway_that_cannot_listen_is_an_engine_error_and_stops_the_workers() -> None:
    """The gateway's port taken once the workers are up: an EngineError saying so, and the backend stopped."""
    backend = MemoryBackend()
    cannot_listen(backend)
    assert backend.stops == 1


def test_a_gateway_that_cannot_listen_leaves_nothing_running(gateway_leftovers: GatewayLeftovers) -> None:
    """After the failed start (the race start_cluster's port check cannot close: the port taken between the
    check and the bind), the process is as before: no thread of the gateway (its transfer engine's server),
    no log filter of it left on the gateway's, aiohttp's and asyncio's loggers."""
    cannot_listen(MemoryBackend())
    wait_for(
        lambda: {t for t in threading.enumerate() if t.is_alive()} <= gateway_leftovers.threads,
        timeout=5.0,
        what="the failed gateway's threads to end",
    )
    assert GatewayLeftovers.now().filters == gateway_leftovers.filters


# ---------------------------------------------------------------------------------------------- local workers


def test_a_worker_that_dies_while_starting_stops_the_others_and_leaves_no_segment(tmp_path: Path) -> None:
    """A decode worker that fails after making its DRAM segment (its SSD folder is a file): the start raises
    an EngineError naming it and its error, every other worker is stopped, and the dead one's segment is
    unlinked."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    config = tiny(num_prefill=1, num_decode=1)
    broken = config.with_overrides("cache", ssd_blocks=4, ssd_dir=str(not_a_folder))
    secret = secrets.token_bytes(32)
    specs = [
        WorkerSpec(role="decode", instance_id="decode-0", config=broken, secret=secret),
        WorkerSpec(role="prefill", instance_id="prefill-0", config=config, secret=secret),
    ]
    backend = LocalBackend()
    pids: list[int] = []
    try:
        with pytest.raises(EngineError, match="worker decode-0 failed to start: cannot open SSD pool file"):
            backend.start(specs)
        pids = [backend.pid(spec.instance_id) for spec in specs]
        assert not multiprocessing.active_children()
        assert not segments_of(pids[0])
    finally:
        backend.stop()
        for pid in pids:
            unlink_segments_of(pid)


def open_fds() -> list[str]:
    """What this process's file descriptors point at, sorted."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(links)


def test_starting_and_stopping_workers_leaves_no_descriptor_behind() -> None:
    """Local workers started and stopped twice: the second round leaves this process the descriptors the first
    left (the first may start multiprocessing's resource tracker once); each worker's start pipe and the
    process's sentinel used to stay open, two descriptors per worker and round. A stopped worker reads as dead
    and keeps its pid."""
    config = tiny(num_prefill=1, num_decode=1)
    secret = secrets.token_bytes(32)
    specs = [
        WorkerSpec(role=role, instance_id=f"{role}-0", config=config, secret=secret) for role in ("prefill", "decode")
    ]
    after: list[list[str]] = []
    for _ in range(2):
        backend = LocalBackend()
        try:
            backend.start(specs)
            pids = [backend.pid(spec.instance_id) for spec in specs]
        finally:
            backend.stop()
        assert [backend.pid(spec.instance_id) for spec in specs] == pids
        assert not any(backend.is_alive(spec.instance_id) for spec in specs)
        after.append([link for link in open_fds() if link.startswith("pipe:")])
    assert after[1] == after[0]


def test_a_dispatcher_whose_worker_cannot_be_reached_closes_its_engine() -> None:
    """A worker gone before the gateway's Connect: the Dispatcher raises, and its transfer engine (a listening
    socket and its threads) is closed, not left to a process that starts clusters again and again."""
    config = tiny(num_prefill=1, num_decode=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"  # closed again: nothing listens there
    workers = [{"instance_id": f"{role}-0", "role": role, "address": nobody} for role in ("prefill", "decode")]
    threads, fds = threading.active_count(), open_fds()
    with pytest.raises(PeerUnavailable):
        Dispatcher(
            config, build_conductor(config), secret=b"s" * 32, workers=workers, is_alive=lambda _: True, block_bytes=1
        )
    wait_for(lambda: threading.active_count() == threads, timeout=EXIT_S, what="the engine's threads to end")
    assert open_fds() == fds


def test_close_stops_workers_gracefully_and_unlinks_what_a_killed_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_cluster sweeps the temporary directory's stale SSD folders and says which; a killed worker reads as
    dead at once; `close` lets the others stop on their own (each removes its SSD folder) and unlinks the
    killed one's segments and removes its SSD folder (it was left for the next start's sweep)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' SSD folders
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's sweep
    stale = f"mooncake-ssd-{unused_pids(1)[0]}-ab_12cd3"
    (tmp_path / stale).mkdir()
    config = tiny(num_prefill=1, num_decode=1).with_overrides("cache", ssd_blocks=4)
    cluster = start_cluster(config)
    try:
        assert cluster.removed_ssd_folders == [stale]
        backend = cluster.backend
        assert isinstance(backend, LocalBackend) and not backend.pin_cores  # pin_cores = "off"
        killed, kept = backend.pid("prefill-0"), backend.pid("decode-0")
        assert {name.split("-")[2] for name in os.listdir(tmp_path)} == {str(killed), str(kept)}
        assert segments_of(killed)
        backend.kill("prefill-0")
        assert not backend.is_alive("prefill-0")
        assert segments_of(killed)  # a killed worker unlinks nothing
    finally:
        cluster.close(grace_s=5.0)
    assert not segments_of(killed) and not segments_of(kept)
    assert os.listdir(tmp_path) == []
    wait_for(lambda: not multiprocessing.active_children(), timeout=EXIT_S, what="every worker to be reaped")


# ---------------------------------------------------------------------------------------------- protocol


def test_each_refusal_is_told_with_its_own_status() -> None:
    """`on_refusal` (the gateway's metrics) hears 429 for a client over its share and 503 over the total, once
    per refused connection, and an admitted one is not told."""
    told: list[int] = []
    guard = ConnectionGuard(EdgeLimits(max_connections=2, max_connections_per_client=1), on_refusal=told.append)
    assert guard.admit("a") is None
    refusal = guard.admit("a")
    assert refusal is not None and refusal.status == 429
    assert guard.admit("b") is None
    refusal = guard.admit("c")
    assert refusal is not None and refusal.status == 503
    assert told == [429, 503] and guard.refused == 2
    guard.check_invariants()


def test_a_request_with_more_headers_than_the_limit_is_refused_in_json() -> None:
    """64 header lines are read; a 65th makes the request unreadable (an OpenAI JSON error, not plain text)."""

    def request(count: int) -> bytes:
        extra = "".join(f"X-{i}: {i}\r\n" for i in range(count - 2))
        return f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode()

    with served(EdgeLimits()) as (_gateway, port):
        assert ask(port, request(64))[0] == 200
        status, headers, body = ask(port, request(65))
        assert status in (400, 431) and headers["content-type"].startswith("application/json")
        assert body["error"]["code"] == status


@pytest.mark.parametrize("status", [400, 431, 499, 500, 503])
def test_aiohttps_own_error_answers_close_the_connection_and_log_a_5xx_as_an_error(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer to a request aiohttp could not handle closes its connection (what follows the bad request on
    it cannot be trusted to be a request); a 5xx is the server's fault, logged as an error with its traceback,
    a 4xx the client's, a warning."""
    caplog.set_level(logging.DEBUG, logger="serving.protocol")
    request = types.SimpleNamespace(remote="127.0.0.1", writer=types.SimpleNamespace(output_size=0))
    response = JsonRequestHandler.handle_error(None, request, status, RuntimeError("boom"))  # type: ignore[arg-type]
    assert response.status == status and response.keep_alive is False
    [record] = [r for r in caplog.records if r.name == "serving.protocol"]
    assert record.levelno == (logging.ERROR if status >= 500 else logging.WARNING)
    assert (record.exc_info is not None) == (status >= 500)


# ---------------------------------------------------------------------------------------------- tokenizer


@given(
    text=st.text(max_size=20),
    junk=st.lists(st.one_of(st.integers(max_value=-1), st.integers(min_value=256)), max_size=10),
    seed=st.randoms(use_true_random=False),
)
def test_byte_tokens_outside_the_bytes_decode_to_nothing(text: str, junk: list[int], seed: Any) -> None:
    """The random preset's model may draw ids past the bytes (and a caller may pass any int): whole and
    streamed, they decode to nothing and the bytes around them to the text."""
    tokens = ByteTokenizer().encode(text)
    for token in junk:
        tokens.insert(seed.randint(0, len(tokens)), token)
    stream = TextStream()
    assert ByteTokenizer().decode(tokens) == text
    assert "".join(stream.feed(token) for token in tokens) + stream.finish() == text


class ByteLevelDecoder:
    """A `Decoder` double for byte-level BPE, whose tokens are byte strings that may end inside a character:
    token i is `pieces[i]`."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return str(self._decoder.decode(self.pieces[token]))

    def finish(self) -> str:
        return str(self._decoder.decode(b"", final=True))


@given(
    text=st.text(alphabet="xaé🙂", max_size=12),
    stops=st.lists(st.text(alphabet="xaé🙂", min_size=1, max_size=3), max_size=3),
    cuts=st.sets(st.integers(1, 48)),
)
@example(text="xé", stops=["x"], cuts={2})
def test_tokens_that_end_inside_a_character_stream_the_text_cut_at_the_first_stop(
    text: str, stops: list[str], cuts: set[int]
) -> None:
    """A checkpoint's tokens may split a character (byte-level BPE): the text given out, `finish()` included, is
    still the reference cut, never a replacement character for the bytes of a character begun after the stop."""
    data = text.encode()
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    stream = TextStream(stops, decoder=ByteLevelDecoder(pieces))
    given_out = "".join(stream.feed(token) for token in range(len(pieces))) + stream.finish()
    assert (given_out, stream.stopped, stream.stop_reason) == cut(text, stops)


def test_the_byte_tokenizers_stream_holds_off_stops_for_min_tokens() -> None:
    """The gateway asks its tokenizer for the stream: the random preset's passes `min_tokens` on (a stop string
    within the first `min_tokens` tokens is text, as in vLLM)."""
    stream = ByteTokenizer().stream(["b"], min_tokens=2)
    assert [stream.feed(token) for token in b"abab"] == ["a", "b", "a", ""]
    assert (stream.stopped, stream.stop_reason) == (True, "b")


# ---------------------------------------------------------------------------------------------- models


def test_a_decode_engine_holds_a_full_batch_of_longest_requests() -> None:
    """`decode_limits`: the Conductor and the decode worker plan for `max_batch_size` requests of up to
    `max_context_tokens` each, all held at once, and are told the same batch and context limits."""
    decode = {"max_batch_size": 3, "max_context_tokens": 4096}
    limits = decode_limits(tiny().with_overrides("decode", **decode))
    assert (limits.max_batch_size, limits.max_context_tokens) == (3, 4096)
    assert limits.kv_capacity_tokens >= 3 * 4096


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("not json", "Expecting value"),
        ('["prefill", "decode"]', "has no 'prefill' section"),
        (
            '{"prefill": {"coefficients": "x"}, "decode": {"coefficients": [0.0, 0.0, 0.0]}}',
            "not a fitted prefill model",
        ),
    ],
)
def test_a_profile_that_is_not_a_profile_is_a_config_error_naming_the_file(
    text: str, said: str, tmp_path: Path
) -> None:
    """Bad JSON, JSON that is not an object of sections, a section the fitted model refuses: each a ConfigError
    that names `[prefill] profile` and the file (never a bare ValueError or TypeError from deep inside)."""
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=said) as raised:
        read_profile(str(path))
    assert f"[prefill] profile = {str(path)!r}" in str(raised.value)


def test_the_conductor_gets_the_configs_threshold_and_the_instances_given() -> None:
    """`build_conductor`: the cache-aware router balances at `[policy] threshold`; the instances passed are
    registered, each decode one with `decode_limits(config)`."""
    config = tiny().with_overrides("policy", router="kvcache_centric", threshold=3.5)
    conductor = build_conductor(config, prefill_instances=["prefill-0"], decode_instances=["decode-0", "decode-1"])
    assert conductor.router.threshold == 3.5  # type: ignore[attr-defined]
    assert [view.instance_id for view in conductor.prefill_views] == ["prefill-0"]
    decode = conductor.decode_views
    assert [view.instance_id for view in decode] == ["decode-0", "decode-1"]
    assert all(view.limits == decode_limits(config) for view in decode)


def test_the_conductors_random_routes_follow_the_seed_given() -> None:
    """`build_conductor(seed=...)`: a random router's choices are the seed's (a replay is reproducible, and two
    seeds are two samples, as the paper's experiments draw them)."""
    config = tiny().with_overrides("policy", router="random")
    hasher = config.model.hasher()
    prompts = [hasher.block_keys(np.arange(i, i + 32, dtype=np.int32)) for i in range(24)]

    def routes(seed: int) -> list[str | None]:
        prefill = [f"prefill-{i}" for i in range(4)]
        conductor = build_conductor(config, prefill_instances=prefill, decode_instances=["decode-0"], seed=seed)
        chosen = []
        for i, keys in enumerate(prompts):
            request = Request(
                request_id=RequestId(f"r{i}"), arrival_s=0.0, input_length=32, output_length=4, block_keys=keys
            )
            chosen.append(conductor.schedule(request, 0.0).prefill_instance)
        return chosen

    first = routes(1)
    assert routes(1) == first and len(set(first)) > 1
    assert routes(2) != first
