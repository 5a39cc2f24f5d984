"""CUDA-only checks of the kernels and precision paths (skipped without a GPU), and a CPU smoke
run of the GPU check script's device-independent parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moebench.bench import gpu_check, gpu_sections, gpu_summary
from moebench.bench.moe_layer import LayerShape
from moebench.bench.training_runs import train_once, training_ratios
from moebench.devices import NATIVE_CAPABILITY, torch_serves
from moebench.kernels import fp8, mxfp8
from moebench.kernels.quantized import gemm_impl, precision_impl, probe_error
from moebench.kernels.quantized_gemm import quantized_grouped_mm
from moebench.kernels.quantized_linear import quantized_linear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ragged(device: str) -> torch.Tensor:
    return torch.tensor([0, 37, 300, 0, 5, 129, 1, 0], device=device).cumsum(0).to(torch.int32)


@pytest.mark.gpu
@cuda
def test_triton_grouped_mm_bf16_matches_torch() -> None:
    from moebench.kernels.grouped_gemm import triton_grouped_mm

    offsets = _ragged("cuda")
    m = int(offsets[-1]) + 11
    a = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(8, 256, 192, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    grad = torch.randn(m, 192, device="cuda", dtype=torch.bfloat16)
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = triton_grouped_mm(a, b, offsets)
    ref = F.grouped_mm(a_ref, b_ref, offs=offsets)
    n = int(offsets[-1])
    torch.testing.assert_close(out[:n], ref[:n], rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    grad[n:] = 0
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(a.grad[:n], a_ref.grad[:n], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b.grad, b_ref.grad, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mxfp8_bit_exact_on_device(dtype: torch.dtype) -> None:
    from moebench.kernels import mxfp8_triton

    x = (torch.randn(512, 1024, device="cuda") * torch.logspace(-30, 30, 512, device="cuda")[:, None]).to(dtype)
    x[7, 100] = float("nan")
    for rounding in ("up", "floor"):
        d_ref, s_ref = mxfp8.quantize(x, rounding)
        d_tri, s_tri = mxfp8_triton.quantize(x, rounding)
        assert torch.equal(s_tri.view(torch.uint8), s_ref.view(torch.uint8))
        nan = d_ref.float().isnan()
        assert torch.equal(d_tri.view(torch.uint8)[~nan], d_ref.view(torch.uint8)[~nan])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_fp8_rowwise_bit_exact_on_device(dtype: torch.dtype) -> None:
    from moebench.kernels import fp8_triton

    x = torch.randn(515, 1000, device="cuda") * torch.exp2(torch.linspace(-140, 120, 515, device="cuda"))[:, None]
    x[3], x[4], x[5, 7], x[6, 999] = 0.0, 1e-42, float("nan"), float("inf")
    x = x.to(dtype)
    for shape, block_k in (((515, 1000), 4096), ((515, 1000), 256), ((5, 103, 1000), 4096)):
        xs = x.view(shape)
        d_ref, s_ref = fp8.quantize_rowwise(xs, dim=-1)
        d_tri, s_tri = fp8_triton.quantize_rowwise(xs, block_k=block_k)
        assert torch.equal(s_tri.view(torch.int32), s_ref.view(torch.int32))
        nan = d_ref.float().isnan()
        assert torch.equal(d_tri.float().isnan(), nan)
        assert torch.equal(d_tri.view(torch.uint8)[~nan], d_ref.view(torch.uint8)[~nan])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_group_columns_bit_exact_on_device(dtype: torch.dtype) -> None:
    from moebench.kernels import fp8_group_triton

    offsets = _ragged("cuda")
    n = int(offsets[-1])
    x = torch.randn(n + 11, 1000, device="cuda") * torch.exp2(torch.linspace(-140, 120, n + 11, device="cuda"))[:, None]
    x[:, 3], x[:, 4], x[40, 7], x[41, 999] = 0.0, 1e-42, float("nan"), float("inf")
    x = x.to(dtype)
    rows = -(-x.shape[0] // 16) * 16
    d_ref, s_ref = fp8.quantize_group_columns(x, offsets)
    d_tri, s_tri = fp8_group_triton.quantize_group_columns_t(x, offsets, rows)
    assert torch.equal(s_tri.view(torch.int32), s_ref.view(torch.int32))
    assert torch.equal(d_tri.view(torch.uint8)[:, :n], d_ref.view(torch.uint8)[:n].t())
    assert not d_tri.view(torch.uint8)[:, n:].any()


@pytest.mark.gpu
@cuda
def test_triton_permute_on_device() -> None:
    from moebench.kernels.permute import destination_rows, permute, permute_reference, unpermute, unpermute_reference

    idx = torch.rand(300, 16, device="cuda").topk(4, dim=-1).indices
    dest, _ = destination_rows(idx, 16)
    x = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(permute(x, dest, 1200), permute_reference(x, dest, 1200))
    y = torch.randn(1200, 384, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(300, 4, device="cuda")
    torch.testing.assert_close(unpermute(y, dest, w), unpermute_reference(y, dest, w), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_quantized_gemm_matches_emulation(fmt: str, saved: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    impl = precision_impl(fmt, device)
    capability = torch.cuda.get_device_capability(device)
    if capability < NATIVE_CAPABILITY[fmt]:
        assert impl == "emulated"
        return
    if fmt == "fp8" and torch_serves(fmt, capability):
        assert impl == "native", f"torch._scaled_grouped_mm serves fp8 here: {probe_error(fmt, device)}"
    elif impl != "native":
        pytest.skip(f"this torch build runs {fmt} grouped GEMMs emulated here: {probe_error(fmt, device)}")
    offsets = _ragged("cuda")
    rows = int(offsets[-1])
    a = torch.randn(rows + 7, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 256, 384, device="cuda", dtype=torch.bfloat16) / 16
    grad = torch.randn(rows + 7, 384, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for name in ("native", "emulated"):
        a_, w_ = a.clone().requires_grad_(), w.clone().requires_grad_()
        out = quantized_grouped_mm(a_, w_, offsets, fmt, name, saved=saved)
        out.backward(grad)
        runs[name] = (out[:rows].float(), a_.grad[:rows].float(), w_.grad.float())
    for got, want in zip(runs["native"], runs["emulated"], strict=True):
        # the same quantized operands; bf16 outputs and (forward) fast accumulation differ by ~bf16 ulps
        assert ((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_quantized_linear_matches_emulation(fmt: str, saved: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    impl = gemm_impl(fmt, device, "linear")
    if torch.cuda.get_device_capability(device) < NATIVE_CAPABILITY[fmt]:
        assert impl == "emulated"
        return
    if fmt == "fp8":
        assert impl == "native", "SM90+ with torch._scaled_mm should run fp8 natively"
    elif impl != "native":
        pytest.skip("this torch build has no MXFP8 GEMM for this device")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16) / 16
    grad = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for name in ("native", "emulated"):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = quantized_linear(x_, w_, fmt, name, saved=saved)
        out.backward(grad)
        runs[name] = (out.float(), x_.grad.float(), w_.grad.float())
    for got, want in zip(runs["native"], runs["emulated"], strict=True):
        assert ((got - want).norm() / want.norm()) < 1e-2  # as for the grouped GEMMs


@pytest.mark.gpu
@cuda
def test_grouped_mm_moe_is_sync_free() -> None:
    moe = gpu_sections.build_moe(LayerShape(tokens=512, d_model=256, hidden=128, experts=16, top_k=4),
                              "grouped_mm", torch.device("cuda"), torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).backward(torch.randn_like(x))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_gpu_check_sections_on_cpu() -> None:
    """The check's CPU-safe sections on toy shapes, called in this process (the orchestration test
    below runs sections in processes of their own): results without errors, verdicts PASS or WARN."""
    ctx = {"device": torch.device("cpu"), "shape": gpu_check.SMALL, "repeats": 1, "small": True,
           "dtype": torch.float32, "deadline": float("inf")}
    sections = {}
    for name in ("dense", "grouped_gemm", "moe_layer", "precision", "sync_free", "tests"):
        fn = dict((n, f) for n, f, _ in gpu_check.SECTIONS)[name]
        sections[name] = fn(ctx)
        if name == "dense":  # what the parent hands the later sections
            ctx["dense_fwd_bwd_tflops"] = sections["dense"]["fwd_bwd"]["tflops"]
        verdict, why = gpu_check.section_verdict(name, sections[name])
        assert verdict in (("SKIP",) if name in ("sync_free", "tests") else ("PASS", "WARN")), (name, why)
    assert sections["tests"]["skipped"] == "needs CUDA" and sections["sync_free"]["skipped"] == "needs CUDA"
    assert sections["moe_layer"]["mxfp8"]["precision_impl"] == "emulated"
    assert sections["moe_layer"]["grouped_mm"]["tflops"] > 0
    assert sections["precision"]["mxfp8_rel_rms_err"] < 0.05
    assert sections["precision"]["fp8_torch_gbps"] > 0
    ragged = sections["precision"]["offsets"]["ragged"]  # the native GEMMs' cases (on a GPU): unaligned groups
    assert ragged["groups"] == gpu_check.SMALL.experts and ragged["unaligned_16"] >= 2 and ragged["empty"] >= 1
    table = dict((a, (b, c)) for a, b, c in gpu_summary.summary_rows({"sections": sections}))
    assert "moe layer mxfp8 [emulated] TFLOP/s" in table
    assert table["quantized GEMM groups not a multiple of 16 (routed, ragged)"][0].endswith(", 2/4")


@pytest.mark.slow
def test_gpu_check_runs_each_section_apart_and_exits_1_on_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu_check.sh, each section in its own process: one that ends its process as a
    device-side assert does, one that raises and one that outlives its budget FAIL alone, the next
    one still runs with what the parent passes on, the JSON and the verdicts are written, the
    verdict table prints last, and the script exits 1; with the failing ones skipped the check
    exits 0. (The built-in sections are skipped: the test above runs them.)"""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent.parent), str(root),
                                                      os.environ.get("PYTHONPATH", "")]))
    builtin = ",".join(name for name, _, _ in gpu_check.SECTIONS)
    # a short start allowance, so the hung section is killed after 1 + 2 s
    common = ["--device", "cpu", "--small", "--plugin", "gpu_check_fake", "--start-allowance", "2"]
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), str(tmp_path), *common, "--skip", builtin],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    sections, verdicts = results["sections"], results["verdicts"]
    assert verdicts["training"] == {"verdict": "SKIP", "why": "--skip"}
    crash = verdicts["fake_crash"]
    assert crash["verdict"] == "FAIL" and "device-side assert triggered" in crash["why"]
    assert verdicts["fake_raise"] == {"verdict": "FAIL", "why": "RuntimeError: wrong answer"}
    hang = verdicts["fake_hang"]
    assert hang["verdict"] == "FAIL" and hang["why"].startswith("timed out: its budget of 1 s and 2 s to start")
    assert verdicts["fake_pass"]["verdict"] == "PASS" and "dense_seen" in sections["fake_pass"]
    assert proc.returncode == 1 and results["verdict"] == "FAIL", proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()
    assert out[-1] == "gpu check FAIL: 3 section(s) failed (fake_crash, fake_raise, fake_hang)"
    table = {line.split()[0]: line.split()[1] for line in out[-1 - len(verdicts):-1]}  # section, verdict
    assert table == {name: v["verdict"] for name, v in verdicts.items()}
    skip = f"{builtin},fake_crash,fake_raise,fake_hang"
    assert gpu_check.main([str(tmp_path), *common, "--skip", skip]) == 0  # nothing failed: exit 0


