"""grouped_mm vs loop backend vs a naive per-token reference: outputs, every gradient, aux losses.

Tolerance: all fp32. The three paths differ only in summation order (per-expert GEMM
tiling, the batched combine vs scalar sums), so the error is a few ulps times the
reduction length (D, H <= 64): about 64 * 1.2e-7 ~ 1e-5 relative; we allow 2e-5.
"""

import copy

import pytest
import torch
from moe_helpers import make_moe

from moebench.model.moe import MoE
from moebench.model.reference import naive_per_token
from moebench.model.router import attach_aux_loss
from moebench.testing import HostSyncError, forbid_host_sync

TOL = {"rtol": 2e-5, "atol": 2e-6}


def _naive_forward(moe: MoE, x_TD):
    r = moe.router(x_TD)
    out = naive_per_token(x_TD, r.idx_TK, r.weight_TK, moe.experts.w13, moe.experts.w2) + moe.shared(x_TD)
    return attach_aux_loss(out, r.aux_loss, moe.router.aux_grad_scale), r


def _grads(moe: MoE, x):
    return {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


@pytest.mark.parametrize("starved", [0, 3])
def test_grouped_loop_and_naive_agree(starved):
    grouped = make_moe(starved=starved)
    loop = copy.deepcopy(grouped)
    loop.experts.backend = "loop"
    naive = copy.deepcopy(grouped)
    x0 = torch.randn(40, 32)
    grad_out = torch.randn(40, 32)

    results = {}
    for name, moe in [("grouped", grouped), ("loop", loop), ("naive", naive)]:
        x = x0.clone().requires_grad_()
        if name == "naive":
            out, routing = _naive_forward(moe, x)
        else:
            moe.router.reset_step_stats()
            out = moe(x)
            # the lb and z losses this block's own forward computed (recorded for the step log)
            routing = moe.router.step_aux / moe.router.step_calls
        out.backward(grad_out)
        results[name] = (out.detach(), _grads(moe, x), routing)

    if starved:
        assert results["naive"][2].counts_E[-starved:].sum() == 0, "test setup: starved experts must get no tokens"
        assert torch.all(results["grouped"][1]["experts.w13"][-starved:] == 0)

    ref_out, ref_grads, ref_routing = results["naive"]
    for name in ("grouped", "loop"):
        out, grads, routing = results[name]
        torch.testing.assert_close(out, ref_out, **TOL)
        assert grads.keys() == ref_grads.keys()
        for key in ref_grads:
            torch.testing.assert_close(grads[key], ref_grads[key], **TOL, msg=f"{name}: grad of {key}")
        torch.testing.assert_close(routing, torch.stack([ref_routing.lb_loss, ref_routing.z_loss]).detach())
    # the aux loss reached the router: its gradient differs from a run without aux losses
    plain = copy.deepcopy(naive)
    plain.cfg.lb_loss_weight = plain.cfg.z_loss_weight = 0.0
    plain.router.cfg = plain.cfg
    plain.zero_grad()
    x = x0.clone().requires_grad_()
    out, _ = _naive_forward(plain, x)
    out.backward(grad_out)
    assert not torch.allclose(plain.router.gate.weight.grad, ref_grads["router.gate.weight"])


def test_grouped_path_never_syncs():
    moe = make_moe(starved=2)
    x = torch.randn(24, 32, requires_grad=True)
    with forbid_host_sync():
        out = moe(x)
        out.backward(torch.randn_like(out))
    assert x.grad is not None


def test_sync_guard_catches_the_loop_backend():
    moe = make_moe()
    moe.experts.backend = "loop"
    with pytest.raises(HostSyncError, match="tolist"), forbid_host_sync():
        moe(torch.randn(8, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["grouped_mm", "cpu_fused"])  # cpu_fused is grouped_mm on a GPU
def test_grouped_path_never_syncs_on_cuda(backend):
    moe = make_moe().cuda().bfloat16()  # grouped_mm on CUDA takes bf16
    moe.experts.backend = backend
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = moe(x)
    out.backward(torch.randn_like(out))  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe(x)
        out.backward(torch.randn_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
