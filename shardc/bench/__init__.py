"""The benchmark: shardc against the plans practitioners write, on the cost of what XLA
compiles (``shardc bench``): the zoo and presets (``zoo``), the experts (``experts``), one
cell compiled and priced (``harness``), the reports (``report``), planning time
(``planning``), call overhead (``calls``), and the measurements on a GPU (``device``,
``gpu_report``, ``deviceless``)."""

COMPILERS = ("cpu", "gpu")
"""The XLA backends a cell may be compiled by: XLA:CPU on simulated CPU devices (the default),
or XLA:GPU for H100s this machine need not have (:mod:`shardc.bench.deviceless`)."""

__all__ = ["COMPILERS"]
