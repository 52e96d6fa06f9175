"""The launcher's lifecycle: no orphan worker and no leftover shared memory however it dies; Ray on loopback.

Orphans: the launcher (`examples/cluster.py`) runs in a subprocess and is
killed with SIGKILL; its workers must exit and unlink their segments within a
bound. A second launcher removes the segments of dead mooncake processes (and
only those), and a worker whose spawning thread ends (the parent-death signal
fires then too) keeps serving. Ctrl-C (SIGINT to the launcher's whole process
group, a pipeline group's stages included) lets a stream in flight end, then
leaves no process and no segment.

Ray: one launcher with `--backend ray` per module; every listening socket of
its processes (read from /proc/net/tcp and tcp6, each socket's inode mapped to
a pid through /proc/<pid>/fd) must be on a loopback address, and SIGTERM must
stop it with exit status 0 and no stack dump.

Every wait is bounded; every process, socket and segment made here is removed
at the end, even when a test fails.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from serving.config import load_config
from serving.launch import (
    SEGMENT_NAME,
    SSD_FOLDER_NAME,
    LocalBackend,
    RayBackend,
    RunningCluster,
    core_plan,
    remove_stale_segments,
    remove_stale_ssd_folders,
    start_cluster,
)

from mooncake.errors import ConfigError
from mooncake.transfer.region import create_shared
from tests.waiting import is_running, wait_for

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "examples" / "cluster.py"
TINY = ROOT / "examples" / "configs" / "tiny.toml"
SHM = Path("/dev/shm")
START_S = 180.0  # a launcher ready (Ray's head included) on a busy two-core machine
EXIT_S = 60.0  # every worker gone after its launcher died: the watch's grace period and then some
POLL_S = 0.05

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not SHM.is_dir() or not Path("/proc/self").is_dir(),
    reason="reads /proc and /dev/shm (Linux)",
)


def holds_within(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def descendants(pid: int) -> set[int]:
    """Every running descendant of `pid`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {child for child in found if is_running(child)}


def segments_of(pids: set[int]) -> set[str]:
    """The /dev/shm segments mooncake created in these processes (named mooncake-<pid>-<hex>)."""
    prefixes = tuple(f"mooncake-{pid}-" for pid in pids)
    return {name for name in os.listdir(SHM) if name.startswith(prefixes)}


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (free for reuse, but not reused this soon)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    assert not is_running(child.pid)
    return child.pid


@contextlib.contextmanager
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process that lives until the block ends (it waits for its stdin to close)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


@contextlib.contextmanager
def planted(names: list[str]) -> Iterator[list[Path]]:
    """Shared-memory segments with these names (files in /dev/shm are POSIX segments); removed at the end."""
    paths = [SHM / name for name in names]
    for path in paths:
        path.write_bytes(b"\0")
    try:
        yield paths
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


@attrs.define(eq=False)
class Launcher:
    """`examples/cluster.py` in a subprocess: its stdout and stderr lines, drained by threads."""

    process: subprocess.Popen[str]
    stdout: queue.Queue[str] = attrs.field(factory=queue.Queue)  # consumed by ready_url
    lines: list[str] = attrs.field(factory=list)  # every stdout line
    stderr: list[str] = attrs.field(factory=list)
    readers: list[threading.Thread] = attrs.field(factory=list)
    seen: set[int] = attrs.field(factory=set)  # every descendant observed, to clean up after a failure

    def ready_url(self) -> str:
        """The gateway's URL, from the launcher's ready line (bounded by START_S)."""
        deadline = time.monotonic() + START_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.process.poll() is not None:
                pytest.fail(f"the launcher did not get ready (exit {self.process.poll()}): {''.join(self.stderr)}")
            with contextlib.suppress(queue.Empty):
                line = self.stdout.get(timeout=min(remaining, 1.0))
                if found := re.search(r"mooncake cluster ready: (http://\S+)", line):
                    return found.group(1)

    def children(self) -> set[int]:
        found = descendants(self.process.pid)
        self.seen |= found
        return found


