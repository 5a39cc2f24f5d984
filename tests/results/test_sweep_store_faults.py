"""Store faults: a store bound to its suite (edited suites, --extend) and disk errors.

Disk errors are made two ways. A small tmpfs mounted for the test (root only; skipped with the
reason otherwise) fills up for real, or turns read-only by a remount. Where a real mount cannot
make the fault at the right moment (a failed fsync, a read-only file system while the sweep
holds its lock file open for writing, which makes the remount fail with EBUSY), the store's
``os`` calls are patched to raise the errno for the one file concerned.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from report_helpers import run_cli

from moebench.errors import StoreError
from moebench.results.load import load_results
from moebench.results.migrate import upgrade
from moebench.results.store import Store


# ---------------------------------------------------------------------- helpers
@pytest.fixture
def sweep(tmp_path, monkeypatch, capsys):
    """``moebench ARGS`` in-process; points finish at once, ``ran`` lists them, ``hooks[point_id]``
    runs as that point finishes (to fill the disk, say). ``suite(**axes)`` writes the suite file."""
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    ran: list[str] = []
    hooks: dict[str, object] = {}

    def run_point(point, log, **_):
        ran.append(point.point_id)
        if point.point_id in hooks:
            hooks[point.point_id]()
        # with its raw step times a record is longer than a page: each append needs a new block of the disk
        return point_record(point, "ok", None, {"schema_version": 1, "status": "ok", "step_times_s": [0.1] * 1000})

    monkeypatch.setattr(sweep_runner, "run_point", run_point)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the fallback for side files: not the store's disk
    path = tmp_path / "s.yaml"

    def suite(grid=None, zip=None, base_set=None, **extra):
        spec = {"name": "q", "base": {"preset": "tiny", "set": base_set or {"train.steps": 3}},
                "grid": grid or {"moe.num_experts": [4, 8]}, **extra}
        if zip:
            spec["zip"] = zip
        path.write_text(yaml.safe_dump(spec))
        return str(path)

    def moebench(*args):
        ran.clear()
        return run_cli([str(a) for a in args], monkeypatch, capsys)

    moebench.ran, moebench.hooks, moebench.suite = ran, hooks, suite
    return moebench


def _records(store: Path) -> list[dict]:
    return [json.loads(line) for line in (store / "records.jsonl").read_text().splitlines()]


def _counts(store: Path, planned: int) -> tuple[int, int]:
    """(lost, duplicated) records of a store whose points all finished: planned points without a
    record, and records beyond the first of a key."""
    keys = [r["key"] for r in _records(store)]
    return planned - len(set(keys)), len(keys) - len(set(keys))


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs at tmp_path/disk, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused: {done.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Write a filler file until the disk is full; removing it frees the disk again."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


# ---------------------------------------------------------------------- a store bound to its suite
def test_resume_with_an_edited_point_config_is_refused_naming_point_and_field(tmp_path, sweep):
    store = tmp_path / "st"
    assert sweep("run", sweep.suite(), "--out", store, "--only", "p000", "--no-progress")[0] == 0
    before = {p.name: p.read_bytes() for p in store.iterdir() if p.is_file() and p.name != ".lock"}
    code, _, err = sweep("run", sweep.suite(base_set={"train.steps": 3, "moe.top_k": 1}), "--out", store, "--resume")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == (f"error: {store / 'points.json'}: the suite changed since this store was made: "
                   "p000 (num_experts=4) changed: moe.top_k 2 -> 1; a store holds one suite; "
                   "start a new store (another --out)\n")
    assert sweep.ran == [] and {p.name: p.read_bytes() for p in store.iterdir()
                                if p.is_file() and p.name != ".lock"} == before
    # --extend does not take a changed point either: the old one would leave the plan
    code, _, err = sweep("run", sweep.suite(base_set={"train.steps": 3, "moe.top_k": 1}), "--out", store,
                         "--resume", "--extend")
    assert code == 2 and "p000 (num_experts=4) changed: moe.top_k 2 -> 1; --extend only adds points" in err


def test_resume_with_a_point_removed_or_added_is_refused(tmp_path, sweep):
    store = tmp_path / "st"
    sweep("run", sweep.suite(), "--out", store, "--no-progress")
    code, _, err = sweep("run", sweep.suite(grid={"moe.num_experts": [4]}), "--out", store, "--resume")
    assert code == 2 and "p001 (num_experts=8) is not in the suite any more" in err, err
    code, _, err = sweep("run", sweep.suite(grid={"moe.num_experts": [4, 8, 16]}), "--out", store, "--resume")
    assert code == 2 and len(err.splitlines()) == 1
    assert (f"{store / 'points.json'}: the suite has 1 point(s) this store does not plan (p002 num_experts=16); "
            "pass --extend to add them") in err
    assert sweep.ran == [] and len(_records(store)) == 2


def test_extend_appends_new_points_and_keeps_the_recorded_ones(tmp_path, sweep):
    """A grown inner axis interleaves the suite's expansion; the store keeps its ids and appends."""
    store = tmp_path / "st"
    zip_axis = {"parallel.strategy": ["fsdp", "ddp"]}
    sweep("run", sweep.suite(zip=zip_axis), "--out", store, "--no-progress")
    records = (store / "records.jsonl").read_bytes()
    old_plan = json.loads((store / "points.json").read_text())["points"]
    grown = sweep.suite(grid={"moe.num_experts": [4, 8]}, zip={"parallel.strategy": ["fsdp", "ddp"],
                                                               "moe.top_k": [2, 2]}, description="grown")
    # same configs as before (top_k 2 is the preset's), but values gain an axis: a changed suite
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--no-progress")
    assert code == 0, err  # no point is new: the store's own values stay
    grown = sweep.suite(grid={"moe.num_experts": [4, 8]}, zip={"parallel.strategy": ["fsdp", "ddp", "ddp"],
                                                               "moe.top_k": [2, 2, 1]}, description="grown")
    code, out, err = sweep("run", grown, "--out", store, "--resume", "--extend", "--no-progress")
    assert code == 0, err
    assert sweep.ran == ["p004", "p005"]  # the suite's p002 and p005 (top_k=1), appended
    assert (store / "records.jsonl").read_bytes().startswith(records)
    plan = json.loads((store / "points.json").read_text())["points"]
    assert plan[:4] == old_plan and [p["values"]["moe.top_k"] for p in plan[4:]] == [1, 1]
    meta = json.loads((store / "meta.json").read_text())
    assert meta["n_points"] == 6 and meta["description"] == "grown"
    assert meta["suite_spec"]["zip"][0]["moe.top_k"] == [2, 2, 1]
    assert [e["points"] for e in meta["extended"]] == [["p004", "p005"]]
    df, _ = load_results(store)
    assert df["point_id"].tolist() == [f"p00{i}" for i in range(6)] and df["key"].is_unique
    assert _counts(store, 6) == (0, 0)
    # the extended store is bound to the grown suite: a plain resume takes it and runs nothing
    code, out, err = sweep("run", grown, "--out", store, "--resume", "--no-progress")
    assert code == 0 and sweep.ran == [] and "6 ok" in out, err


