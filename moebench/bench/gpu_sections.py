"""The GPU check's single-GPU sections that time and check kernels and the MoE layer (dense rate,
grouped GEMMs, MoE layer, precision, sync-free paths, NVML overhead, the CUDA-only tests), and the
parent's NVML sampler; :mod:`moebench.bench.gpu_check` runs them, each in a process of its own.

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k; N = T * K expert rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moebench.bench.moe_layer import LayerShape
from moebench.config import MoEConfig
from moebench.kernels import fp8, mxfp8
from moebench.kernels.groups import group_sizes
from moebench.kernels.quantized import precision_impl
from moebench.kernels.quantized_gemm import quantized_grouped_mm
from moebench.kernels.routing import sort_routes
from moebench.metrics.nvml import NvmlSampler, torch_device_uuids
from moebench.metrics.timer import time_calls
from moebench.model.moe import MoE
from moebench.model.precision import apply_expert_precision
from moebench.precision_modes import BF16_MODES, QUANT_MODES

# ---------------------------------------------------------------------------- timing


def _rate(flops: float, samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    return {"median_s": median, "tflops": flops / median / 1e12, "samples_s": samples}


def triton_usable(device: torch.device) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def random_offsets(shape: LayerShape, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Expert offsets of random top-k routing (what a balanced router produces)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    idx_TK = torch.rand(shape.tokens, shape.experts, generator=gen, device=device).topk(shape.top_k, dim=-1).indices
    return sort_routes(idx_TK, shape.experts)[2]


# ---------------------------------------------------------------------------- sections


def section_tests(ctx: dict[str, Any]) -> dict[str, Any]:
    if ctx["device"].type != "cuda":
        return {"skipped": "needs CUDA"}
    root = Path(__file__).resolve().parents[2]
    timeout = max(10, int(ctx["deadline"] - time.monotonic()))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                          cwd=root, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "output_tail": proc.stdout[-4000:],
            "ok": proc.returncode == 0}


def section_dense(ctx: dict[str, Any]) -> dict[str, Any]:
    s, device, dtype = ctx["shape"], ctx["device"], ctx["dtype"]
    x = torch.randn(s.rows, s.d_model, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(s.d_model, 3 * s.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(s.rows, 3 * s.hidden, device=device, dtype=dtype)

    def fwd() -> None:
        with torch.no_grad():
            x @ w

    def fwd_bwd() -> None:
        (x @ w).backward(grad)
        x.grad = w.grad = None

    reps = ctx["repeats"]
    out = {"fwd": _rate(s.expert_flops / 3, time_calls(fwd, device, 3, reps)),
           "fwd_bwd": _rate(s.expert_flops, time_calls(fwd_bwd, device, 3, reps))}
    ctx["dense_fwd_tflops"] = out["fwd"]["tflops"]
    ctx["dense_fwd_bwd_tflops"] = out["fwd_bwd"]["tflops"]
    return out


def _grouped_backends(device: torch.device) -> dict[str, Callable]:
    """Differentiable ``mm(a [N, K], b [E, K, M], offsets)`` per grouped GEMM implementation."""
    backends: dict[str, Callable] = {"torch": lambda a, b, offs: F.grouped_mm(a, b, offs=offs)}
    if triton_usable(device):
        from moebench.kernels.grouped_gemm import triton_grouped_mm  # imports triton (optional): only if usable

        backends["triton"] = triton_grouped_mm
    return backends


def section_grouped_gemm(ctx: dict[str, Any]) -> dict[str, Any]:
    s, device, dtype = ctx["shape"], ctx["device"], ctx["dtype"]
    offsets = random_offsets(s, device)
    a = torch.randn(s.rows, s.d_model, device=device, dtype=dtype, requires_grad=True)
    b = (torch.randn(s.experts, s.d_model, 2 * s.hidden, device=device, dtype=dtype) / s.d_model**0.5).requires_grad_()
    grad = torch.randn(s.rows, 2 * s.hidden, device=device, dtype=dtype)
    fwd_flops = 2 * s.rows * s.d_model * 2 * s.hidden
    sizes = group_sizes(offsets)
    out: dict[str, Any] = {"offsets_min_max": [int(sizes.min()), int(sizes.max())]}
    reference = None
    for name, mm in _grouped_backends(device).items():
        def fwd(mm: Callable = mm) -> torch.Tensor:
            with torch.no_grad():
                return mm(a, b, offsets)

        def fwd_bwd(mm: Callable = mm) -> None:
            mm(a, b, offsets).backward(grad)
            a.grad = b.grad = None

        result = fwd()
        if reference is None:
            reference = result.float()
        row = {"fwd": _rate(fwd_flops, time_calls(fwd, device, 3, ctx["repeats"])),
               "fwd_bwd": _rate(3 * fwd_flops, time_calls(fwd_bwd, device, 2, ctx["repeats"])),
               "max_rel_err_vs_torch": float((result.float() - reference).abs().max() / reference.abs().max())}
        row["fwd_vs_dense"] = row["fwd"]["tflops"] / ctx["dense_fwd_tflops"]
        out[name] = row
    if "triton" in out:
        out["triton_vs_torch_fwd"] = out["triton"]["fwd"]["tflops"] / out["torch"]["fwd"]["tflops"]
        out["triton_vs_torch_fwd_bwd"] = out["triton"]["fwd_bwd"]["tflops"] / out["torch"]["fwd_bwd"]["tflops"]
    else:
        out["triton"] = {"skipped": "needs CUDA (or TRITON_INTERPRET=1) and triton"}
    return out


def build_moe(shape: LayerShape, backend: str, device: torch.device, dtype: torch.dtype,
              precision: str = "bf16") -> MoE:
    """The MoE block as training builds it for ``moe.backend=backend``: its own dispatcher, the
    backend's expert GEMMs, ``precision``'s quantized GEMMs."""
    cfg = MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_hidden=shape.hidden, routing="random")
    cfg.backend = backend  # type: ignore[assignment]  # "triton" is registered by moebench.kernels.grouped_gemm
    torch.manual_seed(0)
    moe = MoE(shape.d_model, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=shape.d_model**-0.5)
    moe = moe.to(device=device, dtype=dtype)
    apply_expert_precision(moe, precision)
    return moe


def _moe_step(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        moe(x).backward(grad)
        moe.zero_grad(set_to_none=True)
        x.grad = None

    return step


def moe_cases(device: torch.device) -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {"grouped_mm": {"backend": "grouped_mm"}}
    if triton_usable(device):  # expert_backend("triton") imports the kernel module when asked for
        cases["triton"] = {"backend": "triton"}
    cases["fp8"] = {"backend": "grouped_mm", "precision": "fp8"}
    cases["mxfp8"] = {"backend": "grouped_mm", "precision": "mxfp8"}
    return cases


def section_moe_layer(ctx: dict[str, Any]) -> dict[str, Any]:
    s, device, dtype = ctx["shape"], ctx["device"], ctx["dtype"]
    x = torch.randn(s.tokens, s.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(s.tokens, s.d_model, device=device, dtype=dtype)
    out: dict[str, Any] = {"flops_convention": "expert GEMMs only, 6*T*K*3*D*H; router/permute/combine count against"}
    for name, spec in moe_cases(device).items():
        if time.monotonic() > ctx["deadline"]:
            out[name] = {"skipped": "time budget"}
            continue
        try:
            moe = build_moe(s, spec["backend"], device, dtype, spec.get("precision", "bf16"))
            row = _rate(s.expert_flops, time_calls(_moe_step(moe, x, grad), device, 3, ctx["repeats"]))
            row["precision_impl"] = precision_impl(spec.get("precision", "bf16"), device)
            row["vs_dense"] = row["tflops"] / ctx["dense_fwd_bwd_tflops"]
            out[name] = row
            del moe
        except Exception as exc:  # one failing case must not hide the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    for name in QUANT_MODES:
        if "tflops" in out.get(name, {}) and "tflops" in out.get("grouped_mm", {}):
            out[name]["vs_bf16"] = out[name]["tflops"] / out["grouped_mm"]["tflops"]
    return out


def _time_quantizer(out: dict[str, Any], name: str, x: torch.Tensor, moved: int, reference: Callable,
                    module: str, fn: str, ctx: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """GB/s of a quantizer's torch reference and (where Triton runs) its Triton twin, which must be
    bit-exact; returns the reference's ``(data, scales)``."""
    device = ctx["device"]
    ref = reference(x)
    if triton_usable(device):
        triton_fn = getattr(importlib.import_module(f"moebench.kernels.{module}"), fn)
        got = triton_fn(x)
        out[f"{name}_triton_bit_exact"] = all(torch.equal(g.view(torch.uint8), r.view(torch.uint8))
                                              for g, r in zip(got, ref, strict=True))
        samples = time_calls(lambda: triton_fn(x), device, 3, ctx["repeats"])
        out[f"{name}_triton_gbps"] = moved / statistics.median(samples) / 1e9
    samples = time_calls(lambda: reference(x), device, 2, ctx["repeats"])
    out[f"{name}_torch_gbps"] = moved / statistics.median(samples) / 1e9
    return ref


