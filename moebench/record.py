"""The run record: what one training run reports. Trainer writes it; everything
downstream (results store, reports, regression gate, planner) reads only this.

One JSON object per run, schema-versioned. ``moebench train --json`` prints it as the
last line of stdout. The trainer builds it once, as a typed value (:class:`moebench.run_record.RunRecord`:
one dataclass per part, each field below typed there) and writes its ``to_dict()``. Fields (``None``
where a quantity does not apply):

======================================  ===================================================
``schema_version``                      int, :data:`SCHEMA_VERSION`
``status``                              ``ok`` | ``failed`` | ``oom`` | ``timeout`` | ``invalid`` |
                                        ``diverged`` (a loss went NaN or infinite) | ``env_failed``
                                        (the point's process could not start: no python, a full disk)
``error``                               one-line message when status is not ``ok``
``preset`` / ``config`` / ``config_hash`` preset name, fully resolved config dict, its hash
``world_size`` / ``layout``             ranks, and ``{strategy, dp, ep, pp, dispatcher, dist_opt}``
``device`` / ``device_name``            ``cpu`` | ``cuda``; the device model
``precision``                           resolved precision mode (``fp32`` | ``bf16`` | ``fp8`` | ``mxfp8``)
``precision_impl``                      ``native`` | ``emulated``: whether the quantized GEMMs (every kind of
                                        ``precision.scope``) ran on fp8 hardware or as quantize -> dequantize -> bf16
``precision_probe_error``               why a quantized mode runs emulated (the native-kernel probe's
                                        reason: not on CUDA, a torch build without CUDA, the op or
                                        MSLK, the capability, a crash, a disagreement);
                                        None when native or unquantized
``moe_backend``                         what computed the expert GEMMs (``moe.backend=auto`` resolved
                                        for the device: ``cpu_fused`` on CPU, ``grouped_mm`` on GPU;
                                        ``cpu_fused`` off the CPU is ``grouped_mm``; native quantized
                                        GEMMs are ``scaled_grouped_mm`` whatever the backend)
``compiled`` / ``compile_s``            whether the blocks ran under ``torch.compile``
                                        (``train.compile``); seconds the warm-up steps, where they
                                        compile, took beyond as many timed steps (None when eager):
                                        the blocks, and (when it traces) the graph-broken variant
                                        the profiled steps run, in the last warm-up step
``tokens_per_step``                     tokens per optimizer step, counted once per token
``tokens_per_s``                        tokens_per_step / median step time
``tokens_per_s_per_device``             tokens_per_s / world_size
``tflops_per_device``                   flops_per_token * tokens_per_s_per_device / 1e12
``mfu`` / ``peak_flops`` / ``peak_flops_source``  MFU against the bf16 (GPU) or calibrated (CPU) peak
``peak_flops_dtype``                    the dtype of that peak, whatever the run's precision: ``bf16`` on a
                                        GPU (its datasheet dense bf16 peak); on a CPU the calibration
                                        matmul's: ``bf16`` where the CPU has bf16 (its bf16 matmul outruns
                                        fp32), else ``fp32`` (:mod:`moebench.metrics.flops`); None: no peak
``cpu_threads``                         torch threads per rank on a CPU (``OMP_NUM_THREADS``, what the peak's
                                        calibration ran on); None on a GPU
``mfu_above_peak``                      ``mfu`` > 1: the run outran its peak (a noisy or slowed
                                        calibration); flagged, not clipped; None without an MFU
``useful_flops_per_step``               model FLOPs of the kept routes only: ``flops_per_token x tokens_per_step``
                                        less 6 x expert params for each route dropped over capacity
                                        (``dropped_tokens`` per timed step); equal to the former without drops
``padding_flops_per_step``              FLOPs the expert GEMMs spent on padding rows, per timed step, summed over
                                        ranks (not in ``useful_flops_per_step``): only native fp8 computes any, in
                                        its weight gradients' 16-row group alignment
                                        (:func:`moebench.kernels.quantized.padding_flops`); 0 everywhere else
``useful_tflops_per_device`` / ``useful_mfu``  TFLOP/s per device and MFU from ``useful_flops_per_step`` at the
                                        median step time (``tflops_per_device`` / ``mfu`` count every route)
``step_time_median_s`` / ``step_times_s``  median and every timed step (warm-up excluded)
``step_cpu_median_s`` / ``step_cpu_times_s``  median and every timed step's process CPU seconds (every
                                        thread, ``time.process_time``), summed over the ranks: the CPU work a
                                        step cost, which waiting for a core does not lengthen (on a GPU: the
                                        host's part only)
``warmup_step_times_s``                 every warm-up step's time on this rank (rank 0's; not reduced over ranks)
``warmup_steps`` / ``timed_steps``      how many steps were excluded at least / timed
``max_warmup_steps``                    the adaptive warm-up's cap (``train.max_warmup_steps``; 0: fixed)
``warmup_steps_used``                   warm-up steps the run took (``warmup_steps``, or more while the
                                        step time still fell: :mod:`moebench.metrics.steady`)
``window_drift`` / ``window_drifting``  median step time of the timed window's second half / its first
                                        half (1.0: steady; slowest rank's steps); whether it is more than
                                        :data:`WINDOW_DRIFT_LIMIT` from 1 (the window is not steady)
``loss_first`` / ``loss_last`` / ``losses``  LM loss (no aux terms) of the first / last / every step:
                                        mean over the data-parallel ranks (the whole global batch)
``lb_loss`` / ``z_loss``                router losses of the last step: mean over every MoE layer
                                        (all pipeline stages), micro-batch and data-parallel rank
``expert_load_max_over_mean``           per step: max over MoE layers of max routes per expert /
                                        mean (1.0 is balanced), from counts summed over every rank
``dropped_tokens``                      routes dropped over capacity, summed over timed steps, MoE
                                        layers and ranks (each route counted once, by its sender)
``routing_checksum``                    the routes of the timed steps (every MoE layer and data-parallel rank)
                                        as one int below 2**52: the sum of a hash of (step, the token's
                                        index in the global batch, layer, expert) per route
                                        (:mod:`moebench.model.route_keys`), so one process and every
                                        layout that routes the same tokens alike give the same value
                                        (``moe.routing=skewed`` does by construction); None under a
                                        pipeline or without MoE layers
``peak_mem_bytes``                      allocator peak (``torch.cuda.max_memory_allocated``) on
                                        GPU; peak process RSS on CPU
``peak_mem_reserved_bytes``             allocator reserved peak on GPU, else None
``peak_rss_bytes``                      peak resident set size of the process
``total_params`` / ``active_params`` / ``flops_per_token``  from the config's cost model
``comm_bytes_per_step``                 ``{axis: bytes}`` per optimizer step (empty on one rank)
``comm_bytes_valid`` / ``comm_bytes_padding``  ``comm_bytes_per_step`` split, per axis: bytes of rows that
                                        carried a route and bytes of empty slots (the row-wise
                                        dispatcher's fixed-size blocks; 0 on every other axis and
                                        dispatcher); valid + padding = the total, mean over timed steps
``ep_rank_load_max_over_mean``          row-wise EP, per step: max over MoE layers and EP groups of the
                                        rows each EP rank received (kept routes, summed over the step's
                                        micro-batches) max / mean; None under other dispatchers
``capacity_util_max``                   row-wise EP: the largest share of one destination's receive
                                        capacity a dispatch filled (timed steps, every layer and
                                        rank; 1.0 = full, drops possible); None under other dispatchers
``padded_rows_fraction``                row-wise EP: share of the dispatch all-to-all's block slots (every
                                        (source, destination) block, a rank's own included) that
                                        carried no route, over the timed steps; None otherwise
``optimizer_state_bytes_per_rank``      bytes of fp32 master/moment state on one rank
``memory_parts_bytes``                  rank 0's memory by part, ``{parameters, gradients, optimizer_state,
                                        saved_activations, comm_buffers, transient}`` in bytes, measured
                                        in one extra step after the profiled ones
                                        (:mod:`moebench.train.memory_parts` says how each is measured;
                                        ``comm_buffers`` is 0, ``transient`` None on CPU); the plan's
                                        are its first stage's (:func:`moebench.plan.memory.planned_parts`)
``host_syncs_per_step``                 rank 0's Python-level calls that waited on the device (``.item()``,
                                        ``.tolist()``, ``nonzero``, ...: :mod:`moebench.metrics.host_syncs`)
                                        in the memory-parts step, a whole optimizer step; None under
                                        ``train.compile``. ``host_syncs_by_site`` the count per moebench
                                        function and call (e.g. the sync dispatcher's split sizes,
                                        ``moebench.parallel.dispatch.dispatch: tolist``, once per MoE layer
                                        and micro-batch; row-wise dispatch 0; on CPU the fused expert
                                        kernel reads its group sizes, a sync only in name there)
``work_per_step``                       rank 0's first step (step 0, untimed), counted exactly, not timed:
                                        ``{aten_ops, host_syncs, collective_calls: {axis: n},
                                        collective_bytes: {axis: bytes}}`` (:mod:`moebench.metrics.work`);
                                        the same in every run of the same code and config, whatever the
                                        load; ``moebench check`` compares it exactly. None under ``train.compile``
``nvml_*`` / ``throttled``              NVML samplers over the timed window, one per rank on its own
                                        GPU, combined over every GPU of every node: peak memory used
                                        the max, energy (J) the **sum**, SM clock the median of the
                                        GPUs' medians, throttle reasons the union; ``nvml_devices``
                                        each GPU's figures with its rank; sample interval, count and
                                        overhead are rank 0's sampler's; all None without a GPU
``tokens_per_joule``                    tokens the GPUs in ``nvml_devices`` processed in the timed
                                        window / their summed energy; None without NVML energy
``time_breakdown_s``                    ``{phase: seconds per step}`` over :data:`PHASES`, taken inside the
                                        timed steps (:mod:`moebench.train.breakdown`): the median timed
                                        step's (the mean of the two middle ones for an even count), on the
                                        rank that set its time, the step timer's time outside the clock in
                                        ``other``, so the phases add up to ``step_time_median_s``; a rank's
                                        wait for a slower one is inside the collective it waited in;
                                        ``time_breakdown_max_s`` each phase's max over ranks in the same
                                        steps; ``time_breakdown_backward_s`` the backward part of each
                                        phase; None under ``train.phase_clock=false``. Records from before
                                        issue 44 took each phase's median over the timed steps per rank,
                                        ``other`` the rest of the rank's median step, then the mean over
                                        ranks (the mean rank's step, short of the timed median:
                                        docs/report.md); records from before that took them in
                                        ``profiled_steps`` extra steps after the timed ones (with
                                        ``profiled_step_s``, ``breakdown_scale``, ``breakdown_representative``,
                                        ``time_breakdown_scaled_s``, ``comm_exposed_mean_s``: readers accept
                                        all three)
``breakdown_step_s``                    what the phases add up to: the timed median step (the clock's
                                        span of each rank's median step, mean over ranks, in records from
                                        before issue 44); ``breakdown_steps`` how many timed steps the
                                        breakdown was chosen from
``profiled_steps``                      extra steps run after the timed ones for ``train.trace`` (0 without)
``comm_s`` / ``comm_breakdown_s``       seconds per timed step the step spent in collectives (in the median
                                        timed step(s) of the breakdown, mean over ranks; older records: median
                                        over the timed steps): the ``torch.distributed``
                                        ones (gathers, reductions, count exchanges, waits for the gradient
                                        buckets) and the EP token all-to-all of eager steps (both
                                        directions); ``comm_breakdown_s`` the same by the phase they count
                                        in. On CPU (gloo) a collective blocks
                                        the step's thread, so this is the communication the step did not
                                        hide; on CUDA the events on the compute stream time how long that
                                        stream waited. Collectives inside compiled graphs are not timed
``comm_exposed_s``                      the worst rank's ``comm_s``: communication the timed steps did not
                                        hide (on gloo exposed equals taken: collectives block). Old records:
                                        timed median minus the profiled step's compute
``trace_files``                         (``train.trace=true``) each rank's Chrome trace of the profiled
                                        steps (never the timed ones), rank order: ``torch.profiler``
                                        with the phase regions as ``moebench/<phase>`` ranges, the
                                        collectives as ``moebench/comm:<phase>``, each step as
                                        ``moebench/step`` (:mod:`moebench.report.trace` reads them). In a
                                        store relative to its folder (``logs/<point>.ranks/rank<N>.trace.json.gz``);
                                        from ``moebench train`` absolute, under ``$MOEBENCH_TRACE_DIR``
                                        (default ``./traces``); None when tracing is off
``nodes``                               ``[{node, hostname, ranks, nvml_*, throttled}]``: every node the
                                        run's ranks ran on, with its GPUs' NVML figures combined as the
                                        run's are (``nvml_devices``: that node's GPUs; None without NVML)
``operand_stats``                       ``{group: {rms, abs_max, zero_fraction}}`` of the weights rank 0 held after the
                                        run (groups ``experts``, ``router``, ``attention``, ``embeddings``,
                                        ``norms``: :mod:`moebench.metrics.operands`): a GEMM can run faster on
                                        constant or zero operands, so runs compare only if these agree
``reference_flops_before`` / ``after``  FLOP/s of a short reference GEMM (``metrics.flops.reference_flops``)
                                        timed on every rank just before and just after the timed window
                                        (mean over ranks): how fast the machine itself was
``reference_drift``                     ``reference_flops_after / reference_flops_before``
``tokens_per_reference_gflop``          ``tokens_per_s`` per GFLOP/s of the reference GEMM (mean of before and
                                        after): throughput normalised by the machine's measured speed
``tokens_per_cpu_s``                    tokens per step over ``step_cpu_median_s``: tokens per second of CPU time
                                        spent by every rank, a rate that waiting for a core on a loaded machine
                                        does not lower (None without CPU times)
``step_ginstructions`` / ``step_ginstructions_median``  every timed step's instructions in billions
                                        (valgrind's callgrind, ``train.instructions``: one CPU process on one
                                        thread; :mod:`moebench.metrics.instructions`) and their median; None
                                        without it
``tokens_per_ginstruction``             tokens per step over ``step_ginstructions_median``: the clock neither
                                        load nor the host's speed moves (under it the wall and CPU clocks
                                        time valgrind)
``started_at`` / ``wall_time_s``        ISO time the run began; whole run wall time
``env_vars``                            rank 0's ``NCCL_*``, ``TORCH_*`` and ``CUDA_*`` environment variables
                                        (``{name: value}``; no other variable is kept: others can hold
                                        credentials): NCCL's algorithms and transports, torch's and CUDA's
                                        settings change speed without changing the config
``versions``                            ``{moebench, torch, cuda, nccl, triton, python}`` of rank 0's process
                                        (``cuda`` the CUDA torch was built with; None where absent)
``driver_version`` / ``cuda_driver_version``  the NVIDIA driver (NVML) and the newest CUDA it supports
                                        (``12.4``); None without NVML
``gpu_topology``                        ``nvidia-smi topo -m`` on rank 0's node: the GPU/NIC matrix (NVLink
                                        counts, PCIe paths, NUMA affinity); None without nvidia-smi
``gpu_settings``                        every GPU NVML sees on rank 0's node: ``{index, uuid, name,
                                        power_limit_w, enforced_power_limit_w, application_sm_clock_mhz,
                                        application_mem_clock_mhz, nvlinks_active, nvlink_up}`` (``nvlink_up``:
                                        each link by number, true up, false down, null unanswered; a fact
                                        the GPU does not report is None); None without NVML. NCCL's
                                        channel count is not readable from outside NCCL: ``env_vars``
                                        keeps the ``NCCL_*`` variables that bound it where they are set
======================================  ===================================================

:data:`METRICS` is the one spec of every scalar metric (record fields and the ones reports
derive from them): label, unit, which way is better, how a table formats it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moebench.config import Config, ParallelConfig

# Bumped when a field's meaning changes or readers need a field older records cannot have; the
# store's reader upgrades older records one version at a time (:mod:`moebench.results.migrate`).
SCHEMA_VERSION = 2

# Records from before the timed-step breakdown took it in a profiled step, which synchronised at
# every mark; beyond this relative difference from the timed median its breakdown does not describe
# the timed step (their ``breakdown_representative``; the report says so instead of explaining with it).
REPRESENTATIVE_TOLERANCE = 0.15

# The phases of a step in ``time_breakdown_s`` (the planner uses the same keys). Forward and
# backward of each region count together; ``time_breakdown_backward_s`` has the backward part.
PHASES = (
    "attention",  # attention block: its norm, QKV/O projections, scores, residual
    "router",  # the MoE block's norm and router (top-k, aux losses)
    "dispatch",  # permute + all-to-all of token rows to the experts (EP count exchange included)
    "experts",  # routed-expert GEMMs (with gather and combine when a fused CPU kernel does all three)
    "combine",  # rows back to tokens, weighted sum (and their all-to-all under EP)
    "dense",  # dense FFN layers and the shared expert
    "head_loss",  # final norm, LM head, loss
    "grad_reduce",  # gradient all-reduce / reduce-scatter (in backward or after it)
    "param_gather",  # parameter all-gathers: FSDP per block, the sharded optimizer's updated shards
    "optimizer",  # clipping and the AdamW step
    "pipeline_bubble",  # a pipeline rank waiting for its next chunk (p2p transfers included)
    "other",  # embedding, statistics, anything outside the regions above
)

# Profiler range names under ``train.trace`` (:mod:`moebench.model.phases` opens them, the torch-free
# :mod:`moebench.report.trace` reads them): ``moebench/<phase>`` regions, ``moebench/comm:<phase>``
# around each collective, ``moebench/step`` around each profiled step.
TRACE_RANGE_PREFIX = "moebench/"
TRACE_COMM_RANGE = "comm:"
TRACE_STEP_RANGE = TRACE_RANGE_PREFIX + "step"

# The parts of ``memory_parts_bytes`` (:mod:`moebench.train.memory_parts` measures them, the planner
# emits the same keys: :func:`moebench.plan.memory.planned_parts`).
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "saved_activations", "comm_buffers", "transient")

REQUIRED_FIELDS = (
    "schema_version", "status", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
    "mfu", "step_time_median_s", "step_times_s", "loss_first", "loss_last", "peak_mem_bytes",
    "total_params", "active_params", "flops_per_token", "config",
)


def fields_of(part: Any) -> dict[str, Any]:
    """A record part (a dataclass) as the record's fields: its own fields by name, in order, values as
    they are (no copies: the record's lists and dicts are the part's)."""
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}


def layout_of(p: ParallelConfig) -> dict[str, Any]:
    """A record's ``layout``: the parallel layout the run ran under."""
    return {"strategy": p.strategy, "dp": p.dp, "ep": p.ep, "pp": p.pp, "dispatcher": p.dispatcher,
            "dist_opt": p.dist_opt}


