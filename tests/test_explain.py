"""plan.explain() in the user's words: parameter paths, the per-leaf PartitionSpec table,
repeated layers folded into one row group."""

import json

import jax
import pytest
from jax.sharding import AxisType

import shardc
from shardc.explain import fold_repeats, merge_names, spec_text
from shardc.models import gpt
from shardc.plan import Plan


def test_fold_repeats_finds_the_longest_run_in_a_row():
    # a head, a period-3 layer repeated 4 times, a tail; a period-2 pair repeated twice
    # saves 2 rows only, under least=4, so it stays unfolded
    sigs = ["h", *"abc" * 4, "x", "y", "x", "y", "t"]
    assert fold_repeats(sigs) == [(0, 1, 1), (1, 3, 4), (13, 1, 1), (14, 1, 1), (15, 1, 1),
                                  (16, 1, 1), (17, 1, 1)]
    assert fold_repeats(sigs, least=2)[2] == (13, 2, 2)
    assert fold_repeats([]) == []


def test_merge_names_spans_the_indices():
    names = [f"state.opt[0].mu.blocks[{i}].attn.q.kernel" for i in (2, 0, 1, 3)]
    assert merge_names(names) == "state.opt[0].mu.blocks[0..3].attn.q.kernel"
    assert merge_names(["a[1].b", "a[5].b"]) == "a[1,5].b"


@pytest.fixture(scope="module")
def gpt12():
    """GPT-2 small (12 layers) planned from abstract shapes on node=2 x gpu=4."""
    cfg = gpt.GPTConfig.gpt2_small(n_layers=12)
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    step = shardc.auto_shard(gpt.build_step(cfg), mesh=mesh,
                             cluster=shardc.Cluster.multi_node())
    return step.plan(*gpt.abstract_args(cfg))


def test_gpt_explain_names_parameters_and_folds_layers(gpt12):
    plan = gpt12
    text = plan.explain()
    names = set(plan.input_names)
    assert "state.params.blocks[3].attn.query.kernel" in names
    assert "state.opt[0].mu.blocks[3].mlp.fc.kernel" in names and "batch.tokens" in names
    table = text.split("arguments (")[1].split("ops in")[0]
    # one row per parameter across the 12 layers, with its spec and the count
    rows = [line for line in table.splitlines()
            if "state.params.blocks[0..11].attn.query.kernel " in line]
    assert len(rows) == 1 and rows[0].rstrip().endswith("x12")
    k = plan.input_names.index("state.params.blocks[0].attn.query.kernel")
    assert spec_text(plan.input_specs()[k]) in rows[0]
    # the new state is laid out as the state: one line, not 590
    assert "  out[0]: as state, leaf for leaf" in text
    # the op table folds the layers: a group of 12, its rows naming the layers' weights
    assert "-- x12: ops " in text
    op_rows = text.split("-- x12: ops ")[1]
    assert "state.params.blocks[0..11].attn." in op_rows
    assert "v" + str(plan.reshards[0].value) + " ->" not in text  # values named, not ids
    assert max(len(line) for line in text.splitlines()) < 200


def test_plans_saved_without_names_still_load_and_explain(gpt12):
    d = json.loads(gpt12.to_json())
    for key in ("input_ids", "input_types", "output_types", "input_names", "output_names"):
        del d[key]
    for o in d["ops"]:
        del o["reads"], o["writes"]
    old = Plan.from_json(json.dumps(d))
    assert old.input_names == () and old.ops[0].reads == ()
    assert "input 0 " in old.explain(max_rows=5)
    again = Plan.from_json(gpt12.to_json())
    assert again == gpt12
