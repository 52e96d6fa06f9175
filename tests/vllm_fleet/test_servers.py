"""`VllmServer.stop` against a stand-in process group (no vLLM needed): a group that maps shared memory its
processes never unlink (vLLM's engine queues, killed) and binds sockets in its RPC folder (vLLM's ZeroMQ `ipc://`
paths) leaves nothing in /dev/shm or that folder, and no process of it lives on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_fleet.servers import VllmServer

# A parent and a child in a session of their own, like a vLLM API server and its engine core: the child creates
# a segment the parent maps too, and neither would ever unlink it (the resource tracker told to forget it, as
# vLLM's queues outlive a SIGKILL); the parent binds a socket in VLLM_RPC_BASE_PATH, as vLLM's API server does;
# SIGTERM is ignored, so only the SIGKILL after the grace period ends them.
GROUP = r"""
import os, signal, socket, subprocess, sys, time, uuid
from multiprocessing import resource_tracker, shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1:] == ["child"]:
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(segment._name, "shared_memory")
    print(segment.name, flush=True)
    time.sleep(600)
else:
    child = subprocess.Popen([sys.executable, "-c", __CODE__, "child"], stdout=subprocess.PIPE, text=True)
    name = child.stdout.readline().strip()
    segment = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(segment._name, "shared_memory")
    rpc = socket.socket(socket.AF_UNIX)
    rpc.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4())))
    print(name, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/maps").exists(), reason="needs Linux")
def test_a_killed_group_leaves_no_shared_memory_no_socket_and_no_process(tmp_path: Path) -> None:
    code = GROUP.replace("__CODE__", repr(GROUP))
    rpc_dir = tmp_path / "rpc"
    rpc_dir.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "VLLM_RPC_BASE_PATH": str(rpc_dir)},
    )
    server = VllmServer(process, port=0, events_port=0, replay_port=0, log=tmp_path / "log", core=0, rpc_dir=rpc_dir)
    try:
        assert process.stdout is not None
        segment = Path("/dev/shm") / process.stdout.readline().strip().lstrip("/")
        assert segment.exists() and len(list(rpc_dir.iterdir())) == 1  # bound before the name was printed
        deadline = time.monotonic() + 10
        while len(server.group()) < 2 or segment not in server.shared_memory():
            assert time.monotonic() < deadline, "the stand-in group did not start"
            time.sleep(0.05)
        server.stop(grace_s=0.2)
        assert server.group() == [] and process.poll() is not None
        assert not segment.exists() and not rpc_dir.exists()
    finally:
        server.stop(grace_s=0)
