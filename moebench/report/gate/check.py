"""The regression gate: compare a CURRENT results store against a BASELINE store.

Points are matched by ``config_hash`` (the resolved config); points left over on both sides
are then matched by ``(suite, point_id)``, so a config field added by the change under test
does not turn every point into new + missing. Each metric has a threshold and a direction
(throughput: higher is better; memory, time, loss: lower is better). A change counts only
when it passes the threshold *and*, for metrics derived from step time, the ``1 - alpha``
bootstrap confidence interval of the current-over-baseline ratio (:mod:`moebench.results.stats`,
the same numbers a report shows, over the repeats of each point) excludes 1.0; metrics without
samples (memory) are judged on the threshold alone. A change beyond the threshold whose
interval includes 1.0, or with one run on a side, is ``inconclusive``: not a pass, not a
regression; the gate fails on it unless told to warn. Evidence pooled over the points (the
mean log ratio) can decide where no single point can.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from moebench.errors import ConfigError
from moebench.record import METRICS
from moebench.report.gate.interconnect import interconnect_warnings
from moebench.report.gate.work import WorkChange, compare_work, varies
from moebench.results.stats import CONFIDENCE, NO_VERDICT, Ratio, metric_ratio
from moebench.results.table import as_float, by_point, is_missing

HIGHER_IS_BETTER = frozenset(m.name for m in METRICS.values() if m.direction == "higher")
LOWER_IS_BETTER = frozenset(m.name for m in METRICS.values() if m.direction == "lower")
# Their noise is the step-time noise: the raw step samples give them a confidence interval.
FROM_STEP_TIME = frozenset(m.name for m in METRICS.values() if m.from_step_time)
DEFAULT_METRICS = ("tokens_per_s:-5%", "peak_mem_bytes:+5%")
CATEGORIES = ("regressed", "failed", "inconclusive", NO_VERDICT, "improved", "unchanged", "new", "missing")
ON_INCONCLUSIVE = ("fail", "warn")


@dataclass(frozen=True)
class MetricRule:
    name: str
    threshold: float  # relative change that counts, e.g. 0.05
    higher_is_better: bool

    def __str__(self) -> str:
        return f"{self.name}:{'-' if self.higher_is_better else '+'}{100 * self.threshold:g}%"


_METRIC_RE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*:\s*([+-]?)\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_metric(spec: str) -> MetricRule:
    """``NAME:[+|-]PCT%``: the sign says which way is a regression (``-``: a drop).

    The sign may be left out for known metrics (their direction is built in); it must
    agree with the built-in direction when given.
    """
    m = _METRIC_RE.match(spec)
    if not m:
        raise ConfigError(f"bad --metric {spec!r}: expected NAME:[+|-]PCT%, e.g. tokens_per_s:-5% or "
                          "peak_mem_bytes:+5%")
    name, sign, pct = m.group(1), m.group(2), float(m.group(3))
    known = True if name in HIGHER_IS_BETTER else False if name in LOWER_IS_BETTER else None
    if known is None and name.endswith(("_bytes", "_s")):
        known = False
    if sign:
        wanted = sign == "-"
        if known is not None and wanted != known:
            direction = "higher" if known else "lower"
            raise ConfigError(f"bad --metric {spec!r}: {name} is {direction}-is-better, so a regression is a "
                              f"{'drop' if known else 'rise'}; write {name}:{'-' if known else '+'}{pct:g}%")
        known = wanted
    if known is None:
        raise ConfigError(f"bad --metric {spec!r}: unknown direction for {name}; write {name}:-{pct:g}% if higher "
                          f"is better or {name}:+{pct:g}% if lower is better")
    # Any digits parse, so "-" followed by 400 nines is inf; and no positive metric drops by 100% or
    # more: either threshold would turn the gate off without saying so
    if not 0 < pct < math.inf:
        raise ConfigError(f"bad --metric {spec!r}: the threshold must be a finite percentage above 0%")
    if known and pct >= 100:
        raise ConfigError(f"bad --metric {spec!r}: {name} cannot drop by {pct:g}% or more, so the gate could never "
                          "fail; the threshold of a drop must be below 100%")
    return MetricRule(name, pct / 100, known)


@dataclass
class MetricResult:
    metric: str
    baseline: float | None
    current: float | None
    change: float | None  # (current - baseline) / baseline
    # Confidence interval of current / baseline from the step samples (None: threshold only).
    ci_low: float | None
    ci_high: float | None
    verdict: str  # regressed | inconclusive | no verdict | improved | unchanged
    note: str = ""
    # The smallest relative change the data could have told from noise (the interval's half-width).
    detectable: float | None = None
    runs: tuple[int, int] | None = None  # runs behind current and baseline, where an interval was sought
    higher_is_better: bool = True

    @property
    def unsure_against(self) -> bool:
        """Undecided (inconclusive, or no verdict) with the measured change in the bad direction: what the
        gate fails on under ``--on-inconclusive fail``. An undecided change for the better never fails it."""
        if self.verdict not in ("inconclusive", NO_VERDICT) or self.change is None:
            return False
        return self.change < 0 if self.higher_is_better else self.change > 0


@dataclass
class PointResult:
    label: str
    category: str
    baseline_status: str | None
    current_status: str | None
    metrics: list[MetricResult] = field(default_factory=list)
    note: str = ""
    error: str = ""  # the current side's error, for a point that is not ok
    work: list[WorkChange] = field(default_factory=list)  # exact work counts that changed (report/gate/work.py)

    @property
    def fails_gate(self) -> bool:
        # A point that failed the same way in the baseline is a known failure, not a new one.
        newly_failed = self.category == "failed" and self.baseline_status != self.current_status
        return self.category == "regressed" or newly_failed


@dataclass
class Pooled:
    """One metric over every compared point: the geometric mean of current / baseline with its interval."""

    metric: str
    points: int
    ratio: Ratio
    verdict: str  # regressed | improved | unchanged | inconclusive
    same_direction: int  # points whose change went the pooled way


@dataclass
class Comparison:
    rules: list[MetricRule]
    alpha: float
    points: list[PointResult]
    pooled: list[Pooled] = field(default_factory=list)
    allow_missing: bool = False

    def counts(self) -> dict[str, int]:
        return {c: sum(p.category == c for p in self.points) for c in CATEGORIES}

    @property
    def missing(self) -> list[PointResult]:
        """BASELINE's points that CURRENT lacks, when that fails the gate."""
        return [] if self.allow_missing else [p for p in self.points if p.category == "missing"]

    @property
    def failed_gate(self) -> bool:
        pooled_regressed = any(p.verdict == "regressed" for p in self.pooled)
        return any(p.fails_gate for p in self.points) or bool(self.missing) or pooled_regressed

    @property
    def inconclusive(self) -> bool:
        """Some point is undecided with its change in the bad direction (:attr:`MetricResult.unsure_against`)
        and no pooled verdict settles its metric."""
        settled = {p.metric for p in self.pooled if p.verdict != "inconclusive"}
        return any(m.unsure_against and m.metric not in settled for p in self.points for m in p.metrics)

    def exit_code(self, on_inconclusive: str = "fail") -> int:
        """1 when the gate fails, or when it is inconclusive and ``on_inconclusive`` is ``fail``; else 0."""
        return 1 if self.failed_gate or (self.inconclusive and on_inconclusive == "fail") else 0


