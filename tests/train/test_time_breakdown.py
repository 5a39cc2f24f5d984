"""Where the time goes, taken inside the timed steps: the step clock partitions each timed step
without synchronising anything, and every layout's record has phases that add up to its timed
median step (one run per layout family, 2 gloo ranks).

The breakdown is the median timed step's own, on the rank that set its time, with the step timer's
time outside the clock's span in ``other`` (:mod:`moebench.train.breakdown`): so its phases add up
to ``step_time_median_s`` by construction, checked to float precision on one process and on
several ranks alike.
"""

import statistics
import time

import pytest
import torch

from moebench.model.phases import PhaseClock, clock_active, mark
from moebench.presets import load_config
from moebench.record import PHASES
from moebench.testing import run_distributed
from moebench.train.breakdown import median_steps, step_row, time_breakdown
from moebench.train.run import run_training

BASE = ["train.steps=4", "train.warmup_steps=1", "moe.backend=grouped_mm"]


def _record(overrides):
    return run_training(load_config("tiny", BASE + overrides))


def _check_partition(rec, required):
    """The phases add up to the timed median step (see the module docstring), and the phases this
    layout must have took time."""
    phases = rec["time_breakdown_s"]
    assert set(phases) == set(PHASES) and rec["breakdown_steps"] == rec["timed_steps"]
    assert sum(phases.values()) == pytest.approx(rec["breakdown_step_s"], rel=1e-9)
    assert rec["breakdown_step_s"] == pytest.approx(rec["step_time_median_s"], rel=1e-9)
    for name in required:
        assert phases[name] > 0, (name, phases)
    assert all(phases[p] >= 0 for p in PHASES)  # one step's partition: no remainder can be negative
    backward = rec["time_breakdown_backward_s"]
    assert all(0 <= backward[p] <= phases[p] + 1e-9 for p in PHASES)
    assert all(rec["time_breakdown_max_s"][p] >= phases[p] - 1e-9 for p in PHASES)
    assert rec["comm_exposed_s"] >= rec["comm_s"] - 1e-12  # the worst rank's against the mean
    assert rec["profiled_steps"] == 0  # untraced: no extra steps
    for gone in ("breakdown_scale", "time_breakdown_scaled_s", "profiled_step_s"):
        assert gone not in rec


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


class _FakeEvent:
    """``torch.cuda.Event`` on a machine without CUDA: stamps the host time when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: int | None = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter_ns()

    def synchronize(self) -> None:
        _FakeEvent.waited += 1

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.t - self.t) / 1e6  # ms, as CUDA's


def test_the_step_clock_never_synchronises_a_cuda_device(monkeypatch):
    """On CUDA a step clock records events on the stream and waits for none inside the step: a mark
    forward and backward and a timed collective call neither ``torch.cuda.synchronize`` nor an
    event's wait; the events are read afterwards (``resolve``). The profiling clock, which does
    synchronise, shows the mock would see a sync."""
    syncs = []
    _FakeEvent.waited = 0
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", lambda name: 0)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda handle: None)
    clock = PhaseClock(torch.device("cuda"))
    x = torch.randn(4, requires_grad=True)
    with clock_active(clock):
        clock.enter("other")
        y = mark(x, "attention") * 2
        with clock.communication("grad_reduce"):
            pass
        y.sum().backward()
        clock.enter("end")
    assert syncs == [] and _FakeEvent.waited == 0
    assert all(isinstance(stamp, _FakeEvent) for _, stamp in clock.events)
    clock.resolve()  # after the window: now the events are waited for
    assert _FakeEvent.waited > 0 and syncs == []
    assert sum(clock.seconds().values()) == pytest.approx(clock.total_s) and clock.comm_by_phase["grad_reduce"] >= 0
    profiling = PhaseClock(torch.device("cuda"), profiling=True)
    with clock_active(profiling):
        profiling.enter("other")
    assert syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_step_clock_never_synchronises_on_a_gpu():
    """The mocked test above on a real GPU: marks forward and backward and a timed region under
    ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising call raises), then the events,
    read afterwards, partition what ran."""
    w = torch.randn(256, 256, device="cuda")
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    (x @ w).relu().sum().backward()  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    clock = PhaseClock(torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with clock_active(clock):
            clock.enter("other")
            y = (mark(x, "attention") @ w).relu()
            with clock.communication("grad_reduce"):
                y = y * 2
            (mark(y, "experts") @ w).sum().backward()
            clock.enter("end")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert {"fwd:attention", "fwd:experts", "bwd:attention", "grad_reduce"} <= {key for key, _ in clock.events}
    clock.resolve()
    assert clock.total_s > 0 and sum(clock.seconds().values()) == pytest.approx(clock.total_s)


def _clock(steps_ns):
    """A step clock whose timeline is ``[(key, nanoseconds), ...]`` in order, then the end."""
    clock = PhaseClock(torch.device("cpu"))
    t = 0
    for key, ns in steps_ns:
        clock.events.append((key, t))
        t += ns
    clock.events.append(("end", t))
    return clock


def _seconds(clocks):
    """The step timer's times of ``clocks``: their spans, as on a timer with nothing outside the clock."""
    return [c.total_s for c in clocks]


