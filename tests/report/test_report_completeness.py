"""A report says how complete its runs are: pending and running points, description, duration,
each point's config and log, and a table of contents."""

from __future__ import annotations

import fcntl
import json
import os
import re
from html import escape

from report_helpers import edited_store, fixture_store, repeated_store

from moebench.report.build import build_report

SMOKE = fixture_store("smoke")


def _four_point_store(tmp_path):
    """The smoke store as a 4-point suite of which one point has run."""
    records = [json.loads(line) for line in (SMOKE / "records.jsonl").read_text().splitlines()]
    store = edited_store(SMOKE, tmp_path / "store", lambda r: r if r["point_id"] == "fsdp" else None,
                         lambda m: m.update(description="FSDP vs DDP+EP on two CPU ranks"))
    keys = [r["key"] for r in records] + ["f" * 16]
    plan = [{"point_id": f"p{i:03d}", "key": key, "values": {"parallel.strategy": "ddp", "parallel.ep": i},
             "preset": "tiny", "overrides": {}, "nproc": 2, "timeout_s": 600, "error": None}
            for i, key in enumerate(keys)]
    (store / "points.json").write_text(json.dumps({"points": plan}))
    return store


def test_points_not_run_are_listed_as_pending(tmp_path):
    store = _four_point_store(tmp_path)
    html = build_report(store, tmp_path / "out").read_text()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Points (4: 1 ok, 0 not ok, 3 pending)" in html and "Points (4: 1 ok, 0 not ok, 3 pending)" in md
    pending = html.split('id="pending"')[1].split("<h2")[0]
    assert all(f"<td>p00{i}</td>" in pending for i in (1, 2, 3)) and "<td>p000</td>" not in pending
    assert "parallel.ep=3" in pending and "### Pending points" in md


