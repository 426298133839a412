"""Price a compiled program with its communication overlapped with its compute.

:func:`shardc.inspect.hlo.price` adds every collective's time to the compute time: the
program as if nothing ran beside anything else. On GPUs and TPUs XLA's latency-hiding
scheduler runs collectives asynchronously beside independent compute (an FSDP step's
weight all-gathers and gradient reduce-scatters mostly hide behind its matmuls).
:func:`schedule` replays the compiled HLO on two streams:

- **compute**: one stream, the program's instructions in its (scheduled) text order; an
  instruction starts when the stream is free and its operands are ready;
- **communication**: one stream (NCCL runs a stream's collectives one after another, in the
  order they are issued). A collective can start once its operands are ready; whenever the
  stream is free it runs, of the collectives that can start, the one needed first (by the
  text position of its first use), and when none can start, the one that can soonest. Its
  result is ready when it ends, and its first use waits for it: the instruction reading it
  (through any free view of it, below) starts no earlier.

The order the communication stream picks is a latency-hiding scheduler's: XLA:CPU places
its synchronous collectives anywhere before their uses (an FSDP step's every weight gather
at the top, the embedding's among them), and running them in that text order would expose
what a scheduler hides by issuing each ahead of its use. GPU's scheduled ``-start`` ops
are usually issued in the order of their uses already.

XLA:CPU compiles synchronous collectives (``all-reduce``, ...); GPU compiles
``<kind>-start`` / ``<kind>-done`` pairs (and ``async-start`` wrapping a collective's
computation). Both are one collective here: a synchronous one or a ``-start`` may start
when its operands are ready, a ``-done`` is free and passes the result on to its first
use. The step ends when both streams are idle.

Costs
-----
A collective costs exactly what :func:`~shardc.inspect.hlo.collective_seconds` gives the
serial pricing, per run. An instruction's compute weight is its FLOPs as
:func:`shardc.inspect.loops.instruction_flops` counts them (``dot`` and ``convolution``
from shapes and dimension numbers, elementwise arithmetic one per element, a reduction
its reducer's once: reductions weigh little here), a fusion's those of the instructions
it fuses, and a GPU library matmul (a ``custom-call`` whose target names a gemm or
matmul) ``2 * result elements * contracted size`` from its ``dot_dimension_numbers``.
Weights are scaled so that they sum to the serial pricing's compute time
(``cost_analysis`` FLOPs, loop bodies by trip count), so both pricings carry the same
compute. Every other instruction (copies, slices, transposes, broadcasts, tuples,
``-done`` ops) is free and off the streams: it is ready when its operands are, as
``cost_analysis`` counts it no FLOPs either. A program in which no instruction has
FLOPs this reader counts but whose serial compute is not zero runs its compute as one
block after the rest (no overlap claimed).

Loops and calls
---------------
A ``while`` with a known trip count is simulated iteration by iteration (its body replayed
that many times, the loop state passed element by element, so a collective started in one
iteration and awaited in the next, as XLA's collective pipeliner writes it, overlaps the
iteration between); unknown trip counts run once, as :func:`shardc.inspect.loops.multiplicity`
counts them. A loop iteration is a sync point: its collectives start no earlier than the
compute of the one before has ended (the device evaluates the loop condition there, and a
body's kernels are issued after it). A ``call`` is replayed inline. Collectives the replay
never reaches (in a ``conditional``'s branches) are charged serially after the rest, by
the runs the serial pricing gives them. A computation's result is its last instruction
without users (the printed ``ROOT`` in optimized HLO, where dead code is removed).

Not modelled: memory limits on how far ahead a collective may run (XLA bounds the
collectives in flight; here every one may start as soon as its operands are ready),
contention between the two streams for memory bandwidth, and several communication
streams.

References:
  XLA ``latency_hiding_scheduler.cc`` (async collectives scheduled to overlap independent
  compute); XLA ``async_collective_creator.cc`` (``<kind>-start`` / ``<kind>-done`` pairs
  on GPU); XLA ``collective_pipeliner.cc`` (collectives moved across loop iterations);
  NCCL user guide, "CUDA stream semantics" (a stream's operations run in issue order);
  XLA ``hlo_cost_analysis.cc`` (``HandleDot``, ``HandleConvolution``: 2 FLOPs per
    multiply-add);
  XLA ``cudnn_conv_rewriter`` (a convolution and its gradients as ``__cudnn$conv*``
    custom-calls carrying the forward convolution's ``dim_labels``).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardc.cost.streams import Overlap, next_collective
from shardc.inspect.hlotext import Computation, Instruction, leaves, parse_module, shape_tree
from shardc.inspect.loops import (
    _dims,
    _entry,
    called_flops,
    instruction_flops,
    multiplicity,
    trip_count,
)

if TYPE_CHECKING:
    from shardc.inspect.collective import HloCollective

__all__ = ["Overlap", "next_collective", "replay_flops", "schedule"]

Ready = float | tuple["Ready", ...]

_CALLS = re.compile(r"(?:calls|to_apply)=%?([^\s,}]+)")
_BODY = re.compile(r"\bbody=%?([^\s,}]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_GEMM = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul)[^"]*"', re.IGNORECASE)
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


def _latest(r: Ready) -> float:
    if isinstance(r, tuple):
        return max((_latest(x) for x in r), default=0.0)
    return r


def _result(comp: Computation) -> str | None:
    """The computation's result: its last instruction without users."""
    unused = [n for n in comp.instructions if not comp.users.get(n)]
    return unused[-1] if unused else None