def _match_key(t: pd.DataFrame) -> pd.Series:
    """The resolved-config hash; the store key where a record has none (e.g. an invalid config)."""
    key = t["key"] if "key" in t.columns else t["point_id"]
    if "config_hash" not in t.columns:
        return key.astype(str)
    return t["config_hash"].where(t["config_hash"].notna(), key).astype(str)


def match_points(base: pd.DataFrame, cur: pd.DataFrame) -> list[tuple[Any, Any, str]]:
    """(baseline index | None, current index | None, how) for every point of either side."""
    bkey, ckey = _match_key(base), _match_key(cur)
    # A point run twice keeps its last record.
    b_by = {k: i for i, k in bkey.items()}
    c_by = {k: i for i, k in ckey.items()}
    pairs = [(b_by[k], c_by[k], "config") for k in c_by if k in b_by]
    b_left = {(base.at[i, "suite"], base.at[i, "point_id"]): i for k, i in b_by.items() if k not in c_by}
    c_left = {(cur.at[i, "suite"], cur.at[i, "point_id"]): i for k, i in c_by.items() if k not in b_by}
    pairs += [(b_left[k], i, "point id") for k, i in c_left.items() if k in b_left]
    pairs += [(None, i, "") for k, i in c_left.items() if k not in b_left]
    pairs += [(i, None, "") for k, i in b_left.items() if k not in c_left]
    return pairs


