"""Carry a claim to its published hardware: fit the planner's machine profile on the judged stores,
plan the claim's ``published_setup`` with it, and set the planned value beside the published one.

The fit and its held-out check are ``moebench plan --calibrate STORE --holdout half``'s own
(:func:`moebench.plan.calibrate.fit` and :func:`moebench.plan.calibrate.holdout`); the held-out
median error of tokens/s per device on the user's own points is the carried value's uncertainty.
The profile's factors are then applied on the published GPU (:func:`carried_profile`): efficiency
factors as the same fraction of that GPU's peaks and bandwidths, overheads as the same seconds per
occurrence: a move to another machine, which the text names with the calibration terms the stores
never exercised (they keep their roofline values). A move past the fitted points is not made: where
the published setup's layers, experts, total parameters, tokens per rank, ranks or ranks per device
leave the range of the fitted points, the claim is "not carried" and the text says which (a memory
claim is planned by the memory model, which is not fitted, so it is carried wherever it plans).

Each side of the claim is planned from the setup's preset, precision and layout, with the claim's
selector and the setup's own per-side keys on top (a drop: its layout at the axis's two published
ends), and the preset's global batch (the published benchmark's), as ``moebench plan --profile``
plans it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moebench.claim.spec import Claim, PlannedSetup, claim_value_text
from moebench.devices import DEVICES, Device
from moebench.errors import ConfigError, StoreError
from moebench.plan import calibrate
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.precision import plan_precision
from moebench.plan.profile import Profile, time_sharing
from moebench.presets import load_config
from moebench.record import format_count

HOLDOUT = "half"  # the split whose error is the carried value's uncertainty (docs/plan.md, "Calibration")


@dataclass(frozen=True)
class Calibration:
    """The stores' profile and its held-out error, or why the stores cannot be calibrated."""

    profile: Profile | None = None
    points: tuple[calibrate.Measured, ...] = ()
    holdout_error: float | None = None  # median |error| of tokens/s per device on the held-out points
    held_out: int = 0
    why_not: str = ""


@dataclass
class Carried:
    """A claim planned on its published setup from the stores' profile."""

    hardware: str  # "8 x B300"
    value: float | None = None
    error: float | None = None  # the held-out error behind it; None: the value is not calibrated
    held_out: int = 0
    fitted_on: str = ""  # the machine the profile was fitted on
    outside: list[str] = field(default_factory=list)  # where the published setup leaves the fitted range
    notes: list[str] = field(default_factory=list)
    why_not: str = ""

    def text(self, kind: str, published: float | None) -> str:
        """``planned 2.41x on 8 x B300 from this machine's profile (held-out error 12.7%); published 2.70x``."""
        if self.why_not:
            return f"not carried to {self.hardware}: {self.why_not}"
        source = ("from the planner's memory model (the profile calibrates time, not memory: no held-out error)"
                  if self.error is None else
                  f"from this machine's profile (held-out error {self.error:.1%} of tokens/s per device over "
                  f"{self.held_out} points)")
        shown = "" if published is None else f"; published {claim_value_text(published, kind)}"
        return f"planned {claim_value_text(self.value, kind)} on {self.hardware} {source}{shown}"

    def summary(self, kind: str, published: float | None) -> str:
        """:meth:`text` in one line (the report's Claims section)."""
        return self.text(kind, published)

    def lines(self, kind: str, published: float | None) -> list[str]:
        out = [f"  carried: {self.text(kind, published)}"]
        out += [f"  carried: {n}" for n in self.notes]
        return out


def calibrate_stores(paths: Sequence[str]) -> Calibration:
    """Fit a profile on every ok point of the stores and check it on held-out points; a store that
    cannot be calibrated gives the reason in one line (the claim is still judged on it)."""
    try:
        stores, points = calibrate.store_points(paths)  # the judging already warned of side files
        layouts = {_layout(p) for p in points}
        if len(layouts) < 2:
            return Calibration(why_not=f"one layout only ({next(iter(layouts))}, {len(points)} points): the fit "
                                       "cannot tell a layout's costs from another's")
        try:
            calibrate.holdout_split(points, HOLDOUT)
        except ConfigError:  # every layout has a single point: nothing left to hold out
            return Calibration(why_not=f"{len(points)} points, one per layout: the held-out check needs a layout "
                                       "measured at two points or more (e.g. two expert counts)")
        _, _, predictions = calibrate.holdout(points, stores, HOLDOUT)
        profile = calibrate.fit(points, stores)
    except (ConfigError, StoreError) as exc:
        return Calibration(why_not=str(exc))
    return Calibration(profile, tuple(points), calibrate.median_abs_error(predictions), len(predictions))


def _layout(p: calibrate.Measured) -> str:
    lay = p.cfg.parallel
    return f"{lay.strategy} ep{lay.ep} pp{lay.pp} {lay.dispatcher}"


def carried_profile(profile: Profile, device: Device) -> Profile:
    """``profile``'s factors on ``device``: efficiencies as fractions of its peaks, overheads in seconds."""
    return dataclasses.replace(profile, device=device, cores=None, path=None)


