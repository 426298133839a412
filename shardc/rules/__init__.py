"""Strategy rules, one file per family; importing this package registers them all."""

from shardc.ir.flops import op_flops as op_flops  # the FLOPs table (ir/flops.py)
from shardc.rules import callback as callback
from shardc.rules import control as control
from shardc.rules import conv as conv
from shardc.rules import dot as dot  # noqa: F401  (registration)
from shardc.rules import elementwise as elementwise
from shardc.rules import fft as fft
from shardc.rules import fixed as fixed
from shardc.rules import indexing as indexing
from shardc.rules import linalg as linalg
from shardc.rules import misc as misc
from shardc.rules import random as random
from shardc.rules import reduce as reduce
from shardc.rules import shape as shape
from shardc.rules import sort as sort
from shardc.rules import window as window
from shardc.rules.registry import (
    Signature as Signature,
)
from shardc.rules.registry import (
    Strategy as Strategy,
)
from shardc.rules.registry import (
    has_rule as has_rule,
)
from shardc.rules.registry import (
    register as register,
)
from shardc.rules.registry import (
    registered as registered,
)
from shardc.rules.registry import (
    signatures as signatures,
)
from shardc.rules.registry import (
    strategies as strategies,
)
