"""Several runs of one suite in one report: labels, run column, plot styles, run-vs-run deltas; error bars."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from report_helpers import edited_store, fixture_store, repeated_store, with_repeats, with_speed

from moebench.report.build import build_report
from moebench.report.plots import speedup, throughput_vs_experts
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import load_tables

SMOKE = fixture_store("smoke")
EXPERTS = fixture_store("expert-scaling")


def _second_run(meta):
    meta.update(run_id="20261130-090000-9f3e", created_at="2026-11-30T09:00:00+00:00",
                git={"commit": "7e1f00aa12", "dirty": False})


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A is the smoke fixture; run B (a later commit) has ddp 10% slower, the rest unchanged; 3 repeats each."""
    root = tmp_path_factory.mktemp("runs")
    a = edited_store(SMOKE, root / "a", lambda r: with_repeats(r, 3, 1.0, 0.02, seed=1))
    b = edited_store(SMOKE, root / "b", lambda r: with_repeats(r, 3, 0.9 if r["point_id"] == "ddp" else 1.0, 0.02,
                                                               seed=2), _second_run)
    html = build_report([a, b], root / "out").read_text()
    return html, (root / "out" / "report.md").read_text(), pd.read_csv(root / "out" / "results.csv")


def test_every_label_names_its_run(two_runs):
    _, md, csv = two_runs
    assert set(csv["run"]) == {"c3d4@0d579b9", "9f3e@7e1f00a"}
    assert all(label.startswith(f"{run}: ") for label, run in zip(csv["label"], csv["run"], strict=True))
    points = csv.groupby(["run", "point_id"])["label"]
    assert (points.nunique() == 1).all() and (points.size() == 3).all()  # one label per point, on every repeat
    assert csv.drop_duplicates(["run", "point_id"])["label"].is_unique
    assert "| point | run | speedup |" in md


def test_run_vs_run_delta_table_uses_the_same_statistics(two_runs):
    html, md, _ = two_runs
    section = md.split("### Run vs run")[1].split("###")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in section.splitlines() if line.startswith("| ddp")
            or line.startswith("| fsdp")}
    assert set(rows) == {"ddp ep2", "ddp ep2 rowwise", "fsdp"}
    assert "| 0.9" in rows["ddp ep2"] and "| slower |" in rows["ddp ep2"]
    assert "| within noise |" in rows["fsdp"]
    assert "<h2 id=\"run-vs-run\">Run vs run</h2>" in html
    answer = md.split("### Answer")[1].split("| point |")[0]
    assert "**run 9f3e@7e1f00a vs run c3d4@0d579b9**: 0.9" in answer
    assert "over 3 points, 3 runs each: 1 slower, 2 within noise (lowest 0.9" in answer
    assert "**c3d4@0d579b9: ddp ep2 vs fsdp**" in answer and "**9f3e@7e1f00a: ddp ep2 vs fsdp**" in answer


