"""A point's breakdown, folded from its repeats, adds up to the point's step time as each repeat's
adds up to its own (issue 44)."""

import statistics

import pytest
from report_helpers import edited_store, fixture_store, repeated_store

from moebench.record import PHASES
from moebench.report.breakdown import phases_of
from moebench.results.table import by_point, load_tables

SMOKE = fixture_store("smoke")


def _own_breakdown(record):
    """A breakdown that adds up to the record's median step, spent differently in each repeat:
    repeat 0 mostly in experts, the others mostly in attention."""
    if record["status"] != "ok":
        return record
    step = statistics.median(record["step_times_s"])
    share = 0.8 if record["repeat"] == 0 else 0.2
    phases = dict.fromkeys(PHASES, 0.0) | {"experts": share * step, "attention": (1 - share) * step}
    return {**record, "time_breakdown_s": phases, "breakdown_step_s": step}


def test_a_points_phases_add_up_to_its_step_time(tmp_path):
    """The repeats run 20% apart (a loaded machine): the first repeat's breakdown, or each phase's
    median over the repeats, misses the point's step time (the mean of the repeats' medians); the
    mean over the repeats adds up to it."""
    three = repeated_store(SMOKE, tmp_path / "three", 3, run_offset=0.2)
    store = edited_store(three, tmp_path / "s", _own_breakdown)
    records = load_tables([store])[0]
    points = by_point(records)
    ok = points[points["status"] == "ok"]
    assert len(ok) >= 2
    for _, row in ok.iterrows():
        mine = records[(records["point_id"] == row["point_id"]) & (records["status"] == "ok")]
        steps = [statistics.median(s) for s in mine["step_times_s"]]
        assert max(steps) / min(steps) > 1.05  # the repeats differ, so the choice of statistic matters
        phases = phases_of(row)
        assert sum(phases.values()) == pytest.approx(row["step_time_median_s"], rel=1e-9)
        assert phases["experts"] == pytest.approx(statistics.mean(mine["time_breakdown_s.experts"]), rel=1e-9)
        assert row["breakdown_step_s"] == pytest.approx(row["step_time_median_s"], rel=1e-9)