@dataclass(frozen=True)
class Header:
    """The fields every record starts with, measured or planned, after its status: what ran (the
    config and its layout), where, at which precision."""

    preset: str | None
    config: dict[str, Any]
    config_hash: str
    world_size: int
    layout: dict[str, Any]  # {strategy, dp, ep, pp, dispatcher, dist_opt}
    device: str  # cpu | cuda
    device_name: str
    precision: str  # the resolved mode
    tokens_per_step: int

    @classmethod
    def of(cls, cfg: Config, device: str, device_name: str, precision: str) -> Header:
        p = cfg.parallel
        return cls(preset=cfg.preset, config=cfg.to_dict(), config_hash=cfg.hash(), world_size=p.world_size,
                   layout=layout_of(p),
                   device=device, device_name=device_name, precision=precision, tokens_per_step=cfg.tokens_per_step)

    def fields(self, status: str, error: str | None = None) -> dict[str, Any]:
        """The record's first fields: schema version, ``status`` and ``error``, then this header's."""
        return {"schema_version": SCHEMA_VERSION, "status": status, "error": error, **fields_of(self)}


def record_header(cfg: Config, status: str, device: str, device_name: str, precision: str) -> dict[str, Any]:
    """The fields every record starts with, measured (``ok``...) or planned (``planned``)."""
    return Header.of(cfg, device, device_name, precision).fields(status)


