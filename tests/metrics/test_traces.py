"""``train.trace``: a Chrome trace per rank of the profiled steps (never the timed ones), the phase
regions as named ranges; the reader's overlap figures; the report's links; ``moebench run --trace``."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import yaml
from report_helpers import run_cli
from sweep_helpers import tiny_suite

from moebench.errors import ConfigError, StoreError
from moebench.metrics import TRACE_DIR_ENV
from moebench.presets import load_config
from moebench.report.build import build_report
from moebench.report.trace import READER, Overlap, overlap, read_events, trace_overlap
from moebench.report.trace_timeline import first_step, timeline_figure
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.testing import run_distributed
from moebench.train.run import run_training

BASE = ["train.steps=2", "train.warmup_steps=1", "train.profile_steps=2", "moe.backend=grouped_mm"]


def _record(overrides):
    return run_training(load_config("tiny", BASE + overrides))


def _names(path) -> list[str]:
    return [e["name"] for e in read_events(path)]


def test_one_process_traces_only_its_profiled_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    rec = _record(["train.trace=true"])
    assert rec["trace_files"] == [str(tmp_path / "rank0.trace.json.gz")]
    with gzip.open(rec["trace_files"][0], "rt") as f:
        assert "traceEvents" in json.load(f)  # gzip'd Chrome JSON
    names = _names(rec["trace_files"][0])
    assert names.count("moebench/step") == 2  # the two profiled steps, not the timed one
    for phase in ("experts", "attention", "router", "optimizer"):
        assert f"moebench/{phase}" in names, phase
    found = trace_overlap(rec["trace_files"][0])
    assert found.steps == 2 and found.basis == "cpu" and found.compute_s > 0


def test_trace_off_writes_none(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "traces"))
    assert _record([])["trace_files"] is None
    assert not (tmp_path / "traces").exists()


@pytest.mark.slow
def test_two_ranks_each_write_a_trace_whose_comm_matches_the_record(tmp_path, monkeypatch):
    """DDP + EP=2 (sync all-to-all) on 2 gloo ranks: one trace per rank with the all-to-alls as
    ``moebench/comm:dispatch`` ranges. The traces are of the profiled steps and the record's
    ``comm_breakdown_s`` of the timed ones, so their times differ with the load (a timed step is not
    a profiled one); what both must show alike is which phases communicate: the ``moebench/comm:<phase>``
    ranges of every trace name exactly the phases the record timed collectives in."""
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    layout = ["parallel.dp=2", "parallel.ep=2", "parallel.strategy=ddp", "train.trace=true"]
    rec = run_distributed(_record, 2, layout)[0]
    assert rec["trace_files"] == [str(tmp_path / f"rank{r}.trace.json.gz") for r in (0, 1)]
    timed = {phase for phase, seconds in rec["comm_breakdown_s"].items() if seconds > 0}
    assert {"dispatch", "combine", "grad_reduce"} <= timed, rec["comm_breakdown_s"]
    for path in rec["trace_files"]:
        names = _names(path)
        assert "moebench/experts" in names
        assert {n.removeprefix("moebench/comm:") for n in names if n.startswith("moebench/comm:")} == timed
        found = trace_overlap(path)
        assert found.comm_s > 0 and found.exposed_s == pytest.approx(found.comm_s - found.overlapped_s)


def _x(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_reader_on_a_hand_built_trace():
    """One step of 100 us on the host: attention 0-40, dispatch 40-60 with its all-to-all 45-55 inside,
    experts 60-100; a gloo all-reduce on another thread 70-90 (overlaps experts) and one 95-110 that
    outlives the step. Comm = 45-55, 70-90, 95-110 = 45 us; compute = 0-45, 55-100 = 90 us;
    overlapped = 70-90, 95-100 = 25 us; exposed = 20 us."""
    events = [_x("moebench/step", 0, 100), _x("moebench/attention", 0, 40), _x("moebench/dispatch", 40, 20),
              _x("moebench/comm:dispatch", 45, 10), _x("moebench/experts", 60, 40), _x("aten::mm", 60, 30, "cpu_op"),
              _x("gloo:all_reduce", 70, 20, tid=2), _x("gloo:all_reduce", 95, 15, tid=2),
              {"ph": "i", "name": "marker", "ts": 5}]
    assert overlap(events) == Overlap(steps=1, compute_s=pytest.approx(90e-6), comm_s=pytest.approx(45e-6),
                                      overlapped_s=pytest.approx(25e-6), exposed_s=pytest.approx(20e-6), basis="cpu",
                                      step_s=pytest.approx(100e-6))


def test_reader_takes_the_device_timeline_when_the_trace_has_kernels():
    """Two steps; kernels gemm 0-50, nccl 40-70, gemm 100-120: compute 70 us, comm 30 us, 10 us of it
    overlapped, per step half of each."""
    events = [_x("moebench/step", 0, 60), _x("moebench/step", 60, 80), _x("moebench/experts", 0, 60),
              _x("sm90_gemm", 0, 50, "kernel"), _x("ncclDevKernel_AllReduce", 40, 30, "kernel"),
              _x("sm90_gemm", 100, 20, "kernel")]
    got = overlap(events)
    assert got.basis == "gpu" and got.steps == 2
    assert (got.compute_s, got.comm_s, got.overlapped_s, got.exposed_s) == pytest.approx((35e-6, 15e-6, 5e-6, 10e-6))


def test_reader_agrees_with_holistic_trace_analysis_on_kernels(tmp_path):
    """The gpu basis against HolisticTraceAnalysis (not a dependency: skipped without it; it cannot
    read CPU traces, docs/report.md "Which reader"). Kernels gemm 0-50, 60-90, 100-120 and NCCL 40-70,
    85-130 on another stream: comm 75 us, 45 of it under compute, 60% overlapped for both readers."""
    trace_analysis = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed")

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                "args": {"device": 0, "stream": 20 if "nccl" in name else 7, "correlation": corr}}

    events = [_x("ProfilerStep#1", 0, 140, "cpu_op"), _x("moebench/step", 0, 140)] + [
        kernel(name, ts, dur, i) for i, (name, ts, dur) in enumerate(
            [("sm90_gemm", 0, 50), ("ncclDevKernel_AllReduce", 40, 30), ("sm90_gemm", 60, 30),
             ("ncclDevKernel_AllGather", 85, 45), ("sm90_gemm", 100, 20)])]
    (tmp_path / "rank0.trace.json").write_text(json.dumps(
        {"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": events}))
    ours = overlap(events)
    assert ours.basis == "gpu" and ours.overlapped_s / ours.comm_s == pytest.approx(0.6)
    theirs = trace_analysis.TraceAnalysis(trace_dir=str(tmp_path)).get_comm_comp_overlap(visualize=False)
    assert theirs["comp_comm_overlap_pctg"].tolist() == pytest.approx([60.0])


def test_a_file_that_is_no_trace_is_named(tmp_path):
    bad = tmp_path / "rank0.trace.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(StoreError, match=re.escape(str(bad))):
        trace_overlap(bad)
    plain = tmp_path / "other.json"
    plain.write_text(json.dumps({"traceEvents": [_x("aten::mm", 0, 1)]}))
    with pytest.raises(StoreError, match="no 'moebench/step' range"):
        trace_overlap(plain)


@pytest.mark.parametrize("override, message", [
    ("train.trace=maybe", "train.trace"),
    ("train.profile_steps=0", "train.trace=true traces the profiled steps: train.profile_steps=0 must be >= 1"),
])
def test_bad_trace_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", ["train.trace=true", override] if "profile" in override else [override]).validate()


def test_trace_is_left_out_of_the_hash_while_off():
    off, on = load_config("tiny"), load_config("tiny", ["train.trace=true"])
    assert "trace" not in json.dumps(off.hash()) and off.hash() != on.hash()
    assert load_config("tiny", ["train.trace=false"]).hash() == off.hash()


@pytest.mark.slow
def test_run_trace_sets_the_field_on_every_point(tmp_path, monkeypatch, capsys):
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    seen = []

    def run_point(point, log, **_):
        seen.append(point.config.train.trace)
        return point_record(point, "ok", None)

    monkeypatch.setattr(sweep_runner, "run_point", run_point)
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "q", "base": {"preset": "tiny"}, "grid": {"moe.num_experts": [4, 8]}}))
    code, _, err = run_cli(["run", str(suite), "--out", str(tmp_path / "st"), "--trace", "--no-progress"],
                           monkeypatch, capsys)
    assert code == 0, err
    assert seen == [True, True]
    assert json.loads((tmp_path / "st" / "meta.json").read_text())["set"] == {"train.trace": True}


@pytest.mark.slow
def test_a_traced_sweep_keeps_its_traces_in_the_store_and_the_report_links_them(tmp_path):
    """A real one-point sweep: the trace lands beside the point's rank logs, the record names it
    relative to the store, and the report copies it into its folder with the overlap table."""
    suite = tiny_suite(steps=2, set={"train.warmup_steps": 1, "train.profile_steps": 1, "train.trace": True})
    store = run_suite(suite, tmp_path / "st", SweepOptions(progress=False, echo=lambda _: None))
    (line,) = (store / "records.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["status"] == "ok", record.get("error")
    assert record["trace_files"] == ["logs/p000.ranks/rank0.trace.json.gz"]
    assert (store / record["trace_files"][0]).is_file()
    build_report(store, tmp_path / "out")
    html = (tmp_path / "out" / "report.html").read_text()
    (href,) = re.findall(r'<a href="([^"]+)">rank0 trace</a>', html)
    assert (tmp_path / "out" / href).read_bytes() == (store / record["trace_files"][0]).read_bytes()
    assert "overlapped share" in html and "comm_exposed_s" in html
    assert f"read by {READER} from the cpu timeline" in html  # which reader produced the overlap
    (timeline,) = re.findall(r'<img alt="trace timeline of [^"]+" src="([^"]+)"', html)
    assert (tmp_path / "out" / timeline).read_bytes().startswith(b"<?xml")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "### Traces" in markdown and "overlapped share" in markdown and f"]({timeline})" in markdown
    assert f"read by {READER}" in markdown


def test_the_timeline_draws_each_ranks_first_step_from_its_start():
    """Two ranks whose steps start at other times: both are drawn from 0; the phases of the first
    step only, the communication cut to it, and the overlapped part apart from the exposed one."""
    events = [_x("moebench/step", 1000, 100), _x("moebench/attention", 1000, 40), _x("moebench/dispatch", 1040, 20),
              _x("moebench/comm:dispatch", 1045, 10), _x("moebench/experts", 1060, 40),
              _x("gloo:all_reduce", 1070, 20, tid=2), _x("gloo:all_reduce", 1095, 15, tid=2),
              _x("moebench/step", 2000, 100), _x("moebench/attention", 2000, 100)]
    step = first_step(events)
    assert step["length"] == 100
    assert step["phases"] == [("attention", (0, 40)), ("dispatch", (40, 60)), ("experts", (60, 100))]
    assert step["comm"] == [(45, 55), (70, 90), (95, 100)]
    assert step["overlapped"] == [(70, 90), (95, 100)]
    other = [{**e, "ts": e["ts"] + 500} for e in events]
    fig = timeline_figure([events, other], "p000: trace of the profiled step")
    ax = fig.axes[0]
    top_down = [t.get_text() for t in sorted(ax.get_yticklabels(), key=lambda t: -t.get_position()[1])]
    assert top_down == ["rank 0 phases", "rank 0 comm", "rank 1 phases", "rank 1 comm"]
    assert ax.get_xlim() == (0, 0.1)  # ms
    assert timeline_figure([[_x("aten::mm", 0, 5, "cpu_op")]], "no steps") is None


def test_ms_cells_carry_thousands_separators():
    """Millisecond cells read as the rest of the page does (3,340 ms), never 3340.000 or 3.34e+03."""
    import pandas as pd

    from moebench.report.details import phase_rows
    from moebench.report.trace import overlap_rows

    rank = Overlap(steps=1, compute_s=3.34, comm_s=0.012, overlapped_s=0.0, exposed_s=0.012, basis="cpu")
    rows = overlap_rows([rank])
    assert rows[0][2:6] == ["3,340.000", "12.000", "0.000", "12.000"]
    row = pd.Series({"time_breakdown_s.experts": 2.64, "time_breakdown_max_s.experts": 2.9})
    assert phase_rows(row) == [["experts", "2,640.000", "2,900.000", "1.10"]]


def test_overlap_text_says_when_the_profiled_step_is_much_longer_than_the_timed_one():
    """Traces of a 41.25 ms profiled step beside a 12.5 ms timed median: the sentence says 3.30x first; within
    REPRESENTATIVE_TOLERANCE of the timed step it says nothing of it."""
    import pandas as pd

    from moebench.report.details import overlap_text

    row = pd.Series({"step_time_median_s": 0.0125, "comm_s": 0.004, "comm_exposed_s": 0.005})
    ranks = [Overlap(steps=2, compute_s=0.04, comm_s=0.001, overlapped_s=0.0, exposed_s=0.001, basis="cpu",
                     step_s=s) for s in (0.04, 0.0425)]
    text = overlap_text(row, ranks)
    assert text.startswith("the profiled step was 3.30x the timed one (41.2 ms vs 12.5 ms)"), text
    near = [Overlap(steps=1, compute_s=0.01, comm_s=0.001, overlapped_s=0.0, exposed_s=0.001, basis="cpu",
                    step_s=0.014)]
    assert "profiled step was" not in overlap_text(row, near)
