"""What the report's figures and tables show: text as given, scaled units, one colour per layout,
emulated points set apart, no empty panels, integer columns as integers."""

from __future__ import annotations

import csv

import matplotlib.pyplot as plt
import pytest
from click.testing import CliRunner
from report_helpers import edited_store, fixture_store, run_cli

from moebench.record import format_bytes, format_count
from moebench.report.build import build_report
from moebench.report.figure import EMULATED_HATCH, EMULATED_LABEL, STYLE, colors_of
from moebench.report.loss import loss_curves
from moebench.report.plots import caption_below, memory, precision, routing, speedup, tflops_mfu
from moebench.report.render import fmt
from moebench.results import pairing
from moebench.results.table import load_tables

EXPERTS = fixture_store("expert-scaling")
SMOKE = fixture_store("smoke")


def _table(*stores):
    return pairing.pair_with_baseline(*load_tables(list(stores))[:2])


def _texts(fig) -> list[str]:
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [ax.get_xlabel(), ax.get_ylabel(), *(x.get_text() for x in ax.get_yticklabels())]
        if ax.get_legend():
            out += [x.get_text() for x in ax.get_legend().get_texts()]
    return out


def test_text_from_results_is_never_mathtext(tmp_path):
    def odd(record):
        return {**record, "point": {**record["point"], "train.data": "a$x$b"}}

    def meta(m):
        m["suite"] = r"$\frac{1}{0$"

    store = edited_store(SMOKE, tmp_path / "s", odd, meta)
    html = build_report(store, tmp_path / "out", title=r"$\frac{1}{0$ a$x$b").read_text()
    assert r"<h1>$\frac{1}{0$ a$x$b</h1>" in html
    speed = (tmp_path / "out" / "plots" / "speedup.svg").read_text()
    assert "data=a$x$b" in speed and r"suite: $\frac{1}{0$" in speed


def test_units_are_scaled_in_one_helper():
    assert [format_bytes(v) for v in (512, 3e6, 1.5 * 2**30, 150e9)] == ["512 B", "2.86 MiB", "1.50 GiB", "140 GiB"]
    assert [format_count(v) for v in (950, 255_296, 24.3e9)] == ["950", "255 K", "24.3 B"]
    assert fmt(2.4e6, "bytes") == "2.29 MiB" and fmt(255_296, "count") == "255 K"


