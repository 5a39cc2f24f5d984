"""Router losses against hand-computed values, routing modes, bias update, aux-loss gradients."""

import math

import pytest
import torch

from moebench.config import MoEConfig
from moebench.model.router import Router, attach_aux_loss, load_balancing_loss, z_loss


def test_load_balancing_loss_by_hand():
    # 2 tokens, 2 experts, top-1: token 0 -> e0 (p=.75), token 1 -> e0 (p=.6)
    probs = torch.tensor([[0.75, 0.25], [0.6, 0.4]])
    counts = torch.tensor([2.0, 0.0])
    # E/K * sum_e (c_e/T) * mean_p_e = 2/1 * (1.0 * 0.675 + 0 * 0.325)
    assert load_balancing_loss(probs, counts, top_k=1).item() == pytest.approx(1.35)
    # perfectly balanced routing with uniform probabilities scores exactly 1
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.full((4,), 4.0), top_k=2).item() == pytest.approx(1.0)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse0, lse1 = math.log(2.0), math.log(math.e + math.e**2)
    assert z_loss(logits).item() == pytest.approx((lse0**2 + lse1**2) / 2, rel=1e-6)


def _router(**kw) -> Router:
    torch.manual_seed(0)
    r = Router(16, MoEConfig(num_experts=8, top_k=2, **kw))
    torch.nn.init.normal_(r.gate.weight, std=0.5)
    return r


def test_learned_routing_picks_top_probabilities():
    r = _router()
    x = torch.randn(32, 16)
    out = r(x)
    probs = torch.softmax(x @ r.gate.weight.T, dim=-1)
    assert torch.equal(out.idx_TK.sort(1).values, probs.topk(2).indices.sort(1).values)
    torch.testing.assert_close(out.weight_TK, probs.gather(1, out.idx_TK))
    assert out.counts_E.sum().item() == 64
    expected = 0.01 * load_balancing_loss(probs, out.counts_E, 2) + 0.001 * z_loss(x @ r.gate.weight.T)
    torch.testing.assert_close(out.aux_loss, expected)


def test_uniform_routing_is_balanced_and_random_routing_is_valid():
    x = torch.randn(64, 16)
    out = _router(routing="uniform")(x)
    assert torch.all(out.counts_E == 16)
    rnd = _router(routing="random")(x)
    assert torch.all(rnd.idx_TK[:, 0] != rnd.idx_TK[:, 1])
    assert rnd.counts_E.sum().item() == 128


def test_sigmoid_gating_normalises_weights():
    out = _router(gating="sigmoid")(torch.randn(10, 16))
    torch.testing.assert_close(out.weight_TK.sum(-1), torch.ones(10))


def test_aux_free_bias_moves_towards_balance():
    r = _router(bias_gamma=0.1)
    counts = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6])
    r.update_bias(counts)
    assert r.expert_bias[0].item() == pytest.approx(-0.1)
    assert r.expert_bias[1].item() == pytest.approx(0.1)
    # the bias changes selection only, never the combine weights
    x = torch.randn(4, 16)
    r.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 100.0]))
    out = r(x)
    assert torch.all((out.idx_TK == 7).any(dim=1))
    probs = torch.softmax(x @ r.gate.weight.T, dim=-1)
    torch.testing.assert_close(out.weight_TK, probs.gather(1, out.idx_TK))


def test_attached_aux_loss_gets_scaled_gradient():
    w = torch.tensor(2.0, requires_grad=True)
    out = torch.ones(3, requires_grad=True)
    aux = w * 3.0  # d aux / d w = 3
    attach_aux_loss(out * 1.0, aux, 0.25).sum().backward()
    assert w.grad.item() == pytest.approx(0.75)
    assert torch.equal(out.grad, torch.ones(3))


def test_recompute_does_not_count_routes_twice():
    from torch.utils.checkpoint import checkpoint

    r = _router()
    x = torch.randn(16, 16, requires_grad=True)
    out = checkpoint(lambda t: r(t).weight_TK, x, use_reentrant=False)
    out.sum().backward()  # the backward re-runs the router's forward
    assert r.step_calls.item() == 1 and r.step_counts.sum().item() == 32


def test_sigmoid_routing_with_selection_bias_and_scaling():
    """DeepSeek-V3 style: sigmoid scores, a selection-only bias, weights normalised then scaled."""
    r = _router(gating="sigmoid", bias_gamma=0.01, routed_scaling=2.5)
    x = torch.randn(64, 16)
    scores = torch.sigmoid(x @ r.gate.weight.T)
    plain = r(x)
    torch.testing.assert_close(plain.weight_TK.sum(-1), torch.full((64,), 2.5))
    r.expert_bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 0, 0, 0]))  # expert 3 is picked by every token
    biased = r(x)
    assert torch.all((biased.idx_TK == 3).any(dim=1)) and not torch.equal(biased.idx_TK, plain.idx_TK)
    chosen = scores.gather(1, biased.idx_TK)  # the weights carry no bias
    torch.testing.assert_close(biased.weight_TK, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_bias_updates_move_load_towards_balance():
    r = _router(gating="sigmoid", bias_gamma=0.02)
    r.gate.weight.data[0] += 1.0  # every token's favourite: expert 0
    x = torch.randn(256, 16).abs()

    def imbalance() -> float:
        counts = r(x).counts_E
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    for _ in range(100):
        r.update_bias(r(x).counts_E)
    assert imbalance() < 0.7 * before


def test_router_bias_enters_the_logits_and_learns():
    r = _router(router_bias=True)
    with torch.no_grad():
        r.gate.bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 9.0, 0]))
    x = torch.randn(8, 16)
    out = r(x)
    assert torch.all((out.idx_TK == 6).any(dim=1))
    probs = torch.softmax(x @ r.gate.weight.T + r.gate.bias, -1)
    torch.testing.assert_close(out.weight_TK, probs.gather(1, out.idx_TK))
    (out.weight_TK.square().sum() + out.aux_loss).backward()
    assert r.gate.bias.grad is not None and r.gate.bias.grad.abs().sum() > 0
    assert r.gate.weight.grad.abs().sum() > 0


def test_group_limited_routing_picks_from_the_best_groups_only():
    r = _router(gating="sigmoid", expert_groups=4, expert_groups_per_token=2)  # groups {0,1} {2,3} {4,5} {6,7}
    x = torch.randn(64, 16)
    scores = torch.sigmoid(x @ r.gate.weight.T)
    out = r(x)
    group_scores = scores.view(64, 4, 2).sum(-1)  # two experts a group: the sum of both
    best = group_scores.topk(2, dim=-1).indices
    assert torch.all((out.idx_TK[:, :, None] // 2 == best[:, None, :]).any(-1))
    masked = scores.view(64, 4, 2).clone()
    masked[~torch.zeros(64, 4, dtype=torch.bool).scatter_(1, best, True)] = -1
    assert torch.equal(out.idx_TK.sort(1).values, masked.view(64, 8).topk(2).indices.sort(1).values)
    torch.testing.assert_close(out.weight_TK, scores.gather(1, out.idx_TK) / scores.gather(1, out.idx_TK).sum(-1, True))
    unlimited = _router(gating="sigmoid")(x)
    assert not torch.equal(unlimited.idx_TK.sort(1).values, out.idx_TK.sort(1).values)
