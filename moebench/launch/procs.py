"""Process trees that end with their run: parent-death signals, a subreaper, finding and stopping
descendants, and the kernel's OOM-kill count. No torch: the rank wrapper imports this first.

A point's tree is runner -> leader (``moebench train --nproc``, torchrun's agent in-process) ->
ranks. torchrun starts each rank in a session of its own, so no process-group kill reaches the
ranks; instead every level asks the kernel for a signal when its parent dies
(``PR_SET_PDEATHSIG``), and the leader is a subreaper, so whatever a rank leaves behind comes back
to it to be stopped. Linux only; elsewhere the calls do nothing and only the group kill remains.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

# What every moebench process started with ``python -m`` carries: the current directory stays off the
# import path, so a folder named ``moebench`` there (a checkout's parent, a copy of the package) cannot
# shadow the installed package (it did: ``moebench.__file__`` None, every point failing at import).
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Get ``sig`` when the parent thread exits, even by SIGKILL.

    With ``parent`` (the pid the caller was started by), a parent that died before the call (the
    kernel would never send the signal) is caught too: the process sends ``sig`` to itself. Safe in a
    ``preexec_fn`` (no allocation-heavy work).
    """
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if parent is not None and sys.platform == "linux" and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init, so it can stop them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[1])


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) does not count."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for child in _pids():
        stat = _stat(child)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes of this user whose environment has ``name=value`` (other users' are unreadable)."""
    wanted = f"{name}={value}".encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") and alive(pid):
            found.append(pid)
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout_s: float, reap: bool = False) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to end; return those still alive. ``reap``: collect this
    process's exited children meanwhile (only where no Popen waits for its own, e.g. the leader)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if reap:
            reap_children()
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop(pids: list[int], grace_s: float, reap: bool = False) -> None:
    """SIGTERM ``pids``, give them ``grace_s`` to end, then SIGKILL the rest."""
    signal_all(pids, signal.SIGTERM)
    signal_all(wait_gone(pids, grace_s, reap), signal.SIGKILL)
    wait_gone(pids, 1.0, reap)


def reap_children() -> None:
    """Collect exited children without blocking (a subreaper inherits other processes' zombies)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def oom_kill_count() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (v2
    ``memory.events``, v1 ``memory.oom_control``); None where neither can be read."""
    candidates = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
            elif "memory" in controllers.split(","):
                candidates += [Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control",
                               Path("/sys/fs/cgroup/memory/memory.oom_control")]  # inside a cgroup namespace
    for path in candidates:
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                key, _, count = line.partition(" ")
                if key == "oom_kill":
                    return int(count)
    return None
