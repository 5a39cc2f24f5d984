"""What the two-node Slurm tests share: the idle nodes found at import, the skip when there are
fewer than two (scripts/slurm-local.sh starts them on this host), and the sweep options."""

from __future__ import annotations

import pytest

from moebench.sweep.slurm import SlurmOptions, idle_nodes

NODES = idle_nodes()
needs_two_nodes = pytest.mark.skipif(
    NODES is None or len(NODES) < 2,
    reason=f"needs a Slurm cluster with 2 idle nodes (scripts/slurm-local.sh starts one); found {NODES}")
TWO_NODES = SlurmOptions(nodes=2, poll_s=1.0, cpus_per_task=1, time="10")
