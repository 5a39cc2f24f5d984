"""RecomputeRMSNorm (``model.norm_impl=recompute``) against its slow twin, torch's ``nn.RMSNorm``
(through ``fp32_norm`` for bf16 input, as the q/k norms run): forward, input and gain gradients,
a whole model's gradients, and what it saves for backward.

Tolerances. fp32: the same formula with the reduction and the backward written out by hand instead
of torch's kernel; fp32 reorderings move a value by a few ulps: rtol 1e-6, atol 1e-6 x the largest
magnitude. bf16 input: both compute in fp32 from the same bf16 values and round once to bf16, so
they can differ by one bf16 ulp where the fp32 values differ in their last bits: rtol 7.8e-3 (one
ulp), atol 7.8e-3 x the largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebench.model.norm import RecomputeRMSNorm, _RMSNorm
from moebench.model.transformer import build_model, fp32_norm
from moebench.presets import load_config


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def _pair(width: int) -> tuple[nn.RMSNorm, RecomputeRMSNorm]:
    torch.manual_seed(0)
    ref, new = nn.RMSNorm(width, eps=1e-5), RecomputeRMSNorm(width, eps=1e-5)
    with torch.no_grad():  # gains away from one, so a missing or misplaced gain shows
        ref.weight.uniform_(0.5, 1.5)
    new.load_state_dict(ref.state_dict())
    return ref, new


@pytest.mark.parametrize("shape", [(3, 7, 32), (2, 4, 5, 8)], ids=["BSD", "BHSd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recompute_norm_matches_torch(shape, dtype):
    ref, new = _pair(shape[-1])
    x = (torch.randn(shape) * 3 + 0.5).to(dtype)
    grad_y = torch.randn(shape).to(dtype)
    rtol = 1e-6 if dtype == torch.float32 else 7.8e-3
    results = []
    for norm in (ref, new):
        xi = x.clone().requires_grad_()
        y = fp32_norm(norm, xi)  # fp32 input: the plain norm; bf16: upcast for torch's, as the q/k norms run
        y.backward(grad_y)
        results.append((y, xi.grad, norm.weight.grad))
    for got, want in zip(results[1], results[0], strict=True):
        _close(got, want, rtol)


def test_recompute_norm_sees_its_gain():
    """Not a tautology: another gain moves the output and the input gradient."""
    _, new = _pair(16)
    x = torch.randn(4, 16, requires_grad=True)
    y = new(x)
    with torch.no_grad():
        new.weight.mul_(1.1)
    assert not torch.allclose(new(x), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_recompute_norm_saves_its_input_and_one_rstd_a_row(dtype):
    """torch's keeps fp32 rows beside the input (and fp32_norm's upcast of bf16 input); this one
    keeps the input as it came (the same storage) and 4 bytes a row."""
    ref, new = _pair(32)
    x = torch.randn(6, 32).to(dtype).requires_grad_()
    saved: dict[str, dict[int, int]] = {}
    for name, norm in (("torch", ref), ("recompute", new)):
        seen: dict[int, int] = {}

        def pack(t, seen=seen, norm=norm):
            if t.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fp32_norm(norm, x)
        saved[name] = seen
    rows = 6
    assert x.untyped_storage().data_ptr() in saved["recompute"]
    assert sum(saved["recompute"].values()) == x.untyped_storage().nbytes() + 4 * rows
    # torch's: at least the fp32 normalised rows more
    assert sum(saved["torch"].values()) >= sum(saved["recompute"].values()) + 4 * 32 * rows


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_recompute_norm_model_trains_like_the_torch_norm_one(autocast):
    """Block, QK and final norms all swapped: the same loss and every parameter's gradient. bf16: the
    model's gradients pass through bf16 GEMMs on both sides after a one-ulp difference, so 2 bf16
    ulps (rtol 1.6e-2)."""
    overrides = ["model.n_layers=2", "model.seq_len=16", "model.qk_norm=true", "moe.backend=grouped_mm"]
    ref = build_model(load_config("tiny", overrides))
    new = build_model(load_config("tiny", [*overrides, "model.norm_impl=recompute"]))
    assert sum(isinstance(m, RecomputeRMSNorm) for m in new.modules()) == 2 * 4 + 1
    new.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, ref.cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    rtol = 1.6e-2 if autocast else 1e-6
    losses = []
    for model in (ref, new):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss)
    _close(losses[1], losses[0], rtol)
    for (name, p), q in zip(ref.named_parameters(), new.parameters(), strict=True):
        assert q.grad is not None, name
        _close(q.grad, p.grad, rtol)


def test_recompute_norm_gradients_are_exact_in_float64():
    """The hand-written backward (grad_x = rstd g w - x rstd^3 <g w, x> / D, grad_w = the rows' sum of
    g x rstd) against finite differences, float64."""
    torch.manual_seed(0)
    w = torch.empty(8, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-5), (x, w))
