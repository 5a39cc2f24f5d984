"""A dry run of the real trainer at full size: fake tensors, a fake process group, one step.

Each rank position that matters (the first and the last pipeline stage; rank 0 is also an EP
rank) builds the real model, applies the real parallel layout (:func:`moebench.parallel.parallelize`)
and runs one real training step of the trainer (:meth:`moebench.train.trainer.Trainer.step_once`),
on torch's fake tensors (``FakeTensorMode``: shapes and dtypes, no storage, no arithmetic) and
torch's ``fake`` process-group backend (every collective returns at once; one rank of a world of
512 lives in one process, and the rank positions run at once, one process each, on as many cores).
What a step allocates, computes and sends does not depend on the values, so it is measured on shapes
alone:

- memory by category at the step's peak, by torch's own tracker
  (``torch.distributed._tools.mem_tracker.MemTracker``), named as the run record's parts;
- FLOPs, by ``torch.utils.flop_counter``'s formulas on the tracker's ops (recomputed forwards included);
- collective bytes per mesh axis, by moebench's own counter (:mod:`moebench.parallel.comm`).

What differs from a run on GPUs (each said in docs/plan.md, "Dry run of the real trainer"):

- the step is run as a GPU run would run it: the GPU expert backend (``moe.backend=auto`` resolved
  for cuda) and the GPU precision (``precision.mode=auto`` is bf16); quantized modes run their
  emulated implementation (the native one needs a GPU kernel);
- the parameters are fp32 (``precision.param_dtype`` other than fp32 is planned only: the trainer
  keeps fp32 parameters under autocast);
- the expert-parallel dispatcher is the row-wise one (sync-free: fixed-size buffers, no split
  sizes read on the host), which fake tensors can run; the sync all-to-all reads split sizes
  with ``.tolist()`` and cannot;
- a pipeline rank runs torch's own schedule order for its stages (``pipeline_order`` of the
  ``torch.distributed.pipelining`` schedule the trainer builds), each action on this rank's stage
  modules, without torch's p2p runtime (its warm-up votes on values read on the host): a stage
  past the first takes a fake activation of the shape its neighbour sends, and a stage before
  the last a fake gradient of its output's shape;
- the optimizer state exists before the step (one optimizer step first, as a run's memory step
  comes after its warm-up steps);
- a pipeline rank runs the chunks of its warm-up and one round of its steady state, not all of them
  (:meth:`ScheduledStages.chunks_to_peak`), the FLOPs and dispatch and pipeline bytes of the rest
  scaled from them;
- fsdp (``ep = 1``, ``pp = 1``) is tracked by torch's ``FSDPMemTracker``, its gathered parameters and
  gradients and the collectives' buffers counted as communication buffers.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import flop_registry, shape_wrapper

from moebench.config import Config
from moebench.errors import ConfigError
from moebench.model.loss import lm_loss
from moebench.model.precision import apply_precision
from moebench.model.transformer import Transformer
from moebench.parallel.comm import count_collectives
from moebench.parallel.ddp import FlatBufferGrads
from moebench.parallel.fsdp import ShardedGrads
from moebench.parallel.mesh import ParallelDims, build_dims
from moebench.parallel.optimizer import ShardedAdamW
from moebench.parallel.parallelize import parallelize
from moebench.parallel.pipeline import PipelineRunner
from moebench.parallel.strategy import MicroBatchContext
from moebench.record import MEMORY_PARTS as PARTS
from moebench.train.trainer import Trainer

DEVICE = torch.device("cpu")  # fake tensors carry a device but never touch it


@dataclass(frozen=True)
class RankDryRun:
    """What one rank's step allocated, computed and sent."""

    rank: int
    pp_rank: int
    ep_rank: int
    memory_parts: dict[str, int]  # PARTS at the step's peak (MemTracker's categories, named as the record's)
    peak_bytes: int
    flops: int  # FlopCounterMode's formulas over the whole step's ops (WholeStepPeak)
    comm_bytes: dict[str, float]  # per mesh axis (CommCounter)
    seconds: float  # wall time of this rank's build and step
    chunks_run: int = 1  # pipeline chunks this rank ran (ScheduledStages.sampled); FLOPs and ep/pp bytes scaled to all


