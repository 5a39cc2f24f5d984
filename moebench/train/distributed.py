"""Inside a rank of a multi-rank run: the process group, the Slurm variables, the nodes of the run.

The same training code runs whether the ranks were started by ``moebench train --nproc``
(torchrun standalone, :mod:`moebench.launch.leader`), by ``torchrun`` directly, or by ``srun``
(Slurm variables are mapped to torchrun's).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from moebench.metrics.nvml import device_totals


def adopt_launch_env() -> bool:
    """Adopt the launcher's rank variables and say whether this process is one rank of several.

    Under torchrun they are there already; a task of a Slurm job step (srun) has only Slurm's, which
    this maps onto torchrun's (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) in
    ``os.environ``: it writes the environment, so call it where a run starts. True inside a multi-rank
    launch."""
    _map_slurm_env()
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _map_slurm_env() -> None:
    # only the tasks of a job step (srun) are ranks: an sbatch script or salloc shell of a
    # multi-task job sees SLURM_NTASKS too, but is one process that launches the ranks
    if "WORLD_SIZE" in os.environ or "SLURM_STEP_ID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "localhost"))
        if "[" in nodes or "," in nodes:  # a compressed host list: let Slurm expand it
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
            nodes = out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else nodes
        os.environ["MASTER_ADDR"] = nodes


def init_process_group(device_type: str) -> torch.device:
    """Initialise the default group (NCCL on GPU, gloo on CPU) and return this rank's device."""
    timeout = dt.timedelta(seconds=float(os.environ.get("MOEBENCH_DIST_TIMEOUT_S", "600")))
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def node_name() -> str:
    """The Slurm node this rank runs on (several slurmds can share one hostname), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def rank_nodes(nvml_devices: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every node of the run with its hostname, ranks and its GPUs' NVML figures, in order of
    first rank: a collective, so every rank of the default group calls it (single process: this
    host, rank 0). ``nvml_devices`` is this rank's sampler summary (None without NVML); each
    node's entry combines its ranks' with :func:`device_totals`, every GPU tagged with its rank."""
    mine = (node_name(), socket.gethostname(), nvml_devices or [])
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    nodes: dict[tuple[str, str], tuple[list[int], list[dict[str, Any]]]] = {}
    for rank, (node, host, devices) in enumerate(everyone):
        ranks, gpus = nodes.setdefault((node, host), ([], []))
        ranks.append(rank)
        gpus.extend({**device, "rank": rank} for device in devices)
    return [{"node": node, "hostname": host, "ranks": ranks, **device_totals(gpus)}
            for (node, host), (ranks, gpus) in nodes.items()]
