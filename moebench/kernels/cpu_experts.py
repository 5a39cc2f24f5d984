"""CPU expert compute: one expert at a time, every intermediate kept in cache.

Shapes: T tokens, K top-k, N = T*K expert-sorted routes, M rows of one expert, D model dim,
H expert hidden, E experts.

``grouped_mm`` on CPU runs the GEMMs group by group anyway, but the SwiGLU, permutations and
weighted combine around them then stream whole ``[N, 2H]`` / ``[N, D]`` buffers through
memory (and autograd allocates fresh ones each step, page faults included). Here the two
GEMMs, the SwiGLU and the whole backward run per expert: the ``[M, 2H]`` intermediates of
one expert (a few MB) stay in L2/L3, the elementwise work runs on cache-hot data, and every
GEMM writes into a preallocated slice with ``out=``. The backward recomputes ``silu(gate)``
and ``silu(gate) * up`` from the saved ``[N, 2H]`` pre-activation instead of saving them.
With ``swiglu_limit`` set the activation is gpt-oss's clamped SwiGLU (the elementwise parts are
:mod:`moebench.kernels.swiglu`'s ``glu_out`` and friends; slow twin
:func:`moebench.kernels.swiglu.swiglu_clamped` through the ``loop`` backend).

- :func:`fused_moe_cpu`: gather, experts, routing weight and combine in one function (used
  by the MoE block with the single-device dispatcher). Slow twins: ``LocalDispatcher`` with
  the ``loop`` backend, :func:`moebench.model.reference.naive_per_token`.
- :func:`fused_experts_cpu`: experts only, on rows another dispatcher sorted. Slow twin:
  :func:`moebench.model.experts.experts_loop`.

Under bf16 the rows come in bf16 and the stacked weights may stay fp32 (the master weights):
the forward and the backward each cast the whole stack once into a pooled bf16 buffer
(:func:`_compute_weights`), one op where a cast per expert GEMM cost a dispatch each, and the
weight gradients are written into a pooled bf16 stack and come back fp32 in one cast (rounded
to bf16 first, as autocast's cast-back would). The bf16 copy is not saved for backward, which
casts again: saving it would hold a bf16 copy of every layer's experts between forward and
backward. In bf16 the per-expert GEMMs run on bucketed row counts (:func:`_gemm_rows`).

Both read the group sizes on the host, which would stall a GPU, so the ``cpu_fused`` backend
(:mod:`moebench.model.experts`) uses them for CPU tensors only and hands device tensors to
``grouped_mm`` (offsets stay on the device).

Each is a ``torch.library`` custom op (``moebench::fused_moe_cpu``, ``moebench::fused_experts_cpu``,
and a backward op for each) with a fake implementation and a registered autograd formula, so
``torch.compile`` records one call and the compiled block keeps one graph around it.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from moebench.kernels.groups import group_sizes
from moebench.kernels.swiglu import glu_backward_out, glu_out, up_backward_, up_term


class _BufferPool(threading.local):
    """Large CPU buffers kept across steps, handed out again once nothing else holds them.

    A fresh 64 MB tensor costs about as much in page faults as two passes over it (large
    blocks go straight back to the OS on free), and these kernels need a few such buffers
    per step: the saved ``[N, 2H]`` pre-activation, ``[N, D]`` per-route rows (outputs
    and input gradients of the experts-only kernel included), the expert weight gradients and,
    under bf16 with fp32 weights, the bf16 weight stacks. A buffer is free when its
    storage's reference count is back to the pool's own: views saved by an autograd graph
    (also a retained one), held by a caller or kept as a ``.grad`` keep it busy, so reuse
    cannot clobber live data. Per thread, so concurrent threads never share one.
    """

    # about four per MoE layer alive at once (the saved pre-activation until its backward, the two
    # weight gradients until the optimizer drops them); past that, plain allocations
    max_buffers = 64

    def __init__(self) -> None:
        self.buffers: list[tuple[Tensor, int]] = []  # (1-D buffer, its reference count when free)

    @staticmethod
    def _refs(buf: Tensor) -> int:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)

    def take(self, rows: int, cols: int, like: Tensor) -> Tensor:
        """An uninitialised ``[rows, cols]`` tensor with ``like``'s dtype (CPU)."""
        numel = rows * cols
        free = [i for i, (buf, idle) in enumerate(self.buffers) if buf.dtype == like.dtype and self._refs(buf) == idle]
        fits = [i for i in free if self.buffers[i][0].numel() >= numel]
        if fits:
            buf = self.buffers[min(fits, key=lambda i: self.buffers[i][0].numel())][0]
            return buf[:numel].view(rows, cols)
        if free:  # a free buffer too small for this shape: replace it rather than grow the pool
            self.buffers.pop(free[0])
        if len(self.buffers) >= self.max_buffers or not hasattr(torch._C, "_storage_Use_Count"):
            return like.new_empty(rows, cols)
        buf = like.new_empty(numel)
        self.buffers.append((buf, self._refs(buf)))
        return buf.view(rows, cols)