def dry_config(cfg: Config) -> tuple[Config, list[str]]:
    """``cfg`` as the dry run executes it, and what was changed to make that possible."""
    notes: list[str] = []
    sets = [f"moe.backend={cfg.moe.resolved_backend('cuda')}",
            f"precision.mode={cfg.precision.resolved_mode(on_gpu=True)}"]
    p = cfg.parallel
    if p.strategy == "fsdp" and p.ep > 1:
        raise ConfigError("parallel.strategy=fsdp with ep > 1: not dry-run: fsdp's expert parallelism runs the sync "
                         "dispatcher only, which reads split sizes on the host, and fake tensors have no values")
    if p.strategy == "fsdp" and p.pp > 1:
        raise ConfigError("parallel.strategy=fsdp with pp > 1: not dry-run: the dry run runs the pipeline schedule "
                         "without torch's PipelineStage, which decides when fsdp reshards and reduce-scatters (the "
                         "last chunk of a step), so its memory and bytes would not be a run's")
    if cfg.precision.param_dtype != "fp32":
        sets.append("precision.param_dtype=fp32")
        notes.append(f"precision.param_dtype {cfg.precision.param_dtype} -> fp32 (planned only: the trainer keeps fp32 "
                     "parameters under autocast)")
    if p.ep > 1 and p.dispatcher != "rowwise":
        sets.append("parallel.dispatcher=rowwise")
        notes.append("dispatcher sync -> rowwise (the sync all-to-all reads split sizes on the host)")
    out = Config.from_dict(cfg.to_dict()).apply_overrides(sets)
    out.preset = cfg.preset
    return out.validate(), notes


def rank_positions(cfg: Config) -> list[int]:
    """Rank 0 (first pipeline stage, EP rank 0) and, under a pipeline, the last stage's rank 0."""
    p = cfg.parallel
    return [0] if p.pp == 1 else [0, (p.pp - 1) * p.dp]


def run_ranks(cfg: Config, ranks: list[int] | None = None, sample_chunks: bool = True) -> list[RankDryRun]:
    """One dry step on each of ``ranks`` (default :func:`rank_positions`) of ``cfg``'s layout;
    ``cfg`` as :func:`dry_config` returns it. ``sample_chunks``: a pipeline rank runs only the chunks
    that reach its peak (:meth:`ScheduledStages.chunks_to_peak`).

    The ranks are independent (each its own fake process group and model), so where the machine has
    more than one core the first runs here while the others run at once in processes of their own
    (spawned: a forked copy of a process that has used torch's thread pool may hang in it); each
    rank is one core's work, a Python interpreter dispatching ops."""
    positions = rank_positions(cfg) if ranks is None else list(ranks)
    workers = min(len(positions) - 1, _cores() - 1)
    if workers < 1:
        return [run_rank(cfg, r, sample_chunks) for r in positions]
    first, *rest = positions
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        others = [pool.submit(run_rank, cfg, r, sample_chunks) for r in rest]
        return [run_rank(cfg, first, sample_chunks), *(f.result() for f in others)]


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_rank(cfg: Config, rank: int, sample_chunks: bool = True) -> RankDryRun:
    started = time.perf_counter()
    precision = cfg.precision.resolved_mode(on_gpu=True)
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    with fake_process_group(rank, cfg.parallel.world_size):
        dims = build_dims(cfg, DEVICE)  # the mesh's own bookkeeping runs on real tensors
        with FakeTensorMode(allow_non_fake_inputs=True), count_collectives(dims.axis_of) as counter:
            # built straight on fake tensors: build_model's meta -> to_empty swap does not apply to them, and
            # the values (initialisation) do not matter
            model = Transformer(cfg)
            apply_precision(model, precision, cfg.precision.mxfp8_rounding, cfg.precision.scope,
                            cfg.precision.saved_activations)
            strategy = parallelize(model, cfg, dims, DEVICE, bf16=compute == torch.bfloat16)
            del model
            if isinstance(strategy.runner, PipelineRunner):
                strategy.runner = ScheduledStages(strategy.runner, cfg, dims, sample_chunks)
            trainer = Trainer(cfg, strategy, DEVICE, compute)
            _initialise_optimizer_state(trainer)
            counter.reset()
            tracker = step_tracker(trainer)
            with tracker:
                trainer.step_once(0)
            comm = counter.snapshot()
        peak = tracker.get_tracker_snapshot("peak")
    by_type = {getattr(k, "value", k): v for k, v in next(iter(peak.values())).items()} if peak else {}
    parts = _parts(by_type)
    run, scale = 1, 1.0
    if isinstance(strategy.runner, ScheduledStages):  # per-chunk work of the chunks not run: as the ones run
        run, scale = strategy.runner.sampled, strategy.runner.chunks / strategy.runner.sampled
        comm = {axis: b * scale if axis in ("ep", "pp") else b for axis, b in comm.items()}
    return RankDryRun(rank, dims.pp_rank, dims.ep_rank, parts, int(by_type.get("Total", sum(parts.values()))),
                      int(tracker.flops * scale), comm, time.perf_counter() - started, run)


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """``out[rows_e] = a[rows_e] @ b[e]`` (a 2-D, b 3-D: every row meets one expert), the weight
    gradient ``a[rows_e]^T @ g[rows_e]`` (both 2-D, grouped along the shared dimension), or one
    matmul per group (both 3-D): 2 multiply-adds per (row, input, output) triple."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]


def _wgrad_flops(a_shape, g_shape, *args, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * g_shape[1]  # a [M, K], g [M, N]: sum over the M rows


def _attention_flops(q_shape, k_shape, causal: bool, passes: int) -> int:
    """``passes`` matmuls of (B, H, Sq, d) x (Sk, d) (2 forward, 4 backward); a causal kernel
    skips the masked half (query i reads i + 1 keys), as the planner's attention term counts it."""
    b, h, sq, d = q_shape
    flops = passes * 2 * b * h * sq * k_shape[-2] * d
    return flops // 2 if causal else flops


