"""Microbenchmarks of the MoE hot path (pytest-benchmark); not part of the default test run.

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k, N = T*K routes.

    pytest tests/benchmarks --benchmark-enable --benchmark-autosave      # save a baseline
    pytest tests/benchmarks --benchmark-enable --benchmark-compare       # compare with the last one

The default CPU shape is small enough for a shared 2-core machine; on CUDA a larger shape
keeps kernels from being launch-bound. ``MOEBENCH_BENCH_SHAPE=T,D,H,E,K`` sets another one,
e.g. ``4096,512,512,64,8``, the shape BACKGROUND.md quotes peer numbers for. Every timed
call synchronises the device.
"""

from __future__ import annotations

import os
import typing

import pytest
import torch

from moebench.config import MoEConfig
from moebench.kernels.routing import sort_routes
from moebench.model.experts import Experts
from moebench.model.moe import LocalDispatcher, MoE
from moebench.model.router import Router

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_DEFAULT_SHAPE = "16384,2048,1024,64,8" if DEVICE.type == "cuda" else "2048,256,256,32,4"
T, D, H, E, K = (int(v) for v in os.environ.get("MOEBENCH_BENCH_SHAPE", _DEFAULT_SHAPE).split(","))
ROUNDS = {"rounds": 5, "warmup_rounds": 1, "iterations": 1}
# Triton kernels run on CPU only in the interpreter (TRITON_INTERPRET=1): far too slow to time.
cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton kernels are timed on CUDA only")
if DEVICE.type == "cuda":
    import moebench.kernels.grouped_gemm  # noqa: F401  (registers the "triton" expert backend)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn):
    def run():
        out = fn()
        _sync()
        return out

    return run


@pytest.fixture(scope="module")
def tokens():
    gen = torch.Generator(device="cpu").manual_seed(0)
    x_TD = torch.randn(T, D, generator=gen).to(DEVICE)
    idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices.to(DEVICE)
    weight_TK = torch.rand(T, K, generator=gen).to(DEVICE)
    return x_TD, idx_TK, weight_TK


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, expert_hidden=H, **kw)


def test_router_forward(benchmark, tokens):
    x_TD, _, _ = tokens
    router = Router(D, _cfg()).to(DEVICE)
    with torch.no_grad():
        benchmark.pedantic(_timed(lambda: router(x_TD)), **ROUNDS)


def test_sort_routes(benchmark, tokens):
    _, idx_TK, _ = tokens
    benchmark.pedantic(_timed(lambda: sort_routes(idx_TK, E)), **ROUNDS)


def _triton_dispatcher():
    from moebench.model.triton_dispatch import TritonLocalDispatcher

    return TritonLocalDispatcher()


@pytest.mark.parametrize("make", [LocalDispatcher, pytest.param(_triton_dispatcher, marks=cuda_only)],
                         ids=["torch", "triton"])
def test_local_dispatch_combine(benchmark, tokens, make):
    x_TD, idx_TK, weight_TK = tokens
    dispatcher = make()

    def round_trip():
        dispatched = dispatcher.dispatch(x_TD, idx_TK, E)
        return dispatcher.combine(dispatched.x_ND, weight_TK, dispatched)

    out_TD = benchmark.pedantic(_timed(round_trip), **ROUNDS)
    # Identity experts: the round trip must give back sum_k w_tk * x_t.
    torch.testing.assert_close(out_TD, x_TD * weight_TK.sum(-1, keepdim=True))


@pytest.mark.parametrize("backend", [b for b in typing.get_args(typing.get_type_hints(MoEConfig)["backend"])
                                     if b != "triton" or DEVICE.type == "cuda"])
def test_experts_forward_backward(benchmark, tokens, backend):
    x_TD, idx_TK, _ = tokens
    experts = Experts(E, D, H, backend).to(DEVICE)
    experts.init_weights(0.02, 0.02)
    dispatched = LocalDispatcher().dispatch(x_TD, idx_TK, E)
    x_ND = dispatched.x_ND.detach().requires_grad_()
    # A random (contiguous) incoming gradient: grouped_mm's CPU backward rejects zero strides.
    grad_ND = torch.randn(x_ND.shape[0], D, device=DEVICE)

    def step():
        experts.zero_grad(set_to_none=True)
        experts(x_ND, dispatched.offsets_E).backward(grad_ND)

    benchmark.pedantic(_timed(step), **ROUNDS)
    benchmark.extra_info.update(tokens=T, d_model=D, hidden=H, experts=E, top_k=K, device=str(DEVICE))


def test_moe_layer_forward_backward(benchmark, tokens):
    x_TD, _, _ = tokens
    moe = MoE(D, _cfg()).to(DEVICE)
    moe.experts.init_weights(0.02, 0.02)
    x = x_TD.detach().requires_grad_()
    grad_TD = torch.randn_like(x_TD)

    def step():
        moe.zero_grad(set_to_none=True)
        moe(x).backward(grad_TD)

    benchmark.pedantic(_timed(step), **ROUNDS)
    flops = 6 * T * K * 3 * D * H  # expert matmuls only, forward + backward
    benchmark.extra_info.update(expert_gflop_per_call=flops / 1e9, device=str(DEVICE))
