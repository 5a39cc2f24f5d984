"""The ``cpu_fused`` backend against its slow twins: forward, every gradient, aux losses, empty experts.

Twins: the ``loop`` backend behind :class:`LocalDispatcher` (plain autograd) and
:func:`naive_per_token`. Tolerance in fp32: the paths differ only in summation order (per-expert
GEMMs, the routing weight applied before vs after the K-sum, ``<g @ w2^T, act>`` vs
``<g, act @ w2>`` for the weight gradient), a few ulps times the reduction length (<= 64):
64 * 1.2e-7 ~ 1e-5 relative, so 2e-5 as in tests/model/test_moe_parity.py. float64 ``gradcheck``
checks the hand-written backwards against finite differences.
"""

import copy

import pytest
import torch
from moe_helpers import make_moe

from moebench.kernels.cpu_experts import _route_order, fused_experts_cpu, fused_moe_cpu
from moebench.kernels.expert_backends import experts_cpu_fused, experts_loop
from moebench.model.moe import LocalDispatcher, MoE
from moebench.model.reference import naive_per_token
from moebench.testing import HostSyncError, forbid_host_sync

TOL = {"rtol": 2e-5, "atol": 2e-6}


class _OtherDispatcher(LocalDispatcher):
    """Any dispatcher but the plain local one: the block must dispatch, then call the experts backend."""

    fusable = False


def _run(moe: MoE, x0: torch.Tensor, grad_out: torch.Tensor):
    x = x0.clone().requires_grad_()
    out = moe(x)
    out.backward(grad_out)
    routing = moe.router(x.detach())  # routing is deterministic: same losses as inside the forward
    grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    return out.detach(), grads, routing


def _fused_twin(loop, fuse_dispatch: bool):
    """The same block (weights copied) on the cpu_fused backend; without ``fuse_dispatch`` its dispatch
    stays outside the kernel (the experts-only route)."""
    fused = copy.deepcopy(loop)
    fused.experts.backend = "cpu_fused"
    if not fuse_dispatch:
        fused.dispatcher = _OtherDispatcher()
    return fused


@pytest.mark.parametrize("starved", [0, 3])
@pytest.mark.parametrize("fuse_dispatch", [True, False])
def test_cpu_fused_matches_loop_backend(starved, fuse_dispatch):
    loop = make_moe("loop", starved)
    fused = _fused_twin(loop, fuse_dispatch)
    x0, grad_out = torch.randn(40, 32), torch.randn(40, 32)
    ref_out, ref_grads, ref_routing = _run(loop, x0, grad_out)
    out, grads, routing = _run(fused, x0, grad_out)
    if starved:
        assert routing.counts_E[-starved:].sum() == 0, "test setup: starved experts must get no tokens"
        assert torch.all(grads["experts.w13"][-starved:] == 0) and torch.all(grads["experts.w2"][-starved:] == 0)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **TOL, msg=f"grad of {key}")
    torch.testing.assert_close(routing.lb_loss, ref_routing.lb_loss)
    torch.testing.assert_close(routing.z_loss, ref_routing.z_loss)
    assert fused.router.step_dropped == 0


def _routes(num_tokens: int, num_experts: int, top_k: int, unused: int) -> torch.Tensor:
    """Distinct experts per token, the last ``unused`` experts never chosen."""
    return torch.stack([torch.randperm(num_experts - unused)[:top_k] for _ in range(num_tokens)])


def test_fused_moe_gradcheck_and_naive_twin():
    torch.manual_seed(1)
    experts, d_model, hidden, tokens, top_k = 6, 8, 6, 9, 2
    f64 = {"dtype": torch.float64, "requires_grad": True}
    x = torch.randn(tokens, d_model, **f64)
    weight = torch.rand(tokens, top_k, **f64)
    w13 = torch.randn(experts, d_model, 2 * hidden, **f64)
    w2 = torch.randn(experts, hidden, d_model, **f64)
    idx = _routes(tokens, experts, top_k, unused=2)
    torch.autograd.gradcheck(lambda *a: fused_moe_cpu(a[0], idx, a[1], a[2], a[3]), (x, weight, w13, w2))
    grad_out = torch.randn(tokens, d_model, dtype=torch.float64)
    results = []
    for fn in (fused_moe_cpu, naive_per_token):
        out = fn(x, idx, weight, w13, w2)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad.clone() for t in (x, weight, w13, w2))])
        for t in (x, weight, w13, w2):
            t.grad = None
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_fused_experts_match_loop_with_padding_and_empty_experts():
    torch.manual_seed(2)
    sizes = torch.tensor([5, 0, 7, 3, 0, 9])
    offsets = sizes.cumsum(0).to(torch.int32)
    rows = int(sizes.sum()) + 4  # capacity padding past the last expert
    f64 = {"dtype": torch.float64, "requires_grad": True}
    x = torch.randn(rows, 16, **f64)
    w13, w2 = torch.randn(6, 16, 24, **f64), torch.randn(6, 12, 16, **f64)
    used = int(sizes.sum())
    torch.autograd.gradcheck(lambda *a: fused_experts_cpu(*a, offsets)[:used], (x, w13, w2))
    grad_out = torch.randn(rows, 16, dtype=torch.float64)
    results = []
    for fn in (fused_experts_cpu, experts_loop):
        out = fn(x, w13, w2, offsets)
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad.clone() for t in (x, w13, w2))])
        for t in (x, w13, w2):
            t.grad = None
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert torch.all(results[0][2][[1, 4]] == 0), "experts without rows get zero gradients"