def derived_metrics(tokens_per_step: int, step_time_s: float, world_size: int, flops_per_token: float,
                    peak_flops: float | None) -> dict[str, float | bool | None]:
    """Tokens/s, TFLOP/s and MFU per device at ``step_time_s``, for measured runs and plans alike;
    ``mfu_above_peak`` flags an MFU above 1 (the peak's calibration was noisy or slowed), kept as
    measured rather than clipped."""
    tokens_per_s = tokens_per_step / step_time_s
    per_device = tokens_per_s / world_size
    flops_per_device = flops_per_token * per_device
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": (mfu := flops_per_device / peak_flops if peak_flops else None),
        "mfu_above_peak": None if mfu is None else mfu > 1.0,
    }


def settled_status(status: str, record: dict[str, Any], error: str | None = None) -> tuple[str, str | None]:
    """The (status, error) a run is read as, the one place that decides "diverged": an ``ok`` run whose
    loss went NaN or infinite (:func:`_divergence`) is ``diverged``, with why; any other status stands
    with its ``error``. The trainer (``train/run.py``), the sweep (``sweep/launch.py``) and every reader
    of a store (``results/settle.py``) call it, so a run is never ok in one and diverged in another."""
    if status == "ok" and (why := _divergence(record)) is not None:
        return "diverged", why
    return status, error