def test_a_changed_timeout_or_baseline_follows_into_meta(tmp_path, sweep):
    store = tmp_path / "st"
    sweep("run", sweep.suite(), "--out", store, "--only", "p000", "--no-progress")
    code, _, err = sweep("run", sweep.suite(timeout=77, baseline={"moe.num_experts": 4}), "--out", store,
                         "--resume", "--no-progress")
    assert code == 0 and sweep.ran == ["p001"], err
    meta = json.loads((store / "meta.json").read_text())
    assert meta["suite_spec"]["timeout"] == 77 and meta["baseline"] == {"moe.num_experts": 4}
    assert {p["timeout_s"] for p in json.loads((store / "points.json").read_text())["points"]} == {77}


@pytest.mark.parametrize("args, message", [
    (["--extend"], "--extend adds points to an existing store: use it with --resume or --rerun-failed"),
    (["--resume", "--extend", "--only", "p000"], "--extend adds every new point of the suite: drop --only/--filter"),
])
def test_extend_needs_a_store_to_continue_and_every_new_point(tmp_path, sweep, args, message):
    store = tmp_path / "st"
    if "--resume" in args:
        sweep("run", sweep.suite(), "--out", store, "--no-progress")
    code, _, err = sweep("run", sweep.suite(), "--out", store, *args)
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------- disk errors
def test_enospc_at_store_creation_leaves_nothing(small_disk, sweep):
    filler = _fill(small_disk)
    store = small_disk / "st"
    code, _, err = sweep("run", sweep.suite(), "--out", store, "--no-progress")
    assert code == 2 and err == f"error: {store}: cannot create the store (No space left on device)\n", err
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no store, no temporary folder, no .lock
    filler.unlink()
    code, _, err = sweep("run", sweep.suite(), "--out", store, "--no-progress")
    assert code == 0 and _counts(store, 2) == (0, 0), err


