"""Skewed routing and the routing checksum: the draw is keyed by a token's place in the global
batch, so splitting the batch over calls or ranks changes nothing; a larger skew concentrates the
load; the checksum of one process equals every layout's (2 gloo ranks, tiny preset, 2 steps)."""

import re

import pytest
import torch

from moebench.config import MoEConfig
from moebench.errors import ConfigError
from moebench.model.router import Router, set_route_positions
from moebench.presets import load_config
from moebench.testing import run_distributed
from moebench.train.run import run_training

E, K, TOKENS = 8, 2, 512


def _router(skew: float, sources: int = 1) -> Router:
    torch.manual_seed(0)
    return Router(16, MoEConfig(num_experts=E, top_k=K, routing="skewed", routing_skew=skew, routing_sources=sources))


def _route(router: Router, x_TD: torch.Tensor, first_token: int, step: int = 3):
    set_route_positions([router], seed=7, step=step, first_token=first_token, tokens_per_step=TOKENS)
    return router(x_TD)


def _load(router: Router) -> float:
    counts_E = _route(router, torch.randn(TOKENS, 16), 0).counts_E
    return (counts_E.max() / counts_E.mean()).item()


def test_larger_skew_concentrates_the_load():
    loads = [_load(_router(skew)) for skew in (0.0, 1.0, 2.0)]
    assert loads[0] < 1.3 < loads[1] < loads[2], loads
    assert _router(0.0)(torch.randn(64, 16)).idx_TK.unique(dim=1).shape[1] == K  # K distinct experts


def test_routes_depend_on_the_token_place_not_on_the_split():
    """Two calls of 256 tokens route as one call of 512 (what two ranks or micro-batches do), the
    checksums add up, and the hidden state does not matter; another step routes otherwise."""
    x_TD = torch.randn(TOKENS, 16)
    whole = _router(1.0, sources=2)
    full = _route(whole, x_TD, 0).idx_TK
    halves = []
    checksum = 0
    for first in (0, TOKENS // 2):
        part = _router(1.0, sources=2)
        halves.append(_route(part, torch.randn(TOKENS // 2, 16), first).idx_TK)
        checksum += int(part.step_checksum)
    assert torch.equal(torch.cat(halves), full)
    assert checksum == int(whole.step_checksum)
    other_step = _router(1.0, sources=2)
    assert not torch.equal(_route(other_step, x_TD, 0, step=4).idx_TK, full)
    assert int(other_step.step_checksum) != checksum


def test_each_source_prefers_its_own_rotation():
    """Under routing_sources=2 the first half of the step's tokens prefers expert 0 most, the
    second half expert E/2."""
    router = _router(2.0, sources=2)
    idx_TK = _route(router, torch.randn(TOKENS, 16), 0).idx_TK
    first, second = (torch.bincount(half.flatten(), minlength=E) for half in idx_TK.chunk(2))
    assert first.argmax().item() == 0 and second.argmax().item() == E // 2


def test_router_gradients_stay_defined():
    router = _router(1.0)
    x_TD = torch.randn(64, 16, requires_grad=True)
    out = _route(router, x_TD, 0)
    (out.weight_TK.sum() + out.aux_loss).backward()
    assert router.gate.weight.grad is not None and torch.isfinite(router.gate.weight.grad).all()
    assert torch.isfinite(x_TD.grad).all()


@pytest.mark.parametrize("overrides, field", [
    (["moe.routing=skewed", "moe.routing_skew=-1"], "moe.routing_skew=-1.0 must be a finite number >= 0"),
    (["moe.routing=skewed", "moe.routing_skew=inf"], "for moe.routing_skew; expected a finite number"),
    (["moe.routing=skewed", "moe.routing_sources=0"], "moe.routing_sources=0 must be >= 1"),
    (["moe.routing=skewed", "moe.routing_sources=3"], "moe.routing_sources=3 does not divide train.global_batch_size"),
    (["moe.routing_skew=1"], "moe.routing_skew=1.0 applies only to moe.routing=skewed"),
    (["moe.routing_sources=2"], "moe.routing_sources=2 applies only to moe.routing=skewed"),
    (["moe.routing=skewed", "parallel.pp=2", "model.n_layers=2"], "moe.routing=skewed needs parallel.pp=1"),
])
def test_bad_routing_fields_are_named(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config("tiny", overrides)


SKEWED = ["train.steps=2", "train.warmup_steps=1", "train.profile_steps=0", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.device=cpu", "moe.routing=skewed", "moe.routing_skew=1.0",
          "moe.routing_sources=2"]


def _checksum(overrides: list[str]) -> int:
    return run_training(load_config("tiny", SKEWED + overrides))["routing_checksum"]


@pytest.fixture(scope="module")
def single_process() -> int:
    return _checksum([])


LAYOUTS = {
    "fsdp": ["parallel.strategy=fsdp", "parallel.dp=2"],
    "ddp-ep2-rowwise": ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise", "moe.capacity_factor=1.0"],
    "ddp-ep2-sync": ["parallel.dp=2", "parallel.ep=2"],
    "ddp-ep2-rowwise-recompute": ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise",
                                  "parallel.activation_checkpointing=per-layer"],
}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_checksum_matches_one_process(overrides, single_process):
    """Every rank reports the checksum of all ranks' routes: the single process's, whatever the
    layout (the rowwise point drops routes at capacity 1.0: the checksum is of the routing)."""
    assert isinstance(single_process, int) and 0 < single_process < 2**52
    assert run_distributed(_checksum, 2, overrides, timeout=180) == [single_process, single_process]
