"""Which state a step may keep in host memory where a memory budget binds.

A state leaf offloaded (``Plan.offloaded``) lives in the host's ``pinned_host`` memory
between calls: each step moves it to the devices where it is read and its new state back
once made (:func:`shardc.lower.emit.to_memory`), paying both transfers at the host link's
bandwidth (``Cluster.host_bandwidth``, :func:`shardc.solve.problem.input_cost`) and holding
it on the devices only from its first read to its last
(:func:`shardc.solve.lifetimes.offloaded_spans`). That saves memory for the state read in a
short stretch of the step, as an optimizer's moments are, read by the update alone; a
weight read by the forward pass and by the update is held across the step either way and
only pays the transfers. The planner tries the offloaded program only where the budget
binds (:func:`shardc.step.solving.fastest`), and keeps it where it is the fastest plan that
fits; ``auto_shard(..., offload=False)`` forbids it.
"""

from __future__ import annotations

from shardc.solve.lifetimes import read_points
from shardc.step.signature import TracedCall

__all__ = ["SHORT_SPAN", "offloadable"]

SHORT_SPAN = 0.25
"""The longest stretch of the program, as a share of its ops, over which a state leaf may
be read and still be offloaded: held on the devices from its first read to its last, a
leaf read across more of the step saves little of what its transfers cost."""


def offloadable(tr: TracedCall) -> frozenset[int]:
    """The state inputs of ``tr``'s program the planner may keep in host memory: tied to
    an output (new state each step), not scalars, not placed by the user (a fixed layout),
    read by some op, and read within :data:`SHORT_SPAN` of the program's ops."""
    graph = tr.traced.graph
    first, last = read_points(graph)
    span = SHORT_SPAN * max(len(graph.ops), 1)
    out = set()
    for j, k in tr.ties:
        v = graph.inputs[k]
        if v.ndim == 0 or k in tr.fixed.inputs or j in tr.fixed.outputs or v.id not in first:
            continue
        if last[v.id] - first[v.id] <= span:
            out.add(k)
    return frozenset(out)
