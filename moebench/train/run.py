"""One training run from a resolved config to a run record (see :mod:`moebench.record`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moebench.config import Config
from moebench.errors import ConfigError
from moebench.kernels.expert_backends import check_backend
from moebench.kernels.quantized import QUANT_MODES, expert_gemms_that_run, precision_impl, probe_error
from moebench.layout import validate_layout
from moebench.metrics.flops import device_peak, reference_flops
from moebench.metrics.host_syncs import CountHostSyncs
from moebench.metrics.memory import allocation_failure, available_host_bytes, memory_fields, reset_peaks
from moebench.metrics.nvml import NvmlSampler, device_totals
from moebench.metrics.steady import window_drift
from moebench.metrics.trace import tracing
from moebench.model.compile import compile_blocks
from moebench.model.precision import apply_precision
from moebench.model.route_keys import CHECKSUM_MODULUS
from moebench.model.transformer import build_model
from moebench.parallel.comm import COUNTER, count_collectives
from moebench.parallel.parallelize import parallelize
from moebench.parallel.strategy import Strategy
from moebench.record import (
    METRICS,
    derived_metrics,
    divergence,
    format_bytes,
    format_count,
    format_flop_rate,
    record_header,
    window_drifting,
)
from moebench.train.breakdown import time_breakdown
from moebench.train.distributed import distributed_env, init_process_group, rank_nodes
from moebench.train.trainer import Trainer

_PER_DEVICE = METRICS["tokens_per_s_per_device"].header  # the step lines' rate, named as everywhere else


def _device_type(cfg: Config) -> str:
    """``cpu`` or ``cuda`` (``auto``: cuda when available); a clear error when cuda is absent."""
    want = cfg.train.device
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use cpu or auto")
    return want


def resolve_device(cfg: Config) -> torch.device:
    if _device_type(cfg) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device_support(cfg: Config, device: torch.device, precision: str) -> None:
    """Combinations torch cannot run, refused up front with what would work (the expert backends'
    rules live beside them: :func:`moebench.kernels.expert_backends.check_backend`)."""
    check_backend(cfg.moe.backend, device.type, precision, cfg.moe.swiglu_limit)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def run_training(cfg: Config, log: Callable[[str], None] | None = None,
                 on_finish: Callable[[Trainer, Any], None] | None = None) -> dict[str, Any]:
    """Build, train and measure; return the run record (status ``ok`` or ``oom``).

    ``on_finish(trainer, dims)`` runs on every rank after the last step, before the
    process group is torn down (tests use it to collect the final weights).
    """
    started = time.perf_counter()
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    dims = None
    if distributed_env():
        from moebench.parallel.mesh import build_dims

        validate_layout(cfg, int(os.environ["WORLD_SIZE"]))
        # not resolve_device(): this rank's GPU is chosen (LOCAL_RANK) by init_process_group
        device = init_process_group(_device_type(cfg))
        dims = build_dims(cfg, device)
    else:
        if cfg.parallel.world_size > 1:
            raise ConfigError(f"the layout needs {cfg.parallel.world_size} ranks (dp x pp); launch with "
                              f"--nproc {cfg.parallel.world_size}, torchrun or srun")
        validate_layout(cfg, 1)  # e.g. ep=2 on one process would train unsharded under an EP label
        device = resolve_device(cfg)
    try:
        record = _run(cfg, device, dims, log if (dims is None or dims.rank == 0) else None,
                      started, started_at, on_finish)
        # which node ran which ranks, and each node's GPUs: multi-node runs are checked by it
        record["nodes"] = rank_nodes(record.get("nvml_devices"))
        if "nvml_devices" in record:  # the record's NVML figures cover every rank's GPU
            record.update(device_totals([gpu for node in record["nodes"] for gpu in node["nvml_devices"] or []]))
            record["tokens_per_joule"] = tokens_per_joule(record)
        if dims is not None:
            # every rank leaves its last collective before any rank tears the groups down
            # (tearing down under a peer's pending gloo work can abort the process)
            dist.barrier()
        return record
    finally:
        if dims is not None:
            dist.destroy_process_group()


def _host_memory_short(cfg: Config, device: torch.device, dims) -> str | None:
    """Why a one-process CPU run cannot fit before it starts: its fp32 weights, gradients and two
    AdamW moments (16 bytes a parameter, activations not counted) beyond the memory available.
    Allocating them anyway ends in the kernel's OOM killer (lazily touched pages) on a shared host."""
    if device.type != "cpu" or dims is not None:
        return None
    available, needed = available_host_bytes(), 16 * cfg.total_params()
    if available is None or needed <= available:
        return None
    return (f"weights, gradients and AdamW moments of {cfg.total_params():,} parameters need at least "
            f"{needed / 2**30:,.1f} GiB; this machine has {available / 2**30:,.1f} GiB available")


