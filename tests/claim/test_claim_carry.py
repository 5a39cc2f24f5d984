"""Carrying a claim to its published hardware (``published_setup``): the profile fitted on the checked-in
fixture stores, the published setup planned with it, the held-out error as its uncertainty, the fitted
range, and a store that cannot be calibrated. No training runs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from report_helpers import edited_store, fixture_store, run_cli

from moebench.claim.carry import Calibration, calibrate_stores, carry, machine_notes, outside_range
from moebench.claim.spec import load_claim, parse_claim, shipped_claims
from moebench.devices import DEVICES
from moebench.errors import ConfigError
from moebench.plan import calibrate
from moebench.plan.profile import cpu_device
from moebench.presets import load_config
from moebench.report.claims import claim_rows
from moebench.results.store import Store

SETUP = {"preset": "moe-8l-e128", "gpu": "b300", "gpus": 8, "precision": "bf16", "parallel": {"ep": 8},
         "den": {"parallel.ep": 1}}
CLAIM = {
    "name": "ddp-faster", "statement": "DDP+EP is faster than FSDP", "source": "a paper", "suite": "expert-scaling",
    "comparison": {"kind": "ratio", "num": {"parallel.strategy": "ddp"}, "den": {"parallel.strategy": "fsdp"},
                   "at": {"moe.num_experts": "largest"}},
    "holds": ">= 1.0", "published": {"value": 2.7}, "published_setup": SETUP,
}
DROP = {**CLAIM, "comparison": {"kind": "drop", "select": {"parallel.strategy": "fsdp"}, "axis": "moe.num_experts"},
        "holds": "> 0", "published_setup": {"preset": "moe-8l-e8", "gpu": "b300", "gpus": 8, "axis": [8, 128]}}


@pytest.fixture(scope="module")
def fitted() -> Calibration:
    """The 8 x H200 fixture store: 16 ok points over five layouts, so the held-out split has points."""
    return calibrate_stores([str(fixture_store("expert-scaling"))])


def _setup(**changes):
    return {**CLAIM, "published_setup": {**SETUP, **changes}}


@pytest.mark.parametrize(("data", "field", "says"), [
    (_setup(gpu="b301"), "published_setup.gpu", "unknown GPU"),
    (_setup(preset=None), "published_setup.preset", "required"),
    (_setup(gpus=0), "published_setup.gpus", "positive whole number"),
    (_setup(parallel={"epp": 8}), "published_setup.parallel.epp", "parallel fields are"),
    (_setup(precision="fp4"), "published_setup.precision", "fp4"),
    (_setup(axis=[8, 128]), "published_setup.axis", "only a drop"),
    (_setup(colour="red"), "published_setup.colour", "unknown key"),
    (_setup(set={"train.global_bach_size": 64}), "published_setup.set.train.global_bach_size", "global_bach_size"),
    ({**DROP, "published_setup": {**DROP["published_setup"], "axis": [8]}}, "published_setup.axis", "required"),
    ({**DROP, "published_setup": {**DROP["published_setup"], "num": {"parallel.ep": 8}}}, "published_setup.num",
     "give axis"),
])
def test_a_bad_published_setup_is_one_line_naming_the_field(tmp_path, data, field, says):
    path = tmp_path / "bad.yaml"
    data["published_setup"] = {k: v for k, v in data["published_setup"].items() if v is not None}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_claim(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}:") and says in message and "\n" not in message


def test_every_shipped_claim_names_its_published_setup():
    """Every shipped claim the planner can plan is carried (a count, such as host syncs, is not planned)."""
    for path in shipped_claims():
        claim = load_claim(path.stem)
        if claim.kind == "count":
            continue
        planned = claim.planned
        assert planned is not None and planned.gpu == "b300" and planned.gpus in (4, 8), path


def test_the_fit_is_plan_calibrates_own(fitted):
    """The carried uncertainty is ``moebench plan --calibrate STORE --holdout half``'s held-out error."""
    store = fixture_store("expert-scaling")
    records, _ = Store(store).newest_records()
    points = calibrate.measured_points(records, Store(store).read_meta(), str(store))
    _, _, predictions = calibrate.holdout(points, [str(store)], "half")
    assert fitted.why_not == "" and fitted.profile is not None
    assert fitted.holdout_error == calibrate.median_abs_error(predictions) and fitted.held_out == len(predictions)


def test_a_ratio_planned_on_the_measured_hardware_lands_near_the_measured_one(fitted):
    """Carried to the fixture's own setup (8 x H200, 64 experts), DDP+EP / FSDP comes back near the 2.13x the
    store measured (within the held-out error of each side), and nothing leaves the fitted range."""
    claim = parse_claim(_setup(preset="moe-8l-e64", gpu="h200", precision=None), "c.yaml")
    carried = carry(claim, fitted)
    assert carried is not None and not carried.why_not and not carried.outside and not carried.notes
    tolerance = (1 + fitted.holdout_error) / (1 - fitted.holdout_error)
    assert 2.13 / tolerance <= carried.value <= 2.13 * tolerance


def test_carried_to_the_published_hardware_says_where_it_comes_from(fitted):
    """64 experts on 8 B300: inside the fitted range (8 to 64 experts, 8 layers, 8 ranks), on another GPU."""
    carried = carry(parse_claim(_setup(preset="moe-8l-e64"), "c.yaml"), fitted)
    text = carried.text("ratio", 2.7)
    assert carried.value > 1
    assert text == (f"planned {carried.value:.2f}x on 8 x B300 from this machine's profile (held-out error "
                    f"{fitted.holdout_error:.1%} of tokens/s per device over {fitted.held_out} points); "
                    "published 2.70x")
    assert any(n.startswith("fitted on NVIDIA H200") for n in carried.notes)
    to_64 = {**DROP, "published_setup": {**DROP["published_setup"], "axis": [8, 64]}}
    drop = carry(parse_claim(to_64, "c.yaml"), fitted)
    assert drop.value is not None and 0 < drop.value < 1  # FSDP falls from 8 to 64 experts on B300 too


