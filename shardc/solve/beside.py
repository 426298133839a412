"""Independent solves run beside each other, one per core.

HiGHS lets go of Python's GIL while it solves, so two LPs on two threads take the time of
the longer one (0.35 s against 0.76 in a row, measured here); the Python around them (a
model's rows, a plan's repair) still runs one thread at a time. The planner hands this
module only calls whose answers do not depend on each other or on the order they finish
in, so a plan is the same on one core or several, loaded or idle: only the wall time
changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["beside", "cores", "idle_core"]

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def idle_core() -> bool:
    """Whether a core is free for work this process may not need (a speculative solve): the
    process may use more than one, and the one-minute load average, less this process's own
    running thread, leaves one idle. On a loaded machine (a test suite's workers, a bench
    running cells side by side) such work only takes the time of work that is needed."""
    n = cores()
    if n < 2:
        return False
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not reported here: take the machine as ours
        return True
    return load - 1 < n - 1


def beside(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's answer, in order: the first on this thread, the others on threads of
    their own where the process may use more than one core (else one after another, here).
    An error in any call is raised here, after every call has ended."""
    if len(calls) < 2 or cores() < 2:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=min(len(calls) - 1, cores() - 1)) as pool:
        later = [pool.submit(call) for call in calls[1:]]
        first = calls[0]()
        return [first, *(f.result() for f in later)]
