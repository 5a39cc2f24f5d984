"""The answer at the top of a report: ratios with intervals and verdicts, noise and unequal work flagged."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from report_helpers import edited_store, fixture_store, repeated_store, with_repeats

from moebench.report.build import build_report
from moebench.report.headline import headline
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import load_tables

SMOKE = fixture_store("smoke")
EXPERTS = fixture_store("expert-scaling")
ANSWER_RE = r"(\d+\.\d\d)x \[(\d+\.\d\d), (\d+\.\d\d)\] (faster|slower|within noise) \((\d) runs each\)"


@pytest.fixture(scope="module")
def smoke3(tmp_path_factory):
    """The smoke fixture with every point run 3 times (AR(1) steps, a 1% run-level offset)."""
    return repeated_store(SMOKE, tmp_path_factory.mktemp("smoke3") / "s", 3, noise=0.02, phi=0.5, run_offset=0.01,
                          seed=1)


def _report(store, out):
    """(html, md, results.csv with one row per point: repeat 0's, which carries the point's comparison)."""
    html = build_report(store, out).read_text()
    csv = pd.read_csv(out / "results.csv")
    return html, (out / "report.md").read_text(), csv[csv["repeat"] == 0].set_index("point_id")


def _like_fsdp(tmp_path, factor: float, noise: float, name: str):
    """ddp runs fsdp's very steps ``factor`` times faster (same work per step, one ``noise`` pattern)."""
    fsdp = next(r for r in map(json.loads, (SMOKE / "records.jsonl").read_text().splitlines())
                if r["point_id"] == "fsdp")

    def edit(r):
        if r["point_id"] == "ddp":
            keep = {k: r[k] for k in ("config", "config_hash", "layout", "point", "point_id", "key")}
            return with_repeats({**fsdp, **keep}, 3, factor, noise, seed=1)
        return with_repeats(r, 3, 1.0, noise, seed=1) if r["point_id"] == "fsdp" else None

    return edited_store(SMOKE, tmp_path / name, edit)


def test_headline_comes_first_in_html_and_markdown(tmp_path, smoke3):
    html, md, _ = _report(smoke3, tmp_path)
    body = html.split("<body>", 1)[1]
    assert body.index("<section class=\"headline\">") < body.index("<table>")
    assert md.index("### Answer") < md.index("| point |")
    for pattern, text in ((r"<b>(ddp ep2(?: rowwise)? vs fsdp)</b>: <span class=\"v-faster\">", html),
                          (r"- \*\*(ddp ep2(?: rowwise)? vs fsdp)\*\*: ", md)):
        found = [m[0] for m in re.findall(pattern + ANSWER_RE, text)]
        assert sorted(found) == ["ddp ep2 rowwise vs fsdp", "ddp ep2 vs fsdp"], text[:2000]


