"""Time limits that a busy machine cannot trip: seconds of a fair share of the CPUs, not of the wall.

A run that takes 60 s on a quiet 2-core machine takes about 60 x L / 2 s of wall time when the
load average is L > 2: every runnable process gets its share of the cores. A wall-clock limit set
on a quiet machine therefore turns into a failure on a loaded one, although nothing about the run
changed. :class:`ShareClock` counts a run's time the way the run experiences it: each wall second
counts as ``min(1, cores / load)`` seconds, read from the 1-minute load average at every tick,
so a load spike in the middle of a run stretches its limit while it lasts.

The stretch is capped (:data:`MAX_STRETCH`): a run that hangs still ends, at most that many times
its limit in wall time, however busy the machine is. The load average includes the run's own
processes, so a run that keeps both cores busy on a 2-core machine reads load 2: its share is 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# A limit of 90 s ends a run after at most 90 x 20 s = 30 min of wall time, whatever the load.
MAX_STRETCH = 20.0


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cores() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def share(load: float | None, n_cores: int) -> float:
    """The fraction of a core's second that one wall second gives a runnable process at ``load``."""
    if load is None or load <= n_cores:
        return 1.0
    return max(n_cores / load, 1.0 / MAX_STRETCH)


@dataclass
class ShareClock:
    """Fair-share seconds since :meth:`start`, advanced by :meth:`tick` (call it at least every second or two:
    each interval is weighted by the load read at its end)."""

    n_cores: int = field(default_factory=cores)
    # False: count wall seconds (a Slurm task: its allocation is its own, and Slurm's own --time is a wall limit)
    fair: bool = True
    elapsed: float = 0.0  # fair-share seconds so far (wall seconds when not ``fair``)
    wall: float = 0.0
    load_start: float | None = None
    _load_seconds: float = 0.0  # load x wall seconds, over the ticks that read a load
    _loaded_wall: float = 0.0
    _last: float = 0.0

    def start(self) -> ShareClock:
        self._last = time.monotonic()
        self.load_start = load_average()
        return self

    def tick(self) -> float:
        """Advance the clock to now; returns the fair-share seconds elapsed so far."""
        now = time.monotonic()
        load = load_average()
        dt, self._last = now - self._last, now
        if load is not None:
            self._load_seconds += load * dt
            self._loaded_wall += dt
        self.wall += dt
        self.elapsed += dt * (share(load, self.n_cores) if self.fair else 1.0)
        return self.elapsed

    @property
    def load_mean(self) -> float | None:
        """The load average the run saw, weighted by time (the start's reading before any tick; None: none)."""
        return self._load_seconds / self._loaded_wall if self._loaded_wall > 0 else self.load_start

    @property
    def unit(self) -> str:
        """What the limit counted: ``s of a fair share of the machine`` or ``s of wall time``."""
        return "s of a fair share of the machine" if self.fair else "s of wall time"

    def describe(self) -> str:
        """``412 s of wall time at load 9.2 on 2 cores`` (the load part only when there was one)."""
        load = self.load_mean
        where = f" at load {load:.1f} on {self.n_cores} cores" if load is not None else ""
        return f"{self.wall:.0f} s of wall time{where}"
