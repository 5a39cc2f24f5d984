"""gpt-oss's clamped SwiGLU (``moe.swiglu_limit``): the kernel against the reference formula, the
MoE block's backends against the naive per-token twin, and how a backend declared without it
(none is today) would be refused or not chosen.

Tolerances: the activation alone is compared in fp64 (the two spellings round differently, 1e-12);
the MoE block in fp32 with test_moe_parity.py's tolerance (summation order only).
"""

import copy

import pytest
import torch

from moebench.config import BACKEND_FEATURES, MoEConfig, resolve_backend
from moebench.errors import ConfigError
from moebench.kernels.expert_backends import check_backend
from moebench.kernels.quantized import quantized_experts
from moebench.kernels.swiglu import swiglu, swiglu_clamped
from moebench.model.experts import Experts
from moebench.model.moe import MoE
from moebench.model.reference import clamped_swiglu_reference, naive_per_token
from moebench.model.router import attach_aux_loss
from moebench.presets import load_config

TOL = {"rtol": 2e-5, "atol": 2e-6}


def test_clamped_swiglu_matches_the_reference_formula():
    torch.manual_seed(0)
    h = (torch.randn(64, 2 * 16, dtype=torch.float64) * 6).requires_grad_()  # many values past the limit
    got = swiglu_clamped(h, 7.0)
    gate, up = h.chunk(2, dim=-1)
    want = clamped_swiglu_reference(gate, up, 7.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    (g_got,) = torch.autograd.grad(got, h, grad)
    (g_want,) = torch.autograd.grad(want, h, grad)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
    clamped = torch.cat([gate > 7, up.abs() > 7], dim=-1)
    assert clamped.any() and torch.all(g_got[clamped] == 0)  # no gradient through a clamped value
    assert not torch.allclose(got, swiglu(h))


def _moe(backend: str) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=16, backend=backend,
                    swiglu_limit=0.5)  # small enough that the O(1) pre-activations get clamped
    moe = MoE(32, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.parametrize("backend", ["grouped_mm", "loop", "cpu_fused", "auto"])
def test_moe_with_clamped_swiglu_matches_the_naive_twin(backend):
    fast = _moe(backend)
    naive = copy.deepcopy(fast)
    x0, grad_out = torch.randn(40, 32), torch.randn(40, 32)
    x = x0.clone().requires_grad_()
    got = fast(x)
    got.backward(grad_out)
    xr = x0.clone().requires_grad_()
    r = naive.router(xr)
    out = naive_per_token(xr, r.idx_TK, r.weight_TK, naive.experts.w13, naive.experts.w2, swiglu_limit=0.5)
    want = attach_aux_loss(out + naive.shared(xr), r.aux_loss, naive.router.aux_grad_scale)
    want.backward(grad_out)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    for (name, p), q in zip(fast.named_parameters(), naive.parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


@pytest.fixture
def cpu_fused_cannot_clamp(monkeypatch):
    """The backend table as it would read with cpu_fused's kernels writing plain SwiGLU only."""
    monkeypatch.setitem(BACKEND_FEATURES, "cpu_fused", BACKEND_FEATURES["cpu_fused"] - {"moe.swiglu_limit"})


def test_every_backend_clamps_and_auto_stays_cpu_fused_on_cpu():
    clamp = {"moe.swiglu_limit"}
    assert all(clamp <= features for features in BACKEND_FEATURES.values())
    assert resolve_backend("auto", "cpu", clamp) == "cpu_fused"
    assert resolve_backend("auto", "cuda", clamp) == "grouped_mm"
    assert load_config("tiny", ["moe.swiglu_limit=7"]).moe.resolved_backend("cpu") == "cpu_fused"
    check_backend("cpu_fused", "cpu", "fp32", clamp)


def test_a_backend_that_cannot_clamp_is_refused_or_not_chosen(cpu_fused_cannot_clamp):
    clamp = {"moe.swiglu_limit"}
    assert resolve_backend("auto", "cpu", clamp) == "grouped_mm" and resolve_backend("auto", "cpu") == "cpu_fused"
    assert load_config("tiny", ["moe.swiglu_limit=7"]).moe.resolved_backend("cpu") == "grouped_mm"
    refusal = r"moe\.backend=cpu_fused does not compute clamped SwiGLU \(moe\.swiglu_limit\)"
    with pytest.raises(ConfigError, match=refusal):
        check_backend("cpu_fused", "cpu", "fp32", clamp)
    check_backend("auto", "cpu", "fp32", clamp)


def test_the_model_refuses_a_backend_without_the_clamp_however_it_is_built(cpu_fused_cannot_clamp):
    with pytest.raises(ConfigError, match=r"moe\.backend=cpu_fused .*use moe\.backend=auto or loop or grouped_mm"):
        _moe("cpu_fused")
    with pytest.raises(ConfigError, match=r"moe\.swiglu_limit"):
        Experts(4, 8, 8, "cpu_fused", swiglu_limit=7.0)
    moe = _moe("loop")
    with pytest.raises(ConfigError, match=r"moe\.swiglu_limit"):
        moe.experts.backend = "cpu_fused"  # set after the build: refused too
    assert moe.experts.backend == "loop"


def test_quantized_experts_clamp_too():
    torch.manual_seed(2)
    experts = Experts(4, 64, 32, swiglu_limit=0.05)
    experts.init_weights(0.05, 0.05)
    x, offsets = torch.randn(24, 64), torch.tensor([6, 6, 18, 24], dtype=torch.int32)
    experts.precision = "fp8"
    got = experts(x, offsets)
    torch.testing.assert_close(got, quantized_experts(x, experts.w13, experts.w2, offsets, "fp8", impl="emulated",
                                                    swiglu_limit=0.05))
    assert not torch.allclose(got, quantized_experts(x, experts.w13, experts.w2, offsets, "fp8", impl="emulated"))
