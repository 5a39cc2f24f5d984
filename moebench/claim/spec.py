"""Claim files: a published statement, the suite that tests it, the comparison, and what counts as holding.

A claim is a YAML file (see docs/claims.md)::

    name: ddp-ep-vs-fsdp
    statement: DDP with expert parallelism trains faster than FSDP as the expert count grows.
    source: OLMo-core 3 MoE release (Ai2, 2026): 52,000 vs 19,400 tokens/s/GPU on 8 B300
    suite: smoke                                  # a suite name in suites/ or a YAML path
    suite_gpu: expert-scaling                     # optional: run instead where CUDA is available
    comparison:
      kind: ratio                                 # ratio | drop | memory | count
      num: {parallel.strategy: ddp}               # ratio, memory: two point selectors
      den: {parallel.strategy: fsdp}
      at: {moe.num_experts: largest}              # optional: only these points (largest/smallest of an axis)
    holds: ">= 1.0"                               # the measured value OP bound that counts as holding
    published:
      value: 2.7                                  # the published figure, shown beside the measured one
      setup: {device: B300, devices: 8, precision: bf16, active_params: 3.17e9}
    published_setup:                              # optional: planned to carry the claim there
      {preset: moe-8l-e128, gpu: b300, gpus: 8, precision: bf16, parallel: {ep: 8}, den: {parallel.ep: 1}}

``drop`` compares one layout (``select``) across an ``axis``: the relative drop of tokens/s per
device from the axis's smallest value to its largest (``1 - largest / smallest``). ``memory`` is
a ratio of a one-value-per-point metric (``peak_mem_bytes`` by default). Every key is checked when
the file is parsed; an error names the file and the field, in one line. ``count`` holds a one-value-per-point
count (``host_syncs_per_step`` by default; ``per: moe_layer`` divides it by the model's MoE layers) of
each ``num`` point against ``holds`` and, with ``den``, of its paired ``den`` point against ``den_holds``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebench.devices import DEVICES
from moebench.errors import ConfigError
from moebench.record import MEMORY_PARTS, METRICS
from moebench.sweep.suite import (
    LAUNCH_KEYS,
    check_config_key,
    check_value,
    find_named_yaml,
    find_suite,
    parse_suite,
    read_yaml,
)

# The shipped claims: the repository's top-level claims/, linked as moebench/claims so an installed package
# carries the same files (as suites/ is linked as moebench/suites). A claims/ folder in the working directory
# comes first.
CLAIMS_DIR = Path(__file__).resolve().parents[1] / "claims"
TOP_KEYS = ("name", "statement", "source", "suite", "suite_gpu", "comparison", "holds", "published",
            "published_setup")
KINDS = ("ratio", "drop", "memory", "count")
COMPARISON_KEYS = {
    "ratio": ("kind", "num", "den", "at", "metric"),
    "drop": ("kind", "select", "axis", "metric"),
    "memory": ("kind", "num", "den", "at", "metric"),
    "count": ("kind", "num", "den", "at", "metric", "per", "den_holds"),
}
# ``count``: what a count may be divided by (``per``): the model's MoE layers (n_layers - n_dense_layers)
PER = ("moe_layer",)
DEFAULT_METRIC = {"memory": "peak_mem_bytes", "count": "host_syncs_per_step"}
SETUP_KEYS = ("device", "devices", "precision", "active_params", "total_params", "description", "dispatcher",
              "micro_batch", "routing", "precision_scope", "arms")
# What a published value depends on beyond its hardware and model, each named by every shipped claim
# (tests/claim/test_claims.py): the expert dispatcher, the micro-batch, the routing and the precision scope
SCOPE_KEYS = ("dispatcher", "micro_batch", "routing", "precision_scope")
# ``routing``: one of moe.routing's values (judged against the measured points), or not stated
ROUTINGS = ("learned", "random", "uniform", "skewed", "not stated")
PUBLISHED_KEYS = ("value", "setup")
PLANNED_KEYS = ("preset", "gpu", "gpus", "precision", "parallel", "set", "num", "den", "axis")
# ``at: {axis: largest}``: the axis's largest (or smallest) value among the points either side selects
# ``largest`` is the axis's largest value among the points either side selects, whatever their status (a side
# that failed there leaves the claim inconclusive); ``largest ok`` the largest where both sides finished ok.
EXTREMES = ("largest", "smallest", "largest ok", "smallest ok")
PART_COLUMN = "memory_parts_bytes.{}"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", re.ASCII)
_HOLDS = re.compile(r"^\s*(>=|<=|>|<)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Setup:
    """The published setup, as far as a store can be compared with it (every field optional)."""

    device: str | None = None  # a device name the measured one must contain, e.g. B300
    devices: int | None = None
    precision: str | None = None  # bf16, mxfp8 ... (run natively)
    active_params: float | None = None
    total_params: float | None = None
    description: str = ""
    dispatcher: str = ""  # how tokens reached the experts, e.g. "row-wise NVSHMEM, EP4"
    micro_batch: str = ""  # e.g. "2 x 8192-token sequences a rank"
    routing: str = ""  # a ROUTINGS value
    precision_scope: str = ""  # which GEMMs ran in the published precision, e.g. "experts and attention projections"
    arms: str = ""  # a ratio: what the two published arms differed in (a stack, or the parallelism alone)


@dataclass(frozen=True)
class PlannedSetup:
    """The published setup as the planner plans it (``published_setup``), to carry a claim there: the
    preset, GPU and count, precision, the layout both sides share, and per side what else changes."""

    preset: str
    gpu: str  # a key of moebench.devices.DEVICES
    gpus: int
    precision: str | None = None
    parallel: dict[str, Any] = field(default_factory=dict)  # parallel fields (without "parallel.")
    set: dict[str, Any] = field(default_factory=dict)  # other config keys both sides share (batch, routing)
    num: dict[str, Any] = field(default_factory=dict)  # ratio, memory: config keys one side sets
    den: dict[str, Any] = field(default_factory=dict)
    axis: tuple[Any, Any] | None = None  # drop: the axis's published smallest and largest values


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str
    source: str
    suite: str
    kind: str
    metric: str
    op: str
    bound: float
    num: dict[str, Any] = field(default_factory=dict)  # ratio, memory; drop: the layout (``select``)
    den: dict[str, Any] = field(default_factory=dict)
    at: dict[str, Any] = field(default_factory=dict)
    axis: str | None = None  # drop
    published: float | None = None
    setup: Setup = Setup()
    planned: PlannedSetup | None = None  # published_setup: where `moebench claim` carries the claim
    path: str = "<dict>"
    suite_gpu: str | None = None  # run instead of ``suite`` where CUDA is available (GPU-sized)
    per: str | None = None  # count: divided by the model's MoE layers ("moe_layer")
    den_op: str | None = None  # count with den: the den side's own bound (comparison.den_holds)
    den_bound: float | None = None

    @property
    def holds_text(self) -> str:
        if self.den_op is None:
            return f"{self.op} {self.bound:g}"
        return f"{self.op} {self.bound:g} ({_selector_words(self.num)}), {self.den_op} {self.den_bound:g} " \
               f"({_selector_words(self.den)})"

    @property
    def quantity(self) -> str:
        """What the measured value is, in words: ``host syncs per step (untimed step, rank 0) per MoE layer``."""
        if self.kind == "count":
            label = METRICS[self.metric].label if self.metric in METRICS else self.metric
            return f"{label}{' per MoE layer' if self.per == 'moe_layer' else ''}"
        return {"ratio": "ratio", "drop": "relative drop", "memory": "memory ratio"}[self.kind]


def suite_for(claim: Claim, cuda: bool) -> str:
    """The suite ``moebench claim`` runs for ``claim``: its ``suite_gpu`` on a machine with CUDA, else ``suite``."""
    return claim.suite_gpu if cuda and claim.suite_gpu else claim.suite


def _selector_words(selector: dict[str, Any]) -> str:
    return ", ".join(str(v) for v in selector.values())


def find_claim(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or a claim name: ``./claims/NAME.yaml`` if the working directory has one,
    else the claim of that name shipped with moebench (:data:`CLAIMS_DIR`)."""
    return find_named_yaml(name_or_path, "claim", CLAIMS_DIR)