def _divergence(record: dict[str, Any]) -> str | None:
    """Why an ``ok`` run did not train: the first step whose LM loss is NaN or infinite (None
    after a JSON round trip, which has no NaN), else None; :func:`settled_status` turns it into the
    run's status."""
    losses = record.get("losses")
    steps = list(losses) if isinstance(losses, (list, tuple)) else []
    for step, loss in enumerate(steps, start=1):
        if not (isinstance(loss, (int, float)) and math.isfinite(loss)):
            return f"loss is {'missing' if loss is None else loss} at step {step} of {len(steps)} (the run diverged)"
    for name in ("loss_first", "loss_last"):
        if name in record and not (isinstance(record[name], (int, float)) and math.isfinite(record[name])):
            return f"{name} is {record[name]} (the run diverged)"
    return None


def dropped_share(record: dict[str, Any]) -> float | None:
    """Dropped routes over all routes of a record's timed steps (the report's ``dropped_fraction``,
    :func:`moebench.results.table.dropped_fraction`, for one record); None when it routes nothing
    or a field is missing."""
    cfg = record.get("config") or {}
    model, moe = cfg.get("model") or {}, cfg.get("moe") or {}
    try:
        n_moe = int(model["n_layers"]) - int(model.get("n_dense_layers") or 0)
        routes = int(record["tokens_per_step"]) * int(moe["top_k"]) * n_moe * int(record["timed_steps"])
        dropped = int(record["dropped_tokens"])
    except (KeyError, TypeError, ValueError):
        return None
    return dropped / routes if routes > 0 else None


