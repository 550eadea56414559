"""The one way tests wait for something another thread or process does: poll until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    interval_s: float = 0.05,
    message: str | Callable[[], str] = "the condition never held",
) -> T:
    """Calls `predicate` every `interval_s` until it returns something truthy, and returns that. After
    `timeout_s` the test fails with `message` (a string, or a function called then for one, to show the
    state at the end). An exception `predicate` raises ends the wait at once: a predicate may assert that
    what it waits on is still alive."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"{text} (waited {timeout_s:g} s)")
        time.sleep(interval_s)
    return value