def _cpu_attention_flops(q_shape, k_shape, v_shape, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, is_causal, 2)


def _cpu_attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, dropout_p=0.0,
                                  is_causal=False, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, is_causal, 4)


def flop_formulas() -> dict:
    """FLOPs of the ops a fake step runs that ``FlopCounterMode`` has no formula for: the grouped
    GEMMs of the experts (torch's and moebench's custom ops) and the CPU attention kernel that
    ``scaled_dot_product_attention`` selects for tensors on the CPU device."""
    import moebench.kernels.grouped_mm_op  # noqa: F401 - registers moebench::grouped_mm

    aten, ours = torch.ops.aten, torch.ops.moebench
    return {aten._grouped_mm: _grouped_mm_flops, ours.grouped_mm: _grouped_mm_flops,
            ours.grouped_mm_wgrad: _wgrad_flops,
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops}


_DEVICE = torch.ops.prim.device.default


class WholeStepPeak:
    """The step's peak alone, which is all a dry run reads, and its FLOPs, counted by the tracker's own
    dispatch with ``FlopCounterMode``'s formulas (torch's and :func:`flop_formulas`): torch's trackers
    walk every tracked module's statistics on every dispatched op (``_update_peak_stats``), 45% of the
    time of ``ultra-1.2t``'s dry run at its published layout (cProfile: 668 of 1,499 s), and a
    ``FlopCounterMode`` of its own is one more Python mode every op goes through. A tensor's device
    (``prim.device``, read by autograd and by ``is_cuda``: half the ops ``ultra-1.2t``'s rank 0 dispatched)
    allocates nothing and computes nothing, and skips both; a fake tensor's is its ``device`` property, what the
    fake-tensor mode's own handler returns, read without dispatching to that mode."""

    flops = 0
    _formulas: dict | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            return args[0].device if isinstance(args[0], FakeTensor) else func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._formulas is None:
            self._formulas = {**flop_registry, **{k: shape_wrapper(f) for k, f in flop_formulas().items()}}
        formula = self._formulas.get(getattr(func, "_overloadpacket", None))
        if formula is not None and out is not NotImplemented:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


class StepMemTracker(WholeStepPeak, MemTracker):
    """torch's MemTracker over a step of several forwards: it refuses a root module's second
    forward (it takes it for the next iteration), which a step of several micro-batches or
    pipeline chunks has. Such a module's per-module statistics start afresh; the categories and
    the peak, all a dry run reads, are kept for the whole step."""

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class StepFSDPMemTracker(WholeStepPeak, FSDPMemTracker):
    """torch's FSDP tracker (sharded and gathered parameters and gradients, all-gather and
    reduce-scatter buffers, each a category of its own) over a step of several micro-batches: as
    :class:`StepMemTracker`, a root's second forward starts its per-module statistics afresh."""

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        @functools.wraps(inner)
        def again(*args, **kwargs):
            name = self._mod_tracker.get_known_fqn(fsdp_mod)
            if (fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw
                    and self._mod_tracker.parents - {name} == {"Global"}):
                del self.memory_tracking[fsdp_mod]
            return inner(*args, **kwargs)

        return again


