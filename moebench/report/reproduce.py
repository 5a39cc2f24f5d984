"""The commands that make a report again, from what each store's meta.json recorded: the ``moebench run``
that filled the store (the suite as it was named, a path staying a path; its ``--set`` fields and
``--repeats``) and the ``moebench report`` that rendered the page.

What meta.json does not record is not in them: ``--only``/``--filter`` (the store's plan still lists
every point; those left out show as pending), ``--timeout`` (the suite's own limit is used) and the
Slurm options.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moebench.results.table import norm_value
from moebench.sweep.suite import SUITES_DIR, cli_value


def suite_arg(meta: dict[str, Any]) -> str:
    """The suite as ``moebench run`` takes it: its name where the recorded ``suite_file`` is the file the
    name finds (``suites/NAME.yaml`` in the working directory, or the one moebench ships), else that path;
    the name for a store from before ``suite_file`` or a suite built in code (``<dict>``)."""
    name = norm_value(meta.get("suite"))
    source = meta.get("suite_file")
    if not isinstance(source, str) or not source or source.startswith("<"):
        return name
    if Path(source) in (Path("suites") / f"{name}.yaml", SUITES_DIR / f"{name}.yaml"):
        return name
    return source


def run_argv(meta: dict[str, Any]) -> list[str]:
    """``moebench run SUITE [--set KEY=VALUE ...] [--repeats N]`` as the store's meta.json recorded it."""
    argv = ["moebench", "run", suite_arg(meta)]
    sets = meta.get("set") if isinstance(meta.get("set"), dict) else {}
    for key, value in sorted(sets.items()):
        argv += ["--set", f"{key}={cli_value(value)}"]
    repeats = meta.get("repeats")
    if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 1:
        argv += ["--repeats", str(repeats)]
    return argv


def run_command(meta: dict[str, Any], store: str | os.PathLike[str]) -> str:
    """The ``moebench run ... --out STORE`` that fills a store like ``store`` (a fresh one: remove it first)."""
    return shlex.join([*run_argv(meta), "--out", os.fspath(store)])


def report_command(stores: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str],
                   title: str | None = None) -> str:
    """The ``moebench report`` that rendered a page: the stores as they were given, ``-o`` and any ``--title``."""
    argv = ["moebench", "report", *map(os.fspath, stores), "-o", os.fspath(out_dir)]
    return shlex.join(argv + (["--title", title] if title else []))
