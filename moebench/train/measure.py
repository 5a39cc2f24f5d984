"""A run's figures: each rank's, read once after the timed window, then the run's from every rank's.

:func:`over_ranks` is the one place where the ranks' figures meet; every rank calls it and runs its
collectives in the same order. The record (:class:`moebench.run_record.RunRecord`) is built from
what it returns, so no field is computed for one rank and then overwritten with the run's.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moebench.config import Config
from moebench.metrics.flops import device_peak
from moebench.metrics.memory import memory_fields
from moebench.metrics.steady import window_drift
from moebench.model.phases import PhaseClock
from moebench.model.route_keys import CHECKSUM_MODULUS
from moebench.parallel.strategy import Strategy
from moebench.record import window_drifting
from moebench.run_record import Breakdown, Communication, Memory, PeakFlops, Steps, Training
from moebench.train.breakdown import time_breakdown
from moebench.train.trainer import Trainer, WindowSamples


@dataclass(frozen=True)
class RankFigures:
    """This rank's figures, read right after the timed window: the profiled and memory steps that
    follow add to the trainer's logs and to the memory peaks."""

    step_times_s: list[float]
    step_cpu_times_s: list[float]  # this process's CPU seconds in each timed step (every thread)
    step_ginstructions: list[float]  # billions of instructions each timed step (train.instructions; one process)
    step_time_median_s: float
    warmup_step_times_s: list[float]
    compile_s: float | None
    peak: PeakFlops
    losses: list[float]
    memory: Memory  # this rank's peaks
    optimizer_state_bytes: int
    reference_flops: tuple[float, float]  # before and after the timed window
    lb_loss: float | None
    z_loss: float | None
    expert_load_max_over_mean: list[float]
    dropped_tokens: int  # over this rank's data-parallel group (the trainer reduced it), its stages only
    padding_flops_per_step: float  # this rank's experts
    routing_checksum: Tensor | None  # this rank's timed routes; None without MoE layers or under a pipeline
    dispatch: tuple[Tensor, Tensor] | None  # row-wise EP: (maxes, sums) of this rank's layers; None otherwise


def rank_figures(cfg: Config, trainer: Trainer, strategy: Strategy, device: torch.device,
                 reference_flops: list[float]) -> RankFigures:
    """This rank's figures, after the timed window and before anything else runs."""
    log, timer = trainer.log, trainer.timer
    warmup = len(timer.warmup_samples)  # the warm-up steps this run took (fixed or until steady)
    losses = torch.stack(log.losses).tolist()
    peak = device_peak(device)  # before the memory peaks are read: a CPU calibration's matrices count in them
    memory = Memory(**memory_fields(device))
    optimizer_state = strategy.optimizer_state_bytes(trainer.optimizer)
    if log.lb:
        router = {"lb_loss": log.lb[-1].item(), "z_loss": log.z[-1].item(),
                  "expert_load_max_over_mean": torch.stack(log.load_imbalance).tolist(),
                  "dropped_tokens": int(torch.stack(log.dropped[warmup:]).sum().item()),
                  "padding_flops_per_step": torch.stack(log.padding_flops[warmup:]).mean().item()}
    else:
        router = {"lb_loss": None, "z_loss": None, "expert_load_max_over_mean": [], "dropped_tokens": 0,
                  "padding_flops_per_step": 0.0}
    before, after = reference_flops
    return RankFigures(
        step_times_s=timer.samples, step_cpu_times_s=timer.cpu_samples, step_time_median_s=timer.median,
        step_ginstructions=timer.ginstruction_samples,
        warmup_step_times_s=timer.warmup_samples,
        compile_s=timer.warmup_excess_s if cfg.train.compile else None,
        peak=PeakFlops(peak.flops, peak.dtype, peak.source, torch.get_num_threads() if device.type == "cpu" else None),
        losses=losses, memory=memory, optimizer_state_bytes=optimizer_state, reference_flops=(before, after), **router,
        routing_checksum=_routing_checksum(cfg, trainer),
        dispatch=_dispatch(cfg, trainer, device, warmup, warmup + len(timer.samples)))


