"""Parallel layout: validation before launch, and the device mesh with its process groups.

Rank order (innermost last): ``rank = pp_rank * dp + edp_rank * ep + ep_rank``.
``world_size = dp * pp``; expert parallelism is carved out of the data-parallel ranks of a
pipeline stage (``dp = edp * ep``), so EP ranks are neighbours (same node first).

Axes and their groups (also the keys of ``comm_bytes_per_step``):
- ``dp``: every data-parallel rank of a stage (dense gradients, FSDP gathers)
- ``ep``: ranks that split the experts between them (token all-to-all)
- ``edp``: ranks holding the *same* experts (expert gradients)
- ``pp``: the stages of one pipeline (activations)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moebench.config import Config
from moebench.errors import ConfigError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def validate_layout(cfg: Config, world_size: int | None = None) -> None:
    """Raise one ConfigError listing every problem of the layout, with what would fit."""
    p, m, e = cfg.parallel, cfg.model, cfg.moe
    world = p.world_size if world_size is None else world_size
    problems: list[str] = []
    if p.dp * p.pp != world:
        fits = [f"dp={world // pp} pp={pp}" for pp in _divisors(world) if pp <= m.n_layers]
        problems.append(f"parallel.dp={p.dp} x parallel.pp={p.pp} = {p.dp * p.pp} ranks but the world size is "
                        f"{world} (would fit: {', '.join(fits)})")
    if p.dp % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide parallel.dp={p.dp} (EP is carved out of the "
                        f"data-parallel ranks; ep could be {', '.join(map(str, _divisors(p.dp)))})")
    if e.num_experts % p.ep:
        options = [str(d) for d in _divisors(e.num_experts) if p.dp % d == 0]
        problems.append(f"moe.num_experts={e.num_experts} is not divisible by parallel.ep={p.ep} "
                        f"(ep could be {', '.join(options)})")
    if m.n_layers < p.pp:
        problems.append(f"model.n_layers={m.n_layers} cannot be split over parallel.pp={p.pp} stages: "
                        f"every stage needs a layer (pp could be at most {m.n_layers})")
    elif p.pp_schedule == "interleaved-1f1b" and p.pp > 1 and m.n_layers < 2 * p.pp:
        problems.append(f"interleaved-1f1b puts 2 stages on each of {p.pp} ranks: model.n_layers={m.n_layers} "
                        f"must be at least {2 * p.pp}")
    if p.pp > 1 and cfg.train.micro_batch_size % p.pp_microbatches:
        problems.append(f"train.micro_batch_size={cfg.train.micro_batch_size} is not divisible by "
                        f"parallel.pp_microbatches={p.pp_microbatches} (the schedule splits each micro-batch)")
    if p.strategy == "fsdp" and p.dist_opt:
        problems.append("parallel.dist_opt=true applies to ddp: fsdp already shards the optimizer state")
    if p.strategy == "fsdp" and p.pp > 1:
        problems.append("parallel.pp > 1 is supported with strategy=ddp (the resident-expert stack), not fsdp")
    if p.strategy == "fsdp" and p.ep > 1 and p.dispatcher == "rowwise":
        problems.append("parallel.strategy=fsdp with ep > 1 supports dispatcher=sync only")
    if p.ep > 1 and m.n_dense_layers == m.n_layers:
        problems.append("parallel.ep > 1 but the model has no MoE layers")
    if problems:
        raise ConfigError("impossible parallel layout: " + "; ".join(problems))


@dataclass
class ParallelDims:
    """This rank's coordinates and the process groups of every axis."""

    rank: int
    world_size: int
    dp: int
    ep: int
    pp: int
    mesh: DeviceMesh  # ("pp", "edp", "ep")
    dp_mesh: DeviceMesh  # ("dp",): edp x ep flattened, what FSDP shards over
    groups: dict[str, dist.ProcessGroup]

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    def axis_of(self, group: dist.ProcessGroup | None) -> str:
        for name, g in self.groups.items():
            if g is group:
                return name
        return "world"


def build_dims(cfg: Config, device: torch.device) -> ParallelDims:
    """Create the mesh for an initialised process group and validate it against the world."""
    world = dist.get_world_size()
    validate_layout(cfg, world)
    p = cfg.parallel
    mesh = init_device_mesh(device.type, (p.pp, p.dp // p.ep, p.ep), mesh_dim_names=("pp", "edp", "ep"))
    dp_mesh = mesh["edp", "ep"]._flatten("dp")
    groups = {
        "dp": dp_mesh.get_group(),
        "ep": mesh.get_group("ep"),
        "edp": mesh.get_group("edp"),
        "pp": mesh.get_group("pp"),
    }
    return ParallelDims(dist.get_rank(), world, p.dp, p.ep, p.pp, mesh, dp_mesh, groups)
