"""The matmul efficiency ``moebench plan --validate`` fits on the published calibration rows, and the
held-out rows planned with it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from moebench.cli import cli
from moebench.errors import ConfigError
from moebench.plan.planner import PlanOptions
from moebench.plan.published import Measured, load_published
from moebench.plan.published_fit import fit_matmul_efficiency
from moebench.plan.roofline import DEFAULT_MATMUL_EFFICIENCY
from moebench.plan.validate import plan_row, row_setting

ROWS = load_published()
BY_ID = {r.id: r for r in ROWS}


def _invoke(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["plan", "--validate", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.splitlines()[-1])


def _tokens_per_s(row_id: str, efficiency: float) -> float:
    plan = plan_row(BY_ID[row_id], PlanOptions(matmul_efficiency=efficiency))
    return plan["record"]["tokens_per_s_per_device"]


def test_fit_plans_the_calibration_row_at_its_published_tokens_per_s():
    fit = fit_matmul_efficiency(ROWS, PlanOptions())
    assert not fit.at_bound and [(t.row, t.metric, t.published) for t in fit.targets] == [
        ("olmo3-4xb300-e32-bf16", "tokens_per_s_per_device", 54_680)]
    assert _tokens_per_s("olmo3-4xb300-e32-bf16", fit.matmul_efficiency) == pytest.approx(54_680, rel=1e-9)
    # the roofline's default plans the row 1.38x too fast: the fit is well below it
    assert fit.matmul_efficiency < 0.8 * DEFAULT_MATMUL_EFFICIENCY
    assert fit.describe().startswith(f"matmul efficiency {fit.matmul_efficiency:.3f}, fitted on olmo3-4xb300-e32-bf16")


def test_fit_follows_the_data():
    """Computed from the published value, not typed in: halve it and the fit plans the half."""
    bf16 = BY_ID["olmo3-4xb300-e32-bf16"]
    halved = dataclasses.replace(bf16, measured=(Measured("tokens_per_s_per_device", 27_340),))
    fit = fit_matmul_efficiency([halved], PlanOptions())
    plan = plan_row(halved, PlanOptions(matmul_efficiency=fit.matmul_efficiency))
    assert plan["record"]["tokens_per_s_per_device"] == pytest.approx(27_340, rel=1e-9)
    # a value no efficiency reaches stops at the bound and says so
    fast = dataclasses.replace(bf16, measured=(Measured("tokens_per_s_per_device", 10 * 54_680),))
    fit = fit_matmul_efficiency([fast], PlanOptions())
    assert fit.at_bound and fit.matmul_efficiency == 1.0 and "at its bound" in fit.describe()


def test_fit_needs_a_planned_calibration_throughput():
    held_out = [dataclasses.replace(r, role="held-out") for r in ROWS]
    with pytest.raises(ConfigError, match="no calibration row publishes tokens_per_s_per_device or tflops_per_device"):
        fit_matmul_efficiency(held_out, PlanOptions())
    tbo = dataclasses.replace(BY_ID["olmo3-4xb300-e32-tbo"], role="calibration",
                              measured=(Measured("tokens_per_s_per_device", 55_000),))
    with pytest.raises(ConfigError, match=r"calibration row olmo3-4xb300-e32-tbo is not planned \(two-batch overlap"):
        fit_matmul_efficiency([tbo], PlanOptions())


def test_held_out_rows_are_planned_with_the_fit():
    out = _invoke()
    efficiency = out["fit"]["matmul_efficiency"]
    lines = {(line["row"], line["metric"]): line for line in out["validate"]}
    assert lines["olmo3-4xb300-e32-bf16", "tokens_per_s_per_device"]["ratio"] == pytest.approx(1, rel=1e-9)
    recompute = lines["olmo3-4xb300-e32-recompute", "tokens_per_s_per_device"]
    assert recompute["role"] == "held-out"
    assert recompute["planned"] == pytest.approx(_tokens_per_s("olmo3-4xb300-e32-recompute", efficiency))
    # the same as `moebench plan` at that efficiency and the row's settings
    plain = CliRunner().invoke(cli, ["plan", "--preset", "moe-8l-e32", "--gpus", "4", "--gpu", "b300", "--json",
                                     "--matmul-efficiency", repr(efficiency),
                                     *[w for s in row_setting(BY_ID["olmo3-4xb300-e32-recompute"]).overrides
                                       for w in ("--set", s)]])
    assert recompute["planned"] == pytest.approx(json.loads(plain.output.splitlines()[-1])["tokens_per_s_per_device"])


def test_unfitted_view_plans_at_the_roofline_default():
    out = _invoke("--unfitted")
    assert out["fit"] is None
    bf16 = next(line for line in out["validate"]
                if (line["row"], line["metric"]) == ("olmo3-4xb300-e32-bf16", "tokens_per_s_per_device"))
    assert bf16["planned"] == pytest.approx(_tokens_per_s("olmo3-4xb300-e32-bf16", DEFAULT_MATMUL_EFFICIENCY))
    assert bf16["ratio"] > 1.3
    given = _invoke("--unfitted", "--matmul-efficiency", "0.5")["validate"]
    assert next(line for line in given if line["row"] == "olmo3-4xb300-e32-bf16")["planned"] == pytest.approx(
        _tokens_per_s("olmo3-4xb300-e32-bf16", 0.5))
    text = CliRunner().invoke(cli, ["plan", "--validate", "--unfitted"]).output
    assert text.splitlines()[0].startswith("matmul efficiency 0.799, not fitted (default: ")


@pytest.mark.parametrize("args,says", [
    (["--validate", "--matmul-efficiency", "0.5"], "--validate fits the matmul efficiency on the calibration rows: "
                                                   "add --unfitted"),
    (["--unfitted", "--preset", "moe-8l-e32", "--gpus", "4"], "--unfitted goes with --validate"),
])
def test_fit_options_errors(args, says):
    result = CliRunner().invoke(cli, ["plan", *args])
    assert result.exit_code != 0 and says in str(result.exception), result.output


def test_docs_state_the_unfitted_ratios():
    """docs/plan.md's --unfitted figures are what `moebench plan --validate --unfitted` prints."""
    from pathlib import Path

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text().split())
    ratio = {(line["row"], line["metric"]): line["ratio"] for line in _invoke("--unfitted")["validate"]}
    speed = {row: r for (row, metric), r in ratio.items()
             if metric in ("tokens_per_s_per_device", "tflops_per_device") and r is not None}
    megatron = [r for (row, metric), r in ratio.items()
                if row.startswith("megatron-") and metric == "tokens_per_s_per_device"]
    statement = (f"the calibration row plans {speed['olmo3-4xb300-e32-bf16']:.2f}x its published tokens/s, the "
                 f"held-out OLMo-core rows {speed['olmo3-4xb300-e32-recompute']:.2f}x (recompute), "
                 f"{speed['olmo3-ultra-128e']:.2f}x (Ultra-128E) and {speed['olmo3-ultra-256e']:.2f}x (Ultra-256E), "
                 f"the Megatron rows {min(megatron):.2f}-{max(megatron):.2f}x in tokens/s")
    assert statement in doc, statement
    middle = [speed[f"olmo3-{name}"] for name in ("small-64e", "medium-64e", "medium-96e", "medium-128e")]
    scale = (f"the scale rows {speed['olmo3-tiny-64e']:.2f}x (Tiny-64E, no EP), {min(middle):.2f}-{max(middle):.2f}x "
             f"(Small-64E and the three Medium) and {speed['olmo3-large-128e']:.2f}x (Large-128E) in TFLOP/s")
    assert scale in doc, scale
