"""Quantized grouped GEMMs: the blocked scale layout, the gradient rule, and the native path's
operands checked against a model of the kernel's contract (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scaled_mm_model import (
    DeviceAssert,
    blocked_index,
    check_contract,
    scaled_grouped_mm_meta_only,
    scaled_grouped_mm_model,
)

from moebench.kernels import fp8, mxfp8
from moebench.kernels.quantized_gemm import (
    aligned_groups,
    emulated_mm,
    fp8_group_columns_t,
    native_mm,
    quantize_dequantize,
    quantized_grouped_mm,
    token_rows,
)
from moebench.kernels.scale_layout import blocked, grouped_blocked
from moebench.testing import forbid_host_sync

# ragged groups: empty experts, a group past one 128-row tile, and 9 padding rows at the end
SIZES = [0, 37, 150, 0, 5, 1]
PADDING = 9


def _offsets() -> torch.Tensor:
    return torch.tensor(SIZES).cumsum(0).to(torch.int32)


def _e8m0(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(1, 255, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("rows,blocks", [(1, 1), (127, 3), (128, 4), (300, 9)])
def test_blocked_layout_matches_cublas_formula(rows: int, blocks: int) -> None:
    scales = _e8m0((rows, blocks), torch.Generator().manual_seed(rows))
    out = blocked(scales)
    assert out.dtype == torch.float8_e8m0fnu and out.shape == (-(-rows // 128) * 128, -(-blocks // 4) * 4)
    flat, raw = out.view(torch.uint8).flatten(), scales.view(torch.uint8)
    used = torch.zeros_like(flat, dtype=torch.bool)
    for i in range(rows):
        for j in range(blocks):
            idx = blocked_index(i, j, blocks)
            assert flat[idx] == raw[i, j]
            used[idx] = True
    assert (flat[~used] == 0).all()  # padding is zero, and every scale landed on its own byte


def test_grouped_blocked_pads_each_group_to_whole_tiles() -> None:
    offsets = _offsets()
    n = int(offsets[-1]) + PADDING
    scales = _e8m0((n, 4), torch.Generator().manual_seed(3))
    got = grouped_blocked(scales, offsets).view(torch.uint8).flatten()
    # the reference: lay out each non-empty group on its own, then concatenate (the kernel's view)
    ends = offsets.tolist()
    parts = [blocked(scales[s:e]).view(torch.uint8).flatten()
             for s, e in zip([0, *ends[:-1]], ends, strict=True) if e > s]
    want = torch.cat(parts)
    assert got.numel() >= want.numel()
    assert torch.equal(got[:want.numel()], want)


def _operands(k: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(k + m)
    n = sum(SIZES) + PADDING
    # rows and experts spanning 2**-12 .. 2**12: a scale applied to the wrong row or block shows
    a = torch.randn(n, k, generator=gen) * torch.logspace(-12, 12, n, base=2)[:, None]
    b = torch.randn(len(SIZES), k, m, generator=gen) * torch.logspace(-12, 12, len(SIZES), base=2)[:, None, None]
    grad = torch.randn(n, m, generator=gen)
    return a.to(dtype), b.to(dtype), grad.to(dtype)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_operands_under_kernel_model_match_emulation(fmt: str, saved: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The native path, with a model of torch._scaled_grouped_mm in place of the kernel, computes
    what its emulated twin computes: forward and both gradients, under both saving policies."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_model)
    offsets = _offsets()
    rows = int(offsets[-1])
    a, b, grad = _operands(128, 96, torch.bfloat16)
    results = {}
    for impl in ("native", "emulated"):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = quantized_grouped_mm(a_, b_, offsets, fmt, impl, saved=saved)
        out.backward(grad)
        results[impl] = (out[:rows], a_.grad[:rows], b_.grad)
    for got, want in zip(results["native"], results["emulated"], strict=True):
        # both round the same quantized products to bf16; they differ in accumulation order and the
        # emulation's bf16 rounding of the dequantized operands (exact: E4M3 x 2**s fits bf16)
        assert _relative_error(got, want) < 1e-2
    # and a wrong layout would not pass: the untouched bf16 product is farther off than that
    plain = F.grouped_mm(a, b, offs=offsets)[:rows]
    assert _relative_error(results["native"][0], plain) > 1e-3


@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_gradient_rule_against_composition(fmt: str, saved: str) -> None:
    """Emulated: out = Q(a) Q(b); grad_a = Q(g) Q(b^T) along M; grad_b = Q(a)^T Q(g) per group
    and column for fp8; for mxfp8 deq(Q(a))^T g with Q along K when the quantized operands are
    saved, a^T g when the compute-dtype ones are."""
    offsets = _offsets()
    a, b, grad = _operands(64, 32, torch.float32)
    a.requires_grad_()
    b.requires_grad_()
    out = quantized_grouped_mm(a, b, offsets, fmt, "emulated", rounding="floor", saved=saved)
    out.backward(grad)
    fake = fp8.fake_quantize_rowwise if fmt == "fp8" else (lambda x, dim: mxfp8.fake_quantize(x, "floor", dim))
    a0, b0 = a.detach(), b.detach()
    want_out = F.grouped_mm(fake(a0, dim=-1), fake(b0, dim=-2), offs=offsets)
    want_ga = F.grouped_mm(fake(grad, dim=-1), fake(b0.transpose(1, 2), dim=-2), offs=offsets)
    if fmt == "fp8":  # per (expert group, column) scales along the token dim
        a_q, g_q = (fp8.dequantize_group_columns(*fp8.quantize_group_columns(t, offsets), offsets) for t in (a0, grad))
        want_gb = F.grouped_mm(a_q.t(), g_q, offs=offsets)
    elif saved == "quantized":  # the forward's Q(a), blocks along K
        want_gb = F.grouped_mm(fake(a0, dim=-1).t(), grad, offs=offsets)
    else:
        want_gb = F.grouped_mm(a0.t(), grad, offs=offsets)
    rows = int(offsets[-1])
    torch.testing.assert_close(out[:rows], want_out[:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad[:rows], want_ga[:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, want_gb, rtol=1e-5, atol=1e-5)
    assert not torch.equal(a.grad[:rows], F.grouped_mm(grad, b0.transpose(1, 2), offs=offsets)[:rows])


def _saved_for_backward(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("impl", ["native", "emulated"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_quantized_saving_keeps_only_e4m3_operands(fmt: str, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """saved="quantized": autograd holds E4M3 data (1 byte per element of a and b) and their
    scales, never a compute-dtype copy of either; saved="compute" holds the bf16 inputs."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_model)
    offsets = _offsets()
    a, b, _ = _operands(128, 96, torch.bfloat16)
    a.requires_grad_()
    b.requires_grad_()
    quantized = _saved_for_backward(lambda: quantized_grouped_mm(a, b, offsets, fmt, impl))
    compute = _saved_for_backward(lambda: quantized_grouped_mm(a, b, offsets, fmt, impl, saved="compute"))
    assert [t.dtype for t in compute] == [torch.int32, torch.bfloat16, torch.bfloat16]
    data = [t for t in quantized if t.dtype == torch.float8_e4m3fn]
    assert sum(t.numel() for t in data) >= a.numel() + b.numel()  # native fp8 pads the token dim to 16
    assert not any(t.dtype == torch.bfloat16 for t in quantized)
    nbytes = sum(t.untyped_storage().nbytes() for t in quantized[1:])
    assert nbytes < 0.6 * (a.nbytes + b.nbytes)  # E4M3 + scales against bf16


