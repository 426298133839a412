"""plan.explain() in the user's words: parameter paths, the per-leaf PartitionSpec table,
repeated layers folded into one row group."""

import inspect
import io
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import shardc
from shardc.models import gpt
from shardc.plan.record import Plan
from shardc.report.explain import fold_repeats, merge_names, spec_text


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
    # the resharding edges' table names its columns
    edges = text.split("resharding edges:")[1].splitlines()
    assert edges[1].split() == ["value", "read", "by", "from", "to", "collectives", "time",
                                "wire", "bytes"], edges[:3]


def test_plans_saved_without_names_still_load_and_explain(gpt12):
    d = json.loads(gpt12.to_json())
    for key in ("input_ids", "input_types", "output_types", "input_names", "output_names"):
        del d[key]
    for column in ("reads", "writes", "source", "where"):
        del d["ops"][column]
    old = Plan.from_json(json.dumps(d))
    assert old.input_names == () and old.ops[0].reads == () and old.ops[0].source == ""
    assert "input 0 " in old.explain(max_rows=5)
    again = Plan.from_json(gpt12.to_json())
    assert again == gpt12


def _mlp_loss(p, x):
    h = jnp.tanh(x @ p["w1"])  # the line the first dot's row names
    return jnp.mean((h @ p["w2"]) ** 2)


