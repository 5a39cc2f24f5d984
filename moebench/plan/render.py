"""Text rendering of plans and searches: every number with the assumption behind it."""

from __future__ import annotations

import math
from typing import Any

from moebench.plan.calibrate import TERMS, median_abs_error
from moebench.record import format_bytes, format_count

_MEMORY_NOTES = {
    "params": "fp32 (the master weights unless dist_opt), or bf16 compute weights (param_dtype=bf16)",
    "grads": "fp32 buffers, one per held parameter (+ the reduced shard: dist_opt, fp32 parameters); fsdp: "
             "the shards made by its peak",
    "grads_after_peak": "fsdp: gradient shards made after its peak, held at the optimizer step",
    "master_weights": "fp32 master copy (dist_opt: this rank's shard) beside the parameters",
    "optimizer_moments": "AdamW exp_avg + exp_avg_sq, fp32",
    "compute_weight_copies": "bf16 casts saved for backward (quantized GEMMs: E4M3 + scales when saved so)",
    "quantized_gemm_operands": "largest quantized GEMM: E4M3 + scales (native) or bf16 copies (emulated)",
    "fsdp_unsharded": "at fsdp's peak: the root gathered; in backward also layers gathered (compute dtype) and "
                      "a layer's unsharded and fp32 gradients",
    "activations": "saved for backward, chunks in flight",
    "stage_outputs": "pipeline: a non-last stage's output, kept per chunk in flight until its backward",
    "ep_capacity_buffers": "capacity padding of expert-side buffers",
    "logits_transient": "the loss: fp32 logits copy + gradient (fused: one token chunk's + the head's weight gradient)",
    "optimizer_step_temp": "AdamW step temporaries (dist_opt: sqrt(v) over its largest shard; fused AdamW: none); "
                           "peak takes the larger phase",
    "backward_transient": "fsdp, per-layer recompute: a layer's activation gradients in its backward",
    "recomputed_layer": "per-layer recompute: the layer a backward recomputes, one chunk's (peak: beside the GEMM "
                        "operands or the logits, the larger)",
}


def layout_line(r: dict[str, Any]) -> str:
    p = r["config"]["parallel"]
    return (f"{p['strategy']} dp={p['dp']} ep={p['ep']} pp={p['pp']} dist_opt={'on' if p['dist_opt'] else 'off'} "
            f"recompute={p['activation_checkpointing']} dispatcher={p['dispatcher']} world={r['world_size']}")


