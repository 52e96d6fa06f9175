"""Starting and stopping a whole cluster: workers on a backend, then the gateway on an event loop thread.

Backends place the workers: `LocalBackend` as spawned processes on this machine,
`RayBackend` as Ray actors (on a local Ray head whose servers all listen on the
configured host, 127.0.0.1 by default, or an existing cluster via `address`).
Either way the workers talk to each other and to the gateway over mooncake's
own transfer engines.

`start_cluster(config)` first removes the shared-memory segments of mooncake
processes that died without unlinking them (`remove_stale_segments`) and the
temporary SSD-tier folders of workers killed before removing theirs
(`remove_stale_ssd_folders`), then
returns a `RunningCluster` once the gateway answers; `close()` stops the
gateway, every worker (SIGTERM, then SIGKILL after a grace period), unlinks
any shared-memory segment a killed worker left behind and removes its SSD folder.

Lifecycle of a local worker (`_worker_main` around `run_worker`):
    a launcher that dies, however it dies (SIGKILL included), takes its workers
    with it. Three signals say it is gone, any one suffices: the kernel's
    parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`; it fires when the
    spawning *thread* exits, so the handler checks that the parent pid really
    changed), the lifeline pipe reaching EOF (the launcher holds its only
    write end) and the parent pid changing (polled every `WATCH_PERIOD_S`).
    The worker then stops as on SIGTERM (closing its engine unlinks its
    segments); if it has not exited within `EXIT_GRACE_S`, its watch unlinks
    the segments named with its pid and ends the process.
    A worker stays in the launcher's process group (and so goes with it in a
    terminal's job control) but ignores SIGINT, as do the pipeline stages it
    starts (`run_worker`): a terminal's Ctrl-C, sent to the whole foreground
    group, is the launcher's alone, whose `close()` lets requests in flight
    end before it stops the workers.

Invariants:
    - a segment is named `mooncake-<creator pid>-<12 hex digits>` (the rule of
      `mooncake.transfer.region.create_shared`); only such names whose creator
      is not running are ever removed, never another program's or a live one's;
    - a worker outlives its launcher by at most `EXIT_GRACE_S` plus one
      watch period.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers its exit handler now: LocalBackend's must run before it
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Protocol

import attrs

from mooncake.errors import EngineError
from serving.config import ClusterConfig
from serving.gateway import Gateway
from serving.machine import check_port_free
from serving.protocol import http_url
from serving.worker import WorkerSpec, run_worker, start_failure

__all__ = [
    "Backend",
    "CorePlan",
    "LocalBackend",
    "RayBackend",
    "RunningCluster",
    "core_plan",
    "remove_stale_segments",
    "remove_stale_ssd_folders",
    "start_cluster",
]

LOG = logging.getLogger("serving.launch")

NODE_ADDRESS = "<node>"
"""A `WorkerSpec.host` a Ray actor replaces with its node's address (`ray.util.get_node_ip_address()`)."""

