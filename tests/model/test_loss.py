"""The chunked LM head + loss (moebench.model.loss.chunked_lm_loss) against its slow twin, the full
logits through ``lm_loss``: forward, gradients of the head's input and weight, the whole model's
gradients, and what each saves for backward.

Tolerances. fp32: both sides compute the same values in another order (per-chunk sums of the loss
and of the weight gradient, a fused exp(logits - logsumexp) for the softmax); fp32 reorderings move
a result by a few ulps of the largest term: rtol 1e-6 and atol 1e-6 x the largest magnitude. bf16
autocast: both run the head's GEMMs in bf16 and the log-softmax in fp32, but a GEMM blocked over
another token count can round a bf16 output one ulp the other way, and the chunked weight gradient
rounds once per chunk where the reference rounds once: 2 bf16 ulps (eps 7.8e-3), rtol 1.6e-2,
atol 1.6e-2 x the largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from moebench.errors import ConfigError
from moebench.model.loss import chunked_lm_loss, lm_loss
from moebench.model.transformer import build_model
from moebench.presets import load_config

T, D, V = 50, 32, 96  # 50 tokens: chunks of 16 leave a short last one


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def _head_and_loss(fn, h, w, targets, autocast: bool):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, targets)
    (loss * 0.5).backward()  # a loss scale, as 1/micro-batches gives in training
    return loss, h.grad, w.grad


def _reference(h, w, targets):
    return lm_loss(h @ w.T, targets)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T // 2, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3
    return h, w, torch.randint(0, V, (2, T // 2), generator=g)


@pytest.mark.parametrize("chunk", [1, 16, T, 4 * T])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_chunked_loss_matches_the_full_logits(chunk, autocast):
    h, w, targets = _inputs()
    rtol = 1.6e-2 if autocast else 1e-6
    want = _head_and_loss(_reference, h, w, targets, autocast)
    got = _head_and_loss(lambda *a: chunked_lm_loss(*a, chunk), h, w, targets, autocast)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype
        _close(g, r, rtol)


def test_chunked_loss_sees_a_wrong_target():
    """Not a tautology: the twin's loss and gradients move with the targets."""
    h, w, targets = _inputs()
    other = (targets + 1) % V
    assert chunked_lm_loss(h, w, targets, 16) != pytest.approx(chunked_lm_loss(h, w, other, 16).item(), rel=1e-3)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_chunked_model_trains_like_the_reference(autocast):
    """The whole model with ``model.loss_chunk_tokens``: same loss and every parameter's gradient
    (tolerances of the module docstring; gradients of a deep bf16 model through the same bf16
    head gradients)."""
    overrides = ["model.n_layers=2", "model.seq_len=24", "moe.backend=grouped_mm"]
    ref, chunked = build_model(load_config("tiny", overrides)), build_model(
        load_config("tiny", [*overrides, "model.loss_chunk_tokens=10"]))
    chunked.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, ref.cfg.model.vocab_size, (2, 25), generator=torch.Generator().manual_seed(1))
    rtol = 1.6e-2 if autocast else 1e-6
    losses = []
    for model in (ref, chunked):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss)
    _close(losses[1], losses[0], rtol)
    for (name, p), q in zip(ref.named_parameters(), chunked.parameters(), strict=True):
        assert q.grad is not None, name
        _close(q.grad, p.grad, rtol)


def _saved_bytes_per_token(fn, autocast: bool) -> float:
    """Saved bytes of the head + loss alone (the saved_tensors_hooks method of test_plan_memory), per
    token: the difference of two token counts, so the token-independent weight terms cancel."""
    def saved(tokens: int) -> int:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, 1, D, generator=g, requires_grad=True)
        w = torch.randn(V, D, generator=g, requires_grad=True)
        targets = torch.randint(0, V, (tokens, 1), generator=g)
        seen: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in (h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
            fn(h, w, targets)
        return sum(seen.values())
    return (saved(64) - saved(32)) / 32


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_chunked_loss_saves_the_input_gradient_only(autocast):
    """Per token the reference keeps the fp32 log-softmax (4 V bytes), the int64 targets (8) and under
    autocast the bf16 copy of the head's input (2 D); the chunked loss keeps the input gradient (D in
    the compute dtype) and nothing of V's size."""
    a = 2 if autocast else 4
    reference = _saved_bytes_per_token(_reference, autocast)
    chunked = _saved_bytes_per_token(lambda *x: chunked_lm_loss(*x, 8), autocast)
    assert reference == 4 * V + 8 + (a * D if autocast else 0)
    assert chunked == a * D


@pytest.mark.parametrize("bad,match", [("model.loss_chunk_tokens=0", "must be >= 1"),
                                       ("parallel.pp=2", "needs parallel.pp=1")])
def test_chunked_loss_config_is_checked(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny", ["model.loss_chunk_tokens=16", bad, "model.n_layers=2"])
