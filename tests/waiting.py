"""Waiting in tests: poll a condition with a deadline (never a bare sleep), and whether a process still runs."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["is_running", "stop_process", "wait_for"]


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str, poll_s: float = 0.02) -> None:
    """Poll `predicate` until it holds; fail the test naming `what` if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(poll_s)


def _state(stat: Path) -> str:
    """A process's or thread's state letter from its /proc stat file (after the name, which may hold ')')."""
    return stat.read_text().rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan's zombie may wait for an init that never reaps)."""
    try:
        state = _state(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def stop_process(pid: int, *, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads has stopped; fail the test (the process let go
    again with SIGCONT) if it exits instead or does not stop within `timeout` seconds.

    `kill` returns once the signal is queued: on a busy machine a thread of the
    process may still run for a while and, say, answer one more request.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _state(Path(f"/proc/{pid}/stat")) in ("Z", "X"):
                break  # exited: a stopped process is what the test needs
            states = []
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                    states.append(_state(task / "stat"))
        except FileNotFoundError:
            break  # exited and reaped
        if all(state in ("T", "t", "Z", "X") for state in states):  # an exited thread stays a zombie a while
            return
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGCONT)
            pytest.fail(f"waited {timeout} s for process {pid} to stop")
        time.sleep(0.005)
    pytest.fail(f"process {pid} exited instead of stopping")