START_TIMEOUT_S = 120.0
SERVING_DIR = Path(__file__).resolve().parent  # shipped to Ray workers, which do not have examples/ on their path
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory; elsewhere there is nothing to list
SEGMENT_NAME = re.compile(r"mooncake-(?P<pid>[1-9][0-9]{0,6})-[0-9a-f]{12}")  # create_shared's names, nothing else
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: a larger number was never a process
# A worker's SSD tier without `[cache] ssd_dir`: tempfile's folder, its prefix naming the worker's pid.
SSD_FOLDER_NAME = re.compile(r"mooncake-ssd-(?P<pid>[1-9][0-9]{0,6})-[a-z0-9_]{8}")
WATCH_PERIOD_S = 0.5
EXIT_GRACE_S = 15.0  # a worker's graceful stop after its launcher died, before it unlinks and exits hard
# How long a stop waits, step by step (`RunningCluster.close`, then the backend's `stop`):
CLOSE_GRACE_S = 15.0  # requests in flight end (close's default `grace_s`)
CLOSE_ANSWER_S = 5.0  # then those still running get their 503 and the gateway's loop ends
STOP_GRACE_S = 15.0  # the workers' graceful stop after SIGTERM, one period for all (a Ray actor: each)
STOP_KILL_S = 5.0  # then SIGKILL, the workers reaped
CLOSE_S = CLOSE_GRACE_S + CLOSE_ANSWER_S + STOP_GRACE_S + STOP_KILL_S  # the longest close of local workers takes
PARENT_DEATH_SIGNAL = signal.SIGUSR1  # not SIGTERM: a spawning thread's exit fires it too, and must not stop us
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Backend(Protocol):
    """Where workers run. `node_host`: the address the gateway's transfer engine listens on, one every worker
    reaches (127.0.0.1 on one machine; this node's address on a multi-node Ray cluster)."""

    node_host: str

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]: ...

    def is_alive(self, instance_id: str) -> bool:
        """False only when the worker is certainly gone (its process exited, Ray says its actor died): the other
        workers then release what it held with them, so a stopped or slow one must never read as dead."""
        ...

    def kill(self, instance_id: str) -> None: ...
    def stop(self) -> None: ...


# ---------------------------------------------------------------------------------------------- shared memory


def _unlink(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError, OSError, ValueError):  # ValueError: an empty segment
            segment = shared_memory.SharedMemory(name=name, create=False)
            segment.close()
            segment.unlink()  # also forgets it in multiprocessing's resource tracker


