"""Fast Fourier transforms: ``fft`` (``jnp.fft.fft`` / ``ifft`` / ``rfft`` / ``irfft`` and
their n-dimensional forms all lower to it).

``lax.fft(x, fft_type, fft_lengths)`` transforms the last ``len(fft_lengths)`` dims of ``x``
and maps every other (leading) dim through: each leading index is its own signal. Per mesh
axis, any leading dim may be split, operand and result together, ``S(d) -> S(d)`` (XLA's
SPMD partitioner keeps a batch-dim sharding of an ``fft`` with no communication,
``HandleFft``). A transformed dim is
not split: a butterfly reads across the whole signal (a distributed FFT is a transpose, all
to all, between two local passes, which one signature cannot express).

Every FFT type is a linear map over the reals (``IRFFT`` too: it reads the half spectrum
and returns the real signal of its Hermitian extension, a linear map of the input), so a
partial operand gives a partial result: ``P -> P``, summed after the transform as before it
(OneFlow's ``FftC2COp`` / ``FftR2COp`` / ``FftC2ROp`` offer that one signature).

FLOPs: a radix-2 Cooley-Tukey FFT of N complex points does (N/2) log2 N butterflies of one
complex multiply (6 real FLOPs) and two complex adds (4), i.e. 5 N log2 N, the count FFTW
reports speed in for any N; a real transform of N points costs half, 2.5 N log2 N. N is the
product of ``fft_lengths`` (a multi-dim transform of N points is one transform per dim of
the same total); times the number of signals (the leading dims' product). XLA's
``HloCostAnalysis::HandleFft`` charges 8 N prod(log2 n_i) (a complex FMA per point per
level), which is the same order and equal to ours within 1.6x for one dim.

References:
  J. W. Cooley and J. W. Tukey, "An algorithm for the machine calculation of complex Fourier
  series", Math. Comp. 19 (1965); FFTW's benchFFT methodology,
  http://www.fftw.org/speed/method.html (mflops = 5 N log2 N / time, half for real data);
  OneFlow ``user/ops/fft_ops.cpp``; XLA ``service/spmd/spmd_partitioner.cc`` (``HandleFft``),
  ``service/hlo_cost_analysis.cc`` (``HandleFft``); jax ``_src/lax/fft.py``.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Op
from shardc.ir.sbp import P, Split
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["fft_flops", "fft_rule"]


def _is_real(op: Op) -> bool:
    """A transform of real data (RFFT) or to real data (IRFFT): half the work."""
    return op.params["fft_type"].name in ("RFFT", "IRFFT")


def fft_flops(op: Op) -> float:
    """5 N log2 N per complex signal of N points (2.5 N log2 N per real one)."""
    lengths = op.params["fft_lengths"]
    n = math.prod(lengths)
    x = op.inputs[0]
    signals = math.prod(x.shape[:x.ndim - len(lengths)])
    per_signal = 5.0 * n * math.log2(n) if n > 1 else 0.0
    return signals * per_signal * (0.5 if _is_real(op) else 1.0)


@register("fft", flops=fft_flops)
def fft_rule(op: Op) -> list[Signature]:
    x = op.inputs[0]
    leading = x.ndim - len(op.params["fft_lengths"])
    sigs = [Signature((Split(d),), (Split(d),)) for d in range(leading) if x.shape[d] > 1]
    if is_numeric(x.dtype):
        sigs.append(Signature((P,), (P,)))
    return sigs
