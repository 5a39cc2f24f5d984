"""The ``moebench plan`` command body (the click options live in :mod:`moebench.cli`)."""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from moebench.devices import Device, get_device
from moebench.errors import ConfigError
from moebench.plan import calibrate
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.profile import Profile, load_profile
from moebench.plan.published import load_published
from moebench.plan.published_fit import fit_matmul_efficiency, fitted_options
from moebench.plan.render import calibration_lines, plan_lines, search_lines
from moebench.plan.search import SearchResult, search
from moebench.plan.validate import validate, validate_lines
from moebench.presets import load_config
from moebench.record import format_count, to_json_line


def run_plan(preset: str, overrides: list[str], gpus: int | None, gpu: str | None, do_search: bool, top: int,
             as_json: bool, options: PlanOptions) -> None:
    if gpus is None and gpu is None and not do_search and options.profile is None:
        _cost_only(preset, load_config(preset, overrides), as_json)
        return
    # Validated only once laid out: the batch may be scaled to the GPU count first.
    cfg = load_config(preset).apply_overrides(overrides)
    keys = {item.partition("=")[0].strip() for item in overrides}
    gpus = cfg.parallel.world_size if gpus is None else gpus
    device = plan_device(gpu, options.profile)
    batch_given = "train.global_batch_size" in keys
    if do_search:
        result = search(cfg, gpus, device, batch_given, options)
        runnable = best_runnable(result.ranked)
        best = None if runnable is None else {"rank": runnable[0], "command": train_command(runnable[1])}
        if as_json:
            click.echo(to_json_line({
                "status": "planned", "gpus": gpus, "gpu": device.name if options.profile else (gpu or "h200"),
                "ranked": result.ranked[:top], "best_command": best,
                "fitting": len(result.ranked), "not_fitting": len(result.too_big),
                "invalid": [{"layout": layout, "reason": reason} for layout, reason in result.invalid],
            }))
        else:
            for line in search_lines(result, gpus, top, best):
                click.echo(line)
        return
    laid_out = apply_world_size(cfg, gpus, dp_given="parallel.dp" in keys, batch_given=batch_given)
    record = build_plan(laid_out, device, options)
    # a layout that does not fit gets no speed: the fastest one that fits on as many GPUs instead
    instead = None if record["plan"]["fits"] else fitting_instead(cfg, gpus, device, batch_given, options)
    if as_json:
        if instead is not None:
            record["plan"]["instead"] = instead
        click.echo(to_json_line(record))
    else:
        for line in plan_lines(record, instead):
            click.echo(line)


def run_verify(preset: str, overrides: list[str], gpus: int | None, gpu: str | None, as_json: bool) -> None:
    """Plan vs a dry run of the real trainer at the layout ``run_plan`` would plan (docs/plan.md)."""
    from moebench.plan.verify import verify, verify_lines

    cfg = load_config(preset).apply_overrides(overrides)
    keys = {item.partition("=")[0].strip() for item in overrides}
    laid_out = apply_world_size(cfg, cfg.parallel.world_size if gpus is None else gpus,
                                dp_given="parallel.dp" in keys, batch_given="train.global_batch_size" in keys)
    result = verify(laid_out, gpu or "h200")
    if as_json:
        click.echo(to_json_line({"status": "planned", "verify": result}))
        return
    for line in verify_lines(result):
        click.echo(line)


def run_validate(options: PlanOptions, fitted: bool, as_json: bool) -> None:
    """Every shipped published row with a preset, planned at its published layout (docs/plan.md):
    with ``fitted``, at the matmul efficiency fitted on the calibration rows; else at ``options``'."""
    rows = load_published()
    fit = fit_matmul_efficiency(rows, options) if fitted else None
    lines = validate(rows, options if fit is None else fitted_options(fit, options))
    if as_json:
        click.echo(to_json_line({"status": "planned", "fit": None if fit is None else fit.as_dict(),
                                 "validate": lines}))
        return
    click.echo(fit.describe() if fit is not None else
               f"matmul efficiency {options.matmul_efficiency:.3f}, not fitted ({options.matmul_efficiency_source})")
    click.echo("")
    for line in validate_lines(lines):
        click.echo(line)


