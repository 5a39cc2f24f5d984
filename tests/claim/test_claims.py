"""Claim files (validation), their judgement on the checked-in fixture stores, the report's Claims section
and `moebench claim`'s exit codes. No training runs: every claim is judged on existing stores."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from report_helpers import edited_store, fixture_store, repeated_store, run_cli

from moebench.claim.judge import CANNOT, FAILS, HOLDS, INCONCLUSIVE, judge
from moebench.claim.spec import CLAIMS_DIR, check_suite, load_claim, parse_claim, shipped_claims
from moebench.errors import ConfigError
from moebench.report.claims import claim_rows, claims_html, claims_md
from moebench.results.claims_file import read_claims, write_claims
from moebench.results.table import load_tables
from moebench.sweep.suite import load_suite

RATIO = {
    "name": "ddp-faster", "statement": "DDP+EP is faster than FSDP", "source": "a paper", "suite": "expert-scaling",
    "comparison": {"kind": "ratio", "num": {"parallel.strategy": "ddp"}, "den": {"parallel.strategy": "fsdp"},
                   "at": {"moe.num_experts": "largest"}},
    "holds": ">= 1.0",
    "published": {"value": 2.7, "setup": {"device": "B300", "devices": 8, "precision": "bf16",
                                          "active_params": 3.17e9}},
}


def equal_work(record):
    """The fixture's row-wise points drop 0.7-1.2% of routes, fsdp none: unequal work, which a claim refuses
    to judge; with no drops anywhere the comparisons below are like for like."""
    return {**record, "dropped_tokens": 0}


def _claim(**changes):
    data = json.loads(json.dumps(RATIO))
    for key, value in changes.items():
        *path, last = key.split("__")
        node = data
        for part in path:
            node = node[part]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return data


def _drop(select: str, holds: str) -> dict:
    return _claim(comparison={"kind": "drop", "select": {"parallel.strategy": select}, "axis": "moe.num_experts"},
                  holds=holds)


@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"name": None}, "name", "required"),
    ({"statement": ""}, "statement", "required"),
    ({"colour": "red"}, "colour", "unknown key"),
    ({"comparison__kind": "speed"}, "comparison.kind", "ratio, drop, memory, count"),
    ({"suite_gpu": 8}, "suite_gpu", "expected text"),
    ({"comparison__num": {"parallel.stratgy": "ddp"}}, "comparison.num.parallel.stratgy", "parallel fields are"),
    ({"comparison__den": {"parallel.strategy": "zero3"}}, "comparison.den.parallel.strategy", "zero3"),
    ({"comparison__den": {"parallel.strategy": "ddp"}}, "comparison.den", "same points"),
    ({"comparison__at": {"moe.num_experts": "most"}}, "comparison.at.moe.num_experts", "most"),
    ({"comparison__axis": "moe.num_experts"}, "comparison.axis", "unknown key for kind ratio"),
    ({"comparison__metric": "peak_mem_bytes"}, "comparison.metric", "not derived from step times"),
    ({"holds": "faster"}, "holds", "OP VALUE"),
    ({"holds": ">= 0"}, "holds", "says nothing"),
    ({"published__value": "2.7x"}, "published.value", "expected a finite number"),
    ({"published__value": 10**400}, "published.value",
     "expected a finite number, got 1000000000000000000000000000000000000... (401 characters)"),
    ({"published__setup__total_params": 10**400}, "published.setup.total_params", "positive finite number"),
    ({"published__setup__devices": 0}, "published.setup.devices", "positive whole number"),
    ({"published__setup__active_params": "3.17e9"}, "published.setup.active_params", "write 3.17e+9"),
    ({"published__setup__gpu": "B300"}, "published.setup.gpu", "unknown key"),
])
def test_a_bad_claim_is_one_line_naming_file_and_field(tmp_path, changes, field, says):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_claim(**changes)))
    with pytest.raises(ConfigError) as info:
        load_claim(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}:") and says in message and "\n" not in message


@pytest.mark.parametrize("suite", ["../../passwd", "../../README.yaml"])
def test_a_claims_suite_must_be_a_suite(tmp_path, monkeypatch, suite):
    """Only existence was checked: any readable file (``suite: ../../etc/passwd``) passed as the claim's suite."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "README.yaml").write_text("title: not a suite\n")
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(_claim(suite=suite)))
    with pytest.raises(ConfigError) as info:
        check_suite(load_claim(path))
    assert str(info.value).startswith(f"{path}: suite: {suite}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("what", ["claim", "suite"])
def test_a_fifo_is_not_a_regular_file(tmp_path, monkeypatch, capsys, what):
    """A FIFO was "does not exist" (a claim) and would block a reader waiting for a writer."""
    import os

    fifo = tmp_path / f"{what}.yaml"
    os.mkfifo(fifo)
    args = ["claim", str(fifo), "--no-record"] if what == "claim" else ["run", str(fifo), "--dry-run"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert (code, out, err) == (2, "", f"error: {what} file {fifo} is not a regular file\n")


def test_drop_and_memory_claims_check_their_own_fields():
    with pytest.raises(ConfigError, match=r"^c.yaml: comparison.axis: required"):
        parse_claim(_claim(comparison={"kind": "drop", "select": {"parallel.strategy": "ddp"}}), "c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml: comparison.axis: moe.num_experts is also in comparison.select"):
        parse_claim(_claim(comparison={"kind": "drop", "select": {"moe.num_experts": 8},
                                       "axis": "moe.num_experts"}), "c.yaml")
    memory = parse_claim(_claim(comparison__kind="memory", comparison__metric="memory_parts_bytes.saved_activations",
                                holds="< 1.0"), "c.yaml")
    assert memory.metric == "memory_parts_bytes.saved_activations"


def test_shipped_claims_parse_and_their_suites_have_both_sides():
    """Each shipped claim names its published source and value, and its suite expands to points that
    each of its selectors picks."""
    paths = shipped_claims()
    assert CLAIMS_DIR.parent.name == "moebench" and len(paths) >= 4
    for path in paths:
        claim = load_claim(path.stem)
        assert claim.name == path.stem and claim.source and claim.published is not None, path
        check_suite(claim)
        for suite in filter(None, (claim.suite, claim.suite_gpu)):
            configs = [p.config for p in load_suite(suite).points() if p.valid]
            for side in (claim.num, claim.den):
                assert not side or any(all(str(getattr(getattr(c, k.split(".")[0]), k.split(".")[1])) == str(v)
                                           for k, v in side.items()) for c in configs), (path, suite, side)


def test_one_run_per_point_is_inconclusive_with_the_published_differences():
    """The fixture store has one run per point: values but no interval (no between-run variance), so no
    verdict either way; the conditions name the hardware and the unequal dropped routes."""
    table, metas, _ = load_tables([fixture_store("expert-scaling")])
    v = judge(parse_claim(RATIO, "c.yaml"), table, metas, ["fixture"])
    assert v.verdict == INCONCLUSIVE
    assert sorted(round(c.value, 2) for c in v.comparisons) == [2.13, 2.22]  # e64: the largest ok expert count
    assert all(c.low is None and c.runs == (1, 1) for c in v.comparisons)
    assert any(c.startswith("hardware: measured on 8 x NVIDIA H200; published on 8 x B300") for c in v.conditions)
    assert any(c.startswith("unequal work: ddp ep8 rowwise, num_experts=64 drops 1.2%") for c in v.conditions)


def test_repeats_give_intervals_and_verdicts(tmp_path):
    """Three runs per point: the interval decides; a bound the interval lies wholly above or below is
    held or not, one it straddles is inconclusive."""
    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, equal_work, noise=0.002)
    table, metas, _ = load_tables([store])
    holds = judge(parse_claim(RATIO, "c.yaml"), table, metas)
    assert holds.verdict == HOLDS and all(c.runs == (3, 3) and c.low < c.value < c.high for c in holds.comparisons)
    assert judge(parse_claim(_claim(holds=">= 3.0"), "c.yaml"), table, metas).verdict == FAILS
    assert judge(parse_claim(_claim(holds=">= 2.13"), "c.yaml"), table, metas).verdict == INCONCLUSIVE
    # drops across the axis: FSDP falls by half from 8 to 64 experts, DDP+EP by about 3%
    fsdp = judge(parse_claim(_drop("fsdp", "> 0"), "c.yaml"), table, metas)
    assert fsdp.verdict == HOLDS and [round(c.value, 3) for c in fsdp.comparisons] == [0.517]
    assert fsdp.comparisons[0].num_label == "fsdp, num_experts=64"  # e128 ran out of memory: not the largest ok
    ddp = judge(parse_claim(_drop("ddp", "<= 0.05"), "c.yaml"), table, metas)
    assert ddp.verdict == HOLDS and len(ddp.comparisons) == 2
    assert all(c.high < 0.05 for c in ddp.comparisons)


def test_memory_ratio_is_one_value_per_point():
    table, metas, _ = load_tables([fixture_store("expert-scaling")])
    claim = parse_claim(_claim(comparison={"kind": "memory", "num": {"parallel.strategy": "ddp"},
                                           "den": {"parallel.strategy": "fsdp"}, "at": {"moe.num_experts": 8}},
                               holds="<= 1.0"), "c.yaml")
    v = judge(claim, table, metas)
    assert v.verdict == FAILS  # at 8 experts EP8's dispatch buffers outweigh FSDP's sharding
    assert {round(c.value, 2) for c in v.comparisons} == {1.0, 1.21}


def test_a_store_without_the_points_cannot_judge():
    """No evidence either way is its own verdict (exit 0), not an error in the claim."""
    table, metas, _ = load_tables([fixture_store("smoke")])
    v = judge(parse_claim(_drop("ddp", "<= 0.05"), "c.yaml"), table, metas)
    assert v.verdict == CANNOT and not v.comparisons
    assert v.conditions[0].startswith("the store(s) cannot make this comparison: the points of")
    assert v.conditions[0].endswith("a drop needs two")


def test_recorded_verdicts_reach_the_report_escaped(tmp_path):
    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, equal_work, noise=0.002)
    table, metas, _ = load_tables([store])
    v = judge(parse_claim(_claim(statement="<b>x</b>"), "c.yaml"), table, metas).to_dict()
    write_claims(store, [v])
    write_claims(store, [{**v, "verdict": FAILS}])  # judged again: replaces, not appends
    assert [c["verdict"] for c in read_claims(store)] == [FAILS]
    rows = claim_rows([store], warnings := [])
    assert not warnings and rows[0][1] == FAILS and "2.1" in rows[0][2]
    page = "".join(claims_html(rows, "<h2 id=\"claims\">Claims</h2>"))
    assert "&lt;b&gt;" in page and "<b>x" not in page
    assert page.count("<td class=\"words\">") == len(rows[0])  # every cell wraps: no sideways scroll
    assert "<code>moebench claim</code>" in page and "`" not in page  # Markdown's backticks stay in report.md
    assert claims_md(rows)[0] == "### Claims"
    (store / "claims.json").write_text("[1]")
    assert claim_rows([store], warnings) == [] and "claims.json" in warnings[0]