def to_json_line(record: dict[str, Any]) -> str:
    """One line of JSON (no NaN: JSON has none; non-finite floats become null)."""
    return json.dumps(finite(record), separators=(",", ":"), sort_keys=True)


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, infinity) nested in it replaced by None,
    since JSON has neither; tuples become lists, as JSON writes them anyway."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


Direction = Literal["higher", "lower"]
# How a table cell shows a value (:func:`format_value`): ``int`` 12,345; ``count`` 1.23 M; ``f`` 3 significant
# digits below 1,000; ``pct`` a fraction as 41.2%; ``bytes`` 612 MiB or 1.50 GiB; ``ms`` seconds as ms; ``x`` 1.25x;
# ``tflops`` a rate stored in TFLOP/s, shown in the unit that fits: 37.5 GFLOP/s on a CPU, 412 TFLOP/s on a GPU;
# ``ranks`` a world size: 1 rank, 8 ranks.
FmtKind = Literal["int", "count", "f", "pct", "bytes", "ms", "x", "tflops", "ranks"]
Clock = Literal["wall", "cpu", "instructions"]
# Each clock's record fields: a point's per-run samples (a folded table's), a run's samples, their median.
CLOCK_FIELDS: dict[str, tuple[str, str, str]] = {
    "wall": ("step_runs", "step_times_s", "step_time_median_s"),
    "cpu": ("cpu_step_runs", "step_cpu_times_s", "step_cpu_median_s"),
    "instructions": ("instruction_step_runs", "step_ginstructions", "step_ginstructions_median"),
}

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = ("", "K", "M", "B", "T")
_FLOP_RATE_UNITS = ("FLOP/s", "KFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s")