def test_a_store_a_sweep_holds_is_running(tmp_path):
    store = _four_point_store(tmp_path)
    fd = os.open(store / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        html = build_report(store, tmp_path / "out").read_text()
    finally:
        os.close(fd)
    assert "Points (4: 1 ok, 0 not ok, 3 running)" in html and "the sweep is still running" in html


def test_description_duration_configs_logs_and_contents(tmp_path):
    store = _four_point_store(tmp_path)
    out = tmp_path / "out"
    html = build_report(store, out).read_text()
    assert "FSDP vs DDP+EP on two CPU ranks" in html
    assert "ran 3m 00s" in html  # created 10:00:00, last point finished 10:03:00
    configs = html.split('id="configs"')[1]
    assert configs.count("<details>") == 1 and "&quot;strategy&quot;: &quot;fsdp&quot;" in configs
    (link,) = set(re.findall(r'<a href="([^"#]+)">log</a>', configs))
    # copied into the report folder, so the link survives copying the folder
    assert not os.path.isabs(link) and not link.startswith("..")
    assert (out / link).read_bytes() == (store / "logs" / "fsdp.log").read_bytes()
    toc = html.split('<nav class="toc">')[1].split("</nav>")[0]
    for anchor in ("points", "pending", "plots", "configs", "step_times"):
        assert f'href="#{anchor}"' in toc and f'id="{anchor}"' in html, anchor


def test_the_duration_runs_to_the_last_repeat_that_finished(tmp_path):
    """A point's repeats are runs of their own: the sweep ran until the last of them finished, not
    until the run the point's table row stands for."""
    day = json.loads((SMOKE / "meta.json").read_text())["created_at"][:10]  # created at 10:00:00

    def later(r):
        return {**r, "finished_at": f"{day}T10:{3 + 4 * r['repeat']:02d}:00+00:00"}

    store = repeated_store(SMOKE, tmp_path / "store", n=3)
    store = edited_store(store, tmp_path / "later", later)
    html = build_report(store, tmp_path / "out").read_text()
    assert "ran 11m 00s" in html  # the third repeat finished at 10:11:00


def test_each_point_says_how_to_rerun_it_its_hardware_phases_and_every_rank_log(tmp_path):
    """The reproduce command (relative, from the repo root), the host, mean and slowest-rank time per phase,
    and a link to each rank log that exists (rank1 has none), all inside the report folder."""
    import shutil

    from report_helpers import edited_store, fixture_store

    store = edited_store(fixture_store("smoke"), tmp_path / "store")
    ranks = store / "logs" / "fsdp.ranks"
    ranks.mkdir()
    (ranks / "rank0.log").write_text("rank 0 says hello\n")
    (ranks / "rank2.log").write_text("rank 2 says hello\n")
    build_report(store, tmp_path / "out")
    shutil.copytree(tmp_path / "out", tmp_path / "copied")
    shutil.rmtree(tmp_path / "out")
    html = (tmp_path / "copied" / "report.html").read_text()
    configs = html.split('id="configs"')[1]
    fsdp = next(d for d in configs.split("<details>") if d.startswith("<summary>fsdp "))
    assert "<code>moebench run smoke --filter parallel.strategy=fsdp</code>" in fsdp
    assert "hardware: 2 ranks on ci-runner-3 (CPU: Intel(R) Xeon(R) Platinum 8480+), device cpu" in fsdp
    # param_gather: 3.125 ms on the mean rank, 3.281 ms on the slowest (the fixture's time_breakdown_max_s)
    assert "<td>param_gather</td><td>3.125</td><td>3.281</td><td>1.05</td>" in fsdp
    links = dict((name, href) for href, name in re.findall(r'<a href="([^"#]+)">([^<]+)</a>', fsdp))
    assert set(links) == {"log", "rank0", "rank2"}
    assert (tmp_path / "copied" / links["rank2"]).read_text() == "rank 2 says hello\n"
    md = (tmp_path / "copied" / "report.md").read_text()
    assert "- fsdp: `moebench run smoke --filter parallel.strategy=fsdp`" in md


def test_the_runs_section_gives_the_commands_that_make_the_store_and_the_report_again(tmp_path):
    """From meta.json: the suite as it was named (a path stays a path), its --set fields and --repeats, into the
    store; then the report command with the stores as given and -o. Each point's command names the suite so too."""
    from moebench.report.reproduce import suite_arg
    from moebench.sweep.suite import SUITES_DIR

    suite_file = tmp_path / "my suites" / "smoke.yaml"
    store = edited_store(SMOKE, tmp_path / "store", meta_edit=lambda m: m.update(
        suite_file=str(suite_file), set={"train.steps": 5, "train.compile": False}, repeats=3))
    build_report(store, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    run = (f"moebench run '{suite_file}' --set train.compile=false --set train.steps=5 --repeats 3 "
           f"--out {tmp_path / 'store'}")
    assert f"  - `{run}`\n  - `moebench report {tmp_path / 'store'} -o {tmp_path / 'out'}`\n" in md
    html = (tmp_path / "out" / "report.html").read_text()
    runs = html.split('id="runs"')[1].split("<h2")[0]
    assert f"<li><code>{escape(run)}</code></li>" in runs
    assert (f"- fsdp: `moebench run '{suite_file}' --set train.compile=false --set train.steps=5 --repeats 3 "
            "--filter parallel.strategy=fsdp`") in md
    # a suite found by its name is named so; a store from before suite_file, by its name too
    assert suite_arg({"suite": "smoke", "suite_file": str(SUITES_DIR / "smoke.yaml")}) == "smoke"
    assert suite_arg({"suite": "smoke", "suite_file": "suites/smoke.yaml"}) == "smoke"
    assert suite_arg({"suite": "smoke"}) == "smoke"


def test_a_config_value_auto_is_shown_with_what_ran(tmp_path):
    """``moe.backend``, ``precision.mode`` and ``train.device`` read ``auto`` in the config: the page says what
    each resolved to (the record's ``moe_backend``, ``precision``, ``device``); a record without the field keeps
    its bare ``auto``."""
    store = edited_store(SMOKE, tmp_path / "store",
                         lambda r: {**r, "moe_backend": "cpu_fused"} if r["point_id"] == "fsdp" else r)
    build_report(store, tmp_path / "out")
    configs = (tmp_path / "out" / "report.html").read_text().split('id="configs"')[1]
    fsdp, ddp = (next(d for d in configs.split("<details>") if d.startswith(f"<summary>{p} "))
                 for p in ("fsdp", "ddp"))
    for shown in ('"backend": "auto (ran cpu_fused)"', '"mode": "auto (ran fp32)"', '"device": "auto (ran cpu)"'):
        assert escape(shown) in fsdp, shown
    assert escape('"backend": "auto",') in ddp and escape('"mode": "auto (ran fp32)"') in ddp
