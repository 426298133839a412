"""Python's cyclic garbage collector, paused while shardc traces, plans and lowers.

Each of these allocates hundreds of thousands to millions of short-lived tuples, lists and
arrays (jaxpr equations, descent's local costs, the ILP's rows, each plan's records) beside
a heap of long-lived objects (a training script's, the program's IR, its cost graphs).
CPython's collector runs whenever allocations outnumber deallocations by its threshold,
and every full collection walks the whole heap. Measured: in the bench process (350k
objects) tracing the ViT's saved plan took 1.2 s with the collector on, 0.8 s paused; GPT-2
small's time-memory frontier on (2, 4) spent 5 of its 38 s in collections that found under
20,000 objects in cycles across the run (reference counting frees the rest). The cycles
left wait for the first collection after the pause. The collector is the process's: where
two threads plan at once, the first to finish turns it back on while the other plans
(that one is then slower, not wrong)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off inside (a decorator too: ``@gc_paused()``) and restored on exit,
    also on an error; a pause inside another leaves it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
