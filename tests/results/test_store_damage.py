"""Hostile store files x every reader: no traceback, no hang, no silent acceptance.

Each case damages one file of a copy of a small store (made once, in-process, by ``moebench run``
with the training step replaced) and runs ``status``, ``report``, ``check`` and ``run --resume``
in-process against it. Every reader that reads the damaged file must name it (a warning for the
lenient ``status``/``report``/``resume``, an exit-2 error line for the strict ``check``); a reader
that does not read it, or damage that is harmless (CRLF line ends), must pass as on the clean
store. Nothing here starts a process, so the whole matrix runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from report_helpers import fixture_store, run_cli

from moebench.results import reader

SMOKE = fixture_store("smoke")
READERS = ("status", "report", "check", "resume")
LINE_CAP = 256 * 2**10  # the readers' bounds, lowered so that a test file can pass them
FILE_CAP = 2**20
HANG_S = 5


class Hang(Exception):
    pass


def _run_record() -> dict:
    """A measured record's numbers, from the smoke fixture's first point (config fields left to the point)."""
    first = json.loads((SMOKE / "records.jsonl").read_text().splitlines()[0])
    keep = ("schema_version", "status", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu",
            "step_time_median_s", "step_times_s", "timed_steps", "loss_first", "loss_last", "losses",
            "peak_mem_bytes", "device", "device_name", "precision", "tokens_per_step", "flops_per_token")
    return {k: first[k] for k in keep if k in first}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(store, suite file): two ok points, a points.json, a pending/ and an unsaved/ folder."""
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    root = tmp_path_factory.mktemp("clean")
    suite = root / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "dmg", "base": {"preset": "tiny", "set": {"train.steps": 3}},
                                     "grid": {"moe.num_experts": [4, 8]}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "ok", None, _run_record()))
        from moebench.cli import main

        mp.setattr("sys.argv", ["moebench", "run", str(suite), "--out", str(root / "store"), "--no-progress"])
        main()
    store = root / "store"
    (store / "pending").mkdir()
    (store / "unsaved").mkdir()
    return store, suite


@pytest.fixture
def run(clean, tmp_path, monkeypatch, capsys):
    """``run(damage, reader)``: copy the clean store, damage it, run the reader; (code, out, err, crash)."""
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    store_src, suite = clean
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", LINE_CAP)
    monkeypatch.setattr(reader, "MAX_FILE_BYTES", FILE_CAP)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "ok", None,
                                                                                          _run_record()))
    monkeypatch.setattr("moebench.report.plots.render_all", lambda *a, **k: [])  # the readers are under test

    def go(damage: Callable[[Path], None], name: str):
        store = tmp_path / "store"
        base = tmp_path / "base"
        shutil.copytree(store_src, store, symlinks=True)
        shutil.copytree(store_src, base, symlinks=True)
        damage(store)
        args = {"status": ["status", store], "report": ["report", store, "-o", tmp_path / "r"],
                "check": ["check", base, store], "resume": ["run", suite, "--out", store, "--resume", "--no-progress"]}
        old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hang()))
        signal.alarm(HANG_S)
        try:
            code, out, err = run_cli([str(a) for a in args[name]], monkeypatch, capsys)
            crash = None
        except Hang:
            code, out, err, crash = None, "", "", "hang"
        except Exception as exc:
            captured = capsys.readouterr()
            code, out, err, crash = None, captured.out, captured.err, f"traceback: {type(exc).__name__}: {exc}"[:200]
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        return code, out, err, crash

    return go


# ---------------------------------------------------------------------- damage kinds
def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        path = store / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        make(path)
    return damage


def _link(target: str) -> Callable[[Path], None]:
    return lambda p: p.symlink_to(target)


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _loop(p: Path) -> None:
    p.symlink_to(p.name)


def _garbage(p: Path) -> None:
    p.write_bytes(bytes(range(256)) * 64)


def _deep(p: Path) -> None:
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n")


def _edit_records(edit: Callable[[list[str]], list[str]]) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        path = store / "records.jsonl"
        path.write_text("".join(line + "\n" for line in edit(path.read_text().splitlines())))
    return damage


def _edit_first(change: Callable[[dict], dict]) -> Callable[[Path], None]:
    return _edit_records(lambda lines: [json.dumps(change(json.loads(lines[0]))), *lines[1:]])