@contextlib.contextmanager
def launcher(*args: str) -> Iterator[Launcher]:
    """Run the launcher with these arguments; at the end, kill whatever of it is left."""
    command = [sys.executable, str(LAUNCHER), "--port", "0", *args]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    running = Launcher(process)
    assert process.stdout is not None and process.stderr is not None

    def drain_stdout(stream: Any) -> None:
        for line in stream:
            running.lines.append(line)
            running.stdout.put(line)

    def drain_stderr(stream: Any) -> None:
        for line in stream:
            running.stderr.append(line)

    for target, stream in ((drain_stdout, process.stdout), (drain_stderr, process.stderr)):
        thread = threading.Thread(target=target, args=(stream,), daemon=True)
        thread.start()
        running.readers.append(thread)
    try:
        yield running
    finally:
        running.seen |= descendants(process.pid)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        for pid in running.seen:
            if is_running(pid):  # only after a failure: a passing test saw them all exit
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        holds_within(lambda: not any(is_running(pid) for pid in running.seen), 30)
        for name in segments_of(running.seen | {process.pid}):
            (SHM / name).unlink(missing_ok=True)
        for thread in running.readers:
            thread.join(timeout=10)
        process.stdout.close()
        process.stderr.close()


def complete(url: str, prompt: str) -> dict[str, Any]:
    """POST one short completion; its JSON answer."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


# ---------------------------------------------------------------------------------------------- stale segments


def test_the_sweeps_rule_is_create_shareds_rule() -> None:
    """The sweep's name rule matches exactly what create_shared names (its pid included), and spares a live one."""
    segment, array = create_shared(64)
    try:
        match = SEGMENT_NAME.fullmatch(segment.name.lstrip("/"))
        assert match is not None and int(match["pid"]) == os.getpid()
        assert segment.name.lstrip("/") not in remove_stale_segments()
        assert (SHM / segment.name.lstrip("/")).exists()
    finally:
        del array  # the array keeps the mapping alive: closing under it is refused (BufferError)
        segment.close()
        segment.unlink()


def test_stale_segments_of_dead_processes_are_removed_and_nothing_else() -> None:
    """Only `mooncake-<pid>-<12 hex>` segments of a dead (or zombie) pid go; a live pid's and other names stay."""
    dead = dead_pid()
    token = secrets.token_hex(6)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, and stays unreaped until we wait
    try:
        wait_for(lambda: not is_running(zombie.pid), timeout=60, what="the child to exit")
        with live_process() as alive:
            stale = [f"mooncake-{dead}-{token}", f"mooncake-{zombie.pid}-{token}"]
            kept = [
                f"mooncake-{alive.pid}-{token}",  # its creator lives
                f"mooncake-{os.getpid()}-{secrets.token_hex(6)}",  # ours
                f"mooncake-{dead}-ABCDEF{token[:6]}",  # not create_shared's (lower-case) hex
                f"mooncake-{dead}-{token}0",  # 13 digits
                f"mooncake-{dead}-{token[:-1]}",  # 11 digits
                f"mooncake-0{dead}-{token}",  # a pid is never written with a leading zero
                f"mooncake-{dead}-{token}-x",
                f"mooncake-ssd-{dead}-{token}",
                f"vllm-{dead}-{token}",
                f"mooncake-{1 << 23}-{token}",  # beyond any pid
            ]
            with planted(stale + kept) as paths:
                removed = remove_stale_segments()
                assert set(stale) <= set(removed)
                assert not set(kept) & set(removed)
                assert [path.name for path in paths if path.exists()] == kept
                assert not set(stale + kept) & set(remove_stale_segments())  # a second sweep finds none of them
    finally:
        zombie.wait(timeout=30)