def test_claim_command_exit_codes(tmp_path, monkeypatch, capsys):
    """0: holds or inconclusive; 1: a claim does not hold; 2: a bad claim file. Judged on a store, nothing run."""
    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, equal_work, noise=0.002)
    good, bad, broken = tmp_path / "good.yaml", tmp_path / "bad.yaml", tmp_path / "broken.yaml"
    good.write_text(yaml.safe_dump(RATIO))
    bad.write_text(yaml.safe_dump(_claim(name="too-fast", holds=">= 3.0")))
    broken.write_text(yaml.safe_dump(_claim(holds="faster")))
    code, out, _ = run_cli(["claim", str(good), "--store", str(store)], monkeypatch, capsys)
    assert code == 0 and "claim ddp-faster: HOLDS" in out
    code, out, _ = run_cli(["claim", str(good), str(bad), "--store", str(store)], monkeypatch, capsys)
    assert code == 1 and "claim too-fast: DOES NOT HOLD" in out
    assert {c["name"]: c["verdict"] for c in read_claims(store)} == {"ddp-faster": HOLDS, "too-fast": FAILS}
    code, _, err = run_cli(["claim", str(broken), "--store", str(store)], monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: {broken}: holds:")


COUNT = _claim(name="rowwise-syncs", comparison={
    "kind": "count", "metric": "host_syncs_per_step", "per": "moe_layer",
    "num": {"parallel.dispatcher": "rowwise"}, "den": {"parallel.dispatcher": "sync"}, "den_holds": ">= 1"},
    holds="<= 0")


@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"comparison__den_holds": None}, "comparison.den_holds", "required with comparison.den"),
    ({"comparison__den": None}, "comparison.den_holds", "selects none"),
    ({"comparison__per": "layer"}, "comparison.per", "moe_layer"),
    ({"comparison__metric": "tokens_per_s"}, "comparison.metric", "derived from step times"),
    ({"holds": ">= -1"}, "holds", "not negative"),
    ({"comparison__den_holds": "some"}, "comparison.den_holds", "OP VALUE"),
    ({"published_setup": {"preset": "tiny", "gpu": "b300", "gpus": 8}}, "published_setup", "not carried"),
])
def test_a_bad_count_claim_is_one_line_naming_file_and_field(changes, field, says):
    data = json.loads(json.dumps(COUNT))
    for key, value in changes.items():
        *path, last = key.split("__")
        node = data
        for part in path:
            node = node[part]
        node.pop(last) if value is None else node.__setitem__(last, value)
    with pytest.raises(ConfigError) as info:
        parse_claim(data, "c.yaml")
    assert str(info.value).startswith(f"c.yaml: {field}:") and says in str(info.value), info.value
    assert "\n" not in str(info.value)


