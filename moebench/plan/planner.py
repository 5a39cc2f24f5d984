"""Assemble a plan: memory, communication and roofline for one layout, as a run record.

The result uses the run record's field names (:mod:`moebench.record`) with
``"status": "planned"``, so reports can put planned and measured runs side by side.
Whatever only a plan has (breakdowns per stage, assumptions) is under ``"plan"``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from moebench.config import Config
from moebench.devices import (
    NATIVE_ALIGN,
    NATIVE_CAPABILITY,
    TORCH_GROUPED_CAPABILITIES,
    TORCH_VERSION_PINNED,
    Device,
    capability_text,
    get_device,
    torch_serves,
)
from moebench.errors import ConfigError
from moebench.layout import check_physical_layout, validate_layout
from moebench.plan import calibrate, comm, memory, roofline
from moebench.plan.breakdown import planned_breakdown
from moebench.plan.precision import KernelGap, Precision, installed_torch_gap, plan_precision
from moebench.plan.profile import Profile
from moebench.plan.quantized import QUANTIZED_WEIGHT_GRAD
from moebench.plan.stages import Stage, check_capacity, kept_route_share, micro_batching, stages
from moebench.record import derived_metrics, record_header

# Planned peak must leave this share of HBM free: CUDA context, NCCL buffers and allocator
# fragmentation, which the allocator-peak figure the plan predicts does not include.
DEFAULT_MEM_RESERVE = 0.10
# At most this many stage plans (each searched plan x its pipeline stages) per search, and pipeline
# stages per plan: about 0.13 ms and a few KB each, so the bound is some 7 s of planning; 10x the
# largest preset search in docs/plan.md (ultra-2.38t on 4096 gb300: 638 plans, 4,912 stage plans, 0.44 s).
MAX_STAGE_PLANS = 50_000


@dataclass(frozen=True)
class PlanOptions:
    matmul_efficiency: float = roofline.DEFAULT_MATMUL_EFFICIENCY
    matmul_efficiency_source: str = f"default: {roofline.MATMUL_EFFICIENCY_SOURCE}"
    overlap: str = "default"
    mem_reserve: float = DEFAULT_MEM_RESERVE
    profile: Profile | None = None  # calibration factors (moebench plan --profile); None: the roofline
    # why the torch where the plan is made lacks a native kernel, per (format, GEMM kind): the command
    # line passes moebench.kernels.quantized.missing_kernel in (plan imports no torch); None: not asked
    kernel_gap: KernelGap | None = None


def check_gpus(gpus: int) -> None:
    if gpus < 1:
        raise ConfigError(f"--gpus={gpus} must be >= 1")


def apply_world_size(cfg: Config, gpus: int, dp_given: bool, batch_given: bool) -> Config:
    """Return a copy of ``cfg`` laid out on ``gpus`` ranks: ``dp = gpus / pp``.

    Unless the global batch was given, it grows with DP so each rank keeps the preset's
    sequences per step (weak scaling), rounded up to a whole number of micro-batches.
    """
    check_gpus(gpus)
    cfg.validate_sizes()  # before dividing by pp, dp or the micro-batch size
    out = copy.deepcopy(cfg)
    p = out.parallel
    if gpus % p.pp:
        raise ConfigError(f"--gpus={gpus} is not divisible by parallel.pp={p.pp}")
    dp = gpus // p.pp
    if dp_given and p.dp != dp:
        raise ConfigError(f"parallel.dp={p.dp} x parallel.pp={p.pp} != --gpus={gpus}; drop one of them")
    if not batch_given:
        mbs = out.train.micro_batch_size
        per_rank = -(-cfg.train.global_batch_size // (cfg.parallel.dp * mbs)) * mbs
        out.train.global_batch_size = per_rank * dp
    p.dp = dp
    return out


def build_plan(cfg: Config, gpu: str | Device, options: PlanOptions | None = None) -> dict[str, Any]:
    """Plan ``cfg`` (layout in ``cfg.parallel``) on ``gpu``; returns a record-shaped dict."""
    opts = options or PlanOptions()
    if opts.overlap not in ("default", "none"):
        raise ConfigError(f"overlap={opts.overlap!r}; allowed: default, none")
    device = gpu if isinstance(gpu, Device) else get_device(gpu)
    _check_plannable(cfg)
    prec = plan_precision(cfg, None if device.cpu else device)
    mb = micro_batching(cfg)
    ropts = roofline.RooflineOptions(opts.matmul_efficiency, opts.overlap)
    stage_list = stages(cfg)
    stage_rows, times, stage_terms, held = _plan_stages(cfg, prec, device, stage_list, ropts)
    roof = roofline.step_time(cfg, times)
    runnable, not_runnable_reason = moebench_runs(cfg, prec)
    p = cfg.parallel
    breakdown, estimate = _step_estimate(cfg, prec, device, stage_list, stage_terms, held, roof, opts)
    step_time_s = sum(breakdown.values()) if opts.profile is not None else roof.step_time_s
    # useful model FLOPs: routes dropped over capacity are computed by no expert
    dropped = 1 - kept_route_share(cfg)
    flops_per_token = cfg.flops_per_token() - dropped * sum(st.expert_flops_per_token for st in stage_list)
    peak_stage = max(stage_rows, key=lambda r: r["memory_bytes"]["total"])
    peak = peak_stage["memory_bytes"]["total"]
    usable = device.hbm_bytes * (1 - opts.mem_reserve)
    return {
        **record_header(cfg, "planned", "cpu" if device.cpu else "cuda", device.name, prec.mode),
        "precision_impl": prec.impl,
        **derived_metrics(cfg.tokens_per_step, step_time_s, p.world_size, flops_per_token, device.bf16_flops),
        "peak_flops": device.bf16_flops,
        "peak_flops_source": (device.source if device.cpu else
                              f"{device.name} dense bf16 datasheet peak (MFU is against bf16 in every mode)"),
        "step_time_median_s": step_time_s,
        "step_times_s": [],  # no measured samples in a plan
        "warmup_steps": None, "timed_steps": 0,
        "loss_first": None, "loss_last": None,
        "peak_mem_bytes": peak,
        "comm_bytes_per_step": stage_rows[0]["comm_bytes_per_step"],
        "comm_bytes_valid": stage_rows[0]["comm_bytes_valid"],
        "comm_bytes_padding": stage_rows[0]["comm_bytes_padding"],
        "optimizer_state_bytes_per_rank": stage_rows[0]["optimizer_state_bytes"],
        "memory_parts_bytes": stage_rows[0]["memory_parts_bytes"],  # rank 0's stage, as a run records
        "time_breakdown_s": breakdown,
        **cfg.cost_summary(),
        "flops_per_token": flops_per_token,
        "plan": {
            "estimate": estimate,
            "device": {k: getattr(device, k) for k in device.__dataclass_fields__},
            "fits": peak <= usable,
            "moebench_runs": runnable,  # whether moebench's trainer accepts this layout today
            "moebench_rejects": not_runnable_reason,
            "usable_mem_bytes": usable,
            "dropped_route_share": dropped,
            "placement": dataclasses.asdict(roofline.placement(cfg, device)),
            "peak_mem_stage": peak_stage["stage"],
            "bottleneck_stage": roof.bottleneck_stage,
            "pipeline_s": roof.pipeline_s,
            "micro_batching": {"accum_steps": mb.accum_steps, "chunks": mb.chunks,
                               "seqs_per_chunk": mb.seqs_per_chunk, "tokens_per_chunk": mb.tokens_per_chunk},
            "stages": stage_rows,
            "assumptions": assumptions(cfg, device, prec, opts),
        },
    }


def _check_plannable(cfg: Config) -> None:
    """ConfigError unless ``cfg`` is valid, its layout can exist and its stages are few enough to plan."""
    cfg.validate()
    check_physical_layout(cfg)  # pp at most model.n_layers among them
    if cfg.parallel.pp > MAX_STAGE_PLANS:  # each stage is planned: 10^6 of them ran for minutes
        raise ConfigError(f"parallel.pp={cfg.parallel.pp:,}: a plan of more than {MAX_STAGE_PLANS:,} pipeline "
                          "stages is refused (each stage is planned)")
    check_capacity(cfg)


def _plan_stages(cfg: Config, prec: Precision, device: Device, stage_list: list[Stage],
                 ropts: roofline.RooflineOptions
                 ) -> tuple[list[dict[str, Any]], list[roofline.StageTime], list[list[comm.CommTerm]], list[float]]:
    """Each pipeline stage's memory, communication and time: (its row of the plan, its time, its
    communication terms, the parameters whose optimizer moments it holds), stage by stage."""
    stage_rows, times, stage_terms, held = [], [], [], []
    for st in stage_list:
        mem = memory.stage_memory(cfg, prec, st)
        terms = comm.stage_comm(cfg, prec, st)
        held.append(mem.optimizer_moments / 8)
        stage_terms.append(terms)
        t = roofline.stage_time(cfg, prec, device, st, terms, held[-1], ropts)
        times.append(t)
        stage_rows.append({
            "stage": st.index, "layers": st.n_layers, "moe_layers": st.n_moe,
            "params_local": st.params_local, "memory_bytes": mem.as_dict(),
            "optimizer_state_bytes": mem.optimizer_state,
            "memory_parts_bytes": mem.parts(),
            "comm_bytes_per_step": comm.bytes_per_axis(terms),
            "comm_bytes_valid": comm.bytes_per_axis(terms, "valid"),
            "comm_bytes_padding": comm.bytes_per_axis(terms, "padding"),
            "comm_terms": [{"axis": c.axis, "what": c.what, "bytes": c.bytes_per_step, "group": c.group,
                            "overlap": c.overlap, "seconds": roofline.comm_time(cfg, device, c)} for c in terms],
            "flops_per_token": st.flops_per_token, "time_s": t.as_dict(),
        })
    return stage_rows, times, stage_terms, held


def _step_estimate(cfg: Config, prec: Precision, device: Device, stage_list: list[Stage],
                   stage_terms: list[list[comm.CommTerm]], held: list[float], roof: roofline.Roofline,
                   opts: PlanOptions) -> tuple[dict[str, float], dict[str, Any]]:
    """The step's seconds by phase and how they were estimated: the roofline's breakdown of the
    bottleneck stage, or with ``opts.profile`` its calibration factors applied to the stages' features."""
    breakdown = planned_breakdown(cfg, stage_list[roof.bottleneck_stage], roof)
    estimate: dict[str, Any] = {"kind": "roofline", "profile": None}
    if opts.profile is not None:
        p = cfg.parallel
        features = calibrate.phase_features(cfg, prec, device, stage_list, stage_terms, held,
                                            opts.profile.time_sharing(p.world_size))
        breakdown = calibrate.predict_phases(opts.profile.factors, features, opts.matmul_efficiency)
        estimate = {"kind": "calibrated", "profile": opts.profile.path, "fitted_on": opts.profile.fitted_on,
                    "roofline_step_time_s": roof.step_time_s,
                    "roofline_tokens_per_s_per_device": cfg.tokens_per_step / roof.step_time_s / p.world_size}
    return breakdown, estimate


