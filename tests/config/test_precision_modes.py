"""Precision modes: config, quantized experts, precision_impl, native alignment checks, and training tracks fp32."""

from __future__ import annotations

import importlib.util
import statistics
import typing

import pytest
import torch
from torch import nn

from moebench.config import Config, MoEConfig, resolve_backend
from moebench.errors import ConfigError
from moebench.kernels.expert_backends import expert_backend, experts_grouped_mm
from moebench.kernels.quantized import precision_impl, quantized_experts
from moebench.model.experts import Experts
from moebench.model.precision import QuantizedLinear, apply_expert_precision, apply_precision
from moebench.model.transformer import build_model
from moebench.parallel.strategy import Strategy
from moebench.presets import load_config
from moebench.train.run import run_training, summary_lines
from moebench.train.trainer import Trainer


def test_config_modes_and_rounding() -> None:
    cfg = Config().apply_overrides(["precision.mode=mxfp8", "precision.mxfp8_rounding=floor"])
    assert (cfg.precision.mode, cfg.precision.mxfp8_rounding) == ("mxfp8", "floor")
    assert Config().precision.mode == "auto" and Config().precision.mxfp8_rounding == "up"
    with pytest.raises(ConfigError, match="allowed"):
        Config().set("precision.mode", "fp4")
    with pytest.raises(ConfigError, match="allowed"):
        Config().set("precision.mxfp8_rounding", "nearest")


def test_the_config_and_the_kernels_know_the_same_modes() -> None:
    """The config's allowed modes are the kernels' (both moebench/precision_modes.py's)."""
    from moebench.config import PrecisionConfig
    from moebench.kernels.quantized import quant_format
    from moebench.precision_modes import MODES, UNQUANTIZED_MODES

    allowed = typing.get_args(typing.get_type_hints(PrecisionConfig)["mode"])
    assert set(allowed) == {*UNQUANTIZED_MODES, *MODES}
    assert [quant_format(m) for m in ("auto", "fp32", "bf16", "fp8", "mxfp8")] == ["none"] * 3 + ["fp8", "mxfp8"]
    with pytest.raises(ValueError, match="precision mode must be one of"):
        quant_format("fp4")


def test_experts_precision_attribute() -> None:
    torch.manual_seed(2)
    experts = Experts(4, 64, 32)
    experts.init_weights(0.05, 0.05)
    x = torch.randn(24, 64)
    offsets = torch.tensor([6, 6, 18, 24], dtype=torch.int32)
    assert experts.precision == "none"
    plain = experts(x, offsets)
    assert torch.equal(plain, experts_grouped_mm(x, experts.w13, experts.w2, offsets))
    for mode in ("fp8", "mxfp8"):
        experts.precision = mode
        got = experts(x, offsets)
        want = quantized_experts(x, experts.w13, experts.w2, offsets, mode, impl="emulated")
        assert torch.equal(got, want) and not torch.equal(got, plain)
        rel = (got - plain).norm() / plain.norm()
        assert 1e-4 < rel < 0.1  # quantization noise of an 8-bit float: a few percent at most


def test_precision_impl_on_cpu() -> None:
    assert precision_impl("fp32", "cpu") == precision_impl("bf16", "cpu") == "native"
    assert precision_impl("fp8", "cpu") == precision_impl("mxfp8", "cpu") == "emulated"
    with pytest.raises(ValueError):
        precision_impl("fp4", "cpu")


def test_emulation_says_why_and_require_native_refuses_it() -> None:
    """On CPU a quantized mode runs emulated: the record says why and what computed the experts;
    precision.require_native=true turns that into a one-line error instead of an emulated run."""
    from moebench.kernels.quantized import probe_error

    assert probe_error("bf16", "cpu") is None
    assert "only on CUDA" in probe_error("fp8", "cpu") and probe_error("fp8", "cpu", "linear").startswith("grouped")
    cfg = load_config("tiny", ["precision.mode=fp8", "train.steps=3", "train.warmup_steps=1",
                               "train.profile_steps=0"])
    record = run_training(cfg)
    assert record["status"] == "ok" and record["precision_impl"] == "emulated"
    assert "only on CUDA" in record["precision_probe_error"] and record["moe_backend"] == "grouped_mm"
    first, why = summary_lines(record)[:2]  # moebench train's summary says what ran, and why emulated
    assert "precision fp8 (emulated)  experts grouped_mm" in first
    assert why == f"emulated {record['precision_probe_error']}"
    with pytest.raises(ConfigError, match=r"require_native=true, but precision.mode=fp8 runs emulated on cpu"):
        run_training(cfg.apply_overrides(["precision.require_native=true"]))


