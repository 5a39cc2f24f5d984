"""The profiled-step account: each op's self time in exactly one class (moebench.metrics.op_account)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from moebench.metrics.op_account import CLASSES, CLIP_RANGE, account, op_class


@pytest.mark.parametrize(("name", "above", "expected"), [
    ("aten::mm", [], "gemm"),
    ("aten::addmm", ["aten::linear"], "gemm"),
    ("aten::mm", ["moebench::fused_moe_cpu_backward"], "gemm"),  # the expert op's GEMMs are GEMMs
    ("aten::mm", ["Optimizer.step#AdamW.step"], "optimizer"),
    ("aten::linalg_vector_norm", ["aten::_foreach_norm"], "optimizer"),
    ("aten::linalg_vector_norm", [CLIP_RANGE], "optimizer"),
    ("aten::_fused_adamw_", [], "optimizer"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ["aten::scaled_dot_product_attention"],
     "attention_kernel"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "attention_kernel"),
    ("aten::index_select", ["aten::index", "moebench::fused_moe_cpu"], "expert_op_other"),
    ("moebench::fused_moe_cpu_backward", [], "expert_op_other"),  # its own Python loop
    ("aten::copy_", ["aten::_to_copy"], "copies"),
    ("aten::copy_", ["aten::_to_copy", "moebench::fused_moe_cpu"], "expert_op_copies"),
    ("aten::mul", ["MulBackward0"], "other_ops"),
    ("aten::linalg_vector_norm", [], "other_ops"),
    ("MulBackward0", ["autograd::engine::evaluate_function: MulBackward0"], "framework"),
])
def test_each_op_lands_in_the_class_its_rules_give(name, above, expected):
    assert op_class(name, above) == expected


def test_a_profiled_step_is_split_whole_into_the_classes():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.AdamW([w], foreach=True)
    x = torch.randn(2, 4, 16, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        q = (x @ w).float()
        loss = F.scaled_dot_product_attention(q, q, q, is_causal=True).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([w], 1.0, foreach=True)
        opt.step()
    events = prof.events()
    seconds = account(events)
    assert list(seconds) == list(CLASSES)
    assert sum(seconds.values()) == pytest.approx(sum(e.self_cpu_time_total for e in events) * 1e-6)
    for cls in ("gemm", "attention_kernel", "optimizer", "other_ops"):
        assert seconds[cls] > 0, cls
    assert seconds["expert_op_other"] == seconds["expert_op_copies"] == 0


def test_the_script_accounts_for_the_expert_kernel_at_the_bench_shape():
    """scripts/cpu_step_account.py's per-process figures: cpu_fused's GEMMs are gemm, its loop expert_op_other."""
    script = runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "cpu_step_account.py"))
    out = script["measure"]("layer_cpu_fused", "fp32", 1, 1)
    assert {"step", "profiled", "between_ops", *CLASSES} == set(out)
    assert out["gemm"] > 0 and out["expert_op_other"] > 0 and out["attention_kernel"] == 0
    assert out["profiled"] == pytest.approx(sum(out[c] for c in CLASSES) + out["between_ops"])
