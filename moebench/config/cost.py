"""The analytic cost model: parameter counts and FLOPs per token from a config's shapes.

They are methods of :class:`~moebench.config.run_config.Config` (this class is one of its bases),
tested against the numel of a built model.
"""

from __future__ import annotations

from moebench.config.sections import ModelConfig, MoEConfig


class CostModel:
    """Parameter counts and FLOPs per token of the ``model`` and ``moe`` sections of a Config."""

    model: ModelConfig
    moe: MoEConfig

    def _attention_matmul_params(self) -> int:
        """QKV and output projections of one attention layer (weights only)."""
        m = self.model
        return m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.hd + m.n_heads * m.hd * m.d_model

    def attention_bias_params(self) -> int:
        """Projection biases (``model.attention_bias``) and sinks (``model.attention_sinks``) of one layer."""
        m = self.model
        bias = (m.n_heads + 2 * m.n_kv_heads) * m.hd + m.d_model if m.attention_bias else 0
        return bias + (m.n_heads if m.attention_sinks else 0)

    def qk_norm_params(self) -> int:
        """Weights of the q and k norms: one head_dim each per head, or the full q and k widths."""
        m = self.model
        if not m.qk_norm:
            return 0
        return 2 * m.hd if m.qk_norm_scope == "per_head" else (m.n_heads + m.n_kv_heads) * m.hd

    def attention_params(self) -> int:
        return self._attention_matmul_params() + self.attention_bias_params() + self.qk_norm_params()

    def router_params(self) -> int:
        """One layer's router: the gate weight and, with ``moe.router_bias``, its bias."""
        e = self.moe
        return (self.model.d_model + (1 if e.router_bias else 0)) * e.num_experts

    def expert_params(self) -> int:
        """One routed SwiGLU expert (gate, up, down)."""
        return 3 * self.model.d_model * self.moe.expert_hidden

    def _layer_params(self, experts_counted: int) -> tuple[int, int]:
        """(dense layer params, MoE layer params) with ``experts_counted`` routed experts."""
        m, e = self.model, self.moe
        norms = 2 * m.d_model
        dense = self.attention_params() + norms + 3 * m.d_model * m.dense_hidden
        shared = 3 * m.d_model * e.shared_expert_hidden
        moe = self.attention_params() + norms + self.router_params() + shared + experts_counted * self.expert_params()
        return dense, moe

    def _params(self, experts_counted: int) -> int:
        m = self.model
        dense, moe = self._layer_params(experts_counted)
        embed_and_head = 2 * m.vocab_size * m.d_model + m.d_model  # + final norm
        n_moe = m.n_layers - m.n_dense_layers
        return embed_and_head + m.n_dense_layers * dense + n_moe * moe

    def total_params(self) -> int:
        """Every parameter of the model (untied embedding and LM head)."""
        return self._params(self.moe.num_experts)

    def active_params(self) -> int:
        """Parameters one token touches: top_k routed experts, embeddings and head included."""
        return self._params(self.moe.top_k)

    def _matmul_params_by_phase(self, n_dense: int, n_moe: int, head: bool) -> dict[str, int]:
        """Active matmul parameters of ``n_dense`` dense and ``n_moe`` MoE layers (and the LM head)
        by step phase (the keys of :data:`moebench.record.PHASES` that do matmuls)."""
        m, e = self.model, self.moe
        return {
            "attention": (n_dense + n_moe) * self._attention_matmul_params(),
            "router": n_moe * m.d_model * e.num_experts,  # a router bias adds no matmul
            "experts": n_moe * e.top_k * self.expert_params(),
            "dense": 3 * m.d_model * (n_dense * m.dense_hidden + n_moe * e.shared_expert_hidden),
            "head_loss": m.vocab_size * m.d_model if head else 0,
        }

    def matmul_params_per_token(self) -> int:
        """Active parameters that take part in a matmul: everything but embeddings and norms."""
        m = self.model
        return sum(self._matmul_params_by_phase(m.n_dense_layers, m.n_layers - m.n_dense_layers, True).values())

    def flops_by_phase(self, n_dense: int | None = None, n_moe: int | None = None, head: bool = True) -> dict[str, int]:
        """Model FLOPs per trained token by step phase, for ``n_dense`` dense and ``n_moe`` MoE layers
        (default: the whole model) and the LM head; they add up to :meth:`flops_per_token`.

        ``6 * matmul params`` of each phase, plus the attention score/value term
        ``12 * heads * head_dim * context`` per layer, ``context`` from :meth:`attention_context`.
        """
        m = self.model
        n_dense = m.n_dense_layers if n_dense is None else n_dense
        n_moe = m.n_layers - m.n_dense_layers if n_moe is None else n_moe
        out = {p: 6 * v for p, v in self._matmul_params_by_phase(n_dense, n_moe, head).items()}
        out["attention"] += round(12 * (n_dense + n_moe) * m.n_heads * m.hd * self.attention_context())
        return out

    def attention_context(self) -> float:
        """Keys a query attends to, on average over the tokens and the layers (exact causal counting).

        Whole-sequence causal: ``seq_len / 2`` (``seq_len // 2``). A window ``w < seq_len``:
        ``min(i, w)`` keys for query ``i``, on average ``w - w^2 / (2 seq_len)``. With a window
        pattern of period P > 1 the mean over one period (P - 1 windowed layers, one whole-sequence
        one): exact for a model whose layer count is a multiple of P (every preset), and the same
        for every layer, so a pipeline stage's share is its layer count's.
        """
        m = self.model
        full = m.seq_len // 2
        if m.sliding_window is None or m.sliding_window >= m.seq_len:
            return full
        w = m.sliding_window
        windowed = w - w * w / (2 * m.seq_len)
        period = m.sliding_window_pattern
        return windowed if period == 1 else ((period - 1) * windowed + full) / period

    def flops_per_token(self) -> int:
        """Model FLOPs per trained token (forward + backward, no recompute): see :meth:`flops_by_phase`."""
        return sum(self.flops_by_phase().values())

    def cost_summary(self) -> dict[str, int]:
        return {
            "total_params": self.total_params(),
            "active_params": self.active_params(),
            "flops_per_token": self.flops_per_token(),
        }
