"""Judge a claim on results stores: holds, does not hold, or inconclusive, and what differs from the published setup.

Every number comes from the report's own code: points are folded over their repeats
(:func:`moebench.results.table.by_point`), paired as the ratio gate pairs them
(:func:`moebench.report.gate.ratio.ratio_matches`), and a rate ratio gets its interval from the one
statistics module (:func:`moebench.results.stats.metric_ratio`: ratio of mean run medians, hierarchical
bootstrap, t interval over the runs).

A comparison *holds* when its whole 95% interval lies on the holding side of the claim's bound,
*does not hold* when the whole interval lies on the other side, and is *inconclusive* otherwise:
the interval straddles the bound, a side has a single run (no between-run variance: no interval,
as the report gives no verdict), too few steps, or a point that did not finish ok. A memory ratio
is one measured value per point (no step samples): it holds or not. A count (host syncs per step)
is the same in every run of a point, so it is judged without an interval: it holds or not, and is
inconclusive when its runs disagree. A claim holds when every
comparison holds, does not hold when one does not, and is inconclusive otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from moebench.claim.spec import EXTREMES, Claim, claim_value_text
from moebench.errors import ConfigError
from moebench.record import format_count
from moebench.report.gate.ratio import ratio_matches, unequal_work_note
from moebench.results.pairing import selector_mask
from moebench.results.stats import (
    CONFIDENCE,
    FAILS,
    HOLDS,
    OPS,
    UNDECIDED,
    Ratio,
    bound_verdict,
    metric_ratio,
    runs_text,
)
from moebench.results.table import as_float, by_point, norm_value, resolve_field

if TYPE_CHECKING:
    from moebench.claim.carry import Carried

INCONCLUSIVE = UNDECIDED
CANNOT = "cannot judge"  # the stores cannot make the comparison: no evidence either way
VERDICTS = (HOLDS, FAILS, INCONCLUSIVE, CANNOT)
# Measured parameters within this factor of the published ones are "the same scale".
SCALE_FACTOR = 2.0


@dataclass
class Comparison:
    """One measured value of a claim: a pair of points (ratio, memory) or one layout across an axis (drop)."""

    num_label: str
    den_label: str
    value: float | None
    low: float | None = None
    high: float | None = None
    runs: tuple[int, int] = (0, 0)
    verdict: str = INCONCLUSIVE
    note: str = ""

    def value_text(self, kind: str) -> str:
        if self.value is None:
            return "no value"
        shown = claim_value_text(self.value, kind)
        interval = (f" [{claim_value_text(self.low, kind)}, {claim_value_text(self.high, kind)}]"
                    if self.low is not None and self.high is not None else "")
        return f"{shown}{interval}, {runs_text(self.runs)}"


@dataclass
class Verdict:
    """A claim judged on some stores: the verdict, each comparison behind it, and the setup's differences."""

    name: str
    statement: str
    source: str
    kind: str
    holds: str  # the condition, e.g. ">= 1"
    verdict: str
    comparisons: list[Comparison]
    conditions: list[str] = field(default_factory=list)  # what differs from the published setup
    published: float | None = None
    published_setup: str = ""
    stores: list[str] = field(default_factory=list)
    carried: Carried | None = None  # the claim planned on its published setup (moebench.claim.carry)
    quantity: str = ""  # what is measured, in words (:attr:`moebench.claim.spec.Claim.quantity`)
    resolved: str = ""  # what an ``at`` extreme resolved to: ``num_experts=16 (largest)``
    magnitude: str = ""  # the measured ratios against the published value (:func:`magnitude`)
    scope: str = ""  # what the published value was measured with: dispatcher, micro-batch, routing, precision scope
    arms: str = ""  # a ratio: what the published arms differed in (a stack, or the parallelism alone)

    def measured_text(self) -> str:
        """The comparisons in one line: ``ddp / fsdp: 1.21x [1.08, 1.35], 3 runs each; ...``."""
        return "; ".join(f"{c.num_label}{self._versus(c)}: {c.value_text(self.kind)}"
                         f"{' (' + c.note + ')' if c.note else ''}" for c in self.comparisons)

    def _versus(self, c: Comparison) -> str:
        """`` / DEN`` for a ratio; a count is not divided by its den partner's (`` vs DEN``)."""
        return f"{' vs ' if self.kind == 'count' else ' / '}{c.den_label}" if c.den_label else ""

    def published_text(self) -> str:
        value = "" if self.published is None else claim_value_text(self.published, self.kind)
        return ", ".join(x for x in (value, self.published_setup) if x) or "not given"

    def to_dict(self) -> dict[str, Any]:
        """What a store's claims.json keeps (the report's Claims section reads ``measured`` and ``published``)."""
        data = asdict(self)
        data.update(measured=self.measured_text(), published=self.published_text(), published_value=self.published)
        if self.carried is not None:
            data["carried"]["text"] = self.carried.summary(self.kind, self.published)
        return data

    def lines(self) -> list[str]:
        """The verdict as text, for the terminal."""
        out = [f"claim {self.name}: {self.verdict.upper()}", f"  {self.statement}", f"  source: {self.source}",
               f"  holds when the {self.quantity} is {self.holds}" + _rule(self.kind)]
        out += [f"  {c.verdict}: {c.num_label}{self._versus(c)}: "
                f"{c.value_text(self.kind)}{'; ' + c.note if c.note else ''}" for c in self.comparisons]
        out += [f"  at {self.resolved}"] if self.resolved else []
        out.append(f"  published: {self.published_text()}")
        out += [f"  published with: {self.scope}"] if self.scope else []
        out += [f"  published arms: {self.arms}"] if self.arms else []
        out += [f"  magnitude: {self.magnitude}"] if self.magnitude else []
        out += [f"  differs from the published setup: {c}" for c in self.conditions]
        if self.carried is not None:
            out += self.carried.lines(self.kind, self.published)
        return out