def _gemm_flops(comp: Computation, instr: Instruction) -> float:
    """FLOPs of a library matmul custom-call from its ``dot_dimension_numbers``."""
    contract = _GEMM_CONTRACT.search(instr.attrs)
    src = comp.instructions.get(instr.operands[0]) if instr.operands else None
    if contract is None or src is None or not _GEMM.search(instr.attrs):
        return 0.0
    lhs = _dims(leaves(shape_tree(src.shape))[0]) or []
    out = _dims(leaves(shape_tree(instr.shape))[0]) or []
    dims = [int(d.strip().strip('"')) for d in contract.group(1).split(",") if d.strip()]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims if d < len(lhs))


_CUDNN = re.compile(r'custom_call_target="__cudnn\$conv(Forward|BiasActivationForward|'
                    r'BackwardInput|BackwardFilter)"')
_DIM_LABELS = re.compile(r"dim_labels=[^_\s]+_([^-\s]+)->")


def _conv_flops(comp: Computation, instr: Instruction) -> float:
    """FLOPs of a cuDNN convolution custom-call (XLA:GPU's ``__cudnn$conv*``): 2 per
    multiply-add of the forward convolution it computes or differentiates, ``2 x |forward
    output| x |kernel| / output features``. Its ``dim_labels`` are the forward
    convolution's; the forward output is the result of a forward call, the first operand
    of a backward-input one and the second of a backward-filter one, whose result is the
    kernel's gradient."""
    kind, labels = _CUDNN.search(instr.attrs), _DIM_LABELS.search(instr.attrs)
    if kind is None or labels is None or len(instr.operands) < 2:
        return 0.0

    def dims(name: str | None) -> list[int]:
        src = comp.instructions.get(name) if name else None
        return (_dims(leaves(shape_tree(src.shape))[0]) or []) if src is not None else []

    result = _dims(leaves(shape_tree(instr.shape))[0]) or []
    first, second = dims(instr.operands[0]), dims(instr.operands[1])
    out, kernel = {"BackwardInput": (first, second),
                   "BackwardFilter": (second, result)}.get(kind.group(1), (result, second))
    at = labels.group(1).find("o")
    if not out or not kernel or not 0 <= at < len(kernel) or not kernel[at]:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(kernel) / kernel[at]