def test_sections_fit_nine_minutes_in_priority_order() -> None:
    """The budgets sum to the check's 540 s, inside the script's hard timeout; the dense rate runs
    first (later sections compare against it) and learning before the runs held against its lr=0 control."""
    names = [name for name, _, _ in gpu_check.SECTIONS]
    assert sum(budget for _, _, budget in gpu_check.SECTIONS) == gpu_check.BUDGET_S == 540
    script = (Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh").read_text()
    assert "exec timeout 570 " in script
    assert names[0] == "dense" and names.index("learning") < min(names.index("scope_linear"),
                                                                 names.index("triton_training"))
    assert gpu_check.section_context({"learning": {"control_lr0": {"loss_last": 5.5}}})["markov_control_loss"] == 5.5


def test_section_verdicts_fail_wrong_results_and_warn_on_speed() -> None:
    v = gpu_check.section_verdict
    assert v("dense", {"fwd_bwd": {"tflops": 700.0}}, device_peak=989e12) == ("PASS", "")
    assert v("dense", {"fwd_bwd": {"tflops": 1500.0}}, device_peak=989e12)[0] == "FAIL"  # above the datasheet
    assert v("dense", {"fwd_bwd": {"tflops": 1000.0}}, device_peak=989e12)[0] == "FAIL"  # above the peak
    assert v("dense", {"fwd_bwd": {"tflops": 250.0}}, device_peak=989e12) == (
        "FAIL", "dense rate 0.25 of the datasheet peak, outside [0.3, 1.0]")  # implausibly slow
    assert v("precision", {"fp8_triton_bit_exact": False})[0] == "FAIL"
    assert v("precision", {"fp8_native_vs_emulated_grad_w_rel_err": 0.2})[0] == "FAIL"
    assert v("moe_layer", {"grouped_mm": {"vs_dense": 0.5}})[0] == "WARN"
    assert v("moe_layer", {"fp8": {"error": "boom"}})[0] == "FAIL"
    assert v("training", {"bf16_compiled_loss_rel_diff": 0.03})[0] == "FAIL"
    assert v("tests", {"ok": False, "summary": "1 failed"}) == ("FAIL", "pytest -m gpu: 1 failed")
    assert v("sync_free", {"skipped": "needs CUDA"}) == ("SKIP", "needs CUDA")
    nvml = {"nvml_peak_mem_used_bytes": 80 * 2**30, "nvml_energy_j": 2.1e5, "throttled": False,
            "nvml_throttle_reasons": []}
    assert v("nvml", nvml) == ("PASS", "")
    assert v("nvml", {**nvml, "throttled": True, "nvml_throttle_reasons": ["sw_thermal_slowdown"]}) == (
        "WARN", "throttled: sw_thermal_slowdown (speed rows suspect)")
    assert v("nvml", {**nvml, "nvml_energy_j": None})[0] == "WARN"
    assert v("nvml", {**nvml, "nvml_peak_mem_used_bytes": None}) == ("FAIL", "NVML gave no memory reading")
    table = dict((a, (b, c)) for a, b, c in gpu_summary.summary_rows({"sections": {"nvml": nvml}}))
    assert table["nvml peak mem GiB / energy kJ / throttle reasons"] == ("80.0 / 210.0 / none", "")


def test_learning_check_passes_training_and_fails_its_lr0_control() -> None:
    """The learning verdict on two real records' losses (tiny, markov data, 20 steps on CPU:
    5.549 -> 1.542 at the default lr, 5.549 -> 5.556 at lr=0): the trained run is held against
    the lr=0 run's final loss, the lr=0 control against its own first step, and it fails that."""
    from moebench.bench.training_runs import learned

    trained, control = {"loss_first": 5.549, "loss_last": 1.542}, {"loss_first": 5.549, "loss_last": 5.556}
    assert learned(trained, control["loss_last"]) is True and learned(control) is False
    assert learned(control, control["loss_last"]) is False  # the control against itself: the check can fail
    assert learned({"loss_first": 5.549, "loss_last": 5.4}, 5.556) is False  # 2.8% below: not enough
    assert learned({"error": "exit 1"}) is None
    result = {"default_lr": {"learned": True}, "control_lr0": {"learned": False}, "ok": True}
    assert gpu_check.section_verdict("learning", result) == ("PASS", "")
    assert gpu_check.section_verdict("learning", {**result, "ok": False, "why": "the lr=0 control learned"}) == (
        "FAIL", "the lr=0 control learned")


def test_runs_cut_short_by_the_budget_skip_and_others_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a scripted ``train_once``: in the training section a run the section's budget cut short
    is SKIPped, a crashed one FAILs the section; a learning run that did not finish says why."""
    from moebench.bench import training_runs

    answers = iter([{"loss_last": 4.0, "tokens_per_s": 1.0}, {"error": "exit 1: boom"},
                    {"loss_last": 4.0, "tokens_per_s": 1.0}, {"error": "timed out after 100 s"}])
    monkeypatch.setattr(training_runs, "train_once", lambda *args, **kwargs: next(answers))
    ctx = {"device": torch.device("cpu"), "small": True, "deadline": time.monotonic() + 100}
    result = training_runs.section_training(ctx)
    assert result["fp8_compiled"] == {"skipped": "time budget (timed out after 100 s)"}
    assert gpu_check.section_verdict("training", result) == (
        "FAIL", "runs failed: ['bf16_compiled']; compiled loss off by >= 1%: []")
    answers = iter([{"loss_first": 5.5, "loss_last": 1.5}, {"error": "timed out after 40 s"}])
    result = training_runs.section_learning(ctx)
    assert result["ok"] is False and result["why"] == "control_lr0: timed out after 40 s"


# a real record's breakdown (tiny, eager, CPU), in seconds: the phases add up to breakdown_step_s
TIMED = {"time_breakdown_s": {"attention": 1.477, "combine": 0.0, "dense": 0.0, "dispatch": 0.0, "experts": 5.284,
                              "grad_reduce": 1.2e-05, "head_loss": 0.414, "optimizer": 0.736, "other": 0.044,
                              "param_gather": 0.0, "pipeline_bubble": 0.0, "router": 1.280},
         "time_breakdown_backward_s": {"attention": 1.073, "experts": 3.702, "router": 0.850},
         "breakdown_step_s": 9.235012, "step_time_median_s": 9.236, "breakdown_steps": 2}


def test_phase_clock_check_passes_a_partitioned_step_and_names_what_is_wrong() -> None:
    from moebench.bench.training_runs import phase_clock_problems

    assert phase_clock_problems(TIMED) == []
    # other is the rest of the median step: negative is no fault of the clock
    assert phase_clock_problems({**TIMED, "time_breakdown_s": {**TIMED["time_breakdown_s"], "other": -0.1},
                                 "breakdown_step_s": 9.091012}) == []
    broken = {**TIMED, "time_breakdown_s": {**TIMED["time_breakdown_s"], "router": 0.0, "head_loss": -0.1},
              "time_breakdown_backward_s": {"experts": 0.0}, "step_time_median_s": 12.0}
    assert phase_clock_problems(broken) == ["head_loss -1.00e-01 s < 0", "no time in router",
                                            "no time in head_loss", "no backward time in experts",
                                            "phases sum to 7.4410 s, the step they partition took 9.2350 s",
                                            "the clock's median step is 9.2350 s, the timed median 12.0000 s"]
    assert phase_clock_problems({"time_breakdown_s": None}) == ["no time_breakdown_s / breakdown_step_s in the record"]
    assert gpu_check.section_verdict("phase_clock", {**TIMED, "ok": True}) == ("PASS", "")


def test_training_check_rows() -> None:
    run = {"loss_first": 8.38, "loss_last": 6.1, "moe_backend": "triton", "precision_impl": "native",
           "baseline": "lr=0 control"}
    sections = {"learning": {"default_lr": {"loss_first": 8.38, "loss_last": 6.0},
                             "control_lr0": {"loss_first": 8.38, "loss_last": 8.37}},
                "triton_training": run, "scope_linear": {"error": "exit 1: boom"},
                "phase_clock": {**TIMED, "ok": True}}
    table = dict((a, (b, c)) for a, b, c in gpu_summary.training_check_rows(sections))
    assert table["learning: markov loss default lr | lr=0"][0] == "8.380 -> 6.000 | 8.380 -> 8.370"
    assert table["moe.backend=triton [triton, native] markov loss"] == ("8.380 -> 6.100",
                                                                       ">= 5% below the lr=0 control")
    assert table["scope=linear fp8"] == ("exit 1: boom", "")
    assert table["phase clock: timed step ms (top phases)"][0] == "9235.0 (experts 57%, attention 16%, router 14%)"


def test_gpu_check_table_verdicts() -> None:
    results = {"sections": {
        "tests": {"summary": "5 passed"},
        "dense": {"fwd_bwd": {"tflops": 700.0}},
        "grouped_gemm": {"torch": {"fwd": {"tflops": 600.0}}, "triton": {"fwd": {"tflops": 500.0}},
                         "triton_vs_torch_fwd_bwd": 0.85},
        "moe_layer": {"grouped_mm": {"tflops": 590.0, "vs_dense": 0.84},
                      "mxfp8": {"tflops": 300.0, "vs_dense": 0.43, "vs_bf16": 0.51, "precision_impl": "emulated"}},
        "sync_free": {"ok": True},
        "precision": {"fp8_triton_bit_exact": True, "fp8_native_vs_emulated_out_rel_err": 2e-3,
                      "fp8_native_vs_emulated_grad_a_rel_err": 3e-3, "fp8_native_vs_emulated_grad_w_rel_err": 0.2},
    }}
    table = dict((a, (b, c)) for a, b, c in gpu_summary.summary_rows(results))
    assert table["triton / torch (fwd+bwd)"] == ("0.85", "FAIL (>= 0.9)")
    assert table["moe layer grouped_mm TFLOP/s"][1] == "PASS (>= 0.8)"
    assert table["moe layer mxfp8 [emulated] TFLOP/s"][1] == "0.51x bf16"
    assert table["sync-free routing"] == ("True", "PASS")
    assert table["fp8 rowwise triton bit-exact"] == ("True", "")
    assert table["mxfp8 triton bit-exact"] == ("None", "")
    assert table["fp8 native vs emulated rel err (out/dA/dW)"] == ("2.0e-03/3.0e-03/2.0e-01", "FAIL (< 1e-2)")
    assert not any(name.startswith("mxfp8 native") for name in table)  # mxfp8 did not run natively


def test_gpu_check_training_rows() -> None:
    """Ratios only for pairs whose runs both finished; a failed run shows its error."""
    run = {"tokens_per_s": 1000.0, "mfu": 0.4, "compile_s": None, "moe_backend": "grouped_mm",
           "precision_impl": "native", "loss_last": 4.0}
    runs = {"bf16_eager": run, "bf16_compiled": {**run, "tokens_per_s": 1250.0, "compile_s": 41.0, "loss_last": 4.02},
            "fp8_eager": {**run, "tokens_per_s": 1500.0}, "fp8_compiled": {"error": "exit 1: boom"}}
    runs.update(training_ratios(runs))
    assert runs["bf16_compiled_vs_eager"] == pytest.approx(1.25) and "fp8_compiled_vs_eager" not in runs
    assert runs["fp8_vs_bf16_eager"] == pytest.approx(1.5) and "fp8_vs_bf16_compiled" not in runs
    table = dict((a, (b, c)) for a, b, c in gpu_summary.summary_rows({"sections": {"training": runs}}))
    assert table["train bf16_compiled [grouped_mm, native] tok/s"] == ("1,250, MFU 40.0%, compile 41 s", "")
    assert table["train bf16 compiled / eager tok/s (loss change)"] == ("1.25x (5.0e-03)", "PASS (loss < 1e-2)")
    assert table["train fp8_compiled"] == ("exit 1: boom", "")
    assert table["train fp8 / bf16 tok/s (eager)"] == ("1.50x", "")


@pytest.mark.slow
def test_gpu_check_training_run_on_cpu() -> None:
    """One of the check's runs end to end on CPU: tiny, fp8 (emulated) experts, compiled."""
    got = train_once("tiny", "cpu", "fp8", True, steps=3, timeout_s=600)
    assert "error" not in got, got
    assert got["compiled"] is True and got["compile_s"] > 0 and got["precision_impl"] == "emulated"
    assert got["moe_backend"] == "grouped_mm" and got["tokens_per_s"] > 0  # the emulation's GEMMs


def test_sampler_overhead_interleaves_both_arms() -> None:
    """The A/B behind the NVML overhead row, on CPU with a scripted NVML: every round times the
    step without and with a polling sampler, and each sampler is stopped after its arm."""
    from nvml_helpers import FakeNvml

    from moebench.metrics.nvml import NvmlSampler

    samplers: list[NvmlSampler] = []

    def make() -> NvmlSampler:
        samplers.append(NvmlSampler(["GPU-a"], interval_s=0.001, nvml=FakeNvml(["GPU-a"])))
        return samplers[-1]

    a = torch.randn(128, 128)
    out = gpu_sections.sampler_overhead(lambda: a @ a, make, torch.device("cpu"), rounds=3, steps=4)
    assert len(out["samples_off_s"]) == len(out["samples_on_s"]) == 12
    assert len(samplers) == 3 and all(s.samples >= 1 and not s._thread.is_alive() for s in samplers)
    assert out["overhead"] == pytest.approx(out["on_median_s"] / out["off_median_s"] - 1)
    table = dict((a, (b, c)) for a, b, c in gpu_summary.summary_rows({"sections": {"nvml_overhead": out}}))
    assert table["nvml sampler overhead (A/B)"][1].endswith("(< 1%)")


def test_markov_sections_say_why_a_run_did_not_train(monkeypatch) -> None:
    from moebench.bench import training_runs

    run = {"loss_first": 8.38, "loss_last": 8.37, "baseline": "lr=0 control", "learned": False,
           "moe_backend": "grouped_mm"}
    monkeypatch.setattr(training_runs, "_markov_run", lambda ctx, precision, extra: dict(run))
    why = "did not train: 8.38 -> 8.37 (baseline lr=0 control)"
    assert training_runs.section_scope_linear({})["why"] == why
    cuda = {"device": torch.device("cuda")}
    assert training_runs.section_triton_training(cuda)["why"] == f"the record says grouped_mm ran; {why}"
    run.update(learned=True, moe_backend="triton")
    assert training_runs.section_scope_linear({})["ok"] and training_runs.section_triton_training(cuda)["ok"]
