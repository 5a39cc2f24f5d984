"""Calibration: a small set of named efficiency and overhead factors fitted to a store's measured time
breakdowns, so that a plan predicts the machine that was measured rather than its roofline.

The model. Each phase ``p`` of a step (:data:`moebench.record.PHASES`) on a point whose ranks
time-share ``s`` to a core (:meth:`Profile.time_sharing`: 1 on GPUs) takes

    t_p = s * sum_k  f_k * x_pk

over the terms ``k`` of :data:`TERMS`, with features ``x_pk`` taken from the planner's own
pieces (:func:`phase_features`), per optimizer step of the slowest pipeline stage:

- efficiency terms: the roofline seconds of the phase's work at the device's peak (matmul
  FLOPs at the peak FLOP/s, transfers and the AdamW update at the link and memory
  bandwidths, nothing hidden); ``f`` is measured seconds per roofline second, 1 / efficiency;
- overhead terms: a count per step (layers x chunks, MoE layers x chunks, local experts x MoE
  layers x chunks, chunks, steps); ``f`` is seconds per occurrence (launches, Python, small GEMMs).

The pipeline bubble is the roofline's idle share of the step applied to the calibrated chunk
work, plus the pipeline sends at their own factor.

Every point is planned on the fit's machine (:func:`machine`: a CPU at the best calibration
matmul of its stores), as ``moebench plan --profile`` plans on the profile's.

The fit (:func:`fit`): non-negative least squares over every (point, phase), each point's rows
divided by its step time so every point weighs the same in relative terms. The target is the
record's ``time_breakdown_s``, taken inside the timed steps, brought onto the timer's median timed
step (the slowest rank's), so the predicted phases add up to the step whose tokens/s is predicted:
a no-op since issue 44, whose records' phases add up to it already; older records' add up to the
clock's median step of the mean rank (``breakdown_step_s``), a few percent shorter.
Records from before the timed-step breakdown took theirs in profiled steps after the timed ones;
they are read the same way, their phases brought onto the timed median as well.
Factors stay in their term's range (:class:`Term`: matmul factors >= 1, since no matmul beats
the peak it is priced at; every factor > 0 and bounded). A term no
point exercises is not fitted and keeps its roofline value.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moebench.config import Config
from moebench.devices import DEVICES, Device, device_key
from moebench.errors import ConfigError, StoreError
from moebench.plan import comm, memory, roofline
from moebench.plan.breakdown import planned_breakdown
from moebench.plan.precision import Precision, plan_precision
from moebench.plan.profile import Profile, cpu_device, time_sharing
from moebench.plan.stages import Stage, micro_batching, stages
from moebench.precision_modes import MODES
from moebench.record import PHASES
from moebench.results.load import find_stores
from moebench.results.store import Store

COMPUTE_PHASES = ("attention", "router", "experts", "dense", "head_loss")
# the work of one chunk, which an idle pipeline slot waits for
CHUNK_PHASES = (*COMPUTE_PHASES, "dispatch", "combine", "param_gather")


@dataclass(frozen=True)
class Term:
    kind: str  # "efficiency": x roofline seconds; "overhead": seconds per occurrence
    meaning: str
    # the values a profile may give the term (checked when a profile is loaded or fitted): > 0 and
    # finite, a factor outside them describes no machine (docs/plan.md, "Calibration")
    low: float
    high: float


# matmul: measured / roofline seconds at the peak; no matmul beats its peak (>= 1), and 1000 is 0.1% of it
MATMUL_RANGE = (1.0, 1e3)
# transfers and the AdamW update: measured / roofline seconds; they may beat the roofline when the
# measured steps overlap them, by at most 10^4, and run at most 10^4 times slower
TRANSFER_RANGE = (1e-4, 1e4)
# overheads: seconds per occurrence (a launch, a Python call, a small GEMM), 1 ns to 10 s
OVERHEAD_RANGE = (1e-9, 10.0)


def _efficiency(meaning: str, bounds: tuple[float, float] = TRANSFER_RANGE) -> Term:
    return Term("efficiency", meaning, *bounds)


def _overhead(meaning: str) -> Term:
    return Term("overhead", meaning, *OVERHEAD_RANGE)


TERMS: dict[str, Term] = {
    **{f"matmul.{mode}": _efficiency(f"{mode} matmul FLOPs: measured / roofline seconds at the peak", MATMUL_RANGE)
       for mode in MODES},
    **{op.replace("-", "_"): _efficiency(f"{op} transfers: measured / roofline seconds") for op in comm.OPS},
    "optimizer": _efficiency("clipping + AdamW at memory bandwidth: measured / roofline seconds"),
    "attention.per_layer": _overhead("attention block, per layer and chunk"),
    "dense.per_layer": _overhead("dense FFN / shared expert, per dense layer and chunk"),
    **{f"{phase}.per_moe_layer": _overhead(f"{phase}, per MoE layer and chunk")
       for phase in ("router", "dispatch", "experts", "combine")},
    "dispatch.per_expert": _overhead("EP dispatch (ep > 1), per local expert, MoE layer and chunk"),
    **{f"{phase}.per_expert": _overhead(f"{phase}, per local expert, MoE layer and chunk")
       for phase in ("experts", "combine")},
    "head_loss.per_chunk": _overhead("final norm, LM head and loss, per chunk"),
    "grad_reduce.per_step": _overhead("gradient reduction, per step"),
    "param_gather.per_layer": _overhead("FSDP parameter gathers, per layer and chunk"),
    "optimizer.per_step": _overhead("clipping and the AdamW step, per step"),
    "other.per_step": _overhead("embedding, statistics, the loop itself, per step"),
}


def term_ranges() -> dict[str, tuple[float, float]]:
    """Every term's allowed values, as :func:`moebench.plan.profile.load_profile` checks them."""
    return {name: (t.low, t.high) for name, t in TERMS.items()}

