"""One Slurm array task: run one repeat of one point of a store's plan and leave its record in pending/.

``python -m moebench.sweep.worker STORE RUN_ID`` (``p003``, or ``p003.r1`` for its repeat 1; written into the
sbatch script by :mod:`moebench.sweep.slurm`). Single-node points run ``moebench train`` exactly as a local
sweep does. Multi-node points run ``srun torchrun`` with a c10d rendezvous on the first
node of the allocation, one torchrun per node, ``nproc / nodes`` ranks each
(:mod:`moebench.launch.multinode`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moebench.errors import MoebenchError, StoreError
from moebench.launch.multinode import rank_threads, rendezvous_host, srun_torchrun
from moebench.results.store import Store
from moebench.sweep.launch import point_env, run_point
from moebench.sweep.slurm import ranks_per_node, task_recorded, write_pending
from moebench.sweep.status import POINTS_FILE, read_plan
from moebench.sweep.suite import Point


def multinode_argv(point: Point, nodes: int, head: str, job_id: str) -> list[str]:
    """``srun`` one torchrun per node; the ranks meet at ``head`` (c10d rendezvous)."""
    per_node = ranks_per_node(point, nodes)
    args = point.train_args()
    if "--nproc" in args:  # torchrun launches the ranks here, not `moebench train --nproc`
        i = args.index("--nproc")
        del args[i:i + 2]
    return srun_torchrun(nodes, per_node, head, job_id, ["train", *args])


def run_task(store_path: str, run_id: str) -> Path | None:
    """Run the point's repeat ``run_id`` names and leave its record in pending/; None when this task
    has a record already (Slurm requeued it after it finished: running it again would record it twice)."""
    store = Store(store_path)
    point_id, _, repeat = run_id.partition(".r")
    if repeat and not repeat.isdigit():
        raise StoreError(f"{run_id!r}: expected a point id (p003) or a run id (p003.r1)")
    match = [d for d in read_plan(store) if d["point_id"] == point_id]
    if not match:
        raise StoreError(f"{store.path}: no point {point_id!r} in {POINTS_FILE}")
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
    if job_id is not None and task_id is not None and task_recorded(store, job_id, task_id):
        return None
    repeats = int(store.read_meta().get("repeats") or 1)
    point = Point.from_dict(match[0]).at_repeat(int(repeat or 0), max(repeats, int(repeat or 0) + 1))
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    launcher = None
    env = point_env(store)
    if nodes > 1:
        head = rendezvous_host(os.environ["SLURM_JOB_NODELIST"])
        job = os.environ.get("SLURM_JOB_ID", "0")
        launcher = lambda p: multinode_argv(p, nodes, head, job)  # noqa: E731
        env.update(rank_threads(ranks_per_node(point, nodes)))  # srun passes it to every node's ranks
    # wall seconds: the task's allocation is its own, and Slurm's --time (the timeout + 5 min) is a wall limit
    record = run_point(point, store.log_path(point.run_id), env=env, launcher=launcher, fair_share=False)
    record["slurm_job_id"], record["slurm_task_id"] = job_id, task_id
    return write_pending(store, record)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m moebench.sweep.worker STORE RUN_ID")
    try:
        path = run_task(args[0], args[1])
    except MoebenchError as exc:  # one line in the task's log (the sweep records it), not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if path is None:
        print(f"moebench worker: point {args[1]}: this task has a record already (requeued?); not run again")
        return
    print(f"moebench worker: point {args[1]} -> {path}")


if __name__ == "__main__":
    main()
