"""conv_general_dilated: batch, output-channel and input-channel splits.

With ``ConvDimensionNumbers`` ``lhs_spec = (batch, feature, spatial...)``, ``rhs_spec =
(out_feature, in_feature, spatial...)`` and ``out_spec = (batch, feature, spatial...)``, per
mesh axis (OneFlow's conv SBP table, read through XLA's dimension numbers):

* batch split ``(S(lhs batch), B) -> S(out batch)``;
* output-channel split ``(B, S(rhs out_feature)) -> S(out feature)``;
* input-channel split ``(S(lhs feature), S(rhs in_feature)) -> P`` (the contraction);
* ``(P, B) -> P`` and ``(B, P) -> P`` (the conv is bilinear).

The convs of the backward pass are the same primitive with other dimension numbers, so they
need no rule of their own: the kernel gradient of an ungrouped conv has the activations' batch
dim as ``lhs`` *feature* and the cotangent's batch dim as ``rhs`` *in_feature*, so splitting
the data batch gives the P of the input-channel rule.

Groups (``feature_group_count`` / ``batch_group_count`` ``G > 1``): the batch split (for
feature groups) and the linear P signatures hold as they are. A channel split is exact only
when every device holds whole groups, i.e. when the mesh axis size divides ``G``; the rule
cannot see the mesh, so it offers the group split only where the even-split check of the
split dims implies it: ``G`` equal to the split dim's size (depthwise convs and their
gradients). Then ``(S(lhs feature), S(rhs out_feature)) -> S(out feature)`` for feature
groups and ``(S(lhs batch), S(rhs out_feature)) -> S(out feature)`` for batch groups (the
depthwise kernel gradient), each device running ``G / n`` groups. Other channel splits of a
grouped conv are left out, and so are spatial splits: a window crosses the cut, so they need
a halo exchange that an SBP signature cannot express.

References:
  OneFlow ``user/ops/conv_op.cpp`` SBP signatures; XLA ``ConvolutionDimensionNumbers`` and
  ``spmd/convolution_handler.cc`` (channel/batch-group partitioning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shardc.ir.graph import Op
from shardc.ir.sbp import B, NdSbp, P, Split
from shardc.rules.registry import Signature, register
from shardc.rules.shape import is_numeric

__all__ = ["conv_flops", "conv_rule", "conv_specs", "local_groups", "TAP_COUNT_LIMIT"]


def conv_specs(op: Op) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(lhs_spec, rhs_spec, out_spec)``: each ``(batch|out_feature, feature|in_feature,
    spatial...)`` as dims of the lhs, rhs and output; ``None`` dimension numbers mean NCHW."""
    dn = op.params.get("dimension_numbers")
    if dn is None:
        n = op.inputs[0].ndim
        return tuple(range(n)), tuple(range(n)), tuple(range(n))
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


TAP_COUNT_LIMIT = 1 << 22  # output positions x kernel taps per spatial dim counted exactly


def _taps(size: int, window: int, out: int, stride: int, lhs_dil: int, rhs_dil: int,
          pad_lo: int) -> int:
    """(output position, kernel tap) pairs of one spatial dim that read a real input
    element, not padding or a hole of ``lhs_dilation`` (the input gradient of a strided conv
    dilates its input: three in four taps of a stride-2 2-D conv read zeros)."""
    if out * window > TAP_COUNT_LIMIT:
        return out * window
    pos = (np.arange(out)[:, None] * stride + np.arange(window)[None, :] * rhs_dil - pad_lo)
    real = (pos >= 0) & (pos <= (size - 1) * lhs_dil) & (pos % lhs_dil == 0)
    return int(real.sum())


def conv_flops(op: Op) -> float:
    """2 multiply-adds per (output element, kernel tap, input feature per group) whose tap
    reads a real input element: taps on padding or on ``lhs_dilation`` holes are not work
    (XLA's ``cost_analysis`` counts the same way; the rhs in_feature dim is already ``lhs
    features / feature_group_count``)."""
    lhs_spec, rhs_spec, out_spec = conv_specs(op)
    lhs, rhs = op.inputs[:2]
    out = op.outputs[0]
    p = op.params
    n = len(lhs_spec) - 2
    strides = tuple(p.get("window_strides") or (1,) * n)
    lhs_dil = tuple(p.get("lhs_dilation") or (1,) * n)
    rhs_dil = tuple(p.get("rhs_dilation") or (1,) * n)
    padding = tuple(p.get("padding") or ((0, 0),) * n)
    spatial_out = math.prod(out.shape[d] for d in out_spec[2:])
    taps = math.prod(
        _taps(lhs.shape[lhs_spec[2 + i]], rhs.shape[rhs_spec[2 + i]], out.shape[out_spec[2 + i]],
              strides[i], lhs_dil[i], rhs_dil[i], padding[i][0])
        for i in range(n))
    return 2.0 * (out.size // max(spatial_out, 1)) * taps * rhs.shape[rhs_spec[1]]


@register("conv_general_dilated", flops=conv_flops)
def conv_rule(op: Op) -> list[Signature]:
    lhs, rhs = op.inputs
    (lb, lf, *_), (ro, ri, *_), (ob, of, *_) = conv_specs(op)
    fgc = int(op.params.get("feature_group_count", 1))
    bgc = int(op.params.get("batch_group_count", 1))
    sigs = []
    if bgc == 1:  # batch elements are independent (feature groups or not)
        sigs.append(Signature((Split(lb), B), (Split(ob),)))
    if fgc == 1 and bgc == 1:
        sigs.append(Signature((B, Split(ro)), (Split(of),)))
        sigs.append(Signature((Split(lf), Split(ri)), (P,)))
    elif bgc == 1:  # feature groups: whole groups per device when G is the split dim's size
        if fgc in (lhs.shape[lf], rhs.shape[ro]):
            sigs.append(Signature((Split(lf), Split(ro)), (Split(of),)))
    elif fgc == 1:  # batch groups: lhs batch groups pair with rhs out_feature groups
        sigs.append(Signature((Split(lf), Split(ri)), (P,)))  # groups don't touch features
        if bgc in (lhs.shape[lb], rhs.shape[ro]):
            sigs.append(Signature((Split(lb), Split(ro)), (Split(of),)))
    if all(is_numeric(v.dtype) for v in (*op.inputs, *op.outputs)):
        sigs.append(Signature((P, B), (P,)))
        sigs.append(Signature((B, P), (P,)))
    return sigs


def local_groups(op: Op, lhs: NdSbp, axis_sizes: Sequence[int]) -> dict | None:
    """A grouped convolution (``feature_group_count`` or ``batch_group_count`` ``G > 1``)
    whose ``lhs`` layout splits its groups over ``n`` devices: its params on each device's
    pieces, ``G / n`` groups (None for any other op or layout).

    XLA's partitioner does not run that split where it is (a per-example kernel gradient
    under ``jax.vmap`` compiles to an all-to-all), so the lowering runs it per device
    (``shardc.lower.emit``) with these params.
    """
    if op.name != "conv_general_dilated":
        return None
    groups = {k: int(op.params.get(k, 1)) for k in ("feature_group_count", "batch_group_count")}
    key = next((k for k, g in groups.items() if g > 1), None)
    if key is None:
        return None
    (lb, lf, *_), _, _ = conv_specs(op)
    dim = lf if key == "feature_group_count" else lb
    n = math.prod(axis_sizes[a] for a, s in enumerate(lhs.sbps)
                  if isinstance(s, Split) and s.dim == dim)
    return {**op.params, key: groups[key] // n} if n > 1 else None
