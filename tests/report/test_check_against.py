"""``moebench check --against REV SUITE``: revision errors, interleaving, the gate decision.

Nothing here is timed: the points run a scripted trainer, and the gate is judged on stores
whose step times are generated.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from report_helpers import edited_store, fixture_store, repeated_store, run_cli, with_speed
from sweep_helpers import tiny_suite

from moebench.errors import ConfigError
from moebench.report.gate.against import check_against, gate
from moebench.report.gate.check import parse_metric
from moebench.results.store import Store
from moebench.sweep.against import Side, interleave, parse_env, resolve_rev, run_sides, side_env

SMOKE = fixture_store("smoke")
RULES = [parse_metric("tokens_per_s:-5%")]

# Records which side ran which point, in order, and reports a speed the environment sets.
FAKE_TRAIN = textwrap.dedent("""
    import json, os, sys
    args = sys.argv[1:]
    experts = int(next(a.split("=")[1] for a in args if a.startswith("moe.num_experts=")))
    with open(os.environ["ORDER_FILE"], "a") as f:
        f.write(f"{experts} {os.environ['SIDE']}\\n")
    step = 0.1 * float(os.environ.get("SLOW", "1"))
    times = [step * (1 + 0.001 * (i % 3)) for i in range(12)]
    print(json.dumps({"schema_version": 1, "status": "ok", "tokens_per_step": 100, "world_size": 1,
                      "step_times_s": times, "step_time_median_s": sorted(times)[6],
                      "tokens_per_s": 100 / sorted(times)[6]}))
""")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository with two commits."""
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q")
    for n in (1, 2):
        (path / "f.txt").write_text(str(n))
        _git(path, "add", "f.txt")
        _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{n}")
    return path


@pytest.fixture
def fake(tmp_path, fake_trainer):
    return fake_trainer(FAKE_TRAIN, ORDER_FILE=str(tmp_path / "order.txt"))


def _suite(experts=(8, 16, 32)):
    return tiny_suite(grid={"moe.num_experts": list(experts)}, timeout=60)


def _side(name: str, tmp_path: Path, **env: str) -> Side:
    return Side(name, tmp_path, "0" * 40, False, tmp_path / name, {"SIDE": name, **env})


def test_resolve_rev(repo):
    assert resolve_rev("HEAD", repo) == _git(repo, "rev-parse", "HEAD")
    assert resolve_rev("HEAD~1", repo) == _git(repo, "rev-parse", "HEAD~1")