def _is_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has: an orphan's may wait for a reaper)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # without /proc, kill(pid, 0) is all there is to know
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _named_by_pid(root: Path, pattern: re.Pattern[str], pids: Collection[int] | None = None) -> list[tuple[str, int]]:
    """The names in `root` that follow `pattern` (its `pid` group naming the process that made them; of `pids`
    only, if given), sorted, each with that pid."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is not None and (owner := int(match["pid"])) < PID_MAX and (pids is None or owner in pids):
            found.append((name, owner))
    return sorted(found)


def _segments(pid: int | None = None) -> list[str]:
    """The names in SHM_DIR that follow the segment rule (of creator `pid` only, if given), sorted."""
    return [name for name, _owner in _named_by_pid(SHM_DIR, SEGMENT_NAME, None if pid is None else (pid,))]


def remove_stale_segments() -> list[str]:
    """Unlink the shared-memory segments whose creating process is gone; returns their names.

    Only names that follow `create_shared`'s rule (`mooncake-<pid>-<12 hex digits>`) are considered,
    and only those whose pid names no running process are removed. A pid reused by an unrelated
    process keeps its segment (a leak, never a loss); processes of another pid namespace sharing
    /dev/shm are out of sight, so share it only between launchers of one namespace.
    """
    removed = []
    for name, owner in _named_by_pid(SHM_DIR, SEGMENT_NAME):
        if _is_running(owner):
            continue
        # unlink(2) on the file is shm_unlink(3) on Linux, and needs no mapping: a zero-byte segment goes too.
        with contextlib.suppress(FileNotFoundError, PermissionError):  # gone already, or another user's
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed


def remove_stale_ssd_folders(root: Path | None = None, *, pids: Collection[int] | None = None) -> list[str]:
    """Remove the SSD-tier folders of workers that are gone (of the workers of `pids` only, if given); returns
    their names.

    A worker without `[cache] ssd_dir` keeps its SSD pages in a temporary folder named
    `mooncake-ssd-<its pid>-<tempfile's 8 characters>` (in `root`, the temporary directory by default) and
    removes it when it closes; one that was killed never does, and its folder may hold gigabytes. As for
    segments, only that name and only a pid that names no running process are removed.
    """
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    for name, owner in _named_by_pid(root, SSD_FOLDER_NAME, pids):
        if _is_running(owner):
            continue
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)  # another user's stays
            if not path.exists():
                removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------------- local workers


def _set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send `signum` when our parent exits; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class _ParentWatch:
    """Stops this worker process when its launcher is gone (see the module's Lifecycle)."""

    def __init__(self, parent_pid: int, lifeline: Any) -> None:
        self._parent_pid = parent_pid
        self._lifeline = lifeline  # the read end of a pipe whose write end only the launcher holds
        self._gone = threading.Event()  # the launcher died, or a stop came before run_worker took SIGTERM
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> None:
        # Until run_worker installs its own SIGTERM handler, a SIGTERM must not kill us between creating a
        # segment and unlinking it: it is noted, and the watch repeats it until the worker's handler takes it.
        signal.signal(signal.SIGTERM, lambda *_: self._gone.set())
        signal.signal(PARENT_DEATH_SIGNAL, self._on_parent_death_signal)
        _set_parent_death_signal(PARENT_DEATH_SIGNAL)
        self._thread.start()

    def _on_parent_death_signal(self, *_: object) -> None:
        if self._parent_changed():  # else only the thread that spawned us ended; the launcher lives
            self._gone.set()

    def _parent_changed(self) -> bool:
        return os.getppid() != self._parent_pid

    def _lifeline_closed(self) -> bool:
        try:
            if self._lifeline.poll(WATCH_PERIOD_S):  # readable: the launcher never writes, so EOF
                self._lifeline.recv()
        except (EOFError, OSError):
            return True
        return False

    def _run(self) -> None:
        while not self._gone.is_set() and not self._parent_changed() and not self._lifeline_closed():
            pass  # _lifeline_closed waits up to WATCH_PERIOD_S
        for _ in range(int(EXIT_GRACE_S)):
            os.kill(os.getpid(), signal.SIGTERM)  # run_worker's handler: a graceful stop, which unlinks
            time.sleep(1.0)  # repeated: the first may come before run_worker has installed that handler
        _unlink(_segments(os.getpid()))
        os._exit(1)


def _worker_main(spec: WorkerSpec, connection: Any, parent_pid: int, lifeline: Any) -> None:
    """A local worker process's main: `run_worker` under a parent watch; unlinks what its engine left."""
    _ParentWatch(parent_pid, lifeline).start()
    try:
        run_worker(spec, connection)
    finally:
        _unlink(_segments(os.getpid()))


def _starts_processes(spec: WorkerSpec) -> bool:
    """Whether the worker starts processes of its own (a pipeline group's stages), which a daemonic one may not."""
    return spec.role == "prefill" and spec.config.prefill.pipeline_size > 1


@attrs.frozen
class CorePlan:
    """Cores for engine processes of their own: `engines[i]` for the i-th worker (as many as it runs processes),
    `rest` for the launcher, its gateway and anything else on the machine."""

    engines: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]


def core_plan(available: Sequence[int], needs: Sequence[int]) -> CorePlan | None:
    """Give each worker `needs[i]` cores of its own from `available`, the last ones first, and keep at least one
    for the rest; None when there are not enough (the engines then share the cores as the system places them).

    Invariants of a plan: the engines' sets and the rest are disjoint, cover `available`, and the i-th set has
    `needs[i]` cores.
    """
    cores = sorted(available)
    if sum(needs) + 1 > len(cores):
        return None
    engines, end = [], len(cores)
    for need in needs:
        engines.append(tuple(cores[end - need : end]))
        end -= need
    return CorePlan(engines=tuple(engines), rest=tuple(cores[:end]))


def _started(instance_id: str, info: dict[str, Any]) -> dict[str, Any]:
    """A worker's start message (how to reach it), or the EngineError naming it and why it failed to start
    (`serving.worker.start_failure`): a backend's error says the cause, not only that a worker is gone."""
    if "error" in info:
        raise EngineError(f"worker {instance_id} failed to start: {info['error']}")
    return info


