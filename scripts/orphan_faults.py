"""Count the processes a killed sweep leaves behind: ``moebench run`` on a tiny 2-rank suite (the
real trainer), killed by SIGKILL, SIGHUP or SIGTERM at several moments, and a point timeout.

    python scripts/orphan_faults.py [--pythonpath DIR] [--steps N] [--wait S]

Every process of the run carries a probe variable in its environment (it is inherited by the
runner, the leader, torchrun's agent and the ranks), so survivors are counted the same way for
any version of moebench (``--pythonpath`` runs another checkout's, e.g. to see the faults before
a fix). Prints a Markdown table: case, moment, processes and ranks alive when killed, survivors
after ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from moebench.train.procs import processes_with_env, stop

PROBE = "MOEBENCH_ORPHAN_PROBE"


def _is_rank(pid: int) -> bool:
    try:
        return b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _tree(probe: str) -> tuple[list[int], list[int]]:
    """(every live process of the run, those of them that are ranks)."""
    pids = processes_with_env(PROBE, probe)
    return pids, [p for p in pids if _is_rank(p)]


def run_case(folder: Path, pythonpath: str, steps: int, sig: int | None, moment: str, timeout_s: float,
             wait_s: float) -> dict[str, object]:
    probe = uuid.uuid4().hex
    suite = folder / f"{probe}.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "orphans", "timeout": timeout_s,
        "base": {"preset": "tiny", "set": {"train.steps": steps, "train.warmup_steps": 1, "train.device": "cpu",
                                           "parallel.dp": 2, "parallel.ep": 2, "parallel.dispatcher": "rowwise"}},
    }))
    env = {**os.environ, PROBE: probe, "PYTHONPATH": pythonpath}
    argv = [sys.executable, "-m", "moebench.cli", "run", str(suite), "--out", str(folder / probe), "--no-progress"]
    sweep = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # its own session: a SIGHUP reaches only the runner
    deadline = time.monotonic() + 300
    pids: list[int] = []
    ranks: list[int] = []
    while time.monotonic() < deadline and sweep.poll() is None:
        pids, ranks = _tree(probe)
        if moment == "leader starting" and len(pids) >= 1:
            time.sleep(1.0)
            break
        if moment == "ranks running" and len(ranks) >= 2:
            time.sleep(2.0)  # into the training steps
            break
        time.sleep(0.1)
    pids, ranks = _tree(probe)
    if sig is not None:
        os.kill(sweep.pid, sig)
    sweep.wait()
    time.sleep(wait_s)
    left, _ = _tree(probe)
    stop(left, 1.0)  # whatever the fault left, so the next case starts clean
    return {"alive": len(pids), "ranks": len(ranks), "survivors": len(left)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythonpath", default=os.environ.get("PYTHONPATH", ""),
                        help="PYTHONPATH of the sweep (another checkout)")
    parser.add_argument("--steps", type=int, default=400, help="training steps: the ranks must outlive each kill")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds after the sweep ended before counting")
    parser.add_argument("--timeout", type=float, default=40.0, help="point timeout of the timeout case")
    args = parser.parse_args()
    cases = [(sig, moment) for sig in (signal.SIGKILL, signal.SIGHUP, signal.SIGTERM)
             for moment in ("leader starting", "ranks running")]
    print(f"| case | moment | processes alive | ranks alive | survivors after {args.wait:g} s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="orphans-") as tmp:
        for sig, moment in cases:
            got = run_case(Path(tmp), args.pythonpath, args.steps, sig, moment, 600, args.wait)
            print(f"| {signal.Signals(sig).name} to the sweep | {moment} | {got['alive']} | {got['ranks']} "
                  f"| {got['survivors']} |", flush=True)
        got = run_case(Path(tmp), args.pythonpath, 100_000, None, "ranks running", args.timeout, args.wait)
        print(f"| point timeout ({args.timeout:g} s) | ranks running | {got['alive']} | {got['ranks']} "
              f"| {got['survivors']} |", flush=True)


if __name__ == "__main__":
    main()
