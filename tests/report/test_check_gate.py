"""``moebench check BASELINE CURRENT``: thresholds, significance, categories, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from report_helpers import edited_store, fixture_store, repeated_store, run_cli

from moebench.errors import ConfigError
from moebench.report.gate.check import parse_metric

SMOKE = fixture_store("smoke")
EXPERTS = fixture_store("expert-scaling")


@pytest.fixture
def pair(tmp_path):
    """Make (baseline, current) stores from the smoke fixture with a speed factor and noise level,
    every point run 3 times (``runs=1``: once, as the fixture).

    Both sides draw the same noise pattern, so the medians differ by exactly ``factor``
    and the only question left to the gate is whether that shift stands out of the noise.
    """

    def make(factor: float, noise: float, edit=lambda r: r, runs: int = 3):
        base = repeated_store(SMOKE, tmp_path / "base", runs, noise=noise, seed=1)
        cur = repeated_store(SMOKE, tmp_path / "cur", runs, edit, factor=factor, noise=noise, seed=1)
        return str(base), str(cur)

    return make


def check_json(args, monkeypatch, capsys):
    code, out, err = run_cli(["check", *args, "--format", "json"], monkeypatch, capsys)
    return code, json.loads(out), err


def test_identical_stores_pass(monkeypatch, capsys):
    code, data, err = check_json([str(SMOKE), str(SMOKE)], monkeypatch, capsys)
    # one run a point: no interval, so no verdict (never "unchanged"); no change at all, so nothing blocks
    assert code == 0
    assert data["counts"]["no verdict"] == 3 and data["counts"]["regressed"] == 0
    # one store against itself: same commit, same configs, so any difference could only be the machine's
    assert "same commit and the same configs" in err and "moebench check --against REV SUITE" in err


def test_ten_percent_throughput_drop_with_low_noise_fails(pair, monkeypatch, capsys):
    base, cur = pair(0.9, 0.01)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 1
    assert data["counts"]["regressed"] == 3
    tok = [m for p in data["points"] for m in p["metrics"] if m["metric"] == "tokens_per_s"]
    assert all(m["verdict"] == "regressed" and m["change"] == pytest.approx(-0.1, abs=0.02) for m in tok)
    assert all(m["ci_high"] < 0.95 for m in tok)  # the whole 95% interval of current / baseline


def test_three_percent_change_inside_the_noise_is_inconclusive(pair, monkeypatch, capsys):
    base, cur = pair(0.97, 0.10)
    code, data, _ = check_json([base, cur, "--metric", "tokens_per_s:-2%"], monkeypatch, capsys)
    tok = [m for p in data["points"] for m in p["metrics"]]
    beyond = [m for m in tok if -m["change"] > 0.02]
    assert beyond, "the injected change must exceed the threshold for this test to mean anything"
    assert all(m["verdict"] == "inconclusive" and m["ci_low"] <= 1.0 <= m["ci_high"] for m in beyond)
    assert all(m["note"] == "beyond threshold but within noise" and m["detectable"] > 0.03 for m in beyond)
    assert data["counts"]["inconclusive"] == len(beyond) and data["counts"]["unchanged"] == 3 - len(beyond)
    # never folded into "unchanged": the gate fails on it unless told to warn
    assert code == 1 and data["inconclusive"]
    code, data, _ = check_json([base, cur, "--metric", "tokens_per_s:-2%", "--on-inconclusive", "warn"],
                               monkeypatch, capsys)
    assert code == 0 and data["counts"]["inconclusive"] == len(beyond)
    code, out, _ = run_cli(["check", base, cur, "--metric", "tokens_per_s:-2%"], monkeypatch, capsys)
    assert "INCONCLUSIVE (could detect ±" in out and "inconclusive" in out.strip().splitlines()[-1]


def test_one_run_a_side_is_inconclusive_not_unchanged(pair, monkeypatch, capsys):
    base, cur = pair(0.9, 0.01, runs=1)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 1 and data["counts"]["no verdict"] == 3 and data["counts"]["regressed"] == 0
    tok = [m for p in data["points"] for m in p["metrics"] if m["metric"] == "tokens_per_s"]
    assert all(m["note"] == "1 run each: no between-run variance, no verdict" and m["ci_low"] is None for m in tok)
    code, out, _ = run_cli(["check", base, cur, "--on-inconclusive", "warn"], monkeypatch, capsys)
    assert code == 0 and "no verdict (1 run each: no between-run variance)" in out


def test_an_undecided_change_for_the_better_never_fails_the_gate(pair, monkeypatch, capsys):
    """+80% with one run a side: no verdict, but in the good direction, so even --on-inconclusive fail passes."""
    base, cur = pair(1.8, 0.01, runs=1)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 0 and data["counts"]["no verdict"] == 3 and data["counts"]["improved"] == 0


def test_too_few_steps_is_no_verdict_not_a_threshold_call(pair, monkeypatch, capsys):
    """A 10% drop measured with fewer timed steps than an interval needs: no verdict, never "regressed"."""
    base, cur = pair(0.9, 0.01)
    code, data, _ = check_json([base, cur, "--min-samples", "1000"], monkeypatch, capsys)
    assert code == 1 and data["counts"]["no verdict"] == 3 and data["counts"]["regressed"] == 0
    tok = [m for p in data["points"] for m in p["metrics"] if m["metric"] == "tokens_per_s"]
    assert all(m["note"] == "under 1000 timed steps in a run: no interval, no verdict" for m in tok), tok


def test_evidence_pooled_over_points_decides(pair, monkeypatch, capsys):
    """Each point alone too noisy to tell a 6% drop; the three together are not."""
    base, cur = pair(0.94, 0.08)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    tok = [m for p in data["points"] for m in p["metrics"] if m["metric"] == "tokens_per_s"]
    assert any(m["verdict"] == "inconclusive" for m in tok), tok
    (pooled,) = data["pooled"]
    assert pooled["metric"] == "tokens_per_s" and pooled["points"] == 3 and pooled["same_direction"] == 3
    assert pooled["verdict"] == "regressed" and pooled["ci_high"] < 1.0 and code == 1
    code, out, _ = run_cli(["check", base, cur], monkeypatch, capsys)
    assert "pooled tokens_per_s over 3 points: -6.0% [" in out and "regressed (3 of 3 moved down)" in out


def test_same_three_percent_change_with_low_noise_fails(pair, monkeypatch, capsys):
    base, cur = pair(0.97, 0.003)
    code, data, _ = check_json([base, cur, "--metric", "tokens_per_s:-2%"], monkeypatch, capsys)
    assert code == 1 and data["counts"]["regressed"] == 3


def test_three_percent_change_under_the_default_threshold_passes(pair, monkeypatch, capsys):
    base, cur = pair(0.97, 0.003)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 0 and data["rules"] == ["tokens_per_s:-5%", "peak_mem_bytes:+5%"]
    assert data["counts"]["unchanged"] == 3  # its interval rules out a 5% drop


def test_unchanged_needs_an_interval_that_rules_out_the_regression(pair, monkeypatch, capsys):
    """No change, measured with 25% step noise: the point estimate sits inside the 5% threshold but
    the interval reaches well beyond it, so the data cannot say "unchanged" (with 0.3% noise it can:
    test_three_percent_change_under_the_default_threshold_passes)."""
    base, cur = pair(1.0, 0.25)
    code, data, _ = check_json([base, cur, "--metric", "tokens_per_s:-5%"], monkeypatch, capsys)
    tok = [m for p in data["points"] for m in p["metrics"]]
    inside = [m for m in tok if abs(m["change"]) <= 0.05]
    assert inside, "a change inside the threshold is what this test is about"
    for m in inside:
        assert m["verdict"] == "inconclusive" and m["ci_low"] < 0.95, m
        assert m["note"].startswith("within threshold, but the interval reaches a")
    assert data["counts"]["unchanged"] == 0
    # the gate blocks only where the measured change went the bad way (an undecided gain never fails it)
    assert code == int(any(m["change"] < 0 for m in inside))


def test_speedup_is_improved_not_regressed(pair, monkeypatch, capsys):
    base, cur = pair(1.2, 0.01)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 0 and data["counts"]["improved"] == 3


def test_memory_rise_regresses_on_threshold_alone(pair, monkeypatch, capsys):
    base, cur = pair(1.0, 0.01, edit=lambda r: {**r, "peak_mem_bytes": int(r["peak_mem_bytes"] * 1.1)})
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 1
    mem = [m for p in data["points"] for m in p["metrics"] if m["metric"] == "peak_mem_bytes"]
    assert all(m["verdict"] == "regressed" and m["ci_low"] is None for m in mem)


def test_newly_failed_point_fails_and_known_failures_do_not(pair, monkeypatch, capsys):
    base, cur = pair(1.0, 0.01, edit=lambda r: {**r, "status": "oom"} if r["point_id"] == "ddp" else r)
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert code == 1
    (failed,) = [p for p in data["points"] if p["category"] == "failed"]
    assert failed["baseline_status"] == "ok" and failed["current_status"] == "oom"
    # The expert-scaling fixture holds an OOM and an invalid point: failing the same way twice is not new.
    code, data, _ = check_json([str(EXPERTS), str(EXPERTS)], monkeypatch, capsys)
    assert code == 0 and data["counts"]["failed"] == 2


def test_a_diverged_point_fails_the_gate(pair, monkeypatch, capsys):
    def nan_loss(r):
        if r["point_id"] == "ddp":
            return {**r, "status": "diverged", "error": "loss is nan at step 3 of 60 (the run diverged)"}
        if r["point_id"] == "fsdp":  # recorded ok before NaN losses made a point diverged: read as diverged
            return {**r, "losses": [*r["losses"][:-1], None], "loss_last": None}
        return r

    base, cur = pair(1.0, 0.01, edit=nan_loss)
    code, data, err = check_json([base, cur], monkeypatch, capsys)
    assert code == 1 and data["counts"]["failed"] == 2
    assert {p["current_status"] for p in data["points"] if p["category"] == "failed"} == {"diverged"}
    whys = [w for w in data["warnings"] if "fsdp is recorded ok" in w]
    assert len(whys) == 3  # one per run of fsdp: every repeat of the point was recorded ok with a null loss
    for why in whys:
        assert why.endswith(": fsdp is recorded ok but its loss is missing at step 22 of 22 (the run diverged): "
                            "read as diverged") and why in err


def test_new_and_missing_points(tmp_path, monkeypatch, capsys):
    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: None if r["point_id"] == "fsdp" else r)
    code, data, _ = check_json([str(cur), str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and data["counts"]["new"] == 1
    code, data, _ = check_json([str(SMOKE), str(cur)], monkeypatch, capsys)
    assert code == 1 and data["counts"]["missing"] == 1 and data["missing"] == ["fsdp"]
    code, out, _ = run_cli(["check", str(SMOKE), str(cur)], monkeypatch, capsys)
    assert code == 1 and "missing: fsdp is in BASELINE but not in CURRENT" in out
    code, data, _ = check_json([str(SMOKE), str(cur), "--allow-missing"], monkeypatch, capsys)
    assert code == 0 and data["counts"]["missing"] == 1 and data["missing"] == []


def test_points_fall_back_to_point_id_when_the_config_changed(tmp_path, monkeypatch, capsys):
    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: {**r, "config_hash": "new" + r["config_hash"]})
    code, data, _ = check_json([str(SMOKE), str(cur)], monkeypatch, capsys)
    assert code == 0 and data["counts"]["no verdict"] == 3
    assert all(p["note"] == "matched by point id (config differs)" for p in data["points"])


def test_warns_when_machines_differ(tmp_path, monkeypatch, capsys):
    def other_host(meta):
        meta["host"] = {**meta["host"], "hostname": "laptop", "cpu_model": "Apple M3"}

    cur = edited_store(SMOKE, tmp_path / "cur", meta_edit=other_host)
    code, _, err = run_cli(["check", str(SMOKE), str(cur)], monkeypatch, capsys)
    assert code == 0
    assert "different machines" in err and "Apple M3" in err


def test_text_and_markdown_formats(pair, monkeypatch, capsys):
    base, cur = pair(0.9, 0.01)
    code, out, _ = run_cli(["check", base, cur], monkeypatch, capsys)
    assert code == 1 and "REGRESSED" in out and out.strip().splitlines()[-1].startswith("FAIL: 3 regressed")
    code, out, _ = run_cli(["check", base, cur, "--format", "md"], monkeypatch, capsys)
    assert code == 1 and out.startswith("**moebench check: FAIL") and "|---|" in out


@pytest.mark.parametrize(("spec", "name", "threshold", "higher"), [
    ("tokens_per_s:-5%", "tokens_per_s", 0.05, True),
    ("tokens_per_s:5%", "tokens_per_s", 0.05, True),
    ("peak_mem_bytes:+2.5%", "peak_mem_bytes", 0.025, False),
    ("my_score:-1%", "my_score", 0.01, True),
    ("peak_mem_bytes:+250%", "peak_mem_bytes", 2.5, False),  # a rise may exceed 100%
])
def test_parse_metric(spec, name, threshold, higher):
    rule = parse_metric(spec)
    assert (rule.name, rule.threshold, rule.higher_is_better) == (name, pytest.approx(threshold), higher)


@pytest.mark.parametrize(("spec", "message"), [
    ("tokens_per_s:+5%", "a regression is a drop"),
    ("peak_mem_bytes:-5%", "a regression is a rise"),
    ("my_score:5%", "unknown direction"),
    ("tokens_per_s-5", "expected NAME"),
    ("tokens_per_s:0%", "above 0%"),
    # thresholds that turned the gate off: inf from 400 digits, drops a positive metric cannot make
    ("tokens_per_s:-" + "9" * 400 + "%", "finite percentage above 0%"),
    ("peak_mem_bytes:+" + "9" * 400 + "%", "finite percentage above 0%"),
    ("tokens_per_s:-100%", "cannot drop by 100% or more"),
    ("my_score:-150%", "cannot drop by 150% or more"),
])
def test_parse_metric_rejects(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_metric(spec)


def test_usage_errors_exit_2(monkeypatch, capsys):
    code, _, err = run_cli(["check", str(SMOKE), str(SMOKE), "--metric", "tokens_per_s:+5%"], monkeypatch, capsys)
    assert code == 2 and "a regression is a drop" in err
    code, _, err = run_cli(["check", str(SMOKE)], monkeypatch, capsys)
    assert code == 2 and "one store only supports --ratio" in err
    code, _, err = run_cli(["check", str(SMOKE), str(SMOKE), "--metric", "nope_s:+5%"], monkeypatch, capsys)
    assert code == 2 and "no such field" in err
    code, _, err = run_cli(["check", str(SMOKE), "--ratio", "ddp/fsdp:tokens_per_s>=1", "--alpha", "5"],
                           monkeypatch, capsys)
    assert code == 2 and "--alpha 5.0 must be between 0 and 1" in err  # a ratio-only gate checks it too
    code, _, err = run_cli(["check", str(SMOKE), str(SMOKE), "--min-samples", "0"], monkeypatch, capsys)
    assert code == 2 and "'--min-samples': 0 is not in the range x>=1" in err


def _broken_stores(tmp_path):
    truncated = edited_store(SMOKE, tmp_path / "truncated")
    with open(truncated / "records.jsonl", "a") as f:
        f.write('{"key": "abc", "status": "ok", "tokens_per')
    malformed = edited_store(SMOKE, tmp_path / "malformed", lambda r: {**r, "tokens_per_s": "fast"})
    no_meta = edited_store(SMOKE, tmp_path / "no_meta")
    (no_meta / "meta.json").unlink()
    (no_meta / "records.jsonl").rename(no_meta / "records.jsonl.bak")
    list_key = edited_store(SMOKE, tmp_path / "list_key", lambda r: {**r, "key": [1]} if r["point_id"] == "ddp" else r)
    host_text = edited_store(SMOKE, tmp_path / "host_text", meta_edit=lambda m: m.update(host="laptop"))
    records_dir = edited_store(SMOKE, tmp_path / "records_dir")
    (records_dir / "records.jsonl").unlink()
    (records_dir / "records.jsonl").mkdir()
    return [(truncated, "records.jsonl:4: truncated line"), (malformed, "'tokens_per_s' is 'fast', not a number"),
            (no_meta, "no results store here"), (list_key, "records.jsonl:2: field 'key' must be a non-empty string"),
            (host_text, "meta.json: field 'host' must be a JSON object, got 'laptop'"),
            (records_dir, "records.jsonl: a directory, not a regular file; not read")]


def test_broken_stores_exit_2_with_one_line_and_no_traceback(tmp_path, monkeypatch, capsys):
    for store, message in _broken_stores(tmp_path):
        for args in ([str(SMOKE), str(store)], [str(store), str(SMOKE)]):  # a broken BASELINE too
            code, out, err = run_cli(["check", *args], monkeypatch, capsys)
            assert code == 2, (store, out, err)
            assert message in err and "Traceback" not in err + out
            assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("metric", "shown"), [
    ("status:-5%", "'ok'"), ("config_hash:+5%", "'"), ("step_times_s:+5%", "a list"), ("point_id:-5%", "'"),
])
def test_a_field_that_is_not_a_number_cannot_be_gated(metric, shown, monkeypatch, capsys):
    code, out, err = run_cli(["check", str(SMOKE), str(SMOKE), "--metric", metric], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err + out and len(err.strip().splitlines()) == 1
    name = metric.partition(":")[0]
    assert err.startswith(f"error: --metric {metric}: field '{name}' of {SMOKE} point ") and "not a number" in err
    assert f"is {shown}" in err


def test_stores_that_share_no_point_are_a_usage_error(monkeypatch, capsys):
    code, out, err = run_cli(["check", str(SMOKE), str(EXPERTS)], monkeypatch, capsys)
    assert code == 2 and not out
    assert "BASELINE (suite smoke) and CURRENT (suite expert-scaling) share no point" in err


@pytest.mark.slow
def test_truncated_store_through_the_installed_entry_point(tmp_path):
    store, message = _broken_stores(tmp_path)[0]
    proc = subprocess.run([sys.executable, "-m", "moebench.cli", "check", str(SMOKE), str(store)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_json_output_has_no_nan(tmp_path, monkeypatch, capsys):
    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: {**r, "step_times_s": [float("nan")] * 20}
                       if r["point_id"] == "ddp" else r)
    code, out, _ = run_cli(["check", str(SMOKE), str(cur), "--format", "json"], monkeypatch, capsys)
    assert code in (0, 1) and "NaN" not in out
    json.loads(out)


def test_a_machine_that_slowed_down_is_blamed_for_the_difference(tmp_path, monkeypatch, capsys):
    def other_commit(meta):
        meta["git"] = {"commit": "f" * 40, "dirty": False}

    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: {**r, "peak_flops": r["peak_flops"] * 0.8}, other_commit)
    _, _, err = run_cli(["check", str(SMOKE), str(cur)], monkeypatch, capsys)
    assert "calibrated speed differs between BASELINE and CURRENT (110 GFLOP/s vs 88 GFLOP/s, -20%)" in err
    assert "same commit" not in err  # a different commit: only the calibration speaks for the machine


def test_calibrations_in_different_dtypes_say_mfu_does_not_compare(tmp_path, monkeypatch, capsys):
    """A store from before bf16 calibrations (no ``peak_flops_dtype``: fp32) against one calibrated in
    bf16: the peaks differ by the dtype, not the machine, so the warning says MFU does not compare."""
    old = edited_store(SMOKE, tmp_path / "old", lambda r: {k: v for k, v in r.items() if k != "peak_flops_dtype"})
    cur = edited_store(SMOKE, tmp_path / "cur", lambda r: {**r, "peak_flops": r["peak_flops"] * 3,
                                                          "peak_flops_dtype": "bf16"})
    _, _, err = run_cli(["check", str(old), str(cur)], monkeypatch, capsys)
    assert "calibrated their CPU peak in different dtypes (fp32 vs bf16 matmul)" in err
    assert "calibrated speed differs" not in err


def test_text_output_says_what_it_compared_with_values_and_errors(pair, monkeypatch, capsys):
    """A header per side (run, commit, host), the two absolute values beside each change, and the
    error a failed point recorded."""
    edit = lambda r: {**r, "status": "oom", "error": "CUDA out of memory"} if r["point_id"] == "ddp" else r  # noqa: E731
    base, cur = pair(1.0, 0.01, edit=edit)
    code, out, _ = run_cli(["check", base, cur], monkeypatch, capsys)
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith("BASELINE: run ") and lines[1].startswith("CURRENT: run ")
    assert "; commit " in lines[0] and "; host ci-runner-3 (CPU: " in lines[0]
    assert "error: CUDA out of memory" in out
    fsdp = next(line for line in lines if line.startswith("fsdp "))
    assert " -> " in fsdp and "MiB -> " in fsdp  # tokens/s and peak memory, baseline -> current
    code, data, _ = check_json([base, cur], monkeypatch, capsys)
    assert [h.split(":")[0] for h in data["compared"]] == ["BASELINE", "CURRENT"]
    assert next(p for p in data["points"] if p["category"] == "failed")["error"] == "CUDA out of memory"
