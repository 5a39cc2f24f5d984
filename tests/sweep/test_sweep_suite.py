"""Suite files: schema errors that name file and key, grid x zip expansion, point validation."""

from __future__ import annotations

import re

import pytest
import yaml
from click.testing import CliRunner

from moebench.cli import cli
from moebench.errors import ConfigError
from moebench.sweep.suite import SUITES_DIR, find_suite, load_suite, parse_suite, require_runnable

BASE = {"name": "t", "base": {"preset": "tiny", "set": {"train.steps": 4}}}


def _suite(**extra):
    return parse_suite({**BASE, **extra}, source="t.yaml")


def test_grid_times_zip_expansion_order():
    s = _suite(grid={"moe.num_experts": [4, 8]},
               zip={"parallel.strategy": ["fsdp", "ddp"], "parallel.ep": [1, 2], "parallel.dp": [2, 2]})
    points = s.points()
    assert [(p.values["moe.num_experts"], p.values["parallel.strategy"]) for p in points] == [
        (4, "fsdp"), (4, "ddp"), (8, "fsdp"), (8, "ddp")]
    assert [p.point_id for p in points] == ["p000", "p001", "p002", "p003"]
    assert all(p.valid and p.nproc == 2 for p in points)
    assert points[1].config.parallel.ep == 2 and points[1].config.train.steps == 4
    assert "--nproc" in points[1].train_args() and points[1].train_args()[-1] == "--json"


def test_several_zip_groups_multiply():
    s = _suite(zip=[{"moe.top_k": [1, 2]}, {"train.seed": [0, 1, 2]}])
    assert len(s.points()) == 6


def test_keys_stable_and_distinct():
    a = _suite(grid={"moe.num_experts": [4, 8]}).points()
    b = _suite(grid={"moe.num_experts": [4, 8]}).points()
    assert [p.key for p in a] == [p.key for p in b]
    assert a[0].key != a[1].key
    # the same resolved config reached through different overrides is the same point
    c = parse_suite({"name": "t", "base": {"preset": "tiny", "set": {"train.steps": 4, "moe.num_experts": 4}}})
    assert c.points()[0].key == a[0].key


def test_invalid_points_carry_reason():
    s = _suite(zip={"parallel.dp": [2, 2, 1], "parallel.ep": [2, 3, 1], "moe.top_k": [2, 2, 99]})
    p_ok, p_ep, p_topk = s.points()
    assert p_ok.valid
    assert not p_ep.valid and "parallel.ep=3" in p_ep.error
    assert not p_topk.valid and "moe.top_k=99" in p_topk.error


def test_duplicate_points_are_invalid():
    s = _suite(zip={"moe.num_experts": [8, 8]})  # tiny already has 8 experts: the same config twice
    a, b = s.points()
    assert a.valid and b.error == "same resolved config as p000"


def test_nproc_must_match_world_size():
    s = _suite(zip={"nproc": [2, 4]}, grid={"parallel.dp": [2]})
    good, bad = s.points()
    assert good.valid and "nproc=4" in bad.error