def _syncs_store(tmp_path, rowwise: list[int], sync: int = 4):
    """The smoke fixture (fsdp, ddp ep2 sync, ddp ep2 row-wise; 2 MoE layers) with 3 runs a point and
    host syncs per step: ``rowwise`` per run for the row-wise point, ``sync`` for the sync one, 0 for FSDP."""
    runs = repeated_store(fixture_store("smoke"), tmp_path / "runs", n=3, noise=0.002)
    counts = {"ddp": [sync] * 3, "ddp-rowwise": rowwise, "fsdp": [0] * 3}
    return edited_store(runs, tmp_path / "s",
                        lambda r: {**r, "host_syncs_per_step": counts[r["point_id"]][r["repeat"]]})


def test_count_claims_are_judged_without_an_interval(tmp_path):
    """Row-wise 0 host syncs per MoE layer against its sync all-to-all partner (not FSDP, which makes none
    either): holds, with no interval; a row-wise sync fails it; runs that disagree leave it inconclusive."""
    claim = parse_claim(COUNT, "c.yaml")
    table, metas, _ = load_tables([_syncs_store(tmp_path / "a", [0, 0, 0])])
    v = judge(claim, table, metas)
    (c,) = v.comparisons
    assert v.verdict == HOLDS and c.value == 0 and c.low is None and c.runs == (3, 3)
    assert c.den_label.startswith("ddp ep2") and "2" in c.note and "no interval" in c.note
    assert "judged without an interval" in "\n".join(v.lines())
    assert "per MoE layer is <= 0 (rowwise), >= 1 (sync)" in "\n".join(v.lines())
    table, metas, _ = load_tables([_syncs_store(tmp_path / "b", [2, 2, 2])])
    assert judge(claim, table, metas).verdict == FAILS  # one per MoE layer where none should be
    table, metas, _ = load_tables([_syncs_store(tmp_path / "c", [0, 0, 0], sync=1)])
    assert judge(claim, table, metas).verdict == FAILS  # the sync side under one per layer
    table, metas, _ = load_tables([_syncs_store(tmp_path / "d", [0, 1, 0])])
    v = judge(claim, table, metas)
    assert v.verdict == INCONCLUSIVE and "runs disagree (0 to 0.5)" in v.comparisons[0].note
    alone = {**COUNT, "comparison": {"kind": "count", "num": {"parallel.strategy": "fsdp"}}, "holds": "< 1"}
    v = judge(parse_claim(alone, "c.yaml"), table, metas)  # no den: each num point against the bound
    assert v.verdict == HOLDS and [(c.value, c.den_label) for c in v.comparisons] == [(0, "")]
    assert "holds when the host syncs per step (untimed step, rank 0) is < 1" in "\n".join(v.lines())
    table, metas, _ = load_tables([repeated_store(fixture_store("smoke"), tmp_path / "e", n=3)])
    v = judge(claim, table, metas)  # records without the count: no verdict either way
    assert v.verdict == INCONCLUSIVE and "host_syncs_per_step not recorded" in v.comparisons[0].note


