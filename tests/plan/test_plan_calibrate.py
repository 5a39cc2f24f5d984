"""Planner calibration: the fit recovers known factors from a synthetic store and predicts
held-out points; profile files round-trip and bad ones are one-line errors; plans say whether
they are a roofline or calibrated, and with which profile."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from moebench.cli import cli, main
from moebench.devices import DEVICES
from moebench.plan import calibrate
from moebench.plan.command import read_profile
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.profile import Profile, cpu_device
from moebench.plan.stages import micro_batching
from moebench.presets import load_config
from moebench.record import PHASES

PEAK = 50e9  # FLOP/s of the synthetic store's calibration matmul
CORES = 2
# The machine the synthetic store was "measured" on: every term the points exercise.
TRUE = {
    "matmul.fp32": 2.5, "all_to_all": 6.0, "all_reduce": 3.0, "all_gather": 2.0, "reduce_scatter": 7.0,
    "optimizer": 0.5, "attention.per_layer": 2e-3, "router.per_moe_layer": 1.5e-3, "dispatch.per_moe_layer": 1e-3,
    "experts.per_moe_layer": 0.8e-3, "combine.per_moe_layer": 1.2e-3, "dispatch.per_expert": 1e-4,
    "experts.per_expert": 6e-5, "combine.per_expert": 9e-5, "head_loss.per_chunk": 1.4e-3,
    "grad_reduce.per_step": 3e-3, "param_gather.per_layer": 9e-3, "optimizer.per_step": 2.5e-3,
    "other.per_step": 5e-3,
}


def _config(experts: int, layers: int, mbs: int, ranks: int, layout: str) -> dict:
    sets = [f"moe.num_experts={experts}", f"model.n_layers={layers}", f"train.micro_batch_size={mbs}",
            f"parallel.dp={ranks}", f"train.global_batch_size={8 * ranks}", "train.device=cpu", "moe.top_k=2"]
    sets += {"fsdp": ["parallel.strategy=fsdp"], "ddp-ep": [f"parallel.ep={ranks}", "parallel.dispatcher=rowwise"],
             "ddp": []}[layout]
    return load_config("tiny", sets).to_dict()


def _store(tmp_path, name: str = "synthetic", breakdowns: bool = True, truth: dict[str, float] = TRUE):
    """A results store whose breakdowns are exactly the model's prediction under ``truth``."""
    configs = [(e, n, m, r, lay) for r in (2, 4) for lay in ("fsdp", "ddp-ep", "ddp") for e in (8, 16)
               for n, m in ((2, 8), (3, 4))]
    records = []
    for i, (e, n, m, r, lay) in enumerate(configs):
        records.append({"key": f"k{i}", "point_id": f"p{i:03d}", "status": "ok", "config": _config(e, n, m, r, lay),
                        "precision": "fp32", "device": "cpu", "peak_flops": PEAK,
                        "time_breakdown_s": dict.fromkeys(PHASES, 1.0), "step_time_median_s": 1.0,
                        "tokens_per_s_per_device": 1.0})
    meta = {"schema_version": 1, "suite": name, "run_id": name, "host": {"cpu_count": CORES, "cpu_model": "Test"}}
    # the features of each point, then the breakdown the true factors give
    for r, p in zip(records, calibrate.measured_points(records, meta, name), strict=True):
        phases = calibrate.predict_phases(truth, p.features_on(p.device))
        step = sum(phases.values())
        # the profiled steps run 10% slower than the timed ones: the fit scales them back
        r["time_breakdown_s"] = {k: 1.1 * v for k, v in phases.items()} if breakdowns else None
        r["step_time_median_s"] = step
        r["tokens_per_s_per_device"] = p.cfg.tokens_per_step / step / p.world_size
    folder = tmp_path / name
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder, records, meta