def test_report_tables_show_megabytes_of_traffic(tmp_path):
    build_report(SMOKE, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| comm/step |" in md and " MiB |" in md and "0.00 |" not in md


def test_check_and_plan_print_scaled_units(monkeypatch, capsys):
    code, out, _ = run_cli(["check", "--ratio", "ddp/fsdp:peak_mem_bytes<=2", str(SMOKE)], monkeypatch, capsys)
    assert code == 0 and "625 MiB / 625 MiB" in out
    from moebench.cli import cli

    result = CliRunner().invoke(cli, ["plan", "--preset", "tiny", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert "total params     255 K" in result.output and "0.000 B" not in result.output
    assert " KiB " in result.output and "0.00   fp32" not in result.output


def test_one_colour_per_layout_label_in_every_report():
    alone, mixed = colors_of(_table(SMOKE)), colors_of(_table(SMOKE, EXPERTS))
    assert all(mixed[label] == colour for label, colour in alone.items())
    assert len(set(mixed.values())) == len(mixed)


def test_emulated_points_are_hatched_with_a_legend_entry(tmp_path):
    def as_emulated(record):
        if record["point_id"] == "ddp":
            record = {**record, "precision": "mxfp8", "precision_impl": "emulated"}
        return record

    fig = tflops_mfu(_table(edited_store(SMOKE, tmp_path / "s", as_emulated)))
    for ax in fig.axes:
        assert len([p for p in ax.patches if p.get_hatch() == EMULATED_HATCH]) == 1
    assert EMULATED_LABEL in _texts(fig)
    plt.close(fig)


def test_empty_panels_are_omitted_with_a_line_saying_why(tmp_path):
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, "dropped_tokens": 0})
    fig = routing(_table(store))
    assert len(fig.axes) == 1 and "dropped routes panel omitted: no point dropped a route" in _texts(fig)
    plt.close(fig)
    fig = routing(_table(SMOKE))
    assert len(fig.axes) == 2
    plt.close(fig)


def test_long_labels_are_wrapped():
    fig = tflops_mfu(_table(EXPERTS, SMOKE))
    ticks = [x.get_text() for x in fig.axes[0].get_yticklabels()]
    assert any("\n" in t for t in ticks) and all(len(line) <= 42 for t in ticks for line in t.splitlines())
    plt.close(fig)


def test_integer_columns_stay_integers_in_the_csv(tmp_path):
    build_report(EXPERTS, tmp_path)
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for col in ("dp", "ep", "pp", "world_size", "num_experts", "top_k", "total_params", "peak_mem_bytes",
                "comm_dp_bytes", "dropped_tokens"):
        values = [r[col] for r in rows if r[col]]
        assert values and all(v.isdigit() for v in values), (col, values[:3])
    assert any(r["peak_mem_bytes"] == "" for r in rows)  # a failed point stays empty, not 0


def test_cpu_memory_is_one_number_under_one_label():
    fig = memory(_table(SMOKE))
    texts = _texts(fig)
    legend = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert "process RSS" not in legend and "allocator peak (on CPU: the process RSS)" in legend
    assert any("on CPU: the allocator peak is the process RSS, drawn once" in t for t in texts)
    plt.close(fig)


@pytest.mark.parametrize(("store", "peak"), [(SMOKE, "calibrated matmul"), (EXPERTS, "datasheet bf16")])
def test_the_mfu_axis_names_the_records_peak(store, peak):
    fig = tflops_mfu(_table(store))
    label = fig.axes[1].get_xlabel().replace("\n", " ")
    assert label == f"MFU (% of {peak})"
    plt.close(fig)


def test_no_plot_shows_mathtext_markup(tmp_path):
    """Log-scale tick labels are mathtext in matplotlib; with mathtext off they must still read 10, 100."""
    build_report([EXPERTS, SMOKE], tmp_path)
    for svg in (tmp_path / "plots").glob("*.svg"):
        assert "mathdefault" not in svg.read_text(), svg.name


def _captioned(draw, t):
    """A figure as the report lays it out: caption and notes below, labels fitted."""
    with plt.rc_context(STYLE):
        fig = draw(t)
        caption_below(fig, "device: a caption as long as two suites' device phrases make it, " * 3)
        fig.canvas.draw()
    return fig


def _boxes(texts, renderer):
    return [x.get_window_extent(renderer) for x in texts if x.get_text()]


def _overlapping(boxes) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _inside(fig, texts) -> bool:
    renderer = fig.canvas.get_renderer()
    return all(b.x0 >= 0 and b.x1 <= fig.bbox.width for b in _boxes(texts, renderer))


def _second_run(tmp_path, edit=lambda r: r, day: int = 1):
    """A copy of the smoke fixture as a later run of the suite (on December ``day``)."""
    def later(meta):
        meta["run_id"], meta["created_at"] = f"202612{day:02d}-120000-e5f{day}", f"2026-12-{day:02d}T12:00:00+00:00"

    return edited_store(SMOKE, tmp_path / "later", edit, later)


def test_panel_x_labels_fit_their_axes_and_the_caption_the_figure():
    fig = _captioned(routing, _table(SMOKE, EXPERTS))  # long point labels squeeze both panels
    renderer = fig.canvas.get_renderer()
    assert len(fig.axes) == 2 and not _overlapping(_boxes([ax.xaxis.label for ax in fig.axes], renderer))
    assert _inside(fig, [ax.xaxis.label for ax in fig.axes]) and _inside(fig, fig.texts)
    plt.close(fig)


def test_suites_and_runs_are_ordered_by_name_and_start_whatever_the_argument_order(tmp_path):
    later = _second_run(tmp_path)
    t = _table(later, EXPERTS, SMOKE)
    assert list(dict.fromkeys(t["suite"])) == ["expert-scaling", "smoke"]
    html = build_report([later, SMOKE], tmp_path / "report").read_text()  # the Runs lines too
    assert html.index("smoke / 20261128-110000-c3d4") < html.index("smoke / 20261201-120000-e5f1")
    assert list(dict.fromkeys(t.loc[t["suite"] == "smoke", "run_id"])) == ["20261128-110000-c3d4",
                                                                            "20261201-120000-e5f1"]


def test_two_suites_baselines_are_never_one_axis_label(tmp_path):
    other = edited_store(SMOKE, tmp_path / "s", meta_edit=lambda m: m.update(suite="smoke-ddp",
                                                                              baseline={"parallel.strategy": "ddp"}))
    t = _table(other, EXPERTS)
    assert t.attrs["baselines"] == {"expert-scaling": "parallel.strategy=fsdp", "smoke-ddp": "parallel.strategy=ddp"}
    fig = _captioned(speedup, t)
    label = fig.axes[0].get_xlabel().replace("\n", " ")
    assert "parallel.strategy" not in label and " or " not in label
    notes = {x.get_text() for x in fig.texts}
    assert {"expert-scaling: baseline parallel.strategy=fsdp", "smoke-ddp: baseline parallel.strategy=ddp"} <= notes
    assert _inside(fig, [fig.axes[0].xaxis.label]) and _inside(fig, fig.texts)
    plt.close(fig)
    fig = _captioned(speedup, _table(SMOKE))
    assert "over the baseline parallel.strategy=fsdp" in fig.axes[0].get_xlabel().replace("\n", " ")
    plt.close(fig)


def test_memory_labels_of_eight_one_series_bars_do_not_collide(tmp_path):
    def rss_only(record):  # a CPU point: the allocator peak is the RSS, nothing else is drawn; labels of 2 lines
        return {**record, "peak_mem_reserved_bytes": None, "point": {**record["point"], "train.data": "fineweb-edu"}}

    first = edited_store(SMOKE, tmp_path / "first", rss_only)
    t = _table(first, _second_run(tmp_path, rss_only), _second_run(tmp_path / "b", rss_only, day=2))
    fig = _captioned(memory, t)
    ticks = fig.axes[0].get_yticklabels()
    assert len(fig.axes[0].patches) == len(ticks) == 9 and not _overlapping(_boxes(ticks, fig.canvas.get_renderer()))
    plt.close(fig)


def test_a_legend_of_one_layout_alone_is_left_out(tmp_path):
    one = edited_store(SMOKE, tmp_path / "s", lambda r: r if r["point_id"] == "fsdp" else None)
    fig = tflops_mfu(_table(one))
    assert all(ax.get_legend() is None for ax in fig.axes)
    plt.close(fig)
    fig = tflops_mfu(_table(SMOKE))
    assert fig.axes[-1].get_legend() is not None
    plt.close(fig)


def test_loss_curve_legends_name_each_line_once(tmp_path):
    fig = loss_curves(_table(SMOKE, _second_run(tmp_path)))
    assert len(fig.axes) == 2  # one panel per run's baseline
    for ax in fig.axes:
        labels = [x.get_text() for x in ax.get_legend().get_texts()]
        assert len(labels) == len(set(labels)) and sum("(baseline)" in x for x in labels) == 1
    plt.close(fig)


def test_close_final_losses_are_drawn_on_an_axis_around_them(tmp_path):
    def as_precision(record):
        if record["point_id"] != "fsdp":
            return None
        bf16 = {**record, "point_id": "bf16", "key": record["key"] + "-bf16", "precision": "bf16",
                "loss_last": record["loss_last"] + 0.004, "point": {"precision.mode": "bf16"},
                "config": {**record["config"], "precision": {**record["config"]["precision"], "mode": "bf16"}}}
        fp32 = {**record, "point": {"precision.mode": "fp32"},
                "config": {**record["config"], "precision": {**record["config"]["precision"], "mode": "fp32"}}}
        return [fp32, bf16]

    store = edited_store(SMOKE, tmp_path / "s", as_precision, lambda m: m.update(baseline={"precision.mode": "fp32"}))
    fig = precision(_table(store))
    loss_ax = fig.axes[2]
    low, high = loss_ax.get_xlim()
    assert 0 < low < 4.1558 and high > 4.1598 and high - low < 0.1
    assert "does not start at 0" in loss_ax.get_xlabel()
    assert fig.axes[0].get_xlim()[0] == 0  # tokens/s bars still start at 0
    plt.close(fig)


def _with_useful_mfu(record):
    """The smoke fixture's records as the trainer writes them now: ``useful_mfu`` beside ``mfu``, lower by the
    share of routes dropped (ddp-rowwise drops some)."""
    if record["status"] != "ok":
        return record
    kept = 0.5 if record["dropped_tokens"] else 1.0
    return {**record, "useful_mfu": record["mfu"] * kept}


def test_points_that_dropped_routes_show_their_useful_mfu(tmp_path):
    from moebench.report.render import USEFUL_MFU_NOTE, columns, table_rows

    t = _table(edited_store(SMOKE, tmp_path / "s", _with_useful_mfu))
    headers = [h for h, _, _ in columns(t)]
    assert "useful MFU (of bf16 matmul)" in headers and "MFU (of bf16 matmul)" in headers
    rows = {r[0]: dict(zip(headers, r, strict=True)) for r in table_rows(t)}
    lossy = next(label for label in rows if "rowwise" in label)
    assert rows[lossy]["useful MFU (of bf16 matmul)"] == "13.2%" and rows[lossy]["MFU (of bf16 matmul)"] == "26.4%"
    build_report(tmp_path / "s", tmp_path / "r")
    assert USEFUL_MFU_NOTE in (tmp_path / "r" / "report.md").read_text()
    # the MFU panel draws the kept routes' MFU over the lossy point's bar, with a legend entry
    fig = tflops_mfu(t)
    dotted = [p for p in fig.axes[1].patches if p.get_hatch() == ".."]
    assert [round(p.get_width(), 1) for p in dotted] == [13.2]
    assert any(x.startswith("MFU of the kept routes") for x in _texts(fig))
    plt.close(fig)


def test_no_useful_mfu_column_where_no_route_was_dropped(tmp_path):
    from moebench.report.render import columns

    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**_with_useful_mfu(r), "dropped_tokens": 0})
    t = _table(store)
    assert "useful_mfu" not in [col for _, col, _ in columns(t)]
    fig = tflops_mfu(t)
    assert not [p for p in fig.axes[1].patches if p.get_hatch() == ".."]
    plt.close(fig)


