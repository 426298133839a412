"""shardc: an auto-sharding compiler for JAX."""

from shardc import errors as errors
from shardc import rules as rules
from shardc.cost.cluster import Cluster as Cluster
from shardc.errors import (
    ArgumentsError,
    BenchError,
    CalibrationError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CostGraphError,
    DonatedArgumentError,
    GraphError,
    HloError,
    LayoutError,
    MemoryBudgetError,
    MeshAxisError,
    NeedsDevicesError,
    NoRuleWarning,
    NoStackError,
    NotFoundError,
    OptionsError,
    OptionsTypeError,
    PipelineError,
    PlanError,
    PlanFormatError,
    PlanMismatchError,
    ProgramError,
    ShardcError,
    ShardcWarning,
    SignatureError,
)
from shardc.ir.sbp import B as B
from shardc.ir.sbp import Broadcast as Broadcast
from shardc.ir.sbp import NdSbp as NdSbp
from shardc.ir.sbp import Partial as Partial
from shardc.ir.sbp import Split as Split
from shardc.pipeline.schedule import Pipeline as Pipeline
from shardc.plan.record import Plan as Plan
from shardc.plan.record import Predicted as Predicted
from shardc.rules.registry import register as register
from shardc.step.auto_shard import AutoSharded as AutoSharded
from shardc.step.auto_shard import auto_shard as auto_shard
from shardc.step.auto_shard import device_sweep as device_sweep
from shardc.step.auto_shard import pareto as pareto
from shardc.step.options import Options as Options
from shardc.tradeoff.frontier import Frontier as Frontier
from shardc.tradeoff.sweep import DeviceSweep as DeviceSweep
from shardc.version import __version__ as __version__

__all__ = ["ArgumentsError", "AutoSharded", "B", "BenchError", "Broadcast", "CalibrationError",
           "CheckpointCorruptError", "CheckpointError", "CheckpointNotFoundError",
           "Cluster", "CostGraphError", "DeviceSweep", "DonatedArgumentError",
           "Frontier", "GraphError", "HloError", "LayoutError", "MemoryBudgetError",
           "MeshAxisError", "NdSbp", "NeedsDevicesError", "NoRuleWarning",
           "NoStackError", "NotFoundError", "Options", "OptionsError",
           "OptionsTypeError", "Partial", "Pipeline", "PipelineError", "Plan",
           "PlanError", "PlanFormatError", "PlanMismatchError", "Predicted",
           "ProgramError", "ShardcError", "ShardcWarning", "SignatureError", "Split",
           "auto_shard", "device_sweep", "errors", "pareto", "register", "rules"]