def test_the_record_names_the_gemms_that_ran() -> None:
    from moebench.kernels.quantized import expert_gemms_that_run as ran

    assert ran("cpu_fused", "cpu", "fp32", "native") == "cpu_fused"
    assert ran("cpu_fused", "cuda", "bf16", "native") == "grouped_mm"  # cpu_fused is grouped_mm off the CPU
    assert ran("loop", "cuda", "fp8", "native") == ran("triton", "cuda", "mxfp8", "native") == "scaled_grouped_mm"
    assert ran("triton", "cuda", "fp8", "emulated") == "triton"
    assert ran("loop", "cpu", "fp8", "emulated") == "grouped_mm"  # the emulation's GEMMs are torch's
    assert ran("loop", "cuda", "bf16", "native") == "loop"


@pytest.mark.slow
def test_the_probe_runs_apart_and_reports_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device-side assert kills the probe's own process: the run gets the reason, not a poisoned context."""
    import sys

    from moebench.kernels import quantized

    crash = [sys.executable, "-c", "import sys; sys.stderr.write('CUDA error: device-side assert triggered\\n');"
             " sys.exit(134)"]
    assert quantized.run_probe("fp8", 0, "grouped", crash) == (
        "the fp8 grouped probe process exited 134: CUDA error: device-side assert triggered")
    agree = [sys.executable, "-c", "print('noise'); print('{\"error\": null}')"]
    assert quantized.run_probe("fp8", 0, "grouped", agree) is None
    disagree = [sys.executable, "-c", "print('{\"error\": \"weight gradient disagrees\"}')"]
    assert quantized.run_probe("fp8", 0, "grouped", disagree) == "weight gradient disagrees"
    assert "exited 0: no output" in quantized.run_probe("fp8", 0, "grouped", [sys.executable, "-c", "pass"])


