"""Triton kernels against their torch twins, on CPU tensors under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before triton is imported, and must not leak into other
tests; so without it set, this module's one test re-runs the module in a child pytest with
``TRITON_INTERPRET=1``. With it set (the child, or a developer running it directly), the
kernel tests below run in-process.

Interpreter limits worked around here (triton 3.9): ``tl.dot`` on bf16 operands multiplies the
raw uint16 bit patterns, so GEMM tests use fp32 and fp16 on CPU (bf16 is covered by the GPU
tests); E4M3 conversion mishandles subnormals, which is why the MXFP8 kernel encodes E4M3 in
integer arithmetic (and is then bit-exact here); the FP8 rowwise kernel reuses that encoder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":

    @pytest.mark.slow
    def test_triton_kernels_under_interpreter() -> None:
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        summary = proc.stdout.strip().splitlines()[-1]
        assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]

else:
    from moebench.kernels import fp8, fp8_group_triton, fp8_triton, grouped_gemm, mxfp8, mxfp8_triton
    from moebench.kernels.expert_backends import expert_backend, experts_loop
    from moebench.kernels.permute import (
        destination_rows,
        permute,
        permute_reference,
        unpermute,
        unpermute_reference,
    )
    from moebench.model.moe import LocalDispatcher
    from moebench.model.triton_dispatch import TritonLocalDispatcher

    def _offsets(counts: list[int]) -> torch.Tensor:
        return torch.tensor(counts).cumsum(0).to(torch.int32)

    def _loop_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """float64 per-group reference; padding rows are zero."""
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            out[start:end] = a[start:end].double() @ b[e].double()
            start = end
        return out

    # ------------------------------------------------------------ MXFP8 quantize kernel

    @pytest.mark.parametrize("rounding", ["up", "floor"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_mxfp8_kernel_bit_exact(rounding: str, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(21, 96, generator=gen) * torch.logspace(-40, 38, 21)[:, None]
        x[3, 5], x[4, 40], x[5] = float("nan"), -float("inf"), 0.0
        x[6, :32] = 1e-42
        x = x.to(dtype)
        d_ref, s_ref = mxfp8.quantize(x, rounding)
        d_tri, s_tri = mxfp8_triton.quantize(x, rounding, block_g=16)
        assert d_tri.dtype == torch.float8_e4m3fn and s_tri.dtype == torch.float8_e8m0fnu
        assert torch.equal(s_tri.view(torch.uint8), s_ref.view(torch.uint8))
        nan = d_ref.float().isnan()
        assert torch.equal(d_tri.float().isnan(), nan)
        assert torch.equal(d_tri.view(torch.uint8)[~nan], d_ref.view(torch.uint8)[~nan])

    def test_mxfp8_kernel_empty_and_3d() -> None:
        d, s = mxfp8_triton.quantize(torch.empty(0, 64))
        assert d.shape == (0, 64) and s.shape == (0, 2)
        x = torch.randn(2, 3, 64)
        assert torch.equal(mxfp8_triton.quantize(x)[1].view(torch.uint8), mxfp8.quantize(x)[1].view(torch.uint8))
        with pytest.raises(ValueError):
            mxfp8_triton.quantize(torch.randn(3, 33))
        with pytest.raises(ValueError, match="floating-point"):
            mxfp8_triton.quantize(torch.ones(3, 32, dtype=torch.int32))

    # ------------------------------------------------------------ FP8 rowwise quantize kernel

    def _rowwise_cases(dtype: torch.dtype, k: int, seed: int) -> torch.Tensor:
        """Rows spanning the dtype's range (fp32: 2**-140..2**120), plus zero, subnormal and
        non-finite rows and row maxima on both sides of the 448 * 2**s boundary."""
        gen = torch.Generator().manual_seed(seed)
        info = torch.finfo(dtype)
        lo, hi = torch.tensor(info.tiny).log2().item() - 14, torch.tensor(info.max).log2().item() - 8
        x = torch.randn(24, k, generator=gen) * torch.exp2(torch.linspace(lo, hi, 24))[:, None]
        x[2] = 0.0
        x[3] = -0.0
        x[4] = torch.randn(k, generator=gen) * 1e-42  # fp32 subnormals (bf16 keeps some, fp16 flushes)
        x[5, k // 2] = float("nan")
        x[6, -1] = -float("inf")
        x[7, 0], x[7, 1] = float("inf"), float("nan")
        x[8, k - 1] = 14.0  # 1.75 * 2**3: mantissa field exactly 0x600000, s = -5
        x[9, 0] = torch.nextafter(torch.tensor(14.0), torch.tensor(20.0))  # just above: s = -4
        x[10, 1] = info.max  # the largest exponent the scale reaches
        x[11, :] = 1e-30
        x[11, -2] = 3e4  # one large element: the rest of the row flushes to E4M3 zero
        return x.to(dtype)

    def _assert_rowwise_equal(x: torch.Tensor, **kwargs) -> None:
        d_ref, s_ref = fp8.quantize_rowwise(x, dim=-1)
        d_tri, s_tri = fp8_triton.quantize_rowwise(x, **kwargs)
        assert d_tri.dtype == torch.float8_e4m3fn and s_tri.dtype == torch.float32
        assert d_tri.shape == x.shape and s_tri.shape == (*x.shape[:-1], 1)
        assert torch.equal(s_tri.view(torch.int32), s_ref.view(torch.int32))  # NaN and 2**-127 bits too
        assert torch.equal(d_tri.view(torch.uint8), d_ref.view(torch.uint8))

    @pytest.mark.parametrize("k, block_k", [(40, 4096), (40, 16), (1000, 4096), (1000, 256), (64, 64)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_fp8_rowwise_kernel_bit_exact(k: int, block_k: int, dtype: torch.dtype) -> None:
        """One chunk per row (block_k >= K) and the two-pass path over ragged chunks."""
        _assert_rowwise_equal(_rowwise_cases(dtype, k, seed=k), block_k=block_k)

    def test_fp8_rowwise_kernel_random_shapes() -> None:
        gen = torch.Generator().manual_seed(4)
        for _ in range(6):
            rows, k = (int(v) for v in torch.randint(1, 300, (2,), generator=gen))
            block_k = 2 ** int(torch.randint(3, 10, (1,), generator=gen))
            x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-140, 120, (rows, 1), generator=gen))
            _assert_rowwise_equal(x, block_k=block_k)

    def test_fp8_rowwise_kernel_3d_empty_and_bad_input() -> None:
        x = _rowwise_cases(torch.float32, 40, seed=2).view(2, 12, 40)
        _assert_rowwise_equal(x)
        _assert_rowwise_equal(x.transpose(0, 1))  # non-contiguous input
        _assert_rowwise_equal(x.double())
        _assert_rowwise_equal(torch.empty(0, 40))
        _assert_rowwise_equal(torch.empty(2, 0, 40))
        with pytest.raises(ValueError, match="floating-point"):
            fp8_triton.quantize_rowwise(torch.ones(3, 32, dtype=torch.int32))
        with pytest.raises(ValueError, match="non-empty last dimension"):
            fp8_triton.quantize_rowwise(torch.ones(3, 0))
        with pytest.raises(ValueError, match="power of two"):
            fp8_triton.quantize_rowwise(torch.ones(3, 32), block_k=48)

    # ------------------------------------------------------------ FP8 per-group column quantize kernel

    def _assert_group_columns_equal(x: torch.Tensor, offsets: torch.Tensor, rows: int) -> None:
        """Token-major data against the reference transposed (first offsets[-1] rows), zeros past
        them; the scale bit for bit (NaN and 2**-127 too)."""
        d_ref, s_ref = fp8.quantize_group_columns(x, offsets)
        d_tri, s_tri = fp8_group_triton.quantize_group_columns_t(x, offsets, rows)
        assert d_tri.dtype == torch.float8_e4m3fn and s_tri.dtype == torch.float32
        assert d_tri.shape == (x.shape[1], rows) and s_tri.shape == (offsets.numel(), x.shape[1])
        assert d_tri.view(torch.uint8).is_contiguous()
        assert torch.equal(s_tri.view(torch.int32), s_ref.view(torch.int32))
        n = int(offsets[-1])
        assert torch.equal(d_tri.view(torch.uint8)[:, :n], d_ref.view(torch.uint8)[:n].t())
        assert not d_tri.view(torch.uint8)[:, n:].any()

    def _group_cases(dtype: torch.dtype, counts: list[int], pad: int, k: int, seed: int) -> torch.Tensor:
        """Rows spanning the dtype's range, and columns that are zero, subnormal, NaN, Inf or hit the
        448 * 2**s boundary within one group; padding rows are large so that leaking them shows."""
        gen = torch.Generator().manual_seed(seed)
        info = torch.finfo(dtype)
        lo, hi = torch.tensor(info.tiny).log2().item() - 14, torch.tensor(info.max).log2().item() - 8
        n = sum(counts) + pad
        x = torch.randn(n, k, generator=gen) * torch.exp2(torch.empty(n, 1).uniform_(lo, hi, generator=gen))
        first = counts[0]  # the first row of group 1
        x[:, 0] = 0.0
        x[:, 1] = torch.randn(n, generator=gen) * 1e-42
        x[first, 2] = float("nan")
        x[first, 3] = -float("inf")
        x[:, 4] = 1.0
        x[first, 4] = 14.0  # 1.75 * 2**3: mantissa field exactly 0x600000, s = -5
        x[:, 5] = 1e-30
        x[first, 5] = torch.nextafter(torch.tensor(14.0), torch.tensor(20.0))  # just above: s = -4
        x[first, 6] = info.max
        x[sum(counts):] = 1e4
        return x.to(dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_fp8_group_columns_kernel_bit_exact(dtype: torch.dtype) -> None:
        """Groups longer than both row tiles (32 and 128), one-row and empty groups, a padding tail
        past offsets[-1] and columns past the 64/128-column blocks."""
        counts = [3, 200, 0, 1, 0, 70, 1]
        x = _group_cases(dtype, counts, pad=9, k=150, seed=7)
        rows = -(-x.shape[0] // 16) * 16
        _assert_group_columns_equal(x, _offsets(counts), rows)
        _assert_group_columns_equal(x, _offsets(counts), rows + 48)  # a wider pad is zero too

    def test_fp8_group_columns_kernel_random_offsets() -> None:
        gen = torch.Generator().manual_seed(8)
        for _ in range(6):
            e, k = int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 200, (1,), generator=gen))
            counts = torch.randint(0, 90, (e,), generator=gen) * (torch.rand(e, generator=gen) > 0.3)
            pad = int(torch.randint(0, 20, (1,), generator=gen))
            n = int(counts.sum()) + pad
            x = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-140, 120, (n, 1), generator=gen))
            _assert_group_columns_equal(x, counts.cumsum(0).to(torch.int32), -(-n // 16) * 16)

    def test_fp8_group_columns_kernel_edges_and_bad_input() -> None:
        offsets = _offsets([5, 0, 11])
        x = _group_cases(torch.float32, [5, 0, 11], pad=0, k=40, seed=9)
        _assert_group_columns_equal(x.double(), offsets, 16)
        _assert_group_columns_equal(x.t().contiguous().t(), offsets, 16)  # non-contiguous input
        _assert_group_columns_equal(torch.empty(0, 40), _offsets([0, 0]), 0)
        _assert_group_columns_equal(torch.empty(0, 40), _offsets([0, 0]), 16)
        d, s = fp8_group_triton.quantize_group_columns_t(torch.empty(16, 0), offsets, 16)
        assert d.shape == (0, 16) and s.shape == (3, 0)
        with pytest.raises(ValueError, match="floating-point"):
            fp8_group_triton.quantize_group_columns_t(torch.ones(16, 8, dtype=torch.int32), offsets, 16)
        with pytest.raises(ValueError, match="at least"):
            fp8_group_triton.quantize_group_columns_t(x, offsets, 8)
        with pytest.raises(ValueError, match="non-empty 1-D"):
            fp8_group_triton.quantize_group_columns_t(x, offsets[:0], 16)

    @pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
    def test_quantized_gemm_on_triton_backend_matches_torch(fmt: str) -> None:
        """Emulated quantized GEMMs through the Triton grouped GEMMs (mm, dgrad, wgrad) equal torch's."""
        from moebench.kernels.quantized_gemm import quantized_grouped_mm

        gen = torch.Generator().manual_seed(6)
        offsets = torch.tensor([0, 7, 40, 40, 45], dtype=torch.int32)
        a = torch.randn(48, 64, generator=gen)
        w = torch.randn(5, 64, 32, generator=gen)
        grad = torch.randn(48, 32, generator=gen)
        grads = {}
        for backend in ("triton", "grouped_mm"):
            a_, w_ = a.clone().requires_grad_(), w.clone().requires_grad_()
            out = quantized_grouped_mm(a_, w_, offsets, fmt, "emulated", backend=backend)
            out.backward(grad)
            grads[backend] = (out[:45], a_.grad[:45], w_.grad)
        for got, want in zip(grads["triton"], grads["grouped_mm"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32, different summation order

    # ------------------------------------------------------------ grouped GEMM

    CASES = [
        [0, 7, 33, 0, 5],  # empty experts, ragged sizes
        [16, 16, 16],  # tile-aligned
        [0, 0, 0],  # nothing routed
        [1],  # one expert, one row
        [40, 0, 0, 2, 0, 9, 1, 0, 3],  # odd expert count (E_POW2 padding)
    ]

    @pytest.mark.parametrize("counts", CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_grouped_mm_forward_and_grads(counts: list[int], dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(len(counts))
        k_dim, n_dim, pad = 40, 24, 5
        offsets = _offsets(counts)
        m = int(offsets[-1]) + pad
        a = torch.randn(m, k_dim, generator=gen).to(dtype).requires_grad_()
        b = torch.randn(len(counts), k_dim, n_dim, generator=gen).to(dtype).requires_grad_()
        out = grouped_gemm.triton_grouped_mm(a, b, offsets)
        grad = torch.randn(m, n_dim, generator=gen).to(dtype)
        out.backward(grad)

        a64 = a.detach().double().requires_grad_()
        b64 = b.detach().double().requires_grad_()
        ref = _loop_mm(a64, b64, offsets)
        ref.backward(grad.double())
        # fp32: ieee dot, only summation order differs. fp16: output rounding, 2**-11 relative.
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        scale = ref.abs().max().item() + 1
        assert (out.double() - ref).abs().max() <= tol * scale
        assert torch.equal(out[int(offsets[-1]):], torch.zeros(pad, n_dim, dtype=dtype))  # padding rows zero
        assert (a.grad.double() - a64.grad).abs().max() <= tol * (a64.grad.abs().max() + 1)
        assert torch.equal(a.grad[int(offsets[-1]):], torch.zeros(pad, k_dim, dtype=dtype))
        assert (b.grad.double() - b64.grad).abs().max() <= tol * (b64.grad.abs().max() + 1)
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(b.grad[e], torch.zeros_like(b.grad[e]))  # empty expert: zero grad

    def test_grouped_mm_ops_are_registered_with_their_backward() -> None:
        """``moebench::triton_grouped_mm`` and its wgrad op pass torch's opcheck schema and
        autograd-registration checks (their gradients: the test above). opcheck's fake-tensor
        checks need a GPU: the interpreter runs a kernel even on fake tensors; the CUDA test in
        tests/model/test_compile_graph_breaks.py compiles a triton block instead."""
        offsets = _offsets([3, 0, 6])
        a, b = torch.randn(11, 16, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True)
        checks = ("test_schema", "test_autograd_registration")
        for op, args in ((grouped_gemm._grouped_mm_op, (a, b, offsets)),
                         (grouped_gemm._grouped_wgrad_op, (a.detach(), torch.randn(11, 8), offsets))):
            assert set(torch.library.opcheck(op, args, test_utils=checks).values()) == {"SUCCESS"}

    def test_grouped_mm_rejects_bad_input() -> None:
        with pytest.raises(ValueError, match="one entry per expert"):
            grouped_gemm.grouped_mm_fwd(torch.randn(4, 8), torch.randn(2, 8, 8), _offsets([4]))
        with pytest.raises(ValueError, match="share a dtype"):
            grouped_gemm.grouped_mm_fwd(torch.randn(4, 8), torch.randn(1, 8, 8).half(), _offsets([4]))

    @pytest.mark.parametrize("swiglu_limit", [None, 0.5])  # 0.5: many O(1) pre-activations clamped
    def test_triton_backend_matches_loop_backend(swiglu_limit: float | None) -> None:
        assert expert_backend("triton") is grouped_gemm.experts_triton
        gen = torch.Generator().manual_seed(3)
        d, h, counts = 32, 16, [3, 0, 20, 1]
        offsets = _offsets(counts)
        x = torch.randn(sum(counts) + 2, d, generator=gen)
        w13 = torch.randn(4, d, 2 * h, generator=gen) / d**0.5
        w2 = torch.randn(4, h, d, generator=gen) / h**0.5
        params = [t.clone().requires_grad_() for t in (x, w13, w2)]
        ref_params = [t.clone().requires_grad_() for t in (x, w13, w2)]
        out = grouped_gemm.experts_triton(*params, offsets, swiglu_limit=swiglu_limit)
        ref = experts_loop(*ref_params, offsets, swiglu_limit=swiglu_limit)
        n = int(offsets[-1])
        torch.testing.assert_close(out[:n], ref[:n], rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(ref)
        grad[n:] = 0  # padding outputs are don't-care; give them no gradient
        out.backward(grad)
        ref.backward(grad)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.grad[:n] if p.ndim == 2 else p.grad, q.grad[:n] if q.ndim == 2 else q.grad,
                                       rtol=1e-5, atol=1e-5)

    # ------------------------------------------------------------ permute / unpermute

    @pytest.mark.parametrize("shape", [(13, 3, 200, 6), (1, 1, 8, 1), (9, 2, 129, 16)])
    def test_dispatcher_matches_local_dispatcher(shape: tuple[int, int, int, int]) -> None:
        t, k, d, e = shape
        gen = torch.Generator().manual_seed(t)
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        x = torch.randn(t, d, generator=gen)
        w = torch.rand(t, k, generator=gen)
        y = torch.randn(t * k, d, generator=gen)
        g = torch.randn(t, d, generator=gen)
        results = []
        for dispatcher in (LocalDispatcher(), TritonLocalDispatcher()):
            xs, ws, ys = (v.clone().requires_grad_() for v in (x, w, y))
            disp = dispatcher.dispatch(xs, idx, e)
            out = dispatcher.combine(ys, ws, disp)
            loss = (out * g).sum() + (disp.x_ND * y).sum()
            results.append((disp.x_ND.detach(), disp.offsets_E, out.detach(), *torch.autograd.grad(loss, [xs, ws, ys])))
        ref, got = results
        assert torch.equal(got[0], ref[0])  # permute copies rows: bit-exact
        assert torch.equal(got[1], ref[1])
        for r, q in zip(ref[2:], got[2:], strict=True):
            torch.testing.assert_close(q, r, rtol=1e-5, atol=1e-5)

    def test_dropped_routes_and_padding_rows() -> None:
        gen = torch.Generator().manual_seed(7)
        t, k, d, e = 10, 2, 48, 4
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        dest, _ = destination_rows(idx, e)
        dest[0, 1] = -1
        dest[6, 0] = -1
        rows = t * k + 3  # capacity padding
        x = torch.randn(t, d, generator=gen, dtype=torch.float16)
        got = permute(x, dest, rows)
        assert torch.equal(got, permute_reference(x, dest, rows))
        assert torch.equal(got[t * k:], torch.zeros(3, d, dtype=torch.float16))
        y = torch.randn(rows, d, generator=gen)
        w = torch.rand(t, k, generator=gen, requires_grad=True)
        ys = y.clone().requires_grad_()
        out = unpermute(ys, dest, w)
        torch.testing.assert_close(out, unpermute_reference(y, dest, w.detach()), rtol=1e-6, atol=1e-6)
        out.sum().backward()
        assert w.grad[0, 1] == 0 and w.grad[6, 0] == 0
        assert torch.equal(ys.grad[t * k:], torch.zeros(3, d))  # unrouted rows get no gradient