def test_a_taken_port_is_a_config_error_before_any_worker_starts() -> None:
    """A second cluster on a port something listens on fails at once, naming the file, [cluster] port and the
    value, and starts no worker; port 0 (any free port) is never refused."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        config = load_config(TINY).with_overrides("cluster", port=port, num_prefill=1, num_decode=1)
        began = time.monotonic()
        with pytest.raises(ConfigError, match=rf"tiny.toml: \[cluster\] port = {port}: 127.0.0.1:{port} is taken"):
            start_cluster(config)
        assert time.monotonic() - began < 2.0  # refused before the workers (seconds to start) were started


def test_stale_ssd_folders_of_dead_workers_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """A killed worker's temporary SSD folder (`mooncake-ssd-<pid>-<8 chars>`, pages inside) goes once its pid is
    dead; a live pid's, other names, a file of that name and the folder a worker makes now (ours) stay."""
    dead = dead_pid()
    with live_process() as alive:
        stale = tmp_path / f"mooncake-ssd-{dead}-ab_12cd3"
        (stale / "sub").mkdir(parents=True)
        (stale / "prefill-0.pool").write_bytes(b"\0" * 4096)
        kept = [f"mooncake-ssd-{alive.pid}-ab_12cd3", f"mooncake-ssd-{dead}-ab12cd3", f"mooncake-ssd-0{dead}-ab_12cd3"]
        for name in kept:
            (tmp_path / name).mkdir()
        (tmp_path / f"mooncake-ssd-{dead}-zz_12cd3").write_text("a file, not a folder")
        made = tempfile.TemporaryDirectory(prefix=f"mooncake-ssd-{os.getpid()}-", dir=tmp_path)  # as a worker does
        try:
            assert SSD_FOLDER_NAME.fullmatch(Path(made.name).name)  # the rule is the one the worker's names follow
            assert remove_stale_ssd_folders(tmp_path) == [stale.name]
            assert not stale.exists() and all((tmp_path / name).is_dir() for name in kept)
            assert Path(made.name).is_dir() and (tmp_path / f"mooncake-ssd-{dead}-zz_12cd3").is_file()
            assert remove_stale_ssd_folders(tmp_path) == []
        finally:
            made.cleanup()


# ---------------------------------------------------------------------------------------------- orphans


def test_workers_exit_and_unlink_when_the_launcher_is_killed() -> None:
    """SIGKILL the launcher: within EXIT_S no worker process remains and none of their segments is left."""
    with launcher("--config", str(TINY)) as running:
        url = running.ready_url()
        assert complete(url, "before the kill")["usage"]["completion_tokens"] == 4
        workers = running.children()
        assert len(workers) >= 3  # two prefill and one decode worker (and multiprocessing's resource tracker)
        assert len(segments_of(workers)) == 3  # one DRAM pool per worker

        running.process.kill()
        running.process.wait(timeout=30)
        wait_for(
            lambda: not any(is_running(pid) for pid in workers),
            timeout=EXIT_S,
            what=f"the killed launcher's processes {sorted(workers)} to exit (no orphans)",
        )
        assert not segments_of(workers | {running.process.pid}), "leftover shared memory"
        assert not any("Traceback" in line for line in running.stderr), "".join(running.stderr)


