"""Ranks across the nodes of a Slurm allocation: ``srun`` one torchrun per node, and the ranks
meet in a c10d rendezvous on the allocation's first node. ``moebench train --nproc N`` in an
``salloc`` shell or ``sbatch`` script of several nodes launches this way; so do multi-node
sweep points (:mod:`moebench.sweep.worker`).

The rendezvous address is the first node's ``NodeAddr`` as Slurm knows it (what slurmctld
itself uses to reach the node; a node name need not resolve), unless ``MOEBENCH_RDZV_HOST``
names one. Its port depends on the job id, so two jobs sharing a node (an oversubscribed
partition, array tasks) do not meet at the same port.
"""

from __future__ import annotations

import os
import subprocess
import sys

from moebench.errors import ConfigError, LaunchError
from moebench.launch.procs import SAFE_PATH_ENV

RDZV_PORT_BASE = 29500
RDZV_PORTS = 2000  # ports RDZV_PORT_BASE .. +1999, one chosen by the job id


def rendezvous_port(job_id: str) -> int:
    return RDZV_PORT_BASE + int(job_id) % RDZV_PORTS if job_id.isdigit() else RDZV_PORT_BASE


def rendezvous_host(nodelist: str) -> str:
    """The address the first node of ``nodelist`` (a Slurm host list) is reached at."""
    if os.environ.get("MOEBENCH_RDZV_HOST"):
        return os.environ["MOEBENCH_RDZV_HOST"]
    names = _scontrol(["show", "hostnames", nodelist]).split()
    if not names:
        raise LaunchError(f"scontrol show hostnames {nodelist!r} named no node")
    fields = dict(item.partition("=")[::2] for item in _scontrol(["show", "node", "-o", names[0]]).split())
    return fields.get("NodeAddr") or names[0]


def _scontrol(args: list[str]) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {exc}") from None
    if out.returncode != 0:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def srun_torchrun(nodes: int, per_node: int, head: str, job_id: str, train_args: list[str]) -> list[str]:
    """``srun`` one torchrun per node, ``per_node`` ranks each, running ``moebench <train_args>``;
    the ranks meet at ``head`` (c10d rendezvous), and one failing rank ends the step."""
    return [
        "srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{rendezvous_port(job_id)}", f"--rdzv-id=moebench-{job_id}",
        "-m", "moebench.cli", *train_args,
    ]


def allocation_nodes(env: dict[str, str] | None = None) -> int:
    """Nodes of the Slurm allocation this process runs in outside any job step (an ``salloc`` shell,
    an ``sbatch`` script); 1 elsewhere, and inside a step (``srun``, whose tasks are placed already)."""
    env = dict(os.environ) if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" in env:
        return 1
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)


def launch_across(nodes: int, nproc: int, argv: list[str]) -> int:
    """Run ``moebench <argv>`` as ``nproc`` ranks spread evenly over the allocation's ``nodes``
    nodes; return the exit code."""
    if nproc % nodes:
        raise ConfigError(f"--nproc {nproc}: this Slurm allocation has {nodes} nodes and the ranks must split "
                          f"evenly over them (or run inside srun --nodes=1 for one node)")
    per_node = nproc // nodes
    cmd = srun_torchrun(nodes, per_node, rendezvous_host(os.environ["SLURM_JOB_NODELIST"]),
                        os.environ["SLURM_JOB_ID"], argv)
    return subprocess.run(cmd, env={**os.environ, **rank_threads(per_node), **SAFE_PATH_ENV}).returncode


def rank_threads(per_node: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``per_node`` ranks sharing a node's allocated CPUs, unless the
    caller set it: torch otherwise gives every rank a thread per CPU, and ranks spinning on more
    threads than CPUs wait on each other's collectives (a DDP + all-to-all step 20x slower)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, node_cpus() // per_node))}


def node_cpus() -> int:
    """CPUs the allocation has on this (or, in an salloc shell, its first) node: ``SLURM_CPUS_ON_NODE``
    where Slurm sets it (batch scripts, job steps), else the first count of ``SLURM_JOB_CPUS_PER_NODE``
    (``2(x3),1``: two CPUs on each of three nodes, one on a fourth), else this machine's CPUs."""
    if os.environ.get("SLURM_CPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    first = os.environ.get("SLURM_JOB_CPUS_PER_NODE", "").split("(")[0].split(",")[0]
    return int(first) if first.isdigit() else os.cpu_count() or 1
