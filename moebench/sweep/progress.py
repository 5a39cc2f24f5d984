"""Sweep progress: a tqdm bar over points (with ETA) and one summary line per finished point."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from moebench.record import METRICS


def describe(values: dict[str, Any]) -> str:
    """``moe.num_experts=8 parallel.strategy=fsdp`` -> ``num_experts=8 strategy=fsdp``."""
    return " ".join(f"{k.rpartition('.')[2]}={'-' if v is None else v}" for k, v in values.items())


def _number(record: dict[str, Any], name: str) -> float | None:
    """A numeric field of a record; None when absent or not a number (a hand-edited store:
    ``moebench report`` and ``check`` name such a field, the status line just leaves it out)."""
    value = record.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def metric_parts(record: dict[str, Any]) -> list[str]:
    """``12,345 tok/s`` and ``peak 512 MiB``, for the fields the record has."""
    parts = []
    tokens, peak = _number(record, "tokens_per_s"), _number(record, "peak_mem_bytes")
    if tokens is not None:
        parts.append(f"{tokens:,.0f} {METRICS['tokens_per_s'].header}")
    if peak is not None:
        parts.append(f"peak {peak / 2**20:,.0f} MiB")
    return parts


def summary_line(record: dict[str, Any]) -> str:
    """One line per finished point: id, status, axes, tokens/s, peak memory, wall time."""
    parts = [f"{record.get('point_id', '?'):<5}{record.get('status', '?'):<7}"]
    parts.append(describe(record.get("point") or {}))
    parts += metric_parts(record)
    if record.get("throttled"):
        parts.append("THROTTLED")
    wall = _number(record, "point_wall_s")
    if wall is not None:
        parts.append(f"{wall:.1f}s")
    if record.get("status") != "ok" and record.get("error"):
        parts.append(f"| {record['error'][:160]}")
    return "  ".join(parts)


class Progress:
    """The bar goes to stderr (hidden when it is not a terminal); summary lines to stdout."""

    def __init__(self, total: int, enabled: bool = True, echo=None) -> None:
        self.echo = echo
        self.bar = tqdm(total=total, unit="point", file=sys.stderr, dynamic_ncols=True,
                        disable=None if enabled else True, leave=False)

    def started(self, point_id: str, values: dict[str, Any]) -> None:
        self.bar.set_postfix_str(f"{point_id} {describe(values)}", refresh=True)

    def finished(self, record: dict[str, Any]) -> None:
        line = summary_line(record)
        if self.echo is not None:
            with tqdm.external_write_mode(file=sys.stderr):  # clear the bar, print, redraw it
                self.echo(line)
        else:
            self.bar.write(line, file=sys.stdout)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
