"""The tidy table: one row per run of a point (point and repeat) with the columns reports and gates read.

Input is the DataFrame of :func:`moebench.results.load.load_results` (flattened record
columns such as ``layout.strategy``, ``config.moe.num_experts``, ``comm_bytes_per_step.ep``).
Output keeps every ``config.*`` and ``point.*`` column (for matching) and adds canonical,
typed columns (``strategy``, ``num_experts``, ``comm_bytes_total``, ``repeat`` ...). Failed
points stay in the table with empty metrics, so nothing disappears downstream.
:func:`by_point` folds the repeats of each point into one row, for everything that compares
points (pairing, the headline, the gates).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from moebench.errors import StoreError
from moebench.record import METRICS as METRIC_SPECS
from moebench.record import unsteady
from moebench.results.load import PathArg, load_results
from moebench.results.stats import cv, side_stat, work_per_step

# Scalar metrics copied from the record (missing columns become empty); the rest are derived below.
RECORD_SCALARS = tuple(m.name for m in METRIC_SPECS.values() if not m.derived)
# List fields kept as Python lists (raw samples).
SAMPLES = ("step_times_s", "step_cpu_times_s", "step_ginstructions", "expert_load_max_over_mean", "losses")
COMM_AXES = ("dp", "ep", "edp", "pp")


def is_missing(value: Any) -> bool:
    """None, or the NaN pandas puts where a record had no value."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def is_set(value: Any) -> bool:
    """A flag that is True (a Python or numpy bool, as a column of flags holds it); None, NaN or
    a missing field is not."""
    return isinstance(value, bool | np.bool_) and bool(value)


def as_float(value: Any) -> float | None:
    return None if is_missing(value) else float(value)


def norm_value(value: Any) -> str:
    """A comparable text form of a config/point value (2 == 2.0 == "2"; NaN == None)."""
    if is_missing(value):
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def field_candidates(name: str) -> list[str]:
    """Columns that may hold a point field such as ``parallel.strategy`` or ``precision``."""
    names = [name, f"config.{name}", f"point.{name}"]
    section, _, rest = name.partition(".")
    if section == "parallel" and rest:
        names.append(f"layout.{rest}")
    return names


def resolve_field(df: pd.DataFrame, name: str) -> str | None:
    """The column holding ``name`` (``None`` if no column does)."""
    for col in field_candidates(name):
        if col in df.columns:
            return col
    return None


def _column(df: pd.DataFrame, *names: str) -> pd.Series:
    for name in names:
        if name in df.columns:
            return df[name]
    return pd.Series([None] * len(df), index=df.index, dtype=object)


def _numeric(df: pd.DataFrame, name: str, where: pd.Series) -> pd.Series:
    col = _column(df, name)
    out = pd.to_numeric(col.where(col.notna(), None), errors="coerce")
    bad = col.notna() & out.isna()
    if bad.any():
        i = bad[bad].index[0]
        raise StoreError(f"{where[i]}: field {name!r} is {col[i]!r}, not a number")
    return out.astype(float)


def _samples(df: pd.DataFrame, name: str, where: pd.Series) -> list[list[float] | None]:
    out: list[list[float] | None] = []
    for i, value in _column(df, name).items():
        if is_missing(value):
            out.append(None)
            continue
        # null is a sample that was NaN or infinite (JSON has neither): a diverged run's loss, say
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) or v is None for v in value):
            raise StoreError(f"{where[i]}: field {name!r} must be a list of numbers, got {str(value)[:60]!r}")
        out.append([math.nan if v is None else float(v) for v in value])
    return out


def _node_counts(df: pd.DataFrame, where: pd.Series) -> list[float]:
    """How many nodes each point's ranks ran on (the record's ``nodes`` list); NaN where not recorded."""
    out = []
    for i, value in _column(df, "nodes").items():
        if is_missing(value) or value == []:
            out.append(math.nan)
        elif isinstance(value, list) and all(isinstance(n, dict) for n in value):
            out.append(float(len(value)))
        else:
            raise StoreError(f"{where[i]}: field 'nodes' must be a list of {{node, hostname, ranks}}, "
                             f"got {str(value)[:60]!r}")
    return out