Features = dict[str, dict[str, float]]  # phase -> term -> feature value


def roofline_factor(term: str, matmul_efficiency: float) -> float:
    """A term's value where no profile fitted it: the roofline's own (overheads: none)."""
    if TERMS[term].kind == "overhead":
        return 0.0
    return 1 / matmul_efficiency if term.startswith("matmul.") else 1.0


def lower_bound(term: str) -> float:
    """The smallest value a fit may give ``term``: the low end of its range (a matmul at most at the
    peak; transfers and the AdamW update may beat their roofline when the measured steps overlap them)."""
    return TERMS[term].low


def stage_inputs(cfg: Config, prec: Precision) -> tuple[list[Stage], list[list[comm.CommTerm]], list[float]]:
    """What the roofline needs of every stage: the stage, its transfers and its held parameters."""
    stage_list = stages(cfg)
    terms = [comm.stage_comm(cfg, prec, st) for st in stage_list]
    held = [memory.stage_memory(cfg, prec, st).optimizer_moments / 8 for st in stage_list]
    return stage_list, terms, held


def phase_features(cfg: Config, prec: Precision, device: Device, stage_list: list[Stage],
                   terms: list[list[comm.CommTerm]], held: list[float], sharing: float) -> Features:
    """The features of every phase (see the module docstring), for the slowest stage."""
    raw = roofline.RooflineOptions(matmul_efficiency=1.0, overlap="none")
    times = [roofline.stage_time(cfg, prec, device, st, t, h, raw)
             for st, t, h in zip(stage_list, terms, held, strict=True)]
    roof = roofline.step_time(cfg, times)
    st, t = stage_list[roof.bottleneck_stage], times[roof.bottleneck_stage]
    base = planned_breakdown(cfg, st, roof)
    x: Features = {phase: {} for phase in PHASES}
    for term in terms[roof.bottleneck_stage]:
        op = term.op.replace("-", "_")
        for phase in term.phases:
            x[phase][op] = x[phase].get(op, 0.0) + roofline.comm_time(cfg, device, term) / len(term.phases)
    p = cfg.parallel
    chunks = micro_batching(cfg).chunks_per_step
    moe_chunks = st.n_moe * chunks
    local_experts = cfg.moe.num_experts // p.ep
    for phase in COMPUTE_PHASES:
        x[phase][f"matmul.{prec.mode}"] = base[phase]
    for phase in ("dispatch", "combine"):
        x[phase][f"{phase}.per_moe_layer"] = moe_chunks
    # the EP dispatchers split rows per expert and destination; the local one sorts them once
    x["dispatch"]["dispatch.per_expert"] = moe_chunks * local_experts if p.ep > 1 else 0
    x["combine"]["combine.per_expert"] = moe_chunks * local_experts
    x["attention"]["attention.per_layer"] = st.n_layers * chunks
    x["dense"]["dense.per_layer"] = st.n_dense * chunks
    x["router"]["router.per_moe_layer"] = moe_chunks
    x["experts"]["experts.per_moe_layer"] = moe_chunks
    x["experts"]["experts.per_expert"] = moe_chunks * local_experts
    x["head_loss"]["head_loss.per_chunk"] = chunks if st.has_head else 0
    x["grad_reduce"]["grad_reduce.per_step"] = 1.0 if x["grad_reduce"] else 0.0
    x["param_gather"]["param_gather.per_layer"] = st.n_layers * chunks if p.strategy == "fsdp" and p.dp > 1 else 0
    x["optimizer"]["optimizer"] = base["optimizer"]
    x["optimizer"]["optimizer.per_step"] = 1.0
    x["other"]["other.per_step"] = 1.0
    # pipeline: the sends (above), and the roofline's idle slots as a share of the chunk work they wait for
    busy = chunks * t.chunk_s
    idle = max(0.0, roof.pipeline_s - busy) / busy if busy else 0.0
    if idle:
        for phase in (*CHUNK_PHASES, "pipeline_bubble"):
            for term, value in list(x[phase].items()):
                x["pipeline_bubble"][term] = x["pipeline_bubble"].get(term, 0.0) + idle * value
    return {phase: {k: v * sharing for k, v in by_term.items() if v} for phase, by_term in x.items()}