_pool = _BufferPool()


def _bounds(sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` for every non-empty expert."""
    out, start = [], 0
    for e, size in enumerate(sizes):
        if size:
            out.append((e, start, start + size))
        start += size
    return out


def _gemm_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows a per-expert GEMM of ``rows`` rows runs on: ``rows`` in fp32/fp64, else rounded up
    to a bucket (a multiple of 16, and of an eighth of ``rows`` past 128: at most 1/8 padding).

    In bf16/fp16 torch's CPU matmul is a oneDNN kernel built for its exact shape (then cached): a
    row count not seen before costs far more to build than a 128-row expert GEMM takes to run, and
    routing gives every expert a new row count every step (``scripts/bf16_row_counts.py`` times
    both). With the counts bucketed, a few dozen shapes cover every step and each kernel comes
    from the cache. fp32 runs MKL's GEMM, which builds nothing per shape, so it stays exact.
    """
    if dtype in (torch.float32, torch.float64) or rows == 0:
        return rows
    step = 1 << max(4, rows.bit_length() - 4)
    return -(-rows // step) * step


def _slack(bounds: list[tuple[int, int, int]], dtype: torch.dtype) -> int:
    """Rows past the last route a buffer needs so that every expert's padded GEMM writes in bounds
    (an expert's padding rows spill into the next expert's rows, which that expert then overwrites)."""
    return max((_gemm_rows(b - a, dtype) - (b - a) for _, a, b in bounds), default=0)


def _scratch(like: Tensor, rows: int, cols: int) -> Tensor:
    """Uninitialised per-expert scratch ``[rows, cols]`` (tests fill it with NaN: padding rows must never leak)."""
    return like.new_empty(rows, cols)


def _stack_like(w_EAB: Tensor, like: Tensor) -> Tensor:
    """An uninitialised pooled ``[E, A, B]`` stack shaped as ``w_EAB``, in ``like``'s dtype."""
    experts, rows, cols = w_EAB.shape
    return _pool.take(experts * rows, cols, like).view(experts, rows, cols)


def _compute_weights(w_EAB: Tensor, like: Tensor) -> Tensor:
    """Stacked expert weights in ``like``'s dtype: themselves, or (fp32 master weights under bf16)
    one cast of the whole stack into a pooled buffer.

    Memory: the bf16 copy of a layer's two stacks is ``2 * 3*E*D*H`` bytes (25.2 MB at D=512,
    H=256, E=32), live while one kernel runs, never saved for backward; a backward holds it and
    the bf16 weight gradients (as many bytes again) at once. Both are pooled, so a process keeps
    about 50 MB more at that shape than the per-expert casts it replaces, whatever the layer count.
    """
    return w_EAB if w_EAB.dtype == like.dtype else _stack_like(w_EAB, like).copy_(w_EAB)


def _zero_padding(t: Tensor, m: int) -> None:
    """Zero rows ``m:`` of a padded GEMM operand (nothing to do, and no op dispatched, in fp32)."""
    if t.shape[0] > m:
        t[m:].zero_()


def _padded(src: Tensor, a: int, b: int, scratch: Tensor) -> Tensor:
    """Rows ``a:b`` of ``src`` as the padded operand of a GEMM: ``src[a:b]`` when no padding is
    due, else copied into ``scratch`` (as many rows as the padded GEMM) with zero padding rows, so
    that a product summed over rows (a weight gradient) adds nothing for them."""
    m = b - a
    if scratch.shape[0] == m:
        return src[a:b]
    scratch[:m].copy_(src[a:b])
    _zero_padding(scratch, m)
    return scratch


def _empty_expert_grad(w_EAB: Tensor, bounds: list[tuple[int, int, int]], like: Tensor) -> Tensor:
    """Pooled gradient buffer for stacked expert weights in ``like``'s (the GEMMs') dtype: experts
    without rows get zeros, the rest is overwritten. Where that is not the weights' dtype,
    :func:`_master_grad` casts it back, so a bf16 weight gradient of fp32 master weights is
    rounded to bf16 first, as autocast's cast-back would round it."""
    grad_EAB = _stack_like(w_EAB, like)
    busy = {e for e, _, _ in bounds}
    for e in range(w_EAB.shape[0]):
        if e not in busy:
            grad_EAB[e].zero_()
    return grad_EAB


def _master_grad(grad_EAB: Tensor | None, w_EAB: Tensor) -> Tensor | None:
    """A weight gradient in the weights' dtype: one cast of the whole stack (into a pooled buffer)
    where it differs.

    Weight gradients come from the pool like the other large buffers: a fresh fp32 stack
    page-faults on every step (autograd keeps it as the weights' ``.grad`` until the optimizer
    drops it, then it goes back to the OS). Held as a ``.grad`` the buffer stays busy, so no
    later step overwrites it."""
    if grad_EAB is None or grad_EAB.dtype == w_EAB.dtype:
        return grad_EAB
    return _stack_like(w_EAB, w_EAB).copy_(grad_EAB)


class _Scratch(NamedTuple):
    """A kernel's per-expert scratch, with rows for its largest expert's padded GEMM
    (:func:`_gemm_rows`); the backward's parts are None in a forward."""

    x: Tensor  # [M, D]: an expert's gathered or padded input rows
    act: Tensor  # [M, H]
    g: Tensor | None = None  # [M, D]: the output gradient's rows
    glu: Tensor | None = None  # [M, H]: silu(gate), or its clamped form
    grad_act: Tensor | None = None  # [M, H]
    grad_h: Tensor | None = None  # [M, 2H]


def _expert_scratch(like: Tensor, hidden: int, bounds: list[tuple[int, int, int]],
                    backward: bool = False) -> _Scratch:
    """The per-expert scratch of a forward (or, ``backward``, a backward) over rows like ``like``."""
    rows = max((_gemm_rows(b - a, like.dtype) for _, a, b in bounds), default=0)
    d_model = like.shape[1]
    forward = (_scratch(like, rows, d_model), _scratch(like, rows, hidden))
    if not backward:
        return _Scratch(*forward)
    return _Scratch(*forward, _scratch(like, rows, d_model), _scratch(like, rows, hidden),
                    _scratch(like, rows, hidden), _scratch(like, rows, 2 * hidden))


def _backward_buffers(like: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, bounds: list[tuple[int, int, int]],
                      need_w13: bool, need_w2: bool) -> tuple[Tensor | None, Tensor | None, _Scratch]:
    """A backward's expert-weight gradients in ``like``'s dtype (None where not needed) and its
    per-expert scratch."""
    grad_w13 = _empty_expert_grad(w13_ED2H, bounds, like) if need_w13 else None
    grad_w2 = _empty_expert_grad(w2_EHD, bounds, like) if need_w2 else None
    return grad_w13, grad_w2, _expert_scratch(like, w2_EHD.shape[1], bounds, backward=True)


def _experts_forward(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, sizes: list[int],
                     limit: float | None) -> tuple[Tensor, Tensor]:
    """SwiGLU experts (clamped at ``limit`` when set) over expert-sorted rows, one expert at a time:
    ``(y_ND, h_N2H)``."""
    hidden = w2_EHD.shape[1]
    bounds = _bounds(sizes)
    num_rows, dtype = x_ND.shape[0], x_ND.dtype
    used = bounds[-1][2] if bounds else 0
    slack = _slack(bounds, dtype)
    h_N2H = _pool.take(num_rows + slack, 2 * hidden, x_ND)
    y_ND = _pool.take(num_rows + slack, w2_EHD.shape[2], x_ND)  # the caller's combine gathers it and lets go
    s = _expert_scratch(x_ND, hidden, bounds)
    w13_ED2H, w2_EHD = _compute_weights(w13_ED2H, x_ND), _compute_weights(w2_EHD, x_ND)
    for e, a, b in bounds:
        p = _gemm_rows(b - a, dtype)  # padding rows: any values, each GEMM row is independent
        h_M2H, act = h_N2H[a:a + p], s.act[:p]
        torch.mm(_padded(x_ND, a, b, s.x[:p]), w13_ED2H[e], out=h_M2H)
        glu_out(h_M2H[:, :hidden], limit, out=act)
        act.mul_(up_term(h_M2H[:, hidden:], limit))
        torch.mm(act, w2_EHD[e], out=y_ND[a:a + p])
    y_ND[used:num_rows].zero_()  # capacity padding: defined zeros, like the loop backend (after any spill)
    return y_ND[:num_rows], h_N2H[:num_rows]


def _experts_backward(grad_ND: Tensor, x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, h_N2H: Tensor,
                      sizes: list[int], need: tuple[bool, bool, bool],
                      limit: float | None) -> tuple[Tensor | None, ...]:
    """Gradients of :func:`_experts_forward` for ``(x, w13, w2)`` (None where ``need`` says no),
    recomputing ``glu(gate)`` and the activation from the saved pre-activation."""
    bounds = _bounds(sizes)
    need_x, need_w13, need_w2 = need
    grad_ND = grad_ND.contiguous()
    hidden, dtype = w2_EHD.shape[1], x_ND.dtype
    num_rows = x_ND.shape[0]
    grad_x = _pool.take(num_rows + _slack(bounds, dtype), x_ND.shape[1], x_ND) if need_x else None
    grad_w13, grad_w2, s = _backward_buffers(x_ND, w13_ED2H, w2_EHD, bounds, need_w13, need_w2)
    w13, w2 = _compute_weights(w13_ED2H, x_ND), _compute_weights(w2_EHD, x_ND)
    for e, a, b in bounds:
        m, p = b - a, _gemm_rows(b - a, dtype)
        h = h_N2H[a:b]
        gate, up = h[:, :hidden], up_term(h[:, hidden:], limit)
        glu, grad_act, grad_h = s.glu[:m], s.grad_act[:p], s.grad_h[:p]
        g = _padded(grad_ND, a, b, s.g[:p])  # zero padding rows: they add nothing to the weight gradients
        glu_out(gate, limit, out=glu)
        torch.mm(g, w2[e].t(), out=grad_act)
        if need_w2:
            act = s.act[:p]
            torch.mul(glu, up, out=act[:m])
            _zero_padding(act, m)
            torch.mm(act.t(), g, out=grad_w2[e])
        up_backward_(torch.mul(grad_act[:m], glu, out=grad_h[:m, hidden:]), h[:, hidden:], limit)
        grad_act[:m].mul_(up)
        glu_backward_out(grad_act[:m], gate, limit, out=grad_h[:m, :hidden])
        _zero_padding(grad_h, m)
        if need_w13:
            torch.mm(_padded(x_ND, a, b, s.x[:p]).t(), grad_h, out=grad_w13[e])
        if need_x:
            torch.mm(grad_h, w13[e].t(), out=grad_x[a:a + p])
    if need_x:  # capacity padding rows get no gradient (zeroed after any spill)
        grad_x[bounds[-1][2] if bounds else 0:num_rows].zero_()
    return ((grad_x[:num_rows] if need_x else None), _master_grad(grad_w13, w13_ED2H),
            _master_grad(grad_w2, w2_EHD))


def _sum_routes(y_ND: Tensor, slot_TK: Tensor, weight_TK: Tensor | None = None) -> Tensor:
    """``out[t] = sum_k weight[t, k] * y[slot[t, k]]`` (weight 1 when None): one ``embedding_bag``
    sum, each token a bag of its K rows (a fused gather-scale-add in every dtype, where a gather
    then a sum over K streams a ``[T, K, D]`` copy and bf16's sum over that middle dimension is slow)."""
    weights = None if weight_TK is None else weight_TK.to(y_ND.dtype)
    return F.embedding_bag(slot_TK, y_ND, mode="sum", per_sample_weights=weights)


def _route_order(idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(order_N, slot_TK, counts_E)``: routes in expert order, the sorted position of route
    ``t*K + k``, and the routes per expert (the forward computes them once; its backward reuses them)."""
    flat_N = idx_TK.reshape(-1)
    order_N = flat_N.argsort(stable=True)
    slot_N = torch.empty_like(order_N)
    slot_N.scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    return order_N, slot_N.view(idx_TK.shape), torch.bincount(flat_N, minlength=num_experts)


def _moe_forward(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
                 limit: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gather -> SwiGLU experts (clamped at ``limit`` when set) -> weighted combine, one expert at a
    time: ``(out_TD, h_N2H)`` and the route order :func:`_route_order` gives, which the backward reuses.

    Per expert e with rows ``a:b`` of the expert-sorted order: gather its tokens into a
    scratch ``[M, D]``, run both GEMMs and the SwiGLU, and write the rows into a pooled
    ``[N, D]`` buffer; one bag sum then adds each token's K rows, scaled by their routing
    weights. Only the ``[N, 2H]`` pre-activation is kept for backward (x is gathered again
    there). The GEMMs run on :func:`_gemm_rows` rows; their padding rows hold whatever the
    scratch held and spill into the next expert's rows, which that expert overwrites.
    """
    hidden, dtype = w2_EHD.shape[1], x_TD.dtype
    order_N, slot_TK, counts_E = _route_order(idx_TK, w13_ED2H.shape[0])
    num_routes = order_N.shape[0]
    token_N = order_N // idx_TK.shape[1]
    bounds = _bounds(counts_E.tolist())
    slack = _slack(bounds, dtype)
    h_N2H = _pool.take(num_routes + slack, 2 * hidden, x_TD)
    y_ND = _pool.take(num_routes + slack, w2_EHD.shape[2], x_TD)
    s = _expert_scratch(x_TD, hidden, bounds)
    w13_ED2H, w2_EHD = _compute_weights(w13_ED2H, x_TD), _compute_weights(w2_EHD, x_TD)
    for e, a, b in bounds:
        m, p = b - a, _gemm_rows(b - a, dtype)
        h, act = h_N2H[a:a + p], s.act[:p]
        torch.index_select(x_TD, 0, token_N[a:b], out=s.x[:m])
        torch.mm(s.x[:p], w13_ED2H[e], out=h)
        glu_out(h[:m, :hidden], limit, out=act[:m])
        act[:m].mul_(up_term(h[:m, hidden:], limit))
        torch.mm(act, w2_EHD[e], out=y_ND[a:a + p])
    return _sum_routes(y_ND[:num_routes], slot_TK, weight_TK), h_N2H[:num_routes], order_N, slot_TK, counts_E


def _moe_backward(grad_TD: Tensor, x_TD: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
                  h_N2H: Tensor, order_N: Tensor, slot_TK: Tensor, counts_E: Tensor,
                  need: tuple[bool, bool, bool, bool], limit: float | None) -> tuple[Tensor | None, ...]:
    """Gradients of :func:`_moe_forward` for ``(x, weight, w13, w2)`` (None where ``need`` says no),
    from its saved pre-activation and route order.

    The routing-weight gradient uses ``<g, act @ w2> = <g @ w2^T, act>``, a product the
    backward computes anyway, so the unweighted expert outputs are never kept. The GEMMs run on
    :func:`_gemm_rows` rows; every operand a weight gradient sums over has zero padding rows.
    """
    need_x, need_w, need_w13, need_w2 = need
    token_N = order_N // slot_TK.shape[1]
    bounds = _bounds(counts_E.tolist())
    dtype, num_routes = x_TD.dtype, order_N.shape[0]
    w_N1 = weight_TK.reshape(-1).index_select(0, order_N).to(dtype).unsqueeze(1)
    grad_TD = grad_TD.contiguous()
    hidden = w2_EHD.shape[1]
    grad_w13, grad_w2, s = _backward_buffers(x_TD, w13_ED2H, w2_EHD, bounds, need_w13, need_w2)
    w13, w2 = _compute_weights(w13_ED2H, x_TD), _compute_weights(w2_EHD, x_TD)
    grad_w_N = w_N1.new_empty(num_routes)
    grad_x_ND = _pool.take(num_routes + _slack(bounds, dtype), x_TD.shape[1], x_TD) if need_x else None
    for e, a, b in bounds:
        m, p = b - a, _gemm_rows(b - a, dtype)
        h, w = h_N2H[a:b], w_N1[a:b]
        gate, up = h[:, :hidden], up_term(h[:, hidden:], limit)
        g, glu, act, grad_act, grad_h = s.g[:p], s.glu[:m], s.act[:p], s.grad_act[:p], s.grad_h[:p]
        torch.index_select(grad_TD, 0, token_N[a:b], out=g[:m])
        _zero_padding(g, m)
        glu_out(gate, limit, out=glu)
        torch.mul(glu, up, out=act[:m])
        _zero_padding(act, m)
        torch.mm(g, w2[e].t(), out=grad_act)  # d out / d act, before the routing weight
        torch.sum(torch.mul(grad_act[:m], act[:m], out=grad_h[:m, :hidden]), dim=1, out=grad_w_N[a:b])
        if need_w2:
            act[:m].mul_(w)
            torch.mm(act.t(), g, out=grad_w2[e])
        grad_act = grad_act[:m].mul_(w)
        up_backward_(torch.mul(grad_act, glu, out=grad_h[:m, hidden:]), h[:, hidden:], limit)
        glu_backward_out(grad_act.mul_(up), gate, limit, out=grad_h[:m, :hidden])
        _zero_padding(grad_h, m)
        if need_w13:
            torch.index_select(x_TD, 0, token_N[a:b], out=s.x[:m])
            _zero_padding(s.x[:p], m)
            torch.mm(s.x[:p].t(), grad_h, out=grad_w13[e])
        if need_x:
            torch.mm(grad_h, w13[e].t(), out=grad_x_ND[a:a + p])
    grad_x = _sum_routes(grad_x_ND[:num_routes], slot_TK) if need_x else None
    grad_weight = None
    if need_w:  # route t*K + k sits at sorted position slot[t, k]
        grad_weight = grad_w_N.index_select(0, slot_TK.reshape(-1)).view(slot_TK.shape).to(weight_TK.dtype)
    return grad_x, grad_weight, _master_grad(grad_w13, w13_ED2H), _master_grad(grad_w2, w2_EHD)


# Custom ops (``moebench::``): torch.compile records each kernel as one opaque call with a fake
# (shape-only) implementation, so a compiled block keeps one graph around it; the host sizes, the
# buffer pool and the per-expert loops run inside the op. The backward is an op of its own.
# A gradient that is not needed comes back as an empty tensor (an op cannot return None).


def _needed(grads: tuple[Tensor | None, ...], like: Tensor) -> tuple[Tensor, ...]:
    return tuple(like.new_empty(0) if g is None else g for g in grads)


def _kept(grads: tuple[Tensor, ...], need: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    return tuple(g if n else None for g, n in zip(grads, need, strict=True))


@torch.library.custom_op("moebench::fused_experts_cpu", mutates_args=())
def _experts_op(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                swiglu_limit: float | None) -> tuple[Tensor, Tensor]:
    return _experts_forward(x_ND, w13_ED2H, w2_EHD, group_sizes(offsets_E).tolist(), swiglu_limit)


@_experts_op.register_fake
def _(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
      swiglu_limit: float | None) -> tuple[Tensor, Tensor]:
    return x_ND.new_empty(x_ND.shape[0], w2_EHD.shape[2]), x_ND.new_empty(x_ND.shape[0], w13_ED2H.shape[2])


@torch.library.custom_op("moebench::fused_experts_cpu_backward", mutates_args=())
def _experts_backward_op(grad_ND: Tensor, x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, h_N2H: Tensor,
                         offsets_E: Tensor, need_x: bool, need_w13: bool, need_w2: bool,
                         swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor]:
    sizes = group_sizes(offsets_E).tolist()
    grads = _experts_backward(grad_ND, x_ND, w13_ED2H, w2_EHD, h_N2H, sizes, (need_x, need_w13, need_w2),
                              swiglu_limit)
    return _needed(grads, x_ND)  # type: ignore[return-value]


@_experts_backward_op.register_fake
def _(grad_ND: Tensor, x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, h_N2H: Tensor, offsets_E: Tensor,
      need_x: bool, need_w13: bool, need_w2: bool, swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(t) if n else t.new_empty(0)  # type: ignore[return-value]
                 for t, n in ((x_ND, need_x), (w13_ED2H, need_w13), (w2_EHD, need_w2)))


def _experts_setup(ctx, inputs: tuple, output: tuple) -> None:
    x_ND, w13_ED2H, w2_EHD, offsets_E, ctx.swiglu_limit = inputs
    ctx.save_for_backward(x_ND, w13_ED2H, w2_EHD, output[1], offsets_E)
    ctx.set_materialize_grads(False)  # h_N2H is saved, never used downstream: no zero gradient for it


def _experts_grad(ctx, grad_ND: Tensor, _grad_h: Tensor | None) -> tuple[Tensor | None, ...]:
    if grad_ND is None:  # the output took no part in the loss
        return None, None, None, None, None
    x_ND, w13_ED2H, w2_EHD, h_N2H, offsets_E = ctx.saved_tensors
    need = tuple(ctx.needs_input_grad[:3])
    grads = _experts_backward_op(grad_ND, x_ND, w13_ED2H, w2_EHD, h_N2H, offsets_E, *need, ctx.swiglu_limit)
    return (*_kept(grads, need), None, None)


_experts_op.register_autograd(_experts_grad, setup_context=_experts_setup)


def fused_experts_cpu(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                      swiglu_limit: float | None = None) -> Tensor:
    """SwiGLU experts (gpt-oss's clamped SwiGLU at ``swiglu_limit``), one expert at a time (reads
    ``offsets_E`` on the host: CPU use only)."""
    with torch.autocast(x_ND.device.type, enabled=False):  # callers already cast to the compute dtype
        return _experts_op(x_ND.contiguous(), w13_ED2H.contiguous(), w2_EHD.contiguous(), offsets_E,
                           swiglu_limit)[0]


@torch.library.custom_op("moebench::fused_moe_cpu", mutates_args=())
def _moe_op(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
            swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _moe_forward(x_TD, idx_TK, weight_TK, w13_ED2H, w2_EHD, swiglu_limit)


@_moe_op.register_fake
def _(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
      swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    routes = idx_TK.new_empty(idx_TK.numel(), dtype=torch.int64)
    return (torch.empty_like(x_TD), x_TD.new_empty(idx_TK.numel(), w13_ED2H.shape[2]), routes,
            torch.empty_like(idx_TK, dtype=torch.int64), idx_TK.new_empty(w13_ED2H.shape[0], dtype=torch.int64))


@torch.library.custom_op("moebench::fused_moe_cpu_backward", mutates_args=())
def _moe_backward_op(grad_TD: Tensor, x_TD: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
                     h_N2H: Tensor, order_N: Tensor, slot_TK: Tensor, counts_E: Tensor, need_x: bool,
                     need_weight: bool, need_w13: bool, need_w2: bool,
                     swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _moe_backward(grad_TD, x_TD, weight_TK, w13_ED2H, w2_EHD, h_N2H, order_N, slot_TK, counts_E,
                          (need_x, need_weight, need_w13, need_w2), swiglu_limit)
    return _needed(grads, x_TD)  # type: ignore[return-value]


@_moe_backward_op.register_fake
def _(grad_TD: Tensor, x_TD: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, h_N2H: Tensor,
      order_N: Tensor, slot_TK: Tensor, counts_E: Tensor, need_x: bool, need_weight: bool, need_w13: bool,
      need_w2: bool, swiglu_limit: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pairs = ((x_TD, need_x), (weight_TK, need_weight), (w13_ED2H, need_w13), (w2_EHD, need_w2))
    return tuple(torch.empty_like(t) if n else x_TD.new_empty(0) for t, n in pairs)  # type: ignore[return-value]


def _moe_setup(ctx, inputs: tuple, output: tuple) -> None:
    x_TD, _, weight_TK, w13_ED2H, w2_EHD, ctx.swiglu_limit = inputs
    ctx.save_for_backward(x_TD, weight_TK, w13_ED2H, w2_EHD, *output[1:])  # h_N2H and the route order
    ctx.set_materialize_grads(False)


def _moe_grad(ctx, grad_TD: Tensor, *_saved_outputs: Tensor | None) -> tuple[Tensor | None, ...]:
    if grad_TD is None:
        return None, None, None, None, None, None
    need_x, _, need_w, need_w13, need_w2 = ctx.needs_input_grad[:5]
    need = (need_x, need_w, need_w13, need_w2)
    grads = _moe_backward_op(grad_TD, *ctx.saved_tensors, *need, ctx.swiglu_limit)
    grad_x, grad_w, grad_w13, grad_w2 = _kept(grads, need)
    return grad_x, None, grad_w, grad_w13, grad_w2, None


_moe_op.register_autograd(_moe_grad, setup_context=_moe_setup)


def fused_moe_cpu(x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor,
                  swiglu_limit: float | None = None) -> Tensor:
    """``out[t] = sum_k weight[t, k] * expert_{idx[t, k]}(x[t])``, dispatch and combine fused in
    (the experts' SwiGLU clamped gpt-oss's way at ``swiglu_limit``).

    Lossless (no capacity). Reads the expert sizes on the host: CPU use only. Its slow twins are
    :class:`moebench.model.moe.LocalDispatcher` with the ``loop`` backend and
    :func:`moebench.model.reference.naive_per_token`.
    """
    with torch.autocast(x_TD.device.type, enabled=False):  # callers already cast to the compute dtype
        return _moe_op(x_TD.contiguous(), idx_TK, weight_TK, w13_ED2H.contiguous(), w2_EHD.contiguous(),
                       swiglu_limit)[0]
