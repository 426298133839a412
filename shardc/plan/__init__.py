"""The plan: the record of every value's layout and every op's strategy with its predicted
cost (``record``), its JSON form (``codec``), its assembly from a solved cost graph
(``assemble``), and its step replayed with collectives overlapping compute (``overlap``)."""

from shardc.plan.codec import PlanFormatError
from shardc.plan.record import Plan, Predicted

__all__ = ["Plan", "PlanFormatError", "Predicted"]
