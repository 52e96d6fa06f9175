"""Waiting in tests: poll a condition with a deadline (never a bare sleep), and whether a process still runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["is_running", "wait_for"]


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