def moebench_runs(cfg: Config, prec: Precision) -> tuple[bool, str | None]:
    """Ask the trainer's own layout rules (:func:`moebench.layout.validate_layout`), and its
    alignment rule for native quantized GEMMs (:data:`moebench.devices.NATIVE_ALIGN`).

    The plan itself refuses only layouts that cannot exist (:func:`moebench.layout.check_physical_layout`);
    moebench's own limits (e.g. fsdp with pipeline stages and EP) are reported here rather than refused,
    so a layout moebench cannot train can still be planned.
    """
    if prec.quantized and prec.impl == "native":
        align = NATIVE_ALIGN[prec.mode]
        m = cfg.model
        dims = {"model.d_model": m.d_model, "moe.expert_hidden": cfg.moe.expert_hidden}
        if prec.linears_quantized:  # every quantized linear's in and out features
            dims |= {"model.n_heads x head_dim": m.n_heads * m.hd, "model.n_kv_heads x head_dim": m.n_kv_heads * m.hd,
                     "model.dense_hidden": m.dense_hidden if m.n_dense_layers else 0,
                     "moe.shared_expert_hidden": cfg.moe.shared_expert_hidden}
        odd = {name: d for name, d in dims.items() if d % align}
        if odd:
            sizes = " and ".join(f"{name} ({d})" for name, d in odd.items())
            return False, (f"precision.mode={prec.mode} runs natively on this GPU and needs {sizes} to be "
                           f"multiples of {align}")
    if cfg.parallel.world_size == 1:
        return True, None
    try:
        validate_layout(cfg)
    except ConfigError as exc:
        return False, str(exc)
    return True, None


