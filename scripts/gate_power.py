"""Measure ``moebench check --against`` on this machine: its false alarms and its power.

Alternates two kinds of trial, each a full ``moebench check --against REV SUITE``:

- A vs A: REV is HEAD and the working tree is HEAD's code, so nothing changed and the gate
  must pass;
- slowdown: the same, with ``MOEBENCH_INJECT_SLOWDOWN=FRACTION`` set for the working tree's
  runs only (each step sleeps that fraction of its compute time), so the gate must fail.

Both stores of every trial are kept, and each trial is judged again at several thresholds
with the same gate (:func:`moebench.report.gate.against.gate`), so one measurement says which
threshold is safe here. Run from a clean checkout (the working tree must be HEAD):

    python scripts/gate_power.py --trials 5 --out gate-power/
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from moebench.report.gate.against import gate
from moebench.report.gate.check import parse_metric

THRESHOLDS = (5, 10, 15, 20)


def run_trial(out: Path, rev: str, suite: str, slowdown: float | None) -> float:
    argv = [sys.executable, "-m", "moebench.cli", "check", "--against", rev, suite, "--keep", str(out),
            "--format", "json"]
    if slowdown is not None:
        argv += ["--current-env", f"MOEBENCH_INJECT_SLOWDOWN={slowdown}"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        sys.exit(f"gate_power: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return time.perf_counter() - started


def judge(out: Path, threshold: int) -> tuple[bool, list[str]]:
    """(gate fails, one 'point change [ci] category' per point) at ``tokens_per_s:-threshold%``.

    The gate fails as CI would see it: a regression, or an inconclusive change (the default
    ``--on-inconclusive fail``), is a red build.
    """
    rule = parse_metric(f"tokens_per_s:-{threshold}%")
    comparison, _ = gate(out / "baseline", out / "current", [rule], alpha=0.05, min_samples=5)
    changes = []
    for p in comparison.points:
        m = p.metrics[0] if p.metrics else None
        if m is None or m.change is None:
            changes.append(f"{p.label} {p.category}")
            continue
        ci = f" [{100 * (m.ci_low - 1):+.0f}%, {100 * (m.ci_high - 1):+.0f}%]" if m.ci_low is not None else ""
        changes.append(f"{p.label} {100 * m.change:+.1f}%{ci} {p.category}")
    return comparison.exit_code() != 0, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials of each kind")
    parser.add_argument("--slowdown", type=float, default=0.3)
    parser.add_argument("--suite", default="check-against")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", type=Path, default=Path("gate-power"))
    args = parser.parse_args()
    trials = []
    for i in range(args.trials):
        for kind, slowdown in (("A vs A", None), (f"slowdown {args.slowdown:g}", args.slowdown)):
            out = args.out / f"{i:02d}-{'aa' if slowdown is None else 'slow'}"
            wall = run_trial(out, args.rev, args.suite, slowdown)
            verdicts = {t: judge(out, t) for t in THRESHOLDS}
            trials.append({"kind": kind, "store": str(out), "wall_s": round(wall, 1),
                           "fails": {t: v[0] for t, v in verdicts.items()}, "points": verdicts[THRESHOLDS[0]][1]})
            print(f"{kind:<14} {wall:5.0f}s  fails at " +
                  " ".join(f"-{t}%:{'yes' if v[0] else 'no '}" for t, v in verdicts.items()) +
                  "  | " + "; ".join(verdicts[THRESHOLDS[0]][1]), flush=True)
    print()
    for t in THRESHOLDS:
        aa = [x for x in trials if x["kind"] == "A vs A"]
        slow = [x for x in trials if x["kind"] != "A vs A"]
        print(f"tokens_per_s:-{t}%: {sum(x['fails'][t] for x in aa)} false alarms in {len(aa)} A-vs-A trials, "
              f"{sum(x['fails'][t] for x in slow)} of {len(slow)} slowdowns caught")
    (args.out / "summary.json").write_text(json.dumps(trials, indent=2))


if __name__ == "__main__":
    main()
