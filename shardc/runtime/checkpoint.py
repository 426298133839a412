"""Checkpoints of a sharded train state and its plan, that restore onto another mesh.

A thin layer over Orbax's ``CheckpointManager`` (``orbax-checkpoint``, the ``train``
extra): each saved step is one directory holding the state (Orbax's standard pytree
format: every process writes its own shards) and the plan it was trained with (JSON).
Saves are asynchronous (``save`` returns once the arrays are copied off the devices; the
files are written in the background) and atomic (Orbax writes a temporary directory and
renames it when every file is in place, so a crash mid-save leaves no step that
:meth:`Checkpoints.latest_step` returns).

Restoring reads each device's shard of each array straight into the shardings asked for
(``ShapeDtypeStruct``s carrying ``NamedSharding``s: the new plan's, from
``step.input_shardings(...)``), on whatever mesh they name: another device count or mesh
shape than the one saved from. No array is gathered whole on one device or host.

    ckpt = Checkpoints("/ckpt")
    step = shardc.auto_shard(train_step, mesh=mesh)
    state_sh, _ = step.input_shardings(abstract_state, abstract_batch)[0]
    start = ckpt.latest_step()
    state = ckpt.restore(abstract_state, state_sh) if start is not None else init()
    for i in range((start or 0) + 1, n + 1):
        state, loss = step(state, batch)
        ckpt.save(i, state, step.plan(state, batch))
    ckpt.close()
"""

from __future__ import annotations

import json
import os

import jax

from shardc.plan.record import Plan

try:
    import orbax.checkpoint as ocp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shardc.runtime.checkpoint needs orbax-checkpoint: pip install "
                      "'shardc[train]'") from exc

__all__ = ["Checkpoints"]

_STATE, _PLAN = "state", "plan"


class Checkpoints:
    """Numbered checkpoints in ``directory`` (created if missing); the ``max_to_keep``
    newest are kept (None: all). Every process of a job makes one with the same directory
    and calls ``save`` / ``restore`` together."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None (keep all), got "
                             f"{max_to_keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                 enable_async_checkpointing=True))

    def save(self, step: int, state, plan: Plan) -> None:
        """Start saving ``state`` (a pytree of arrays) and the ``plan`` that made it as
        checkpoint ``step``; returns once the arrays are off the devices (the step may
        donate or overwrite them). A step already saved is an error."""
        if step in self._manager.all_steps():
            raise ValueError(f"checkpoint {step} already exists in {self.directory}; save "
                             "each step once (resume from latest_step() + 1)")
        self._manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _PLAN: ocp.args.JsonSave(json.loads(plan.to_json()))}))

    def wait(self) -> None:
        """Block until every save started has been written and committed."""
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, abstract, shardings=None, step: int | None = None):
        """The state saved at ``step`` (default: the latest), each array placed as asked:
        ``abstract`` is a pytree like the state of ``ShapeDtypeStruct``s (or arrays) with
        a ``sharding`` each, or with ``shardings`` a matching pytree of shardings (the
        new plan's: ``step.input_shardings(...)``)."""
        step = self._step(step)
        if shardings is not None:
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract, shardings)
        unplaced = [jax.tree_util.keystr(path) for path, x in
                    jax.tree_util.tree_leaves_with_path(abstract)
                    if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding)]
        if unplaced:
            raise ValueError(f"restore needs a sharding for every array (to read each shard "
                             f"onto its device), none for {unplaced[:3]} (and "
                             f"{max(len(unplaced) - 3, 0)} more); pass shardings="
                             "step.input_shardings(...) for the state")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target)}))
        return restored[_STATE]

    def plan(self, step: int | None = None) -> Plan:
        """The plan saved with checkpoint ``step`` (default: the latest)."""
        step = self._step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _PLAN: ocp.args.JsonRestore()}))
        return Plan.from_json(json.dumps(restored[_PLAN]))

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint {step} in {self.directory}; it has "
                                    f"{self.all_steps()}")
        return step