@pytest.mark.parametrize("rev, message", [
    ("HEAD~5", "--against HEAD~5: unknown revision in"),
    ("no-such-branch", "unknown revision"),
    ("--all", "not a revision"),
])
def test_unknown_rev_is_a_config_error(repo, rev, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rev(rev, repo)


def test_not_a_git_repository(tmp_path):
    with pytest.raises(ConfigError, match="is not a git repository"):
        resolve_rev("HEAD", tmp_path)


def test_cli_unknown_rev_is_one_line_exit_2(monkeypatch, capsys):
    code, out, err = run_cli(["check", "--against", "no-such-rev-xyz", "check-against"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --against no-such-rev-xyz: unknown revision")


@pytest.mark.parametrize("args, message", [
    (["check", "--against", "HEAD", "smoke", "other"], "give one SUITE"),
    (["check", "--against", "HEAD", "smoke", "--ratio", "ddp/fsdp:tokens_per_s>=1"], "--ratio gates one store"),
    (["check", "--against", "HEAD", "smoke", "--current-env", "NOEQUALS"], "expected NAME=VALUE"),
    (["check", "--against", "HEAD", "no-such-suite"], "no-such-suite"),
    (["check", str(SMOKE), str(SMOKE), "--keep", "x"], "go with --against"),
    (["check", str(SMOKE), str(SMOKE), "--mllog"], "go with --against"),
    (["check", "--against", "HEAD", "smoke", "--mllog"], "give --keep FOLDER"),
])
def test_cli_bad_input_exits_2_before_running(args, message, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and message in err


def test_interleave_alternates_sides_point_by_point(tmp_path):
    points = _suite().points()
    sides = [_side("baseline", tmp_path), _side("current", tmp_path)]
    order = [(p.point_id, s.name) for p, s in interleave(points, sides)]
    assert order == [("p000", "baseline"), ("p000", "current"), ("p001", "baseline"), ("p001", "current"),
                     ("p002", "baseline"), ("p002", "current")]


def test_side_env_puts_the_code_first_and_keeps_cwd_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = side_env(tmp_path, {"X": "1"})
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/elsewhere"]
    assert env["PYTHONSAFEPATH"] == "1" and env["X"] == "1"
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}


@pytest.mark.slow
def test_run_sides_runs_interleaved_into_two_stores(tmp_path, fake):
    sides = [_side("baseline", tmp_path), _side("current", tmp_path, SLOW="1.3")]
    lines: list[str] = []
    stores = run_sides(_suite(), sides, lines.append, launcher=fake)
    ran = (tmp_path / "order.txt").read_text().split("\n")[:-1]
    assert ran == ["8 baseline", "8 current", "16 baseline", "16 current", "32 baseline", "32 current"]
    assert [len((s / "records.jsonl").read_text().splitlines()) for s in stores] == [3, 3]
    assert len(lines) == 6 and lines[1].startswith("[2/6] p000 current")
    comparison, _ = gate(stores[0], stores[1], RULES, alpha=0.05, min_samples=5)
    # one run a side: 30% slower is beyond the threshold, but with no between-run variance it is not a verdict
    assert comparison.counts()["no verdict"] == 3 and comparison.exit_code() == 1
    notes = {m.note for p in comparison.points for m in p.metrics}
    assert notes == {"1 run each: no between-run variance, no verdict"}


@pytest.mark.slow
def test_run_sides_writes_each_runs_mllog_into_its_sides_store(tmp_path, fake):
    sides = [_side("baseline", tmp_path), _side("current", tmp_path)]
    stores = run_sides(_suite((8,)), sides, [].append, launcher=fake, mllog=True)
    assert [sorted(p.name for p in (s / "logs").glob("*.mllog")) for s in stores] == [["p000.mllog"]] * 2


@pytest.mark.slow
def test_every_baseline_point_failing_stops_before_the_rest_of_the_current_side(tmp_path, fake):
    """A REV whose code cannot run the suite failed every baseline point, then the whole current side
    ran (past 300 s) before the gate said so: now it stops once each point failed on the baseline."""
    from moebench.errors import LaunchError

    sides = [_side("baseline", tmp_path, SLOW="nan-not-a-number"), _side("current", tmp_path)]
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        run_sides(tiny_suite(grid={"moe.num_experts": [8, 16]}, timeout=60, repeats=2), sides, lines.append,
                  launcher=fake)
    ran = (tmp_path / "order.txt").read_text().split("\n")[:-1]
    assert ran == ["8 baseline", "8 current", "16 baseline"]  # not 16 current, nor the second repeat
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "check --against: every point of suite t failed on the baseline 0000000000 (2 of 2; p000: ")


# The baseline side's runs leave a process behind (in a session of its own, as a rank's helper may); each
# current-side run writes how many of those are still alive when it starts.
LEAVING_TRAIN = textwrap.dedent("""
    import os, subprocess, sys
    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    pids = os.environ["LEFT_PIDS"]
    if os.environ["SIDE"] == "baseline":
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        with open(pids, "a") as f:
            f.write(f"{helper.pid}\\n")
    else:
        left = [int(p) for p in open(pids).read().split()]
        with open(os.environ["ORDER_FILE"], "a") as f:
            f.write(f"{sum(map(alive, left))} of {len(left)} alive\\n")
    print('{"schema_version": 1, "status": "ok", "tokens_per_s": 10.0, "step_times_s": [0.1]}')
""")


@pytest.mark.slow
def test_a_run_of_one_side_leaves_no_process_to_the_next(tmp_path, fake_trainer):
    """A process the baseline side's run left behind would compete with the current side's run that follows
    it: the sides run through the sweep's loop, which stops it (by the store's marker) before the next run."""
    import os
    import signal

    pids = tmp_path / "left.txt"
    pids.touch()
    launcher = fake_trainer(LEAVING_TRAIN, ORDER_FILE=str(tmp_path / "order.txt"), LEFT_PIDS=str(pids))
    sides = [_side("baseline", tmp_path), _side("current", tmp_path)]
    try:
        run_sides(_suite((8, 16)), sides, [].append, launcher=launcher)
        assert (tmp_path / "order.txt").read_text().splitlines() == ["0 of 1 alive", "0 of 2 alive"]
    finally:
        for pid in map(int, pids.read_text().split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_timed_out_run_is_tried_once_more_at_the_end_on_its_side(tmp_path, monkeypatch):
    from moebench.sweep import runner
    from moebench.sweep.launch import point_record

    ran: list[str] = []

    def run_point(point, log_path, **_):  # the current side's first run of p000 times out once
        ran.append(f"{point.run_id} {log_path.parent.parent.name}")
        return point_record(point, "timeout" if ran == ["p000 baseline", "p000 current"] else "ok", None)

    monkeypatch.setattr(runner, "run_point", run_point)
    lines: list[str] = []
    stores = run_sides(_suite((8, 16)), [_side("baseline", tmp_path), _side("current", tmp_path)], lines.append)
    assert ran == ["p000 baseline", "p000 current", "p001 baseline", "p001 current", "p000 current"]
    assert lines[1].startswith("[2/4] p000 current 0000000000: num_experts=8  timeout")
    assert lines[4:6] == ["1 run(s) timed out: trying each once more",
                          "[retry 1/1] p000 current 0000000000: num_experts=8  ok"]
    assert [r["status"] for r in Store(stores[1]).latest_by_run().values()] == ["ok", "ok"]


@pytest.mark.slow
def test_one_ok_baseline_point_lets_the_sides_run_on(tmp_path, fake):
    sides = [_side("baseline", tmp_path), _side("current", tmp_path)]
    run_sides(_suite((8, 16)), sides, [].append, launcher=fake)
    assert len((tmp_path / "order.txt").read_text().split("\n")[:-1]) == 4


@pytest.mark.slow
def test_check_against_checks_out_rev_and_cleans_up(repo, tmp_path, fake, monkeypatch):
    monkeypatch.setenv("SIDE", "either")
    result = check_against("HEAD~1", _suite((8,)), RULES, keep=tmp_path / "keep", repo=repo, echo=lambda _: None,
                           launcher=fake)
    assert not result.comparison.failed_gate
    base_meta = json.loads((tmp_path / "keep" / "baseline" / "meta.json").read_text())
    assert base_meta["git"]["commit"] == _git(repo, "rev-parse", "HEAD~1")
    assert base_meta["against"] == {"side": "baseline"}
    assert "moebench-against-" in result.sides[0].env["PYTHONPATH"]  # REV's temporary worktree
    assert len(_git(repo, "worktree", "list").splitlines()) == 1  # the worktree is gone again
    with pytest.raises(Exception, match="already holds a results store"):
        check_against("HEAD", _suite((8,)), RULES, keep=tmp_path / "keep", repo=repo, launcher=fake)


@pytest.mark.parametrize("factor, fails", [(1.0, False), (0.97, False), (0.7, True)])
def test_gate_decision_on_generated_stores(tmp_path, factor, fails):
    """A 30% slower current side fails the gate; an equal or 3% slower one (under the 5% threshold) passes."""
    base = repeated_store(SMOKE, tmp_path / "base", 3, noise=0.02, seed=1)
    cur = repeated_store(SMOKE, tmp_path / "cur", 3, factor=factor, noise=0.02, seed=2)
    comparison, _ = gate(base, cur, RULES, alpha=0.05, min_samples=5)
    assert comparison.failed_gate is fails and comparison.exit_code() == int(fails)


def test_one_run_a_side_is_inconclusive_and_fails_unless_warned(tmp_path):
    base = edited_store(SMOKE, tmp_path / "base", lambda r: with_speed(r, 1.0, 0.02, seed=1))
    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: with_speed(r, 0.7, 0.02, seed=2))
    comparison, _ = gate(base, cur, RULES, alpha=0.05, min_samples=5)
    assert not comparison.failed_gate and comparison.inconclusive and comparison.counts()["no verdict"] == 3
    assert comparison.exit_code("fail") == 1 and comparison.exit_code("warn") == 0


def test_injected_slowdown_works_that_fraction_of_the_step_then_as_much_work_each_step(monkeypatch):
    """The hook gate_power.py relies on: MOEBENCH_INJECT_SLOWDOWN=0.3 computes (never sleeps) for 30% of the
    step in its first steps, counting the matmuls, then does the fewest of those counts every step: the same
    work whatever the clock, so a CPU-time or instruction clock sees it as the work it stands for."""
    import time

    import torch

    from moebench.train import trainer

    monkeypatch.delenv("MOEBENCH_INJECT_SLOWDOWN", raising=False)
    assert trainer.InjectedSlowdown.from_env() is None
    asked: list[tuple[float, int | None]] = []
    done = iter([40, 30])  # matmuls the two calibration steps took
    monkeypatch.setattr(trainer, "_busy", lambda s, n=None: asked.append((s, n)) or (next(done) if n is None else n))
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: 12.0)
    monkeypatch.setenv("MOEBENCH_INJECT_SLOWDOWN", "0.3")
    slowdown = trainer.InjectedSlowdown.from_env()
    for _ in range(4):
        slowdown(torch.device("cpu"), started=10.0)
    assert asked[:2] == [(pytest.approx(0.6), None)] * 2  # 30% of a 2 s step, by time
    assert [n for _, n in asked[2:]] == [30, 30] and slowdown.fixed == 30  # then the fewest matmuls, fixed
    monkeypatch.setenv("MOEBENCH_INJECT_SLOWDOWN", "lots")
    with pytest.raises(ValueError, match="MOEBENCH_INJECT_SLOWDOWN='lots'"):
        trainer.InjectedSlowdown.from_env()
    monkeypatch.undo()
    calls: list[int] = []
    real_mm = torch.mm
    monkeypatch.setattr(trainer.time, "sleep", lambda s: pytest.fail("the injected slowdown slept"))
    monkeypatch.setattr(trainer.torch, "mm", lambda a, b: calls.append(1) or real_mm(a, b))
    started = time.perf_counter()
    assert trainer._busy(0.05) == len(calls) > 0
    assert time.perf_counter() - started >= 0.05  # it computed for as long as asked, never slept
    before = len(calls)
    assert trainer._busy(0.0, 7) == 7 and len(calls) == before + 7  # a count: that many, whatever the time


@pytest.mark.slow
def test_a_signal_during_the_run_cleans_the_worktree_and_the_temporary_folder(repo, tmp_path, fake, monkeypatch):
    import os
    import signal
    import tempfile

    from moebench.sweep.runner import SweepInterrupted

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("SIDE", "either")

    def terminated(point):  # SIGTERM arrives while the first point starts
        os.kill(os.getpid(), signal.SIGTERM)
        return fake(point)

    with pytest.raises(SweepInterrupted) as info:
        check_against("HEAD~1", _suite((8, 16)), RULES, repo=repo, echo=lambda _: None, launcher=terminated)
    assert info.value.signum == signal.SIGTERM
    assert len(_git(repo, "worktree", "list").splitlines()) == 1 and os.listdir(tmp_path / "tmp") == []


def test_leftovers_of_a_killed_call_are_removed_by_the_next(repo, tmp_path, monkeypatch):
    import os
    import tempfile

    from moebench.sweep.against import OWNER_FILE, WORK_PREFIX, remove_orphans

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = {}
    for name, pid in (("dead", int(gone.stdout)), ("alive", os.getpid())):
        work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{name}-"))
        (work / OWNER_FILE).write_text(f"{pid}\n")
        _git(repo, "worktree", "add", "--detach", "--quiet", str(work / "tree"), "HEAD~1")
        folders[name] = work
    lines: list[str] = []
    assert remove_orphans(repo, lines.append) == [folders["dead"]]
    assert not folders["dead"].exists() and folders["alive"].exists()
    assert lines == [f"removed 1 leftover(s) of an earlier check --against that was killed: {folders['dead']}"]
    trees = _git(repo, "worktree", "list").splitlines()
    assert len(trees) == 2 and str(folders["alive"] / "tree") in trees[1]


@pytest.mark.slow
def test_cli_prints_the_interrupt_line_and_exits_128_plus_the_signal(repo, tmp_path, monkeypatch, capsys):
    import os
    import signal
    import tempfile

    import yaml

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # no other call's folders
    (tmp_path / "tmp").mkdir()
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "t", "base": {"preset": "tiny", "set": {"train.steps": 3}},
                                     "grid": {"moe.num_experts": [8]}}))
    monkeypatch.setattr("moebench.sweep.against.REPO_ROOT", repo)
    monkeypatch.setattr("moebench.sweep.runner.run_point",
                        lambda point, log, **_: os.kill(os.getpid(), signal.SIGTERM))  # stopped: no record
    code, _, err = run_cli(["check", "--against", "HEAD~1", str(suite)], monkeypatch, capsys)
    assert code == 128 + signal.SIGTERM
    assert err.splitlines()[-1] == "interrupted by SIGTERM; check --against removed its worktree and temporary folder"
    assert len(_git(repo, "worktree", "list").splitlines()) == 1
