"""What qualifies a verdict besides unequal work: a throttled side and an emulated side. The Answer says
so in amber, a group's range leaves emulated points out and says how many, bars and cells are marked."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from report_helpers import fixture_store, repeated_store

from moebench.report.figure import THROTTLED_LABEL
from moebench.report.headline import headline
from moebench.report.plots import speedup, tflops_mfu
from moebench.report.render import CSS, headline_html, speedup_cell
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import load_tables
from moebench.sweep.progress import summary_line

EXPERTS = fixture_store("expert-scaling")  # its e64-fsdp baseline ran with throttled clocks


def _paired(store):
    return pair_with_baseline(*load_tables([store])[:2])


def _emulated_fp8(record):
    """The 64-expert points of the three layouts ran fp8 emulated (a machine without fp8 GEMMs)."""
    if record["point_id"] in ("e64-fsdp", "e64-ddp", "e64-ddp-rowwise"):
        record = {**record, "precision": "fp8", "precision_impl": "emulated"}
        record["config"]["precision"]["mode"] = "fp8"
    return record


@pytest.fixture(scope="module")
def experts3(tmp_path_factory):
    return _paired(repeated_store(EXPERTS, tmp_path_factory.mktemp("e3") / "s", 3, noise=0.01, seed=1))


@pytest.fixture(scope="module")
def emulated3(tmp_path_factory):
    return _paired(repeated_store(EXPERTS, tmp_path_factory.mktemp("m3") / "s", 3, _emulated_fp8, noise=0.01,
                                  seed=1))


def test_a_throttled_baseline_qualifies_the_verdict_and_the_range(experts3):
    """ddp at 64 experts is clearly faster than fsdp, whose clocks throttled: the point reads
    "faster (baseline throttled)" in amber, and the group's highest point names it."""
    lines, details = headline(experts3)
    e64 = next(d for d in details if d.subject == "ddp ep8 vs fsdp at num_experts=64")
    assert e64.verdict == "qualified" and "] faster (baseline throttled) (3 runs each)" in e64.answer
    group = next(x for x in lines if x.subject == "ddp ep8 vs fsdp")
    assert group.verdict == "qualified"
    assert "at num_experts=64 (baseline throttled)" in group.detail and "at num_experts=8," in group.detail
    assert "1 point(s) with a throttled side (1 baseline throttled)" in group.flags
    html = headline_html(experts3)
    assert '<b>ddp ep8 vs fsdp</b>: <span class="v-qualified">' in html and ".v-qualified{color:#b36b00" in CSS
    assert '<b>ddp vs fsdp at n_dense_layers=8</b>: <span class="v-faster">' in html  # unthrottled stays green
    cells = {r["point_id"]: speedup_cell(r) for _, r in experts3.iterrows()}
    assert "⚠ baseline throttled" in cells["e64-ddp"] and "throttled" not in cells["e32-ddp"]


def test_a_throttled_side_without_a_verdict_is_a_warning():
    """One run a side gives no verdict to qualify: the point carries the throttle as a warning."""
    _, details = headline(_paired(EXPERTS))
    e64 = next(d for d in details if d.subject == "ddp ep8 vs fsdp at num_experts=64")
    assert e64.verdict == "no verdict" and "(baseline throttled)" not in e64.answer
    assert e64.flags == ["baseline throttled: NVML saw the GPU clocks throttle in the timed window: "
                         "the ratio overstates the speedup"]


def test_emulated_points_leave_the_range_and_qualify_their_own_lines(emulated3):
    lines, details = headline(emulated3)
    group = next(x for x in lines if x.subject == "ddp ep8 vs fsdp")
    # 2.13x at 64 experts was emulated fp8: the range is the three real points'
    assert group.answer.startswith("1.06x to 1.58x over 3 points, 3 runs each: 3 faster"), group.answer
    assert group.flags[0] == "1 emulated fp8 point(s) left out of the range and tally (not the format's speed)"
    assert group.verdict == "faster"  # what is left is plain: the emulated point no longer colours it
    e64 = next(d for d in details if d.subject.startswith("ddp ep8 vs fsdp at num_experts=64"))
    assert e64.verdict == "qualified" and "faster (baseline throttled; both sides emulated fp8)" in e64.answer
    cells = {r["point_id"]: speedup_cell(r) for _, r in emulated3.iterrows()}
    assert "⚠ both sides emulated fp8" in cells["e64-ddp"]


def test_a_group_of_emulated_points_only_keeps_them(tmp_path):
    """A suite run emulated throughout has nothing else to range over: every point stays, each qualified."""
    def all_fp8(record):
        record = {**record, "precision": "fp8", "precision_impl": "emulated"}
        record["config"]["precision"]["mode"] = "fp8"
        return record

    t = _paired(repeated_store(fixture_store("smoke"), tmp_path / "s", 3, all_fp8, noise=0.01, seed=1))
    lines, _ = headline(t)
    assert lines and all("left out" not in " ".join(x.flags) for x in lines)
    assert all("emulated fp8" in x.answer for x in lines if x.verdict == "qualified")


def test_throttled_bars_are_outlined_with_a_legend_entry():
    t = _paired(EXPERTS)
    fig = speedup(t)  # ratio bars: the point's or its baseline's clocks throttled (both 64-expert ddp layouts)
    (ax,) = fig.axes
    assert len([p for p in ax.patches if p.get_gid() == "throttled"]) == 2
    assert THROTTLED_LABEL in [x.get_text() for x in ax.get_legend().get_texts()]
    plt.close(fig)
    fig = tflops_mfu(t)  # the point's own figures: only e64-fsdp ran throttled
    assert all(len([p for p in ax.patches if p.get_gid() == "throttled"]) == 1 for ax in fig.axes)
    plt.close(fig)


def test_run_lines_say_emulated():
    record = {"point_id": "p003", "status": "ok", "point": {"precision.mode": "fp8"}, "precision": "fp8",
              "precision_impl": "emulated", "tokens_per_s_per_device": 740.0, "point_wall_s": 12.0}
    assert summary_line(record) == "p003    ok                740                    12s mode=fp8  fp8 emulated"
