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
    python scripts/phase_clock_overhead.py --in-process --steps 300           # one process, interleaved steps

``--in-process`` builds one trainer and alternates its steps with the clock on and off (the order
swapped every pair), so the processes' own speed, which differs by more than the overhead from one
fresh process to the next, weighs on both alike: the overhead is the ratio of the two sides' median
step times minus 1, with the steps' median absolute deviation beside it (one process, no breakdown).

Run it on a quiet machine: on a loaded one the rounds' spread is larger than the overhead it
measures (docs/report.md, "What the phase clock costs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
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


def in_process(preset: str, steps: int, sets: list[str]) -> dict:
    """One trainer, ``steps`` pairs of steps with the step clock on and off, interleaved (see above)."""
    import torch

    from moebench.presets import load_config
    from moebench.train.run import build_strategy, compute_dtype
    from moebench.train.trainer import Trainer

    cfg = load_config(preset, sets)
    device = torch.device("cpu")
    precision = cfg.precision.resolved_mode(on_gpu=False)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, build_strategy(cfg, device, None, precision), device, compute_dtype(precision))
    times: dict[bool, list[float]] = {True: [], False: []}
    load = _load()
    for i in range(10 + steps):
        for clock in ((True, False) if i % 2 == 0 else (False, True)):
            cfg.train.phase_clock = clock
            started = time.perf_counter()
            trainer.train_step(i)
            if i >= 10:  # the first ten pairs warm up
                times[clock].append(time.perf_counter() - started)
    on, off = statistics.median(times[True]), statistics.median(times[False])

    def mad(xs: list[float]) -> float:
        m = statistics.median(xs)
        return statistics.median(abs(x - m) for x in xs)

    return {"overhead": on / off - 1, "on_s": on, "off_s": off, "on_mad_s": mad(times[True]),
            "off_mad_s": mad(times[False]), "steps": steps, "preset": preset, "set": sets,
            "load": [load, _load()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", dest="as_json", action="store_true", help="print every run's figures as JSON")
    parser.add_argument("--in-process", action="store_true",
                        help="one process, --steps pairs of steps with the clock on and off, interleaved")
    args = parser.parse_args(argv)
    if args.in_process:
        got = in_process(args.preset, args.steps, args.sets)
        print(json.dumps(got, indent=1) if args.as_json else
              f"overhead {got['overhead']:+.2%}: clock on {got['on_s'] * 1e3:.3f} ms "
              f"(MAD {got['on_mad_s'] * 1e3:.3f}), "
              f"off {got['off_s'] * 1e3:.3f} ms (MAD {got['off_mad_s'] * 1e3:.3f}), median of {args.steps} steps "
              f"each, interleaved in one process; load {got['load'][0]} -> {got['load'][1]}")
        return 0
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