def _precision_assumption(prec: Precision) -> str:
    if prec.param_dtype == "bf16":
        return (f"precision {prec.mode}, param_dtype bf16 (OLMo-core's DDP policy; planned only, the trainer "
                "keeps fp32 parameters): bf16 compute weights, bf16 gradients added into fp32 buckets, fp32 main "
                "weights and AdamW moments in the optimizer (sharded with dist_opt)")
    return (f"precision {prec.mode}: fp32 parameters (the master weights; dist_opt keeps a separate fp32 master "
            "shard), fp32 gradients, fp32 AdamW moments; matmuls in the compute dtype under autocast")


def assumptions(cfg: Config, device: Device, prec: Precision, opts: PlanOptions) -> list[str]:
    p = cfg.parallel
    out = [
        estimate_line(opts.profile),
        f"device: {device.name}; {device.source}",
        "peaks: dense (half the sparse datasheet figure); NVLink one direction (half the bidirectional figure)",
        _precision_assumption(prec),
        f"compute at {opts.matmul_efficiency:.0%} of peak ({opts.matmul_efficiency_source}), "
        "elementwise work not modelled separately" + (" (the quantize passes aside)" if prec.quantized else ""),
        "FLOPs per token: 6 x active matmul params + causal attention (seq/2), model FLOPs (no recompute)",
        f"memory: allocator peak = the model state, what the chunks in flight hold and the larger of the loss's "
        f"logits and a GEMM's operands (with any recomputed layer), or the optimizer step's temporaries; "
        f"fits if <= {1 - opts.mem_reserve:.0%} of HBM (rest: context, NCCL, fragmentation)",
        "comm bytes per rank: ring all-reduce 2(n-1)/n B; all-gather/reduce-scatter (n-1)/n B; "
        "all-to-all bytes leaving the rank; pipeline bytes sent; routing balanced",
        "ranks numbered stage*dp + dp_rank, EP groups contiguous; a ring spanning nodes runs at the NIC rate",
    ]
    place = placement_assumption(cfg, device)
    if place:
        out.append(place)
    if opts.overlap == "default":
        out.append("overlap: gradient reduction hidden behind the last chunk's backward, FSDP gathers behind "
                   "each chunk's compute; EP all-to-all and pipeline sends exposed")
    else:
        out.append("overlap: none (every transfer on the critical path)")
    if p.strategy == "fsdp":
        out.append("fsdp: layers gathered in fwd and bwd, root once, gradients reduce-scattered every chunk; "
                   "memory peak: the larger of the last forward's end (no gradient before the step's first "
                   "backward) and a layer's backward (the gradients above it made, the activations below it held)")
    elif p.dist_opt:
        gather = ("bf16: fp32 reduce-scatter + bf16 all-gather, 4 + 2 bytes a parameter" if prec.param_dtype == "bf16"
                  else "reduce-scatter + all-gather move the same bytes as the all-reduce")
        out.append("dist_opt: fp32 master weights + AdamW moments sharded over DP (experts over DP/EP), "
                   f"parameters and gradient buffers stay whole; {gather}")
    if p.pp > 1:
        held = {"gpipe": "all chunks' activations",
                "1f1b": "stage s holds min(chunks, pp - s) chunks' activations"}.get(
            p.pp_schedule, f"{p.virtual_stages} virtual stages a rank, rank r holds (v - 1) x chunks a round + "
                           "2 (pp - 1 - r) + 1 virtual-stage chunks' activations (torch's warm-up)")
        out.append(f"pp: {p.pp_schedule}, each micro-batch split into {p.pp_microbatches} chunks; {held}")
    if p.ep > 1:
        out.append(f"ep: {p.dispatcher} dispatcher; "
                   + (f"{p.rowwise_capacity} capacity ({_capacity_words(cfg)}): "
                      "fixed-size blocks, padding included, on the wire; capacity-sized expert buffers"
                      if p.dispatcher == "rowwise"
                      else "exact rows on the wire after a count exchange"))
    if kept_route_share(cfg) < 1:
        out.append(f"capacity factor {cfg.effective_capacity_factor():g} < 1 under balanced routing: "
                   f"{1 - kept_route_share(cfg):.1%} of the routes are dropped; their expert GEMMs are neither "
                   "computed nor counted in flops_per_token, TFLOP/s or MFU")
    if prec.quantized:
        out.append(_quantized_assumption(device, prec, opts.kernel_gap))
    return out


