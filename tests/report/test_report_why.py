"""A why for every pair, verdict or not: phase differences, work per rank, bytes and bandwidth per axis, and
the per-step throughput curve (moebench.report.why, plots.step_throughput)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from report_helpers import fixture_store

from moebench.record import PHASES
from moebench.report.build import build_report
from moebench.report.plots import step_throughput
from moebench.report.why import comm_table, pair_whys, phase_table, work_table
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import load_tables

SMOKE = fixture_store("smoke")


def _side(variant: str, phases: dict[str, float], timed: float, **extra: object) -> pd.Series:
    row = {"variant": variant, "step_time_median_s": timed, "breakdown_step_s": sum(phases.values()), **extra}
    row.update({f"time_breakdown_s.{p}": phases.get(p, 0.0) for p in PHASES})
    return pd.Series(row)


def test_phase_table_puts_the_largest_difference_first_and_shows_how_much_of_the_step_it_covers():
    base = _side("fsdp", {"experts": 0.004, "param_gather": 0.003, "other": 0.001}, timed=0.010)
    point = _side("ddp ep2", {"experts": 0.0035, "dispatch": 0.0015, "other": 0.001}, timed=0.008)
    table = phase_table(point, base)
    assert table.headers == ["phase", "fsdp ms", "ddp ep2 ms", "difference ms"]
    assert table.rows == [
        ["param_gather", "3", "0", "-3"], ["dispatch", "0", "1.5", "+1.5"], ["experts", "4", "3.5", "-0.5"],
        ["other", "1", "1", "0"],
        ["sum of phases", "8", "6", "-2"], ["timed step (median)", "10", "8", "-2"],
        # the phases cover 80% and 75% of each timed step, and all of the timed difference
        ["phases' share of the timed step", "80.0%", "75.0%", "100.0%"]]


def test_no_phase_table_without_a_breakdown_on_a_side():
    base = _side("fsdp", {}, timed=0.01).drop([f"time_breakdown_s.{p}" for p in PHASES])
    assert phase_table(_side("ddp", {"experts": 0.001}, timed=0.01), base) is None


def _smoke() -> pd.DataFrame:
    repeats, metas, _ = load_tables([SMOKE])
    return pair_with_baseline(repeats, metas)


def _pair(t: pd.DataFrame, point: str) -> tuple[pd.Series, pd.Series]:
    (i,) = t.index[t["point_id"] == point]
    return t.loc[i], t.loc[t.at[i, "baseline_row"]]


def test_work_table_counts_each_ranks_expert_rows_and_flops():
    """tiny: 1,024 tokens a step, top-2, 2 MoE layers, d_model = expert_hidden = 64, 2 ranks. Each rank computes
    1,024 x 2 x 2 / 2 = 2,048 rows, 2,048 x 6 x 3 x 64 x 64 = 151 M FLOPs; ddp ep2 holds 4 of the 8 experts.
    The rowwise point dropped 37 routes over 20 timed steps: 1.85 a step over 2 ranks, 2,047 rows."""
    t = _smoke()
    table = work_table(*_pair(t, "ddp"))
    rows = {r[0]: r[1:] for r in table.rows}
    assert table.headers == ["per rank, per step", "fsdp", "ddp ep2"]
    assert rows["experts it computes rows for"] == ["8", "4"]
    assert rows["expert rows (routes) computed"] == ["2,048", "2,048"]
    assert rows["expert GEMM FLOPs"] == ["151 M", "151 M"]
    # 2,048 x 73,728 FLOPs in the experts phase's 3.75 ms
    assert rows["achieved expert FLOP/s"][0] == "40.3 GFLOP/s"
    rowwise = {r[0]: r[1:] for r in work_table(*_pair(t, "ddp-rowwise")).rows}
    assert rowwise["expert rows (routes) computed"][1] == "2,047"


def test_comm_table_gives_bandwidth_per_axis_from_the_collectives_time_or_a_lower_bound():
    t = _smoke()
    point, base = _pair(t, "ddp")
    table = comm_table(point, base)
    rows = {r[0]: r[1:] for r in table.rows}
    assert list(rows) == ["ep", "dp"]  # edp moved 0 bytes on both sides: no row
    # ddp ep2's all-to-all: 2 MiB in dispatch + combine (1.292 + 0.969 ms): whole phases, so a lower bound
    assert rows["ep"] == ["dispatch + combine", "0 B", "0", "", "2.00 MiB", "2.26", "≥ 885 MiB/s"]
    # with the collectives' own time the bandwidth is exact: 2 MiB in 1 ms
    timed = point.copy()
    timed["comm_breakdown_s.dispatch"], timed["comm_breakdown_s.combine"] = 0.0006, 0.0004
    assert {r[0]: r[1:] for r in comm_table(timed, base).rows}["ep"][-3:] == ["2.00 MiB", "1", "1.95 GiB/s"]


def test_every_pair_gets_its_tables_verdict_or_not():
    whys = pair_whys(_smoke())
    assert [w.title for w in whys] == ["ddp ep2 vs fsdp", "ddp ep2 rowwise vs fsdp"]
    assert all("no verdict" in w.speedup for w in whys)
    names = ["phases", "work per rank", "communication per mesh axis"]
    assert [[x.name for x in w.tables] for w in whys] == [names, names]
    assert "profiled steps" in whys[0].note  # the fixture's records are older: their breakdown says so


def test_the_smoke_report_explains_its_inconclusive_pairs(tmp_path):
    build_report(SMOKE, tmp_path)
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "**Why**" not in md  # the answer's Why line stays for conclusive verdicts
    section = md.split("### Why each pair differs")[1].split("\n### ")[0]
    assert "#### ddp ep2 vs fsdp" in section and "#### ddp ep2 rowwise vs fsdp" in section
    assert "| param_gather | 3.12 | 0 | -3.12 |" in section
    assert '<h2 id="why">Why each pair differs</h2>' in html and html.count('<details class="pair" open>') == 2
    assert (tmp_path / "plots" / "step_throughput.svg").is_file()


def test_step_throughput_draws_every_timed_steps_tokens_per_second_per_device():
    t = _smoke()
    fig = step_throughput(t)
    assert isinstance(fig, Figure)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"ddp ep2", "ddp ep2 rowwise", "fsdp (baseline)"}
    fsdp = t[t["point_id"] == "fsdp"].iloc[0]
    expected = 1024 / np.asarray(fsdp["step_times_s"]) / 2
    assert lines["fsdp (baseline)"].get_ydata() == pytest.approx(expected)
    assert list(lines["fsdp (baseline)"].get_xdata()) == list(range(1, 21))


def test_no_step_times_no_curve():
    t = _smoke()
    t["step_runs"] = [[] for _ in range(len(t))]
    assert step_throughput(t) == "no ok point kept its raw step times"
