"""The text of the module :func:`shardc.report.export.python_module` writes: a
``str.format`` template (literal braces doubled) whose fields are the plan's parts, the
header's facts (``origin``, ``mesh``, ``fingerprint``, ``step_ms``, ``placed``), its
tables (``mesh_axes``, ``pipeline``, ``inputs``, ``outputs``, ``constraints``) and the
``_stacks`` function (``stacks``)."""

__all__ = ["MODULE"]

MODULE = '''"""Sharding plan{origin}, exported by shardc: run it with plain jax.jit.

Mesh {mesh}; program fingerprint {fingerprint}; predicted step
{step_ms:.4f} ms on the plan's cluster. Nothing here imports shardc,
but for a plan with a pipeline (``PIPELINE``), whose program's layer stacks are
``shardc.pipeline.layers``: ``constrained`` runs them as that pipeline.

Arguments are the program's positional arguments, flattened as ``jax.tree.leaves(args)``
(dict keys sorted, as JAX flattens them): leaf k gets ``INPUTS[k]``'s PartitionSpec.
Results are flattened likewise (``OUTPUTS``). Use::

    import this_module as plan
    step = plan.jit(train_step)          # jax.jit(train_step) with the plan's shardings
    new_state, loss = step(state, batch)

or build the shardings yourself: ``in_shardings(mesh)`` / ``out_shardings(mesh)`` are flat
lists, ``jitted(fn, *args)`` is the ``jax.jit`` object for arguments shaped like ``args``.

Inside the function, ``constrained(fn, mesh)`` (the default of ``jit`` / ``jitted``) places
the plan's ``with_sharding_constraint``s: it traces ``fn`` to its jaxpr and binds the
equations again one by one, pinning the inputs and outputs ``CONSTRAINTS`` lists (by the
equation's place: its index, after those of the ``jit`` calls around it), as shardc's own
lowering does. What this plain interpreter cannot place is left to XLA's propagation, so
the compiled program can differ from shardc's there (compare with ``shardc explain
plan.json --compile``):
- inside ``scan`` / ``while`` / ``cond`` bodies and inside remat, ``custom_jvp`` and
  ``custom_vjp`` calls, which are bound whole (inlining them would change how the program
  differentiates or recomputes); only inner ``jit`` calls are inlined;
- the intermediate steps of a result's conversion (``out_shardings`` pins its last layout);
- partial sums (JAX cannot spell them on Auto axes; shardc's lowering leaves them too).
An equation whose primitive is not the plan's raises: not the program the plan was made
for. ``constraints=False`` pins the ends only.
{placed}"""

import functools
import math

import jax
import numpy as np
from jax.extend.core import Literal
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = {mesh_axes!r}

#: the pipeline the program's layer stacks (shardc.pipeline.layers) run as; None: none
PIPELINE = {pipeline!r}

#: (name, shape, PartitionSpec) per leaf of the positional arguments, in jax.tree.leaves order
INPUTS = (
{inputs}
)

#: (name, shape, PartitionSpec) per leaf of the results, in jax.tree.leaves order
OUTPUTS = (
{outputs}
)

#: per equation (its place: equation indices, outermost jit call first): its primitive,
#: {{input index: PartitionSpecs it is pinned to in turn}}, and per output the same
{constraints}

#: the calls whose bodies are inlined (and constrained); other calls are bound whole
_INLINED = {{"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
            "core_call": "call_jaxpr"}}


def _pin(x, specs, mesh):
    for spec in specs:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return x


{stacks}

def _run(jaxpr, consts, args, where, mesh, stacks=None):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    for i, eqn in enumerate(jaxpr.eqns):
        place, name = (*where, i), eqn.primitive.name
        ins = [read(a) for a in eqn.invars]
        entry = CONSTRAINTS.get(place)
        if entry is not None:
            if entry[0] != name:
                raise TypeError(f"equation {{place}} is {{name}}, the plan's {{entry[0]}}: "
                                "not the program the plan was made for")
            for k, specs in entry[1].items():
                ins[k] = _pin(ins[k], specs, mesh)
        outs = stacks.call(eqn, None, ins) if stacks is not None else None
        if outs is None and name in _INLINED:
            sub = eqn.params[_INLINED[name]]
            body, body_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
            outs = _run(body, body_consts, ins[len(ins) - len(body.invars):], place, mesh,
                        stacks)
        elif outs is None:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            if entry is not None:
                outs = [_pin(x, specs, mesh) for x, specs in zip(outs, entry[2])]
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [read(a) for a in jaxpr.outvars]


def constrained(fn, mesh: Mesh):
    """``fn`` (positional arguments) with the plan's constraints placed inside it."""

    def bare(x):  # traced as the plan was: the layouts inside jit are not the program's
        aval = jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    @functools.wraps(fn)
    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*jax.tree.map(bare, args))
        leaves = [_pin(x, ARGUMENTS.get(k, ()), mesh)
                  for k, x in enumerate(jax.tree.leaves(args))]
        stacks = _stacks(mesh)
        outs = _run(closed.jaxpr, closed.consts, leaves, (), mesh, stacks)
        if stacks is not None:
            stacks.check_used()
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def make_mesh(devices=None) -> Mesh:
    """The plan's mesh (Auto axes) over ``devices``, row-major; default: the first
    devices of ``jax.devices()``."""
    shape = tuple(size for _, size in MESH_AXES)
    names = tuple(name for name, _ in MESH_AXES)
    n = math.prod(shape)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"the plan's mesh {{dict(MESH_AXES)}} needs {{n}} devices, "
                         f"{{len(devices)}} given")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(shape))


def in_shardings(mesh: Mesh) -> list:
    """A NamedSharding per argument leaf, in ``jax.tree.leaves(args)`` order."""
    return [NamedSharding(mesh, spec) for _, _, spec in INPUTS]


def out_shardings(mesh: Mesh) -> list:
    """A NamedSharding per result leaf, in ``jax.tree.leaves(results)`` order."""
    return [NamedSharding(mesh, spec) for _, _, spec in OUTPUTS]


def _check(leaves, table, what: str) -> None:
    if len(leaves) != len(table):
        raise TypeError(f"the plan has {{len(table)}} {{what}} leaves, these have "
                        f"{{len(leaves)}}: not the program the plan was made for")
    for x, (name, shape, _) in zip(leaves, table):
        have = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        if shape is not None and have != shape:
            raise TypeError(f"{{what}} {{name}} has shape {{have}}, the plan's {{shape}}: "
                            "not the program the plan was made for")


def jitted(fn, *args, mesh: Mesh | None = None, constraints: bool = True, **jit_kwargs):
    """``jax.jit(fn, in_shardings=..., out_shardings=...)`` for positional arguments
    shaped like ``args`` (arrays or ShapeDtypeStructs): the flat shardings unflattened
    into the pytrees of ``args`` and of ``fn``'s results; with ``constraints``, of
    ``constrained(fn, mesh)``."""
    mesh = make_mesh() if mesh is None else mesh
    leaves, tree = jax.tree.flatten(args)
    _check(leaves, INPUTS, "argument")
    out_leaves, out_tree = jax.tree.flatten(jax.eval_shape(fn, *args))
    _check(out_leaves, OUTPUTS, "result")
    return jax.jit(constrained(fn, mesh) if constraints else fn,
                   in_shardings=jax.tree.unflatten(tree, in_shardings(mesh)),
                   out_shardings=jax.tree.unflatten(out_tree, out_shardings(mesh)),
                   **jit_kwargs)


def jit(fn, mesh: Mesh | None = None, constraints: bool = True, **jit_kwargs):
    """``fn`` under ``jax.jit`` with the plan's shardings, called like ``fn`` (positional
    arguments); arguments are placed on the plan's layouts first. ``.lower(*args)`` and
    ``.jitted(*args)`` give the lowered program and the ``jax.jit`` object."""
    mesh = make_mesh() if mesh is None else mesh
    cache = {{}}

    def get(args):
        tree = jax.tree.structure(args)
        if tree not in cache:
            cache[tree] = jitted(fn, *args, mesh=mesh, constraints=constraints,
                                 **jit_kwargs)
        return cache[tree]

    @functools.wraps(fn)
    def call(*args):
        placed = jax.device_put(args, jax.tree.unflatten(jax.tree.structure(args),
                                                         in_shardings(mesh)))
        return get(args)(*placed)

    call.lower = lambda *args: get(args).lower(*args)
    call.jitted = lambda *args: get(args)
    return call
'''