@pytest.mark.parametrize("data, where, allowed", [
    ({"name": "t", "axes": {}}, "axes", "allowed: name, description"),
    ({"base": {}}, "name", "required"),
    ({**BASE, "grid": {"moe.nope": [1]}}, "grid.moe.nope", "moe fields are"),
    ({**BASE, "grid": {"bogus.x": [1]}}, "grid.bogus.x", "allowed: preset, nproc, model.<field>"),
    ({**BASE, "grid": {"moe.top_k": 3}}, "grid.moe.top_k", "non-empty list"),
    ({**BASE, "zip": {"moe.top_k": [1, 2], "train.seed": [1]}}, "zip[0]", "equal lengths"),
    ({**BASE, "grid": {"moe.top_k": [1]}, "zip": {"moe.top_k": [2]}}, "zip[0].moe.top_k", "appears twice"),
    ({"name": "t", "base": {"preset": "nope"}}, "base.preset", "allowed: tiny"),
    ({"name": "t", "base": {"presets": "tiny"}}, "base.presets", "allowed: preset, set, nproc"),
    ({**BASE, "timeout": -1}, "timeout", "positive"),
    ({**BASE, "baseline": {"parallel.strat": "fsdp"}}, "baseline.parallel.strat", "parallel fields are"),
    ({**BASE, "grid": {1: [1]}}, "grid.1", "not text"),
    ({"name": "t", "base": {"set": {2: 1}}}, "base.set.2", "not text"),
    ({"name": "t", "base": {"nproc": True}}, "base.nproc", "positive integer"),
    # a value the field can never take is an error of the file, not one invalid point per combination
    ({**BASE, "grid": {"moe.num_experts": [8, "many"]}}, "grid.moe.num_experts[1]",
     "bad value 'many' for moe.num_experts; expected an integer"),
    ({"name": "t", "base": {"set": {"moe.gating": 5}}}, "base.set.moe.gating", "allowed: softmax, sigmoid"),
    ({**BASE, "zip": {"moe.top_k": [2, None]}}, "zip[0].moe.top_k[1]", "bad value None for moe.top_k"),
    ({**BASE, "grid": {"moe.num_experts": [[8]]}}, "grid.moe.num_experts[0]", "bad value [8]"),
    ({**BASE, "baseline": {"parallel.strategy": "fdsp"}}, "baseline.parallel.strategy", "allowed: fsdp, ddp"),
    ({**BASE, "grid": {"nproc": [2, 0]}}, "grid.nproc[1]", "not a positive integer"),
    ({**BASE, "grid": {"preset": ["tiny", "huge"]}}, "grid.preset[1]", "unknown preset 'huge'"),
    ({"name": ".."}, "name", "names the results folder"),
    ({**BASE, "timeout": float("nan")}, "timeout", "positive number"),
    ({"name": "t", "base": {"preset": ["tiny", "small"]}}, "base.preset", "expected one preset name"),
    ({**BASE, "zip": [{}]}, "zip[0]", "an empty mapping zips no axis"),
])
def test_schema_errors_name_file_key_and_allowed(data, where, allowed):
    with pytest.raises(ConfigError) as info:
        parse_suite(data, source="bad.yaml")
    message = str(info.value)
    assert message.startswith(f"bad.yaml: {where}:"), message
    assert allowed in message


def test_shipped_suites_parse_and_validate():
    names = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
    assert {"smoke", "expert-scaling", "expert-scaling-cpu", "topk", "precision", "parallelism",
            "olmoe-1b-7b", "topk-cpu", "precision-cpu", "parallelism-cpu"} <= set(names)
    for name in names:
        suite = load_suite(name)
        assert suite.name == name
        points = suite.points()
        assert points and all(p.valid for p in points), [(p.point_id, p.error) for p in points if not p.valid]
    smoke = load_suite("smoke").points()
    assert {p.values["parallel.strategy"] for p in smoke} == {"fsdp", "ddp"}
    assert all(p.nproc == 2 for p in smoke)


# the CPU twins of device-sized suites: same question, sized to run on a 2-CPU machine in minutes
CPU_TWINS = {"topk-cpu": "topk", "precision-cpu": "precision", "parallelism-cpu": "parallelism"}


@pytest.mark.parametrize("twin, suite", sorted(CPU_TWINS.items()))
def test_cpu_twins_ask_their_suites_question_on_two_cpus(twin, suite):
    """Each point of a CPU twin runs on the CPU on at most 2 ranks; a one-process twin sweeps its
    suite's points exactly, a layout twin the suite's axes with values the suite has (but dp, the
    world it scales down), so the twin asks the suite's question in small."""
    small, full = load_suite(twin), load_suite(suite)
    assert all(p.config.train.device == "cpu" and p.nproc <= 2 for p in small.points())
    assert small.timeout_s <= 300 < full.timeout_s and small.baseline == full.baseline
    if suite != "parallelism":
        assert [p.values for p in small.points()] == [p.values for p in full.points()]
        return
    axes = {k for p in full.points() for k in p.values}
    assert {k for p in small.points() for k in p.values} == axes
    for axis in axes - {"parallel.dp"}:
        assert {p.values[axis] for p in small.points()} <= {p.values[axis] for p in full.points()}, axis


# the shipped suites whose row-wise points may drop routes: each says so in its description
DROPPING_SUITES = {"expert-scaling", "drop-policy"}


