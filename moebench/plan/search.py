"""Enumerate the layouts a config can run on N GPUs and rank them by planned throughput.

Searched: strategy (``ddp``; ``fsdp`` without EP, the FSDP baseline), ``pp`` (divisors of N
up to the layer count), ``ep`` (divisors of the expert count that divide ``dp = N / pp``),
the distributed optimizer (ddp with ``dp > 1``), per-layer recompute, and how a rank's
sequences per step are cut into micro-batches and pipeline chunks
(:func:`micro_batchings`; the global batch stays fixed). Dispatcher, pipeline schedule and
precision stay as configured.

The enumeration is bounded by the model, not by N: at most ``n_layers`` pipeline depths, the
divisors of the expert count, and a logarithmic number of micro-batchings per layout. A plan's
work and memory grow with its pipeline stages (one row per stage), so the search counts its
stage plans (plans x stages) before planning any and refuses more than
:data:`MAX_STAGE_PLANS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moebench.config import Config
from moebench.devices import Device
from moebench.errors import ConfigError
from moebench.layout import divisors
from moebench.plan.planner import MAX_STAGE_PLANS, PlanOptions, apply_world_size, build_plan, check_gpus

# chunk counts per micro-batch tried under pp > 1, in multiples of pp (plus the one-flush maximum)
PP_CHUNK_MULTIPLES = (1, 2, 4)


def candidate_layouts(cfg: Config, gpus: int) -> list[dict[str, Any]]:
    """The ``cfg.parallel`` fields of every searched layout on ``gpus`` ranks."""
    out = []
    for pp in (d for d in divisors(gpus) if d <= cfg.model.n_layers):
        dp = gpus // pp
        for recompute in ("none", "per-layer"):
            base = {"pp": pp, "activation_checkpointing": recompute}
            out.append({**base, "strategy": "fsdp", "ep": 1, "dist_opt": False})
            for ep in divisors(cfg.moe.num_experts):
                if dp % ep:
                    continue
                for dist_opt in ((False, True) if dp > 1 else (False,)):
                    out.append({**base, "strategy": "ddp", "ep": ep, "dist_opt": dist_opt})
    return out


def micro_batchings(cfg: Config) -> list[dict[str, int]]:
    """``micro_batch_size`` / ``pp_microbatches`` pairs to try for a laid-out ``cfg``, the
    configured pair first; each keeps the rank's sequences per step (the global batch) fixed.

    Without pp: micro-batches of 1, 2, 4, ... sequences and the whole step's (larger ones hide
    more of the gradient reduction and gather FSDP weights less often, but hold more
    activations). With pp: chunks of one sequence (the least memory; the roofline's bubble
    depends on the chunk count, not the chunk size), ``pp``, ``2 pp``, ``4 pp`` of them per
    micro-batch, or all of the step's in one micro-batch: one pipeline flush per step.
    """
    p, t = cfg.parallel, cfg.train
    configured = {"micro_batch_size": t.micro_batch_size, "pp_microbatches": p.pp_microbatches}
    if t.global_batch_size % p.dp:
        return [configured]
    seqs = t.global_batch_size // p.dp  # per rank per optimizer step
    if p.pp == 1:
        sizes = [1 << i for i in range(seqs.bit_length()) if seqs % (1 << i) == 0] + [seqs]
        out = [{"micro_batch_size": m, "pp_microbatches": p.pp_microbatches} for m in sizes]
    else:
        chunks = [k * p.pp for k in PP_CHUNK_MULTIPLES] + [seqs]
        out = [{"micro_batch_size": n, "pp_microbatches": n} for n in chunks if seqs % n == 0]
    unique = {tuple(mb.values()): mb for mb in [configured, *out]}
    return list(unique.values())


def with_layout(cfg: Config, layout: dict[str, Any]) -> Config:
    """``cfg`` with the ``parallel`` fields of ``layout`` and its ``micro_batch_size``, if any."""
    parallel = {k: v for k, v in layout.items() if k != "micro_batch_size"}
    train = dataclasses.replace(cfg.train, micro_batch_size=layout.get("micro_batch_size", cfg.train.micro_batch_size))
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel), train=train)


@dataclass
class SearchResult:
    ranked: list[dict[str, Any]]  # plans that fit, fastest first
    too_big: list[dict[str, Any]]  # plans that do not fit, smallest peak first
    invalid: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # layout, reason


def search(cfg: Config, gpus: int, gpu: str | Device, batch_given: bool,
           options: PlanOptions | None = None) -> SearchResult:
    # a wrong GPU count or size is the user's error, not one invalid layout per candidate
    check_gpus(gpus)
    cfg.validate_sizes()
    fits, too_big, invalid = [], [], []
    work = []
    for layout in candidate_layouts(cfg, gpus):
        try:
            # the global batch of the configured micro-batch size, then held fixed
            laid_out = apply_world_size(with_layout(cfg, layout), gpus, dp_given=False, batch_given=batch_given)
        except ConfigError as exc:
            invalid.append((layout, str(exc)))
            continue
        work.append((layout, laid_out, micro_batchings(laid_out)))
    check_search_size(work, gpus)
    for layout, laid_out, mbs in work:
        for mb in mbs:
            try:
                plan = build_plan(with_layout(laid_out, mb), gpu, options)
            except ConfigError as exc:
                invalid.append(({**layout, **mb}, str(exc)))
                continue
            (fits if plan["plan"]["fits"] else too_big).append(plan)
    fits.sort(key=lambda r: -r["tokens_per_s_per_device"])
    too_big.sort(key=lambda r: r["peak_mem_bytes"])
    return SearchResult(fits, too_big, invalid)


def check_search_size(work: list[tuple[dict[str, Any], Config, list[dict[str, int]]]], gpus: int) -> None:
    """Refuse, before planning any, a search of more than :data:`MAX_STAGE_PLANS` stage plans."""
    plans = sum(len(mbs) for _, _, mbs in work)
    stage_plans = sum(len(mbs) * laid_out.parallel.pp for _, laid_out, mbs in work)
    if stage_plans > MAX_STAGE_PLANS:
        deepest = max(laid_out.parallel.pp for _, laid_out, _ in work)
        raise ConfigError(
            f"--search on --gpus={gpus} would plan {plans:,} layouts with up to {deepest:,} pipeline stages each: "
            f"{stage_plans:,} stage plans, above the search's bound of {MAX_STAGE_PLANS:,}; search fewer GPUs "
            "(or a model with fewer layers: the pipeline depths tried are the divisors of --gpus up to "
            "model.n_layers), or plan one layout without --search")
