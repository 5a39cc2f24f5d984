"""Results store: atomic appends, SIGKILL safety, the lock, and the tolerant loader."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from moebench.errors import StoreError
from moebench.record import to_json_line
from moebench.results.durable import append_line
from moebench.results.load import load_results
from moebench.results.store import Store


def _record(i: int, status: str = "ok", **extra) -> dict:
    return {
        "schema_version": 1, "point_id": f"p{i}", "key": f"k{i}", "status": status,
        "point": {"moe.num_experts": 8 * (i + 1)}, "config": {"moe": {"num_experts": 8 * (i + 1)}},
        "layout": {"strategy": "fsdp"}, "tokens_per_s": 100.0 + i, "step_times_s": [0.1, 0.2],
        **extra,
    }


def _store(tmp_path, n: int = 3) -> Store:
    store = Store(tmp_path / "run")
    store.create({"suite": "t", "run_id": "r1", "baseline": {"parallel.strategy": "fsdp"}})
    with store.locked():
        for i in range(n):
            store.append(_record(i))
    return store


def test_roundtrip_flattens_columns(tmp_path):
    store = _store(tmp_path)
    df, meta = load_results(store.path)
    assert meta["suite"] == "t" and meta["schema_version"] == 1
    assert list(df["point_id"]) == ["p0", "p1", "p2"]
    assert list(df["config.moe.num_experts"]) == [8, 16, 24]
    assert list(df["point.moe.num_experts"]) == [8, 16, 24]
    assert df["layout.strategy"].tolist() == ["fsdp"] * 3
    assert df["step_times_s"].iloc[0] == [0.1, 0.2]
    assert set(df["run_id"]) == {"r1"}


def test_create_refuses_existing_store(tmp_path):
    store = _store(tmp_path, 1)
    with pytest.raises(StoreError, match="already holds a results store"):
        store.create({"suite": "t"})


def test_truncated_line_named_and_rest_readable(tmp_path):
    store = _store(tmp_path, 2)
    with open(store.records_path, "a") as f:
        f.write('{"key": "k9", "status": "o')  # a crash mid-line
    with pytest.raises(StoreError, match=r"records\.jsonl:3: truncated"):
        load_results(store.path)
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p1"]
    assert len(warnings) == 1 and ":3:" in warnings[0]
    # the next writer ends the partial line so the new record stays readable
    with store.locked():
        store.append(_record(5))
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p1", "p5"]
    assert len(warnings) == 1


@pytest.mark.parametrize("tail", [b"\x00" * 64 + b"\n", b"\x00" * 4096])
def test_a_zero_filled_tail_is_named_as_such(tmp_path, tail):
    """A crash can leave a file longer than what was written, the rest zeros: not a UTF-32 decode error."""
    store = _store(tmp_path, 2)
    with open(store.records_path, "ab") as f:
        f.write(tail)
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p1"]
    n = len(tail.rstrip(b"\n"))
    assert warnings == [f"{store.records_path}:3: zero-filled line ({n} NUL bytes where no record was written)"]


def test_a_cut_line_is_still_called_truncated_after_the_next_writer_ends_it(tmp_path):
    store = _store(tmp_path, 1)
    with open(store.records_path, "a") as f:
        f.write('{"key": "k9", "status": "o')
    with store.locked():  # a resumed sweep terminates the partial line before appending
        store.append(_record(2))
    with pytest.raises(StoreError, match=r"records\.jsonl:2: truncated line"):
        load_results(store.path)
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p2"] and len(warnings) == 1


def test_a_line_cut_anywhere_is_truncated_and_a_damaged_one_corrupt(tmp_path):
    """Every cut of a real record line, once ended by a newline (as the next writer does), reads as
    truncated whatever token it stops in (a literal, a number, an escape); the line with a byte
    changed reads as corrupt."""
    store = _store(tmp_path, 1)
    line = to_json_line(_record(9, finished=True, oom=False, error=None, loss=-1.5e-07, host='h\u00e9"x'))
    assert all(token in line for token in ("true", "false", "null", "-1.5e-07", "\\u00e9", '\\"'))
    cuts = [line[:n] for n in range(1, len(line))]
    damaged = [line.replace("true", "trux"), line.replace(",", " ", 1), line + "}"]
    with open(store.records_path, "a") as f:
        f.writelines(text + "\n" for text in cuts + damaged)
    _, warnings = store.read_records(strict=False)
    kinds = [w.split(": ")[1].split(" (")[0] for w in warnings]
    assert kinds == ["truncated line"] * len(cuts) + ["corrupt line"] * len(damaged)


def test_a_line_cut_in_a_literal_is_truncated_after_the_next_writer_ends_it(tmp_path):
    store = _store(tmp_path, 1)
    with open(store.records_path, "a") as f:
        f.write('{"key": "k9", "ok": tru')
    with store.locked():
        store.append(_record(2))
    with pytest.raises(StoreError, match=r"records\.jsonl:2: truncated line"):
        load_results(store.path)


@pytest.mark.parametrize(("edit", "message"), [
    ({"key": [1]}, "field 'key' must be a non-empty string, got [1]"),
    ({"key": None}, "field 'key' must be a non-empty string, got None"),
    ({"key": ""}, "field 'key' must be a non-empty string"),
    ({"status": 5}, "field 'status' must be a non-empty string, got 5"),
])
def test_a_record_whose_key_or_status_is_not_text_is_named(tmp_path, edit, message):
    store = _store(tmp_path, 1)
    with store.locked():
        store.append({**_record(1), **edit})
        store.append(_record(2))
    with pytest.raises(StoreError, match=rf"records\.jsonl:2: {re.escape(message)}"):
        load_results(store.path)
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p2"] and len(warnings) == 1
    assert set(store.latest_by_key()) == {"k0", "k2"}


def test_unreadable_files_are_store_errors_naming_them(tmp_path):
    store = _store(tmp_path, 1)
    store.records_path.unlink()
    store.records_path.mkdir()
    with pytest.raises(StoreError, match=r"records\.jsonl: a directory, not a regular file; not read"):
        load_results(store.path)
    with pytest.raises(StoreError, match=r"records\.jsonl: a directory, not a regular file"), store.locked():
        pass  # a sweep does not append to it either
    store.meta_path.unlink()
    store.meta_path.mkdir()
    with pytest.raises(StoreError, match=r"meta\.json: a directory, not a regular file; not read"):
        store.read_meta()


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("host", "laptop", "object"), ("git", 5, "object"), ("baseline", "fsdp", "object"), ("suite", ["a"], "string"),
])
def test_meta_fields_of_the_wrong_type_are_named(tmp_path, field, value, kind):
    store = _store(tmp_path, 1)
    store.update_meta(**{field: value})
    message = rf"meta\.json: field '{field}' must be a JSON {kind}, got {re.escape(repr(value))}"
    with pytest.raises(StoreError, match=message):
        load_results(store.path)


def test_store_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match=r"file/run: cannot create the store folder \(Not a directory"), \
            Store(tmp_path / "file" / "run").locked():
        pass


def test_create_refuses_records_without_their_meta(tmp_path):
    store = _store(tmp_path, 2)
    before = store.records_path.read_bytes()
    store.meta_path.unlink()
    with pytest.raises(StoreError, match=r"records\.jsonl exists but .*meta\.json does not"):
        store.create({"suite": "other", "run_id": "r2"})
    assert store.records_path.read_bytes() == before and not store.meta_path.exists()


def test_corrupt_middle_line(tmp_path):
    store = _store(tmp_path, 1)
    with open(store.records_path, "a") as f:
        f.write("not json\n")
        f.write(json.dumps(_record(7)) + "\n")
    with pytest.raises(StoreError, match=r":2: corrupt"):
        load_results(store.path)
    df, _, warnings = load_results(store.path, strict=False)
    assert list(df["point_id"]) == ["p0", "p7"] and len(warnings) == 1


def test_latest_record_wins_on_rerun(tmp_path):
    store = _store(tmp_path, 2)
    with store.locked():
        store.append(_record(1, status="ok", tokens_per_s=999.0))
    df, _ = load_results(store.path)
    assert len(df) == 2 and df.set_index("key").loc["k1", "tokens_per_s"] == 999.0
    df_all, _ = load_results(store.path, latest_only=False)
    assert len(df_all) == 3


def test_lock_blocks_second_sweep(tmp_path):
    store = _store(tmp_path, 0)
    # a second descriptor conflicts even within one process (flock is per open file)
    busy = pytest.raises(StoreError, match=r"locked by another sweep \(pid \d+")
    with store.locked(), busy, Store(store.path).locked():
        pass
    with store.locked():  # released again
        pass


def test_a_finished_sweep_leaves_a_lock_naming_no_one(tmp_path):
    """Finished stores kept a .lock naming a dead pid; the holder's line now lasts while it holds it."""
    store = _store(tmp_path, 0)
    lock = store.path / ".lock"
    with store.locked():
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")
    assert lock.exists() and lock.read_text() == ""
    with store.locked():
        with pytest.raises(StoreError), Store(store.path).locked():
            pass
        assert lock.read_text().startswith("pid ")  # a refused second sweep does not empty the holder's line