def section_precision(ctx: dict[str, Any]) -> dict[str, Any]:
    s, device, dtype = ctx["shape"], ctx["device"], ctx["dtype"]
    out: dict[str, Any] = {"precision_impl": {m: precision_impl(m, device) for m in BF16_MODES}}
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s.rows // 4, s.d_model, device=device, generator=gen).to(dtype)
    # bytes moved: read x, write the E4M3 data and the scales (one byte per 32 elements / fp32 per row)
    mx_bytes = x.numel() * x.element_size() + x.numel() // 32 * mxfp8.packed_row_bytes(32)
    fp8_bytes = x.numel() * (x.element_size() + 1) + x.shape[0] * 4
    ref = _time_quantizer(out, "mxfp8", x, mx_bytes, mxfp8.quantize, "mxfp8_triton", "quantize", ctx)
    _time_quantizer(out, "fp8", x, fp8_bytes, fp8.quantize_rowwise, "fp8_triton", "quantize_rowwise", ctx)
    out["mxfp8_rel_rms_err"] = float((mxfp8.dequantize(*ref) - x.float()).norm() / x.float().norm())
    a = torch.randn(s.rows, s.d_model, device=device, dtype=dtype)
    w = torch.randn(s.experts, s.d_model, 2 * s.hidden, device=device, dtype=dtype) / s.d_model**0.5
    grad = torch.randn(s.rows, 2 * s.hidden, device=device, dtype=dtype)
    cases = {"routed": random_offsets(s, device), "ragged": ragged_offsets(s, device)}
    out["offsets"] = {case: offsets_summary(offsets) for case, offsets in cases.items()}
    for fmt in QUANT_MODES:
        if out["precision_impl"][fmt] != "native":
            continue
        # the native kernels at the group sizes routing gives: any size, not multiples of 16
        # (torch's grouped fp8 GEMM asserts on the device for some operand layouts at such sizes,
        # which ends this section's process: the check then FAILs it alone)
        worst: dict[str, float] = {}
        for case, offsets in cases.items():
            runs = {}
            for impl in ("native", "emulated"):
                a_, w_ = a.clone().requires_grad_(), w.clone().requires_grad_()
                y = quantized_grouped_mm(a_, w_, offsets, fmt, impl)
                y.backward(grad)
                runs[impl] = (y.float(), a_.grad.float(), w_.grad.float())
            exact = F.grouped_mm(a, w, offs=offsets).float()
            errs = {what: float((got - want).norm() / want.norm()) for what, got, want
                    in zip(("out", "grad_a", "grad_w"), runs["native"], runs["emulated"], strict=True)}
            errs["native_vs_bf16"] = float((runs["native"][0] - exact).norm() / exact.norm())
            out[f"{fmt}_native_{case}"] = errs
            for what, err in errs.items():
                worst[what] = max(worst.get(what, 0.0), err)
        for what in ("out", "grad_a", "grad_w"):
            out[f"{fmt}_native_vs_emulated_{what}_rel_err"] = worst[what]  # the worst over the offset cases
        out[f"{fmt}_native_vs_bf16_rel_err"] = worst["native_vs_bf16"]
    return out


