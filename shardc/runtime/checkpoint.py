"""Checkpoints of a sharded train state and its plan, that restore onto another mesh.

A thin layer over Orbax's ``CheckpointManager`` (the ``train`` extra): each step is one
directory holding the state (every process writes its own shards) and the plan (JSON).
Saves are asynchronous and atomic. Restores read each device's shard straight into the
shardings asked for, on any mesh: no array is gathered whole. Each committed step is
sealed (``shardc-seal.json``: its files and sizes); :meth:`Checkpoints.restore_newest`
falls back past a damaged or unsealed step and deletes it::

    ckpt = Checkpoints("/ckpt")
    found = ckpt.restore_newest(abstract_state, state_shardings)
    start, state = (found.step, found.state) if found else (0, init())
    for i in range(start + 1, n + 1):
        state, loss = step(state, batch_for(i))
        ckpt.save(i, state, step.plan(state, batch), meta={"next_batch": i + 1})
    ckpt.close()
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, NamedTuple

import jax

from shardc.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    OptionsError,
)
from shardc.plan.record import Plan

try:
    import orbax.checkpoint as ocp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shardc.runtime.checkpoint needs orbax-checkpoint: pip install "
                      "'shardc[train]'") from exc

__all__ = ["Checkpoints", "Restored"]

_STATE, _PLAN, _META = "state", "plan", "meta"
#: the file in a step's directory listing its files and sizes once the step is committed
SEAL = "shardc-seal.json"

log = logging.getLogger("shardc")


class Restored(NamedTuple):
    """What :meth:`Checkpoints.restore_newest` found.

    Attributes:
        step: The checkpoint's step.
        state: The state, placed as asked.
        meta: The meta saved with it.
    """

    step: int
    state: Any
    meta: dict


class Checkpoints:
    """Numbered checkpoints of a sharded state in ``directory``.

    Every process of a job makes one with the same directory and calls ``save`` /
    ``restore`` together. Usable as a context manager (closed on exit).

    Args:
        directory: Where the checkpoints live (created if missing).
        max_to_keep: The newest checkpoints kept; None: all.

    Raises:
        ValueError: For a ``max_to_keep`` that is not a positive integer or None.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        """Open (or create) the checkpoints in ``directory``; see the class's Args."""
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise OptionsError(f"max_to_keep must be a positive integer or None (keep all), got "
                               f"{max_to_keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                 enable_async_checkpointing=True))

    def save(self, step: int, state, plan: Plan, meta: dict | None = None) -> None:
        """Start saving ``state``, its plan and ``meta`` as checkpoint ``step``.

        Returns once the arrays are off the devices (the step may then donate or
        overwrite them); the files are written in the background.

        Args:
            step: The checkpoint's number.
            state: A pytree of arrays.
            plan: The plan that made it.
            meta: JSON-ready facts to keep beside it (a data loader's position, say).

        Raises:
            ValueError: When checkpoint ``step`` already exists.
        """
        if step in self._manager.all_steps():
            raise CheckpointError(f"checkpoint {step} already exists in {self.directory}; save "
                                  "each step once (resume from latest_step() + 1)")
        self.wait()  # seals the previous save (Orbax starts this one once it is committed)
        self._manager.save(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _PLAN: ocp.args.JsonSave(json.loads(plan.to_json())),
            _META: ocp.args.JsonSave(dict(meta or {}))}))

    def wait(self) -> None:
        """Block until every save started has been written and committed, and seal it."""
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            for step in self._manager.all_steps():
                if not os.path.exists(os.path.join(self._path(step), SEAL)):
                    self._seal(step)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every checkpoint in the directory."""
        return list(self._manager.all_steps())

    def restore(self, abstract, shardings=None, step: int | None = None):
        """The state saved at ``step``, placed as asked.

        Args:
            abstract: A pytree like the state of ``ShapeDtypeStruct``s (or arrays), each
                with a ``sharding`` unless ``shardings`` gives them.
            shardings: A matching pytree of shardings (the new plan's:
                ``step.input_shardings(...)``); None: those of ``abstract``.
            step: The checkpoint; None: the latest.

        Returns:
            The state, each array read shard by shard onto its devices.

        Raises:
            ValueError: When an array has no sharding.
            FileNotFoundError: When there is no such checkpoint.
        """
        step = self._step(step)
        if shardings is not None:
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract, shardings)
        unplaced = [jax.tree_util.keystr(path) for path, x in
                    jax.tree_util.tree_leaves_with_path(abstract)
                    if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding)]
        if unplaced:
            raise CheckpointError(f"restore needs a sharding for every array (to read each shard "
                                  f"onto its device), none for {unplaced[:3]} (and "
                                  f"{max(len(unplaced) - 3, 0)} more); pass shardings="
                                  "step.input_shardings(...) for the state")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(target)}))
        return restored[_STATE]

    def restore_newest(self, abstract, shardings=None) -> Restored | None:
        """The newest intact checkpoint, restored.

        The newest checkpoint whose files match its seal, restored as :meth:`restore`
        does. Damaged or unsealed newer steps are named in one warning and deleted (by
        process 0). Every process calls it.

        Args:
            abstract: The state's pytree of ``ShapeDtypeStruct``s (or arrays).
            shardings: A matching pytree of shardings, unless ``abstract`` carries them.

        Returns:
            ``Restored(step, state, meta)``, or None when the directory has no checkpoint.

        Raises:
            RuntimeError: Checkpoints exist but none is complete.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return None
        bad = []
        for step in steps:
            problem = self.damage(step)
            if problem is None:
                break
            bad.append((step, problem))
        else:
            raise CheckpointCorruptError(f"no complete checkpoint in {self.directory}: "
                                         + "; ".join(f"{s}: {p}" for s, p in bad)
                                         + ". Restore one from a backup or start afresh")
        if bad:
            log.warning("shardc: %s; restoring checkpoint %d, the newest complete one",
                        "; ".join(f"checkpoint {s} in {self.directory} is unusable ({p})"
                                  for s, p in bad), step)
            self._drop([s for s, _ in bad])
        return Restored(step, self.restore(abstract, shardings, step), self.meta(step))

    def damage(self, step: int) -> str | None:
        """What is wrong with checkpoint ``step``'s files against its seal.

        Args:
            step: A step of :meth:`all_steps`.

        Returns:
            The problem in words (a file missing, truncated or grown, the seal missing or
            unreadable), or None when the files match the seal.
        """
        root = self._path(step)
        try:
            with open(os.path.join(root, SEAL)) as f:
                sealed = json.load(f)
        except FileNotFoundError:
            return "never sealed: the job stopped before its save was verified"
        except (OSError, ValueError) as exc:
            return f"its seal is unreadable: {exc}"
        for name, size in sorted(sealed.items()):
            try:
                found = os.path.getsize(os.path.join(root, name))
            except OSError:
                return f"{name} is missing"
            if found != size:
                return f"{name} has {found} bytes, sealed with {size}: truncated or overwritten"
        return None

    def meta(self, step: int | None = None) -> dict:
        """The meta saved with checkpoint ``step``.

        Args:
            step: The checkpoint; None: the latest.

        Returns:
            The meta; {} if none was saved.
        """
        step = self._step(step)
        if not os.path.isdir(os.path.join(self._path(step), _META)):
            return {}
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _META: ocp.args.JsonRestore()}))
        return dict(restored[_META])

    def plan(self, step: int | None = None) -> Plan:
        """The plan saved with checkpoint ``step``.

        Args:
            step: The checkpoint; None: the latest.

        Returns:
            The plan.
        """
        step = self._step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _PLAN: ocp.args.JsonRestore()}))
        return Plan.from_json(json.dumps(restored[_PLAN]))

    def close(self) -> None:
        """Finish and seal pending saves and release the manager."""
        self.wait()
        self._manager.close()

    def __enter__(self) -> Checkpoints:
        """The checkpoints, closed on exit."""
        return self

    def __exit__(self, *exc) -> None:
        """:meth:`close`."""
        self.close()

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _seal(self, step: int) -> None:
        """Write checkpoint ``step``'s seal: every file under it and its size.

        Written atomically: a temporary file renamed into place.
        """
        root = self._path(step)
        sizes = {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
                 for d, _, files in os.walk(root) for f in files}
        tmp = os.path.join(root, SEAL + ".tmp")
        with open(tmp, "w") as f:
            json.dump(sizes, f, sort_keys=True)
        os.replace(tmp, os.path.join(root, SEAL))

    def _drop(self, steps: list[int]) -> None:
        """Delete damaged checkpoints (process 0).

        Once every process has judged them (each reached the same verdict from the same
        files) and before any lists them again.
        """
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"shardc: judged checkpoints {steps}")
        if jax.process_index() == 0:
            for step in steps:
                shutil.rmtree(self._path(step), ignore_errors=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"shardc: dropped checkpoints {steps}")
        self._manager.reload()

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise CheckpointNotFoundError(f"no checkpoint {step} in {self.directory}; it has "
                                          f"{self.all_steps()}")
        return step
