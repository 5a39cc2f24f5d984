"""Durable writes: a whole line or none, a whole file or none.

Each line is written with one ``os.write`` on an ``O_APPEND`` descriptor and then fsync'd, so a
SIGKILL leaves either the whole line or nothing; a write that fails (full disk) is cut back off.
A line cut short by a crash anyway (power loss) is terminated before the next append
(:func:`terminate_partial_line`), and the loader names it instead of silently gluing two records
together. A file is written beside its place, fsync'd and renamed over it. Every OSError of a
write is a StoreError naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

from moebench.errors import StoreError


def write_failed(path: Path, exc: OSError, doing: str = "write") -> StoreError:
    """The one line a failed write becomes: the path and the system's reason (a full disk, a
    read-only file system, a quota...), never a traceback."""
    return StoreError(f"{path}: cannot {doing} ({exc.strerror or exc})")


def append_line(path: Path, line: str) -> None:
    """Append one full line atomically with respect to SIGKILL (single write + fsync).

    A write or fsync that fails (a full disk can also end a write short) is cut back to the
    file's previous length, so the file never keeps half a line; the OSError goes to the caller.
    """
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size  # the sweep holds the lock: nobody else appends meanwhile
        try:
            written = os.write(fd, data)
            if written != len(data):
                # a regular file's write ends short only when the disk has no room for the rest
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} after {written} of {len(data)} bytes")
            os.fsync(fd)
        except OSError:
            # freeing blocks works on a full disk; if even that fails the loader names the cut line
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                os.fsync(fd)
            raise
    finally:
        os.close(fd)


def terminate_partial_line(path: Path) -> None:
    """If a crash left a last line without its newline, end it so new lines stay separate."""
    if not path.is_file() or path.stat().st_size == 0:
        return  # a records.jsonl that is not a file is reported by whoever reads it
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_failed(path, exc, "end its cut last line") from None


def make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the store folder ({exc.strerror}: {exc.filename})") from None


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: write a temporary file, fsync, rename over ``path``.

    On failure the temporary file is removed and ``path`` is as it was (StoreError naming it).
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write_synced(tmp, text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_failed(path, exc) from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

