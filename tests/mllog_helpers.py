"""What tests of ``--mllog`` files share: the mlperf-logging package's checker and parser over a log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlperf_logging.compliance_checker import mlp_compliance, mlp_parser

from moebench.metrics.mllog import RULES


def check(path: Path) -> tuple[bool, list[str]]:
    """The package's compliance checker over ``path`` with moebench's rules: (passed, its messages)."""
    # werror: a repeated line the checker only warns about (two identical run_stop lines) fails too
    checker = mlp_compliance.make_checker("training", "6.0.0", quiet=False, werror=True)
    passed = checker.check_file(str(path), str(RULES))
    return passed, [*checker.overwritable.values(), *checker.not_overwritable]


def lines(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The log's lines by key, as the package's parser reads them (a line it cannot parse fails the test)."""
    parsed, errors = mlp_parser.parse_file(str(path), ruleset="6.0.0")
    assert not errors, errors
    out: dict[str, list[dict[str, Any]]] = {}
    for line in parsed:
        out.setdefault(line.key, []).append({"time_ms": line.timestamp, **line.value})
    return out