def test_the_impl_is_resolved_when_precision_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward never asks the probe (a compiled block would trace into it): apply_precision does, once."""
    from moebench.model import precision as precision_module

    cfg = load_config("tiny")
    model = build_model(cfg, "cpu")
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(precision_module, "gemm_impl", lambda mode, device, kind="grouped": asked.append(
        (mode, kind)) or "emulated")
    apply_precision(model, "fp8", scope="linear")
    n = len(asked)
    assert n > 0 and {k for _, k in asked} == {"grouped", "linear"}
    from moebench.kernels import quantized

    monkeypatch.setattr(quantized, "gemm_impl", lambda *a, **k: pytest.fail("the forward reached the probe"))
    model(torch.randint(0, cfg.model.vocab_size, (1, 16)))
    assert len(asked) == n


def test_apply_expert_precision() -> None:
    cfg = load_config("tiny")
    model = build_model(cfg, "cpu")
    assert apply_expert_precision(model, "mxfp8", "floor") == cfg.model.n_layers - cfg.model.n_dense_layers
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(m.precision == "mxfp8" and m.mxfp8_rounding == "floor" for m in experts)
    apply_expert_precision(model, "bf16")
    assert all(m.precision == "none" for m in experts)
    odd = build_model(load_config("tiny", ["moe.expert_hidden=48"]), "cpu")
    with pytest.raises(ConfigError, match="multiples of 32"):
        apply_expert_precision(odd, "mxfp8")
    apply_expert_precision(odd, "fp8")  # rowwise scaling has no block constraint (emulated here)


def test_scope_linear_quantizes_every_dense_linear_but_router_and_head() -> None:
    cfg = load_config("small", ["model.n_layers=2", "moe.shared_expert_hidden=64"])  # dense layer 0 + shared expert
    model = build_model(cfg, "cpu")
    keys = model.state_dict().keys()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    plain = model(tokens)
    count = apply_precision(model, "mxfp8", "floor", "linear")
    swapped = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert swapped == {f"layers.{i}.{path}" for i in range(2) for path in ("attn.wqkv", "attn.wo")} | \
        {"layers.0.ffn.w13", "layers.0.ffn.w2", "layers.1.ffn.shared.w13", "layers.1.ffn.shared.w2"}
    assert count == 1 + len(swapped)  # the MoE layer's experts, and the linears
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert model.state_dict().keys() == keys
    assert all(m.precision == "mxfp8" and m.mxfp8_rounding == "floor" for m in linears)
    assert type(model.lm_head) is nn.Linear and type(model.layers["1"].ffn.router.gate) is nn.Linear
    quantized = model(tokens)
    rel = ((quantized - plain).norm() / plain.norm()).item()
    assert 1e-4 < rel < 0.1  # 8-bit quantization noise, no more
    apply_precision(model, "bf16", scope="linear")  # back to plain matmuls, modules kept
    assert torch.equal(model(tokens), plain)
    odd = build_model(load_config("tiny", ["model.dense_hidden=48", "model.n_dense_layers=1"]), "cpu")
    with pytest.raises(ConfigError, match=r"out_features \(64\) of layers.0.ffn.w2 \(precision.scope=linear\)"):
        apply_precision(odd, "mxfp8", scope="linear")
    apply_precision(odd, "mxfp8")  # the experts alone are aligned


@pytest.mark.parametrize("mode,align", [("fp8", 16), ("mxfp8", 128)])
def test_native_modes_reject_unaligned_dims(mode: str, align: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a mode runs natively its kernel needs aligned K: refuse up front, not mid-step."""
    from moebench.model import precision

    monkeypatch.setattr(precision, "gemm_impl", lambda mode, device, kind: "native")
    apply_expert_precision(build_model(load_config("tiny", [f"model.d_model={align}",
                                                              f"moe.expert_hidden={align}"]), "cpu"), mode)
    hidden = align + (8 if mode == "fp8" else 32)  # passes every other check of its mode
    odd = build_model(load_config("tiny", [f"model.d_model={align}", f"moe.expert_hidden={hidden}"]), "cpu")
    with pytest.raises(ConfigError, match=f"multiples of {align}"):
        apply_expert_precision(odd, mode)


def test_every_configurable_backend_has_a_kernel() -> None:
    """A model built with any ``moe.backend`` the config allows finds its compute function,
    also outside the trainer (the triton one is imported on first use)."""
    names = typing.get_args(typing.get_type_hints(MoEConfig)["backend"])
    assert set(names) == {"auto", "loop", "grouped_mm", "cpu_fused", "triton"}
    for name in names:
        if name == "triton" and importlib.util.find_spec("triton") is None:
            continue
        for device in ("cpu", "cuda"):  # auto is a kernel's name once resolved for the device
            assert callable(expert_backend(resolve_backend(name, device)))
    with pytest.raises(ValueError, match="unknown expert backend"):
        expert_backend("nope")


# ---------------------------------------------------------------- training tracks fp32

STEPS = 50


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP's spin-waiting under
    oversubscription made 2-thread runs of these tests up to 20x slower. Losses are unchanged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# tiny preset with half its batch (8 sequences of 64 tokens): CPU bf16 matmuls are slow here.
_SMALL_BATCH = ["train.global_batch_size=8", "train.micro_batch_size=8", f"train.steps={STEPS}"]
# Tolerance: the mean LM loss over the last 10 of 50 steps within 3% of fp32's. Measured on this
# CPU: bf16 -0.3%, fp8 +0.4%, mxfp8 +1.3% (saving compute-dtype operands: +0.5%); scope=linear fp8
# +1.2%, mxfp8 +0.7% (loss ~1.48, falling from 5.5). A quantizer with a wrong scale (e.g. off by
# 2x in a block) moves it by far more than that.
REL_TOL = 0.03


def _tail_mean(losses: list[float]) -> float:
    return statistics.mean(losses[-10:])


@pytest.fixture(scope="module")
def fp32_losses() -> list[float]:
    record = run_training(load_config("tiny", ["precision.mode=fp32", *_SMALL_BATCH]))
    assert record["precision_impl"] == "native"
    return record["losses"]


