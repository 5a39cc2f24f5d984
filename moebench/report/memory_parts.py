"""Memory by part, measured and planned: each point's ``memory_parts_bytes`` (rank 0, one extra step
of the run: :mod:`moebench.train.memory_parts`) as a stacked bar, with the planner's parts for the
same config below it (:func:`moebench.plan.memory.planned_parts`).

The parts need no device model, so CPU points are planned too (the quantized GEMMs as the CPU runs
them, emulated); a GPU point the planner knows is planned for that GPU.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moebench.config import Config
from moebench.devices import DEVICES, device_key
from moebench.errors import MoebenchError, StoreError
from moebench.plan.memory import planned_parts
from moebench.plan.precision import plan_precision
from moebench.record import MEMORY_PARTS as PARTS
from moebench.record import byte_unit
from moebench.report import figure as fg
from moebench.report.figure import OUTSIDE, SERIES, height, wrap
from moebench.report.planned import config_dict
from moebench.results.table import is_missing

COLUMN = "memory_parts_bytes.{}"
PART_COLORS = dict(zip(PARTS, SERIES, strict=False))


def measured_parts(row: pd.Series) -> dict[str, float | None] | None:
    """``{part: bytes}`` of one point (None for a part it could not measure); None for a record
    from before the field."""
    cols = [COLUMN.format(p) for p in PARTS]
    if not all(c in row.index for c in cols) or all(is_missing(row[c]) for c in cols):
        return None
    out: dict[str, float | None] = {}
    for part, col in zip(PARTS, cols, strict=True):
        value = row[col]
        if not is_missing(value) and not isinstance(value, (int, float)):
            raise StoreError(f"point {row.get('point_id')}: {col} is {value!r}, not a number of bytes")
        out[part] = None if is_missing(value) else float(value)
    return out


def planned_parts_for(row: pd.Series) -> dict[str, float] | str:
    """The planner's parts for one point's config, or why there are none."""
    key = device_key(str(row.get("device_name"))) if row.get("device") == "cuda" else None
    try:
        cfg = Config.from_dict(config_dict(row))
        return planned_parts(cfg, plan_precision(cfg, DEVICES[key] if key else None))
    except MoebenchError as exc:
        return f"{row['label']}: not planned ({exc})"


def plot_memory_parts(t: pd.DataFrame) -> Figure | str:
    """Measured and planned parts of each ok point, bar above bar (or why not)."""
    bars: list[tuple[str, dict[str, float | None]]] = []
    unplanned: list[str] = []
    for _, row in fg.ok_rows(t).iterrows():
        measured = measured_parts(row)
        if measured is None:
            continue
        planned = planned_parts_for(row)
        bars.append((f"{row['label']}: measured", measured))
        if isinstance(planned, str):
            unplanned.append(planned)
        else:
            bars.append((f"{row['label']}: planned", dict(planned)))
    if not bars:
        return "no ok point records memory_parts_bytes (records from before the field)"
    scale, unit = byte_unit(max(sum(v or 0.0 for v in parts.values()) for _, parts in bars))
    fig, ax = plt.subplots(figsize=(10, height(pd.Series([label for label, _ in bars]))))
    left = np.zeros(len(bars))
    for part in PARTS:
        widths = np.array([(parts[part] or 0.0) / scale for _, parts in bars])
        if widths.any():
            ax.barh(range(len(bars)), widths, left=left, color=PART_COLORS[part], label=part.replace("_", " "))
            left += widths
    ax.set_yticks(range(len(bars)), labels=[wrap(label) for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel(f"memory on rank 0 ({unit}; measured: one extra step; planned: the first stage)")
    ax.legend(**OUTSIDE)
    no_peak = sum(label.endswith(": measured") and parts["transient"] is None for label, parts in bars)
    if no_peak:
        fg.omitted(fig, f"{no_peak} measured point(s) without an allocator peak (CPU): transient not drawn; "
                        "measured comm buffers are 0 (not identifiable apart from the transient)")
    for note in unplanned:
        fg.omitted(fig, note)
    return fig
