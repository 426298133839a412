"""How the tests compare a sharded run with the unsharded one: to tolerances derived from
the computation (:mod:`shardc.bench.numerics`), so the comparison holds on any machine's
floating-point path."""

from shardc.bench.numerics import ATOL, RTOL, mismatches


def assert_close(got, want, *, rtol: float = RTOL, atol: float = ATOL, lr: float = 0.0,
                 what: str = "") -> None:
    """Assert that the pytrees ``got`` and ``want`` agree leaf for leaf: elementwise to
    ``atol + rtol * |want|``, plus a few units in the last place of each leaf's largest
    magnitude (what reassociated sums move), plus, for parameters after an Adam step of
    learning rate ``lr``, the update's own sensitivity to its gradient."""
    bad = mismatches(got, want, lr, rtol=rtol, atol=atol)
    assert not bad, (what + ": " if what else "") + "; ".join(bad)