# group sizes of the ``ragged`` case, repeated over the experts (the last expert takes the rest):
# sizes torch's fp8 grouped GEMM needs in multiples of 16 for some layouts, an empty group, one
# row, 16 (aligned), and the precision probe's 5
RAGGED_SIZES = (5, 0, 37, 1, 16, 129, 3001, 2047)


def ragged_offsets(shape: LayerShape, device: torch.device) -> torch.Tensor:
    """Expert offsets with groups of :data:`RAGGED_SIZES` rows, as far as ``shape.rows`` allows."""
    sizes, used = [], 0
    for i in range(shape.experts - 1):
        size = RAGGED_SIZES[i % len(RAGGED_SIZES)]
        size = size if used + size <= shape.rows else 0
        sizes.append(size)
        used += size
    sizes.append(shape.rows - used)
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def offsets_summary(offsets: torch.Tensor) -> dict[str, Any]:
    """How ragged a case's groups are: all of them, those (but the last) not a multiple of 16, empty ones."""
    sizes = group_sizes(offsets).tolist()
    return {"groups": len(sizes), "unaligned_16": sum(1 for n in sizes[:-1] if n % 16),
            "empty": sizes.count(0), "min": min(sizes), "max": max(sizes)}


def section_sync_free(ctx: dict[str, Any]) -> dict[str, Any]:
    if ctx["device"].type != "cuda":
        return {"skipped": "needs CUDA"}
    s, device, dtype = ctx["shape"], ctx["device"], ctx["dtype"]
    small = dataclasses.replace(s, tokens=min(s.tokens, 4096))
    x = torch.randn(small.tokens, small.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    cases = moe_cases(device)  # the bf16, Triton and quantized (fp8 / mxfp8, native or emulated) paths
    cases["loop (control, must raise)"] = {"backend": "loop"}
    out: dict[str, Any] = {}
    for name, spec in cases.items():
        moe = build_moe(small, spec["backend"], device, dtype, spec.get("precision", "bf16"))
        step = _moe_step(moe, x, grad)
        step()  # warm up (Triton autotuning syncs) outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            out[name] = {"synced": False}
        except RuntimeError as exc:
            out[name] = {"synced": True, "error": str(exc).splitlines()[0][:300]}
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    out["ok"] = (not any(v["synced"] for k, v in out.items() if not k.startswith("loop"))
                 and out["loop (control, must raise)"]["synced"])
    return out


def sampler_overhead(step: Callable[[], None], make_sampler: Callable[[], Any], device: torch.device,
                     rounds: int = 5, steps: int = 10) -> dict[str, Any]:
    """Step time with one more sampler polling vs without, in interleaved rounds (so drift hits
    both arms alike); ``overhead`` = median on / median off - 1."""
    off: list[float] = []
    on: list[float] = []
    for _ in range(rounds):
        off += time_calls(step, device, 1, steps)
        sampler = make_sampler().start()
        try:
            on += time_calls(step, device, 1, steps)
        finally:
            sampler.stop()
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"off_median_s": off_s, "on_median_s": on_s, "overhead": on_s / off_s - 1,
            "samples_off_s": off, "samples_on_s": on}