def test_fit_recovers_known_factors_and_predicts_held_out_points(tmp_path):
    folder, records, meta = _store(tmp_path)
    points = calibrate.measured_points(records, meta, str(folder))
    profile = calibrate.fit(points, [str(folder)])
    assert profile.factors.keys() == TRUE.keys()  # matmul.bf16, send, dense.per_layer: nothing exercises them
    for term, value in TRUE.items():
        assert profile.factors[term] == pytest.approx(value, rel=1e-6), term
    assert profile.fitted_on["in_sample_max_abs_error"] < 1e-9
    assert profile.device.cpu and profile.device.bf16_flops == PEAK and profile.cores == CORES
    for how in ("half", "ranks"):
        fit_on, held = calibrate.holdout_split(points, how)
        assert held and not set(map(id, fit_on)) & set(map(id, held))
        part = calibrate.fit(fit_on, [str(folder)])
        assert calibrate.median_abs_error([calibrate.predict(part, p) for p in held]) < 1e-6, how
    assert {p.world_size for p in calibrate.holdout_split(points, "ranks")[0]} == {2}


def test_no_matmul_is_fitted_faster_than_the_peak(tmp_path):
    folder, records, meta = _store(tmp_path, truth={**TRUE, "matmul.fp32": 0.5})
    profile = calibrate.fit(calibrate.measured_points(records, meta, str(folder)), [])
    assert profile.factors["matmul.fp32"] == 1.0


def test_features_follow_the_roofline_and_time_sharing():
    cfg = apply_world_size(load_config("tiny", ["parallel.strategy=fsdp", "train.device=cpu"]), 2, False, False)
    device = cpu_device(PEAK, "Test")
    plan = build_plan(cfg, device, PlanOptions(matmul_efficiency=1.0, overlap="none"))
    prec = calibrate.plan_precision(cfg, None)
    x = calibrate.phase_features(cfg, prec, device, *calibrate.stage_inputs(cfg, prec), 1.0)
    gather = next(t for t in plan["plan"]["stages"][0]["comm_terms"] if t["what"].startswith("parameters"))
    assert x["param_gather"]["all_gather"] == pytest.approx(gather["seconds"])  # bytes at 1 GB/s
    assert x["attention"]["attention.per_layer"] == cfg.model.n_layers * micro_batching(cfg).chunks_per_step
    for phase in calibrate.COMPUTE_PHASES:
        assert x[phase].get("matmul.fp32", 0.0) == pytest.approx(plan["time_breakdown_s"][phase])
    doubled = calibrate.phase_features(cfg, prec, device, *calibrate.stage_inputs(cfg, prec), 2.0)
    assert doubled["experts"] == {k: 2 * v for k, v in x["experts"].items()}
    assert Profile(device, {}, cores=2).time_sharing(4) == 2.0
    assert Profile(DEVICES["h200"], {}).time_sharing(64) == 1.0


