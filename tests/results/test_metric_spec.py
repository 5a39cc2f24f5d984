"""``moebench.record.METRICS`` is the one home of each metric's label, unit, direction and format."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from report_helpers import fixture_store

from moebench.errors import ConfigError
from moebench.record import METRICS, finite, to_json_line
from moebench.report import planned, render
from moebench.report.gate import check
from moebench.report.gate import output as check_output
from moebench.report.plots import render_all
from moebench.results import pairing, table
from moebench.results.table import load_tables
from moebench.sweep import suite
from moebench.sweep.progress import metric_parts


def test_the_table_copies_every_record_metric_of_the_spec_and_derives_the_rest():
    record = [m.name for m in METRICS.values() if not m.derived]
    assert list(table.RECORD_SCALARS) == record
    t = pairing.pair_with_baseline(*load_tables([fixture_store("smoke")])[:2])
    assert {m.name for m in METRICS.values() if m.derived} <= set(t.columns)


@pytest.mark.parametrize("name", list(METRICS))
def test_the_gate_takes_each_direction_from_the_spec(name):
    spec = METRICS[name]
    assert (name in check.HIGHER_IS_BETTER, name in check.LOWER_IS_BETTER) == (
        spec.direction == "higher", spec.direction == "lower")
    assert (name in check.FROM_STEP_TIME) == spec.from_step_time
    if spec.direction is not None:
        assert check.parse_metric(f"{name}:5%").higher_is_better == (spec.direction == "higher")
    elif name.endswith(("_bytes", "_s")):  # no direction of its own: the suffix default applies
        assert not check.parse_metric(f"{name}:5%").higher_is_better
    else:
        with pytest.raises(ConfigError, match="unknown direction"):
            check.parse_metric(f"{name}:5%")


def test_the_suffix_default_still_holds_for_fields_outside_the_spec():
    assert not check.parse_metric("some_new_bytes:5%").higher_is_better
    assert not check.parse_metric("some_new_s:5%").higher_is_better
    with pytest.raises(ConfigError, match="unknown direction"):
        check.parse_metric("some_new_count:5%")


def test_every_metric_column_shows_the_spec_header_and_format():
    shown = [(header, col, kind) for header, col, kind in render.COLUMNS if col in METRICS]
    assert {col for _, col, _ in shown} >= {"tokens_per_s_per_device", "peak_mem_bytes", "speedup"}
    for header, col, kind in shown:
        assert (header, kind) == (METRICS[col].header, METRICS[col].fmt), col
    for name in ("tokens_per_s_per_device", "peak_mem_bytes", "comm_bytes_total"):
        assert f"{METRICS[name].header} plan" in planned.HEADERS


def test_render_knows_every_format_kind_of_the_spec():
    for kind in {m.fmt for m in METRICS.values()}:
        assert render.fmt(1234.5, kind) != table.norm_value(1234.5), kind
    assert render.fmt(0.0125, "ms") == "12.5"
    assert render.fmt(math.nan, "ms") == ""


def test_plots_take_metric_labels_from_the_spec(monkeypatch):
    """Relabel every metric: each one a plot names must show its new label."""
    for name, m in list(METRICS.items()):
        monkeypatch.setitem(METRICS, name, dataclasses.replace(m, label=f"<{name}>"))
    t = pairing.pair_with_baseline(*load_tables([fixture_store("expert-scaling")])[:2])
    texts = []
    for _, fig in render_all(t, ""):
        assert isinstance(fig, Figure)  # this fixture has data for every plot
        for ax in fig.axes:
            texts += [ax.get_xlabel(), ax.get_ylabel()]
            if ax.get_legend():
                texts += [x.get_text() for x in ax.get_legend().get_texts()]
        plt.close(fig)
    shown = " ".join(texts)
    assert {name for name in METRICS if f"<{name}>" in shown} == {
        "tokens_per_s_per_device", "tflops_per_device", "mfu", "loss_last", "peak_mem_bytes",
        "peak_mem_reserved_bytes", "peak_rss_bytes", "nvml_peak_mem_used_bytes", "comm_bytes_total",
        "load_imbalance", "dropped_tokens", "speedup"}


def test_the_status_line_names_throughput_as_the_spec_does():
    assert metric_parts({"tokens_per_s": 800.0}) == [f"800 {METRICS['tokens_per_s'].header}"]


def test_the_status_line_shows_a_dropped_share_above_zero():
    record = {"tokens_per_s": 800.0, "tokens_per_step": 1024, "timed_steps": 20, "dropped_tokens": 8929,
              "config": {"model": {"n_layers": 2, "n_dense_layers": 0}, "moe": {"top_k": 2}}}
    assert metric_parts(record)[-1] == "drops 10.90% of routes"  # 8929 of 1024 x 2 x 2 x 20 routes
    assert not any("drops" in p for p in metric_parts({**record, "dropped_tokens": 0}))


def test_finite_and_the_default_baseline_have_one_definition():
    data = {"a": [1.0, math.nan, (math.inf, 2)], "b": -math.inf}
    assert finite(data) == {"a": [1.0, None, [None, 2]], "b": None}
    assert json.loads(to_json_line(data)) == finite(data)
    assert check_output.finite is finite
    assert pairing.DEFAULT_BASELINE is suite.DEFAULT_BASELINE


def test_record_stays_a_low_layer():
    """The spec lives below report and sweep, and loads without torch."""
    code = ("import sys, moebench.record; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('moebench.report', "
            "'moebench.sweep'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
