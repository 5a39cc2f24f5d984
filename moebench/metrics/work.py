"""Exact work counts of one training step: what a step does, counted, not timed.

Clocks on a shared machine move with its load; counts do not. One step, the run's first (step 0,
a warm-up step: untimed), runs with counters on, and the record keeps what it did
(``work_per_step``):

- ``aten_ops``: ATen operators dispatched on this rank (a :class:`~torch.utils._python_dispatch.
  TorchDispatchMode` sees each one, forward and backward, the optimizer's too);
- ``host_syncs``: Python-level calls that waited on the device (:mod:`moebench.metrics.host_syncs`);
- ``collective_calls`` / ``collective_bytes``: every collective, per mesh axis, from the comm counter.

Step 0 starts from the seeded initial weights and the first batch, so two runs of the same code
route the same tokens and count the same work, whatever the machine was doing and however long
their adaptive warm-ups ran: an A-vs-A comparison is identical by construction. ``moebench
check`` compares the counts exactly (:mod:`moebench.report.gate.work`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from moebench.metrics.host_syncs import CountHostSyncs


class CountOps(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it (``total``)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        return func(*args, **(kwargs or {}))


@dataclass
class WorkCount:
    """What :func:`counting_work` saw; :meth:`fields` is the record's ``work_per_step``."""

    aten_ops: int = 0
    host_syncs: int = 0
    collective_calls: dict[str, int] = field(default_factory=dict)
    collective_bytes: dict[str, float] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {"aten_ops": self.aten_ops, "host_syncs": self.host_syncs,
                "collective_calls": dict(sorted(self.collective_calls.items())),
                "collective_bytes": dict(sorted(self.collective_bytes.items()))}


@contextlib.contextmanager
def counting_work(comm: Any) -> Iterator[WorkCount]:
    """Count the work of the code inside: ATen ops and host syncs here, collectives through ``comm`` (a
    :class:`moebench.parallel.comm.CommCounter` that the caller resets before the step)."""
    work = WorkCount()
    with CountHostSyncs() as syncs, CountOps() as ops:
        yield work
    work.aten_ops, work.host_syncs = ops.total, syncs.total
    work.collective_calls = {axis: int(n) for axis, n in comm.calls.items()}
    work.collective_bytes = {axis: float(b) for axis, b in comm.bytes.items()}