# fp32 tolerance of the clamped SwiGLU against loop: as TOL's reasoning, with D, H = 32 the sums are
# half as long as TOL allows for, so 1e-5
CLAMP_TOL = {"rtol": 1e-5, "atol": 1e-6}
# small enough that the O(1) pre-activations of make_moe's weights get clamped, on both sides of up
LIMIT = 0.5


def test_clamped_swiglu_gradcheck_and_naive_twins():
    """gpt-oss's clamped SwiGLU in both kernels, float64: finite differences, and the slow twins
    (naive_per_token, the loop backend) to rounding; the clamp bites (the plain result differs)."""
    torch.manual_seed(7)
    f64 = {"dtype": torch.float64, "requires_grad": True}
    tokens, top_k, experts, d_model, hidden, limit = 9, 2, 6, 8, 6, 1.5
    x, weight = torch.randn(tokens, d_model, **f64), torch.rand(tokens, top_k, **f64)
    w13, w2 = torch.randn(experts, d_model, 2 * hidden, **f64), torch.randn(experts, hidden, d_model, **f64)
    idx = _routes(tokens, experts, top_k, unused=2)
    offsets = torch.tensor([3, 0, 4, 2, 0, 1]).cumsum(0).to(torch.int32)
    rows = torch.randn(12, d_model, **f64)  # 10 routed rows, 2 of capacity padding
    h = (x @ w13).detach()  # every expert's pre-activation of every token
    assert (h[..., :hidden] > limit).any() and (h[..., hidden:].abs() > limit).any(), "the clamp must bite"
    torch.autograd.gradcheck(lambda *a: fused_moe_cpu(a[0], idx, *a[1:], swiglu_limit=limit), (x, weight, w13, w2))
    used = int(offsets[-1])
    torch.autograd.gradcheck(lambda *a: fused_experts_cpu(*a, offsets, limit)[:used], (rows, w13, w2))
    pairs = (((x, weight, w13, w2), lambda *a, **k: fused_moe_cpu(a[0], idx, *a[1:], **k),
              lambda *a, **k: naive_per_token(a[0], idx, *a[1:], **k)),
             ((rows, w13, w2), lambda *a, **k: fused_experts_cpu(*a, offsets, **k)[:used],
              lambda *a, **k: experts_loop(*a, offsets, **k)[:used]))
    for leaves, fast, slow in pairs:
        results = []
        for fn in (fast, slow):
            out = fn(*leaves, swiglu_limit=limit)
            out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(8)))
            results.append([out.detach(), *(t.grad.clone() for t in leaves)])
            for t in leaves:
                t.grad = None
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(results[0][0], fast(*leaves).detach())


@pytest.mark.parametrize("fuse_dispatch", [True, False])
def test_cpu_fused_clamped_swiglu_matches_loop_backend(fuse_dispatch):
    loop = make_moe("loop", swiglu_limit=LIMIT)
    fused = _fused_twin(loop, fuse_dispatch)
    x0, grad_out = torch.randn(40, 32), torch.randn(40, 32)
    ref_out, ref_grads, _ = _run(loop, x0, grad_out)
    out, grads, _ = _run(fused, x0, grad_out)
    torch.testing.assert_close(out, ref_out, **CLAMP_TOL)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **CLAMP_TOL, msg=f"grad of {key}")
    plain = copy.deepcopy(fused)
    plain.experts.swiglu_limit = None
    assert not torch.allclose(plain(x0), out, **CLAMP_TOL), "the clamp must change the result"