def test_outside_the_fitted_range_nothing_is_carried(fitted):
    """The fixture's ok points stop at 64 experts (128 ran out of memory): 128 experts, and the 46.9B parameters
    they make, are past what the fit saw, so the claim is not carried there and the text says why. A memory
    claim is planned by the memory model, which is not fitted: it is carried wherever it plans."""
    for data in (CLAIM, DROP):
        carried = carry(parse_claim(data, "c.yaml"), fitted)
        experts, params = carried.outside[:2]  # a drop plans both ends of its axis: 8/128
        assert carried.value is None and experts.startswith("experts ") and experts.endswith("128 (fitted 8-64)")
        assert params.startswith("total parameters ") and params.endswith("46.9 B (fitted 3.17 B-24.3 B)")
        assert carried.text("ratio", 2.7) == ("not carried to 8 x B300: outside the fitted range: "
                                              + "; ".join(carried.outside))
    memory = carry(load_claim("mxfp8-peak-memory"), fitted)
    assert memory.value is not None and memory.error is None


def test_the_fitted_range_is_named_when_left(fitted):
    deeper = load_config("moe-8l-e64", {"model.n_layers": 16, "parallel.dp": 16, "train.global_batch_size": 64})
    outside = outside_range([deeper], DEVICES["b300"], fitted.points)
    assert [x.split(" (")[0] for x in outside] == ["layers 16", "total parameters 50.8 B", "tokens per rank 32,768",
                                                  "ranks 16"]
    assert outside[0] == "layers 16 (fitted 8)" and outside[2:] == ["tokens per rank 32,768 (fitted 8,192)",
                                                                    "ranks 16 (fitted 8)"]
    assert outside_range([load_config("moe-8l-e8", {"parallel.dp": 8})], DEVICES["b300"], fitted.points) == []


def test_a_cpu_profile_on_a_gpu_is_called_what_it_is():
    (note,) = machine_notes(cpu_device(1e11, "Test CPU"), DEVICES["b300"])
    assert note.startswith("the profile is a CPU's") and "not a measurement of the GPU" in note
    assert machine_notes(DEVICES["b300"], DEVICES["b300"]) == []


def test_a_store_that_cannot_be_calibrated_says_why_and_is_still_judged(monkeypatch, capsys):
    """The smoke fixture has one point per layout: no held-out split; the claim is judged all the same."""
    calibration = calibrate_stores([str(fixture_store("smoke"))])
    assert calibration.profile is None and "one per layout" in calibration.why_not
    code, out, _ = run_cli(["claim", "ddp-ep-vs-fsdp", "--store", str(fixture_store("smoke")), "--no-record"],
                           monkeypatch, capsys)
    assert code == 0 and "claim ddp-ep-vs-fsdp: INCONCLUSIVE" in out
    (line,) = [x for x in out.splitlines() if x.startswith("  carried:")]
    assert line.startswith("  carried: not carried to 8 x B300: this store cannot be calibrated: 3 points, one per")
    # a memory claim is planned by the memory model, which needs no profile
    memory = carry(load_claim("mxfp8-peak-memory"), calibration)
    assert memory.value is not None and memory.error is None and "memory model" in memory.text("memory", 0.92)


def test_one_layout_only_cannot_be_calibrated(tmp_path):
    def fsdp_only(r):
        return r if r["config"]["parallel"]["strategy"] == "fsdp" else None

    store = edited_store(fixture_store("expert-scaling"), tmp_path / "s", fsdp_only)
    calibration = calibrate_stores([str(store)])
    assert calibration.profile is None and calibration.why_not.startswith("one layout only (fsdp ep1 pp1 sync, ")
    assert carry(parse_claim(CLAIM, "c.yaml"), calibration).text("ratio", 2.7).startswith(
        "not carried to 8 x B300: this store cannot be calibrated: one layout only")


def test_the_cli_carries_by_default_and_the_report_shows_it(monkeypatch, capsys, tmp_path):
    store = str(shutil.copytree(fixture_store("expert-scaling"), tmp_path / "s"))
    code, out, _ = run_cli(["claim", "ddp-ep-vs-fsdp", "--store", store, "--format", "json"], monkeypatch, capsys)
    (verdict,) = json.loads(out)
    # 128 experts: past the fixture's 64, so not carried, and the report says so
    assert code == 0 and verdict["carried"]["text"].startswith("not carried to 8 x B300: outside the fitted range: "
                                                               "experts 128 (fitted 8-64)")
    (row,) = claim_rows([Path(store)], [])
    assert row[3].startswith("2.70x, 8 x B300") and f"; {verdict['carried']['text']}" in row[3]
    code, out, _ = run_cli(["claim", "ddp-ep-vs-fsdp", "--store", store, "--no-record", "--no-carry"],
                           monkeypatch, capsys)
    assert code == 0 and "carried" not in out


def test_the_setup_s_shared_keys_are_planned(fitted):
    """``published_setup.set`` (the published batch, micro-batch, routing, scope) reaches both planned sides: the
    4-B300 runs' 2-sequence micro-batches save twice the activations of the preset's one."""
    claim = load_claim("recompute-peak-memory")
    assert claim.planned.set["train.micro_batch_size"] == 2
    one = dataclasses.replace(claim, planned=dataclasses.replace(claim.planned, set={}))
    with_set, without = carry(claim, fitted).value, carry(one, fitted).value
    assert with_set is not None and without is not None and with_set < 1 and with_set != pytest.approx(without)
