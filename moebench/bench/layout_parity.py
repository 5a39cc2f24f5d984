"""The multi-GPU check (``scripts/gpu_check.sh OUT --ranks N``): every parallel layout on N ranks
against one process, with timings.

Each run is ``moebench train --nproc N ... --json`` in its own process (NCCL on GPUs, gloo on
CPU, where the tests run it): the single-process reference first, then fsdp, ddp with expert
parallelism (sync and row-wise dispatch), the distributed optimizer and a 2-stage pipeline, all
on one global batch of 8 sequences, so they compute the same math. A layout passes when its
per-step losses match the reference's within :data:`LOSS_RTOL`.

Why the settings (the parity tests' reasons, ``tests/parallel/test_parallel_parity.py``): fp32, so only
reduction order differs (about 1e-6 of a loss); 1-sequence micro-batches, because the pipeline
splits each micro-batch into ``pp_microbatches`` chunks and the load-balancing loss is not
additive over tokens; the aux-loss-free bias off (``moe.bias_gamma=0``), because its ``sign()``
update turns a last-bit near-tie in top-k into a discrete difference; row-wise at lossless
capacity, so no route drops. A real layout bug (a gradient not averaged, a shard not reduced)
moves the loss by about the lr's step, 1e-3 of it per step here, ten times the tolerance.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from moebench.bench.training_runs import train_record

LOSS_RTOL = 1e-4
BASE = ("model.n_layers=2", "moe.num_experts=8", "moe.top_k=2", "moe.bias_gamma=0", "precision.mode=fp32",
        "train.global_batch_size=8", "train.micro_batch_size=1", "train.lr=1e-3", "train.steps=4",
        "train.warmup_steps=1", "train.profile_steps=0")
RUN_TIMEOUT_S = 120.0


def layouts(ranks: int) -> dict[str, tuple[str, ...]]:
    """Every layout checked on ``ranks`` ranks (an even number, at most 8: the global batch is 8)."""
    ep = ("parallel.ep=2",)
    return {
        "fsdp": ("parallel.strategy=fsdp", f"parallel.dp={ranks}"),
        "ddp_ep_sync": (f"parallel.dp={ranks}", *ep, "parallel.dispatcher=sync"),
        "ddp_ep_rowwise": (f"parallel.dp={ranks}", *ep, "parallel.dispatcher=rowwise", "moe.capacity=lossless"),
        "ddp_dist_opt": (f"parallel.dp={ranks}", "parallel.dist_opt=true"),
        "pp2": ("parallel.pp=2", f"parallel.dp={ranks // 2}", "train.micro_batch_size=2",
                "parallel.pp_microbatches=2"),
    }


def check_ranks(ranks: int) -> None:
    """``--ranks`` must give every layout a whole share of the 8-sequence global batch."""
    if ranks < 2 or ranks > 8 or ranks % 2:
        raise ValueError(f"--ranks {ranks}: the multi-GPU check needs an even number of ranks from 2 to 8")


def train_layout(device: str, nproc: int, settings: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """One ``moebench train`` run of ``BASE + settings`` on ``nproc`` ranks: its losses and
    tokens/s, or its error."""
    cmd = [sys.executable, "-m", "moebench.cli", "train", "--preset", "tiny", "--nproc", str(nproc), "--json"]
    cmd += ["--oversubscribe"] if device == "cpu" and nproc > 1 else []  # CPU ranks may outnumber the cores
    for item in (*BASE, f"train.device={device}", *settings):
        cmd += ["--set", item]
    t0 = time.monotonic()
    record, error = train_record(cmd, timeout_s)
    if record is None:
        return {"error": error}
    return {"losses": record["losses"], "tokens_per_s": record["tokens_per_s"],
            "step_time_median_s": record["step_time_median_s"], "wall_s": time.monotonic() - t0}


def loss_mismatch(got: list[float], want: list[float]) -> str | None:
    """Why ``got`` does not match the reference's losses ``want`` (None when it does)."""
    if len(got) != len(want):
        return f"{len(got)} losses vs the reference's {len(want)}"
    worst = max((abs(g - w) / abs(w), i) for i, (g, w) in enumerate(zip(got, want, strict=True)))
    return None if worst[0] <= LOSS_RTOL else f"step {worst[1]}: loss off by {worst[0]:.1e} (tolerance {LOSS_RTOL:g})"


def section_layouts(ctx: dict[str, Any]) -> dict[str, Any]:
    """The reference, then every layout of :func:`layouts` (``ctx["layouts"]`` may replace them);
    ``ok`` when every layout ran and matched."""
    ranks, device = ctx["ranks"], ctx["device"].type
    chosen = ctx.get("layouts") or layouts(ranks)
    out: dict[str, Any] = {"ranks": ranks, "rtol": LOSS_RTOL,
                           "reference": train_layout(device, 1, (), RUN_TIMEOUT_S)}
    reference = out["reference"]
    for name, settings in chosen.items():
        left = ctx["deadline"] - time.monotonic()
        if "error" in reference or left < 20:
            out[name] = {"skipped": "no reference run" if "error" in reference else "time budget"}
            continue
        run = train_layout(device, ranks, tuple(settings), min(left, RUN_TIMEOUT_S))
        if "error" not in run:
            run["mismatch"] = loss_mismatch(run["losses"], reference["losses"])
            run["vs_reference_tokens_per_s"] = run["tokens_per_s"] / reference["tokens_per_s"]
        out[name] = run
    out["failed"] = [n for n in chosen if "error" in out[n] or out[n].get("mismatch")]
    out["ok"] = "error" not in reference and not out["failed"] and not any("skipped" in out[n] for n in chosen)
    return out


def layout_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The results table's rows: each layout's tokens/s, its ratio to one process and its parity."""
    rows = []
    for name, run in result.items():
        if not isinstance(run, dict) or name == "reference":
            continue
        if "tokens_per_s" not in run:
            rows.append((f"layout {name} ({result['ranks']} ranks)", "-", run.get("error") or run.get("skipped", "")))
            continue
        parity = run["mismatch"] or f"losses match (rtol {LOSS_RTOL:g})"
        rows.append((f"layout {name} ({result['ranks']} ranks)", f"{run['tokens_per_s']:.0f} tok/s",
                     f"{run['vs_reference_tokens_per_s']:.2f}x one process; {parity}"))
    return rows
