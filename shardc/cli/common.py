"""What the ``shardc`` commands share: the ``--mesh`` / ``--axes`` / ``--cluster`` parsers,
meshes abstract and real, the zoo models and the user's programs, a saved plan's loading,
progress lines and ``show``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

__all__ = ["PRESETS", "ZOO", "abstract_mesh", "axes_for", "axis_names", "cluster_of",
           "device_mesh", "load_plan", "load_program", "mesh_shape", "needs_zoo",
           "planned_step", "positive", "progress_logger", "show"]


def mesh_shape(text: str) -> tuple[int, ...]:
    """``--mesh``: ``8``, ``2x4``, ``2x2x2`` (an argparse type: a bad value is one line)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape; write sizes joined "
                                         "by x, e.g. 8 or 2x4")
    return shape


def axis_names(text: str) -> tuple[str, ...]:
    """``--axes``: comma-separated, distinct, non-empty names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct axis names separated by "
                                         "commas, e.g. node,gpu")
    return names


def positive(kind, zero: bool = False):
    """An argparse type: a ``kind`` above 0 (``zero``: at least 0)."""
    word = "non-negative" if zero else "positive"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not (v >= 0 if zero else v > 0):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {word} {kind.__name__}")
        return v
    parse.__name__ = f"{word} {kind.__name__}"
    return parse


def abstract_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """The mesh ``shape`` with Auto axes ``names`` and no devices: planning needs neither
    the devices nor their number."""
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    import jax
    from jax.sharding import AxisType

    n = 1
    for s in shape:
        n *= s
    if len(jax.devices()) < n:
        sys.exit(f"shardc: mesh {shape} needs {n} devices but JAX sees {len(jax.devices())}; "
                 f"pass --devices {n}")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


ZOO = ("gpt", "mlp")


PRESETS = ("default", "nvlink-node", "multi-node", "multi-pod", "tpu-v4")


def cluster_of(text: str | None, names: tuple[str, ...], cmd: str = "plan"):
    """``--cluster``: a preset's name (its axes are the mesh's) or a JSON file as
    ``Cluster.to_json`` writes it; None: NDR InfiniBand over the first of two axes and
    NVLink within; on three axes pods, nodes and GPUs (``multi-pod``); else NVLink on every
    axis."""
    from shardc.cost.cluster import Cluster

    if text is None:
        text = {2: "multi-node", 3: "multi-pod"}.get(len(names), "nvlink-node")
    preset = text.replace("_", "-")
    for name, rank, axes in (("multi-node", 2, "node, gpu"), ("multi-pod", 3, "pod, node, gpu")):
        if preset == name and len(names) != rank:
            sys.exit(f"shardc {cmd}: --cluster {name} needs a {rank}-axis mesh ({axes}); this "
                     f"one has {len(names)} axes")
    if preset in PRESETS:
        return {"default": lambda: Cluster(), "nvlink-node": lambda: Cluster.nvlink_node(names),
                "multi-node": lambda: Cluster.multi_node(*names),
                "multi-pod": lambda: Cluster.multi_pod(*names),
                "tpu-v4": lambda: Cluster.tpu_v4(names)}[preset]()
    if not os.path.isfile(text):
        sys.exit(f"shardc {cmd}: --cluster {text!r} is neither a preset ({', '.join(PRESETS)}) "
                 "nor a JSON file")

    try:
        with open(text) as f:
            cluster = Cluster.from_json(json.load(f))
        cluster.check_axes(names)
    except (ValueError, TypeError) as exc:
        sys.exit(f"shardc {cmd}: --cluster {text}: {str(exc).splitlines()[0]} (write it as "
                 "Cluster.to_json() does)")
    return cluster


def load_program(spec: str, cmd: str):
    from shardc.step.program import ProgramError, load_program

    try:
        return load_program(spec)
    except ProgramError as exc:
        sys.exit(f"shardc {cmd}: {exc}")


def needs_zoo(cmd: str) -> None:
    """The model zoo (Flax, Optax) and the bench's tools come with the ``bench`` extra."""
    import importlib.util

    missing = [m for m in ("flax", "optax", "rich", "matplotlib")
               if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"shardc {cmd}: needs {', '.join(missing)} (the model zoo and the bench): "
                 "pip install 'shardc[bench]'")


