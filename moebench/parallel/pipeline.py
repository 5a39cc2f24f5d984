"""Pipeline parallelism with ``torch.distributed.pipelining``: stages by layers, 1F1B
(GPipe and interleaved 1F1B as options), combined with ddp + EP inside each stage.

Each accumulation micro-batch is split by the schedule into ``pp_microbatches`` chunks.
The LM loss of a chunk is scaled by ``1 / (chunks * micro-batches)`` and the router aux
losses by the same factor (they ride on the activations' backward, see
:func:`moebench.model.router.attach_aux_loss`), so the objective equals the
single-process one over the same global batch.

Stage placement (:mod:`moebench.layout`): ``pp * v`` stages (``v = parallel.virtual_stages``,
2 by default under interleaved 1F1B), stage ``s`` on pipeline rank ``s % pp`` (looped), each
holding a contiguous block of layers (``parallel.pp_layers``, or the first stages one layer more
where the layers do not divide, see :func:`pipeline_layer_ranges`); the first stage also holds
the embedding, the last the final norm and LM head.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._utils import _make_tensor_from_meta

from moebench.config import Config
from moebench.layout import pipeline_layer_ranges, rank_stage_ids
from moebench.model.loss import lm_loss
from moebench.model.phases import active_clock, mark
from moebench.model.router import stats_paused
from moebench.parallel.comm import COUNTER
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.strategy import MicroBatchContext


class PipelineStages(nn.ModuleList):
    """The stage modules this rank runs (one, or ``parallel.virtual_stages`` when interleaved)."""


def stage_ids(cfg: Config, dims: ParallelDims) -> tuple[list[int], int]:
    """This rank's stage indices and the number of stages over all ranks."""
    return rank_stage_ids(cfg, dims.pp_rank), cfg.parallel.num_stages


def split_model(model: nn.Module, cfg: Config, dims: ParallelDims) -> PipelineStages:
    """Cut a full model into this rank's stages (copies with the other layers deleted)."""
    ids, num_stages = stage_ids(cfg, dims)
    ranges = pipeline_layer_ranges(cfg)
    stages = []
    for s in ids:
        stage = _copy_model(model) if s != ids[-1] else model  # the last one reuses the full model
        keep = {str(i) for i in ranges[s]}
        for name in list(stage.layers.keys()):
            if name not in keep:
                del stage.layers[name]
        if s != 0:
            stage.tok_emb = None
        if s != num_stages - 1:
            stage.norm = None
            stage.lm_head = None
        stages.append(stage)
    return PipelineStages(stages)


