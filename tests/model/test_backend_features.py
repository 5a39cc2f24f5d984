"""No expert backend skips a model feature's math: every preset, shrunk to a tiny shape that keeps
its features, built through the model API with every backend this device runs, either computes
what the ``loop`` reference computes (loss and every gradient) or is refused when it is built,
with one line naming the backend, the feature and what to use instead.

Tolerance (fp32): the backends differ from ``loop`` only in summation order inside the expert
GEMMs (D, H <= 32) and, for ``cpu_fused``, in the fused combine: 1e-5 relative, as
tests/model/test_compile.py allows a whole model's loss and gradients.
"""

from __future__ import annotations

import pytest
import torch

from moebench.config import BACKEND_FEATURES, Config
from moebench.errors import ConfigError
from moebench.model.loss import lm_loss
from moebench.model.transformer import build_model
from moebench.presets import PRESETS, load_config

# every backend that runs on this machine's CPU (triton compiles GPU kernels: tests/kernels/test_kernels_triton.py)
BACKENDS = ["auto", "grouped_mm", "cpu_fused", "loop"]
# the combinations that must be refused, and nothing else: none today, every backend computes every
# feature (config.BACKEND_FEATURES); test_a_backend_declared_without_a_feature_is_refused keeps the refusal honest
REFUSED: dict[tuple[str, str], str] = {}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _tiny(preset: str, backend: str) -> Config:
    """``preset`` at a tiny shape with every feature kept: its router (gating, bias, groups, scaling,
    routing), shared expert, dense layers, attention variants and a clamp small enough to bite."""
    cfg = load_config(preset, validate=False)
    m, e = cfg.model, cfg.moe
    experts = 16 if e.expert_groups > 1 else 8  # DeepSeek-V3's 8 groups of 2 still cover its top-8
    cfg.apply_overrides({
        "model.vocab_size": 64, "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.head_dim": 8, "model.seq_len": 16, "model.dense_hidden": 32,
        "model.n_dense_layers": min(m.n_dense_layers, 1),
        "model.sliding_window": None if m.sliding_window is None else 4,
        "moe.num_experts": experts, "moe.top_k": min(e.top_k, experts), "moe.expert_hidden": 32,
        "moe.shared_expert_hidden": min(e.shared_expert_hidden, 16),
        # the O(0.1) pre-activations of a fresh init stay far below gpt-oss's 7: clamp some of them
        "moe.swiglu_limit": None if e.swiglu_limit is None else 0.05,
        "moe.backend": backend,
    })
    return cfg.validate()


def _loss_and_grads(cfg: Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # moe.routing=random draws from the global generator: the same draw for every backend
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_matches_the_loop_reference_or_is_refused(preset, backend):
    cfg = _tiny(preset, backend)
    if (preset, backend) in REFUSED:
        with pytest.raises(ConfigError) as refusal:
            build_model(cfg)
        message = str(refusal.value)
        assert "\n" not in message and f"moe.backend={backend} " in message
        assert REFUSED[preset, backend] in message and "use moe.backend=auto" in message
        return
    want_loss, want_grads = _loss_and_grads(_tiny(preset, "loop"))
    loss, grads = _loss_and_grads(cfg)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        if grad is None:  # e.g. the router gate under moe.routing=random
            assert grads[name] is None, name
            continue
        torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("preset", PRESETS)
def test_a_backend_declared_without_a_feature_is_refused(preset, monkeypatch):
    """With cpu_fused declared without the clamp, exactly the clamped presets refuse it, in one line."""
    monkeypatch.setitem(BACKEND_FEATURES, "cpu_fused", BACKEND_FEATURES["cpu_fused"] - {"moe.swiglu_limit"})
    cfg = _tiny(preset, "cpu_fused")
    if cfg.moe.swiglu_limit is None:
        build_model(cfg)
        return
    with pytest.raises(ConfigError) as refusal:
        build_model(cfg)
    message = str(refusal.value)
    assert "\n" not in message and "moe.backend=cpu_fused " in message
    assert "clamped SwiGLU (moe.swiglu_limit)" in message and "use moe.backend=auto" in message


def test_the_shrunk_presets_keep_their_features():
    kept = {name: _tiny(name, "loop").moe.features() for name in PRESETS}
    assert kept["gpt-oss-20b"] == {"moe.swiglu_limit", "moe.router_bias"}
    assert kept["deepseek-v3-671b-gqa"] == {"moe.expert_groups", "moe.routed_scaling", "moe.shared_expert_hidden"}
    assert all(kept[name] == load_config(name).moe.features() for name in PRESETS)
