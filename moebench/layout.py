"""The parallel layout rules: which ``cfg.parallel`` layouts exist, and which the trainer runs.

Pure config arithmetic (no torch), so the sweep, the planner and the CLI check a layout
before any process starts, with the same messages as the trainer.

Rank order (innermost last): ``rank = pp_rank * dp + edp_rank * ep + ep_rank``.
``world_size = dp * pp``; expert parallelism is carved out of the data-parallel ranks of a
pipeline stage (``dp = edp * ep``), so EP ranks are neighbours (same node first).
Pipeline stages: ``pp x v`` of them (``v = parallel.virtual_stages``), stage ``s`` on pipeline
rank ``s % pp`` (looped, as torch's interleaved schedules place them), each a contiguous block of
layers (:func:`pipeline_layer_ranges`: ``parallel.pp_layers`` as given, or :func:`stage_layer_ranges`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moebench.config import Config
from moebench.errors import ConfigError

# The most ranks (processes, GPUs, nodes) a command line may ask for: a larger count is a typo,
# and one past 2^53 would not even survive the cost model's floats (`plan --gpus 10^30`).
MAX_RANKS = 2**20


def divisors(n: int) -> list[int]:
    """Every divisor of ``n >= 1``, ascending (pairs up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def stage_layer_ranges(n_layers: int, stages: int) -> list[range]:
    """Contiguous layer blocks, one per pipeline stage; the first ``n_layers % stages``
    stages take one layer more (63 layers on 8 stages: seven of 8, one of 7)."""
    base, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for s in range(stages):
        count = base + (1 if s < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def pipeline_layer_ranges(cfg: Config) -> list[range]:
    """The layers of each of the ``pp x v`` pipeline stages, in stage order: ``parallel.pp_layers``
    where given, else :func:`stage_layer_ranges`."""
    counts = cfg.parallel.pp_layers
    if counts is None:
        return stage_layer_ranges(cfg.model.n_layers, cfg.parallel.num_stages)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def rank_stage_ids(cfg: Config, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, in order: ``pp_rank + i * pp`` for each virtual stage."""
    p = cfg.parallel
    return [pp_rank + i * p.pp for i in range(p.virtual_stages)]


def _pipeline_problems(cfg: Config) -> list[str]:
    """The virtual-stage degree and the layer layout: every stage needs a layer."""
    p, m = cfg.parallel, cfg.model
    v = p.pp_virtual_stages
    if v is not None and v < 1:
        return [f"parallel.pp_virtual_stages={v} must be >= 1"]
    interleaved = p.pp_schedule == "interleaved-1f1b"
    if v is not None and v > 1 and not interleaved:
        return [f"parallel.pp_virtual_stages={v} needs parallel.pp_schedule=interleaved-1f1b "
                f"({p.pp_schedule} runs one stage a rank)"]
    if v == 1 and interleaved and p.pp > 1:
        return ["parallel.pp_virtual_stages=1 with parallel.pp_schedule=interleaved-1f1b: interleaving needs at "
                "least 2 stages a rank (or pp_schedule=1f1b)"]
    stages = p.num_stages
    if p.pp_layers is not None:
        counts = list(p.pp_layers)
        if len(counts) != stages or min(counts) < 1 or sum(counts) != m.n_layers:
            return [f"parallel.pp_layers={','.join(map(str, counts))} must give each of the {stages} pipeline "
                    f"stages (pp={p.pp} x {p.virtual_stages} virtual) at least one layer, summing to "
                    f"model.n_layers={m.n_layers}"]
    elif m.n_layers < stages and p.virtual_stages == 1:
        return [f"model.n_layers={m.n_layers} cannot be split over parallel.pp={p.pp} stages: "
                f"every stage needs a layer (pp could be at most {m.n_layers})"]
    elif m.n_layers < stages:
        return [f"model.n_layers={m.n_layers} cannot be split over {stages} pipeline stages (parallel.pp={p.pp} x "
                f"parallel.pp_virtual_stages={p.virtual_stages} under {p.pp_schedule}): every stage needs a "
                f"layer (pp_virtual_stages could be at most {m.n_layers // p.pp})"]
    return []


@dataclass(frozen=True)
class Problem:
    message: str
    physical: bool  # True: no trainer can run the layout; False: a limit of moebench's trainer


def layout_problems(cfg: Config, world_size: int | None = None) -> list[Problem]:
    """Every problem of ``cfg.parallel`` on ``world_size`` ranks (default: dp * pp), with what would fit."""
    p, m, e = cfg.parallel, cfg.model, cfg.moe
    world = p.world_size if world_size is None else world_size
    out: list[Problem] = []

    def add(message: str, physical: bool = True) -> None:
        out.append(Problem(message, physical))

    if p.dp * p.pp != world:
        fits = [f"dp={world // pp} pp={pp}" for pp in divisors(world) if pp <= m.n_layers]
        add(f"parallel.dp={p.dp} x parallel.pp={p.pp} = {p.dp * p.pp} ranks but the world size is "
            f"{world} (would fit: {', '.join(fits)})")
    if p.dp % p.ep:
        add(f"parallel.ep={p.ep} does not divide parallel.dp={p.dp} (EP is carved out of the "
            f"data-parallel ranks; ep could be {', '.join(map(str, divisors(p.dp)))})")
    if e.num_experts % p.ep:
        options = [str(d) for d in divisors(e.num_experts) if p.dp % d == 0]
        add(f"moe.num_experts={e.num_experts} is not divisible by parallel.ep={p.ep} "
            f"(ep could be {', '.join(options)})")
    for message in _pipeline_problems(cfg):
        add(message)
    if p.pp > 1 and cfg.train.micro_batch_size % p.pp_microbatches:
        add(f"train.micro_batch_size={cfg.train.micro_batch_size} is not divisible by "
            f"parallel.pp_microbatches={p.pp_microbatches} (the schedule splits each micro-batch)")
    rounds = max(1, p.pp_microbatches // p.pp)
    if p.pp > 1 and p.pp_schedule == "interleaved-1f1b" and p.pp_microbatches % rounds:
        add(f"parallel.pp_microbatches={p.pp_microbatches} under interleaved-1f1b must be a multiple of its "
            f"{rounds} rounds (pp_microbatches // pp, as torch's ScheduleInterleaved1F1B requires)", physical=False)
    if p.strategy == "fsdp" and p.dist_opt:
        add("parallel.dist_opt=true applies to ddp: fsdp already shards the optimizer state", physical=False)
    if p.strategy == "fsdp" and p.pp > 1 and p.ep > 1:
        add("parallel.strategy=fsdp with pp > 1 runs with ep=1 only (FSDP + pipeline + EP has no parity test)",
            physical=False)
    if p.strategy == "fsdp" and p.ep > 1 and p.dispatcher == "rowwise":
        add("parallel.strategy=fsdp with ep > 1 supports dispatcher=sync only", physical=False)
    if p.ep > 1 and m.n_dense_layers == m.n_layers:
        add("parallel.ep > 1 but the model has no MoE layers", physical=False)
    return out


def _raise(problems: list[Problem]) -> None:
    if problems:
        raise ConfigError("impossible parallel layout: " + "; ".join(pr.message for pr in problems))


def validate_layout(cfg: Config, world_size: int | None = None) -> None:
    """Raise one ConfigError listing every problem of the layout (what the trainer refuses)."""
    _raise(layout_problems(cfg, world_size))


def check_physical_layout(cfg: Config) -> None:
    """Raise one ConfigError listing the problems no trainer could run around (what a plan refuses);
    moebench's own limits (:attr:`Problem.physical` false) are left to the caller to report."""
    _raise([pr for pr in layout_problems(cfg) if pr.physical])