def test_workspace_reuse_across_layers_and_retained_graphs():
    """The shared scratch buffer is transient: two live forwards and a retained graph stay correct."""
    loop = make_moe("loop")
    fused = copy.deepcopy(loop)
    fused.experts.backend = "cpu_fused"
    x1, x2 = torch.randn(24, 32), torch.randn(24, 32)
    for moe in (loop, fused):
        a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        out = moe(moe(a) + b)  # the same layer twice: both graphs hold saved tensors at once
        out.sum().backward(retain_graph=True)
        out.sum().backward()  # second backward through the retained graph accumulates the same again
        moe.result = (out.detach(), a.grad, b.grad, moe.experts.w13.grad)
    for got, want in zip(fused.result, loop.result, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("swiglu_limit", [None, LIMIT])
def test_bf16_autocast_matches_loop(swiglu_limit):
    """bf16 end to end: rows cast, fp32 weights cast in the kernel, bucketed GEMM rows.

    Tolerance: bf16 has 8 mantissa bits (eps 7.8e-3); both paths round the same GEMM outputs
    to bf16 but apply the routing weight at different points, so a few ulps: 3e-2.
    """
    loop = make_moe("loop", swiglu_limit=swiglu_limit)
    fused = copy.deepcopy(loop)
    fused.experts.backend = "cpu_fused"
    x0, grad_out = torch.randn(40, 32), torch.randn(40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out, ref_grads, _ = _run(loop, x0, grad_out)
        out, grads, _ = _run(fused, x0, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=3e-2, atol=3e-2)
    for key in ref_grads:
        scale = ref_grads[key].abs().max().item()
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=3e-2, atol=3e-2 * scale, msg=key)


def test_cpu_path_reads_sizes_on_host_device_path_does_not():
    """On CPU the fused kernel reads group sizes (documented) inside its custom op, where a
    TorchFunctionMode no longer sees them: the mode sees one ``moebench::fused_moe_cpu`` call.
    Other devices take grouped_mm, sync-free."""
    moe = make_moe("cpu_fused")
    with forbid_host_sync():
        moe(torch.randn(8, 32))
    with pytest.raises(HostSyncError), forbid_host_sync():  # the host read the op hides
        _route_order(torch.randint(0, 3, (8, 2)), 3)
    meta = {"device": "meta", "dtype": torch.bfloat16}  # grouped_mm's shape checks want bf16
    x_ND = torch.empty(64, 16, **meta)
    offsets = torch.tensor([5, 9, 20], dtype=torch.int32, device="meta")
    with forbid_host_sync():
        y_ND = experts_cpu_fused(x_ND, torch.empty(3, 16, 32, **meta), torch.empty(3, 16, 16, **meta), offsets)
    assert y_ND.shape == (64, 16)


def test_buffer_pool_reuses_only_free_buffers():
    from moebench.kernels.cpu_experts import _BufferPool

    pool, like = _BufferPool(), torch.empty(0)
    held = pool.take(4, 8, like)
    other = pool.take(4, 8, like)
    assert held.data_ptr() != other.data_ptr(), "a buffer still referenced must not be handed out"
    ptr = other.data_ptr()
    del other
    again = pool.take(2, 8, like)  # smaller request: served by the free buffer
    assert again.data_ptr() == ptr
    del again
    saved = pool.take(4, 8, like).view(-1)[:5]  # a view (e.g. saved by autograd) keeps the buffer busy
    assert pool.take(4, 8, like).data_ptr() not in (held.data_ptr(), saved.data_ptr())


def test_fused_experts_pooled_gradients_accumulate():
    """Gradients handed out from the pool stay valid while held (here: as a leaf's accumulated .grad)."""
    torch.manual_seed(3)
    offsets = torch.tensor([6, 6, 13], dtype=torch.int32)
    x = torch.randn(13, 8, requires_grad=True)
    w13, w2 = torch.randn(3, 8, 12), torch.randn(3, 6, 8)
    grad_out = torch.randn(13, 8)
    ref = torch.autograd.grad(experts_loop(x, w13, w2, offsets), x, grad_out)[0]
    out = fused_experts_cpu(x, w13, w2, offsets)
    out.backward(grad_out, retain_graph=True)
    first = x.grad.clone()
    other = fused_experts_cpu(torch.randn(13, 8, requires_grad=True), w13, w2, offsets)  # takes pool buffers
    other.backward(torch.randn(13, 8))
    out.backward(grad_out)
    torch.testing.assert_close(first, ref, **TOL)
    torch.testing.assert_close(x.grad, 2 * ref, **TOL)


@pytest.mark.parametrize("bf16", [False, True])
def test_pooled_weight_gradients_stay_valid_while_held(bf16):
    """Expert weight gradients come from the pool: one held as a weight's ``.grad`` is never handed
    out again, so a later backward of another block with the same shapes leaves it as it was."""
    torch.manual_seed(7)
    first, second = make_moe("cpu_fused"), make_moe("cpu_fused")
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    grads = []
    for moe in (first, second):
        with precision:
            out = moe(torch.randn(40, 32))
        out.float().backward(torch.randn(40, 32))
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters()})
    for moe, want in zip((first, second), grads, strict=True):
        for name, p in moe.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=0, atol=0, msg=name)
    assert first.experts.w13.grad.dtype == torch.float32


