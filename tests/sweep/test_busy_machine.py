"""Verdicts on a busy machine: time limits in fair-share seconds, timed-out runs retried and outvoted,
unsteady windows left out or judged "no verdict", a baseline timeout never read as a code change."""

from __future__ import annotations

import json
import sys

import pytest
from report_helpers import edited_store, fixture_store, repeated_store, run_cli

from moebench.launch import share
from moebench.launch.tree import run_process
from moebench.report.build import load_tables
from moebench.results.table import by_point, csv_table
from moebench.sweep.launch import REPEAT_MARGIN, time_limit
from moebench.sweep.suite import Point

SMOKE = fixture_store("smoke")


def test_a_wall_second_counts_as_the_share_of_a_core_the_load_leaves():
    assert share.share(None, 2) == 1.0 and share.share(1.5, 2) == 1.0 and share.share(2.0, 2) == 1.0
    assert share.share(8.0, 2) == pytest.approx(0.25)
    # capped: a hang still ends, at most MAX_STRETCH times its limit in wall time
    assert share.share(1e6, 2) == pytest.approx(1 / share.MAX_STRETCH)


@pytest.mark.slow
@pytest.mark.parametrize("load_per_core, timed_out", [(0.5, True), (4.0, False)])
def test_a_loaded_machine_stretches_the_limit_and_a_quiet_one_does_not(tmp_path, monkeypatch, load_per_core,
                                                                         timed_out):
    """A 2.5 s run under a 1 s limit: timed out on a quiet machine, finished at 4x the cores' load (1 s of
    fair share is then 4 s of wall time)."""
    monkeypatch.setattr(share, "load_average", lambda: load_per_core * share.cores())
    outcome = run_process([sys.executable, "-c", "import time; time.sleep(2.5); print('done')"], tmp_path / "log",
                          timeout_s=1.0, grace_s=1)
    assert outcome.timed_out is timed_out
    assert outcome.clock is not None and outcome.clock.load_mean == pytest.approx(load_per_core * share.cores())
    if timed_out:
        assert f"at load {load_per_core * share.cores():.1f} on {share.cores()} cores" in (tmp_path / "log").read_text()
    else:
        assert outcome.last_stdout_line == "done" and outcome.clock.elapsed < 1.0 < outcome.wall_s


def _point(timeout_s: float) -> Point:
    return Point(0, {}, "tiny", {}, None, timeout_s)


def test_a_repeat_may_take_a_margin_over_its_points_slowest_finished_run():
    point = _point(90.0)
    assert time_limit(point, []) == 90.0
    ok = [{"status": "ok", "point_share_s": 40.0}, {"status": "ok", "point_share_s": 50.0}]
    assert time_limit(point, ok) == REPEAT_MARGIN * 50.0
    # a failed run, or a record from before the field existed, says nothing about the point's speed
    assert time_limit(point, [{"status": "timeout", "point_share_s": 500.0}, {"status": "ok"}]) == 90.0


def _with_repeat_status(statuses: dict[int, str]):
    def edit(r):
        status = statuses.get(r["repeat"])
        if status is None:
            return r
        return {**r, "status": status, "error": "exceeded its time limit (at load 31.0 on 2 cores)",
                "step_times_s": None, "tokens_per_s": None, "tokens_per_s_per_device": None}
    return edit


def test_a_point_is_judged_on_its_ok_repeats_when_two_remain(tmp_path):
    store = edited_store(repeated_store(SMOKE, tmp_path / "three", 3), tmp_path / "s",
                         _with_repeat_status({2: "timeout"}))
    points = by_point(load_tables([store])[0])
    assert set(points["status"]) == {"ok"} and set(points["runs"]) == {2}
    assert set(points["failed_runs"]) == {"1 timeout"}
    # one ok repeat left: the point takes its first failed repeat's status
    store = edited_store(repeated_store(SMOKE, tmp_path / "three2", 3), tmp_path / "s2",
                         _with_repeat_status({1: "timeout", 2: "failed"}))
    points = by_point(load_tables([store])[0])
    assert set(points["status"]) == {"timeout"} and set(points["failed_runs"]) == {""}  # the status says it


def _drifting(repeats: set[int]):
    return lambda r: {**r, "window_drift": 1.30} if r["repeat"] in repeats else {**r, "window_drift": 1.01}


