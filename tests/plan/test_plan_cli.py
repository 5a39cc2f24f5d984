"""``moebench plan``: the cost-only output, the planned record, the trillion-parameter
layouts, the search, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from moebench.cli import cli, main
from moebench.devices import DEVICES
from moebench.layout import divisors
from moebench.plan.planner import apply_world_size, build_plan
from moebench.plan.search import candidate_layouts, micro_batchings, search
from moebench.presets import load_config
from moebench.record import REQUIRED_FIELDS

ULTRA = ["parallel.pp=8", "parallel.dist_opt=true", "parallel.activation_checkpointing=per-layer",
         "parallel.pp_microbatches=16", "train.micro_batch_size=16"]


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["plan", *args])


# Runs ``moebench plan ARGS`` in a fresh interpreter, then says which heavy modules got imported.
_IMPORTS_AFTER_PLAN = """
import sys
from moebench.cli import main
main()
print(", ".join(f"{name} imported" if name in sys.modules else f"no {name}" for name in ("torch", "pandas")),
      file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    [],
    ["--gpus", "512", "--gpu", "b300", "--set", "parallel.pp=8", "--set", "parallel.ep=32"],
    ["--gpus", "64", "--gpu", "b300", "--search", "--top", "1"],
    ["--gpus", "64", "--gpu", "b300", "--set", "precision.mode=fp8", "--set", "precision.scope=linear"],
    ["--gpus", "64", "--gpu", "b300", "--set", "precision.mode=mxfp8"],
])
def test_plan_never_imports_torch(args):
    """A plan is arithmetic on the config and the device table: no path of the command may pull
    in torch (seconds of import, and a plan must run where torch is not installed), nor pandas
    (docs/plan.md: the command's whole run, imports included, is a fraction of a second)."""
    argv = [sys.executable, "-c", _IMPORTS_AFTER_PLAN, "plan", "--preset", "ultra-2.38t", "--json", *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout.splitlines()[-1])
    assert done.stderr.splitlines()[-1] == "no torch, no pandas", done.stderr


def test_plan_without_flags_prints_costs_only():
    result = _invoke("--preset", "moe-8l-e64")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == ["preset", "total", "active", "FLOPs"]
    assert "24.3 B (24,312,092,672)" in lines[1] and "3.17 B (3,172,800,512)" in lines[2]
    data = json.loads(_invoke("--preset", "tiny", "--json").output)
    cfg = load_config("tiny")
    assert data == {"preset": "tiny", **cfg.cost_summary(), "config_hash": cfg.hash()}


def test_plan_json_is_a_planned_run_record():
    result = _invoke("--preset", "moe-8l-e32", "--gpus", "8", "--gpu", "h100", "--set", "parallel.ep=8", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[-1])
    assert record["status"] == "planned"
    assert set(REQUIRED_FIELDS) <= record.keys()
    for key in ("comm_bytes_per_step", "optimizer_state_bytes_per_rank", "layout", "world_size", "plan"):
        assert key in record
    assert record["world_size"] == 8 and record["layout"]["ep"] == 8 and record["layout"]["dp"] == 8
    assert record["config"]["train"]["global_batch_size"] == 64  # weak scaling: 8 sequences per rank
    assert record["tflops_per_device"] == pytest.approx(
        record["flops_per_token"] * record["tokens_per_s_per_device"] / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] * 1e12 / DEVICES["h100"].bf16_flops)
    assert record["plan"]["assumptions"]


def test_plan_text_shows_assumptions_beside_numbers():
    result = _invoke("--preset", "moe-8l-e8", "--gpus", "8", "--set", "parallel.strategy=fsdp")
    assert result.exit_code == 0, result.output
    assert "NVIDIA H200" in result.output  # the default device
    assert "fp32 (the master weights unless dist_opt)" in result.output
    assert "fsdp: layers gathered in fwd and bwd" in result.output
    assert "tokens/s per GPU" in result.output