def _rule(kind: str) -> str:
    if kind == "memory":
        return ""
    if kind == "count":
        return " (a count that does not vary between runs: judged without an interval)"
    return f" ({100 * CONFIDENCE:g}% interval wholly on that side)"


def judge(claim: Claim, table: pd.DataFrame, metas: Sequence[dict[str, Any]] = (),
          stores: Sequence[str] = ()) -> Verdict:
    """Judge ``claim`` on ``table`` (the tidy table of :func:`moebench.results.table.load_tables`, one row per
    run; its repeats are folded here). A ConfigError when the stores hold nothing the claim can compare."""
    t = by_point(table)
    names = [*claim.num, *claim.den, *claim.at, *([claim.axis] if claim.axis else [])]
    for name in names:
        if resolve_field(t, name) is None and resolve_field(t, f"parallel.{name}") is None:
            raise ConfigError(f"{claim.path}: comparison: no field {name!r} in the store(s) {', '.join(stores)}")
    if claim.metric not in t.columns:
        raise ConfigError(f"{claim.path}: comparison.metric: the store(s) {', '.join(stores)} record no "
                          f"{claim.metric}")
    resolved = ""
    try:
        if claim.kind == "drop":
            comparisons, pairs = _drop(claim, t)
        else:
            at, resolved = _at(claim, t)
            comparisons, pairs = _count(claim, at, table) if claim.kind == "count" else _ratio(claim, at)
    except CannotJudge as exc:
        return Verdict(claim.name, claim.statement, claim.source, claim.kind, claim.holds_text, CANNOT, [],
                       [f"the store(s) cannot make this comparison: {exc}"], claim.published, _setup_text(claim),
                       list(stores), quantity=claim.quantity, resolved=resolved, scope=scope_text(claim),
                       arms=claim.setup.arms)
    verdict = (FAILS if any(c.verdict == FAILS for c in comparisons)
               else HOLDS if comparisons and all(c.verdict == HOLDS for c in comparisons) else INCONCLUSIVE)
    return Verdict(claim.name, claim.statement, claim.source, claim.kind, claim.holds_text, verdict, comparisons,
                   conditions(claim, t, pairs, metas), claim.published, _setup_text(claim), list(stores),
                   quantity=claim.quantity, resolved=resolved, magnitude=magnitude(claim, comparisons),
                   scope=scope_text(claim), arms=claim.setup.arms)


