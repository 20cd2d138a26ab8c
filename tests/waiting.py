"""How tests wait: on the event they need (a version reached, a fault recorded, a row written),
never on a fixed sleep or a tight per-call timeout that a busy machine can exceed.

    until(what, condition, seen=None)  -> condition's first truthy value
    answer(ref, what)                  -> ray.get(ref), waiting on the same deadline
    stepping(what, step, done)         -> drive a Ray-free component by hand until done

All three share one generous deadline per test (TEST_DEADLINE_S from the test's start, below
pytest-timeout's 600 s so that our message is the one printed): it fires only on a real hang,
and then says what the test was waiting for and what it saw last.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import pytest

T = TypeVar("T")

TEST_DEADLINE_S = 480.0
_started = [time.monotonic()]


@pytest.fixture(autouse=True)
def _test_clock() -> None:
    """Every test's deadline counts from its own start (conftest.py imports this fixture)."""
    _started[0] = time.monotonic()


def remaining_s() -> float:
    return _started[0] + TEST_DEADLINE_S - time.monotonic()


def until(what: str, condition: Callable[[], T], seen: Callable[[], Any] | None = None,
          poll_s: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy; past the test's deadline, fail
    naming `what` and the last thing `seen()` (default: the condition's last value)."""
    waited = time.monotonic()
    while not (value := condition()):
        if remaining_s() <= 0:
            saw = seen() if seen is not None else value
            pytest.fail(f"hung: waited {time.monotonic() - waited:.0f}s (the test's deadline of "
                        f"{TEST_DEADLINE_S:.0f}s) for {what}; last saw: {saw!r}")
        time.sleep(poll_s)
    return value


def answer(ref: Any, what: str) -> Any:
    """ray.get(ref) within the test's deadline; past it, fail naming `what`."""
    import ray

    ready, _ = ray.wait([ref], timeout=max(remaining_s(), 0.0))
    if not ready:
        pytest.fail(f"hung: no answer within the test's deadline of {TEST_DEADLINE_S:.0f}s "
                    f"for {what}")
    return ray.get(ref)


def stepping(what: str, step: Callable[[], Any], done: Callable[[], Any],
               seen: Callable[[], Any] | None = None) -> None:
    """Drive a Ray-free component by hand: call `step` until `done()` (a step that did
    nothing is followed by a millisecond's nap), within the test's deadline."""
    def stepped() -> Any:
        if not done() and not step():
            time.sleep(0.001)
        return done()
    until(what, stepped, seen=seen, poll_s=0.0)
