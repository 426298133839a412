"""The models and cluster presets the benchmark matrix runs over.

Weak scaling: a model's ``bench`` and ``quick`` configurations give the global batch for
:data:`REFERENCE_DEVICES` devices; on a preset with more devices the batch grows with them
(the per-device batch stays), so every expert can split the batch over every device, as a
practitioner running more GPUs would.

Memory-bound cells: a model with a ``device_memory`` runs on every preset with that much
memory per device instead of the preset's own. A method whose compiled peak exceeds it does
not fit (it stays in the report, marked), the best expert is the best that fits, and shardc
plans under that budget. It is the model's, not a preset's, because a memory bound is a
model too large for a device: the smaller zoo models fit any of these devices whole.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from shardc.cost.cluster import Cluster
from shardc.errors import OptionsError

__all__ = ["DEFAULT_PRESETS", "Preset", "PRESETS", "REFERENCE_DEVICES", "SMALL_DEVICE_MEMORY",
           "ZOO", "ZooModel"]


@dataclass(frozen=True)
class Preset:
    """A physical cluster viewed as one logical mesh, with a link per mesh axis; ``hosts``:
    the machines its devices sit in, equal shares each (the GPUs XLA:GPU compiles for,
    :func:`shardc.bench.harness.make_mesh`)."""

    name: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: Cluster
    about: str
    hosts: int = 1

    @property
    def devices(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n


REFERENCE_DEVICES = 8
"""The device count the zoo's ``bench`` / ``quick`` batch sizes are written for."""

PRESETS = {
    "node-8": Preset("node-8", (8,), ("gpu",), Cluster.nvlink_node(("gpu",)),
                     "one 8-GPU H100 node, NVLink, as mesh (8,)"),
    "node-2x4": Preset("node-2x4", (2, 4), ("node", "gpu"),
                       Cluster.nvlink_node(("node", "gpu")),
                       "the same node as mesh (2, 4), both axes NVLink (the same devices, "
                       "links and logical views as node-8, so not in the default matrix)"),
    "2nodes-2x8": Preset("2nodes-2x8", (2, 8), ("node", "gpu"),
                         Cluster.multi_node("node", "gpu"),
                         "two such nodes over NDR InfiniBand as mesh (2, 8)", hosts=2),
    "4nodes-eth": Preset("4nodes-eth", (4, 8), ("node", "gpu"),
                         Cluster.ethernet_nodes("node", "gpu"),
                         "four such nodes over 100 Gb/s Ethernet (12.5 GB/s per device "
                         "across nodes) as mesh (4, 8): slow links, where a deep model "
                         "pipelines its layers over the nodes", hosts=4),
}


DEFAULT_PRESETS = ("node-8", "2nodes-2x8")
"""The bench matrix: one node, and two over InfiniBand (node-2x4 is node-8's devices)."""

SMALL_DEVICE_MEMORY = 24 * 2**30
"""The memory-bound cells' device (issue "Memory": 24 GiB, an L4 / A10-class card's memory),
on the presets' H100 links and FLOPs: the cells compare plans under a memory bound, not
hardware."""


@dataclass(frozen=True)
class ZooModel:
    name: str
    module: str  # models.<name>
    tiny: str  # classmethod names on the config class
    bench: str
    quick: str
    moe: bool = False
    device_memory: float | None = None  # memory-bound: bytes per device (module doc)
    presets: tuple[str, ...] = DEFAULT_PRESETS  # where `shardc bench` runs it by default
    #: its state outgrows ``device_memory`` on the devices alone: the experts offload too
    #: (XLA:CPU only: the bench's XLA:GPU compile has no host memory)
    offload: bool = False
    #: a long sequence, fewer sequences than devices: the context-parallel experts too
    long: bool = False

    def load(self):
        return importlib.import_module(self.module)

    def config(self, which: str, devices: int = REFERENCE_DEVICES) -> Any:
        """The ``which`` configuration ("tiny", "bench", "quick"); the bench and quick
        batches scaled to ``devices`` (weak scaling, see the module doc)."""
        mod = self.load()
        cls = next(v for k, v in vars(mod).items() if k.endswith("Config") and isinstance(v, type))
        cfg = _call(cls, getattr(self, which))
        if which == "tiny" or devices == REFERENCE_DEVICES:
            return cfg
        if (cfg.batch * devices) % REFERENCE_DEVICES:
            raise OptionsError(f"{self.name}: batch {cfg.batch} for {REFERENCE_DEVICES} devices "
                               f"does not scale to {devices}")
        return dataclasses.replace(cfg, batch=cfg.batch * devices // REFERENCE_DEVICES)


def _call(cls, expr: str):
    """``"gpt2_small(n_layers=4)"`` -> ``cls.gpt2_small(n_layers=4)``;
    ``"tiny"`` -> ``cls.tiny()``."""
    name, _, args = expr.partition("(")
    kwargs = {}
    for part in filter(None, args.rstrip(")").split(",")):
        k, v = part.split("=")
        kwargs[k.strip()] = int(v)
    return getattr(cls, name.strip())(**kwargs)


ZOO = {
    "mlp": ZooModel("mlp", "shardc.models.mlp", "tiny", "realistic", "realistic(n_layers=4)"),
    "gpt": ZooModel("gpt", "shardc.models.gpt", "tiny", "gpt2_small(n_layers=12)",
                    "gpt2_small(n_layers=2)"),
    "moe": ZooModel("moe", "shardc.models.moe", "tiny", "realistic", "tiny", moe=True),
    "wrn": ZooModel("wrn", "shardc.models.wrn", "tiny", "realistic", "tiny"),
    "vit": ZooModel("vit", "shardc.models.vit", "tiny", "realistic", "tiny"),
    "llama": ZooModel("llama", "shardc.models.llama", "tiny", "realistic", "realistic(n_layers=2)"),
    # its quick config (2 layers, 0.65B params, mostly the two vocab tables) fits whole
    "llama-1b": ZooModel("llama-1b", "shardc.models.llama", "tiny", "llama32_1b",
                         "llama32_1b(n_layers=2)", device_memory=SMALL_DEVICE_MEMORY),
    # 32 scanned layers of small width: the pipelined model (4nodes-eth)
    "deep": ZooModel("deep", "shardc.models.llama", "deep_tiny", "deep", "deep",
                     presets=("4nodes-eth",)),
    # weights and Adam state outgrow 512 MiB devices on node-8 however they are split: the
    # leanest device-only plans (FSDP) do not fit, the optimizer state offloaded does
    "mlp-offload": ZooModel("mlp-offload", "shardc.models.mlp", "tiny", "realistic(n_layers=4)",
                            "realistic(n_layers=4)", device_memory=512 * 2**20,
                            presets=("node-8",), offload=True),
    # 32768 tokens per sequence, one sequence per node: attention split over the sequence
    # or the heads (context parallelism, Ulysses) or not at all
    "llama-long": ZooModel("llama-long", "shardc.models.llama", "tiny", "long_context",
                           "long_context(n_layers=2)", long=True),
    # latency-bound: data parallelism is the plan to beat (models/small.py)
    "small": ZooModel("small", "shardc.models.small", "tiny", "bench", "bench(n_layers=2)"),
    # gradient accumulation unrolled over 4 micro-batches (models/accum.py)
    "accum": ZooModel("accum", "shardc.models.accum", "tiny", "bench", "bench(n_layers=2)"),
}

