"""Operand statistics: what each run's weights were (moebench.metrics.operands), recorded, and a difference
between the two sides of a comparison named as the operands', not the code's."""

import torch
from report_helpers import edited_store, fixture_store

from moebench.metrics.operands import group_of, operand_stats
from moebench.model.transformer import build_model
from moebench.presets import load_config
from moebench.report.build import load_tables
from moebench.report.gate.check import environment_warnings, operand_warnings
from moebench.train.run import run_training

SMOKE = fixture_store("smoke")


def test_parameters_fall_into_operand_groups():
    assert group_of("layers.3.ffn.experts.w13") == "experts"
    assert group_of("layers.0.ffn.router.gate.weight") == "router"
    assert group_of("layers.0.attn.wqkv.weight") == "attention"
    assert group_of("layers.0.attn_norm.weight") == group_of("norm.weight") == "norms"
    assert group_of("tok_emb.weight") == group_of("lm_head.weight") == "embeddings"


def test_zeroed_experts_show_in_their_group_only():
    model = build_model(load_config("tiny", []))
    normal = operand_stats(model)
    assert set(normal) == {"experts", "router", "attention", "embeddings", "norms"}
    assert normal["experts"]["zero_fraction"] == 0.0 and normal["experts"]["rms"] > 0
    assert normal["norms"]["rms"] == 1.0  # RMSNorm weights start at one
    with torch.no_grad():
        for name, p in model.named_parameters():
            if group_of(name) == "experts":
                p.zero_()
    zeroed = operand_stats(model)
    assert zeroed["experts"] == {"rms": 0.0, "abs_max": 0.0, "zero_fraction": 1.0}
    assert zeroed["router"] == normal["router"]


def test_a_run_records_its_operands():
    record = run_training(load_config("tiny", ["train.steps=2", "train.warmup_steps=1", "train.profile_steps=0"]))
    stats = record["operand_stats"]
    assert 0 < stats["experts"]["rms"] < stats["experts"]["abs_max"] and stats["experts"]["zero_fraction"] < 0.01


def _with_operands(experts_rms: float):
    def edit(r):
        return {**r, "operand_stats": {"experts": {"rms": experts_rms, "abs_max": 0.06, "zero_fraction": 0.0},
                                       "router": {"rms": 0.02, "abs_max": 0.06, "zero_fraction": 0.0}}}
    return edit


def test_check_names_different_operands_as_the_environments(tmp_path):
    base = load_tables([edited_store(SMOKE, tmp_path / "b", _with_operands(0.017))])[0]
    same = load_tables([edited_store(SMOKE, tmp_path / "s", _with_operands(0.018))])[0]  # trained a little: alike
    zero = load_tables([edited_store(SMOKE, tmp_path / "z", _with_operands(0.0))])[0]
    assert operand_warnings(base, same) == []
    (line,) = operand_warnings(base, zero)
    assert "experts rms 0.017 vs 0" in line and "router" not in line and "operands'" in line
    assert line in environment_warnings(base, zero, [], [])
