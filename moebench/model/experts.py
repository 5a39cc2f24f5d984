"""Routed SwiGLU experts with stacked weights; the compute backend is chosen by name.

Shapes: N expert-sorted rows, D model dim, H expert hidden, E local experts.

Input is an expert-sorted buffer ``x_ND`` with int32 cumulative ``offsets_E`` (``offsets[e]``
is the end row of expert e). The backends (``loop``, ``grouped_mm``, ``cpu_fused``, ``triton``)
are in :mod:`moebench.kernels.expert_backends`. With the single-device dispatcher and the
``cpu_fused`` backend on CPU, the MoE block calls :meth:`Experts.fused_routes`, which also fuses
the gather and the weighted combine in. A backend that does not compute one of the model's
features (:data:`moebench.config.BACKEND_FEATURES`) is refused when it is set, so no entry point
can run it and get other math.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moebench.config import check_backend_features, resolve_backend
from moebench.kernels.cpu_experts import fused_moe_cpu
from moebench.kernels.expert_backends import expert_backend
from moebench.kernels.quantized import padding_flops, quantized_experts
from moebench.model.router import in_recompute


class Experts(nn.Module):
    """SwiGLU experts, weights stacked along dim 0.

    ``num_local_experts``: the experts this module holds: all of them on one device,
    ``num_experts / ep`` after :func:`moebench.parallel.expert.apply_expert_parallel` (the router
    and the config keep the global count).
    """

    def __init__(self, num_local_experts: int, d_model: int, hidden: int, backend: str = "auto",
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.d_model = d_model
        self.hidden = hidden
        self.swiglu_limit = swiglu_limit  # moe.swiglu_limit: gpt-oss's clamped SwiGLU when set
        # Quantized expert GEMMs ("fp8" | "mxfp8"), set from precision.mode by
        # moebench.model.precision.apply_expert_precision; "none" computes in the input dtype.
        self.precision = "none"
        self.mxfp8_rounding = "up"
        self.saved_activations = "quantized"  # what the quantized GEMMs save for backward
        # native | emulated, resolved once when the precision is applied, so that a compiled block
        # never reaches the device probe
        self.precision_impl = "emulated"
        self.backend = backend  # checked against the features set above (the setter below)
        # FLOPs this optimizer step's expert GEMMs spent on padding rows (forward and backward of
        # every micro-batch; only native fp8 has any: kernels.quantized.padding_flops); read and
        # zeroed by the trainer once a step, never synced here
        self.register_buffer("step_padding_flops", torch.zeros((), dtype=torch.float64), persistent=False)
        self.w13 = nn.Parameter(torch.empty(num_local_experts, d_model, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, d_model))

    @property
    def backend(self) -> str:
        """The ``moe.backend`` this module runs (``auto`` resolved per call, :meth:`_backend`)."""
        return self._backend_name

    @backend.setter
    def backend(self, name: str) -> None:
        check_backend_features(name, self.features())
        self._backend_name = name

    def features(self) -> frozenset[str]:
        """The model features (:data:`moebench.config.MOE_FEATURES`) the expert compute itself runs."""
        on = {"moe.swiglu_limit": self.swiglu_limit is not None, "precision.mode": self.precision != "none"}
        return frozenset(name for name, used in on.items() if used)

    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        self.step_padding_flops.zero_()  # after a meta-device build it holds garbage
        nn.init.trunc_normal_(self.w13, std=std, a=-3 * std, b=3 * std, generator=generator)
        nn.init.trunc_normal_(self.w2, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator)

    def _compute_dtype(self, x: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` and the weights as the backend takes them under autocast: grouped_mm is not on
        autocast's op lists, so everything is cast explicitly to the compute dtype, except the
        weights of the ``cpu_fused`` kernel on CPU, which casts them itself (never saving the copy)."""
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            if not self._cpu_kernel(backend, x):
                w13, w2 = w13.to(dtype), w2.to(dtype)
        return x, w13, w2

    def _cpu_kernel(self, backend: str, x: Tensor) -> bool:
        """Whether ``backend`` runs the fused CPU kernels on ``x``: ``cpu_fused`` on CPU, unquantized."""
        return backend == "cpu_fused" and x.device.type == "cpu" and self.precision == "none"

    def fuses_routes(self, x_TD: Tensor) -> bool:
        """Whether :meth:`fused_routes` can take these tokens (the fused CPU kernels run on them);
        otherwise the caller dispatches, calls :meth:`forward` and combines."""
        return self._cpu_kernel(self._backend(x_TD), x_TD)

    def fused_routes(self, x_TD: Tensor, idx_TK: Tensor, weight_TK: Tensor) -> Tensor:
        """``sum_k weight[t, k] * expert_{idx[t, k]}(x[t])`` in one fused CPU kernel (see :meth:`fuses_routes`)."""
        assert self._backend(x_TD) == "cpu_fused", "fused_routes is cpu_fused's path (fuses_routes)"
        x_TD, w13, w2 = self._compute_dtype(x_TD, "cpu_fused")
        return fused_moe_cpu(x_TD, idx_TK, weight_TK, w13, w2, self.swiglu_limit)

    def _backend(self, x: Tensor) -> str:
        """The backend that runs on ``x``'s device (``auto`` resolved)."""
        return resolve_backend(self.backend, x.device.type, self.features())

    def forward(self, x_ND: Tensor, offsets_E: Tensor) -> Tensor:
        backend = self._backend(x_ND)
        x_ND, w13, w2 = self._compute_dtype(x_ND, backend)
        if self.precision != "none":
            padding = padding_flops(x_ND, w13, w2, offsets_E, self.precision, self.precision_impl)
            if padding is not None and not in_recompute():
                with torch.no_grad():
                    self.step_padding_flops += padding
            return quantized_experts(x_ND, w13, w2, offsets_E, self.precision, self.mxfp8_rounding, backend,
                                     self.saved_activations, impl=self.precision_impl, swiglu_limit=self.swiglu_limit)
        return expert_backend(backend)(x_ND, w13, w2, offsets_E, swiglu_limit=self.swiglu_limit)

    def extra_repr(self) -> str:
        return (f"local_experts={self.num_local_experts}, d_model={self.d_model}, hidden={self.hidden}, "
                f"backend={self.backend}, swiglu_limit={self.swiglu_limit}")
