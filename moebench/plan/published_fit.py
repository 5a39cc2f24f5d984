"""The planner's throughput fitted on the published calibration rows (``moebench plan --validate``).

One constant is fitted: the matmul efficiency, the share of the dense (and fp8) peak the roofline's
GEMMs reach (:class:`moebench.plan.planner.PlanOptions`). It is the smallest honest set: the rows
declared ``calibration`` state one throughput (the 4-B300 BF16 point's tokens/s), which one
constant can match and two could not be told apart by. Everything else the roofline prices (links,
HBM, the pipeline bubble) keeps its datasheet value, so a held-out row's error is the error of
those terms and of the mechanisms the planner lacks.

The fit solves ``mean over the calibration values of log(planned / published) = 0``: each planned
throughput grows with the efficiency, so the mean does too, and bisection finds it (with one value,
planned equals published). Where no efficiency in [``MIN_MATMUL_EFFICIENCY``, 1] reaches it, the
fit stops at the bound and says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from moebench.errors import ConfigError
from moebench.plan.planner import PlanOptions
from moebench.plan.published import PublishedRow
from moebench.plan.roofline import MIN_MATMUL_EFFICIENCY
from moebench.plan.validate import plan_row, planned_metrics

# the published metrics a fit matches: absolute throughputs (relative and memory values are not fitted)
FITTED_METRICS = ("tokens_per_s_per_device", "tflops_per_device")
_STEPS = 60  # bisection halvings of [0.01, 1] in log space: far below the printed precision


@dataclass(frozen=True)
class Target:
    row: str
    metric: str
    published: float


@dataclass(frozen=True)
class Fit:
    matmul_efficiency: float
    targets: tuple[Target, ...]
    at_bound: bool  # no efficiency in range matches: the nearest bound

    def describe(self) -> str:
        rows = ", ".join(dict.fromkeys(t.row for t in self.targets))
        what = ", ".join(f"{t.metric} {t.published:,.0f}" for t in self.targets)
        line = f"matmul efficiency {self.matmul_efficiency:.3f}, fitted on {rows} ({what})"
        if self.at_bound:
            line += ": at its bound, no efficiency in range plans the published value"
        return line + "; every other row held out"

    def as_dict(self) -> dict[str, Any]:
        return {"matmul_efficiency": self.matmul_efficiency, "at_bound": self.at_bound,
                "targets": [dataclasses.asdict(t) for t in self.targets], "describe": self.describe()}


def targets(rows: list[PublishedRow]) -> list[Target]:
    """Every absolute throughput a calibration row publishes."""
    found = [Target(r.id, m.metric, m.value) for r in rows if r.calibration for m in r.measured
             if m.metric in FITTED_METRICS]
    if not found:
        raise ConfigError(f"no calibration row publishes {' or '.join(FITTED_METRICS)}: nothing to fit the matmul "
                          "efficiency on (role: calibration in moebench/published/*.yaml; or --unfitted)")
    return found


def _mean_log_ratio(rows: dict[str, PublishedRow], wanted: list[Target], options: PlanOptions) -> float:
    plans: dict[str, dict[str, float]] = {}
    for row_id in dict.fromkeys(t.row for t in wanted):
        plan = plan_row(rows[row_id], options)
        if "record" not in plan:
            raise ConfigError(f"calibration row {row_id} is not planned ({plan['not_planned']}): nothing to fit on")
        plans[row_id] = planned_metrics(plan["record"])
    return sum(math.log(plans[t.row][t.metric] / t.published) for t in wanted) / len(wanted)


def fit_matmul_efficiency(rows: list[PublishedRow], options: PlanOptions) -> Fit:
    """The matmul efficiency at which the calibration rows plan their published throughput."""
    wanted = targets(rows)
    by_id = {r.id: r for r in rows}

    def error(efficiency: float) -> float:
        return _mean_log_ratio(by_id, wanted, dataclasses.replace(options, matmul_efficiency=efficiency))

    low, high = MIN_MATMUL_EFFICIENCY, 1.0
    if error(high) <= 0 or error(low) >= 0:  # too slow even at the peak, or too fast even at 1% of it
        bound = high if error(high) <= 0 else low
        return Fit(bound, tuple(wanted), at_bound=error(bound) != 0)
    for _ in range(_STEPS):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if error(mid) < 0 else (low, mid)
    return Fit(math.sqrt(low * high), tuple(wanted), at_bound=False)


def fitted_options(fit: Fit, options: PlanOptions) -> PlanOptions:
    """``options`` planning with the fitted efficiency, its source named."""
    return dataclasses.replace(options, matmul_efficiency=fit.matmul_efficiency,
                               matmul_efficiency_source=fit.describe())
