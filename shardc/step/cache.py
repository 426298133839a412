"""Plans cached on disk, so a second process planning the same program loads the plan.

A plan is stored as its JSON (:meth:`shardc.plan.record.Plan.to_json`) under a key that covers
everything the solver's answer depends on: the program (:func:`shardc.plan.record.fingerprint`:
primitives, params, dataflow) and its argument types, the mesh's shape, axis names and
platform, the cluster, every other planning option (the whole options record but where
the cache is), the layouts the program must keep (ties, fixed inputs and outputs) and the
shardc version. Plans are deterministic (every solver stage runs to its end; the time
limit is a wall-clock guard that a plan's status reports when it cut the search), so a
cached plan is the plan this process would make. Files are written atomically (a
temporary file renamed into place), so processes sharing a directory never read half a
plan; a file that does not parse or belongs to another program is re-planned and
overwritten (logged).

The directory is ``auto_shard(..., cache_dir=...)``, else ``$SHARDC_CACHE_DIR``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from shardc.ir.graph import Value
from shardc.ir.sbp import NdSbp
from shardc.plan.codec import PlanFormatError
from shardc.plan.record import Plan
from shardc.step.options import platform_of

__all__ = ["CACHE_ENV", "PlanCache"]

#: the environment variable naming the cache directory when ``cache_dir`` is not given
CACHE_ENV = "SHARDC_CACHE_DIR"

log = logging.getLogger("shardc")


#: the :class:`~shardc.step.options.Options` fields the key holds otherwise: the cluster (as
#: its JSON), the seeds and the layouts asked for (as the solver gets them: ``seeds``,
#: ``fixed``), and not where the cache is; every other field is keyed as it is, so an
#: option added to the record is keyed without a change here
_KEYED_APART = frozenset({"cluster", "seeds", "in_shardings", "cache_dir"})


class PlanCache:
    """A directory of plans keyed by :meth:`key`."""

    __slots__ = ("root",)

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @classmethod
    def at(cls, cache_dir: str | os.PathLike | None) -> PlanCache | None:
        """The cache at ``cache_dir``, else at ``$SHARDC_CACHE_DIR``; None when neither."""
        where = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or None
        return None if where is None else cls(where)

    def key(self, program: str, inputs: Sequence[Value],
            mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
            options: Any, seeds: Mapping[str, Mapping[int, NdSbp]], ties, fixed,
            resident: Collection[int] = ()) -> str:
        """A digest of what the plan depends on (see the module doc): ``program`` is the
        graph's :func:`~shardc.plan.record.fingerprint`, ``inputs`` its inputs, ``seeds`` the
        seed layouts by name, as the solver gets them."""
        from shardc.version import __version__

        parts = {
            "shardc": __version__,
            "program": program,
            "inputs": [[list(v.shape), str(v.dtype)] for v in inputs],
            "mesh": [list(mesh.axis_sizes), list(mesh.axis_names)],
            # the backend's combiners and memory model shape the plan (None: abstract)
            "platform": platform_of(mesh),
            "cluster": options.cluster.to_json(),
            "options": {f.name: str(getattr(options, f.name))
                        for f in dataclasses.fields(options) if f.name not in _KEYED_APART},
            "seeds": {name: sorted((k, str(nd)) for k, nd in layouts.items())
                      for name, layouts in sorted(seeds.items())},
            "ties": [list(t) for t in ties],
            "resident": sorted(resident),
            "fixed": [sorted((k, str(nd)) for k, nd in fixed.inputs.items()),
                      sorted((k, str(nd)) for k, nd in fixed.outputs.items()),
                      sorted((k, str(nd)) for k, nd in fixed.placed.items())],
        }
        text = json.dumps(parts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str, program: Callable[[Plan], str]) -> Plan | None:
        """The plan stored under ``key``; None when there is none usable: damaged, or its
        fingerprint is not ``program(plan)``, the fingerprint of the program it runs (the
        traced one, or the one recomputing the segments ``plan.remat``)."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            plan = Plan.from_json(text)
        except PlanFormatError as exc:
            log.warning("shardc: ignoring the damaged cached plan %s (%s); planning again",
                        path, exc)
            return None
        if plan.fingerprint != program(plan):
            log.warning("shardc: the cached plan %s was made for another program; planning "
                        "again", path)
            return None
        log.info("shardc: loaded the plan from %s", path)
        return dataclasses.replace(plan, solver={**plan.solver, "cached": str(path)})

    def save(self, key: str, plan: Plan) -> None:
        """Store ``plan`` under ``key`` atomically (a failure to write is logged, not
        raised: the plan is in hand)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".plan-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(plan.to_json())
            os.replace(tmp, self.path(key))
        except OSError as exc:
            log.warning("shardc: could not cache the plan in %s: %s", self.root, exc)
