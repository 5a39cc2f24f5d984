"""One training run from a resolved config to a run record (see :mod:`moebench.record`)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import torch

from moebench.config import Config
from moebench.kernels.quantized import apply_expert_precision, precision_impl
from moebench.metrics.flops import device_peak, throughput
from moebench.metrics.memory import memory_fields, reset_peaks
from moebench.model.transformer import build_model
from moebench.record import SCHEMA_VERSION
from moebench.train.trainer import Strategy, Trainer


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            from moebench.errors import ConfigError

            raise ConfigError("train.device=cuda but no CUDA device is available; use cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_precision(cfg: Config, device: torch.device) -> str:
    mode = cfg.precision.mode
    if mode == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return mode


def compute_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def run_training(cfg: Config, log: Callable[[str], None] | None = None,
                 strategy_factory: Callable[[torch.nn.Module], Strategy] | None = None) -> dict[str, Any]:
    """Build, train and measure; return the run record (status ``ok`` or ``oom``)."""
    started = time.perf_counter()
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    torch.manual_seed(cfg.train.seed)
    reset_peaks(device)
    base = _base_record(cfg, device, precision, started_at)
    base["precision_impl"] = precision_impl(precision, device)  # native | emulated (quantized experts)
    try:
        model = build_model(cfg, device)
        apply_expert_precision(model, precision, cfg.precision.mxfp8_rounding)
        strategy = (strategy_factory or Strategy)(model)
        trainer = Trainer(cfg, model, strategy, device, compute_dtype(precision))
        for step in range(cfg.train.steps):
            trainer.train_step(step)
            if log is not None and (step == 0 or (step + 1) % max(1, cfg.train.steps // 10) == 0):
                log(f"step {step + 1:4d}/{cfg.train.steps}  loss {trainer.log.losses[-1].item():.4f}  "
                    f"{trainer.timer.samples[-1] if trainer.timer.samples else trainer.timer.warmup_samples[-1]:.3f}s")
    except torch.OutOfMemoryError as exc:
        return {**base, "status": "oom", "error": str(exc).splitlines()[0], **memory_fields(device),
                "wall_time_s": time.perf_counter() - started}
    record = {**base, **_measurements(cfg, trainer, strategy, device)}
    record["wall_time_s"] = time.perf_counter() - started
    return record


def _base_record(cfg: Config, device: torch.device, precision: str, started_at: str) -> dict[str, Any]:
    p = cfg.parallel
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "ok",
        "error": None,
        "preset": cfg.preset,
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "world_size": p.world_size,
        "layout": {"strategy": p.strategy, "dp": p.dp, "ep": p.ep, "pp": p.pp,
                   "dispatcher": p.dispatcher, "dist_opt": p.dist_opt},
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "tokens_per_step": cfg.tokens_per_step,
        "warmup_steps": cfg.train.warmup_steps,
        "started_at": started_at,
        **cfg.cost_summary(),
    }


def _measurements(cfg: Config, trainer: Trainer, strategy: Strategy, device: torch.device) -> dict[str, Any]:
    log = trainer.log
    losses = torch.stack(log.losses).tolist()
    peak, peak_source = device_peak(device)
    median = trainer.timer.median
    fields: dict[str, Any] = {
        "timed_steps": len(trainer.timer.samples),
        "step_times_s": trainer.timer.samples,
        "warmup_step_times_s": trainer.timer.warmup_samples,
        "step_time_median_s": median,
        **throughput(cfg.tokens_per_step, median, strategy.world_size, cfg.flops_per_token(), peak),
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        **memory_fields(device),
        "comm_bytes_per_step": strategy.comm_bytes_per_step(),
        "optimizer_state_bytes_per_rank": strategy.optimizer_state_bytes(trainer.optimizer),
    }
    if log.lb:
        warmup = cfg.train.warmup_steps
        fields.update({
            "lb_loss": log.lb[-1].item(),
            "z_loss": log.z[-1].item(),
            "expert_load_max_over_mean": torch.stack(log.load_imbalance).tolist(),
            "dropped_tokens": int(torch.stack(log.dropped[warmup:]).sum().item()),
        })
    else:
        fields.update({"lb_loss": None, "z_loss": None, "expert_load_max_over_mean": [], "dropped_tokens": 0})
    return fields


def summary_lines(record: dict[str, Any]) -> list[str]:
    """A short human-readable summary of a run record."""
    if record["status"] != "ok":
        return [f"status: {record['status']}: {record.get('error')}"]
    mfu = f"{record['mfu'] * 100:.1f}%" if record["mfu"] is not None else "n/a"
    return [
        f"preset {record['preset']}  device {record['device_name']}  precision {record['precision']}  "
        f"world {record['world_size']}",
        f"params   total {record['total_params'] / 1e6:.2f}M  active {record['active_params'] / 1e6:.2f}M  "
        f"FLOPs/token {record['flops_per_token'] / 1e6:.2f}M",
        f"loss     {record['loss_first']:.4f} -> {record['loss_last']:.4f}",
        f"speed    {record['tokens_per_s']:.0f} tokens/s ({record['tokens_per_s_per_device']:.0f} per device), "
        f"median step {record['step_time_median_s'] * 1e3:.1f} ms over {record['timed_steps']} steps",
        f"compute  {record['tflops_per_device']:.3f} TFLOP/s per device, MFU {mfu} ({record['peak_flops_source']})",
        f"memory   peak {record['peak_mem_bytes'] / 2**20:.0f} MiB",
    ]
