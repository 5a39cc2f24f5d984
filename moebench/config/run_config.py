"""A run's configuration: its five sections, its hash, ``--set`` overrides and its checks.

Parameter counts and FLOPs per token are methods of its base :class:`~moebench.config.cost.CostModel`;
the checks :meth:`Config.validate` raises are :mod:`moebench.config.validate`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from moebench.config.cost import CostModel
from moebench.config.overrides import parse_field, split_override
from moebench.config.sections import (
    ADDED,
    SECTIONS,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from moebench.config.validate import config_problems, size_problems
from moebench.errors import ConfigError


@dataclass
class Config(CostModel):
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preset: str = "custom"

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        cfg = cls(preset=str(data.get("preset", "custom")))
        for name, values in data.items():
            if name == "preset":
                continue
            if name not in SECTIONS:
                raise ConfigError(f"unknown config section {name!r}; allowed: {', '.join(SECTIONS)}")
            for key, value in dict(values).items():
                cfg.set(f"{name}.{key}", value)
        cfg.validate()
        return cfg

    def hash(self) -> str:
        """Stable short hash of the resolved config (keys sorted).

        A field declared with :func:`added_field` is left out while it holds its default, so that
        adding a field does not change the hash of every config written before it: stores,
        fixtures and ``check --against`` an older commit still match point by point.
        """
        data = self.to_dict()
        for name in SECTIONS:
            values = getattr(self, name)
            for f in dataclasses.fields(values):
                if f.metadata.get(ADDED) and getattr(values, f.name) == f.default:
                    del data[name][f.name]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ overrides
    def set(self, key: str, value: Any) -> None:
        """Set ``section.field`` from a Python value or a command-line string."""
        value = parse_field(key, value)
        section_name, _, field_name = key.partition(".")
        setattr(getattr(self, section_name), field_name, value)

    def apply_overrides(self, overrides: list[str] | dict[str, Any]) -> Config:
        items = overrides.items() if isinstance(overrides, dict) else map(split_override, overrides)
        for key, value in items:
            self.set(key, value)
        return self

    # ------------------------------------------------------------------ validation
    def validate_sizes(self) -> Config:
        """Check the counts every other check and cost divides by (all >= 1); raise ConfigError.

        The planner runs this alone before it scales the batch to a GPU count, which the full
        :meth:`validate` (batch divisibility) can only check afterwards.
        """
        _raise(size_problems(self))
        return self

    def validate(self) -> Config:
        """Check shapes and settings that do not depend on the launch; raise ConfigError."""
        self.validate_sizes()
        _raise(config_problems(self))
        return self

    def effective_capacity_factor(self) -> float:
        """Capacity factor the row-wise dispatcher runs at (the one home of this rule).

        ``moe.capacity=factor``: ``moe.capacity_factor``. ``moe.capacity=lossless``: ``parallel.ep``,
        whatever ``moe.capacity_factor`` says (it is ignored, so a suite may set both). At ep it
        holds the worst case under either ``parallel.rowwise_capacity`` rule
        (:mod:`moebench.parallel.capacity`, R = ep ranks, N routes per source): ``pair`` gives every
        (source, destination) ``ceil(ep * N / R) = N`` rows, all a source has, and ``destination``
        gives every destination ``R * N`` rows, all that every source has; so every route of every
        source may go to one destination and none is dropped.
        """
        if self.moe.capacity == "lossless":
            return float(self.parallel.ep)
        return self.moe.capacity_factor

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.model.seq_len


def _raise(problems: list[str]) -> None:
    """One ConfigError for every problem found, if any."""
    if problems:
        raise ConfigError("; ".join(problems))
