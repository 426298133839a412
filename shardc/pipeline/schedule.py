"""The pipeline a plan chooses for a scan over layers.

Stages over one mesh axis, the batch cut into micro-batches, and the schedule that runs
them.

One record crosses every boundary (planner, lowering, plan files, reports): a
:class:`Pipeline` is complete at construction and checked there, so a bad request names
its fix before anything is traced.

References:
  Huang et al., "GPipe" (NeurIPS 2019): the bubble share (S - 1) / (M + S - 1).
  Narayanan et al., "Efficient large-scale language model training on GPU clusters using
  Megatron-LM" (SC 2021) §2.2: 1F1B keeps at most S micro-batches in flight per stage;
  the interleaved (circular) schedule with V virtual stages per device divides the
  bubble by V.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.errors import PipelineError

__all__ = ["SCHEDULES", "Pipeline"]

SCHEDULES = ("gpipe", "1f1b", "circular")


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A pipeline: stages over a mesh axis, micro-batches and a schedule.

    Attributes:
        axis: The mesh axis the stages run over.
        stages: S, the number of stages (at least 2).
        microbatches: M, the micro-batches the batch is cut into.
        schedule: One of :data:`SCHEDULES`: ``"gpipe"``, ``"1f1b"`` or ``"circular"``.
        virtual: V, layer chunks per device (``"circular"`` only).

    Raises:
        ValueError: At construction, for an unknown schedule, fewer than 2 stages, no
            micro-batch, or virtual stages without the circular schedule.
    """

    axis: str
    stages: int
    microbatches: int
    schedule: str = "gpipe"
    virtual: int = 1

    def __post_init__(self):
        """Check the fields (see Raises)."""
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"Pipeline(schedule={self.schedule!r}): use one of {SCHEDULES}")
        if self.stages < 2:
            raise PipelineError(f"Pipeline(stages={self.stages}): a pipeline needs at least 2 "
                                "stages; leave pipeline=None to run without one")
        if self.microbatches < 1:
            raise PipelineError(f"Pipeline(microbatches={self.microbatches}): need at least 1")
        if self.virtual < 1 or (self.virtual > 1 and self.schedule != "circular"):
            raise PipelineError(f"Pipeline(virtual={self.virtual}): virtual stages need "
                                "schedule='circular'; use virtual=1 otherwise")

    @property
    def bubble(self) -> float:
        """Idle share of the step's pipelined part.

        (S - 1) / (M + S - 1), over V for the circular schedule (GPipe; Megatron-LM §2.2).
        """
        s, m = self.stages, self.microbatches
        return (s - 1) / (m * self.virtual + s - 1) if self.virtual > 1 else (s - 1) / (m + s - 1)

    def stage_layers(self, n_layers: int) -> tuple[tuple[range, ...], ...]:
        """Per stage, the ranges of layers it runs, in order.

        Stage ``s`` holds chunk ``v * S + s`` of ``n_layers / (S V)`` layers for each
        ``v`` (:mod:`shardc.pipeline.runtime`).

        Args:
            n_layers: The layer count of the stack.

        Returns:
            Per stage, its chunks' layer ranges in the order it runs them.
        """
        k = n_layers // (self.stages * self.virtual)
        return tuple(tuple(range((v * self.stages + s) * k, (v * self.stages + s + 1) * k)
                           for v in range(self.virtual)) for s in range(self.stages))

    def describe(self, n_layers: int) -> str:
        """Which layers each stage runs: ``stage 0: layers 0-7; stage 1: 8-15; ...``.

        Args:
            n_layers: The layer count of the stack.

        Returns:
            One line naming each stage's layers.
        """
        def span(r: range) -> str:
            return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
        return "; ".join(f"stage {s}: {'layers ' if s == 0 else ''}"
                         + ", ".join(span(r) for r in chunks)
                         for s, chunks in enumerate(self.stage_layers(n_layers)))

    def to_json(self) -> dict:
        """The pipeline as a JSON-ready dict (:meth:`from_json` reads it back)."""
        return {"axis": self.axis, "stages": self.stages, "microbatches": self.microbatches,
                "schedule": self.schedule, "virtual": self.virtual}

    @classmethod
    def from_json(cls, d: dict) -> Pipeline:
        """The pipeline :meth:`to_json` wrote.

        Args:
            d: The dict :meth:`to_json` returned.

        Returns:
            The pipeline, checked as at construction.
        """
        return cls(**d)