def shipped_claims() -> list[Path]:
    return sorted(CLAIMS_DIR.glob("*.yaml"))


def load_claim(name_or_path: str | Path) -> Claim:
    path = find_claim(name_or_path)
    return parse_claim(read_yaml(path, "claim file"), source=str(path))


def parse_claim(data: Any, source: str = "<dict>") -> Claim:
    """Check a claim's structure; an error names the file, the field and what is allowed."""

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {message}")

    _mapping(data, "", TOP_KEYS, fail)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise fail("name", f"{name!r}: required: letters, digits and _.+- starting with a letter or digit")
    texts = {}
    for key in ("statement", "source", "suite"):
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise fail(key, f"required: text, got {value!r}"[:120])
        texts[key] = value.strip()
    suite_gpu = data.get("suite_gpu")
    if suite_gpu is not None and (not isinstance(suite_gpu, str) or not suite_gpu.strip()):
        raise fail("suite_gpu", f"expected text: the suite to run where CUDA is available, got {suite_gpu!r}"[:120])
    comparison = data.get("comparison")
    if not isinstance(comparison, dict):
        raise fail("comparison", f"required: a mapping with kind ({' | '.join(KINDS)}) and its selectors")
    kind = comparison.get("kind")
    if kind not in KINDS:
        raise fail("comparison.kind", f"{kind!r}: expected one of {', '.join(KINDS)}")
    bad = sorted(set(map(str, comparison)) - set(COMPARISON_KEYS[kind]))
    if bad:
        raise fail(f"comparison.{bad[0]}", f"unknown key for kind {kind}; allowed: {', '.join(COMPARISON_KEYS[kind])}")
    metric = comparison.get("metric", DEFAULT_METRIC.get(kind, "tokens_per_s_per_device"))
    spec = METRICS.get(metric) if isinstance(metric, str) else None
    parts = [PART_COLUMN.format(p) for p in MEMORY_PARTS]
    if kind == "memory" and metric in parts:
        pass  # one part of the memory by part (train.memory_parts): one value per point
    elif spec is None:
        more = f", or for kind memory one of {', '.join(parts)}" if kind == "memory" else ""
        raise fail("comparison.metric", f"unknown metric {metric!r}; see moebench/record.py's METRICS{more}")
    elif kind == "count" and spec.from_step_time:
        raise fail("comparison.metric", f"{metric} is derived from step times: kind count compares a one-value-per-"
                                        "point count (e.g. host_syncs_per_step)")
    elif kind in ("ratio", "drop") and not spec.from_step_time:
        raise fail("comparison.metric", f"{metric} is not derived from step times; kind {kind} compares rates "
                                        "(use kind memory for a one-value-per-point metric)")
    op, bound = _holds(data.get("holds"), "holds", kind, fail)
    sides: dict[str, Any] = {}
    if kind == "drop":
        sides["num"] = _selector(comparison.get("select"), "comparison.select", fail, required=True)
        axis = comparison.get("axis")
        if not isinstance(axis, str):
            raise fail("comparison.axis", f"required: the config key the drop runs across, e.g. moe.num_experts, "
                                          f"got {axis!r}")
        check_config_key(axis, "comparison.axis", fail)
        if axis in sides["num"]:
            raise fail("comparison.axis", f"{axis} is also in comparison.select; the drop runs across it")
        sides["axis"] = axis
    else:
        sides["num"] = _selector(comparison.get("num"), "comparison.num", fail, required=True)
        sides["den"] = _selector(comparison.get("den"), "comparison.den", fail, required=kind != "count")
        if sides["num"] == sides["den"]:
            raise fail("comparison.den", "selects the same points as comparison.num")
        sides["at"] = _selector(comparison.get("at"), "comparison.at", fail, extremes=True)
    if kind == "count":
        per = comparison.get("per")
        if per is not None and per not in PER:
            raise fail("comparison.per", f"{per!r}: expected one of {', '.join(PER)}")
        sides["per"] = per
        den_holds = comparison.get("den_holds")
        if sides["den"] and den_holds is None:
            raise fail("comparison.den_holds", "required with comparison.den: the den points' own bound, e.g. '>= 1'")
        if den_holds is not None and not sides["den"]:
            raise fail("comparison.den_holds", "a bound for the den points, but comparison.den selects none")
        if den_holds is not None:
            sides["den_op"], sides["den_bound"] = _holds(den_holds, "comparison.den_holds", kind, fail)
        if data.get("published_setup") is not None:
            raise fail("published_setup", "a count is not planned (the planner models times and memory, not "
                                          "counts): a count claim is not carried")
    published, setup = _published(data.get("published"), fail)
    planned = _planned(data.get("published_setup"), kind, sides.get("axis"), fail)
    return Claim(name=name, statement=texts["statement"], source=texts["source"], suite=texts["suite"], kind=kind,
                 suite_gpu=suite_gpu.strip() if suite_gpu else None, metric=metric, op=op, bound=bound,
                 published=published, setup=setup, planned=planned, path=source, **sides)


