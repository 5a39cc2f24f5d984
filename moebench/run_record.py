"""The run record as a typed value: one dataclass per part, each filled once, and :class:`RunRecord`,
whose :meth:`RunRecord.to_dict` is the JSON object :mod:`moebench.record` documents field by field.

The trainer (:mod:`moebench.train.run`) reduces its measurements over the ranks first, then builds
the parts from the reduced figures; nothing overwrites a field afterwards. What is derived from
other fields (throughput, MFU, useful FLOPs, the reference-normalised rate, tokens per joule) is
derived here, from the parts, with :func:`moebench.record.derived_metrics` the one derivation of
tokens/s -> TFLOP/s -> MFU (the planner's too). No torch: the record's consumers import none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebench.record import Header, derived_metrics, fields_of


@dataclass(frozen=True)
class Setup:
    """What the run is, known before its first step; every record has it, one that ran out of memory too."""

    header: Header
    started_at: str  # ISO time the run began
    warmup_steps: int
    max_warmup_steps: int
    compiled: bool
    total_params: int
    active_params: int
    flops_per_token: int
    precision_impl: str  # native | emulated
    precision_probe_error: str | None
    moe_backend: str
    # what decides whether two runs are comparable (moebench.metrics.environment.run_environment), rank 0's
    env_vars: dict[str, str]  # NCCL_*, TORCH_*, CUDA_* only
    versions: dict[str, Any]
    gpu_topology: str | None  # nvidia-smi topo -m
    driver_version: str | None
    cuda_driver_version: str | None
    gpu_settings: list[dict[str, Any]] | None  # power limits, application clocks, NVLinks per GPU

    def fields(self) -> dict[str, Any]:
        """Its own fields (the header's come first in the record, with the status: :class:`RunRecord`)."""
        own = fields_of(self)
        del own["header"]
        return own


@dataclass(frozen=True)
class Memory:
    """Memory peaks: the largest rank's (``peak_mem_reserved_bytes``: rank 0's)."""

    peak_mem_bytes: int
    peak_mem_reserved_bytes: int | None
    peak_rss_bytes: int


@dataclass(frozen=True)
class Steps:
    """The timed window on the slowest rank (a step lasts as long as its slowest rank) and the warm-up."""

    timed_steps: int
    warmup_steps_used: int
    step_times_s: list[float]
    warmup_step_times_s: list[float]
    compile_s: float | None
    step_time_median_s: float
    step_cpu_times_s: list[float]
    step_cpu_median_s: float | None
    step_ginstructions: list[float] | None
    step_ginstructions_median: float | None
    window_drift: float | None
    window_drifting: bool | None


@dataclass(frozen=True)
class Training:
    """What the steps computed: LM losses, router statistics over every rank and stage, routes."""

    loss_first: float
    loss_last: float
    losses: list[float]
    lb_loss: float | None
    z_loss: float | None
    expert_load_max_over_mean: list[float]
    dropped_tokens: int
    padding_flops_per_step: float
    routing_checksum: int | None
    ep_rank_load_max_over_mean: list[float] | None
    capacity_util_max: float | None
    padded_rows_fraction: float | None


@dataclass(frozen=True)
class PeakFlops:
    """What MFU divides by, and where it came from."""

    peak_flops: float | None
    peak_flops_dtype: str | None
    peak_flops_source: str
    cpu_threads: int | None


@dataclass(frozen=True)
class Throughput:
    """Rates at the median step time, all derived: tokens/s -> TFLOP/s -> MFU, and the same for the
    FLOPs of kept routes only."""

    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None
    mfu_above_peak: bool | None
    useful_flops_per_step: float
    useful_tflops_per_device: float
    useful_mfu: float | None
    tokens_per_cpu_s: float | None  # tokens per step over the step's CPU time (every rank's)
    tokens_per_ginstruction: float | None  # tokens per step over its billions of instructions (train.instructions)

    @classmethod
    def derive(cls, setup: Setup, steps: Steps, training: Training, peak: PeakFlops,
               expert_params: int) -> Throughput:
        h = setup.header
        cpu, instr = steps.step_cpu_median_s, steps.step_ginstructions_median
        return cls(**derived_metrics(h.tokens_per_step, steps.step_time_median_s, h.world_size,
                                     setup.flops_per_token, peak.peak_flops),
                   tokens_per_cpu_s=h.tokens_per_step / cpu if cpu else None,
                   tokens_per_ginstruction=h.tokens_per_step / instr if instr else None,
                   **useful_throughput(setup.flops_per_token, expert_params, h.tokens_per_step, h.world_size,
                                       training.dropped_tokens / steps.timed_steps, steps.step_time_median_s,
                                       peak.peak_flops))


def useful_throughput(flops_per_token: float, expert_params: int, tokens_per_step: int, world_size: int,
                      dropped_per_step: float, step_time_s: float, peak_flops: float | None) -> dict[str, Any]:
    """FLOPs the step computed for kept routes only: the config's FLOPs per token times the
    tokens, less ``6 * expert params`` (forward + backward) for every route dropped over capacity;
    the TFLOP/s and MFU those give at ``step_time_s``. ``tflops_per_device`` / ``mfu`` keep counting
    every route, as the cost model does."""
    useful = flops_per_token * tokens_per_step - dropped_per_step * 6 * expert_params
    per_device = useful / step_time_s / world_size
    return {"useful_flops_per_step": useful, "useful_tflops_per_device": per_device / 1e12,
            "useful_mfu": per_device / peak_flops if peak_flops else None}


@dataclass(frozen=True)
class Reference:
    """The reference GEMM's FLOP/s just before and after the timed window (mean over ranks), and the
    throughput per unit of that measured machine speed."""

    reference_flops_before: float
    reference_flops_after: float
    tokens_per_reference_gflop: float
    reference_drift: float

    @classmethod
    def derive(cls, before: float, after: float, tokens_per_s: float) -> Reference:
        """Tokens/s over the reference GEMM's GFLOP/s (mean of before and after), and how much the
        machine's speed moved across the window."""
        return cls(before, after, tokens_per_s / ((before + after) / 2 / 1e9), after / before)


@dataclass(frozen=True)
class Communication:
    """Bytes per optimizer step and axis (mean over the timed steps), split into rows and padding."""

    comm_bytes_per_step: dict[str, float]
    comm_bytes_valid: dict[str, float]
    comm_bytes_padding: dict[str, float]


@dataclass(frozen=True)
class Breakdown:
    """Where a step's time goes, taken inside the timed steps (:mod:`moebench.train.breakdown`); all
    None (``breakdown_steps`` 0) under ``train.phase_clock=false``. ``profiled_steps``: the extra
    steps run for the trace (0 without ``train.trace``)."""

    time_breakdown_s: dict[str, float] | None
    time_breakdown_max_s: dict[str, float] | None
    time_breakdown_backward_s: dict[str, float] | None
    breakdown_step_s: float | None
    breakdown_steps: int
    comm_s: float | None
    comm_breakdown_s: dict[str, float] | None
    comm_exposed_s: float | None
    profiled_steps: int


@dataclass(frozen=True)
class Probes:
    """What the untimed steps after the profiled ones and the optimizer say about one rank."""

    optimizer_state_bytes_per_rank: int
    memory_parts_bytes: dict[str, int | None]  # rank 0's
    host_syncs_per_step: int | None  # rank 0's; None under train.compile
    host_syncs_by_site: dict[str, int] | None
    trace_files: list[str] | None
    work_per_step: dict[str, Any] | None  # rank 0's first step, counted (moebench.metrics.work); None compiled
    operand_stats: dict[str, dict[str, float]]  # rank 0's weights after the run, by group (metrics.operands)


@dataclass(frozen=True)
class Nvml:
    """The NVML samplers' figures over the timed window, combined over every rank's GPU, and the
    tokens per joule they give; all None without a GPU."""

    nvml_peak_mem_used_bytes: int | None
    nvml_energy_j: float | None
    nvml_sm_clock_mhz_median: float | None
    nvml_throttle_reasons: list[str] | None
    throttled: bool | None
    nvml_interval_s: float | None  # rank 0's sampler's
    nvml_samples: int | None
    nvml_overhead_fraction: float | None
    nvml_devices: list[dict[str, Any]] | None
    tokens_per_joule: float | None

    @classmethod
    def derive(cls, sampled: dict[str, Any], totals: dict[str, Any], setup: Setup, steps: Steps) -> Nvml:
        """``sampled``: this rank's sampler fields; ``totals``: the GPU fields combined over every node
        (:func:`moebench.metrics.nvml.device_totals`), which replace this rank's."""
        fields = {**sampled, **totals}
        return cls(**fields, tokens_per_joule=tokens_per_joule(
            fields["nvml_energy_j"], fields["nvml_devices"], setup.header.tokens_per_step,
            setup.header.world_size, steps.timed_steps))


def tokens_per_joule(energy_j: float | None, devices: list[dict[str, Any]] | None, tokens_per_step: int,
                     world_size: int, timed_steps: int) -> float | None:
    """Tokens the sampled GPUs processed in the timed window per joule NVML measured on them (the
    energy counters cover the same window, summed over ``devices``: every rank's GPU); None
    where there is no energy reading."""
    if not energy_j:
        return None
    return tokens_per_step / world_size * len(devices or []) * timed_steps / energy_j


@dataclass(frozen=True)
class Measured:
    """Everything a run that trained measured (a run that ran out of memory has none of it)."""

    steps: Steps
    throughput: Throughput
    peak: PeakFlops
    reference: Reference
    training: Training
    communication: Communication
    breakdown: Breakdown
    probes: Probes
    nvml: Nvml

    def fields(self) -> dict[str, Any]:
        return {k: v for part in fields_of(self).values() for k, v in fields_of(part).items()}


@dataclass(frozen=True)
class RunRecord:
    """One training run's record: ``status`` ``ok`` or ``diverged`` with every part measured,
    ``oom`` with only the setup, the memory peaks, the wall time and the nodes."""

    setup: Setup
    status: str  # ok | diverged | oom
    error: str | None
    memory: Memory
    measured: Measured | None
    wall_time_s: float
    # every node the ranks ran on, with its GPUs' NVML figures (moebench.train.distributed.rank_nodes)
    nodes: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON writes it (:func:`moebench.record.to_json_line`), its fields as
        :mod:`moebench.record` documents them."""
        return {**self.setup.header.fields(self.status, self.error), **self.setup.fields(),
                **fields_of(self.memory), **(self.measured.fields() if self.measured is not None else {}),
                "wall_time_s": self.wall_time_s, "nodes": self.nodes}