def _routing_checksum(cfg: Config, trainer: Trainer) -> Tensor | None:
    """This rank's part of the routing checksum (:func:`moebench.model.route_keys.route_checksum`):
    its timed steps' routes over its MoE layers. None without MoE layers or under a pipeline (a
    stage holds only some layers, and routes its micro-batches in the schedule's order)."""
    timed = trainer.log.routing_checksum[len(trainer.timer.warmup_samples):]
    if not timed or cfg.parallel.pp > 1:
        return None
    return torch.stack(timed).sum() % CHECKSUM_MODULUS


def _dispatch(cfg: Config, trainer: Trainer, device: torch.device, warmup: int,
              steps: int) -> tuple[Tensor, Tensor] | None:
    """Row-wise EP statistics of this rank's layers (None under other dispatchers): rank load per
    step, capacity use (max over the timed steps) and the timed steps' padding and all slots. A
    pipeline stage without MoE layers has zeros. ``warmup`` and ``steps``: the warm-up steps this run
    took (the same on every rank) and all the steps it ran."""
    p = cfg.parallel
    if p.dispatcher != "rowwise" or p.ep == 1:
        return None
    log = trainer.log
    t_S4 = (torch.stack(log.dispatch) if log.dispatch
            else torch.zeros(steps, 4, dtype=torch.float64, device=device))
    return torch.cat([t_S4[:, 0], t_S4[warmup:, 1].max().reshape(1)]), t_S4[warmup:, 2:].sum(0)


@dataclass(frozen=True)
class RunFigures:
    """The run's figures: every rank's reduced to the parts of its record."""

    steps: Steps
    memory: Memory
    training: Training
    reference_flops: tuple[float, float]  # mean over ranks
    breakdown: Breakdown