class LocalBackend:
    """Workers as spawned processes of this machine, each watching that this process lives.

    A worker is a daemonic process (multiprocessing ends it if this process exits without `stop`), except
    one that starts processes of its own, which a daemonic process may not: `stop` is then also an exit
    handler of this process.
    """

    node_host = "127.0.0.1"

    def __init__(self, *, pin_cores: bool = False) -> None:
        self.pin_cores = pin_cores  # each worker on cores of its own when the machine has enough (`core_plan`)
        self.plan: CorePlan | None = None
        self._pinned: tuple[int, set[int]] | None = None  # the thread pinned to the plan's rest, its own set before
        self._processes: dict[str, Any] = {}
        self._pids: dict[str, int] = {}
        self._shm: dict[str, list[str]] = {}
        self._lifelines: list[Any] = []  # write ends, never written: they close when this process dies

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
        context = multiprocessing.get_context("spawn")
        # Before multiprocessing's own exit handler, which would wait for a non-daemonic worker forever.
        atexit.register(self.stop)
        if self.pin_cores:
            needs = [spec.config.prefill.pipeline_size if _starts_processes(spec) else 1 for spec in specs]
            self.plan = core_plan(sorted(os.sched_getaffinity(0)), needs)
            if self.plan is None:
                LOG.warning(
                    "pin_cores: %d engine processes need %d cores and the launcher one; %d available: not pinned",
                    len(specs),
                    sum(needs),
                    len(os.sched_getaffinity(0)),
                )
            else:
                # This thread (Linux pins threads): the gateway's thread it starts next inherits the set, and so
                # does each worker until it is moved to its own cores below.
                self._pinned = (threading.get_native_id(), os.sched_getaffinity(0))
                os.sched_setaffinity(0, self.plan.rest)
        pipes: dict[str, Any] = {}
        for i, spec in enumerate(specs):
            parent, child = context.Pipe(duplex=False)
            watched, lifeline = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(spec, child, os.getpid(), watched),
                name=spec.instance_id,
                daemon=not _starts_processes(spec),
            )
            process.start()
            if self.plan is not None:  # its pipeline stages, started later, inherit the set
                os.sched_setaffinity(process.pid, self.plan.engines[i])
            child.close()
            watched.close()
            self._lifelines.append(lifeline)
            self._processes[spec.instance_id] = process
            self._pids[spec.instance_id] = int(process.pid)
            pipes[spec.instance_id] = parent
        try:
            infos = self._await_started(pipes)
        except BaseException:
            self.stop()
            raise
        finally:  # each worker speaks once on its start pipe
            for pipe in pipes.values():
                pipe.close()
        return [infos[spec.instance_id] for spec in specs]

    def _await_started(self, pipes: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each worker's start message, read as they come: the first worker that fails to start (or dies, or the
        deadline) is the EngineError, without waiting for those before it to start."""
        infos: dict[str, dict[str, Any]] = {}
        names = {pipe: instance_id for instance_id, pipe in pipes.items()}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(infos) < len(pipes):
            waiting = [pipe for pipe, instance_id in names.items() if instance_id not in infos]
            ready = multiprocessing.connection.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = ", ".join(names[pipe] for pipe in waiting)
                raise EngineError(f"worker {late} did not start within {START_TIMEOUT_S} s")
            for readable in ready:
                instance_id = names[readable]
                try:
                    info = pipes[instance_id].recv()
                except EOFError:  # killed, or failed before it could say why (its stderr says)
                    raise EngineError(f"worker {instance_id} died while starting") from None
                infos[instance_id] = _started(instance_id, info)
                self._shm[instance_id] = info["shm"]  # unlinked by `stop` if the worker is killed
        return infos

    def is_alive(self, instance_id: str) -> bool:
        process = self._processes.get(instance_id)  # none once `stop` has reaped it
        return process is not None and bool(process.is_alive())

    def pid(self, instance_id: str) -> int:
        """The worker's process id (also once it is stopped)."""
        return self._pids[instance_id]

    def kill(self, instance_id: str) -> None:
        """SIGKILL a worker (to test failures); its shared memory is unlinked and its SSD folder removed at
        `stop`."""
        self._processes[instance_id].kill()
        self._processes[instance_id].join(timeout=10)

    def stop(self) -> None:
        for process in self._processes.values():
            if process.is_alive():
                process.terminate()  # SIGTERM: the worker closes its engine, cache and shared memory
        # One grace period for all (not one each): a stop is bounded by STOP_GRACE_S + STOP_KILL_S however many
        # workers hang.
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self._processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        deadline = time.monotonic() + STOP_KILL_S
        for process in self._processes.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for instance_id, process in list(self._processes.items()):
            if not process.is_alive():  # its sentinel pipe goes with it; one that outlived its kill stays listed
                process.close()
                del self._processes[instance_id]
        _unlink([name for names in self._shm.values() for name in names])  # what killed workers left
        # And their SSD folders, now rather than at the next start (a killed worker's may hold gigabytes).
        remove_stale_ssd_folders(pids={pid for i, pid in self._pids.items() if i not in self._processes})
        for lifeline in self._lifelines:
            lifeline.close()
        self._lifelines.clear()
        if self._pinned is not None:
            thread, cores = self._pinned
            with contextlib.suppress(OSError):  # the thread has ended
                os.sched_setaffinity(thread, cores)
            self._pinned = None
        atexit.unregister(self.stop)