def test_calibrate_command_writes_a_profile_that_plans_with(tmp_path):
    folder, records, _ = _store(tmp_path)
    out = tmp_path / "machine.json"
    result = CliRunner().invoke(cli, ["plan", "--calibrate", str(folder), "--holdout", "ranks", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "matmul.fp32" in result.output and "held out (ranks)" in result.output
    assert "on held-out points: 0.0%" in result.output
    as_json = CliRunner().invoke(cli, ["plan", "--calibrate", str(folder), "--holdout", "half", "--json"])
    summary = json.loads(as_json.output.splitlines()[-1])
    assert summary["holdout"]["split"] == "half" and summary["holdout"]["median_abs_error"] < 1e-6
    assert summary["profile"]["factors"].keys() == TRUE.keys() and summary["output"] is None
    profile = read_profile(str(out))
    assert profile.factors == pytest.approx(calibrate.fit(
        calibrate.measured_points(records, json.loads((folder / "meta.json").read_text()), str(folder)),
        []).factors)
    # the plan of a store point with the profile predicts its measured tokens/s
    r = records[-1]
    sets = [f"{sec}.{k}={v}" for sec in ("model", "moe", "train") for k, v in r["config"][sec].items()
            if v is not None]
    sets += [f"parallel.{k}={v}" for k, v in r["config"]["parallel"].items() if k != "dp"]
    args = ["plan", "--preset", "tiny", "--profile", str(out), "--gpus", str(r["config"]["parallel"]["dp"]), "--json"]
    planned = CliRunner().invoke(cli, args + [a for s in sets for a in ("--set", s)])
    assert planned.exit_code == 0, planned.output
    record = json.loads(planned.output.splitlines()[-1])
    assert record["device"] == "cpu" and record["plan"]["estimate"]["kind"] == "calibrated"
    assert record["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s_per_device"], rel=1e-6)
    search = CliRunner().invoke(cli, ["plan", "--preset", "tiny", "--profile", str(out), "--gpus", "2", "--search",
                                      "--top", "2", "--set", "train.device=cpu"])
    assert search.exit_code == 0, search.output
    assert "layouts fit on 2 GPUs" in search.output and f"estimate: calibrated with profile {out}" in search.output


def test_uncalibrated_plans_say_roofline_and_calibrated_ones_name_their_profile(tmp_path):
    cfg = apply_world_size(load_config("moe-8l-e64", ["parallel.ep=8"]), 8, False, False)
    roof = build_plan(cfg, "h200")
    assert roof["plan"]["estimate"] == {"kind": "roofline", "profile": None}
    assert roof["step_time_median_s"] == pytest.approx(sum(roof["time_breakdown_s"].values()))
    text = CliRunner().invoke(cli, ["plan", "--preset", "moe-8l-e64", "--gpus", "8", "--set", "parallel.ep=8"]).output
    assert "estimate         roofline (uncalibrated" in text
    search = CliRunner().invoke(cli, ["plan", "--preset", "moe-8l-e64", "--gpus", "8", "--search", "--top", "1"])
    assert "estimate: roofline (uncalibrated" in search.output
    assert f"tokens/s per GPU {roof['tokens_per_s_per_device']:,.0f}" in text
    path = tmp_path / "h200.json"
    Profile(DEVICES["h200"], {"matmul.bf16": 2.0, "other.per_step": 0.01}).save(path)
    calibrated = build_plan(cfg, "h200", PlanOptions(profile=read_profile(str(path))))
    estimate = calibrated["plan"]["estimate"]
    assert estimate["kind"] == "calibrated" and estimate["profile"] == str(path)
    assert estimate["roofline_tokens_per_s_per_device"] == pytest.approx(roof["tokens_per_s_per_device"])
    assert calibrated["tokens_per_s_per_device"] < roof["tokens_per_s_per_device"]
    assert calibrated["time_breakdown_s"]["other"] == pytest.approx(0.01)
    text = CliRunner().invoke(cli, ["plan", "--preset", "moe-8l-e64", "--gpus", "8", "--set", "parallel.ep=8",
                                    "--profile", str(path)]).output
    assert f"calibrated with profile {path}" in text


def _profile_file(tmp_path, **changes) -> str:
    data = Profile(cpu_device(PEAK, "Test"), {"matmul.fp32": 2.0}, cores=2).to_dict()
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("changes,message", [
    ({"kind": "something else"}, "field 'kind' must be 'moebench machine profile'"),
    ({"schema_version": 7}, "field 'schema_version' is 7; this moebench reads 1"),
    ({"factors": [1, 2]}, "field 'factors' must be an object"),
    ({"factors": {"matmul.fp32": -1}}, "field 'factors.matmul.fp32' must be a finite number in [1, 1000], got -1"),
    # all-zero factors (a ZeroDivisionError in the planner), a matmul factor of 0 (MFU 622%), 1e308 (0 tok/s)
    ({"factors": {"matmul.fp32": 0, "all_to_all": 0}}, "field 'factors.matmul.fp32' must be a finite number in"),
    ({"factors": {"other.per_step": 0.0}}, "field 'factors.other.per_step' must be a finite number in [1e-09, 10], "
                                           "got 0.0"),
    ({"factors": {"matmul.fp32": 0.5}}, "field 'factors.matmul.fp32' must be a finite number in [1, 1000], got 0.5"),
    ({"factors": {"all_to_all": 1e308}}, "field 'factors.all_to_all' must be a finite number in [0.0001, 10000], "
                                         "got 1e+308"),
    ({"factors": {"optimizer": float("nan")}}, "field 'factors.optimizer' must be a finite number in"),
    ({"factors": {"matmul.fp32": True}}, "field 'factors.matmul.fp32' must be a finite number in"),
    ({"factors": {}}, "field 'factors' is empty: a profile without fitted factors calibrates nothing"),
    ({"factors": {"warp_speed": 1}}, "field 'factors.warp_speed' is not a calibration term"),
    ({"cores": 0}, "field 'cores' must be an integer >= 1 or null, got 0"),
    ({"fitted_on": "yesterday"}, "field 'fitted_on' must be an object"),
    ({"device__bf16_flops": "fast"}, "field 'device.bf16_flops' must be the CPU's calibrated FLOP/s"),
    ({"device": {"name": "NVIDIA Z9000"}}, "field 'device.name' 'NVIDIA Z9000' is not a GPU in the device table"),
])
def test_bad_profile_files_are_one_line_errors(tmp_path, changes, message, monkeypatch, capsys):
    path = _profile_file(tmp_path, **changes)
    monkeypatch.setattr(sys, "argv", ["moebench", "plan", "--profile", path])
    with pytest.raises(SystemExit) as exit_info:
        main()
    lines = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {message}"), lines


def test_every_term_states_a_positive_finite_range_and_the_fit_stays_inside_it(tmp_path):
    """The ranges load_profile checks are the fit's own bounds, so a fitted profile always loads;
    a factor at either end of its range still gives a finite, positive, sub-peak plan."""
    for name, (low, high) in calibrate.term_ranges().items():
        assert 0 < low < high < float("inf"), name
        assert calibrate.lower_bound(name) == low
    cfg = apply_world_size(load_config("moe-8l-e64", ["parallel.ep=8"]), 8, False, False)
    for end in (0, 1):
        factors = {name: bounds[end] for name, bounds in calibrate.term_ranges().items()}
        path = tmp_path / f"end{end}.json"
        Profile(DEVICES["h200"], factors).save(path)
        plan = build_plan(cfg, "h200", PlanOptions(profile=read_profile(str(path))))
        assert 0 < plan["tokens_per_s_per_device"] < float("inf") and 0 < plan["mfu"] <= 1, end


def test_unreadable_profile_and_mismatched_gpu(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    result = CliRunner().invoke(cli, ["plan", "--profile", str(tmp_path / "broken.json")])
    assert f"{tmp_path / 'broken.json'}: not JSON" in str(result.exception)
    result = CliRunner().invoke(cli, ["plan", "--profile", _profile_file(tmp_path), "--gpu", "h200", "--gpus", "2"])
    assert "differs from the machine profile" in str(result.exception)


def test_stores_without_breakdowns_are_one_line_errors(tmp_path, monkeypatch, capsys):
    folder, _, _ = _store(tmp_path, breakdowns=False)
    monkeypatch.setattr(sys, "argv", ["moebench", "plan", "--calibrate", str(folder)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {folder}: nothing to calibrate on: no ok point has a time_breakdown_s "
        "(were they run with train.profile_steps=0?)"]
    folder, _, _ = _store(tmp_path, name="measured")
    result = CliRunner().invoke(cli, ["plan", "--calibrate", str(folder), "-o", str(tmp_path / "no" / "such.json")])
    assert f"{tmp_path / 'no' / 'such.json'}: cannot write the profile" in str(result.exception)
    result = CliRunner().invoke(cli, ["plan", "--holdout", "half"])
    assert "--holdout goes with --calibrate STORE" in str(result.exception)


def test_calibrate_reads_records_kept_in_side_files(tmp_path):
    """A point whose append failed is in the store's unsaved/ folder: calibration reads it, as
    load_results does, and says so."""
    from moebench.results.side_files import UNSAVED_DIR

    folder, records, _ = _store(tmp_path)
    lines = (folder / "records.jsonl").read_text().splitlines(keepends=True)
    (folder / "records.jsonl").write_text("".join(lines[:-1]))
    (folder / UNSAVED_DIR).mkdir()
    (folder / UNSAVED_DIR / "1-1.json").write_text(lines[-1])
    result = CliRunner().invoke(cli, ["plan", "--calibrate", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert "record(s) kept in side files" in result.output  # CliRunner mixes stderr into output
    assert json.loads(result.output.splitlines()[-1])["profile"]["fitted_on"]["points"] == len(records)