def test_ctrl_c_lets_a_stream_in_flight_end_and_leaves_nothing(tmp_path: Path) -> None:
    """A terminal's Ctrl-C is SIGINT to the launcher's whole process group — its workers and a pipeline group's
    stage process too: only the launcher acts on it, so a stream in flight runs to its end (the gateway stops
    before the workers), then the launcher exits with status 0, every process of it exits, no traceback is
    written and no segment is left."""
    text = TINY.read_text().replace("num_prefill = 2", "num_prefill = 1")
    text = text.replace("pipeline_size = 1 ", "pipeline_size = 2 ")  # one prefill instance of two processes
    assert "num_prefill = 1" in text and "pipeline_size = 2 " in text
    config = tmp_path / "ctrl-c.toml"
    config.write_text(text)
    max_tokens = 200
    body = {
        "model": "tiny",
        "prompt": "Ctrl-C",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with launcher("--config", str(config)) as running:
        url = running.ready_url()
        spawned = running.children()  # a prefill worker, its stage, a decode worker (and the resource tracker)
        assert len(spawned) >= 3
        assert len(segments_of(spawned)) == 2  # one DRAM pool per worker
        request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        events: list[str] = []
        with urllib.request.urlopen(request, timeout=60) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:  # its first token is out: the decode runs
                        os.killpg(running.process.pid, signal.SIGINT)  # the launcher leads its group
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(event) for event in events[:-1]]
        assert not [chunk for chunk in chunks if "error" in chunk], chunks[-2:]
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]

        assert exit_status(running) == 0
        wait_for(
            lambda: not any(is_running(pid) for pid in spawned),
            timeout=EXIT_S,
            what=f"the launcher's processes {sorted(spawned)} to exit (no orphans)",
        )
        assert not segments_of(spawned | {running.process.pid}), "leftover shared memory"
        assert any(line.startswith("stopping") for line in running.lines)
        assert not any("Traceback" in line or "; stopping" in line for line in running.stderr), "".join(running.stderr)


def test_a_new_launcher_removes_stale_segments_of_dead_processes_only() -> None:
    """A (re)started launcher unlinks a dead pid's planted segment, leaves a live one's, and says so."""
    stale = f"mooncake-{dead_pid()}-{secrets.token_hex(6)}"
    with live_process() as alive:
        kept = f"mooncake-{alive.pid}-{secrets.token_hex(6)}"
        with planted([stale, kept]), launcher("--config", str(TINY)) as running:
            running.ready_url()
            assert not (SHM / stale).exists()
            assert (SHM / kept).exists()
            said = r"removed \d+ shared-memory segments of dead processes"
            assert any(re.match(said, line) for line in running.lines)
            running.process.send_signal(signal.SIGTERM)
            assert exit_status(running) == 0