def test_enospc_at_record_append_keeps_the_record_for_resume(tmp_path, small_disk, sweep):
    store = small_disk / "st"
    suite = sweep.suite(grid={"moe.num_experts": [4, 8, 16]})
    sweep.hooks["p001"] = lambda: _fill(small_disk)  # the disk fills up while p001 runs
    code, out, err = sweep("run", suite, "--out", store, "--no-progress")
    assert code == 2 and len(err.splitlines()) == 1, err
    kept = Path(err.split("it is kept in ")[1].split(", and")[0])
    assert err.startswith(f"error: {store / 'records.jsonl'}: cannot append p001's record (No space left"), err
    assert kept.parent.parent == tmp_path / "cache" / "moebench" / "unsaved"  # the store's disk took nothing
    assert [r["point_id"] for r in _records(store)] == ["p000"] and sweep.ran == ["p000", "p001"]
    # status and report see the store as it is, without a traceback
    code, out, err = sweep("status", store)
    assert code == 0 and "p001 ok" in out and "p002 pending" in out, err
    assert err == f"warning: {store}: 1 record(s) kept in side files after a failed write ({kept.parent}); " \
                  "the next `moebench run --resume` on the store merges them into records.jsonl\n"
    code, out, err = sweep("report", store, "-o", tmp_path / "report")
    assert code == 0 and "Traceback" not in err, err
    df, _, warnings = load_results(store, strict=False)  # what the report reads: the kept record too
    assert df["point_id"].tolist() == ["p000", "p001"] and "1 record(s) kept in side files" in warnings[0]
    code, out, err = sweep("run", suite, "--out", store, "--resume", "--no-progress")
    assert code == 2 and "Traceback" not in err  # still full: p001's record stays where it is
    assert kept.exists() and [r["point_id"] for r in _records(store)] == ["p000"]
    (small_disk / "filler").unlink()
    code, out, err = sweep("run", suite, "--out", store, "--resume", "--no-progress")
    assert code == 0, err
    assert sweep.ran == ["p002"] and not kept.exists()  # p001 was merged, not run again
    assert [r["point_id"] for r in _records(store)] == ["p000", "p001", "p002"] and _counts(store, 3) == (0, 0)