def _model(name: str, layers: int | None, tiny: bool):
    needs_zoo("plan")
    if name == "gpt":
        from shardc.models import gpt

        cfg = gpt.GPTConfig.tiny() if tiny else gpt.GPTConfig.gpt2_small(n_layers=layers or 12)
        if tiny and layers:
            cfg = gpt.GPTConfig(**{**cfg.__dict__, "n_layers": layers})
        return gpt, cfg
    if name == "mlp":
        from shardc.models import mlp

        return mlp, mlp.MLPConfig.tiny()
    sys.exit(f"shardc plan: unknown model {name!r}; choose gpt or mlp")


@contextlib.contextmanager
def progress_logger():
    """shardc's INFO lines (what a long search is doing: each frontier plan, a budget that
    binds) printed on stderr while the command runs."""
    logger = logging.getLogger("shardc")
    handler, level = logging.StreamHandler(sys.stderr), logger.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def planned_step(args, cmd: str):
    """``(auto_shard step, abstract args)`` for ``shardc plan`` / ``pareto``: a zoo model or
    the user's program, on an AbstractMesh (planning needs no devices: any size plans)."""
    shape = args.mesh
    is_zoo = args.target in ZOO
    if not is_zoo and ":" not in args.target:
        sys.exit(f"shardc {cmd}: {args.target!r} is neither a zoo model ({', '.join(ZOO)}) "
                 "nor a program; write path/to/file.py:make or pkg.module:make, where make() "
                 "returns (fn, args)")
    if not is_zoo and (args.layers or args.tiny):
        sys.exit(f"shardc {cmd}: --layers and --tiny size the zoo models; a program's make() "
                 "sizes its own")
    import shardc

    names = axes_for(cmd, shape, args.axes)
    cluster = cluster_of(args.cluster, names, cmd)
    mesh = abstract_mesh(shape, names)
    if is_zoo:
        module, cfg = _model(args.target, args.layers, args.tiny)
        fn, abstract = module.build_step(cfg), module.abstract_args(cfg)
    else:
        program = load_program(args.target, cmd)
        fn, abstract = program.fn, program.args
    step = shardc.auto_shard(fn, mesh=mesh, cluster=cluster, time_limit=args.time_limit,
                             mesh_search=args.mesh_search)
    return step, abstract


def show(report, plain: bool = False) -> None:
    """Print a :class:`shardc.util.tables.Report`: rich tables on a terminal when rich is
    installed (the ``bench`` extra), else (or with ``plain``, or into a pipe) plain text."""
    import importlib.util

    if plain or not sys.stdout.isatty() or importlib.util.find_spec("rich") is None:
        print(report)
        return
    from rich.console import Console

    Console().print(report)


def axes_for(cmd: str, shape: tuple[int, ...], names: tuple[str, ...] | None):
    default = ("pod", "node", "gpu")[-len(shape):] if len(shape) <= 3 else tuple(
        f"a{i}" for i in range(len(shape)))
    names = names or default
    if len(names) != len(shape):
        sys.exit(f"shardc {cmd}: --axes names {len(names)} axes but --mesh has {len(shape)}")
    return names


def load_plan(path: str, cmd: str):
    from shardc.plan.codec import PlanFormatError
    from shardc.plan.record import Plan

    try:
        with open(path) as f:
            return Plan.from_json(f.read())
    except OSError as exc:
        sys.exit(f"shardc {cmd}: {path}: {exc.strerror}")
    except PlanFormatError as exc:
        sys.exit(f"shardc {cmd}: {path}: {exc}")
