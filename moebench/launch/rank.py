"""``python -m moebench.launch.rank -m MODULE ARGS | SCRIPT ARGS``: one rank under the leader.

torchrun's agent (run in-process by :func:`moebench.launch.leader.launch_ranks`) starts this in a
session of its own. Before running the rank's program in this same process it:

- asks for SIGKILL when the leader dies, even by SIGKILL (no group kill reaches this session);
- tees its stderr into ``rank<N>.log`` of the launch's rank-log folder (every rank's tail);
- on an uncaught exception, writes its one-line error to ``rank<N>.error.json`` (the first real
  error, which the leader reports, instead of torchrun's ``ChildFailedError``).
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

from moebench.launch.failure import RANK_LOGS_ENV, rank_log, write_rank_error
from moebench.launch.procs import die_with_parent

LEADER_ENV = "MOEBENCH_LEADER_PID"


def tee_stderr(path: Path) -> None:
    """Send fd 2 through ``tee -a path`` to where it went before. ``tee`` is a separate process, so a
    rank killed by SIGKILL loses nothing it had written; it ends at EOF, when the rank (and any child
    holding fd 2) is gone."""
    tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=sys.stderr.fileno(),
                           stderr=subprocess.DEVNULL, start_new_session=True)
    assert tee.stdin is not None
    os.dup2(tee.stdin.fileno(), sys.stderr.fileno())
    tee.stdin.close()  # fd 2 is now the pipe's only write end


def main(args: list[str]) -> None:
    if os.environ.get(LEADER_ENV):
        die_with_parent(signal.SIGKILL, parent=int(os.environ[LEADER_ENV]))
    rank = int(os.environ.get("RANK", "0"))
    log_dir = Path(os.environ[RANK_LOGS_ENV]) if os.environ.get(RANK_LOGS_ENV) else None
    if log_dir is not None:
        tee_stderr(rank_log(log_dir, rank))
    if len(args) >= 2 and args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
    elif args:
        sys.argv = list(args)
        run = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
    else:
        sys.exit("usage: python -m moebench.launch.rank -m MODULE ARGS... | SCRIPT ARGS...")
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise  # an exit code, or a stop asked for: no error of the rank's own
    except BaseException as exc:
        if log_dir is not None:
            write_rank_error(log_dir, rank, exc)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
