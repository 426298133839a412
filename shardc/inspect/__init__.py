"""shardc.inspect: what XLA actually compiled, read back and priced."""

from shardc.inspect.collective import HloCollective as HloCollective
from shardc.inspect.hlo import CompiledCost as CompiledCost
from shardc.inspect.hlo import collectives as collectives
from shardc.inspect.hlo import price as price