# ---------------------------------------------------------------------------------------------- Ray


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RayBackend:
    """Workers as Ray actors. `address=None` starts a local Ray head on `host`; else joins that cluster.

    A head this backend starts has every server on `host`. Ray turns a loopback node address into
    the machine's own (`resolve_ip_for_localhost`) and its servers then listen on all interfaces,
    unless Ray runs as a one-machine cluster (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read by Ray at
    import and by every process it starts): with it, GCS, raylet (node and object manager), the
    runtime-env agent, the core workers and the autoscaler's metrics all listen on 127.0.0.1. No
    dashboard unless `include_dashboard`, and then on `host`; no usage reports unless
    `RAY_USAGE_STATS_ENABLED` says so; workers at the engines' own priority unless `RAY_worker_niceness` says
    otherwise (Ray's default nices them to 15). Ray's C++ failure handler takes SIGTERM from Python at
    `ray.init` (a stack dump, then an abort): the process's Python handlers are put back after it.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        host: str = "127.0.0.1",
        num_cpus: int | None = None,
        include_dashboard: bool = False,
    ) -> None:
        self._saved_env: dict[str, str | None] = {}
        if address is None:  # before `import ray`: its constants read them
            self._set_env({"RAY_USAGE_STATS_ENABLED": os.environ.get("RAY_USAGE_STATS_ENABLED", "0")})
            # Ray nices its workers to 15 by default: the engines, actors here, would then get almost no CPU on a
            # busy machine (starting in minutes, missing the gateway's health probes).
            niceness = os.environ.get("RAY_worker_niceness", "0")  # noqa: SIM112 (Ray spells its config so)
            self._set_env({"RAY_worker_niceness": niceness})
            if _is_loopback(host):
                self._set_env({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        import ray
        import ray._private.ray_constants as ray_constants

        self._ray = ray
        self._constants = ray_constants
        self._saved_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
        self._owns_ray = not ray.is_initialized()
        self._actors: dict[str, Any] = {}
        self._shm: dict[str, list[str]] = {}
        # A head of our own on `host` is one machine; a cluster joined (or one running already) may span several,
        # so every engine listens on its node's address there (workers resolve theirs on their node).
        self._multi_node = address is not None or not self._owns_ray
        if not self._owns_ray:
            self._restore_env()
            self.node_host = ray.util.get_node_ip_address()
            return
        options: dict[str, Any] = {
            "include_dashboard": include_dashboard,
            "log_to_driver": False,
            "runtime_env": {"py_modules": [str(SERVING_DIR)]},
        }
        if address is None:
            if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in self._saved_env:
                ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
            options.update(address="local", _node_ip_address=host, dashboard_host=host, num_cpus=num_cpus)
        else:
            options["address"] = address
        handlers = _python_signal_handlers()
        try:
            ray.init(**options)
        except BaseException:
            self._restore_env()
            raise
        finally:
            _reinstall(handlers)
        self.node_host = ray.util.get_node_ip_address() if self._multi_node else "127.0.0.1"

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        self._constants.ENABLE_RAY_CLUSTER = self._saved_cluster_flag

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
        ray = self._ray
        actor_class = ray.remote(num_cpus=0)(_RayWorker)
        for spec in specs:
            if self._multi_node:
                spec = attrs.evolve(spec, host=NODE_ADDRESS)
            self._actors[spec.instance_id] = actor_class.options(name=None).remote(spec)
        refs = {instance_id: actor.start.remote() for instance_id, actor in self._actors.items()}
        try:
            return self._await_started(refs)
        except BaseException:  # a late or dead actor, Ctrl-C: no actor, head or variable of ours outlives the start
            self.stop()
            raise

    def _await_started(self, refs: dict[str, Any]) -> list[dict[str, Any]]:
        """Each worker's start message (of `refs`, its `start` call's), in their order; the EngineError naming the
        workers not started within START_TIMEOUT_S, or the first that died or failed to start."""
        ray = self._ray
        names = {ref: instance_id for instance_id, ref in refs.items()}
        _ready, waiting = ray.wait(list(refs.values()), num_returns=len(refs), timeout=START_TIMEOUT_S)
        if waiting:
            late = ", ".join(names[ref] for ref in waiting)
            raise EngineError(f"worker {late} did not start within {START_TIMEOUT_S} s")
        infos = {}
        for instance_id, ref in refs.items():
            try:
                infos[instance_id] = info = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # its actor's process died (its log says why)
                raise EngineError(f"worker {instance_id} died while starting: {error}") from error
            self._shm[instance_id] = info.get("shm", [])  # unlinked by `stop` if the worker is killed
        return [_started(instance_id, info) for instance_id, info in infos.items()]

    def is_alive(self, instance_id: str) -> bool:
        try:
            return bool(self._ray.get(self._actors[instance_id].is_alive.remote(), timeout=5))
        except self._ray.exceptions.RayActorError:  # Ray says the actor died
            return False
        except Exception:  # a timeout or another Ray error: a slow or stopped actor is not known to be dead
            return True

    def kill(self, instance_id: str) -> None:
        self._ray.kill(self._actors[instance_id])

    def stop(self) -> None:
        ray = self._ray
        for actor in self._actors.values():
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=STOP_GRACE_S)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors.clear()
        _unlink([name for names in self._shm.values() for name in names])
        if self._owns_ray:
            ray.shutdown()
            self._restore_env()


def _python_signal_handlers() -> dict[int, Any]:
    """SIGTERM's and SIGINT's Python handlers, if this is the main thread (the only one that may set them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}


