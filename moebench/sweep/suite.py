"""Suite files: a base config plus axes to vary, expanded into validated points.

A suite is a YAML file (see docs/sweep.md)::

    name: smoke
    description: what the sweep answers
    base: {preset: tiny, set: {train.steps: 6}}
    grid: {moe.num_experts: [8, 16]}            # cartesian product
    zip:                                        # lists varied together (one or a list of groups)
      parallel.strategy: [fsdp, ddp]
      parallel.ep: [1, 2]
    baseline: {parallel.strategy: fsdp}         # which points the report compares against
    timeout: 300                                # seconds per point
    repeats: 3                                  # runs per point, round-robin over the points

Axis keys are config keys (``section.field``) or the two launch keys ``preset`` and
``nproc`` (ranks to launch; by default the layout's world size, ``dp * pp``). Every value
is checked against its field's type when the file is parsed; every point is validated
before anything runs (config, rank count, and the parallel layout via
:func:`moebench.layout.validate_layout`); invalid points carry their reason.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import moebench
from moebench.config import SECTIONS, Config, field_named, parse_field
from moebench.devices import LocalRanks
from moebench.errors import ConfigError
from moebench.layout import validate_layout
from moebench.presets import PRESETS, load_config
from moebench.results.store import DEFAULT_BASELINE

# The suites shipped with moebench: the repository's top-level suites/, linked as moebench/suites so an
# installed package carries the same files. A suites/ folder in the working directory comes first.
SUITES_DIR = Path(__file__).resolve().parents[1] / "suites"
TOP_KEYS = ("name", "description", "base", "grid", "zip", "baseline", "timeout", "repeats")
BASE_KEYS = ("preset", "set", "nproc")
LAUNCH_KEYS = ("preset", "nproc")
DEFAULT_TIMEOUT_S = 1800.0
# Runs per point (suite ``repeats``, ``moebench run --repeats``): more would be hours of runs by mistake.
MAX_REPEATS = 100
# Points one suite may expand to unless ``moebench run --max-points`` allows more: as many as one
# Slurm job array holds by default (MaxArraySize 1001), and hours of runs. The count is known
# before expansion, so a 12.96M-point grid is refused at once instead of expanded.
MAX_POINTS = 1000
# YAML nodes a suite file may expand to, aliases counted at every use: a real suite has a few
# hundred; nested aliases ("billion laughs") reach billions from a few lines.
MAX_YAML_NODES = 100_000
# A suite name names the results folder and the Slurm job: the characters both take.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", re.ASCII)


@dataclass
class Point:
    """One run of a sweep: what to launch, its store key, and why it is invalid (if it is)."""

    index: int
    values: dict[str, Any]  # this point's axis values (what distinguishes it in tables)
    preset: str
    overrides: dict[str, Any]  # base ``set`` plus config-key axis values
    nproc: int | None
    timeout_s: float
    config: Config | None = None
    error: str | None = None
    duplicate_of: str | None = None  # id of an earlier point with the same key: never run nor recorded
    oversubscribe: bool = False  # ``moebench run --oversubscribe``: more ranks than the machine has devices
    # Which of the point's ``repeats`` runs this is (0-based); not part of the key: the repeats of a
    # point share its config and its identity, and the store tells them apart by this index.
    repeat: int = 0
    repeats: int = 1

    @property
    def point_id(self) -> str:
        return f"p{self.index:03d}"

    @property
    def run_id(self) -> str:
        """This run of the point: ``p003`` for repeat 0 (as a store without repeats names it), ``p003.r1`` after."""
        return self.point_id if self.repeat == 0 else f"{self.point_id}.r{self.repeat}"

    def at_repeat(self, repeat: int, repeats: int) -> Point:
        return dataclasses.replace(self, repeat=repeat, repeats=repeats)

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def key(self) -> str:
        """Hash of the resolved config, the rank count and the code version: the resume key."""
        ident: dict[str, Any] = {"code": moebench.__version__, "nproc": self.nproc}
        if self.config is not None:
            ident["config"] = self.config.to_dict()
        else:
            ident["unresolved"] = {"preset": self.preset, "set": {k: str(v) for k, v in self.overrides.items()}}
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def train_args(self) -> list[str]:
        """Arguments after ``moebench train`` that run this point."""
        args = ["--preset", self.preset]
        for k, v in self.overrides.items():
            args += ["--set", f"{k}={cli_value(v)}"]
        if self.nproc and self.nproc > 1:
            args += ["--nproc", str(self.nproc), *(["--oversubscribe"] if self.oversubscribe else [])]
        return [*args, "--json"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "point_id": self.point_id, "key": self.key, "values": self.values, "preset": self.preset,
            "overrides": self.overrides, "nproc": self.nproc, "timeout_s": self.timeout_s, "error": self.error,
            **({"oversubscribe": True} if self.oversubscribe else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], resolve: bool = True) -> Point:
        point = cls(
            index=int(data["point_id"][1:]), values=data["values"], preset=data["preset"],
            overrides=data["overrides"], nproc=data["nproc"], timeout_s=data["timeout_s"], error=data["error"],
            oversubscribe=data.get("oversubscribe") is True,
        )
        if resolve and point.error is None:
            point.config = load_config(point.preset, dict(point.overrides))
        return point


@dataclass
class Suite:
    name: str
    description: str
    preset: str
    base_set: dict[str, Any]
    grid: dict[str, list[Any]]
    zips: list[dict[str, list[Any]]]
    baseline: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_BASELINE))
    timeout_s: float = DEFAULT_TIMEOUT_S
    base_nproc: int | None = None
    source: str = "<dict>"
    # ``moebench run --set``: config fields set for every point, over ``base.set`` (not part of the file)
    cli_set: dict[str, Any] = field(default_factory=dict)
    baseline_given: bool = False  # the file names its baseline (the default one may match no point)
    max_points: int = MAX_POINTS  # ``moebench run --max-points``
    # ranks a local run can start here (``moebench run`` without --slurm/--oversubscribe); None: no bound
    local_ranks: LocalRanks | None = None
    oversubscribe: bool = False  # ``moebench run --oversubscribe``: passed on to each point's ``train``
    repeats: int = 1  # runs of each point, each in its own process tree (``moebench run --repeats`` overrides)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description,
            "base": {"preset": self.preset, "set": self.base_set, "nproc": self.base_nproc},
            "grid": self.grid, "zip": self.zips, "baseline": self.baseline, "timeout": self.timeout_s,
            "repeats": self.repeats,
        }

    def with_set(self, values: dict[str, Any], source: str = "--set ") -> Suite:
        """This suite with config fields set for every point, each checked as a suite value is.

        ``source`` starts each error (``--set moe.top_k=9: ...``). A field the suite varies is
        refused: the axis would silently win over the override.
        """
        def fail(where: str, message: str) -> ConfigError:
            return ConfigError(f"{where}: {message}")

        checked = {}
        for key, value in values.items():
            where = f"{source}{key}={cli_value(value)}"
            check_config_key(key, where, fail)
            if key in self.axis_names():
                raise fail(where, f"{key} is an axis of {self.source}; pick its points with --filter {key}=VALUE")
            check_value(key, value, where, fail)
            checked[key] = parse_field(key, value)
        return dataclasses.replace(self, cli_set=checked)

    def axis_names(self) -> list[str]:
        return [*self.grid, *(k for group in self.zips for k in group)]

    def point_count(self) -> int:
        """How many points the grid x zip groups expand to, without expanding them."""
        return math.prod(len(v) for v in self.grid.values()) * math.prod(
            len(next(iter(g.values()), [])) for g in self.zips)

    def points(self) -> list[Point]:
        """Expand grid x zip groups into points (grid axes vary slowest), each validated."""
        count = self.point_count()
        if count > self.max_points:
            raise ConfigError(f"{self.source}: grid x zip expands to {count:,} points, more than the cap of "
                              f"{self.max_points:,} (moebench run --max-points {count} allows them)")
        factors: list[list[dict[str, Any]]] = []
        if self.grid:
            keys = list(self.grid)
            factors.append([dict(zip(keys, combo, strict=True)) for combo in itertools.product(*self.grid.values())])
        for group in self.zips:
            keys = list(group)
            factors.append([dict(zip(keys, combo, strict=True)) for combo in zip(*group.values(), strict=True)])
        points = []
        seen: dict[str, str] = {}
        for index, parts in enumerate(itertools.product(*factors)):
            values = {k: v for part in parts for k, v in part.items()}
            point = self._make_point(index, values)
            # two points that resolve to the same config would share one store key
            if point.valid and point.key in seen:
                point.duplicate_of = seen[point.key]
                point.error = f"same resolved config as {point.duplicate_of}"
            seen.setdefault(point.key, point.point_id)
            points.append(point)
        return points

    def _make_point(self, index: int, values: dict[str, Any]) -> Point:
        preset = str(values.get("preset", self.preset))
        overrides = {**self.base_set, **self.cli_set, **{k: v for k, v in values.items() if k not in LAUNCH_KEYS}}
        nproc = values.get("nproc", self.base_nproc)
        point = Point(index, values, preset, overrides, nproc, self.timeout_s, oversubscribe=self.oversubscribe)
        try:
            cfg = load_config(preset, dict(overrides))
        except ConfigError as exc:
            point.error = str(exc)
            return point
        point.config = cfg
        world = cfg.parallel.world_size
        if point.nproc is None:
            point.nproc = world
        point.error = layout_error(cfg, int(point.nproc))
        if point.error is None and self.local_ranks is not None:
            most, what = self.local_ranks.limit(cfg.train.device)
            if point.nproc > max(most, 1):
                point.error = (f"nproc={point.nproc} is more ranks than the {most} {what} here (a local run "
                               "starts one process per rank; --oversubscribe starts them anyway, --slurm runs "
                               "them on a cluster)")
        return point


def runs(points: list[Point], repeats: int) -> list[Point]:
    """Every run of ``points``, round-robin: p0r0 p1r0 ... p0r1 p1r1 ..., so the repeats of the
    points a report compares interleave in time and a drift of the machine touches each alike.
    An invalid point has one run (its invalid record); it cannot run, so it has no repeats."""
    return [p.at_repeat(r, repeats) for r in range(repeats) for p in points if p.valid or r == 0]


def check_repeats(repeats: Any, where: str) -> int:
    """``repeats`` as a run count, or a ConfigError naming ``where`` it came from."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise ConfigError(f"{where}: expected a whole number of runs per point in [1, {MAX_REPEATS}], "
                          f"got {repeats!r}")
    return repeats