def compare_metric(rule: MetricRule, b: pd.Series, c: pd.Series, alpha: float, min_samples: int) -> MetricResult:
    """One metric of one matched point. A metric derived from step time is judged by the interval of its
    current / baseline ratio (:mod:`moebench.results.stats`): no interval (one run a side, too few steps, an
    unsteady timed window), no verdict, whatever the size of the change. Others (memory) by the threshold."""
    bv, cv = as_float(b.get(rule.name)), as_float(c.get(rule.name))
    hib = rule.higher_is_better
    if bv is None or cv is None or bv == 0:
        return MetricResult(rule.name, bv, cv, None, None, None, "unchanged", "not reported on both sides",
                            higher_is_better=hib)
    change = (cv - bv) / bv
    worse = -change if hib else change
    verdict = "regressed" if worse > rule.threshold else "improved" if -worse > rule.threshold else "unchanged"
    if rule.name not in FROM_STEP_TIME:
        return MetricResult(rule.name, bv, cv, change, None, None, verdict, "no raw samples: threshold only",
                            higher_is_better=hib)
    ratio = metric_ratio(c, b, rule.name, confidence=1 - alpha, min_samples=min_samples)
    if ratio is None or ratio.why is not None:
        why = ratio.why if ratio is not None else "no step samples on a side"
        return MetricResult(rule.name, bv, cv, change, None, None, NO_VERDICT, f"{why}, {NO_VERDICT}",
                            runs=ratio.runs if ratio is not None else None, higher_is_better=hib)
    result = MetricResult(rule.name, bv, cv, change, ratio.low, ratio.high, verdict, "", ratio.detectable, ratio.runs,
                          hib)
    if abs(worse) > rule.threshold and not ratio.excludes(1.0):
        result.verdict, result.note = "inconclusive", "beyond threshold but within noise"
    elif abs(worse) <= rule.threshold:
        # "unchanged" is a claim too: that no regression beyond the threshold hides in the noise
        reach = (1 - ratio.low) if hib else (ratio.high - 1)
        if reach > rule.threshold:
            result.verdict = "inconclusive"
            result.note = f"within threshold, but the interval reaches a {100 * reach:.1f}% regression"
    return result


def pool(rule: MetricRule, results: list[MetricResult], alpha: float) -> Pooled | None:
    """The metric over every point with an interval: the mean log ratio, its interval from the points' own.

    Each point's interval gives its standard error on the log scale (half-width over the
    normal quantile; the intervals are already widened for few runs); the points are
    independent processes, so the mean's standard error is their root sum of squares over the
    number of points. Needs two points or more.
    """
    from scipy.special import ndtri

    rated = [m for m in results if m.ci_low is not None and m.ci_high is not None and m.change is not None
             and m.ci_low > 0 and m.current and m.baseline]
    if len(rated) < 2:
        return None
    z = float(ndtri(1 - alpha / 2))
    logs = [math.log(m.current / m.baseline) for m in rated]
    ses = [(math.log(m.ci_high) - math.log(m.ci_low)) / (2 * z) for m in rated]
    centre, se = sum(logs) / len(logs), math.sqrt(sum(x * x for x in ses)) / len(logs)
    runs = min((m.runs for m in rated if m.runs), default=(2, 2))
    ratio = Ratio(math.exp(centre), math.exp(centre - z * se), math.exp(centre + z * se), 1 - alpha,
                  rule.threshold, runs)
    worse = -(ratio.value - 1) if rule.higher_is_better else ratio.value - 1
    same = sum((x > 0) == (centre > 0) for x in logs)
    if abs(worse) <= rule.threshold:
        # no verdict on the mean only settles the points when it rules out a change as big as the threshold
        bad_side = ratio.low if rule.higher_is_better else ratio.high
        settled = abs(bad_side - 1) <= rule.threshold
        return Pooled(rule.name, len(rated), ratio, "unchanged" if settled else "inconclusive", same)
    if not ratio.excludes(1.0):
        return Pooled(rule.name, len(rated), ratio, "inconclusive", same)
    return Pooled(rule.name, len(rated), ratio, "regressed" if worse > 0 else "improved", same)


def check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha {alpha} must be between 0 and 1")


def check_numeric(t: pd.DataFrame, name: str, what: str) -> None:
    """A gated field must hold numbers: ``status``, a hash or a list of samples cannot be compared."""
    for i, value in t[name].items():
        if not is_missing(value) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            where = f"{t['store'][i]} point {t['point_id'][i]}" if "store" in t.columns else f"point {t['point_id'][i]}"
            shown = f"a {type(value).__name__}" if isinstance(value, (list, dict)) else repr(value)[:40]
            raise ConfigError(f"{what}: field {name!r} of {where} is {shown}, not a number; gate a "
                              f"numeric metric such as {' or '.join(m.partition(':')[0] for m in DEFAULT_METRICS)}")


def _error(row: pd.Series) -> str:
    """A not-ok point's recorded error, on one line (empty when it recorded none)."""
    error = row.get("error")
    return "" if is_missing(error) or row.get("status") == "ok" else " ".join(str(error).split())


