"""What the phase clock of the timed steps costs, and whether its breakdown adds up to the timed step.

Each round runs the same point twice, each a fresh ``moebench train --json`` process, once with
``train.phase_clock=true`` and once with ``false``, the order alternating from round to round (so a
machine that speeds up or slows down over the rounds weighs on both alike). The overhead is the
median over the rounds of each round's ratio of timed medians (clock on / clock off) minus 1; the
range of the ratios says how far one round can be trusted. Beside it, from the runs with the clock:
the phases' step (``breakdown_step_s``) over the timed median (``step_time_median_s``), and the load
average at each run's start (``/proc/loadavg``, 1 minute).

    python scripts/phase_clock_overhead.py --rounds 5                        # one process, tiny
    python scripts/phase_clock_overhead.py --rounds 5 --nproc 2 \\
        --set parallel.strategy=fsdp --set parallel.dp=2                      # a layout

Run it on a quiet machine: on a loaded one the rounds' spread is larger than the overhead it
measures (docs/report.md, "What the phase clock costs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _load() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def train(preset: str, steps: int, nproc: int, sets: list[str], clock: bool) -> dict:
    """One ``moebench train`` run in its own process; its record."""
    cmd = [sys.executable, "-m", "moebench.cli", "train", "--preset", preset, "--steps", str(steps), "--json",
           "--set", f"train.phase_clock={str(clock).lower()}", "--set", "train.trace=false"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--oversubscribe"]
    for item in sets:
        cmd += ["--set", item]
    load = _load()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads(done.stdout)
    record["load_at_start"] = load
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", dest="as_json", action="store_true", help="print every run's figures as JSON")
    args = parser.parse_args(argv)
    ratios, sums, rows = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {clock: train(args.preset, args.steps, args.nproc, args.sets, clock) for clock in order}
        on, off = got[True], got[False]
        ratio = on["step_time_median_s"] / off["step_time_median_s"]
        step_sum = on["breakdown_step_s"] / on["step_time_median_s"]
        ratios.append(ratio)
        sums.append(step_sum)
        rows.append({"round": r + 1, "on_s": on["step_time_median_s"], "off_s": off["step_time_median_s"],
                     "ratio": ratio, "breakdown_over_timed": step_sum,
                     "load": [on["load_at_start"], off["load_at_start"]]})
        print(f"round {r + 1}: clock on {on['step_time_median_s'] * 1e3:.2f} ms, off "
              f"{off['step_time_median_s'] * 1e3:.2f} ms, on/off {ratio:.4f}; breakdown step / timed median "
              f"{step_sum:.4f}; load {on['load_at_start']} / {off['load_at_start']}", file=sys.stderr)
    summary = {"overhead": statistics.median(ratios) - 1, "ratio_min": min(ratios), "ratio_max": max(ratios),
               "breakdown_over_timed_min": min(sums), "breakdown_over_timed_max": max(sums),
               "rounds": rows, "preset": args.preset, "steps": args.steps, "nproc": args.nproc, "set": args.sets}
    if args.as_json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"overhead {summary['overhead']:+.2%} (median of {args.rounds} rounds; on/off "
              f"{min(ratios):.4f}-{max(ratios):.4f}); breakdown step / timed median {min(sums):.4f}-{max(sums):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
