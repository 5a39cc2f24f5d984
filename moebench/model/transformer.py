"""Decoder-only MoE language model: embedding, GQA attention with RoPE, MoE blocks, LM head.

Shapes: B batch, S sequence, D model dim, Hq/Hkv query/kv heads, hd head dim, V vocab.

Single-device code. Build it on the meta device and materialise it with
:func:`build_model`; parallel strategies wrap or shard it afterwards. ``layers`` is a
``ModuleDict`` keyed by layer index and the embedding, final norm and head may be
``None``, so a pipeline stage is this same class with some parts deleted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moebench.config import Config, ModelConfig
from moebench.model.loss import chunked_lm_loss, lm_loss
from moebench.model.moe import MoE, SwiGLU
from moebench.model.norm import RecomputeRMSNorm, make_norm
from moebench.model.phases import mark


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles_SH.cos(), angles_SH.sin()


def apply_rope(x_BHSd: Tensor, cos_SH: Tensor, sin_SH: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of each head by position-dependent angles."""
    x1, x2 = x_BHSd.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos_SH - x2 * sin_SH, x2 * cos_SH + x1 * sin_SH], dim=-1)
    return rotated.to(x_BHSd.dtype)


def fp32_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """``norm(x)`` computed in at least fp32 and returned in ``x``'s dtype. Under bf16 autocast q
    and k leave the QKV matmul in bf16 while the gains are fp32 parameters; torch's fused RMSNorm
    needs one dtype for both and would fall back to its unfused path in bf16. A
    :class:`RecomputeRMSNorm` computes in fp32 itself and keeps no fp32 upcast for backward."""
    if isinstance(norm, RecomputeRMSNorm):
        return norm(x)
    return norm(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)


# Extra q/k/v width that carries the sink logit (one column used, the rest keep head_dim a multiple of 8)
_SINK_PAD = 8


def attention_mask(seq_len: int, window: int | None, sink: bool, device: torch.device) -> Tensor:
    """Boolean ``(S, S [+ 1])`` mask for sdpa (True: attend): causal, banded to ``window`` keys (a
    query sees itself and the ``window - 1`` keys before it), and with ``sink`` one more key, last,
    that every query sees (see :meth:`Attention._attend`)."""
    pos_S = torch.arange(seq_len, device=device)
    dist_SS = pos_S[:, None] - pos_S[None, :]  # query - key
    allowed_SS = dist_SS >= 0
    if window is not None:
        allowed_SS &= dist_SS < window
    if not sink:
        return allowed_SS
    return torch.cat([allowed_SS, allowed_SS.new_ones(seq_len, 1)], dim=-1)


