"""``moebench plan --validate``: every shipped published row with a preset is planned at its layout,
and the ratio column is planned / published (docs/plan.md carries the table)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from moebench.cli import cli
from moebench.plan.planner import PlanOptions
from moebench.plan.published import load_published
from moebench.plan.validate import NotPlanned, plan_row, row_setting


def _validate_out() -> dict:
    result = CliRunner().invoke(cli, ["plan", "--validate", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.splitlines()[-1])


def _validate() -> list[dict]:
    return _validate_out()["validate"]


def test_every_published_value_appears_with_plan_over_published():
    lines = _validate()
    rows = load_published()
    assert [(line["row"], line["metric"]) for line in lines] == [(r.id, m.metric) for r in rows for m in r.measured]
    for line in lines:
        if line["planned"] is None:
            assert line["ratio"] is None
        else:
            assert line["ratio"] == pytest.approx(line["planned"] / line["published"])
    planned_rows = {line["row"] for line in lines if line["planned"] is not None}
    # every row with a preset is planned, except those whose setup moebench cannot express
    unplannable = {"olmo3-4xb300-e32-tbo", "torchtitan-qwen3-30b-8xb200-deepep"}
    assert planned_rows == {r.id for r in rows if r.preset is not None} - unplannable
    assert all(line["not_planned"] for line in lines if line["row"] in unplannable)


def test_calibration_row_and_its_plan():
    out = _validate_out()
    lines = {(line["row"], line["metric"]): line for line in out["validate"]}
    bf16 = lines["olmo3-4xb300-e32-bf16", "tokens_per_s_per_device"]
    assert bf16["role"] == "calibration" and bf16["published"] == 54_680
    assert {line["role"] for key, line in lines.items() if key[0] != "olmo3-4xb300-e32-bf16"} == {"held-out"}
    # a relative value is planned relative: the MXFP8 row's planned tokens/s over the BF16 row's
    mx = lines["olmo3-4xb300-e32-mxfp8", "tokens_per_s_ratio"]
    mx_speed = CliRunner().invoke(cli, ["plan", "--preset", "moe-8l-e32", "--gpus", "4", "--gpu", "b300", "--json",
                                        "--matmul-efficiency", repr(out["fit"]["matmul_efficiency"]),
                                        *[w for s in row_setting(next(r for r in load_published()
                                                                      if r.id == "olmo3-4xb300-e32-mxfp8")).overrides
                                          for w in ("--set", s)]])
    assert mx["planned"] == pytest.approx(json.loads(mx_speed.output.splitlines()[-1])["tokens_per_s_per_device"]
                                          / bf16["planned"])


def test_published_layout_becomes_the_plans_settings():
    rows = {r.id: r for r in load_published()}
    ultra = row_setting(rows["olmo3-ultra-128e"]).overrides
    # 8192 sequences on dp 64: 128 one-sequence micro-batches per rank, one pipeline flush
    for item in ("train.global_batch_size=8192", "train.micro_batch_size=128", "parallel.pp_microbatches=128",
                 "parallel.pp_schedule=interleaved-1f1b", "parallel.ep=8", "parallel.pp=8", "parallel.dist_opt=true",
                 "parallel.dispatcher=rowwise", "moe.capacity_factor=1.1875", "moe.routing=random",
                 "precision.mode=mxfp8", "precision.scope=linear", "parallel.activation_checkpointing=per-layer"):
        assert item in ultra
    bf16 = row_setting(rows["olmo3-4xb300-e32-bf16"]).overrides
    assert {"train.micro_batch_size=2", "train.global_batch_size=64", "moe.routing=uniform"} <= set(bf16)
    tiny = row_setting(rows["olmo3-tiny-64e"]).overrides
    # 1,024 sequences on 16 ranks, 8 a micro-batch; EP1 and PP1
    assert {"train.global_batch_size=1024", "train.micro_batch_size=8", "parallel.ep=1", "parallel.pp=1",
            "moe.routing=random", "precision.mode=bf16", "parallel.dist_opt=true"} <= set(tiny)
    medium = row_setting(rows["olmo3-medium-128e"]).overrides
    # 3,072 sequences on dp 32: 48 two-sequence micro-batches per rank, one pipeline flush
    assert {"train.micro_batch_size=96", "parallel.pp_microbatches=48", "parallel.pp_schedule=interleaved-1f1b",
            "parallel.dispatcher=rowwise", "moe.capacity_factor=1.1875"} <= set(medium)
    # the published stage layouts and virtual-stage degrees become the plan's
    assert {"parallel.pp_virtual_stages=2", "parallel.pp_layers=5,5,5,5,5,5,5,4"} <= set(medium)
    assert "parallel.pp_layers=" + ",".join(["4"] * 15 + ["3"]) in ultra
    qwen = row_setting(rows["megatron-qwen3-235b-256xgb300-mxfp8"])
    assert {"parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=12"} <= set(qwen.overrides)
    assert not any("virtual" in note for note in qwen.notes)
    assert "parallel.pp_virtual_stages=8" in row_setting(rows["megatron-deepseek-v3-256xgb300-mxfp8"]).overrides
    with pytest.raises(NotPlanned, match="no preset of the Tiny-64E shape"):
        row_setting(dataclasses.replace(rows["olmo3-tiny-64e"], preset=None))


def test_rows_are_planned_with_their_implementation_settings():
    """The settings a source says mirror its framework are applied and named first in the row's notes."""
    rows = {r.id: r for r in load_published()}
    bf16 = row_setting(rows["olmo3-4xb300-e32-bf16"])
    assert {"precision.param_dtype=bf16", "model.norm_impl=recompute", "model.loss_chunk_tokens=1024"} <= set(
        bf16.overrides)
    assert bf16.notes[0] == ("planned as: precision.param_dtype=bf16, model.norm_impl=recompute, "
                             "model.loss_chunk_tokens=1024")
    ultra = row_setting(rows["olmo3-ultra-128e"])
    assert not any(o.startswith("model.loss_chunk_tokens") for o in ultra.overrides)
    megatron = row_setting(rows["megatron-qwen3-30b-8xb300-mxfp8"])
    assert not any(o.startswith(("precision.param_dtype", "model.norm_impl")) for o in megatron.overrides)
    assert megatron.notes[0] == "planned as: moebench's defaults (the source states no implementation setting)"
    lines = {(line["row"], line["metric"]): line for line in _validate()}
    # the settings move the plan: the 4-B300 peak is the policy's, not the fp32-parameter trainer's 162 GiB
    assert lines["olmo3-4xb300-e32-bf16", "peak_mem_gib"]["planned"] == pytest.approx(107.10, abs=0.005)
    assert lines["olmo3-4xb300-e32-bf16", "peak_mem_gib"]["notes"][0] == bf16.notes[0]


def test_a_setting_the_rows_layout_refuses_leaves_the_row_unplanned():
    """The config's own rule decides (here: the fused loss needs pp=1), named in the row's reason."""
    rows = {r.id: r for r in load_published()}
    ultra = dataclasses.replace(rows["olmo3-ultra-128e"],
                                implementation={"model.loss_chunk_tokens": 1024})
    assert "model.loss_chunk_tokens=1024 needs parallel.pp=1" in plan_row(ultra, PlanOptions())["not_planned"]


def test_validate_takes_no_layout_options():
    result = CliRunner().invoke(cli, ["plan", "--validate", "--gpus", "8"])
    assert result.exit_code != 0 and "--validate plans each published row at its own layout" in str(result.exception)


def test_docs_carry_the_validate_table():
    """docs/plan.md states what `moebench plan --validate` prints now (whitespace aside)."""
    from pathlib import Path

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text().split())
    result = CliRunner().invoke(cli, ["plan", "--validate"])
    assert result.exit_code == 0, result.output
    missing = [line for line in result.output.splitlines() if line and " ".join(line.split()) not in doc]
    assert not missing, "docs/plan.md lacks these --validate lines:\n" + "\n".join(missing)
