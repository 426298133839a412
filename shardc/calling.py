"""``jax.jit``'s calling convention, for ``auto_shard``: static and donated arguments by
position (negative too) or by name, keyword arguments, weak-typed Python scalars, and
arguments that already have a placement.

A call is split the way ``jax.jit`` splits it: static arguments (hashable, part of the
cache key, baked into the traced program) and dynamic ones, positional and keyword, whose
leaves are what the plan places. The abstract value of a leaf keeps its weak type, so
``x.astype(bf16) * 2.0`` stays ``bfloat16`` as under ``jax.jit``.

References:
  JAX ``jax.jit`` documentation (``static_argnums`` / ``static_argnames`` /
  ``donate_argnums`` / ``donate_argnames``, and how each is inferred from the other through
  the function's signature; negative ``static_argnums`` count from the end of the call's
  positional arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

__all__ = ["Call", "Convention", "abstract_leaf", "misplaced", "place", "placement"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _ints(x: int | Iterable[int] | None) -> tuple[int, ...]:
    if x is None:
        return ()
    return (int(x),) if isinstance(x, int) else tuple(int(i) for i in x)


def _names(x: str | Iterable[str] | None) -> tuple[str, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, str) else tuple(x)


def _infer(sig: inspect.Signature | None, nums, names, what: str
           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``*_argnums`` and ``*_argnames`` completed from each other through ``sig``, as
    ``jax.jit`` does: a parameter that can be passed either way is named by both."""
    nums, names = _ints(nums), _names(names)
    if sig is None:
        return nums, names
    params = list(sig.parameters.values())
    if names:
        unknown = [n for n in names if n not in sig.parameters]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
            raise ValueError(f"{what}_argnames {unknown} are not parameters of the function "
                             f"(it takes {list(sig.parameters)})")
    pos_kw = [(i, p.name) for i, p in enumerate(params)
              if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    names = tuple(dict.fromkeys((*names, *(n for i, n in pos_kw if i in nums))))
    nums = tuple(dict.fromkeys((*nums, *(i for i, n in pos_kw if n in names))))
    return nums, names


@dataclass(frozen=True)
class Convention:
    """How ``fn`` is called: which arguments are static, which donated."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()

    @classmethod
    def of(cls, fn: Callable, *, static_argnums=None, static_argnames=None,
           donate_argnums=None, donate_argnames=None) -> Convention:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins may have none: no inference, like jit
            sig = None
        s_nums, s_names = _infer(sig, static_argnums, static_argnames, "static")
        d_nums, d_names = _infer(sig, donate_argnums, donate_argnames, "donate")
        both = set(s_names) & set(d_names) | set(i for i in s_nums if i >= 0) & set(d_nums)
        if both:
            raise ValueError(f"arguments {sorted(map(str, both))} are both static and "
                             "donated; a static argument is not a buffer to donate")
        return cls(s_nums, s_names, d_nums, d_names)

    def split(self, args: Sequence, kwargs: dict) -> Call:
        """Split one call's arguments into static and dynamic ones."""
        n = len(args)

        def position(i: int) -> int:  # a negative index counts from the end, as in jit
            return i % n if i < 0 else i

        static_pos = sorted({position(i) for i in self.static_argnums if -n <= i < n})
        statics = (tuple((i, args[i]) for i in static_pos),
                   tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
        try:
            hash(statics)
        except TypeError as exc:
            raise TypeError(f"static arguments must be hashable, as for jax.jit: {exc}; "
                            "make them dynamic, or pass a hashable value (a tuple, not a "
                            "list)") from exc
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        donated = {position(i) for i in self.donate_argnums if -n <= i < n}
        donate_pos = tuple(sorted(i - sum(1 for j in static_pos if j < i)
                                  for i in donated if i not in static_pos))
        donate_kw = tuple(k for k in dyn_kwargs if k in self.donate_argnames)
        leaves, tree = jax.tree.flatten((dyn_args, dyn_kwargs))
        return Call(statics, n, leaves, tree, donate_pos, donate_kw)


@dataclass(frozen=True)
class Call:
    """One call's arguments as ``jax.jit`` sees them: the static ones (hashable), and the
    leaves of the dynamic ones, ``((positional, ...), {keyword: ...})`` flattened."""

    statics: tuple  # ((position, value), ...), ((name, value), ...)
    n_args: int  # positional arguments, static ones included
    leaves: list = field(compare=False)
    tree: Any = None  # the treedef of ((dynamic positional), {dynamic keyword})
    donate_argnums: tuple[int, ...] = ()  # among the dynamic positional arguments
    donate_argnames: tuple[str, ...] = ()

    def arg_trees(self) -> list:
        """One treedef per dynamic argument: positional ones, then keyword ones by name."""
        pos, kw = self.tree.children()
        return [*pos.children(), *kw.children()]

    def leaf_names(self) -> list[str]:
        """How the user names each leaf: ``args[0]['params']['w']``, ``kwargs['x']``."""
        paths = jax.tree_util.tree_flatten_with_path(self.unflatten(self.leaves))[0]
        return [("args" if p[0].idx == 0 else "kwargs") + jax.tree_util.keystr(p[1:])
                for p, _ in paths]

    def unflatten(self, leaves: Sequence) -> tuple[tuple, dict]:
        return jax.tree.unflatten(self.tree, list(leaves))

    def function(self, fn: Callable) -> Callable:
        """``fn`` as a function of this call's dynamic leaves (statics put back in place)."""
        pos, kw = dict(self.statics[0]), dict(self.statics[1])

        def flat(*leaves):
            dyn_args, dyn_kwargs = self.unflatten(leaves)
            it = iter(dyn_args)
            full = [pos[i] if i in pos else next(it) for i in range(self.n_args)]
            return fn(*full, **dyn_kwargs, **kw)

        return flat


def abstract_leaf(x) -> jax.core.ShapedArray:
    """Shape, dtype and weak type of an argument leaf (an array, a tracer, a Python scalar
    or a ``ShapeDtypeStruct``), without its placement."""
    aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    weak = bool(getattr(aval, "weak_type", False))
    return jax.core.ShapedArray(tuple(aval.shape), aval.dtype, weak_type=weak)


def placement(x) -> jax.sharding.Sharding | None:
    """The sharding an argument leaf was given (a committed array, or a
    ``ShapeDtypeStruct`` with one); None for anything else (it goes where the plan says)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed:
        return x.sharding
    return None


def _same(have: jax.sharding.Sharding, want: NamedSharding, ndim: int) -> bool:
    return have == want or have.is_equivalent_to(want, ndim)


def misplaced(leaves: Sequence, shardings: Sequence[NamedSharding]) -> list[int]:
    """Indices of the leaves given a placement (committed arrays, ``ShapeDtypeStruct``s with
    a sharding) other than the planned one."""
    return [k for k, (x, want) in enumerate(zip(leaves, shardings))
            if (have := placement(x)) is not None and not _same(have, want, len(x.shape))]


def place(leaves: Sequence, shardings: Sequence[NamedSharding]) -> list:
    """Arguments moved to the planned shardings where they are elsewhere (one transfer
    each). Tracers, Python scalars, ``ShapeDtypeStruct``s and arrays already in place are
    passed as they are."""
    out = []
    for x, want in zip(leaves, shardings):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if not _same(x.sharding, want, x.ndim):
                x = jax.device_put(x, want)
        elif isinstance(x, np.ndarray):
            x = jax.device_put(x, want)
        out.append(x)
    return out