def _mlp_step(p, x):
    value, g = jax.value_and_grad(_mlp_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value


@pytest.fixture(scope="module")
def mlp_plan():
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
    step = shardc.auto_shard(_mlp_step, mesh=mesh, cluster=shardc.Cluster.multi_node())
    args = ({"w1": jax.ShapeDtypeStruct((512, 2048), jnp.float32),
             "w2": jax.ShapeDtypeStruct((2048, 512), jnp.float32)},
            jax.ShapeDtypeStruct((256, 512), jnp.float32))
    return step, args, step.plan(*args)


def test_op_rows_name_the_source_line(mlp_plan):
    _, _, plan = mlp_plan
    line = inspect.getsourcelines(_mlp_loss)[1] + 1
    first_dot = next(o for o in plan.ops if o.prim == "dot_general")
    assert first_dot.source == f"{__file__}:{line}" and first_dot.where
    rows = [r for r in plan.explain(max_rows=None).splitlines()
            if r.split()[:2] == [str(first_dot.id), "dot_general"]]
    assert len(rows) == 1 and f"test_explain.py:{line}" in rows[0]
    # the update's ops name the lambda's line in _mlp_step
    update = inspect.getsourcelines(_mlp_step)[1] + 2
    assert plan.ops[-1].source.endswith(f"test_explain.py:{update}")
    assert Plan.from_json(plan.to_json()).ops == plan.ops


def _sorted_norms(x):
    return jnp.sort(x, axis=-1)[:, :4] * jnp.linalg.norm(x, axis=-1, keepdims=True)


def test_ops_inside_jaxs_own_jitted_functions_name_the_line_that_called_them():
    # jnp.sort and jnp.linalg.norm run as JAX's jitted functions, whose equations keep no
    # frame of the user's: each op of theirs is placed at the line that called them
    from shardc.ir.trace import trace

    graph = trace(_sorted_norms, jax.ShapeDtypeStruct((16, 8), jnp.float32)).graph
    line = f"{__file__}:{inspect.getsourcelines(_sorted_norms)[1] + 1}"
    names = {op.name for op in graph.ops}
    assert {"sort", "sqrt", "reduce_sum"} <= names
    assert {op.source for op in graph.ops} == {line}, {(op.name, op.source) for op in graph.ops}


def test_report_renders_as_html_and_rich_tables(mlp_plan):
    _, _, plan = mlp_plan
    page = plan._repr_html_()
    assert page.count("<table>") >= 3 and "<th>PartitionSpec</th>" in page
    k = plan.input_names.index("p.w1")
    assert "<td style=\"text-align:left\">p.w1</td>" in page
    assert spec_text(plan.input_specs()[k]).replace("'", "&#x27;") in page
    rich = pytest.importorskip("rich.console")
    out = io.StringIO()
    rich.Console(file=out, width=220, color_system=None).print(plan.report(max_rows=5))
    text = out.getvalue()
    assert "┃ leaf" in text and "│ p.w1" in text and "test_explain.py:" in text
    assert str(plan.report(max_rows=5)) == plan.explain(max_rows=5)


def test_generic_layouts_follow_their_rules():
    from shardc.ir.sbp import B, NdSbp, Split
    from shardc.tradeoff.baselines import generic_layouts

    # state: two kernels, a bias, and an optimizer slot per kernel shaped like it (the
    # slots repeat the kernels' shapes in order: split alike); data: a batch of 8 rows
    shapes = [(512, 2048), (2048, 512), (2048,), (512, 2048), (2048, 512), (8, 512)]
    state = {0, 1, 2, 3, 4}
    got = generic_layouts(shapes, state, (2, 4))
    both = lambda d: NdSbp((Split(d), Split(d)))  # noqa: E731
    rep = NdSbp((B, B))
    assert got["data parallel"] == {0: rep, 1: rep, 2: rep, 3: rep, 4: rep, 5: both(0)}
    assert got["FSDP"] == {0: both(1), 1: both(0), 2: both(0), 3: both(1), 4: both(0),
                           5: both(0)}
    assert got["Megatron TP"] == {0: both(1), 1: both(0), 2: rep, 3: both(1), 4: both(0),
                                  5: rep}
    gpu = lambda d: NdSbp((B, Split(d)))  # noqa: E731
    assert got["DP x TP"] == {0: gpu(1), 1: gpu(0), 2: rep, 3: gpu(1), 4: gpu(0),
                              5: NdSbp((Split(0), B))}
    assert "ZeRO-1" not in got  # no optimizer slots named
    # ZeRO-1: data parallel, with the slots (inputs only the update reads) split as in FSDP
    zero = generic_layouts(shapes, state, (2, 4), optimizer={3, 4})["ZeRO-1"]
    assert zero == {0: rep, 1: rep, 2: rep, 3: both(1), 4: both(0), 5: both(0)}
    assert isinstance(generic_layouts(shapes, state, (8,))["DP x TP"], str)
    # a split that does not divide: replicated
    assert generic_layouts([(6, 3), (5,)], {0}, (4,))["FSDP"] == {0: NdSbp((B,)),
                                                                 1: NdSbp((B,))}


def test_explain_prints_margins_against_generic_layouts(mlp_plan):
    """On an abstract mesh (nothing to compile) the margins are estimates on the plan's own
    model, which the plan (solved on it) never loses to."""
    step, args, plan = mlp_plan
    abstract = shardc.auto_shard(_mlp_step, mesh=jax.sharding.AbstractMesh((2, 4),
                                                                           ("node", "gpu")),
                                 cluster=shardc.Cluster.multi_node())
    margins = abstract.margins(*args)
    assert margins.source == "estimate"
    # plain SGD: no optimizer slots, so no ZeRO-1
    assert [b.name for b in margins.baselines] == ["data parallel", "FSDP", "Megatron TP",
                                                   "DP x TP"]
    text = plan.explain(max_rows=3, margins=margins)
    table = text.split("margins (")[1].split("arguments (")[0]
    assert table.startswith("estimated step per layout")
    for b in margins.baselines:
        ratio = plan.predicted.step_time / b.predicted.step_time
        assert f"this plan {ratio:.2f}x of {b.name}" in table
        # the plan was solved to optimality on the same model: no generic layout beats it
        assert ratio <= 1.0 + 1e-9, (b.name, ratio)
    assert "DP replicates the state" in table and "Estimates" in table
    # each layout is priced on its own (not the plan's figures copied)
    assert len({b.predicted.step_time for b in margins.baselines}) == 4


def test_margins_on_devices_price_the_compiled_programs(mlp_plan):
    """With devices, each layout and the plan are compiled and priced from their HLO: a
    plan whose inputs are data parallelism's compiles to its program and reads 1.00x."""
    from shardc.inspect import price

    step, args, plan = mlp_plan
    margins = step.margins(*args)
    assert margins.source == "compiled"
    compiled = price(step.lower(*args).compile(), step.mesh_for(plan), plan.cluster)
    assert margins.step_time == pytest.approx(compiled.time + plan.predicted.feed_time)
    text = plan.explain(max_rows=3, margins=margins)
    assert "compiled step per layout" in text
    for b in margins.baselines:
        assert f"this plan {margins.ratio(b.name):.2f}x of {b.name}" in text
    # small weights, a large batch: the plan is data parallelism, and reads 1.00x of it
    wide = ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
             "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
            jax.ShapeDtypeStruct((16384, 64), jnp.float32))
    dp = shardc.auto_shard(_mlp_step, mesh=step.mesh)
    assert [str(s) for s in dp.plan(*wide).input_specs()] == \
        ["P()", "P()", "P(('node', 'gpu'),)"]
    assert dp.margins(*wide).ratio("data parallel") == pytest.approx(1.0, abs=1e-6)


def test_plot_draws_layouts_and_the_time_split(mlp_plan, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    from shardc.report.plot import KINDS, comm_by_op, layout_codes

    backend = matplotlib.get_backend()
    _, _, plan = mlp_plan
    codes = layout_codes(plan)
    assert codes.shape == (2, len(plan.ops))
    first_dot = next(j for j, o in enumerate(plan.ops) if o.prim == "dot_general")
    assert [KINDS[c] for c in codes[:, first_dot]] == \
        [str(s) for s in plan.ops[first_dot].outs[0].sbps]
    assert comm_by_op(plan).sum() == pytest.approx(plan.predicted.comm_time)
    fig = plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 3  # layouts, their colour bar, the time split
    assert "predicted step" in fig.axes[1].get_title()
    assert matplotlib.get_backend() == backend  # the process's backend left alone
