"""docs/architecture.md stays true: its module map names every module, and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


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
    modules += ["moebench.layout", "moebench.devices", "moebench.config", "moebench.record", "moebench.run_record"]
    code = f"import sys; import {', '.join(modules)}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"importing {modules} loaded torch: {result.stderr[-2000:]}"


def test_each_recipe_names_files_that_exist():
    """Every recipe ("**Add a ...**") names the files it touches; each exists, and a file still to be
    written (``parallel/<name>.py``) goes into a folder that exists."""
    recipes = re.findall(r"^\*\*(Add [^*]+)\*\*(.*?)(?=^\*\*Add |^## |\Z)", DOC.split("## Recipes", 1)[1],
                         flags=re.S | re.M)
    assert len(recipes) >= 3, "docs/architecture.md's Recipes section lost its recipes"
    for title, body in recipes:
        named = re.findall(r"`((?:moebench/|tests/)?[\w/<>.-]+\.(?:py|md|yaml))`", body)
        assert len(named) >= 2, f"recipe {title!r} names {named}: a recipe says which files it touches"
        for n in named:
            base = ROOT if n.startswith("tests/") else ROOT / "moebench"
            target = base / n
            ok = target.parent.is_dir() if "<" in n else target.exists()
            assert ok, f"recipe {title!r} names {n}, which does not exist under {base}"