@pytest.mark.parametrize("preset,ep", [("ultra-1.2t", 8), ("ultra-2.38t", 32)])
def test_trillion_parameter_layouts_on_512_gpus(preset, ep):
    cfg = apply_world_size(load_config(preset).apply_overrides([*ULTRA, f"parallel.ep={ep}"]), 512, False, False)
    plan = build_plan(cfg, "b300")
    assert plan["layout"] == {"strategy": "ddp", "dp": 64, "ep": ep, "pp": 8, "dispatcher": "sync",
                              "dist_opt": True}
    assert plan["total_params"] > 1e12 and plan["world_size"] == 512
    assert set(plan["comm_bytes_per_step"]) == {"dp", "edp", "ep", "pp"}
    assert 100 < plan["tflops_per_device"] < 2250
    # 63 layers on 8 stages: an uneven split (seven stages of 8, one of 7) that the trainer runs too
    assert plan["plan"]["moebench_runs"] and not plan["plan"]["moebench_rejects"]
    assert [s["layers"] for s in plan["plan"]["stages"]] == [8] * 7 + [7]
    # as moebench trains: whole fp32 parameter and gradient buffers on every rank (plus the
    # reduce-scattered gradient shard); without recompute and dist_opt it needs more
    mem = plan["plan"]["stages"][plan["plan"]["peak_mem_stage"]]["memory_bytes"]
    assert mem["grads"] == pytest.approx(mem["params"] + mem["master_weights"])
    plain = apply_world_size(load_config(preset).apply_overrides(
        ["parallel.pp=8", f"parallel.ep={ep}", "parallel.pp_microbatches=16", "train.micro_batch_size=16"]),
        512, False, False)
    assert build_plan(plain, "b300")["peak_mem_bytes"] > plan["peak_mem_bytes"]


def test_search_finds_fitting_layouts_for_the_trillion_parameter_model():
    cfg = load_config("ultra-1.2t").apply_overrides(["parallel.pp_microbatches=16", "train.micro_batch_size=16"])
    result = search(cfg, 512, "b300", batch_given=False)
    assert result.ranked
    best = result.ranked[0]
    assert best["plan"]["fits"] and best["layout"]["ep"] > 8  # more EP spreads the 1.2T expert weights
    assert best["config"]["parallel"]["activation_checkpointing"] == "per-layer"


def test_ep_group_across_nodes_runs_at_network_speed():
    device = DEVICES["b300"]
    for ep, expect_network in ((8, False), (32, True)):
        cfg = apply_world_size(load_config("ultra-2.38t").apply_overrides([*ULTRA, f"parallel.ep={ep}"]),
                               512, False, False)
        term = next(t for t in build_plan(cfg, device)["plan"]["stages"][0]["comm_terms"] if t["axis"] == "ep")
        nvlink_only = term["bytes"] / device.intra_node_bw
        assert (term["seconds"] > 2 * nvlink_only) is expect_network


def test_native_mxfp8_speeds_up_blackwell_only():
    def tps(gpu, mode):
        cfg = apply_world_size(load_config("moe-8l-e32", ["parallel.ep=8", f"precision.mode={mode}"]), 8, False, False)
        return build_plan(cfg, gpu)["tokens_per_s_per_device"]

    assert tps("b300", "mxfp8") > 1.05 * tps("b300", "bf16")
    # Hopper emulates MXFP8: bf16 GEMMs after quantize/dequantize passes, which cost more than the
    # quantized dispatch saves
    assert tps("h100", "mxfp8") < tps("h100", "bf16")


@pytest.mark.parametrize(("mode", "wire"), [("mxfp8", "forward dispatch rows sent as MXFP8"),
                                            ("fp8", "EP rows stay bf16")])
def test_quantized_assumption_names_what_the_dispatch_sends(mode, wire):
    cfg = apply_world_size(load_config("moe-8l-e32", ["parallel.ep=8", f"precision.mode={mode}"]), 8, False, False)
    notes = [a for a in build_plan(cfg, "h100")["plan"]["assumptions"] if a.startswith(f"{mode}:")]
    assert len(notes) == 1 and wire in notes[0]


