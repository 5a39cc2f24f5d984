"""Sliding-window attention, attention sinks and projection biases against a naive twin.

The twin (:func:`moebench.model.reference.naive_attention`) writes the scores, the banded causal
mask and the sink logit out by hand. Inputs are fp64 and both sides compute in fp64, so they agree
to rounding (1e-10); a mask one key off, or a sink missing from the denominator, moves outputs by
percents.
"""

import pytest
import torch

from moebench.model.reference import naive_attention
from moebench.model.transformer import Attention, apply_rope, build_model, rope_tables
from moebench.presets import load_config

TOL = {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("window,sinks,kv_heads", [(None, True, 2), (3, False, 2), (3, True, 1), (1, True, 4),
                                                   (50, False, 4)])
def test_attend_matches_naive_attention(window, sinks, kv_heads):
    torch.manual_seed(0)
    B, H, S, hd = 2, 4, 12, 8
    q = torch.randn(B, H, S, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, S, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, S, hd, dtype=torch.float64, requires_grad=True)
    cfg = load_config("tiny", ["model.d_model=32", "model.n_heads=4", f"model.n_kv_heads={kv_heads}",
                               f"model.attention_sinks={str(sinks).lower()}"])
    attn = Attention(cfg.model, window).double()
    if sinks:
        with torch.no_grad():
            attn.sinks.copy_(torch.randn(H, dtype=torch.float64))
    fast = attn._attend(q, k, v)
    ref = naive_attention(q, k, v, window, attn.sinks)
    torch.testing.assert_close(fast, ref, **TOL)
    grad = torch.randn_like(fast)
    params = [q, k, v] + ([attn.sinks] if sinks else [])
    got = torch.autograd.grad(fast, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_window_and_sinks_change_the_output():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    full = naive_attention(q, k, v)
    assert not torch.allclose(naive_attention(q, k, v, window=4), full, atol=1e-3)
    assert not torch.allclose(naive_attention(q, k, v, sinks_H=torch.zeros(2, dtype=torch.float64)), full, atol=1e-3)
    # the first `window` queries see the same keys either way
    torch.testing.assert_close(naive_attention(q, k, v, window=4)[..., :4, :], full[..., :4, :])


def test_biased_attention_layer_matches_the_twin():
    cfg = load_config("tiny", ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
                               "model.attention_bias=true", "model.attention_sinks=true"])
    torch.manual_seed(0)
    attn = Attention(cfg.model, window=5).double()
    with torch.no_grad():
        attn.sinks.normal_()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    hq, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = (x @ attn.wqkv.weight.T + attn.wqkv.bias).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    q, k, v = (t.view(2, 9, -1, hd).transpose(1, 2) for t in (q, k, v))
    cos, sin = rope_tables(9, hd, attn.rope_theta, x.device)
    o = naive_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, 5, attn.sinks)
    ref = o.transpose(1, 2).reshape(2, 9, hq * hd) @ attn.wo.weight.T + attn.wo.bias
    torch.testing.assert_close(attn(x), ref, **TOL)


def test_gpt_oss_features_train_in_a_model():
    """The tiny model with every gpt-oss switch on: layer 0 windowed, layer 1 whole-sequence, and
    every new parameter (biases, sinks, router bias) gets a gradient."""
    cfg = load_config("tiny", ["model.attention_bias=true", "model.attention_sinks=true", "model.sliding_window=8",
                               "model.sliding_window_pattern=2", "moe.router_bias=true", "moe.norm_topk_prob=true"])
    model = build_model(cfg)
    assert [model.layers[str(i)].attn.window for i in range(2)] == [8, None]
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "bias")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