def test_gemm_rows_buckets():
    """bf16 GEMMs run on bucketed row counts (at most 1/8 padding, a few dozen shapes); fp32 is exact."""
    from moebench.kernels.cpu_experts import _gemm_rows

    padded = {m: _gemm_rows(m, torch.bfloat16) for m in range(4097)}
    assert padded[0] == 0 and all(p >= m for m, p in padded.items())
    assert all(p - m <= max(15, m // 8) for m, p in padded.items())
    assert len(set(padded.values())) <= 50
    assert all(_gemm_rows(m, dt) == m for m in (0, 1, 17, 1000) for dt in (torch.float32, torch.float64))


@pytest.mark.parametrize("limit", [None, 1.5])
def test_padded_gemms_leak_nothing(monkeypatch, limit):
    """With every GEMM padded (float64 here, so the comparison is exact to rounding) and every
    scratch and pooled buffer full of NaN, both kernels give the unpadded results: padding rows of
    the row-independent GEMMs are overwritten, and weight gradients only ever sum zero padding rows."""
    from moebench.kernels import cpu_experts

    torch.manual_seed(4)
    f64 = {"dtype": torch.float64}
    tokens, top_k, experts, d_model, hidden = 11, 2, 5, 8, 6
    x = torch.randn(tokens, d_model, **f64)
    weight = torch.rand(tokens, top_k, **f64)
    w13, w2 = torch.randn(experts, d_model, 2 * hidden, **f64), torch.randn(experts, hidden, d_model, **f64)
    idx = _routes(tokens, experts, top_k, unused=1)
    sizes = torch.tensor([5, 0, 7, 3, 9])
    offsets = sizes.cumsum(0).to(torch.int32)
    rows = int(sizes.sum()) + 4  # capacity padding past the last expert
    x_rows = torch.randn(rows, d_model, **f64)

    def results() -> list[torch.Tensor]:
        out = []
        inputs = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
        y = fused_moe_cpu(inputs[0], idx, *inputs[1:], swiglu_limit=limit)
        y.backward(torch.ones_like(y))
        out += [y.detach(), *(t.grad for t in inputs)]
        inputs = [t.clone().requires_grad_() for t in (x_rows, w13, w2)]
        y = fused_experts_cpu(*inputs, offsets, limit)
        y.backward(torch.ones_like(y))
        return [*out, y.detach(), *(t.grad for t in inputs)]

    exact = results()

    class NanPool(cpu_experts._BufferPool):
        def take(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
            return super().take(rows, cols, like).fill_(float("nan"))

    monkeypatch.setattr(cpu_experts, "_gemm_rows", lambda rows, dtype: rows and rows + 3 + rows % 4)
    monkeypatch.setattr(cpu_experts, "_scratch", lambda like, rows, cols: like.new_full((rows, cols), float("nan")))
    monkeypatch.setattr(cpu_experts, "_pool", NanPool())
    for got, want in zip(results(), exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["moe", "experts"])
def test_fp32_weights_cast_in_kernel_equal_a_whole_cast(kernel):
    """bf16 rows with the fp32 master weights (cast in the kernel, fp32 gradients out)
    give exactly what casting the whole stack to bf16 first gives: the same bf16 operands, and
    weight gradients rounded to bf16 before they become fp32, as autograd's cast-back does."""
    torch.manual_seed(5)
    tokens, top_k, experts, d_model, hidden = 37, 2, 6, 32, 24
    x = torch.randn(tokens, d_model).bfloat16()
    weight = torch.rand(tokens, top_k)
    w13, w2 = torch.randn(experts, d_model, 2 * hidden) / 6, torch.randn(experts, hidden, d_model) / 5
    idx = _routes(tokens, experts, top_k, unused=1)
    offsets = torch.tensor([5, 0, 9, 13, 7, 3]).cumsum(0).to(torch.int32)
    results = []
    for whole_cast in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, weight, w13, w2)]
        x_, weight_, w13_, w2_ = leaves
        ws = (w13_.bfloat16(), w2_.bfloat16()) if whole_cast else (w13_, w2_)
        out = fused_moe_cpu(x_, idx, weight_, *ws) if kernel == "moe" else fused_experts_cpu(x_, *ws, offsets)
        out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(6)))
        assert w13_.grad.dtype == torch.float32
        results.append([out.detach(), *(t.grad for t in leaves if t.grad is not None)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
