"""Match points that differ only in their parallel layout.

Reports pair every point with its *baseline* point (the suite's ``baseline`` selector in
meta.json, ``{"parallel.strategy": "fsdp"}`` by default): same model (preset, ``model.*``
and ``moe.*`` config but the compute backend), same precision, world size and device. When
several baseline points qualify, the one whose remaining config differs in the fewest
fields wins (e.g. the same batch size and seed). Precision and device are loose keys:
equal where both points recorded them, since a crash recorded by the sweep runner carries
neither. Fields the selector names are what the
pair differs in, so they leave the match key (a ``precision.mode: bf16`` baseline pairs
across precisions).

The ratio gate (:mod:`moebench.report.gate.ratio`) uses the same matcher with a stricter key:
every config field outside ``parallel.*`` must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from moebench.results.stats import metric_ratio
from moebench.results.store import DEFAULT_BASELINE
from moebench.results.subject import add_subjects
from moebench.results.table import by_point, field_candidates, norm_value, resolve_field

# Implementation choices that do not change the model being trained.
_NOT_MODEL = ("config.moe.backend",)
# Two sides whose dropped shares of routes differ by more than this did not do the same work.
DROP_TOLERANCE = 0.005
# The baseline's fields a comparison carries as they are (the rest are numbers): what qualifies a verdict
# (a throttled or emulated side) and names the baseline.
_BASE_TEXT = ("variant", "label", "throttled", "precision", "precision_impl")
# A point "diverges" when its mean loss over the last steps (table.compared_loss) is above the
# baseline's by more than LOSS_SIGMAS standard errors of that difference, from the baseline's
# step-to-step spread (a faster precision that does not train the same model is not faster), and
# by at least LOSS_FLOOR of the baseline's loss (a curve so smooth that its spread is ~0 is no
# licence to flag rounding). Judged only between points that train the same model (LOSS_MODEL).
LOSS_SIGMAS = 3.0
LOSS_FLOOR = 0.005
# What decides the model a run trains: its architecture and routing, and the optimisation it gets.
LOSS_MODEL = ("config.model.", "config.moe.", "config.train.lr", "config.train.global_batch_size",
              "config.train.seed", "config.train.data", "config.train.seq_len")
# ... but not the expert backend (the same math) nor the capacity (a layout choice: its drops are
# exactly what the loss judgement should see)
_NOT_LOSS_MODEL = (*_NOT_MODEL, "config.moe.capacity", "config.moe.capacity_factor")


def keys(df: pd.DataFrame, cols: Sequence[str]) -> pd.Series:
    """One hashable, normalised tuple per row over ``cols``."""
    return pd.Series([tuple(norm_value(v) for v in row) for row in df[list(cols)].itertuples(index=False)]
                     if cols else [()] * len(df), index=df.index, dtype=object)


def selector_mask(df: pd.DataFrame, selector: dict[str, Any]) -> pd.Series:
    """Rows whose fields equal every ``field: value`` of the selector (unknown field: no row)."""
    mask = pd.Series(True, index=df.index)
    for name, value in selector.items():
        col = resolve_field(df, name)
        if col is None:
            return pd.Series(False, index=df.index)
        mask &= df[col].map(norm_value) == norm_value(value)
    return mask


# Fields a run measures or resolves (a point that failed early has none of them): they must
# agree where both sides have them, and a missing one matches anything.
LOOSE = ("precision", "device_name")


def best_matches(df: pd.DataFrame, rows: pd.Index, candidates: pd.Index, hard: Sequence[str],
                 soft: Sequence[str], loose: Sequence[str] = LOOSE) -> dict[Any, Any]:
    """For each row, the candidate with equal ``hard`` columns, compatible ``loose`` ones
    (equal, or missing on either side) and the fewest differing ``soft`` ones; among those, the
    same repeat (the run of the other point that ran next to it, round-robin)."""
    loose = [c for c in loose if c in df.columns and c not in hard]
    hard_keys, soft_keys, loose_keys = keys(df, hard), keys(df, soft), keys(df, loose)
    repeat = df["repeat"] if "repeat" in df.columns else pd.Series(0, index=df.index)
    pool: dict[tuple, list[Any]] = {}
    for c in candidates:
        pool.setdefault(hard_keys[c], []).append(c)

    def compatible(r: Any, c: Any) -> bool:
        return all(a == b or "none" in (a, b) for a, b in zip(loose_keys[r], loose_keys[c], strict=True))

    out: dict[Any, Any] = {}
    for r in rows:
        found = [c for c in pool.get(hard_keys[r], []) if compatible(r, c)]
        if r in found:
            out[r] = r
        elif found:
            out[r] = min(found, key=lambda c: (sum(a != b for a, b in zip(soft_keys[r], soft_keys[c], strict=True)),
                                               repeat[r] != repeat[c]))
    return out


def model_columns(df: pd.DataFrame) -> list[str]:
    cols = [c for c in df.columns if c.startswith(("config.model.", "config.moe.")) and c not in _NOT_MODEL]
    return [*sorted(cols), "preset", "world_size"]


def named_columns(df: pd.DataFrame, names: Sequence[str]) -> set[str]:
    """Every column that holds (part of) the named fields, e.g. for ``precision.mode`` also the
    record's resolved ``precision``; for ``precision`` also ``config.precision.*``.

    Fields named by a selector are what the two sides of a comparison differ in, so they
    must not be part of the key the sides are matched on.
    """
    out: set[str] = set()
    for name in names:
        col = resolve_field(df, name) or name
        short = col.removeprefix("config.").removeprefix("point.")
        out |= {col, *field_candidates(short), short.split(".")[0]}
        out |= {c for c in df.columns if c.startswith(f"config.{short}.")}
    return out


def pair_with_baseline(t: pd.DataFrame, metas: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Add ``baseline_point_id``, ``speedup``, ``mem_ratio`` and ``comm_ratio`` columns.

    ``speedup`` is tokens/s per device over the baseline's, with its 95% interval and verdict
    from :mod:`moebench.results.stats` (``speedup_low``, ``speedup_high``, ``speedup_verdict``,
    ``inconclusive``) and ``drops_differ`` when the two sides dropped shares of their routes
    more than :data:`DROP_TOLERANCE` apart; ``baseline_throttled``, ``baseline_precision`` and
    ``baseline_precision_impl`` (what qualifies a verdict: :mod:`moebench.report.headline`);
    ``loss_delta``, the relative change of the mean loss over the last steps up to
    ``train.steps`` (:func:`moebench.results.table.compared_loss`) over the baseline's,
    ``loss_tolerance`` the relative rise that counts, and ``diverges`` when it is higher by more
    than that (see :data:`LOSS_SIGMAS`); both NaN/False between points that do not train the same
    model (``loss_judged``); ``subject``, ``subject_at`` and ``baseline_shown``, what the report calls the
    comparison and its baseline (:mod:`moebench.results.subject`);
    ``mem_ratio`` the allocator peak over the baseline's; ``comm_ratio`` communicated bytes per
    step over the baseline's. A baseline point is paired with itself (ratios of 1, no interval). The
    repeats of a point are folded first (:func:`moebench.results.table.by_point`): one row per point.
    """
    t = by_point(t).copy()
    selectors = {m.get("run_id"): (m.get("baseline") or DEFAULT_BASELINE) for m in metas}
    run_ids = t["run_id"] if "run_id" in t.columns else pd.Series([None] * len(t), index=t.index)
    ok = t["status"] == "ok"
    matches: dict[Any, Any] = {}
    for run_id in run_ids.unique():
        selector = selectors.get(run_id, DEFAULT_BASELINE)
        # A suite whose baseline is a precision (or any model field) compares across it.
        named = named_columns(t, list(selector))
        hard = [c for c in model_columns(t) if c not in named]
        loose = [c for c in LOOSE if c not in named]
        soft = sorted(c for c in t.columns if c.startswith("config.") and c not in hard and c not in named)
        rows = t.index[(run_ids == run_id).to_numpy()]
        candidates = t.index[(selector_mask(t, selector) & ok).to_numpy()]
        # Prefer a baseline from the same run; fall back to any loaded run on the same device.
        same_run = candidates[(run_ids[candidates] == run_id).to_numpy()]
        found = best_matches(t, rows, same_run, hard, soft, loose)
        rest = rows.difference(pd.Index(list(found)))
        found.update(best_matches(t, rest, candidates, hard, soft, loose))
        matches.update(found)
    base = pd.Series(matches, dtype=object).reindex(t.index)
    t["baseline_point_id"] = [t.at[b, "point_id"] if b is not None and b == b else None for b in base]
    t["baseline_row"] = base  # the baseline's row label, for whatever else compares a row with its baseline

    def ratio(col: str) -> list[float]:
        out = []
        for i, b in base.items():
            if b is None or b != b or t.at[i, "status"] != "ok":
                out.append(float("nan"))
                continue
            num, den = t.at[i, col], t.at[b, col]
            out.append(num / den if den and den == den and num == num else float("nan"))
        return out

    suites = {m.get("run_id"): str(m.get("suite")) for m in metas}
    baselines: dict[str, set[str]] = {}
    for r in run_ids.unique():
        text = ", ".join(f"{k}={v}" for k, v in selectors.get(r, DEFAULT_BASELINE).items())
        baselines.setdefault(suites.get(r, "?"), set()).add(text)
    # one selector per suite, each under its suite's name: two suites' baselines never read as one
    t.attrs["baselines"] = {suite: " or ".join(sorted(texts)) for suite, texts in sorted(baselines.items())}
    texts = set(t.attrs["baselines"].values())
    t.attrs["baseline"] = texts.pop() if len(texts) == 1 else "; ".join(
        f"{suite}: {text}" for suite, text in t.attrs["baselines"].items())
    t["speedup"] = ratio("tokens_per_s_per_device")
    t["mem_ratio"] = ratio("peak_mem_bytes")
    t["comm_ratio"] = ratio("comm_bytes_total")
    _speedup_noise(t, base)
    add_subjects(t)
    return t