def _reinstall(handlers: dict[int, Any]) -> None:
    for signum, handler in handlers.items():
        if handler is not None:  # None: set from C, not Python's to give back
            signal.signal(signum, handler)


class _RayWorker:
    """A Ray actor around one `Worker`. A worker that fails to start is an actor that answers `start` with its
    `start_failure`, as a local worker's start pipe does (Ray's own error would bury it in a remote traceback)."""

    def __init__(self, spec: WorkerSpec) -> None:
        from serving.worker import Worker

        if spec.host == NODE_ADDRESS:
            import ray

            spec = attrs.evolve(spec, host=ray.util.get_node_ip_address())  # this actor's node
        self.instance_id = spec.instance_id
        self.worker: Worker | None = None
        self.failure: dict[str, str] | None = None
        try:
            self.worker = Worker(spec)
        except Exception as error:
            self.failure = start_failure(spec.instance_id, error)

    def start(self) -> dict[str, Any]:
        if self.worker is None:
            assert self.failure is not None
            return self.failure
        try:
            return self.worker.start()
        except Exception as error:
            self.worker.close()
            self.worker, self.failure = None, start_failure(self.instance_id, error)
            return self.failure

    def is_alive(self) -> bool:
        return self.worker is not None and not self.worker.wait(0)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.close()


