"""Sweep progress: a tqdm bar over points (with ETA), the running point's latest step and
elapsed time, and one summary line per finished point."""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from moebench.record import METRICS, dropped_share
from moebench.results.pairing import best_matches
from moebench.sweep.launch import read_tail

TICK_S = 1.0
_PER_DEVICE = METRICS["tokens_per_s_per_device"].header
# ``step    7/12  loss 4.1234  0.312s  312 tokens/s/dev``, as the trainer writes each step under --json
# (moebench.train.run.step_counter: ``warmup    3/≤50`` while it warms up)
_STEP = re.compile(r"^(step|warmup)\s+(\d+)/(≤?\d+)(?!\S)")
_RATE = re.compile(rf"([\d,]+) {re.escape(_PER_DEVICE)}\s*$")


def describe(values: dict[str, Any]) -> str:
    """``moe.num_experts=8 parallel.strategy=fsdp`` -> ``num_experts=8 strategy=fsdp``."""
    return " ".join(f"{k.rpartition('.')[2]}={'-' if v is None else v}" for k, v in values.items())


def _number(record: dict[str, Any], name: str) -> float | None:
    """A numeric field of a record; None when absent or not a number (a hand-edited store:
    ``moebench report`` and ``check`` name such a field, the status line just leaves it out)."""
    value = record.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def metric_parts(record: dict[str, Any]) -> list[str]:
    """``1,234 tokens/s/dev``, ``fp8 emulated`` where the quantized GEMMs were, ``peak 512 MiB``
    and, above 0, ``drops 10.90% of routes``, for the fields the record has.

    The rate is per device, as the report shows it, named by the metric spec; only a record
    without that field (hand-made) shows its total rate, under the total's own name.
    """
    parts = []
    peak = _number(record, "peak_mem_bytes")
    for name in ("tokens_per_s_per_device", "tokens_per_s"):
        tokens = _number(record, name)
        if tokens is not None:
            parts.append(f"{tokens:,.0f} {METRICS[name].header}")
            break
    if record.get("precision_impl") == "emulated":  # fp8 / mxfp8 speed that is not the format's
        parts.append(f"{record.get('precision')} emulated")
    if peak is not None:
        parts.append(f"peak {peak / 2**20:,.0f} MiB")
    dropped = dropped_share(record)
    if dropped:  # equal work shows nothing; a run that dropped routes says how many
        parts.append(f"drops {100 * dropped:.2f}% of routes")
    return parts


def line_width() -> int | None:
    """The columns a run line may take: the terminal's width where stdout is one (its lines are read
    there, beside the bar), else None: a file or a pipe keeps each line whole."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _fit(head: str, fields: list[tuple[str, str, int]], width: int | None) -> str:
    """``head``, a space, then the fields, two spaces apart, within ``width`` columns (None: all of it).

    Each field is ``(lead, text, rank)``; over the width, the field of lowest rank loses words from the
    end of its text first (shown by a trailing ``…``; its ``lead``, the ``|`` before an error, stays),
    then the next: a line is never cut inside a word or a number, and the columns of ``head`` are never
    cut (a terminal narrower than them wraps the line)."""
    words = [text.split(" ") for _, text, _ in fields]
    cut = [False] * len(fields)

    def line() -> str:
        parts = [" ".join([*([lead] if lead else []), *w, *(["…"] if c else [])])
                 for (lead, _, _), w, c in zip(fields, words, cut, strict=True)]
        return f"{head} {'  '.join(p for p in parts if p)}".rstrip()

    order = sorted(range(len(fields)), key=lambda i: fields[i][2])
    while width is not None and len(line()) > width:
        i = next((i for i in order if words[i]), None)
        if i is None:
            break
        words[i].pop()
        cut[i] = True
    return line()


def _columns(run: str, status: str, rate: str, ratio: str, peak: str, wall: str) -> str:
    return f"{run:<7} {status:<8} {rate:>12} {ratio:>7} {peak:>7} {wall:>6}"


# What each column of a run line holds, printed once above the lines (the numbers carry no units).
SUMMARY_HEADER = _columns("run", "status", _PER_DEVICE, "vs base", "MiB", "wall") + " axes"

# Which words of a run line go first when it is wider than the terminal: the error's (the status says the run
# failed; the log and `moebench status` keep the whole error), then the axes' (the run id names the point),
# last what qualifies its numbers (emulated precision, dropped routes, throttling).
_ERROR, _AXES, _QUALIFIER = 0, 1, 2


def summary_line(record: dict[str, Any], ratio: float | str | None = None, width: int | None = None) -> str:
    """One line per finished run, in the columns of :data:`SUMMARY_HEADER`: id (``p001``, ``p001.r2``
    for a later repeat), status, tokens/s per device, ``ratio`` (of that rate to the baseline point's:
    a number, ``base`` for the baseline itself, or None when it has not run), peak memory (MiB), wall time,
    then the axes and what qualifies the run (emulated precision, dropped routes, throttling, the error),
    within ``width`` columns (:func:`_fit`; None: whole)."""
    run_id = str(record.get("point_id", "?")) + (f".r{record['repeat']}" if record.get("repeat") else "")
    tokens = _number(record, "tokens_per_s_per_device")
    peak = _number(record, "peak_mem_bytes")
    wall = _number(record, "point_wall_s")
    rest = [("", describe(record.get("point") or {}), _AXES)]
    if record.get("precision_impl") == "emulated":  # fp8 / mxfp8 speed that is not the format's
        rest.append(("", f"{record.get('precision')} emulated", _QUALIFIER))
    dropped = dropped_share(record)
    if dropped:
        rest.append(("", f"drops {100 * dropped:.2f}% of routes", _QUALIFIER))
    if record.get("throttled"):
        rest.append(("", _throttled(record.get("nodes") or []), _QUALIFIER))
    if record.get("status") != "ok" and record.get("error"):
        rest.append(("|", str(record["error"]), _ERROR))
    head = _columns(run_id, str(record.get("status", "?")), "" if tokens is None else f"{tokens:,.0f}",
                    ratio if isinstance(ratio, str) else "" if ratio is None else
                    f"{ratio:.2f}x" if ratio < 100 else f"{ratio:,.0f}x",
                    "" if peak is None else f"{peak / 2**20:,.0f}", "" if wall is None else f"{wall:.0f}s")
    return _fit(head, [field for field in rest if field[1]], width)


def is_baseline(values: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Whether a point's axis values match the suite's baseline selector (on the axes it has)."""
    return all(values[k] == v for k, v in baseline.items() if k in values)