def _speedup_noise(t: pd.DataFrame, base: pd.Series) -> None:
    low, high, verdict, inconclusive, unsteady = [], [], [], [], []
    speedup = t["speedup"].copy()
    base_of = {name: [] for name in ("dropped_fraction", "step_time_cv", "loss_compared", "loss_spread",
                                     "loss_window", "runs", "run_spread", *_BASE_TEXT)}
    for i, b in base.items():
        paired = b is not None and b == b and t.at[i, "status"] == "ok" and b != i
        r = metric_ratio(t.loc[i], t.loc[b]) if paired else None
        low.append(r.low if r is not None and r.has_ci else float("nan"))
        high.append(r.high if r is not None and r.has_ci else float("nan"))
        verdict.append(r.verdict if r is not None else None)
        if r is not None:  # from the step samples, so value, interval and verdict agree
            speedup[i] = r.value
        inconclusive.append(r is not None and r.inconclusive)
        unsteady.append(r.unsteady if r is not None else None)
        for name, values in base_of.items():
            values.append(t.at[b, name] if paired else None)
    t["speedup"], t["speedup_low"], t["speedup_high"], t["speedup_verdict"] = speedup, low, high, verdict
    t["inconclusive"] = inconclusive
    t["speedup_unsteady"] = pd.Series(unsteady, index=t.index, dtype=object)
    for name, values in base_of.items():
        t[f"baseline_{name}"] = pd.Series(values, index=t.index, dtype=object if name in _BASE_TEXT else float)
    # Nothing known on one side (a dense model routes nothing) is not a difference.
    gap = (t["dropped_fraction"] - t["baseline_dropped_fraction"]).abs()
    t["drops_differ"] = (gap > DROP_TOLERANCE).fillna(False).astype(bool)
    _loss_judgement(t, base)


