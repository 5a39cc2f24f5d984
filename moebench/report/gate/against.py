"""``moebench check --against REV SUITE``: the working tree against another commit, measured here.

:mod:`moebench.sweep.against` runs the suite on both sides, interleaved, one store per side;
the two stores then go through the same gate as ``moebench check BASELINE CURRENT``
(:func:`moebench.report.gate.check.compare`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from moebench.report.build import machine_warnings
from moebench.report.gate.check import Comparison, MetricRule, check_alpha, compare, parse_metric
from moebench.report.gate.output import FORMATS
from moebench.results.table import load_tables
from moebench.sweep.against import Side, measured_sides, parse_env
from moebench.sweep.runner import SweepInterrupted, with_timeout
from moebench.sweep.suite import Point, Suite, check_repeats, load_suite

# Throughput only: the two sides' step-time samples give it a confidence interval; a memory
# threshold has none, so a noisy RSS would fail the gate on its own.
DEFAULT_METRICS = ("tokens_per_s:-5%",)


def gate(base_store: Path, cur_store: Path, rules: list[MetricRule], alpha: float,
         min_samples: int, allow_missing: bool = False) -> tuple[Comparison, list[str]]:
    """The comparison of the two stores, exactly as ``moebench check BASELINE CURRENT`` makes it.

    The two sides ran different code on one machine, interleaved, so no environment warning:
    this is the comparison those warnings point to.
    """
    base, base_metas, base_warnings = load_tables([base_store])
    cur, cur_metas, cur_warnings = load_tables([cur_store])
    warnings = base_warnings + cur_warnings + machine_warnings([*base_metas, *cur_metas], "BASELINE and CURRENT")
    return compare(base, cur, rules, alpha=alpha, min_samples=min_samples, allow_missing=allow_missing), warnings


@dataclass
class AgainstResult:
    comparison: Comparison
    warnings: list[str]
    stores: list[Path]
    sides: list[Side]


def check_against(rev: str, suite: Suite, rules: list[MetricRule], *, alpha: float = 0.05, min_samples: int = 5,
                  keep: Path | None = None, current_env: dict[str, str] | None = None,
                  echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                  repo: Path | None = None, launcher: Callable[[Point], list[str]] | None = None,
                  allow_missing: bool = False, mllog: bool = False) -> AgainstResult:
    """Run ``suite`` on ``rev`` and on the working tree, interleaved, and gate current against baseline.

    ``keep`` a folder that keeps both stores (``baseline/`` and ``current/``); without it they
    are removed once gated; ``mllog`` writes each run's MLPerf-style log into them.
    """
    with measured_sides(rev, suite, keep=keep, current_env=current_env, echo=echo, repo=repo,
                        launcher=launcher, mllog=mllog) as (stores, sides):
        comparison, warnings = gate(stores[0], stores[1], rules, alpha, min_samples, allow_missing)
    return AgainstResult(comparison, warnings, stores if keep is not None else [], sides)


def against_cmd(rev: str, args: Sequence[str], metrics: Sequence[str], ratios: Sequence[str], alpha: float,
                min_samples: int, fmt: str, keep: str | None, current_env: Sequence[str], on_inconclusive: str = "fail",
                allow_missing: bool = False, repeats: int | None = None, timeout: float | None = None,
                mllog: bool = False) -> int:
    """``moebench check --against REV SUITE``: check the arguments, run, print; returns the exit code."""
    import click

    if len(args) != 1:
        raise click.UsageError("with --against, give one SUITE (a name in suites/ or a YAML path), not stores")
    if ratios:
        raise click.UsageError("--ratio gates one store; it does not combine with --against")
    if mllog and keep is None:
        raise click.UsageError("--mllog writes each run's log into the stores: give --keep FOLDER to keep them")
    # everything that can be wrong is found before a worktree is made or a point runs
    check_alpha(alpha)
    rules = [parse_metric(m) for m in (metrics or DEFAULT_METRICS)]
    env = parse_env(current_env)
    suite = with_timeout(load_suite(args[0]), timeout)
    if repeats is not None:
        suite = replace(suite, repeats=check_repeats(repeats, "--repeats"))
    try:
        result = check_against(rev, suite, rules, alpha=alpha, min_samples=min_samples,
                               keep=Path(keep) if keep is not None else None, current_env=env,
                               echo=lambda line: click.echo(line, err=True), allow_missing=allow_missing,
                               mllog=mllog)
    except SweepInterrupted as exc:
        kept = f"; the stores so far are kept in {keep}" if keep is not None else ""
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            click.echo(f"interrupted by {signal.Signals(exc.signum).name}; check --against removed its worktree "
                       f"and temporary folder{kept}", err=True)
        return 128 + exc.signum
    code = result.comparison.exit_code(on_inconclusive)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(FORMATS[fmt](result.comparison, [], result.warnings if fmt != "text" else [], code))
    if result.stores:
        click.echo(f"stores: {result.stores[0]} (baseline), {result.stores[1]} (current)", err=True)
    return code