def layout_error(cfg: Config, world_size: int) -> str | None:
    """Why this layout cannot run on ``world_size`` ranks, or None when it can."""
    if world_size != cfg.parallel.world_size:
        return (
            f"nproc={world_size} does not match the layout's world size parallel.dp x parallel.pp = "
            f"{cfg.parallel.dp} x {cfg.parallel.pp} = {cfg.parallel.world_size}"
        )
    try:
        validate_layout(cfg, world_size)
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------- parsing
def find_suite(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or a suite name: ``./suites/NAME.yaml`` if the working directory has
    one, else the suite of that name shipped with moebench (:data:`SUITES_DIR`)."""
    return find_named_yaml(name_or_path, "suite", SUITES_DIR)


def find_named_yaml(name_or_path: str | Path, kind: str, shipped: Path) -> Path:
    """A path to a YAML file, or the name of one: ``./<kind>s/NAME.yaml`` if the working directory
    has one, else ``shipped/NAME.yaml`` (the folder moebench ships). ``kind`` (``suite``, ``claim``)
    names the folder and the errors."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"{kind} file {p} does not exist")
        if not p.is_file():  # a folder, FIFO or device: reading a FIFO would wait for a writer
            raise ConfigError(f"{kind} file {p} is not a regular file")
        return p
    folders = [Path(f"{kind}s"), shipped]
    for folder in folders:
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    # In a checkout, ./suites is the folder the shipped one links to: list each folder once.
    listed: dict[Path, tuple[Path, list[str]]] = {}
    for folder in folders:
        if folder.is_dir():
            listed.setdefault(folder.resolve(), (folder, sorted(f.stem for f in folder.glob("*.yaml"))))
    known = "; ".join(f"{folder}: {', '.join(names) or 'none'}" for folder, names in listed.values())
    close = difflib.get_close_matches(str(name_or_path), [n for _, names in listed.values() for n in names], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown {kind} {str(name_or_path)!r}{hint} "
                      f"(known {kind}s in {known or f'no {kind}s folder'})")


class _SuiteLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error.

    Plain PyYAML keeps the last of two equal keys, so a second ``grid:`` block or an axis
    listed twice would silently replace the first.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports an unhashable key
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {first_line[key]})", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_expanded_size(node)
        return node


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it beyond :data:`MAX_YAML_NODES` nodes, or that
    refers to itself; counted on the composed graph (an alias is the same node object)."""
    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    def fail(node: yaml.Node, problem: str) -> yaml.YAMLError:
        return yaml.composer.ComposerError(None, None, problem, node.start_mark)

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children(node))
            if sizes[id(node)] > MAX_YAML_NODES:
                raise fail(node, f"aliases expand the file beyond {MAX_YAML_NODES:,} values")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise fail(node, "an alias refers to the collection it is part of")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in sizes)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line, ``file:line:column: not valid YAML: problem``, instead of PyYAML's multi-line text."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} on line {context_mark.line + 1})"
    return ConfigError(f"{where}: not valid YAML: {problem}")


def load_suite(name_or_path: str | Path) -> Suite:
    path = find_suite(name_or_path)
    return parse_suite(read_yaml(path), source=str(path))


def read_yaml(path: Path, what: str = "suite file") -> Any:
    """A suite-like YAML file's data (safe loader, no repeated keys, bounded aliases), or a one-line
    ConfigError naming the file, line and column."""
    try:
        data = yaml.load(path.read_text(), Loader=_SuiteLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{path}: not valid YAML: collections nested too deeply") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc})") from None
    return data


def parse_suite(data: Any, source: str = "<dict>") -> Suite:
    """Check a suite's structure; errors name the file, the key and what is allowed."""

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {message}")

    if not isinstance(data, dict):
        raise fail("(top level)", f"expected a mapping with keys {', '.join(TOP_KEYS)}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise fail(unknown[0], f"unknown key; allowed: {', '.join(TOP_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise fail("name", f"{name!r}: required: letters, digits and _.+- starting with a letter or digit "
                           "(it names the results folder and the Slurm job)")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail("description", f"expected text, got {type(description).__name__}")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise fail("base", f"expected a mapping with keys {', '.join(BASE_KEYS)}")
    bad = sorted(set(base) - set(BASE_KEYS))
    if bad:
        raise fail(f"base.{bad[0]}", f"unknown key; allowed: {', '.join(BASE_KEYS)}")
    preset = base.get("preset", "tiny")
    if not isinstance(preset, str):  # a list is not a sweep over presets here: that is a grid axis
        raise fail("base.preset", f"expected one preset name, got {repr(preset)[:60]}; to sweep presets, "
                                  "use the axis grid: {preset: [...]}")
    if preset not in PRESETS:
        raise fail("base.preset", f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    base_set = base.get("set") or {}
    if not isinstance(base_set, dict):
        raise fail("base.set", "expected a mapping of section.field: value")
    for key, value in base_set.items():
        check_config_key(key, f"base.set.{key}", fail)
        check_value(key, value, f"base.set.{key}", fail)
    base_nproc = base.get("nproc")
    if base_nproc is not None and (not isinstance(base_nproc, int) or isinstance(base_nproc, bool) or base_nproc < 1):
        raise fail("base.nproc", "expected a positive integer")

    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise fail("grid", "expected a mapping of axis: [values]")
    for key, values in grid.items():
        _check_axis(key, values, f"grid.{key}", fail)
    zips_raw = data.get("zip") or []
    zips_raw = [zips_raw] if isinstance(zips_raw, dict) else zips_raw
    if not isinstance(zips_raw, list) or not all(isinstance(g, dict) for g in zips_raw):
        raise fail("zip", "expected a mapping of axis: [values] (or a list of such mappings)")
    seen = set(grid)
    for i, group in enumerate(zips_raw):
        if not group:
            raise fail(f"zip[{i}]", "an empty mapping zips no axis; give axis: [values] or drop it")
        lengths = set()
        for key, values in group.items():
            _check_axis(key, values, f"zip[{i}].{key}", fail)
            if key in seen:
                raise fail(f"zip[{i}].{key}", "axis appears twice; each axis may vary in one place only")
            seen.add(key)
            lengths.add(len(values))
        if len(lengths) > 1:
            raise fail(f"zip[{i}]", f"zipped lists must have equal lengths, got {sorted(lengths)}")

    baseline = data.get("baseline", DEFAULT_BASELINE)
    if not isinstance(baseline, dict) or not baseline:
        raise fail("baseline", "expected a mapping of axis: value, e.g. {parallel.strategy: fsdp}")
    for key, value in baseline.items():
        if key not in LAUNCH_KEYS:
            check_config_key(key, f"baseline.{key}", fail, axis=True)
        check_value(key, value, f"baseline.{key}", fail)
    timeout = data.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise fail("timeout", "expected a positive number of seconds per point")
    repeats = check_repeats(data.get("repeats", 1), f"{source}: repeats")
    return Suite(
        name=name, description=description, preset=preset, base_set=dict(base_set),
        grid={k: list(v) for k, v in grid.items()}, zips=[{k: list(v) for k, v in g.items()} for g in zips_raw],
        baseline=dict(baseline), timeout_s=float(timeout), base_nproc=base_nproc, source=source,
        baseline_given="baseline" in data, repeats=repeats,
    )


def _check_axis(key: str, values: Any, where: str, fail) -> None:
    if key not in LAUNCH_KEYS:
        check_config_key(key, where, fail, axis=True)
    if not isinstance(values, list) or not values:
        raise fail(where, "expected a non-empty list of values")
    for i, value in enumerate(values):
        check_value(key, value, f"{where}[{i}]", fail)


def check_value(key: str, value: Any, where: str, fail) -> None:
    """A value the axis can never take (wrong type, not an allowed choice) is a suite error,
    not one invalid point per combination it appears in."""
    if key == "preset":
        if value not in PRESETS:
            raise fail(where, f"unknown preset {value!r}; allowed: {', '.join(PRESETS)}")
    elif key == "nproc":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(where, f"nproc {value!r} is not a positive integer")
    else:
        try:
            parse_field(key, value)
        except ConfigError as exc:
            raise fail(where, str(exc)) from None


def check_config_key(key: Any, where: str, fail, axis: bool = False) -> None:
    """``key`` names a config field (``axis``: or a launch key, which only axes and baselines take)."""
    if not isinstance(key, str):  # YAML reads ``1:`` or ``true:`` as a number or a bool
        raise fail(where, f"key {key!r} is not text; expected section.field")
    if not axis and key in LAUNCH_KEYS:
        raise fail(where, f"{key} is not a config field; the suite sets it (base.{key}, or an axis {key}: [...]), "
                          f"and --filter {key}=VALUE picks the points of an axis")
    section, _, name = key.partition(".")
    if section not in SECTIONS and field_named(key):
        raise fail(where, f"unknown key {key!r}; did you mean {field_named(key)}?")
    if section not in SECTIONS:
        allowed = ", ".join([*(LAUNCH_KEYS if axis else ()), *(f"{s}.<field>" for s in SECTIONS)])
        raise fail(where, f"unknown key {key!r}; allowed: {allowed}")
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if name not in fields:
        raise fail(where, f"unknown key {key!r}; {section} fields are: {', '.join(fields)}")


def require_runnable(suite: Suite, points: list[Point]) -> None:
    """Refuse a suite none of whose points can run (a store of invalid records helps nobody), or
    whose own baseline selector matches none of its runnable points (no report could compare)."""
    if not any(p.valid for p in points):
        first = points[0]
        more = f" (and {len(points) - 1} more invalid points; --dry-run lists them)" if len(points) > 1 else ""
        raise ConfigError(f"{suite.source}: no point of the suite can run; {first.point_id}: {first.error}{more}")
    if suite.baseline_given:
        runnable = [p for p in points if p.valid and p.config is not None]
        if not any(all(_point_value(p, k) == _selector_value(k, v) for k, v in suite.baseline.items())
                   for p in runnable):
            taken = "; ".join(f"{k} takes {', '.join(sorted({cli_value(_point_value(p, k)) for p in runnable}))}"
                              for k in suite.baseline)
            wanted = ", ".join(f"{k}={cli_value(v)}" for k, v in suite.baseline.items())
            raise ConfigError(f"{suite.source}: baseline: {wanted} matches no runnable point ({taken})")


def _point_value(point: Point, key: str) -> Any:
    if key in LAUNCH_KEYS:
        return point.preset if key == "preset" else point.nproc
    section, _, name = key.partition(".")
    return getattr(getattr(point.config, section), name)


def _selector_value(key: str, value: Any) -> Any:
    return value if key in LAUNCH_KEYS else parse_field(key, value)


def cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)