def step_tracker(trainer: Trainer) -> MemTracker:
    """The memory tracker of a dry step, told what exists before it: torch's FSDP tracker finds
    fsdp's sharded parameters and the optimizer's state itself; under ddp :func:`_track_state`
    names them."""
    if isinstance(trainer.strategy.grads, ShardedGrads):
        return StepFSDPMemTracker(trainer.model, trainer.optimizer)
    tracker = StepMemTracker()
    _track_state(tracker, trainer)
    return tracker


def _initialise_optimizer_state(trainer: Trainer) -> None:
    """One optimizer step before the measured one: torch's AdamW creates its moments at its first
    step, so a first step's forward would run without them (a run's memory step comes after its
    warm-up steps). The flat buffers hold every gradient already; elsewhere zeros stand in."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.strategy.zero_grad(trainer.optimizer)


def _track_state(tracker: MemTracker, trainer: Trainer) -> None:
    """Tell the tracker what exists before the step, by category: the model's parameters and
    buffers, the gradient buffers and the optimizer's state. moebench's own flat buffers and
    sharded optimizer are not torch modules or optimizers, so their tensors are registered with
    the tracker's category directly (``_update_and_maybe_create_winfos``: torch has no public call
    that takes a category)."""
    tracker.track_external(trainer.model)
    grads, optimizer = trainer.strategy.grads, trainer.optimizer
    if isinstance(grads, FlatBufferGrads):
        for buf in grads.buffers:
            for t in (buf.grad, buf.grad_shard):
                tracker._update_and_maybe_create_winfos(t, _MemRefType.GRAD)
    if isinstance(optimizer, ShardedAdamW):
        for t in (*optimizer.master, *optimizer.exp_avg, *optimizer.exp_avg_sq):
            tracker._update_and_maybe_create_winfos(t, _MemRefType.OPT)
    else:
        tracker.track_external(optimizer)


# MemTracker's categories -> the run record's memory parts (moebench.train.memory_parts): forward
# allocations still alive at the peak are what autograd saved; backward's (activation gradients)
# and anything else are transient. FSDPMemTracker's: the local shards are the parameters and
# gradients; the gathered (unsharded) parameters and gradients and the collectives' buffers are
# the communication buffers, as the planner counts fsdp's gathered layers
_CATEGORY_PART = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
                  "Optstate": "optimizer_state", "Activation": "saved_activations", "Temp": "transient",
                  "Other": "transient",
                  "Sharded Param": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer_state",
                  "Unsharded Param": "comm_buffers", "Unsharded Grad": "comm_buffers", "All Gather": "comm_buffers",
                  "Reduce Scatter": "comm_buffers", "Inputs": "saved_activations"}


def _parts(by_type: dict[str, int]) -> dict[str, int]:
    parts = dict.fromkeys(PARTS, 0)
    for category, nbytes in by_type.items():
        if category in _CATEGORY_PART:
            parts[_CATEGORY_PART[category]] += nbytes
    return parts


class ScheduledStages:
    """The micro-batch runner of a pipeline rank in a dry run: torch's schedule order for this rank
    (the ``pipeline_order`` of the schedule :class:`PipelineRunner` built), run on this rank's stage
    modules without p2p; the neighbours' activations and gradients are fake tensors of their shape."""

    def __init__(self, runner: PipelineRunner, cfg: Config, dims: ParallelDims, sample: bool = True) -> None:
        schedule = runner.schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.modules = {s.stage_index: s.submod for s in stages}
        self.num_stages = stages[0].num_stages
        if len(stages) > 1:  # interleaved: torch's own order for this rank
            actions = [self._action(a) for a in schedule.pipeline_order[dims.pp_rank] if a is not None]
        else:
            actions = _single_stage_order(cfg.parallel.pp_schedule, stages[0].stage_index, self.num_stages,
                                          runner.chunks)
        actions = [a for a in actions if a is not None]
        self.chunks = runner.chunks
        self.sampled = self.chunks_to_peak(actions, self.chunks, dims.pp) if sample else self.chunks
        self.actions = [a for a in actions if a[2] < self.sampled]
        self.runner, self.norm_group = runner, runner.norm_group
        self.d_model = cfg.model.d_model

    @staticmethod
    def chunks_to_peak(actions: list[tuple[int, str, int]], chunks: int, pp: int) -> int:
        """The first chunks whose actions reach the rank's peak: those of its warm-up (every forward before
        its first backward) and ``pp`` more, a full round of the steady state, where each forward is
        followed by a backward and no more chunks come into flight (interleaved: a round over both of its
        stages). Running the order's actions of these chunks only keeps the order's prefix up to there
        unchanged and never holds more chunks than the full order at the same point, so the peak is the
        full step's; the per-chunk work of the rest (FLOPs, dispatch and pipeline bytes) is the same."""
        first_backward = next((i for i, a in enumerate(actions) if a[1] == "B"), len(actions))
        warmup = max((a[2] for a in actions[:first_backward]), default=0)
        return min(chunks, warmup + 1 + pp)

    @staticmethod
    def _action(a) -> tuple[int, str, int] | None:
        kind = a.computation_type.value
        return (a.stage_index, kind, a.microbatch_index) if kind in ("F", "B") else None

    def loss_scale(self, micro_batches: int) -> float:
        return self.runner.loss_scale(micro_batches)

    def forward_backward(self, micro: list[tuple[Tensor, Tensor]], autocast: contextlib.AbstractContextManager,
                         device: torch.device, micro_batch: MicroBatchContext) -> Tensor:
        scale = self.loss_scale(len(micro))
        for i, (inputs, targets) in enumerate(micro):
            chunks_in, chunks_tg = inputs.tensor_split(self.runner.chunks), targets.tensor_split(self.runner.chunks)
            with micro_batch(i == len(micro) - 1), autocast:
                self._run(chunks_in, chunks_tg, scale)
        return torch.zeros((), device=device)

    def _run(self, inputs: tuple[Tensor, ...], targets: tuple[Tensor, ...], scale: float) -> None:
        live: dict[tuple[int, int], Tensor] = {}
        received: dict[tuple[int, int], Tensor] = {}
        for stage, kind, chunk in self.actions:
            module: nn.Module = self.modules[stage]
            if kind == "F":
                tokens = inputs[chunk]
                x = tokens if stage == 0 else torch.empty(
                    (*tokens.shape, self.d_model), device=tokens.device, requires_grad=True)
                if stage != 0:
                    received[stage, chunk] = x
                out = module(x)
                if stage == self.num_stages - 1:
                    out = lm_loss(out, targets[chunk]) * scale
                live[stage, chunk] = out
            else:
                out = live.pop((stage, chunk))
                out.backward(None if out.ndim == 0 else torch.empty_like(out))
                if stage != 0:
                    _drop_received(received.pop((stage, chunk)))


