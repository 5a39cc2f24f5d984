"""``moebench claim``: judge published claims by running their suites, or on stores that exist."""

from __future__ import annotations

import sys

import click

from moebench.claim.spec import check_suite, load_claim, suite_for
from moebench.errors import StoreError
from moebench.results.claims_file import write_claims
from moebench.results.load import find_stores
from moebench.sweep.cli import StdoutOrNothing, continue_command
from moebench.sweep.suite import load_suite


@click.command("claim", short_help="Judge published claims: run their suites (or read stores) and say if they hold.")
@click.argument("claims", nargs=-1, required=True)
@click.option("--store", "stores", multiple=True, type=click.Path(),
              help="Judge this store (a store folder, records.jsonl or folder of stores) instead of running the "
                   "claims' suites (repeatable: judged together).")
@click.option("--results-dir", default="results", show_default=True, help="Parent folder of the stores it runs.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Set a config field for every point of the suites it runs (as moebench run --set).")
@click.option("--repeats", type=int, default=None, help="Runs per point of the suites it runs (default: the suite's).")
@click.option("--oversubscribe", is_flag=True, help="Run local points with more ranks than this machine has devices.")
@click.option("--no-record", is_flag=True, help="Do not write the verdicts into the stores' claims.json.")
@click.option("--no-carry", is_flag=True,
              help="Do not carry claims with a published_setup to it (fit a profile on the stores, plan the setup).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def claim_cmd(claims: tuple[str, ...], stores: tuple[str, ...], results_dir: str,
              overrides: tuple[str, ...], repeats: int | None, oversubscribe: bool, no_record: bool, no_carry: bool,
              fmt: str) -> None:
    """Judge each CLAIM (a name in claims/ or a YAML path): holds, does not hold, or inconclusive.

    Without --store, runs each claim's suite once (as `moebench run SUITE` does, into
    results/<suite>/<run-id>/; where CUDA is available, the claim's suite_gpu when it names one)
    and judges the new store; with --store, judges those stores and runs
    nothing. A claim with a published_setup is also carried there: the planner's profile is fitted
    on the judged stores (as `moebench plan --calibrate --holdout half`), the setup planned with it,
    and the planned value printed beside the published one with the held-out error (--no-carry:
    not). The verdicts are written into the judged stores (claims.json), so `moebench report`
    shows them in its Claims section. Exit 0: every claim holds or is inconclusive; 1: a claim does
    not hold; 2: a bad claim file, option or store (docs/claims.md).
    """
    import json

    # pandas (a quarter of a second of imports), for this command alone: `moebench` starts without it
    from moebench.claim.carry import calibrate_stores, carry
    from moebench.claim.judge import FAILS, judge
    from moebench.results.table import load_tables

    loaded = [load_claim(c) for c in claims]  # every file is checked before anything runs
    if stores and (overrides or repeats is not None or oversubscribe):
        raise click.UsageError("--set, --repeats and --oversubscribe go with running the suites, not with --store")
    groups: dict[str, list] = {}
    cuda = False if stores else cuda_available()  # a claim's suite_gpu runs where CUDA is
    for claim in loaded:
        check_suite(claim)
        groups.setdefault("\n".join(stores) if stores else suite_for(claim, cuda), []).append(claim)
    verdicts = []
    for key, group in groups.items():
        paths = list(stores) if stores else [_run_suite(key, results_dir, overrides, repeats, oversubscribe)]
        table, metas, warnings = load_tables(paths, strict=False)
        for w in warnings:
            click.echo(f"warning: {w}", err=True)
        judged = [judge(claim, table, metas, paths) for claim in group]
        if not no_carry and any(claim.planned for claim in group):
            calibration = calibrate_stores(paths)  # one fit for every claim judged on these stores
            for claim, verdict in zip(group, judged, strict=True):
                verdict.carried = carry(claim, calibration)
        verdicts += judged
        if no_record:
            continue
        for store in (s for p in paths for s in find_stores(p)):
            try:
                write_claims(store, [v.to_dict() for v in judged])
            except StoreError as exc:  # a read-only store is still judged
                click.echo(f"warning: verdicts not recorded: {exc}", err=True)
    if fmt == "json":
        click.echo(json.dumps([v.to_dict() for v in verdicts], indent=2))
    else:
        click.echo("\n\n".join("\n".join(v.lines()) for v in verdicts))
    sys.exit(1 if any(v.verdict == FAILS for v in verdicts) else 0)


def cuda_available() -> bool:
    """Whether this machine runs CUDA, asked when the suites are about to run (torch is imported here,
    not when the command is)."""
    import torch

    return bool(torch.cuda.is_available())


def _run_suite(suite: str, results_dir: str, overrides: tuple[str, ...], repeats: int | None,
               oversubscribe: bool) -> str:
    """Run ``suite`` into a new store as ``moebench run SUITE`` does (the runner's :func:`run_request`); its
    path. Failed points are recorded and judged (inconclusive), not fatal; an interrupt exits as
    ``moebench run`` does, naming the ``moebench run`` line that continues the store."""
    from moebench.sweep.runner import RunRequest, default_out, run_request  # the runner (~130 ms of imports)

    out = str(default_out(load_suite(suite), results_dir))
    request = RunRequest(suite=suite, out=out, results_dir=results_dir, overrides=overrides, repeats=repeats,
                         oversubscribe=oversubscribe, allow_failures=True, progress=False)
    # the same run as `moebench run`'s options (its parameter names) say it
    params = {"suite": suite, "overrides": overrides, "repeats": repeats, "oversubscribe": oversubscribe,
              "allow_failures": True, "no_progress": True}
    code = run_request(request, StdoutOrNothing(), lambda line: click.echo(line, err=True),
                       lambda store: continue_command(params, store))
    if code:
        sys.exit(code)
    return out