class _Replay:
    """The two streams' clocks while a module is replayed (see the module docstring)."""

    def __init__(self, comps: dict[str, Computation], seconds: dict[str, dict[str, float]]):
        self.comps, self.seconds = comps, seconds
        self.memo: dict = {}  # loops.called_flops's
        self.weights: dict[tuple[str, str], float] = {}
        self.totals: dict[str, float] = {}
        self.first_use: dict[str, dict[str, int]] = {}
        self.scale = 0.0  # seconds per FLOP of weight
        self.compute = self.comm = 0.0  # when each stream is next free
        self.ran: Counter = Counter()  # (computation, instruction) -> collective runs

    def weight(self, comp: Computation, instr: Instruction) -> float:
        """FLOPs of an instruction on the compute stream (0: free)."""
        key = (comp.name, instr.name)
        if key not in self.weights:
            if instr.opcode.endswith(("-done", "-update")):  # waits, printed with calls=
                w = 0.0
            elif instr.opcode == "custom-call":
                w = _gemm_flops(comp, instr) or _conv_flops(comp, instr)
            else:
                w = instruction_flops(comp, instr) + called_flops(self.comps, instr, True,
                                                                  self.memo)
            self.weights[key] = w
        return self.weights[key]

    def collective(self, comp: Computation, instr: Instruction) -> dict | None:
        """The collectives an instruction runs, ``{(computation, name): seconds}`` (None:
        it runs none): itself, or those of the computation an ``async-start`` wraps."""
        if instr.opcode == "async-start":
            inner = _CALLS.search(instr.attrs)
            found = self.seconds.get(inner.group(1), {}) if inner else {}
            return {(inner.group(1), n): t for n, t in found.items()} or None
        t = self.seconds.get(comp.name, {}).get(instr.name)
        return None if t is None else {(comp.name, instr.name): t}

    def total(self, name: str) -> float:
        """Weight the replay of computation ``name`` puts on the compute stream."""
        if name not in self.totals:
            comp, out = self.comps.get(name), 0.0
            for instr in comp.instructions.values() if comp is not None else ():
                if instr.opcode == "while" and (body := _BODY.search(instr.attrs)):
                    out += (trip_count(instr) or 1) * self.total(body.group(1))
                elif instr.opcode == "call" and (callee := _CALLS.search(instr.attrs)):
                    out += self.total(callee.group(1))
                elif self.collective(comp, instr) is None:
                    out += self.weight(comp, instr)
            self.totals[name] = out
        return self.totals[name]

    def run(self, name: str, args: Sequence[Ready], floor: float) -> Ready:
        """Replay computation ``name`` on ``args`` (their ready times); its collectives
        start no earlier than ``floor``. Returns its result's ready time."""
        comp = self.comps.get(name)
        if comp is None:
            return 0.0
        frame = _Frame(comp, floor, self.deadlines(comp))
        for instr in comp.instructions.values():
            runs = self.collective(comp, instr)
            if runs is not None:
                frame.pending[instr.name] = runs
            else:
                frame.ready[instr.name] = self.step(comp, instr, frame, args)
        self.drain(frame)
        result = _result(comp)
        return frame.ready[result] if result is not None else 0.0

    def deadlines(self, comp: Computation) -> dict[str, int]:
        """Instruction -> text position of its first use that waits (a compute instruction,
        a collective, a loop or call; a free one passes the wait on to its own uses), or
        past the end when nothing waits for it."""
        if comp.name not in self.first_use:
            index = {n: i for i, n in enumerate(comp.instructions)}
            out: dict[str, int] = {}
            for instr in reversed(comp.instructions.values()):
                waits = [index[u] if self.waits(comp, comp.instructions[u]) else out[u]
                         for u in comp.users.get(instr.name, ())]
                out[instr.name] = min(waits, default=len(index))
            self.first_use[comp.name] = out
        return self.first_use[comp.name]

    def waits(self, comp: Computation, instr: Instruction) -> bool:
        return instr.opcode in ("while", "call") or self.weight(comp, instr) > 0 or \
            self.collective(comp, instr) is not None

    def read(self, frame: _Frame, name: str) -> Ready:
        """The ready time of ``name``, running the communication stream up to it first
        when it is a collective not yet run."""
        if name in frame.pending:
            self.drain(frame, name)
        return frame.ready.get(name, 0.0)

    def drain(self, frame: _Frame, until: str | None = None) -> None:
        """Run ``frame``'s collectives on the communication stream, the one needed first
        of those that can start (module docstring), until ``until`` has run (all: None)."""
        while frame.pending and (until is None or until in frame.pending):
            start: dict[str, float] = {}
            for name in frame.pending:
                ops = frame.comp.instructions[name].operands
                if not any(o in frame.pending for o in ops):
                    start[name] = max(frame.floor, _latest(tuple(frame.ready.get(o, 0.0)
                                                                for o in ops)))
            if not start:  # a cycle (none in valid HLO): charged serially, as never reached
                return
            pick = next_collective({n: (t, frame.deadline[n]) for n, t in start.items()},
                                   self.comm)
            runs = frame.pending.pop(pick)
            self.ran.update(runs.keys())
            self.comm = max(self.comm, start[pick]) + sum(runs.values())
            frame.ready[pick] = self.comm

    def step(self, comp: Computation, instr: Instruction, frame: _Frame,
             args: Sequence[Ready]) -> Ready:
        op = instr.opcode
        if op == "parameter":
            k = int(instr.operands[0]) if instr.operands and instr.operands[0].isdigit() else -1
            return args[k] if 0 <= k < len(args) else 0.0
        ins = [self.read(frame, o) for o in instr.operands]
        if op == "tuple":
            return tuple(ins)
        if op == "get-tuple-element":
            index = _INDEX.search(instr.attrs)
            whole = ins[0] if ins else 0.0
            k = int(index.group(1)) if index else -1
            return whole[k] if isinstance(whole, tuple) and 0 <= k < len(whole) else \
                _latest(whole)
        if op == "while" and (body := _BODY.search(instr.attrs)):
            state = ins[0] if ins else 0.0
            for _ in range(trip_count(instr) or 1):
                state = self.run(body.group(1), [state], floor=self.compute)
            return state
        if op == "call" and (callee := _CALLS.search(instr.attrs)):
            return self.run(callee.group(1), ins, frame.floor)
        operands_ready = _latest(tuple(ins))
        w = self.weight(comp, instr)
        if w == 0.0:
            return operands_ready
        self.compute = max(self.compute, operands_ready) + w * self.scale
        return self.compute


