"""Record schema versions: older records are upgraded where every store line is read
(moebench/results/migrate.py through results/lines.py), a newer one is refused with file and line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moebench.errors import StoreError
from moebench.record import SCHEMA_VERSION
from moebench.results.lines import parse_store_line
from moebench.results.load import load_results
from moebench.results.migrate import V2_FIELDS, NewerRecord, upgrade
from moebench.results.store import Store

FIXTURES = Path(__file__).parent.parent / "fixtures" / "results"
STORES = sorted(p.parent for p in FIXTURES.rglob("meta.json"))


def _line(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


def test_the_fixture_stores_are_version_1_on_disk():
    # the migration is tested on them: they must stay old records (rewrite them and this fails)
    assert STORES
    for store in STORES:
        lines = (store / "records.jsonl").read_text().splitlines()
        versions = {json.loads(line).get("schema_version", 1) for line in lines}
        assert versions == {1}, store


@pytest.mark.parametrize("store", STORES, ids=lambda p: p.parent.name)
def test_fixture_records_read_at_the_current_version(store):
    records, warnings = Store(store).read_records()
    assert records and not warnings
    for record in records:
        assert record["schema_version"] == SCHEMA_VERSION == 2
        assert all(name in record and record[name] is None for name in V2_FIELDS)


@pytest.mark.parametrize("store", STORES, ids=lambda p: p.parent.name)
def test_fixture_tables_have_the_version_2_columns(store):
    df, _ = load_results(store)
    assert set(df["schema_version"]) == {2}
    assert all(name in df.columns and df[name].isna().all() for name in V2_FIELDS)


def test_upgrade_keeps_what_a_v1_record_has_and_fills_the_rest():
    old = {"schema_version": 1, "key": "k", "status": "ok", "window_drift": 1.02, "window_drifting": False}
    new = upgrade(old)
    assert new["window_drift"] == 1.02 and new["window_drifting"] is False
    assert new["load_mean"] is None and new["work_per_step"] is None and new["time_limit_s"] is None
    assert old["schema_version"] == 1 and "load_mean" not in old  # the caller's dict is left as it was
    assert list(new)[:3] == ["schema_version", "key", "status"]  # fields keep their order


def test_a_record_without_a_version_is_version_1():
    record, problem = parse_store_line(_line({"key": "k", "status": "failed"}))
    assert problem is None and record["schema_version"] == 2 and record["load_mean"] is None


def test_a_v2_record_reads_as_written():
    v2 = {"schema_version": 2, "key": "k", "status": "ok", "point_id": "p0", "time_limit_s": 600.0,
          "point_share_s": 41.5, "cores": 2, "load_start": 3.1, "load_mean": 2.7,
          "work_per_step": {"aten_ops": 812, "host_syncs": 4, "collective_calls": {}, "collective_bytes": {}},
          "window_drift": 1.01, "window_drifting": False}
    record, problem = parse_store_line(_line(v2))
    assert problem is None and record == v2


@pytest.mark.parametrize("version", ["2", 0, -1, 1.5, True])
def test_a_version_that_is_not_a_positive_integer_is_an_unreadable_line(version):
    record, problem = parse_store_line(_line({"schema_version": version, "key": "k", "status": "ok"}))
    assert record is None and "schema_version" in problem


def test_a_newer_record_is_refused_naming_file_and_line(tmp_path):
    store = tmp_path / "s"
    shutil.copytree(STORES[0], store)
    lines = (store / "records.jsonl").read_text().splitlines(keepends=True)
    newer = json.loads(lines[1])
    newer["schema_version"] = SCHEMA_VERSION + 1
    lines[1] = json.dumps(newer) + "\n"
    (store / "records.jsonl").write_text("".join(lines))
    for strict in (True, False):  # not a damaged line a lenient reader may skip
        with pytest.raises(NewerRecord) as exc:
            Store(store).read_records(strict=strict)
        message = str(exc.value)
        assert message.startswith(f"{store / 'records.jsonl'}:2: record schema_version {SCHEMA_VERSION + 1} is newer")
        assert "\n" not in message and isinstance(exc.value, StoreError)
    with pytest.raises(StoreError, match=r"records.jsonl:2: record schema_version 3 is newer than this moebench reads"):
        load_results(store, strict=False)