def predict_phases(factors: dict[str, float], features: Features,
                   matmul_efficiency: float = roofline.DEFAULT_MATMUL_EFFICIENCY) -> dict[str, float]:
    """Seconds per step by phase; a term without a factor takes its roofline value."""
    def factor(term: str) -> float:
        return factors[term] if term in factors else roofline_factor(term, matmul_efficiency)
    return {phase: sum(factor(k) * v for k, v in features[phase].items()) for phase in PHASES}


# ---------------------------------------------------------------------- measured points
@dataclass(frozen=True)
class Measured:
    """One ok point of a store, with what the fit needs of it."""

    label: str  # store folder name : point id
    store: str
    cfg: Config
    prec: Precision
    device: Device  # as the record names it (a CPU: with its store's calibration matmul as the peak)
    cores: int | None
    target: dict[str, float]  # the breakdown scaled to the median timed step
    step_time_s: float
    tokens_per_s_per_device: float

    @property
    def world_size(self) -> int:
        return self.cfg.parallel.world_size

    def features_on(self, device: Device) -> Features:
        """This point's features planned on ``device`` (the machine of a fit or profile)."""
        return phase_features(self.cfg, self.prec, device, *stage_inputs(self.cfg, self.prec),
                              time_sharing(device, self.cores, self.world_size))


def measured_points(records: list[dict[str, Any]], meta: dict[str, Any], store: str) -> list[Measured]:
    """The store's ok points that carry a time breakdown; a StoreError if there are none."""
    host = meta.get("host") or {}
    # point order (the hold-out splits take every other point): records are appended as points finish
    ok = sorted((r for r in records if r.get("status") == "ok"), key=lambda r: str(r.get("point_id") or r["key"]))
    out = []
    for r in ok:
        breakdown = r.get("time_breakdown_s")
        if not breakdown or not r.get("step_time_median_s") or not sum(breakdown.values()):
            continue
        label = f"{store.rstrip('/').rsplit('/', 1)[-1]}:{r.get('point_id', r['key'])}"
        device, cores = _record_device(r, host, label)
        cfg = Config.from_dict(r["config"])
        cfg.precision.mode = r["precision"]  # as it ran: auto resolves differently on CPU and GPU
        cfg.validate()
        prec = plan_precision(cfg, None if device.cpu else device)
        step = float(r["step_time_median_s"])
        scale = step / sum(breakdown.values())
        out.append(Measured(label, store, cfg, prec, device, cores,
                            {ph: float(breakdown.get(ph) or 0.0) * scale for ph in PHASES}, step,
                            float(r["tokens_per_s_per_device"])))
    if not out:
        why = ("no ok points" if not ok else
               "no ok point has a time_breakdown_s (were they run with train.profile_steps=0?)")
        raise StoreError(f"{store}: nothing to calibrate on: {why}")
    return out


def _record_device(r: dict[str, Any], host: dict[str, Any], label: str) -> tuple[Device, int | None]:
    if r.get("device") == "cpu":
        peak = r.get("peak_flops")
        if not peak:
            raise StoreError(f"{label}: field 'peak_flops' is missing: a CPU point needs its calibration matmul")
        return cpu_device(float(peak), str(host.get("cpu_model") or "unknown")), host.get("cpu_count")
    key = device_key(str(r.get("device_name") or ""))
    if key is None:
        raise StoreError(f"{label}: field 'device_name' {r.get('device_name')!r} is not a GPU the planner knows")
    return DEVICES[key], None


def store_points(paths: Sequence[str], warn: Callable[[str], None] | None = None
                 ) -> tuple[list[str], list[Measured]]:
    """Every store found under ``paths`` and the planner's measured points of each one's newest
    records. ``warn`` hears each store's side-file warning."""
    stores = [str(s) for p in paths for s in find_stores(p)]
    points: list[Measured] = []
    for path in stores:
        store = Store(path)
        records, warning = store.newest_records()
        if warning and warn is not None:
            warn(warning)
        points += measured_points(records, store.read_meta(), path)
    return stores, points