@pytest.mark.parametrize(("mode", "scope"), [("bf16", "experts"), ("fp8", "experts"), ("mxfp8", "experts"),
                                           ("fp8", "linear"), ("mxfp8", "linear")])
def test_training_tracks_fp32(mode: str, scope: str, fp32_losses: list[float]) -> None:
    """The real modes end to end (bf16 compute; fp8/mxfp8 emulated on CPU, saving their quantized operands)."""
    record = run_training(load_config("tiny", [f"precision.mode={mode}", f"precision.scope={scope}", *_SMALL_BATCH]))
    assert record["status"] == "ok"
    assert record["precision"] == mode
    assert record["precision_impl"] == ("native" if mode == "bf16" else "emulated")
    losses = record["losses"]
    assert len(losses) == STEPS and losses != fp32_losses
    assert _tail_mean(losses) < 0.5 * losses[0]  # it learned
    assert abs(_tail_mean(losses) / _tail_mean(fp32_losses) - 1) < REL_TOL


@pytest.mark.parametrize(("mode", "rounding"), [("fp8", "up"), ("mxfp8", "up"), ("mxfp8", "floor")])
def test_quantization_alone_tracks_fp32(mode: str, rounding: str, fp32_losses: list[float]) -> None:
    """Expert quantization with fp32 compute elsewhere: isolates the format's effect from bf16's."""
    cfg = load_config("tiny", _SMALL_BATCH)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, "cpu")
    apply_expert_precision(model, mode, rounding)
    trainer = Trainer(cfg, Strategy(model), torch.device("cpu"), torch.float32)
    for step in range(STEPS):
        trainer.train_step(step)
    losses = torch.stack(trainer.log.losses).tolist()
    assert losses != fp32_losses
    assert abs(_tail_mean(losses) / _tail_mean(fp32_losses) - 1) < REL_TOL


def test_the_installed_torch_decides_native_not_the_capability_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs whatever the device's capability: a torch whose kernel accepts a device outside
    the pinned torch's allow-list runs native there, and a failure there names the allow-list beside
    the probe's reason. What the build lacks on every device (CUDA, the op, MSLK for MXFP8 grouped)
    needs no probe."""
    from moebench.kernels import quantized

    status = quantized._native_status.__wrapped__  # uncached
    probed: list[str] = []

    def probe(answer):
        return lambda fmt, index, kind: probed.append(kind) or answer

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build, as on a GPU machine
    monkeypatch.setattr(torch.__config__, "show", lambda: "Build settings: ..., USE_CUDA=1, -DUSE_MSLK ...")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(quantized, "run_probe", probe(None))
    assert status("fp8", 0, "grouped") is None and probed == ["grouped"]  # outside the allow-list, and native
    sm80 = "native fp8 grouped GEMM raised ValueError: compute capability = [9.0, 10.0]"
    monkeypatch.setattr(quantized, "run_probe", probe(sm80))
    assert status("fp8", 0, "grouped") == (
        f"compute capability 8.0 is outside torch 2.13's native grouped fp8 allow-list (9.0, 10.0) ({sm80})")
    assert status("fp8", 0, "linear") == sm80  # _scaled_mm has an allow-list of its own: the probe's word
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 3))  # B300: in neither set
    assert status("mxfp8", 0, "grouped").startswith("compute capability 10.3 is outside torch 2.13's native "
                                                    "grouped mxfp8 allow-list (10.0)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    assert status("mxfp8", 0, "grouped") == sm80  # inside it: the probe's reason alone
    assert len(probed) == 5
    monkeypatch.setattr(torch.__config__, "show", lambda: "Build settings: ..., USE_CUDA=1, ...")
    assert status("mxfp8", 0, "grouped") == (
        f"this torch {torch.__version__} is built without MSLK (FBGEMM GenAI), which holds its MXFP8 grouped GEMM")
    assert status("mxfp8", 0, "linear") == sm80 and status("fp8", 0, "grouped") == sm80  # MSLK: MXFP8 grouped only
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert status("fp8", 0, "grouped") == f"this torch {torch.__version__} has no torch._scaled_grouped_mm"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert status("fp8", 0, "linear") == f"this torch {torch.__version__} is not a CUDA build"
    assert len(probed) == 7  # what the build lacks needs no probe