def test_suite_gpu_runs_where_cuda_is(tmp_path, monkeypatch, capsys):
    """Without --store, a claim's suite_gpu runs on a machine with CUDA and its suite elsewhere (the CUDA
    fact asked when the suites run; the run itself stubbed with a fixture store)."""
    import torch

    import moebench.claim.cli as claim_cli

    stores = {"smoke": repeated_store(fixture_store("smoke"), tmp_path / "smoke", n=3, noise=0.002),
              "expert-scaling": repeated_store(fixture_store("expert-scaling"), tmp_path / "es", 3, equal_work,
                                                noise=0.002)}
    ran: list[str] = []

    def fake_run(suite, *args):
        ran.append(suite)
        return str(stores[suite])

    monkeypatch.setattr(claim_cli, "_run_suite", fake_run)
    for cuda, suite in ((True, "expert-scaling"), (False, "smoke")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        code, out, _ = run_cli(["claim", "ddp-ep-vs-fsdp", "--no-carry", "--no-record"], monkeypatch, capsys)
        assert code in (0, 1) and ran[-1] == suite and "claim ddp-ep-vs-fsdp:" in out
        assert ("suite: the store holds" in out) is False  # either suite is the claim's own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, _, _ = run_cli(["claim", "mxfp8-peak-memory", "--store", str(stores["smoke"])], monkeypatch, capsys)
    assert ran == ["expert-scaling", "smoke"]  # --store runs nothing
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**RATIO, "suite_gpu": "no-such-suite"}))
    code, _, err = run_cli(["claim", str(bad), "--store", str(stores["smoke"])], monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: {bad}: suite_gpu:") and "no-such-suite" in err


def test_a_claims_suite_runs_through_the_runner_not_the_run_command(tmp_path, monkeypatch, capsys):
    """Without --store, the claim's suite runs through the runner's run_request, as `moebench run` would run
    it (its lines, a store under --results-dir, failures recorded, not fatal), never through the `moebench
    run` command's click function."""
    from moebench.sweep import cli as sweep_cli
    from moebench.sweep import runner as sweep_runner
    from moebench.sweep.launch import point_record

    monkeypatch.setattr(sweep_runner, "run_point", lambda point, log, **_: point_record(point, "failed", "boom"))
    monkeypatch.setattr(sweep_cli.run_cmd, "callback", lambda **_: pytest.fail("claim called `moebench run`"))
    requests = []
    real = sweep_runner.run_request
    monkeypatch.setattr(sweep_runner, "run_request", lambda request, *args: requests.append(request) or
                        real(request, *args))
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "q", "base": {"preset": "tiny"},
                                     "grid": {"parallel.strategy": ["ddp", "fsdp"]}}))
    claim = tmp_path / "c.yaml"
    claim.write_text(yaml.safe_dump(_claim(suite=str(suite), comparison__at=None)))
    code, out, err = run_cli(["claim", str(claim), "--results-dir", str(tmp_path / "r"), "--set", "train.steps=5",
                              "--no-carry"], monkeypatch, capsys)
    assert code == 0, err
    [request] = requests
    assert (request.suite, request.results_dir, request.overrides) == (str(suite), str(tmp_path / "r"),
                                                                       ("train.steps=5",))
    assert request.allow_failures and not request.progress and not request.oversubscribe
    store = Path(request.out)
    assert store.parent == tmp_path / "r" / "q" and len((store / "records.jsonl").read_text().splitlines()) == 2
    assert "p000    failed" in out and f"render it: moebench report {store}" in out
    assert "claim ddp-faster: INCONCLUSIVE" in out and "point(s) not ok" not in err


