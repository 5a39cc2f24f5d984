"""Run configuration: nested dataclasses, ``--set`` overrides and the analytic cost model.

A :class:`Config` has five sections (``model``, ``moe``, ``train``, ``precision``,
``parallel``). Presets live in :mod:`moebench.presets`; any field can be overridden with
``section.field=value``. Derived quantities (parameter counts, FLOPs per token) are
methods of the Config, computed from the shapes and tested against the numel of a built model.

By job: :mod:`~moebench.config.sections` the sections' fields, :mod:`~moebench.config.backends`
which expert backend computes which model feature, :mod:`~moebench.config.overrides` a
``--set`` value read into its field's type, :mod:`~moebench.config.run_config` the Config,
:mod:`~moebench.config.validate` its checks, :mod:`~moebench.config.cost` its cost model.
"""

from moebench.config.backends import BACKEND_FEATURES, MOE_FEATURES, check_backend_features, resolve_backend
from moebench.config.overrides import field_named, parse_field
from moebench.config.run_config import Config
from moebench.config.sections import (
    SCOPE_KINDS,
    SECTIONS,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    added_field,
)

__all__ = [
    "BACKEND_FEATURES",
    "MOE_FEATURES",
    "SCOPE_KINDS",
    "SECTIONS",
    "Config",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "added_field",
    "check_backend_features",
    "field_named",
    "parse_field",
    "resolve_backend",
]
