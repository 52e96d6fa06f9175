"""Waiting in tests: poll a condition with a deadline (never a bare sleep), and whether a process still runs."""

from __future__ import annotations

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


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan's zombie may wait for an init that never reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def stop_process(pid: int, *, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads has stopped.

    `kill` returns once the signal is queued: on a busy machine a thread of the
    process may still run for a while and, say, answer one more request.
    """
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
        except (OSError, IndexError):  # gone, or a thread ended while being read: look again
            return not Path(f"/proc/{pid}").exists()
        return all(state in ("T", "t", "Z", "X") for state in states)

    wait_for(stopped, timeout=timeout, what=f"process {pid} to stop", poll_s=0.005)
