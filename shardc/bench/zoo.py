"""The models and cluster presets the benchmark matrix runs over."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from shardc.cost.cluster import Cluster


@dataclass(frozen=True)
class Preset:
    """A physical cluster viewed as one logical mesh, with a link per mesh axis."""

    name: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: Cluster
    about: str

    @property
    def devices(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n


PRESETS = {
    "node-8": Preset("node-8", (8,), ("gpu",), Cluster.nvlink_node(("gpu",)),
                     "one 8-GPU H100 node, NVLink, as mesh (8,)"),
    "node-2x4": Preset("node-2x4", (2, 4), ("node", "gpu"),
                       Cluster.nvlink_node(("node", "gpu")),
                       "the same node as mesh (2, 4), both axes NVLink"),
    "2nodes-2x8": Preset("2nodes-2x8", (2, 8), ("node", "gpu"),
                         Cluster.multi_node("node", "gpu"),
                         "two such nodes over NDR InfiniBand as mesh (2, 8)"),
}


@dataclass(frozen=True)
class ZooModel:
    name: str
    module: str  # models.<name>
    tiny: str  # classmethod names on the config class
    bench: str
    quick: str
    moe: bool = False

    def load(self):
        return importlib.import_module(self.module)

    def config(self, which: str) -> Any:
        mod = self.load()
        cls = next(v for k, v in vars(mod).items() if k.endswith("Config") and isinstance(v, type))
        return _call(cls, getattr(self, which))


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
    "mlp": ZooModel("mlp", "models.mlp", "tiny", "realistic", "realistic(n_layers=4)"),
    "gpt": ZooModel("gpt", "models.gpt", "tiny", "gpt2_small(n_layers=12)",
                    "gpt2_small(n_layers=2)"),
    "moe": ZooModel("moe", "models.moe", "tiny", "realistic", "tiny", moe=True),
    "wrn": ZooModel("wrn", "models.wrn", "tiny", "realistic", "tiny"),
    "vit": ZooModel("vit", "models.vit", "tiny", "realistic", "tiny"),
    "llama": ZooModel("llama", "models.llama", "tiny", "realistic", "realistic(n_layers=2)"),
}
