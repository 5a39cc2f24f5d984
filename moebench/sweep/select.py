"""``moebench run --only`` and ``--filter``: which points of a suite to run this time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moebench.config import parse_field
from moebench.errors import ConfigError
from moebench.sweep.suite import Point, cli_value


def parse_key_values(items: Sequence[str], option: str) -> dict[str, str]:
    """``["moe.top_k=2", ...]`` -> ``{"moe.top_k": "2"}``; an item without ``=`` names the option."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} {item}: expected KEY=VALUE, e.g. {option} moe.num_experts=16")
        if key in pairs:  # keeping only the last would silently drop the first
            raise ConfigError(f"{option} {key}: given twice ({key}={pairs[key]} and {item}); give each key once")
        pairs[key] = value
    return pairs


def _axis_value(key: str, text: str, where: str) -> Any:
    """``text`` as the type the axis holds, so ``16`` matches the suite's integer 16."""
    if key == "preset":
        return text
    if key == "nproc":
        if not (text.isascii() and text.isdigit()):  # str.isdigit() alone takes fullwidth and other digits
            raise ConfigError(f"{where}: nproc {text!r} is not a positive integer")
        return int(text)
    try:
        return parse_field(key, text)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def chosen_points(points: list[Point], only: Sequence[str], filters: Sequence[str]) -> list[Point]:
    """The points named by ``--only p001,p003`` (repeatable) and matching every ``--filter KEY=VALUE``.

    Unknown ids, keys that are not axes and bad values are errors, and so is a selection that
    leaves no point: each names the option.
    """
    ids = [i.strip() for item in only for i in item.split(",") if i.strip()]
    if only and not ids:  # --only '' would otherwise select every point
        raise ConfigError(f"--only {' '.join(map(repr, only))}: names no point; give point ids, e.g. --only p000,p002")
    known = {p.point_id for p in points}
    for point_id in ids:
        if point_id not in known:
            raise ConfigError(f"--only {point_id}: no such point; the suite has {', '.join(sorted(known))}")
    axes = list(dict.fromkeys(k for p in points for k in p.values))
    wanted = {}
    for key, text in parse_key_values(filters, "--filter").items():
        where = f"--filter {key}={text}"
        if key not in axes:
            raise ConfigError(f"{where}: {key} is not an axis of the suite; axes: {', '.join(axes) or 'none'}")
        wanted[key] = _axis_value(key, text, where)
        taken = list(dict.fromkeys(p.values[key] for p in points if key in p.values))
        if wanted[key] not in taken:
            raise ConfigError(f"{where}: no point has it; {key} takes {', '.join(map(cli_value, taken))}")
    chosen = [p for p in points if (not ids or p.point_id in ids)
              and all(p.values.get(k) == v for k, v in wanted.items())]
    if not chosen:
        given = " ".join([*(f"--only {i}" for i in ids), *(f"--filter {f}" for f in filters)])
        raise ConfigError(f"{given}: no point of the suite matches")
    return chosen
