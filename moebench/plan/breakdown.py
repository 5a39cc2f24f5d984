"""A planned step in the run record's phases (:data:`moebench.record.PHASES`), so a plan and a
measurement can be read side by side.

The roofline's pieces are mapped onto phases for the bottleneck stage (the one that sets the
pipeline's pace): compute split by each phase's share of the stage's model FLOPs, quantize
passes with the experts, exposed EP transfers half to dispatch and half to combine, the
exposed part of FSDP's per-chunk transfers split by their time between ``param_gather`` (the
parameter all-gathers) and ``grad_reduce`` (the gradient reduce-scatters), pipeline sends and
idle slots to ``pipeline_bubble``, the exposed DDP gradient reduction to ``grad_reduce``, the
distributed optimizer's parameter all-gather after the step to ``param_gather``, AdamW to
``optimizer``, and the time another stage's longer tail adds to ``other``: the phases the
trainer's phase clock counts these transfers in (:mod:`moebench.parallel.comm`). The phases
add up to the planned step time.
"""

from __future__ import annotations

from moebench.config import Config
from moebench.plan.roofline import Roofline
from moebench.plan.stages import Stage, micro_batching
from moebench.record import PHASES


def stage_flops_by_phase(cfg: Config, stage: Stage) -> dict[str, int]:
    """Model FLOPs per token of one stage by phase; they add up to ``stage.flops_per_token``."""
    return cfg.flops_by_phase(stage.n_dense, stage.n_moe, stage.has_head)


def planned_breakdown(cfg: Config, stage: Stage, roof: Roofline) -> dict[str, float]:
    """Seconds per optimizer step by phase for ``stage`` (the bottleneck), summing to the step time."""
    t = roof.stages[stage.index]
    chunks = micro_batching(cfg).chunks_per_step
    out = dict.fromkeys(PHASES, 0.0)
    flops = stage_flops_by_phase(cfg, stage)
    total = sum(flops.values())
    for phase, f in flops.items():
        out[phase] += chunks * t.compute_per_chunk_s * (f / total if total else 0.0)
    out["experts"] += chunks * t.quantize_per_chunk_s
    out["dispatch"] += chunks * t.ep_per_chunk_s / 2
    out["combine"] += chunks * t.ep_per_chunk_s / 2
    fsdp = chunks * t.fsdp_exposed_per_chunk_s
    out["param_gather"] += fsdp * (1 - t.fsdp_reduce_share) + t.after_step_s
    out["grad_reduce"] += fsdp * t.fsdp_reduce_share
    out["pipeline_bubble"] += chunks * t.pp_per_chunk_s + max(0.0, roof.pipeline_s - chunks * t.chunk_s)
    out["grad_reduce"] += t.grad_reduce_exposed_s
    out["optimizer"] += t.optimizer_s
    own_tail = t.grad_reduce_exposed_s + t.after_step_s + t.optimizer_s
    out["other"] += max(0.0, roof.step_time_s - roof.pipeline_s - own_tail)
    return out
