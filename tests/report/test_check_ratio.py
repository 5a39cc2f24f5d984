"""The ratio gate: ``moebench check --ratio NUM/DEN:METRIC>=VALUE STORE``."""

from __future__ import annotations

import json

import pytest
from report_helpers import edited_store, fixture_store, repeated_store, run_cli, with_repeats

from moebench.errors import ConfigError
from moebench.report.gate.ratio import evaluate_ratio, parse_ratio
from moebench.results.table import load_tables

SMOKE = fixture_store("smoke")
EXPERTS = fixture_store("expert-scaling")


@pytest.fixture(scope="module")
def smoke():
    return load_tables([SMOKE])[0]


@pytest.fixture(scope="module")
def experts():
    return load_tables([EXPERTS])[0]


def test_parse_ratio():
    spec = parse_ratio("ddp,parallel.dispatcher=rowwise/ddp:tokens_per_s_per_device >= 1.02")
    assert spec.num == {"parallel.strategy": "ddp", "parallel.dispatcher": "rowwise"}
    assert spec.den == {"parallel.strategy": "ddp"}
    assert (spec.metric, spec.op, spec.value) == ("tokens_per_s_per_device", ">=", 1.02)
    assert parse_ratio("fsdp/ddp:peak_mem_bytes<1.5e0").op == "<"