def test_the_breakdown_is_the_median_steps_own():
    """Three steps of 6, 6.5 and 10 units: attention 5, 1, 5 and experts 1, 5.5, 5. Each phase's
    median (5 and 5) would add up to 10, past the median step's 6.5: the breakdown is that step's
    own (attention 1, experts 5.5, other 0), which adds up to the timed median."""
    ms = 1_000_000
    clocks = [_clock([("fwd:attention", 5 * ms), ("fwd:experts", 1 * ms)]),
              _clock([("fwd:attention", 1 * ms), ("bwd:experts", 11 * ms // 2)]),
              _clock([("fwd:attention", 5 * ms), ("fwd:experts", 5 * ms)])]
    clocks[1].comm.append(("experts", 0, 2 * ms))
    got = time_breakdown(clocks, _seconds(clocks), torch.device("cpu"), distributed=False)
    phases = got["time_breakdown_s"]
    assert phases["attention"] == pytest.approx(1e-3) and phases["experts"] == pytest.approx(5.5e-3)
    assert phases["other"] == pytest.approx(0.0) and got["breakdown_step_s"] == pytest.approx(6.5e-3)
    assert sum(phases.values()) == pytest.approx(statistics.median(_seconds(clocks)), rel=1e-12)
    assert got["time_breakdown_backward_s"]["experts"] == pytest.approx(5.5e-3)
    assert got["comm_s"] == pytest.approx(2e-3) and got["comm_breakdown_s"]["experts"] == pytest.approx(2e-3)
    assert got["breakdown_steps"] == 3


def test_an_even_count_takes_the_two_middle_steps_and_the_timer_outside_the_clock_is_other():
    """Four steps: the median is the mean of the two middle ones (statistics.median), and the step
    timer's time beyond a clock's span (1 unit in each step here) counts in other."""
    ms = 1_000_000
    clocks = [_clock([("fwd:attention", n * ms)]) for n in (1, 3, 5, 9)]
    timer = [(n + 1) * 1e-3 for n in (1, 3, 5, 9)]
    got = time_breakdown(clocks, timer, torch.device("cpu"), distributed=False)
    assert got["time_breakdown_s"]["attention"] == pytest.approx(4e-3)
    assert got["time_breakdown_s"]["other"] == pytest.approx(1e-3)
    assert sum(got["time_breakdown_s"].values()) == pytest.approx(statistics.median(timer), rel=1e-12)


def test_ranks_the_rank_that_set_each_step_gives_its_breakdown():
    """Two ranks, three steps (rows of :func:`step_row`): a step lasts as long as its slowest
    rank, so the timed steps are 4, 6 and 9 units; the median one is step 1, whose time rank 1 set,
    waiting 3 units in grad_reduce for rank 0. The breakdown is rank 1's in that step, so it adds up
    to the timed median and names the wait; the worst rank per phase is read in the same step. The
    mean rank's phases (5 units) or each phase's median would not add up to 6."""
    ms = 1_000_000
    steps = {0: [(2, 0), (4, 0), (9, 0)], 1: [(1, 3), (3, 3), (1, 2)]}  # (experts, grad_reduce) per step
    rows = []
    for rank in (0, 1):
        clocks = [_clock([("bwd:experts", e * ms), ("grad_reduce", g * ms)]) for e, g in steps[rank]]
        rows.append(torch.stack([step_row(c, c.total_s) for c in clocks]))
    own, worst, mean = median_steps(torch.stack(rows))
    n = len(PHASES)
    phases = dict(zip(PHASES, own[:n].tolist(), strict=True))
    assert phases["experts"] == pytest.approx(3e-3) and phases["grad_reduce"] == pytest.approx(3e-3)
    assert sum(phases.values()) == pytest.approx(statistics.median([4e-3, 6e-3, 9e-3]), rel=1e-12)
    worst_phases = dict(zip(PHASES, worst[:n].tolist(), strict=True))
    assert worst_phases["experts"] == pytest.approx(4e-3) and worst_phases["grad_reduce"] == pytest.approx(3e-3)
    assert mean[:n].sum().item() == pytest.approx(5e-3)


def test_single_process_breakdown():
    rec = _record([])
    _check_partition(rec, ["attention", "router", "dispatch", "experts", "combine", "head_loss", "optimizer"])
    assert rec["comm_s"] == 0 and rec["time_breakdown_s"]["param_gather"] == 0


def test_phase_clock_off():
    rec = _record(["train.phase_clock=false"])
    assert rec["time_breakdown_s"] is None and rec["breakdown_steps"] == 0 and rec["comm_s"] is None


@pytest.mark.slow
@pytest.mark.parametrize("overrides,required", [
    (["parallel.strategy=fsdp", "parallel.dp=2"], ["param_gather", "grad_reduce", "experts"]),
    (["parallel.dp=2", "parallel.ep=2"], ["dispatch", "experts", "combine", "grad_reduce"]),
    (["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise"], ["dispatch", "grad_reduce"]),
    (["parallel.dp=2", "parallel.dist_opt=true"], ["grad_reduce", "param_gather", "optimizer"]),
    (["parallel.strategy=ddp", "parallel.pp=2", "parallel.dp=1"], ["pipeline_bubble", "attention"]),
], ids=["fsdp", "ddp-ep-sync", "ddp-ep-rowwise", "dist-opt", "pipeline"])
def test_every_layout_partitions_its_timed_step(overrides, required):
    rec = run_distributed(_record, 2, overrides)[0]
    _check_partition(rec, required)
    assert rec["comm_s"] > 0
    if "parallel.ep=2" in overrides:
        # the EP token all-to-all (functional collectives) is counted and timed in the timed steps:
        # combine has no other collective
        assert rec["comm_bytes_per_step"]["ep"] > 0 and rec["comm_breakdown_s"]["combine"] > 0
