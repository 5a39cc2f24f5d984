"""Padding FLOPs: the zero rows native fp8's weight gradients compute, counted per step."""

import pytest
import torch

import moebench.model.experts as experts_module
from moebench.kernels.quantized import padding_flops
from moebench.kernels.quantized_gemm import GROUP_ROW_ALIGN, aligned_groups, alignment_padding_rows
from moebench.model.experts import Experts
from moebench.model.router import stats_paused
from moebench.presets import load_config
from moebench.train.run import run_training


@pytest.mark.parametrize("sizes", [[5, 0, 16, 17, 1], [16, 32], [0, 0, 3], [31]])
def test_padding_rows_are_the_rows_alignment_inserts(sizes):
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes) + 4, 3)  # 4 capacity-padding rows past the last group: not counted
    _, aligned_ends = aligned_groups(x, offsets)
    rows = alignment_padding_rows(offsets)
    assert rows.item() == aligned_ends[-1].item() - offsets[-1].item()
    # an empty group gets a whole block of zero rows (the 2-D x 2-D kernel refuses empty groups)
    assert rows.item() == sum(-s % GROUP_ROW_ALIGN if s else GROUP_ROW_ALIGN for s in sizes)


def test_only_native_fp8_in_bf16_computes_padding():
    D, H = 8, 12
    w13, w2 = torch.zeros(3, D, 2 * H), torch.zeros(3, H, D)
    offsets = torch.tensor([5, 5, 20], dtype=torch.int32)  # groups of 5, 0, 15: 11 + 16 + 1 padding rows
    x = torch.zeros(20, D, dtype=torch.bfloat16)
    got = padding_flops(x, w13, w2, offsets, "fp8", "native")
    assert got.dtype == torch.float64 and got.item() == 28 * 6 * D * H  # two weight gradients: 4DH + 2DH a row
    assert padding_flops(x, w13, w2, offsets, "fp8", "emulated") is None
    assert padding_flops(x, w13, w2, offsets, "mxfp8", "native") is None  # its weight gradient runs in bf16
    assert padding_flops(x.float(), w13, w2, offsets, "fp8", "native") is None  # native needs bf16 operands
    assert padding_flops(x, w13, w2, offsets, "bf16", "native") is None


def test_experts_accumulate_padding_outside_recompute(monkeypatch):
    monkeypatch.setattr(experts_module, "quantized_experts", lambda x, *a, **k: x)  # the GEMMs need CUDA
    experts = Experts(2, 8, 4)
    experts.init_weights(0.02, 0.02)
    experts.precision, experts.precision_impl = "fp8", "native"
    x = torch.zeros(9, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([3, 9], dtype=torch.int32)  # 13 + 10 padding rows
    experts(x, offsets)
    experts(x, offsets)
    assert experts.step_padding_flops.item() == 2 * 23 * 6 * 8 * 4
    with stats_paused():  # as activation checkpointing's recompute: not counted again
        experts(x, offsets)
    assert experts.step_padding_flops.item() == 2 * 23 * 6 * 8 * 4


def test_the_record_counts_padding_per_step(monkeypatch):
    """Every MoE layer's padding of every micro-batch, per timed step (reset between steps)."""
    monkeypatch.setattr(experts_module, "padding_flops",
                        lambda *a, **k: torch.tensor(7.0, dtype=torch.float64))
    cfg = load_config("tiny", ["train.steps=3", "train.warmup_steps=1", "precision.mode=fp8"])
    record = run_training(cfg)
    assert record["status"] == "ok"
    n_moe = cfg.model.n_layers - cfg.model.n_dense_layers
    assert record["padding_flops_per_step"] == 7.0 * n_moe * cfg.grad_accum_steps



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_native_fp8_run_records_its_alignment_padding():
    cfg = load_config("tiny", ["train.steps=3", "train.warmup_steps=1", "precision.mode=fp8"])
    record = run_training(cfg)
    assert record["status"] == "ok"
    if record["precision_impl"] != "native":
        pytest.skip(f"fp8 runs emulated here: {record['precision_probe_error']}")
    # routing almost never fills each expert group to a multiple of 16 rows
    assert record["padding_flops_per_step"] > 0