def plan_lines(r: dict[str, Any], instead: dict[str, Any] | None = None) -> list[str]:
    plan, mb = r["plan"], r["plan"]["micro_batching"]
    cfg = r["config"]
    stage = plan["stages"][plan["peak_mem_stage"]]
    lines = [
        f"preset           {r['preset']}  (config {r['config_hash']})",
        f"layout           {layout_line(r)}",
        f"device           {r['device_name']}",
        f"estimate         {estimate_text(plan['estimate'])}",
        f"precision        {r['precision']}  precision_impl {r['precision_impl']}",
        f"total params     {format_count(r['total_params'])}",
        f"active params    {format_count(r['active_params'])}",
        f"FLOPs per token  {format_count(r['flops_per_token'])} FLOP (6N + causal attention, seq/2)",
        f"batch            {cfg['train']['global_batch_size']} seqs x {cfg['model']['seq_len']} = "
        f"{format_count(r['tokens_per_step'])} tokens/step; per rank {mb['accum_steps']} micro-batch(es) x "
        f"{mb['chunks']} chunk(s) of {mb['seqs_per_chunk']} seq",
        "",
        f"memory per GPU   stage {stage['stage']} (largest)",
    ]
    for key, note in _MEMORY_NOTES.items():
        value = stage["memory_bytes"][key]
        if value:
            lines.append(f"  {key:<22s} {format_bytes(value):>10s}   {note}")
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    usable = plan["usable_mem_bytes"]
    lines.append(f"  {'total (peak)':<22s} {format_bytes(r['peak_mem_bytes']):>10s}   of "
                 + (f"{format_bytes(usable)} usable -> {verdict}" if math.isfinite(usable)
                    else "a capacity the profile does not know (not checked)"))
    if not plan["moebench_runs"]:
        lines.append(f"  note: moebench's trainer rejects this layout today: {plan['moebench_rejects']}")
    lines.append(f"  optimizer state (record field) {format_bytes(r['optimizer_state_bytes_per_rank'])} "
                 "(fp32 master weights + moments, rank 0)")
    lines += ["", "comm per step    rank 0 (stage 0)                              bytes   seconds  overlap"]
    for term in plan["stages"][0]["comm_terms"]:
        lines.append(f"  {term['axis']:<4s} {term['what']:<52s} {format_bytes(term['bytes']):>10s} "
                     f"{term['seconds']:8.4f}  {term['overlap']}")
    if not plan["stages"][0]["comm_terms"]:
        lines.append("  (none: a single rank per stage)")
    if not plan["fits"]:
        lines += ["", f"no speed: the layout needs {format_bytes(r['peak_mem_bytes'])} per GPU, "
                      f"{format_bytes(usable)} usable"]
        lines += instead_lines(instead)
        lines += ["", "assumptions"] + [f"  - {a}" for a in plan["assumptions"]]
        return lines
    t = plan["stages"][plan["bottleneck_stage"]]["time_s"]
    lines += [
        "",
        f"time per step    slowest stage {plan['bottleneck_stage']}",
        f"  compute per chunk     {t['compute_per_chunk_s'] * 1e3:9.2f} ms  matmuls at the planned peaks",
        f"  quantize / chunk      {t['quantize_per_chunk_s'] * 1e3:9.2f} ms  fp8 quantize/dequantize passes, HBM bound",
        f"  EP all-to-all / chunk {t['ep_per_chunk_s'] * 1e3:9.2f} ms  exposed",
        f"  PP sends / chunk      {t['pp_per_chunk_s'] * 1e3:9.2f} ms  exposed",
        f"  FSDP exposed / chunk  {t['fsdp_exposed_per_chunk_s'] * 1e3:9.2f} ms  beyond the chunk's compute",
        f"  pipeline              {plan['pipeline_s']:9.3f} s   chunks x slots, pipeline bubble included",
        f"  grad reduce exposed   {t['grad_reduce_exposed_s']:9.3f} s   beyond the last chunk's backward",
        f"  after optimizer step  {t['after_step_s']:9.3f} s   dist_opt parameter all-gather",
        f"  optimizer (HBM bound) {t['optimizer_s']:9.3f} s",
        f"  step                  {r['step_time_median_s']:9.3f} s"
        + ("   calibrated: the sum of the phases below (roofline step "
           f"{plan['estimate']['roofline_step_time_s']:.3f} s)" if plan["estimate"]["kind"] == "calibrated" else ""),
        "",
        f"tokens/s per GPU {r['tokens_per_s_per_device']:,.0f}"
        + _idle_words(plan, r["world_size"], r["tokens_per_s_per_device"], ",.0f") + _dropped_words(plan),
        f"TFLOP/s per GPU  {r['tflops_per_device']:.1f}"
        + _idle_words(plan, r["world_size"], r["tflops_per_device"], ".1f", why=False),
        f"MFU              {r['mfu']:.1%} of the "
        + (f"calibration matmul's {r['peak_flops'] / 1e9:.1f} GFLOP/s" if r["device"] == "cpu"
           else f"bf16 dense peak {r['peak_flops'] / 1e12:.0f} TFLOP/s"),
    ]
    if plan["estimate"]["kind"] == "calibrated":
        lines += ["", "calibrated phases (seconds per step)"]
        lines += [f"  {phase:<22s} {seconds * 1e3:9.2f} ms" for phase, seconds in r["time_breakdown_s"].items()
                  if seconds]
    lines += ["", "assumptions"]
    lines += [f"  - {a}" for a in plan["assumptions"]]
    return lines


