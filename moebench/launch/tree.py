"""One command as an isolated process tree: its own session, its output teed into a log, stopped
as a whole on a timeout or an interrupt, and never outliving the process that started it.

A sweep point runs through :func:`run_process` (:mod:`moebench.sweep.launch`): on timeout, failure
or an interrupted sweep its group gets SIGTERM, a grace period, then SIGKILL; a multi-rank leader
stops its ranks (which torchrun puts in sessions of their own) on that SIGTERM, and they die with it
in any case (:mod:`moebench.launch.procs`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from moebench.launch.procs import die_with_parent
from moebench.launch.share import ShareClock

GRACE_S = 10.0
POLL_S = 0.2  # how often a running point checks whether the sweep was asked to stop
LOAD_POLL_S = 1.0  # how often, at most, a running point's fair-share clock reads the load


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    last_stdout_line: str | None
    wall_s: float
    interrupted: bool = False  # stopped because the sweep was interrupted
    clock: ShareClock | None = None  # the run's fair-share clock: the load it saw, the seconds its limit counted


def kill_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group, wait up to ``grace_s`` for the leader, then SIGKILL the group."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    else:
        time.sleep(min(grace_s, 1.0))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the sweep dies (even by SIGKILL), so a point never outlives it.

    A multi-rank leader stops its ranks on that SIGTERM (moebench.launch.leader.launch_ranks).
    """
    die_with_parent(signal.SIGTERM)


def run_process(
    argv: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None, grace_s: float = GRACE_S,
    stop: threading.Event | None = None, fair_share: bool = True,
) -> Outcome:
    """Run ``argv`` in a new session, teeing stdout and stderr into ``log_path``.

    ``timeout_s`` counts fair-share seconds (:class:`moebench.launch.share.ShareClock`): on a machine
    loaded past its cores the run gets more wall time, as much more as the load takes from it
    (``fair_share=False``: plain wall seconds).

    When ``stop`` is set (the sweep was interrupted) the tree is stopped as on a timeout, with a
    shorter grace; the outcome says so and keeps whatever the process had printed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    last_line: list[str] = []  # the last non-empty stdout line
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())  # quoted, so it can be pasted to rerun the point
        lock = threading.Lock()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env, preexec_fn=_die_with_parent,
        )
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, log, lock, last_line), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, log, lock, None), daemon=True),
        ]
        for t in pumps:
            t.start()
        timed_out = interrupted = False
        clock = ShareClock(fair=fair_share).start()
        try:
            while proc.poll() is None:
                left = timeout_s - clock.tick()
                if stop is not None and stop.is_set():
                    interrupted = True
                    kill_group(proc.pid, min(grace_s, 2.0), proc)
                elif left <= 0:
                    timed_out = True
                    kill_group(proc.pid, grace_s, proc)
                else:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=min(left, POLL_S if stop is not None else LOAD_POLL_S))
        except BaseException:  # Ctrl-C to a caller without ``stop``: take the point's tree down with it
            kill_group(proc.pid, min(grace_s, 2.0), proc)
            raise
        finally:
            # ranks or helpers left behind by a finished leader are killed too: no orphans
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for t in pumps:
                t.join(timeout=5)
        clock.tick()
        if timed_out:
            log.write(f"\n[moebench] killed after its time limit of {timeout_s:g} {clock.unit} "
                      f"({clock.describe()})\n".encode())
        if interrupted:
            with contextlib.suppress(OSError):  # a full disk must not lose the record of a run that finished
                log.write(b"\n[moebench] stopped: the sweep was interrupted\n")
    return Outcome(proc.returncode, timed_out, last_line[0] if last_line else None, time.perf_counter() - started,
                   interrupted, clock)


def _pump(stream: IO[bytes], log: IO[bytes], lock: threading.Lock, last_line: list[str] | None) -> None:
    logging = True
    for raw in iter(stream.readline, b""):
        if last_line is not None and raw.strip():
            last_line[:] = [raw.decode(errors="replace").strip()]
        if not logging:
            continue
        with lock:
            try:
                log.write(raw)
            except OSError:
                # a full disk ends the log, not the point: keep reading its output, so that it does not
                # block on a full pipe and its record (the last line) still reaches the store
                logging = False
    stream.close()
