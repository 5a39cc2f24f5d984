"""Builders the sweep-level test files share: a suite over the tiny preset, and a scripted
stand-in for ``moebench train`` (each test file's script decides what its points do).

The fixtures built on them live in ``conftest.py``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moebench.sweep.suite import Point, Suite, parse_suite


def tiny_suite(name: str = "t", steps: int = 3, set: dict[str, Any] | None = None, **fields: Any) -> Suite:
    """A suite over the tiny preset at ``steps`` training steps; ``fields`` are the suite's
    other top-level fields (``grid``, ``zip``, ``timeout``, ``repeats``, ...)."""
    return parse_suite({"name": name, "base": {"preset": "tiny", "set": {"train.steps": steps, **(set or {})}},
                        **fields})


def script_launcher(path: Path, script: str) -> Callable[[Point], list[str]]:
    """Write ``script`` (dedented) to ``path``; the launcher runs it with each point's train arguments."""
    path.write_text(textwrap.dedent(script))
    return lambda point: [sys.executable, str(path), *point.train_args()]