def _drop_received(x: Tensor) -> None:
    """After a chunk's backward the trainer drops the activation the stage received and its gradient
    (sent upstream): :class:`moebench.parallel.pipeline.ChunkBufferStage` and torch's ``stage_backward``.
    Here torch's ``ModTracker``, under the memory tracker, would keep both alive to the step's end (its
    gradient hook on a module's inputs holds them through autograd, out of the garbage collector's
    reach), so their storages are emptied instead, which the tracker counts as freed."""
    grad, x.grad = x.grad, None
    for t in (x, grad):
        if t is not None:
            t.untyped_storage().resize_(0)


def _single_stage_order(schedule: str, stage: int, num_stages: int, chunks: int) -> list[tuple[int, str, int]]:
    """The order of a one-stage-a-rank schedule as its runtime runs it (torch's ``pipeline_order`` IR
    of ``Schedule1F1B`` skips the last stage's first chunk): GPipe every forward, then every backward;
    1F1B ``num_stages - 1 - stage`` forwards, then one forward and one backward, then the rest."""
    if schedule == "gpipe":
        return [(stage, "F", c) for c in range(chunks)] + [(stage, "B", c) for c in range(chunks)]
    warmup = min(chunks, num_stages - 1 - stage)
    order = [(stage, "F", c) for c in range(warmup)]
    for c in range(warmup, chunks):
        order += [(stage, "F", c), (stage, "B", c - warmup)]
    return order + [(stage, "B", c) for c in range(chunks - warmup, chunks)]
