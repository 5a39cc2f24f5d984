"""docs/architecture.md stays true: its module map names every module, every path it names exists, and
the strategy and precision recipes name every module that branches on a strategy's or a quantized
precision mode's name."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args, get_type_hints

from moebench.config import ParallelConfig
from moebench.precision_modes import QUANT_MODES

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()

# Modules that spell a strategy's name but need no change when a strategy is added, and why.
NOT_IN_STRATEGY_RECIPE = {
    "results/store.py": "DEFAULT_BASELINE names fsdp as the default baseline; a new strategy leaves it as it is",
}

# Modules that spell a quantized mode's name but need no change when a mode is added, and why.
NOT_IN_PRECISION_RECIPE = {
    "bench/training_runs.py": "the GPU check's training runs compare bf16 with fp8 only",
    "bench/gpu_summary.py": "its table rows of those training runs (bf16 and fp8); its format rows loop QUANT_MODES",
}


def _recipes() -> dict[str, str]:
    """The Recipes section's recipes ("**Add a ...**"), title -> text."""
    found = re.findall(r"^\*\*(Add [^*]+)\*\*(.*?)(?=^\*\*Add |^## |\Z)", DOC.split("## Recipes", 1)[1],
                       flags=re.S | re.M)
    return dict(found)


def _modules_spelling(names: set[str]) -> set[str]:
    """Modules under moebench/ (as the docs name them: ``parallel/fsdp.py``) with a string literal, not a
    docstring, equal to one of ``names``: a comparison, a dict key, a choice list."""
    out = set()
    for path in (ROOT / "moebench").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        if any(isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
               for node in ast.walk(tree)):
            out.add(path.relative_to(ROOT / "moebench").as_posix())
    return out


def test_module_map_names_every_module():
    modules = [p.relative_to(ROOT / "moebench").as_posix() for p in (ROOT / "moebench").rglob("*.py")
               if p.name != "__init__.py"]
    missing = [m for m in modules if f"`{m}`" not in DOC]
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_every_named_path_exists():
    named = set(re.findall(r"`((?:moebench/)?[\w/]+\.(?:py|md|toml|sh))`", DOC))
    missing = [n for n in named
               if not any((base / n).exists() for base in (ROOT, ROOT / "moebench", ROOT / "docs"))]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_torch_free_rooms_import_no_torch():
    """launch/, plan/, results/ and the contracts below them import no torch at module level: the sweep, the
    planner and the readers of stores start fast and run where torch is not installed (docs/architecture.md,
    "Layers")."""
    import subprocess
    import sys

    modules = [f"moebench.launch.{p.stem}" for p in (ROOT / "moebench" / "launch").glob("*.py")
               if p.name != "__init__.py"]
    modules += [f"moebench.results.{p.stem}" for p in (ROOT / "moebench" / "results").glob("*.py")
                if p.name != "__init__.py"]
    modules += ["moebench.layout", "moebench.devices", "moebench.config", "moebench.record", "moebench.run_record",
                "moebench.precision_modes"]
    code = f"import sys; import {', '.join(modules)}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"importing {modules} loaded torch: {result.stderr[-2000:]}"


def test_each_recipe_names_files_that_exist():
    """Every recipe ("**Add a ...**") names the files it touches; each exists, and a file still to be
    written (``parallel/<name>.py``) goes into a folder that exists."""
    recipes = _recipes()
    assert len(recipes) >= 3, "docs/architecture.md's Recipes section lost its recipes"
    for title, body in recipes.items():
        named = re.findall(r"`((?:moebench/|tests/)?[\w/<>.-]+\.(?:py|md|yaml))`", body)
        assert len(named) >= 2, f"recipe {title!r} names {named}: a recipe says which files it touches"
        for n in named:
            base = ROOT if n.startswith(("tests/", "docs/")) else ROOT / "moebench"
            target = base / n
            ok = target.parent.is_dir() if "<" in n else target.exists()
            assert ok, f"recipe {title!r} names {n}, which does not exist under {base}"


def test_the_strategy_recipe_names_every_module_that_branches_on_a_strategy():
    """Adding a strategy touches every module that spells a strategy's name ("fsdp", "ddp": the choices of
    ``parallel.strategy``) in its code; the recipe names each of them, or NOT_IN_STRATEGY_RECIPE says why
    that module needs no change."""
    strategies = set(get_args(get_type_hints(ParallelConfig)["strategy"]))
    assert {"fsdp", "ddp"} <= strategies
    recipe = _recipes()["Add a parallel strategy"]
    named = set(re.findall(r"`([\w/]+\.py)`", recipe))
    spelling = _modules_spelling(strategies)
    assert {"layout.py", "parallel/parallelize.py"} <= spelling  # the scan sees the branches it is for
    missing = sorted(spelling - named - set(NOT_IN_STRATEGY_RECIPE))
    assert not missing, (f"docs/architecture.md's recipe 'Add a parallel strategy' does not name {missing}, which "
                         f"branch on a strategy name: name them there, or exempt them here with the reason")
    stale = sorted(m for m in NOT_IN_STRATEGY_RECIPE if m not in spelling or m in named)
    assert not stale, f"NOT_IN_STRATEGY_RECIPE exempts {stale}, which no longer needs it"


def test_the_precision_recipe_names_every_module_that_branches_on_a_quantized_mode():
    """Adding a quantized precision mode touches every module that spells one's name ("fp8", "mxfp8":
    moebench/precision_modes.py's QUANT_MODES) in its code; the recipe names each of them, or
    NOT_IN_PRECISION_RECIPE says why that module needs no change."""
    assert set(QUANT_MODES) == {"fp8", "mxfp8"}
    recipe = _recipes()["Add a quantized precision mode"]
    named = set(re.findall(r"`([\w/]+\.py)`", recipe))
    spelling = _modules_spelling(set(QUANT_MODES))
    assert {"precision_modes.py", "kernels/quantized_gemm.py"} <= spelling  # the scan sees the branches it is for
    missing = sorted(spelling - named - set(NOT_IN_PRECISION_RECIPE))
    assert not missing, (f"docs/architecture.md's recipe 'Add a quantized precision mode' does not name {missing}, "
                         f"which branch on a quantized mode's name: name them there, or exempt them here with "
                         f"the reason")
    stale = sorted(m for m in NOT_IN_PRECISION_RECIPE if m not in spelling or m in named)
    assert not stale, f"NOT_IN_PRECISION_RECIPE exempts {stale}, which no longer needs it"


def test_no_import_cycles_between_modules():
    """No module imports (at any depth, function-local imports included: they hide a cycle, they do not
    cut it) a module that imports it back; annotations alone (``TYPE_CHECKING``) do not count."""
    import grimp

    graph = grimp.build_graph("moebench", exclude_type_checking_imports=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert cycles == []
