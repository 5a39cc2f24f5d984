"""Quantized GEMMs as the trainer runs them (:mod:`moebench.kernels.quantized_gemm`,
:mod:`moebench.kernels.quantized_linear`): which GEMMs are quantized, the operand buffers each one
materialises, the HBM traffic of its quantize / dequantize passes, and what the quantized GEMMs
save for backward, for the ``native`` and the ``emulated`` implementation.

Legend: N expert-side rows of one chunk on one rank (capacity padding included), T tokens of one
chunk, D model dim, H expert hidden, E local experts (``num_experts / ep``); c compute-dtype
bytes, q bytes of one quantized element with its share of the scales
(:attr:`Precision.quant_bytes`).

Which GEMMs (``precision.scope``): ``experts``, per MoE layer the forward ``x [N, D] @ w13 [E, D,
2H]`` and ``act [N, H] @ w2 [E, H, D]``; ``linear``, also per layer the attention projections
``[T, D] @ wqkv`` and ``[T, Hq hd] @ wo``, and the dense FFN (dense layers) or shared expert (MoE
layers) ``[T, D] @ w13``, ``[T, Hd] @ w2``. Each with its input gradient ``grad @ w^T``, and in
``fp8`` also its weight gradient ``x^T @ grad`` (reduced over the tokens; MXFP8 keeps those in the
compute dtype). Both operands of each are quantized along its reduction dim.

Saved for backward (``precision.saved_activations``): ``compute`` keeps the compute-dtype operands
(what bf16 saves); ``quantized`` keeps, per GEMM, its input as the weight gradient reads it (fp8:
per column along the tokens; MXFP8: the forward's own E4M3 operand) and the weight quantized along
its output dim, q bytes per element instead of c (:func:`saved_bytes_factor`,
:func:`quantized_params_local`). What quantization adds to memory is otherwise transient, one GEMM
at a time, the first operand quantized first:

- ``native`` (``torch._scaled_grouped_mm`` / ``torch._scaled_mm``): both operands as E4M3 data +
  scales (q per element); a weight gradient also lays both out token-major (another q per element);
- ``emulated``: both operands dequantized into compute-dtype copies (c per element) for a
  compute-dtype GEMM, each copy written while its E4M3 form is alive.

An operand that is saved (MXFP8's forward input and every weight-gradient input when ``quantized``;
the input gradient's weight likewise) is not transient: it is counted with the saved tensors. A
native forward GEMM also copies its weight K-major in the compute dtype for the quantizer.

HBM traffic counts each pass reading its input and writing its output once: quantize (c in, q
out), dequantize (q in, c out), the forward's K-major weight copy (c in, c out), the native weight
gradient's token-major copies (zero-filled, then q in, q out). The saving policy moves quantize
passes between forward and backward without changing their number. Not modelled, in time or
memory: the quantizers' fp32 intermediates (off CUDA the trainer bounds them by quantizing slices of rows),
and the scales' blocked (swizzled) copies of native MXFP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.config import Config
from moebench.plan.precision import Precision
from moebench.plan.stages import Stage, expert_rows_per_chunk, kept_route_share, micro_batching

# modes whose weight-gradient GEMMs are quantized too (moebench.kernels.quantized_gemm: MXFP8's
# 32-blocks along the token dim would need every expert group padded to 32 rows)
QUANTIZED_WEIGHT_GRAD = ("fp8",)


@dataclass(frozen=True)
class QuantizedGemm:
    """One quantized GEMM of one layer, for one chunk on one rank."""

    first: float  # elements of the operand quantized first: [rows, K] (a weight gradient's saved input)
    second: float  # elements of the other: the weight [E, K, M] (a weight gradient's output gradient)
    kind: str  # forward | input_grad | weight_grad


def _matmul_gemms(prec: Precision, rows: float, k: int, m: int, weight: float) -> list[QuantizedGemm]:
    """The quantized GEMMs of one ``[rows, K] @ [K, M]`` matmul (``weight`` elements) and its gradients."""
    gemms = [QuantizedGemm(rows * k, weight, "forward"), QuantizedGemm(rows * m, weight, "input_grad")]
    if prec.mode in QUANTIZED_WEIGHT_GRAD:
        gemms.append(QuantizedGemm(rows * k, rows * m, "weight_grad"))
    return gemms


def layer_gemms(cfg: Config, prec: Precision) -> list[QuantizedGemm]:
    """The quantized expert GEMMs of one MoE layer: forward, input gradient and (fp8) weight gradient
    of w13, then of w2."""
    n, d, h = expert_rows_per_chunk(cfg), cfg.model.d_model, cfg.moe.expert_hidden
    e = cfg.moe.num_experts // cfg.parallel.ep
    return _matmul_gemms(prec, n, d, 2 * h, e * d * 2 * h) + _matmul_gemms(prec, n, h, d, e * h * d)


def _ffn_gemms(cfg: Config, prec: Precision, hidden: int) -> list[QuantizedGemm]:
    t, d = micro_batching(cfg).tokens_per_chunk, cfg.model.d_model
    if not hidden:
        return []
    return _matmul_gemms(prec, t, d, 2 * hidden, d * 2 * hidden) + _matmul_gemms(prec, t, hidden, d, hidden * d)


def linear_gemms(cfg: Config, prec: Precision, moe: bool) -> list[QuantizedGemm]:
    """The quantized dense-linear GEMMs of one layer under ``precision.scope=linear`` (none
    otherwise): attention projections, then the dense FFN or the shared expert."""
    if not prec.linears_quantized:
        return []
    m, t = cfg.model, micro_batching(cfg).tokens_per_chunk
    q, kv = m.n_heads * m.hd, m.n_kv_heads * m.hd
    qkv = q + 2 * kv
    attention = (_matmul_gemms(prec, t, m.d_model, qkv, m.d_model * qkv)
                 + _matmul_gemms(prec, t, q, m.d_model, q * m.d_model))
    return attention + _ffn_gemms(cfg, prec, cfg.moe.shared_expert_hidden if moe else m.dense_hidden)


def _stage_gemms(cfg: Config, prec: Precision, stage: Stage) -> list[tuple[int, list[QuantizedGemm]]]:
    """(layers, GEMMs of one such layer) for the stage's quantized GEMMs."""
    if not prec.quantized:
        return []
    out = [(stage.n_moe, layer_gemms(cfg, prec) + linear_gemms(cfg, prec, True))]
    if stage.n_dense:
        out.append((stage.n_dense, linear_gemms(cfg, prec, False)))
    return [(n, gemms) for n, gemms in out if n and gemms]


