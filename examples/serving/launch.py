"""Starting and stopping a whole cluster: workers on a backend, then the gateway on an event loop thread.

Backends place the workers: `LocalBackend` as spawned processes on this machine,
`RayBackend` as Ray actors (on a local Ray instance bound to 127.0.0.1, or an
existing cluster via `address`). Either way the workers talk to each other and
to the gateway over mooncake's own transfer engines.

`start_cluster(config)` returns a `RunningCluster` once the gateway answers;
`close()` stops the gateway, every worker (SIGTERM, then SIGKILL after a grace
period) and unlinks any shared-memory segment a killed worker left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import secrets
import threading
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from mooncake.errors import EngineError
from serving.config import ClusterConfig
from serving.gateway import Gateway
from serving.worker import WorkerSpec, run_worker

__all__ = ["Backend", "LocalBackend", "RayBackend", "RunningCluster", "start_cluster"]

START_TIMEOUT_S = 120.0
SERVING_DIR = Path(__file__).resolve().parent  # shipped to Ray workers, which do not have examples/ on their path


class Backend(Protocol):
    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]: ...
    def is_alive(self, instance_id: str) -> bool: ...
    def kill(self, instance_id: str) -> None: ...
    def stop(self) -> None: ...


def _unlink(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError, OSError):
            segment = shared_memory.SharedMemory(name=name, create=False)
            segment.close()
            segment.unlink()


class LocalBackend:
    """Workers as spawned processes of this machine."""

    def __init__(self) -> None:
        self._processes: dict[str, Any] = {}
        self._shm: dict[str, list[str]] = {}

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
        context = multiprocessing.get_context("spawn")
        pipes = {}
        for spec in specs:
            parent, child = context.Pipe(duplex=False)
            process = context.Process(target=run_worker, args=(spec, child), name=spec.instance_id, daemon=True)
            process.start()
            child.close()
            self._processes[spec.instance_id] = process
            pipes[spec.instance_id] = parent
        infos = []
        for instance_id, pipe in pipes.items():
            if not pipe.poll(START_TIMEOUT_S):
                self.stop()
                raise EngineError(f"worker {instance_id} did not start within {START_TIMEOUT_S} s")
            try:
                info = pipe.recv()
            except EOFError:
                self.stop()
                raise EngineError(f"worker {instance_id} died while starting") from None
            self._shm[instance_id] = info["shm"]
            infos.append(info)
        return infos

    def is_alive(self, instance_id: str) -> bool:
        return bool(self._processes[instance_id].is_alive())

    def kill(self, instance_id: str) -> None:
        """SIGKILL a worker (to test failures); its shared memory is unlinked at `stop`."""
        self._processes[instance_id].kill()
        self._processes[instance_id].join(timeout=10)

    def stop(self) -> None:
        for process in self._processes.values():
            if process.is_alive():
                process.terminate()  # SIGTERM: the worker closes its engine, cache and shared memory
        for process in self._processes.values():
            process.join(timeout=15)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        _unlink([name for names in self._shm.values() for name in names])  # what killed workers left


class RayBackend:
    """Workers as Ray actors. `address=None` starts a local Ray bound to 127.0.0.1; else joins that cluster."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None) -> None:
        import ray

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            options: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "runtime_env": {"py_modules": [str(SERVING_DIR)]},
            }
            if address is None:
                options.update(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus)
            else:
                options["address"] = address
            ray.init(**options)
        self._actors: dict[str, Any] = {}
        self._shm: dict[str, list[str]] = {}

    def start(self, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
        ray = self._ray
        actor_class = ray.remote(num_cpus=0)(_RayWorker)
        for spec in specs:
            self._actors[spec.instance_id] = actor_class.options(name=None).remote(spec)
        infos = ray.get([actor.start.remote() for actor in self._actors.values()], timeout=START_TIMEOUT_S)
        for info in infos:
            self._shm[info["instance_id"]] = info["shm"]
        return list(infos)

    def is_alive(self, instance_id: str) -> bool:
        try:
            return bool(self._ray.get(self._actors[instance_id].is_alive.remote(), timeout=5))
        except Exception:  # any Ray error means the actor is gone
            return False

    def kill(self, instance_id: str) -> None:
        self._ray.kill(self._actors[instance_id])

    def stop(self) -> None:
        ray = self._ray
        for actor in self._actors.values():
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=15)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors.clear()
        _unlink([name for names in self._shm.values() for name in names])
        if self._owns_ray:
            ray.shutdown()


class _RayWorker:
    """A Ray actor around one `Worker`."""

    def __init__(self, spec: WorkerSpec) -> None:
        from serving.worker import Worker

        self.worker = Worker(spec)

    def start(self) -> dict[str, Any]:
        return self.worker.start()

    def is_alive(self) -> bool:
        return not self.worker.wait(0)

    def stop(self) -> None:
        self.worker.close()


class RunningCluster:
    """A started cluster: `url`, `gateway`, `backend`, `infos`; `close()` stops it all."""

    def __init__(self, config: ClusterConfig, backend: Backend) -> None:
        self.config, self.backend = config, backend
        secret = secrets.token_bytes(32)
        specs = [
            WorkerSpec(role=role, instance_id=f"{role}-{i}", config=config, secret=secret)
            for role, count in (("prefill", config.cluster.num_prefill), ("decode", config.cluster.num_decode))
            for i in range(count)
        ]
        self.infos = backend.start(specs)
        try:
            self.gateway = Gateway(config, secret, self.infos, backend.is_alive)
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

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        runner = web.AppRunner(self.gateway.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.cluster.host, self.config.cluster.port)
        await site.start()
        port = runner.addresses[0][1]
        self.url = f"http://{self.config.cluster.host}:{port}"
        self._ready.set()
        await self._stopping.wait()
        await runner.cleanup()

    def close(self) -> None:
        if self._stopping is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=30)
        self.backend.stop()

    def __enter__(self) -> RunningCluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def start_cluster(config: ClusterConfig, *, backend: str = "local", ray_address: str | None = None) -> RunningCluster:
    """Start workers on `backend` ("local" or "ray") and the gateway; returns once it serves."""
    chosen: Backend = LocalBackend() if backend == "local" else RayBackend(ray_address)
    return RunningCluster(config, chosen)
