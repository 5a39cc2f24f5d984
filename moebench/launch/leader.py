"""The leader of a local multi-rank run: torchrun's agent in this process, and how many ranks fit here.

``moebench train --nproc N`` starts its ranks through :func:`launch_ranks`; each rank runs under
:mod:`moebench.launch.rank`. Importing this module loads no torch (torchrun's agent and the CUDA
device count are imported where they are used).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from moebench.devices import LocalRanks
from moebench.errors import ConfigError
from moebench.launch.failure import RANK_LOGS_ENV, first_failure, write_failure
from moebench.launch.procs import SAFE_PATH_ENV, become_subreaper, descendants, oom_kill_count, stop, wait_gone
from moebench.launch.rank import LEADER_ENV
from moebench.launch.share import cores


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run ``moebench <argv>`` on ``nproc`` local ranks; return the exit code."""
    return launch_ranks(nproc, ["-m", "moebench.cli", *argv])


def launch_ranks(nproc: int, rank_argv: list[str]) -> int:
    """Run ``python <rank_argv>`` on ``nproc`` local ranks with torchrun's agent in this process.

    The agent ends every rank when one fails, so a crash never leaves the others hanging in a
    collective; on SIGTERM, SIGINT or SIGHUP it stops the ranks (SIGTERM, later SIGKILL) before
    this returns 128 + the signal. Each rank gets SIGKILL if this process dies first
    (:mod:`moebench.launch.rank`), and this process is a subreaper, so whatever a rank leaves
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
    os.environ.update({LEADER_ENV: str(os.getpid()), RANK_LOGS_ENV: str(log_dir), **SAFE_PATH_ENV})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    oom_before = oom_kill_count()
    try:
        # "--": the ranks' own options are not torchrun's, even where a prefix matches (--nproc)
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "--", "moebench.launch.rank", *rank_argv]))
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
    import torch  # here, not at the top: the rest of moebench.launch runs without torch

    return LocalRanks(cpus=cores(), gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def check_local_ranks(nproc: int, device: str) -> None:
    """Refuse to start more local ranks than this machine has devices for (``--oversubscribe`` skips it)."""
    most, what = local_ranks().limit(device)
    if nproc > max(most, 1):
        raise ConfigError(f"--nproc {nproc}: more ranks than the {most} {what} here (one process per rank); "
                          "pass --oversubscribe to start them anyway")
