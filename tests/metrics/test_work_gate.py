"""The work gate: a step's exact work counts, recorded by the trainer and compared exactly by ``moebench check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from report_helpers import edited_store, fixture_store, repeated_store, run_cli

from moebench.report.gate.work import BYTES_THRESHOLD, compare_work

SMOKE = fixture_store("smoke")
WORK = {"aten_ops": 1746, "host_syncs": 0, "collective_calls": {"dp": 2, "ep": 11}, "collective_bytes":
        {"dp": 234840.0, "ep": 2097284.0}}


def _row(work):
    flat = {f"work_per_step.{k}": v for k, v in work.items() if not isinstance(v, dict)}
    flat.update({f"work_per_step.{k}.{axis}": n for k, v in work.items() if isinstance(v, dict)
                 for axis, n in v.items()})
    return flat


def _with(**changes):
    work = json.loads(json.dumps(WORK))
    for key, value in changes.items():
        kind, _, axis = key.partition("__")
        if axis:
            work[kind][axis] = value
        else:
            work[kind] = value
    return work


@pytest.mark.parametrize(("changes", "regressed", "text"), [
    ({"host_syncs": 1}, True, "host syncs 0 -> 1 a step"),
    ({"collective_calls__ep": 12}, True, "ep collective calls 11 -> 12 a step"),
    ({"collective_calls__world": 1}, True, "world collective calls 0 -> 1 a step"),  # a new axis counts from 0
    ({"aten_ops": 1747}, True, "ATen ops 1,746 -> 1,747 a step"),  # one extra copy
    ({"collective_bytes__ep": 2097284.0 * 1.125}, True, "ep collective bytes +12.5%"),  # a wider buffer
    ({"collective_bytes__ep": 2097284.0 * (1 + BYTES_THRESHOLD / 2)}, False, "ep collective bytes +0.5%"),
    ({"aten_ops": 1700}, False, "ATen ops 1,746 -> 1,700 a step"),  # less work is no regression
])
def test_each_kind_of_extra_work_is_a_regression(changes, regressed, text):
    (change,) = compare_work(_row(WORK), _row(_with(**changes)))
    assert change.regressed is regressed and change.text() == text
    assert compare_work(_row(WORK), _row(WORK)) == []  # the same counts: nothing to say


def test_the_gate_fails_on_extra_work_and_says_what_changed(tmp_path, monkeypatch, capsys):
    base = repeated_store(SMOKE, tmp_path / "base", 3, lambda r: {**r, "work_per_step": WORK}, seed=1)
    same = repeated_store(SMOKE, tmp_path / "same", 3, lambda r: {**r, "work_per_step": WORK}, seed=1)
    more = repeated_store(SMOKE, tmp_path / "more", 3, lambda r: {**r, "work_per_step": _with(host_syncs=1)}, seed=1)
    code, out, _ = run_cli(["check", str(base), str(same), "--format", "json"], monkeypatch, capsys)
    assert code == 0 and all(p["work"] == [] for p in json.loads(out)["points"])
    code, out, _ = run_cli(["check", str(base), str(more)], monkeypatch, capsys)
    assert code == 1 and out.count("work: host syncs 0 -> 1 a step REGRESSED") == 3, out
    # runs of one point that counted different work: reported, not judged
    flaky = edited_store(more, tmp_path / "flaky", lambda r: {**r, "work_per_step": WORK} if r["repeat"] == 0 else r)
    code, out, _ = run_cli(["check", str(base), str(flaky)], monkeypatch, capsys)
    assert code == 0 and "exact work counts differ between the runs of a point: not compared" in out, out


def _train(tmp_path, name, inject=""):
    env = {**os.environ, "MOEBENCH_INJECT_WORK": inject}
    cmd = [sys.executable, "-m", "moebench.cli", "train", "--preset", "tiny", "--steps", "2", "--nproc", "2",
           "--set", "parallel.dp=2", "--set", "parallel.ep=2", "--set", "parallel.dispatcher=rowwise",
           "--set", "train.profile_steps=0", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["work_per_step"]


@pytest.mark.slow
def test_the_trainer_counts_the_same_work_twice_and_every_injected_regression(tmp_path):
    """Two runs of one config count identical work (A-vs-A: nothing to flag, whatever the load); a run with an
    extra .item(), all-reduce and copy in every step is caught on each count."""
    a, b = _train(tmp_path, "a"), _train(tmp_path, "b")
    assert a == b and a["aten_ops"] > 0 and a["collective_calls"]["ep"] > 0
    injected = _train(tmp_path, "c", "item,all_reduce,copy")
    changes = {c.what: c for c in compare_work(_row(a), _row(injected))}
    assert changes["host syncs"].regressed and changes["host syncs"].current == a["host_syncs"] + 1
    assert changes["world collective calls"].regressed
    assert changes["ATen ops"].regressed and changes["ATen ops"].current > a["aten_ops"]