def variant_label(strategy: Any, ep: Any, pp: Any, dispatcher: Any, dist_opt: Any, compiled: Any = False) -> str:
    """Short name of a parallel layout: ``fsdp``, ``ddp ep8 rowwise``, ``ddp pp2 dist-opt``, ``ddp compiled``
    (a compiled run is its own variant, so a compile suite's answer reads ``ddp compiled vs ddp``)."""
    parts = [norm_value(strategy)]
    if norm_value(ep) not in ("1", "none"):
        parts.append(f"ep{norm_value(ep)}")
    if norm_value(pp) not in ("1", "none"):
        parts.append(f"pp{norm_value(pp)}")
    if norm_value(strategy) == "ddp" and norm_value(dispatcher) not in ("sync", "none"):
        parts.append(norm_value(dispatcher))
    if norm_value(dist_opt) == "true":
        parts.append("dist-opt")
    if norm_value(compiled) == "true":
        parts.append("compiled")
    return " ".join(parts)


def axis_name(col: str) -> str:
    """Short axis name for labels: ``point.moe.num_experts`` -> ``num_experts``, ``precision.mode`` -> ``precision``."""
    parts = col.removeprefix("point.").split(".")
    return parts[-2] if parts[-1] == "mode" and len(parts) > 1 else parts[-1]


# Layout axes a label leaves out: the variant names them (dp with the world size, the table's header)
VARIANT_AXES = tuple(f"point.parallel.{name}" for name in ("strategy", "dp", "ep", "pp", "dispatcher", "dist_opt"))


def _point_axes(row: pd.Series, point_cols: list[str]) -> str:
    """The point's axis values other than its layout (the variant says that; other parallel
    fields, e.g. ``rowwise_capacity``, are shown); a run whose quantized GEMMs were emulated says so."""
    parts = [f"{axis_name(c)}={norm_value(row[c])}" for c in point_cols
             if c not in VARIANT_AXES and norm_value(row[c]) != "none"]
    if row["precision_impl"] == "emulated":
        parts.append("emulated")
    return ", ".join(parts)


def run_name(suite: Any, store: Any) -> str:
    """What a run's own lines are called: ``suite / store folder``, or the name once when they are
    one name (a store ``--out smoke`` made for suite smoke)."""
    return str(suite) if str(suite) == str(store) else f"{suite} / {store}"


def _axis_key(value: Any) -> tuple[int, float | str]:
    """Sort key of one axis value: numbers by value before words, a point without the axis last."""
    if is_missing(value):
        return 2, ""
    # numpy's integers are not Python ints: a column of them (every point has the axis) sorted as text,
    # num_experts 16, 32, 64 before 8
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return 0, float(value)
    return 1, norm_value(value)


def run_order(meta: dict[str, Any]) -> tuple[str, str]:
    """The order runs are shown in: suites by name, the runs of one suite by their start."""
    return str(meta.get("suite")), str(meta.get("created_at"))


def run_tag(meta: dict[str, Any]) -> str:
    """Short name of one run: the random tail of its run id and its commit, ``a1b2@0d579b9``; a run
    id of another shape (a date-time without a tail, a name ``--out`` gave) is kept whole."""
    run_id = str(meta.get("run_id") or "?")
    tail = run_id.rsplit("-", 1)[-1] if re.fullmatch(r"\d{8}-\d{6}-[0-9a-z]+", run_id) else run_id
    git = meta.get("git") or {}
    commit = str(git.get("commit") or "unknown")[:7] + ("+dirty" if git.get("dirty") else "")
    return f"{tail}@{commit}"


def share_text(x: float) -> str:
    """A dropped share of routes as a verdict quotes it: ``0%``, ``0.04%``, ``10.9%``."""
    return "0%" if x == 0 else f"{100 * x:.2f}%" if abs(x) < 0.001 else f"{100 * x:.1f}%"


