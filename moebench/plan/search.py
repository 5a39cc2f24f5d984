"""Enumerate the layouts a config can run on N GPUs and rank them by planned throughput.

Searched: strategy (``ddp``; ``fsdp`` without EP, the FSDP baseline), ``pp`` (divisors of N
up to the layer count), ``ep`` (divisors of ``dp = N / pp`` that divide the expert count),
the distributed optimizer (ddp with ``dp > 1``) and per-layer recompute. Everything else
(dispatcher, micro-batching, pipeline schedule, precision) stays as configured.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from moebench.config import Config
from moebench.devices import Device
from moebench.errors import ConfigError
from moebench.layout import divisors
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan, check_gpus


def candidate_layouts(cfg: Config, gpus: int) -> list[dict[str, Any]]:
    out = []
    for pp in divisors(gpus):
        if pp > cfg.model.n_layers:
            continue
        dp = gpus // pp
        for recompute in ("none", "per-layer"):
            base = {"pp": pp, "activation_checkpointing": recompute}
            out.append({**base, "strategy": "fsdp", "ep": 1, "dist_opt": False})
            for ep in divisors(dp):
                if cfg.moe.num_experts % ep:
                    continue
                for dist_opt in ((False, True) if dp > 1 else (False,)):
                    out.append({**base, "strategy": "ddp", "ep": ep, "dist_opt": dist_opt})
    return out


@dataclass
class SearchResult:
    ranked: list[dict[str, Any]]  # plans that fit, fastest first
    too_big: list[dict[str, Any]]  # plans that do not fit, smallest peak first
    invalid: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # layout, reason


def search(cfg: Config, gpus: int, gpu: str | Device, batch_given: bool,
           options: PlanOptions | None = None) -> SearchResult:
    # a wrong GPU count or size is the user's error, not one invalid layout per candidate
    check_gpus(gpus)
    cfg.validate_sizes()
    fits, too_big, invalid = [], [], []
    for layout in candidate_layouts(cfg, gpus):
        trial = copy.deepcopy(cfg)
        for key, value in layout.items():
            setattr(trial.parallel, key, value)
        try:
            trial = apply_world_size(trial, gpus, dp_given=False, batch_given=batch_given)
            plan = build_plan(trial, gpu, options)
        except ConfigError as exc:
            invalid.append((layout, str(exc)))
            continue
        (fits if plan["plan"]["fits"] else too_big).append(plan)
    fits.sort(key=lambda r: -r["tokens_per_s_per_device"])
    too_big.sort(key=lambda r: r["peak_mem_bytes"])
    return SearchResult(fits, too_big, invalid)