def carry(claim: Claim, calibration: Calibration) -> Carried | None:
    """``claim`` planned on its ``published_setup`` with the calibration's profile; None without a setup."""
    setup = claim.planned
    if setup is None:
        return None
    device = DEVICES[setup.gpu]
    out = Carried(hardware=f"{setup.gpus} x {setup.gpu.upper()}")
    if claim.kind != "memory" and calibration.profile is None:
        out.why_not = f"this store cannot be calibrated: {calibration.why_not}"
        return out
    profile = None if calibration.profile is None else carried_profile(calibration.profile, device)
    try:
        plans = [_plan(setup, sets, device, profile) for sets in _sides(claim, setup)]
    except ConfigError as exc:
        out.why_not = f"the published setup does not plan: {exc}"
        return out
    num, den = (_metric(record, claim.metric) for record, _ in plans)
    if num is None or not den:
        out.why_not = f"the plan has no {claim.metric}"
        return out
    out.value = 1 - num / den if claim.kind == "drop" else num / den
    for record, cfg in plans:
        if not record["plan"]["fits"]:
            p = cfg.parallel
            out.notes.append(f"{p.strategy} ep{p.ep} with {cfg.moe.num_experts} experts does not fit in "
                             f"{setup.gpu.upper()} memory as planned")
    if claim.kind == "memory":
        return out
    assert calibration.profile is not None
    out.error, out.held_out = calibration.holdout_error, calibration.held_out
    out.fitted_on = calibration.profile.device.name
    out.outside = outside_range([cfg for _, cfg in plans], device, calibration.points)
    if out.outside:  # a fit says nothing past the points it was fitted on: no value there
        out.why_not = f"outside the fitted range: {'; '.join(out.outside)}"
        out.value = None
        return out
    out.notes += machine_notes(calibration.profile.device, device)
    unfitted = sorted({term for _, cfg in plans for term in _terms(cfg, device)} - set(calibration.profile.factors))
    if unfitted:
        out.notes.append(f"terms the stores never exercised keep their roofline values: {', '.join(unfitted)}")
    return out


def _sides(claim: Claim, setup: PlannedSetup) -> list[dict[str, Any]]:
    """The config keys of each planned side (numerator first): the claim's selector, then the setup's."""
    if claim.kind == "drop":
        assert setup.axis is not None and claim.axis is not None
        small, large = setup.axis
        return [{**claim.num, claim.axis: large}, {**claim.num, claim.axis: small}]
    return [{**claim.num, **setup.num}, {**claim.den, **setup.den}]


def _plan(setup: PlannedSetup, sets: dict[str, Any], device: Device,
          profile: Profile | None) -> tuple[dict[str, Any], Any]:
    keys = dict(sets)
    preset, gpus = keys.pop("preset", setup.preset), keys.pop("nproc", setup.gpus)
    overrides = {**({"precision.mode": setup.precision} if setup.precision else {}),
                 **{f"parallel.{k}": v for k, v in setup.parallel.items()}, **setup.set, **keys}
    cfg = load_config(preset, validate=False).apply_overrides(overrides)
    laid = apply_world_size(cfg, gpus, dp_given="parallel.dp" in overrides, batch_given=True)
    return build_plan(laid, device, PlanOptions(profile=profile)), laid


def _metric(record: dict[str, Any], metric: str) -> float | None:
    """A plan record's ``metric``; ``group.part`` reads a part (``memory_parts_bytes.saved_activations``)."""
    group, _, part = metric.partition(".")
    value = record.get(metric) if metric in record else (record.get(group) or {}).get(part)
    return None if value is None else float(value)


def _terms(cfg: Any, device: Device) -> set[str]:
    """The calibration terms a plan of ``cfg`` on ``device`` uses."""
    prec = plan_precision(cfg, device)
    features = calibrate.phase_features(cfg, prec, device, *calibrate.stage_inputs(cfg, prec), 1.0)
    return {term for by_term in features.values() for term in by_term}


def machine_notes(fitted: Device, target: Device) -> list[str]:
    if fitted == target:
        return []
    if fitted.cpu:
        return [f"the profile is a CPU's ({fitted.name}: transfers priced per GB at a 1 GB/s unit, overheads in "
                f"CPU seconds): on a {target.name} it gives this machine's shape of costs at that GPU's peaks and "
                "bandwidths, not a measurement of the GPU"]
    return [f"fitted on {fitted.name}: its efficiencies are carried as fractions of the {target.name}'s peaks and "
            "bandwidths, its overheads as the same seconds"]


def outside_range(cfgs: Sequence[Any], device: Device, points: Sequence[calibrate.Measured]) -> list[str]:
    """Where the planned configs leave the range of the fitted points: layers, experts, total parameters,
    tokens per rank, ranks, ranks per device (ranks time-sharing a CPU core; 1 on a GPU)."""
    def quantities(cfg: Any, shared: float) -> dict[str, float]:
        world = cfg.parallel.world_size
        return {"layers": cfg.model.n_layers, "experts": cfg.moe.num_experts, "total parameters": cfg.total_params(),
                "tokens per rank": cfg.tokens_per_step / world, "ranks": world, "ranks per device": shared}

    fitted = [quantities(p.cfg, time_sharing(p.device, p.cores, p.world_size)) for p in points]
    planned = [quantities(cfg, time_sharing(device, None, cfg.parallel.world_size)) for cfg in cfgs]
    out = []
    for name in fitted[0]:
        low, high = min(f[name] for f in fitted), max(f[name] for f in fitted)
        values = sorted({q[name] for q in planned})
        if any(v < low or v > high for v in values):
            shown = "/".join(_count(v, name) for v in values)
            span = _count(low, name) if low == high else f"{_count(low, name)}-{_count(high, name)}"
            out.append(f"{name} {shown} (fitted {span})")
    return out


def _count(x: float, name: str = "") -> str:
    if name == "total parameters":
        return format_count(x)  # 46.9B
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:.3g}"