def section_nvml_overhead(ctx: dict[str, Any]) -> dict[str, Any]:
    """What the trainer's NVML sampler (its default interval) costs a MoE training step."""
    device = ctx["device"]
    if device.type != "cuda":
        return {"skipped": "needs CUDA and NVML"}
    if not NvmlSampler.for_torch_device(device).available:
        return {"skipped": "needs CUDA and NVML"}

    s = dataclasses.replace(ctx["shape"], tokens=min(ctx["shape"].tokens, 4096))
    x = torch.randn(s.tokens, s.d_model, device=device, dtype=ctx["dtype"], requires_grad=True)
    step = _moe_step(build_moe(s, "grouped_mm", device, ctx["dtype"]), x, torch.randn_like(x))
    out = sampler_overhead(step, lambda: NvmlSampler.for_torch_device(device), device)
    out["interval_s"] = NvmlSampler.for_torch_device(device).interval_s
    return out


def start_nvml(device: torch.device) -> Any | None:
    """The parent's NVML sampler over every section (its window: energy, SM clock and throttle
    reasons from the first section to the last); None without CUDA or NVML."""
    if device.type != "cuda" or importlib.util.find_spec("moebench.metrics.nvml") is None:
        return None
    sampler = NvmlSampler(torch_device_uuids([device.index or 0]), interval_s=0.05)
    if not sampler.available:
        return None
    sampler.start()
    sampler.window_start()
    return sampler


def stop_nvml(sampler: Any | None) -> dict[str, Any]:
    """The ``nvml`` section's result: the sampler's record fields over the whole check."""
    if sampler is None:
        return {"skipped": "needs CUDA and NVML"}
    sampler.window_end()
    return sampler.stop()