@dataclass
class _Frame:
    """One replay of a computation: ready times so far, its collectives not yet run, the
    time they may start from, and their deadlines (:meth:`_Replay.deadlines`)."""

    comp: Computation
    floor: float
    deadline: dict[str, int]
    ready: dict[str, Ready] = field(default_factory=dict)
    pending: dict[str, dict] = field(default_factory=dict)


def replay_flops(hlo_text: str, collectives: Sequence[HloCollective]) -> float:
    """Per-device FLOPs of the program in ``hlo_text`` as the replay weighs its compute
    (module docstring, "Costs"; loop bodies by trip count, ``collectives`` left out): the
    compute of a program whose ``cost_analysis()`` gives none (XLA:GPU's ahead-of-time
    compiles for devices this machine does not have)."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for c in collectives:
        per[c.computation][c.name] = 0.0
    return _Replay(parse_module(hlo_text), dict(per)).total(_entry(hlo_text))


def schedule(hlo_text: str, collectives: Sequence[HloCollective], seconds: Sequence[float],
             compute_time: float) -> Overlap:
    """The program in ``hlo_text`` replayed with its communication overlapped (module
    docstring). ``collectives`` are :func:`shardc.inspect.hlo.collectives` of the text,
    ``seconds`` each one's time per run (:func:`~shardc.inspect.hlo.collective_seconds`),
    ``compute_time`` the serial pricing's compute seconds, spread over the instructions by
    their FLOPs."""
    if len(seconds) != len(collectives):
        raise AssertionError(f"schedule: {len(seconds)} times for {len(collectives)} "
                             "collectives; give one time per collective, in the same order")
    comps = parse_module(hlo_text)
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for c, t in zip(collectives, seconds):  # a split all-reduce is one instruction
        per[c.computation][c.name] = per[c.computation].get(c.name, 0.0) + t
    replay = _Replay(comps, dict(per))
    entry = _entry(hlo_text)
    flops = replay.total(entry)
    replay.scale = compute_time / flops if flops > 0 else 0.0
    end = _latest(replay.run(entry, (), 0.0))
    end = max(end, replay.compute, replay.comm)
    runs = multiplicity(hlo_text)
    # seconds per collective: as replayed, or by the serial pricing's runs where never reached
    times = [t * (replay.ran[(c.computation, c.name)] or runs.get(c.computation, 1))
             for c, t in zip(collectives, seconds)]
    unreached = sum(t for c, t in zip(collectives, times)
                    if not replay.ran[(c.computation, c.name)])
    return Overlap(end + unreached + (compute_time if flops <= 0 else 0.0), compute_time,
                   sum(times))