def test_one_run_has_no_run_column_and_no_deltas(tmp_path):
    build_report(SMOKE, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| point | speedup |" in md and "Run vs run" not in md and "**ddp ep2 vs fsdp**" in md


def test_throughput_lines_have_error_bars_and_a_style_per_run(tmp_path):
    b = edited_store(EXPERTS, tmp_path / "b", lambda r: with_speed(r, 0.95, 0.02, seed=3), _second_run)
    t = pair_with_baseline(*load_tables([EXPERTS, b])[:2])
    fig = throughput_vs_experts(t)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 6  # 3 layouts x 2 runs
    styles = {c.get_label(): c.lines[0].get_linestyle() for c in bars}
    assert {s for lab, s in styles.items() if "9f3e@7e1f00a" in lab} != {s for lab, s in styles.items()
                                                                          if "c3d4" in lab or "a1b2" in lab}
    assert all(any(len(seg) for seg in c.lines[2][0].get_segments()) for c in bars)
    plt.close(fig)


def test_speedup_plot_has_interval_whiskers(tmp_path):
    t = pair_with_baseline(*load_tables([repeated_store(EXPERTS, tmp_path / "e", 3, noise=0.02, seed=1)])[:2])
    fig = speedup(t)
    (bars,) = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    widths = [seg[1][0] - seg[0][0] for seg in bars.lines[2][0].get_segments()]
    assert len(widths) == 8 and all(w > 0 for w in widths)
    plt.close(fig)


def test_repeats_get_a_marker_each_and_a_spread_column(tmp_path):
    store = repeated_store(EXPERTS, tmp_path / "e", 3, noise=0.02, run_offset=0.03, seed=1)
    t = pair_with_baseline(*load_tables([store])[:2])
    fig = throughput_vs_experts(t)
    marks = [c for c in fig.axes[0].collections if c.get_gid() == "repeats"]
    lines = [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]
    points = sum(len(c.lines[0].get_xdata()) for c in lines)
    assert sum(len(c.get_offsets()) for c in marks) == 3 * points  # one hollow marker per repeat
    plt.close(fig)
    ok = t[t["status"] == "ok"]
    assert (ok["runs"] == 3).all() and (ok["run_spread"] > 0).all()
    build_report(store, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| runs | run spread |" in md  # the failed points ran 0 times: the runs column stays


def test_two_runs_of_one_commit_are_blamed_on_the_environment(tmp_path):
    """Same commit, same configs, the machine's calibrated speed down by half: the report says so."""
    def later(meta):
        meta.update(run_id="20261130-090000-9f3e", created_at="2026-11-30T09:00:00+00:00")

    b = edited_store(SMOKE, tmp_path / "b", lambda r: {**with_speed(r, 0.6, 0.02, seed=2),
                                                       "peak_flops": r["peak_flops"] / 2}, later)
    build_report([SMOKE, b], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "run c3d4@0d579b9 and run 9f3e@0d579b9 ran the same commit and the same configs" in md
    # the first run (c3d4) measured 110, the later one (9f3e) 55: named in that order
    assert ("calibrated speed differs between run c3d4@0d579b9 and run 9f3e@0d579b9 (110 GFLOP/s vs 55 GFLOP/s, "
            "-50%)") in md
    assert "moebench check --against REV SUITE" in md


def test_every_why_line_and_baseline_cell_names_its_run(two_runs):
    """With two runs of a suite loaded, a Why sentence and a baseline cell say which run they are about."""
    _, md, _ = two_runs
    why = md.split("**Why** (measured time breakdown):\n\n")[1].split("\n\n")[0]
    sentences = [line for line in why.splitlines() if line.startswith("- ")]
    assert sentences and all(line.startswith(("- c3d4@0d579b9: ", "- 9f3e@7e1f00a: ")) for line in sentences)
    rows = [line.split(" | ") for line in md.split("| point |")[1].split("\n\n")[0].splitlines()[2:]]
    header = ["point", *md.split("| point | ")[1].split(" |\n")[0].split(" | ")]
    cells = [dict(zip(header, row, strict=False))["baseline"] for row in rows]
    assert cells and all(c in ("c3d4@0d579b9: fsdp", "9f3e@7e1f00a: fsdp") for c in cells), cells


def test_two_suites_loaded_name_their_suite_in_each_subject(tmp_path):
    """A report over two suites starts each Answer line and baseline cell with the suite it is about."""
    build_report([SMOKE, EXPERTS], tmp_path)
    md = (tmp_path / "report.md").read_text()
    answer = md.split("### Answer")[1].split("### Points")[0]
    assert "- **smoke: ddp ep2 vs fsdp**: " in answer and "- **expert-scaling: ddp ep8 vs fsdp**: " in answer
    assert "| smoke: fsdp |" in md and "| expert-scaling: fsdp, num_experts=8 |" in md
    # the device phrases differ: each says which suite ran on it, the suites in name order
    assert ("expert-scaling on 8 x NVIDIA H200, NCCL, bf16 dense peak 989 TFLOP/s; smoke on CPU: 1 thread per rank, "
            "gloo, bf16 matmul peak 110 GFLOP/s. Tokens/s per device") in answer


def test_run_tags_keep_a_date_time_run_id_whole():
    from moebench.results.table import run_tag

    git = {"git": {"commit": "0d579b9abc", "dirty": False}}
    assert run_tag({"run_id": "20261202-054512-ab12", **git}) == "ab12@0d579b9"
    assert run_tag({"run_id": "20261202-054512", **git}) == "20261202-054512@0d579b9"  # was 20261202-054@
    assert run_tag({"run_id": "nightly-run", **git}) == "nightly-run@0d579b9"


def test_a_store_named_after_its_suite_is_named_once(tmp_path):
    import pandas as pd

    from moebench.report.completeness import RunStatus
    from moebench.report.details import run_notes
    from moebench.report.render import run_info

    meta = {"suite": "smoke", "run_id": "smoke", "host": {"gpus": []}}
    assert run_info([meta], pd.DataFrame({"run_id": ["smoke"]}))[0][0] == "smoke"  # was "smoke / smoke"
    assert run_info([{**meta, "run_id": "r1"}], pd.DataFrame({"run_id": ["r1"]}))[0][0] == "smoke / r1"
    notes = run_notes([RunStatus(tmp_path / "smoke", "smoke", "a suite"), RunStatus(tmp_path / "r1", "smoke", "x")])
    assert [name for name, _ in notes] == ["smoke", "smoke / r1"]