class Attention(nn.Module):
    """GQA attention with RoPE; optional QK-norm, projection biases, a sliding window and sinks.

    ``window``: this layer's window (``ModelConfig.layer_window``). Plain causal attention runs
    sdpa's ``is_causal`` path; a window or sinks run it with a boolean mask (:func:`attention_mask`),
    which picks a masked kernel (memory-efficient on CUDA, not flash); tests check it against
    :func:`moebench.model.reference.naive_attention`.
    """

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.rope_theta = cfg.rope_theta
        self.window = window
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.hd, cfg.d_model, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attention_sinks else None
        # QK-norm: per head over head_dim (Qwen3), or over the whole projected q and k (OLMoE)
        self.qk_norm_full = cfg.qk_norm_scope == "full"
        q_width, k_width = (cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd) if self.qk_norm_full else (cfg.hd, cfg.hd)
        self.q_norm = make_norm(cfg, q_width) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, k_width) if cfg.qk_norm else None
        self._rope: tuple[int, torch.device, Tensor, Tensor] | None = None

    def _rope_tables(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            # in the graph (a few fused kernels): a cache on the module would make the first call
            # compile for an empty cache and the next recompile for a full one
            return rope_tables(seq_len, self.head_dim, self.rope_theta, device)
        if self._rope is None or self._rope[0] < seq_len or self._rope[1] != device:
            self._rope = (seq_len, device, *rope_tables(seq_len, self.head_dim, self.rope_theta, device))
        return self._rope[2][:seq_len], self._rope[3][:seq_len]

    def forward(self, x_BSD: Tensor) -> Tensor:
        B, S, _ = x_BSD.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x_BSD).split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_full:
            q, k = fp32_norm(self.q_norm, q), fp32_norm(self.k_norm, k)
        q_BHSd = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k_BHSd = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BHSd = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not self.qk_norm_full:
            q_BHSd, k_BHSd = fp32_norm(self.q_norm, q_BHSd), fp32_norm(self.k_norm, k_BHSd)
        cos, sin = self._rope_tables(S, x_BSD.device)
        q_BHSd, k_BHSd = apply_rope(q_BHSd, cos, sin), apply_rope(k_BHSd, cos, sin)
        o_BHSd = self._attend(q_BHSd, k_BHSd, v_BHSd)
        return self.wo(o_BHSd.transpose(1, 2).reshape(B, S, q_size))

    def _attend(self, q_BHSd: Tensor, k_BHSd: Tensor, v_BHSd: Tensor) -> Tensor:
        """sdpa, causal; with a window, or sinks, under a mask from :func:`attention_mask`.

        A sink is one more key, the same for every head, whose value is zero: q gains a column
        holding the head's ``sink / scale`` and k a column that is 1 for the sink key and 0 for the
        rest, so the sink scores the head's logit and the real keys score as before; the kv heads
        stay shared (GQA) and the mask stays ``(S, S + 1)``, not one per head.
        """
        gqa = self.n_kv_heads != self.n_heads
        S = q_BHSd.shape[2]
        if (self.window is None or self.window >= S) and self.sinks is None:
            return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSd, is_causal=True, enable_gqa=gqa)
        mask_SS = attention_mask(S, self.window, self.sinks is not None, q_BHSd.device)
        if self.sinks is None:
            return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSd, attn_mask=mask_SS, enable_gqa=gqa)
        scale = self.head_dim ** -0.5
        B, H, _, hd = q_BHSd.shape
        sink_BHS1 = (self.sinks.to(q_BHSd.dtype) / scale)[None, :, None, None].expand(B, H, S, 1)
        q_BHSe = torch.cat([q_BHSd, sink_BHS1, q_BHSd.new_zeros(B, H, S, _SINK_PAD - 1)], dim=-1)
        k_BGSe = F.pad(k_BHSd, (0, _SINK_PAD, 0, 1))  # one more key, all zero ...
        k_BGSe[:, :, -1, hd] = 1.0  # ... but for the sink column
        v_BGSe = F.pad(v_BHSd, (0, _SINK_PAD, 0, 1))  # the sink's value: zero
        o_BHSe = F.scaled_dot_product_attention(q_BHSe, k_BGSe, v_BGSe, attn_mask=mask_SS, scale=scale,
                                                enable_gqa=gqa)
        return o_BHSe[..., :hd]


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_id: int) -> None:
        super().__init__()
        m = cfg.model
        self.layer_id = layer_id
        self.attn_norm = make_norm(m, m.d_model)
        self.attn = Attention(m, m.layer_window(layer_id))
        self.ffn_norm = make_norm(m, m.d_model)
        self.is_moe = layer_id >= m.n_dense_layers
        self.ffn: nn.Module = MoE(m.d_model, cfg.moe, layer_id) if self.is_moe else SwiGLU(m.d_model, m.dense_hidden)

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_BSD = mark(x_BSD, "attention")
        h = x_BSD + self.attn(self.attn_norm(x_BSD))
        h = mark(h, "router" if self.is_moe else "dense")  # an MoE block's router region includes its norm
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(m.vocab_size, m.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(m.n_layers)})
        self.norm: nn.RMSNorm | None = make_norm(m, m.d_model)
        self.lm_head: nn.Linear | None = nn.Linear(m.d_model, m.vocab_size, bias=False)

    def forward(self, tokens_or_h: Tensor, targets: Tensor | None = None) -> Tensor:
        """Tokens ``(B, S)`` -> logits ``(B, S, V)``, or with ``targets`` ``(B, S)`` the mean LM loss
        (:mod:`moebench.model.loss`; under ``model.loss_chunk_tokens`` the full logits never exist).
        A pipeline stage may take/return ``(B, S, D)``."""
        h = self.tok_emb(tokens_or_h) if self.tok_emb is not None else tokens_or_h
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(mark(h, "head_loss"))
        if self.lm_head is None:
            return h
        chunk = self.cfg.model.loss_chunk_tokens
        if targets is not None and chunk is not None:
            return mark(chunked_lm_loss(h, self.lm_head.weight, targets, chunk), "head_loss")
        logits = mark(self.lm_head(h), "head_loss")  # the loss's own backward starts here
        return logits if targets is None else lm_loss(logits, targets)

    def moe_blocks(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed``: N(0, 0.02) truncated at 3 sigma, output
        projections scaled by 1/sqrt(2 * layers) (GPT-2), norms to one, biases and sinks zero."""
        torch.manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.model.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Embedding):
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, nn.Linear):
                s = out_std if name.endswith(("wo", "w2")) else std
                nn.init.trunc_normal_(module.weight, std=s, a=-3 * s, b=3 * s)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.zeros_(module.sinks)
            elif hasattr(module, "init_weights") and module is not self:
                module.init_weights(std, out_std)
        for block in self.moe_blocks():
            block.router.expert_bias.zero_()
            block.router.positions.zero_()
            block.router.layer_key.fill_(block.router.layer_id)
            block.router.reset_step_stats()


def build_model(cfg: Config, device: torch.device | str = "cpu", seed: int | None = None) -> Transformer:
    """Build on the meta device (no memory), then materialise on ``device`` and initialise."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(cfg.train.seed if seed is None else seed)
    return model
