"""The training loop: gradient accumulation, AdamW on fp32 master weights, clipping,
router statistics and synchronised step timing.

The loop is strategy-agnostic. A :class:`moebench.parallel.strategy.Strategy` owns everything
that differs between a single process and the parallel layouts (how micro-batches run, how
gradients are reduced, how the optimizer is sharded); the base class is the single-process
one, and :func:`moebench.parallel.parallelize.parallelize` builds the others.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from moebench.config import Config
from moebench.metrics.instructions import InstructionCounter
from moebench.metrics.memory import reset_peaks
from moebench.metrics.steady import still_warming
from moebench.metrics.timer import StepTimer, synchronize
from moebench.metrics.work import counting_work
from moebench.model.moe import MoE
from moebench.model.phases import PhaseClock, clock_active
from moebench.model.route_keys import CHECKSUM_MODULUS
from moebench.model.router import set_route_positions
from moebench.parallel.comm import CommCounter
from moebench.parallel.dispatch import RowwiseDispatch
from moebench.parallel.strategy import Strategy
from moebench.record import MEMORY_PARTS as PARTS
from moebench.record import TRACE_STEP_RANGE
from moebench.train.data import TokenStream, micro_batches
from moebench.train.memory_parts import (
    SavedActivations,
    optimizer_state_bytes,
    parameter_storages,
    storage_bytes,
)


@dataclass
class StepLog:
    losses: list[Tensor] = field(default_factory=list)
    lb: list[Tensor] = field(default_factory=list)
    z: list[Tensor] = field(default_factory=list)
    load_imbalance: list[Tensor] = field(default_factory=list)
    dropped: list[Tensor] = field(default_factory=list)
    # row-wise EP, this rank's layers: [rank load max/mean (max over layers), capacity use max,
    # padding slots, slots] per step (RowwiseStats); empty under other dispatchers
    dispatch: list[Tensor] = field(default_factory=list)
    # int64 per step: this rank's routing checksum over its layers (route_keys.route_checksum)
    routing_checksum: list[Tensor] = field(default_factory=list)
    # float64 per step: FLOPs this rank's expert GEMMs spent on padding rows (Experts.step_padding_flops)
    padding_flops: list[Tensor] = field(default_factory=list)


def _maybe_inject_failure(rank: int, step: int) -> None:
    """Testing hook: ``MOEBENCH_INJECT_FAILURE=RANK:STEP`` makes that rank crash at that step
    (used to prove that a crashed rank never leaves the others hanging)."""
    spec = os.environ.get("MOEBENCH_INJECT_FAILURE")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (MOEBENCH_INJECT_FAILURE)")


class InjectedSlowdown:
    """Testing hook: ``MOEBENCH_INJECT_SLOWDOWN=0.3`` makes every step do 30% more work inside the timed
    region, as real computation (small matmuls on the host: a sleep would be invisible to any CPU-time or
    instruction clock and would free the cores a co-tenant then takes): a known regression that proves the
    gate catches one (``scripts/gate_power.py``).

    The first :attr:`CALIBRATION_STEPS` steps compute for that fraction of their own time and count the
    matmuls it took; every later step does the fewest of those counts, a fixed amount of work. So the
    timed steps' extra work does not grow when the machine is slow or loaded (time-based, it did: at
    load the busy loop took more of a core than the step's waits, ~14% for 10%). Under callgrind
    (``train.instructions``) the calibration runs under valgrind too, where the matmuls slow less than the
    step, so a fraction adds about twice its share of instructions (0.05 about +10%; docs/report.md)."""

    CALIBRATION_STEPS = 2

    def __init__(self, fraction: float) -> None:
        self.fraction = max(fraction, 0.0)
        self.counts: list[int] = []

    @classmethod
    def from_env(cls) -> InjectedSlowdown | None:
        spec = os.environ.get("MOEBENCH_INJECT_SLOWDOWN")
        if not spec:
            return None
        try:
            return cls(float(spec))
        except ValueError:
            raise ValueError(f"MOEBENCH_INJECT_SLOWDOWN={spec!r}: expected a fraction of the step time, "
                             "e.g. 0.3") from None

    @property
    def fixed(self) -> int | None:
        """The matmuls every step does once calibrated; None while calibrating."""
        return min(self.counts) if len(self.counts) >= self.CALIBRATION_STEPS else None

    def __call__(self, device: torch.device, started: float) -> None:
        synchronize(device)  # the step's work, not just its launches on a GPU
        if self.fixed is None:
            self.counts.append(_busy(self.fraction * (time.perf_counter() - started)))
        else:
            _busy(math.inf, self.fixed)


def _busy(seconds: float, matmuls: int | None = None) -> int:
    """Keep this thread computing (a 64 x 64 fp32 matmul at a time: a few microseconds each) for ``seconds``,
    or for ``matmuls`` matmuls; how many it did."""
    a = torch.ones(64, 64)
    end = time.perf_counter() + seconds
    done = 0
    while (done < matmuls) if matmuls is not None else (time.perf_counter() < end):
        a = torch.mm(a, a).clamp_(max=1.0)
        done += 1
    return done


# MOEBENCH_INJECT_WORK: regressions in a step's work, each what the work gate must catch
# (tests/metrics/test_work_gate.py)
INJECTED_WORK = ("item", "all_reduce", "copy")


def _maybe_inject_work(device: torch.device) -> None:
    """Testing hook: ``MOEBENCH_INJECT_WORK=item,all_reduce,copy`` adds to every step a host sync (``.item()``),
    a one-element all-reduce over every rank, and/or one extra ATen copy: known regressions in work that
    :mod:`moebench.report.gate.work` must catch, at any load."""
    spec = os.environ.get("MOEBENCH_INJECT_WORK")
    if not spec:
        return
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in INJECTED_WORK]
    if unknown:
        raise ValueError(f"MOEBENCH_INJECT_WORK={spec!r}: unknown {', '.join(unknown)}; expected some of "
                         f"{', '.join(INJECTED_WORK)}")
    x = torch.zeros(1, device=device)
    if "item" in kinds:
        x.sum().item()
    if "all_reduce" in kinds and dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)
    if "copy" in kinds:
        x.clone()


@dataclass
class WindowSamples:
    """What :meth:`Trainer.run_window` collected, one entry a step, warm-up steps first."""

    comm: list[dict[str, float]]  # bytes per axis (CommCounter.snapshot)
    padding: list[dict[str, Tensor]]  # padding bytes per axis (CommCounter.padding_snapshot)
    steps: int  # steps run: warm-up and timed


class Trainer:
    def __init__(self, cfg: Config, strategy: Strategy, device: torch.device, compute_dtype: torch.dtype) -> None:
        # the strategy's model: the parallelised one (e.g. this rank's pipeline stages)
        self.cfg, self.model, self.strategy, self.device = cfg, strategy.model, strategy, device
        self.compute_dtype = compute_dtype
        self.optimizer = strategy.build_optimizer(cfg)
        self.data = TokenStream(cfg.train.data, cfg.model.vocab_size, cfg.model.seq_len, cfg.train.seed)
        self.timer = StepTimer(device, warming=still_warming([], cfg.train.warmup_steps, cfg.train.max_warmup_steps),
                               instructions=InstructionCounter() if cfg.train.instructions else None)
        self.slowdown = InjectedSlowdown.from_env()
        self.work: dict | None = None  # the first step's exact work counts (None: not counted, e.g. compiled)
        self.warmup_times: list[float] = []  # each warm-up step's time on the slowest rank
        self.log = StepLog()
        self.step_clocks: list[PhaseClock] = []  # the timed steps' step clocks (train.phase_clock)
        self.moe_blocks = [m for m in self.model.modules() if isinstance(m, MoE)]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def run_window(self, counter: CommCounter, window_start: Callable[[], None],
                   after_step: Callable[[int], None]) -> WindowSamples:
        """The warm-up (fixed, or until steady), then the timed window. ``window_start`` runs once,
        just before the first timed step; ``after_step(step)`` after every step. Each step's
        collective bytes come from ``counter``, reset before the step."""
        comm: list[dict[str, float]] = []
        padding: list[dict[str, Tensor]] = []
        step = 0
        if not self.timer.warming:
            window_start()
        while not self.done:
            warming = self.timer.warming
            counter.reset()
            if step == 0 and not self.cfg.train.compile:  # the first step's exact work (metrics/work.py)
                with counting_work(counter) as work:
                    self.train_step(step)
                self.work = work.fields()
            else:
                self.train_step(step)
            comm.append(counter.snapshot())
            padding.append(counter.padding_snapshot())
            if warming and not self.timer.warming:
                window_start()
            after_step(step)
            step += 1
        return WindowSamples(comm, padding, step)

    def train_step(self, step: int) -> None:
        _maybe_inject_failure(self.strategy.rank, step)
        micro = self._micro_batches(step)
        clock = self._warmup_clock(step)
        if clock is None and self.cfg.train.phase_clock:
            clock = PhaseClock(self.device)  # a step clock: it changes nothing it times
        timed = not self.timer.warming
        self.timer.start()
        started = time.perf_counter()
        with clock_active(clock) if clock is not None else contextlib.nullcontext():
            # the clock's timeline spans what the timer times, so its phases partition the timed step
            if clock is not None:
                clock.enter("other")
            self._step(micro, clock)
            _maybe_inject_work(self.device)
            if self.slowdown is not None:
                self.slowdown(self.device, started)
            if clock is not None:
                clock.enter("end")
        elapsed = self.timer.stop()
        if self.timer.warming:
            self._settle(elapsed)
        elif timed and clock is not None:
            self.step_clocks.append(clock)

    def _settle(self, elapsed: float) -> None:
        """After a warm-up step: end the warm-up when the steady rule says so. The rule reads the
        slowest rank's step times, reduced here, so every rank decides alike (a rank that warmed up
        one step longer than the others would leave their collectives waiting)."""
        if dist.is_available() and dist.is_initialized():
            slowest = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            elapsed = slowest.item()
        self.warmup_times.append(elapsed)
        t = self.cfg.train
        if not still_warming(self.warmup_times, t.warmup_steps, t.max_warmup_steps):
            self.timer.end_warmup()

    @property
    def done(self) -> bool:
        """Whether the timed window is complete."""
        return len(self.timer.samples) >= self.cfg.train.timed_steps

    def _warmup_clock(self, step: int) -> PhaseClock | None:
        """A profiling clock for the last warm-up step of a compiled run that traces, then discarded.

        With a profiling clock active, compiled blocks recompile with a graph break at every phase
        mark (:mod:`moebench.model.compile`); running that step under one compiles this variant in
        the warm-up as well, so neither a timed nor a profiled step ever compiles.
        """
        t = self.cfg.train
        if t.compile and t.trace and t.profile_steps and step == t.warmup_steps - 1:
            return PhaseClock(self.device, profiling=True)
        return None

    def profile_step(self, step: int) -> PhaseClock:
        """One more step, outside the timed samples, under a profiling clock (for its trace).
        ``clock.wall_s`` is the step's wall time measured around it, independently of the clock."""
        micro = self._micro_batches(step)
        clock = PhaseClock(self.device, profiling=True)
        with clock_active(clock), torch.profiler.record_function(TRACE_STEP_RANGE):
            # the wall clock starts inside the step's profiler range: a process's first
            # record_function costs about a millisecond of op lookup, 6% of a 25 ms step, which is
            # the profiler's setup, not the step's
            synchronize(self.device)
            start = time.perf_counter()
            clock.enter("other")
            self._step(micro, clock)
            clock.enter("end")
            clock.wall_s = time.perf_counter() - start
        return clock

    def memory_step(self, step: int) -> dict[str, int | None]:
        """One more step, outside the timed and the profiled ones: this rank's memory by part
        (:mod:`moebench.train.memory_parts`), ``{part: bytes}`` over :data:`PARTS`."""
        micro = self._micro_batches(step)
        saved = SavedActivations(parameter_storages(self.model))
        watch = not self.cfg.train.compile  # compiled blocks are not run under extra hooks
        parts: dict[str, int | None] = {}

        def reduced() -> None:
            parts["gradients"] = storage_bytes(self.strategy.grads.gradient_tensors())

        synchronize(self.device)
        reset_peaks(self.device)
        self._step(micro, None, saved.watching() if watch else contextlib.nullcontext(), reduced)
        synchronize(self.device)
        parts.update(parameters=storage_bytes(self.model.parameters()),
                     optimizer_state=optimizer_state_bytes(self.optimizer),
                     saved_activations=saved.peak_bytes if watch else None, comm_buffers=0)
        parts["transient"] = None
        if self.device.type == "cuda" and watch:
            # at least 0: the saved tensors shrink while the gradients grow, so the parts' peaks
            # need not coincide
            held = sum(v for v in parts.values() if v is not None)
            parts["transient"] = max(0, torch.cuda.max_memory_allocated(self.device) - held)
        return {k: parts[k] for k in PARTS}

    def step_once(self, step: int) -> None:
        """One step outside the timed, profiled and memory steps, with nothing read back on the host:
        what a dry run on fake tensors executes (:mod:`moebench.train.dry_run`)."""
        self._step(self._micro_batches(step), None)

    def _micro_batches(self, step: int) -> list[tuple[Tensor, Tensor]]:
        cfg = self.cfg
        batch_GS = self.data.global_batch(step, cfg.train.global_batch_size)
        micro = micro_batches(batch_GS, self.strategy.dp_rank, self.strategy.dp_size, cfg.train.micro_batch_size)
        for block in self.moe_blocks:  # the aux losses' gradient scale is the LM loss's
            block.router.aux_grad_scale = self.strategy.loss_scale(len(micro))
        first_token = self.strategy.dp_rank * (cfg.train.global_batch_size // self.strategy.dp_size) * cfg.model.seq_len
        set_route_positions([m.router for m in self.moe_blocks], cfg.train.seed, step, first_token,
                            cfg.tokens_per_step)
        return micro

    def _step(self, micro: list[tuple[Tensor, Tensor]], clock: PhaseClock | None,
              saving: contextlib.AbstractContextManager | None = None,
              reduced: Callable[[], None] | None = None) -> None:
        """``saving``: a context around forward and backward (saved-tensor hooks); ``reduced``: called
        once the gradients are reduced, before the optimizer step (memory_step's two probes)."""
        enter = clock.enter if clock is not None else lambda key: None
        with saving if saving is not None else contextlib.nullcontext():
            loss = self.strategy.forward_backward(micro, self._autocast(), self.device)
        enter("grad_reduce")  # what backward did not already reduce
        self.strategy.finish_gradients()
        if reduced is not None:
            reduced()
        enter("optimizer")
        self.strategy.clip_grad_norm(self.cfg.train.clip_grad_norm)
        self.optimizer.step()
        self.strategy.zero_grad(self.optimizer)
        enter("other")
        self._log_step(loss)

    @torch.no_grad()
    def _log_step(self, loss: Tensor) -> None:
        """The step's loss and router statistics over every data-parallel rank, and the
        aux-loss-free bias update (all on the device).

        Each rank trains on other tokens, so one collective sums over the dp ranks the expert
        counts (the bias update needs them: every replica moves its bias alike), the loss,
        the lb/z losses and the dropped routes. Loss and lb/z then become means over the
        ranks (each rank averaged the same number of micro-batches); counts and drops stay
        sums (a rank counts only its own tokens' routes, also under expert parallelism).
        """
        routers = [m.router for m in self.moe_blocks]
        parts = [loss.reshape(1)]
        if routers:
            aux_L2 = torch.stack([r.step_aux / r.step_calls.clamp_min(1) for r in routers])
            parts += [torch.stack([r.step_counts for r in routers]).flatten(), aux_L2.flatten(),
                      sum(r.step_dropped for r in routers).reshape(1)]
        summed = self.strategy.all_reduce_sum(torch.cat(parts))
        dp = self.strategy.dp_size
        self.log.losses.append(summed[0] / dp)
        if not routers:
            return
        L, E = len(routers), routers[0].num_experts
        counts_LE = summed[1 : 1 + L * E].view(L, E)
        aux_L2 = summed[1 + L * E : -1].view(L, 2) / dp
        imbalance = (counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp_min(1e-9)).max()
        self.log.load_imbalance.append(imbalance)
        self.log.lb.append(aux_L2[:, 0].mean())
        self.log.z.append(aux_L2[:, 1].mean())
        self.log.dropped.append(summed[-1])
        self.log.routing_checksum.append(sum(r.step_checksum for r in routers) % CHECKSUM_MODULUS)
        for router, counts_E in zip(routers, counts_LE, strict=True):
            router.update_bias(counts_E)
            router.reset_step_stats()
        experts = [m.experts for m in self.moe_blocks]
        self.log.padding_flops.append(torch.stack([e.step_padding_flops for e in experts]).sum())
        for e in experts:
            e.step_padding_flops.zero_()
        taken = [m.dispatcher.stats.take() for m in self.moe_blocks if isinstance(m.dispatcher, RowwiseDispatch)]
        if taken := [t for t in taken if t is not None]:
            t_L4 = torch.stack(taken)  # layers x (load, capacity use, padding slots, slots)
            self.log.dispatch.append(torch.cat([t_L4[:, :2].max(0).values, t_L4[:, 2:].sum(0)]))

