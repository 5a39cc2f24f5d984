"""Loss curves per comparison group, the loss difference against the reference precision, and
"diverges" in the answer when the mean loss of the last steps rises beyond the baseline's
step-to-step noise, judged only between points that train the same model."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from report_helpers import edited_store, fixture_store, with_repeats

from moebench.report.build import build_report
from moebench.report.headline import headline
from moebench.report.loss import loss_curves, loss_vs_precision
from moebench.results import pairing
from moebench.results.pairing import LOSS_FLOOR, LOSS_SIGMAS
from moebench.results.table import load_tables, loss_window

EXPERTS = fixture_store("expert-scaling")
SMOKE = fixture_store("smoke")


def _table(store):
    return pairing.pair_with_baseline(*load_tables([store])[:2])


def test_loss_curves_put_each_point_next_to_its_baseline():
    t = _table(SMOKE)
    fig = loss_curves(t)
    (ax,) = fig.axes  # every smoke point pairs with the one fsdp baseline
    assert len(ax.get_lines()) == 3 and "fsdp fp32 (baseline)" in [x.get_text() for x in ax.get_legend().get_texts()]
    fsdp = t[t["point_id"] == "fsdp"].iloc[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label().endswith("(baseline)"))
    assert list(line.get_ydata()) == fsdp["losses"]
    plt.close(fig)


def test_loss_difference_against_the_reference_precision():
    assert loss_vs_precision(_table(SMOKE)) == ("no points that differ only in precision from a bf16 (GPU) or "
                                                "fp32 (CPU) point")
    t = _table(EXPERTS)
    fig = loss_vs_precision(t)
    assert len(fig.axes) == 2  # ddp ep8 and fsdp at 8 experts, each fp32 vs bf16
    by_id = t.set_index("point_id")
    diff = np.asarray(by_id.at["e8-ddp-fp32", "losses"]) - np.asarray(by_id.at["e8-ddp", "losses"])
    ddp = next(ax for ax in fig.axes if ax.get_title().startswith("ddp ep8"))
    (line,) = [ln for ln in ddp.get_lines() if ln.get_label() == "fp32"]
    assert np.allclose(line.get_ydata(), diff)
    plt.close(fig)


def test_a_faster_precision_whose_loss_diverges_is_not_faster(tmp_path):
    """bf16 baseline; the fp32 point made 1.5x faster but ending 5% higher in loss; 3 runs each."""
    def diverging(record):
        factor = 1.0
        if record["point_id"] == "e8-ddp-fp32":
            factor = 1.5 / 0.42
            record["losses"] = [x * 1.05 for x in record["losses"]]
            record["loss_last"] = record["losses"][-1]
        return with_repeats(record, 3, factor, 0.01, seed=1)

    def bf16_baseline(meta):
        meta["baseline"] = {"precision": "bf16"}

    store = edited_store(EXPERTS, tmp_path / "s", diverging, bf16_baseline)
    t = _table(store)
    row = t.set_index("point_id").loc["e8-ddp-fp32"]
    assert row["baseline_point_id"] == "e8-ddp" and row["speedup_verdict"] == "faster"
    assert row["loss_delta"] > row["loss_tolerance"] and row["diverges"]
    _, details = headline(t)
    line = next(x for x in details if x.subject == "fp32 vs bf16 at ddp ep8")
    assert line.verdict == "diverges" and "faster" not in line.answer
    assert any("mean loss over the last" in f and "standard errors" in f for f in line.flags)
    build_report(store, tmp_path / "out")
    csv = pd.read_csv(tmp_path / "out" / "results.csv").query("repeat == 0").set_index("point_id")
    assert bool(csv.at["e8-ddp-fp32", "diverges"]) and not bool(csv.at["e8-fsdp-fp32", "diverges"])
    assert "⚠ diverges" in (tmp_path / "out" / "report.md").read_text()


def test_points_that_train_alike_do_not_diverge():
    t = _table(EXPERTS)
    compared = t[t["baseline_point_id"].notna() & (t["baseline_point_id"] != t["point_id"])]
    assert len(compared) and not compared["diverges"].any() and compared["loss_judged"].all()
    assert (compared["loss_delta"].abs() < compared["loss_tolerance"]).all()


def test_only_a_higher_final_loss_diverges():
    """Diverging is training worse: a point ending 4% below its baseline's loss is not flagged, 4% above is
    (the fixture's tolerance is well under 4%)."""
    df, metas = load_tables([EXPERTS])[:2]
    i = df.index[df["point_id"] == "e8-ddp"][0]
    base = df.loc[df["point_id"] == "e8-fsdp", "loss_compared"].iloc[0]
    for factor, flagged in ((0.96, False), (1.04, True)):
        df.loc[i, "loss_compared"] = base * factor  # the loss after train.steps (table.compared_loss)
        t = pairing.pair_with_baseline(df, metas)
        assert bool(t.loc[t["point_id"] == "e8-ddp", "diverges"].iloc[0]) is flagged


def _with_baseline_spread(spread: float, rise: float):
    """The expert-scaling table with e8-ddp's mean loss ``rise`` above its fsdp baseline's and the
    baseline's step-to-step spread set to ``spread`` (an absolute loss)."""
    df, metas = load_tables([EXPERTS])[:2]
    base = df.index[df["point_id"] == "e8-fsdp"]
    df.loc[base, "loss_spread"] = spread
    df.loc[df["point_id"] == "e8-ddp", "loss_compared"] = df.loc[base, "loss_compared"].iloc[0] * (1 + rise)
    row = pairing.pair_with_baseline(df, metas).set_index("point_id").loc["e8-ddp"]
    return row


def test_the_tolerance_is_the_baselines_noise():
    """The same 2% rise diverges over a smooth baseline and not over a noisy one: the tolerance
    is LOSS_SIGMAS standard errors of the difference of two means of w steps, spread * sqrt(2 / w),
    and never under LOSS_FLOOR."""
    smooth, noisy = _with_baseline_spread(0.01, 0.02), _with_baseline_spread(0.2, 0.02)
    w = smooth["baseline_loss_window"]
    assert w == loss_window(int(smooth["config.train.steps"]))
    mean = smooth["baseline_loss_compared"]
    assert noisy["loss_tolerance"] == pytest.approx(LOSS_SIGMAS * 0.2 * (2 / w) ** 0.5 / mean)
    assert smooth["diverges"] and not noisy["diverges"]
    assert _with_baseline_spread(0.0, 0.004)["loss_tolerance"] == LOSS_FLOOR


def test_points_that_train_another_model_are_not_judged_on_loss():
    """With top_k=4 as the baseline, the top-2 and top-8 points pair with a top-4 one, but they
    train another model: their losses are not compared (loss_delta NaN, never "diverges"),
    however far they moved."""
    df, metas = load_tables([EXPERTS])[:2]
    by_top_k = [{**m, "baseline": {"moe.top_k": 4}} for m in metas]
    df.loc[df["point_id"] == "e64-ddp-top8", "loss_compared"] *= 1.2
    t = pairing.pair_with_baseline(df, by_top_k).set_index("point_id")
    for point in ("e64-ddp-top2", "e64-ddp-top8"):
        row = t.loc[point]
        assert isinstance(row["baseline_point_id"], str), point
        assert not row["loss_judged"] and np.isnan(row["loss_delta"]) and not row["diverges"]