def exit_status(running: Launcher) -> int:
    """The launcher's exit status once it exits (bounded by EXIT_S); a launcher still stopping then fails
    the test with what it wrote (where each of its threads was, if its stop ran long)."""
    try:
        return running.process.wait(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within {EXIT_S} s of SIGTERM:\n{''.join(running.stderr)}")


def test_workers_outlive_the_thread_that_spawned_them() -> None:
    """The parent-death signal also fires when the spawning thread ends: workers must keep serving then."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    started: list[RunningCluster] = []
    spawner = threading.Thread(target=lambda: started.append(start_cluster(config)))
    spawner.start()
    spawner.join(timeout=START_S)
    assert not spawner.is_alive() and started, "the cluster did not start"
    with started[0] as cluster:
        # Long enough for a stop to be noticed (the watch polls every 0.5 s, the worker stops in about 1 s).
        watched_until = time.monotonic() + 3.0
        while time.monotonic() < watched_until:
            assert complete(cluster.url, "still here?")["usage"]["completion_tokens"] == 4
        assert all(cluster.backend.is_alive(info["instance_id"]) for info in cluster.infos)


@given(
    available=st.sets(st.integers(0, 63), min_size=1, max_size=16),
    needs=st.lists(st.integers(1, 4), min_size=1, max_size=6),
)
def test_a_core_plan_gives_each_engine_cores_of_its_own(available: set[int], needs: list[int]) -> None:
    """Each worker gets as many cores as it runs processes, none shared, at least one left for the launcher,
    every available core used once; no plan when they do not fit."""
    plan = core_plan(sorted(available), needs)
    if sum(needs) + 1 > len(available):
        assert plan is None
        return
    assert plan is not None
    assert [len(cores) for cores in plan.engines] == needs and plan.rest
    every = [core for cores in (*plan.engines, plan.rest) for core in cores]
    assert sorted(every) == sorted(available)


def test_pin_cores_gives_engines_cores_of_their_own_when_there_are_enough() -> None:
    """`[cluster] pin_cores = "auto"`: with a core for each engine and one more, each worker process runs on its
    own core and the launcher on the rest until the cluster closes; with fewer (this two-core machine: two
    engines need three), nothing is pinned and the cluster serves as without."""
    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1, pin_cores="auto")
    before = os.sched_getaffinity(0)
    with start_cluster(config) as cluster:
        backend = cluster.backend
        assert isinstance(backend, LocalBackend)
        affinities = {frozenset(os.sched_getaffinity(backend.pid(info["instance_id"]))) for info in cluster.infos}
        if len(before) >= 3:
            assert backend.plan is not None and os.sched_getaffinity(0) == set(backend.plan.rest)
            assert affinities == {frozenset(cores) for cores in backend.plan.engines}
        else:
            assert backend.plan is None and os.sched_getaffinity(0) == before and affinities == {frozenset(before)}
        assert complete(cluster.url, "pinned?")["usage"]["completion_tokens"] == 4
    assert os.sched_getaffinity(0) == before


# ---------------------------------------------------------------------------------------------- Ray


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this machine: inode → (address, port), from /proc/net/tcp and tcp6."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state != "0A":  # TCP_LISTEN
                    continue
                address_hex, port_hex = local.split(":")
                raw = bytes.fromhex(address_hex)
                # The kernel prints each 32-bit word in host (little-endian) order.
                address = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found[inode] = (socket.inet_ntop(family, address), int(port_hex, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@attrs.frozen
class RayRun:
    """What one Ray-backed launcher did: its processes' listening sockets, its answer, its exit."""

    binds: list[tuple[int, str, str, int]]  # (pid, command line, address, port)
    commands: list[str]
    completion_tokens: int
    exit_status: int
    stderr: str
    left: set[int]


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> RayRun:
    """One `--backend ray` launcher (1 prefill + 1 decode): sockets read while it serves, then SIGTERM."""
    pytest.importorskip("ray")
    text = TINY.read_text()
    small = re.sub(r"(?m)^num_prefill = \d+", "num_prefill = 1", text)
    assert small != text
    config = tmp_path_factory.mktemp("ray") / "tiny-ray.toml"
    config.write_text(small)
    with launcher("--config", str(config), "--backend", "ray") as running:
        url = running.ready_url()
        tokens = complete(url, "Hello from Ray.")["usage"]["completion_tokens"]
        session = re.compile(rf"session_[0-9_-]+_{running.process.pid}\b")
        pids = running.children() | {running.process.pid}
        pids |= {
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and session.search(command_line(int(p.name)))
        }
        sockets = listening_sockets()
        binds = [
            (pid, command_line(pid), *sockets[inode])
            for pid in sorted(pids)
            for inode in socket_inodes(pid)
            if inode in sockets
        ]
        commands = [command_line(pid) for pid in sorted(pids)]
        running.process.send_signal(signal.SIGTERM)
        status = exit_status(running)
        holds_within(lambda: not any(is_running(pid) for pid in pids), EXIT_S)
        for thread in running.readers:
            thread.join(timeout=10)
        left = {pid for pid in pids if is_running(pid)}
        return RayRun(binds, commands, tokens, status, "".join(running.stderr), left)


@pytest.mark.slow
def test_a_ray_actor_reads_as_dead_only_when_ray_says_it_died() -> None:
    """The gateway releases what a dead worker held with the others, so a timeout (a stopped or slow actor) must
    read as alive; only Ray's actor-died error is a death."""
    ray = pytest.importorskip("ray")

    class Actor:
        def __init__(self, answer: BaseException | bool) -> None:
            self.is_alive = types.SimpleNamespace(remote=lambda: answer)

    def get(answer: BaseException | bool, timeout: float) -> bool:
        if isinstance(answer, BaseException):
            raise answer
        return answer

    backend = object.__new__(RayBackend)
    backend._ray = types.SimpleNamespace(get=get, exceptions=ray.exceptions)  # type: ignore[attr-defined]
    backend._actors = {  # type: ignore[attr-defined]
        "up": Actor(True),
        "slow": Actor(ray.exceptions.GetTimeoutError("5 s")),
        "dead": Actor(ray.exceptions.RayActorError()),
    }
    assert [backend.is_alive(name) for name in ("up", "slow", "dead")] == [True, True, False]


def test_ray_servers_listen_on_loopback_only(ray_run: RayRun) -> None:
    """Every socket Ray's processes (GCS, raylet, agents, workers) and ours listen on is a loopback address."""
    assert ray_run.completion_tokens == 4
    assert any("gcs_server" in command for command in ray_run.commands)
    assert any("raylet" in command for command in ray_run.commands)
    assert len(ray_run.binds) >= 4  # the gateway, GCS, the raylet's two, the workers' engines
    exposed = [bind for bind in ray_run.binds if not is_loopback(bind[2])]
    assert not exposed, "\n".join(
        f"pid {pid} listens on {address}:{port}: {cmd[:120]}" for pid, cmd, address, port in exposed
    )


@pytest.mark.slow
def test_ray_launcher_stops_cleanly_on_sigterm(ray_run: RayRun) -> None:
    """SIGTERM: exit status 0, every Ray process gone, and no stack dump or traceback on stderr."""
    assert ray_run.exit_status == 0, ray_run.stderr
    assert not ray_run.left
    for marker in ("Traceback", "SIGTERM received", "Stack (most recent call first)", "Fatal Python error", "*** "):
        assert marker not in ray_run.stderr, ray_run.stderr


def test_a_worker_and_the_gateway_listen_where_their_spec_says() -> None:
    """The address a worker's engine listens on is its spec's host (a Ray actor on a multi-node cluster gets its
    node's), reported in its start info; a gateway given a host listens for reports there. 127.0.0.2 is
    loopback too, so the test stays on this machine."""
    from serving.gateway import Gateway
    from serving.worker import Worker, WorkerSpec

    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    secret = secrets.token_bytes(32)
    worker = Worker(WorkerSpec(role="prefill", instance_id="prefill-0", config=config, secret=secret, host="127.0.0.2"))
    try:
        info = worker.start()
        assert info["address"].startswith("127.0.0.2:"), info
        gateway = Gateway(config, secret, [info], lambda _instance: True, host="127.0.0.2")
        try:
            assert gateway.dispatcher.engine.address.startswith("127.0.0.2:")
            assert gateway.dispatcher.health("prefill-0").ok  # the worker reaches it and answers
        finally:
            gateway.dispatcher.close()
    finally:
        worker.close()


def test_a_join_whose_kv_did_not_stay_is_refused_for_kv_not_failed() -> None:
    """A hand-off whose blocks the decode node no longer holds (no room for them, or evicted before the
    join) is the node's memory refusing the request: a decode.rejected for the KV budget (429 upstream),
    not a failure (500)."""
    from serving import wire
    from serving.worker import Worker, WorkerSpec

    config = load_config(TINY).with_overrides("cluster", port=0, num_prefill=1, num_decode=1)
    worker = Worker(WorkerSpec(role="decode", instance_id="decode-0", config=config, secret=secrets.token_bytes(32)))
    told: list[Any] = []
    worker._tell_gateway = told.append  # type: ignore[method-assign]
    worker.start()
    try:
        sampling = wire.Sampling(max_tokens=4, temperature=0.0, top_p=1.0, seed=0, stop_ids=())
        job = wire.DecodeJob(request_id=1, attempt=0, keys=(12345,), prompt_tokens=8, first_token=7, sampling=sampling)
        worker._join(job, lambda _token: None)
        assert told == [wire.DecodeRejected(instance_id="decode-0", request_id=1, attempt=0, reason="kv_budget")]
    finally:
        worker.close()
