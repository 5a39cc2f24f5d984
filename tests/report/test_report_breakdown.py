"""The report's time-breakdown figure and the sentence that explains a speedup by its phases."""

import pandas as pd
from matplotlib.figure import Figure

from moebench.record import PHASES
from moebench.report.breakdown import explain, explanations, phases_of, plot_breakdown


def _row(point, variant, baseline, seconds, speedup=float("nan")):
    row = {"status": "ok", "point_id": point, "run_id": "r1", "baseline_point_id": baseline,
           "baseline_row": int(baseline[1:]), "variant": variant,
           "baseline_variant": "fsdp", "label": f"{variant}, num_experts=8", "axes": "num_experts=8", "run": "r1",
           "subject": "" if point == baseline else f"{variant} vs fsdp", "subject_at": "num_experts=8",
           "speedup": speedup}
    row.update({f"time_breakdown_s.{p}": seconds.get(p, 0.0) for p in PHASES})
    total = sum(seconds.values())
    row.update({"breakdown_step_s": total, "step_time_median_s": total, "inconclusive": False,
                "speedup_low": speedup * 0.9, "speedup_high": speedup * 1.1})
    return row


def _profiled(t):
    """The table as records from before the timed-step breakdown have it: a profiled step instead."""
    return t.assign(profiled_step_s=t["breakdown_step_s"]).drop(columns="breakdown_step_s")


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
    # each label states the phases' total it draws and the timed median beside it
    assert [tick.get_text().replace("\n", " ") for tick in ax.get_yticklabels()] == [
        "fsdp, num_experts=8 (phases 1,000 ms, timed 1,000 ms)",
        "ddp ep2, num_experts=8 (phases 450 ms, timed 450 ms)"]
    assert {text.get_text() for text in ax.get_legend().get_texts()} == set(FSDP) | set(DDP)


def test_report_gives_no_why_for_inconclusive_comparisons(tmp_path):
    """The fixture store's comparisons are single runs (no verdict): the report explains none."""
    from pathlib import Path

    from moebench.report.build import build_report

    store = Path(__file__).parent.parent / "fixtures" / "results" / "smoke" / "20261128-110000-c3d4"
    build_report(store, tmp_path)
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "no verdict" in md
    assert "**Why**" not in md and "Why</b>" not in html
    # its points were profiled: the breakdown table is there, each phase as mean / worst rank
    assert "### Time breakdown" in md and "Time breakdown</h2>" in html and " / " in md


def test_planned_and_measured_breakdowns_side_by_side():
    """GPU points get their plan's breakdown (same phase keys) drawn under the measured one."""
    from pathlib import Path

    from moebench.report.breakdown import plot_planned_breakdown
    from moebench.results.table import load_tables

    store = Path(__file__).parent.parent / "fixtures" / "results" / "expert-scaling" / "20261128-100000-a1b2"
    t, _, _ = load_tables([store])
    fig = plot_planned_breakdown(t)
    labels = [tick.get_text().replace("\n", " ") for tick in fig.axes[0].get_yticklabels()]
    assert labels and len(labels) % 2 == 0
    assert all(a.endswith("measured") and b.endswith("planned") for a, b in zip(labels[::2], labels[1::2], strict=True))
    assert "no GPU point" in plot_planned_breakdown(t[t["device"] != "cuda"])


def test_why_says_so_when_an_old_profiled_breakdown_does_not_describe_the_timed_step():
    """Records from before the timed-step breakdown (a profiled step, its scale and flag) still read."""
    t = _profiled(_table())
    t.loc[1, "step_time_median_s"] = 0.9  # profiled 0.45 s: off by 2x
    assert explain(t.loc[1], t.loc[0]) == ("no explanation: the profiled breakdown does not describe the "
                                           "timed step of ddp ep2 (profiled 450 ms, timed 900 ms)")
    t = _profiled(_table())
    t["breakdown_representative"] = [True, False]  # the record's flag wins over the totals
    t["breakdown_scale"], t["time_breakdown_scaled_s.experts"] = [1.0, 1.3], [0.2, 0.26]
    assert explain(t.loc[1], t.loc[0]).startswith("no explanation")
    # a timed-step breakdown describes its step whatever the totals: it is the timed step's own
    t = _table()
    t.loc[1, "step_time_median_s"] = 0.9
    assert explain(t.loc[1], t.loc[0]).startswith("fsdp spends")