def dropped_fraction(t: pd.DataFrame, where: pd.Series) -> pd.Series:
    """Dropped routes over all routes of the timed steps.

    The record's ``dropped_tokens`` counts routes (token, expert choice) over capacity,
    summed over timed steps, MoE layers and ranks, each once by its sender; the global batch
    routes ``tokens_per_step * top_k`` per MoE layer per step. An all-dense model routes nothing.
    """
    n_moe = _numeric(t, "config.model.n_layers", where) - _numeric(t, "config.model.n_dense_layers", where)
    timed = _numeric(t, "timed_steps", where)
    timed = timed.where(timed.notna(), pd.Series([len(s) if s else math.nan for s in t["step_times_s"]],
                                                 index=t.index))
    routes = t["tokens_per_step"] * t["top_k"] * n_moe * timed
    return (t["dropped_tokens"] / routes.where(routes > 0)).astype(float)


def tidy(df: pd.DataFrame, metas: Iterable[dict[str, Any]] = ()) -> pd.DataFrame:
    """Canonical per-point table (see the module docstring); raises StoreError on bad field types."""
    by_run = {m.get("run_id"): m for m in metas}
    t = df.copy().reset_index(drop=True)
    if "point_id" not in t.columns:
        t["point_id"] = t.index.astype(str)
    # one row per run of a point (moebench run --repeats), 0-based; 0 in stores written before repeats
    t["repeat"] = pd.to_numeric(_column(t, "repeat"), errors="coerce").fillna(0).astype(int)
    meta_of = [by_run.get(r, {}) for r in _column(t, "run_id")]
    # suites by name, the runs of one suite by their start, whatever order the stores were given in;
    # a run's points by their axis values, numbers as numbers (num_experts 8, 32, 128), and where those
    # tie (the layouts of one point) in the store's point order (a stable sort)
    axis_cols = sorted(c for c in t.columns if c.startswith("point.") and c not in VARIANT_AXES)
    axis_keys = [tuple(_axis_key(t.at[i, c]) for c in axis_cols) for i in range(len(t))]
    order = sorted(range(len(t)), key=lambda i: (run_order(meta_of[i]), axis_keys[i]))
    t, meta_of = t.iloc[order].reset_index(drop=True), [meta_of[i] for i in order]
    where = _column(t, "store").fillna("store").astype(str) + " point " + t["point_id"].astype(str)
    t["suite"] = [m.get("suite") for m in meta_of]
    t["commit"] = [(m.get("git") or {}).get("commit") for m in meta_of]
    t["status"] = _column(t, "status").fillna("failed").astype(str)
    for name in ("error", "log_tail", "preset", "precision", "precision_impl", "device_name"):
        t[name] = _column(t, name)
    # what a reader sees: an emulated fp8/mxfp8 run says so wherever its precision is shown
    t["precision_shown"] = [f"{norm_value(p)} (emulated)" if impl == "emulated" else p
                            for p, impl in zip(t["precision"], t["precision_impl"], strict=True)]
    t["strategy"] = _column(t, "layout.strategy", "config.parallel.strategy")
    for name in ("dp", "ep", "pp"):
        t[name] = _numeric(t, resolve_field(t, f"parallel.{name}") or f"layout.{name}", where)
    t["dispatcher"] = _column(t, "layout.dispatcher", "config.parallel.dispatcher")
    t["dist_opt"] = _column(t, "layout.dist_opt", "config.parallel.dist_opt")
    t["world_size"] = _numeric(t, "world_size", where)
    missing_ws = t["world_size"].isna()
    t.loc[missing_ws, "world_size"] = t.loc[missing_ws, "dp"] * t.loc[missing_ws, "pp"]
    t["num_nodes"] = pd.Series(_node_counts(t, where), index=t.index, dtype=float)
    t["num_experts"] = _numeric(t, "config.moe.num_experts", where)
    t["top_k"] = _numeric(t, "config.moe.top_k", where)
    n_layers = _numeric(t, "config.model.n_layers", where)
    t["dense"] = (_numeric(t, "config.model.n_dense_layers", where) >= n_layers) & n_layers.notna()
    for name in RECORD_SCALARS:
        t[name] = _numeric(t, name, where)
    for name in SAMPLES:
        t[name] = pd.Series(_samples(t, name, where), index=t.index, dtype=object)
    t["step_time_cv"] = [cv(s) if s else math.nan for s in t["step_times_s"]]
    t["dropped_fraction"] = dropped_fraction(t, where)
    t["loss_compared"], t["loss_spread"], t["loss_window"] = compared_loss(t, where)
    t["load_imbalance"] = [sum(v) / len(v) if v else math.nan for v in t["expert_load_max_over_mean"]]
    t["load_imbalance_max"] = [max(v) if v else math.nan for v in t["expert_load_max_over_mean"]]
    axes = sorted({c.split(".", 1)[1] for c in t.columns if c.startswith("comm_bytes_per_step.")},
                  key=lambda a: (COMM_AXES.index(a) if a in COMM_AXES else len(COMM_AXES), a))
    for axis in axes:
        t[f"comm_{axis}_bytes"] = _numeric(t, f"comm_bytes_per_step.{axis}", where)
    comm_cols = [f"comm_{a}_bytes" for a in axes]
    total = t[comm_cols].sum(axis=1, min_count=1) if comm_cols else pd.Series(math.nan, index=t.index)
    # An ok run on one rank reports an empty comm dict: that is zero bytes, not unknown.
    t["comm_bytes_total"] = total.where(total.notna() | (t["status"] != "ok"), 0.0)
    t.attrs["comm_axes"] = axes
    # NVML clock-throttle flag (None where no NVML sampler ran).
    t["throttled"] = _column(t, "throttled").map(lambda v: v if isinstance(v, bool) else None)
    t["variant"] = [variant_label(*v) for v in zip(t["strategy"], t["ep"], t["pp"], t["dispatcher"], t["dist_opt"],
                                                   _column(t, "compiled"), strict=True)]
    t["run"] = [run_tag(m) if m else norm_value(r) for m, r in zip(meta_of, _column(t, "run_id"), strict=True)]
    point_cols = sorted(c for c in t.columns if c.startswith("point."))
    t["axes"] = [_point_axes(row, point_cols) for _, row in t.iterrows()]
    labels = [", ".join(p for p in (v, a) if p) for v, a in zip(t["variant"], t["axes"], strict=True)]
    # Several runs of one suite: every label says which run it is; several suites: which suite.
    runs_per_suite = t.groupby(t["suite"].map(norm_value))["run"].nunique()
    t.attrs["multi_run"] = bool((runs_per_suite > 1).any())
    prefixes = [" ".join(p for p in (norm_value(s) if len(runs_per_suite) > 1 else "",
                                     r if t.attrs["multi_run"] else "") if p)
                for s, r in zip(t["suite"], t["run"], strict=True)]
    t["prefix"] = prefixes  # what a label, a comparison's subject and a baseline cell start with
    labels = [f"{p}: {lab}" if p else lab for p, lab in zip(prefixes, labels, strict=True)]
    # the repeats of one point share its label; two points with one label get their ids
    points_of: dict[str, set[tuple[str, str]]] = {}
    for lab, run, pid in zip(labels, t["run"], t["point_id"], strict=True):
        points_of.setdefault(lab, set()).add((run, str(pid)))
    t["label"] = [f"{lab} [{pid}]" if len(points_of[lab]) > 1 else lab
                  for lab, pid in zip(labels, t["point_id"], strict=True)]
    return t


