"""History plots: three or more runs of one suite give a trend per point, ordered by run time."""

from __future__ import annotations

import pytest
from report_helpers import edited_store, fixture_store, with_repeats

from moebench.report.build import build_report
from moebench.report.history import histories, history_figure, run_label, series
from moebench.results.pairing import pair_with_baseline
from moebench.results.store import commit_label
from moebench.results.table import load_tables

SMOKE = fixture_store("smoke")
# (run id, created_at, commit, speed factor); listed out of time order on purpose
RUNS = [("20261130-120000-cccc", "2026-11-30T12:00:00+00:00", "c" * 40, 0.8),
        ("20261128-120000-aaaa", "2026-11-28T12:00:00+00:00", "a" * 40, 1.0),
        ("20261129-120000-bbbb", "2026-11-29T12:00:00+00:00", "b" * 40, 1.1)]


def _runs(tmp_path, runs=RUNS):
    paths = []
    for run_id, created, commit, factor in runs:
        def meta_edit(m, run_id=run_id, created=created, commit=commit):
            m.update(run_id=run_id, created_at=created, git={"commit": commit, "dirty": commit.startswith("c")})

        paths.append(edited_store(SMOKE, tmp_path / "smoke" / run_id,
                                  lambda r, f=factor: with_repeats(r, 3, f, 0.01, seed=1), meta_edit))
    return paths


def test_runs_are_ordered_by_time_and_labelled_by_commit(tmp_path):
    table, metas, _ = load_tables(_runs(tmp_path))
    (runs,) = histories(metas).values()
    assert [commit_label(m) for m in runs] == ["aaaaaaa", "bbbbbbb", "ccccccc+dirty"]
    s = series(pair_with_baseline(table, metas), runs)
    fsdp = s[s["point"] == "fsdp"].sort_values("run")
    # speed factors 1.0, 1.1, 0.8 in time order
    ratios = (fsdp["tokens"] / fsdp["tokens"].iloc[0]).round(2).tolist()
    assert ratios == [1.0, 1.1, 0.8]
    assert (fsdp["tokens_low"] <= fsdp["tokens"]).all() and (fsdp["tokens"] <= fsdp["tokens_high"]).all()
    assert fsdp["speedup"].isna().all()  # the baseline itself: the 1.0 line
    ddp = s[s["point"] != "fsdp"]
    assert ddp["speedup"].notna().all() and (ddp["speedup_low"] <= ddp["speedup"]).all()


def test_fewer_than_three_runs_have_no_history(tmp_path):
    _, metas, _ = load_tables(_runs(tmp_path, RUNS[:2]))
    assert histories(metas) == {}


def test_report_draws_the_history_plot_from_a_suite_folder(tmp_path):
    _runs(tmp_path)
    html = build_report([tmp_path / "smoke"], tmp_path / "report")
    assert (html.parent / "plots" / "history_smoke.svg").stat().st_size > 0
    assert "History of smoke over 3 runs" in (html.parent / "report.md").read_text()


def test_two_runs_draw_no_history_plot(tmp_path):
    html = build_report(_runs(tmp_path, RUNS[:2]), tmp_path / "report")
    assert not (html.parent / "plots" / "history_smoke.svg").exists()


def test_no_ok_point_is_a_note(tmp_path):
    paths = _runs(tmp_path)
    table, metas, _ = load_tables(paths)
    (runs,) = histories(metas).values()
    assert history_figure(table.assign(status="failed"), runs) == "no ok point in these runs"


@pytest.mark.parametrize("meta, label", [({"git": {"commit": "0d579b9e1f", "dirty": False}}, "0d579b9"),
                                         ({"git": None}, "unknown")])
def test_commit_label(meta, label):
    assert commit_label(meta) == label


def test_history_ticks_carry_the_run_time():
    """Three runs of one commit are three ticks that differ: the machine, not the code, may have moved."""
    runs = [{"git": {"commit": "0d579b9e1f", "dirty": False}, "created_at": f"2026-11-28T1{h}:05:00+00:00"}
            for h in range(3)]
    assert [run_label(m) for m in runs] == ["0d579b9\n11-28 10:05", "0d579b9\n11-28 11:05", "0d579b9\n11-28 12:05"]
    assert run_label({"git": None}) == "unknown\ntime unknown"


def _texts(fig) -> list[str]:
    return [t.get_text().replace("\n", " ") for t in fig.texts]


def test_a_far_wider_interval_is_cut_at_the_axis_and_said(tmp_path):
    """One point's two far-apart repeats give a whisker ~30x its median: the axis fits the other lines, and the
    figure says one interval runs past it instead of flattening them."""
    paths = _runs(tmp_path)
    wild = edited_store(SMOKE, tmp_path / "wild", lambda r: with_repeats(r, 2, 1.0, 0.01, seed=1, run_offset=0.5)
                        if r["point_id"] == "ddp" else with_repeats(r, 3, 1.0, 0.01, seed=1),
                        lambda m: m.update(run_id="20261201-120000-dddd", created_at="2026-12-01T12:00:00+00:00"))
    table, metas, _ = load_tables([*paths, wild])
    t = pair_with_baseline(table, metas)
    (runs,) = histories(metas).values()
    s = series(t, runs)
    widest = s.loc[s["tokens_high"].idxmax()]
    assert widest["tokens_high"] > 2 * widest["tokens"]  # the repeats' spread makes it that wide
    fig = history_figure(t, runs)
    top = fig.axes[0].get_ylim()[1]
    assert top < widest["tokens_high"] and top < 1.3 * s["tokens"].max()
    assert any("cut at the axis" in x for x in _texts(fig))
    assert not any("have no interval" in x for x in _texts(fig))


def test_markers_without_an_interval_say_why(tmp_path):
    runs = [(run_id, created, commit, factor) for run_id, created, commit, factor in RUNS]
    paths = []
    for run_id, created, commit, factor in runs:
        def meta_edit(m, run_id=run_id, created=created, commit=commit):
            m.update(run_id=run_id, created_at=created, git={"commit": commit, "dirty": False})

        paths.append(edited_store(SMOKE, tmp_path / "smoke" / run_id,
                                  lambda r, f=factor: with_repeats(r, 3, f, 0.01, seed=1, steps=3), meta_edit))
    table, metas, _ = load_tables(paths)
    (hist,) = histories(metas).values()
    fig = history_figure(pair_with_baseline(table, metas), hist)
    texts = _texts(fig)
    assert any(x.startswith("9 of 9 tokens/s markers have no interval: a run of the point has fewer than 5")
               for x in texts)
    assert any("speedup markers have no interval" in x for x in texts)