def baseline_of(values: dict[str, Any], candidates: list[dict[str, Any]],
                baseline: dict[str, Any]) -> dict[str, Any] | None:
    """A point's baseline among ``candidates`` (points that match the selector), by the report's own rule
    (:func:`moebench.results.pairing.best_matches`): equal on every axis outside the layout (``parallel.*``)
    and the selector, then the fewest other axes different, values compared as the report compares them
    (2 == 2.0). A zipped layout (``strategy: [fsdp, ddp]`` with ``ep: [1, 2]``) changes axes beside the
    selector's, so the baseline is not the point with the selector's values set."""
    if not candidates:
        return None
    df = pd.DataFrame([values, *candidates])
    hard = [k for k in values if not k.startswith("parallel.") and k not in baseline]
    match = best_matches(df, df.index[:1], df.index[1:], hard, list(values), loose=())
    return candidates[match[0] - 1] if 0 in match else None


def _throttled(nodes: list[dict[str, Any]]) -> str:
    """``THROTTLED``, naming the nodes whose GPUs throttled when the point spanned several."""
    hot = [str(n.get("node")) for n in nodes if n.get("throttled")]
    return f"THROTTLED on {', '.join(hot)}" if len(nodes) > 1 and hot else "THROTTLED"


def latest_step(log_text: str) -> str | None:
    """``step 7/12 312 tokens/s/dev`` (``warmup 3/≤50 ...`` while it warms up) from the last step line of a
    point's log; None before the first."""
    for line in reversed(log_text.splitlines()):
        if line.startswith("$ "):
            return None  # the command line of this attempt: what comes before is an earlier attempt's
        step = _STEP.match(line.strip())
        if step:
            rate = _RATE.search(line)
            return f"{step[1]} {step[2]}/{step[3]}" + (f" {rate[1]} {_PER_DEVICE}" if rate else "")
    return None


def point_progress(point_id: str, log_path: Path, elapsed_s: float) -> str:
    """``p003 step 7/12 312 tokens/s/dev 00:41``: what the bar shows while a point runs."""
    step = latest_step(read_tail(log_path, 2000))
    minutes, seconds = divmod(int(elapsed_s), 60)
    return " ".join([point_id, *([step] if step else []), f"{minutes:02d}:{seconds:02d}"])


