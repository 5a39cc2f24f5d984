"""What a failed multi-rank launch leaves behind, and which rank failed first (no torch).

Under the leader (``moebench train --nproc``) every rank tees its stderr into ``rank<N>.log`` in
the launch's rank-log folder and writes an uncaught exception's line to ``rank<N>.error.json``;
when ranks fail the leader writes ``failure.json``: the rank that failed first, its error line,
its exit code or signal, and whether memory ran out. The sweep reads these to record a point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

RANK_LOGS_ENV = "MOEBENCH_RANK_LOGS"
FAILURE_FILE = "failure.json"
RANK_TAIL_CHARS = 2000
# What CUDA, the caching allocator, Python and the C library print when memory runs out.
OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|std::bad_alloc")
ERROR_LINE = re.compile(r"^(error: |Error: |[\w.]*(Error|Exception)\b.*:)")


def error_line(text: str, pattern: re.Pattern[str] = ERROR_LINE) -> str | None:
    """The last line of ``text`` that matches ``pattern`` (an error), cut to 300 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if pattern.search(line):
            return line[:300]
    return None


def read_tail(path: Path, chars: int) -> str:
    """The last ``chars`` characters of a file; empty when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def rank_log(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.log"


def rank_error_file(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.error.json"


def write_rank_error(log_dir: Path, rank: int, exc: BaseException) -> None:
    """Called by a rank whose entry point raised: its error line and when (ns, so ranks order)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    line = f"{type(exc).__name__}: {first}".rstrip(": ")
    rank_error_file(log_dir, rank).write_text(json.dumps({"error": line[:300], "time_ns": time.time_ns()}))


def _rank_error(log_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        data = json.loads(rank_error_file(log_dir, rank).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("error"), str) else None


def first_failure(log_dir: Path, exitcodes: dict[int, int], oom_kills: int | None = None) -> dict[str, Any]:
    """The failing rank that caused the others to fail, from every failed rank's exit code.

    A rank killed by a signal other than SIGTERM was killed from outside (the OOM killer, a user):
    its peers' errors (a closed connection) follow from it. Else the rank whose exception came
    first. SIGTERM is what torchrun's agent sends the remaining ranks once one has failed, so a
    SIGTERMed rank is the cause only when nothing else failed. ``oom_kills``: OOM kills counted in
    the memory cgroup during the launch.
    """
    errors = {rank: e for rank in exitcodes if (e := _rank_error(log_dir, rank)) is not None}

    def order(rank: int) -> tuple[int, int, int]:
        code = exitcodes[rank]
        if code < 0 and -code != signal.SIGTERM:
            return 0, 0, rank
        if rank in errors:
            return 1, int(errors[rank].get("time_ns") or 0), rank
        return (2 if code > 0 else 3), 0, rank

    rank = min(exitcodes, key=order)
    code = exitcodes[rank]
    sig = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else None
    if sig == "SIGKILL":
        why = (f"killed by SIGKILL: the kernel OOM killer ({oom_kills} OOM kill(s) in the memory cgroup "
               "during the run)" if oom_kills else
               "killed by SIGKILL from outside the run (most likely the kernel OOM killer)")
    elif sig is not None:
        why = f"killed by {sig}"
    elif rank in errors:
        why = errors[rank]["error"]
    else:
        why = error_line(read_tail(rank_log(log_dir, rank), RANK_TAIL_CHARS)) or f"exit code {code}"
    return {"rank": rank, "error": f"rank {rank}: {why}", "exitcode": code, "signal": sig,
            "oom": sig == "SIGKILL" or bool(OOM_PATTERN.search(why))}


def write_failure(log_dir: Path, failure: dict[str, Any]) -> None:
    (log_dir / FAILURE_FILE).write_text(json.dumps(failure))


def read_failure(log_dir: Path) -> dict[str, Any] | None:
    """The leader's ``failure.json`` of a launch; None when no rank failed (or no leader ran)."""
    try:
        data = json.loads((log_dir / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("error"), str) else None


def rank_tails(log_dir: Path, chars: int = RANK_TAIL_CHARS) -> dict[str, str]:
    """Each rank's last ``chars`` characters of stderr, keyed by rank (as text: JSON keys)."""
    found = {}
    for path in log_dir.glob("rank*.log"):
        rank = path.stem.removeprefix("rank")
        if rank.isdigit():
            found[rank] = read_tail(path, chars)
    return dict(sorted(found.items(), key=lambda kv: int(kv[0])))
