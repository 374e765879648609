"""Every code block of README.md and docs/*.md is tested, and every relative link leads somewhere.

Python blocks: each is compiled and every ``pipecut`` name it imports or reaches by attribute
exists; each is also listed in :data:`PYTHON_BLOCKS` with the test that runs it or the reason it
is only compiled, so a new block needs a decision. Blocks that need several ranks run in
tests/multiprocess/test_docs.py; the single-process ones run here or in tests/unit/test_public_api.py.
Shell blocks: every command is parsed by the program it calls (``pipecut`` by its own parser,
``torchrun`` by torch's, ``make`` against the Makefile's targets, scripts and test paths must
exist and take the options given); the command-line page's block runs as written.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

import pipecut
from pipecut.cli.factory import load_factory
from pipecut.cli.main import build_parser, main
from pipecut.ir import Plan
from tests.docs import ROOT, Block, block, blocks, code, pages

PYTHON_BLOCKS: dict[tuple[str, str], str] = {
    ("README.md", "layers = [torch.nn.Sequential"):
        "run at 2 ranks against the plain model: tests/multiprocess/test_docs.py",
    ("docs/training-loop.md", "# Planning: one process"):
        "run at 2 ranks against the plain model: tests/multiprocess/test_docs.py",
    ("docs/training-loop.md", 'ckpt.latest("ckpt")'):
        "run at 4 ranks, then resumed from its checkpoint: tests/multiprocess/test_docs.py",
    ("docs/training-loop.md", "normalizer=(y != -100)"):
        "compiled: fragments (`compile(...)`); each line runs in tests/multiprocess/test_training_loop.py",
    ("docs/big-models.md", "from_config(cfg)"):
        "compiled: a recipe with `...`; it runs on five families in tests/multiprocess/test_pretrained.py",
    ("docs/options.md", "heavy_pieces=False"):
        "run: tests/unit/test_options.py::test_the_options_page_runs",
    ("docs/clusters.md", "partition_costs"):
        "run: tests/unit/test_public_api.py::test_the_docs_plan_for_hardware_that_is_not_here",
    ("docs/clusters.md", "plan_cluster(model, batch"):
        "run with two layers of Llama-3.1-8B: test_the_cluster_block_plans_a_run",
    ("docs/tensor-parallel.md", 'mesh_dim_names=("dp", "pp", "tp")'):
        "compiled: a fragment; it runs on 8 ranks in tests/multiprocess/test_tensor_parallel.py (FSDP2 x TP x PP)",
}
"""(page, marker) of every python block -> how it is tested."""

LANGUAGES = {"python", "sh", "bash", "text"}


def _python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang == "python"]


def _shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in ("sh", "bash")]


def _id(b: Block) -> str:
    return f"{b.page}:{b.line}"


def test_every_block_names_a_known_language() -> None:
    odd = [f"{_id(b)} {b.lang!r}" for b in blocks() if b.lang not in LANGUAGES]
    assert not odd, f"blocks without a language from {sorted(LANGUAGES)} (the tests skip them): {odd}"


def test_every_python_block_is_accounted_for() -> None:
    found = {_id(b) for b in _python_blocks()}
    listed = set()
    for (page, marker), how in PYTHON_BLOCKS.items():
        source = block(page, marker)  # exactly one block of that page holds the marker
        listed |= {_id(b) for b in blocks(page) if b.source == source}
        assert how.startswith(("run", "compiled: ")), how
    assert found == listed, f"python blocks without an entry in PYTHON_BLOCKS: {sorted(found - listed)}"


def _pipecut_names(source: str) -> list[str]:
    """Dotted names of everything under ``pipecut`` the source imports or reaches by attribute."""
    tree = ast.parse(source)
    bound = {"pipecut": "pipecut"}  # fragments may leave `import pipecut` out
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pipecut":
                    names.append(alias.name)
                    bound[alias.asname or "pipecut"] = alias.name if alias.asname else "pipecut"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipecut":
            for alias in node.names:
                names.append(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            names.append(".".join([bound[node.id], *reversed(chain)]))
    return names


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i]))
    return obj


def test_name_resolution_finds_what_is_missing() -> None:
    names = _pipecut_names("import pipecut\nfrom pipecut.runtime import checkpoint as ckpt\n"
                           "pipecut.plan(m); ckpt.latest('c'); ckpt.nothing_here()")
    assert {"pipecut.plan", "pipecut.runtime.checkpoint.latest", "pipecut.runtime.checkpoint.nothing_here"} <= set(names)
    assert _resolve("pipecut.runtime.checkpoint.latest") is pipecut.runtime.checkpoint.latest
    with pytest.raises(ModuleNotFoundError):
        _resolve("pipecut.runtime.checkpoint.nothing_here")


@pytest.mark.parametrize("b", _python_blocks(), ids=_id)
def test_python_block_compiles_and_its_pipecut_names_exist(b: Block) -> None:
    compile(b.source, b.page, "exec")
    for name in _pipecut_names(b.source):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            pytest.fail(f"{_id(b)} uses {name}, which does not exist: {e}")


def _commands(source: str) -> list[list[str]]:
    """Each command of a shell block as argv: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", source)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_command(argv: list[str]) -> None:
    while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the program
        argv = argv[1:]
    program, args = argv[0], argv[1:]
    if program == "make":
        targets = [a for a in args if "=" not in a]
        assert targets and set(targets) <= _makefile_targets(), f"{argv}: no such Makefile target"
    elif program == "pipecut":
        if args == ["--version"]:
            return
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit as e:  # argparse exits 2 on a bad option
            pytest.fail(f"{argv}: the parser refused it ({e})")
        if parsed.command == "plan":
            load_factory(parsed.factory)  # MODULE:FACTORY names a function
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        assert (ROOT / parsed.training_script).is_file(), f"{argv}: no script {parsed.training_script}"
    elif program.endswith("/python"):
        script = ROOT / args[0]
        assert script.is_file(), f"{argv}: no script {args[0]}"
        text = script.read_text()
        unknown = [a for a in args if a.startswith("--") and f'"{a}"' not in text]
        assert not unknown, f"{argv}: {script.name} takes no {unknown}"
    elif program.endswith("/pytest"):
        missing = [a for a in args if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
        assert not missing, f"{argv}: no such test paths {missing}"
    else:
        pytest.fail(f"{argv}: no check for {program!r}; teach _check_command about it")


@pytest.mark.parametrize("b", _shell_blocks(), ids=_id)
def test_shell_block_commands_are_accepted_by_their_programs(b: Block) -> None:
    commands = _commands(b.source)
    assert commands, f"{_id(b)} holds no command"
    for argv in commands:
        _check_command(argv)


def test_the_command_check_refuses_what_does_not_exist() -> None:
    for bad in (["make", "nonsense"], ["pipecut", "plan", "examples.gpt:nothing"], ["ls"],
                ["torchrun", "--nproc_per_node=2", "examples/nothing.py"],
                [".venv/bin/python", "benchmarks/fuzz.py", "--no-such-option"]):
        with pytest.raises((AssertionError, pipecut.errors.PipecutError, pytest.fail.Exception)):
            _check_command(bad)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    two = _commands(block("README.md", "make test", "sh"))
    assert [c[:2] for c in two] == [["make", "demo"], ["make", "test"]]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]


