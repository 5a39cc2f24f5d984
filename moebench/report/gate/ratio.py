"""The ratio gate: a ratio measured inside one run, e.g. ``ddp/fsdp:tokens_per_s>=1.0``.

On a shared, noisy machine absolute times drift between runs, but two layouts measured
back to back in the same run drift together; their ratio holds up.

Syntax: ``NUM/DEN:METRIC OP VALUE`` with OP one of ``>= > <= <``. Each side selects points
by comma-separated terms: a bare word is a strategy (``ddp`` = ``parallel.strategy=ddp``);
``FIELD=VALUE`` names any config key, point axis or record field (``parallel.dispatcher=
rowwise``, ``moe.num_experts=32``, ``precision=bf16``; ``parallel.`` may be left out).
Every NUM point is paired with a DEN point of the same run that agrees on everything
outside the ``parallel`` section (model, MoE, training and precision config, world size,
device) except the fields the sides name; among several, the one with the closest parallel
layout is taken. A DEN point never pairs with a point that also matches NUM. A miss of the
bound that is within the step-time noise, or measured with one run a side, is inconclusive:
reported, not failing (see :func:`evaluate_ratio`). Two points whose dropped shares of routes
differ by more than :data:`moebench.results.pairing.DROP_TOLERANCE` did unequal work: the pair
gets no verdict and fails the gate, unless ``allow_unequal_work`` (``--allow-unequal-work``),
which judges it and labels it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from moebench.errors import ConfigError
from moebench.report.gate.check import FROM_STEP_TIME, check_alpha, check_numeric
from moebench.results.pairing import DROP_TOLERANCE, LOOSE, best_matches, named_columns, selector_mask
from moebench.results.stats import FAILS, HOLDS, OPS, UNDECIDED, bound_verdict, metric_ratio
from moebench.results.table import as_float, by_point, resolve_field, share_text

_TAIL_RE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class RatioSpec:
    text: str
    num: dict[str, str]
    den: dict[str, str]
    metric: str
    op: str
    value: float


def _side(text: str, spec: str) -> dict[str, str]:
    terms: dict[str, str] = {}
    for term in (s.strip() for s in text.split(",")):
        if not term:
            raise ConfigError(f"bad --ratio {spec!r}: empty selector term in {text!r}")
        name, eq, value = term.partition("=")
        name, value = (name.strip(), value.strip()) if eq else ("parallel.strategy", term)
        if not name or not value:
            raise ConfigError(f"bad --ratio {spec!r}: selector term {term!r} must be STRATEGY or FIELD=VALUE")
        if name in terms:
            raise ConfigError(f"bad --ratio {spec!r}: {name} given twice in {text!r}")
        terms[name] = value
    return terms


def parse_ratio(spec: str) -> RatioSpec:
    sides, colon, tail = spec.partition(":")
    m = _TAIL_RE.match(tail)
    if not colon or not m or sides.count("/") > 1:
        raise ConfigError(f"bad --ratio {spec!r}: expected NUM/DEN:METRIC>=VALUE, e.g. ddp/fsdp:tokens_per_s>=1.0 "
                          "or ddp,parallel.dispatcher=rowwise/ddp:tokens_per_s>=1.0, or a bound on the value of "
                          "each point a selector picks, SEL:METRIC<=VALUE, e.g. fsdp:peak_mem_bytes<=2e9")
    if "/" not in sides:  # SEL:METRIC<=VALUE: the metric's own value, no denominator
        value = float(m.group(3))
        if not math.isfinite(value):
            raise ConfigError(f"bad --ratio {spec!r}: the bound must be a finite number")
        return RatioSpec(spec, _side(sides, spec), {}, m.group(1), m.group(2), value)
    num_text, den_text = sides.split("/")
    num, den = _side(num_text, spec), _side(den_text, spec)
    if num == den:
        raise ConfigError(f"bad --ratio {spec!r}: both sides select the same points")
    value = float(m.group(3))
    # the metrics are positive, so their ratio is too: a bound of 0 or below (1e-400 is 0) always holds
    # (or never does) and inf never does; either would make the gate say nothing
    if not 0 < value < math.inf:
        raise ConfigError(f"bad --ratio {spec!r}: the bound must be a finite number above 0, e.g. >=1.0")
    return RatioSpec(spec, num, den, m.group(1), m.group(2), value)


@dataclass
class RatioPair:
    num_label: str
    den_label: str
    num_value: float | None
    den_value: float | None
    ratio: float | None
    passed: bool  # not a clear miss: holds, or inconclusive
    note: str = ""
    # Confidence interval of the ratio from the step samples, when the bound is missed and samples exist.
    ci_low: float | None = None
    ci_high: float | None = None
    inconclusive: bool = False  # misses the bound, but the noise (or a single run) cannot say it really does
    unequal_work: bool = False  # the sides dropped different shares of routes (refused unless allowed)
    refused: bool = False  # unequal work without allow_unequal_work: no verdict, fails the gate

    @property
    def outcome(self) -> str:
        if self.refused:
            return "unequal work"
        return "inconclusive" if self.inconclusive else "pass" if self.passed else "fail"


@dataclass
class RatioResult:
    spec: RatioSpec
    pairs: list[RatioPair]
    unmatched: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.pairs)

    @property
    def inconclusive(self) -> int:
        return sum(p.inconclusive for p in self.pairs)


def _resolve(t: pd.DataFrame, name: str, spec: str) -> str:
    col = resolve_field(t, name) or ("." not in name and resolve_field(t, f"parallel.{name}"))
    if not col:
        raise ConfigError(f"--ratio {spec!r}: no field {name!r} in the store (try parallel.strategy, "
                          "parallel.dispatcher, moe.num_experts, precision ...)")
    return col


def unequal_work_note(t: pd.DataFrame, r: int, d: int) -> str | None:
    """``unequal work: ddp ... drops 10.9% of routes, fsdp 0%`` when the two points' dropped shares
    differ beyond :data:`DROP_TOLERANCE`; None when they agree or one is unknown (a dense model)."""
    nf, df = as_float(t.at[r, "dropped_fraction"]), as_float(t.at[d, "dropped_fraction"])
    if nf is None or df is None or not abs(nf - df) > DROP_TOLERANCE:
        return None
    return (f"unequal work: {t.at[r, 'label']} drops {share_text(nf)} of routes, {t.at[d, 'label']} "
            f"{share_text(df)} (tolerance {100 * DROP_TOLERANCE:g} percentage points)")


def ratio_matches(t: pd.DataFrame, num: dict[str, str], den: dict[str, str],
                  text: str) -> tuple[pd.Index, pd.Index, dict[Any, Any]]:
    """The NUM rows, the DEN candidates and each NUM row's DEN partner in ``t`` (one row per point), paired
    as the module docstring says; ``text`` names the comparison in the error for an unknown field."""
    num_sel = {_resolve(t, name, text): value for name, value in num.items()}
    den_sel = {_resolve(t, name, text): value for name, value in den.items()}
    named_cols = named_columns(t, [*num_sel, *den_sel])
    hard = [c for c in t.columns if c.startswith("config.") and not c.startswith("config.parallel.")
            and c not in named_cols]
    hard += [c for c in ("world_size", "run_id") if c in t.columns and c not in named_cols]
    loose = [c for c in LOOSE if c not in named_cols]
    soft = [c for c in t.columns if c.startswith("config.parallel.") and c not in named_cols]
    num_mask = selector_mask(t, num_sel)
    den_mask = selector_mask(t, den_sel) & ~num_mask
    rows, candidates = t.index[num_mask.to_numpy()], t.index[den_mask.to_numpy()]
    return rows, candidates, best_matches(t, rows, candidates, sorted(hard), sorted(soft), loose)


def evaluate_ratio(t: pd.DataFrame, spec: RatioSpec, alpha: float = 0.05, min_samples: int = 5,
                   allow_unequal_work: bool = False) -> RatioResult:
    """Pair the points of ``t`` as described in the module docstring and test each ratio.

    A step-time-derived ratio is judged by the one rule of bounds
    (:func:`moebench.results.stats.bound_verdict`): it holds only when the whole ``1 - alpha``
    confidence interval (:func:`moebench.results.stats.metric_ratio`, over the repeats of both
    points) meets the bound, fails only when the whole interval misses it, and is inconclusive
    otherwise or without an interval (one run a side, too few steps, unsteady windows):
    reported, not failing.
    """
    check_alpha(alpha)
    t = by_point(t)
    if spec.metric not in t.columns:
        raise ConfigError(f"--ratio {spec.text!r}: no metric {spec.metric!r} in the store")
    check_numeric(t, spec.metric, f"--ratio {spec.text!r}")
    if not spec.den:
        return _bound(t, spec)
    rows, candidates, matches = ratio_matches(t, spec.num, spec.den, spec.text)
    if not matches:
        strategies = ", ".join(sorted(t["strategy"].dropna().astype(str).unique()))
        raise ConfigError(f"--ratio {spec.text!r}: no point pairs ({len(rows)} points match NUM, {len(candidates)} "
                          f"match DEN, none of them agree on model, precision and world size); strategies in the "
                          f"store: {strategies or 'none'}")
    op = OPS[spec.op]
    pairs = []
    for r, d in matches.items():
        nl, dl = str(t.at[r, "label"]), str(t.at[d, "label"])
        bad = [f"{side} {t.at[i, 'status']}" for side, i in (("numerator", r), ("denominator", d))
               if t.at[i, "status"] != "ok"]
        nv, dv = as_float(t.at[r, spec.metric]), as_float(t.at[d, spec.metric])
        if bad:
            pairs.append(RatioPair(nl, dl, nv, dv, None, False, "; ".join(bad)))
            continue
        if nv is None or dv is None or dv == 0:
            pairs.append(RatioPair(nl, dl, nv, dv, None, False, f"{spec.metric} missing or zero"))
            continue
        ratio = nv / dv
        unequal = unequal_work_note(t, r, d)
        if unequal and not allow_unequal_work:
            pairs.append(RatioPair(nl, dl, nv, dv, ratio, False, f"no verdict: {unequal} (--allow-unequal-work "
                                   "judges it anyway)", unequal_work=True, refused=True))
            continue
        passed, low, high, note, unsure = bool(op(ratio, spec.value)), None, None, "", False
        if spec.metric not in FROM_STEP_TIME:
            # peak memory, bytes sent: one deterministic value per point, no step samples to be noisy
            note = f"{spec.metric} is one measured value per point (no step samples): the bound holds or not"
        else:
            ci = metric_ratio(t.loc[r], t.loc[d], spec.metric, confidence=1 - alpha, min_samples=min_samples)
            verdict, detail = bound_verdict(ci, spec.op, spec.value) if ci is not None else \
                (UNDECIDED, "no step samples on a side, no verdict")
            low, high = (ci.low, ci.high) if ci is not None and ci.has_ci else (None, None)
            side = "meets" if passed else "misses"
            undecided = f"{side} the bound within the noise ({detail})" if low is not None else \
                f"{side} the bound, but {detail}"
            note = detail if verdict in (HOLDS, FAILS) else undecided
            passed, unsure = verdict != FAILS, verdict == UNDECIDED
        note = "; ".join(x for x in (unequal, note) if x)
        pairs.append(RatioPair(nl, dl, nv, dv, ratio, passed, note, low, high, unsure, unequal_work=bool(unequal)))
    unmatched = [str(t.at[r, "label"]) for r in rows if r not in matches]
    return RatioResult(spec, pairs, unmatched)


def _bound(t: pd.DataFrame, spec: RatioSpec) -> RatioResult:
    """``SEL:METRIC<=VALUE``: each point the selector picks, its own (repeat-folded) value against the bound.

    Works from one value per point (a peak memory needs no repeats): no interval is sought, a value past
    the bound fails and a point that is not ok fails."""
    sel = {_resolve(t, name, spec.text): value for name, value in spec.num.items()}
    rows = t.index[selector_mask(t, sel).to_numpy()]
    if not len(rows):
        picked = ", ".join(f"{k}={v}" for k, v in spec.num.items())
        raise ConfigError(f"--ratio {spec.text!r}: no point matches {picked}")
    op, pairs = OPS[spec.op], []
    for r in rows:
        label, value = str(t.at[r, "label"]), as_float(t.at[r, spec.metric])
        if t.at[r, "status"] != "ok" or value is None:
            why = f"point {t.at[r, 'status']}" if t.at[r, "status"] != "ok" else f"{spec.metric} not recorded"
            pairs.append(RatioPair(label, "", value, None, None, False, why))
            continue
        passed = bool(op(value, spec.value))
        pairs.append(RatioPair(label, "", value, None, None, passed, f"one value per point, bound {spec.value:g}"))
    return RatioResult(spec, pairs)
