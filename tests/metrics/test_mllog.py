"""``--mllog``: a run record as MLPerf-style ``:::MLLOG`` lines, checked by the mlperf-logging package.

The package's compliance checker runs with moebench's rules (``moebench/metrics/mllog_rules.yaml``):
an MLPerf ruleset also wants an MLPerf benchmark name and evaluation lines, which no moebench run has.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from mllog_helpers import check, lines

from moebench.metrics.mllog import write_mllog


def record(**fields: Any) -> dict[str, Any]:
    return {"status": "ok", "preset": "tiny", "world_size": 2, "device_name": "NVIDIA H200",
            "started_at": "2026-12-05T06:00:00+00:00", "wall_time_s": 12.5, "warmup_steps_used": 2, "timed_steps": 3,
            "tokens_per_s": 4096.0, "tokens_per_s_per_device": 2048.0, "step_time_median_s": 0.25,
            "config": {"train": {"global_batch_size": 8, "micro_batch_size": 2, "seed": 3, "lr": 1e-3},
                       "model": {"seq_len": 128}, "parallel": {"dp": 2, "ep": 2, "pp": 1}}, **fields}


def test_an_ok_run_passes_the_checker_with_its_throughput_batch_and_system(tmp_path):
    path = write_mllog(record(), tmp_path / "run.mllog")
    assert check(path) == (True, [])
    log = lines(path)
    assert log["submission_platform"][0]["value"] == "2xNVIDIA H200"
    assert log["submission_benchmark"][0]["value"] == "moebench_tiny"
    assert log["global_batch_size"][0]["value"] == 8 and log["gradient_accumulation_steps"][0]["value"] == 2
    assert log["tracked_stats"][0]["value"]["throughput"] == 4096.0
    assert log["tracked_stats"][0]["metadata"]["step"] == 5
    assert log["trained_samples"][0]["value"] == 8 * 5
    start, stop = log["run_start"][0], log["run_stop"][0]
    assert stop["time_ms"] - start["time_ms"] == 12500 and stop["metadata"]["status"] == "success"
    assert start["metadata"]["file"] == "moebench/metrics/mllog.py"  # relative to the checkout


def test_a_failed_point_is_an_aborted_run_without_throughput(tmp_path):
    # what the sweep records for a point that printed no record: its own times, no started_at
    failed = {"status": "oom", "preset": "tiny", "nproc": 1, "finished_at": "2026-12-05T06:00:10+00:00",
              "point_wall_s": 4.0, "config": record()["config"]}
    path = write_mllog(failed, tmp_path / "p000.mllog")
    assert check(path) == (True, [])
    log = lines(path)
    assert "tracked_stats" not in log and log["run_stop"][0]["metadata"]["status"] == "aborted"
    assert log["run_stop"][0]["time_ms"] - log["run_start"][0]["time_ms"] == 4000


@pytest.mark.parametrize("damage,why", [
    (lambda text: text.replace('"key": "run_stop"', '"key": "run_stop', 1), "Log lines had parsing errors"),
    (lambda text: "\n".join(ln for ln in text.splitlines() if '"run_stop"' not in ln), "'run_stop'"),
    (lambda text: "\n".join(ln for ln in text.splitlines() if '"tracked_stats"' not in ln), "s['throughput']"),
    (lambda text: text + text.splitlines()[-1] + "\n", "EXACTLY_ONE occurrence of 'run_stop'"),
])
def test_a_malformed_log_fails_the_checker(tmp_path, damage, why):
    path = write_mllog(record(), tmp_path / "run.mllog")
    path.write_text(damage(path.read_text()))
    passed, messages = check(path)
    assert not passed and any(why in m for m in messages), messages


def test_lines_are_json_after_the_mllog_tag(tmp_path):
    text = write_mllog(record(status="diverged"), tmp_path / "run.mllog").read_text()
    for line in text.splitlines():
        tag, _, body = line.partition(" ")
        assert tag == ":::MLLOG" and json.loads(body)["namespace"] == ""