def compare(base: pd.DataFrame, cur: pd.DataFrame, rules: list[MetricRule], alpha: float = 1 - CONFIDENCE,
            min_samples: int = 5, allow_missing: bool = False) -> Comparison:
    """Classify every point as regressed / failed / inconclusive / improved / unchanged / new / missing.

    The repeats of each point are folded first (:func:`moebench.results.table.by_point`). A
    point of BASELINE that CURRENT lacks fails the gate unless ``allow_missing``.
    """
    check_alpha(alpha)
    base, cur = by_point(base), by_point(cur)
    for rule in rules:
        if rule.name not in base.columns and rule.name not in cur.columns:
            raise ConfigError(f"--metric {rule.name}: no such field in the stores; try one of "
                              f"{', '.join(sorted(HIGHER_IS_BETTER | LOWER_IS_BETTER))}")
        for t in (base, cur):
            if rule.name in t.columns:
                check_numeric(t, rule.name, f"--metric {rule}")
    matches = match_points(base, cur)
    if not base.empty and not cur.empty and not any(bi is not None and ci is not None for bi, ci, _ in matches):
        # every point "new" and every baseline point "missing" would pass the gate without comparing anything
        suites = [", ".join(sorted(map(str, t["suite"].dropna().unique()))) or "unknown" for t in (base, cur)]
        raise ConfigError(f"BASELINE (suite {suites[0]}) and CURRENT (suite {suites[1]}) share no point, by config "
                          "or by point id: nothing to compare; is BASELINE the right store?")
    points = []
    for bi, ci, how in matches:
        b = base.loc[bi] if bi is not None else None
        c = cur.loc[ci] if ci is not None else None
        label = str((c if c is not None else b)["label"])
        bs = str(b["status"]) if b is not None else None
        cs = str(c["status"]) if c is not None else None
        if b is None or c is None:
            category = "new" if b is None else "missing"
            points.append(PointResult(label, "failed" if cs not in (None, "ok") else category, bs, cs,
                                      error=_error(c) if c is not None else ""))
            continue
        note = "matched by point id (config differs)" if how == "point id" else ""
        if cs != "ok":
            points.append(PointResult(label, "failed", bs, cs, note=note, error=_error(c)))
            continue
        if bs == "timeout":  # the baseline's machine was too slow, not its code wrong: nothing to compare
            points.append(PointResult(label, NO_VERDICT, bs, cs, note=f"baseline timed out ({_error(b)})"))
            continue
        if bs != "ok":
            points.append(PointResult(label, "improved", bs, cs, note=f"baseline was {bs}"))
            continue
        metrics = [compare_metric(r, b, c, alpha, min_samples) for r in rules]
        varying = varies(b) or varies(c)
        work = [] if varying else compare_work(b, c)
        verdicts = {m.verdict for m in metrics} | ({"regressed"} if any(w.regressed for w in work) else set())
        category = next((v for v in ("regressed", "inconclusive", NO_VERDICT, "improved") if v in verdicts),
                        "unchanged")
        if varying:
            note = "; ".join(x for x in (note, "exact work counts differ between the runs of a point: not compared")
                             if x)
        points.append(PointResult(label, category, bs, cs, metrics, note, work=work))
    order = {c: i for i, c in enumerate(CATEGORIES)}
    points.sort(key=lambda p: (order[p.category], p.label))
    pooled = [pool(r, [m for p in points for m in p.metrics if m.metric == r.name], alpha)
              for r in rules if r.name in FROM_STEP_TIME]
    return Comparison(rules, alpha, points, [p for p in pooled if p is not None], allow_missing)


def _calibrated_peak(t: pd.DataFrame) -> tuple[float, str, str] | None:
    """The median CPU calibration peak (FLOP/s) of a store's points, its matmul dtype(s) and `` at load 3.7``
    (the median load average its runs started at; empty for records from before loads were kept), where they
    measured one (a record without ``peak_flops_dtype`` predates bf16 calibrations: fp32)."""
    if "peak_flops" not in t.columns or "peak_flops_source" not in t.columns:
        return None
    calibrated = t["peak_flops_source"].astype(str).str.contains("calibrat") & t["peak_flops"].notna()
    if not calibrated.any():
        return None
    dtypes = t.loc[calibrated, "peak_flops_dtype"] if "peak_flops_dtype" in t.columns else pd.Series(dtype=object)
    names = sorted({str(d) for d in dtypes.dropna()} | ({"fp32"} if dtypes.isna().any() or dtypes.empty else set()))
    loads = pd.to_numeric(t.loc[calibrated, "load_start"], errors="coerce").dropna() if "load_start" in t.columns \
        else pd.Series(dtype=float)
    at = f" at load {loads.median():.1f}" if len(loads) else ""
    return float(t.loc[calibrated, "peak_flops"].median()), "/".join(names), at


