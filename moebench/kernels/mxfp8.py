"""MXFP8 (OCP Microscaling, E4M3 elements): the torch reference quantizer.

Shapes: ``x_ND`` any ``[..., D]`` tensor, D a multiple of 32; B = D // 32 blocks per row.

Every block of 32 consecutive elements of the last dimension shares one power-of-two scale
``2**s`` stored as E8M0 (``torch.float8_e8m0fnu``: the biased exponent ``s + 127`` in one
byte, 0xFF is NaN); each element is stored as E4M3 (``torch.float8_e4m3fn``, max 448,
subnormals down to 2**-9, no infinities). ``x ~= data * 2**s``.

Scale rounding (``rounding=``):

- ``"up"`` (default, the "RCEIL" of NVIDIA's recipe): the smallest ``s`` with
  ``amax / 2**s <= 448``, i.e. ``s = ceil(log2(amax / 448))``. Nothing saturates; the block's
  largest element uses the top binade of E4M3.
- ``"floor"`` (the OCP MX v1.0 reference conversion): ``s = floor(log2(amax)) - 8`` (8 is the
  largest E4M3 exponent). Keeps one more bit of range for small elements, but elements whose
  scaled magnitude lands in (448, 512) saturate to 448 (up to 12.5% relative error on them).

``s`` is clamped to E8M0's range [-127, 127]. All-zero blocks get ``s = -127``.

NaN/Inf policy: E4M3FN has no infinity. A block that contains any NaN or +-Inf gets the NaN
scale (0xFF), so the *whole block* dequantizes to NaN. Non-finite input is never turned into a
finite number silently; a training run that produces one sees NaN loss.

Transport: :func:`pack` lays each row out as ``D`` data bytes followed by ``D // 32`` scale
bytes, ``D + D // 32 = 33 D / 32`` bytes per row (bf16 needs ``2 D``: 0.516x the bytes).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2**8
E8M0_BIAS = 127
E8M0_NAN = 255

Rounding = Literal["up", "floor"]
ROUNDINGS: tuple[str, ...] = ("up", "floor")


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"mxfp8 rounding must be one of {', '.join(ROUNDINGS)}; got {rounding!r}")


def check_last_dim(x: Tensor) -> None:
    """ValueError unless ``x`` is floating point with a last dimension that is a multiple of 32."""
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP8 needs the last dimension to be a multiple of {BLOCK}; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"MXFP8 quantizes floating-point tensors; got {x.dtype}")


def scale_exponent(amax: Tensor, rounding: str = "up") -> Tensor:
    """Unbiased int32 block exponent ``s`` for fp32 block maxima ``amax`` (finite, >= 0).

    Exact (no ``log2`` rounding): ``frexp`` gives ``floor(log2(amax))``, and the "up" correction
    compares the exactly rescaled ``amax`` with 448.
    """
    check_rounding(rounding)
    _, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    s = (exponent - 1 - E4M3_EMAX).to(torch.int32)  # floor(log2(amax)) - 8; amax / 2**s in [256, 512)
    if rounding == "up":
        s = s + (torch.ldexp(amax, -s) > E4M3_MAX).to(torch.int32)
    s = torch.where(amax > 0, s, torch.full_like(s, -E8M0_BIAS))
    return s.clamp(-E8M0_BIAS, E8M0_BIAS)


def scale_to_e4m3(x: Tensor, amax: Tensor, rounding: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(data float8_e4m3fn, s int32, finite bool)``: fp32 ``x`` times ``2**-s``, cast to E4M3.

    ``amax`` holds the fp32 maxima of ``|x|`` over each scaling group, broadcastable to ``x``
    (reduced with ``keepdim``); ``s`` and ``finite`` have its shape. A non-finite group gets
    ``s`` as if it were zero; callers give it a NaN scale. Shared by MXFP8 and rowwise FP8.
    """
    finite = torch.isfinite(amax)
    s = scale_exponent(torch.where(finite, amax, torch.zeros_like(amax)), rounding)
    # Power-of-two scaling is exact in fp32, so the one rounding is the cast to E4M3
    # (round to nearest even). Clamp first: "floor" overflows 448, and the cast must not see it.
    data = torch.ldexp(x, -s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, s, finite


def shape_only(x: Tensor) -> bool:
    """Whether ``x`` is a fake tensor outside a compiler's trace: a quantizer then runs as one custom op
    (:func:`quantize`, :func:`dequantize`), whose fake implementation makes its outputs' shapes and dtypes
    and nothing else. A dry run (:mod:`moebench.train.dry_run`) dispatches each op of the torch reference
    through the fake-tensor, FLOP-counter and memory-tracker modes, tens of ops an operand; a compiler's
    trace keeps the reference's ops, which it can fuse."""
    return is_fake(x) and not torch.compiler.is_compiling()


def quantize(x: Tensor, rounding: str = "up") -> tuple[Tensor, Tensor]:
    """Quantize along the last dimension: ``(data float8_e4m3fn [..., D], scales float8_e8m0fnu [..., D/32])``."""
    check_last_dim(x)
    check_rounding(rounding)
    if shape_only(x):
        return _quantize_op(x, rounding)
    return _quantize_reference(x, rounding)


def _quantize_reference(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # [..., B, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN propagates; Inf stays Inf
    data, s, finite = scale_to_e4m3(blocks, amax, rounding)
    s, finite = s.squeeze(-1), finite.squeeze(-1)
    bits = torch.where(finite, s + E8M0_BIAS, torch.full_like(s, E8M0_NAN)).to(torch.uint8)
    return data.flatten(-2), bits.view(torch.float8_e8m0fnu)


def scales_to_float(scales: Tensor) -> Tensor:
    """E8M0 scales as fp32 ``2**s`` (NaN for 0xFF)."""
    bits = scales.view(torch.uint8).to(torch.int32)
    values = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - E8M0_BIAS)
    return torch.where(bits == E8M0_NAN, torch.full_like(values, float("nan")), values)


def dequantize(data: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize`: ``data * 2**s`` per block, returned as ``dtype``."""
    if data.shape[:-1] != scales.shape[:-1] or data.shape[-1] != scales.shape[-1] * BLOCK:
        raise ValueError(f"data {tuple(data.shape)} and scales {tuple(scales.shape)} do not match 32-blocks")
    if shape_only(data):
        return _dequantize_op(data, scales, dtype)
    return _dequantize_reference(data, scales, dtype)


def _dequantize_reference(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    blocks = data.float().unflatten(-1, (-1, BLOCK)) * scales_to_float(scales).unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


# The quantizers as custom ops, for fake tensors (shape_only): one dispatch each, the reference as the
# real implementation. The fake ones allocate the outputs alone, as the GPU's Triton quantizer does
# (moebench.kernels.mxfp8_triton), where the reference also holds fp32 copies of its input for a moment.
@torch.library.custom_op("moebench::mxfp8_quantize", mutates_args=())
def _quantize_op(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    return _quantize_reference(x, rounding)


@_quantize_op.register_fake
def _(x: Tensor, rounding: str) -> tuple[Tensor, Tensor]:
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    return data, torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.float8_e8m0fnu, device=x.device)


@torch.library.custom_op("moebench::mxfp8_dequantize", mutates_args=())
def _dequantize_op(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    return _dequantize_reference(data, scales, dtype)


@_dequantize_op.register_fake
def _(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty(data.shape, dtype=dtype, device=data.device)


def packed_row_bytes(d: int) -> int:
    """Bytes per row of :func:`pack` for a last dimension ``d``: ``d + d // 32``."""
    if d % BLOCK:
        raise ValueError(f"MXFP8 rows need a multiple of {BLOCK} elements; got {d}")
    return d + d // BLOCK


def pack(data: Tensor, scales: Tensor) -> Tensor:
    """One uint8 ``[N, D + D/32]`` buffer (data bytes, then scale bytes) for sending rows."""
    return torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def unpack(packed: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """Split a :func:`pack` buffer back into ``(data, scales)`` for a last dimension ``d``."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != packed_row_bytes(d):
        raise ValueError(
            f"expected uint8 rows of {packed_row_bytes(d)} bytes; got {packed.dtype} {tuple(packed.shape)}"
        )
    data = packed[..., :d].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., d:].contiguous().view(torch.float8_e8m0fnu)
    return data, scales


def encode_rows(x_ND: Tensor, rounding: str = "up") -> Tensor:
    """Quantize ``[N, D]`` rows and pack them for sending: uint8 ``[N, D + D/32]``."""
    return pack(*quantize(x_ND, rounding))


def decode_rows(packed: Tensor, d: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Inverse of :func:`encode_rows` on the receiving side: ``[N, D]`` in ``dtype``."""
    return dequantize(*unpack(packed, d), dtype=dtype)


def fake_quantize(x: Tensor, rounding: str = "up", dim: int = -1) -> Tensor:
    """``dequantize(quantize(x))`` with blocks along ``dim``, in ``x``'s dtype (no gradient rule)."""
    moved = x.movedim(dim, -1)
    return dequantize(*quantize(moved, rounding), dtype=x.dtype).movedim(-1, dim)