# ---------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class Prediction:
    point: Measured
    phases: dict[str, float]

    @property
    def step_time_s(self) -> float:
        return sum(self.phases.values())

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.point.cfg.tokens_per_step / self.step_time_s / self.point.world_size

    @property
    def error(self) -> float:
        """(predicted - measured) / measured tokens/s per device."""
        return self.tokens_per_s_per_device / self.point.tokens_per_s_per_device - 1


def fit(points: list[Measured], stores: list[str]) -> Profile:
    """Fit every term some point exercises (see the module docstring)."""
    import numpy as np
    from scipy.optimize import nnls

    devices = {p.device.name for p in points}
    if len(devices) > 1:
        raise ConfigError(f"the stores mix devices ({', '.join(sorted(devices))}): a profile is one machine's; "
                          "calibrate each separately")
    cores = {p.cores for p in points}
    if len(cores) > 1:
        raise ConfigError(f"the stores were measured on machines with different core counts ({sorted(cores)})")
    device = machine(points)
    features = [p.features_on(device) for p in points]
    columns = sorted({k for x in features for phase in PHASES for k in x[phase]})
    rows, target = [], []
    for p, x in zip(points, features, strict=True):
        for phase in PHASES:
            rows.append([x[phase].get(k, 0.0) / p.step_time_s for k in columns])
            target.append(p.target[phase] / p.step_time_s)
    a = np.array(rows)
    # no matmul beats the peak it is priced at (factor >= 1); fit the excess over that floor
    floor = np.array([lower_bound(k) for k in columns])
    y = np.array(target) - a @ floor
    # columns scaled to unit norm: features range from microseconds of roofline to counts of ten
    norms = np.linalg.norm(a, axis=0)
    excess, _ = nnls(a / norms, y)
    factors = {k: float(lo + c / n) for k, lo, c, n in zip(columns, floor, excess, norms, strict=True)}
    for k, value in factors.items():
        if value > TERMS[k].high:
            raise ConfigError(f"{', '.join(stores) or 'the points'}: the fit gives {k} = {value:.3g}, above its "
                              f"range [{TERMS[k].low:g}, {TERMS[k].high:g}]: these measurements describe no machine "
                              "the model can price (a stalled or oversubscribed run?)")
    errors = [Prediction(p, predict_phases(factors, x)).error for p, x in zip(points, features, strict=True)]
    return Profile(device=device, factors=factors, cores=points[0].cores, fitted_on={
        "stores": stores, "points": len(points),
        "in_sample_median_abs_error": statistics.median(abs(e) for e in errors),
        "in_sample_max_abs_error": max(abs(e) for e in errors)})


def machine(points: list[Measured]) -> Device:
    """The one device of the points. A CPU's peak is the best calibration matmul its stores measured
    (each sweep run measures its own, itself a best of five: a lower figure means a busy machine)."""
    device = points[0].device
    if not device.cpu:
        return device
    return cpu_device(max(p.device.bf16_flops for p in points), device.name.removeprefix("CPU "))


def predict(profile: Profile, point: Measured) -> Prediction:
    """A measured point planned on the profile's machine."""
    return Prediction(point, predict_phases(profile.factors, point.features_on(profile.device)))


def holdout_split(points: list[Measured], how: str) -> tuple[list[Measured], list[Measured]]:
    """(points to fit, points to predict). ``half``: every other point of each layout of each
    store, in point order; ``ranks``: fit the smallest rank count, predict the others."""
    if how == "half":
        groups: dict[tuple[Any, ...], list[Measured]] = {}
        for p in points:
            lay = p.cfg.parallel
            key = (p.store, lay.world_size, lay.strategy, lay.ep, lay.pp, lay.dispatcher, lay.dist_opt)
            groups.setdefault(key, []).append(p)
        fit_on = [p for g in groups.values() for p in g[0::2]]
        held = [p for g in groups.values() for p in g[1::2]]
    elif how == "ranks":
        smallest = min(p.world_size for p in points)
        fit_on = [p for p in points if p.world_size == smallest]
        held = [p for p in points if p.world_size != smallest]
    else:
        raise ConfigError(f"--holdout {how!r}; allowed: half, ranks")
    if not held:
        raise ConfigError(f"--holdout {how}: every point would be fitted, none left to predict"
                          + (" (all points have the same rank count)" if how == "ranks" else ""))
    return fit_on, held


def holdout(points: list[Measured], stores: list[str], how: str) -> tuple[Profile, list[Measured], list[Prediction]]:
    """Fit on part of ``points`` (:func:`holdout_split`) and predict the rest: (the part's profile,
    the points it was fitted on, the predictions of the held-out points)."""
    fit_on, held = holdout_split(points, how)
    part = fit(fit_on, stores)
    return part, fit_on, [predict(part, p) for p in held]


def median_abs_error(predictions: list[Prediction]) -> float:
    return statistics.median(abs(p.error) for p in predictions)