def test_an_unsteady_run_is_left_out_while_two_steady_ones_remain(tmp_path):
    store = repeated_store(SMOKE, tmp_path / "s", 3)
    store = edited_store(store, tmp_path / "d", _drifting({1}))
    points = by_point(load_tables([store])[0])
    assert set(points["runs"]) == {2} and points["unsteady"].isna().all()
    assert all(text.startswith("1 of 3 runs left out (unsteady): repeat 1: timed window drifted 1.30x")
               for text in points["unsteady_runs"])
    # results.csv says which runs were left out, as docs/report.md promises
    assert csv_table(points)["unsteady_runs"].str.startswith("1 of 3 runs left out (unsteady)").all()


def test_unsteady_windows_give_no_verdict_in_report_and_gate(tmp_path, monkeypatch, capsys):
    base = repeated_store(SMOKE, tmp_path / "base", 3, seed=1)
    cur = edited_store(repeated_store(SMOKE, tmp_path / "c", 3, factor=0.5, seed=1), tmp_path / "cur",
                       _drifting({0, 1}))
    points = by_point(load_tables([cur])[0])
    assert all(w.startswith("unsteady timed window in 2 of 3 runs (timed window drifted 1.30x)")
               for w in points["unsteady"])
    code, out, _ = run_cli(["check", str(base), str(cur), "--format", "json"], monkeypatch, capsys)
    data = json.loads(out)
    # a halving of throughput, but measured in windows that drifted: no verdict (blocking under "fail")
    assert data["counts"]["no verdict"] == 3 and data["counts"]["regressed"] == 0 and code == 1
    code, _, _ = run_cli(["check", str(base), str(cur), "--on-inconclusive", "warn"], monkeypatch, capsys)
    assert code == 0
    # the drifting side as the baseline: the reason says whose windows they were
    code, out, _ = run_cli(["check", str(cur), str(base), "--format", "json"], monkeypatch, capsys)
    notes = [p["metrics"][0]["note"] for p in json.loads(out)["points"]]
    assert all(n.startswith("baseline: unsteady timed window in 2 of 3 runs") for n in notes), notes


def test_a_baseline_timeout_is_no_verdict_not_an_improvement(tmp_path, monkeypatch, capsys):
    base = edited_store(SMOKE, tmp_path / "base", lambda r: {**r, "status": "timeout", "error": "too slow"})
    code, out, _ = run_cli(["check", str(base), str(SMOKE), "--format", "json"], monkeypatch, capsys)
    data = json.loads(out)
    assert code == 0 and data["counts"]["no verdict"] == 3 and data["counts"]["improved"] == 0
    assert all(p["note"] == "baseline timed out (too slow)" for p in data["points"])
    # the other way round the gate still fails: the current side failed where the baseline did not
    code, out, _ = run_cli(["check", str(SMOKE), str(base), "--format", "json"], monkeypatch, capsys)
    assert code == 1 and json.loads(out)["counts"]["failed"] == 3


def test_the_load_is_shown_where_runs_are_named(tmp_path, monkeypatch, capsys):
    """Runs lines, the gate's header and the calibration warning say how busy the machine was."""
    from moebench.report.render import run_info

    def loaded(load):
        return lambda r: {**r, "load_start": load, "load_mean": load, "cores": 2, "peak_flops_source": "calibrated",
                          "peak_flops": 50e9 if load > 10 else 318e9}

    busy = edited_store(SMOKE, tmp_path / "busy", loaded(37.0))
    quiet = edited_store(SMOKE, tmp_path / "quiet", loaded(1.2))
    t, metas, _ = load_tables([busy])
    assert run_info(metas, t)[0][1].count("; load 37.0 while its runs ran (1-minute average, 2 cores)") == 1
    _, out, err = run_cli(["check", str(quiet), str(busy)], monkeypatch, capsys)
    assert "BASELINE: run" in out and "load 1.2 while its runs ran" in out.splitlines()[0]
    assert "load 37.0 while its runs ran" in out.splitlines()[1]
    assert "(318 GFLOP/s at load 1.2 vs 50 GFLOP/s at load 37.0, -84%)" in err


@pytest.mark.slow
def test_a_slurm_task_counts_wall_seconds(tmp_path, monkeypatch):
    """fair_share=False (the Slurm worker): the load stretches nothing; the limit says it counted wall time."""
    monkeypatch.setattr(share, "load_average", lambda: 4.0 * share.cores())
    outcome = run_process([sys.executable, "-c", "import time; time.sleep(2.5)"], tmp_path / "log", timeout_s=1.0,
                          grace_s=1, fair_share=False)
    assert outcome.timed_out and "killed after its time limit of 1 s of wall time" in (tmp_path / "log").read_text()