def _unit(value: float, base: int, units: tuple[str, ...]) -> tuple[float, str]:
    """(``base ** i``, ``units[i]``) for the largest ``i`` with ``|value| >= base ** i`` (the last unit caps)."""
    i = 0
    while i < len(units) - 1 and abs(value) >= base ** (i + 1):
        i += 1
    return base**i, units[i]


def byte_unit(value: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit that shows ``value`` bytes with 1 to 1023 before the point,
    so a tiny model's 3 MiB of traffic is not 0.00 GiB and an H200's 140 GiB is not 150,323,855,360."""
    return _unit(value, 1024, _BYTE_UNITS)


def count_unit(value: float) -> tuple[float, str]:
    """(divisor, suffix) of the decimal unit for a count such as parameters: K, M, B (billion), T."""
    return _unit(value, 1000, _COUNT_UNITS)


def flop_rate_unit(value: float) -> tuple[float, str]:
    """(divisor, name) of the decimal unit that shows ``value`` FLOP/s with 1 to 999 before the point:
    a CPU's 37.5 GFLOP/s is not 0.04 TFLOP/s."""
    return _unit(value, 1000, _FLOP_RATE_UNITS)


def format_flop_rate(value: float) -> str:
    """``37.5 GFLOP/s``, ``412 TFLOP/s``: the one way reports show a FLOP rate (``value`` in FLOP/s)."""
    return _scaled(value, *flop_rate_unit(value))


def _scaled(value: float, divisor: float, unit: str) -> str:
    x = value / divisor  # three significant digits, none after the point for whole bytes or counts
    digits = 0 if (divisor == 1 and float(x).is_integer()) or abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return f"{x:.{digits}f} {unit}".rstrip()


def format_bytes(value: float) -> str:
    """``612 MiB``, ``1.50 GiB``, ``512 B``: the one way reports, ``check`` and ``plan`` show bytes."""
    return _scaled(value, *byte_unit(value))


def format_count(value: float) -> str:
    """``1.23 M``, ``4.50 B``, ``950``: counts such as parameters, scaled to thousands, millions, billions."""
    return _scaled(value, *count_unit(value))


def format_value(value: float, kind: FmtKind | str) -> str:
    """``value`` as a table shows a metric of format ``kind`` (see :data:`FmtKind`)."""
    if kind == "ms":
        return format_value(value * 1e3, "f")
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "count":
        return format_count(value)
    if kind == "tflops":
        return format_flop_rate(value * 1e12)
    if kind == "ranks":
        return f"{value:,.0f} rank" + ("" if value == 1 else "s")
    if kind == "bytes":
        return format_bytes(value)
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "x":
        return f"{value:.2f}x"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def metric_kind(name: str) -> FmtKind:
    """The format of a metric: the spec's, or by suffix for a field outside it (``*_bytes``: bytes)."""
    if name in METRICS:
        return METRICS[name].fmt
    return "bytes" if name.endswith("_bytes") else "ms" if name.endswith("_s") else "f"


@dataclass(frozen=True)
class Metric:
    """What reports, plots, the status line and the regression gate know about one scalar metric."""

    name: str  # record field, or report column for a derived metric
    label: str  # what it measures, for plot axes and legends: "tokens/s per device"
    header: str  # short name for table columns and the sweep status line: "tokens/s/dev"
    unit: str  # of the value as stored (not as shown): "bytes", "s", "nats"...
    # Which way is better; None: no built-in one, so ``moebench check`` wants a sign (``--metric NAME:+5%``)
    # unless the name ends in ``_bytes`` or ``_s``.
    direction: Direction | None
    fmt: FmtKind
    # A monotone function of the step time: its noise is the step-time noise, so the gate runs
    # its rank test on the step-time samples.
    from_step_time: bool = False
    # Which clock's per-step samples it is a function of (:data:`CLOCK_FIELDS`): wall time, or the
    # CPU time every rank's process spent in the step.
    clock: Clock = "wall"
    derived: bool = False  # computed by the report from record fields, not written by the trainer


# A timed window whose second-half median step time is more than this fraction away from its
# first half's (``window_drift``) is not steady: its median depends on the window's length.
WINDOW_DRIFT_LIMIT = 0.10


def window_drifting(drift: float | None) -> bool | None:
    """Whether a window with this ``window_drift`` drifts beyond :data:`WINDOW_DRIFT_LIMIT` (None: no drift)."""
    return None if drift is None else abs(drift - 1.0) > WINDOW_DRIFT_LIMIT


# A run whose reference GEMM (timed just before and just after its window) ran more than this
# fraction slower or faster at the end than at the start ran on a machine that changed under it:
# on these shared machines a co-tenant arriving or leaving moves it by 2-4x, a steady machine by
# a few percent.
REFERENCE_DRIFT_LIMIT = 0.25


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0 else None


def unsteady(record: Any) -> str | None:
    """Why a run's timed window cannot stand for its speed, or None when it can: its window drifted past
    :data:`WINDOW_DRIFT_LIMIT`, or the machine's own speed moved past :data:`REFERENCE_DRIFT_LIMIT`."""
    drift = _finite(record.get("window_drift"))
    if drift is not None and window_drifting(drift):
        return f"timed window drifted {drift:.2f}x"
    ref = _finite(record.get("reference_drift"))
    if ref is not None and abs(math.log(ref)) > math.log1p(REFERENCE_DRIFT_LIMIT):
        return f"the machine's reference GEMM ran {ref:.2f}x as fast after the window as before"
    return None


_RECORD = (
    Metric("tokens_per_s", "tokens/s", "tok/s", "tokens/s", "higher", "int", from_step_time=True),
    Metric("tokens_per_s_per_device", "tokens/s per device", "tokens/s/dev", "tokens/s", "higher", "int",
           from_step_time=True),
    Metric("tflops_per_device", "model FLOP/s per device", "FLOP/s/dev", "TFLOP/s", "higher", "tflops",
           from_step_time=True),
    Metric("mfu", "MFU", "MFU", "fraction of peak", "higher", "pct", from_step_time=True),
    # MFU of the routes kept under capacity: a point that drops routes does less work than its ``mfu`` counts
    Metric("useful_mfu", "MFU of the kept routes (dropped routes' FLOPs not counted)", "useful MFU",
           "fraction of peak", "higher", "pct", from_step_time=True),
    Metric("step_time_median_s", "median step time", "step ms", "s", "lower", "ms", from_step_time=True),
    Metric("loss_first", "first LM loss", "first loss", "nats", "lower", "f"),
    Metric("loss_last", "final LM loss", "loss", "nats", "lower", "f"),
    Metric("peak_mem_bytes", "allocator peak", "peak mem", "bytes", "lower", "bytes"),
    Metric("peak_mem_reserved_bytes", "allocator reserved", "reserved mem", "bytes", "lower", "bytes"),
    Metric("peak_rss_bytes", "process RSS", "RSS", "bytes", "lower", "bytes"),
    Metric("dropped_tokens", "dropped routes", "dropped", "routes", "lower", "int"),
    Metric("total_params", "parameters", "params", "parameters", None, "count"),
    Metric("active_params", "active parameters per token", "active params", "parameters", None, "count"),
    Metric("flops_per_token", "model FLOP per token", "FLOP/token", "FLOP", None, "int"),
    Metric("tokens_per_step", "tokens per optimizer step", "tokens/step", "tokens", None, "int"),
    Metric("nvml_peak_mem_used_bytes", "NVML device peak", "NVML peak", "bytes", "lower", "bytes"),
    # A sampler setting, not a result: no direction (the gate's ``*_s`` default still applies).
    Metric("nvml_interval_s", "NVML sample interval", "NVML interval ms", "s", None, "ms"),
    Metric("nvml_energy_j", "NVML energy", "energy J", "J", "lower", "f"),
    Metric("tokens_per_joule", "tokens per joule per device (NVML energy)", "tok/J", "tokens/J", "higher", "f"),
    # Steadiness of the timed window, not a result: no direction.
    Metric("window_drift", "timed window drift (second-half / first-half median step)", "drift", "x", None, "x"),
    Metric("tokens_per_reference_gflop", "tokens/s per GFLOP/s of the reference GEMM", "tok/s/ref GFLOP/s",
           "tokens/s per GFLOP/s", "higher", "f"),
    Metric("tokens_per_cpu_s", "tokens per CPU-second (every rank's process CPU time)", "tok/CPU-s",
           "tokens per CPU-s", "higher", "int", from_step_time=True, clock="cpu"),
    Metric("tokens_per_ginstruction", "tokens per billion instructions (callgrind, train.instructions)",
           "tok/G instr", "tokens per G instructions", "higher", "f", from_step_time=True, clock="instructions"),
    Metric("host_syncs_per_step", "host syncs per step (untimed step, rank 0)", "host syncs", "calls", "lower",
           "int"),
    Metric("compile_s", "compile time (warm-up, outside the timed window)", "compile s", "s", "lower", "f"),
)
_DERIVED = (
    Metric("comm_bytes_total", "communicated bytes per optimizer step, rank 0", "comm/step", "bytes", "lower",
           "bytes", derived=True),
    Metric("load_imbalance", "expert load max/mean", "load imbalance", "x", "lower", "x", derived=True),
    Metric("load_imbalance_max", "worst step's expert load max/mean", "worst load imbalance", "x", "lower", "x",
           derived=True),
    Metric("speedup", "speedup", "speedup", "x", "higher", "x", derived=True),
    # Noise and equal work, next to every comparison (moebench.results.stats, .table).
    Metric("step_time_cv", "step-time spread (std / mean)", "step CV", "fraction", "lower", "pct", derived=True),
    Metric("dropped_fraction", "dropped share of routes (timed steps)", "dropped/routes", "fraction of routes",
           "lower", "pct", derived=True),
    # Equal results: a faster point whose loss rose beyond its tolerance did not train like its baseline
    # (report.pairing).
    Metric("loss_delta", "change of the mean LM loss over the last steps, over the baseline's", "loss change",
           "fraction", None, "pct", derived=True),
    # Pairing ratios the gate has no built-in direction for.
    Metric("mem_ratio", "allocator peak over the baseline's", "mem ratio", "x", None, "x", derived=True),
    Metric("comm_ratio", "communicated bytes over the baseline's", "comm ratio", "x", None, "x", derived=True),
)
# Every scalar metric by name; record fields first, in the order reports write them.
METRICS: dict[str, Metric] = {m.name: m for m in (*_RECORD, *_DERIVED)}
