"""The ``moebench plan`` command body (the click options live in :mod:`moebench.cli`)."""

from __future__ import annotations

import json
from typing import Any

import click

from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.render import plan_lines, search_lines
from moebench.plan.search import search
from moebench.presets import load_config
from moebench.record import format_count, to_json_line


def run_plan(preset: str, overrides: list[str], gpus: int | None, gpu: str | None, do_search: bool, top: int,
             as_json: bool, options: PlanOptions) -> None:
    if gpus is None and gpu is None and not do_search:
        _cost_only(preset, load_config(preset, overrides), as_json)
        return
    # Validated only once laid out: the batch may be scaled to the GPU count first.
    cfg = load_config(preset).apply_overrides(overrides)
    keys = {item.partition("=")[0].strip() for item in overrides}
    gpus = cfg.parallel.world_size if gpus is None else gpus
    gpu = gpu or "h200"
    batch_given = "train.global_batch_size" in keys
    if do_search:
        result = search(cfg, gpus, gpu, batch_given, options)
        if as_json:
            click.echo(to_json_line({
                "status": "planned", "gpus": gpus, "gpu": gpu, "ranked": result.ranked[:top],
                "fitting": len(result.ranked), "not_fitting": len(result.too_big),
                "invalid": [{"layout": layout, "reason": reason} for layout, reason in result.invalid],
            }))
        else:
            for line in search_lines(result, gpus, top):
                click.echo(line)
        return
    cfg = apply_world_size(cfg, gpus, dp_given="parallel.dp" in keys, batch_given=batch_given)
    record = build_plan(cfg, gpu, options)
    if as_json:
        click.echo(to_json_line(record))
    else:
        for line in plan_lines(record):
            click.echo(line)


def _cost_only(preset: str, cfg: Any, as_json: bool) -> None:
    """Parameter counts and FLOPs per token from the config alone."""
    result = {"preset": preset, **cfg.cost_summary(), "config_hash": cfg.hash()}
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"preset           {preset}")
    click.echo(f"total params     {format_count(result['total_params'])} ({result['total_params']:,})")
    click.echo(f"active params    {format_count(result['active_params'])} ({result['active_params']:,})")
    click.echo(f"FLOPs per token  {format_count(result['flops_per_token'])} (6N + causal attention, seq/2)")
