"""Published operating points as data: the shipped ``moebench/published/*.yaml`` files. Torch-free.

One file per source (a report, a repository's table), each a ``source``, the moebench settings that
mirror its framework's implementation, and a list of ``rows``::

    source: {title: "...", where: "owner/repo path @ commit"}
    implementation: {precision.param_dtype: bf16, model.norm_impl: recompute}   # {}: the source states none
    rows:
      - id: olmo3-4xb300-e32-bf16              # unique over every file
        role: calibration                       # or held-out (the default)
        description: "..."
        hardware: {gpu: b300, gpus: 4}          # a moebench.devices key
        model: {name: "...", preset: moe-8l-e32, total_params: 13.037e+9, active_params: 3.172e+9}
        layout: {data_parallel: ddp, dist_opt: true, ep: 4, pp: 1, virtual_stages: 1,
                 ep_transport: row-wise, two_batch_overlap: false}
        # optional under pp > 1: layers of each of the pp x virtual_stages stages, in order
        # (stage_layers: [10, 10, 10, 9]); unstated, the first stages take the remainder
        batch: {seq_len: 8192, micro_batch_sequences: 2, global_batch_sequences: 64}
        routing: uniform                        # learned | random | uniform | force-balanced
        capacity_factor: 1.25                   # a number, or dropless
        precision: bf16                         # bf16 | fp8 | mxfp8
        precision_scope: experts                # experts | linear (moebench's precision.scope)
        recompute: none                         # none | per-layer
        measured:
          - {metric: tokens_per_s_per_device, value: 54680}
          - {metric: tokens_per_s_ratio, value: 1.21, relative_to: OTHER-ROW-ID, approximate: true}
        statistic: "mean of 3 fresh processes"  # how the value was taken, as the source says
        protocol: "..."
        implementation: {precision.param_dtype: bf16}   # optional: replaces the file's for this row

``implementation`` takes only the settings of :data:`IMPLEMENTATION_KEYS` (how a framework computes
the same model: its precision policy, fused norms, a fused LM head and loss), each value checked as
the config field it sets; layout, batch and precision are the row's own fields.

Any field the source does not give is the string ``not stated`` (a row's model may be ``no preset``:
moebench has no preset of that shape, and such a row is not planned). ``micro_batch_sequences`` is
sequences per rank in one forward/backward (one pipeline micro-batch under PP). Every key is checked
when a file is read; an error is one line naming the file, the row and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moebench.config import parse_field
from moebench.devices import DEVICES
from moebench.errors import ConfigError
from moebench.precision_modes import BF16_MODES
from moebench.presets import PRESETS

PUBLISHED_DIR = Path(__file__).resolve().parents[1] / "published"
NOT_STATED = "not stated"
NO_PRESET = "no preset"
GIB = 2**30

ROLES = ("calibration", "held-out")
ROUTINGS = ("learned", "random", "uniform", "force-balanced")
SCOPES = ("experts", "linear")
RECOMPUTES = ("none", "per-layer")
DATA_PARALLEL = ("ddp", "fsdp")
EP_TRANSPORTS = ("row-wise", "deepep", "all-to-all")
# the config fields a source's ``implementation`` may set: how its framework computes the model, not
# what the row ran (layout, batch, precision and recompute are the row's own fields)
IMPLEMENTATION_KEYS = ("precision.param_dtype", "model.norm_impl", "model.loss_chunk_tokens")
# metric -> (unit, whether it is relative to another row)
METRICS: dict[str, tuple[str, bool]] = {
    "tokens_per_s_per_device": ("tokens/s", False),
    "tflops_per_device": ("TFLOP/s", False),
    "peak_mem_gib": ("GiB", False),
    "persistent_mem_gib": ("GiB", False),
    "transient_mem_gib": ("GiB", False),
    "ep_buffer_gib": ("GiB", False),
    "tokens_per_s_ratio": ("x", True),  # this row's tokens/s over relative_to's
    "peak_mem_delta_gib": ("GiB", True),  # this row's peak memory minus relative_to's
}

_TOP = ("id", "role", "description", "hardware", "model", "layout", "batch", "routing", "capacity_factor",
        "precision", "precision_scope", "recompute", "measured", "statistic", "protocol", "implementation")
_REQUIRED = tuple(k for k in _TOP if k not in ("role", "implementation"))
_HARDWARE = ("gpu", "gpus")
_MODEL = ("name", "preset", "total_params", "active_params")
_LAYOUT = ("data_parallel", "dist_opt", "ep", "pp", "virtual_stages", "stage_layers", "tp", "cp", "ep_transport",
           "two_batch_overlap")
_LAYOUT_REQUIRED = ("data_parallel", "dist_opt", "ep", "pp", "ep_transport")
_BATCH = ("seq_len", "micro_batch_sequences", "global_batch_sequences")
_MEASURED = ("metric", "value", "relative_to", "approximate")

Stated = Any  # a value of the field's type, or NOT_STATED


@dataclass(frozen=True)
class Layout:
    data_parallel: Stated  # ddp | fsdp
    dist_opt: Stated  # bool
    ep: int
    pp: int
    virtual_stages: Stated  # int: model chunks per pipeline rank (1: plain 1F1B)
    stage_layers: Stated  # tuple of ints: layers of each pipeline stage in order (moebench's parallel.pp_layers)
    tp: int
    cp: int
    ep_transport: Stated  # row-wise | deepep | all-to-all
    two_batch_overlap: bool


@dataclass(frozen=True)
class Batch:
    seq_len: Stated
    micro_batch_sequences: Stated
    global_batch_sequences: Stated

    @property
    def tokens_per_step(self) -> int | None:
        if NOT_STATED in (self.seq_len, self.global_batch_sequences):
            return None
        return self.seq_len * self.global_batch_sequences


@dataclass(frozen=True)
class Measured:
    metric: str
    value: float
    relative_to: str | None = None
    approximate: bool = False

    @property
    def unit(self) -> str:
        return METRICS[self.metric][0]


@dataclass(frozen=True)
class PublishedRow:
    id: str
    role: str
    description: str
    source: str  # the file's source title
    where: str  # the file's source location
    path: Path
    gpu: str
    gpus: int
    model_name: str
    preset: str | None  # None: no preset of this shape
    total_params: Stated
    active_params: Stated
    layout: Layout
    batch: Batch
    routing: Stated
    capacity_factor: Stated  # float | "dropless"
    precision: Stated
    precision_scope: Stated
    recompute: Stated
    measured: tuple[Measured, ...]
    statistic: str
    protocol: str
    # config field -> value: the settings that mirror the source's implementation (the row's own, else the file's)
    implementation: dict[str, Any]

    @property
    def calibration(self) -> bool:
        return self.role == "calibration"


class _Reader:
    """Checks one file's values; every error names the file, the row and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {where}: {message}")

    def keys(self, where: str, value: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a mapping, got {type(value).__name__}")
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise self.fail(f"{where}.{unknown[0]}", f"unknown key (allowed: {', '.join(allowed)})")
        missing = [k for k in required if k not in value]
        if missing:
            raise self.fail(f"{where}.{missing[0]}", f"missing (write {NOT_STATED!r} if the source does not say)")
        return value

    def text(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"must be a non-empty string, got {value!r}")
        return value

    def choice(self, where: str, value: Any, choices: tuple[str, ...], stated_only: bool = False) -> Stated:
        allowed = choices if stated_only else (*choices, NOT_STATED)
        if value not in allowed:
            raise self.fail(where, f"{value!r} is not one of {', '.join(allowed)}")
        return value

    def count(self, where: str, value: Any, may_be_unstated: bool = True) -> Stated:
        if may_be_unstated and value == NOT_STATED:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(where, f"must be an integer >= 1{' or not stated' if may_be_unstated else ''}, "
                                   f"got {value!r}")
        return value

    def counts(self, where: str, value: Any) -> Stated:
        """A non-empty list of integers >= 1 (a tuple), or not stated."""
        if value == NOT_STATED:
            return value
        if not isinstance(value, list) or not value:
            raise self.fail(where, f"must be a non-empty list of integers >= 1 or not stated, got {value!r}")
        return tuple(self.count(f"{where}[{i}]", v, may_be_unstated=False) for i, v in enumerate(value))

    def number(self, where: str, value: Any, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(where, f"must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.fail(where, f"must be > 0, got {value!r}")
        return float(value)

    def flag(self, where: str, value: Any, may_be_unstated: bool = True) -> Stated:
        if (may_be_unstated and value == NOT_STATED) or isinstance(value, bool):
            return value
        raise self.fail(where, f"must be true or false{' or not stated' if may_be_unstated else ''}, got {value!r}")

    def implementation(self, where: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a mapping of setting: value ({{}} for none), got {type(value).__name__}")
        out = {}
        for key, raw in value.items():
            if key not in IMPLEMENTATION_KEYS:
                raise self.fail(f"{where}.{key}", f"not an implementation setting (allowed: "
                                                  f"{', '.join(IMPLEMENTATION_KEYS)})")
            try:
                out[key] = parse_field(key, raw)
            except ConfigError as exc:
                raise self.fail(f"{where}.{key}", str(exc)) from None
        return out

    def row(self, i: int, raw: Any, title: str, where_from: str, implementation: dict[str, Any]) -> PublishedRow:
        if not isinstance(raw, dict):
            raise self.fail(f"rows[{i}]", f"must be a mapping, got {type(raw).__name__}")
        row_id = self.text(f"rows[{i}].id", raw.get("id"))
        at = f"rows[{i}] ({row_id})"
        raw = self.keys(at, raw, _TOP, _REQUIRED)
        hw = self.keys(f"{at}.hardware", raw["hardware"], _HARDWARE, _HARDWARE)
        gpu = self.choice(f"{at}.hardware.gpu", hw["gpu"], tuple(DEVICES), stated_only=True)
        model = self.keys(f"{at}.model", raw["model"], _MODEL, _MODEL)
        preset = model["preset"]
        if preset != NO_PRESET and preset not in PRESETS:
            raise self.fail(f"{at}.model.preset", f"unknown preset {preset!r} (write {NO_PRESET!r} if moebench has "
                                                  "none of this shape)")
        params = {k: model[k] if model[k] == NOT_STATED else self.number(f"{at}.model.{k}", model[k])
                  for k in ("total_params", "active_params")}
        lay = self.keys(f"{at}.layout", raw["layout"], _LAYOUT, _LAYOUT_REQUIRED)
        layout = Layout(
            data_parallel=self.choice(f"{at}.layout.data_parallel", lay["data_parallel"], DATA_PARALLEL),
            dist_opt=self.flag(f"{at}.layout.dist_opt", lay["dist_opt"]),
            ep=self.count(f"{at}.layout.ep", lay["ep"], may_be_unstated=False),
            pp=self.count(f"{at}.layout.pp", lay["pp"], may_be_unstated=False),
            virtual_stages=self.count(f"{at}.layout.virtual_stages", lay.get("virtual_stages", 1)),
            stage_layers=self.counts(f"{at}.layout.stage_layers", lay.get("stage_layers", NOT_STATED)),
            tp=self.count(f"{at}.layout.tp", lay.get("tp", 1), may_be_unstated=False),
            cp=self.count(f"{at}.layout.cp", lay.get("cp", 1), may_be_unstated=False),
            ep_transport=self.choice(f"{at}.layout.ep_transport", lay["ep_transport"], EP_TRANSPORTS),
            two_batch_overlap=self.flag(f"{at}.layout.two_batch_overlap", lay.get("two_batch_overlap", False),
                                        may_be_unstated=False),
        )
        gpus = self.count(f"{at}.hardware.gpus", hw["gpus"], may_be_unstated=False)
        model_parallel = layout.pp * layout.tp * layout.cp
        if gpus % model_parallel or (gpus // model_parallel) % layout.ep:
            raise self.fail(f"{at}.layout", f"gpus={gpus} is not pp x tp x cp x a multiple of ep "
                                            f"(pp={layout.pp}, tp={layout.tp}, cp={layout.cp}, ep={layout.ep})")
        if layout.stage_layers != NOT_STATED and (layout.virtual_stages == NOT_STATED
                                                  or len(layout.stage_layers) != layout.pp * layout.virtual_stages):
            raise self.fail(f"{at}.layout.stage_layers", f"{len(layout.stage_layers)} stages, but pp={layout.pp} x "
                                                         f"virtual_stages={layout.virtual_stages}")
        b = self.keys(f"{at}.batch", raw["batch"], _BATCH, _BATCH)
        batch = Batch(**{k: self.count(f"{at}.batch.{k}", b[k]) for k in _BATCH})
        cf = raw["capacity_factor"]
        if cf not in (NOT_STATED, "dropless"):
            cf = self.number(f"{at}.capacity_factor", cf)
        measured = raw["measured"]
        if not isinstance(measured, list) or not measured:
            raise self.fail(f"{at}.measured", "must be a non-empty list of {metric, value} entries")
        return PublishedRow(
            id=row_id, role=self.choice(f"{at}.role", raw.get("role", "held-out"), ROLES, stated_only=True),
            description=self.text(f"{at}.description", raw["description"]), source=title, where=where_from,
            path=self.path, gpu=gpu, gpus=gpus, model_name=self.text(f"{at}.model.name", model["name"]),
            preset=None if preset == NO_PRESET else preset, layout=layout, batch=batch, **params,
            routing=self.choice(f"{at}.routing", raw["routing"], ROUTINGS),
            capacity_factor=cf,
            precision=self.choice(f"{at}.precision", raw["precision"], BF16_MODES),
            precision_scope=self.choice(f"{at}.precision_scope", raw["precision_scope"], SCOPES),
            recompute=self.choice(f"{at}.recompute", raw["recompute"], RECOMPUTES),
            measured=tuple(self.measurement(f"{at}.measured[{j}]", m) for j, m in enumerate(measured)),
            statistic=self.text(f"{at}.statistic", raw["statistic"]),
            protocol=self.text(f"{at}.protocol", raw["protocol"]),
            implementation=(self.implementation(f"{at}.implementation", raw["implementation"])
                            if "implementation" in raw else implementation),
        )

    def measurement(self, where: str, raw: Any) -> Measured:
        raw = self.keys(where, raw, _MEASURED, ("metric", "value"))
        metric = self.choice(f"{where}.metric", raw["metric"], tuple(METRICS), stated_only=True)
        relative = METRICS[metric][1]
        value = self.number(f"{where}.value", raw["value"], positive=metric != "peak_mem_delta_gib")
        rel = raw.get("relative_to")
        if relative != (rel is not None):
            raise self.fail(f"{where}.relative_to", f"{'required' if relative else 'not allowed'} for {metric}")
        return Measured(metric, value, None if rel is None else self.text(f"{where}.relative_to", rel),
                        self.flag(f"{where}.approximate", raw.get("approximate", False), may_be_unstated=False))


def read_published_file(path: str | Path) -> list[PublishedRow]:
    """The rows of one published file, checked (relative_to is checked over all files by :func:`load_published`)."""
    path = Path(path)
    reader = _Reader(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {' '.join(str(exc).split())}") from exc
    data = reader.keys("top level", data, ("source", "implementation", "rows"), ("source", "rows"))
    if "implementation" not in data:
        raise reader.fail("implementation", "missing (write {} if the source states no setting of its implementation)")
    source = reader.keys("source", data["source"], ("title", "where"), ("title", "where"))
    title, where_from = reader.text("source.title", source["title"]), reader.text("source.where", source["where"])
    if not isinstance(data["rows"], list) or not data["rows"]:
        raise reader.fail("rows", "must be a non-empty list")
    implementation = reader.implementation("implementation", data["implementation"])
    return [reader.row(i, raw, title, where_from, implementation) for i, raw in enumerate(data["rows"])]


def load_published(paths: list[str | Path] | None = None) -> list[PublishedRow]:
    """Every row of ``paths`` (default: the shipped ``moebench/published/*.yaml``), in file order.

    Row ids are unique over the files, and a relative measurement's ``relative_to`` names one of them.
    """
    files = sorted(PUBLISHED_DIR.glob("*.yaml")) if paths is None else [Path(p) for p in paths]
    rows: list[PublishedRow] = []
    seen: dict[str, Path] = {}
    for path in files:
        for row in read_published_file(path):
            if row.id in seen:
                raise ConfigError(f"{path}: rows ({row.id}).id: also in {seen[row.id]}")
            seen[row.id] = path
            rows.append(row)
    for row in rows:
        for m in row.measured:
            if m.relative_to is not None and m.relative_to not in seen:
                raise ConfigError(f"{row.path}: rows ({row.id}).measured ({m.metric}).relative_to: "
                                  f"no row {m.relative_to!r}")
    return rows
