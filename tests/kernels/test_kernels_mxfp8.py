"""MXFP8 / FP8 reference quantizers against an independent float64 model of the OCP MX spec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from moebench.kernels import fp8, mxfp8

# ---------------------------------------------------------------- float64 model of the spec

# Every non-negative finite E4M3FN value, indexed by its 7-bit code (0x7F is NaN).
_E4M3 = np.array([(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                  for e in range(16) for m in range(8)][:127])


def _e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float64 to the nearest E4M3 value, ties to the even code; saturate at 448."""
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(_E4M3, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - _E4M3[lo], _E4M3[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * np.where(pick_hi, _E4M3[hi], _E4M3[lo])


def _model_quantize(x: np.ndarray, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 (dequantized values, scale exponents) per the spec, one block per row of 32."""
    blocks = x.reshape(-1, 32)
    out = np.empty_like(blocks)
    exps = np.empty(len(blocks), dtype=np.int64)
    for i, block in enumerate(blocks):
        amax = np.abs(block).max()
        if amax == 0:
            s = -127
        else:
            s = math.frexp(amax)[1] - 1 - 8  # floor(log2(amax)) - emax(E4M3)
            if rounding == "up" and amax / 2.0**s > 448:
                s += 1
            s = min(max(s, -127), 127)
        exps[i] = s
        out[i] = _e4m3_round(block / 2.0**s) * 2.0**s
    return out.reshape(x.shape), exps.reshape(*x.shape[:-1], -1)


def _blocks(seed: int = 0) -> torch.Tensor:
    """Rows spanning fp32's range: tiny, subnormal, huge, mixed magnitudes within a block."""
    gen = torch.Generator().manual_seed(seed)
    # randn * 3e37 stays finite in fp32
    mags = torch.tensor([1e-44, 1e-40, 1e-30, 1e-8, 1e-3, 1.0, 3.0, 447.0, 449.0, 1e6, 1e30, 3e37])
    rows = torch.randn(len(mags), 64, generator=gen, dtype=torch.float64) * mags[:, None].double()
    wide = torch.randn(4, 64, generator=gen, dtype=torch.float64) * torch.logspace(-6, 6, 64, dtype=torch.float64)
    return torch.cat([rows, wide]).float()


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_matches_float64_spec_model(rounding: str) -> None:
    x = _blocks()
    data, scales = mxfp8.quantize(x, rounding)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert scales.shape == (x.shape[0], x.shape[1] // 32)
    want, want_exp = _model_quantize(x.double().numpy(), rounding)
    got_exp = scales.view(torch.uint8).long().numpy() - 127
    np.testing.assert_array_equal(got_exp, want_exp)
    np.testing.assert_array_equal(mxfp8.dequantize(data, scales, torch.float64).numpy(), want)


@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_error_within_e4m3_step_of_block(rounding: str) -> None:
    x = _blocks(1).double()  # exactly the fp32 values the quantizer sees
    deq = mxfp8.dequantize(*mxfp8.quantize(x.float(), rounding), torch.float64)
    scale = mxfp8.scales_to_float(mxfp8.quantize(x.float(), rounding)[1]).double().repeat_interleave(32, -1)
    v = (x / scale).abs()
    # half an E4M3 step at |v|: steps are 2**(floor(log2 v) - 3) for normals, 2**-9 below 2**-6
    step = torch.where(v >= 2**-6, torch.exp2(torch.floor(torch.log2(v.clamp(min=2**-6))) - 3), torch.tensor(2.0**-9))
    err = (deq - x).abs() / scale
    saturated = v > 448
    assert (err[~saturated] <= step[~saturated] / 2 + 1e-12).all()
    if rounding == "up":
        assert not saturated.any()  # round-up never saturates
    else:
        assert saturated.any()  # the test data does hit the floor mode's top-of-binade overflow
        assert torch.equal(deq[saturated].abs() / scale[saturated], torch.full_like(v[saturated], 448.0))


def test_zero_and_subnormal_blocks() -> None:
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1, 1, 32) * 1e-42  # fp32 subnormals
    data, scales = mxfp8.quantize(x)
    assert (scales.view(torch.uint8) == 0).all()  # 2**-127: the smallest scale
    deq = mxfp8.dequantize(data, scales)
    assert torch.equal(deq[0], torch.zeros(64))
    assert (deq[1, 32:] - x[1, 32:]).abs().max() <= 2.0**-127 * 2**-9  # one E4M3 subnormal step


def test_e4m3_subnormal_elements_in_a_normal_block() -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0
    x[0, 1:9] = torch.tensor([2.0**-9, 3 * 2.0**-10, 2.0**-10, 2.0**-11, 5 * 2.0**-10, 2.0**-7, -2.0**-8, 1e-4])
    deq = mxfp8.dequantize(*mxfp8.quantize(x))  # scale 1: elements land on E4M3's own grid
    want = [2.0**-9, 2 * 2.0**-9, 0.0, 0.0, 2 * 2.0**-9, 2.0**-7, -2.0**-8, 0.0]  # ties go to even
    assert deq[0, 1:9].tolist() == want


def test_huge_and_tiny_blocks_scale_range() -> None:
    x = torch.tensor([[3e38] * 32, [1e-38] * 32])
    data, scales = mxfp8.quantize(x)
    bits = scales.view(torch.uint8).tolist()
    assert bits[0][0] == 127 + 120  # ceil(log2(3e38 / 448)) = 120
    assert bits[1][0] == 0  # floor(log2(1e-38)) - 8 = -135 clamps to E8M0's -127
    torch.testing.assert_close(mxfp8.dequantize(data, scales), x, rtol=1 / 16, atol=0)


def test_nan_inf_policy_voids_the_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 0] = -float("inf")
    data, scales = mxfp8.quantize(x)
    assert scales.view(torch.uint8)[0].tolist() == [255, scales.view(torch.uint8)[0, 1].item()]
    deq = mxfp8.dequantize(data, scales)
    assert deq[0, :32].isnan().all() and deq[0, 32:].isfinite().all()
    assert deq[1, 32:].isnan().all() and deq[1, :32].isfinite().all()
    assert deq[2, :32].isnan().all()


def test_bf16_input_and_leading_dims() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 96).bfloat16()
    data, scales = mxfp8.quantize(x)
    assert data.shape == x.shape and scales.shape == (2, 3, 3)
    err = (mxfp8.dequantize(data, scales) - x.float()).abs()
    assert (err <= 16 * mxfp8.scales_to_float(scales).repeat_interleave(32, -1)).all()


def test_bad_shapes_and_rounding() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.quantize(torch.randn(4, 30))
    with pytest.raises(ValueError, match="rounding"):
        mxfp8.quantize(torch.randn(4, 32), rounding="nearest")
    with pytest.raises(ValueError, match="floating-point"):
        mxfp8.quantize(torch.ones(4, 32, dtype=torch.int32))


def test_pack_unpack_round_trip_and_byte_count() -> None:
    x = torch.randn(5, 256)
    data, scales = mxfp8.quantize(x)
    packed = mxfp8.pack(data, scales)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 256 + 8) == (5, mxfp8.packed_row_bytes(256))
    d2, s2 = mxfp8.unpack(packed, 256)
    assert torch.equal(d2.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    assert mxfp8.packed_row_bytes(2048) / (2 * 2048) == pytest.approx(33 / 64)  # vs bf16 rows
    with pytest.raises(ValueError):
        mxfp8.unpack(packed, 128)
    wire = mxfp8.encode_rows(x)
    assert torch.equal(wire, packed)
    assert torch.equal(mxfp8.decode_rows(wire, 256, torch.float32), mxfp8.dequantize(data, scales))


def test_fake_quantize_along_other_dim() -> None:
    w = torch.randn(3, 64, 16)
    got = mxfp8.fake_quantize(w, dim=-2)
    want = mxfp8.dequantize(*mxfp8.quantize(w.transpose(1, 2))).transpose(1, 2)
    assert torch.equal(got, want)


def test_fp8_rowwise_power_of_two_scales() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 40) * torch.logspace(-20, 20, 6)[:, None]
    x[5] = 0.0
    data, scale = fp8.quantize_rowwise(x)
    assert scale.shape == (6, 1) and data.dtype == torch.float8_e4m3fn
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    assert (data.float().abs().amax(-1)[:5] > 224).all()  # top binade used, no saturation
    deq = fp8.dequantize_rowwise(data, scale)
    assert ((deq - x).abs() <= 16 * scale).all()  # half of E4M3's largest step (32) in row units
    _, cols_scale = fp8.quantize_rowwise(x.T.contiguous(), dim=0)
    assert cols_scale.shape == (1, 6)
    bad = x.clone()
    bad[1, 2] = float("inf")
    assert fp8.fake_quantize_rowwise(bad)[1].isnan().all()