def loss_model_columns(t: pd.DataFrame) -> list[str]:
    return sorted(c for c in t.columns if c.startswith(LOSS_MODEL) and c not in _NOT_LOSS_MODEL)


def _loss_judgement(t: pd.DataFrame, base: pd.Series) -> None:
    """``loss_delta``, ``loss_tolerance``, ``loss_judged`` and ``diverges`` (see :func:`pair_with_baseline`)."""
    model = keys(t, loss_model_columns(t))
    judged = [b is not None and b == b and b != i and model[i] == model[b] for i, b in base.items()]
    t["loss_judged"] = pd.Series(judged, index=t.index, dtype=bool)
    base_mean = t["baseline_loss_compared"].abs()
    # the spread of one step's loss, over the baseline's window of w steps: the mean of each side
    # has w samples, so their difference has a standard error of spread * sqrt(2 / w)
    se = t["baseline_loss_spread"] * np.sqrt(2 / t["baseline_loss_window"])
    t["loss_tolerance"] = np.maximum(LOSS_SIGMAS * se / base_mean, LOSS_FLOOR).where(t["loss_judged"])
    # at the steps both reached (table.compared_loss): runs of an adaptive warm-up end at different steps
    delta = (t["loss_compared"] - t["baseline_loss_compared"]) / base_mean
    t["loss_delta"] = delta.where(t["loss_judged"])
    # diverging is training worse: a loss that ends lower is not held against a layout
    t["diverges"] = (t["loss_delta"] > t["loss_tolerance"].fillna(LOSS_FLOOR)).fillna(False).astype(bool)