def test_why_says_so_when_the_breakdown_disagrees_with_the_timed_speedup():
    t = _table()
    t.loc[1, "speedup"] = 0.8  # timed slower, the phases 550 ms faster
    assert explain(t.loc[1], t.loc[0]) == (
        "no explanation: the breakdown has ddp ep2 faster (phases 450 ms, timed 450 ms vs fsdp "
        "phases 1,000 ms, timed 1,000 ms), the timed steps slower (0.80x)")


def test_why_leaves_out_small_phases():
    t = _table()
    # 0.5 ms (under 1 ms) and 15 ms (under 2% of fsdp's 1 s step) are left out
    t.loc[1, "time_breakdown_s.router"] = 0.0005
    t.loc[1, "time_breakdown_s.head_loss"] = 0.015
    text = explain(t.loc[1], t.loc[0])
    assert "router" not in text and "head_loss" not in text and "dispatch" in text


def test_why_skips_inconclusive_and_picks_the_narrowest_interval():
    rows = [_row("p0", "fsdp", "p0", FSDP), _row("p1", "ddp ep2", "p0", DDP, speedup=2.2),
            _row("p2", "ddp ep2", "p0", DDP, speedup=3.7)]
    rows[2]["axes"] = rows[2]["subject_at"] = "num_experts=16"
    rows[2]["speedup_low"], rows[2]["speedup_high"] = 0.6, 6.2  # widest: not the one explained
    t = pd.DataFrame(rows)
    assert explanations(t)[0].startswith("ddp ep2 vs fsdp (at num_experts=8)")
    t["inconclusive"] = [False, True, True]
    assert explanations(t) == []


def test_breakdown_table_shows_the_worst_rank_beside_the_mean():
    from moebench.report.breakdown import breakdown_table

    t = _table()
    t["time_breakdown_max_s.param_gather"] = [0.6, 0.0]
    t["comm_s"], t["comm_exposed_s"] = [0.65, 0.1], [0.7, 0.12]
    headers, rows = breakdown_table(t)
    assert headers == ["point", "phases ms", "timed ms", *[p for p in PHASES if p in FSDP or p in DDP], "comm ms"]
    fsdp = dict(zip(headers, rows[0], strict=True))
    assert fsdp["param_gather"] == "500 / 600" and fsdp["phases ms"] == "1,000" and fsdp["comm ms"] == "650 / 700"
    # an older record's exposed figure is not a worst rank: it keeps its own name
    old = t.drop(columns="breakdown_step_s").assign(profiled_step_s=1.0, comm_exposed_s=[0.2, 0.05])
    headers, rows = breakdown_table(old)
    assert dict(zip(headers, rows[0], strict=True))["comm ms"] == "650, exposed 200"


def test_breakdown_cells_and_sentences_read_as_the_rest_of_the_page():
    """Milliseconds as every other table of the report writes them (``2,640``, ``0.5``), never ``2.64e+03``."""
    from moebench.report.breakdown import breakdown_table
    from moebench.report.render import fmt

    t = _table()
    t.loc[0, "time_breakdown_s.param_gather"], t.loc[1, "time_breakdown_s.router"] = 2.64, 0.0005
    t.loc[0, "breakdown_step_s"] = t.loc[0, "step_time_median_s"] = 3.34
    headers, rows = breakdown_table(t)
    fsdp, ddp = (dict(zip(headers, r, strict=True)) for r in rows)
    assert fsdp["param_gather"].startswith("2,640 ") and fsdp["timed ms"] == fmt(3.34, "ms") == "3,340"
    assert ddp["router"].startswith("0.5 ")
    assert not any("e+" in cell or "e-" in cell for r in rows for cell in r[1:])
    assert "saves 2,640 ms in param_gather" in explain(t.loc[1], t.loc[0])


def test_breakdown_table_reads_old_profiled_records():
    from moebench.report.breakdown import breakdown_table

    t = _profiled(_table())
    t.loc[0, "profiled_step_s"] = 0.8
    headers, rows = breakdown_table(t)
    assert dict(zip(headers, rows[0], strict=True))["phases ms"] == "800"
