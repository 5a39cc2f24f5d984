"""Planned next to measured: the numbers a report puts side by side, with their ratios.

Both arguments are run records (a plan has ``status == "planned"``). On CPU the measured
peak memory is the process RSS, which includes the Python/torch runtime; pass
``baseline_mem_bytes`` (the RSS of a negligible run) to compare like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Row:
    metric: str
    planned: float
    measured: float | None

    @property
    def ratio(self) -> float | None:
        """measured / planned (None where either side is missing or the plan is zero)."""
        if self.measured is None or not self.planned:
            return None
        return self.measured / self.planned


def plan_vs_measured(planned: dict[str, Any], measured: dict[str, Any], baseline_mem_bytes: int = 0) -> list[Row]:
    rows = [Row("tokens_per_s_per_device", planned["tokens_per_s_per_device"], measured.get("tokens_per_s_per_device")),
            Row("tflops_per_device", planned["tflops_per_device"], measured.get("tflops_per_device"))]
    peak = measured.get("peak_mem_bytes")
    rows.append(Row("peak_mem_bytes", planned["peak_mem_bytes"], None if peak is None else peak - baseline_mem_bytes))
    rows.append(Row("optimizer_state_bytes_per_rank", planned["optimizer_state_bytes_per_rank"],
                    measured.get("optimizer_state_bytes_per_rank")))
    for field in ("comm_bytes_per_step", "comm_bytes_padding"):
        planned_comm, measured_comm = planned.get(field) or {}, measured.get(field) or {}
        for axis in sorted(set(planned_comm) | set(measured_comm)):
            if field == "comm_bytes_padding" and not (planned_comm.get(axis) or measured_comm.get(axis)):
                continue  # no empty slots on either side: nothing to compare
            rows.append(Row(f"{field}.{axis}", planned_comm.get(axis, 0.0), measured_comm.get(axis)))
    return rows
