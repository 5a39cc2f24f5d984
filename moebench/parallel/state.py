"""Full (unsharded) parameters of a parallelised model, for parity checks and checkpoints."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moebench.parallel.expert import is_expert_param
from moebench.parallel.mesh import ParallelDims

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_state_dict(model: nn.Module, dims: ParallelDims | None) -> dict[str, Tensor]:
    """Every parameter at full size on every rank (collective: call on all ranks)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if dims is not None and dims.ep > 1 and is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(dims.ep)]
            dist.all_gather(parts, t.contiguous(), group=dims.groups["ep"])
            t = torch.cat(parts)
        if dims is not None and dims.pp > 1:
            name = name.split(".", 1)[1]  # drop the PipelineStages index
        out[_clean(name)] = t.detach().cpu().clone()
    if dims is not None and dims.pp > 1:
        stages: list[dict[str, Tensor] | None] = [None] * dims.pp
        dist.all_gather_object(stages, out, group=dims.groups["pp"])
        out = {k: v for stage in stages for k, v in (stage or {}).items()}
    return out