def test_shipped_comparisons_do_equal_work():
    """A suite that compares a row-wise point runs it at lossless capacity (no route dropped on
    either side), unless it is a dropping suite that says so."""
    for path in SUITES_DIR.glob("*.yaml"):
        suite = load_suite(path.stem)
        rowwise = [p for p in suite.points() if p.config.parallel.dispatcher == "rowwise" and p.config.parallel.ep > 1]
        if path.stem in DROPPING_SUITES:
            assert "dropping suite" in suite.description and rowwise, path.stem
            continue
        assert all(p.config.moe.capacity == "lossless" for p in rowwise), path.stem


def test_suite_names_resolve_in_the_working_directory_first(tmp_path, monkeypatch):
    """Shipped suites are package data (found from any directory); ./suites/NAME.yaml overrides one."""
    monkeypatch.chdir(tmp_path)
    assert find_suite("smoke") == SUITES_DIR / "smoke.yaml" and SUITES_DIR.parent.name == "moebench"
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "smoke.yaml").write_text(yaml.safe_dump({**BASE, "name": "smoke"}))
    assert find_suite("smoke").resolve() == (tmp_path / "suites" / "smoke.yaml").resolve()
    with pytest.raises(ConfigError, match=r"known suites in suites: smoke; .*expert-scaling-cpu"):
        find_suite("nope")


def test_shipped_suites_are_one_copy_at_the_top_level():
    """The repository keeps its suites in the top-level suites/ folder; the package's moebench/suites is
    a link to it (a wheel copies the files in), so there is one copy of each suite to edit."""
    root = SUITES_DIR.parents[1]
    assert SUITES_DIR.is_symlink() and SUITES_DIR.resolve() == (root / "suites").resolve()
    assert {p.name for p in (root / "suites").glob("*.yaml")} >= {"smoke.yaml", "check-against.yaml"}


def test_unknown_suite_lists_each_suite_once_and_suggests_a_close_name(monkeypatch):
    """In a checkout ./suites is the folder moebench/suites links to: the error lists it once."""
    monkeypatch.chdir(SUITES_DIR.parents[1])
    with pytest.raises(ConfigError) as info:
        find_suite("smokee")
    message = str(info.value)
    assert message.startswith("unknown suite 'smokee'; did you mean 'smoke'? (known suites in suites: ")
    assert message.count("expert-scaling-cpu,") == 1 and str(SUITES_DIR) not in message, message
    with pytest.raises(ConfigError, match=r"unknown suite 'zzz' \(known"):  # nothing close: no guess
        find_suite("zzz")


def test_find_suite_by_path_and_unknown(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**BASE, "name": "mine"}))
    assert find_suite(str(path)) == path and load_suite(path).name == "mine"
    with pytest.raises(ConfigError, match=r"unknown suite 'nope' \(known suites in .*smoke"):
        find_suite("nope")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:2:1: not valid YAML: expected ',' or ']'"):
        load_suite(tmp_path / "broken.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary\.yaml: cannot read the suite file"):
        load_suite(tmp_path / "binary.yaml")


