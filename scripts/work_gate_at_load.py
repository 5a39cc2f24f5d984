"""Trials of the work gate on a loaded machine: does it catch every injected regression in a step's work,
and raise no false alarm, whatever the load?

Each trial runs a suite's first point (default ``gate-clock``, the DDP row-wise point of the commit gate)
as ``moebench train --json``, once plain and once with each ``MOEBENCH_INJECT_WORK`` kind (an extra
``.item()``, all-reduce or copy per step), every run its own process tree, beside ``--hogs`` CPU-bound
processes. Each injected run's exact work counts are compared with its trial's plain run by the gate's own
rule (:func:`moebench.report.gate.work.compare_work`), and each plain run with the previous trial's (an
A-vs-A comparison: a change there is a false alarm). One line per trial; the tally at the end:

    python scripts/work_gate_at_load.py --trials 20 --hogs 4 --out work-at-load/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from moebench.report.gate.work import compare_work
from moebench.results.table import WORK_PREFIX
from moebench.sweep.suite import load_suite
from moebench.train.trainer import INJECTED_WORK


def flat_work(record: dict[str, Any]) -> dict[str, float]:
    """The record's ``work_per_step`` as the gate reads it from a table row (``work_per_step.aten_ops`` ...)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[WORK_PREFIX + prefix] = float(value)

    walk("", record.get("work_per_step") or {})
    return out


def run(argv: list[str], inject: str | None, log: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("MOEBENCH_INJECT_WORK", None)
    if inject:
        env["MOEBENCH_INJECT_WORK"] = inject
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    log.write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.exit(f"work_gate_at_load: {' '.join(argv)} exited {done.returncode}; see {log}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=4, help="CPU-bound processes to run beside the trials")
    parser.add_argument("--suite", default="gate-clock")
    parser.add_argument("--out", type=Path, default=Path("work-at-load"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    point = load_suite(args.suite).points()[0]
    argv = [sys.executable, "-m", "moebench.cli", "train", *point.train_args(), "--json"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    caught = dict.fromkeys(INJECTED_WORK, 0)
    false_alarms, loads = 0, []
    previous: dict[str, float] | None = None
    try:
        for trial in range(args.trials):
            loads.append(os.getloadavg()[0])
            plain = flat_work(run(argv, None, args.out / f"{trial:02d}-plain.log"))
            line = [f"trial {trial:2d} load {loads[-1]:4.1f}"]
            if previous is not None:
                changes = compare_work(previous, plain)
                false_alarms += any(c.regressed for c in changes)
                line.append("A-vs-A " + ("; ".join(c.text() for c in changes) or "identical"))
            previous = plain
            for kind in INJECTED_WORK:
                changes = compare_work(plain, flat_work(run(argv, kind, args.out / f"{trial:02d}-{kind}.log")))
                caught[kind] += any(c.regressed for c in changes)
                line.append(f"{kind}: " + ("; ".join(c.text() for c in changes if c.regressed) or "MISSED"))
            print(" | ".join(line), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"{args.trials} trials beside {args.hogs} CPU-bound processes, 1-minute load {min(loads):.1f} to "
          f"{max(loads):.1f} on {os.cpu_count()} cores: " +
          ", ".join(f"{kind} caught {n} of {args.trials}" for kind, n in caught.items()) +
          f"; {false_alarms} false alarms in {args.trials - 1} A-vs-A comparisons")


if __name__ == "__main__":
    main()
