"""``moebench run SUITE`` and ``moebench status RUN``."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.load import find_stores
from moebench.results.settle import settle_records
from moebench.results.side_files import unsaved_warning
from moebench.results.store import Store
from moebench.sweep.suite import MAX_POINTS

TIMEOUT_HELP = ("Time limit of each run, in seconds of a fair share of the machine: on a machine loaded past its "
                "cores a run gets as much more wall time as the load takes from it; a timed-out run is tried once "
                "more at the end")


@click.command("run", short_help="Run a suite into a results store.")
@click.argument("suite")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Store folder (default results/<suite>/<run-id>/); names the store to continue with --resume.")
@click.option("--results-dir", default="results", show_default=True, help="Parent folder of default stores.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Set a config field for every point, e.g. --set train.steps=5 (repeatable; kept in the store, "
                   "so --resume applies it again).")
@click.option("--only", multiple=True, metavar="IDS", help="Run only these points, e.g. --only p001,p003.")
@click.option("--filter", "filters", multiple=True, metavar="AXIS=VALUE",
              help="Run only the points with this axis value, e.g. --filter moe.num_experts=16 (repeatable: all).")
@click.option("--resume", is_flag=True, help="Continue the store named by --out: run only points without a record.")
@click.option("--rerun-failed", is_flag=True, help="Continue the store named by --out: rerun points that are not ok.")
@click.option("--extend", is_flag=True,
              help="With --resume/--rerun-failed: add the edited suite's new points to the store (the recorded "
                   "points stay as they are); without it a changed suite is refused.")
@click.option("--dry-run", is_flag=True, help="Print the expanded points, which are invalid and why; run nothing.")
@click.option("--allow-failures", is_flag=True, help="Exit 0 even when some points did not finish ok.")
@click.option("--no-progress", is_flag=True, help="No progress bar (summary lines only).")
@click.option("--slurm", is_flag=True, help="Submit the points as a Slurm job array and follow it.")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--account", default=None, help="Slurm account.")
@click.option("--time", "time_limit", default=None, help="Slurm time limit per task (default: the point timeout).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes per point (multi-node: srun torchrun).")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default: none requested).")
@click.option("--cpus-per-task", type=int, default=None, help="CPUs per task.")
@click.option("--extra", multiple=True, metavar="OPT", help="Extra sbatch option, e.g. --extra=--qos=high.")
@click.option("--poll", type=float, default=5.0, show_default=True, help="Seconds between Slurm state polls.")
@click.option("--max-points", type=int, default=MAX_POINTS, show_default=True,
              help="Refuse a suite that expands to more points than this.")
@click.option("--oversubscribe", is_flag=True,
              help="Run local points with more ranks than this machine has GPUs (or, on CPU, CPUs).")
@click.option("--repeats", type=int, default=None,
              help="Runs per point, each in its own process tree, round-robin over the points (default: the "
                   "suite's repeats, 1 if it has none; a continued store: its own).")
@click.option("--requeue", is_flag=True,
              help="Let Slurm requeue tasks (preemptible partitions); a requeued task still records its point once.")
@click.option("--trace", is_flag=True,
              help="Write a torch.profiler Chrome trace per rank of every point's profiled steps beside its logs "
                   "(the same as --set train.trace=true); the report links them.")
@click.option("--mllog", is_flag=True,
              help="Write each finished run as MLPerf-style ':::MLLOG' lines beside its log (logs/<run>.mllog).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help=f"{TIMEOUT_HELP} (default: the suite's `timeout` key).")
def run_cmd(suite: str, out: str | None, results_dir: str, overrides: tuple[str, ...], only: tuple[str, ...],
            filters: tuple[str, ...], resume: bool, rerun_failed: bool, extend: bool, dry_run: bool,
            allow_failures: bool, no_progress: bool, slurm: bool, partition: str | None, account: str | None,
            time_limit: str | None, nodes: int, gpus_per_node: int | None, cpus_per_task: int | None,
            extra: tuple[str, ...], poll: float, max_points: int, oversubscribe: bool,
            repeats: int | None, requeue: bool, trace: bool, mllog: bool, timeout: float | None) -> None:
    """Run a suite (a name in suites/ or a YAML path) into a results store."""
    # the runner and what it runs (~130 ms of imports), for this command alone: `moebench` starts without them
    from moebench.sweep.runner import RunRequest, run_request
    from moebench.sweep.slurm import SlurmOptions

    slurm_options = None
    if slurm:
        slurm_options = SlurmOptions(partition=partition, account=account, time=time_limit, nodes=nodes,
                                     gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, extra=list(extra),
                                     poll_s=poll, requeue=requeue)
    request = RunRequest(
        suite=suite, out=out, results_dir=results_dir, overrides=overrides, only=only, filters=filters,
        resume=resume, rerun_failed=rerun_failed, extend=extend, dry_run=dry_run, allow_failures=allow_failures,
        progress=not no_progress, slurm=slurm_options, max_points=max_points, oversubscribe=oversubscribe,
        repeats=repeats, trace=trace, mllog=mllog, timeout=timeout)
    params = click.get_current_context().params
    code = run_request(request, click.echo if dry_run else StdoutOrNothing(),
                       lambda line: click.echo(line, err=True), lambda store: continue_command(params, store))
    if code:
        sys.exit(code)


class StdoutOrNothing:
    """``click.echo`` to stdout until stdout goes away (``moebench run ... | head -1``); from then on
    lines are dropped, once said on stderr, and the sweep goes on (a closed pipe must not stop it)."""

    def __init__(self) -> None:
        self.closed = False

    def __call__(self, line: str) -> None:
        if self.closed:
            return
        try:
            click.echo(line)
        except BrokenPipeError:
            self.closed = True
            # what is still buffered, and the interpreter's flush at exit, go nowhere instead of failing
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            with contextlib.suppress(OSError):
                click.echo("stdout was closed: the sweep goes on; `moebench status STORE` shows every point",
                           err=True)


# Options that choose the store or what to do with it; continue_command sets them itself.
_STORE_OPTIONS = ("out", "results_dir", "resume", "rerun_failed", "dry_run")


def continue_command(params: Mapping[str, Any], store: Path) -> str:
    """The ``moebench run`` line that continues ``store``: the options ``params`` gives (``moebench run``'s
    parameter values by name; one left out is at its default), with ``--out STORE`` and ``--resume``,
    or ``--rerun-failed`` when that was running."""
    argv = ["moebench", "run", params["suite"], "--out", str(store)]
    argv.append("--rerun-failed" if params.get("rerun_failed") else "--resume")
    for param in run_cmd.params:
        value = params.get(param.name)
        if not isinstance(param, click.Option) or param.name in _STORE_OPTIONS or value in (None, False, ()) \
                or value == param.default:
            continue
        opt = max(param.opts, key=len)
        if param.is_flag:
            argv.append(opt)
            continue
        for item in value if param.multiple else [value]:
            # --extra=--qos=high: a value that starts with a dash must be glued to its option
            argv += [f"{opt}={item}"] if str(item).startswith("-") else [opt, str(item)]
    return shlex.join(argv)


@click.command("status", short_help="Show the state of each point of a run.")
@click.argument("run")
def status_cmd(run: str) -> None:
    """Show each point's state: RUN is what `moebench report` reads (a store folder, its records.jsonl,
    a folder of stores such as results/smoke) or a run id under results/*/."""
    # the runner (~130 ms of imports), for this command alone
    from moebench.sweep.slurm import live_states, pending_records
    from moebench.sweep.status import status_table

    stores = find_stores(_run_id_folder(run) or run)
    for i, path in enumerate(stores):
        if len(stores) > 1:
            if i:
                click.echo()
            click.echo(f"store: {path}")
        # read-only: no lock, no merge, no repair, so watching a running sweep (or someone else's store) changes nothing
        store = Store(path)
        # a records.jsonl that cannot be read at all (a FIFO, a device, a link loop, too big) fails
        # status as it fails report, check and --resume (exit 2); bad lines are warnings below
        with contextlib.suppress(FileNotFoundError):  # no point finished yet
            next(reader.lines(store.records_path), None)
        records, problems = store.read_records(strict=False)
        unsaved = store.unsaved_records(problems)
        pending_records(store, problems)
        for warning in problems:
            click.echo(f"warning: {warning} (not read)", err=True)
        for warning in settle_records(records, path)[1]:
            click.echo(f"warning: {warning}", err=True)
        if unsaved:
            click.echo(f"warning: {unsaved_warning(path, unsaved)}", err=True)
        click.echo(status_table(path, live_states(path)))


def _run_id_folder(run: str) -> Path | None:
    """The store a bare run id names (``results/<suite>/<run-id>``); None when ``run`` is a path."""
    if Path(run).exists() or "/" in run:
        return None
    matches = sorted(Path("results").glob(f"*/{run}"))
    if len(matches) > 1:
        raise StoreError(f"run id {run!r} is ambiguous: {', '.join(map(str, matches))}; pass the folder")
    if not matches:
        raise StoreError(f"no store {run!r}: pass a store folder, a folder of stores or a run id under results/*/")
    return matches[0]