@pytest.mark.slow
def test_a_point_that_fills_the_disk_keeps_its_record(tmp_path, small_disk, monkeypatch):
    """The disk fills while a point runs and prints on: its log ends there, its record (the last
    stdout line) is kept in a side file, and --resume merges it as the point's ok record."""
    import sys
    import textwrap

    from moebench.sweep.runner import SweepOptions, run_suite
    from moebench.sweep.suite import parse_suite

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = tmp_path / "fills_the_disk.py"
    script.write_text(textwrap.dedent(f"""
        import json
        with open({str(small_disk / "filler")!r}, "wb", buffering=0) as f:
            for size in (65536, 4096, 1):
                try:
                    while True:
                        f.write(b"x" * size)
                except OSError:
                    pass
        for i in range(300):  # more than the log's last page and a pipe's buffer take
            print(f"step {{i}} " + "x" * 300, flush=True)
        print(json.dumps({{"schema_version": 1, "status": "ok", "tokens_per_s": 1.0}}))
    """))
    suite = parse_suite({"name": "t", "base": {"preset": "tiny"}, "timeout": 60})
    launcher = lambda point: [sys.executable, str(script)]  # noqa: E731
    with pytest.raises(StoreError, match="cannot append p000's record"):
        run_suite(suite, small_disk / "st", SweepOptions(progress=False, echo=lambda _: None, launcher=launcher))
    (small_disk / "filler").unlink()
    run_suite(suite, small_disk / "st", SweepOptions(resume=True, progress=False, echo=lambda _: None,
                                                     launcher=launcher))
    (record,) = _records(small_disk / "st")
    assert record["status"] == "ok" and record["tokens_per_s"] == 1.0


def test_enospc_at_points_json_write_leaves_the_old_plan(small_disk, sweep):
    store = small_disk / "st"
    sweep("run", sweep.suite(), "--out", store, "--no-progress")
    before = {p.name: p.read_bytes() for p in store.iterdir() if p.is_file() and p.name != ".lock"}
    filler = _fill(small_disk)
    grown = sweep.suite(grid={"moe.num_experts": [4, 8, 16]})
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--extend", "--no-progress")
    assert code == 2 and err == f"error: {store / 'points.json'}: cannot write (No space left on device)\n", err
    assert {p.name: p.read_bytes() for p in store.iterdir() if p.is_file() and p.name != ".lock"} == before
    filler.unlink()
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--extend", "--no-progress")
    assert code == 0 and sweep.ran == ["p002"] and _counts(store, 3) == (0, 0), err


def test_a_read_only_store_refuses_writes_in_one_line_and_still_reads(tmp_path, small_disk, sweep):
    store = small_disk / "st"
    suite = sweep.suite()
    sweep("run", suite, "--out", store, "--only", "p000", "--no-progress")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code, _, err = sweep("run", suite, "--out", store, "--resume", "--no-progress")
    assert code == 2 and err == (f"error: {store / '.lock'}: cannot open the store's lock file "
                                 "(Read-only file system)\n"), err
    code, _, err = sweep("run", suite, "--out", small_disk / "new", "--no-progress")
    assert code == 2 and err == f"error: {small_disk / 'new'}: cannot create the store (Read-only file system)\n"
    code, out, err = sweep("status", store)
    assert code == 0 and "p000 ok" in out and "p001 pending" in out, err
    code, _, err = sweep("report", store, "-o", tmp_path / "report")
    assert code == 0, err


def _failing(monkeypatch, name: str, fail):
    """Patch ``os.<name>`` for calls on records.jsonl only (by path, or by descriptor)."""
    real = getattr(os, name)

    def patched(target, *args, **kwargs):
        path = target if isinstance(target, (str, Path)) else os.readlink(f"/proc/self/fd/{target}")
        if str(path).endswith("records.jsonl"):
            return fail(real, target, *args, **kwargs)
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, name, patched)


