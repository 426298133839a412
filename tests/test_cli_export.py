"""The CLI on a user's own program (plan, explain, export), the exported module run with
plain jax.jit, and one-line errors for bad arguments."""

import ast
import importlib.util
import json
import os
import textwrap
from collections import Counter

import jax
import numpy as np
import pytest
from helpers import SLOW_NODES, assert_close

import shardc
from shardc.cli import main
from shardc.inspect import collectives
from shardc.plan.record import Plan
from shardc.report.explain import spec_text

# a 2-layer MLP regression step with plain SGD: not a zoo model; large enough that the
# plan on node=2 x gpu=4 shards it (a smaller one runs replicated)
PROGRAM = textwrap.dedent('''
    import jax
    import jax.numpy as jnp


    def loss(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch["x"], batch["y"])
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


    def make():
        k = jax.random.split(jax.random.key(0), 4)
        params = {"w1": jax.random.normal(k[0], (512, 2048)) * 0.05, "b1": jnp.zeros(2048),
                  "w2": jax.random.normal(k[1], (2048, 512)) * 0.05, "b2": jnp.zeros(512)}
        batch = {"x": jax.random.normal(k[2], (256, 512)),
                 "y": jax.random.normal(k[3], (256, 512))}
        return step, (params, batch)
''')


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The program written to a file and planned by ``shardc plan file.py:make``."""
    folder = tmp_path_factory.mktemp("program")
    (folder / "prog.py").write_text(PROGRAM)
    out = folder / "p.json"
    (folder / "cluster.json").write_text(json.dumps(SLOW_NODES.to_json()))
    main(["plan", f"{folder / 'prog.py'}:make", "--mesh", "2x4", "--rows", "5",
          "--cluster", str(folder / "cluster.json"), "--out", str(out)])
    return folder, out


def test_plan_names_the_users_leaves_and_saves(planned, capsys):
    folder, out = planned
    plan = Plan.from_json(out.read_text())
    assert plan.input_names == ("params.b1", "params.b2", "params.w1", "params.w2",
                                "batch.x", "batch.y")
    assert plan.output_names == ("out[0].b1", "out[0].b2", "out[0].w1", "out[0].w2", "out[1]")
    assert plan.input_types[2] == "f32[512,2048]"
    assert any(spec != jax.sharding.PartitionSpec() for spec in plan.input_specs())  # sharded
    main(["explain", str(out), "--rows", "5"])
    text = capsys.readouterr().out
    table = text.split("arguments (6 leaves")[1].split("results")[0]
    for name, spec in zip(plan.input_names, plan.input_specs()):
        assert f"{name} " in table and spec_text(spec) in table
    assert "predicted vs compiled" not in text
    # the op rows name the program's lines: the forward's dots, the update's lambda
    lines = PROGRAM.splitlines()
    hidden = 1 + next(i for i, t in enumerate(lines) if "h = jax.nn.relu" in t)
    update = 1 + next(i for i, t in enumerate(lines) if "jax.tree.map(lambda" in t)
    assert {o.source for o in plan.ops if o.prim == "dot_general"} >= \
        {f"{folder / 'prog.py'}:{hidden}"}
    ops = text.split("costliest rows")[1]
    assert f"prog.py:{hidden}" in ops or f"prog.py:{update}" in ops


def test_explain_with_the_program_prints_margins(planned, capsys):
    folder, out = planned
    main(["explain", str(out), "--program", f"{folder / 'prog.py'}:make", "--rows", "3"])
    text = capsys.readouterr().out
    table = text.split("margins (")[1].split("arguments (")[0]
    for name in ("data parallel", "FSDP", "Megatron TP", "DP x TP"):
        row = next(line for line in table.splitlines() if line.strip().startswith(name))
        assert f"x of {name}" in row, row
    assert "predicted vs compiled" not in text
    main(["explain", str(out), "--plot", str(folder / "plan.png"), "--rows", "1"])
    assert (folder / "plan.png").stat().st_size > 1000


def test_explain_compile_compares_collectives(planned, capsys):
    folder, out = planned
    main(["explain", str(out), "--compile", "--program", f"{folder / 'prog.py'}:make"])
    text = capsys.readouterr().out
    report = text.split("predicted vs compiled collectives")[1]
    rows = [line.split() for line in report.splitlines()[2:] if line.strip().startswith("all")
            or line.strip().startswith("reduce")]
    assert rows and all(r[-1] == "matched" for r in rows)


def test_exported_module_runs_the_plan_with_plain_jit(planned, capsys):
    folder, out = planned
    plan = Plan.from_json(out.read_text())
    main(["export", str(out), "--format", "python"])
    code = capsys.readouterr().out
    imports = [n for node in ast.walk(ast.parse(code))
               if isinstance(node, ast.Import | ast.ImportFrom)
               for n in ([node.module] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names])]
    assert "jax" in imports and not any(n.startswith("shardc") for n in imports)
    (folder / "plan_code.py").write_text(code)
    exported = _import(folder / "plan_code.py", "plan_code")
    fn, args = _import(folder / "prog.py", "prog_again").make()

    step = exported.jit(fn)
    (new_params, loss) = step(*args)
    (ref_params, ref_loss) = jax.jit(fn)(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(new_params, ref_params, rtol=1e-4, atol=1e-6)

    mesh = exported.make_mesh()
    compiled = step.lower(*args).compile()
    # the compiled program takes and gives the plan's layouts, leaf for leaf
    got_in = [s.spec for s in jax.tree.leaves(compiled.input_shardings[0])]
    got_out = [s.spec for s in jax.tree.leaves(compiled.output_shardings)]
    assert got_in == plan.input_specs() and got_out == plan.output_specs()

    # against the program shardc runs (every planned value constrained): with the plan's
    # constraints placed inside (the default), the same collectives, one for one
    by_shardc = shardc.auto_shard(fn, mesh=mesh, cluster=plan.cluster)
    by_shardc.use_plan(plan, *args)
    ours = by_shardc.lower(*args).compile()

    def kinds(c):
        return Counter((h.kind, h.shapes, h.axes) for h in collectives(c, mesh))

    assert exported.CONSTRAINTS and kinds(ours) and kinds(compiled) == kinds(ours)
    # pinning the ends only, XLA's propagation reduces the scalar loss as a partial sum
    # where the plan gathers the residual first: at most scalar collectives more
    ends = exported.jit(fn, constraints=False)
    theirs = kinds(ends.lower(*args).compile())
    assert not kinds(ours) - theirs
    extra = theirs - kinds(ours)
    assert all(shapes == ("f32[]",) for _, shapes, _ in extra), extra
    (ends_params, ends_loss) = ends(*args)
    np.testing.assert_allclose(float(ends_loss), float(ref_loss), rtol=1e-5)
    check = plan.verify(compiled, mesh)
    for row in check.rows:
        if row.planned_count:
            assert row.compiled_bytes == pytest.approx(row.planned_bytes), row


def test_export_rules_map_parameter_paths_to_specs(planned, capsys):
    folder, out = planned
    plan = Plan.from_json(out.read_text())
    main(["export", str(out), "--format", "rules"])
    code = capsys.readouterr().out
    k = plan.input_names.index("params.w1")
    assert f'(r"^params\\.w1$", {spec_text(plan.input_specs()[k])}),' in code
    (folder / "rules.py").write_text(code)
    rules = _import(folder / "rules.py", "plan_rules")
    params, batch = _import(folder / "prog.py", "prog_rules").make()[1]
    got = [*jax.tree.leaves(rules.specs(params, "params")),
           *jax.tree.leaves(rules.specs(batch, "batch"))]
    assert got == plan.input_specs()


def test_rules_fold_layers_that_agree_and_name_those_that_do_not():
    from jax.sharding import PartitionSpec as P

    from shardc.report.export import path_rules

    names = [f"params.blocks[{i}].{w}" for i in range(4) for w in ("w", "b")]
    specs = [P(None, "gpu") if w == "w" and i != 2 else P() for i in range(4)
             for w in ("w", "b")]
    rules, notes = path_rules(names, specs)
    assert (r"params\.blocks\[\d+\]\.b", "P()", 4) in rules
    # layer 2's kernel is laid out apart: one exact rule per kernel, ahead of the folded
    assert [r[0] for r in rules[:4]] == [rf"params\.blocks\[{i}\]\.w" for i in range(4)]
    assert rules[2][1] == "P()" and len(notes) == 1 and "2 layouts" in notes[0]


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    code = exc.value.code
    message = code if isinstance(code, str) else err.splitlines()[-1]
    assert "Traceback" not in err and "\n" not in message.strip(), message
    assert message.startswith("shardc"), message
    return message


def test_bad_program_arguments_are_one_line(tmp_path, capsys, planned):
    (tmp_path / "nomake.py").write_text("x = 1\n")
    (tmp_path / "wrong.py").write_text("import jax.numpy as jnp\ndef make():\n"
                                       "    return jnp.ones(3)\n")
    (tmp_path / "badargs.py").write_text("def make():\n    return (lambda x: x), {'x': 1}\n")
    (tmp_path / "text.py").write_text("def make():\n    return (lambda x: x), ('hello',)\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "cluster.json").write_text(json.dumps({"axis_bandwidth": {"rack": 1e9}}))
    _, plan = planned
    unnamed = json.loads(plan.read_text())
    del unnamed["input_names"], unnamed["output_names"]
    (tmp_path / "unnamed.json").write_text(json.dumps(unnamed))
    cases = {
        f"{tmp_path / 'missing.py'}:make": "no such file",
        f"{tmp_path / 'nomake.py'}:make": "has no 'make'",
        f"{tmp_path / 'wrong.py'}:make": "return (fn, args)",
        f"{tmp_path / 'badargs.py'}:make": "as args",
        f"{tmp_path / 'text.py'}:make": "is not an array",
        "no_such_module_here:make": "no module named",
        "resnet": "neither a zoo model",
    }
    for target, expect in cases.items():
        assert expect in _one_line_error(["plan", target], capsys)
    prog = f"{tmp_path / 'nomake.py'}:make"
    for argv, expect in (
            (["plan", prog, "--mesh", "2xfour"], "not a mesh shape"),
            (["plan", "mlp", "--cluster", "dgx-9000"], "neither a preset"),
            (["plan", "mlp", "--cluster", str(tmp_path / "cluster.json")], "rack"),
            (["plan", "mlp", "--mesh", "8", "--cluster", "multi-node"], "2-axis mesh"),
            (["explain", str(tmp_path / "bad.json")], "not valid JSON"),
            (["explain", str(tmp_path / "none.json")], "No such file"),
            (["explain", str(plan), "--compile"], "--program"),
            (["explain", str(plan), "--compile", "--program", "mlp2.py"], "does not name"),
            (["explain", str(plan), "--plot", str(tmp_path / "no" / "p.png")], "--plot"),
            (["export", str(plan), "--format", "yaml"], "invalid choice"),
            (["export", str(tmp_path / "unnamed.json"), "--format", "rules"], "no names")):
        assert expect in _one_line_error(argv, capsys), argv


def test_the_console_script_runs_main_then_leaves_the_heap_to_the_exit(monkeypatch):
    """``shardc`` (``pyproject``'s script, ``python -m shardc.cli``) is ``command``: the
    command, then ``gc.freeze`` (no last collection walking what it planned); ``main``
    alone, as tests and scripts call it, leaves the collector as it was."""
    import gc
    import runpy
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    import shardc.cli as cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda argv=None: calls.append("main"))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    cli.command()
    assert calls == ["main", "freeze"]
    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["shardc"] == "shardc.cli:command"
    # ``python -m shardc.cli`` runs the same: main, then the freeze
    calls.clear()
    runpy.run_module("shardc.cli", run_name="__main__")
    assert calls == ["main", "freeze"]
    # and, run for real, parses its arguments: a bad command is one usage error
    env = {**os.environ, "PYTHONPATH": str(root)}
    bad = subprocess.run([sys.executable, "-m", "shardc.cli", "nonsense"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert "usage: shardc" in bad.stderr and "invalid choice: 'nonsense'" in bad.stderr