def test_dry_run_prints_table_with_invalid_reason(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, "zip": {"parallel.dp": [1, 2], "parallel.ep": [1, 3]}}))
    result = CliRunner().invoke(cli, ["run", str(path), "--dry-run", "--out", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    assert "p000" in result.output and "p001" in result.output
    assert "NO: impossible parallel layout: parallel.ep=3 does not divide parallel.dp=2" in result.output
    assert "2 points, 1 valid, 1 invalid" in result.output
    assert not (tmp_path / "store").exists()  # a dry run writes nothing


def test_yaml_errors_are_one_line_with_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: s\nbase: {preset: tiny\ngrid: [1,\n")
    with pytest.raises(ConfigError) as info:
        load_suite(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3:5: not valid YAML: expected ',' or '}}'"), message
    assert "line 2" in message and "\n" not in message and "<unicode string>" not in message


def test_a_key_given_twice_is_an_error_not_silently_replaced(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("name: s\ngrid:\n  moe.num_experts: [8]\n  moe.top_k: [1]\n  moe.num_experts: [16]\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:5:3: .*'moe\.num_experts' appears twice \(first on line 3\)"):
        load_suite(path)
    path.write_text("name: s\nbase: {preset: tiny}\nbase: {preset: small}\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:3:1: .*key 'base' appears twice"):
        load_suite(path)
    path.write_text("name: s\nbase: &b {preset: tiny}\ngrid: {<<: *b, moe.top_k: [1, 2]}\n")  # merge keys still work
    with pytest.raises(ConfigError, match=r"grid\.preset: expected a non-empty list"):
        load_suite(path)


def test_a_suite_without_a_runnable_point_is_refused_before_any_store(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": {"preset": "tiny", "nproc": 4},
                                    "grid": {"moe.num_experts": [8, 16]}}))
    for extra in (["--dry-run"], []):
        result = CliRunner().invoke(cli, ["run", str(path), "--out", str(tmp_path / "store"), *extra])
        assert isinstance(result.exception, ConfigError), result.output
        message = str(result.exception)
        assert message.startswith(f"{path}: no point of the suite can run; p000: nproc=4 does not match"), message
        assert "1 more invalid point" in message
        assert not (tmp_path / "store").exists()


def _write(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def _dry_run(path, monkeypatch, capsys, *args):
    from report_helpers import run_cli

    return run_cli(["run", str(path), "--dry-run", *args], monkeypatch, capsys)


def test_a_value_with_a_newline_never_reaches_the_sbatch_script(tmp_path):
    path = _write(tmp_path, 'name: t\nbase: {preset: tiny}\ngrid: {train.lr: ["0.01\\ntouch /tmp/x"]}\n')
    with pytest.raises(ConfigError, match=r"grid\.train\.lr\[0\]: bad value '0.01\\ntouch /tmp/x'"):
        load_suite(path)


@pytest.mark.parametrize("name", ["a\x00b", "a b", "é", "-x", "a;b", ".", ".."])
def test_suite_name_is_a_folder_and_job_name(name):
    with pytest.raises(ConfigError, match=r"t\.yaml: name: .*letters, digits and _\.\+-"):
        _suite(name=name)


def test_point_cap_is_checked_before_expansion(tmp_path, monkeypatch, capsys):
    grid = {"train.seed": list(range(60)), "train.lr": [0.001 * i for i in range(1, 61)],
            "moe.top_k": [1, 2] * 30, "model.n_layers": list(range(1, 61))}
    path = _write(tmp_path, yaml.safe_dump({"name": "big", "base": {"preset": "tiny"}, "grid": grid}))
    code, _, err = _dry_run(path, monkeypatch, capsys)  # 12.96M points: refused at once
    assert code == 2 and len(err.splitlines()) == 1
    assert err.strip() == (f"error: {path}: grid x zip expands to 12,960,000 points, more than the cap of 1,000 "
                           "(moebench run --max-points 12960000 allows them)")
    small = _write(tmp_path, yaml.safe_dump({"name": "s", "base": {"preset": "tiny"},
                                             "grid": {"train.seed": list(range(5))}}))
    assert _dry_run(small, monkeypatch, capsys, "--max-points", "4")[0] == 2
    assert _dry_run(small, monkeypatch, capsys, "--max-points", "5")[0] == 0


def test_alias_bomb_is_refused(tmp_path):
    """Nine levels of nine aliases: 387M values from ten lines (it hung --dry-run)."""
    bomb = "\n".join(["name: t", "description:", "  - &a0 [x, x, x, x, x, x, x, x, x]",
                      *[f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]]) + "\n"
    with pytest.raises(ConfigError, match=r"not valid YAML: aliases expand the file beyond 100,000 values"):
        load_suite(_write(tmp_path, bomb))


def test_recursive_alias_and_deep_nesting_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="an alias refers to the collection it is part of"):
        load_suite(_write(tmp_path, "name: t\ndescription: &d [1, *d]\n"))
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_suite(_write(tmp_path, "name: t\ndescription: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_description_is_text():
    with pytest.raises(ConfigError, match=r"t\.yaml: description: expected text, got list"):
        _suite(description=["a"])


def test_baseline_must_match_a_runnable_point(tmp_path, monkeypatch, capsys):
    zip_ = {"parallel.strategy": ["fsdp", "ddp"], "parallel.dp": [2, 2]}
    path = _write(tmp_path, yaml.safe_dump({"name": "t", "base": {"preset": "tiny"}, "zip": zip_,
                                            "baseline": {"parallel.strategy": "ddp", "parallel.dp": 1}}))
    code, out, err = _dry_run(path, monkeypatch, capsys)
    assert code == 2 and "p000" in out  # the points are listed first
    assert err.strip() == (f"error: {path}: baseline: parallel.dp=1, parallel.strategy=ddp matches no runnable "
                           "point (parallel.dp takes 2; parallel.strategy takes ddp, fsdp)")
    assert _suite(zip=zip_, baseline={"parallel.strategy": "ddp"}).baseline_given
    s = _suite(zip=zip_, baseline={"parallel.strategy": "ddp"})
    require_runnable(s, s.points())  # matches p001
    s = _suite(grid={"parallel.strategy": ["ddp"]})  # the default baseline may match nothing
    require_runnable(s, s.points())


def test_more_local_ranks_than_cpus_is_invalid_unless_oversubscribed(tmp_path, monkeypatch, capsys):
    import moebench.launch.leader as launch
    from moebench.devices import LocalRanks

    monkeypatch.setattr(launch, "local_ranks", lambda: LocalRanks(cpus=2, gpus=0))
    base = {"preset": "tiny", "set": {"parallel.dp": 4, "train.micro_batch_size": 2}}
    path = _write(tmp_path, yaml.safe_dump({"name": "t", "base": base, "baseline": {"parallel.dp": 4}}))
    code, out, _ = _dry_run(path, monkeypatch, capsys)
    assert code == 2 and "nproc=4 is more ranks than the 2 CPUs here" in out
    assert _dry_run(path, monkeypatch, capsys, "--oversubscribe")[0] == 0
    assert _dry_run(path, monkeypatch, capsys, "--slurm")[0] == 0  # ranks run on the cluster's nodes
    assert LocalRanks(cpus=2, gpus=8).limit("auto") == (8, "GPUs")
    assert LocalRanks(cpus=2, gpus=8).limit("cpu") == (2, "CPUs")


def test_filter_values_are_ascii_numbers_too():
    from moebench.sweep.select import chosen_points

    s = _suite(zip={"nproc": [1, 2], "parallel.dp": [1, 2]})
    assert [p.point_id for p in chosen_points(s.points(), [], ["nproc=2"])] == ["p001"]
    with pytest.raises(ConfigError, match="--filter nproc=\uff12: nproc '\uff12' is not a positive integer"):
        chosen_points(s.points(), [], ["nproc=\uff12"])
    with pytest.raises(ConfigError, match=re.escape("bad value '\uff12' for parallel.dp; expected an integer")):
        chosen_points(s.points(), [], ["parallel.dp=\uff12"])


def test_oversubscribe_reaches_each_points_train_command():
    """Only when asked: an older moebench (check --against REV) does not know the flag."""
    import dataclasses

    from moebench.sweep.suite import Point

    s = _suite(zip={"nproc": [1, 2], "parallel.dp": [1, 2]})
    assert all("--oversubscribe" not in p.train_args() for p in s.points())
    one, two = dataclasses.replace(s, oversubscribe=True).points()
    assert "--oversubscribe" not in one.train_args() and "--oversubscribe" in two.train_args()
    assert Point.from_dict(two.to_dict()).train_args() == two.train_args()  # Slurm tasks read points.json


@pytest.mark.parametrize("args, message", [
    (["--only", ""], "--only '': names no point"),
    (["--only", ","], "--only ',': names no point"),
    (["--set", "train.steps=3", "--set", "train.steps=4"],
     "--set train.steps: given twice (train.steps=3 and train.steps=4); give each key once"),
    (["--filter", "parallel.strategy=ddp", "--filter", "parallel.strategy=fsdp"],
     "--filter parallel.strategy: given twice"),
])
def test_selections_that_would_silently_mean_something_else_are_errors(args, message):
    result = CliRunner().invoke(cli, ["run", "smoke", "--dry-run", *args])
    assert result.exit_code != 0 and message in str(result.exception or result.output), result.output


def test_expanding_a_suite_resolves_each_sections_field_types_once(monkeypatch):
    """A suite's expansion cost grows with its points: resolving the config sections' annotations
    (typing.get_type_hints) for every override of every point made 10,000 points cost 14 s of CPU time."""
    import typing

    from moebench.config import overrides

    overrides._field_types.cache_clear()
    calls = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda cls, *a, **k: calls.append(cls) or real(cls, *a, **k))
    suite = parse_suite({"name": "many", "base": {"preset": "tiny", "set": {"train.device": "cpu"}},
                         "grid": {"moe.num_experts": [2, 4, 8, 16], "train.seed": list(range(10)),
                                  "model.d_model": [64, 128]}})
    assert len(suite.points()) == 80
    assert len(calls) == len(set(calls)) <= 5  # once per section at most
