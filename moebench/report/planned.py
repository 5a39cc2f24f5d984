"""Planned next to measured: the planner's roofline and memory model for each GPU point.

For every ok point measured on a GPU the planner knows (:data:`moebench.devices.DEVICES`,
matched by name, e.g. "NVIDIA H200" -> ``h200``), the point's resolved config is planned
with :func:`moebench.plan.planner.build_plan` and compared with
:func:`moebench.plan.compare.plan_vs_measured`. Ratios are measured / planned.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from moebench.config import Config
from moebench.devices import device_key
from moebench.errors import MoebenchError
from moebench.plan.compare import plan_vs_measured
from moebench.plan.planner import build_plan
from moebench.record import METRICS, FmtKind, format_value
from moebench.results.table import is_missing

HEADERS = ["point", "device", *[h for m in ("tokens_per_s_per_device", "peak_mem_bytes", "comm_bytes_total")
                                for h in (f"{METRICS[m].header} plan", "measured", "ratio")]]


def config_dict(row: pd.Series) -> dict[str, Any]:
    """The record's resolved config, rebuilt from the flattened ``config.*`` columns."""
    out: dict[str, Any] = {}
    for col, value in row.items():
        if not str(col).startswith("config."):
            continue
        if is_missing(value):
            value = None  # pandas fills missing values with NaN; the config means None
        elif isinstance(value, np.generic):
            value = value.item()  # a folded table's int64 / bool_ cell: the config's fields take Python values
        *sections, name = str(col).removeprefix("config.").split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = value
    return out


def _measured(row: pd.Series) -> dict[str, Any]:
    axes = [c.removeprefix("comm_").removesuffix("_bytes") for c in row.index
            if c.startswith("comm_") and c.endswith("_bytes") and c != "comm_bytes_total"]
    comm = {a: row[f"comm_{a}_bytes"] for a in axes if row[f"comm_{a}_bytes"] == row[f"comm_{a}_bytes"]}
    return {"tokens_per_s_per_device": row["tokens_per_s_per_device"], "tflops_per_device": row["tflops_per_device"],
            "peak_mem_bytes": row["peak_mem_bytes"], "comm_bytes_per_step": comm,
            "optimizer_state_bytes_per_rank": row.get("optimizer_state_bytes_per_rank")}


def _cells(planned: float, measured: float | None, kind: FmtKind = "int") -> list[str]:
    shown = format_value(planned, kind)
    if measured is None or measured != measured:
        return [shown, "", ""]
    ratio = f"{measured / planned:.2f}x" if planned else ""
    return [shown, format_value(measured, kind), ratio]


def gpu_points(t: pd.DataFrame) -> pd.DataFrame:
    """The ok points measured on a GPU: the ones a plan can be drawn for."""
    return t[(t["status"] == "ok") & (t.get("device", pd.Series("cuda", index=t.index)) == "cuda")]


def plan_for(row: pd.Series) -> dict[str, Any] | str:
    """The planner's record for one measured GPU point, or why there is none."""
    key = device_key(str(row["device_name"]))
    if key is None:
        return f"{row['label']}: the planner has no entry for {row['device_name']}"
    try:
        return build_plan(Config.from_dict(config_dict(row)), key)
    except MoebenchError as exc:
        return f"{row['label']}: not planned ({exc})"


def plan_rows(t: pd.DataFrame) -> tuple[list[list[str]], list[str]]:
    """Table rows (see :data:`HEADERS`) and one note per GPU point that could not be planned."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for _, row in gpu_points(t).iterrows():
        planned = plan_for(row)
        if isinstance(planned, str):
            notes.append(planned)
            continue
        key = device_key(str(row["device_name"]))
        cmp = {r.metric: r for r in plan_vs_measured(planned, _measured(row))}
        tok, peak = cmp["tokens_per_s_per_device"], cmp["peak_mem_bytes"]
        planned_comm = sum(r.planned for m, r in cmp.items() if m.startswith("comm_bytes_per_step."))
        mem, comm = _cells(peak.planned, peak.measured, "bytes"), _cells(planned_comm, row["comm_bytes_total"], "bytes")
        rows.append([row["label"], key, *_cells(tok.planned, tok.measured), *mem, *comm])
    return rows, notes