def test_a_clear_speedup_excludes_one(tmp_path, smoke3):
    _, md, csv = _report(smoke3, tmp_path)
    line = next(x for x in md.splitlines() if x.startswith("- **ddp ep2 rowwise vs fsdp**"))
    value, low, high, verdict, runs = re.search(ANSWER_RE, line).groups()
    assert 1.0 < float(low) <= float(value) <= float(high) and verdict == "faster" and runs == "3"
    assert csv.at["ddp-rowwise", "speedup_low"] > 1.0 and csv.at["ddp-rowwise", "speedup_verdict"] == "faster"
    assert csv.at["ddp-rowwise", "runs"] == 3 and csv.at["ddp-rowwise", "run_spread"] > 0
    # a side's step time is the mean of its runs' medians: throughput is the harmonic mean of the runs'
    every = pd.read_csv(tmp_path / "results.csv")
    hmean = {p: 1 / (1 / g["tokens_per_s_per_device"]).mean() for p, g in every.groupby("point_id")}
    assert csv.at["ddp-rowwise", "speedup"] == pytest.approx(hmean["ddp-rowwise"] / hmean["fsdp"], rel=1e-4)
    assert sorted(every["repeat"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_one_run_each_gives_the_ratio_and_no_verdict(tmp_path):
    _, md, csv = _report(SMOKE, tmp_path)
    line = next(x for x in md.splitlines() if x.startswith("- **ddp ep2 rowwise vs fsdp**"))
    assert re.search(r"\*\*: 1\.\d\dx, 1 run each: no between-run variance, no verdict", line), line
    assert csv.at["ddp-rowwise", "speedup_verdict"] == "no verdict" and csv.at["ddp-rowwise", "runs"] == 1
    assert (csv["repeat"] == 0).all()


def test_a_change_inside_the_noise_includes_one_and_is_warned(tmp_path):
    store = _like_fsdp(tmp_path, factor=1.05, noise=0.15, name="noisy")
    html, md, csv = _report(store, tmp_path / "out")
    assert csv.at["ddp", "speedup_low"] < 1.0 < csv.at["ddp", "speedup_high"]
    assert csv.at["ddp", "speedup_verdict"] == "within noise"
    assert re.search(r"\*\*ddp ep2 vs fsdp\*\*: 1\.\d\dx \[0\.\d\d, 1\.\d\d\] within noise \(3 runs each\) "
                     r"⚠ inconclusive", md)
    assert "warning: ddp ep2: " in md and "neither faster nor slower can be claimed" in md
    assert "⚠ inconclusive" in html


def test_the_same_change_with_low_noise_is_faster(tmp_path):
    _, md, csv = _report(_like_fsdp(tmp_path, factor=1.05, noise=0.003, name="quiet"), tmp_path / "out")
    assert csv.at["ddp", "speedup_low"] > 1.0 and csv.at["ddp", "speedup_verdict"] == "faster"
    assert "inconclusive" not in md


def test_dropped_route_fraction_and_unequal_work(tmp_path):
    routes = 1024 * 2 * 2 * 20  # tokens per step x top-k x MoE layers x timed steps (tiny preset)
    t = pair_with_baseline(*load_tables([SMOKE])[:2]).set_index("point_id")
    assert t.at["ddp-rowwise", "dropped_fraction"] == pytest.approx(37 / routes)
    assert not t["drops_differ"].any()  # 0.05% is within the tolerance
    store = edited_store(SMOKE, tmp_path / "s",
                         lambda r: {**r, "dropped_tokens": int(0.02 * routes)} if r["point_id"] == "ddp-rowwise" else r)
    html, md, csv = _report(store, tmp_path / "out")
    assert csv.at["ddp-rowwise", "drops_differ"] and not csv.at["ddp", "drops_differ"]
    line = next(x for x in md.splitlines() if x.startswith("- **ddp ep2 rowwise vs fsdp**"))
    assert "unequal work: drops 2.00% of routes vs 0.00% for the baseline" in line
    assert "⚠ unequal drops" in md.split("| point |")[1]  # the speedup cell says so too
    assert "unequal work" in html


def test_a_verdict_between_unequal_sides_is_amber_and_says_why(tmp_path, smoke3):
    """With 3 runs a side ddp-rowwise is clearly faster, but it drops 2% of the routes fsdp computes:
    its line reads "faster (unequal work: drops 2.0% vs 0%)" in amber, never plain green."""
    routes = 1024 * 2 * 2 * 20
    store = edited_store(smoke3, tmp_path / "s",
                         lambda r: {**r, "dropped_tokens": int(0.02 * routes)} if r["point_id"] == "ddp-rowwise" else r)
    html, md, _ = _report(store, tmp_path / "out")
    line = next(x for x in md.splitlines() if x.startswith("- **ddp ep2 rowwise vs fsdp**"))
    assert re.search(r"\] faster \(unequal work: drops 2\.0% vs 0%\) \(3 runs each\)", line), line
    assert re.search(r"<b>ddp ep2 rowwise vs fsdp</b>: <span class=\"v-unequal-work\">", html)
    assert not re.search(r"<b>ddp ep2 rowwise vs fsdp</b>: <span class=\"v-faster\">", html)
    assert re.search(r"<b>ddp ep2 vs fsdp</b>: <span class=\"v-faster\">", html)  # equal work stays green
    assert ".v-unequal-work{color:#b36b00" in html


def test_many_points_are_grouped_with_the_full_list_folded(tmp_path):
    t = pair_with_baseline(*load_tables([repeated_store(EXPERTS, tmp_path / "e", 3, noise=0.01, seed=1)])[:2])
    lines, details = headline(t)
    by_subject = {x.subject: x for x in lines}
    rowwise = by_subject["ddp ep8 rowwise vs fsdp"]
    assert rowwise.answer.endswith("over 3 points, 3 runs each: 3 faster")
    assert rowwise.detail.startswith("lowest 1.") and "at num_experts=8, highest 2." in rowwise.detail
    assert any("drop a different share of routes" in f for f in rowwise.flags)  # 32 and 64 experts drop > 0.5%
    assert len(details) == 8 and len(lines) == 3
    assert rowwise.verdict == "unequal work"  # amber: faster points among them did unequal work
    e64 = next(d for d in details if d.subject == "ddp ep8 rowwise vs fsdp at num_experts=64")
    # its baseline (fsdp at 64 experts) throttled too: both qualify the verdict
    assert e64.verdict == "unequal work" and "faster (unequal work: drops " in e64.answer
    assert " vs 0%; baseline throttled)" in e64.answer


def _one_axis_suite(tmp_path, suite: str, section: str, field: str, axis: str, values, baseline):
    """The smoke fixture's fsdp point once per value of one axis, paired on that axis (``baseline``)."""
    def edit(r):
        if r["point_id"] != "fsdp":
            return None
        out = []
        for v in values:
            cfg = json.loads(json.dumps(r["config"]))
            cfg[section][field] = v
            extra = {"precision": v} if section == "precision" else {}
            out.append({**r, **extra, "config": cfg, "point": {axis: v}, "point_id": f"p-{v}", "key": f"k-{v}"})
        return out

    return edited_store(SMOKE, tmp_path / suite, edit,
                        lambda m: m.update(suite=suite, baseline={axis: baseline}, run_id=f"20261128-110000-{suite}"))


def test_subjects_name_the_axes_that_differ(tmp_path):
    """A top-k suite reads ``top_k=1 vs top_k=2`` and a precision suite ``fp32 vs bf16``, not ``fsdp vs fsdp``:
    the subject is built from what differs between a point and its baseline."""
    topk = _one_axis_suite(tmp_path, "topk", "moe", "top_k", "moe.top_k", [1, 2], 2)
    lines, _ = headline(pair_with_baseline(*load_tables([topk])[:2]))
    assert [x.subject for x in lines] == ["top_k=1 vs top_k=2"]
    precision = _one_axis_suite(tmp_path, "precision", "precision", "mode", "precision.mode", ["fp32", "bf16"], "bf16")
    lines, _ = headline(pair_with_baseline(*load_tables([precision])[:2]))
    assert [x.subject for x in lines] == ["fp32 vs bf16"]
    # both loaded: each subject names its suite
    lines, _ = headline(pair_with_baseline(*load_tables([topk, precision])[:2]))
    assert sorted(x.subject for x in lines) == ["precision: fp32 vs bf16", "topk: top_k=1 vs top_k=2"]


def test_device_class_and_flop_units_on_cpu_and_gpu(tmp_path):
    """A CPU report names threads per rank, gloo and the calibration matmul's dtype and peak in the Answer's
    intro and its Runs line, shows FLOP rates in GFLOP/s and its MFU beside that calibration; the GPU fixture
    shows TFLOP/s; a world of one is ``1 rank``."""
    cpu = "CPU: 1 thread per rank, gloo, bf16 matmul peak 110 GFLOP/s"
    html, md, _ = _report(SMOKE, tmp_path / "cpu")
    answer = md.split("### Answer")[1].split("- **")[0]
    assert f"{cpu}. Tokens/s per device" in answer and f"<p>{cpu}. Tokens/s per device" in html
    assert f"**smoke / 20261128-110000-c3d4**: {cpu}; created" in md
    assert "| FLOP/s/dev | MFU (of bf16 matmul) |" in md and "| 24.0 GFLOP/s |" in md and "TFLOP/s" not in md
    assert "world 2 ranks" in md
    _, md, _ = _report(EXPERTS, tmp_path / "gpu")
    assert "8 x NVIDIA H200, NCCL, bf16 dense peak 989 TFLOP/s. Tokens/s per device" in md
    assert "| 421 TFLOP/s |" in md and "GFLOP/s" not in md and "| MFU |" in md
    assert "| invalid | 1 rank |" in md