def _mapping(value: Any, where: str, keys: tuple[str, ...], fail) -> None:
    """``value`` is a mapping whose keys are among ``keys``; ``where``: its field ("" for the file's top level)."""
    if not isinstance(value, dict):
        raise fail(where or "(top level)", f"expected a mapping with keys {', '.join(keys)}")
    bad = sorted(set(map(str, value)) - set(keys))
    if bad:
        raise fail(f"{where}.{bad[0]}" if where else bad[0], f"unknown key; allowed: {', '.join(keys)}")


def _holds(holds: Any, where: str, kind: str, fail) -> tuple[str, float]:
    """``OP VALUE``: the operator and the bound. A ratio's bound is above 0; a count's is not negative."""
    m = _HOLDS.match(holds) if isinstance(holds, str) else None
    if m is None:
        raise fail(where, f"{holds!r}: expected OP VALUE with OP one of >= > <= <, e.g. '>= 1.0'")
    bound = float(m.group(2))
    if not math.isfinite(bound):
        raise fail(where, "the bound must be a finite number")
    if kind in ("ratio", "memory") and bound <= 0:
        raise fail(where, f"a ratio of positive values is above 0: the bound {bound:g} says nothing")
    if kind == "count" and bound < 0:
        raise fail(where, f"a count is not negative: the bound {bound:g} says nothing")
    return m.group(1), bound


