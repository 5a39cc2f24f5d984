"""Compiled training (``train.compile=true``) computes the eager math: one process (loss, logits,
every gradient, router losses, also in a profiled step with its graph-broken variant), and 2-rank
ddp + EP and fsdp runs against the eager single-process run (losses, router statistics, weights).

Tolerance (fp32): inductor fuses elementwise chains and reorders reductions (RMSNorm, softmax),
so results differ from eager in the last bits: 1e-5 relative on one step's loss and gradients.
Over training steps Adam amplifies that on tiny gradients, so weights keep the parity tests'
rtol 2e-4 / atol 2e-5 (lr 1e-3: a real bug moves weights by ~lr).

Compiling is slow on a loaded 2-core machine (inductor's C++ builds), hence the tiny preset, a
handful of steps and three tests.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity_helpers import assert_router_stats_match, train_and_save

from moebench.model.compile import compile_blocks
from moebench.model.loss import lm_loss
from moebench.model.phases import PhaseClock, clock_active
from moebench.model.transformer import build_model
from moebench.presets import load_config
from moebench.testing import run_distributed

pytestmark = pytest.mark.slow

COMPILED = ["train.compile=true", "train.warmup_steps=2"]


def _step(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    logits = model(tokens)
    loss = lm_loss(logits, tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    aux = torch.stack([block.router.step_aux for block in model.moe_blocks()])
    model.zero_grad(set_to_none=True)
    for block in model.moe_blocks():
        block.router.reset_step_stats()
    return loss.detach(), grads, aux


def test_compiled_blocks_match_eager_loss_gradients_and_aux_losses():
    cfg = load_config("tiny", ["model.n_layers=2", "model.n_dense_layers=1"])  # a dense and an MoE block
    eager, compiled = build_model(cfg), build_model(cfg)
    compile_blocks(compiled)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    want = _step(eager, tokens)
    clock = PhaseClock(torch.device("cpu"), profiling=True)
    for profiled in (False, True):  # ordinary, then the graph-broken variant a profiled step runs
        with clock_active(clock) if profiled else contextlib.nullcontext():
            got = _step(compiled, tokens)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert got[1].keys() == want[1].keys()
        for name, grad in want[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    # the marks still partition the profiled step, forward and backward, region by region
    keys = {key for key, _ in clock.events}
    assert {"fwd:attention", "fwd:dense", "fwd:router", "fwd:experts", "bwd:attention", "bwd:experts"} <= keys


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "ref.pt")
    train_and_save(["train.warmup_steps=2"], path)
    return torch.load(path)


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=sync"],
                                    ["parallel.strategy=fsdp", "parallel.dp=2"]], ids=["ddp-ep2", "fsdp"])
def test_compiled_two_rank_run_matches_eager_single_process(layout, reference, tmp_path):
    path = str(tmp_path / "run.pt")
    run_distributed(train_and_save, 2, [*COMPILED, *layout], path)
    got = torch.load(path)
    record = got["record"]
    assert record["compiled"] is True and record["compile_s"] > 0
    assert not reference["record"]["compiled"] and reference["record"]["compile_s"] is None
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
    assert_router_stats_match(record, reference["record"], "compiled")
    for key, ref in reference["state"].items():
        torch.testing.assert_close(got["state"][key], ref, rtol=2e-4, atol=2e-5, msg=lambda m, k=key: f"{k}: {m}")
    # the step clock left the compiled blocks whole: their phases still add up to the timed step
    assert sum(record["time_breakdown_s"].values()) == pytest.approx(record["breakdown_step_s"], rel=1e-9)
    assert record["breakdown_step_s"] == pytest.approx(record["step_time_median_s"], rel=0.10)