def over_ranks(mine: RankFigures, clocks: list[PhaseClock], strategy: Strategy, device: torch.device,
               n_moe: int, profiled_steps: int) -> RunFigures:
    """The run's figures from every rank's (every rank calls it: collectives). A step lasts as long as
    its slowest rank and costs the CPU time of every rank together; the memory peak is the largest
    rank's; the reference GEMM's rates are the mean over the ranks (they timed it at once, sharing
    the machine as their steps do); padding FLOPs,
    drops and routes are sums; under a pipeline the stages' router statistics combine. ``n_moe``:
    this rank's MoE layers; ``clocks``: its timed steps' step clocks; ``profiled_steps``: the extra
    steps run for the trace. The tensors in ``mine`` are reduced in place."""
    dims = strategy.dims
    checksum = None
    if mine.routing_checksum is not None:
        total = strategy.all_reduce_sum(mine.routing_checksum.reshape(1))
        checksum = int(total.remainder(CHECKSUM_MODULUS).item())
    dispatch = _dispatch_over_ranks(mine.dispatch)
    step_times, median, cpu_times = mine.step_times_s, mine.step_time_median_s, mine.step_cpu_times_s
    memory = mine.memory
    (before, after), padding_flops = mine.reference_flops, mine.padding_flops_per_step
    router = {"lb_loss": mine.lb_loss, "z_loss": mine.z_loss,
              "expert_load_max_over_mean": mine.expert_load_max_over_mean, "dropped_tokens": mine.dropped_tokens}
    if dims is not None:
        times = torch.tensor(step_times, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        mem = torch.tensor([memory.peak_mem_bytes, memory.peak_rss_bytes], dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        step_times = times.tolist()
        cpu = torch.tensor(cpu_times, dtype=torch.float64, device=device)
        dist.all_reduce(cpu)
        cpu_times = cpu.tolist()
        peak_mem, peak_rss = (int(v) for v in mem.tolist())
        memory = dataclasses.replace(memory, peak_mem_bytes=peak_mem, peak_rss_bytes=peak_rss)
        # the reference rates' mean and the padding FLOPs' sum (each rank computed its own experts'
        # padding rows) in one reduction
        sums = torch.tensor([before, after, padding_flops], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        world = dist.get_world_size()
        before, after, padding_flops = sums.tolist()
        before, after = before / world, after / world
        median = statistics.median(step_times)
        if dims.pp > 1:
            router = _router_stats_over_stages(router, len(mine.losses), n_moe, device, dims.groups["pp"])
    drift = window_drift(step_times)  # the slowest rank's steps
    steps = Steps(timed_steps=len(mine.step_times_s), warmup_steps_used=len(mine.warmup_step_times_s),
                  step_times_s=step_times, warmup_step_times_s=mine.warmup_step_times_s, compile_s=mine.compile_s,
                  step_time_median_s=median, step_cpu_times_s=cpu_times,
                  step_cpu_median_s=statistics.median(cpu_times) if cpu_times else None,
                  # one process only (train.instructions): nothing to reduce over ranks
                  step_ginstructions=mine.step_ginstructions or None,
                  step_ginstructions_median=statistics.median(mine.step_ginstructions)
                  if mine.step_ginstructions else None,
                  window_drift=drift, window_drifting=window_drifting(drift))
    training = Training(loss_first=mine.losses[0], loss_last=mine.losses[-1], losses=mine.losses, **router,
                        padding_flops_per_step=padding_flops, routing_checksum=checksum, **dispatch)
    breakdown = Breakdown(**time_breakdown(clocks, mine.step_times_s, device, distributed=dims is not None),
                          profiled_steps=profiled_steps)
    return RunFigures(steps, memory, training, (before, after), breakdown)


def _dispatch_over_ranks(dispatch: tuple[Tensor, Tensor] | None) -> dict[str, Any]:
    """Row-wise EP statistics over every rank (None under other dispatchers): rank load per step
    (max over MoE layers and EP groups), capacity use (max over the timed steps) and the padding
    share of the all-to-all's slots (timed steps). Every rank joins the reductions, also a
    pipeline stage without MoE layers."""
    if dispatch is None:
        return {"ep_rank_load_max_over_mean": None, "capacity_util_max": None, "padded_rows_fraction": None}
    maxes, sums = dispatch
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums)
    padding_slots, slots = sums.tolist()
    return {"ep_rank_load_max_over_mean": maxes[:-1].tolist(), "capacity_util_max": maxes[-1].item(),
            "padded_rows_fraction": padding_slots / slots if slots else None}


def _router_stats_over_stages(router: dict[str, Any], steps: int, n_moe: int, device: torch.device,
                              pp_group: dist.ProcessGroup) -> dict[str, Any]:
    """Under a pipeline a rank's routers are only its stages' layers: combine the stages
    (lb and z losses: mean over every MoE layer; load: max over layers; drops: sum). The
    trainer already reduced each stage's statistics over its data-parallel replicas."""
    lb, z = router["lb_loss"] or 0.0, router["z_loss"] or 0.0
    sums = torch.tensor([n_moe * lb, n_moe * z, n_moe, router["dropped_tokens"]], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=pp_group)
    load = torch.tensor(router["expert_load_max_over_mean"] or [0.0] * steps, dtype=torch.float64, device=device)
    dist.all_reduce(load, op=dist.ReduceOp.MAX, group=pp_group)
    lb_sum, z_sum, layers, dropped = sums.tolist()
    if not layers:
        return router
    return {"lb_loss": lb_sum / layers, "z_loss": z_sum / layers, "expert_load_max_over_mean": load.tolist(),
            "dropped_tokens": int(dropped)}


def communication(window: WindowSamples, warmed: int) -> Communication:
    """Bytes per optimizer step and axis over the timed steps (the window's steps after the
    ``warmed`` warm-up ones), split into bytes that carried rows and padding (the row-wise
    dispatcher's empty slots); the padding is read from the device once, here."""
    total = _mean_comm(window.comm[warmed:])
    pad = _mean_comm([{axis: float(v) for axis, v in step.items()} for step in window.padding[warmed:]])
    return Communication(comm_bytes_per_step=total,
                         comm_bytes_valid={axis: nbytes - pad.get(axis, 0.0) for axis, nbytes in total.items()},
                         comm_bytes_padding={axis: pad.get(axis, 0.0) for axis in total})


def _mean_comm(steps: list[dict[str, float]]) -> dict[str, float]:
    """Mean bytes per optimizer step and axis over ``steps``."""
    axes = sorted({axis for step in steps for axis in step})
    return {axis: sum(step.get(axis, 0.0) for step in steps) / len(steps) for axis in axes}
