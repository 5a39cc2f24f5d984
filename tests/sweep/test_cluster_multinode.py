"""Points across two Slurm nodes (scripts/slurm-local.sh starts them on this host): a 4-rank
FSDP point and a 4-rank DDP + row-wise EP point, run by ``--slurm --nodes 2`` (srun, one
torchrun per node, c10d rendezvous on the first node), train exactly as on one node: the same
losses, the same bytes per mesh axis, and a record naming both nodes; so does ``moebench train
--nproc 4`` in an ``salloc`` of two nodes. Skipped, with the reason, when no cluster with two
idle nodes is up."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from cluster_helpers import NODES, TWO_NODES, needs_two_nodes

from moebench.results.store import Store
from moebench.sweep.runner import SweepOptions, run_suite
from moebench.sweep.suite import parse_suite

pytestmark = [pytest.mark.slow, pytest.mark.cluster, needs_two_nodes]

FOUR_RANKS = {"preset": "tiny", "nproc": 4, "set": {
    "train.steps": 3, "train.warmup_steps": 1, "train.profile_steps": 0, "train.device": "cpu",
    "train.micro_batch_size": 4, "parallel.dp": 4}}


def _records(store_path) -> dict[str, dict]:
    records, _ = Store(store_path).read_records()
    return {r["point_id"]: r for r in records}


def test_two_node_points_match_one_node(tmp_path):
    # four ranks on one node of a 2-CPU machine is oversubscribed, as intended here
    suite = replace(parse_suite({"name": "two-node", "base": FOUR_RANKS, "timeout": 300, "zip": {
        "parallel.strategy": ["fsdp", "ddp"], "parallel.ep": [1, 4], "parallel.dispatcher": ["sync", "rowwise"]}}),
        oversubscribe=True)
    one = _records(run_suite(suite, tmp_path / "one", SweepOptions(progress=False, echo=lambda line: None)))
    two = _records(run_suite(suite, tmp_path / "two", SweepOptions(progress=False, echo=lambda line: None,
                                                                   slurm=TWO_NODES)))
    assert sorted(two) == sorted(one) == ["p000", "p001"]
    for pid, record in two.items():
        assert record["status"] == "ok", record.get("log_tail")
        # gloo reduces the same ranks in the same order over loopback either way: bit-equal
        assert record["losses"] == one[pid]["losses"], pid
        assert record["comm_bytes_per_step"] == one[pid]["comm_bytes_per_step"] != {}, pid
        nodes = record["nodes"]
        assert len(nodes) == 2 and {n["node"] for n in nodes} <= set(NODES), nodes
        assert sorted(r for n in nodes for r in n["ranks"]) == [0, 1, 2, 3]
        assert [len(n["ranks"]) for n in nodes] == [2, 2]
        assert [len(n["ranks"]) for n in one[pid]["nodes"]] == [4]

    # the same FSDP point by hand: `moebench train --nproc 4` in a two-node allocation spreads its ranks
    fsdp = next(p for p in suite.points() if p.point_id == "p000")
    out = subprocess.run(["salloc", "--nodes=2", "--time=5", sys.executable, "-m", "moebench.cli", "train",
                          *fsdp.train_args()], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["losses"] == one["p000"]["losses"]
    assert [len(n["ranks"]) for n in record["nodes"]] == [2, 2] and {n["node"] for n in record["nodes"]} <= set(NODES)
