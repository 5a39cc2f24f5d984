"""Run a suite: expand and validate its points, run each in isolation, append to the store.

``run_suite("smoke")`` is the Python entry point; it returns the store folder, which
:func:`moebench.results.load.load_results` and the report read. :func:`run_request` is what
``moebench run`` (and ``moebench claim``, for a claim's suite) does with its options: run the
suite, then say how it went.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shlex
import signal
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moebench.errors import ConfigError, StoreError
from moebench.launch.procs import processes_with_env, stop
from moebench.metrics.host import run_metadata
from moebench.metrics.mllog import write_mllog
from moebench.results import reader
from moebench.results.durable import write_text_atomic
from moebench.results.settle import settle_records
from moebench.results.store import Store, now_iso
from moebench.sweep.binding import bind_plan
from moebench.sweep.launch import STORE_MARKER_ENV, point_env, point_record, run_point, time_limit, with_one_retry
from moebench.sweep.progress import Progress
from moebench.sweep.select import chosen_points, parse_key_values
from moebench.sweep.slurm import check_options, merge_pending, refuse_queued, submit_and_follow
from moebench.sweep.status import POINTS_FILE, failed_points, invalid_points, read_plan, status_table
from moebench.sweep.suite import MAX_POINTS, Point, Suite, check_repeats, load_suite, require_runnable, runs


class SweepInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM to the sweep: unwinds like Ctrl-C so the running point's tree is killed,
    then leaves :func:`run_suite` naming the store, so the CLI can say how to continue it."""

    def __init__(self, signum: int, store: Path | None = None) -> None:
        super().__init__(f"signal {signum}")
        self.signum, self.store = signum, store


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """How :func:`run_suite` runs a suite (``moebench run``'s options), one field per choice.

    ``resume`` runs a store's unrecorded and ``env_failed`` points, ``rerun_failed`` also its non-ok
    ones, ``extend`` (with either) adds the suite's new points to its plan. ``results_dir`` holds fresh
    stores (``<results_dir>/<suite>/<run id>``) when no ``out`` is given. ``progress`` draws the
    progress bar; ``echo`` gets its lines, ``warn`` one line per point that will not run because it
    duplicates another and per line of the store that cannot be read (it stays in the file; its point,
    without a readable record, runs again). ``slurm`` (a :class:`moebench.sweep.slurm.SlurmOptions`)
    submits the points as a job array instead of running them here; ``env`` and ``launcher`` are the
    environment and the command line of a local point (tests stand in a fake trainer). ``overrides``
    (``--set``) sets config fields for every point; they are recorded in meta.json and a continued
    store re-applies its own. ``point_ids`` runs only those points. ``repeats`` (``--repeats``) runs
    each point that many times, over the suite's ``repeats``; a continued store keeps its own unless
    given (more repeats: the new ones run). ``mllog`` (``--mllog``) writes each finished run's MLPerf-style
    log beside its log (``logs/<run>.mllog``, :mod:`moebench.metrics.mllog`); local sweeps only.
    """

    resume: bool = False
    rerun_failed: bool = False
    extend: bool = False
    results_dir: str | Path = "results"
    progress: bool = True
    echo: Callable[[str], None] | None = None
    warn: Callable[[str], None] | None = None
    slurm: Any = None
    env: dict[str, str] | None = None
    launcher: Callable[[Point], list[str]] | None = None
    overrides: dict[str, Any] | None = None
    point_ids: Collection[str] | None = None
    repeats: int | None = None
    mllog: bool = False

    @property
    def continuing(self) -> bool:
        """Whether the sweep continues an existing store (``--resume`` or ``--rerun-failed``)."""
        return self.resume or self.rerun_failed


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What ``moebench run SUITE`` asks for, its options as given: :func:`run_request` turns it into a
    sweep (``moebench claim`` asks the same for a claim's suite). ``overrides`` are the ``--set``
    items (``KEY=VALUE``), ``only`` and ``filters`` those of ``--only`` and ``--filter``, ``progress``
    is not ``--no-progress``, ``slurm`` a :class:`moebench.sweep.slurm.SlurmOptions` (None: run
    here); the other fields are the options of the same names."""

    suite: str
    out: str | None = None
    results_dir: str = "results"
    overrides: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    filters: tuple[str, ...] = ()
    resume: bool = False
    rerun_failed: bool = False
    extend: bool = False
    dry_run: bool = False
    allow_failures: bool = False
    progress: bool = True
    slurm: Any = None
    max_points: int = MAX_POINTS
    oversubscribe: bool = False
    repeats: int | None = None
    trace: bool = False
    mllog: bool = False
    timeout: float | None = None


def with_timeout(suite: Suite, timeout: float | None) -> Suite:
    """The suite with ``--timeout`` as its per-run limit (unchanged without one)."""
    return suite if timeout is None else dataclasses.replace(suite, timeout_s=float(timeout))


def run_request(request: RunRequest, echo: Callable[[str], None], err: Callable[[str], None],
                continue_line: Callable[[Path], str]) -> int:
    """Do what ``request`` asks: print the plan (``dry_run``), or run the suite into its store and say
    how it went, ``echo`` taking the lines of the run and ``err`` the warnings and what is not ok.
    Returns the exit code: 0, 1 when a point chosen to run is not ok (unless ``allow_failures``), or
    128 + the signal that interrupted the sweep, after naming the store and the command that
    continues it (``continue_line(store)``)."""
    # the local ranks count GPUs, which imports torch: only a run that runs here asks
    from moebench.launch.leader import local_ranks

    if request.max_points < 1:
        raise ConfigError(f"--max-points {request.max_points}: must be >= 1")
    check_out(request.out, request.resume or request.rerun_failed)
    spec = with_timeout(dataclasses.replace(load_suite(request.suite), max_points=request.max_points,
                                            oversubscribe=request.oversubscribe), request.timeout)
    if request.slurm is None and not request.oversubscribe:
        spec = dataclasses.replace(spec, local_ranks=local_ranks())
    overrides = (*request.overrides, "train.trace=true") if request.trace else request.overrides
    sets = parse_key_values(overrides, "--set")
    points = spec.with_set(sets).points()  # a bad --set, --only or --filter stops here, before any store exists
    only, filters = request.only, request.filters
    chosen = {p.point_id for p in chosen_points(points, only, filters)} if only or filters else None
    if request.dry_run:
        echo(f"suite {spec.name}: {spec.description}".rstrip(": "))
        echo(plan_table([p for p in points if chosen is None or p.point_id in chosen]))
        require_runnable(spec, points)
        return 0
    try:
        path = run_suite(spec, request.out, SweepOptions(
            resume=request.resume, rerun_failed=request.rerun_failed, extend=request.extend,
            results_dir=request.results_dir, progress=request.progress, echo=echo,
            warn=lambda line: err(f"warning: {line}"), slurm=request.slurm, overrides=sets, point_ids=chosen,
            repeats=request.repeats, mllog=request.mllog))
    except SweepInterrupted as exc:
        name = signal.Signals(exc.signum).name
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            err(f"interrupted by {name}; finished points are kept in the store: {exc.store}")
            err(f"continue with: {continue_line(exc.store)}")
        return 128 + exc.signum
    echo(status_table(path).splitlines()[-1])
    echo(f"store: {path}")
    echo(f"render it: moebench report {shlex.quote(str(path))}")
    if request.allow_failures:
        return 0
    # with --only/--filter, the points left out are not this run's failures
    invalid = {k: why for k, why in invalid_points(path).items() if chosen is None or k in chosen}
    rerun = [k for k in failed_points(path)  # run ids: p001 or p001.r2
             if k.split(".")[0] not in invalid and (chosen is None or k.split(".")[0] in chosen)]
    if rerun:
        err(f"{len(rerun)} point(s) not ok: {', '.join(rerun)} (rerun them with --out {path} --rerun-failed)")
    for point_id, reason in invalid.items():
        err(f"{point_id} invalid (a rerun cannot fix it; change the suite): {reason}")
    return 1 if rerun or invalid else 0


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def default_out(suite: Suite, results_dir: str | Path = "results") -> Path:
    return Path(results_dir) / suite.name / new_run_id()


def select_points(
    points: list[Point], latest: dict[tuple[str, int], dict[str, Any]], resume: bool, rerun_failed: bool
) -> list[Point]:
    """Runs still to do (``points`` are runs: a point at a repeat): all (fresh store), unrecorded or
    ``env_failed`` ones (--resume), or also non-ok ones (--rerun-failed); ``latest`` is keyed by (key, repeat)."""
    if rerun_failed:
        return [p for p in points if latest.get((p.key, p.repeat), {}).get("status") != "ok"]
    if resume:
        return [p for p in points if (p.key, p.repeat) not in latest
                or latest[(p.key, p.repeat)].get("status") == "env_failed"]
    return list(points)


def plan_table(points: list[Point]) -> str:
    """The expanded points as an aligned text table, with invalid points and their reason."""
    axes = list(dict.fromkeys(k for p in points for k in p.values))
    header = ["point", *axes, "nproc", "valid"]
    rows = [[p.point_id, *(str(p.values.get(a, "")) for a in axes), str(p.nproc or "-"),
             "yes" if p.valid else f"NO: {p.error}"] for p in points]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    n_bad = sum(not p.valid for p in points)
    lines.append(f"{len(points)} points, {len(points) - n_bad} valid, {n_bad} invalid")
    return "\n".join(lines)


def suite_meta(suite: Suite, run_id: str, points: list[Point]) -> dict[str, Any]:
    return {"suite": suite.name, **suite_fields(suite, points), "set": suite.cli_set, "run_id": run_id,
            "created_at": now_iso(), **run_metadata()}


def suite_fields(suite: Suite, points: list[Point]) -> dict[str, Any]:
    """The meta.json fields that describe a store's suite and plan: a continued store keeps them true."""
    return {"description": suite.description, "suite_file": suite.source, "suite_spec": suite.to_dict(),
            "baseline": suite.baseline, "n_points": len(points), "repeats": suite.repeats}


def plan_text(points: list[Point]) -> str:
    """``points.json``: every planned point, as :func:`read_plan` reads it back."""
    return json.dumps({"points": [p.to_dict() for p in points]}, indent=2, sort_keys=True) + "\n"


def check_out(out: str | Path | None, continuing: bool) -> None:
    """The store ``--out`` names, as far as it is checked before anything runs (the command calls this
    before it counts the local GPUs, which imports torch)."""
    if continuing and out is None:
        raise StoreError("--resume and --rerun-failed continue an existing store: name it with --out")
    if out is not None and not str(out).strip():
        raise StoreError("--out '': an empty path names no folder (it would be the current one); name the store folder")


def open_store(suite: Suite, points: list[Point], out: str | Path | None, options: SweepOptions) -> Store:
    """Create a fresh store (meta.json and points.json at once), or check that the one named by
    ``out`` holds this suite (its plan is checked against the points under the lock, later).

    Slurm options (``options.slurm``) are checked against the store path and the runnable points first:
    a typo in one must not leave a half-made store of meta.json and invalid records behind.
    """
    results_dir = options.results_dir
    check_out(out, options.continuing)
    path = Path(out) if out is not None else default_out(suite, results_dir)
    store = Store(path)
    if options.slurm is not None:
        check_options(options.slurm, store, suite.name, [p for p in points if p.valid])
    if options.continuing:
        meta = store.read_meta()
        if meta.get("suite") != suite.name:
            raise StoreError(f"{path} holds suite {meta.get('suite')!r}, not {suite.name!r} "
                             f"(field 'suite' of {store.meta_path})")
    else:
        store.create(suite_meta(suite, path.name, points), {POINTS_FILE: plan_text(points)})
        if path.resolve().parent == (Path(results_dir) / suite.name).resolve():  # not into any --out's parent
            store.link_latest()
    return store


def continue_plan(store: Store, suite: Suite, points: list[Point], extend: bool) -> list[Point]:
    """The points a continued store runs: its own plan, bound to ``suite`` (a changed suite is a
    StoreError naming the first change; ``extend`` appends the suite's new points). points.json and
    meta.json are rewritten only when they change, points.json first (caller holds the lock).

    That order is recoverable: meta.json's ``n_points`` is the plan's length as of its last write,
    so points beyond it are the ones an ``--extend`` stopped between the two writes (a kill) had
    added; their ``extended`` entry is written now, marked ``recovered``.
    """
    meta = store.read_meta()
    path = store.path / POINTS_FILE
    plan = read_plan(store) if reader.exists(path) else []  # no plan (a store made before the first point): all new
    bound = bind_plan(plan, points, extend, str(path), (meta.get("versions") or {}).get("moebench"))
    text = plan_text(bound)
    if json.loads(text)["points"] != plan or not path.exists():
        write_text_atomic(path, text)
    fields = suite_fields(suite, bound)
    history = list(meta.get("extended") or [])
    known = meta.get("n_points")
    if isinstance(known, int) and not isinstance(known, bool) and 0 < known < len(plan):
        history.append({"at": now_iso(), "points": [d["point_id"] for d in plan[known:]], "recovered": True})
    added = [p.point_id for p in bound[len(plan):]]
    if added:
        history.append({"at": now_iso(), "points": added})
    if history != list(meta.get("extended") or []):
        fields["extended"] = history
    if any(meta.get(k) != v for k, v in fields.items()):
        store.update_meta(**fields)
    return bound


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP to the sweep, once :meth:`catching` is entered (main thread only).

    Between points a signal raises :class:`SweepInterrupted` at once. While a point runs or its
    record is written (:meth:`held`) it only sets :attr:`stop`: the point's tree is stopped, a run
    that had finished is still recorded, and then the sweep leaves.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.signum: int | None = None
        self._holding = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.stop.set()
        if not self._holding:
            raise SweepInterrupted(signum)

    @contextlib.contextmanager
    def catching(self) -> Iterator[Interrupts]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.signum is not None:
            raise SweepInterrupted(self.signum)


def stop_leftovers(store: Store, warn: Callable[[str], None] | None, grace_s: float = 2.0) -> None:
    """Stop every process an earlier local run of this store left behind (found by the store marker
    in its environment), so none competes with the points about to run. Called under the store's
    lock: no live sweep owns such a process."""
    pids = processes_with_env(STORE_MARKER_ENV, _marker(store))
    if not pids:
        return
    if warn is not None:
        warn(f"{len(pids)} process(es) of an earlier run of {store.path} were still running "
             f"(pid {', '.join(map(str, pids))}); stopped them before running any point")
    stop(pids, grace_s)


def _marker(store: Store) -> str:
    return str(store.path.resolve())


def run_suite(suite: str | Path | Suite, out: str | Path | None = None, options: SweepOptions | None = None) -> Path:
    """Run every point of ``suite`` (a name in suites/, a YAML path, or a Suite) into a store, as
    ``options`` says (default: a fresh store under ``results/``, every point).

    Returns the store folder. Failing points are recorded (``failed``/``oom``/``timeout``/
    ``invalid``) and the sweep continues. A continued store must hold this suite's points
    (:mod:`moebench.sweep.binding`); ``options.extend`` adds the new ones.
    """
    options = options or SweepOptions()
    if options.mllog and options.slurm is not None:
        raise ConfigError("--mllog writes each point's log from the sweep that runs it: not with --slurm")
    if options.extend and not options.continuing:
        raise ConfigError("--extend adds points to an existing store: use it with --resume or --rerun-failed")
    if options.extend and options.point_ids is not None:
        raise ConfigError("--extend adds every new point of the suite: drop --only/--filter "
                          "(a later --resume can run a subset)")
    suite = suite if isinstance(suite, Suite) else load_suite(suite)
    if options.continuing and out is not None:
        suite = _with_stored_set(suite, Store(out), options.overrides or {})
    else:
        suite = suite.with_set(options.overrides or {})
    if options.repeats is not None:
        suite = dataclasses.replace(suite, repeats=check_repeats(options.repeats, "--repeats"))
    elif options.continuing and out is not None:
        stored = Store(out).read_meta().get("repeats")
        suite = dataclasses.replace(suite, repeats=check_repeats(stored or 1, f"{Store(out).meta_path}: repeats"))
    points = suite.points()
    require_runnable(suite, points)
    store = open_store(suite, points, out, options)
    try:
        _run_points(store, suite, points, options)
    except KeyboardInterrupt as exc:
        raise SweepInterrupted(getattr(exc, "signum", signal.SIGINT), store.path) from None
    return store.path


def _run_points(store: Store, suite: Suite, points: list[Point], options: SweepOptions) -> None:
    warn, slurm = options.warn, options.slurm
    with sweeping([store], warn) as interrupts:
        # chosen by key: a continued store keeps its own point ids, which an extended plan no longer shares
        chosen = None if options.point_ids is None else {p.key for p in points if p.point_id in options.point_ids}
        if options.continuing:
            points = continue_plan(store, suite, points, options.extend)
        for line in _skipped(store, points) if warn is not None else []:
            warn(line)
        # a duplicate shares its twin's key, so recording it would overwrite the twin's result
        todo = [p for p in select_points(runs(points, suite.repeats), store.latest_by_run(), options.resume,
                                         options.rerun_failed)
                if not p.duplicate_of and (chosen is None or p.key in chosen)]
        if slurm is None:
            refuse_queued(store, [p for p in todo if p.valid])  # run here, they would run twice
        with Progress(len(todo), enabled=options.progress, echo=options.echo, baseline=suite.baseline) as bar:
            runnable = []
            for point in todo:
                if point.valid:
                    runnable.append(point)
                    continue
                record = point_record(point, "invalid", point.error)
                store.append(record)
                bar.finished(record)
            if slurm is not None:
                submit_and_follow(store, runnable, slurm, bar, warn)
                return
            run_here([(point, store) for point in runnable], options, interrupts, Watch(bar, warn))


@contextlib.contextmanager
def sweeping(stores: Sequence[Store], warn: Callable[[str], None] | None) -> Iterator[Interrupts]:
    """The sweep's hold on its stores (``moebench run``: one; ``check --against``: one per side): each
    locked, then, before any point runs, cleared of what an earlier run left (its processes stopped,
    its waiting records merged), with the sweep's signals caught (:class:`Interrupts`) until the
    block ends."""
    with contextlib.ExitStack() as stack:
        for store in stores:
            stack.enter_context(store.locked())
        interrupts = stack.enter_context(Interrupts().catching())
        for store in stores:
            stop_leftovers(store, warn)
            # records of Slurm tasks that finished after their sweep stopped (any later run, with or without
            # --slurm), then records a full disk kept out of records.jsonl (after: one of those may be a pending
            # record's copy)
            merge_pending(store, warn)
            store.merge_unsaved(warn)
        yield interrupts


class Watch:
    """What :func:`run_here` says as it goes: the progress bar follows the running point and prints a
    line per finished run; ``warn`` says which runs timed out and run once more. ``check --against``
    says it its own way (:mod:`moebench.sweep.against`)."""

    def __init__(self, bar: Progress, warn: Callable[[str], None] | None = None) -> None:
        self.bar, self.warn = bar, warn

    def started(self, point: Point, store: Store) -> None:
        self.bar.started(point.run_id, store.log_path(point.run_id))

    def finished(self, point: Point, store: Store, record: dict[str, Any], position: tuple[int, int],
                 retry: tuple[int, int] | None) -> None:
        """``record`` is in ``store``; the run was ``position`` (i of n) of the order, and ``retry`` (j of n)
        of the timed-out runs tried again (None in the first pass)."""
        self.bar.finished(record)

    def retrying(self, timed_out: list[tuple[Point, Store]]) -> None:
        self.bar.add(len(timed_out))
        if self.warn is not None:
            self.warn(f"{len(timed_out)} run(s) timed out ({', '.join(p.run_id for p, _ in timed_out)}): "
                      "trying each once more")


def run_here(order: Sequence[tuple[Point, Store]], options: SweepOptions, interrupts: Interrupts, watch: Watch,
             envs: Mapping[Path, dict[str, str]] | None = None) -> None:
    """Run each (point, store) of ``order`` here, in that order, and record it into its store, then once more
    each run that timed out (:func:`moebench.sweep.launch.with_one_retry`): the loop of ``moebench run``
    (one store) and of ``check --against`` (a store per side, their runs interleaved), inside
    :func:`sweeping`, which gives ``interrupts``.

    A run's environment is its store's ``envs`` entry (default ``options.env``), the store's CPU peak
    file and its marker, by which any process a run leaves behind is found and stopped after it;
    its time limit grows with the store's earlier runs of its point (:func:`moebench.sweep.launch.time_limit`).
    """
    stores = {store.path: store for _, store in order}
    env = {path: {**((envs or {}).get(path, options.env) or {}), **point_env(store), STORE_MARKER_ENV: _marker(store)}
           for path, store in stores.items()}
    earlier: dict[tuple[Path, str], list[dict[str, Any]]] = {}  # (store, key) -> records of its runs so far
    for path, store in stores.items():
        for (key, _), rec in store.latest_by_run().items():
            earlier.setdefault((path, key), []).append(rec)

    def run_one(item: tuple[int, Point, Store], retry: tuple[int, int] | None) -> dict[str, Any] | None:
        """Run one point here and record it; its record (None: stopped by an interrupt before it finished)."""
        i, point, store = item
        done = earlier.setdefault((store.path, point.key), [])
        with interrupts.held():
            watch.started(point, store)
            try:
                record = run_point(point, store.log_path(point.run_id), env=env[store.path],
                                   launcher=options.launcher, stop=interrupts.stop, limit_s=time_limit(point, done))
                if record is not None:
                    store.append(record)
                    done.append(record)
                    if options.mllog:
                        _write_mllog(record, store.log_path(point.run_id).with_suffix(".mllog"), options.warn)
                    watch.finished(point, store, record, (i, len(order)), retry)
            finally:
                # defence in depth: nothing of a finished point may compete with the next one (of any
                # store), even when the watch stops the loop here
                stop_leftovers(store, None)
        return record

    with_one_retry([(i, point, store) for i, (point, store) in enumerate(order, 1)], run_one,
                   lambda timed_out: watch.retrying([(point, store) for _, point, store in timed_out]))


def _write_mllog(record: dict[str, Any], path: Path, warn: Callable[[str], None] | None) -> None:
    """The run's MLPerf-style log beside its log; a failed write is a warning (the record is kept)."""
    try:
        write_mllog(record, path)
    except OSError as exc:
        if warn is not None:
            warn(f"{path}: could not write the MLLOG file: {exc.strerror or exc}")


def _with_stored_set(suite: Suite, store: Store, given: dict[str, Any]) -> Suite:
    """The suite with the ``--set`` values the store was started with: a continued store's points
    must resolve to the configs (and keys) already recorded."""
    stored = suite.with_set(store.read_meta().get("set") or {}, source=f"{store.meta_path}: field 'set': ")
    if given and suite.with_set(given).cli_set != stored.cli_set:
        have = " ".join(f"--set {k}={v}" for k, v in stored.cli_set.items()) or "no --set"
        raise StoreError(f"{store.path} was started with {have} (field 'set' of {store.meta_path}); "
                         "drop --set to continue it with those, or start a new store")
    return stored


def _skipped(store: Store, points: list[Point]) -> list[str]:
    """What a sweep leaves aside without recording it: unreadable store lines, duplicate points."""
    records, problems = store.read_records(strict=False)
    lines = [f"{problem} (left in the file; a point without a readable record runs again)" for problem in problems]
    lines += settle_records(records, store.path)[1]
    lines += [f"{p.point_id} resolves to the same config as {p.duplicate_of}: not run, it shares that point's record"
              for p in points if p.duplicate_of]
    return lines
