"""Where the time goes: the phase clock partitions each profiled step, and every layout's record
shows the phases that layout has (2-4 gloo ranks)."""

import pytest
import torch

from moebench.model.phases import PhaseClock, clock_active, mark
from moebench.presets import load_config
from moebench.record import PHASES
from moebench.testing import run_distributed
from moebench.train.run import run_training

BASE = ["train.steps=2", "train.warmup_steps=1", "train.profile_steps=1", "moe.backend=grouped_mm"]


def _record(overrides):
    return run_training(load_config("tiny", BASE + overrides))


def _check_partition(rec, required):
    """The phases add up to the profiled step measured around it (within 10%), and the phases
    this layout must have took time."""
    phases = rec["time_breakdown_s"]
    assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(rec["profiled_step_s"], rel=0.1)
    for name in required:
        assert phases[name] > 0, (name, phases)
    backward = rec["time_breakdown_backward_s"]
    assert all(0 <= backward[p] <= phases[p] + 1e-9 for p in PHASES)
    assert all(rec["time_breakdown_max_s"][p] >= phases[p] - 1e-9 for p in PHASES)
    assert 0 <= rec["comm_exposed_s"] <= rec["comm_s"]
    _check_reconciled(rec)


def _check_reconciled(rec):
    """The scaled breakdown sums to the timed median (within 10%), the raw phases stay as measured,
    and the flag says whether the profiled step was within 15% of the timed one."""
    scale = rec["step_time_median_s"] / rec["profiled_step_s"]
    assert rec["breakdown_scale"] == pytest.approx(scale)
    assert rec["breakdown_representative"] == (abs(scale - 1) <= 0.15)
    scaled = rec["time_breakdown_scaled_s"]
    assert sum(scaled.values()) == pytest.approx(rec["step_time_median_s"], rel=0.1)
    assert all(scaled[p] == pytest.approx(rec["time_breakdown_s"][p] * scale) for p in PHASES)


def test_marks_attribute_forward_and_backward_to_their_regions():
    """Forward: the time after a mark is its region's; backward: the time after a mark's gradient
    passes is the previous region's (autograd runs the graph in reverse)."""
    clock = PhaseClock(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)
    with clock_active(clock):
        clock.enter("other")
        y = mark(x, "attention") * 2
        z = mark(y, "experts") * 3
        clock.enter("head_loss")
        z.sum().backward()
        clock.enter("end")
    order = [key for key, _ in clock.events]
    assert order == ["other", "fwd:attention", "fwd:experts", "head_loss", "bwd:attention", "bwd:other", "end"]
    assert sum(clock.seconds().values()) == pytest.approx(clock.total_s)
    assert mark(x, "attention") is x  # no clock: a plain identity, nothing recorded


def test_single_process_breakdown():
    rec = _record([])
    _check_partition(rec, ["attention", "router", "dispatch", "experts", "combine", "head_loss", "optimizer"])
    assert rec["comm_s"] == 0 and rec["time_breakdown_s"]["param_gather"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides,required", [
    (2, ["parallel.strategy=fsdp", "parallel.dp=2"], ["param_gather", "grad_reduce", "experts"]),
    (2, ["parallel.dp=2", "parallel.ep=2"], ["dispatch", "experts", "combine", "grad_reduce"]),
    (2, ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise"], ["dispatch", "grad_reduce"]),
    (2, ["parallel.dp=2", "parallel.dist_opt=true"], ["grad_reduce", "param_gather", "optimizer"]),
    (4, ["parallel.dp=2", "parallel.pp=2", "parallel.ep=2"], ["pipeline_bubble", "attention", "grad_reduce"]),
], ids=["fsdp", "ddp-ep-sync", "ddp-ep-rowwise", "dist-opt", "pipeline"])
def test_every_layout_partitions_its_step(world, overrides, required):
    rec = run_distributed(_record, world, overrides)[0]
    _check_partition(rec, required)
    assert rec["comm_s"] > 0


def test_profiling_off():
    rec = _record(["train.profile_steps=0"])
    assert rec["time_breakdown_s"] is None and rec["profiled_steps"] == 0
    assert rec["time_breakdown_scaled_s"] is None and rec["breakdown_scale"] is None
