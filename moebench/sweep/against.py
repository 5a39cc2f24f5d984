"""The running half of ``moebench check --against REV SUITE``: a suite on another commit and on
the working tree, measured here, interleaved, one results store per side.

As asv's ``continuous`` does, both sides run on this machine in one session: REV is checked
out into a temporary git worktree and its points run with ``PYTHONPATH`` pointing there
(``PYTHONSAFEPATH=1`` keeps the current directory from shadowing it, in every rank torchrun
starts), the working tree's points with ``PYTHONPATH`` pointing at the checkout this moebench
runs from. The two are interleaved point by point (baseline p000, current p000, baseline
p001, ...), so load or thermal drift on a shared machine hits both sides alike instead of
all of one side. With the suite's ``repeats`` (``check --against --repeats N``) every point runs
N times per side, round-robin over the points, and the side that goes first alternates with
the repeat (repeat 0 baseline first, repeat 1 current first, ...), so neither side always
runs on the machine its twin just warmed. The runs go through ``moebench run``'s own loop
(:func:`moebench.sweep.runner.run_here`, an ordered list of (point, store) pairs), so what one
run leaves running is stopped before the next, of either side. The gate that judges the two
stores is :mod:`moebench.report.gate.against`.

The suite is expanded, and the stores written, by the working tree's code; REV contributes
only what is measured: its ``moebench train``. A REV whose trainer rejects one of the
suite's settings records that point as failed on the baseline side.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebench.errors import ConfigError, LaunchError, StoreError
from moebench.launch.procs import SAFE_PATH_ENV
from moebench.metrics.host import REPO_ROOT, git_info
from moebench.results.store import Store
from moebench.sweep.progress import Progress, describe, metric_parts
from moebench.sweep.runner import (
    Interrupts,
    SweepOptions,
    Watch,
    new_run_id,
    plan_text,
    run_here,
    suite_meta,
    sweeping,
)
from moebench.sweep.status import POINTS_FILE
from moebench.sweep.suite import Point, Suite, require_runnable, runs

SIDES = ("baseline", "current")
WORK_PREFIX = "moebench-against-"  # the temporary folder of one call: REV's worktree and the stores
OWNER_FILE = "owner.pid"  # in it: the pid of the call that made it, so a later call knows it is orphaned


@dataclass(frozen=True)
class Side:
    """One side of the comparison: which code its points import and where its records go."""

    name: str  # "baseline" (REV) or "current" (the working tree)
    code_root: Path
    commit: str | None
    dirty: bool
    store: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        short = self.commit[:10] if self.commit else "unknown"
        return f"{self.name} {short}{'+dirty' if self.dirty else ''}"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("check --against needs git, and there is no git on PATH") from None


def resolve_rev(rev: str, repo: Path) -> str:
    """The full commit hash of ``rev`` in the git checkout ``repo`` (ConfigError: not a repo, unknown rev)."""
    if _git(repo, "rev-parse", "--show-toplevel").returncode != 0:
        raise ConfigError(f"--against {rev}: {repo} is not a git repository (moebench runs from there)")
    if not rev or rev.startswith("-"):
        raise ConfigError(f"--against {rev!r}: not a revision")
    out = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if out.returncode != 0 or not out.stdout.strip():
        raise ConfigError(f"--against {rev}: unknown revision in {repo} (a commit, branch or tag, e.g. HEAD~1)")
    return out.stdout.strip()


@contextlib.contextmanager
def checked_out(repo: Path, commit: str, dest: Path) -> Iterator[Path]:
    """A detached git worktree of ``commit`` at ``dest``, removed again on the way out."""
    out = _git(repo, "worktree", "add", "--detach", "--quiet", str(dest), commit)
    if out.returncode != 0:
        raise StoreError(f"cannot check out {commit[:10]} into {dest}: {out.stderr.strip().splitlines()[-1:]}")
    try:
        yield dest
    finally:
        _git(repo, "worktree", "remove", "--force", str(dest))
        _git(repo, "worktree", "prune")


def side_env(code_root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes ``python -m moebench.cli`` (and torchrun's ranks) import ``code_root``."""
    path = os.pathsep.join(p for p in (str(code_root), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **SAFE_PATH_ENV, **(extra or {})}


def interleave(points: Sequence[Point], sides: Sequence[Side], repeats: int = 1) -> list[tuple[Point, Side]]:
    """Every run (point and repeat, round-robin) on every side, run by run: (p0, baseline),
    (p0, current), (p1, baseline), ..., then repeat 1 with the sides swapped: (p0.r1, current),
    (p0.r1, baseline), ..."""
    return [(p, s) for p in runs([p for p in points if not p.duplicate_of], repeats)
            for s in (sides if p.repeat % 2 == 0 else sides[::-1])]


def open_side(suite: Suite, points: list[Point], side: Side) -> Store:
    store = Store(side.store)
    meta = suite_meta(suite, new_run_id(), points)
    # meta.json's git names the code that ran: REV for the baseline, not this checkout
    meta["git"] = {"commit": side.commit, "dirty": side.dirty}
    meta["against"] = {"side": side.name}
    store.create(meta, {POINTS_FILE: plan_text(points)})
    return store


def run_sides(suite: Suite, sides: Sequence[Side], echo: Callable[[str], None],
              launcher: Callable[[Point], list[str]] | None = None, mllog: bool = False) -> list[Path]:
    """Run every point of ``suite`` on every side, interleaved, one store per side, through the sweep's
    own loop (:func:`moebench.sweep.runner.run_here`): each store locked and cleared of what an earlier
    run left, each run's leftover processes stopped before the next run (of either side) starts;
    ``mllog`` writes each finished run's MLPerf-style log beside its log, as ``moebench run --mllog``."""
    points = suite.points()
    require_runnable(suite, points)
    stores = {s.name: open_side(suite, points, s) for s in sides}
    order = [(point, stores[side.name]) for point, side in interleave(points, sides, suite.repeats)]

    def warn(line: str) -> None:
        echo(f"warning: {line}")

    # SIGINT, SIGTERM, SIGHUP: the running point's tree is stopped, then SweepInterrupted unwinds
    # through the callers' clean-up (the worktree, the temporary folder)
    with sweeping(list(stores.values()), warn) as interrupts, Progress(len(order), echo=echo) as bar:
        watch = SideWatch(bar, suite, points, sides, stores)
        run_here(order, SweepOptions(launcher=launcher, warn=warn, mllog=mllog), interrupts, watch,
                 envs={stores[s.name].path: s.env for s in sides})
    return [stores[s.name].path for s in sides]


class SideWatch(Watch):
    """What the sides' loop says: a line per run naming its side (``[2/6] p000 current 0123456789: ...``),
    and, once every point has failed on the baseline side (REV's code cannot run the suite), a
    LaunchError that stops the sides there instead of running the rest of the current side."""

    def __init__(self, bar: Progress, suite: Suite, points: list[Point], sides: Sequence[Side],
                 stores: dict[str, Store]) -> None:
        super().__init__(bar)
        self.suite, self.baseline = suite, sides[0]
        self.side_of = {stores[s.name].path: s for s in sides}
        self.baseline_log = stores[self.baseline.name].log_path
        # each run once on the baseline; point id -> why, while no baseline run is ok (None: one was)
        self.first_pass = {p.point_id for p in points if p.valid and not p.duplicate_of}
        self.baseline_failed: dict[str, str] | None = {}

    def started(self, point: Point, store: Store) -> None:
        # the bar names the side too: p000 runs twice a repeat
        self.bar.started(f"{point.run_id} {self.side_of[store.path].name}", store.log_path(point.run_id))

    def finished(self, point: Point, store: Store, record: dict[str, Any], position: tuple[int, int],
                 retry: tuple[int, int] | None) -> None:
        side = self.side_of[store.path]
        where = f"[retry {retry[0]}/{retry[1]}]" if retry else f"[{position[0]}/{position[1]}]"
        parts = "  ".join([str(record["status"]), *metric_parts(record)])
        self.bar.finished(record, f"{where} {point.run_id} {side.tag}: {describe(point.values)}  {parts}")
        if retry or side is not self.baseline or not point.valid or self.baseline_failed is None:
            return
        if record["status"] == "ok":
            self.baseline_failed = None  # one ok run: there is something to compare against
            return
        self.baseline_failed[point.point_id] = " ".join(str(record.get("error") or record["status"]).split())
        if set(self.baseline_failed) >= self.first_pass:
            first, why = next(iter(self.baseline_failed.items()))
            raise LaunchError(
                f"check --against: every point of suite {self.suite.name} failed on the "
                f"{self.baseline.tag} ({len(self.baseline_failed)} of {len(self.first_pass)}; {first}: {why[:160]}), "
                f"so there is nothing to compare against; stopped before running the rest of the current "
                f"side (its log: {self.baseline_log(first)}, kept with --keep)")

    def retrying(self, timed_out: list[tuple[Point, Store]]) -> None:
        self.bar.add(len(timed_out))
        self.bar.write(f"{len(timed_out)} run(s) timed out: trying each once more")


def _orphaned(work: Path) -> bool:
    """Whether the call that made ``work`` is gone (killed with SIGKILL, or its machine rebooted).
    A folder without its owner file is left alone: its maker may be between mkdtemp and writing
    the file, or an older moebench that writes none may still be running in it."""
    try:
        pid = int((work / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process, alive
    return False


def remove_orphans(repo: Path, echo: Callable[[str], None] | None = None) -> list[Path]:
    """Remove what earlier calls killed by SIGKILL left: their temporary folders (this user's, under
    the temporary directory) and the git worktrees registered in ``repo`` inside them."""
    listing = _git(repo, "worktree", "list", "--porcelain").stdout.splitlines()
    trees = [Path(line.removeprefix("worktree ")) for line in listing if line.startswith("worktree ")]
    folders = {t.parent for t in trees if t.parent.name.startswith(WORK_PREFIX)}
    folders |= set(Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"))
    removed = []
    for work in sorted(folders):
        if not _orphaned(work):
            continue
        for tree in (t for t in trees if t.parent == work):
            _git(repo, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(work, ignore_errors=True)
        removed.append(work)
    if removed:
        _git(repo, "worktree", "prune")
        if echo is not None:
            echo(f"removed {len(removed)} leftover(s) of an earlier check --against that was killed: "
                 + ", ".join(map(str, removed)))
    return removed


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` items of ``--current-env``."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--current-env {item!r}: expected NAME=VALUE, e.g. MOEBENCH_INJECT_SLOWDOWN=0.3")
        env[key] = value
    return env


@contextlib.contextmanager
def measured_sides(rev: str, suite: Suite, *, keep: Path | None = None, current_env: dict[str, str] | None = None,
                   echo: Callable[[str], None], repo: Path | None = None,
                   launcher: Callable[[Point], list[str]] | None = None,
                   mllog: bool = False) -> Iterator[tuple[list[Path], list[Side]]]:
    """Run ``suite`` on ``rev`` and on the working tree, interleaved; yields (stores, sides).

    ``repo`` is the checkout moebench runs from (default: the one this module was imported
    from); ``keep`` a folder that keeps both stores (``baseline/`` and ``current/``); without
    it they live in a temporary folder that is removed when the block ends. ``mllog``: see :func:`run_sides`.
    """
    repo = repo or REPO_ROOT
    commit = resolve_rev(rev, repo)
    if keep is not None:
        for name in SIDES:
            if Store(keep / name).exists():
                raise StoreError(f"--keep {keep}: {keep / name} already holds a results store; choose another folder")
    here = git_info(repo)
    remove_orphans(repo, echo)
    # a signal from here on unwinds through the clean-up below (SweepInterrupted), none kills us mid-way
    with Interrupts().catching():
        work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
        out = keep if keep is not None else work / "stores"
        try:
            (work / OWNER_FILE).write_text(f"{os.getpid()}\n")
            with checked_out(repo, commit, work / "tree") as tree:
                sides = [Side("baseline", tree, commit, False, out / "baseline", side_env(tree)),
                         Side("current", repo, here.get("commit"), bool(here.get("dirty")), out / "current",
                              side_env(repo, current_env))]
                echo(f"check --against {rev}: {sides[0].tag} vs {sides[1].tag}, suite {suite.name}, interleaved")
                stores = run_sides(suite, sides, echo, launcher, mllog)
            yield stores, sides
        finally:
            shutil.rmtree(work, ignore_errors=True)