def placement_assumption(cfg: Config, device: Device) -> str | None:
    """How EP groups sit in NVLink domains, where that is not simply consecutive ranks filling them."""
    ep, domain = cfg.parallel.ep, device.gpus_per_node
    place = roofline.placement(cfg, device)
    if ep > domain:
        return (f"placement: EP{ep} groups are larger than a {domain}-GPU NVLink domain and span "
                f"{-(-ep // domain)} of them; the all-to-all's cross-domain share goes over the network (NIC rate)")
    if place.ranks_per_domain < domain and place.domains > 1:
        return (f"placement: EP{ep} groups kept whole in {domain}-GPU NVLink domains: {place.ranks_per_domain} "
                f"ranks per domain, {domain - place.ranks_per_domain} of its GPUs left idle; {place.domains} domains "
                f"({place.gpus} GPUs) for {cfg.parallel.world_size} ranks")
    return None


def _capacity_words(cfg: Config) -> str:
    if cfg.moe.capacity == "lossless":
        return f"lossless: capacity factor ep = {cfg.effective_capacity_factor():g}, no route dropped"
    return f"capacity factor {cfg.moe.capacity_factor}"


def estimate_line(profile: Profile | None) -> str:
    """What the step time is: the roofline, or the roofline's pieces through a fitted profile."""
    if profile is None:
        return ("estimate: roofline (uncalibrated): the device's peaks and link bandwidths, nothing measured; "
                "moebench plan --profile FILE predicts a measured machine instead")
    points, error = profile.fitted_on.get("points"), profile.fitted_on.get("in_sample_median_abs_error")
    how = (f"{points} points, in-sample median |error| of tokens/s {error:.0%}"
           if isinstance(points, int) and isinstance(error, (int, float)) else "no fit record")
    return (f"estimate: calibrated with profile {profile.path or '(in memory)'} ({how}): each phase = fitted "
            "factors x the roofline's pieces + fitted overheads; --overlap does not apply, --matmul-efficiency "
            "only to a precision the profile did not fit")