def test_largest_does_not_fall_back_and_says_what_it_resolved_to(tmp_path):
    """At the largest expert count both sides ran (64 here: no ddp point at 128), judged there; when a side failed
    there, inconclusive, not moved to a smaller count; ``largest ok`` asks for the fallback."""
    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, equal_work, noise=0.002)
    table, metas, _ = load_tables([store])
    v = judge(parse_claim(RATIO, "c.yaml"), table, metas)
    assert v.verdict == HOLDS and v.resolved == "num_experts=64 (largest)"
    assert "  at num_experts=64 (largest)" in v.lines()
    failed = edited_store(store, tmp_path / "f", lambda r: {**r, "status": "oom"} if r["point_id"] == "e64-fsdp" else r)
    table, metas, _ = load_tables([failed])
    v = judge(parse_claim(RATIO, "c.yaml"), table, metas)
    assert v.verdict == INCONCLUSIVE and v.resolved == "num_experts=64 (largest)"
    assert all("denominator oom" in c.note for c in v.comparisons)
    ok = judge(parse_claim(_claim(comparison__at={"moe.num_experts": "largest ok"}), "c.yaml"), table, metas)
    assert ok.verdict == HOLDS and ok.resolved == "num_experts=32 (largest ok)"


def test_a_claim_refuses_unequal_work_and_judges_the_published_magnitude(tmp_path):
    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, noise=0.002)  # the fixture's drops
    table, metas, _ = load_tables([store])
    v = judge(parse_claim(RATIO, "c.yaml"), table, metas)
    rowwise = next(c for c in v.comparisons if "rowwise" in c.num_label)
    assert rowwise.verdict == INCONCLUSIVE and rowwise.note.startswith("no verdict: unequal work: ddp ep8 rowwise")
    equal = repeated_store(fixture_store("expert-scaling"), tmp_path / "e", 3, equal_work, noise=0.002)
    v = judge(parse_claim(RATIO, "c.yaml"), *load_tables([equal])[:2])
    # holds in direction (>= 1), but the interval lies below the published 2.7x
    assert v.verdict == HOLDS and v.magnitude.count("vs published 2.70x: below it") == len(v.comparisons)