def _copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` with every parameter and buffer cloned up front (the memo then
    hands deepcopy the clones). deepcopy would copy each tensor through its storage, keyed by the
    storage's address, which fake tensors (a dry run, :mod:`moebench.train.dry_run`) reuse: two
    storages then map to one copy on another device."""
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        clone = t.detach().clone()
        memo[id(t)] = nn.Parameter(clone, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else clone
    return copy.deepcopy(model, memo)


def _count_sends(first: bool, last: bool):
    """Forward hook: a stage sends its output forward (unless last) and, in backward, the
    gradient of its input back (unless first); both have the activation's size."""

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        sent = 0 if last else output.numel() * output.element_size()
        if not first:
            sent += inputs[0].numel() * inputs[0].element_size()
        COUNTER.add("pp", sent)

    return hook


def _mark_stage_output(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """Forward hook: after a stage's forward the rank waits for its next chunk (the bubble,
    p2p transfers included); the gradient arriving here starts the stage's backward."""
    return mark(output, "pipeline_bubble")


def _pause_stats_in_shape_inference(stage: PipelineStage) -> None:
    """torch's PipelineStage runs one extra forward on its first step to infer shapes (on
    placeholder inputs past the first stage); keep it out of the router statistics, which
    also drive the aux-loss-free bias. The hook is a private method (``_forward_metadata_inference``
    in torch 2.13, ``_shape_inference`` before); where a torch version has neither, nothing is wrapped."""
    name = next((n for n in ("_forward_metadata_inference", "_shape_inference") if hasattr(stage, n)), None)
    if name is None:
        return
    infer = getattr(stage, name)

    def wrapped(*args, **kwargs):
        with stats_paused():
            return infer(*args, **kwargs)

    setattr(stage, name, wrapped)


class ChunkBufferStage(PipelineStage):
    """torch's ``PipelineStage`` with a chunk's receive buffers held only while the chunk is in flight.

    torch allocates, when a stage sets up, one buffer per chunk for the activation it receives (a
    stage past the first) and one for the gradient it receives (a stage before the last), and keeps
    them for the stage's life: each is a whole micro-batch of the residual stream, ``chunks x
    tokens_per_chunk x d_model`` in the stage's output dtype, held through the optimizer step and
    between steps. Here a chunk's buffers are made when its receive is posted and dropped after its
    backward (the gradient sent upstream is the input's ``.grad``, a tensor of its own), so a stage
    holds the buffers of its chunks in flight only; the received activation is the first layer's
    input, which that layer saves anyway. Uses torch's private ``_make_tensor_from_meta`` (torch 2.13)."""

    def _prepare_forward_infra(self, *args, **kwargs):
        meta = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():
            _drop_buffers(infos)
        return meta

    def _prepare_backward_infra(self, *args, **kwargs):
        meta = super()._prepare_backward_infra(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _drop_buffers(infos)
        return meta

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        _make_buffers(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            _make_buffers(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)
        if full_backward:  # a split backward (zero-bubble schedules) still needs the input for its weights
            _drop_buffers(self.args_recv_info.get(bwd_chunk_id, ()))
            _drop_buffers(self.grad_recv_info.get(bwd_chunk_id, ()))


def _make_buffers(infos, device: torch.device) -> None:
    for info in infos:
        if not info.is_root_arg and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


def _drop_buffers(infos) -> None:
    """Replace each receive buffer with an empty tensor: torch reads ``buffer is None`` as "no
    tensor to receive", which it checks against the metadata."""
    for info in infos:
        if not info.is_root_arg and info.buffer is not None:
            info.buffer = info.buffer.new_empty(0)


class PipelineRunner:
    """Runs each accumulation micro-batch through this rank's stages with a pipeline schedule."""

    def __init__(self, stages: PipelineStages, cfg: Config, dims: ParallelDims, device: torch.device) -> None:
        """``stages``: this rank's stages, from :func:`split_model`, already wrapped for data parallelism."""
        self.dims = dims
        ids, num_stages = stage_ids(cfg, dims)
        self.first = 0 in ids
        self.last = num_stages - 1 in ids
        self.chunks = cfg.parallel.pp_microbatches
        self._chunk_scale = 1.0  # this step's loss_scale, for the schedule's loss_fn
        self.norm_group = dims.groups["pp"]  # the other stages hold the rest of the parameters
        for module, s in zip(stages, ids, strict=True):
            module.register_forward_hook(_count_sends(first=s == 0, last=s == num_stages - 1))
            module.register_forward_hook(_mark_stage_output)
        pp_group = dims.groups["pp"]
        pipe_stages = [ChunkBufferStage(m, s, num_stages, device, group=pp_group)
                       for m, s in zip(stages, ids, strict=True)]
        for stage in pipe_stages:
            _pause_stats_in_shape_inference(stage)
        # scale_grads=False: the loss is already scaled by 1/(chunks * micro-batches); torch's
        # own rescaling would also shrink gradients accumulated by earlier micro-batches.
        kw = {"n_microbatches": self.chunks, "loss_fn": self._loss, "scale_grads": False}
        if cfg.parallel.pp_schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(pipe_stages, **kw)
        elif cfg.parallel.pp_schedule == "gpipe":
            self.schedule = ScheduleGPipe(pipe_stages[0], **kw)
        else:
            self.schedule = Schedule1F1B(pipe_stages[0], **kw)
        # the last stage's global rank: where the loss lives
        self.last_rank = dist.get_global_rank(pp_group, (num_stages - 1) % dims.pp)

    def loss_scale(self, micro_batches: int) -> float:
        """Each chunk's LM loss scale: every micro-batch is split into ``pp_microbatches`` chunks."""
        return 1.0 / (micro_batches * self.chunks)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(logits, targets) * self._chunk_scale

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device, micro_batch: MicroBatchContext) -> Tensor:
        self._chunk_scale = self.loss_scale(len(micro))
        total = torch.zeros((), device=device)
        clock = active_clock()
        if clock is not None:  # until this rank's first stage runs, it waits on the pipeline
            clock.enter("pipeline_bubble")
        for i, (inputs, targets) in enumerate(micro):
            losses: list[Tensor] = []
            kwargs = {"target": targets.to(device), "losses": losses} if self.last else {}
            args = (inputs.to(device),) if self.first else ()
            with micro_batch(i == len(micro) - 1), autocast:
                # return_outputs=False: otherwise the last stage keeps every chunk's output (its
                # logits) until the step ends, to merge them into a result nothing here reads
                self.schedule.step(*args, return_outputs=False, **kwargs)
            if self.last:
                total += torch.stack([loss.detach() for loss in losses]).sum()
        dist.broadcast(total, src=self.last_rank, group=self.dims.groups["pp"])
        return total