class RunningCluster:
    """A started cluster: `url`, `gateway`, `backend`, `infos`, `removed_segments`; `close()` stops it all."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The gateway's event loop (it runs on its own thread): for tools that must run on it, like a profiler."""
        return self._loop

    def __init__(self, config: ClusterConfig, backend: Backend) -> None:
        self.config, self.backend = config, backend
        self.removed_segments: list[str] = []
        self.removed_ssd_folders: list[str] = []
        secret = secrets.token_bytes(32)
        specs = [
            WorkerSpec(role=role, instance_id=f"{role}-{i}", config=config, secret=secret)
            for role, count in (("prefill", config.cluster.num_prefill), ("decode", config.cluster.num_decode))
            for i in range(count)
        ]
        self.infos = backend.start(specs)
        try:
            self.gateway = Gateway(config, secret, self.infos, backend.is_alive, host=backend.node_host)
        except BaseException:
            backend.stop()
            raise
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._serve, name="gateway", daemon=True)
        self._thread.start()
        self._ready.wait(START_TIMEOUT_S)
        if self._failure is not None or not self.url:
            self.close()
            raise EngineError(f"the gateway did not start: {self._failure!r}")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as error:  # reported to the starting thread
            self._failure = error
            self._ready.set()
        finally:  # else the loop's self-pipe stays open until the collector finds it
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        # The guarded site: connection caps, header and body deadlines, JSON for aiohttp's own errors.
        runner = await self.gateway.start(self.config.cluster.host, self.config.cluster.port)
        port = runner.addresses[0][1]
        self.url = http_url(self.config.cluster.host, port)
        self._ready.set()
        await self._stopping.wait()
        await runner.cleanup()

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop serving: requests in flight get `grace_s` to end, then those still running end with a 503 saying
        the cluster is shutting down (before their workers stop: else their clients would read that an engine
        failed), and every worker stops."""
        if self._stopping is not None and self._loop.is_running():
            with contextlib.suppress(RuntimeError):  # the loop ended and closed meanwhile
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=grace_s)  # a daemon: if its cleanup hangs, the workers are stopped all the same
        if self._thread.is_alive() and self._loop.is_running():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self.gateway.dispatcher.shut_down_requests)
            self._thread.join(timeout=CLOSE_ANSWER_S)  # the handlers write the 503s and the cleanup ends
        self.backend.stop()

    def __enter__(self) -> RunningCluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def start_cluster(
    config: ClusterConfig, *, backend: str = "local", ray_address: str | None = None, ray_dashboard: bool = False
) -> RunningCluster:
    """Remove stale segments, start workers on `backend` ("local" or "ray") and the gateway; returns once it serves.

    `ray_address` joins an existing Ray cluster instead of starting a head on `[cluster] host`;
    `ray_dashboard` starts Ray's dashboard with that head. The names of the stale segments removed
    are in the result's `removed_segments`, those of the stale SSD folders (`remove_stale_ssd_folders`) in its
    `removed_ssd_folders`.
    """
    check_port_free(config)  # before any worker starts: a clash found by the gateway came after them all
    removed = remove_stale_segments()
    folders = remove_stale_ssd_folders()
    chosen: Backend
    if backend == "local":
        chosen = LocalBackend(pin_cores=config.cluster.pin_cores == "auto")
    else:
        chosen = RayBackend(ray_address, host=config.cluster.host, include_dashboard=ray_dashboard)
    cluster = RunningCluster(config, chosen)
    cluster.removed_segments = removed
    cluster.removed_ssd_folders = folders
    return cluster
