"""Measure ``moebench check --against`` on this machine: its false alarms and its power.

Runs rounds of trials, each trial a full ``moebench check --against REV SUITE``, optionally beside
``--hogs N`` CPU-bound processes:

- A vs A: REV is HEAD and the working tree is HEAD's code, so nothing changed and the gate
  must pass;
- slowdown (one trial per fraction of ``--slowdown``): the same, with ``MOEBENCH_INJECT_SLOWDOWN=FRACTION``
  set for the working tree's runs only (each step does that fraction of its compute time again as real
  work on the host: small matmuls, not a sleep; counted in the first two steps, then a fixed number a
  step), so the gate must fail. Figures in docs/report.md taken
  before this say they were measured with the earlier sleep, or simulated (--simulate: recorded steps
  scaled afterwards).

Both stores of every trial are kept, and each trial is judged again at several thresholds
with the same gate (:func:`moebench.report.gate.against.gate`), so one measurement says which
threshold is safe here. Run from a clean checkout (the working tree must be HEAD):

    python scripts/gate_power.py --trials 5 --out gate-power/
    python scripts/gate_power.py --trials 20 --slowdown 0.1,0.25 --hogs 4 --suite gate-clock --out at-load/
    python scripts/gate_power.py --trials 4 --slowdown 0.05 --suite gate-instructions \
        --metric tokens_per_ginstruction:-2% --out instr/  # valgrind; CI's rule
    python scripts/gate_power.py --out gate-power/ --judge-only   # judge the kept stores again
    python scripts/gate_power.py --out gate-power/ --simulate 0.3,0.7  # slowdowns applied to A-vs-A stores

Each trial is judged on raw and reference-normalised throughput, at several thresholds, with
an inconclusive comparison counted red (``fail``) or not (``warn``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moebench.report.gate.against import gate
from moebench.report.gate.check import parse_metric

THRESHOLDS = (5, 10, 15, 20, 30, 40)
# The raw throughput, the one normalised by the reference GEMM each process times around its timed
# window (record.tokens_per_reference_gflop), and tokens per CPU-second (the CPU clock, which waiting
# for a core does not move), and tokens per billion instructions (the gate-instructions suite: callgrind's
# count, which neither moves): the gate should use another than the first only if it does better here.
METRICS = ("tokens_per_s", "tokens_per_reference_gflop", "tokens_per_cpu_s", "tokens_per_ginstruction")
# What a red build is: "fail" counts an inconclusive comparison as red (check's default),
# "warn" only a regression the interval confirms (check --on-inconclusive warn).
POLICIES = ("fail", "warn")


def run_trial(out: Path, rev: str, suite: str, slowdown: float | None, rules: list[str]) -> tuple[float, int]:
    """(seconds, exit code) of one ``check --against``: its own verdict, timeouts and exact work counts included."""
    # as CI runs it (scripts/test.sh): an inconclusive comparison warns, and CI's metric rules, so the exit
    # code is CI's verdict
    argv = [sys.executable, "-m", "moebench.cli", "check", "--against", rev, suite, "--keep", str(out),
            "--format", "json", "--on-inconclusive", "warn", *(a for rule in rules for a in ("--metric", rule))]
    if slowdown is not None:
        argv += ["--current-env", f"MOEBENCH_INJECT_SLOWDOWN={slowdown}"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        sys.exit(f"gate_power: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return time.perf_counter() - started, done.returncode


def judge(out: Path, metric: str, threshold: float, policy: str) -> tuple[bool, list[str]]:
    """(the gate fails, one 'point change [ci] category' per point) at ``METRIC:-threshold%``.

    The gate fails as CI would see it under ``policy`` (see :data:`POLICIES`).
    """
    rule = parse_metric(f"{metric}:-{threshold:g}%")
    comparison, _ = gate(out / "baseline", out / "current", [rule], alpha=0.05, min_samples=5)
    changes = []
    for p in comparison.points:
        m = p.metrics[0] if p.metrics else None
        if m is None or m.change is None:
            changes.append(f"{p.label} {p.category}")
            continue
        ci = f" [{100 * (m.ci_low - 1):+.0f}%, {100 * (m.ci_high - 1):+.0f}%]" if m.ci_low is not None else ""
        changes.append(f"{p.label} {100 * m.change:+.1f}%{ci} {p.category}")
    return comparison.exit_code(on_inconclusive=policy) != 0, changes


def judge_all(out: Path, rules: list[str] = ()) -> dict[str, bool]:
    """Every (metric, threshold, policy) verdict of one trial, keyed ``metric:-T%/policy``: each of
    :data:`METRICS` at each of :data:`THRESHOLDS`, and each ``--metric`` rule at its own threshold."""
    pairs = [(m, t) for m in METRICS for t in THRESHOLDS] + [rule_pair(r) for r in rules]
    return {f"{m}:-{t:g}%/{p}": judge(out, m, t, p)[0] for m, t in dict.fromkeys(pairs) for p in POLICIES}


def rule_pair(rule: str) -> tuple[str, float]:
    """(metric, threshold %) of a ``--metric`` rule such as ``tokens_per_ginstruction:-2%``, as check parses it."""
    parsed = parse_metric(rule)
    return parsed.name, 100 * parsed.threshold


# the record fields a slowdown scales: step times up by (1 + s), rates down by it
STEP_TIMES = ("step_time_median_s",)
RATES = ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "tokens_per_reference_gflop")


def slowed_copy(store: Path, slowdown: float, into: Path) -> Path:
    """``store`` with every step of every record ``1 + slowdown`` times as long: what
    ``MOEBENCH_INJECT_SLOWDOWN`` does to a run (each step sleeps that share of its compute time),
    applied to a run that was measured without it."""
    shutil.copytree(store, into, ignore=shutil.ignore_patterns(".lock", "logs"))
    records = []
    for line in (store / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        r["step_times_s"] = [t * (1 + slowdown) for t in r.get("step_times_s") or []]
        for key in STEP_TIMES:
            if isinstance(r.get(key), int | float):
                r[key] *= 1 + slowdown
        for key in RATES:
            if isinstance(r.get(key), int | float):
                r[key] /= 1 + slowdown
        records.append(json.dumps(r))
    (into / "records.jsonl").write_text("\n".join(records) + "\n")
    return into


def simulate(trials: list[dict], slowdowns: list[float]) -> None:
    """Judge every A-vs-A trial again with its current side slowed after the fact: the detection
    rate at each slowdown, from the same noise the false-alarm count saw."""
    aa = [x for x in trials if x["kind"] == "A vs A"]
    for slowdown in slowdowns:
        caught: dict[str, int] = {}
        for x in aa:
            with tempfile.TemporaryDirectory() as tmp:
                trial = Path(tmp)
                shutil.copytree(Path(x["store"]) / "baseline", trial / "baseline",
                                ignore=shutil.ignore_patterns(".lock", "logs"))
                slowed_copy(Path(x["store"]) / "current", slowdown, trial / "current")
                for key, red in judge_all(trial).items():
                    caught[key] = caught.get(key, 0) + red
        drop = 100 * (1 - 1 / (1 + slowdown))
        for key, n in caught.items():
            print(f"{key:<44} simulated slowdown {slowdown:g} ({drop:.0f}% fewer tokens/s): "
                  f"{n:2d} of {len(aa)} A-vs-A trials caught")


def summarise(trials: list[dict]) -> None:
    aa = [x for x in trials if x["kind"] == "A vs A"]
    kinds = sorted({x["kind"] for x in trials} - {"A vs A"})
    for key in trials[0]["fails"]:
        caught = ", ".join(f"{sum(x['fails'][key] for x in trials if x['kind'] == kind):2d} of "
                           f"{sum(x['kind'] == kind for x in trials)} {kind} caught" for kind in kinds)
        print(f"{key:<44} {sum(x['fails'][key] for x in aa):2d} false alarms in {len(aa)} A-vs-A trials" +
              (f", {caught}" if caught else ""))
    exits = [x for x in aa if "rc" in x]
    if exits:
        print(f"check --against itself (its own rule, timeouts and work counts): exit 1 in "
              f"{sum(x['rc'] == 1 for x in exits)} of {len(exits)} A-vs-A trials")
    loads = [x[k] for x in trials for k in ("load_before", "load_after")]
    print(f"1-minute load average at the trials' starts and ends: {min(loads):.1f} to {max(loads):.1f} "
          f"on {os.cpu_count()} cores")


def co_tenants(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (a pure-Python loop each) that load the machine beside the trials."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="rounds: each an A-vs-A trial and one per slowdown")
    parser.add_argument("--slowdown", default="0.3", metavar="FRACTIONS",
                        help="injected slowdowns, comma-separated: each round runs a trial of each")
    parser.add_argument("--no-aa", action="store_true",
                        help="rounds of slowdown trials only (the A-vs-A ones of earlier rounds in --out stay counted)")
    parser.add_argument("--hogs", type=int, default=0, help="CPU-bound processes to run beside the trials")
    parser.add_argument("--suite", default="check-against")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--metric", action="append", default=[], metavar="RULE",
                        help="a metric rule check gets, as CI passes it (e.g. tokens_per_ginstruction:-2%%, "
                             "repeatable); the trials are also judged on it, and the first is the one printed")
    parser.add_argument("--out", type=Path, default=Path("gate-power"))
    parser.add_argument("--judge-only", action="store_true",
                        help="judge the stores a previous call kept in --out again, running nothing")
    parser.add_argument("--simulate", default=None, metavar="FRACTIONS",
                        help="judge the kept A-vs-A stores with these slowdowns (comma-separated) applied "
                             "to their current side after the fact, running nothing")
    args = parser.parse_args()
    summary = args.out / "summary.json"
    if args.simulate:
        simulate(json.loads(summary.read_text()), [float(f) for f in args.simulate.split(",")])
        return
    if args.judge_only:
        trials = json.loads(summary.read_text())
        for x in trials:
            x["fails"] = judge_all(Path(x["store"]), args.metric)
        summary.write_text(json.dumps(trials, indent=2))
        summarise(trials)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    trials = json.loads(summary.read_text()) if summary.exists() else []  # a later call adds rounds
    kinds = [] if args.no_aa else [("A vs A", None)]
    kinds += [(f"slowdown {float(f):g}", float(f)) for f in args.slowdown.split(",")]
    hogs = co_tenants(args.hogs)
    try:
        for i in range(len(trials), len(trials) + args.trials * len(kinds), len(kinds)):
            for j, (kind, slowdown) in enumerate(kinds):
                out = args.out / f"{i + j:03d}-{'aa' if slowdown is None else f'slow{slowdown:g}'}"
                load_before = os.getloadavg()[0]
                wall, rc = run_trial(out, args.rev, args.suite, slowdown, args.metric)
                metric, threshold = rule_pair(args.metric[0]) if args.metric else (METRICS[0], THRESHOLDS[0])
                _, points = judge(out, metric, threshold, POLICIES[0])
                fails = judge_all(out, args.metric)
                trials.append({"kind": kind, "store": str(out), "wall_s": round(wall, 1), "hogs": args.hogs, "rc": rc,
                               "load_before": load_before, "load_after": os.getloadavg()[0],
                               "fails": fails, "points": points})
                shown = [threshold] if args.metric else THRESHOLDS
                print(f"{kind:<14} {wall:5.0f}s load {load_before:.1f}  exit {rc}  red ({metric}, fail/warn) at " +
                      " ".join(f"-{t:g}%:{'y' if fails[f'{metric}:-{t:g}%/fail'] else 'n'}"
                               f"{'y' if fails[f'{metric}:-{t:g}%/warn'] else 'n'}" for t in shown) +
                      "  | " + "; ".join(points), flush=True)
                summary.write_text(json.dumps(trials, indent=2))  # after every trial: an interrupted run loses none
    finally:
        for hog in hogs:
            hog.kill()
    print()
    summarise(trials)


if __name__ == "__main__":
    main()