@pytest.mark.parametrize(("spec", "message"), [
    ("ddp/fsdp", "expected NUM/DEN"),
    ("ddp/fsdp/ddp:tokens_per_s>=1", "expected NUM/DEN"),
    ("a/b/c:tokens_per_s>=1", "expected NUM/DEN"),
    ("ddp/fsdp:tokens_per_s=>1", "expected NUM/DEN"),
    ("ddp,/fsdp:tokens_per_s>=1", "empty selector term"),
    ("ddp/ddp:tokens_per_s>=1", "same points"),
    ("ddp,fsdp/fsdp:tokens_per_s>=1", "given twice"),
    # bounds that always or never hold, so the gate says nothing
    ("ddp/fsdp:tokens_per_s>=1e400", "finite number above 0"),
    ("ddp/fsdp:tokens_per_s>=-1", "finite number above 0"),
    ("ddp/fsdp:tokens_per_s>=0", "finite number above 0"),
    ("ddp/fsdp:tokens_per_s<=1e-400", "finite number above 0"),
])
def test_parse_ratio_rejects(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_ratio(spec)


def test_ddp_over_fsdp_pairs_every_ddp_point_with_the_fsdp_point(smoke):
    result = evaluate_ratio(smoke, parse_ratio("ddp/fsdp:tokens_per_s>=1.0"))
    assert result.passed and not result.unmatched
    assert sorted(p.num_label for p in result.pairs) == ["ddp ep2", "ddp ep2 rowwise"]
    by_id = smoke.set_index("point_id")["tokens_per_s"]
    ratios = {p.num_label: p.ratio for p in result.pairs}
    assert ratios["ddp ep2"] == pytest.approx(by_id["ddp"] / by_id["fsdp"])


def test_field_selector_never_pairs_a_point_with_itself(smoke):
    result = evaluate_ratio(smoke, parse_ratio("ddp,parallel.dispatcher=rowwise/ddp:tokens_per_s>=1.0"))
    ((pair),) = result.pairs
    assert (pair.num_label, pair.den_label) == ("ddp ep2 rowwise", "ddp ep2")
    short = evaluate_ratio(smoke, parse_ratio("dispatcher=rowwise/dispatcher=sync:tokens_per_s>=1.0"))
    assert [(p.num_label, p.den_label) for p in short.pairs] == [("ddp ep2 rowwise", "ddp ep2")]


def test_pairs_are_matched_on_the_other_axes(experts):
    result = evaluate_ratio(experts, parse_ratio("ddp/fsdp:tokens_per_s>=1.0"))
    by_label = {p.num_label: p.den_label for p in result.pairs}
    assert by_label["ddp ep8, num_experts=32"] == "fsdp, num_experts=32"
    assert by_label["ddp, n_dense_layers=8"] == "fsdp, n_dense_layers=8"
    assert by_label["ddp ep8, precision=fp32"] == "fsdp, precision=fp32"
    # No FSDP point with top-k 2: reported as unmatched, not paired with another model.
    assert "ddp ep8, num_experts=64, top_k=2" in result.unmatched


def test_ratio_over_a_non_parallel_field(experts):
    result = evaluate_ratio(experts, parse_ratio("precision=fp32/precision=bf16:tokens_per_s<0.5"))
    assert {(p.num_label, p.den_label) for p in result.pairs} == {
        ("fsdp, precision=fp32", "fsdp, num_experts=8"),
        ("ddp ep8, precision=fp32", "ddp ep8, num_experts=8"),
    }
    assert result.passed


def test_no_pairs_is_a_usage_error(smoke):
    with pytest.raises(ConfigError, match=r"no point pairs .* strategies in the store: ddp, fsdp"):
        evaluate_ratio(smoke, parse_ratio("megatron/fsdp:tokens_per_s>=1.0"))
    with pytest.raises(ConfigError, match="no field 'nonsense'"):
        evaluate_ratio(smoke, parse_ratio("nonsense=1/fsdp:tokens_per_s>=1.0"))
    with pytest.raises(ConfigError, match="no metric 'speed'"):
        evaluate_ratio(smoke, parse_ratio("ddp/fsdp:speed>=1.0"))
    with pytest.raises(ConfigError, match=r"field 'status' of .* point \S+ is 'ok', not a number"):
        evaluate_ratio(smoke, parse_ratio("ddp/fsdp:status>=1.0"))
    with pytest.raises(ConfigError, match=r"field 'step_times_s' of .* is a list, not a number"):
        evaluate_ratio(smoke, parse_ratio("ddp/fsdp:step_times_s>=1.0"))


def test_cli_exit_codes(tmp_path, monkeypatch, capsys):
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.0", str(SMOKE)], monkeypatch, capsys)
    # one run a point: no interval, so a met bound is not "holds" either: inconclusive, not failing
    assert code == 0 and "PASS: ratios: 0 of 1 fail; pairs: 2 inconclusive" in out
    assert "meets the bound, but 1 run each: no between-run variance, no verdict" in out
    # one run a side: a miss is reported, not failed (no between-run variance to call it clear)
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.5", str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and "inconclusive misses the bound, but 1 run each: no between-run variance" in out
    assert "PASS: ratios: 0 of 1 fail; pairs: 2 inconclusive" in out
    # three runs a point: an interval wholly above the bound holds
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=0.5", str(repeated_store(
        SMOKE, tmp_path / "r", 3, noise=0.01, seed=1))], monkeypatch, capsys)
    assert code == 0 and "PASS: ratios: 0 of 1 fail; pairs: 2 hold" in out
    repeated = repeated_store(SMOKE, tmp_path / "repeated", 3, noise=0.01, seed=1)
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.5", str(repeated)], monkeypatch, capsys)
    assert code == 1 and "FAIL 95% CI [" in out and ", 3 runs each" in out
    code, _, err = run_cli(["check", "--ratio", "megatron/fsdp:tokens_per_s>=1", str(SMOKE)], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: --ratio")


def test_a_failed_side_fails_the_ratio(tmp_path, monkeypatch, capsys):
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, "status": "timeout"} if r["point_id"] == "fsdp" else r)
    args = ["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.0", str(store), "--format", "json"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    data = json.loads(out)
    assert code == 1 and not data["ratios"][0]["passed"]
    assert all(p["note"] == "denominator timeout" for p in data["ratios"][0]["pairs"])


def test_ratio_and_comparison_together(monkeypatch, capsys):
    args = ["check", str(SMOKE), str(SMOKE), "--ratio", "ddp/fsdp:tokens_per_s>=1.0", "--format", "json"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    data = json.loads(out)
    assert code == 0 and data["counts"]["no verdict"] == 3 and data["ratios"][0]["passed"]


def _ddp_slower_than_fsdp(tmp_path, noise: float, runs: int = 3):
    """ddp steps are fsdp's steps (one noise pattern per run) made 3% slower, so the ratio is 0.97."""
    fsdp = next(json.loads(line) for line in (SMOKE / "records.jsonl").read_text().splitlines()
                if json.loads(line)["point_id"] == "fsdp")

    def edit(r):
        if r["point_id"] == "fsdp":
            return with_repeats(fsdp, runs, noise=noise, seed=4)
        if r["point_id"] == "ddp":
            own = {k: r[k] for k in ("config", "config_hash", "layout", "point", "point_id", "key")}
            return with_repeats({**fsdp, **own}, runs, factor=0.97, noise=noise, seed=4)
        return None

    return edited_store(SMOKE, tmp_path / f"noise{noise}-{runs}", edit)


def test_a_ratio_miss_inside_the_noise_is_inconclusive_not_failed(tmp_path):
    t = load_tables([_ddp_slower_than_fsdp(tmp_path, noise=0.10)])[0]
    result = evaluate_ratio(t, parse_ratio("ddp/fsdp:tokens_per_s>=1.0"))
    ((pair),) = result.pairs
    assert pair.ratio == pytest.approx(0.97, abs=1e-6)
    assert pair.passed and pair.ci_low <= 1.0 <= pair.ci_high and "within the noise" in pair.note
    assert pair.inconclusive and pair.outcome == "inconclusive" and result.passed and result.inconclusive == 1


def test_a_ratio_miss_with_one_run_a_side_is_inconclusive(tmp_path):
    t = load_tables([_ddp_slower_than_fsdp(tmp_path, noise=0.003, runs=1)])[0]
    ((pair),) = evaluate_ratio(t, parse_ratio("ddp/fsdp:tokens_per_s>=1.0")).pairs
    assert pair.outcome == "inconclusive" and pair.ci_low is None
    assert pair.note == "misses the bound, but 1 run each: no between-run variance, no verdict"


def test_a_ratio_miss_beyond_the_noise_fails(tmp_path):
    t = load_tables([_ddp_slower_than_fsdp(tmp_path, noise=0.003)])[0]
    ((pair),) = evaluate_ratio(t, parse_ratio("ddp/fsdp:tokens_per_s>=1.0")).pairs
    assert pair.ratio == pytest.approx(0.97, abs=1e-6)
    assert not pair.passed and pair.ci_high < 0.98 and pair.outcome == "fail"
    # Without enough samples for an interval: no verdict (never the bound alone), so not a failure.
    ((pair),) = evaluate_ratio(t, parse_ratio("ddp/fsdp:tokens_per_s>=1.0"), min_samples=50).pairs
    assert pair.outcome == "inconclusive" and pair.ci_low is None
    assert pair.note == "misses the bound, but under 50 timed steps in a run: no interval, no verdict"


def test_a_crashed_point_still_pairs_and_fails_the_gate(tmp_path, monkeypatch, capsys):
    """The runner records a crash without the fields the run would have resolved (precision, device)."""
    measured = ("precision", "device", "device_name", "tokens_per_s", "step_times_s", "step_time_median_s")

    def crash(r):
        if r["point_id"] != "ddp":
            return r
        return {**{k: v for k, v in r.items() if k not in measured}, "status": "failed", "error": "exit code 1"}

    store = edited_store(SMOKE, tmp_path / "s", crash)
    args = ["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.0", str(store), "--format", "json"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    pairs = json.loads(out)["ratios"][0]["pairs"]
    assert code == 1
    assert {(p["num_label"], p["passed"], p["note"]) for p in pairs} == {
        ("ddp ep2", False, "numerator failed"),
        ("ddp ep2 rowwise", True, "meets the bound, but 1 run each: no between-run variance, no verdict")}


def test_unequal_work_gets_no_verdict_unless_allowed(tmp_path, monkeypatch, capsys):
    """ddp-rowwise drops 10.9% of its routes, fsdp none: the gate says why in one line and exits 1;
    --allow-unequal-work judges the pair and labels it."""
    routes = 1024 * 2 * 2 * 20  # tokens per step x top-k x MoE layers x timed steps
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, "dropped_tokens": round(0.109 * routes)}
                         if r["point_id"] == "ddp-rowwise" else r)
    args = ["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.0", str(store)]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 1 and "FAIL: ratios: 1 of 1 fail; pairs: 1 inconclusive, 1 refused" in out, out
    refused = next(x for x in out.splitlines() if "REFUSED" in x)
    assert "no verdict: unequal work: ddp ep2 rowwise drops 10.9% of routes, fsdp 0%" in refused, refused
    assert "REFUSED" not in next(x for x in out.splitlines() if x.startswith("ddp ep2 "))  # equal work is judged
    code, out, _ = run_cli([*args, "--allow-unequal-work", "--format", "json"], monkeypatch, capsys)
    pairs = {p["num_label"]: p for p in json.loads(out)["ratios"][0]["pairs"]}
    # judged and labelled: with one run a side, inconclusive (no interval), not refused
    assert code == 0 and pairs["ddp ep2 rowwise"]["outcome"] == "inconclusive"
    assert pairs["ddp ep2 rowwise"]["unequal_work"]
    assert pairs["ddp ep2 rowwise"]["note"].startswith("unequal work: ddp ep2 rowwise drops 10.9%")
    assert not pairs["ddp ep2"]["unequal_work"]
    # the fixture's 37 dropped routes (0.05%) are within the 0.5-point tolerance: judged as equal work
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=1.0", str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and "unequal" not in out


def test_a_bound_on_one_value_per_point_needs_no_repeats(monkeypatch, capsys):
    """``SEL:METRIC<=VALUE`` gates each selected point's own value: a peak memory from one run, no noise test."""
    assert parse_ratio("fsdp:peak_mem_bytes<=6e8").den == {}
    code, out, _ = run_cli(["check", "--ratio", "fsdp:peak_mem_bytes<=7e8", str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and "fsdp   625 MiB         pass" in out and "PASS: ratios: 0 of 1 fail; pairs: 1 hold" in out
    code, out, _ = run_cli(["check", "--ratio", "fsdp:peak_mem_bytes<=6e8", str(SMOKE)], monkeypatch, capsys)
    assert code == 1 and "FAIL one value per point" in out and "too few step samples" not in out


def test_a_missed_memory_ratio_fails_from_single_values(monkeypatch, capsys):
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:peak_mem_bytes<=0.5", str(SMOKE)], monkeypatch, capsys)
    assert code == 1 and "FAIL peak_mem_bytes is one measured value per point" in out


def test_one_store_missing_planned_runs_fails_the_gate(tmp_path, monkeypatch, capsys):
    """``check --ratio STORE`` (the form scripts/test.sh uses) passed a store missing half its planned
    points: its points.json now says what is missing, which fails the gate as a BASELINE point
    missing from CURRENT does (--allow-missing: listed only)."""
    import yaml

    from moebench.cli import main
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    measured = json.loads((SMOKE / "records.jsonl").read_text().splitlines()[0])
    keep = ("schema_version", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu",
            "step_time_median_s", "step_times_s", "timed_steps", "peak_mem_bytes", "device", "precision")
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "half", "base": {"preset": "tiny"},
                                     "grid": {"parallel.strategy": ["ddp", "fsdp"], "moe.num_experts": [4, 8]}}))
    store = tmp_path / "store"
    with monkeypatch.context() as mp:
        mp.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(
            point, "ok", None, {k: measured[k] for k in keep if k in measured}))
        mp.setattr("sys.argv", ["moebench", "run", str(suite), "--out", str(store), "--no-progress"])
        main()
    capsys.readouterr()
    records = [json.loads(line) for line in (store / "records.jsonl").read_text().splitlines()]
    kept = [r for r in records if r["config"]["moe"]["num_experts"] == 4]
    (store / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    dropped = sorted(r["point_id"] for r in records if r not in kept)
    args = ["check", "--ratio", "ddp/fsdp:tokens_per_s>=0.5", str(store)]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 1, out
    assert f"missing: 2 planned run(s) of CURRENT have no record: {', '.join(dropped)}" in out
    assert out.splitlines()[-1] == "FAIL: 2 planned run(s) missing; ratios: 0 of 1 fail; pairs: 1 inconclusive"
    code, out, _ = run_cli([*args, "--allow-missing", "--format", "json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["missing"] == dropped
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:tokens_per_s>=0.5", str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and "missing" not in out  # a store from before points.json: its records are all it has
