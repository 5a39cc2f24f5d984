"""The baseline: FSDP2 ``fully_shard`` per transformer block, experts included.

Every micro-batch all-gathers each block's parameters (experts too) in forward and again
in backward, and reduce-scatters its gradients: the re-gathering the resident-expert
stack avoids. With ``ep > 1`` (as the older stack ran its larger models) each rank's
expert block is additionally sharded over ``edp``. Under a pipeline (``pp > 1``, ``ep = 1``)
each stage is sharded on its own over its dp replicas; torch's ``PipelineStage`` then holds back
resharding and the reduce-scatters until the last chunk of each schedule step.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moebench.config import Config
from moebench.model.moe import MoE
from moebench.model.router import Router
from moebench.parallel.expert import is_expert_param
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.optimizer import build_adamw, optimizer_state_bytes
from moebench.parallel.pipeline import PipelineStages

# Under bf16: the modules that compute in fp32 on every layout keep their fp32 parameters, all the
# others are gathered in bf16 (what autocast would cast them to anyway); gradients reduce in fp32.
BF16_GATHER = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   cast_forward_inputs=False)  # the residual stream stays fp32, as under ddp


def fp32_modules(module: nn.Module) -> list[nn.Module]:
    """The modules below ``module`` that compute in fp32 whatever the compute dtype: RMSNorms
    (their fused kernel runs in the parameters' dtype) and routers (fp32 softmax and top-k)."""
    return [m for m in module.modules() if isinstance(m, nn.RMSNorm | Router)]


def apply_fsdp(model: nn.Module, dims: ParallelDims, bf16_params: bool = False) -> None:
    """FSDP2 ``fully_shard`` per block and on the root (over dp); with ``ep > 1`` each rank's expert
    block (already sliced by :func:`moebench.parallel.expert.apply_expert_parallel`) is sharded over
    ``edp`` first.

    ``bf16_params``: a per-module mixed-precision policy computing what ddp computes under bf16
    autocast. Matmul weights (attention, dense FFNs, experts, LM head) are all-gathered in bf16,
    the values autocast gives them; a block's norms and router form one fp32 group of their own
    (one small all-gather per block), the LM head is a bf16 unit gathered once per micro-batch
    (like the root, it stays gathered from its forward to its backward), and the root's
    embedding and final norm stay fp32, so the
    embedding output, the residual stream, the norms and the routing are fp32 as under ddp (a
    bf16 gather there would round them: tests/parallel/test_parallel_parity.py's bf16 case). Gradients are
    reduced in fp32 everywhere.
    """
    matmul = {"mp_policy": BF16_GATHER} if bf16_params else {}
    if dims.ep > 1:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            fully_shard(moe.experts, mesh=dims.mesh["edp"], **matmul)
    # under a pipeline each stage is a root of its own (its layers, and the embedding or head it holds)
    stages = isinstance(model, PipelineStages)
    if stages:
        # a stage without the head returns its last block's output, which FSDP2's hooks hand on as a
        # view; torch's PipelineStage only sends it (nothing writes to it in place), so the warning
        # that an in-place op would skip a hook says nothing here
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for root in model if stages else [model]:
        for block in root.layers.values():
            if bf16_params:
                fully_shard(fp32_modules(block), mesh=dims.dp_mesh)
            fully_shard(block, mesh=dims.dp_mesh, **matmul)
        if bf16_params and getattr(root, "lm_head", None) is not None:
            # the last forward and the first backward: kept gathered in between, as the root would be
            fully_shard(root.lm_head, mesh=dims.dp_mesh, reshard_after_forward=False, **matmul)
        fully_shard(root, mesh=dims.dp_mesh)  # the embedding and final norm (fp32), and the head without bf16


class ShardedGrads:
    """fsdp's gradient sync: FSDP2 reduce-scatters during backward; this fixes the expert scale,
    clips over the shards and builds the optimizer on them."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.model, self.dims = model, dims
        self.expert_params = [p for n, p in model.named_parameters() if is_expert_param(n)] if dims.ep > 1 else []

    def micro_batch(self, is_last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        """FSDP averaged expert gradients over edp; the objective needs their sum over edp
        divided by dp (see ddp.py), i.e. a further 1/ep. (A divide factor would do this
        inside the reduce-scatter, but gloo lacks the PREMUL_SUM it needs.)"""
        if self.expert_params:
            torch._foreach_mul_([p.grad.to_local() for p in self.expert_params], 1.0 / self.dims.ep)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        # with ep > 1 the expert shards are DTensors on the edp mesh, the rest on dp: the multi-tensor
        # kernels cannot take both in one call
        return build_adamw(self.model.parameters(), cfg, fused=self.dims.ep == 1)

    def clip_grad_norm(self, max_norm: float, extra_group: dist.ProcessGroup | None = None) -> Tensor:
        """Local shards partition every parameter over dp (experts: edp x ep), so one
        all-reduce of the local squared sums gives the global norm (over ``extra_group`` too:
        the other pipeline stages' parameters)."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        sq = torch.stack([g.float().square().sum() for g in grads]).sum()
        dist.all_reduce(sq, group=self.dims.groups["dp"])
        if extra_group is not None:
            dist.all_reduce(sq, group=extra_group)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return optimizer_state_bytes(optimizer)

    def gradient_tensors(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]  # DTensor shards