class PointTicker:
    """Calls ``show(point_progress(...))`` every ``interval_s`` until stopped: the trainer writes a
    line per step to the point's log, and the bar would otherwise stand still for a whole point."""

    def __init__(self, show: Callable[[str], None], point_id: str, log_path: Path, interval_s: float = TICK_S) -> None:
        self.show, self.point_id, self.log_path, self.interval_s = show, point_id, log_path, interval_s
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.show(point_progress(self.point_id, self.log_path, time.monotonic() - self.started))
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def eta(done: int, total: int, done_s: float, now_s: float) -> str:
    """Time left for ``total`` runs, ``done`` of them finished ``done_s`` seconds into the sweep, at
    ``now_s``: the measured time a run (``done_s / done``) for each run left, less the time the running
    one has taken so far, so the estimate counts down between runs instead of standing still until the
    next one ends. A running run past the measured time a run leaves the estimate of the runs after it,
    marked ``+`` (at least that). ``?`` before a run has been measured."""
    if done <= 0 or total <= done:
        return "?" if total > done else "00:00"
    per_run = done_s / done
    later = per_run * (total - done - 1)  # the runs after the running one
    left = per_run * (total - done) - max(0.0, now_s - done_s)
    return tqdm.format_interval(left) if left >= later else tqdm.format_interval(later) + "+"


class _Bar(tqdm):
    """tqdm with :func:`eta` as its ``{eta}`` field: tqdm's own remaining time divides by the rate of its
    last updates, so between two finished points (minutes, each) it shows the same figure."""

    FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, ETA {eta}{postfix}]"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.done_s = 0.0  # seconds into the sweep when the latest run finished
        super().__init__(*args, bar_format=self.FORMAT, **kwargs)

    def update(self, n: float | None = 1) -> bool | None:
        if not self.disable:
            self.done_s = self._time() - self.start_t
        return super().update(n)

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if not self.disable:
            d["eta"] = eta(int(self.n), int(self.total or 0), self.done_s, d["elapsed"])
        return d


class Progress:
    """The bar goes to stderr (hidden when it is not a terminal); summary lines to stdout."""

    def __init__(self, total: int, enabled: bool = True, echo=None, baseline: dict[str, Any] | None = None,
                 width: Callable[[], int | None] = line_width) -> None:
        self.echo = echo
        self.width = width  # read at each line: a terminal resized mid-sweep gets lines of its new width
        self.baseline = baseline or {}  # the suite's selector: a run line gives its rate over its baseline's
        # the ok runs so far: their axis values and tokens/s per device, the latest run of each point
        self.rates: dict[str, tuple[dict[str, Any], float]] = {}
        self.headed = False
        self.bar = _Bar(total=total, unit="point", file=sys.stderr, dynamic_ncols=True,
                        disable=None if enabled else True, leave=False)
        self.ticker: PointTicker | None = None

    def started(self, point_id: str, log_path: Path) -> None:
        if self.bar.disable:
            return
        self._stop_ticker()
        self.ticker = PointTicker(lambda text: self.bar.set_postfix_str(text, refresh=True), point_id, log_path)

    def add(self, runs: int) -> None:
        """``runs`` more runs to go (timed-out runs tried again)."""
        self.bar.total = (self.bar.total or 0) + runs
        self.bar.refresh()

    def _stop_ticker(self) -> None:
        if self.ticker is not None:
            self.ticker.stop()
            self.ticker = None

    def finished(self, record: dict[str, Any], line: str | None = None) -> None:
        """One run done: its summary line (under the header, once), or ``line`` where the caller says the
        run its own way (``check --against`` names the side)."""
        self._stop_ticker()
        if line is None:
            if not self.headed:
                self.write(SUMMARY_HEADER)
            self.headed = True
            line = summary_line(record, self._ratio(record), self.width())
        self.write(line)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """``line`` to ``echo`` (stdout without one), the bar cleared while it prints and drawn again after."""
        if self.echo is not None:
            with tqdm.external_write_mode(file=sys.stderr):
                self.echo(line)
        else:
            self.bar.write(line, file=sys.stdout)

    def _ratio(self, record: dict[str, Any]) -> float | str | None:
        values = record.get("point") or {}
        tokens = _number(record, "tokens_per_s_per_device")
        if record.get("status") != "ok" or tokens is None or not any(k in values for k in self.baseline):
            return None  # no baseline axis among the point's: nothing to compare it with here
        self.rates[json.dumps(values, sort_keys=True, default=str)] = (values, tokens)
        if is_baseline(values, self.baseline):
            return "base"
        candidates = [(v, rate) for v, rate in self.rates.values() if is_baseline(v, self.baseline)]
        base = baseline_of(values, [v for v, _ in candidates], self.baseline)
        rate = next((r for v, r in candidates if v is base), None)
        return tokens / rate if rate else None

    def close(self) -> None:
        self._stop_ticker()
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
