"""The ``moebench plan`` command body (the click options live in :mod:`moebench.cli`)."""

from __future__ import annotations

import json
from typing import Any

import click

from moebench.devices import Device, get_device
from moebench.errors import ConfigError
from moebench.plan import calibrate
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.profile import Profile, load_profile
from moebench.plan.render import calibration_lines, plan_lines, search_lines
from moebench.plan.search import search
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
        if as_json:
            click.echo(to_json_line({
                "status": "planned", "gpus": gpus, "gpu": device.name if options.profile else (gpu or "h200"),
                "ranked": result.ranked[:top],
                "fitting": len(result.ranked), "not_fitting": len(result.too_big),
                "invalid": [{"layout": layout, "reason": reason} for layout, reason in result.invalid],
            }))
        else:
            for line in search_lines(result, gpus, top):
                click.echo(line)
        return
    cfg = apply_world_size(cfg, gpus, dp_given="parallel.dp" in keys, batch_given=batch_given)
    record = build_plan(cfg, device, options)
    if as_json:
        click.echo(to_json_line(record))
    else:
        for line in plan_lines(record):
            click.echo(line)


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
        fit_on, held = calibrate.holdout_split(points, holdout)
        part = calibrate.fit(fit_on, stores)
        evaluation = {"holdout": holdout, "fitted": [p.label for p in fit_on], "profile": part,
                      "predictions": [calibrate.predict(part, p) for p in held]}
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