def test_quantize_dequantize_and_argument_errors() -> None:
    x = torch.randn(4, 64)
    assert torch.equal(quantize_dequantize(x, "mxfp8", -1), mxfp8.fake_quantize(x))
    assert torch.equal(quantize_dequantize(x, "fp8", 0), fp8.fake_quantize_rowwise(x, dim=0))
    offsets = torch.tensor([4], dtype=torch.int32)
    w = torch.randn(1, 64, 32)
    with pytest.raises(ValueError, match="format"):
        quantized_grouped_mm(x, w, offsets, "int4")
    with pytest.raises(ValueError, match="impl"):
        quantized_grouped_mm(x, w, offsets, "fp8", "fast")
    with pytest.raises(ValueError, match="rounding"):
        quantized_grouped_mm(x, w, offsets, "mxfp8", rounding="nearest")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_call_meets_torch_meta_contract(fmt: str) -> None:
    """torch's own shape/dtype/stride/scale-size checks accept the native operands (meta tensors: no GPU)."""
    a = torch.empty(300, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(4, 256, 384, device="meta", dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.empty(4, device="meta", dtype=torch.int32)
    out = quantized_grouped_mm(a, w, offsets, fmt, "native")
    assert out.shape == (300, 384) and out.dtype == torch.bfloat16
    out.backward(torch.empty_like(out))
    assert a.grad.shape == a.shape and w.grad.shape == w.shape
    if fmt == "fp8":
        with pytest.raises(RuntimeError, match="16 bytes"):  # what apply_expert_precision guards against
            native_mm(torch.empty(80, 40, device="meta", dtype=torch.bfloat16),
                      torch.empty(4, 40, 48, device="meta", dtype=torch.bfloat16), offsets, fmt)


def test_aligned_groups_move_each_group_to_a_16_row_start_without_a_sync() -> None:
    """Every group starts at a multiple of 16 rows, holds its own rows in order, zeros in between,
    and is never empty (16 zero rows); capacity padding keeps its place after the last group;
    offsets computed on the device."""
    offsets = _offsets()
    x = torch.arange(1, sum(SIZES) + PADDING + 1, dtype=torch.float32)[:, None].repeat(1, 3)
    with forbid_host_sync():
        out, aligned = aligned_groups(x, offsets)
    assert aligned.dtype == torch.int32 and out.shape == (x.shape[0] + 16 * len(SIZES), 3)
    ends, new_ends = offsets.tolist(), aligned.tolist()
    assert all(e % 16 == 0 for e in new_ends)
    assert all(e - s >= 16 for s, e in zip([0, *new_ends[:-1]], new_ends, strict=True))
    for g, n in enumerate(SIZES):
        start, new_start = ends[g] - n, new_ends[g] - max(-(-n // 16) * 16, 16)
        assert torch.equal(out[new_start:new_start + n], x[start:start + n])
        assert (out[new_start + n:new_ends[g]] == 0).all()
    tail = x[ends[-1]:]
    assert torch.equal(out[new_ends[-1]:new_ends[-1] + len(tail)], tail)
    assert out.sum() == x.sum()  # nothing lost, nothing written twice


def test_kernel_model_refuses_unaligned_weight_gradient_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model raises where the kernel would assert on the device: the 2-D x 2-D weight gradient
    at real (unaligned) routing sizes, unless the groups are aligned first."""
    offsets = _offsets()
    a, _, grad = _operands(32, 48, torch.bfloat16)
    rows = token_rows(a.shape[0])
    (a_data, a_scale), (g_data, g_scale) = (fp8_group_columns_t(t, offsets, rows) for t in (a, grad))
    with pytest.raises(DeviceAssert, match="multiple of 16"):
        scaled_grouped_mm_model(a_data, g_data.t(), a_scale.flatten(), g_scale.flatten(), offs=offsets,
                                out_dtype=torch.bfloat16)
    (a_al, offs_al), (g_al, _) = aligned_groups(a, offsets), aligned_groups(grad, offsets)
    rows = token_rows(a_al.shape[0])
    (a_data, a_scale), (g_data, g_scale) = (fp8_group_columns_t(t, offs_al, rows) for t in (a_al, g_al))
    got = scaled_grouped_mm_model(a_data, g_data.t(), a_scale.flatten(), g_scale.flatten(), offs=offs_al,
                                  out_dtype=torch.bfloat16)
    assert got.shape == (len(SIZES), 32, 48)


def test_emulated_mm_defaults_to_torch_grouped_gemm() -> None:
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    a, b = torch.randn(8, 32), torch.randn(2, 32, 16)
    want = F.grouped_mm(mxfp8.fake_quantize(a), mxfp8.fake_quantize(b, dim=-2), offs=offsets)
    torch.testing.assert_close(emulated_mm(a, b, offsets, "mxfp8"), want)


def test_blocked_batches_leading_dims() -> None:
    scales = _e8m0((3, 130, 5), torch.Generator().manual_seed(9))
    got = blocked(scales).view(torch.uint8)
    for e in range(3):
        assert torch.equal(got[e], blocked(scales[e]).view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_quantized_paths_do_not_sync(fmt: str) -> None:
    """Offsets stay on the device: the emulated GEMM, its gradients and the blocked scale layout."""
    offsets = _offsets()
    a, b, grad = _operands(64, 32, torch.float32)
    a.requires_grad_()
    scales = _e8m0((a.shape[0], 2), torch.Generator().manual_seed(1))
    with forbid_host_sync():
        quantized_grouped_mm(a, b, offsets, fmt).backward(grad)
        grouped_blocked(scales, offsets)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_path_does_not_sync(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native GEMMs and their gradients prepare every operand on the device: the weight
    gradient's aligned groups and offsets, the blocked scales (the kernel: meta checks only)."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_meta_only)
    offsets = _offsets()
    a, b, grad = _operands(64, 32, torch.bfloat16)
    a.requires_grad_(), b.requires_grad_()
    with forbid_host_sync():
        quantized_grouped_mm(a, b, offsets, fmt, "native").backward(grad)
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def _fp8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


def _ones(*shape: int) -> torch.Tensor:
    return torch.ones(shape)


def _offs(*ends: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(ends, dtype=dtype)


def test_kernel_model_enforces_torch_grouped_gemm_contract() -> None:
    """What torch checks before and while it prepares a grouped GEMM, each raised by the model:
    the meta kernel (offsets dtype, scale dtypes and sizes, strides) as RuntimeError, the
    preparation kernel's per-group rules as DeviceAssert."""
    model = scaled_grouped_mm_model
    a_t, g_t = _fp8(32, 48), _fp8(24, 48)  # 2-D x 2-D: [K, tokens] x [tokens, M], tokens contiguous in both
    wgrad = {"scale_a": _ones(3 * 32), "scale_b": _ones(3 * 24), "out_dtype": torch.bfloat16}
    assert model(a_t, g_t.t(), offs=_offs(16, 32, 48), **wgrad).shape == (3, 32, 24)
    with pytest.raises(RuntimeError, match="int32"):
        model(a_t, g_t.t(), offs=_offs(16, 32, 48, dtype=torch.int64), **wgrad)
    with pytest.raises(RuntimeError, match="float32"):
        model(a_t, g_t.t(), offs=_offs(16, 32, 48), **{**wgrad, "scale_b": wgrad["scale_b"].bfloat16()})
    with pytest.raises(RuntimeError, match="elements"):
        model(a_t, g_t.t(), offs=_offs(16, 32, 48), **{**wgrad, "scale_a": _ones(32)})
    with pytest.raises(RuntimeError, match="column major"):
        model(a_t, g_t.t().contiguous(), offs=_offs(16, 32, 48), **wgrad)
    with pytest.raises(DeviceAssert, match="multiple of 16"):  # routing's sizes: the bug aligned_groups fixes
        model(a_t, g_t.t(), offs=_offs(5, 5, 48), **wgrad)
    model(a_t, g_t.t(), offs=_offs(16, 32, 37), **wgrad)  # the last group may be ragged
    with pytest.raises(DeviceAssert, match="greater than 0"):  # an empty group, aligned or not
        model(a_t, g_t.t(), offs=_offs(16, 16, 48), **wgrad)
    with pytest.raises(DeviceAssert, match="greater or equal 0"):
        model(a_t, g_t.t(), offs=_offs(32, 16, 48), **wgrad)
    with pytest.raises(DeviceAssert, match="less than tensor size"):
        model(a_t, g_t.t(), offs=_offs(16, 32, 64), **wgrad)
    # 2-D x 3-D (forward, input gradient): the ragged dim is A's rows, not its contiguous dim, so
    # any group sizes are fine, empty ones included
    x, w = _fp8(40, 32), _fp8(3, 16, 32)
    fwd = {"scale_a": _ones(40), "scale_b": _ones(3, 16), "out_dtype": torch.bfloat16}
    assert model(x, w.transpose(-2, -1), offs=_offs(5, 5, 37), **fwd).shape == (40, 16)
    with pytest.raises(RuntimeError, match="16 bytes"):  # K of 24 E4M3: rows not 16-byte aligned
        model(_fp8(40, 24), _fp8(3, 16, 24).transpose(-2, -1), offs=_offs(5, 5, 37), **fwd)
    # 3-D x 2-D (not used by moebench): the ragged dim is the output's contiguous one, 8 bf16 columns
    w3, y = _fp8(3, 16, 32), _fp8(20, 32).t()
    check_contract(w3, y, _ones(3, 16), _ones(20), _offs(8, 8, 20), torch.bfloat16)
    with pytest.raises(DeviceAssert, match="output tensor"):
        check_contract(w3, y, _ones(3, 16), _ones(20), _offs(5, 10, 20), torch.bfloat16)


def test_group_columns_equal_rowwise_quantization_of_each_group() -> None:
    offsets = _offsets()
    a, _, _ = _operands(16, 8, torch.float32)
    a[40, 3] = float("nan")  # group 2 (rows 37..186), column 3
    data, scale = fp8.quantize_group_columns(a, offsets)
    assert scale.shape == (len(SIZES), 16)
    ends = offsets.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end == start:
            continue
        want_data, want_scale = fp8.quantize_rowwise(a[start:end], dim=0)  # one scale per column
        torch.testing.assert_close(scale[g], want_scale[0], rtol=0, atol=0, equal_nan=True)
        nan = want_data.float().isnan()
        assert torch.equal(data[start:end].view(torch.uint8)[~nan], want_data.view(torch.uint8)[~nan])
    assert scale[2, 3].isnan() and not scale[2, :3].isnan().any()
    back = fp8.dequantize_group_columns(data, scale, offsets)
    assert torch.equal(back[ends[-1]:], torch.zeros_like(back[ends[-1]:]))  # padding rows


def test_native_probe_accepts_a_faithful_kernel_and_rejects_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe behind precision_impl, on CPU with stand-in kernels: the contract model passes;
    a kernel that raises or computes something else means emulated; no_grad callers are fine."""
    from moebench.kernels.quantized import native_agrees

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_model)
    with torch.no_grad():
        assert native_agrees("fp8", cpu) and native_agrees("mxfp8", cpu)

    def off_by_a_scale(*args, **kwargs):
        return scaled_grouped_mm_model(*args, **kwargs) * 1.5

    def refuses(*args, **kwargs):
        raise RuntimeError("unsupported layout")

    for kernel in (off_by_a_scale, refuses):
        monkeypatch.setattr(torch, "_scaled_grouped_mm", kernel)
        assert not native_agrees("fp8", cpu) and not native_agrees("mxfp8", cpu)


def test_sliced_quantizers_are_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMMs' quantizers work through slices of rows (bounded fp32 intermediates): the same
    bytes as one pass of the references, for rows, blocks and per-(group, column) scales across
    group boundaries."""
    from moebench.kernels import quantized_gemm

    offsets = _offsets()
    a, b, _ = _operands(64, 32, torch.bfloat16)
    monkeypatch.setattr(quantized_gemm, "CHUNK_ELEMENTS", 7 * 64)  # 7-row slices of a, one expert of b at a time
    for fmt, (quantize, dequantize) in {"fp8": (fp8.quantize_rowwise, fp8.dequantize_rowwise),
                                        "mxfp8": (mxfp8.quantize, mxfp8.dequantize)}.items():
        for t in (a, b):
            data, scale = quantized_gemm.quantize_rows(t, fmt)
            want_data, want_scale = quantize(t)
            assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
            assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
            assert torch.equal(quantized_gemm.dequantize_rows(data, scale, fmt, torch.bfloat16),
                               dequantize(want_data, want_scale, torch.bfloat16))
    want = fp8.quantize_group_columns(a, offsets)
    data, scale = fp8.quantize_group_columns(a, offsets, chunk_rows=7)
    assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])
    assert torch.equal(fp8.dequantize_group_columns(data, scale, offsets, chunk_rows=7),
                       fp8.dequantize_group_columns(*want, offsets))