def _raise(code):
    def fail(real, target, *args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("name, fail, reason", [
    ("write", lambda real, fd, data: real(fd, data[: len(data) // 2]), "No space left on device after"),  # half a line
    ("fsync", _raise(errno.ENOSPC), "No space left on device"),  # written, but the disk refuses it at fsync
    ("write", _raise(errno.EDQUOT), "Disk quota exceeded"),
    ("open", _raise(errno.EROFS), "Read-only file system"),
])
def test_a_record_that_cannot_be_appended_is_cut_back_and_kept(tmp_path, monkeypatch, name, fail, reason):
    store = Store(tmp_path / "st")
    store.create({"suite": "t", "run_id": "r"})
    first = {"point_id": "p000", "key": "k0", "status": "ok", "step_times_s": [0.1] * 50}
    second = {**first, "point_id": "p001", "key": "k1"}
    with store.locked():
        store.append(first)
    before = store.records_path.read_bytes()
    with monkeypatch.context() as patch:
        _failing(patch, name, fail)
        with store.locked(), pytest.raises(StoreError) as info:
            store.append(second)
    assert store.records_path.read_bytes() == before  # no half line left behind
    (kept, record), = store.unsaved_records()
    assert kept.parent == store.path / "unsaved" and record == upgrade(second)  # read as every store line is
    assert str(info.value) == (f"{store.records_path}: cannot append p001's record ({reason}"
                               + str(info.value).split(reason, 1)[1])
    assert f"it is kept in {kept}" in str(info.value)
    with store.locked():
        assert store.merge_unsaved() == [upgrade(second)] and store.merge_unsaved() == []
    assert [r["key"] for r in store.read_records()[0]] == ["k0", "k1"] and not kept.exists()


def test_a_side_file_merged_before_it_could_be_removed_is_not_appended_twice(tmp_path):
    store = Store(tmp_path / "st")
    store.create({"suite": "t", "run_id": "r"})
    record = {"point_id": "p000", "key": "k0", "status": "ok"}
    with store.locked():
        store.append(record)
    side = store.path / "unsaved" / "1-1.json"
    side.parent.mkdir()
    side.write_text(json.dumps(record) + "\n")  # a merge killed between its append and the unlink
    with store.locked():
        assert store.merge_unsaved() == []
    assert len(store.read_records()[0]) == 1 and not side.exists()


@pytest.mark.parametrize("step", ["mkdir", "write", "rename"])
def test_a_store_that_cannot_be_made_leaves_nothing(tmp_path, monkeypatch, step):
    from moebench.results import durable

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target = {"mkdir": (Path, "mkdir"), "write": (durable, "write_synced"), "rename": (os, "rename")}[step]
    (tmp_path / "results").mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(*target, fail)
        with pytest.raises(StoreError, match=r"results/st: cannot create the store \(No space left on device\)"):
            Store(tmp_path / "results" / "st").create({"suite": "t", "run_id": "r"}, {"points.json": "{}"})
    assert list((tmp_path / "results").iterdir()) == []


def test_an_empty_folder_becomes_a_store_under_its_lock(tmp_path, monkeypatch):
    from moebench.results import store as store_module

    folder = tmp_path / "st"
    folder.mkdir()
    calls = []

    def fail_on_meta(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "meta.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(store_module.os, "rename", fail_on_meta)
        with pytest.raises(StoreError, match="cannot create the store"):
            Store(folder).create({"suite": "t", "run_id": "r"}, {"points.json": "{}"})
    assert calls == ["logs", "points.json", "meta.json"]  # meta.json last: without it nothing is a store
    assert [p.name for p in folder.iterdir()] == [".lock"]  # the lock file: the folder is not a store
    Store(folder).create({"suite": "t", "run_id": "r"}, {"points.json": "{}"})
    assert Store(folder).read_meta()["suite"] == "t" and (folder / "points.json").read_text() == "{}"


def test_a_rival_that_makes_the_store_first_wins_whole(tmp_path, monkeypatch):
    """Two sweeps creating one fresh --out: the second rename finds a whole store and gives up."""
    from moebench.results import store as store_module

    target = Store(tmp_path / "st")
    build = store_module._build

    def rival_first(folder, texts):
        build(folder, texts)
        if not target.exists():
            with monkeypatch.context() as patch:
                patch.setattr(store_module, "_build", build)
                target.create({"suite": "rival", "run_id": "r1"})

    monkeypatch.setattr(store_module, "_build", rival_first)
    with pytest.raises(StoreError, match="already holds a results store"):
        target.create({"suite": "t", "run_id": "r2"})
    assert target.read_meta()["suite"] == "rival"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["st"]  # the loser's temporary folder is gone


def test_a_slurm_record_whose_merge_fails_is_merged_once(tmp_path, monkeypatch):
    """merge_pending's append fails: the record stays in pending/ and a copy goes to a side file;
    the next merge takes the pending one and drops the copy."""
    from moebench.sweep.slurm import merge_pending, write_pending

    store = Store(tmp_path / "st")  # that submitted p000 as Slurm task 7_0
    task = {"point_id": "p000", "key": "k0"}
    store.create({"suite": "t", "run_id": "r", "slurm": {"jobs": [{"job_id": "7", "tasks": {"0": task}}]}})
    record = {**task, "status": "ok", "slurm_job_id": "7", "slurm_task_id": "0"}
    write_pending(store, record)
    with monkeypatch.context() as patch:
        _failing(patch, "write", _raise(errno.ENOSPC))
        with store.locked(), pytest.raises(StoreError, match="cannot append p000's record"):
            merge_pending(store)
    assert len(store.unsaved_records()) == 1 and not store.records_path.read_bytes()
    with store.locked():  # the order of a sweep's start: pending/ first, then the side files
        merge_pending(store)
        assert store.merge_unsaved() == []
    assert store.read_records()[0] == [upgrade(record)] and store.unsaved_records() == []


def _points(**grid):
    from moebench.sweep.suite import parse_suite

    return parse_suite({"name": "b", "base": {"preset": "tiny"}, "grid": grid}).points()


def test_the_difference_named_is_the_rank_count_a_field_or_the_version():
    import moebench
    from moebench.sweep.binding import bind_plan, first_difference

    (point,) = _points(**{"moe.num_experts": [4]})
    assert first_difference({**point.to_dict(), "nproc": 2}, point, "0.0") == "nproc 2 -> 1"
    (other,) = _points(**{"moe.num_experts": [6]})
    assert first_difference(point.to_dict(), other, "0.0") == "moe.num_experts 4 -> 6"
    stale = {**point.to_dict(), "key": "0" * 16}  # the same config, keyed by another moebench
    with pytest.raises(StoreError, match=re.escape(f"under another moebench version (0.0 -> {moebench.__version__})")):
        bind_plan([stale], [point], False, "points.json", "0.0")


def test_extend_keeps_a_planned_duplicate_and_numbers_new_ones_in_the_store():
    from moebench.sweep.binding import bind_plan

    old = _points(**{"moe.num_experts": [4, 4]})
    assert old[1].duplicate_of == "p000"
    grown = _points(**{"moe.num_experts": [2, 2, 4, 4]})  # two new points first, the second a duplicate
    bound = bind_plan([p.to_dict() for p in old], grown, True, "points.json")
    assert [(p.point_id, p.values["moe.num_experts"], p.duplicate_of) for p in bound] == [
        ("p000", 4, None), ("p001", 4, "p000"), ("p002", 2, None), ("p003", 2, "p002")]
    assert [p.key for p in bound[:2]] == [old[0].key] * 2


def test_a_kill_between_the_plan_and_meta_writes_of_extend_loses_no_history(tmp_path, sweep):
    store = tmp_path / "st"
    sweep("run", sweep.suite(), "--out", store, "--no-progress")
    meta_before = (store / "meta.json").read_bytes()
    grown = sweep.suite(grid={"moe.num_experts": [4, 8, 16]})
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--extend", "--no-progress")
    assert code == 0, err
    (store / "meta.json").write_bytes(meta_before)  # as if killed after points.json, before meta.json
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--no-progress")
    assert code == 0 and sweep.ran == [], err
    meta = json.loads((store / "meta.json").read_text())
    assert meta["n_points"] == 3 and [(e["points"], e.get("recovered")) for e in meta["extended"]] == [(["p002"], True)]
    code, _, err = sweep("run", grown, "--out", store, "--resume", "--no-progress")  # recorded once
    assert code == 0 and len(json.loads((store / "meta.json").read_text())["extended"]) == 1


def test_side_files_belong_to_the_store_run_not_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = Store(tmp_path / "st")
    first.create({"suite": "a", "run_id": "run-a"})
    kept, _ = first._keep_unsaved({"point_id": "p000", "key": "ka", "status": "ok"})
    own, cached = first.unsaved_dirs()
    assert cached == tmp_path / "cache" / "moebench" / "unsaved" / "run-a" and kept.parent == own
    (cached / "1-1.json").parent.mkdir(parents=True)
    os.replace(kept, cached / "1-1.json")  # the store's disk was full too
    assert [r["key"] for _, r in first.unsaved_records()] == ["ka"]
    # the folder is removed and another store made at the same path: it never sees run-a's side file
    for path in sorted(first.path.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    first.path.rmdir()
    second = Store(tmp_path / "st")
    second.create({"suite": "b", "run_id": "run-b"})
    assert second.unsaved_records() == [] and second.unsaved_dirs()[1].name == "run-b"
    # a side file of another run inside this store's own folder (a folder reused by hand): set aside
    (second.path / "unsaved").mkdir()
    stray = second.path / "unsaved" / "2-2.json"
    stray.write_text(json.dumps({"point_id": "p000", "key": "ka", "status": "ok", "unsaved_by_run": "run-a"}))
    problems: list[str] = []
    assert second.unsaved_records(problems) == []
    assert problems == [f"{stray}: a record kept by store run 'run-a', not by this one ('run-b'): never merged here"]
    warnings: list[str] = []
    with second.locked():
        assert second.merge_unsaved(warnings.append) == []
    assert warnings == [problems[0] + f"; moved to {stray.parent / 'ignored' / stray.name}"]
    assert not stray.exists() and second.read_records()[0] == []
    assert (cached / "1-1.json").exists()  # run-a's own side file stays where run-a would find it


def test_store_output_paths(tmp_path, sweep, monkeypatch):
    cwd = tmp_path / "repo"
    cwd.mkdir()
    (cwd / "README.md").write_text("a repository")
    monkeypatch.chdir(cwd)
    code, _, err = sweep("run", sweep.suite(), "--out", "", "--no-progress")
    assert code == 2 and err.startswith("error: --out '': an empty path names no folder") and len(err.splitlines()) == 1
    code, _, err = sweep("run", sweep.suite(), "--out", cwd, "--no-progress")
    assert code == 2 and f"{cwd} is not empty (1 entries: README.md) and holds no results store" in err, err
    assert sorted(os.listdir(cwd)) == ["README.md"] and not (tmp_path / "latest").exists() and sweep.ran == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sweep("run", sweep.suite(), "--out", empty, "--no-progress")[0] == 0 and (empty / "meta.json").exists()
    long = tmp_path / ("x" * 300)
    for args in (["run", sweep.suite(), "--out", long, "--no-progress"], ["status", long]):
        code, _, err = sweep(*args)
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "too long" in err


def test_finding_stores_passes_over_folders_that_vanish_while_walked(tmp_path, monkeypatch):
    """``report /`` walked /proc, where folders vanish between listing and reading: a
    FileNotFoundError traceback. A folder that cannot be listed is passed over."""
    from moebench.results.load import find_stores

    store = tmp_path / "results" / "s" / "r1"
    store.mkdir(parents=True)
    (store / "meta.json").write_text("{}")
    (tmp_path / "proc" / "4242" / "task").mkdir(parents=True)
    (tmp_path / "results" / "s" / "latest").symlink_to("r1")
    real_scandir = os.scandir

    def vanishing(path="."):
        if Path(path).name == "4242":  # listed by its parent, gone by the time it is read
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", vanishing)
    assert find_stores(tmp_path) == [store]