def test_the_shipped_host_sync_claim_compares_ep_dispatchers_only():
    """FSDP's dispatcher field reads sync too: the claim's sides are DDP points, so the row-wise point is compared
    with the sync all-to-all DDP point, never with FSDP (which makes no host sync and would fail the claim)."""
    from moebench.claim.spec import load_claim

    table, metas, _ = load_tables([fixture_store("smoke")])
    v = judge(load_claim("rowwise-no-host-sync"), table, metas)
    assert [(c.num_label, c.den_label) for c in v.comparisons] == [("ddp ep2 rowwise", "ddp ep2")]
    no_sync_ddp = edited_store(fixture_store("smoke"), Path(tempfile.mkdtemp()) / "s",
                               lambda r: None if r["point_id"] == "ddp" else r)
    v = judge(load_claim("rowwise-no-host-sync"), *load_tables([no_sync_ddp])[:2])
    assert v.verdict == CANNOT and "no point pairs" in v.conditions[0]


def test_every_shipped_claim_names_what_its_published_value_depends_on():
    """Dispatcher, micro-batch, routing and precision scope of the published value, each said (or "not stated");
    the 2.7x says its arms were stack vs stack, which moebench's parallelism-only arms are not."""
    from moebench.claim.spec import SCOPE_KEYS

    for path in shipped_claims():
        setup = load_claim(path.stem).setup
        assert all(getattr(setup, key) for key in SCOPE_KEYS), (path.stem, setup)
    arms = load_claim("ddp-ep-vs-fsdp").setup.arms
    assert arms.startswith("stack vs stack") and "parallelism alone" in arms
    table, metas, _ = load_tables([fixture_store("smoke")])
    lines = judge(load_claim("ddp-ep-vs-fsdp"), table, metas).lines()
    assert any(x.startswith("  published arms: stack vs stack") for x in lines)
    assert "  published with: dispatcher DDP arm: row-wise NVSHMEM" in "\n".join(lines)