def _layout_words(p: dict[str, Any], mbs: int) -> str:
    return (f"{p['strategy']} dp={p['dp']} ep={p['ep']} pp={p['pp']} dist_opt={'on' if p['dist_opt'] else 'off'} "
            f"recompute={p['activation_checkpointing']} micro_batch_size={mbs}")


def instead_lines(instead: dict[str, Any] | None) -> list[str]:
    """What fits instead of a layout that does not (:func:`moebench.plan.command.fitting_instead`)."""
    if instead is None:
        return []
    if instead["fits"] is None:
        return [f"  {instead['why']}"]
    where = _layout_words(instead["layout"], instead["micro_batch_size"])
    if not instead["fits"]:
        return [f"  nothing searched fits on these GPUs; the smallest peak is {format_bytes(instead['peak_mem_bytes'])}"
                f" ({where}): more GPUs or a larger one"]
    return [f"  fits instead (the fastest layout of --search that moebench trains): {where}, "
            f"{format_bytes(instead['peak_mem_bytes'])}, {instead['tokens_per_s_per_device']:,.0f} tokens/s per GPU",
            f"  {instead['command']}"]


def _idle_words(plan: dict[str, Any], ranks: int, per_rank: float, fmt: str, why: bool = True) -> str:
    """A per-GPU figure is per rank; where the placement leaves GPUs idle (whole EP groups per NVL72
    rack: 512 ranks on 576 GPUs) it also gives the figure over every GPU the placement occupies."""
    gpus = plan["placement"]["gpus"]
    if gpus <= ranks:
        return ""
    return (f"  per rank; {format(per_rank * ranks / gpus, fmt)} per occupied GPU"
            + (f" ({ranks:,} ranks on {gpus:,} GPUs, {gpus - ranks:,} idle)" if why else ""))


def _dropped_words(plan: dict[str, Any]) -> str:
    """What a tokens/s figure leaves out when the capacity factor drops routes: each dropped route's
    expert work is skipped, so the rate rises as the model does less (0.001: 3x the lossless rate)."""
    share = plan.get("dropped_route_share") or 0
    if share <= 0:
        return ""
    return (f"  NOT comparable with a lossless plan: {share:.1%} of the routes are dropped by the capacity "
            "factor and skip their experts")


def estimate_text(estimate: dict[str, Any]) -> str:
    if estimate["kind"] == "roofline":
        return "roofline (uncalibrated: datasheet peaks and bandwidths; --profile FILE predicts a measured machine)"
    return f"calibrated with profile {estimate['profile']}"


def calibration_lines(profile: Any, points: list[Any], evaluation: dict[str, Any] | None,
                      output: str | None) -> list[str]:
    """The fitted factors with their meaning, the in-sample error and the held-out evaluation."""
    fitted = profile.fitted_on
    device = profile.device
    lines = [f"calibrated on {fitted['points']} points of {len(fitted['stores'])} store(s): {device.name}"
             + (f", {device.bf16_flops / 1e9:.1f} GFLOP/s per rank (the best calibration matmul of the stores), "
                f"{profile.cores} cores" if device.cpu else ""), "",
             f"  {'term':<24s} {'value':>12s}  meaning"]
    for term, spec in TERMS.items():
        if term not in profile.factors:
            continue
        value = profile.factors[term]
        shown = f"{value:10.3g} x" if spec.kind == "efficiency" else f"{value * 1e3:9.3f} ms"
        lines.append(f"  {term:<24s} {shown:>12s}  {spec.meaning}")
    unfitted = [t for t in TERMS if t not in profile.factors]
    lines.append(f"  not in the stores (roofline values): {', '.join(unfitted) if unfitted else 'none'}")
    if device.cpu:
        lines.append("  CPU transfers are priced at 1 GB/s: a transfer factor is seconds per GB (1 / effective GB/s)")
    lines += ["", f"in-sample: median |error| of tokens/s per device {fitted['in_sample_median_abs_error']:.1%} "
              f"(max {fitted['in_sample_max_abs_error']:.1%}) over {fitted['points']} points"]
    if evaluation:
        preds = evaluation["predictions"]
        part = evaluation["profile"].fitted_on
        lines += ["", f"held out ({evaluation['holdout']}): fitted on {part['points']} points (in-sample "
                  f"{part['in_sample_median_abs_error']:.1%}), predicting {len(preds)}:",
                  f"  {'point':<32s} {'ranks':>5s} {'measured':>10s} {'predicted':>10s} {'error':>7s}"]
        for p in preds:
            lines.append(f"  {p.point.label:<32s} {p.point.world_size:>5d} {p.point.tokens_per_s_per_device:>10,.0f} "
                         f"{p.tokens_per_s_per_device:>10,.0f} {p.error:>+7.1%}")
        lines.append(f"  median |error| of tokens/s per device on held-out points: {median_abs_error(preds):.1%}")
    lines.append("")
    lines.append(f"profile written to {output}" if output else "profile not written (-o FILE writes it)")
    return lines