def environment_warnings(base: pd.DataFrame, cur: pd.DataFrame, base_metas: list[dict[str, Any]],
                         cur_metas: list[dict[str, Any]], names: tuple[str, str] = ("BASELINE", "CURRENT")
                         ) -> list[str]:
    """Say so when a difference between the two stores can only be the machine's, not the code's.

    ``names`` name the two sides in the message (a report says ``run 9f3e@7e1f00a``).
    """
    a, b = names
    out = []
    commits = [{((m.get("git") or {}).get("commit"), bool((m.get("git") or {}).get("dirty"))) for m in ms}
               for ms in (base_metas, cur_metas)]
    hashes = [set(t["config_hash"].dropna().astype(str)) if "config_hash" in t.columns else set() for t in (base, cur)]
    same_code = len(commits[0]) == 1 and commits[0] == commits[1] and None not in {c for c, _ in commits[0]} \
        and not any(d for _, d in commits[0]) and hashes[0] and hashes[0] == hashes[1]
    if same_code:
        out.append(f"{a} and {b} ran the same commit and the same configs: any difference between them "
                   "is the environment's (load, clocks, co-tenants), not the code's; to compare code, use "
                   "moebench check --against REV SUITE, which runs both sides interleaved on one machine")
    out += operand_warnings(base, cur, names)
    out += interconnect_warnings(base, cur, names)
    calibrations = [_calibrated_peak(t) for t in (base, cur)]
    if None in calibrations:
        return out
    (p0, d0, at0), (p1, d1, at1) = calibrations  # type: ignore[misc]
    if d0 != d1:
        out.append(f"{a} and {b} calibrated their CPU peak in different dtypes ({d0} vs {d1} matmul): their "
                   "MFU divides by different peaks and does not compare; tokens/s and step times still do")
    elif min(p0, p1) > 0 and max(p0, p1) / min(p0, p1) > 1.10:
        out.append(f"the machine's calibrated speed differs between {a} and {b} ({p0 / 1e9:.0f} GFLOP/s{at0} vs "
                   f"{p1 / 1e9:.0f} GFLOP/s{at1}, {100 * (p1 / p0 - 1):+.0f}%): part of any difference "
                   "is the environment's, not the code's; use moebench check --against REV SUITE, which runs both "
                   "sides interleaved on one machine")
    return out


# Operand statistics (moebench.metrics.operands) that tell two runs' weights apart: a share of exact zeros
# this far apart, or a scale this many times another (or zero against nonzero). Training moves the weights
# of one config by far less over a benchmark's steps; a constant, zero or rescaled init moves them by more.
OPERAND_ZERO_GAP = 0.01
OPERAND_SCALE_RATIO = 1.5


def operand_warnings(base: pd.DataFrame, cur: pd.DataFrame, names: tuple[str, str] = ("BASELINE", "CURRENT")
                     ) -> list[str]:
    """One warning when the same config ran on different operands on the two sides (the record's
    ``operand_stats``, compared config by config): a GEMM's speed depends on what it multiplies, so the
    difference is the operands', not the code's speed."""
    cols = sorted(c for c in set(base.columns) & set(cur.columns) if c.startswith("operand_stats."))
    if not cols or "config_hash" not in base.columns or "config_hash" not in cur.columns:
        return []
    differ = []
    for config in sorted(set(base["config_hash"].dropna()) & set(cur["config_hash"].dropna())):
        sides = [t[t["config_hash"] == config] for t in (base, cur)]
        for col in cols:
            was, now = (pd.to_numeric(t[col], errors="coerce").median() for t in sides)
            _, group, stat = col.split(".", 2)
            if not (pd.isna(was) or pd.isna(now)) and _operands_differ(stat, was, now):
                differ.append(f"{group} {stat} {was:.3g} vs {now:.3g}")
    if not differ:
        return []
    a, b = names
    shown = "; ".join(dict.fromkeys(differ))
    return [f"{a} and {b} ran the same configs on different weights ({shown}): a GEMM runs faster on constant or "
            "zero operands, so part of any speed difference is the operands', not the code's"]


def _operands_differ(stat: str, was: float, now: float) -> bool:
    if stat == "zero_fraction":
        return abs(was - now) > OPERAND_ZERO_GAP
    low, high = sorted((was, now))
    return (low == 0) != (high == 0) or (low > 0 and high / low > OPERAND_SCALE_RATIO)