@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"published__setup__routing": "balanced"}, "published.setup.routing", "learned, random, uniform, skewed"),
    ({"published__setup__dispatcher": 8}, "published.setup.dispatcher", "expected text"),
    ({"published__setup__micro_batch": " "}, "published.setup.micro_batch", "expected text"),
    ({"published__setup__arms": ["stack"]}, "published.setup.arms", "expected text"),
])
def test_a_bad_published_scope_is_one_line_naming_the_field(changes, field, says):
    with pytest.raises(ConfigError) as info:
        parse_claim(_claim(**changes), "c.yaml")
    assert str(info.value).startswith(f"c.yaml: {field}:") and says in str(info.value)


def test_routing_other_than_the_published_is_named():
    """The fixture routed randomly: a claim published with uniform routes says so; one published with random
    routes (or not stated) does not."""
    table, metas, _ = load_tables([fixture_store("expert-scaling")])
    uniform = judge(parse_claim(_claim(published__setup__routing="uniform"), "c.yaml"), table, metas)
    assert "routing: measured random; published uniform (how balanced the routes are moves the rate)" in \
        uniform.conditions
    for same in ("random", "not stated"):
        v = judge(parse_claim(_claim(published__setup__routing=same), "c.yaml"), table, metas)
        assert not any(c.startswith("routing:") for c in v.conditions)


def test_a_rate_with_an_emulated_side_gets_no_verdict(tmp_path):
    """Quantize-dequantize times the emulation, not the native kernels a published speed-up measured: the
    ratio that holds with both sides native is inconclusive when one side ran emulated."""
    def emulated_fsdp(r):
        r = equal_work(r)
        return {**r, "precision_impl": "emulated"} if r["config"]["parallel"]["strategy"] == "fsdp" else r

    store = repeated_store(fixture_store("expert-scaling"), tmp_path / "s", 3, emulated_fsdp, noise=0.002)
    v = judge(parse_claim(RATIO, "c.yaml"), *load_tables([store])[:2])
    assert v.verdict == INCONCLUSIVE and all(c.verdict == INCONCLUSIVE for c in v.comparisons)
    assert all(c.note.startswith("no verdict: bf16 ran emulated (quantize-dequantize)") for c in v.comparisons)
    memory = parse_claim(_claim(comparison={"kind": "memory", "num": {"parallel.strategy": "ddp"},
                                            "den": {"parallel.strategy": "fsdp"}, "at": {"moe.num_experts": 8}},
                                holds="<= 1.0"), "c.yaml")
    assert judge(memory, *load_tables([store])[:2]).verdict == FAILS  # memory is still judged