# The last steps whose mean loss a point is judged on (at most half of its ``train.steps``).
LOSS_WINDOW = 8


def loss_window(n_steps: int) -> int:
    """How many of the last steps the loss judgement averages over in a run of ``n_steps``."""
    return max(1, min(LOSS_WINDOW, n_steps // 2))


def compared_loss(t: pd.DataFrame, where: pd.Series) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(mean loss, step-to-step spread, steps averaged) of each run over the last
    :func:`loss_window` steps up to ``train.steps``, the step every run of the config reaches (an
    adaptive warm-up, ``train.max_warmup_steps``, adds steps beyond it). The spread is the
    standard deviation of one step's loss around the curve's trend: that of successive
    differences over sqrt(2), which a falling curve does not inflate; NaN with fewer than 3
    steps. The last recorded losses where fewer than ``train.steps`` were recorded; ``loss_last``
    alone (spread NaN) where no losses were."""
    steps = _numeric(t, "config.train.steps", where)
    means, spreads, windows = [], [], []
    for losses, n, last in zip(t["losses"], steps, t["loss_last"], strict=True):
        recorded = len(losses) if isinstance(losses, list) else 0
        n = int(n) if n == n and 1 <= n <= recorded else recorded  # a record with fewer losses: its last ones
        w = loss_window(n)
        window = losses[n - w:n] if n else []
        if not window or any(x is None for x in window):
            means.append(last)
            spreads.append(math.nan)
            windows.append(math.nan)
            continue
        arr = np.asarray(window, dtype=float)
        means.append(float(arr.mean()))
        spreads.append(float(np.diff(arr).std(ddof=1) / math.sqrt(2)) if len(arr) >= 3 else math.nan)
        windows.append(float(w))
    return (pd.Series(means, index=t.index, dtype=float), pd.Series(spreads, index=t.index, dtype=float),
            pd.Series(windows, index=t.index, dtype=float))


# The flattened columns of the record's exact work counts (``work_per_step``: moebench.metrics.work).
WORK_PREFIX = "work_per_step."
# The breakdown's columns (``time_breakdown_s.<phase>`` and the figures beside it): a point's are the mean over
# its judged repeats, the statistic its step time is (the mean of the runs' medians), so that its phases add up
# to its timed step as each run's add up to its own. The first repeat's would not (repeats on a loaded machine
# differ by up to 1.9x: docs/report.md), nor would each column's median over the repeats.
BREAKDOWN_PREFIXES = ("time_breakdown_s.", "time_breakdown_max_s.", "time_breakdown_backward_s.",
                      "time_breakdown_scaled_s.", "comm_breakdown_s.")
BREAKDOWN_SCALARS = ("breakdown_step_s", "profiled_step_s", "comm_s", "comm_exposed_s", "comm_exposed_mean_s")
# A point is judged on its ok repeats when at least this many finished (two give a between-run spread);
# its failed repeats are counted beside them (``failed_runs``).
MIN_OK_RUNS = 2


def failed_runs_text(statuses: Iterable[str]) -> str:
    """``1 timeout``, ``2 failed, 1 timeout``: the repeats of a point that did not finish ok ("" when all did)."""
    counts = Counter(status for status in statuses if status != "ok")
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def _steady(ok: pd.DataFrame) -> tuple[pd.DataFrame, str | None, str]:
    """The ok repeats a point's speed is judged on, why it cannot be judged (None: it can), and which were
    left out: runs whose timed window is unsteady (:func:`moebench.record.unsteady`) are left out while
    :data:`MIN_OK_RUNS` steady ones remain; with fewer, all stay and the point has no verdict."""
    why = [unsteady(r) for _, r in ok.iterrows()]
    left = [f"repeat {int(rep)}: {w}" for rep, w in zip(ok["repeat"], why, strict=True) if w]
    if not left:
        return ok, None, ""
    steady = ok[[w is None for w in why]]
    if len(steady) >= MIN_OK_RUNS:
        return steady, None, f"{len(left)} of {len(ok)} runs left out (unsteady): " + "; ".join(left)
    return ok, f"unsteady timed window in {len(left)} of {len(ok)} runs ({next(w for w in why if w)})", ""


def _point_row(g: pd.DataFrame) -> pd.Series:
    """One point from its repeats (see :func:`by_point`)."""
    ok = g[g["status"] == "ok"]
    judged = ok if len(ok) >= MIN_OK_RUNS or len(ok) == len(g) else g[g["status"] != "ok"]
    row = judged.iloc[0].copy()
    # an ok point's repeats that did not finish ok (a failed point's status says it already)
    row["failed_runs"] = failed_runs_text(g["status"].astype(str)) if judged is ok else ""
    work = [c for c in ok.columns if c.startswith(WORK_PREFIX)]
    # exact counts that differ between the runs of one point: a nondeterministic path, reported, not judged
    row["work_varies"] = bool(work) and len(ok) > 1 and bool((ok[work].nunique(dropna=False) > 1).any())
    ok, row["unsteady"], row["unsteady_runs"] = _steady(ok)
    runs = _sample_lists(ok, "step_times_s")
    cpu_runs = _sample_lists(ok, "step_cpu_times_s")
    instruction_runs = _sample_lists(ok, "step_ginstructions")
    row["runs"] = len(ok)
    row["step_runs"] = runs
    row["cpu_step_runs"] = cpu_runs
    row["instruction_step_runs"] = instruction_runs
    if "throttled" in ok.columns and ok["throttled"].eq(True).any():
        row["throttled"] = True  # one throttled run is enough to qualify the point's speed
    if len(ok) < 2:
        row["run_spread"] = math.nan
        return row
    for name in RECORD_SCALARS:
        row[name] = ok[name].median()
    for name in ("loss_compared", "loss_spread", "loss_window"):
        row[name] = ok[name].median()
    for name in ok.columns:
        if name in BREAKDOWN_SCALARS or str(name).startswith(BREAKDOWN_PREFIXES):
            row[name] = pd.to_numeric(ok[name], errors="coerce").mean()
    if runs:
        # each clock's side statistic (the mean of the runs' medians), which the intervals are built on
        step = {"wall": side_stat([pd.Series(s).to_numpy() for s in runs])}
        for clock, samples in (("cpu", cpu_runs), ("instructions", instruction_runs)):
            step[clock] = side_stat([pd.Series(s).to_numpy() for s in samples]) if len(samples) == len(runs) else None
        first = ok.iloc[0]
        for spec in METRIC_SPECS.values():
            work = work_per_step(first, spec.name) if spec.from_step_time and spec.name in row.index else None
            if work is not None and spec.name != "step_time_median_s" and step[spec.clock]:
                row[spec.name] = work / step[spec.clock]
        row["step_time_median_s"] = step["wall"]
        row["step_times_s"] = [x for s in runs for x in s]
        row["step_time_cv"] = float(pd.Series([cv(s) for s in runs]).mean())
    per_run = ok["tokens_per_s_per_device"].astype(float)
    row["run_tokens"] = per_run.tolist()  # each repeat's tokens/s per device, for the plots' per-run markers
    # between-run spread: how much the runs' throughput differs, as a coefficient of variation
    row["run_spread"] = float(per_run.std(ddof=1) / per_run.mean()) if per_run.notna().all() else math.nan
    return row


def _sample_lists(ok: pd.DataFrame, name: str) -> list[list[float]]:
    """Each ok repeat's non-empty sample list ``name`` (none where the records lack it)."""
    return [s for s in ok[name] if isinstance(s, list) and s] if name in ok.columns else []


def by_point(t: pd.DataFrame) -> pd.DataFrame:
    """One row per point of each run, its repeats folded together.

    ``runs`` counts the ok repeats, ``step_runs`` holds each one's step times, ``cpu_step_runs`` its
    steps' CPU times and ``instruction_step_runs`` their instructions (for the interval over runs,
    :mod:`moebench.results.stats`) and ``run_tokens`` each one's tokens/s per device. A point with at
    least :data:`MIN_OK_RUNS` ok repeats is ok and judged on them, its other repeats counted in
    ``failed_runs`` (``1 timeout``); with fewer, a repeat that is not ok gives the point its status,
    error and log.
    With two or more ok repeats, step-time-derived metrics come from the mean over repeats of
    each one's median step time (the statistic the intervals are built on), other metrics are
    the median over repeats, the breakdown's (:data:`BREAKDOWN_PREFIXES`) the mean over repeats, as the
    step time is, ``step_time_cv`` the mean of the repeats' step CVs and
    ``run_spread`` the coefficient of variation of the repeats' tokens/s per device.
    Idempotent: a folded table is returned as it is.
    """
    if "step_runs" in t.columns:
        return t
    key = [_column(t, "run_id").map(norm_value), t["point_id"].astype(str)]
    rows = [_point_row(g.sort_values("repeat", kind="stable")) for _, g in t.groupby(key, sort=False)]
    if not rows:
        empty = {name: pd.Series(dtype=object)
                 for name in ("failed_runs", "unsteady", "unsteady_runs", "step_runs", "cpu_step_runs",
                              "instruction_step_runs")}
        return t.assign(runs=pd.Series(dtype=int), run_spread=pd.Series(dtype=float), **empty)
    out = pd.DataFrame(rows).reset_index(drop=True)
    out.attrs = dict(t.attrs)
    return out


def emulation_warnings(t: pd.DataFrame) -> list[str]:
    """One warning when any ok point ran its quantized expert GEMMs emulated."""
    emulated = t[(t["status"] == "ok") & (t["precision_impl"] == "emulated")]
    if emulated.empty:
        return []
    modes = ", ".join(sorted({norm_value(p) for p in emulated["precision"]}))
    return [f"{len(emulated)} point(s) ran {modes} expert GEMMs emulated (quantize, dequantize, then a "
            "bf16/fp32 GEMM): they show the format's accuracy, not its speed"]


def summary_columns(t: pd.DataFrame) -> list[str]:
    """The scalar columns written to the CSV (no raw lists, no config dump)."""
    base = ["suite", "run_id", "run", "commit", "point_id", "repeat", "runs", "failed_runs", "unsteady_runs", "label",
            "status", "error",
            "preset", "variant", "strategy",
            "dp", "ep", "pp", "dispatcher", "dist_opt", "world_size", "num_nodes", "precision", "precision_impl",
            "device_name", "num_experts", "top_k", "dense", *RECORD_SCALARS, "step_time_cv", "run_spread",
            "dropped_fraction",
            "load_imbalance", "load_imbalance_max",
            *[f"comm_{a}_bytes" for a in t.attrs.get("comm_axes", [])], "comm_bytes_total",
            "throttled", "baseline_point_id", "speedup", "speedup_low", "speedup_high", "speedup_verdict",
            "drops_differ", "loss_delta", "loss_tolerance", "diverges", "mem_ratio", "comm_ratio"]
    return [c for c in base if c in t.columns]


# Units of whole quantities: pandas reads them as floats (a missing value is NaN), the CSV must not.
_WHOLE_UNITS = ("bytes", "parameters", "routes", "tokens", "FLOP")
_WHOLE_COLUMNS = ("dp", "ep", "pp", "world_size", "num_nodes", "num_experts", "top_k", "repeat", "runs")


def csv_table(t: pd.DataFrame) -> pd.DataFrame:
    """:func:`summary_columns` of ``t``, whole-number columns as integers (``dp`` 2, not 2.0; empty when missing)."""
    out = t[summary_columns(t)].copy()
    whole = {*_WHOLE_COLUMNS, *(m.name for m in METRIC_SPECS.values() if m.unit in _WHOLE_UNITS)}
    for col in out.columns:
        values = out[col]
        if (col in whole or (col.startswith("comm_") and col.endswith("_bytes"))) and values.dtype.kind == "f" \
                and (values.dropna() % 1 == 0).all():
            out[col] = values.astype("Int64")
    return out


def load_tables(paths: Sequence[PathArg], strict: bool = True) -> tuple[pd.DataFrame, list[dict[str, Any]], list[str]]:
    """Read stores through :func:`moebench.results.load.load_results` into the tidy table.

    Returns ``(table, metas, warnings)``. With ``strict`` an unreadable line raises
    StoreError; without, it is skipped and named in ``warnings``.
    """
    if not paths:
        raise StoreError("no results store given")
    if strict:
        df, metas = load_results(list(paths), strict=True)
        warnings: list[str] = list(df.attrs["warnings"])  # no unreadable line, but what the reader settled
    else:
        df, metas, warnings = load_results(list(paths), strict=False)
    metas = list(metas)
    if df.empty:
        why = f" that can be read ({warnings[0]})" if warnings else ""
        raise StoreError(f"{', '.join(map(str, paths))}: the store holds no records{why}")
    return tidy(df, metas), metas, list(warnings)
