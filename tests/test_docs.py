"""The documentation runs as written: the README's quickstart and the example each page of
docs/ opens with, each in a fresh process on 8 simulated CPU devices; and every relative
link in README.md and docs/ leads to a file of the repository (and a heading there, where
it names one)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the topic pages, each opening with a runnable example (docs/faults.md's loop is run by
#: tests/test_faults.py; architecture.md and design-notes.md are about the code)
PAGES = ["user-guide", "pipelines", "memory", "cli", "multihost", "cost-model",
         "benchmarks", "contributing"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(path: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown file, as (language, text), in order."""
    return FENCE.findall(path.read_text())


def _run(code: str, name: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name}'s example failed:\n{done.stderr[-4000:]}"
    return done.stdout


def test_readme_quickstart_runs_as_written():
    readme = ROOT / "README.md"
    code = next(text for lang, text in _blocks(readme) if lang == "python")
    assert "@shardc.auto_shard(mesh=" in code and "jax_num_cpu_devices" in code
    out = _run(code, "README.md")
    # the plan it prints: every argument leaf with its PartitionSpec, the weights split
    for leaf in ("params.w1", "params.w2", "opt_state[0].mu.w1", "x", "y"):
        assert re.search(rf"^  {re.escape(leaf)}\s+f32\[", out, re.M), (leaf, out)
    assert re.search(r"^  params\.w1\s+f32\[512,2048\]\s+P\(.*'(node|gpu)'", out, re.M), out


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    bash = [t for lang, t in _blocks(ROOT / "README.md") if lang == "bash"]
    # the two set-up commands: the demo and the tests
    assert [b.strip() for b in bash] == ['pip install -e ".[bench]" && shardc demo',
                                         'pip install -e ".[dev]" && python -m pytest']
    for page in PAGES:
        assert f"(docs/{page}.md)" in text, page


@pytest.mark.parametrize("page", PAGES)
def test_page_opens_with_an_example_that_runs(page):
    path = DOCS / f"{page}.md"
    blocks = _blocks(path)
    assert blocks and blocks[0][0] == "python", f"{path.name} opens with no python example"
    assert _run(blocks[0][1], path.name).strip(), f"{path.name}'s example printed nothing"


def _slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("benchmarks/*.md"))]


def _broken(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of the Markdown file ``path`` that lead nowhere: to no file, out of
    ``root``, or to a heading the page does not have."""
    text = FENCE.sub("", path.read_text())  # links in code blocks are code
    bad = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not a file here
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if root not in where.parents:
            bad.append(f"{target}: outside the repository")
        elif not where.exists():
            bad.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md":
            body = FENCE.sub("", where.read_text())
            if anchor not in {_slug(h) for h in re.findall(r"^#+ (.*)$", body, re.M)}:
                bad.append(f"{target}: no heading '{anchor}'")
    return bad


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(path):
    bad = _broken(path)
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_link_check_finds_broken_links(tmp_path):
    """The check above can fail: a missing page, a missing heading and a path out of the
    repository are each reported; a good link and a web address are not."""
    assert _slug("Memory and budgets") == "memory-and-budgets"
    assert _slug("`auto_shard`'s options") == "auto_shards-options"
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("# A page\n\n## Memory and budgets\n")
    page = repo / "docs" / "b.md"
    page.write_text("[ok](a.md#memory-and-budgets) [web](https://example.com)\n"
                    "[gone](nowhere.md) [head](a.md#no-such-heading) [out](../../x.md)\n"
                    "```python\n[in code](ignored.md)\n```\n")
    (tmp_path / "x.md").write_text("outside")
    assert _broken(page, repo) == ["nowhere.md: no such file",
                                   "a.md#no-such-heading: no heading 'no-such-heading'",
                                   "../../x.md: outside the repository"]


def _help(command: str) -> str:
    """``shardc <command> --help``'s text, from the parser itself."""
    import contextlib
    import io

    from shardc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_every_command_line_flag_the_docs_name_exists():
    """Each `shardc <command> ... --flag` in README.md and docs/ (code blocks and inline
    code) names a command and flags its parser has."""
    uses: dict[str, set[str]] = {}
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        lines = [ln for lang, block in _blocks(path) if lang == "bash"
                 for ln in block.splitlines()]
        lines += re.findall(r"`(shardc [^`]*)`", FENCE.sub("", text))
        for line in lines:
            for cmd, rest in re.findall(r"(?:^|&& )shardc (\w+)([^#&]*)", line):
                uses.setdefault(cmd, set()).update(re.findall(r"(--[\w-]+)", rest))
    assert {"plan", "explain", "export", "pareto", "calibrate", "bench", "demo"} <= set(uses)
    missing = {cmd: sorted(f for f in flags if f not in _help(cmd))
               for cmd, flags in uses.items()}
    assert not any(missing.values()), missing