def fitting_instead(cfg: Any, gpus: int, device: Device, batch_given: bool, options: PlanOptions) -> dict[str, Any]:
    """What fits on ``gpus`` GPUs when the asked-for layout does not: the search's fastest fitting
    layout and the command that trains it, or why there is none (nothing fits: the smallest peak)."""
    try:
        result: SearchResult = search(cfg, gpus, device, batch_given, options)
    except ConfigError as exc:
        return {"fits": None, "why": f"no search for a layout that fits: {exc}"}
    runnable = best_runnable(result.ranked)
    if runnable is not None:
        best = runnable[1]
        return {"fits": True, "layout": best["config"]["parallel"],
                "micro_batch_size": best["config"]["train"]["micro_batch_size"],
                "peak_mem_bytes": best["peak_mem_bytes"],
                "tokens_per_s_per_device": best["tokens_per_s_per_device"], "command": train_command(best)}
    if result.ranked:
        return {"fits": None, "why": f"{len(result.ranked)} searched layouts fit, but moebench's trainer accepts none "
                                     "of them today (plan --search --json gives each one's reason)"}
    if result.too_big:
        smallest = result.too_big[0]
        return {"fits": False, "layout": smallest["config"]["parallel"],
                "micro_batch_size": smallest["config"]["train"]["micro_batch_size"],
                "peak_mem_bytes": smallest["peak_mem_bytes"]}
    return {"fits": None, "why": "no searched layout is valid on this GPU count"}


def best_runnable(ranked: list[dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The fastest fitting plan moebench's trainer accepts, with its 1-based rank in ``ranked``."""
    return next(((i, r) for i, r in enumerate(ranked, 1) if r["plan"]["moebench_runs"]), None)


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):  # parallel.pp_layers: comma-separated, as --set reads it
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def train_command(record: dict[str, Any]) -> str:
    """The ``moebench train`` line that runs a planned record's layout: ``--nproc`` its world size
    and a ``--set`` for every config field that differs from its preset (batch, layout, precision)."""
    preset = record["preset"]
    base = load_config(preset).to_dict()
    sets = [f"{section}.{key}={_override_value(value)}"
            for section, fields in record["config"].items() if isinstance(fields, dict)
            for key, value in fields.items() if base.get(section, {}).get(key) != value]
    words = ["moebench", "train", "--preset", preset, "--nproc", str(record["world_size"])]
    words += [w for item in sets for w in ("--set", item)]
    return shlex.join(words)


def plan_device(gpu: str | None, profile: Profile | None) -> Device:
    """The device to plan on: ``--gpu`` (default h200), or the profile's machine, which ``--gpu``
    may only repeat (a profile's factors describe the machine they were fitted on)."""
    if profile is None:
        return get_device(gpu or "h200")
    if gpu is not None and get_device(gpu) != profile.device:
        raise ConfigError(f"--gpu {gpu} differs from the machine profile {profile.path} was fitted on "
                          f"({profile.device.name}); drop --gpu or calibrate on a store from a {gpu}")
    return profile.device


def read_profile(path: str) -> Profile:
    return load_profile(path, calibrate.term_ranges())


def run_calibrate(points: list[calibrate.Measured], stores: list[str], output: str | None, holdout: str | None,
                  as_json: bool) -> None:
    """Fit a profile to every point (written to ``output``); with ``holdout``, also fit on part of
    the points and report the error on the rest."""
    profile = calibrate.fit(points, stores)
    evaluation = None
    if holdout:
        part, fit_on, predictions = calibrate.holdout(points, stores, holdout)
        evaluation = {"holdout": holdout, "fitted": [p.label for p in fit_on], "profile": part,
                      "predictions": predictions}
    if output:
        profile.save(output)
    if as_json:
        out = {"profile": profile.to_dict(), "output": output}
        if evaluation:
            preds = evaluation["predictions"]
            out["holdout"] = {
                "split": holdout, "fitted": evaluation["fitted"],
                "in_sample_median_abs_error": evaluation["profile"].fitted_on["in_sample_median_abs_error"],
                "median_abs_error": calibrate.median_abs_error(preds),
                "points": [{"point": p.point.label, "measured": p.point.tokens_per_s_per_device,
                            "predicted": p.tokens_per_s_per_device, "error": p.error} for p in preds]}
        click.echo(to_json_line(out))
        return
    for line in calibration_lines(profile, points, evaluation, output):
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