def _quantized_assumption(device: Device, prec: Precision, kernel_gap: KernelGap | None = None) -> str:
    """How the trainer runs the quantized GEMMs on ``device``, and what the plan counts for it."""
    mode = prec.mode
    have, need = capability_text(device.compute_capability), capability_text(NATIVE_CAPABILITY[mode])
    why = (f"precision_impl {prec.impl}: {mode} tensor cores need compute capability >= {need}, "
           f"the {device.name} has {have} (the trainer confirms it with a probe)")
    if prec.impl == "native" and not torch_serves(mode, device.compute_capability):
        allowed = capability_text(TORCH_GROUPED_CAPABILITIES[mode])
        why += (f"; torch {TORCH_VERSION_PINNED} allows its native grouped {mode} GEMM only on {allowed}, so on "
                "that torch this layout would run emulated unless its build serves the device")
    which = ("expert GEMMs, attention projections, dense FFNs and shared expert (precision.scope=linear; "
             "router and LM head in bf16)" if prec.linears_quantized else "expert GEMMs (precision.scope=experts)")
    if prec.impl == "native":
        passes = ("forward, input-gradient and weight-gradient" if mode in QUANTIZED_WEIGHT_GRAD
                  else "forward and input-gradient (weight gradients in bf16)")
        how = (f"{passes} {which} at the fp8 peak on E4M3 operands; memory adds the largest GEMM's E4M3 data "
               "+ scales (and the forward weight's K-major bf16 copy being quantized)")
    else:
        how = (f"{which} at the bf16 peak on dequantized bf16 copies, plus the quantize and dequantize "
               "passes (slower than bf16); memory adds the largest GEMM's dequantized copies and E4M3 forms")
    wire = ("forward dispatch rows sent as MXFP8 (E4M3 + E8M0 scales), other EP rows bf16" if mode == "mxfp8"
            else "EP rows stay bf16 (quantized after dispatch)")
    saved = ("the quantized GEMMs save their inputs and weights as E4M3 + scales (precision.saved_activations="
             "quantized)" if prec.saves_quantized else
             "saved tensors as bf16 (precision.saved_activations=compute: the GEMMs save their bf16 operands)")
    gap = installed_torch_gap(prec, kernel_gap)
    here = (f"; on this machine's torch it would run emulated ({gap}): the plan assumes a torch with the kernels"
            if gap else "")
    return (f"{mode}: {why}{here}; {how}; quantize passes at HBM bandwidth (their fp32 intermediates not "
            f"modelled); {saved}; {wire}")
