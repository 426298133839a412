"""Python's cyclic garbage collector, paused while shardc plans.

Planning allocates millions of short-lived tuples, lists and arrays (descent's local costs,
the ILP's rows, each plan's records) beside a heap of long-lived ones (the program's IR,
its cost graphs, their strategy lists). CPython's collector runs whenever allocations
outnumber deallocations by its threshold, and every full collection walks the whole heap:
GPT-2 small's time-memory frontier on (2, 4) spent 5 of its 38 s in the collector, which
found under 20,000 objects in cycles across the run (reference counting frees the rest).
:func:`paused` turns the collector off for the planner's entry points and back on after
(a nested pause leaves it as it found it), so the cycles left wait for the next collection
after planning."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused"]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside (a decorator too: ``@paused()``); restored on exit, also
    on an error."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