def _run(cfg: Config, device: torch.device, dims, log, started: float,
         started_at: str, on_finish) -> dict[str, Any]:
    precision = cfg.precision.resolved_mode(on_gpu=device.type == "cuda")
    check_device_support(cfg, device, precision)
    torch.manual_seed(cfg.train.seed)
    reset_peaks(device)
    base = _base_record(cfg, device, precision, started_at)
    base["precision_impl"] = impl = precision_impl(precision, device, cfg.precision.scope)  # native | emulated
    base["precision_probe_error"] = probe_error(precision, device, cfg.precision.scope)
    base["moe_backend"] = expert_gemms_that_run(cfg.moe.resolved_backend(device.type), device.type, precision, impl)
    if cfg.precision.require_native and impl == "emulated" and precision in QUANT_MODES:
        raise ConfigError(f"precision.require_native=true, but precision.mode={precision} runs emulated on "
                          f"{device}: {base['precision_probe_error']}")
    counting = count_collectives(dims.axis_of) if dims is not None else contextlib.nullcontext(COUNTER)
    short = _host_memory_short(cfg, device, dims)
    if short is not None:
        return {**base, "status": "oom", "error": short, **memory_fields(device),
                "wall_time_s": time.perf_counter() - started}
    try:
        with counting as counter:
            model = build_model(cfg, device)
            apply_precision(model, precision, cfg.precision.mxfp8_rounding, cfg.precision.scope,
                            cfg.precision.saved_activations)
            if cfg.train.compile:  # before parallelize: its wrappers and hooks stay outside the compiled blocks
                compile_blocks(model)
            if dims is not None:
                strategy = parallelize(model, cfg, dims, device, bf16=compute_dtype(precision) == torch.bfloat16)
            else:
                strategy = Strategy(model)
            del model  # the strategy holds what this rank trains (e.g. only its pipeline stages)
            trainer = Trainer(cfg, strategy, device, compute_dtype(precision))
            sampler = NvmlSampler.for_torch_device(device).start()  # all-null fields on CPU
            reference: list[float] = []  # the machine's speed just before and just after the timed window

            def window_start() -> None:
                reference.append(_reference_flops(device, dims))
                sampler.window_start()

            def after_step(step: int) -> None:
                if dims is None or dims.rank == 0:
                    _log_step(cfg, trainer, step, strategy.world_size, log)

            window = trainer.run_window(counter, window_start, after_step)
            step = window.steps
            sampler.window_end()
            reference.append(_reference_flops(device, dims))
            measured = _measurements(cfg, trainer, strategy, device)  # before profiling: its peaks are the run's
            # where the time goes: extra steps under a phase clock, kept out of the timed samples
            rank, world = (dims.rank, dims.world_size) if dims is not None else (0, 1)
            with tracing(cfg.train.trace, device, rank, world) as trace_files:  # the profiled steps only
                if dims is not None:
                    # every rank starts the profiled steps together: a rank still in the measurements
                    # above would show as the others' first collective or pipeline bubble
                    dist.barrier()
                clocks = [trainer.profile_step(step + i) for i in range(cfg.train.profile_steps)]
            # memory by part: one more step under saved-tensor hooks, after the timed and profiled ones
            # host syncs: counted in that same step (Python-level calls that wait on the device)
            with CountHostSyncs() as syncs:
                memory_parts = trainer.memory_step(step + cfg.train.profile_steps)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        why = allocation_failure(exc)
        if why is None:
            raise
        return {**base, "status": "oom", "error": why, **memory_fields(device),
                "wall_time_s": time.perf_counter() - started}
    record = {**base, **measured, **sampler.stop(), "memory_parts_bytes": memory_parts, "trace_files": trace_files,
              "host_syncs_per_step": None if cfg.train.compile else syncs.total,
              "host_syncs_by_site": None if cfg.train.compile else dict(syncs.by_site)}
    record["reference_flops_before"], record["reference_flops_after"] = reference
    warmed = len(trainer.timer.warmup_samples)  # the warm-up steps this run took (fixed or until steady)
    record["comm_bytes_per_step"] = _mean_comm(window.comm[warmed:])
    record.update(_valid_and_padding(record["comm_bytes_per_step"], window.padding[warmed:]))
    own_median = record["step_time_median_s"]  # this rank's, before the slowest rank's replaces it
    if dims is not None:
        _reduce_over_ranks(record, device)
        if dims.pp > 1:
            _router_stats_over_stages(record, len(trainer.moe_blocks), device, dims.groups["pp"])
    record.update(useful_throughput(record, cfg))
    record.update(_normalised(record))
    record["window_drift"] = window_drift(record["step_times_s"])  # the slowest rank's steps
    record["window_drifting"] = window_drifting(record["window_drift"])
    record.update(time_breakdown(clocks, record["step_time_median_s"], device, distributed=dims is not None,
                                 own_step_time_median_s=own_median))
    if on_finish is not None:
        on_finish(trainer, dims)
    record["wall_time_s"] = time.perf_counter() - started
    diverged = divergence(record)
    if diverged is not None:
        record.update(status="diverged", error=diverged)
    return record


