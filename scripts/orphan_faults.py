"""Count the processes a killed sweep leaves behind: ``moebench run`` on a tiny 2-rank suite (the
real trainer), killed by SIGKILL, SIGHUP or SIGTERM at several moments, and a point timeout.

    python scripts/orphan_faults.py [--pythonpath DIR] [--steps N] [--wait S]

Every process of the run carries a probe variable in its environment (it is inherited by the
runner, the leader, torchrun's agent and the ranks), so survivors are counted the same way for
any version of moebench (``--pythonpath`` runs another checkout's, e.g. to see the faults before
a fix). Prints a Markdown table: case, moment, processes and ranks alive when killed, survivors
1 s and ``--wait`` seconds after the sweep ended.
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

from moebench.launch.procs import processes_with_env, stop

PROBE = "MOEBENCH_ORPHAN_PROBE"


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _is_rank(pid: int) -> bool:
    """A training rank: torchrun gave it LOCAL_RANK, and it is Python (a rank's tee inherits LOCAL_RANK too)."""
    return b"LOCAL_RANK=" in _read(pid, "environ") and b"python" in _read(pid, "cmdline").split(b"\0")[0]


def _is_leader(pid: int) -> bool:
    """The point's ``moebench train`` (not the sweep's ``moebench run``, not a rank)."""
    argv = _read(pid, "cmdline").split(b"\0")
    return b"train" in argv and b"run" not in argv and not _is_rank(pid)


def _tree(probe: str) -> tuple[list[int], list[int], list[int]]:
    """(every live process of the run, its point leaders, its ranks)."""
    pids = processes_with_env(PROBE, probe)
    return pids, [p for p in pids if _is_leader(p)], [p for p in pids if _is_rank(p)]


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
    # cwd: the temporary folder, else `python -m` would import the moebench of the current folder, not --pythonpath's;
    # its own session: a SIGHUP reaches only the runner
    sweep = subprocess.Popen(argv, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 300
    pids: list[int] = []
    ranks: list[int] = []
    while time.monotonic() < deadline and sweep.poll() is None:
        pids, leaders, ranks = _tree(probe)
        if moment == "leader starting" and leaders:
            time.sleep(1.0)  # importing torch, before any rank
            break
        if moment == "ranks starting" and len(ranks) >= 2:
            break  # importing torch, meeting at the rendezvous, building the model: nothing printed yet
        if moment == "ranks running" and len(ranks) >= 2:
            time.sleep(2.0)  # into the training steps
            break
        time.sleep(0.1)
    pids, _, ranks = _tree(probe)
    if sig is not None:
        os.kill(sweep.pid, sig)
    sweep.wait()
    ended = time.monotonic()
    time.sleep(1.0)
    soon = _tree(probe)[0]
    time.sleep(max(0.0, wait_s - (time.monotonic() - ended)))
    left = _tree(probe)[0]
    stop(left, 1.0)  # whatever the fault left, so the next case starts clean
    return {"alive": len(pids), "ranks": len(ranks), "soon": len(soon), "survivors": len(left)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pythonpath", default=os.environ.get("PYTHONPATH", ""),
                        help="PYTHONPATH of the sweep (another checkout)")
    parser.add_argument("--steps", type=int, default=400, help="training steps: the ranks must outlive each kill")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds after the sweep ended before counting")
    parser.add_argument("--timeout", type=float, default=40.0, help="point timeout of the timeout case")
    args = parser.parse_args()
    cases = [(sig, moment) for sig in (signal.SIGKILL, signal.SIGHUP, signal.SIGTERM)
             for moment in ("leader starting", "ranks starting", "ranks running")]
    print(f"| case | moment | processes alive | ranks alive | survivors after 1 s | after {args.wait:g} s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="orphans-") as tmp:
        for sig, moment in cases:
            got = run_case(Path(tmp), args.pythonpath, args.steps, sig, moment, 600, args.wait)
            print(f"| {signal.Signals(sig).name} to the sweep | {moment} | {got['alive']} | {got['ranks']} "
                  f"| {got['soon']} | {got['survivors']} |", flush=True)
        got = run_case(Path(tmp), args.pythonpath, 100_000, None, "ranks running", args.timeout, args.wait)
        print(f"| point timeout ({args.timeout:g} s) | ranks running | {got['alive']} | {got['ranks']} "
              f"| {got['soon']} | {got['survivors']} |", flush=True)


if __name__ == "__main__":
    main()
