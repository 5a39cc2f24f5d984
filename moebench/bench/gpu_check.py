"""The GPU check: one command that anyone with a CUDA GPU runs (``scripts/gpu_check.sh OUT_DIR``).

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k; N = T * K expert rows.

Each section runs in a process of its own (``--section NAME``), in the priority order and with
the time budget of :data:`SECTIONS` as a hard timeout, so a device-side assert (which poisons a
CUDA context for good), a hang or a crash costs that section alone; results are rewritten to
``OUT_DIR/gpu_check.json`` after every section, so a timeout of the whole keeps what finished.
Each section gets a verdict (:func:`section_verdict`): PASS, FAIL (a wrong result, a crash, a
timeout), WARN (a speed target missed) or SKIP; the check exits 1 when any section FAILs.
``--plugin MODULE`` appends a module's own ``SECTIONS`` (the tests use it for a crashing one).

Sections, in priority order (:data:`SECTIONS`):

1. ``dense``: the dense bf16 matmul rate measured in this run: ``[N, D] @ [D, 3H]`` forward and
   forward+backward, the same FLOPs as the MoE layer's expert GEMMs; doubles as the MFU
   plausibility check: the rate must lie within :data:`PLAUSIBLE_DENSE_SHARE` of the device
   table's bf16 peak.
2. ``precision``: the Triton MXFP8 and FP8 rowwise quantizers vs their torch references on the
   device (bit-exact), the bandwidth of each and of its reference, and for each format that runs
   natively (fp8, mxfp8) the native vs emulated error of a grouped GEMM's output and both
   gradients, and its error against the bf16 product, at routed and ragged group sizes (not
   multiples of 16, empty groups).
3. ``sync_free``: MoE forward+backward under ``torch.cuda.set_sync_debug_mode("error")`` for the
   device-resident paths; the ``loop`` backend (which reads offsets on the host) is the
   positive control that must raise.
4. ``learning``, 5. ``scope_linear``, 6. ``phase_clock``, 7. ``triton_training``: ``moebench
   train`` runs that check training (:mod:`moebench.bench.training_runs`): markov data at the
   default lr must end 5% below the lr=0 run, which is the negative control; fp8 with
   ``precision.scope=linear`` trains; a profiled step's phases partition it; ``moe.backend=triton``
   through the trainer trains and is recorded as triton.
8. ``moe_layer``: MoE layer forward+backward TFLOP/s (expert GEMM FLOPs ``6 N 3 D H``; router,
   permute and combine count against it) for: grouped_mm, triton (as ``moe.backend=triton``
   trains: the block's own dispatcher, Triton expert GEMMs), and the fp8 / mxfp8 expert
   precisions, each with its ``precision_impl``; ratios to the dense rate.
9. ``tests``: the CUDA-only tests (``pytest -m gpu``).
10. ``training``: ``moebench train --preset small`` compiled vs eager (``train.compile``), in bf16
    and fp8, on markov data, each in its own process: tokens/s, MFU, compile time, compiled /
    eager and fp8 / bf16 ratios, and the compiled run's final-loss change.
11. ``grouped_gemm``: torch's grouped GEMM vs the Triton one (forward, and forward+backward),
    one ``[N, D] @ [E, D, 2H]`` GEMM with random routing.
12. ``nvml_overhead``: MoE steps with one more NVML sampler (the trainer's interval) polling vs
    without, interleaved rounds; the target is under 1% slower.
13. ``layouts`` (only with ``--ranks N``, N GPUs): fsdp, ddp with EP sync and row-wise, the
    distributed optimizer and a 2-stage pipeline on N ranks against one process, losses and
    tokens/s (:mod:`moebench.bench.layout_parity`).

The parent also samples NVML (:mod:`moebench.metrics.nvml`) around all of them (``nvml``).

Targets (H200, T=16384 D=2048 H=1024 E=64 K=8, bf16): MoE layer >= 0.8 of the dense rate;
Triton grouped GEMM >= 0.9 of torch's; a compiled run's final loss within 1% of the eager one's
(bf16 rounding only). ``--small --device cpu`` runs the CPU-safe parts on toy shapes and the
training runs on ``tiny`` (used by the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moebench.bench.layout_parity import check_ranks, layout_rows, section_layouts
from moebench.bench.moe_layer import LayerShape
from moebench.bench.training_runs import (
    LEARN_MIN_DROP,
    RUNS,
    run_name,
    section_learning,
    section_phase_clock,
    section_scope_linear,
    section_training,
    section_triton_training,
)
from moebench.config import MoEConfig
from moebench.kernels import fp8, mxfp8
from moebench.kernels.groups import group_sizes
from moebench.kernels.quantized import precision_impl
from moebench.kernels.quantized_gemm import quantized_grouped_mm
from moebench.kernels.routing import sort_routes
from moebench.launch.tree import run_process
from moebench.metrics.flops import gpu_peak_flops
from moebench.metrics.nvml import NvmlSampler, torch_device_uuids
from moebench.metrics.timer import time_calls
from moebench.model.moe import MoE
from moebench.model.precision import apply_expert_precision

BUDGET_S = 540.0  # stay inside 9.5 minutes (scripts/gpu_check.sh) with margin for start-up and the table


TARGET = LayerShape(tokens=16384, d_model=2048, hidden=1024, experts=64, top_k=8)  # the H200 target shape
SMALL = LayerShape(tokens=64, d_model=64, hidden=32, experts=4, top_k=2)


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
    for name in ("fp8", "mxfp8"):
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
    out: dict[str, Any] = {"precision_impl": {m: precision_impl(m, device) for m in ("bf16", "fp8", "mxfp8")}}
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
    for fmt in ("fp8", "mxfp8"):
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


# ---------------------------------------------------------------------------- report


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, value, target/status) rows of the final table."""
    sec = results["sections"]
    rows: list[tuple[str, str, str]] = []

    def get(*keys: str) -> Any:
        node: Any = sec
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    def fmt(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    def verdict(v: float | None, target: float) -> str:
        return "n/a" if v is None else ("PASS" if v >= target else "FAIL") + f" (>= {target})"

    tests = get("tests", "summary")
    rows.append(("cuda tests", tests or str(get("tests", "skipped") or get("tests", "error")), ""))
    rows.append((f"dense {results.get('dtype', 'bf16')} fwd+bwd TFLOP/s", fmt(get("dense", "fwd_bwd", "tflops")), ""))
    rows.append(("grouped fwd torch TFLOP/s", fmt(get("grouped_gemm", "torch", "fwd", "tflops")), ""))
    rows.append(("grouped fwd triton TFLOP/s", fmt(get("grouped_gemm", "triton", "fwd", "tflops")), ""))
    ratio = get("grouped_gemm", "triton_vs_torch_fwd_bwd")
    rows.append(("triton / torch (fwd+bwd)", fmt(ratio, ".2f"), verdict(ratio, 0.9)))
    for name in ("grouped_mm", "triton", "fp8", "mxfp8"):
        row = get("moe_layer", name) or {}
        if "tflops" in row:
            impl = f" [{row['precision_impl']}]" if name in ("fp8", "mxfp8") else ""
            target = verdict(row["vs_dense"], 0.8) if name in ("grouped_mm", "triton") else \
                f"{row.get('vs_bf16', float('nan')):.2f}x bf16"
            value = f"{row['tflops']:.1f} ({row['vs_dense']:.2f} dense)"
            rows.append((f"moe layer {name}{impl} TFLOP/s", value, target))
        else:
            rows.append((f"moe layer {name}", str(row.get("error") or row.get("skipped") or "-")[:60], ""))
    sync_ok = get("sync_free", "ok")
    rows.append(("sync-free routing", "-" if sync_ok is None else str(sync_ok), "PASS" if sync_ok else
                 ("n/a" if sync_ok is None else "FAIL")))
    rows.append(("mxfp8 triton bit-exact", str(get("precision", "mxfp8_triton_bit_exact")), ""))
    rows.append(("fp8 rowwise triton bit-exact", str(get("precision", "fp8_triton_bit_exact")), ""))
    ragged = [get("precision", "offsets", case) for case in ("routed", "ragged")]
    if all(ragged):
        rows.append(("quantized GEMM groups not a multiple of 16 (routed, ragged)",
                     ", ".join(f"{r['unaligned_16']}/{r['groups']}" for r in ragged), ""))
    for fmt in ("fp8", "mxfp8"):
        errs = [get("precision", f"{fmt}_native_vs_emulated_{what}_rel_err") for what in ("out", "grad_a", "grad_w")]
        if all(e is not None for e in errs):  # only where the format ran natively
            rows.append((f"{fmt} native vs emulated rel err (out/dA/dW)", "/".join(f"{e:.1e}" for e in errs),
                         "PASS" if max(errs) < 1e-2 else "FAIL (< 1e-2)"))
    rows += training_check_rows(sec)
    for precision, compiled in RUNS:
        name = run_name(precision, compiled)
        run = get("training", name) or {}
        if "tokens_per_s" in run:
            compile_s = f", compile {run['compile_s']:.0f} s" if run.get("compile_s") is not None else ""
            mfu = f", MFU {100 * run['mfu']:.1f}%" if run.get("mfu") is not None else ""
            rows.append((f"train {name} [{run['moe_backend']}, {run['precision_impl']}] tok/s",
                         f"{run['tokens_per_s']:,.0f}{mfu}{compile_s}", ""))
        elif run:
            rows.append((f"train {name}", str(run.get("error") or run.get("skipped"))[:60], ""))
    for precision in ("bf16", "fp8"):
        ratio = get("training", f"{precision}_compiled_vs_eager")
        loss = get("training", f"{precision}_compiled_loss_rel_diff")
        if ratio is not None:
            rows.append((f"train {precision} compiled / eager tok/s (loss change)", f"{ratio:.2f}x ({loss:.1e})",
                         ("PASS" if loss < 1e-2 else "FAIL") + " (loss < 1e-2)"))
    for mode in ("eager", "compiled"):
        ratio = get("training", f"fp8_vs_bf16_{mode}")
        if ratio is not None:
            rows.append((f"train fp8 / bf16 tok/s ({mode})", f"{ratio:.2f}x", ""))
    rows += layout_rows(sec["layouts"]) if isinstance(sec.get("layouts"), dict) and "ranks" in sec["layouts"] else []
    overhead = get("nvml_overhead", "overhead")
    rows.append(("nvml sampler overhead (A/B)", "-" if overhead is None else f"{100 * overhead:+.2f}%",
                 "n/a" if overhead is None else ("PASS" if overhead < 0.01 else "FAIL") + " (< 1%)"))
    peak, energy = get("nvml", "nvml_peak_mem_used_bytes"), get("nvml", "nvml_energy_j")
    reasons = get("nvml", "nvml_throttle_reasons")
    rows.append(("nvml peak mem GiB / energy kJ / throttle reasons",
                 "-" if peak is None else f"{peak / 2**30:.1f} / {'-' if energy is None else f'{energy / 1e3:.1f}'} / "
                 f"{','.join(reasons) if reasons else 'none'}", ""))
    return rows


def _loss(run: dict[str, Any]) -> str:
    return f"{run.get('loss_first', float('nan')):.3f} -> {run.get('loss_last', float('nan')):.3f}"


def training_check_rows(sec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows of the sections that check a ``moebench train`` run: learning, scope_linear,
    triton_training, phase_clock (a run that did not finish shows why)."""
    rows: list[tuple[str, str, str]] = []
    learning = sec.get("learning") or {}
    trained, control = learning.get("default_lr") or {}, learning.get("control_lr0") or {}
    if "loss_last" in trained and "loss_last" in control:
        rows.append(("learning: markov loss default lr | lr=0", f"{_loss(trained)} | {_loss(control)}",
                     f"default lr >= {LEARN_MIN_DROP:.0%} below lr=0; lr=0 not {LEARN_MIN_DROP:.0%} below its start"))
    for name, label in (("scope_linear", "scope=linear fp8"), ("triton_training", "moe.backend=triton")):
        run = sec.get(name) or {}
        if "loss_last" in run:
            rows.append((f"{label} [{run['moe_backend']}, {run['precision_impl']}] markov loss", _loss(run),
                         f">= {LEARN_MIN_DROP:.0%} below the {run['baseline']}"))
        elif run:
            rows.append((label, str(run.get("error") or run.get("skipped"))[:60], ""))
    clock = sec.get("phase_clock") or {}
    phases = clock.get("time_breakdown_s")
    if phases and clock.get("profiled_step_s"):
        wall = clock["profiled_step_s"]
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:3]
        rows.append(("phase clock: profiled step ms (top phases)",
                     f"{1e3 * wall:.1f} (" + ", ".join(f"{p} {v / wall:.0%}" for p, v in top) + ")",
                     f"phases sum to the step; x{clock['breakdown_scale']:.2f} to a timed one"))
    elif clock:
        rows.append(("phase clock", str(clock.get("error") or clock.get("skipped") or clock.get("why"))[:60], ""))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>{vwidth}}  {c}" for a, b, c in rows)


def _write(out_dir: Path, results: dict[str, Any]) -> None:
    path = out_dir / "gpu_check.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


SectionFn = Callable[[dict[str, Any]], dict[str, Any]]

# (name, function, budget in seconds), in priority order: the dense rate first (later sections
# compare against it), then what catches wrong results (numerics, syncs, training that trains,
# the phase clock, the kernels' own tests), then speed; the budgets sum to BUDGET_S. Each section
# runs in a process of its own with its budget as a hard timeout, so a device-side assert, a hang
# or a crash costs that section alone. The budgets are estimates for one H200 (a section's
# `wall_s` in the JSON says what it took): a ``moebench train`` run is about 10-20 s of start-up
# and a compiled one adds its compile time.
SECTIONS: list[tuple[str, SectionFn, float]] = [
    ("dense", section_dense, 25),
    ("precision", section_precision, 45),
    ("sync_free", section_sync_free, 35),
    ("learning", section_learning, 60),
    ("scope_linear", section_scope_linear, 40),
    ("phase_clock", section_phase_clock, 35),
    ("triton_training", section_triton_training, 50),
    ("moe_layer", section_moe_layer, 45),
    ("tests", section_tests, 60),
    ("training", section_training, 105),
    ("grouped_gemm", section_grouped_gemm, 25),
    ("nvml_overhead", section_nvml_overhead, 15),
]
MIN_SECTION_S = 10.0  # a section that would get less than this is skipped ("time budget")
# what a section's process may spend starting (python, torch, a CUDA context) beyond its budget
# before it is killed; the whole check still stops at BUDGET_S
START_ALLOWANCE_S = 30.0
# the dense fwd+bwd rate as a share of the device's datasheet peak (MFU plausibility): above the
# peak the FLOP count, the peak or the clock is wrong; below 30% the GEMM did not run on the tensor
# cores at full clock (a wrong dtype or layout, a throttled or shared GPU) and every ratio to it
# is suspect (moebench.devices has the peaks)
PLAUSIBLE_DENSE_SHARE = (0.3, 1.0)


# with --ranks N: the multi-GPU layout check, after the single-GPU sections
LAYOUT_SECTION: tuple[str, SectionFn, float] = ("layouts", section_layouts, 180)


def all_sections(plugin: str | None, ranks: int | None = None) -> list[tuple[str, SectionFn, float]]:
    """The built-in sections (and the layout check with ``ranks``), then ``plugin``'s (a module
    with a ``SECTIONS`` list of the same shape)."""
    own = [*SECTIONS, *([LAYOUT_SECTION] if ranks else [])]
    if plugin is None:
        return own
    return [*own, *importlib.import_module(plugin).SECTIONS]


def _passes(ok: bool | None, why: str) -> tuple[str, str]:
    return ("PASS", "") if ok else ("FAIL", why)


def section_verdict(name: str, result: dict[str, Any], device_peak: float | None = None) -> tuple[str, str]:
    """``(PASS | FAIL | WARN | SKIP, why)`` of one section's result. FAIL is a wrong result, a
    crash or a timeout; WARN a speed target missed (it does not fail the check); SKIP a section
    that did not apply here or had no time left."""
    if "skipped" in result:
        return "SKIP", str(result["skipped"])
    if "error" in result:
        return "FAIL", str(result["error"])[:200]
    if name == "tests":
        return _passes(result.get("ok"), f"pytest -m gpu: {result.get('summary')}")
    if name == "dense":
        tflops = (result.get("fwd_bwd") or {}).get("tflops")
        if device_peak and tflops:
            share = tflops * 1e12 / device_peak
            lo, hi = PLAUSIBLE_DENSE_SHARE
            return _passes(lo <= share <= hi, f"dense rate {share:.2f} of the datasheet peak, outside [{lo}, {hi}]")
        return _passes(tflops is not None and tflops > 0, "no dense rate")
    if name == "precision":
        bad = [k for k, v in result.items() if k.endswith("_bit_exact") and v is False]
        bad += [f"{k} {v:.1e}" for k, v in result.items() if "_native_vs_emulated_" in k and v >= 1e-2]
        return _passes(not bad, ", ".join(bad))
    if name == "sync_free":
        return _passes(result.get("ok"), "a device-resident path synced, or the loop control did not")
    if name == "moe_layer":
        errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
        if errors:
            return "FAIL", f"cases failed: {', '.join(errors)}"
        slow = [k for k in ("grouped_mm", "triton") if (result.get(k) or {}).get("vs_dense", 1.0) < 0.8]
        return ("WARN", f"below 0.8 of the dense rate: {', '.join(slow)}") if slow else ("PASS", "")
    if name == "training":
        errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
        drift = [k for k, v in result.items() if k.endswith("_compiled_loss_rel_diff") and v >= 1e-2]
        return _passes(not errors and not drift, f"runs failed: {errors}; compiled loss off by >= 1%: {drift}")
    if name == "layouts":
        return _passes(result.get("ok"), f"layouts failed or did not run: {result.get('failed') or 'see the table'}")
    if name == "grouped_gemm":
        ratio = result.get("triton_vs_torch_fwd_bwd")
        return ("WARN", f"triton / torch {ratio:.2f} < 0.9") if ratio is not None and ratio < 0.9 else ("PASS", "")
    if name == "nvml":
        if result.get("nvml_peak_mem_used_bytes") is None:
            return "FAIL", "NVML gave no memory reading"
        if result.get("throttled"):
            return "WARN", f"throttled: {', '.join(result.get('nvml_throttle_reasons') or [])} (speed rows suspect)"
        if result.get("nvml_energy_j") is None:
            return "WARN", "NVML reports no energy counter"
        return "PASS", ""
    if name == "nvml_overhead":
        over = result.get("overhead")
        return ("WARN", f"sampler overhead {over:+.1%}") if over is not None and over >= 0.01 else ("PASS", "")
    if name == "phase_clock" and result.get("ok") and result.get("breakdown_representative") is False:
        return "WARN", f"the profiled step is {1 / result['breakdown_scale']:.2f}x a timed one (phase marks sync)"
    return _passes(result.get("ok", True), str(result.get("why", "section reported ok=false"))[:300])


def run_section(name: str, out_dir: Path, argv: list[str], timeout_s: float,
                allowance_s: float = START_ALLOWANCE_S) -> dict[str, Any]:
    """Section ``name`` in a child process (``argv`` are this check's own options), killed after
    ``timeout_s`` and ``allowance_s`` to start; its result, or why none came."""
    folder = out_dir / "sections"
    folder.mkdir(parents=True, exist_ok=True)
    result_path, log_path = folder / f"{name}.json", folder / f"{name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "moebench.bench.gpu_check", str(out_dir), "--section", name,
           "--section-timeout", f"{timeout_s:.0f}", *argv]
    log_path.unlink(missing_ok=True)
    # its own process group, killed whole on a timeout: a training section's `moebench train` too
    outcome = run_process(cmd, log_path, timeout_s + allowance_s)
    if result_path.exists():
        return json.loads(result_path.read_text())
    code = outcome.returncode
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
    if outcome.timed_out:
        return {"error": f"timed out: its budget of {timeout_s:.0f} s and {allowance_s:.0f} s to start "
                         f"(log: {log_path})"}
    return {"error": f"section process exited {code} with no result: {tail[0][:300]} (log: {log_path})"}


def _child(args: argparse.Namespace, ctx: dict[str, Any]) -> int:
    """``--section NAME``: run that one section here and write its result (the parent reads it)."""
    sections = {n: fn for n, fn, _ in all_sections(args.plugin, args.ranks)}
    ctx["deadline"] = time.monotonic() + args.section_timeout - 5
    ctx.update(json.loads(args.context or "{}"))
    t0 = time.monotonic()
    try:
        result = sections[args.section](ctx)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-3000:]}
    result["wall_s"] = time.monotonic() - t0
    folder = args.out_dir / "sections"
    tmp = folder / f"{args.section}.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(folder / f"{args.section}.json")
    return 0


def section_context(sections: dict[str, Any]) -> dict[str, Any]:
    """What the parent hands every later section from the earlier ones' results: the dense rates
    (the MoE layer's and grouped GEMM's ratios) and the lr=0 control's final loss (the baseline of
    the markov runs that check learning)."""
    dense = sections.get("dense", {})
    control = (sections.get("learning") or {}).get("control_lr0") or {}
    return {"dense_fwd_tflops": (dense.get("fwd") or {}).get("tflops", float("nan")),
            "dense_fwd_bwd_tflops": (dense.get("fwd_bwd") or {}).get("tflops", float("nan")),
            "markov_control_loss": control.get("loss_last")}


def verdict_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(section, verdict, why) rows, in the order the sections ran."""
    return [(name, v["verdict"], v["why"]) for name, v in results["verdicts"].items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moebench gpu-check",
        description="CUDA tests, grouped GEMM and MoE layer rates vs the dense matmul, fp8/mxfp8 vs bf16, "
                    "sync-free routing, training that trains, and NVML; each section in its own process; "
                    "writes OUT_DIR/gpu_check.json, prints a verdict per section last; exit 1 if any FAILs.")
    parser.add_argument("out_dir", type=Path, help="folder for gpu_check.json")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="toy shapes (CPU smoke test)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--ranks", type=int, default=None,
                        help="also check every parallel layout on this many GPUs against one (even, 2-8)")
    parser.add_argument("--plugin", default=None, help="a module whose SECTIONS run after the built-in ones")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: run this one section
    parser.add_argument("--section-timeout", type=float, default=BUDGET_S, help=argparse.SUPPRESS)
    parser.add_argument("--context", default=None, help=argparse.SUPPRESS)
    # what a section's process may spend starting; the orchestration test shortens it
    parser.add_argument("--start-allowance", type=float, default=START_ALLOWANCE_S, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks is not None:
        try:
            check_ranks(args.ranks)
        except ValueError as exc:
            parser.error(str(exc))

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shape = SMALL if args.small else TARGET
    ctx: dict[str, Any] = {
        "device": device, "shape": shape, "repeats": args.repeats, "small": args.small,
        "dtype": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "dense_fwd_tflops": float("nan"), "dense_fwd_bwd_tflops": float("nan"),
        "ranks": args.ranks,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.section is not None:
        return _child(args, ctx)
    deadline = time.monotonic() + BUDGET_S
    results: dict[str, Any] = {
        "schema_version": 2,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "shape": asdict(shape), "dtype": str(ctx["dtype"]).removeprefix("torch."),
        "sections": {}, "verdicts": {},
    }
    # the datasheet peak the dense rate must be plausible against (none on CPU: its peak is itself measured)
    peak = gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    skip = {s for s in args.skip.split(",") if s}
    sampler = start_nvml(device) if "nvml" not in skip else None
    child_argv = ["--device", device.type, "--repeats", str(args.repeats), *(["--small"] if args.small else []),
                  *(["--plugin", args.plugin] if args.plugin else []),
                  *(["--ranks", str(args.ranks)] if args.ranks else [])]
    for name, _, budget in all_sections(args.plugin, args.ranks):
        left = deadline - time.monotonic()
        if name in skip:
            result: dict[str, Any] = {"skipped": "--skip"}
        elif left - args.start_allowance < MIN_SECTION_S:
            result = {"skipped": "time budget"}
        else:
            context = section_context(results["sections"])
            result = run_section(name, args.out_dir, [*child_argv, "--context", json.dumps(context)],
                                 min(budget, left - args.start_allowance), args.start_allowance)
        results["sections"][name] = result
        verdict, why = section_verdict(name, result, peak)
        results["verdicts"][name] = {"verdict": verdict, "why": why}
        _write(args.out_dir, results)
    results["sections"]["nvml"] = {"skipped": "--skip"} if "nvml" in skip else stop_nvml(sampler)
    verdict, why = section_verdict("nvml", results["sections"]["nvml"])
    results["verdicts"]["nvml"] = {"verdict": verdict, "why": why}
    failed = [n for n, v in results["verdicts"].items() if v["verdict"] == "FAIL"]
    results["verdict"] = "FAIL" if failed else "PASS"
    _write(args.out_dir, results)
    print(f"gpu check: {results['device']} ({results['dtype']}, T={shape.tokens} D={shape.d_model} "
          f"H={shape.hidden} E={shape.experts} K={shape.top_k}); full results in {args.out_dir / 'gpu_check.json'}")
    print(format_table(summary_rows(results)))
    print()
    print(format_table(verdict_rows(results)))
    print(f"gpu check {results['verdict']}" + (f": {len(failed)} section(s) failed ({', '.join(failed)})"
                                               if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