def _reference_flops(device: torch.device, dims) -> float:
    """The reference GEMM's FLOP/s on this rank; under several ranks they leave it together, so the
    first timed step of none waits in a collective for a rank still timing it."""
    flops = reference_flops(device)
    if dims is not None:
        dist.barrier()
    return flops


def _normalised(record: dict[str, Any]) -> dict[str, Any]:
    """Throughput per unit of measured machine speed: tokens/s over the reference GEMM's GFLOP/s
    (mean of before and after the timed window), and how much the machine's speed moved across the window."""
    before, after = record["reference_flops_before"], record["reference_flops_after"]
    return {"tokens_per_reference_gflop": record["tokens_per_s"] / ((before + after) / 2 / 1e9),
            "reference_drift": after / before}


def _log_step(cfg: Config, trainer: Trainer, step: int, world_size: int, log: Callable[[str], None] | None) -> None:
    """Rank 0's line for one step: to stderr step by step, or (a sweep follows the point in its
    log) about ten lines a run. The step count grows while an adaptive warm-up goes on."""
    timer = trainer.timer
    last = (timer.samples or timer.warmup_samples)[-1]
    planned = len(timer.warmup_samples) + cfg.train.timed_steps + (1 if timer.warming else 0)
    line = (f"step {step + 1:4d}/{planned}  loss {trainer.log.losses[-1].item():.4f}  "
            f"{last:.3f}s  {cfg.tokens_per_step / last / world_size:,.0f} {_PER_DEVICE}")
    if log is None:  # --json keeps stdout for the record
        print(line, file=sys.stderr, flush=True)
    elif step == 0 or (step + 1) % max(1, cfg.train.steps // 10) == 0:
        log(line)


def tokens_per_joule(record: dict[str, Any]) -> float | None:
    """Tokens the sampled GPUs processed in the timed window per joule NVML measured on them (the
    energy counters cover the same window, summed over ``nvml_devices``: every rank's GPU); None
    where there is no energy reading."""
    energy = record.get("nvml_energy_j")
    if not energy:
        return None
    gpus = len(record["nvml_devices"])
    return record["tokens_per_step"] / record["world_size"] * gpus * record["timed_steps"] / energy


def _mean_comm(steps: list[dict[str, float]]) -> dict[str, float]:
    """Mean bytes per optimizer step and axis over the timed steps."""
    axes = sorted({axis for step in steps for axis in step})
    return {axis: sum(step.get(axis, 0.0) for step in steps) / len(steps) for axis in axes}


def _valid_and_padding(total: dict[str, float], padding: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``comm_bytes_per_step`` split into bytes that carried rows and padding (the row-wise
    dispatcher's empty slots), per axis; read from the device once, after the timed steps."""
    pad = _mean_comm([{axis: float(v) for axis, v in step.items()} for step in padding])
    return {"comm_bytes_valid": {axis: nbytes - pad.get(axis, 0.0) for axis, nbytes in total.items()},
            "comm_bytes_padding": {axis: pad.get(axis, 0.0) for axis in total}}


def _dispatch_fields(cfg: Config, log: Any, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Row-wise EP statistics over every rank (None under other dispatchers): rank load per step
    (max over MoE layers and EP groups), capacity use (max over the timed steps) and the padding
    share of the all-to-all's slots (timed steps). Every rank joins the reductions, also a
    pipeline stage without MoE layers (zeros). ``warmup`` and ``steps``: the warm-up steps this run
    took (fixed or until steady, the same on every rank) and all the steps it ran."""
    p = cfg.parallel
    if p.dispatcher != "rowwise" or p.ep == 1:
        return {"ep_rank_load_max_over_mean": None, "capacity_util_max": None, "padded_rows_fraction": None}
    t_S4 = (torch.stack(log.dispatch) if log.dispatch
            else torch.zeros(steps, 4, dtype=torch.float64, device=device))
    maxes = torch.cat([t_S4[:, 0], t_S4[warmup:, 1].max().reshape(1)])
    sums = t_S4[warmup:, 2:].sum(0)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums)
    padding_slots, slots = sums.tolist()
    return {"ep_rank_load_max_over_mean": maxes[:-1].tolist(), "capacity_util_max": maxes[-1].item(),
            "padded_rows_fraction": padding_slots / slots if slots else None}


def _reduce_over_ranks(record: dict[str, Any], device: torch.device) -> None:
    """A step lasts as long as its slowest rank; the memory peak is the largest rank's."""
    times = torch.tensor(record["step_times_s"], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    mem = torch.tensor([record["peak_mem_bytes"], record["peak_rss_bytes"]], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    record["step_times_s"] = times.tolist()
    record["peak_mem_bytes"], record["peak_rss_bytes"] = (int(v) for v in mem.tolist())
    # every rank timed the reference GEMM at once (sharing the machine, as its steps do): their mean
    # and each rank computed its own experts' padding rows: the step's is their sum (one reduction for both)
    sums = torch.tensor([record["reference_flops_before"], record["reference_flops_after"],
                         record["padding_flops_per_step"]], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    world = dist.get_world_size()
    before, after, record["padding_flops_per_step"] = sums.tolist()
    record["reference_flops_before"], record["reference_flops_after"] = before / world, after / world
    median = statistics.median(record["step_times_s"])
    record["step_time_median_s"] = median
    record.update(derived_metrics(record["tokens_per_step"], median, record["world_size"], record["flops_per_token"],
                             record["peak_flops"]))


def useful_throughput(record: dict[str, Any], cfg: Config) -> dict[str, float | None]:
    """FLOPs the step computed for kept routes only: the config's FLOPs per token times the
    tokens, less ``6 * expert params`` (forward + backward) for every route dropped over capacity
    (``dropped_tokens`` per timed step); the TFLOP/s and MFU those give at the median step time.
    ``tflops_per_device`` / ``mfu`` keep counting every route, as the cost model does."""
    dropped_per_step = record["dropped_tokens"] / record["timed_steps"]
    useful = cfg.flops_per_token() * record["tokens_per_step"] - dropped_per_step * 6 * cfg.expert_params()
    per_device = useful / record["step_time_median_s"] / record["world_size"]
    return {"useful_flops_per_step": useful, "useful_tflops_per_device": per_device / 1e12,
            "useful_mfu": per_device / record["peak_flops"] if record["peak_flops"] else None}


def _router_stats_over_stages(record: dict[str, Any], n_moe: int, device: torch.device,
                              pp_group: dist.ProcessGroup) -> None:
    """Under a pipeline a rank's routers are only its stages' layers: combine the stages
    (lb and z losses: mean over every MoE layer; load: max over layers; drops: sum). The
    trainer already reduced each stage's statistics over its data-parallel replicas."""
    steps = len(record["losses"])
    lb, z = record["lb_loss"] or 0.0, record["z_loss"] or 0.0
    sums = torch.tensor([n_moe * lb, n_moe * z, n_moe, record["dropped_tokens"]], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=pp_group)
    load = torch.tensor(record["expert_load_max_over_mean"] or [0.0] * steps, dtype=torch.float64, device=device)
    dist.all_reduce(load, op=dist.ReduceOp.MAX, group=pp_group)
    lb_sum, z_sum, layers, dropped = sums.tolist()
    if layers:
        record.update({"lb_loss": lb_sum / layers, "z_loss": z_sum / layers, "expert_load_max_over_mean": load.tolist(),
                       "dropped_tokens": int(dropped)})


def _base_record(cfg: Config, device: torch.device, precision: str, started_at: str) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        **record_header(cfg, "ok", device.type, name, precision),
        "warmup_steps": cfg.train.warmup_steps,
        "max_warmup_steps": cfg.train.max_warmup_steps,
        "started_at": started_at,
        "compiled": cfg.train.compile,
        **cfg.cost_summary(),
    }


def _measurements(cfg: Config, trainer: Trainer, strategy: Strategy, device: torch.device) -> dict[str, Any]:
    log = trainer.log
    losses = torch.stack(log.losses).tolist()
    peak = device_peak(device)
    median = trainer.timer.median
    fields: dict[str, Any] = {
        "timed_steps": len(trainer.timer.samples),
        "warmup_steps_used": len(trainer.timer.warmup_samples),
        "step_times_s": trainer.timer.samples,
        "warmup_step_times_s": trainer.timer.warmup_samples,
        "compile_s": trainer.timer.warmup_excess_s if cfg.train.compile else None,
        "step_time_median_s": median,
        **derived_metrics(cfg.tokens_per_step, median, strategy.world_size, cfg.flops_per_token(), peak.flops),
        "peak_flops": peak.flops,
        "peak_flops_dtype": peak.dtype,
        "peak_flops_source": peak.source,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        **memory_fields(device),
        "optimizer_state_bytes_per_rank": strategy.optimizer_state_bytes(trainer.optimizer),
    }
    if log.lb:
        warmup = len(trainer.timer.warmup_samples)
        fields.update({
            "lb_loss": log.lb[-1].item(),
            "z_loss": log.z[-1].item(),
            "expert_load_max_over_mean": torch.stack(log.load_imbalance).tolist(),
            "dropped_tokens": int(torch.stack(log.dropped[warmup:]).sum().item()),
            # this rank's; summed over the ranks in _reduce_over_ranks
            "padding_flops_per_step": torch.stack(log.padding_flops[warmup:]).mean().item(),
        })
    else:
        fields.update({"lb_loss": None, "z_loss": None, "expert_load_max_over_mean": [], "dropped_tokens": 0,
                       "padding_flops_per_step": 0.0})
    fields["routing_checksum"] = _routing_checksum(cfg, trainer, strategy)
    fields.update(_dispatch_fields(cfg, log, device, len(trainer.timer.warmup_samples),
                                   len(trainer.timer.warmup_samples) + len(trainer.timer.samples)))
    return fields


def _routing_checksum(cfg: Config, trainer: Trainer, strategy: Strategy) -> int | None:
    """The routes of the timed steps, every MoE layer and data-parallel rank, as one checksum
    (:func:`moebench.model.route_keys.route_checksum`): each route is counted once, by the rank that
    routed its token, so any layout on the same global batch gives the same value. None without MoE
    layers or under a pipeline (a stage holds only some layers, and routes its micro-batches in
    the schedule's order)."""
    timed = trainer.log.routing_checksum[len(trainer.timer.warmup_samples):]
    if not timed or cfg.parallel.pp > 1:
        return None
    total = torch.stack(timed).sum() % CHECKSUM_MODULUS
    return int(strategy.all_reduce_sum(total.reshape(1)).remainder(CHECKSUM_MODULUS).item())


def summary_lines(record: dict[str, Any]) -> list[str]:
    """A short human-readable summary of a run record, its numbers formatted as ``moebench plan``
    and the report format them (:mod:`moebench.record`: ``255 K`` params, ``2,670 tokens/s``)."""
    if record["status"] != "ok":
        return [f"status: {record['status']}: {record.get('error')}"]
    mfu = f"{record['mfu'] * 100:.1f}%" if record["mfu"] is not None else "n/a"
    if record.get("mfu_above_peak"):
        mfu += " (above the peak: its calibration was noisy or slowed)"
    why = record.get("precision_probe_error")
    return [
        f"preset {record['preset']}  device {record['device_name']}  precision {record['precision']} "
        f"({record['precision_impl']})  experts {record['moe_backend']}  world {record['world_size']}",
        *([f"emulated {why}"] if why else []),  # an emulated format's speed is not the format's: say why
        f"params   total {format_count(record['total_params'])}  active {format_count(record['active_params'])}  "
        f"FLOPs/token {format_count(record['flops_per_token'])}",
        f"loss     {record['loss_first']:.4f} -> {record['loss_last']:.4f}",
        f"speed    {record['tokens_per_s']:,.0f} tokens/s ({record['tokens_per_s_per_device']:,.0f} per device), "
        f"median step {record['step_time_median_s'] * 1e3:,.1f} ms over {record['timed_steps']} steps",
        f"compute  {format_flop_rate(record['tflops_per_device'] * 1e12)} per device, MFU {mfu} "
        f"({record['peak_flops_source']})",
        f"memory   peak {format_bytes(record['peak_mem_bytes'])}",
    ]
