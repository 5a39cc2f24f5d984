"""Multi-rank runs: local launch through torchrun, and process-group set-up inside a rank.

The same training code runs whether the ranks were started by ``moebench train --nproc``
(torchrun standalone), by ``torchrun`` directly, or by ``srun`` (Slurm variables are
mapped to torchrun's).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moebench.devices import LocalRanks
from moebench.errors import ConfigError
from moebench.metrics.nvml import device_totals
from moebench.train.failure import RANK_LOGS_ENV, first_failure, write_failure
from moebench.train.procs import become_subreaper, descendants, oom_kill_count, stop, wait_gone
from moebench.train.rank import LEADER_ENV


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run ``moebench <argv>`` on ``nproc`` local ranks; return the exit code."""
    return launch_ranks(nproc, ["-m", "moebench.cli", *argv])


def launch_ranks(nproc: int, rank_argv: list[str]) -> int:
    """Run ``python <rank_argv>`` on ``nproc`` local ranks with torchrun's agent in this process.

    The agent ends every rank when one fails, so a crash never leaves the others hanging in a
    collective; on SIGTERM, SIGINT or SIGHUP it stops the ranks (SIGTERM, later SIGKILL) before
    this returns 128 + the signal. Each rank gets SIGKILL if this process dies first
    (:mod:`moebench.train.rank`), and this process is a subreaper, so whatever a rank leaves
    behind is stopped here on the way out. A failure prints (and writes to ``failure.json`` in the
    rank-log folder, ``$MOEBENCH_RANK_LOGS`` or a temporary one) the rank that failed first and its
    error line, instead of torchrun's ``ChildFailedError``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    become_subreaper()
    given = os.environ.get(RANK_LOGS_ENV)
    log_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix="moebench-ranks-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # torchrun's agent hands this environment to every rank
    os.environ.update({LEADER_ENV: str(os.getpid()), RANK_LOGS_ENV: str(log_dir)})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    oom_before = oom_kill_count()
    try:
        # "--": the ranks' own options are not torchrun's, even where a prefix matches (--nproc)
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "--", "moebench.train.rank", *rank_argv]))
        return 0
    except ChildFailedError as exc:
        oom_after = oom_kill_count()
        kills = oom_after - oom_before if oom_before is not None and oom_after is not None else None
        failure = first_failure(log_dir, {rank: f.exitcode for rank, f in exc.failures.items()}, kills)
        write_failure(log_dir, failure)
        print(f"error: {failure['error']}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    finally:
        # torchrun's handlers are still installed, and a second signal would abort this clean-up: the
        # parent-death signal comes once per exiting thread of the sweep (the kernel re-parents to them in turn)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        # tee processes end by themselves at EOF (a moment, to write their last lines); anything else goes
        left = wait_gone(descendants(os.getpid()), 1.0, reap=True)
        stop(left, 1.0, reap=True)
        if not given:
            shutil.rmtree(log_dir, ignore_errors=True)


def local_ranks() -> LocalRanks:
    """The CPUs this process may run on (its affinity, as taskset or a cgroup sets it) and the GPUs it sees."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return LocalRanks(cpus=cpus, gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def check_local_ranks(nproc: int, device: str) -> None:
    """Refuse to start more local ranks than this machine has devices for (``--oversubscribe`` skips it)."""
    most, what = local_ranks().limit(device)
    if nproc > max(most, 1):
        raise ConfigError(f"--nproc {nproc}: more ranks than the {most} {what} here (one process per rank); "
                          "pass --oversubscribe to start them anyway")


def distributed_env() -> bool:
    """True inside a multi-rank launch (torchrun or Slurm's srun)."""
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
