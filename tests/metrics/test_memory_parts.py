"""Memory by part (``memory_parts_bytes``): the measured parts against the analytic sizes and the
planner, quantized saved activations against bf16's, and fsdp's shards (2 gloo ranks)."""

import pytest
import torch

from moebench.model.precision import apply_precision
from moebench.model.transformer import build_model
from moebench.parallel.strategy import Strategy
from moebench.plan.planner import build_plan
from moebench.presets import load_config
from moebench.record import MEMORY_PARTS as PARTS
from moebench.testing import run_distributed
from moebench.train.memory_parts import SavedActivations
from moebench.train.run import compute_dtype, run_training
from moebench.train.trainer import Trainer

SHORT = ["train.steps=2", "train.warmup_steps=1", "train.profile_steps=0"]
# tiny with wide experts: the expert GEMMs' inputs dominate what autograd saves; grouped_mm on every
# mode (the quantized GEMMs run emulated on it on CPU; CPU's fused bf16 kernel saves less than it)
WIDE = [*SHORT, "model.d_model=128", "moe.expert_hidden=512", "moe.backend=grouped_mm",
        "train.global_batch_size=4", "train.micro_batch_size=4"]


def _parts(overrides: list[str]) -> dict[str, int | None]:
    return run_training(load_config("tiny", overrides), log=lambda line: None)["memory_parts_bytes"]


def _step_parts(overrides: list[str]) -> dict[str, int | None]:
    """The trainer's memory step after one training step, without the run's calibrations."""
    cfg = load_config("tiny", overrides)
    mode, pc = cfg.precision.resolved_mode(on_gpu=False), cfg.precision
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_precision(model, mode, pc.mxfp8_rounding, pc.scope, pc.saved_activations)
    trainer = Trainer(cfg, Strategy(model), torch.device("cpu"), compute_dtype(mode))
    trainer.train_step(0)
    return trainer.memory_step(1)


def test_one_process_state_parts_are_the_analytic_sizes_and_the_plans():
    cfg = load_config("tiny", SHORT)
    parts = _parts(SHORT)
    assert tuple(parts) == PARTS
    n = cfg.total_params()
    # fp32 parameters and gradients, AdamW's two fp32 moments
    assert (parts["parameters"], parts["gradients"], parts["optimizer_state"]) == (4 * n, 4 * n, 8 * n)
    assert parts["comm_buffers"] == 0 and parts["transient"] is None  # CPU: no allocator peak
    planned = build_plan(cfg, "h200")["memory_parts_bytes"]
    assert tuple(planned) == PARTS
    assert {k: planned[k] for k in PARTS[:3]} == {k: parts[k] for k in PARTS[:3]}
    assert planned["saved_activations"] == pytest.approx(parts["saved_activations"], rel=0.05)


@pytest.mark.parametrize("mode", ["fp8", "mxfp8"])
def test_quantized_modes_save_fewer_activation_bytes_than_bf16(mode):
    """precision.saved_activations=quantized (the default): the expert GEMMs save E4M3 (+ scales)
    inputs where bf16 saves bf16 ones, whatever the emulation's transient dequantized copies."""
    bf16, quant = (_step_parts([*WIDE, f"precision.mode={m}"]) for m in ("bf16", mode))
    assert quant["saved_activations"] < 0.9 * bf16["saved_activations"]
    assert {k: quant[k] for k in PARTS[:3]} == {k: bf16[k] for k in PARTS[:3]}


def test_saved_activations_follow_lifetimes_and_skip_parameters():
    w = torch.nn.Parameter(torch.randn(64, 64))
    saved = SavedActivations(exclude=set())
    with saved.watching():
        x = torch.randn(8, 64, requires_grad=True)
        y = (x @ w).relu()  # saves x (and w, a parameter: skipped), then relu's output
        assert saved.live == 2 * 8 * 64 * 4
        y.sum().backward()
    assert saved.peak_bytes == 2 * 8 * 64 * 4 and saved.live == 0  # backward released both


def _fsdp_parts(overrides: list[str]) -> dict[str, int | None]:
    return run_training(load_config("tiny", overrides))["memory_parts_bytes"]


@pytest.mark.slow
def test_fsdp_holds_about_half_the_state_on_each_of_two_ranks():
    single = _parts(SHORT)
    sharded = run_distributed(_fsdp_parts, 2, [*SHORT, "parallel.dp=2", "parallel.strategy=fsdp"])
    for rank in sharded:
        for part in PARTS[:3]:
            # each rank's shard of every parameter, padded to a whole number of rows
            assert rank[part] == pytest.approx(single[part] / 2, rel=0.05), part