def test_several_stores_and_parent_folder(tmp_path):
    a = _store(tmp_path / "a", 1)
    b = _store(tmp_path / "b", 2)
    df, metas = load_results([a.path, b.path])
    assert len(df) == 3 and isinstance(metas, list) and len(metas) == 2
    df, metas = load_results(tmp_path)  # a folder of stores
    assert len(df) == 3 and len(metas) == 2
    with pytest.raises(StoreError, match="nowhere: no such results store"):
        load_results(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="empty: no results store here"):
        load_results(tmp_path / "empty")


def test_latest_link_is_not_a_second_store(tmp_path):
    suite = tmp_path / "smoke"
    stores = []
    for run_id, n in [("r1", 1), ("r2", 2)]:
        store = Store(suite / run_id)
        store.create({"suite": "smoke", "run_id": run_id})
        with store.locked():
            for i in range(n):
                store.append(_record(i))
        stores.append(store)
    assert stores[1].link_latest() == suite / "latest"
    df, meta = load_results(suite / "latest")
    assert len(df) == 2 and meta["run_id"] == "r2"
    df, metas = load_results(suite)  # the link and its target count once
    assert len(df) == 3 and sorted(m["run_id"] for m in metas) == ["r1", "r2"]
    stores[0].link_latest()
    assert (suite / "latest").resolve() == stores[0].path.resolve()


def test_bad_meta_version(tmp_path):
    store = _store(tmp_path, 1)
    store.update_meta(schema_version=99)
    with pytest.raises(StoreError, match="schema_version 99"):
        load_results(store.path)
    store.meta_path.write_text("[1]")
    with pytest.raises(StoreError, match=r"meta\.json: expected a JSON object, got list"):
        load_results(store.path)


@pytest.mark.slow
def test_sigkill_never_leaves_partial_line(tmp_path):
    """A writer appending big lines in a loop is SIGKILLed; every line on disk is whole."""
    path = tmp_path / "records.jsonl"
    code = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from moebench.results.durable import append_line
        pad = "x" * 200_000
        i = 0
        while True:
            append_line(Path({str(path)!r}), json.dumps({{"key": str(i), "status": "ok", "pad": pad}}))
            i += 1
            if i == 3:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    data = path.read_bytes()
    assert data.endswith(b"\n")
    lines = data.splitlines()
    assert len(lines) >= 3
    assert [json.loads(x)["key"] for x in lines] == [str(i) for i in range(len(lines))]


def test_append_line_adds_newline(tmp_path):
    path = tmp_path / "f.jsonl"
    append_line(path, '{"a": 1}')
    append_line(path, '{"a": 2}\n')
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