def test_search_ranks_fitting_layouts_by_throughput():
    cfg = load_config("moe-8l-e64")
    result = search(cfg, 8, "h200", batch_given=False)
    speeds = [r["tokens_per_s_per_device"] for r in result.ranked]
    assert speeds == sorted(speeds, reverse=True) and speeds
    assert all(r["plan"]["fits"] for r in result.ranked)
    assert not any(r["plan"]["fits"] for r in result.too_big)
    layouts = {(r["layout"]["strategy"], r["layout"]["ep"], r["layout"]["pp"]) for r in result.ranked + result.too_big}
    assert ("fsdp", 1, 1) in layouts and ("ddp", 8, 1) in layouts
    assert all(r["layout"]["ep"] == 1 for r in result.ranked if r["layout"]["strategy"] == "fsdp")
    # the configured micro_batch_size=1 cannot be split into pp_microbatches=2 chunks: only that
    # micro-batching is invalid, and only under pp > 1 (the search tries splittable ones too)
    assert result.invalid and all(layout["pp"] > 1 and "pp_microbatches" in reason
                                  for layout, reason in result.invalid)


def test_search_finds_one_flush_per_step_pipelines():
    """The preset cuts a rank's 8 sequences into micro-batches of 4 in 2 chunks: two pipeline
    flushes per step. The search also tries one micro-batch of 8 one-sequence chunks."""
    cfg = load_config("ultra-1.2t")
    result = search(cfg, 512, "b300", batch_given=False)
    best = result.ranked[0]
    assert best["layout"]["pp"] > 1 and best["plan"]["micro_batching"]["accum_steps"] == 1
    assert best["plan"]["micro_batching"]["chunks"] == best["config"]["train"]["micro_batch_size"] == 8
    same_layout = [r for r in result.ranked + result.too_big if r["layout"] == best["layout"]
                   and r["config"]["parallel"]["activation_checkpointing"] == "per-layer"
                   and r["config"]["train"]["micro_batch_size"] == cfg.train.micro_batch_size]
    assert same_layout and same_layout[0]["tokens_per_s_per_device"] < best["tokens_per_s_per_device"]
    # the global batch stays what the configured micro-batching gives: 8 sequences per rank
    assert {r["config"]["train"]["global_batch_size"] // r["layout"]["dp"] for r in result.ranked} == {8}


def test_search_enumeration_is_bounded_by_the_model_not_the_gpu_count():
    cfg = load_config("moe-8l-e64")
    ep_options = len(divisors(cfg.moe.num_experts))
    # every pp up to the layer count, every ep; fsdp once; dist_opt on and off; two recompute settings
    bound = cfg.model.n_layers * 2 * (1 + 2 * ep_options)
    assert len(candidate_layouts(cfg, 2**40)) <= bound
    # micro-batchings: log2 of the rank's sequences per step, not their divisors
    laid_out = apply_world_size(cfg, 8, dp_given=False, batch_given=False)
    laid_out.train.global_batch_size = 8 * 720_720  # 240 divisors per rank
    assert len(micro_batchings(laid_out)) <= (720_720).bit_length() + 2


def test_gpu_names_are_case_insensitive():
    upper, lower = _invoke("--gpus", "8", "--gpu", "B300", "--json"), _invoke("--gpus", "8", "--gpu", "b300", "--json")
    assert upper.exit_code == 0, upper.output
    assert json.loads(upper.output.splitlines()[-1]) == json.loads(lower.output.splitlines()[-1])


def test_a_capacity_factor_that_drops_routes_says_its_tokens_per_s_are_not_comparable():
    """Capacity factor 0.001 planned 3x the lossless tokens/s with 99.9% of the routes skipping their
    experts: the rate line says so, in the plan and in a search."""
    layout = ["--preset", "moe-8l-e64", "--gpus", "8", "--set", "parallel.ep=8", "--set", "parallel.dispatcher=rowwise"]
    lossless = _invoke(*layout, "--set", "moe.capacity_factor=1")
    assert "NOT comparable" not in lossless.output
    for args in ([], ["--search", "--top", "1"]):
        lossy = _invoke(*layout, "--set", "moe.capacity_factor=0.001", *args)
        assert lossy.exit_code == 0, lossy.output
        rate = next(line for line in lossy.output.splitlines() if line.startswith("tokens/s"))
        assert "NOT comparable with a lossless plan: 99.9% of the routes are dropped" in rate


def test_per_gpu_figures_say_when_the_placement_leaves_gpus_idle():
    """EP16 on NVL72 racks: 64 ranks a rack, 512 ranks on 576 GPUs; the per-GPU rates are per rank,
    and the lines also give them over the 576 GPUs occupied."""
    args = ["--preset", "moe-8l-e64", "--gpus", "512", "--gpu", "gb300", "--set", "parallel.ep=16"]
    record = json.loads(_invoke(*args, "--json").output.splitlines()[-1])
    assert record["plan"]["placement"]["gpus"] == 576
    lines = {line.split()[0]: line for line in _invoke(*args).output.splitlines() if line.split()}
    per_gpu = record["tokens_per_s_per_device"] * 512 / 576
    assert f"per rank; {per_gpu:,.0f} per occupied GPU (512 ranks on 576 GPUs, 64 idle)" in lines["tokens/s"]
    assert f"per rank; {record['tflops_per_device'] * 512 / 576:.1f} per occupied GPU" in lines["TFLOP/s"]
    h200 = _invoke("--preset", "moe-8l-e64", "--gpus", "512", "--set", "parallel.ep=16").output
    assert "occupied" not in h200  # 8-GPU nodes hold whole EP16 groups: no GPU idle


def test_search_cli_prints_a_table():
    result = _invoke("--preset", "moe-8l-e128", "--gpus", "8", "--gpu", "b300", "--search", "--top", "3")
    assert result.exit_code == 0, result.output
    assert "layouts fit on 8 GPUs" in result.output
    assert result.output.count("ddp") + result.output.count("fsdp") >= 3


@pytest.mark.parametrize("args,message", [
    (["--gpus", "6", "--set", "parallel.pp=4"], "not divisible by parallel.pp"),
    (["--gpus", "8", "--set", "parallel.ep=3"], "parallel.ep=3"),
    (["--gpus", "8", "--set", "parallel.dp=2"], "drop one of them"),
])
def test_bad_layouts_are_one_line_errors(args, message):
    result = _invoke("--preset", "moe-8l-e64", *args)
    assert result.exit_code != 0
    assert message in str(result.exception)


def test_native_quantized_gemm_needs_the_trainers_alignment():
    cfg = apply_world_size(load_config("tiny", ["precision.mode=mxfp8"]), 1, False, False)  # d_model = hidden = 64
    native = build_plan(cfg, "b200")["plan"]
    assert not native["moebench_runs"] and "multiples of 128" in native["moebench_rejects"]
    assert build_plan(cfg, "h200")["plan"]["moebench_runs"]  # emulated: multiples of 32 are enough


@pytest.mark.parametrize("args,message", [
    (["--gpus", "8", "--set", "parallel.pp=0"], "parallel.pp=0 must be >= 1"),
    (["--gpus", "8", "--set", "train.micro_batch_size=0"], "train.micro_batch_size=0 must be >= 1"),
    (["--gpus", "8", "--set", "parallel.dp=0"], "parallel.dp=0 must be >= 1"),
    (["--gpus", "8", "--search", "--set", "train.micro_batch_size=0"], "train.micro_batch_size=0 must be >= 1"),
    (["--gpus", "0", "--search"], "--gpus=0 must be >= 1"),
    (["--gpus", "8", "--set", "moe.capacity_factor=1e308"], "moe.capacity_factor=1e+308 must be in (0, 64]"),
    (["--gpus", "8", "--set", "moe.capacity_factor=65"], "moe.capacity_factor=65.0 must be in (0, 64]"),
    (["--gpu", "h200", "--set", "parallel.pp=1000000", "--set", "parallel.pp_microbatches=1"],
     "impossible parallel layout: model.n_layers=8 cannot be "
     "split over parallel.pp=1000000 stages: every stage needs a layer (pp could be at most 8)"),
    (["--gpu", "h200", "--set", "model.n_layers=1000000", "--set", "parallel.pp=1000000",
      "--set", "parallel.pp_microbatches=1"],
     "parallel.pp=1,000,000: a plan of more than 50,000 pipeline stages is refused (each stage is planned)"),
    (["--gpus", "8", "--matmul-efficiency", "1e-300"], "--matmul-efficiency 1e-300: must be a share of the peak "
                                                       "in [0.01, 1]"),
])
def test_bad_inputs_exit_2_with_one_line(args, message, monkeypatch, capsys):
    """Every bad input is validated before the planner divides by it: one line, exit 2."""
    monkeypatch.setattr(sys, "argv", ["moebench", "plan", "--preset", "moe-8l-e64", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out.err.splitlines() == [f"error: {message}"] and not out.out


@pytest.mark.parametrize("args", [["plan", "--gpus", str(10**30)], ["train", "--nproc", str(2**40)],
                                  ["train", "--steps", str(10**30)]])
def test_numeric_bounds_are_checked_before_anything_runs(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "Invalid value for" in result.output and "range" in result.output, result.output


def test_search_past_its_work_bound_fails_before_planning(monkeypatch, capsys):
    """A search of more stage plans than MAX_STAGE_PLANS is refused before any plan is built
    (a million GPUs and 10^8 layers tried a million-stage pipeline per plan for minutes); the
    largest preset search stays far inside the bound."""
    import time

    from moebench.plan import search as search_module

    planned = []
    monkeypatch.setattr(search_module, "build_plan", lambda *a, **k: planned.append(a) or {})
    monkeypatch.setattr(sys, "argv", ["moebench", "plan", "--preset", "moe-8l-e64", "--search", "--gpus", "1048576",
                                      "--set", "model.n_layers=100000000"])
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert time.perf_counter() - start < 5 and not planned
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "stage plans, above the search's bound of 50,000" in err[0] and "--gpus=1048576" in err[0]
    layouts = search_module.candidate_layouts(load_config("ultra-2.38t"), 4096)
    cfg = load_config("ultra-2.38t")
    work = [(lay, laid, micro_batchings(laid)) for lay in layouts
            for laid in [apply_world_size(search_module.with_layout(cfg, lay), 4096, False, False)]]
    assert sum(len(m) * laid.parallel.pp for _, laid, m in work) < search_module.MAX_STAGE_PLANS / 5


def _command_config(command: str):
    """The config a printed ``moebench train`` line trains, and its --nproc."""
    import shlex

    words = shlex.split(command)
    assert words[:3] == ["moebench", "train", "--preset"]
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    return load_config(words[3], sets), int(words[words.index("--nproc") + 1])


def test_a_layout_that_does_not_fit_gets_no_speed_but_what_fits_instead():
    """mixtral-8x7b as ddp on 8 h200 needs 980 GiB per GPU: no tokens/s, TFLOP/s or MFU, and the
    fastest layout of the search that fits and that moebench trains, with its command line."""
    result = _invoke("--preset", "mixtral-8x7b", "--gpus", "8")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "DOES NOT FIT" in out and "no speed: the layout needs 980 GiB per GPU, 118 GiB usable" in out
    starts = [line.split("  ")[0] for line in out.splitlines()]
    assert not {"tokens/s per GPU", "TFLOP/s per GPU", "MFU", "time per step"} & set(starts)
    assert "fits instead (the fastest layout of --search that moebench trains): fsdp dp=8" in out
    command = out.split("fits instead", 1)[1].splitlines()[1].strip()
    cfg, nproc = _command_config(command)
    best = search(load_config("mixtral-8x7b"), 8, "h200", batch_given=False).ranked[0]
    assert cfg.to_dict() == best["config"] and nproc == 8 and best["plan"]["fits"]
    record = json.loads(_invoke("--preset", "mixtral-8x7b", "--gpus", "8", "--json").output.splitlines()[-1])
    assert not record["plan"]["fits"] and record["plan"]["instead"]["command"] == command
    # nothing fits at all: the smallest peak, and no command
    tiny_gpu = _invoke("--preset", "mixtral-8x7b", "--gpus", "1").output
    assert "nothing searched fits on these GPUs; the smallest peak is" in tiny_gpu and "moebench train" not in tiny_gpu


def test_search_prints_the_command_that_trains_its_best_layout():
    result = _invoke("--preset", "moe-8l-e64", "--gpus", "8", "--search", "--top", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    command = lines[lines.index("#1 runs with:") + 1].strip()
    cfg, nproc = _command_config(command)
    best = search(load_config("moe-8l-e64"), 8, "h200", batch_given=False).ranked[0]
    assert best["plan"]["moebench_runs"] and cfg.to_dict() == best["config"] and nproc == best["world_size"]
    as_json = json.loads(_invoke("--preset", "moe-8l-e64", "--gpus", "8", "--search", "--json").output.splitlines()[-1])
    assert as_json["best_command"] == {"rank": 1, "command": command}


def _gpu_check(tmp_path, **fields):
    results = {"schema_version": 2, "started_at": "2026-12-03T08:00:00+00:00", "device": "NVIDIA H200",
               "dtype": "bfloat16", "sections": {"dense": {"fwd_bwd": {"tflops": 692.6}}}, **fields}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(results))
    return path


def test_matmul_efficiency_from_a_gpu_check_plans_on_its_device_at_its_rate(tmp_path):
    """The dense rate scripts/gpu_check.sh measured replaces the assumed 790/989: 692.6 of the
    H200's 989.4 TFLOP/s is 70%, named with its file in the assumptions."""
    path = _gpu_check(tmp_path)
    result = _invoke("--preset", "tiny", "--gpus", "2", "--matmul-efficiency-from", str(path), "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[-1])
    assert record["device_name"] == DEVICES["h200"].name
    line = next(a for a in record["plan"]["assumptions"] if a.startswith("compute at"))
    assert line.startswith("compute at 70% of peak (measured: dense bf16 fwd+bwd 693 of 989 TFLOP/s")
    assert str(path) in line
    default = json.loads(_invoke("--preset", "tiny", "--gpus", "2", "--json").output.splitlines()[-1])
    assert record["tokens_per_s_per_device"] < default["tokens_per_s_per_device"]  # 70% < 80% of peak


@pytest.mark.parametrize(("fields", "args", "message"), [
    ({"device": "cpu"}, [], "field 'device' ('cpu') is not a GPU"),
    ({"dtype": "float32"}, [], "field 'dtype' is 'float32'"),
    ({"sections": {"dense": {"error": "CUDA error: out of memory"}}}, [],
     "field 'sections.dense.fwd_bwd.tflops' has no measured rate (CUDA error: out of memory)"),
    ({"sections": {"dense": {"fwd_bwd": {"tflops": 1200.0}}}}, [], "exceeds the NVIDIA H200 SXM 141GB dense peak"),
    ({}, ["--gpu", "b200"], "--gpu b200 differs from the GPU"),
    ({}, ["--matmul-efficiency", "0.5"], "--matmul-efficiency-from replaces --matmul-efficiency"),
])
def test_matmul_efficiency_from_refuses_what_it_cannot_use(tmp_path, fields, args, message):
    path = _gpu_check(tmp_path, **fields)
    result = _invoke("--preset", "tiny", "--gpus", "2", "--matmul-efficiency-from", str(path), *args)
    assert result.exit_code != 0
    assert message in str(result.exception)
    if "field" in message:
        assert str(path) in str(result.exception)


def test_matmul_efficiency_from_an_unreadable_file_names_it(tmp_path):
    path = tmp_path / "gpu_check.json"
    path.write_text("{truncated")
    result = _invoke("--preset", "tiny", "--gpus", "2", "--matmul-efficiency-from", str(path))
    assert result.exit_code != 0 and f"{path}: not a readable gpu_check.json" in str(result.exception)


def test_train_command_writes_a_stage_layout_as_set_reads_it():
    """A record's parallel.pp_layers (a JSON list) goes on the command line comma-separated."""
    from moebench.plan.command import train_command

    cfg = load_config("tiny", ["parallel.pp=2", "model.n_layers=3", "parallel.pp_layers=1,2"])
    record = json.loads(json.dumps(build_plan(cfg, "h200")))
    command = train_command(record)
    assert "parallel.pp_layers=1,2" in command
    again, nproc = _command_config(command)
    assert again.parallel.pp_layers == (1, 2) and nproc == 2
