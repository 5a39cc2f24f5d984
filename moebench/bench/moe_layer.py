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

Precision: the MoE rows run what training runs. In fp32 everything is fp32. In bf16 they run as
``precision.mode=bf16`` trains: fp32 master weights, fp32 rows in and gradients out, the block
under bf16 autocast, so each backend casts as it does in a training step (``cpu_fused`` one
expert's weights at a time inside its kernel, the others the whole stack per call) and the weight
gradients come back fp32. The reference rows (``dense_matmul``, ``dense_swiglu_mlp``,
``expert_gemms``) are plain bf16 GEMMs: the hardware rate the layer is measured against. One
extra row, ``moe_cpu_fused_block_bf16`` (bf16 only), keeps the form this benchmark used before:
the whole block cast to bf16 (bf16 weights and weight gradients, no per-step cast), which no
training run computes.

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k.
"""

from __future__ import annotations

import contextlib
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
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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


Precision = Callable[[], contextlib.AbstractContextManager]  # the context a case's forward runs in


def _block(shape: LayerShape, backend: str, dtype: torch.dtype,
           block_dtype: bool) -> tuple[MoE, torch.Tensor, torch.Tensor, Precision]:
    """An MoE block, its input rows and output gradient, and the context its step runs in: the
    training precision path (fp32 weights and rows, autocast to ``dtype`` unless fp32), or with
    ``block_dtype`` the whole block, rows and gradient in ``dtype``, no autocast."""
    cfg = MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_hidden=shape.hidden, backend=backend)
    held = dtype if block_dtype else torch.float32
    moe = MoE(shape.d_model, cfg).to(held)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=shape.d_model**-0.5)
    x_TD = torch.randn(shape.tokens, shape.d_model, dtype=held, requires_grad=True)
    grad_TD = torch.randn(shape.tokens, shape.d_model, dtype=held)
    autocast = held != dtype  # as the trainer's: moebench.train.trainer.Trainer._autocast
    return moe, x_TD, grad_TD, (lambda: torch.autocast("cpu", dtype=dtype)) if autocast else contextlib.nullcontext


def _moe_case(shape: LayerShape, backend: str, dtype: torch.dtype, block_dtype: bool = False) -> Callable[[], None]:
    moe, x_TD, grad_TD, precision = _block(shape, backend, dtype, block_dtype)

    def run() -> None:
        with precision():
            out_TD = moe(x_TD)
        out_TD.backward(grad_TD)
        moe.zero_grad(set_to_none=True)
        x_TD.grad = None

    return run


def _masked_loop_case(shape: LayerShape, dtype: torch.dtype) -> Callable[[], None]:
    moe, x_TD, grad_TD, precision = _block(shape, "auto", dtype, block_dtype=False)

    def run() -> None:
        with precision():
            routing = moe.router(x_TD)
            # rows in the compute dtype and the output back in the input's, as MoE.forward moves them
            rows_TD = x_TD.to(dtype)
            out = masked_expert_loop(rows_TD, routing.idx_TK, routing.weight_TK, moe.experts.w13, moe.experts.w2)
        out.to(x_TD.dtype).backward(grad_TD)
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


def cases(shape: LayerShape, dtype: torch.dtype = torch.float32,
          include_loop: bool = True) -> dict[str, Callable[[], None]]:
    """Every case of the benchmark by name: each call runs one forward and backward (fresh data
    and weights, seeded by the caller)."""
    runs: dict[str, Callable[[], None]] = {
        "dense_matmul": _dense_case(shape, dtype, with_swiglu=False),
        "dense_swiglu_mlp": _dense_case(shape, dtype, with_swiglu=True),
        "expert_gemms": _expert_gemms_case(shape, dtype),
        "moe_grouped_mm": _moe_case(shape, "grouped_mm", dtype),
        "moe_cpu_fused": _moe_case(shape, "cpu_fused", dtype),
        "moe_masked_loop": _masked_loop_case(shape, dtype),
    }
    if include_loop:
        runs["moe_loop_backend"] = _moe_case(shape, "loop", dtype)
    if dtype != torch.float32:  # the former whole-block form, labelled: not what training runs
        runs[f"moe_cpu_fused_block_{DTYPE_NAMES[dtype]}"] = _moe_case(shape, "cpu_fused", dtype, block_dtype=True)
    return runs


def run_benchmark(shape: LayerShape, repeats: int = 7, warmup: int = 2, dtype: torch.dtype = torch.float32,
                  include_loop: bool = True) -> dict:
    """Time every case interleaved; return raw samples and ratios to the dense matmul."""
    torch.manual_seed(0)
    runs = cases(shape, dtype, include_loop)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        for name, fn in runs.items():
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
        "precision_path": precision_path(dtype),
        "results": rows,
    }


def precision_path(dtype: torch.dtype) -> str:
    """How the MoE rows hold and compute at ``dtype`` (see the module docstring)."""
    if dtype == torch.float32:
        return "fp32 weights, rows and compute"
    name = DTYPE_NAMES[dtype]
    return (f"MoE rows as precision.mode={name} trains: fp32 master weights and rows under {name} autocast, "
            f"the backend's own casts; moe_cpu_fused_block_{name}: the whole block in {name} (no training "
            f"run computes that); reference rows: plain {name} GEMMs")


def format_table(result: dict) -> list[str]:
    width = max(20, *map(len, result["results"]))
    lines = [f"{'case':{width}s} {'median ms':>10s} {'GFLOP/s':>9s} {'vs dense':>9s}"]
    for name, row in result["results"].items():
        lines.append(f"{name:{width}s} {row['median_s'] * 1e3:10.1f} {row['gflops']:9.1f} {row['ratio_to_dense']:9.2f}")
    return lines

