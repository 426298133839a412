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

from shardc.errors import ArgumentsError, DonatedArgumentError, SignatureError
from shardc.lower.control import typed_sharding
from shardc.util.axes import axis_tuple

try:  # how JAX names a traced function and its arguments in its errors
    from jax._src.api_util import debug_info as _debug_info
except ImportError:  # another JAX: its errors then name shardc's wrapper
    _debug_info = None

__all__ = ["Call", "Convention", "Dispatch", "Miss", "abstract_leaf", "check_live", "dispatch_key",
           "misplaced", "passed_placed", "place", "placement"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _ints(x: int | Iterable[int] | None) -> tuple[int, ...]:
    if x is None:
        return ()
    return (int(x),) if isinstance(x, int) else tuple(int(i) for i in x)


def _check_argnums(params: list[inspect.Parameter], nums: tuple[int, ...], what: str) -> None:
    """Refuse argnums past the function's positional parameters, as ``jax.jit`` does (any
    is fine for a function taking ``*args``)."""
    if not nums or any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    n = sum(p.kind in _POSITIONAL for p in params)
    if -min(nums) > n or max(nums) >= n:
        raise SignatureError(f"Jitted function has {what}_argnums={nums}, but only accepts {n} "
                             f"positional arguments; give {what}_argnums within "
                             f"range({-n}, {n}), or {what}_argnames by parameter name")


def _infer(sig: inspect.Signature | None, nums, names, what: str
           ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``*_argnums`` and ``*_argnames`` completed from each other through ``sig``, as
    ``jax.jit`` does: a parameter that can be passed either way is named by both."""
    nums, names = _ints(nums), axis_tuple(names)
    if sig is None:
        return nums, names
    params = list(sig.parameters.values())
    _check_argnums(params, nums, what)
    if names:
        unknown = [n for n in names if n not in sig.parameters]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
            raise SignatureError(f"{what}_argnames {unknown} are not parameters of the function "
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
            raise SignatureError(f"arguments {sorted(map(str, both))} are both static and "
                                 "donated; a static argument is not a buffer to donate")
        return cls(s_nums, s_names, d_nums, d_names)

    def dynamic(self, args: Sequence, kwargs: dict) -> tuple[tuple, tuple, dict]:
        """One call's static arguments ``((position, value), ...), ((name, value), ...)``
        and its dynamic positional and keyword arguments; cheap (no leaf is looked at)."""
        if not (self.static_argnums or self.static_argnames):
            return ((), ()), tuple(args), kwargs
        n = len(args)
        static_pos = sorted({i % n for i in self.static_argnums if -n <= i < n})
        statics = (tuple((i, args[i]) for i in static_pos),
                   tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return statics, dyn_args, dyn_kwargs

    def split(self, args: Sequence, kwargs: dict) -> Call:
        """Split one call's arguments into static and dynamic ones."""
        n = len(args)

        def position(i: int) -> int:  # a negative index counts from the end, as in jit
            return i % n if i < 0 else i

        statics, dyn_args, dyn_kwargs = self.dynamic(args, kwargs)
        static_pos = [i for i, _ in statics[0]]
        try:
            hash(statics)
        except TypeError as exc:
            raise ArgumentsError(f"static arguments must be hashable, as for jax.jit: {exc}; "
                                 "make them dynamic, or pass a hashable value (a tuple, not a "
                                 "list)") from exc
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

    def _full(self, leaves: Sequence) -> tuple[list, dict]:
        """The call's positional and keyword arguments, statics in place, with ``leaves``
        as the dynamic ones' leaves."""
        pos, kw = dict(self.statics[0]), dict(self.statics[1])
        dyn_args, dyn_kwargs = self.unflatten(leaves)
        it = iter(dyn_args)
        return [pos[i] if i in pos else next(it) for i in range(self.n_args)], \
            {**dyn_kwargs, **kw}

    def debug_info(self, fn: Callable):
        """What ``jax.jit(fn)`` would report tracing this call: ``fn``'s name, file and line,
        and the argument path of each dynamic leaf (``x``, ``state['w']``), named through
        ``fn``'s signature; None where this JAX has no such record."""
        if _debug_info is None:
            return None
        args, kwargs = self._full(self.leaves)
        return _debug_info("jit", fn, args, kwargs,
                           static_argnums=tuple(i for i, _ in self.statics[0]),
                           static_argnames=tuple(k for k, _ in self.statics[1]))

    def function(self, fn: Callable) -> Callable:
        """``fn`` as a function of this call's dynamic leaves (statics put back in place),
        that JAX's errors name as it would ``fn`` (its source line, the arguments' paths)."""

        def flat(*leaves):
            args, kwargs = self._full(leaves)
            return fn(*args, **kwargs)

        dbg = self.debug_info(fn)
        if dbg is not None:
            flat.__fun_debug_info__ = dbg  # read by JAX's tracing (api_util.debug_info)
        return flat

    def avals(self, fn: Callable) -> list[jax.core.ShapedArray]:
        """Each dynamic leaf's :func:`abstract_leaf`; a leaf that is not an array raises
        ``jax.jit``'s TypeError, naming its argument path and the fix."""
        out = []
        for k, x in enumerate(self.leaves):
            try:
                out.append(abstract_leaf(x))
            except TypeError:
                dbg = self.debug_info(fn)
                path = dbg.arg_names[k] if dbg is not None and dbg.arg_names else \
                    self.leaf_names()[k]
                raise ArgumentsError(
                    f"Error interpreting argument to {_short(fn)} as an abstract array. The "
                    f"problematic value is of type {type(x)} ({_short(x)}) and was passed to "
                    f"the function at path {path}.\nThis typically means that a jit-wrapped "
                    "function was called with a non-array argument, and this argument was not "
                    "marked as static using the static_argnums or static_argnames parameters "
                    "of shardc.auto_shard (as for jax.jit), or that its class is not a "
                    "registered pytree (jax.tree_util.register_dataclass)") from None
        return out


def _short(x, limit: int = 80) -> str:
    """``repr(x)`` cut to ``limit`` characters (an argument may hold large arrays)."""
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 5] + " ...>"


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
    """Whether ``have`` is the placement ``want``: the same devices and layout, and where
    ``want`` is a type (a mesh with Explicit axes), the same axis types (an untyped result
    of an earlier call, on the mesh's Auto view, is given the type a typed call wants:
    ``jax.jit`` refuses arguments on meshes of different axis types)."""
    if have == want:
        return True
    if not have.is_equivalent_to(want, ndim):
        return False
    types = getattr(getattr(have, "mesh", None), "axis_types", None)
    return not typed_sharding(want) or types == want.mesh.axis_types


def misplaced(leaves: Sequence, shardings: Sequence[NamedSharding]) -> list[int]:
    """Indices of the leaves given a placement (committed arrays, ``ShapeDtypeStruct``s with
    a sharding) other than the planned one."""
    return [k for k, (x, want) in enumerate(zip(leaves, shardings))
            if (have := placement(x)) is not None and not _same(have, want, len(x.shape))]


def place(leaves: Sequence, shardings: Sequence[NamedSharding]) -> list:
    """Arguments moved to the planned shardings where they were placed elsewhere (one
    transfer each). Anything unplaced (tracers, Python scalars, NumPy arrays, uncommitted
    arrays) is passed as it is: the executable's ``in_shardings`` place it, as ``jax.jit``'s
    do, and its type stays an unplaced one's, as under ``jax.jit``. Under several processes
    a NumPy argument (the same global value on every process) is placed here: ``jax.jit``
    refuses host arrays for shardings that span processes, and jobs fed NumPy batches
    ran before the executable placed them."""
    several = jax.process_count() > 1
    return [jax.device_put(x, want) if isinstance(x, jax.Array)
            and (have := placement(x)) is not None and not _same(have, want, x.ndim)
            or _placed_by_call(x, want, several)
            else x for x, want in zip(leaves, shardings)]


def passed_placed(x, want: NamedSharding) -> bool:
    """Whether a call passes leaf ``x`` to the executable placed (:func:`place`): given a
    placement, or placed by the call itself."""
    return placement(x) is not None or _placed_by_call(x, want, jax.process_count() > 1)


def _placed_by_call(x, want: NamedSharding, several: bool) -> bool:
    """Whether :func:`place` places an unplaced ``x`` itself: a NumPy array under
    ``several`` processes, or state the plan keeps in host memory."""
    return several and isinstance(x, np.ndarray) or _to_host(x, want)


def _to_host(x, want: NamedSharding) -> bool:
    """Whether ``x`` is an array the plan keeps in host memory that is not there yet
    (``jax.jit`` moves no argument between memory kinds: it refuses the call)."""
    return want.memory_kind == "pinned_host" and isinstance(x, jax.Array) and not \
        isinstance(x, jax.core.Tracer) and x.sharding.memory_kind != "pinned_host"


class Miss(Exception):  # noqa: N818 (a signal, not an error the user sees)
    """A call the fast path's executable was not made for: another shape, dtype or typed
    placement of an argument. The full path plans it."""


#: the starts of ``jax.jit``'s refusals of an argument its ``in_shardings`` do not fit: a
#: committed one placed elsewhere (the full path moves it and says so), one of another rank
_NOT_FITTING = ("Sharding passed to jit does not match", "One of pjit arguments")


def dispatch_key(statics: tuple, dyn_args: tuple, dyn_kwargs: dict) -> tuple:
    """What picks a call's :class:`Dispatch`: its statics and how many dynamic positional
    and which keyword arguments it has; cheap (no pytree is walked: the Dispatch's
    ``jax.jit`` checks the rest)."""
    return statics, len(dyn_args), tuple(sorted(dyn_kwargs)) if dyn_kwargs else ()


@dataclass(frozen=True)
class Dispatch:
    """One planned executable called through ``jax.jit``'s own C++ dispatch: ``jitted``
    (called like the function's dynamic arguments) under a ``jax.jit`` with the plan's
    ``in_shardings`` and the call's donations, its arguments positional (keyword ones after
    the positional, by name). JAX checks each call's argument types and placements itself:
    a call that matches the first costs what a ``jax.jit`` call does; one with other shapes,
    dtypes or typed placements retraces, which raises :class:`Miss`, and a committed
    argument placed elsewhere, or a pytree of another structure, raises ``jax.jit``'s
    ValueError, and a leaf that is no array its TypeError (:meth:`missed` tells these from
    the user's errors; the full path raises the latter in the user's words)."""

    jitted: Callable
    kw_names: tuple[str, ...]
    tree: Any  # the treedef of the dynamic arguments ((positional, ...), {keyword: ...})
    donated: tuple[int, ...] = ()  # the donated ones, positional then keyword by name

    @classmethod
    def of(cls, jitted: Callable, call: Call, shardings: Sequence[NamedSharding],
           out_shardings: Any) -> Dispatch:
        dyn_args, dyn_kwargs = call.unflatten(shardings)
        kw_names = tuple(sorted(dyn_kwargs))
        n = len(dyn_args)
        donate = (*call.donate_argnums, *(n + kw_names.index(k) for k in call.donate_argnames))
        first: list = []  # the argument types of the first trace, the planned ones

        def positional(*xs):
            types = [_type(x) for x in jax.tree.leaves(xs)]
            if not first:
                first.append(types)
            elif types != first[0]:
                raise Miss
            return jitted(*xs[:n], **dict(zip(kw_names, xs[n:])))

        in_shardings = (*dyn_args, *(dyn_kwargs[k] for k in kw_names))
        return cls(jax.jit(positional, in_shardings=in_shardings, out_shardings=out_shardings,
                           donate_argnums=donate), kw_names, call.tree, donate)

    def __call__(self, dyn_args: Sequence, dyn_kwargs: dict):
        xs = (*dyn_args, *(dyn_kwargs[k] for k in self.kw_names))
        if self.donated:  # a deleted buffer crashes a multi-device execute on CPU
            check_live(xs, self.donated, len(dyn_args), self.kw_names)
        return self.jitted(*xs)

    def missed(self, exc: Exception, dyn_args: Sequence, dyn_kwargs: dict) -> bool:
        """Whether ``exc``, raised calling this Dispatch with these arguments, means the call
        is one its executable was not made for (the full path handles it), not the user's
        error."""
        if isinstance(exc, Miss | TypeError):  # TypeError: a leaf that is no array
            return True
        return isinstance(exc, ValueError) and (
            str(exc).startswith(_NOT_FITTING)
            or jax.tree.structure((tuple(dyn_args), dyn_kwargs)) != self.tree)


def check_live(xs: Sequence, donated: Sequence[int], n_args: int,
               kw_names: Sequence[str]) -> None:
    """Refuse a call whose donated arguments hold an array an earlier call donated.

    Args:
        xs: the dynamic arguments, positional then keyword (in ``kw_names`` order).
        donated: the indices in ``xs`` of the donated ones.
        n_args: how many of ``xs`` are positional.
        kw_names: the keyword ones' names.

    Raises:
        DonatedArgumentError: naming the argument leaf whose buffer is deleted, as
            ``jax.jit`` does ("Buffer has been deleted or donated"), and the fix.
    """
    for i in donated:
        for x in jax.tree.leaves(xs[i]):
            try:
                if not x.is_deleted():
                    continue
            except AttributeError:  # not an array: jax.jit's own checks name it
                continue
            where = f"args[{i}]" if i < n_args else f"kwargs[{kw_names[i - n_args]!r}]"
            path = next(jax.tree_util.keystr(p) for p, leaf in
                        jax.tree_util.tree_flatten_with_path(xs[i])[0] if leaf is x)
            raise DonatedArgumentError(
                f"Buffer has been deleted or donated: the dynamic argument {where}{path} "
                f"({x.dtype}{list(x.shape)}) was donated (donate_argnums / donate_argnames) "
                "to an earlier call, which deleted it. Pass that call's result instead (new "
                "state = step(state)), or leave the argument out of donate_argnums")


def _type(x) -> tuple:
    """What a plan is made for of one traced argument: its shape, dtype and weak type, and
    its sharding where that is part of its type (Explicit mesh axes)."""
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    return aval.shape, aval.dtype, aval.weak_type, \
        sharding.spec if typed_sharding(sharding) else None
