"""One training run from a resolved config to a run record (see :mod:`moebench.record`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moebench.config import Config, TrainConfig
from moebench.errors import ConfigError
from moebench.kernels.expert_backends import check_backend
from moebench.kernels.quantized import expert_gemms_that_run, precision_impl, probe_error
from moebench.layout import validate_layout
from moebench.metrics.environment import run_environment
from moebench.metrics.flops import reference_flops
from moebench.metrics.host_syncs import CountHostSyncs
from moebench.metrics.memory import allocation_failure, available_host_bytes, memory_fields, reset_peaks
from moebench.metrics.nvml import NvmlSampler, device_totals
from moebench.metrics.operands import operand_stats
from moebench.metrics.trace import tracing
from moebench.model.compile import compile_blocks
from moebench.model.precision import apply_precision
from moebench.model.transformer import build_model
from moebench.parallel.comm import COUNTER, count_collectives
from moebench.parallel.parallelize import parallelize
from moebench.parallel.strategy import Strategy
from moebench.precision_modes import QUANT_MODES
from moebench.record import METRICS, Header, fields_of, format_bytes, format_count, format_flop_rate, settled_status
from moebench.run_record import Measured, Memory, Nvml, Probes, Reference, RunRecord, Setup, Throughput
from moebench.train.distributed import adopt_launch_env, init_process_group, rank_nodes
from moebench.train.measure import communication, over_ranks, rank_figures
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
    quantized = {"precision.mode"} if precision in QUANT_MODES else set()
    check_backend(cfg.moe.backend, device.type, precision, cfg.moe.features() | quantized)
    if cfg.precision.param_dtype != "fp32":
        raise ConfigError(f"precision.param_dtype={cfg.precision.param_dtype} is planned only (moebench plan): "
                          "the trainer keeps fp32 parameters under autocast (docs/plan.md, Memory)")


def compute_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def run_training(cfg: Config, log: Callable[[str], None] | None = None,
                 on_finish: Callable[[Trainer, Any], None] | None = None) -> dict[str, Any]:
    """Build, train and measure; return the run record (status ``ok``, ``diverged`` or ``oom``).

    ``on_finish(trainer, dims)`` runs on every rank after the last step, before the
    process group is torn down (tests use it to collect the final weights).
    """
    started = time.perf_counter()
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    dims = None
    if adopt_launch_env():
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
        if dims is not None:
            # every rank leaves its last collective before any rank tears the groups down
            # (tearing down under a peer's pending gloo work can abort the process)
            dist.barrier()
        return record.to_dict()
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
         started_at: str, on_finish) -> RunRecord:
    precision = cfg.precision.resolved_mode(on_gpu=device.type == "cuda")
    check_device_support(cfg, device, precision)
    if device.type == "cpu" and cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)  # before anything computes: the record reads it back
    torch.manual_seed(cfg.train.seed)
    reset_peaks(device)
    setup = _setup(cfg, device, precision, started_at, rank0=dims is None or dims.rank == 0)
    if cfg.precision.require_native and setup.precision_impl == "emulated" and precision in QUANT_MODES:
        raise ConfigError(f"precision.require_native=true, but precision.mode={precision} runs emulated on "
                          f"{device}: {setup.precision_probe_error}")
    counting = count_collectives(dims.axis_of) if dims is not None else contextlib.nullcontext(COUNTER)
    short = _host_memory_short(cfg, device, dims)
    if short is not None:
        return _out_of_memory(setup, short, device, started)
    try:
        with counting as counter:
            strategy = build_strategy(cfg, device, dims, precision)
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
            if trainer.timer.instructions is not None:
                trainer.timer.instructions.finish()
            step = window.steps
            sampler.window_end()
            reference.append(_reference_flops(device, dims))
            mine = rank_figures(cfg, trainer, strategy, device, reference)  # before profiling: its peaks are the run's
            for clock in trainer.step_clocks:  # read the timed steps' stamps (on CUDA: their events)
                clock.resolve()
            profiled, trace_files = _profiled_steps(cfg, trainer, step, device, dims)
            # memory by part: one more step under saved-tensor hooks, after the timed and profiled ones
            # host syncs: counted in that same step (Python-level calls that wait on the device)
            with CountHostSyncs() as syncs:
                memory_parts = trainer.memory_step(step + profiled)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        why = allocation_failure(exc)
        if why is None:
            raise
        return _out_of_memory(setup, why, device, started)
    sampled = sampler.stop()
    comm = communication(window, len(mine.warmup_step_times_s))
    # reduce first, then build
    run = over_ranks(mine, trainer.step_clocks, strategy, device, len(trainer.moe_blocks), profiled)
    if on_finish is not None:
        on_finish(trainer, dims)
    wall_time_s = time.perf_counter() - started
    # which node ran which ranks, and each node's GPUs: multi-node runs are checked by it; the
    # record's NVML figures cover every rank's GPU
    nodes = rank_nodes(sampled["nvml_devices"])
    totals = device_totals([gpu for node in nodes for gpu in node["nvml_devices"] or []])
    throughput = Throughput.derive(setup, run.steps, run.training, mine.peak, cfg.expert_params())
    probes = Probes(optimizer_state_bytes_per_rank=mine.optimizer_state_bytes, memory_parts_bytes=memory_parts,
                    host_syncs_per_step=None if cfg.train.compile else syncs.total,
                    host_syncs_by_site=None if cfg.train.compile else dict(syncs.by_site), trace_files=trace_files,
                    work_per_step=trainer.work, operand_stats=operand_stats(trainer.model))
    measured = Measured(steps=run.steps, throughput=throughput, peak=mine.peak,
                        reference=Reference.derive(*run.reference_flops, throughput.tokens_per_s),
                        training=run.training, communication=comm, breakdown=run.breakdown, probes=probes,
                        nvml=Nvml.derive(sampled, totals, setup, run.steps))
    status, error = settled_status("ok", fields_of(run.training))
    return RunRecord(setup, status, error, run.memory, measured, wall_time_s, nodes)


def build_strategy(cfg: Config, device: torch.device, dims, precision: str) -> Strategy:
    """The model built in its precision (compiled with ``train.compile``) and laid out over the ranks;
    the strategy holds what this rank trains (e.g. only its pipeline stages), the model is not kept."""
    model = build_model(cfg, device)
    apply_precision(model, precision, cfg.precision.mxfp8_rounding, cfg.precision.scope,
                    cfg.precision.saved_activations)
    if cfg.train.compile:  # before parallelize: its wrappers and hooks stay outside the compiled blocks
        compile_blocks(model)
    if dims is not None:
        return parallelize(model, cfg, dims, device, bf16=compute_dtype(precision) == torch.bfloat16)
    return Strategy(model)


def _profiled_steps(cfg: Config, trainer: Trainer, step: int, device: torch.device,
                    dims) -> tuple[int, list[str] | None]:
    """The profiled steps after the timed window, from ``step`` on, traced: how many ran, and every
    rank's trace file (None when not ``train.trace``)."""
    # the trace: extra steps under a profiling clock, kept out of the timed samples (untraced
    # runs skip them: where the time goes is taken inside the timed steps)
    profiled = cfg.train.profile_steps if cfg.train.trace else 0
    rank, world = (dims.rank, dims.world_size) if dims is not None else (0, 1)
    if dims is not None:
        # the ranks leave the timed window's measurements together before any trace starts, so that a
        # slower rank's measurements are not traced as the others' wait in the barrier below
        dist.barrier()
    with tracing(cfg.train.trace, device, rank, world) as trace_files:  # the profiled steps only
        if dims is not None:
            # every rank starts the profiled steps together: a rank still starting its profiler
            # would show as the others' first collective or pipeline bubble
            dist.barrier()
        for i in range(profiled):
            trainer.profile_step(step + i)
    return profiled, trace_files


