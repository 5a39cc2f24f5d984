"""The typed run record (moebench/run_record.py): each field in one part, documented in moebench/record.py,
serialised to the record's JSON fields; its derivations are the record's."""

from __future__ import annotations

import dataclasses
import re

import pytest

import moebench.record
import moebench.run_record
from moebench.presets import load_config
from moebench.record import REQUIRED_FIELDS, Header, derived_metrics, record_header
from moebench.run_record import (
    Measured,
    Memory,
    Nvml,
    PeakFlops,
    Reference,
    RunRecord,
    Setup,
    Steps,
    Throughput,
    Training,
)


def _blank(cls: type) -> object:
    """A part with every field None, nested parts blank too (the key sets are under test, not values)."""
    return cls(**{f.name: _blank(_PARTS[f.name]) if f.name in _PARTS else None for f in dataclasses.fields(cls)})


# the fields that hold a part, and the part's class (the annotations are strings: postponed evaluation)
_PARTS = {"header": Header, **{f.name: getattr(moebench.run_record, f.type) for f in dataclasses.fields(Measured)}}


def _record(measured: bool) -> RunRecord:
    return RunRecord(_blank(Setup), "ok", None, _blank(Memory), _blank(Measured) if measured else None, 1.0, [])


def _leaf_fields(cls: type) -> list[str]:
    return [name for f in dataclasses.fields(cls)
            for name in (_leaf_fields(_PARTS[f.name]) if f.name in _PARTS else [f.name])]


def test_each_field_in_one_part_and_documented():
    """No two parts hold one field (none can overwrite another's), the measured record has the
    fields every reader needs, and record.py's field table names each one."""
    fields = ["schema_version", "status", "error", *_leaf_fields(Setup), *_leaf_fields(Memory),
              *_leaf_fields(Measured), "wall_time_s", "nodes"]
    assert len(fields) == len(set(fields))
    record = _record(measured=True).to_dict()
    assert sorted(record) == sorted(fields) and set(REQUIRED_FIELDS) <= set(record)
    doc = moebench.record.__doc__
    documented = set(re.findall(r"``(\w+)``", doc)) | {"reference_flops_after"}  # "``..._before`` / ``after``"
    nvml = {f for f in fields if f.startswith("nvml_") or f == "throttled"}  # "``nvml_*`` / ``throttled``"
    assert "``nvml_*``" in doc and not (set(fields) - nvml - documented)


def test_out_of_memory_record_has_setup_memory_and_nodes_only():
    record = _record(measured=False).to_dict()
    assert set(record) == {"schema_version", "status", "error", *_leaf_fields(Setup), *_leaf_fields(Memory),
                           "wall_time_s", "nodes"}


def test_header_is_the_planner_header():
    """The measured record's header is record_header's, which the planner's planned records use."""
    cfg = load_config("tiny")
    header = Header.of(cfg, "cpu", "cpu", "fp32")
    assert header.fields("ok") == record_header(cfg, "ok", "cpu", "cpu", "fp32")
    assert list(record_header(cfg, "planned", "cpu", "cpu", "fp32"))[:3] == ["schema_version", "status", "error"]


def test_derived_parts_use_the_one_derivation():
    """Throughput is record.derived_metrics at the median step, plus the useful FLOPs of kept routes;
    the reference and energy figures follow from it."""
    cfg = load_config("tiny")
    setup = dataclasses.replace(_blank(Setup), header=Header.of(cfg, "cpu", "cpu", "fp32"),
                                flops_per_token=cfg.flops_per_token())
    steps = dataclasses.replace(_blank(Steps), timed_steps=2, step_time_median_s=0.5)
    training = dataclasses.replace(_blank(Training), dropped_tokens=40)
    peak = PeakFlops(1e12, "bf16", "test", None)
    got = Throughput.derive(setup, steps, training, peak, cfg.expert_params())
    expected = derived_metrics(cfg.tokens_per_step, 0.5, 1, cfg.flops_per_token(), 1e12)
    assert {k: v for k, v in dataclasses.asdict(got).items() if k in expected} == expected
    useful = cfg.flops_per_token() * cfg.tokens_per_step - 20 * 6 * cfg.expert_params()
    assert got.useful_flops_per_step == useful and got.useful_mfu == pytest.approx(useful / 0.5 / 1e12)
    ref = Reference.derive(2e9, 1e9, 3000.0)
    assert ref.tokens_per_reference_gflop == pytest.approx(2000.0) and ref.reference_drift == 0.5
    sampled = {f.name: None for f in dataclasses.fields(Nvml) if f.name != "tokens_per_joule"}
    totals = {"nvml_energy_j": 4.0, "nvml_devices": [{"rank": 0}]}
    energy = Nvml.derive(sampled, totals, setup, steps)
    assert energy.tokens_per_joule == pytest.approx(cfg.tokens_per_step * 2 / 4.0)
    assert Nvml.derive(sampled, {}, setup, steps).tokens_per_joule is None
