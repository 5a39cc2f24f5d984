"""``build_report`` / ``moebench report`` on the checked-in fixture stores."""

from __future__ import annotations

import base64
import os
import re
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
from click.testing import CliRunner
from report_helpers import FIXTURES, edited_store, fixture_store, run_cli

from moebench.report.build import build_report
from moebench.report.plots import PLOTS

EXPERTS = fixture_store("expert-scaling")
SMOKE = fixture_store("smoke")
SCRIPT = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    html_path = build_report([EXPERTS], out)
    return out, html_path.read_text(), (out / "report.md").read_text()


def _valid_svg(data: bytes) -> bool:
    root = ET.fromstring(data)
    width = float(root.get("width", "0").removesuffix("pt"))
    return root.tag == "{http://www.w3.org/2000/svg}svg" and width > 100


def test_every_plot_exists_and_is_a_valid_image(report):
    out, html, md = report
    for plot in PLOTS:
        assert _valid_svg((out / "plots" / f"{plot.name}.svg").read_bytes()), plot.name
        assert f"(plots/{plot.name}.svg)" in md
    embedded = re.findall(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(embedded) == len(PLOTS)
    assert all(_valid_svg(base64.b64decode(e)) for e in embedded)
    assert "Plots not drawn" not in html


def test_html_is_self_contained_and_escapes_results(report):
    _, html, md = report
    assert "<script" not in html.lower() and SCRIPT not in md
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4  # host, point label, error, log tail
    assert not re.search(r'src="(?!data:)', html), "every resource must be embedded"
    assert all(h.startswith("#") or h.endswith(".log") for h in re.findall(r'href="([^"]*)"', html))


def test_failed_points_are_rows_not_gaps(report):
    out, html, md = report
    csv = pd.read_csv(out / "results.csv")
    assert len(csv) == 18
    assert set(csv.loc[csv["status"] != "ok", "point_id"]) == {"e128-fsdp", "bad-data"}
    assert "<td>oom</td>" in html and "CUDA out of memory" in html
    assert "| fsdp, num_experts=128 | oom |" in md


def test_tables_pair_points_with_their_fsdp_baseline(report):
    out, _, _ = report
    csv = pd.read_csv(out / "results.csv").set_index("point_id")
    assert csv.at["e64-ddp", "baseline_point_id"] == "e64-fsdp"
    assert csv.at["e64-ddp", "speedup"] == pytest.approx(
        csv.at["e64-ddp", "tokens_per_s_per_device"] / csv.at["e64-fsdp", "tokens_per_s_per_device"])
    assert csv.at["e8-fsdp", "speedup"] == 1.0
    assert csv.at["e8-ddp-fp32", "baseline_point_id"] == "e8-fsdp-fp32"  # same precision only


def _points_table(md: str) -> list[dict[str, str]]:
    table = ("| point | " + md.split("| point | ")[1].split("\n\n")[0]).splitlines()
    header, *rows = ([cell.strip() for cell in line.strip().strip("|").split("|")] for line in table)
    return [dict(zip(header, row, strict=True)) for row in rows[1:]]


def test_points_table_sorts_axis_values_as_numbers_and_names_each_baseline(report):
    """num_experts 8, 32, 64, 128 in that order (not 128 before 32, as text sorts them), the layouts of
    one point in the store's order; a baseline cell is the baseline point's label, not its id."""
    _, html, md = report
    rows = _points_table(md)
    fsdp = [r["point"] for r in rows if r["point"].startswith("fsdp, num_experts=")]
    assert fsdp == [f"fsdp, num_experts={n}" for n in (8, 32, 64, 128)], fsdp
    points = [r["point"] for r in rows]
    assert points.index("ddp ep8, num_experts=8") < points.index("fsdp, num_experts=8")  # e8-ddp < e8-fsdp
    by_point = {r["point"]: r["baseline"] for r in rows}
    assert by_point["ddp ep8, num_experts=32"] == "fsdp, num_experts=32"
    assert by_point["ddp ep8, precision=fp32"] == "fsdp, precision=fp32"
    # a label breaks after _ and = too, so the baseline column is no wider than point ids made it
    assert '<td class="words">fsdp, num_<wbr>experts=<wbr>32</td>' in html


def test_each_caption_appears_once(report):
    """Each figure carries its title and caption itself; the page adds neither a second time."""
    out, html, md = report
    caption = "device: 8 x NVIDIA H200, NCCL, bf16 dense peak 989 TFLOP/s | commit: 0d579b9c1e | suite: expert-scaling"
    for plot in PLOTS:
        svg = (out / "plots" / f"{plot.name}.svg").read_text()
        assert svg.count(caption) == 1 and svg.count(f">{plot.title}<") == 1, plot.name
    assert "<figcaption" not in html and caption.replace("|", "\\|") not in md


def test_plots_without_data_are_skipped_with_a_note(tmp_path):
    html = build_report(SMOKE, tmp_path).read_text()
    md = (tmp_path / "report.md").read_text()
    # a CPU store: nothing swept over experts, top-k or precision, and no GPU point to plan
    skipped = {"throughput_vs_experts", "precision", "top_k", "loss_vs_precision", "time_breakdown_planned"}
    for plot in PLOTS:
        assert (tmp_path / "plots" / f"{plot.name}.svg").exists() == (plot.name not in skipped), plot.name
    assert "no ok points that differ only in the expert count" in html
    assert "Plots not drawn" in html and "no points that differ only in top-k" in md
    assert "GPU point" not in md  # the GPU-only planned breakdown is not listed as missing on a CPU store


def test_report_command(tmp_path):
    from moebench.cli import cli

    result = CliRunner().invoke(cli, ["report", str(FIXTURES / "smoke"), str(EXPERTS), "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    html = (tmp_path / "r" / "report.html").read_text()
    assert "different machines" in html  # a CPU smoke run next to an H200 run
    assert len(pd.read_csv(tmp_path / "r" / "results.csv")) == 21


def test_report_command_names_skipped_lines_and_a_bad_output_folder(tmp_path, monkeypatch, capsys):
    store = edited_store(SMOKE, tmp_path / "s")
    with open(store / "records.jsonl", "a") as f:
        f.write("garbage\n")
    code, _, err = run_cli(["report", str(store), "-o", str(tmp_path / "r")], monkeypatch, capsys)
    assert code == 0 and err == f"warning: {store / 'records.jsonl'}:4: corrupt line " \
        "(Expecting value: line 1 column 1 (char 0))\n"
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(["report", str(SMOKE), "-o", str(tmp_path / "file" / "r")], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: report folder {tmp_path / 'file' / 'r'}: cannot create it (Not a directory")


def test_planned_vs_measured_for_gpu_points(report):
    _, html, md = report
    assert "<h2 id=\"planned\">Planned vs measured</h2>" in html
    section = md.split("### Planned vs measured")[1].split("###")[0]
    assert section.count("| h200 |") == 16  # every ok point of the H200 store


def test_config_is_rebuilt_exactly_from_the_flat_columns():
    from moebench.config import Config
    from moebench.report.planned import config_dict
    from moebench.results.table import load_tables

    t, _, _ = load_tables([EXPERTS])
    # e8-ddp-seed3's preset was edited after hashing (it carries the HTML-escaping probe).
    for _, row in t[(t["status"] == "ok") & (t["point_id"] != "e8-ddp-seed3")].iterrows():
        assert Config.from_dict(config_dict(row)).hash() == row["config_hash"], row["point_id"]


def test_config_is_rebuilt_from_a_folded_table_of_numpy_cells():
    """A store whose points all finished ok folds into int64 / bool_ columns, which the config's fields refuse
    as they are: config_dict gives them back as Python values."""
    from moebench.config import Config
    from moebench.report.planned import config_dict
    from moebench.results.pairing import pair_with_baseline
    from moebench.results.table import load_tables

    repeats, metas, _ = load_tables([SMOKE])
    t = pair_with_baseline(repeats, metas)
    assert str(t["config.model.d_model"].dtype) == "int64"  # the case this guards
    for i in t.index:  # .loc keeps the columns' numpy types (iterrows boxes them)
        row = t.loc[i]
        assert Config.from_dict(config_dict(row)).hash() == row["config_hash"], row["point_id"]


def test_emulated_precision_is_labelled_and_warned(tmp_path):
    """Nobody may read emulated MXFP8 speed as MXFP8 speed: label, table cell, CSV column, warning."""
    def as_emulated_mxfp8(record):
        if record["status"] == "ok" and record["config"]["moe"]["num_experts"] == 8:
            record = {**record, "precision": "mxfp8", "precision_impl": "emulated"}
            record["config"]["precision"]["mode"] = "mxfp8"
        return record

    store = edited_store(EXPERTS, tmp_path / "store", as_emulated_mxfp8)
    build_report(store, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert re.search(r"warning: \d+ point\(s\) ran mxfp8 expert GEMMs emulated", md)
    assert "mxfp8 (emulated)" in md
    csv = pd.read_csv(tmp_path / "out" / "results.csv")
    emulated = csv[csv["precision_impl"] == "emulated"]
    assert len(emulated) > 0 and emulated["label"].str.contains("emulated").all()
    assert not csv[csv["precision_impl"] != "emulated"]["label"].str.contains("emulated").any()
    plain = tmp_path / "plain"
    build_report(EXPERTS, plain)
    # the reproduce line names the report folder, whose test-made path says "emulated"
    assert "emulated" not in (plain / "report.md").read_text().replace(str(plain), "REPORT")


def test_node_count_column_when_points_ran_on_several_nodes(tmp_path):
    """A record's ``nodes`` becomes ``num_nodes`` in results.csv; the report table shows it once a point
    ran on more than one node (a one-node report has no column that is 1 everywhere)."""
    from moebench.errors import StoreError
    from moebench.report.render import columns
    from moebench.results.load import load_results
    from moebench.results.table import tidy

    def nodes(n):
        return [{"node": f"n{i + 1}", "hostname": "h", "ranks": [i]} for i in range(n)]

    def on_two_nodes(record):
        two = record["status"] == "ok" and record["config"]["moe"]["num_experts"] == 8
        return {**record, "nodes": nodes(2 if two else 1)} if record["status"] == "ok" else record

    store = edited_store(EXPERTS, tmp_path / "store", on_two_nodes)
    build_report(store, tmp_path / "out")
    csv = pd.read_csv(tmp_path / "out" / "results.csv")
    ok = csv["status"] == "ok"
    assert sorted(csv.loc[ok, "num_nodes"].unique()) == [1, 2] and csv.loc[~ok, "num_nodes"].isna().all()
    header = next(line for line in (tmp_path / "out" / "report.md").read_text().splitlines()
                  if line.startswith("| point |"))
    assert "| world | nodes | experts |" in header
    def table(name, edit):
        df, meta = load_results(edited_store(EXPERTS, tmp_path / name, edit))
        return tidy(df, [meta])

    one_node = table("one", lambda r: {**r, "nodes": nodes(1)})
    assert "num_nodes" not in [col for _, col, _ in columns(one_node)] and set(one_node["num_nodes"]) == {1.0}
    with pytest.raises(StoreError, match="field 'nodes' must be a list of"):
        table("bad", lambda r: {**r, "nodes": "n[1-2]"})


def test_report_of_a_store_where_no_point_is_ok(tmp_path, monkeypatch, capsys):
    errors = iter(["RuntimeError: boom", None, "CUDA out of memory"])
    statuses = iter(["failed", "timeout", "oom"])
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, "status": next(statuses), "error": next(errors)})
    code, _, err = run_cli(["report", str(store), "-o", str(tmp_path / "r")], monkeypatch, capsys)
    assert code == 0 and "Traceback" not in err, err
    assert err == ("warning: no point finished ok (1 failed, 1 oom, 1 timeout): the report's 'Failed points' "
                   "section says why each failed\n")
    md = (tmp_path / "r" / "report.md").read_text()
    assert "### Failed points" in md and "RuntimeError: boom" in md and "CUDA out of memory" in md
    assert "| timeout |" in md and "no ok point recorded its per-step losses" in md


def test_report_output_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moebench.report.plots.render_all", lambda *a, **k: [])  # folders are under test
    code, _, err = run_cli(["report", str(SMOKE), "-o", ""], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: -o '': an empty path names no folder"), err
    # a folder of other files is never filled (nor emptied)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = run_cli(["report", str(SMOKE), "-o", str(other)], monkeypatch, capsys)
    assert code == 2 and "not empty and not an earlier report (it holds notes.txt)" in err
    assert sorted(os.listdir(other)) == ["notes.txt"]
    # an earlier report is replaced whole: its stale plot is gone, no temporary folder is left
    out = tmp_path / "r"
    assert run_cli(["report", str(SMOKE), "-o", str(out)], monkeypatch, capsys)[0] == 0
    (out / "plots" / "stale.svg").write_text("<svg/>")
    assert run_cli(["report", str(SMOKE), "-o", str(out)], monkeypatch, capsys)[0] == 0
    assert not (out / "plots" / "stale.svg").exists() and (out / "report.html").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "r"]
    # a name over 255 bytes is one line
    code, _, err = run_cli(["report", str(SMOKE), "-o", str(tmp_path / ("x" * 300))], monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "File name too long" in err and "Traceback" not in err


def test_a_cpu_run_says_cpu_and_an_emulated_run_says_emulated():
    """Nobody reads a CPU sweep as a GPU result, or emulated fp8 speed as fp8 speed: the caption names
    the device class (a CPU: threads per rank, gloo, the calibration peak and its dtype), and a run line
    says when the quantized GEMMs were emulated."""
    from moebench.report.build import caption_for
    from moebench.sweep.progress import metric_parts

    meta = {"host": {"cpu_model": "AMD EPYC", "gpus": []}, "git": {"commit": "0d579b9c1e"}, "suite": "smoke",
            "run_id": "r1"}
    t = pd.DataFrame([{"run_id": "r1", "status": "ok", "peak_flops": 1.1e11, "peak_flops_dtype": "bf16",
                       "cpu_threads": 2}])
    assert caption_for([meta], t) == ("device: CPU: 2 threads per rank, gloo, bf16 matmul peak 110 GFLOP/s | "
                                      "commit: 0d579b9c1e | suite: smoke")
    # a record from before the bf16 calibration (no dtype, no threads) says what it knows
    old = t.drop(columns=["peak_flops_dtype", "cpu_threads"])
    assert caption_for([meta], old).startswith("device: CPU: threads per rank not recorded, gloo, fp32 matmul peak")
    record = {"tokens_per_s_per_device": 740.0, "peak_mem_bytes": 2**29, "precision": "fp8",
              "precision_impl": "emulated"}
    assert metric_parts(record) == ["740 tokens/s/dev", "fp8 emulated", "peak 512 MiB"]
    assert metric_parts({**record, "precision_impl": "native"}) == ["740 tokens/s/dev", "peak 512 MiB"]


def test_points_table_reads_answer_first_and_hides_empty_and_constant_columns():
    """The table opens with the point, its speedup and tokens/s; a column empty for every point (``clocks``
    on CPU) and the point fields one value for every point are not columns, the line above says them."""
    from moebench.report.render import columns, constant_text
    from moebench.results.pairing import pair_with_baseline
    from moebench.results.table import load_tables

    repeats, metas, _ = load_tables([SMOKE])
    table = pair_with_baseline(repeats, metas)
    shown = [col for _, col, _ in columns(table)]
    assert shown[:5] == ["label", "speedup", "tokens_per_s_per_device", "dropped_fraction", "step_time_cv"]
    assert table["throttled"].isna().all() and "throttled" not in shown  # no NVML sampler on CPU
    assert "variant" not in shown  # the point label starts with the layout
    assert "world" in constant_text(table) and "world_size" not in shown
    varied = repeats.assign(world_size=[2.0] + [4.0] * (len(repeats) - 1))
    assert "world_size" in [col for _, col, _ in columns(pair_with_baseline(varied, metas))]


def test_caption_and_notes_never_overlap_each_other_or_the_axes():
    """Notes (a panel left out and why) stack above the caption by their own line heights in
    points, on short and tall figures alike, and the axes start above them."""
    import matplotlib.pyplot as plt

    from moebench.report import figure as fg
    from moebench.report.plots import caption_below

    for height in (2.0, 9.0):
        fig, ax = plt.subplots(figsize=(6, height))
        ax.bar([0, 1], [1, 2])
        ax.set_xlabel("x label")
        fg.omitted(fig, "panel one omitted: why")
        fg.omitted(fig, "panel two omitted: a longer\nreason on two lines")
        caption_below(fig, "device: a CPU, 2 threads\nsecond caption line")
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [x.get_window_extent(renderer) for x in fig.texts]
        assert len(boxes) == 3
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (height, a, b)
        axes_bottom = ax.get_tightbbox(renderer).y0  # the x label and tick labels included
        assert all(b.y1 <= axes_bottom + 1 for b in boxes), height
        plt.close(fig)


def test_device_phrases_that_differ_name_their_runs():
    """Two runs of one suite whose CPU calibrations differ: each phrase says which run it is (its run tag)."""
    from moebench.report.device import device_classes

    metas = [{"suite": "smoke", "run_id": f"20261203-1200{i}0-ab{i}", "host": {"gpus": []},
              "git": {"commit": "3e0c6bb51", "dirty": False}} for i in (1, 2)]
    t = pd.DataFrame([{"run_id": m["run_id"], "status": "ok", "peak_flops": peak, "peak_flops_dtype": "bf16",
                       "cpu_threads": 1} for m, peak in zip(metas, (5.84e10, 4.16e10), strict=True)])
    assert device_classes(metas, t) == ("ab1@3e0c6bb on CPU: 1 thread per rank, gloo, bf16 matmul peak 58.4 GFLOP/s; "
                                        "ab2@3e0c6bb on CPU: 1 thread per rank, gloo, bf16 matmul peak 41.6 GFLOP/s")
    assert device_classes(metas, t.assign(peak_flops=5.84e10)).startswith("CPU: 1 thread per rank")


def test_every_figure_is_drawn_at_the_page_width(report):
    """No figure at half the 1400 px page beside empty space: each is at least figure.WIDTH inches (72 pt each)."""
    from moebench.report.figure import WIDTH

    out, _, _ = report
    for svg in (out / "plots").glob("*.svg"):
        width = float(ET.fromstring(svg.read_bytes()).get("width", "0").removesuffix("pt"))
        assert width >= 72 * WIDTH - 1, svg.name