def magnitude(claim: Claim, comparisons: Sequence[Comparison]) -> str:
    """Whether the measured ratios reach the published value (a HOLDS tests the direction only): ``1.62x [1.44,
    1.83] vs published 2.70x: below it`` per comparison with an interval; empty without a published ratio."""
    if claim.kind != "ratio" or claim.published is None:
        return ""
    parts = []
    for c in comparisons:
        if c.value is None or c.low is None or c.high is None:
            continue
        where = "below it" if c.high < claim.published else "above it" if c.low > claim.published else \
            "consistent with it"
        parts.append(f"{c.value_text(claim.kind)} vs published {claim_value_text(claim.published, claim.kind)}: "
                     f"{where}")
    return "; ".join(parts) or "no interval to compare with the published value"


class CannotJudge(ConfigError):
    """The stores cannot make the claim's comparison (no point pairs, no point at its ``at``): not an error in
    the claim, and no evidence either way; the verdict says so (:data:`CANNOT`)."""


def _at(claim: Claim, t: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows ``at`` keeps, and what each extreme resolved to (``num_experts=16 (largest)``).

    ``largest``/``smallest``: of the axis's values at which both sides have a point, whatever its status, so
    a side that failed at the largest value leaves the comparison inconclusive instead of moving it to a
    smaller one; ``largest ok``/``smallest ok``: where both sides finished ok."""
    if not claim.at:
        return t, ""
    keep = pd.Series(True, index=t.index)
    resolved = []
    for name, value in claim.at.items():
        col = resolve_field(t, name)
        if value in EXTREMES:
            ran = (t["status"] == "ok") if value.endswith(" ok") else pd.Series(True, index=t.index)
            num, den = (set(pd.to_numeric(t.loc[_mask(t, side) & ran, col], errors="coerce").dropna())
                        for side in (claim.num, claim.den))
            values = pd.Series(sorted(num & den), dtype=float)
            if values.empty:
                raise CannotJudge(f"comparison.at.{name}: no value at which both sides have a point"
                                  f"{' that finished ok' if value.endswith(' ok') else ''}")
            extreme = value
            value = values.max() if value.startswith("largest") else values.min()
            resolved.append(f"{name.rpartition('.')[2]}={norm_value(value)} ({extreme})")
        keep &= t[col].map(norm_value) == norm_value(value)
    return t[keep], ", ".join(resolved)


def _mask(t: pd.DataFrame, selector: dict[str, Any]) -> pd.Series:
    return selector_mask(t, {resolve_field(t, k) or resolve_field(t, f"parallel.{k}"): v for k, v in selector.items()})


def _pairs(claim: Claim, t: pd.DataFrame) -> list[tuple[Any, Any]]:
    """Each ``num`` point with its ``den`` partner, paired as the ratio gate pairs them; a ConfigError
    saying how many points each side matched when none pair."""
    num = {k: norm_value(v) for k, v in claim.num.items()}
    den = {k: norm_value(v) for k, v in claim.den.items()}
    rows, candidates, matches = ratio_matches(t, num, den, claim.name)
    if not matches:
        why = ", none agree on model, precision and world size" if len(rows) and len(candidates) else ""
        raise CannotJudge(f"no point pairs ({len(rows)} points match num, "
                          f"{len(candidates)} match den{', at ' + _selector_text(claim.at) if claim.at else ''}{why})")
    return list(matches.items())


def _ratio(claim: Claim, t: pd.DataFrame) -> tuple[list[Comparison], list[tuple[Any, Any]]]:
    pairs = _pairs(claim, t)
    return [_compare(claim, t, r, d) for r, d in pairs], pairs


def _count(claim: Claim, t: pd.DataFrame, runs: pd.DataFrame) -> tuple[list[Comparison], list[tuple[Any, Any]]]:
    """Each ``num`` point's count against ``holds`` and, with ``den``, its partner's (paired as a ratio pairs
    them) against ``den_holds``. ``runs``: the table before folding, to see whether the runs of a point agree."""
    if claim.den:
        pairs: list[tuple[Any, Any]] = _pairs(claim, t)
    else:
        pairs = [(r, None) for r in t.index[_mask(t, claim.num).to_numpy()]]
        if not pairs:
            raise CannotJudge(f"no point matches num ({_selector_text(claim.num)})")
    out = []
    for r, d in pairs:
        c = Comparison(str(t.at[r, "label"]), "" if d is None else str(t.at[d, "label"]), None,
                       runs=(int(t.at[r, "runs"] or 0), 0 if d is None else int(t.at[d, "runs"] or 0)))
        out.append(c)
        sides = [("num", r, claim.op, claim.bound)] + ([] if d is None else [("den", d, claim.den_op, claim.den_bound)])
        bad = [f"{t.at[i, 'label']} {t.at[i, 'status']}" for _, i, _, _ in sides if t.at[i, "status"] != "ok"]
        if bad:
            c.note = "; ".join(bad)
            continue
        counts = {side: _count_runs(claim, t, runs, i) for side, i, _, _ in sides}
        missing = [str(t.at[i, "label"]) for side, i, _, _ in sides if not counts[side]]
        if missing:
            c.note = f"{claim.metric} not recorded for {', '.join(missing)} (runs under train.compile count none)"
            continue
        c.value = counts["num"][0]
        notes, verdicts = [], []
        for side, i, op, bound in sides:
            values = counts[side]
            if side == "den":
                notes.append(f"{t.at[i, 'label']}: {claim_value_text(values[0], 'count')}")
            if min(values) != max(values):
                notes.append(f"{t.at[i, 'label']}'s runs disagree ({claim_value_text(min(values), 'count')} to "
                             f"{claim_value_text(max(values), 'count')})")
                verdicts.append(INCONCLUSIVE)
            else:
                verdicts.append(HOLDS if OPS[op](values[0], bound) else FAILS)
        c.verdict = FAILS if FAILS in verdicts else HOLDS if all(v == HOLDS for v in verdicts) else INCONCLUSIVE
        c.note = "; ".join([*notes, "a count, the same in every run: no interval"])
    # the compared points, for conditions(): without den each num point stands alone (paired with itself:
    # no unequal work to note)
    return out, [(r, d) for r, d in pairs if d is not None] or [(r, r) for r, _ in pairs]


def _count_runs(claim: Claim, t: pd.DataFrame, runs: pd.DataFrame, i: Any) -> list[float]:
    """The count of point row ``i`` in each of its ok runs (per MoE layer with ``per: moe_layer``); empty when
    no run recorded it."""
    mine = runs[(runs["point_id"].astype(str) == str(t.at[i, "point_id"])) & (runs["status"] == "ok")]
    if "run_id" in runs.columns and "run_id" in t.columns:
        mine = mine[mine["run_id"].map(norm_value) == norm_value(t.at[i, "run_id"])]
    values = [as_float(x) for x in mine[claim.metric]] if claim.metric in mine.columns else []
    values = [x for x in values if x is not None]
    if claim.per == "moe_layer" and values:
        layers = as_float(t.at[i, "config.model.n_layers"]) or 0
        n_moe = layers - (as_float(t.at[i, "config.model.n_dense_layers"]) or 0)
        if n_moe <= 0:
            return []
        values = [x / n_moe for x in values]
    return values


def _drop(claim: Claim, t: pd.DataFrame) -> tuple[list[Comparison], list[tuple[Any, Any]]]:
    """The selected layout at the axis's largest value over the same layout at its smallest: their ratio r
    (with its interval) gives the drop ``1 - r``."""
    col = resolve_field(t, claim.axis)
    chosen = _mask(t, claim.num) & (t["status"] == "ok")
    values = pd.to_numeric(t.loc[chosen, col], errors="coerce").dropna()
    if values.nunique() < 2:
        raise CannotJudge(f"the points of {_selector_text(claim.num)} that finished ok "
                          f"take {values.nunique()} value(s) of {claim.axis}; a drop needs two")
    largest, smallest = values.max(), values.min()
    num = {**{k: norm_value(v) for k, v in claim.num.items()}, claim.axis: norm_value(largest)}
    den = {**{k: norm_value(v) for k, v in claim.num.items()}, claim.axis: norm_value(smallest)}
    _, _, matches = ratio_matches(t, num, den, claim.name)
    if not matches:
        raise CannotJudge(f"no point at {claim.axis}={norm_value(largest)} pairs with one "
                          f"at {norm_value(smallest)} (same model but {claim.axis}, precision and world size)")
    out = []
    for r, d in matches.items():
        c = _measure(claim, t, r, d)
        if c.value is not None:  # ratio r -> drop 1 - r: the interval's ends swap
            low, high = c.low, c.high
            c.value = 1 - c.value
            c.low, c.high = (1 - high, 1 - low) if low is not None and high is not None else (None, None)
            c.verdict = _decide_interval(claim, c.low, c.high)
        out.append(_refuse_unequal(c, t, r, d))
    return out, list(matches.items())


def _compare(claim: Claim, t: pd.DataFrame, r: Any, d: Any) -> Comparison:
    """``r`` over ``d`` (:func:`_measure`); no verdict between unequal work (different shares of routes
    dropped), as the report and ``check --ratio`` refuse it, nor between rates where a side ran its
    precision emulated (:func:`_refuse_emulated_rate`)."""
    return _refuse_emulated_rate(claim, _refuse_unequal(_measure(claim, t, r, d), t, r, d), t, r, d)


def _refuse_emulated_rate(claim: Claim, c: Comparison, t: pd.DataFrame, r: Any, d: Any) -> Comparison:
    """A rate ratio with an emulated side (quantize-dequantize where the device has no native kernels) times
    the emulation, not the published kernels: no verdict (its memory and numerics are still judged)."""
    if claim.kind != "ratio" or "precision_impl" not in t.columns:
        return c
    emulated = sorted({str(t.at[i, "precision"]) for i in (r, d) if t.at[i, "precision_impl"] == "emulated"})
    if emulated:
        c.verdict = INCONCLUSIVE
        c.note = "; ".join(x for x in (f"no verdict: {', '.join(emulated)} ran emulated (quantize-dequantize): "
                                       "its speed is not the native kernels'", c.note) if x)
    return c


def _refuse_unequal(c: Comparison, t: pd.DataFrame, r: Any, d: Any) -> Comparison:
    unequal = unequal_work_note(t, r, d)
    if unequal:
        c.verdict = INCONCLUSIVE
        c.note = "; ".join(x for x in (f"no verdict: {unequal}", c.note) if x)
    return c


def _measure(claim: Claim, t: pd.DataFrame, r: Any, d: Any) -> Comparison:
    """``r`` over ``d``: value, interval and runs, and the verdict for a ratio (a drop re-judges it)."""
    c = Comparison(str(t.at[r, "label"]), str(t.at[d, "label"]), None,
                   runs=(int(t.at[r, "runs"] or 0), int(t.at[d, "runs"] or 0)))
    bad = [f"{side} {t.at[i, 'status']}" for side, i in (("numerator", r), ("denominator", d))
           if t.at[i, "status"] != "ok"]
    if bad:
        c.note = "; ".join(bad)
        return c
    if claim.kind == "memory":
        nv, dv = as_float(t.at[r, claim.metric]), as_float(t.at[d, claim.metric])
        if nv is None or not dv:
            c.note = f"{claim.metric} not recorded"
            return c
        c.value = nv / dv
        c.verdict = HOLDS if OPS[claim.op](c.value, claim.bound) else FAILS
        c.note = "one measured value per point"
        return c
    ratio = metric_ratio(t.loc[r], t.loc[d], claim.metric)
    if ratio is None:
        c.note = "no step samples"
        return c
    c.value, c.runs = ratio.value, ratio.runs
    c.low, c.high = (ratio.low, ratio.high) if ratio.has_ci else (None, None)
    if ratio.why is not None:
        c.note = f"{ratio.why}, no interval"
    if claim.kind == "ratio":
        c.verdict = _decide(claim, ratio)
    return c


def _decide(claim: Claim, ratio: Ratio) -> str:
    """The one rule of bounds (:func:`moebench.results.stats.bound_verdict`), as ``check --ratio`` applies it."""
    return bound_verdict(ratio, claim.op, claim.bound)[0]


def _decide_interval(claim: Claim, low: float | None, high: float | None) -> str:
    """A drop ``1 - r``: its interval is the ratio's, mirrored; judged by the same rule (no interval: inconclusive)."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return INCONCLUSIVE
    return bound_verdict(Ratio(1.0, low, high, runs=(2, 2)), claim.op, claim.bound)[0]


def _selector_text(selector: dict[str, Any]) -> str:
    return ", ".join(f"{k}={norm_value(v)}" for k, v in selector.items())


def _setup_text(claim: Claim) -> str:
    s = claim.setup
    if s.device and s.devices:
        hardware = f"{s.devices} x {s.device}"
    else:
        hardware = s.device or (f"{s.devices} devices" if s.devices else "")
    parts = [hardware, s.precision or "", f"{format_count(s.active_params)} active" if s.active_params else "",
             f"{format_count(s.total_params)} total" if s.total_params else "", s.description]
    return ", ".join(p for p in parts if p)


def scope_text(claim: Claim) -> str:
    """``dispatcher ...; micro-batch ...; routing ...; precision scope ...``: what the published value was
    measured with (``published.setup``), empty when the claim names none of it."""
    s = claim.setup
    parts = [("dispatcher", s.dispatcher), ("micro-batch", s.micro_batch), ("routing", s.routing),
             ("precision scope", s.precision_scope)]
    return "; ".join(f"{name} {value}" for name, value in parts if value)


def conditions(claim: Claim, t: pd.DataFrame, pairs: Sequence[tuple[Any, Any]],
               metas: Sequence[dict[str, Any]] = ()) -> list[str]:
    """What differs between the compared points and the published setup: the suite, hardware, scale,
    precision (emulated) and unequal dropped routes (:func:`moebench.report.gate.ratio.unequal_work_note`)."""
    rows = t.loc[sorted({i for pair in pairs for i in pair}, key=list(t.index).index)]
    out: list[str] = []
    suites = sorted({str(m.get("suite")) for m in metas if m.get("suite")})
    names = [s.rsplit("/", 1)[-1].removesuffix(".yaml").removesuffix(".yml") for s in (claim.suite, claim.suite_gpu)
             if s]
    if suites and not set(names) & set(suites):
        named = claim.suite + (f" (on CUDA: {claim.suite_gpu})" if claim.suite_gpu else "")
        out.append(f"suite: the store holds {', '.join(suites)}; the claim names {named}")
    setup = claim.setup
    devices = sorted({norm_value(x) for x in rows.get("device_name", pd.Series(dtype=object)).dropna()})
    worlds = sorted({int(x) for x in rows.get("world_size", pd.Series(dtype=float)).dropna()})
    measured = f"{'/'.join(map(str, worlds)) or '?'} x {', '.join(devices) or 'unknown device'}"
    other_device = setup.device and not any(setup.device.lower() in d.lower() for d in devices)
    other_count = setup.devices and worlds != [setup.devices]
    if other_device or other_count:
        out.append(f"hardware: measured on {measured}; published on "
                   f"{setup.devices or '?'} x {setup.device or 'the same device'}")
    for name in ("active_params", "total_params"):
        published = getattr(setup, name)
        values = pd.to_numeric(rows.get(name, pd.Series(dtype=float)), errors="coerce").dropna()
        if published and not values.empty:
            low, high = float(values.min()), float(values.max())
            if high < published / SCALE_FACTOR or low > published * SCALE_FACTOR:
                shown = format_count(low) if low == high else f"{format_count(low)}-{format_count(high)}"
                out.append(f"scale: {shown} {name.replace('_params', '')} parameters measured, "
                           f"{format_count(published)} published ({high / published:.2g}x)")
    precisions = sorted({norm_value(x) for x in rows.get("precision", pd.Series(dtype=object)).dropna()})
    compares_precision = any(k.startswith("precision") for k in [*claim.num, *claim.den])  # both sides differ
    if (setup.precision and precisions and not compares_precision
            and any(p != setup.precision.lower() for p in precisions)):
        out.append(f"precision: measured in {', '.join(precisions)}; published in {setup.precision}")
    routing = resolve_field(rows, "moe.routing")
    routes = sorted({norm_value(x) for x in rows[routing].dropna()}) if routing else []
    if setup.routing not in ("", "not stated") and routes and routes != [setup.routing]:
        out.append(f"routing: measured {', '.join(routes)}; published {setup.routing}"
                   " (how balanced the routes are moves the rate)")
    emulated = rows[rows["precision_impl"] == "emulated"] if "precision_impl" in rows else rows.iloc[:0]
    if not emulated.empty:
        out.append(f"precision emulated: {', '.join(sorted(set(map(str, emulated['precision']))))} ran as "
                   "quantize-dequantize (the native numerics and saved operands, not its speed; the dequantized "
                   "copies are transient memory native GEMMs do not need)")
    for r, d in pairs:
        note = unequal_work_note(t, r, d)
        if note:
            out.append(note)
    return out
