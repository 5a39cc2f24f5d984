"""The local multi-node cluster itself (scripts/slurm-local.sh): two slurmd daemons on this
host are two Slurm nodes, and one job step spans both. Skipped, with the reason, when no
cluster with two idle nodes is up."""

from __future__ import annotations

import subprocess

import pytest
from cluster_helpers import NODES, needs_two_nodes


@pytest.mark.cluster
@needs_two_nodes
def test_one_step_runs_a_task_on_each_node():
    out = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=1",
                          "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_NODEID"'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = dict(line.split() for line in out.stdout.splitlines())  # node name -> its index in the step
    assert len(seen) == 2 and set(seen) <= set(NODES) and sorted(seen.values()) == ["0", "1"], out.stdout
