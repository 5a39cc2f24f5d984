"""The device mesh of a validated layout and its process groups (the rules: :mod:`moebench.layout`).

Rank order (innermost last): ``rank = pp_rank * dp + edp_rank * ep + ep_rank``.

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
from moebench.layout import validate_layout


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