def _selector(value: Any, where: str, fail, required: bool = False, extremes: bool = False) -> dict[str, Any]:
    """``{section.field: value}`` (or a launch key), each value one the field can take; ``extremes``: or
    ``largest``/``smallest``."""
    if value is None and not required:
        return {}
    if not isinstance(value, dict) or not value:
        raise fail(where, "expected a mapping of section.field: value, e.g. {parallel.strategy: ddp}")
    for key, v in value.items():
        if key not in LAUNCH_KEYS:
            check_config_key(key, f"{where}.{key}", fail)
        if not (extremes and v in EXTREMES):
            check_value(key, v, f"{where}.{key}", fail)
    return dict(value)


def _published(value: Any, fail) -> tuple[float | None, Setup]:
    if value is None:
        return None, Setup()
    _mapping(value, "published", PUBLISHED_KEYS, fail)
    number = value.get("value")
    if number is not None and (isinstance(number, bool) or _finite(number) is None):
        raise fail("published.value", f"expected a finite number, got {_short(number)}")
    setup = value.get("setup") or {}
    _mapping(setup, "published.setup", SETUP_KEYS, fail)
    for key in ("device", "precision", "description"):
        if key in setup and not isinstance(setup[key], str):
            raise fail(f"published.setup.{key}", f"expected text, got {setup[key]!r}")
    for key in (*SCOPE_KEYS, "arms"):  # what the published value depends on: said, or "not stated"
        if key in setup and not (isinstance(setup[key], str) and setup[key].strip()):
            raise fail(f"published.setup.{key}", f"expected text (or not stated), got {setup[key]!r}")
    routing = str(setup.get("routing", "")).strip()
    if routing and routing not in ROUTINGS:
        raise fail("published.setup.routing", f"{routing!r}: expected one of {', '.join(ROUTINGS)} (moe.routing's "
                                              "values, or not stated)")
    devices = setup.get("devices")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise fail("published.setup.devices", f"expected a positive whole number, got {devices!r}")
    for key in ("active_params", "total_params"):
        n = setup.get(key)
        if n is not None and (isinstance(n, bool) or not (_finite(n) or 0) > 0):
            hint = " (YAML reads 3.17e9 as text: write 3.17e+9)" if isinstance(n, str) else ""
            raise fail(f"published.setup.{key}", f"expected a positive finite number, got {_short(n)}{hint}")
    params = {k: float(setup[k]) for k in ("active_params", "total_params") if setup.get(k) is not None}
    return (None if number is None else float(number)), Setup(
        device=setup.get("device"), devices=devices, precision=setup.get("precision"),
        description=str(setup.get("description", "")).strip(), routing=routing,
        **{k: " ".join(str(setup.get(k, "")).split()) for k in ("dispatcher", "micro_batch", "precision_scope",
                                                                "arms")},
        **params)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float; None for text and for numbers beyond a float (a 401-digit YAML
    integer: ``float()`` raises OverflowError on it)."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _short(value: Any) -> str:
    """``repr(value)``, cut to 40 characters (a 401-digit number fills a screen)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(text)} characters)"


def _planned(value: Any, kind: str, axis: str | None, fail) -> PlannedSetup | None:
    """``published_setup``: a preset, a GPU of the device table and a count, the precision, the layout
    (parallel fields), per side the config keys it changes (ratio, memory), the axis's ends (drop)."""
    if value is None:
        return None
    _mapping(value, "published_setup", PLANNED_KEYS, fail)
    for key in ("preset", "gpu", "gpus"):
        if value.get(key) is None:
            raise fail(f"published_setup.{key}", "required: the setup is planned from a preset on a GPU and count")
    check_value("preset", value["preset"], "published_setup.preset", fail)
    gpu = value["gpu"]
    if not isinstance(gpu, str) or gpu.lower() not in DEVICES:
        raise fail("published_setup.gpu", f"unknown GPU {gpu!r}; known: {', '.join(DEVICES)}")
    gpus = value["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise fail("published_setup.gpus", f"expected a positive whole number, got {gpus!r}")
    precision = value.get("precision")
    if precision is not None:
        check_value("precision.mode", precision, "published_setup.precision", fail)
    parallel = value.get("parallel") or {}
    if not isinstance(parallel, dict):
        raise fail("published_setup.parallel", "expected a mapping of parallel fields, e.g. {ep: 8}")
    for key, v in parallel.items():
        check_config_key(f"parallel.{key}", f"published_setup.parallel.{key}", fail)
        check_value(f"parallel.{key}", v, f"published_setup.parallel.{key}", fail)
    shared = _selector(value.get("set"), "published_setup.set", fail)
    sides = {}
    for side in ("num", "den"):
        if value.get(side) is not None and kind == "drop":
            raise fail(f"published_setup.{side}", "a drop plans one layout across its axis: give axis, not num/den")
        sides[side] = _selector(value.get(side), f"published_setup.{side}", fail)
    ends = value.get("axis")
    if kind == "drop":
        if not isinstance(ends, list) or len(ends) != 2 or ends[0] == ends[1]:
            raise fail("published_setup.axis", f"required for a drop: the published smallest and largest {axis}, "
                                               f"e.g. [8, 128]; got {ends!r}")
        for end in ends:
            check_value(str(axis), end, "published_setup.axis", fail)
    elif ends is not None:
        raise fail("published_setup.axis", f"only a drop runs across an axis; a {kind} plans num and den")
    return PlannedSetup(preset=value["preset"], gpu=gpu.lower(), gpus=gpus, precision=precision,
                        parallel=dict(parallel), set=shared, axis=None if ends is None else (ends[0], ends[1]), **sides)


def check_suite(claim: Claim) -> Path:
    """The claim's suite file (its ``suite_gpu`` is checked too), parsed as a suite (a path to any
    readable file, ``../../etc/passwd``, is not one), or a ConfigError naming the claim's field."""
    found = {}
    for key in ("suite", "suite_gpu"):
        name = getattr(claim, key)
        try:
            found[key] = find_suite(name) if name else None
            if found[key] is not None:
                parse_suite(read_yaml(found[key]), source=str(found[key]))
        except ConfigError as exc:
            raise ConfigError(f"{claim.path}: {key}: {exc}") from None
    return found["suite"]


def claim_value_text(x: float | None, kind: str) -> str:
    """A claim's value as its kind is written: ``61.6%`` (a drop), ``3`` (a count), ``2.13x`` (the rest)."""
    if x is None:
        return ""
    if kind == "count":
        return f"{x:.3g}"
    return f"{100 * x:.1f}%" if kind == "drop" else f"{x:.2f}x"
