"""What a plan must keep: layouts fixed per graph input and output, the layouts some may
choose among, and dims some ops may not split (:class:`Fixed`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardc.ir.sbp import NdSbp

__all__ = ["NOTHING_FIXED", "Fixed"]


@dataclass(frozen=True)
class Fixed:
    """Layouts a plan must keep, by graph input and output index: placed arguments the user
    asked to keep, and results whose type fixes their layout (Explicit mesh axes).
    ``among``: graph input index -> the layouts it may take (one of them, chosen by the
    search; a pipeline stage's weights, held whole over the axes splitting each
    micro-batch); ``unsplit``: op id -> indices of the mesh axes its first result's
    leading dim may not be split over (a pipeline stage's carry, whose batch dim its
    tensor-parallel axes leave whole). ``placed``: graph input index -> the layout an
    argument already on the mesh's devices has (a ``jax.Array`` placed by the user, not
    kept): not a restriction, a price: such an input pays its conversion to the layout
    chosen, not the host feed. ``whole``: op id -> the dims of its inputs and of its
    outputs no mesh axis may split (an attention's sequence, under
    ``context_parallel=False``); a restriction on every view of the mesh, so not counted
    as pinning layouts."""

    inputs: Mapping[int, NdSbp] = field(default_factory=dict)
    outputs: Mapping[int, NdSbp] = field(default_factory=dict)
    among: Mapping[int, tuple[NdSbp, ...]] = field(default_factory=dict)
    unsplit: Mapping[int, frozenset[int]] = field(default_factory=dict)
    placed: Mapping[int, NdSbp] = field(default_factory=dict)
    whole: Mapping[int, tuple[tuple[frozenset[int], ...], tuple[frozenset[int], ...]]] = \
        field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs or self.among or self.unsplit)

    def pinning(self, inputs: Mapping[int, NdSbp]) -> Fixed:
        """These restrictions with ``inputs`` pinned as well (this record's pins win)."""
        return dataclasses.replace(self, inputs={**inputs, **self.inputs})


#: the default: nothing pinned
NOTHING_FIXED = Fixed()
