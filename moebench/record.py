"""The run record: what one training run reports. Trainer writes it; everything
downstream (results store, reports, regression gate, planner) reads only this.

One JSON object per run, schema-versioned. ``moebench train --json`` prints it as the
last line of stdout. Fields (``None`` where a quantity does not apply):

======================================  ===================================================
``schema_version``                      int, :data:`SCHEMA_VERSION`
``status``                              ``ok`` | ``failed`` | ``oom`` | ``timeout`` | ``invalid``
``error``                               one-line message when status is not ``ok``
``preset`` / ``config`` / ``config_hash`` preset name, fully resolved config dict, its hash
``world_size`` / ``layout``             ranks, and ``{strategy, dp, ep, pp, dispatcher, dist_opt}``
``device`` / ``device_name``            ``cpu`` | ``cuda``; the device model
``precision``                           resolved precision mode (``fp32`` | ``bf16`` | ``fp8`` | ``mxfp8``)
``precision_impl``                      ``native`` | ``emulated``: whether quantized expert GEMMs ran
                                        on fp8 hardware or as quantize -> dequantize -> bf16
``tokens_per_step``                     tokens per optimizer step, counted once per token
``tokens_per_s``                        tokens_per_step / median step time
``tokens_per_s_per_device``             tokens_per_s / world_size
``tflops_per_device``                   flops_per_token * tokens_per_s_per_device / 1e12
``mfu`` / ``peak_flops`` / ``peak_flops_source``  MFU against the bf16 (GPU) or calibrated (CPU) peak
``step_time_median_s`` / ``step_times_s``  median and every timed step (warm-up excluded)
``warmup_steps`` / ``timed_steps``      how many steps were excluded / timed
``loss_first`` / ``loss_last`` / ``losses``  LM loss (no aux terms) of the first / last / every step:
                                        mean over the data-parallel ranks (the whole global batch)
``lb_loss`` / ``z_loss``                router losses of the last step: mean over every MoE layer
                                        (all pipeline stages), micro-batch and data-parallel rank
``expert_load_max_over_mean``           per step: max over MoE layers of max routes per expert /
                                        mean (1.0 is balanced), from counts summed over every rank
``dropped_tokens``                      routes dropped over capacity, summed over timed steps, MoE
                                        layers and ranks (each route counted once, by its sender)
``peak_mem_bytes``                      allocator peak (``torch.cuda.max_memory_allocated``) on
                                        GPU; peak process RSS on CPU
``peak_mem_reserved_bytes``             allocator reserved peak on GPU, else None
``peak_rss_bytes``                      peak resident set size of the process
``total_params`` / ``active_params`` / ``flops_per_token``  from the config's cost model
``comm_bytes_per_step``                 ``{axis: bytes}`` per optimizer step (empty on one rank)
``optimizer_state_bytes_per_rank``      bytes of fp32 master/moment state on one rank
``nvml_*`` / ``throttled``              NVML sampler over the timed window (rank 0's GPU): peak
                                        memory used, energy (J), SM clock, throttle reasons,
                                        sample interval and overhead; all None without a GPU
``started_at`` / ``wall_time_s``        ISO time the run began; whole run wall time
======================================  ===================================================
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moebench.config import Config

SCHEMA_VERSION = 1

REQUIRED_FIELDS = (
    "schema_version", "status", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
    "mfu", "step_time_median_s", "step_times_s", "loss_first", "loss_last", "peak_mem_bytes",
    "total_params", "active_params", "flops_per_token", "config",
)


def record_header(cfg: Config, status: str, device: str, device_name: str, precision: str) -> dict[str, Any]:
    """The fields every record starts with, measured (``ok``...) or planned (``planned``)."""
    p = cfg.parallel
    return {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        "error": None,
        "preset": cfg.preset,
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "world_size": p.world_size,
        "layout": {"strategy": p.strategy, "dp": p.dp, "ep": p.ep, "pp": p.pp,
                   "dispatcher": p.dispatcher, "dist_opt": p.dist_opt},
        "device": device,
        "device_name": device_name,
        "precision": precision,
        "tokens_per_step": cfg.tokens_per_step,
    }


def to_json_line(record: dict[str, Any]) -> str:
    """One line of JSON (no NaN: JSON has none; non-finite floats become null)."""
    return json.dumps(_finite(record), separators=(",", ":"), sort_keys=True)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