def _pending(text: bytes | str, name: str = "p000-7_0.json") -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        data = text if isinstance(text, bytes) else text.encode()
        (store / "pending" / name).write_bytes(data)
    return damage


def _nan_loss(lines: list[str]) -> list[str]:
    text = lines[0]
    record = json.loads(text)
    record["loss_last"] = 123456.5
    record["losses"][-1] = 123456.5
    return [json.dumps(record).replace("123456.5", "NaN"), *lines[1:]]


def _later_failed(lines: list[str]) -> list[str]:
    record = json.loads(lines[0])
    return [*lines, json.dumps({**record, "status": "failed", "error": "RuntimeError: later"})]


def _crlf(store: Path) -> None:
    for name in ("records.jsonl", "meta.json", "points.json"):
        path = store / name
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


def _meta_type(store: Path) -> None:
    meta = json.loads((store / "meta.json").read_text())
    (store / "meta.json").write_text(json.dumps({**meta, "suite": 5}))


def _long_line(store: Path) -> None:
    with open(store / "records.jsonl", "a") as f:
        f.write("x" * (2 * LINE_CAP) + "\n")


def _big_file(store: Path) -> None:
    path = store / "records.jsonl"
    lines = path.read_text()
    path.write_text(lines * (FILE_CAP // len(lines) + 2))


def _stray_record(point_id: str) -> Callable[[Path], None]:
    """A pending/ record of a task this store never submitted, for ``point_id``."""
    def damage(store: Path) -> None:
        record = json.loads((store / "records.jsonl").read_text().splitlines()[0])
        record.update(point_id=point_id, slurm_job_id="7", slurm_task_id="0")
        (store / "pending" / "p000-7_0.json").write_text(json.dumps(record) + "\n")
    return damage


def _trace(make: Callable[[Path], None]) -> Callable[[Path], None]:
    """The first record names a trace (as a traced run's does), and ``make`` puts something at its path."""
    name = "logs/p000.ranks/rank0.trace.json.gz"

    def damage(store: Path) -> None:
        _edit_first(lambda r: {**r, "trace_files": [name]})(store)
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        make(store / name)
    return damage


# name -> (damage, what the readers' lines must name, which readers read the damaged file)
ALL = set(READERS)
PLAN = {"status", "report", "resume"}  # points.json and pending/: planned points, records to merge
CASES: dict[str, tuple[Callable[[Path], None], str, set[str]]] = {
    "records -> /dev/zero": (_replace("records.jsonl", _link("/dev/zero")), "records.jsonl", ALL),
    "records -> /dev/urandom": (_replace("records.jsonl", _link("/dev/urandom")), "records.jsonl", ALL),
    "meta -> /dev/zero": (_replace("meta.json", _link("/dev/zero")), "meta.json", ALL),
    "records FIFO": (_replace("records.jsonl", _fifo), "records.jsonl", ALL),
    "meta FIFO": (_replace("meta.json", _fifo), "meta.json", ALL),
    "points FIFO": (_replace("points.json", _fifo), "points.json", PLAN),
    "pending FIFO": (_replace("pending/p000-7_0.json", _fifo), "p000-7_0.json", PLAN),
    "unsaved FIFO": (_replace("unsaved/1-1.json", _fifo), "1-1.json", ALL),
    "lock FIFO": (_replace(".lock", _fifo), ".lock", set()),  # flock works on it: no reader is harmed
    "records symlink loop": (_replace("records.jsonl", _loop), "records.jsonl", ALL),
    "meta symlink loop": (_replace("meta.json", _loop), "meta.json", ALL),
    "records dangling link": (_replace("records.jsonl", _link("gone.jsonl")), "records.jsonl", ALL),
    "meta dangling link": (_replace("meta.json", _link("gone.json")), "meta.json", ALL),
    "points dangling link": (_replace("points.json", _link("gone.json")), "points.json", PLAN),
    "records a directory": (_replace("records.jsonl", lambda p: p.mkdir()), "records.jsonl", ALL),
    "meta binary garbage": (_replace("meta.json", _garbage), "meta.json", ALL),
    "points binary garbage": (_replace("points.json", _garbage), "points.json", PLAN),
    "pending binary garbage": (_pending(bytes(range(256)) * 64), "p000-7_0.json", PLAN),
    "unsaved binary garbage": (_replace("unsaved/1-1.json", _garbage), "1-1.json", ALL),
    "meta 100k deep": (_replace("meta.json", _deep), "meta.json", ALL),
    "points 100k deep": (_replace("points.json", _deep), "points.json", PLAN),
    "records line 100k deep": (_edit_records(lambda ls: [*ls, "[" * 100_000 + "]" * 100_000]), "records.jsonl", ALL),
    "pending 100k deep": (_pending("[" * 100_000 + "]" * 100_000), "p000-7_0.json", PLAN),
    "records file over the cap": (_big_file, "records.jsonl", ALL),
    "records line over the cap": (_long_line, "records.jsonl", ALL),
    "CRLF line ends": (_crlf, "", set()),
    "NaN loss": (_edit_records(_nan_loss), "diverged", ALL),
    "config a string": (_edit_first(lambda r: {**r, "config": "hello"}), "records.jsonl", ALL),
    "point a list": (_edit_first(lambda r: {**r, "point": [1, 2]}), "records.jsonl", ALL),
    "layout a number": (_edit_first(lambda r: {**r, "layout": 5}), "records.jsonl", ALL),
    "point_id a path": (_edit_first(lambda r: {**r, "point_id": "../../../../etc/passwd"}), "records.jsonl", ALL),
    "pending point_id a path": (_stray_record("../../../../etc/passwd"), "p000-7_0.json", PLAN),
    "later failed record of an ok key": (_edit_records(_later_failed), "after an ok one", ALL),
    "meta field of the wrong type": (_meta_type, "meta.json", ALL),
    "trace FIFO": (_trace(_fifo), "rank0.trace.json.gz", {"report"}),  # only the report reads traces
    "trace -> /dev/zero": (_trace(_link("/dev/zero")), "rank0.trace.json.gz", {"report"}),
}


UNREADABLE_RECORDS = {case for case in CASES if case.startswith("records ") and "line" not in case}


def outcome(err: str, crash: str | None, named: str) -> str:
    """What a reader did with a damaged store: ``traceback``, ``hang``, ``named`` (its lines name
    the damaged file) or ``unnamed`` (it said nothing about it: a silent acceptance where it reads
    the file, the right answer where it does not)."""
    if crash is not None:
        return crash.split(":")[0]
    if "Traceback" in err:
        return "traceback"
    return "named" if named and named in err else "unnamed"


@pytest.mark.parametrize("reader_name", READERS)
@pytest.mark.parametrize("case", list(CASES))
def test_damage(case, reader_name, run):
    damage, named, reads = CASES[case]
    code, _, err, crash = run(damage, reader_name)
    got = outcome(err, crash, named)
    assert got == ("named" if reader_name in reads else "unnamed"), (code, err[-600:], crash)
    assert not any(line.startswith("  File ") for line in err.splitlines()), err[-600:]
    if case in UNREADABLE_RECORDS:  # no reader goes on without the store's records: exit 2 in every one
        assert code == 2, err
    elif case.startswith("unsaved"):  # a side file is not yet the store's: every reader warns and skips it
        assert code == 0, err
    elif reader_name == "check" and reader_name in reads and named not in ("diverged", "after an ok one"):
        assert code == 2, err  # strict: a damaged store is a data error (the others are readable records)


def test_crlf_and_nan_metrics_read_like_the_clean_store(clean, tmp_path):
    from moebench.results.load import load_results

    store_src, _ = clean
    store = tmp_path / "store"
    shutil.copytree(store_src, store, symlinks=True)
    clean_df, _ = load_results(store)
    _crlf(store)
    path = store / "records.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["mfu"] = 7.25
    path.write_text("\n".join([lines[0], json.dumps(record).replace("7.25", "Infinity"), ""]))
    df, _, warnings = load_results(store, strict=False)
    assert warnings == [] and df["point_id"].tolist() == clean_df["point_id"].tolist() == ["p000", "p001"]
    assert df["mfu"].isna().tolist() == [False, True]  # JSON has no infinity: read as null, as the writer writes it


def test_a_long_line_is_skipped_without_holding_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "f"
    path.write_bytes(b"a\n" + b"x" * 5000 + b"\nb\r\nc")
    assert list(reader.lines(path)) == [(1, b"a\n"), (2, None), (3, b"b\r\n"), (4, b"c")]
