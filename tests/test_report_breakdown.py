"""The report's time-breakdown figure and the sentence that explains a speedup by its phases."""

import pandas as pd
from matplotlib.figure import Figure

from moebench.record import PHASES
from moebench.report.breakdown import explain, explanations, phases_of, plot_breakdown


def _row(point, variant, baseline, seconds, speedup=float("nan")):
    row = {"status": "ok", "point_id": point, "run_id": "r1", "baseline_point_id": baseline,
           "baseline_row": int(baseline[1:]), "variant": variant,
           "baseline_variant": "fsdp", "label": f"{variant}, num_experts=8", "axes": "num_experts=8", "run": "r1",
           "speedup": speedup}
    row.update({f"time_breakdown_s.{p}": seconds.get(p, 0.0) for p in PHASES})
    return row


FSDP = {"attention": 0.10, "experts": 0.20, "param_gather": 0.50, "grad_reduce": 0.15, "optimizer": 0.05}
DDP = {"attention": 0.10, "experts": 0.20, "dispatch": 0.05, "grad_reduce": 0.05, "optimizer": 0.05}


def _table():
    return pd.DataFrame([_row("p0", "fsdp", "p0", FSDP), _row("p1", "ddp ep2", "p0", DDP, speedup=2.2)])


def test_explain_names_the_phases_that_make_the_difference():
    t = _table()
    text = explain(t.loc[1], t.loc[0])
    # fsdp: 1.0 s, half of it gathering; ddp: 0.45 s. Saved: gather 0.5, reduce 0.1; dispatch costs 0.05
    assert text == ("fsdp spends 50% of its step in param_gather and 20% of its step in experts; ddp ep2 is "
                    "550 ms per step faster: saves 500 ms in param_gather, 100 ms in grad_reduce; "
                    "spends 50 ms more in dispatch")
    assert explanations(t) == [f"ddp ep2 vs fsdp (at num_experts=8): {text}"]


def test_no_breakdown_no_sentence_and_a_reason_instead_of_a_plot():
    t = _table()
    t[[f"time_breakdown_s.{p}" for p in PHASES]] = float("nan")
    assert phases_of(t.loc[0]) is None and explanations(t) == []
    assert "no compared point" in plot_breakdown(t)


def test_plot_draws_each_point_beside_its_baseline():
    fig = plot_breakdown(_table())
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [tick.get_text() for tick in ax.get_yticklabels()] == ["fsdp, num_experts=8", "ddp ep2, num_experts=8"]
    assert {text.get_text() for text in ax.get_legend().get_texts()} == set(FSDP) | set(DDP)


def test_report_answer_says_why(tmp_path):
    """The answer box of a report over the fixture store names the phases behind each speedup."""
    from pathlib import Path

    from moebench.report.build import build_report

    store = Path(__file__).parent / "fixtures" / "results" / "smoke" / "20261128-110000-c3d4"
    build_report(store, tmp_path)
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "**Why** (measured time breakdown):" in md and "fsdp spends" in md and "param_gather" in md
    assert html.index("Why</b>") < html.index("<table")


def test_planned_and_measured_breakdowns_side_by_side():
    """GPU points get their plan's breakdown (same phase keys) drawn under the measured one."""
    from pathlib import Path

    from moebench.report.breakdown import plot_planned_breakdown
    from moebench.report.build import load_tables

    store = Path(__file__).parent / "fixtures" / "results" / "expert-scaling" / "20261128-100000-a1b2"
    t, _, _ = load_tables([store])
    fig = plot_planned_breakdown(t)
    labels = [tick.get_text().replace("\n", " ") for tick in fig.axes[0].get_yticklabels()]
    assert labels and len(labels) % 2 == 0
    assert all(a.endswith("measured") and b.endswith("planned") for a, b in zip(labels[::2], labels[1::2], strict=True))
    assert "no GPU point" in plot_planned_breakdown(t[t["device"] != "cuda"])
