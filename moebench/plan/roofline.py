"""Roofline estimate of one optimizer step: compute, communication and optimizer time.

Per chunk (see :mod:`moebench.plan.stages`) a stage spends

- compute: model FLOPs (plus the recomputed forward under per-layer recompute; less the
  expert GEMMs of routes dropped over capacity) at
  ``matmul_efficiency`` x the device's dense bf16 peak; in fp8 / mxfp8 modes the quantized
  expert GEMMs (forward and input gradient, in fp8 also the weight gradient) run at the fp8
  peak where the mode runs natively on the device (``precision_impl``), at the bf16 peak
  where it is emulated;
- quantize: the quantize (and, emulated, dequantize) passes of those GEMMs, bound by HBM
  bandwidth (:mod:`moebench.plan.quantized`), in series with the compute;
- EP all-to-all and pipeline sends: exposed (the dispatch sits between router and experts);
- FSDP gathers/reduce-scatters: prefetched, hidden behind the chunk's compute when shorter.

Per step: a pipeline of ``chunks + pp - 1`` chunk slots per micro-batch for 1F1B and
GPipe (``chunks + (pp - 1) / v`` for interleaved 1F1B, ``v`` virtual stages per rank), paced
by the slowest stage; then the DDP gradient reduction, hidden behind the last chunk's
backward where it fits; the distributed optimizer's parameter all-gather (exposed); and the
AdamW update, bound by HBM bandwidth. With ``overlap="none"`` nothing is hidden.

Link model: ranks are numbered ``rank = stage * dp + edp_rank * ep + ep_rank``
(:mod:`moebench.layout`) and fill NVLink domains of consecutive ranks
(``Device.gpus_per_node``: an 8-GPU HGX/DGX node, a 72-GPU NVL72 rack). Every mesh-axis group
is an arithmetic progression of ranks: ``dp`` consecutive ranks from ``stage * dp``; ``ep``
consecutive ranks from ``stage * dp + edp_rank * ep``; ``edp``: ``dp / ep`` ranks ``ep`` apart
from ``stage * dp + ep_rank``; ``pp``: ``pp`` ranks ``dp`` apart from ``dp_rank``.

Placement is EP-aware (:func:`ranks_per_domain`): an EP group that fits in a domain is never
split across two. Where the domain is not a multiple of ``ep`` (EP32 or EP64 in a 72-GPU NVL72
rack), each domain takes only as many ranks as whole EP groups fill (64 of 72) and leaves the
rest of its GPUs idle; the plan says how many domains and idle GPUs that takes. An EP group
larger than a domain (EP128 on NVL72) cannot avoid spanning domains; its ranks fill domains
densely and the cross-domain share of its all-to-all goes over the network. Groups of the
other axes may straddle domain boundaries, each differently; a collective waits for its
slowest member, so the plan takes the worst-placed rank of the worst-placed group. A ring collective whose group spans
domains runs at the per-GPU network bandwidth, else at NVLink bandwidth; an all-to-all sends
its in-domain share over NVLink and the rest over the network at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from moebench.config import Config
from moebench.devices import Device
from moebench.plan.comm import CommTerm
from moebench.plan.precision import Precision
from moebench.plan.quantized import quantized_flops_per_token, traffic_bytes_per_chunk
from moebench.plan.stages import Stage, kept_route_share, micro_batching

# Achievable share of the dense bf16 peak in large matmuls: an assumption, 790e12 of the H100/H200's
# 989e12 datasheet FLOP/s (moebench.devices), not a figure moebench has measured. A calibrated profile
# (`plan --calibrate`) or `--matmul-efficiency` replaces it; `scripts/gpu_check.sh` measures the real
# dense rate, which `--matmul-efficiency-from` plans with (moebench.plan.measured_rate). The one
# home of the figure: the planner's assumptions and `plan --help` quote the source.
DEFAULT_MATMUL_EFFICIENCY = 790 / 989
MIN_MATMUL_EFFICIENCY = 0.01  # the least `--matmul-efficiency` takes
MATMUL_EFFICIENCY_SOURCE = ("790/989 TFLOP/s, an assumed default, not a measurement; a measured one: "
                            "--matmul-efficiency-from (scripts/gpu_check.sh's dense rate) or --profile (a calibration)")
ADAMW_BYTES_PER_PARAM = 28  # reads param, grad, exp_avg, exp_avg_sq (fp32); writes param and both moments
CLIP_BYTES_PER_PARAM = 4  # the gradient norm reads every gradient once


@dataclass(frozen=True)
class RooflineOptions:
    matmul_efficiency: float = DEFAULT_MATMUL_EFFICIENCY
    overlap: str = "default"  # default | none


@dataclass
class StageTime:
    compute_per_chunk_s: float
    quantize_per_chunk_s: float
    ep_per_chunk_s: float
    pp_per_chunk_s: float
    fsdp_exposed_per_chunk_s: float
    # share of the chunk-overlapped FSDP transfer time that is gradient reduce-scatters (the rest:
    # parameter all-gathers), so the exposed part is booked to the phases the trainer counts them in
    fsdp_reduce_share: float
    grad_reduce_exposed_s: float
    after_step_s: float
    optimizer_s: float

    @property
    def chunk_s(self) -> float:
        return (self.compute_per_chunk_s + self.quantize_per_chunk_s + self.ep_per_chunk_s + self.pp_per_chunk_s
                + self.fsdp_exposed_per_chunk_s)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"chunk_s": self.chunk_s}


@dataclass
class Roofline:
    step_time_s: float
    pipeline_s: float
    bottleneck_stage: int
    stages: list[StageTime] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """How ranks fill NVLink domains (see the module docstring)."""

    domain: int  # GPUs in one NVLink domain (Device.gpus_per_node)
    ranks_per_domain: int  # ranks placed in each domain: whole EP groups only, when they fit
    domains: int  # domains the world size takes
    gpus: int  # the GPUs of those domains (the ranks on one domain when they fit in one)


def ranks_per_domain(ep: int, domain: int) -> int:
    """Ranks placed in one NVLink domain of ``domain`` GPUs: the whole EP groups it holds
    (``domain - domain % ep``) when a group fits in it, else all of it."""
    return domain - domain % ep if ep <= domain else domain


def placement(cfg: Config, device: Device) -> Placement:
    p, domain = cfg.parallel, device.gpus_per_node
    per = ranks_per_domain(p.ep, domain)
    domains = -(-p.world_size // per)
    return Placement(domain, per, domains, domains * domain if domains > 1 else p.world_size)


def group_ranks_per_node(cfg: Config, axis: str, domain: int) -> int:
    """Fewest members of one ``axis`` group that any member finds in its own NVLink domain
    (itself included): the group is on NVLink alone when this equals the group size."""
    p = cfg.parallel
    if axis not in ("dp", "ep", "edp", "pp"):
        raise ValueError(f"unknown mesh axis {axis!r}")
    return _fewest_colocated(axis, p.dp, p.ep, p.pp, domain)


@lru_cache(maxsize=4096)
def _fewest_colocated(axis: str, dp: int, ep: int, pp: int, domain: int) -> int:
    # A group's placement depends only on its first rank modulo the domain size, so each
    # generator below stops once the residues repeat (at most ``domain`` values each).
    stages = range(min(pp, domain))
    if axis == "dp":
        stride, n, starts = 1, dp, {s * dp % domain for s in stages}
    elif axis == "ep":
        stride, n, starts = 1, ep, {g * ep % domain for g in range(min(dp * pp // ep, domain))}
    elif axis == "edp":
        stride, n, starts = ep, dp // ep, {(s * dp + r) % domain for s in stages for r in range(min(ep, domain))}
    else:
        stride, n, starts = dp, pp, set(range(min(dp, domain)))
    return min(_fewest_in_a_domain(start, stride, n, domain) for start in starts)


def _fewest_in_a_domain(start: int, stride: int, n: int, domain: int) -> int:
    """Fewest members of ``start + stride * i`` (``i < n``, ``start < domain``) in any domain
    that holds one of them."""
    if n == 1 or stride >= domain:
        return 1

    def members(k: int) -> int:  # of domain k: ranks [k * domain, (k + 1) * domain)
        lo = max(0, -(-(k * domain - start) // stride))
        hi = min(n, -(-((k + 1) * domain - start) // stride))
        return hi - lo

    last = (start + stride * (n - 1)) // domain
    # interior domains repeat with period stride / gcd(stride, domain): checking one period is enough
    period = stride // math.gcd(stride, domain)
    domains = {0, last, *range(1, min(last, 1 + period))}
    return min(members(k) for k in domains)


def comm_time(cfg: Config, device: Device, term: CommTerm) -> float:
    if term.bytes_per_step == 0:
        return 0.0
    n = term.group
    if term.axis == "pp":
        n = cfg.parallel.pp
    g = group_ranks_per_node(cfg, term.axis, ranks_per_domain(cfg.parallel.ep, device.gpus_per_node))
    if term.axis == "ep":
        intra = term.bytes_per_step * (g - 1) / (n - 1)
        inter = term.bytes_per_step - intra
        return max(intra / device.intra_node_bw, inter / device.inter_node_bw)
    bw = device.intra_node_bw if g >= n else device.inter_node_bw
    return term.bytes_per_step / bw


def useful_flops_per_token(cfg: Config, stage: Stage) -> float:
    """Model FLOPs per token of ``stage`` that are computed: routes dropped over capacity skip
    their expert GEMMs (they contribute zero), so neither their time nor their FLOPs count."""
    return stage.flops_per_token - (1 - kept_route_share(cfg)) * stage.expert_flops_per_token


def compute_time_per_chunk(cfg: Config, prec: Precision, device: Device, stage: Stage, opts: RooflineOptions) -> float:
    tokens = micro_batching(cfg).tokens_per_chunk
    flops = useful_flops_per_token(cfg, stage)
    if cfg.parallel.activation_checkpointing == "per-layer":
        # backward re-runs each layer's forward: a third of the layers' FLOPs (head excluded)
        head = 6 * cfg.model.vocab_size * cfg.model.d_model if stage.has_head else 0
        flops += (flops - head) / 3
    fast = quantized_flops_per_token(cfg, prec, stage) if prec.impl == "native" else 0.0
    time = tokens * (flops - fast) / (device.bf16_flops * opts.matmul_efficiency)
    if fast:  # native quantized GEMMs: only on devices with fp8 units (NATIVE_CAPABILITY)
        time += tokens * fast / (device.fp8_flops * opts.matmul_efficiency)
    return time


def stage_time(cfg: Config, prec: Precision, device: Device, stage: Stage, terms: list[CommTerm],
               held_params: float, opts: RooflineOptions) -> StageTime:
    chunks = micro_batching(cfg).chunks_per_step
    compute = compute_time_per_chunk(cfg, prec, device, stage, opts)
    quantize = traffic_bytes_per_chunk(cfg, prec, stage) / device.hbm_bw
    busy = compute + quantize  # the device's own work, behind which transfers can hide
    hide = opts.overlap != "none"
    per_chunk = {"exposed_ep": 0.0, "exposed_pp": 0.0, "chunk": 0.0}
    grad, after, chunk_reduce = 0.0, 0.0, 0.0
    for t in terms:
        seconds = comm_time(cfg, device, t)
        if t.overlap == "chunk":
            per_chunk["chunk"] += seconds / chunks
            if t.phases == ("grad_reduce",):
                chunk_reduce += seconds / chunks
        elif t.overlap == "exposed":
            per_chunk["exposed_ep" if t.axis == "ep" else "exposed_pp"] += seconds / chunks
        elif t.overlap == "backward":
            grad += seconds
        else:
            after += seconds
    backward_last_chunk = 2 / 3 * busy
    return StageTime(
        compute_per_chunk_s=compute,
        quantize_per_chunk_s=quantize,
        ep_per_chunk_s=per_chunk["exposed_ep"],
        pp_per_chunk_s=per_chunk["exposed_pp"],
        fsdp_exposed_per_chunk_s=max(0.0, per_chunk["chunk"] - busy) if hide else per_chunk["chunk"],
        fsdp_reduce_share=chunk_reduce / per_chunk["chunk"] if per_chunk["chunk"] else 0.0,
        grad_reduce_exposed_s=max(0.0, grad - backward_last_chunk) if hide else grad,
        after_step_s=after,
        optimizer_s=held_params * (ADAMW_BYTES_PER_PARAM + CLIP_BYTES_PER_PARAM) / device.hbm_bw,
    )


def step_time(cfg: Config, times: list[StageTime]) -> Roofline:
    p = cfg.parallel
    mb = micro_batching(cfg)
    slowest = max(range(len(times)), key=lambda s: times[s].chunk_s)
    chunk = times[slowest].chunk_s
    if p.pp == 1:
        slots = mb.chunks
    elif p.pp_schedule == "interleaved-1f1b":
        slots = mb.chunks + (p.pp - 1) / p.virtual_stages
    else:
        slots = mb.chunks + p.pp - 1
    pipeline = mb.accum_steps * slots * chunk
    tail = max(t.grad_reduce_exposed_s + t.after_step_s + t.optimizer_s for t in times)
    return Roofline(step_time_s=pipeline + tail, pipeline_s=pipeline, bottleneck_stage=slowest, stages=times)
