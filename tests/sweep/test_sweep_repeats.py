"""Repeats: each point runs N times, round-robin, and the store, resume, rerun-failed, status,
report rows, Slurm arrays and check --against know which run of which point a record is.

Runs finish in-process (``run_point`` is swapped for one that records its call), so these tests
take milliseconds; the real process trees are tests/sweep/test_sweep_runner.py's.
"""

from __future__ import annotations

import json

import pytest
from sweep_helpers import tiny_suite

from moebench.errors import ConfigError
from moebench.results.load import load_results
from moebench.results.store import Store
from moebench.sweep import runner as sweep_runner
from moebench.sweep.launch import point_record
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.status import failed_points, status_table
from moebench.sweep.suite import parse_suite, runs


def _suite(**extra):
    return tiny_suite("r", grid={"moe.num_experts": [4, 8]}, **extra)


class Ran(list):
    """The run ids a sweep ran, in order; ``fail``: run ids that fail."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: set[str] = set()


@pytest.fixture
def ran(monkeypatch):
    order = Ran()

    def fake_run_point(point, log_path, **_):
        order.append(point.run_id)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"{point.run_id}\n")
        status = "failed" if point.run_id in order.fail else "ok"
        return point_record(point, status, None if status == "ok" else "scripted")

    monkeypatch.setattr(sweep_runner, "run_point", fake_run_point)
    return order


def _run(suite, store, **kw):
    return run_suite(suite, store, SweepOptions(progress=False, echo=lambda _: None, **kw))


def test_suite_repeats_are_validated():
    assert _suite().repeats == 1
    assert _suite(repeats=3).repeats == 3
    for bad in (0, -1, 1.5, True, "3", 101):
        with pytest.raises(ConfigError, match="repeats"):
            _suite(repeats=bad)


def test_round_robin_order_and_records(tmp_path, ran):
    store = tmp_path / "s"
    _run(_suite(repeats=3), store)
    assert ran == ["p000", "p001", "p000.r1", "p001.r1", "p000.r2", "p001.r2"]
    records, _ = Store(store).read_records()
    assert [(r["point_id"], r["repeat"], r["repeats"]) for r in records] == [
        ("p000", 0, 3), ("p001", 0, 3), ("p000", 1, 3), ("p001", 1, 3), ("p000", 2, 3), ("p001", 2, 3)]
    # the repeats of a point share its identity: one key, one config hash
    assert len({r["key"] for r in records if r["point_id"] == "p000"}) == 1
    assert len({r["config_hash"] for r in records if r["point_id"] == "p000"}) == 1
    assert sorted(p.name for p in (store / "logs").glob("*.log")) == [
        "p000.log", "p000.r1.log", "p000.r2.log", "p001.log", "p001.r1.log", "p001.r2.log"]


def test_cli_repeats_override_the_suite(tmp_path, ran):
    _run(_suite(repeats=3), tmp_path / "s", repeats=2)
    assert ran == ["p000", "p001", "p000.r1", "p001.r1"]
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["repeats"] == 2
    with pytest.raises(ConfigError, match="--repeats"):
        _run(_suite(), tmp_path / "t", repeats=0)


def test_resume_runs_only_missing_repeats(tmp_path, ran):
    store = tmp_path / "s"
    _run(_suite(repeats=2), store, point_ids={"p000"})  # p001 never ran
    assert ran == ["p000", "p000.r1"]
    ran.clear()
    _run(_suite(repeats=2), store, resume=True)  # the store's repeats (2)
    assert ran == ["p001", "p001.r1"]
    ran.clear()
    _run(_suite(repeats=2), store, resume=True, repeats=3)  # one more round of every point
    assert ran == ["p000.r2", "p001.r2"]
    ran.clear()
    _run(_suite(), store, resume=True)  # now 3 repeats: nothing missing
    assert ran == []


def test_rerun_failed_reruns_failed_repeats(tmp_path, ran):
    store = tmp_path / "s"
    ran.fail.update({"p001.r1"})
    _run(_suite(repeats=2), store)
    assert failed_points(store) == ["p001.r1"]
    ran.clear()
    ran.fail.clear()
    _run(_suite(repeats=2), store, rerun_failed=True)
    assert ran == ["p001.r1"]
    assert failed_points(store) == []


def test_status_counts_runs(tmp_path, ran):
    store = tmp_path / "s"
    ran.fail.update({"p000.r1"})
    _run(_suite(repeats=2), store, point_ids={"p000"})
    lines = status_table(store).splitlines()
    assert [line.split()[:2] for line in lines[2:-1]] == [
        ["p000", "ok"], ["p001", "pending"], ["p000.r1", "failed"], ["p001.r1", "pending"]]
    assert lines[-1] == "1 failed, 1 ok, 2 pending (runs: 2 points x 2 repeats)"


def test_report_rows_one_per_point_and_repeat(tmp_path, ran):
    store = tmp_path / "s"
    _run(_suite(repeats=2), store)
    df, _ = load_results(store)
    assert list(zip(df["point_id"], df["repeat"], strict=True)) == [
        ("p000", 0), ("p000", 1), ("p001", 0), ("p001", 1)]


def test_old_stores_read_as_repeat_zero(tmp_path, ran):
    store = tmp_path / "s"
    _run(_suite(), store)
    path = Store(store).records_path
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for r in lines:
        del r["repeat"], r["repeats"]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    df, _ = load_results(store)
    assert df["repeat"].tolist() == [0, 0]
    ran.clear()
    _run(_suite(), store, resume=True)
    assert ran == []  # a record without a repeat is repeat 0


def test_invalid_points_are_recorded_once():
    suite = parse_suite({"name": "r", "base": {"preset": "tiny"}, "zip": {"parallel.dp": [1, 3]}, "repeats": 3})
    points = suite.points()
    assert [p.valid for p in points] == [True, False]
    assert [p.run_id for p in runs(points, 3)] == ["p000", "p001", "p000.r1", "p000.r2"]


def _sides(tmp_path):
    from moebench.sweep.against import Side

    return [Side(name, tmp_path, "0" * 40, False, tmp_path / name, {}) for name in ("baseline", "current")]


def test_against_alternates_sides_per_repeat(tmp_path):
    from moebench.sweep.against import interleave

    order = [(p.run_id, s.name) for p, s in interleave(_suite().points(), _sides(tmp_path), repeats=2)]
    assert order == [("p000", "baseline"), ("p000", "current"), ("p001", "baseline"), ("p001", "current"),
                     ("p000.r1", "current"), ("p000.r1", "baseline"), ("p001.r1", "current"), ("p001.r1", "baseline")]


def test_against_runs_every_repeat_into_each_side(tmp_path, monkeypatch):
    from moebench.sweep import against, runner

    ran: list[str] = []

    def fake_run_point(point, log_path, env=None, **_):
        ran.append(f"{point.run_id} {log_path.parent.parent.name}")
        return point_record(point, "ok", None)

    monkeypatch.setattr(runner, "run_point", fake_run_point)  # the sides run through the runner's loop
    stores = against.run_sides(_suite(repeats=2), _sides(tmp_path), lambda _: None)
    assert ran[:2] == ["p000 baseline", "p000 current"] and ran[4:6] == ["p000.r1 current", "p000.r1 baseline"]
    for store in stores:
        assert sorted((r["point_id"], r["repeat"]) for r in Store(store).read_records()[0]) == [
            ("p000", 0), ("p000", 1), ("p001", 0), ("p001", 1)]


def test_check_repeats_needs_against(monkeypatch, capsys):
    from report_helpers import run_cli

    code, _, err = run_cli(["check", "a", "b", "--repeats", "2"], monkeypatch, capsys)
    assert code == 2 and "go with --against" in err
    code, _, err = run_cli(["check", "--against", "HEAD", "smoke", "--repeats", "0"], monkeypatch, capsys)
    assert code == 2 and "--repeats" in err


def test_slurm_array_has_one_task_per_run(tmp_path, monkeypatch):
    import moebench.sweep.slurm as slurm
    from moebench.sweep.slurm import SlurmOptions, write_pending

    store = Store(tmp_path / "s")
    store.create({"suite": "r", "run_id": "x", "repeats": 2})
    todo = runs(_suite().points(), 2)
    scripts: list[str] = []

    def queue(job_id):  # every task finishes at once and leaves its record
        for i, p in enumerate(todo):
            write_pending(store, {**point_record(p, "ok", None), "slurm_job_id": "7", "slurm_task_id": str(i)})
        return {i: "COMPLETED" for i in range(len(todo))}

    monkeypatch.setattr(slurm, "submit", lambda script: scripts.append(script.read_text()) or "7")
    monkeypatch.setattr(slurm, "queue_states", queue)
    monkeypatch.setattr(slurm, "release", lambda job_id: None)  # the array is submitted held
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    progress = type("P", (), {"finished": lambda self, r: None,
                              "bar": type("B", (), {"set_postfix_str": lambda self, s: None})()})()
    with store.locked():
        slurm.submit_and_follow(store, todo, SlurmOptions(), progress)
    assert "POINTS=(p000 p001 p000.r1 p001.r1)" in scripts[0]
    tasks = store.read_meta()["slurm"]["jobs"][0]["tasks"]
    assert [(t["point_id"], t["repeat"]) for t in tasks.values()] == [
        ("p000", 0), ("p001", 0), ("p000", 1), ("p001", 1)]
    assert sorted((r["point_id"], r["repeat"]) for r in store.read_records()[0]) == [
        ("p000", 0), ("p000", 1), ("p001", 0), ("p001", 1)]
    # a record of the right point but another repeat is not that task's
    task = slurm.store_tasks(store)[("7", "2")]
    assert task.run_id == "p000.r1" and task.runs(todo[2]) and not task.runs(todo[0])


def test_slurm_worker_runs_the_repeat_it_is_given(tmp_path, monkeypatch):
    import moebench.sweep.worker as worker
    from moebench.sweep.runner import plan_text
    from moebench.sweep.status import POINTS_FILE

    store = Store(tmp_path / "s")
    points = _suite().points()
    store.create({"suite": "r", "run_id": "x", "repeats": 3}, {POINTS_FILE: plan_text(points)})
    seen = []

    def fake_run_point(point, log_path, **_):
        seen.append((point.run_id, point.repeats, log_path.name))
        return point_record(point, "ok", None)

    monkeypatch.setattr(worker, "run_point", fake_run_point)
    path = worker.run_task(str(store.path), "p001.r2")
    assert seen == [("p001.r2", 3, "p001.r2.log")]
    record = json.loads(path.read_text())
    assert (record["point_id"], record["repeat"], record["repeats"]) == ("p001", 2, 3)


def test_summary_lines_name_the_repeat():
    from moebench.sweep.progress import summary_line

    assert summary_line({"point_id": "p001", "repeat": 2, "status": "ok"}).startswith("p001.r2 ok")
    assert summary_line({"point_id": "p001", "status": "ok"}).startswith("p001    ok")