def search_lines(result: Any, gpus: int, top: int, best: dict[str, Any] | None = None) -> list[str]:
    lines = [f"{len(result.ranked)} layouts fit on {gpus} GPUs, {len(result.too_big)} do not fit, "
             f"{len(result.invalid)} invalid; ranked by planned tokens/s per GPU"]
    planned = result.ranked or result.too_big
    if planned:
        lines.append(f"estimate: {estimate_text(planned[0]['plan']['estimate'])}")
        if dropped := _dropped_words(planned[0]["plan"]):  # the capacity factor is the same in every layout
            lines.append(f"tokens/s {dropped.strip()}")
    lines.append("")
    header = f"{'#':>3s}  {'strategy':<8s} {'dp':>4s} {'ep':>4s} {'pp':>3s} {'dist_opt':>8s} {'recompute':>9s} " \
             f"{'mbs':>4s} {'chunks':>6s} {'tok/s/GPU':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak mem':>10s} {'runs':>5s}"
    lines.append(header)
    for i, r in enumerate(result.ranked[:top], 1):
        p, mb = r["config"]["parallel"], r["plan"]["micro_batching"]
        lines.append(f"{i:>3d}  {p['strategy']:<8s} {p['dp']:>4d} {p['ep']:>4d} {p['pp']:>3d} "
                     f"{'on' if p['dist_opt'] else 'off':>8s} {p['activation_checkpointing']:>9s} "
                     f"{r['config']['train']['micro_batch_size']:>4d} {mb['chunks']:>6d} "
                     f"{r['tokens_per_s_per_device']:>10,.0f} {r['tflops_per_device']:>8.1f} {r['mfu']:>6.1%} "
                     f"{format_bytes(r['peak_mem_bytes']):>10s} {'yes' if r['plan']['moebench_runs'] else 'no':>5s}")
    if not result.ranked and result.too_big:
        smallest = result.too_big[0]
        lines.append(f"  nothing fits; the smallest peak is {format_bytes(smallest['peak_mem_bytes'])} "
                     f"({layout_line(smallest)})")
    lines.append("  mbs: sequences per micro-batch; chunks: pipeline chunks per micro-batch (the global batch "
                 "is the same in every row)")
    if any(not r["plan"]["moebench_runs"] for r in result.ranked[:top]):
        lines.append("  runs: whether moebench's trainer accepts the layout today (plan --json gives the reason)")
    if best:
        which = ("#1" if best["rank"] == 1 else
                 f"#1 is not a layout moebench's trainer accepts today; the fastest one it does, #{best['rank']},")
        lines += ["", f"{which} runs with:", f"  {best['command']}"]
    elif result.ranked:
        lines += ["", "no fitting layout is one moebench's trainer accepts today (plan --search --json: the reasons)"]
    shown = result.ranked[:top]
    notes = list(dict.fromkeys(a for r in shown for a in r["plan"]["assumptions"]))
    if notes:
        lines += ["", "assumptions (each row uses those that apply to its layout)"] + [f"  - {a}" for a in notes]
    return lines
