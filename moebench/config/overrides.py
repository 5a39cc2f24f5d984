"""A ``section.field=value`` override read into the field's type: the key checked against the
sections' fields, the value converted (plain ASCII numbers, booleans, ``Literal`` choices, none)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Literal

from moebench.config.sections import SECTIONS
from moebench.errors import ConfigError

# Keys people give to --set that are command-line options (or their shorthands), not config fields.
OPTION_KEYS = {
    "preset": "--preset {value}",
    "nproc": "--nproc {value} (train) or --gpus {value} (plan)",
    "steps": "--set train.steps={value} (train: --steps {value})",
}


def field_named(name: str) -> str | None:
    """The ``section.field`` key of a bare field name (``num_experts`` -> ``moe.num_experts``),
    when exactly one section has a field of that name."""
    keys = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c) if f.name == name]
    return keys[0] if len(keys) == 1 else None


def parse_field(key: str, value: Any) -> Any:
    """``value`` (a Python value or command-line text) converted to the type of config field
    ``key`` (``section.field``); a ConfigError names the key and what is allowed.

    Suites call it on every axis value before expanding points, so a wrong type is an error
    in the suite file rather than one invalid point per combination.
    """
    section_name, _, field_name = key.partition(".")
    if key in OPTION_KEYS:
        raise ConfigError(f"unknown key {key!r}: {key} is not a config field; "
                          f"use {OPTION_KEYS[key].format(value=value)}")
    if section_name not in SECTIONS or not field_name:
        meant = field_named(key)
        raise ConfigError(
            f"unknown key {key!r}: " + (f"did you mean {meant}?" if meant else
                                        f"expected section.field with section one of {', '.join(SECTIONS)}")
        )
    section = SECTIONS[section_name]
    fields = [f.name for f in dataclasses.fields(section)]
    if field_name not in fields:
        raise ConfigError(
            f"unknown key {key!r}; {section_name} fields are: {', '.join(fields)}"
        )
    return _coerce(key, value, _field_types(section)[field_name])


@functools.cache
def _field_types(section: type) -> dict[str, Any]:
    """A section's field types, resolved once: ``typing.get_type_hints`` evaluates every annotation of the class
    on each call, which made expanding a suite cost milliseconds a point."""
    return typing.get_type_hints(section)


def split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    return key.strip(), value.strip()


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# Integers above 2^53 do not survive a float (JSON readers, pandas columns, the cost model's ratios)
# and no field needs one: a count that large is a typo.
MAX_EXACT_INT = 2**53
# Plain ASCII decimal text. float() and int() also take surrounding whitespace ("0.01\n"),
# underscores, non-ASCII digits ("\uff11") and inf/nan; none of them is a number a suite means,
# and a newline would end a line of a generated sbatch script.
_INT_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _integer(key: str, value: Any) -> int:
    """An int field's value: an int, an integral float, or ASCII decimal text; at most 2^53 in size."""
    bad = ConfigError(f"bad value {value!r} for {key}; expected an integer")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        if _INT_TEXT.fullmatch(value):
            value = int(value)
        elif _NUMBER_TEXT.fullmatch(value):  # 1e3, 4.0
            value = float(value)
        else:
            raise bad
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise bad
        if abs(value) > MAX_EXACT_INT:  # this float already lost the digits the user typed
            raise ConfigError(f"bad value {value!r} for {key}; integers must be at most 2^53 = {MAX_EXACT_INT}")
        value = int(value)
    if not isinstance(value, int):
        raise bad
    if abs(value) > MAX_EXACT_INT:
        raise ConfigError(f"bad value {value!r} for {key}; integers must be at most 2^53 = {MAX_EXACT_INT}")
    return value


def _number(key: str, value: Any) -> float:
    """A float field's value: a finite int or float, or ASCII decimal text; exactly representable."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
            isinstance(value, str) and not _NUMBER_TEXT.fullmatch(value)):
        raise ConfigError(f"bad value {value!r} for {key}; expected a finite number in plain ASCII digits "
                          "without spaces, e.g. 0.01 or 1e-3")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"bad value {value!r} for {key}; expected a finite number")
    if isinstance(value, int) and int(number) != value:
        raise ConfigError(f"bad value {value!r} for {key}; {value} has no exact float (at most 2^53 = "
                          f"{MAX_EXACT_INT} for integers)")
    return number


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` to the field type ``hint`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in {"none", "null"}):
            return None
        return _coerce(key, value, non_none[0])
    if origin is Literal:
        text = str(value)
        if text not in args:
            raise ConfigError(f"bad value {value!r} for {key}; allowed: {', '.join(map(str, args))}")
        return text
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"bad value {value!r} for {key}; expected a boolean (true/false)")
    if hint is int:
        return _integer(key, value)
    if hint is float:
        return _number(key, value)
    if hint is str:
        return str(value)
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: a list, or comma-separated text "4,4,3"
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"bad value {value!r} for {key}; expected a list of integers, e.g. 4,4,3")
        return tuple(_integer(key, item) for item in items)
    raise AssertionError(f"unsupported field type {hint!r} for {key}")