def test_the_cli_page_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """docs/cli.md's block, command by command, on the GPT example (a few seconds each)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # the factories' `examples` package, as from the root
    out = ""
    for argv in _commands(block("docs/cli.md", "pipecut plan", "sh")):
        assert argv[0] == "pipecut"
        if argv[1:] == ["--version"]:
            with pytest.raises(SystemExit, match="0"):
                main(argv[1:])
        else:
            assert main(argv[1:]) == 0, argv
        out += capsys.readouterr().out
    assert Plan.from_json((tmp_path / "plan.json").read_text()).num_stages == 4
    assert Plan.from_json((tmp_path / "a100.json").read_text()).num_stages == 8
    assert {p.name for p in tmp_path.iterdir()} >= {"plan.json", "plan.html", "a100.json"}
    assert "moved between stages" in out and f"pipecut {pipecut.__version__}" in out


def test_the_readme_plans_in_one_process() -> None:
    """The README example's model and batch, planned by the README's one-process call; its
    command line is one the parser takes."""
    source = block("README.md", "layers = [torch.nn.Sequential")
    scope: dict[str, Any] = {}
    exec(source.split("# Rank 0 captures")[0], scope)  # the model and the batch
    calls = re.findall(r"`(pipecut\.plan\(model.*?\))`", (ROOT / "README.md").read_text(), re.S)
    assert len(calls) == 1
    plan = eval(calls[0].replace("\n", " "), scope)
    assert plan.num_stages == 2 and plan.microbatches == 4
    assert len({n for s in plan.stages for n in s.parameters}) == len(list(scope["model"].parameters()))
    inline = re.findall(r"`(pipecut plan [^`]*)`", (ROOT / "README.md").read_text())
    assert inline
    for command in inline:
        _check_command(shlex.split(command))


@pytest.mark.hf
def test_the_cluster_block_plans_a_run(capsys) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from examples import llama_meta

    cfg = llama_meta.config("8b", num_hidden_layers=2)  # the real layer shapes, fewer of them
    scope = {"torch": torch, "LlamaForCausalLM": LlamaForCausalLM, "cfg": cfg}
    exec(code("docs/clusters.md", "plan_cluster(model, batch"), scope)
    plan = scope["plan"]
    assert plan.cluster is not None and plan.run is not None and plan.placement is not None
    assert "cluster 8x8xH100-SXM" in capsys.readouterr().out


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", pages())
def test_relative_links_lead_to_files_and_headings(page: str) -> None:
    here = ROOT / page
    broken = []
    for target in _LINK.findall(here.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (here.parent / path).resolve() if path else here
        if not (dest.exists() and (not anchor or dest.suffix != ".md" or anchor in _anchors(dest))):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"


def test_every_docs_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p for p in pages() if p.startswith("docs/") and p != "docs/README.md"
               and f"({Path(p).name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


# --- entry points say what they take, return and raise -------------------------------------------
def _entry_points() -> list[Any]:
    import pipecut
    from pipecut.runtime.pipeline import Pipeline

    return [pipecut.compile, pipecut.plan, pipecut.partition_costs, Pipeline.step, Pipeline.eval_step,
            Pipeline.save_pretrained]


def _options_classes() -> list[type]:
    from pipecut import options

    return [options.CaptureOptions, options.MeasureOptions, options.PartitionOptions, options.ScheduleOptions,
            options.DataParallelOptions, options.WeightOptions, options.RuntimeOptions, options.Options]


def _sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections (``Args:``, ``Returns:``, ``Raises:``): their lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(doc).splitlines():
        if line.strip() in ("Args:", "Returns:", "Raises:") and not line.startswith(" "):
            current = out.setdefault(line.strip()[:-1], [])
        elif current is not None and line.startswith("    "):
            current.append(line)
        elif line.strip():
            current = None
    return out


def _documented(section: list[str]) -> set[str]:
    """The names an ``Args:`` section documents (``    name: ...`` lines)."""
    return {line.split(":")[0].strip() for line in section if not line.startswith("     ") and ":" in line}


@pytest.mark.parametrize("fn", _entry_points(), ids=lambda f: f.__qualname__)
def test_entry_points_document_args_returns_and_raises(fn: Any) -> None:
    sections = _sections(fn.__doc__ or "")
    assert set(sections) == {"Args", "Returns", "Raises"}, f"{fn.__qualname__}: sections {sorted(sections)}"
    assert all(sections.values()), f"{fn.__qualname__}: an empty section"
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    assert _documented(sections["Args"]) == set(params), f"{fn.__qualname__}: Args vs {params}"
    assert all(line.split(":")[0].strip().endswith("Error") for line in sections["Raises"]
               if not line.startswith("     ")), f"{fn.__qualname__}: Raises names its errors"


@pytest.mark.parametrize("cls", _options_classes(), ids=lambda c: c.__name__)
def test_options_classes_document_args_and_raises(cls: type) -> None:
    sections = _sections(cls.__doc__ or "")
    assert set(sections) == {"Args", "Raises"}, f"{cls.__name__}: sections {sorted(sections)}"
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    assert _documented(sections["Args"]) == fields, f"{cls.__name__}: Args vs {sorted(fields)}"


def test_the_section_reader_finds_sections_and_names() -> None:
    doc = "One line.\n\n    Args:\n        a: x\n            more: y\n        b: z\n\n    Raises:\n        E: w\n"
    sections = _sections(doc)
    assert set(sections) == {"Args", "Raises"} and _documented(sections["Args"]) == {"a", "b"}