def _saved_operands(prec: Precision, gemm: QuantizedGemm) -> tuple[bool, bool]:
    """Whether (first, second) operand's E4M3 form outlives the GEMM as a saved tensor."""
    if not prec.saves_quantized:
        return False, False
    if gemm.kind == "forward":
        return prec.mode == "mxfp8", False  # MXFP8's weight gradient reads the forward's Q(x)
    if gemm.kind == "input_grad":
        return False, True  # the weight, quantized along M in the forward
    return True, False  # fp8 weight gradient: its input, quantized per column in the forward


def operand_bytes(prec: Precision, gemm: QuantizedGemm) -> float:
    """Peak bytes of one GEMM's transient quantized / dequantized operand buffers."""
    c, q = prec.compute_bytes, prec.quant_bytes
    x, y = gemm.first, gemm.second
    x_saved, y_saved = _saved_operands(prec, gemm)
    x_q, y_q = (0.0 if x_saved else q * x), (0.0 if y_saved else q * y)
    # saving E4M3 forms, the forward's compute-dtype weight cast is no longer a saved copy: it lives
    # while the GEMM quantizes it
    cast = c * y if prec.saves_quantized and gemm.kind == "forward" else 0.0
    if prec.impl == "native":
        # both E4M3 forms, plus the forward weight's K-major copy (alive while it is quantized)
        # or the weight gradient's token-major E4M3 copies (alive during the GEMM)
        extra = {"forward": c * y, "weight_grad": x_q + y_q}.get(gemm.kind, 0.0)
        return x_q + y_q + extra + cast
    # the first operand dequantized (its E4M3 form still alive), then the second the same way;
    # the forward's K-major copy (c) is freed before the weight's dequantized copy is written
    return cast + max(x_q + c * x, c * x + y_q + c * y)


def peak_operand_bytes(cfg: Config, prec: Precision, stage: Stage) -> float:
    """The largest quantized GEMM's operand buffers on one rank of ``stage`` (0 unquantized)."""
    gemms = [g for _, layer in _stage_gemms(cfg, prec, stage) for g in layer]
    return max((operand_bytes(prec, g) for g in gemms), default=0.0)


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
    forwards = 2 if cfg.parallel.activation_checkpointing == "per-layer" else 1
    return sum(n * sum(_traffic_bytes(prec, g) * (forwards if g.kind == "forward" else 1) for g in gemms)
               for n, gemms in _stage_gemms(cfg, prec, stage))


def linear_flops_per_token(cfg: Config, stage: Stage) -> int:
    """Model FLOPs per token of the stage's attention projections, dense FFNs and shared experts
    (what ``precision.scope=linear`` adds to the quantized GEMMs)."""
    by_phase = cfg.flops_by_phase(stage.n_dense, stage.n_moe, head=False)
    return by_phase["attention"] - stage.attn_flops_per_token + by_phase["dense"]


def quantized_flops_per_token(cfg: Config, prec: Precision, stage: Stage) -> float:
    """GEMM FLOPs per token that run quantized: of the 6 FLOPs per weight, 2 for each of the
    forward (twice under per-layer recompute), the input gradient, and in fp8 the weight
    gradient; expert routes dropped over capacity are not computed."""
    if not prec.quantized:
        return 0.0
    forwards = 2 if cfg.parallel.activation_checkpointing == "per-layer" else 1
    backwards = 2 if prec.mode in QUANTIZED_WEIGHT_GRAD else 1
    flops = stage.expert_flops_per_token * kept_route_share(cfg)
    if prec.linears_quantized:
        flops += linear_flops_per_token(cfg, stage)
    return flops * (forwards + backwards) / 3


def quantized_params_local(cfg: Config, prec: Precision, stage: Stage) -> int:
    """Weights on one rank of ``stage`` whose GEMMs run quantized: the local experts, and under
    ``precision.scope=linear`` the attention projections, dense FFNs and shared experts."""
    if not prec.quantized:
        return 0
    params = stage.expert_params_local
    if prec.linears_quantized:
        params += linear_flops_per_token(cfg, stage) // 6  # 6 FLOPs per token and weight
    return params


def saved_bytes_factor(prec: Precision) -> float:
    """Bytes per element of a saved quantized-GEMM operand: q when the E4M3 forms are saved, else c."""
    return prec.quant_bytes if prec.saves_quantized else prec.compute_bytes
