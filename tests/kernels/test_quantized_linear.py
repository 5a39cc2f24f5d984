"""Quantized dense linears: the expert GEMMs' rule with one group, native (under a model of
torch._scaled_mm's contract) against its emulated twin, and what is saved for backward."""

from __future__ import annotations

import pytest
import torch
from scaled_mm_model import scaled_mm_model

from moebench.kernels.quantized_gemm import quantized_grouped_mm
from moebench.kernels.quantized_linear import quantized_linear

T, K, M = 80, 128, 96


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    # rows and output features spanning 2**-8 .. 2**8: a scale applied to the wrong row or column shows
    x = torch.randn(T, K, generator=gen) * torch.logspace(-8, 8, T, base=2)[:, None]
    w = torch.randn(M, K, generator=gen) * torch.logspace(-8, 8, M, base=2)[:, None]
    grad = torch.randn(T, M, generator=gen)
    return x.to(dtype), w.to(dtype), grad.to(dtype)


def _run(fn, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x_, w_)
    out.backward(grad)
    return out, x_.grad, w_.grad


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_linear_is_the_grouped_rule_with_one_group(fmt: str, saved: str) -> None:
    """Emulated in fp32: forward and both gradients equal the grouped GEMM's with offsets [T]
    (same quantized values; only the matmul kernels differ, so fp32 rounding apart)."""
    x, w, grad = _operands(torch.float32)
    offsets = torch.tensor([T], dtype=torch.int32)
    got = _run(lambda a, b: quantized_linear(a, b, fmt, saved=saved, rounding="floor"), x, w, grad)
    want = _run(lambda a, b: quantized_grouped_mm(a, b.t()[None], offsets, fmt, saved=saved, rounding="floor"),
                x, w, grad)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    plain = _run(lambda a, b: a @ b.t(), x, w, grad)
    quantized = [_relative_error(g, p) > 1e-3 for g, p in zip(got, plain, strict=True)]
    # every GEMM quantized, but MXFP8's weight gradient on the unquantized x when "compute" is saved
    assert quantized == [True, True, not (fmt == "mxfp8" and saved == "compute")]


@pytest.mark.parametrize("saved", ["quantized", "compute"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_operands_under_kernel_model_match_emulation(fmt: str, saved: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_model)
    x, w, grad = _operands(torch.bfloat16)
    native = _run(lambda a, b: quantized_linear(a, b, fmt, "native", saved=saved), x, w, grad)
    emulated = _run(lambda a, b: quantized_linear(a, b, fmt, "emulated", saved=saved), x, w, grad)
    for got, want in zip(native, emulated, strict=True):
        # the same quantized products rounded to bf16, accumulated in another order
        assert _relative_error(got, want) < 1e-2


def test_leading_dims_and_saved_tensors() -> None:
    """[B, S, K] inputs; saved="quantized" keeps E4M3 forms (and scales) only, "compute" the bf16 inputs."""
    x, w, _ = _operands(torch.bfloat16)
    x = x.view(2, T // 2, K).requires_grad_()
    w.requires_grad_()
    for saved, kinds in (("quantized", {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int32}),
                         ("compute", {torch.bfloat16, torch.int32})):
        dtypes = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            dtypes.add(t.dtype)  # noqa: B023 - read right away, within this iteration
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = quantized_linear(x, w, "mxfp8", saved=saved)
        assert out.shape == (2, T // 2, M) and dtypes == kinds
        out.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_native_call_meets_torch_meta_contract(fmt: str) -> None:
    """torch's own checks of _scaled_mm's shapes, strides and scale sizes accept the native operands."""
    x = torch.empty(300, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(384, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = quantized_linear(x, w, fmt, "native")
    assert out.shape == (300, 384) and out.dtype == torch.bfloat16
    out.backward(torch.empty_like(out))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_native_probe_for_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-GEMM probe behind gemm_impl(..., "linear"): a faithful kernel passes, a wrong one fails."""
    from moebench.kernels.quantized import native_agrees

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_model)
    assert native_agrees("fp8", cpu, "linear") and native_agrees("mxfp8", cpu, "linear")
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: scaled_mm_model(*args, **kwargs) * 1.5)
    assert not native_agrees("fp8", cpu, "linear") and not native_agrees("mxfp8", cpu, "linear")
    with pytest.raises(ValueError, match="kind"):
        native_agrees("fp8", cpu, "conv")


@pytest.mark.parametrize("saved", ["quantized", "compute"])
def test_mxfp8_on_fake_tensors_makes_the_real_shapes_and_dtypes(saved: str) -> None:
    """A dry run's fake tensors take the quantizers' custom ops (one op each, outputs only): the
    layer's output and both gradients come out as the reference's do."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    x, w, grad = _operands(torch.bfloat16)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return quantized_linear(a, b, "mxfp8", saved=saved)

    real = _run(fn, x, w, grad)
    with FakeTensorMode() as mode:
        fake = _run(fn, *(mode.from_tensor(t) for t in (x, w, grad)))
    assert all(is_fake(t) for t in fake)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