def test_speedup_bars_without_a_verdict_are_pale_and_hatched_with_a_legend_entry(tmp_path):
    from report_helpers import repeated_store

    from moebench.report.figure import INCONCLUSIVE_HATCH, INCONCLUSIVE_LABEL

    def legend(fig):
        return [x.get_text().replace("\n", " ") for x in fig.axes[0].get_legend().get_texts()]

    fig = speedup(_table(SMOKE))  # one run a side: no verdict for either comparison
    ax = fig.axes[0]
    assert [p.get_hatch() for p in ax.patches] == [INCONCLUSIVE_HATCH] * 2
    assert INCONCLUSIVE_LABEL in legend(fig) and "1.0: as fast as the baseline" in legend(fig)
    labels = [x.get_text() for x in ax.texts]
    assert len(labels) == 2 and all(x.endswith("x") for x in labels)  # each bar carries its value
    plt.close(fig)
    # three runs each, 0.5% noise: both ddp layouts are conclusively faster, drawn solid, no such legend entry
    t = _table(repeated_store(SMOKE, tmp_path / "r", n=3, noise=0.005))
    assert set(t.loc[t["speedup"].notna() & (t["baseline_point_id"] != t["point_id"]), "speedup_verdict"]) == {"faster"}
    fig = speedup(t)
    assert [p.get_hatch() for p in fig.axes[0].patches] == [None, None]
    assert INCONCLUSIVE_LABEL not in legend(fig)
    plt.close(fig)
