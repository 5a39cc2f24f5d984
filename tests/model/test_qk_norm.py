"""QK-norm scopes against a plain composition of the attention math.

``per_head`` normalises each head's ``head_dim`` values (Qwen3); ``full`` normalises the whole
projected q (``n_heads x head_dim``) and k (``n_kv_heads x head_dim``) before they are split
into heads (OLMoE). The twin below writes RMSNorm out by hand and reuses only RoPE and SDPA,
which both scopes share. Tolerance: the inputs are fp64, but RoPE rotates in fp32 (as in
training), so one fp32 rounding of nearly equal values can differ by an ulp: rtol 1e-5; a norm
over the wrong width moves outputs by tens of percent.

Under bf16 autocast every norm, q/k norms included, must take torch's fused RMSNorm (input and
gains of one dtype, fp32) and not its unfused mixed-dtype fallback.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moebench.model.transformer import Attention, apply_rope, build_model, fp32_norm, rope_tables
from moebench.presets import load_config

SHAPE = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.qk_norm=true"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _twin(attn: Attention, x_BSD: torch.Tensor, scope: str, eps: float) -> torch.Tensor:
    B, S, _ = x_BSD.shape
    hq, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = (x_BSD @ attn.wqkv.weight.T).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    if scope == "full":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    q = q.view(B, S, hq, hd).transpose(1, 2)
    k = k.view(B, S, hkv, hd).transpose(1, 2)
    v = v.view(B, S, hkv, hd).transpose(1, 2)
    if scope == "per_head":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    cos, sin = rope_tables(S, hd, attn.rope_theta, x_BSD.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                       is_causal=True)
    return o.transpose(1, 2).reshape(B, S, hq * hd) @ attn.wo.weight.T


def _attention(scope: str) -> tuple[Attention, float]:
    cfg = load_config("tiny", [*SHAPE, f"model.qk_norm_scope={scope}"])
    torch.manual_seed(0)
    attn = Attention(cfg.model).double()
    with torch.no_grad():  # norm weights away from one, so a wrong width or order shows
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    return attn, cfg.model.norm_eps


@pytest.mark.parametrize("scope", ["per_head", "full"])
def test_qk_norm_matches_the_plain_composition(scope):
    attn, eps = _attention(scope)
    width = {"per_head": (8, 8), "full": (4 * 8, 2 * 8)}[scope]
    assert (attn.q_norm.weight.numel(), attn.k_norm.weight.numel()) == width
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 6, 32, dtype=torch.float64)
    got = attn(x)
    got_grads = torch.autograd.grad(got, [x, *attn.parameters()], grad_out)
    want = _twin(attn, x, scope, eps)
    want_grads = torch.autograd.grad(want, [x, *attn.parameters()], grad_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_the_two_scopes_differ():
    """Same projections, norm weights of one: per-head and full normalisation still disagree."""
    (full, _), (per_head, _) = _attention("full"), _attention("per_head")
    per_head.load_state_dict({k: v for k, v in full.state_dict().items() if "norm" not in k}, strict=False)
    for norm in (full.q_norm, full.k_norm, per_head.q_norm, per_head.k_norm):
        torch.nn.init.ones_(norm.weight)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    assert not torch.allclose(full(x), per_head(x), rtol=1e-3, atol=1e-3)


@pytest.fixture
def warn_every_time():
    """torch warns of its unfused RMSNorm fallback ("Mismatch dtype between input and weight") once
    per process: without this an earlier test that hit it would hide it from the next one."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


@pytest.mark.parametrize("scope", ["per_head", "full"])
def test_bf16_qk_norm_runs_fused_in_fp32(scope, warn_every_time):
    """Under bf16 autocast q and k come out of the QKV matmul in bf16 while the gains stay fp32:
    the norms compute in fp32 (torch's fused kernel; its mixed-dtype fallback warns "Mismatch
    dtype between input and weight", an error here) and hand bf16 on. Against the fp32 twin on
    the same bf16 q: 2 bf16 ulps (eps 7.8e-3)."""
    cfg = load_config("tiny", [*SHAPE, f"model.qk_norm_scope={scope}"])
    attn = Attention(cfg.model)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            attn(torch.randn(2, 5, 32))
    q = torch.randn(2, 4, 5, 8).bfloat16() if scope == "per_head" else torch.randn(2, 5, 32).bfloat16()
    got = fp32_norm(attn.q_norm, q)
    assert got.dtype == torch.bfloat16
    want = _rms(q.float(), attn.q_norm.weight, attn.q_norm.eps)
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("scope", ["per_head", "full"])
def test_every_norm_of_a_bf16_model_gets_its_gains_dtype(scope, warn_every_time):
    """The fused RMSNorm runs only when input and gains share a dtype. Under bf16 autocast every
    norm of the model (block norms, q/k norms, final norm) gets fp32 input for its fp32 gains, and
    neither forward nor backward warns of the fallback: the residual stream stays fp32 and the
    q/k norms upcast (model.transformer.fp32_norm)."""
    cfg = load_config("tiny", ["model.n_layers=2", "model.qk_norm=true", f"model.qk_norm_scope={scope}"])
    model = build_model(cfg)
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, nn.RMSNorm):
            module.register_forward_pre_hook(
                lambda norm, args, name=name: seen.append((name, args[0].dtype, norm.weight.dtype)))
    tokens = torch.randint(cfg.model.vocab_size, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16  # autocast was on: the head ran in bf16
    assert len(seen) == 2 * 4 + 1  # per block: attn, q, k and ffn norms; then the final norm
    assert [s for s in seen if s[1:] != (torch.float32, torch.float32)] == []
