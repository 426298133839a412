"""The legend of the bench's method names: what each expert's (and shardc's) name means.

The experts are built by :mod:`shardc.bench.experts`; their names follow the patterns
below, a number in a name being the size of the mesh axis that form splits over. The
report (:func:`shardc.bench.report.markdown`) lists the patterns its cells use.
"""

from __future__ import annotations

import re

__all__ = ["LEGEND", "describe", "markdown", "SUFFIXES"]

#: (pattern as the table shows it, regular expression, the plan a practitioner writes)
LEGEND: tuple[tuple[str, str, str], ...] = (
    ("`data-parallel`", r"data-parallel",
     "data parallelism over every device: the batch split, parameters and optimizer state "
     "replicated"),
    ("`fsdp`", r"fsdp",
     "FSDP / ZeRO-3 over every device: parameters and optimizer state sharded on their "
     "largest dim, the batch split"),
    ("`zero1`", r"zero1",
     "ZeRO-1 (Megatron-LM's distributed optimizer): parameters replicated, the optimizer "
     "state sharded over every device, the batch split"),
    ("`megatron-tpN`", r"megatron-tp\d+",
     "Megatron tensor parallelism over N devices (column / row split MLP, attention heads, "
     "vocabulary-parallel embedding and output layer), the batch not split"),
    ("`expert-parallel`", r"expert-parallel",
     "MoE experts split over every device, the tokens' batch too"),
    ("`hsdpN`", r"hsdp\d+",
     "hybrid sharded data parallelism: parameters and optimizer state sharded over an "
     "inner axis of N devices, replicated across the outer axis; the batch over both"),
    ("`zero1-shardN`", r"zero1-shard\d+",
     "ZeRO-1 with the optimizer state sharded over an inner axis of N devices, replicated "
     "across the outer; the batch over both"),
    ("`dp-x-tpN`", r"dp-x-tp\d+",
     "tensor parallelism over an inner axis of N devices, data parallelism across the outer"),
    ("`fsdp-x-tpN`", r"fsdp-x-tp\d+",
     "tensor parallelism over an inner axis of N devices; across the outer, the batch split "
     "and the parameters sharded (FSDP)"),
    ("`zero1-x-tpN`", r"zero1-x-tp\d+",
     "tensor parallelism over an inner axis of N devices; across the outer, the batch split "
     "and the optimizer state sharded (Megatron-LM's default)"),
    ("`epN-x-dp`", r"ep\d+-x-dp",
     "MoE experts split over an inner axis of N devices, the batch over both axes"),
    ("`dp-x-fsdpM-x-tpN`", r"dp-x-fsdp\d+-x-tp\d+",
     "on a 3-axis view: tensor parallelism over the inner N devices, parameters sharded "
     "over the middle M (FSDP), the batch over the outer two (HSDP x TP where the outer "
     "axis is the nodes)"),
    ("`data-parallel-node`, `fsdp-node`, `expert-parallel-node`",
     r"(data-parallel|fsdp|expert-parallel)-node",
     "the form within each node only, replicated (data parallel) across the slower nodes"),
    ("`gpipeS-x-dpK`, `gpipeS-x-fsdpK`, `gpipeS-x-tpK`", r"gpipe\d+-x-(dp|fsdp|tp)\d+",
     "a GPipe pipeline over S nodes (a stage per node, S micro-batches, the stacked layers "
     "split over the stages), data parallel / FSDP / tensor parallel over the K devices "
     "within the node"),
    ("`1f1bS-x-dpK`, `1f1bS-x-fsdpK`, `1f1bS-x-tpK`", r"1f1b\d+-x-(dp|fsdp|tp)\d+",
     "the same with the 1F1B schedule (the stack ends in its loss)"),
    ("`maxtext-circularS-x-fsdpK`", r"maxtext-circular\d+-x-fsdp\d+",
     "MaxText's pipeline as its defaults configure it: circular over S nodes, one layer "
     "per stage per pass, S micro-batches, FSDP over the K devices within the node"),
    ("`zero-offload`", r"zero-offload",
     "ZeRO-Offload: parameters replicated, the optimizer state sharded over every device "
     "and kept in host memory between steps (moved to the devices for the update), the "
     "batch split"),
    ("`fsdp-offload`", r"fsdp-offload",
     "FSDP with the optimizer state in host memory between steps (PyTorch FSDP's "
     "`CPUOffload`), the parameters sharded on the devices"),
    ("`cpN-x-fsdp`", r"cp\d+-x-fsdp",
     "context parallelism over N devices (within the node on several nodes; MaxText's "
     "`context` axis): every activation's sequence split, the keys and values gathered "
     "for each query block; parameters and optimizer state sharded over every device "
     "(FSDP), the sequences' batch across the nodes"),
    ("`ringN-x-fsdp`", r"ring\d+-x-fsdp",
     "ring attention written by hand over N devices (as `cpN-x-fsdp`, the attention a "
     "`shard_map` passing the key/value blocks round the devices with `ppermute`, the "
     "online softmax combining them)"),
    ("`ulyssesN-x-fsdp`", r"ulysses\d+-x-fsdp",
     "DeepSpeed-Ulysses over N devices: the residual stream split on the sequence, the "
     "attention on the heads (an all-to-all each way); FSDP over every device"),
    ("`shardc`", r"shardc",
     "shardc's default plan (NCCL's collective model, communication overlapped)"),
    ("`shardc+serial`", r"shardc\+serial",
     "shardc planning for NCCL's model with communication serial"),
    ("`shardc@M`, `shardc@M+overlap`", r"shardc@[a-z-]+(\+overlap)?",
     "shardc planning for collective model M (`ring`, `alpha-beta`), serial or overlapped"),
)