def _out_of_memory(setup: Setup, why: str, device: torch.device, started: float) -> RunRecord:
    """The record of a run that could not allocate what it needed: its setup, this rank's memory peaks."""
    memory = Memory(**memory_fields(device))
    wall_time_s = time.perf_counter() - started
    return RunRecord(setup, "oom", why, memory, None, wall_time_s, rank_nodes(None))


def _reference_flops(device: torch.device, dims) -> float:
    """The reference GEMM's FLOP/s on this rank; under several ranks they leave it together, so the
    first timed step of none waits in a collective for a rank still timing it."""
    flops = reference_flops(device)
    if dims is not None:
        dist.barrier()
    return flops


def step_counter(step: int, warmed: int, train: TrainConfig) -> str:
    """``warmup    1/2`` or ``step    4/12`` for step ``step`` (0-based, warm-up included) of a run that has
    taken ``warmed`` warm-up steps so far: warm-up and timed steps are counted apart, so no denominator
    moves while the run goes on. An adaptive warm-up (``train.max_warmup_steps``) is counted against its cap,
    ``warmup    7/≤50``: it ends when the step time settles, at the latest there."""
    if step < warmed:
        cap = f"≤{train.max_warmup_steps}" if train.max_warmup_steps > train.warmup_steps else train.warmup_steps
        return f"warmup {step + 1:4d}/{cap}"
    return f"step {step + 1 - warmed:4d}/{train.timed_steps}"


def _log_step(cfg: Config, trainer: Trainer, step: int, world_size: int, log: Callable[[str], None] | None) -> None:
    """Rank 0's line for one step: to stderr step by step, or (a sweep follows the point in its
    log) about ten lines a run."""
    timer = trainer.timer
    last = (timer.samples or timer.warmup_samples)[-1]
    line = (f"{step_counter(step, len(timer.warmup_samples), cfg.train)}  loss {trainer.log.losses[-1].item():.4f}  "
            f"{last:.3f}s  {cfg.tokens_per_step / last / world_size:,.0f} {_PER_DEVICE}")
    if log is None:  # --json keeps stdout for the record
        print(line, file=sys.stderr, flush=True)
    elif step == 0 or (step + 1) % max(1, cfg.train.steps // 10) == 0:
        log(line)


def _setup(cfg: Config, device: torch.device, precision: str, started_at: str, rank0: bool) -> Setup:
    """What the run is before its first step: the header, its settings, what computes its GEMMs.
    ``rank0``: this rank's record is the one kept, and so the one that asks the node's GPUs for their facts."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    impl = precision_impl(precision, device, cfg.precision.scope)  # native | emulated
    return Setup(header=Header.of(cfg, device.type, name, precision), started_at=started_at,
                 warmup_steps=cfg.train.warmup_steps, max_warmup_steps=cfg.train.max_warmup_steps,
                 compiled=cfg.train.compile, **cfg.cost_summary(), precision_impl=impl,
                 precision_probe_error=probe_error(precision, device, cfg.precision.scope),
                 moe_backend=expert_gemms_that_run(cfg.moe.resolved_backend(device.type), device.type, precision,
                                                   impl),
                 # what decides whether two runs are comparable: settings, versions, topology
                 **run_environment(gpus=rank0))


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