# ---------------------------------------------------------------- fake tensors: one custom op a quantizer


class _Ops(TorchDispatchMode):
    """The ops dispatched below it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _meta(tensors) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 96)])
def test_fake_quantizers_make_the_reference_shapes_and_dtypes(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.bfloat16)

    def run(t: torch.Tensor) -> list[torch.Tensor]:
        data, scales = mxfp8.quantize(t, "floor")
        rows = t.reshape(-1, t.shape[-1])
        return [data, scales, mxfp8.dequantize(data, scales, torch.bfloat16), mxfp8.dequantize(data, scales),
                mxfp8.encode_rows(rows), mxfp8.decode_rows(mxfp8.encode_rows(rows), t.shape[-1])]

    real = run(x)
    with FakeTensorMode() as mode:
        fake = run(mode.from_tensor(x))
    assert all(is_fake(t) for t in fake)
    assert _meta(fake) == _meta(real)


def test_fake_quantizer_is_one_op_and_real_one_is_the_reference() -> None:
    x = torch.randn(8, 64)
    with _Ops() as real:
        data, scales = mxfp8.quantize(x)
        mxfp8.dequantize(data, scales)
    assert not any(name.startswith("moebench.") for name in real.names)  # eager real tensors: the reference itself
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        with _Ops() as fake:
            data, scales = mxfp8.quantize(fx)
            mxfp8.dequantize(data, scales)
    assert fake.names == ["moebench.mxfp8_quantize.default", "moebench.mxfp8_dequantize.default"]
