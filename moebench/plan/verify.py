"""``moebench plan --verify``: the planner's figures for a layout beside a dry run of the real
trainer at that layout (:mod:`moebench.train.dry_run`: fake tensors, a fake process group, one step
per rank position), per rank: memory by part, FLOPs of the step and collective bytes per mesh axis.

Both sides take the same config, the one the dry run executes (:func:`moebench.train.dry_run.dry_config`):
the GPU expert backend and precision, the row-wise dispatcher under EP, and a quantized mode's emulated
implementation. Planned FLOPs are what the roofline computes (model FLOPs of the routes kept, plus the
recomputed forward under per-layer recompute); the dry run counts what runs (docs/plan.md says where
the two differ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moebench.config import Config
from moebench.devices import get_device
from moebench.plan import comm, memory
from moebench.plan.precision import plan_precision
from moebench.plan.roofline import useful_flops_per_token
from moebench.plan.stages import Stage, micro_batching, stages
from moebench.record import MEMORY_PARTS as PARTS
from moebench.record import format_bytes, format_count


def planned_step_flops(cfg: Config, stage: Stage) -> float:
    """FLOPs one rank of ``stage`` computes in a step, as the roofline times them."""
    flops = useful_flops_per_token(cfg, stage)
    if cfg.parallel.activation_checkpointing == "per-layer":
        head = 6 * cfg.model.vocab_size * cfg.model.d_model if stage.has_head else 0
        flops += (flops - head) / 3  # the recomputed forward of the layers (roofline.compute_time_per_chunk)
    mb = micro_batching(cfg)
    return flops * mb.tokens_per_chunk * mb.chunks_per_step


def verify(cfg: Config, gpu: str = "h200") -> dict[str, Any]:
    """Plan and dry-run ``cfg`` (its layout in ``cfg.parallel``); one row per (rank, quantity)."""
    from moebench.train.dry_run import dry_config, run_ranks  # torch: for this command alone

    run_cfg, notes = dry_config(cfg)
    prec = plan_precision(run_cfg, get_device(gpu))
    if prec.quantized:
        prec = dataclasses.replace(prec, impl="emulated")  # what the dry run executes
    stage_list = stages(run_cfg)
    rows: list[dict[str, Any]] = []
    ranks = run_ranks(run_cfg)
    for r in ranks:
        st = stage_list[r.pp_rank]
        mem = memory.stage_memory(run_cfg, prec, st)
        planned_parts = mem.parts()
        where = {"rank": r.rank, "pp_rank": r.pp_rank, "ep_rank": r.ep_rank}
        for part in PARTS:
            rows.append({**where, "quantity": f"memory {part}", "unit": "bytes",
                         "planned": planned_parts[part], "dry_run": r.memory_parts[part]})
        rows.append({**where, "quantity": "memory peak", "unit": "bytes", "planned": mem.total,
                     "dry_run": r.peak_bytes})
        rows.append({**where, "quantity": "FLOPs per step", "unit": "FLOPs",
                     "planned": planned_step_flops(run_cfg, st), "dry_run": r.flops})
        planned_comm = comm.bytes_per_axis(comm.stage_comm(run_cfg, prec, st))
        for axis in sorted(set(planned_comm) | set(r.comm_bytes)):
            rows.append({**where, "quantity": f"{axis} bytes per step", "unit": "bytes",
                         "planned": planned_comm.get(axis, 0.0), "dry_run": r.comm_bytes.get(axis, 0.0)})
    for row in rows:
        row["ratio"] = row["dry_run"] / row["planned"] if row["planned"] else None
    chunks = micro_batching(run_cfg).chunks
    notes = notes + [f"rank {r.rank} ran {r.chunks_run} of its {chunks} pipeline chunks a micro-batch (its warm-up "
                     "and a round of the steady state); FLOPs and ep/pp bytes scaled to all"
                     for r in ranks if r.chunks_run < chunks]
    p = run_cfg.parallel
    return {"preset": cfg.preset, "world_size": p.world_size, "layout": dataclasses.asdict(p),
            "precision": prec.mode, "notes": notes, "rows": rows,
            "seconds": {r.rank: r.seconds for r in ranks}}


def verify_lines(result: dict[str, Any]) -> list[str]:
    """The plan-vs-dry-run table as markdown."""
    p = result["layout"]
    out = [f"{result['preset']} on {result['world_size']} ranks: dp {p['dp']} ep {p['ep']} pp {p['pp']} "
           f"({p['pp_schedule']}), {p['strategy']}{' + dist_opt' if p['dist_opt'] else ''}, "
           f"recompute {p['activation_checkpointing']}, precision {result['precision']}",
           *[f"note: {n}" for n in result["notes"]],
           "", "| rank (pp, ep) | quantity | plan | dry run | dry run / plan |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        fmt = format_bytes if row["unit"] == "bytes" else format_count
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        out.append(f"| {row['rank']} ({row['pp_rank']}, {row['ep_rank']}) | {row['quantity']} | "
                   f"{fmt(row['planned'])} | {fmt(row['dry_run'])} | {ratio} |")
    seconds = ", ".join(f"rank {r}: {s:.1f} s" for r, s in result["seconds"].items())
    out += ["", f"dry run wall time: {seconds}"]
    return out
