"""``moebench report`` and ``moebench check`` (registered on the main CLI group)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.load import find_stores
from moebench.sweep.cli import TIMEOUT_HELP


@click.command("report", short_help="Build the HTML/Markdown report of results stores.")
@click.argument("results", nargs=-1, required=True, type=click.Path())  # find_stores names a bad one
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output folder (default: reports/<suite>).")
@click.option("--title", default=None, help="Report title (default: the suite names).")
def report_cmd(results: tuple[str, ...], out_dir: str | None, title: str | None) -> None:
    """Build report.html, report.md, results.csv and plots/ from one or more RESULTS stores.

    Every point is paired with its baseline point (same model, precision, world size and
    device; layout chosen by the suite's baseline selector, FSDP by default).
    """
    # pandas and matplotlib (about a second of imports), for this command alone: `moebench` starts without them
    from moebench.report.build import build_report

    if out_dir is None:
        out_dir = str(Path("reports") / find_stores(results[0])[0].parent.name)
    path = build_report(list(results), out_dir, title=title, warn=lambda w: click.echo(f"warning: {w}", err=True))
    click.echo(f"wrote {path}, {path.parent / 'report.md'}, {path.parent / 'results.csv'} and {path.parent / 'plots'}/")


def unrecorded_runs(store: str, warnings: list[str]) -> list[str]:
    """The planned runs (``p001``, ``p001.r1``) of every store under ``store`` without a record; none for a
    store without points.json (written before it: its records are all that is known). A damaged plan
    file is a line in ``warnings``."""
    from moebench.sweep.status import POINTS_FILE, suite_statuses

    missing = []
    for path in find_stores(store):
        if not reader.exists(path / POINTS_FILE):
            continue
        try:
            missing += [run.run_id for run, record in suite_statuses(path, warnings) if record is None]
        except StoreError as exc:
            warnings.append(f"{exc} (planned runs not checked)")
    return missing


@click.command("check", short_help="Regression gate: store vs store, ratios, --against REV.")
@click.argument("stores", nargs=-1, required=True, type=click.Path())
@click.option("--metric", "metrics", multiple=True, metavar="NAME:[+|-]PCT%",
              help="Gate a metric: tokens_per_s:-5% fails on a drop over 5%, peak_mem_bytes:+5% on a rise over "
                   "5% (repeatable; default: tokens_per_s:-5% and peak_mem_bytes:+5%).")
@click.option("--ratio", "ratios", multiple=True, metavar="NUM/DEN:METRIC>=VALUE",
              help="Gate a ratio inside CURRENT, e.g. --ratio 'ddp/fsdp:tokens_per_s>=1.0', or one value per point, "
                   "e.g. --ratio 'fsdp:peak_mem_bytes<=2e9' (quoted: the shell reads > and < as redirections; "
                   "repeatable; see docs/report.md).")
@click.option("--alpha", type=float, default=0.05, show_default=True,
              help="A step-time change counts when the 1-alpha confidence interval from the step samples "
                   "excludes no change.")
@click.option("--min-samples", type=click.IntRange(min=1), default=5, show_default=True,
              help="Fewer step samples than this on either side: judge on the threshold alone.")
@click.option("--format", "fmt", type=click.Choice(["text", "md", "json"]), default="text", show_default=True)
@click.option("--on-inconclusive", type=click.Choice(["fail", "warn"]), default="fail", show_default=True,
              help="A change beyond its threshold that the noise (or a single run) leaves unproven: fail the gate "
                   "(exit 1), or only report it.")
@click.option("--allow-missing", is_flag=True,
              help="A point of BASELINE that CURRENT lacks (with one store: a planned run without a record) does not "
                   "fail the gate (it is still listed).")
@click.option("--allow-unequal-work", is_flag=True,
              help="--ratio: judge a pair whose sides dropped different shares of routes (labelled unequal work) "
                   "instead of refusing it and failing the gate.")
@click.option("--against", metavar="REV", default=None,
              help="Run SUITE on git revision REV and on the working tree, interleaved point by point, and gate "
                   "the working tree against REV (default metric tokens_per_s:-5%).")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="With --against: keep both stores in this folder (baseline/ and current/).")
@click.option("--current-env", multiple=True, metavar="NAME=VALUE",
              help="With --against: set an environment variable for the working tree's runs only (repeatable).")
@click.option("--repeats", type=int, default=None,
              help="With --against: runs per point and side, alternating which side goes first (default: the "
                   "suite's repeats).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help=f"With --against: {TIMEOUT_HELP[0].lower()}{TIMEOUT_HELP[1:]} (default: the suite's `timeout` key).")
@click.option("--mllog", is_flag=True,
              help="With --against and --keep: write each finished run as MLPerf-style ':::MLLOG' lines beside its "
                   "log in the kept stores (logs/<run>.mllog), as moebench run --mllog does.")
def check_cmd(stores: tuple[str, ...], metrics: tuple[str, ...], ratios: tuple[str, ...], alpha: float,
              min_samples: int, fmt: str, on_inconclusive: str, allow_missing: bool, allow_unequal_work: bool,
              against: str | None,
              keep: str | None, current_env: tuple[str, ...], repeats: int | None, timeout: float | None,
              mllog: bool) -> None:
    """Regression gate: check [BASELINE] CURRENT, or check --against REV SUITE.

    With two stores, compares matching points metric by metric; with --ratio, also gates
    ratios measured inside CURRENT (one store is enough then); with --against, runs SUITE on
    REV and on the working tree first (docs/report.md). Exit 0: nothing regressed;
    1: a regression, a newly failed point, a missing point, an inconclusive change (unless
    --on-inconclusive warn), a ratio that clearly does not hold or one between unequal work (unless
    --allow-unequal-work); 2: usage or data error.
    """
    if against is not None:
        from moebench.report.gate.against import against_cmd  # pandas and the sweep runner, only here

        sys.exit(against_cmd(against, stores, metrics, ratios, alpha, min_samples, fmt, keep, current_env,
                             on_inconclusive, allow_missing, repeats, timeout, mllog))
    if keep is not None or current_env or repeats is not None or timeout is not None or mllog:
        raise click.UsageError("--keep, --current-env, --repeats, --timeout and --mllog go with --against REV SUITE")
    # pandas, for this command alone
    from moebench.report.build import machine_warnings
    from moebench.report.gate.check import DEFAULT_METRICS, compare, environment_warnings, parse_metric
    from moebench.report.gate.output import FORMATS, run_header
    from moebench.report.gate.ratio import evaluate_ratio, parse_ratio
    from moebench.results.table import load_tables

    if len(stores) > 2:
        raise click.UsageError("give at most two stores: BASELINE CURRENT")
    if len(stores) == 1 and not ratios:
        raise click.UsageError("one store only supports --ratio gates; give BASELINE CURRENT to compare runs")
    if len(stores) == 1 and metrics:
        raise click.UsageError("--metric compares two runs; give BASELINE CURRENT")
    rules = [parse_metric(m) for m in (metrics or DEFAULT_METRICS)]
    specs = [parse_ratio(r) for r in ratios]
    current, cur_metas, warnings = load_tables([stores[-1]])
    comparison, base_metas = None, []
    if len(stores) == 2:
        base, base_metas, base_warnings = load_tables([stores[0]])
        warnings = base_warnings + warnings + machine_warnings([*base_metas, *cur_metas], "BASELINE and CURRENT")
        warnings += environment_warnings(base, current, base_metas, cur_metas)
        comparison = compare(base, current, rules, alpha=alpha, min_samples=min_samples, allow_missing=allow_missing)
    results = [evaluate_ratio(current, s, alpha=alpha, min_samples=min_samples, allow_unequal_work=allow_unequal_work)
               for s in specs]
    # one store: its own plan says what is missing, as BASELINE does for two (a gate on half the points
    # passed before)
    unrecorded = unrecorded_runs(stores[0], warnings) if comparison is None else []
    failed = (comparison is not None and comparison.exit_code(on_inconclusive)) or not all(r.passed for r in results)
    code = 1 if failed or (unrecorded and not allow_missing) else 0
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    header = run_header(base_metas, cur_metas, (base if comparison is not None else None, current))
    click.echo(FORMATS[fmt](comparison, results, warnings if fmt != "text" else [], code, header, unrecorded,
                            allow_missing))
    sys.exit(code)
