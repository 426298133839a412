"""shardc: an auto-sharding compiler for JAX."""

from shardc import rules as rules
from shardc.cost.cluster import Cluster as Cluster
from shardc.ir.sbp import B as B
from shardc.ir.sbp import Broadcast as Broadcast
from shardc.ir.sbp import NdSbp as NdSbp
from shardc.ir.sbp import Partial as Partial
from shardc.ir.sbp import Split as Split
from shardc.pipeline.schedule import Pipeline as Pipeline
from shardc.plan.codec import PlanFormatError as PlanFormatError
from shardc.plan.record import Plan as Plan
from shardc.plan.record import Predicted as Predicted
from shardc.rules.registry import NoRuleWarning as NoRuleWarning
from shardc.rules.registry import register as register
from shardc.solve.search import MemoryBudgetError as MemoryBudgetError
from shardc.step.auto_shard import AutoSharded as AutoSharded
from shardc.step.auto_shard import auto_shard as auto_shard
from shardc.step.auto_shard import device_sweep as device_sweep
from shardc.step.auto_shard import pareto as pareto
from shardc.step.options import NeedsDevicesError as NeedsDevicesError
from shardc.step.options import Options as Options
from shardc.tradeoff.frontier import Frontier as Frontier
from shardc.tradeoff.sweep import DeviceSweep as DeviceSweep
from shardc.version import __version__ as __version__

__all__ = ["AutoSharded", "B", "Broadcast", "Cluster", "DeviceSweep", "Frontier",
           "MemoryBudgetError", "NdSbp", "NeedsDevicesError", "NoRuleWarning", "Options",
           "Partial", "Pipeline", "Plan", "PlanFormatError", "Predicted", "Split", "auto_shard",
           "device_sweep", "pareto", "register", "rules"]