#: (suffix, regular expression, what it adds to the form it follows)
SUFFIXES: tuple[tuple[str, str, str], ...] = (
    ("`-sp`", r"-sp", "sequence parallelism: the residual stream and its norms split on the "
     "sequence over the tensor-parallel axis"),
    ("`-vp`", r"-vp", "the embedding table and output layer sharded on the vocabulary "
     "rather than the model dim"),
)


def describe(name: str) -> tuple[str, list[str]] | None:
    """``(pattern, suffixes)``: the :data:`LEGEND` pattern the method ``name`` is of and the
    :data:`SUFFIXES` it carries; None where no pattern fits."""
    rest, found = name, []
    for suffix, regex, _ in SUFFIXES:
        if re.search(regex + "$", rest) and not re.fullmatch(r"shardc.*", rest):
            rest, found = re.sub(regex + "$", "", rest), [suffix, *found]
    for pattern, regex, _ in LEGEND:
        if re.fullmatch(regex, rest):
            return pattern, found
    return None


def markdown(methods: list[str]) -> list[str]:
    """The legend's Markdown section for ``methods``: the patterns and suffixes they use,
    in :data:`LEGEND`'s order; names no pattern fits are listed as such."""
    used, suffixes, unknown = set(), set(), []
    for m in dict.fromkeys(methods):
        got = describe(m)
        if got is None:
            unknown.append(m)
        else:
            used.add(got[0])
            suffixes.update(got[1])
    if not used and not unknown:
        return []
    out = ["## Method names\n",
           "What each method's name means (`shardc/bench/experts.py` builds the experts). A "
           "number in a name is the size of the mesh axis the form splits over; an inner "
           "axis is within the node where the devices span nodes.\n",
           "| name | plan |", "|---|---|"]
    out += [f"| {p} | {what} |" for p, _, what in LEGEND if p in used]
    out += [f"| *form*{s} | {what} |" for s, _, what in SUFFIXES if s in suffixes]
    out += [f"| `{m}` | (no pattern) |" for m in unknown]
    return [*out, ""]
