"""Quantized expert GEMMs as the trainer runs them (:mod:`moebench.kernels.quantized_gemm`):
which GEMMs are quantized, the operand buffers each one materialises, and the HBM traffic of
its quantize / dequantize passes, for the ``native`` and the ``emulated`` implementation.

Legend: N expert-side rows of one chunk on one rank (capacity padding included), D model dim,
H expert hidden, E local experts (``num_experts / ep``); c compute-dtype bytes, q bytes of one
quantized element with its share of the scales (:attr:`Precision.quant_bytes`).

Per MoE layer both operands of these GEMMs are quantized along their reduction dim: the
forward ``x [N, D] @ w13 [E, D, 2H]`` and ``act [N, H] @ w2 [E, H, D]``, their input
gradients ``grad [N, 2H] @ w13^T`` and ``grad [N, D] @ w2^T``, and in ``fp8`` also their
weight gradients ``x^T @ grad`` and ``act^T @ grad`` (reduced over the tokens of each expert;
MXFP8 keeps those in the compute dtype). Autograd saves the compute-dtype operands, which bf16
saves too, so what quantization adds to memory is transient, one GEMM at a time, the first
operand quantized first:

- ``native`` (``torch._scaled_grouped_mm``): both operands as E4M3 data + scales (q per
  element); a weight gradient also lays both out token-major (another q per element);
- ``emulated``: both operands dequantized into compute-dtype copies (c per element) for a
  compute-dtype grouped GEMM, each copy written while its E4M3 form is alive.

In both, a forward GEMM first copies its weight K-major in the compute dtype for the quantizer.

HBM traffic counts each pass reading its input and writing its output once: quantize (c in,
q out), dequantize (q in, c out), the forward's K-major weight copy (c in, c out), the native
weight gradient's token-major copies (zero-filled, then q in, q out). Not modelled, in time or
memory: the fp32 intermediates inside the torch quantize / dequantize helpers, and the scales'
blocked (swizzled) copies of native MXFP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.config import Config
from moebench.plan.precision import Precision
from moebench.plan.stages import Stage, expert_rows_per_chunk, kept_route_share

# modes whose weight-gradient GEMMs are quantized too (moebench.kernels.quantized_gemm: MXFP8's
# 32-blocks along the token dim would need every expert group padded to 32 rows)
QUANTIZED_WEIGHT_GRAD = ("fp8",)


@dataclass(frozen=True)
class QuantizedGemm:
    """One quantized expert GEMM of one MoE layer, for one chunk on one rank."""

    first: float  # elements of the operand quantized first: [N, K] rows (a weight gradient's saved input)
    second: float  # elements of the other: the weight [E, K, M] (a weight gradient's output gradient)
    kind: str  # forward | input_grad | weight_grad


def layer_gemms(cfg: Config, prec: Precision) -> list[QuantizedGemm]:
    """The quantized GEMMs of one MoE layer: forward, input gradients, then weight gradients."""
    n, d, h = expert_rows_per_chunk(cfg), cfg.model.d_model, cfg.moe.expert_hidden
    e = cfg.moe.num_experts // cfg.parallel.ep
    w13, w2 = e * d * 2 * h, e * h * d
    gemms = [QuantizedGemm(n * d, w13, "forward"), QuantizedGemm(n * h, w2, "forward"),
             QuantizedGemm(n * 2 * h, w13, "input_grad"), QuantizedGemm(n * d, w2, "input_grad")]
    if prec.mode in QUANTIZED_WEIGHT_GRAD:
        gemms += [QuantizedGemm(n * d, n * 2 * h, "weight_grad"), QuantizedGemm(n * h, n * d, "weight_grad")]
    return gemms


def operand_bytes(prec: Precision, gemm: QuantizedGemm) -> float:
    """Peak bytes of one GEMM's quantized / dequantized operand buffers."""
    c, q = prec.compute_bytes, prec.quant_bytes
    x, y = gemm.first, gemm.second
    if prec.impl == "native":
        # both E4M3 forms, plus the forward weight's K-major copy (alive while it is quantized)
        # or the weight gradient's token-major E4M3 copies (alive during the GEMM)
        extra = {"forward": c * y, "weight_grad": q * (x + y)}.get(gemm.kind, 0.0)
        return q * (x + y) + extra
    # the first operand dequantized (its E4M3 form still alive), then the second the same way;
    # the forward's K-major copy (c) is freed before the weight's dequantized copy is written
    return max((q + c) * x, c * x + (q + c) * y)


def peak_operand_bytes(cfg: Config, prec: Precision, stage: Stage) -> float:
    """The largest quantized GEMM's operand buffers on one rank of ``stage`` (0 unquantized)."""
    if not (prec.quantized and stage.n_moe):
        return 0.0
    return max(operand_bytes(prec, g) for g in layer_gemms(cfg, prec))


def _traffic_bytes(prec: Precision, gemm: QuantizedGemm) -> float:
    c, q = prec.compute_bytes, prec.quant_bytes
    operands = gemm.first + gemm.second
    total = (c + q) * operands  # quantize
    if prec.impl == "emulated":
        total += (q + c) * operands  # dequantize
    elif gemm.kind == "weight_grad":
        total += 3 * q * operands  # token-major copies: zero fill, then read and write
    if gemm.kind == "forward":
        total += 2 * c * gemm.second  # the weight's K-major copy
    return total


def traffic_bytes_per_chunk(cfg: Config, prec: Precision, stage: Stage) -> float:
    """HBM bytes of the quantize / dequantize passes of one chunk on one rank of ``stage``
    (per-layer recompute runs the forward GEMMs twice)."""
    if not (prec.quantized and stage.n_moe):
        return 0.0
    forwards = 2 if cfg.parallel.activation_checkpointing == "per-layer" else 1
    per_layer = sum(_traffic_bytes(prec, g) * (forwards if g.kind == "forward" else 1)
                    for g in layer_gemms(cfg, prec))
    return stage.n_moe * per_layer


def quantized_flops_per_token(cfg: Config, prec: Precision, stage: Stage) -> float:
    """Expert GEMM FLOPs per token that run quantized: of the 6 FLOPs per weight, 2 for each of
    the forward (twice under per-layer recompute), the input gradient, and in fp8 the weight
    gradient; routes dropped over capacity are not computed."""
    if not prec.quantized:
        return 0.0
    forwards = 2 if cfg.parallel.activation_checkpointing == "per-layer" else 1
    backwards = 2 if prec.mode in QUANTIZED_WEIGHT_GRAD else 1
    return stage.expert_flops_per_token * kept_route_share(cfg) * (forwards + backwards) / 3
