"""What shardc knows about JAX primitives, in one table keyed by primitive name.

Each layer reads its facts from here instead of keeping a list of its own: the trace (which
primitives are calls whose body it inlines for planning, and which param holds the body),
the rules (elementwise families, which ops pass a partial value through, which pin a
layout the user chose), the cost model (which ops do no cross-element work, so a collective
before them could as well run after them) and the lowering.

A primitive missing from the table has the defaults: an ordinary op, planned by its rule.
Whether an op has side effects is not a fact of its name: the trace reads it off each
equation (``eqn.effects``), so a loop or branch holding a callback counts too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BINARY", "CALLS", "DEFAULT", "DRAWS", "facts", "FIXED", "KERNEL", "LINEAR_UNARY",
           "PASSES_PARTIAL", "passes_partial", "PER_DEVICE", "Prim", "PRIMS",
           "SPLITS_FROM_OPERANDS", "TAIL", "UNARY"]


@dataclass(frozen=True, slots=True)
class Prim:
    """Facts about one primitive (every field defaults to "an ordinary op")."""

    #: the param holding the body of a call-like primitive: the planner sees the body
    #: inlined, the lowering keeps the call (remat policy, custom derivative rules, the
    #: inner jit) and places the plan's constraints inside that body
    call: str | None = None
    #: elementwise: its output layout is one of its operands' (the solver lets it follow any
    #: operand); the rules in ``rules/elementwise.py`` are registered for these
    elementwise: bool = False
    #: a linear elementwise op: P -> P is exact
    linear: bool = False
    #: a pure layout change that may pass a partial value through (P -> P) even where plans
    #: do not consume partial values: it moves the same bytes before or after the reduction
    passes_partial: bool = False
    #: no cross-element work: a collective on its input could as well run on its output
    #: (the optimizer tail of a train step is made of these; see ``cost/combine.py``)
    tail: bool = False
    #: pins a layout the user wrote (``with_sharding_constraint``, a ``shard_map`` region):
    #: planned with exactly that layout (``rules/fixed.py``)
    fixed: bool = False
    #: its rule splits an output only along a mesh axis that splits an operand (a dot's batch
    #: and free dims, a reduction's kept dims): with no partial value in or out, XLA's
    #: partitioner derives the output layout from the operands' (``lower/emit.py``)
    splits_from_operands: bool = False
    #: XLA's partitioner does not split it along the dims its rule splits (an ``fft`` over
    #: batch dims: XLA partitions only a split last dim and otherwise gathers the operand,
    #: transforms it whole and slices): the lowering runs it per device (``shard_map``) on
    #: its planned layouts
    per_device: bool = False
    #: draws random bits: a layer stack that does is not run as a pipeline, which traces its
    #: layer again per micro-batch (a key from Python state, Flax's ``make_rng``, differs
    #: between traces: ``shardc.pipeline.fit.mixes_examples``)
    draws: bool = False
    #: runs as a library kernel of its own (a GEMM or a convolution), never fused: XLA:GPU's
    #: latency-hiding scheduler places a few such kernels under each asynchronous collective
    #: (``plan/overlap.py``)
    kernel: bool = False


DEFAULT = Prim()

UNARY = (
    "neg exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan sinh cosh asinh "
    "acosh atanh sqrt rsqrt cbrt abs sign floor ceil round is_finite not erf erfc erf_inv "
    "integer_pow square lgamma digamma population_count clz imag real conj copy copy_p "
    "reduce_precision convert_element_type stop_gradient"
).split()
BINARY = (
    "add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge "
    "shift_left shift_right_logical shift_right_arithmetic add_any select_n clamp complex"
).split()
LINEAR_UNARY = ("neg copy copy_p reduce_precision real imag conj stop_gradient "
                "convert_element_type").split()
#: elementwise and layout ops with no cross-element work (see :attr:`Prim.tail`)
TAIL = (
    "add sub mul div neg max min pow sqrt rsqrt abs sign exp log integer_pow square select_n "
    "convert_element_type broadcast_in_dim reshape transpose squeeze expand_dims copy copy_p "
    "eq ne lt le gt ge and or not is_finite add_any tanh logistic clamp name "
    "optimization_barrier scan_exit pad"
).split()
PASSES_PARTIAL = ("transpose reshape squeeze expand_dims copy copy_p rev name "
                  "optimization_barrier").split()
#: call-like primitives and the param holding their body
CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
    "remat2": "jaxpr",
}
FIXED = ("sharding_constraint", "shard_map")
SPLITS_FROM_OPERANDS = "dot_general reduce_sum reduce_max reduce_min argmax argmin".split()
PER_DEVICE = ("fft",)
#: primitives that draw random bits (see :attr:`Prim.draws`)
DRAWS = "random_bits threefry2x32 rng_bit_generator rng_uniform".split()
KERNEL = ("dot_general", "conv_general_dilated")


def _table() -> dict[str, Prim]:
    names = {*UNARY, *BINARY, *TAIL, *PASSES_PARTIAL, *CALLS, *FIXED, *SPLITS_FROM_OPERANDS,
             *PER_DEVICE, *KERNEL, *DRAWS}
    return {n: Prim(call=CALLS.get(n), elementwise=n in UNARY or n in BINARY,
                    linear=n in LINEAR_UNARY, passes_partial=n in PASSES_PARTIAL,
                    tail=n in TAIL, fixed=n in FIXED,
                    splits_from_operands=n in SPLITS_FROM_OPERANDS,
                    per_device=n in PER_DEVICE, kernel=n in KERNEL, draws=n in DRAWS)
            for n in sorted(names)}


PRIMS: dict[str, Prim] = _table()


def facts(name: str) -> Prim:
    """The facts of primitive ``name`` (:data:`DEFAULT` for one the table does not list)."""
    return PRIMS.get(name, DEFAULT)


def passes_partial(op) -> bool:
    """``op`` passes a partial value through (P -> P) as a layout change does: a primitive
    whose fact says so, or a sum over dims of size 1 only (jax's transpose of a broadcast
    that added them), which is a reshape."""
    if facts(op.name).passes_partial:
        return True
    if op.name != "reduce_sum":
        return False
    shape = op.inputs[0].shape
    return all(shape[a % len(shape)] == 1 for a in op.params["axes"])
