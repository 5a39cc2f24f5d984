"""Expert compute backends: the routed SwiGLU experts over an expert-sorted buffer.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E local experts.

Every backend computes ``y[rows_e] = act(x[rows_e] @ w13[e]) @ w2[e]`` for each expert e, with
``act`` :func:`moebench.kernels.swiglu.expert_activation` (SwiGLU, or gpt-oss's clamped SwiGLU at
``swiglu_limit``) and ``offsets_E`` the int32 cumulative row ends; rows past ``offsets[-1]`` (padding of capacity
buffers) are not computed: their output is undefined and callers must not read it.

- ``loop``: one matmul pair per expert, slicing on host offsets. The readable reference; it
  syncs to read the offsets.
- ``grouped_mm``: ``torch.nn.functional.grouped_mm`` over the whole buffer; offsets stay on the
  device (on SM90/SM100; other devices fall back to a per-group loop inside torch). Outside bf16
  it runs as the custom op of :mod:`moebench.kernels.grouped_mm_op` (torch.compile traces
  torch's op in bf16 only).
- ``cpu_fused``: on CPU, :func:`moebench.kernels.cpu_experts.fused_experts_cpu` (forward and
  backward one expert at a time, intermediates cache-resident; reads offsets on the host, which
  costs nothing on CPU); on any other device exactly ``grouped_mm``, so it never stalls a GPU.
- ``triton``: :func:`moebench.kernels.grouped_gemm.experts_triton`, our Triton grouped GEMM
  (imported only when asked for: it needs the triton package).

The names a config may choose are ``MoEConfig.backend``'s, and which model features each
backend computes is :data:`moebench.config.BACKEND_FEATURES` (the model refuses any other
combination when it is built; ``auto`` resolves to a backend that computes them).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Collection

import torch
from torch import Tensor

from moebench.config import check_backend_features
from moebench.errors import ConfigError
from moebench.kernels.cpu_experts import fused_experts_cpu
from moebench.kernels.grouped_mm_op import grouped_mm
from moebench.kernels.groups import group_sizes
from moebench.kernels.swiglu import expert_activation

# (x_ND, w13_ED2H, w2_EHD, offsets_E, swiglu_limit=None) -> y_ND
ExpertFn = Callable[..., Tensor]


def experts_loop(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                 swiglu_limit: float | None = None) -> Tensor:
    """Reference: one matmul pair per expert (host offsets)."""
    sizes = group_sizes(offsets_E).tolist()
    padding = x_ND.shape[0] - sum(sizes)  # capacity padding past the last expert: not computed
    # split/unbind (not x[a:b], w[e]): their backward is one cat/stack, not E full-size zero fills.
    chunks = x_ND.split([*sizes, padding])
    experts = zip(chunks[:-1], w13_ED2H.unbind(0), w2_EHD.unbind(0), strict=True)
    outs = [expert_activation(x_MD @ w13, swiglu_limit) @ w2 for x_MD, w13, w2 in experts]
    if padding:
        outs.append(x_ND.new_zeros(padding, w2_EHD.shape[-1]))
    return torch.cat(outs)


def experts_grouped_mm(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                       swiglu_limit: float | None = None) -> Tensor:
    """All experts in two grouped GEMMs; gate and up projections fused into one."""
    h_N2H = grouped_mm(x_ND, w13_ED2H, offsets_E)
    return grouped_mm(expert_activation(h_N2H, swiglu_limit), w2_EHD, offsets_E)


def experts_cpu_fused(x_ND: Tensor, w13_ED2H: Tensor, w2_EHD: Tensor, offsets_E: Tensor,
                      swiglu_limit: float | None = None) -> Tensor:
    """The per-expert fused kernel on CPU; ``grouped_mm`` (device offsets, no sync) elsewhere."""
    if x_ND.device.type != "cpu":
        return experts_grouped_mm(x_ND, w13_ED2H, w2_EHD, offsets_E, swiglu_limit)
    return fused_experts_cpu(x_ND, w13_ED2H, w2_EHD, offsets_E, swiglu_limit)


_TORCH_BACKENDS: dict[str, ExpertFn] = {
    "loop": experts_loop,
    "grouped_mm": experts_grouped_mm,
    "cpu_fused": experts_cpu_fused,
}


def check_backend(name: str, device_type: str, precision: str, features: Collection[str] = ()) -> None:
    """ConfigError, with what would work, when backend ``name`` (a ``moe.backend``, ``auto`` included)
    cannot run in ``precision`` (a resolved mode) on ``device_type``, or does not compute one of the
    model's ``features`` (:func:`moebench.config.check_backend_features`, the model's own check)."""
    check_backend_features(name, features)
    if device_type == "cuda" and precision == "fp32" and name in ("auto", "grouped_mm", "cpu_fused"):
        raise ConfigError(f"moe.backend={name} runs torch's grouped_mm on CUDA, which computes in bf16 "
                          "only: set precision.mode=bf16 (fp32 master weights are kept) or moe.backend=loop")
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("moe.backend=triton needs the triton package; use moe.backend=grouped_mm")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"moe.backend=triton compiles GPU kernels and the run is on {device_type}: use "
                              "moe.backend=grouped_mm or cpu_fused (TRITON_INTERPRET=1 runs the kernels in "
                              "Triton's slow interpreter, for tests)")


def expert_backend(name: str) -> ExpertFn:
    """The compute function of backend ``name``."""
    if name == "triton":
        from moebench.kernels.grouped_gemm import experts_triton  # imports triton: only when asked for

        return experts_triton
    if name not in _TORCH_BACKENDS:
        raise ValueError(f"unknown expert backend {name!r}; known: {', '.join([*_TORCH_BACKENDS, 'triton'])}")
    return _TORCH_BACKENDS[name]
