"""MoE layer forward+backward throughput as a ratio to a dense matmul of the same FLOPs.

Every implementation and the dense reference are timed *interleaved* in one process
(round r times each of them once), so drift on a shared machine hits all of them alike.
The figure of merit is ``median dense time / median implementation time`` at equal
FLOPs: the share of the dense matmul rate the MoE layer reaches.

FLOPs counted: the expert GEMMs only, ``6 * T * K * 3 * D * H`` (forward + backward).
The router, permutation and combine are *work the MoE layer must do on top*, so they
count against it, never for it.

Rows: ``dense_matmul`` (the reference), ``dense_swiglu_mlp`` (same FLOPs with the SwiGLU),
``expert_gemms`` (the six GEMMs of every expert's forward and backward alone, one expert at a
time over equal groups: no router, gather, activation or combine, so the most any per-expert
implementation can reach at this shape), ``moe_grouped_mm`` / ``moe_cpu_fused`` /
``moe_loop_backend`` (the MoE block with that expert backend; ``cpu_fused`` also fuses the local
dispatch and combine on CPU) and ``moe_masked_loop`` (the per-expert mask/gather/index_add style
many implementations use).

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moebench.config import MoEConfig
from moebench.kernels.swiglu import swiglu
from moebench.metrics.timer import time_call
from moebench.model.moe import MoE
from moebench.model.reference import masked_expert_loop

CPU = torch.device("cpu")  # the layer benchmark runs on CPU tensors
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # `moebench bench moe-layer --dtype`


@dataclass
class LayerShape:
    tokens: int = 4096
    d_model: int = 512
    hidden: int = 512
    experts: int = 64
    top_k: int = 8

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def expert_flops(self) -> int:
        """Forward+backward FLOPs of the two expert GEMMs (gate+up fused, then down)."""
        return 6 * self.rows * 3 * self.d_model * self.hidden


def _moe_case(shape: LayerShape, backend: str, dtype: torch.dtype) -> Callable[[], None]:
    cfg = MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_hidden=shape.hidden, backend=backend)
    moe = MoE(shape.d_model, cfg).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=shape.d_model**-0.5)
    x_TD = torch.randn(shape.tokens, shape.d_model, dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(shape.tokens, shape.d_model, dtype=dtype)

    def run() -> None:
        moe(x_TD).backward(grad_TD)
        moe.zero_grad(set_to_none=True)
        x_TD.grad = None

    return run


def _masked_loop_case(shape: LayerShape, dtype: torch.dtype) -> Callable[[], None]:
    moe = MoE(shape.d_model, MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_hidden=shape.hidden))
    moe = moe.to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=shape.d_model**-0.5)
    x_TD = torch.randn(shape.tokens, shape.d_model, dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(shape.tokens, shape.d_model, dtype=dtype)

    def run() -> None:
        routing = moe.router(x_TD)
        out = masked_expert_loop(x_TD, routing.idx_TK, routing.weight_TK, moe.experts.w13, moe.experts.w2)
        out.backward(grad_TD)
        moe.zero_grad(set_to_none=True)
        x_TD.grad = None

    return run


def _expert_gemms_case(shape: LayerShape, dtype: torch.dtype) -> Callable[[], None]:
    """Each expert's forward (``x @ w13``, ``act @ w2``) and backward (``g @ w2^T``, ``act^T @ g``,
    ``x^T @ grad_h``, ``grad_h @ w13^T``) GEMMs on its own weights, written into preallocated
    buffers, over groups of ``T*K/E`` rows (the remainder spread one row each)."""
    d, h, e = shape.d_model, shape.hidden, shape.experts
    sizes = [shape.rows // e + (i < shape.rows % e) for i in range(e)]
    starts = [sum(sizes[:i]) for i in range(e)]
    w13, w2 = torch.randn(e, d, 2 * h, dtype=dtype), torch.randn(e, h, d, dtype=dtype)
    grad_w13, grad_w2 = torch.empty_like(w13), torch.empty_like(w2)
    x, g = torch.randn(shape.rows, d, dtype=dtype), torch.randn(shape.rows, d, dtype=dtype)
    h_N2H, act = torch.randn(shape.rows, 2 * h, dtype=dtype), torch.randn(shape.rows, h, dtype=dtype)
    y, grad_x, grad_act = torch.empty_like(x), torch.empty_like(x), torch.empty_like(act)

    def run() -> None:
        for i, (a, m) in enumerate(zip(starts, sizes, strict=True)):
            rows = slice(a, a + m)
            torch.mm(x[rows], w13[i], out=h_N2H[rows])
            torch.mm(act[rows], w2[i], out=y[rows])
            torch.mm(g[rows], w2[i].t(), out=grad_act[rows])
            torch.mm(act[rows].t(), g[rows], out=grad_w2[i])
            torch.mm(x[rows].t(), h_N2H[rows], out=grad_w13[i])
            torch.mm(h_N2H[rows], w13[i].t(), out=grad_x[rows])

    return run


def _dense_case(shape: LayerShape, dtype: torch.dtype, with_swiglu: bool) -> Callable[[], None]:
    rows = shape.tokens * shape.top_k
    x = torch.randn(rows, shape.d_model, dtype=dtype, requires_grad=True)
    if not with_swiglu:  # one matmul with the expert FLOPs: [T*K, D] @ [D, 3H]
        w = torch.randn(shape.d_model, 3 * shape.hidden, dtype=dtype, requires_grad=True)
        grad = torch.randn(rows, 3 * shape.hidden, dtype=dtype)

        def run() -> None:
            (x @ w).backward(grad)
            x.grad = w.grad = None

        return run
    w13 = torch.randn(shape.d_model, 2 * shape.hidden, dtype=dtype, requires_grad=True)
    w2 = torch.randn(shape.hidden, shape.d_model, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, shape.d_model, dtype=dtype)

    def run_mlp() -> None:
        (swiglu(x @ w13) @ w2).backward(grad)
        x.grad = w13.grad = w2.grad = None

    return run_mlp


def run_benchmark(shape: LayerShape, repeats: int = 7, warmup: int = 2, dtype: torch.dtype = torch.float32,
                  include_loop: bool = True) -> dict:
    """Time every case interleaved; return raw samples and ratios to the dense matmul."""
    torch.manual_seed(0)
    cases: dict[str, Callable[[], None]] = {
        "dense_matmul": _dense_case(shape, dtype, with_swiglu=False),
        "dense_swiglu_mlp": _dense_case(shape, dtype, with_swiglu=True),
        "expert_gemms": _expert_gemms_case(shape, dtype),
        "moe_grouped_mm": _moe_case(shape, "grouped_mm", dtype),
        "moe_cpu_fused": _moe_case(shape, "cpu_fused", dtype),
        "moe_masked_loop": _masked_loop_case(shape, dtype),
    }
    if include_loop:
        cases["moe_loop_backend"] = _moe_case(shape, "loop", dtype)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(warmup + repeats):
        for name, fn in cases.items():
            elapsed = time_call(fn, CPU)
            if round_ >= warmup:
                samples[name].append(elapsed)
    dense = statistics.median(samples["dense_matmul"])
    rows = {}
    for name, times in samples.items():
        median = statistics.median(times)
        rows[name] = {
            "median_s": median,
            "gflops": shape.expert_flops / median / 1e9,
            "ratio_to_dense": dense / median,
            "samples_s": times,
        }
    return {
        "shape": vars(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "expert_flops": shape.expert_flops,
        "flops_convention": "expert GEMMs only, 6*T*K*3*D*H; router/permute/combine count against the MoE",
        "results": rows,
    }


def format_table(result: dict) -> list[str]:
    lines = [f"{'case':20s} {'median ms':>10s} {'GFLOP/s':>9s} {'vs dense':>9s}"]
    for name, row in result["results"].items():
        lines.append(f"{name:20s} {row['median_s'] * 1e3:10.1f} {row['gflops']:9.1f} {row['ratio_to_dense']:9.2f}")
    return lines

