"""The results store: one folder per sweep run, append-only, safe to kill at any moment.

Layout (see docs/results-store.md)::

    results/<suite>/<run-id>/
      meta.json          run metadata (schema-versioned; written atomically by rename)
      records.jsonl      one JSON line per finished point
      logs/<point>.log   full log of each point
      unsaved/           records that could not be appended (full disk), merged by the next sweep
      .lock              held (flock) by the sweep writing this store

A store is made whole or not at all: its files are written into a temporary folder that is
then renamed into place. Lines and files are written durably (:mod:`moebench.results.files`); a
record that records.jsonl cannot take is kept in a side file (:mod:`moebench.results.side_files`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.record import to_json_line
from moebench.results import durable, reader
from moebench.results.durable import append_line, make_dir, terminate_partial_line, write_failed, write_json_atomic
from moebench.results.lines import POINT_ID, parse_store_line
from moebench.results.migrate import NewerRecord
from moebench.results.settle import run_key, settle_records
from moebench.results.side_files import SideFiles, unsaved_warning

STORE_SCHEMA_VERSION = 1
META_FILE = "meta.json"
RECORDS_FILE = "records.jsonl"
LOGS_DIR = "logs"
LOCK_FILE = ".lock"
# Prefix of the temporary folder a store is built in before it is renamed into place.
CREATING_PREFIX = ".creating-"
# Statuses a point can end with; only ``ok`` counts as done for --rerun-failed, and ``--resume``
# also reruns ``env_failed`` (the point never started: the machine failed, not the point).
STATUSES = ("ok", "failed", "oom", "timeout", "invalid", "diverged", "env_failed")
# meta.json fields that readers index into, and their JSON type (null is allowed for each).
META_TYPES: dict[str, tuple[type, str]] = {
    "suite": (str, "string"), "run_id": (str, "string"), "baseline": (dict, "object"), "git": (dict, "object"),
    "versions": (dict, "object"), "host": (dict, "object"), "slurm": (dict, "object"), "set": (dict, "object"),
}
# The baseline selector of a store whose meta.json names none (a suite without ``baseline``).
DEFAULT_BASELINE = {"parallel.strategy": "fsdp"}


def commit_label(meta: dict[str, Any]) -> str:
    """``0d579b9`` (``+dirty`` for an uncommitted tree, ``unknown`` outside git)."""
    git = meta.get("git") or {}
    return str(git.get("commit") or "unknown")[:7] + ("+dirty" if git.get("dirty") else "")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _build(folder: Path, texts: dict[str, str]) -> None:
    """A new store's folder: ``logs/`` and the files, each fsync'd, then the folder itself."""
    (folder / LOGS_DIR).mkdir(parents=True)
    for name, text in texts.items():
        durable.write_synced(folder / name, text)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store(SideFiles):
    """One run's folder. Reading needs no lock; writing happens inside :meth:`locked`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def records_path(self) -> Path:
        return self.path / RECORDS_FILE

    @property
    def meta_path(self) -> Path:
        return self.path / META_FILE

    def log_path(self, point_id: str) -> Path:
        return self.path / LOGS_DIR / f"{point_id}.log"

    def exists(self) -> bool:
        return self.meta_path.exists()

    # ------------------------------------------------------------------ writing
    def create(self, meta: dict[str, Any], files: dict[str, str] | None = None) -> None:
        """Make the store with its meta.json and ``files`` (name -> text), all or nothing.

        A new folder is built beside its final place and renamed there, so a failure (full disk,
        read-only file system) leaves nothing behind and a rival creator finds either no store or
        a whole one. An existing folder (``--out`` an empty folder) gets the files under its lock,
        meta.json last: it is a store from that rename on. Refuses to overwrite an existing store.
        """
        self._refuse_existing()
        self._refuse_foreign_folder()
        texts = {**(files or {}), META_FILE: json.dumps({"schema_version": STORE_SCHEMA_VERSION, **meta},
                                                       indent=2, sort_keys=True) + "\n"}
        if self.path.is_dir():
            with self.locked():
                self._refuse_existing()  # another sweep may have made it before we got the lock
                self._refuse_foreign_folder()
                self._fill_in_place(texts)
            return
        parent = self.path.absolute().parent
        if not parent.is_dir():
            make_dir(parent)
        tmp = parent / f"{CREATING_PREFIX}{os.getpid()}-{secrets.token_hex(2)}-{self.path.name}"
        try:
            _build(tmp, texts)
            os.rename(tmp, self.path)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self._refuse_existing()  # the rename lost to a rival creator
            raise write_failed(self.path, exc, "create the store") from None

    def _refuse_existing(self) -> None:
        if self.exists():
            raise StoreError(
                f"{self.path} already holds a results store; pass --resume or --rerun-failed to continue it, "
                "or choose another --out"
            )
        if self.records_path.exists():
            # records without their meta.json would be adopted by this run under a new run id and suite
            raise StoreError(f"{self.records_path} exists but {self.meta_path} does not (a damaged store?); "
                             "not starting a new run in it: move the folder aside or choose another --out")

    def _refuse_foreign_folder(self) -> None:
        """An existing folder becomes a store only while empty: ``--out .`` in a repository, or any
        folder of other files, must not get a meta.json, a logs/ folder and a ``latest`` link."""
        if not self.path.is_dir():
            return
        try:
            entries = sorted(e.name for e in os.scandir(self.path) if e.name != LOCK_FILE)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot list the folder ({exc.strerror or exc})") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise StoreError(f"{self.path} is not empty ({len(entries)} entries: {shown}) and holds no results store; "
                             "not making it one: choose a new or empty --out")

    def _fill_in_place(self, texts: dict[str, str]) -> None:
        tmp = self.path / f"{CREATING_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        names = [LOGS_DIR] if not (self.path / LOGS_DIR).is_dir() else []
        names += [*(n for n in texts if n != META_FILE), META_FILE]  # meta.json last: the commit
        moved: list[Path] = []
        try:
            _build(tmp, texts)
            for name in names:
                os.rename(tmp / name, self.path / name)
                moved.append(self.path / name)
        except OSError as exc:
            for path in moved:
                with contextlib.suppress(OSError):
                    if path.is_dir():
                        path.rmdir()  # logs/, still empty
                    else:
                        path.unlink()
            raise write_failed(self.path, exc, "create the store") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def link_latest(self) -> Path | None:
        """Point ``latest`` beside this store (in its parent folder) at it, replaced atomically, so
        ``results/<suite>/latest`` names the newest run (the sweep calls it for stores there only).

        A ``latest`` that is not a symlink (say ``--out results/x/latest``) is left alone: None.
        """
        folder = self.path.resolve()  # ``--out .`` has no name of its own
        link = folder.parent / "latest"
        if link.exists() and not link.is_symlink():
            return None
        tmp = folder.parent / f".latest.tmp{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            os.symlink(folder.name, tmp)
            os.replace(tmp, link)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"{link}: cannot point it at {folder.name} ({exc.strerror or exc}); the store "
                             f"{self.path} itself is whole: continue it with --resume") from None
        return link

    def update_meta(self, **fields: Any) -> None:
        meta = self.read_meta()
        meta.update(fields)
        write_json_atomic(self.meta_path, meta)

    def sweep_running(self) -> bool:
        """Whether a sweep holds this store's lock now (without taking it, or creating the lock file)."""
        try:
            fd = os.open(self.path / LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not block
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also releases the shared lock taken above
        return False

    @contextlib.contextmanager
    def locked(self) -> Iterator[Store]:
        """Hold the store's write lock; a second sweep on the same store gets a clear StoreError."""
        make_dir(self.path)
        lock_path = self.path / LOCK_FILE
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{lock_path}: cannot open the store's lock file ({exc.strerror})") from None
        held = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
                raise StoreError(
                    f"{self.path} is locked by another sweep ({holder}); wait for it to finish or use another --out"
                ) from None
            # the holder's name only explains a refusal; the flock alone is the lock (a full disk may refuse the text)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now_iso()}".encode(), 0)
            held = True
            reader.appendable(self.records_path)
            terminate_partial_line(self.records_path)
            yield self
        finally:
            if held:  # a finished store names no holder (its pid is gone); emptied, not removed: a sweep
                # that opened the removed file and one that made a new one would each hold a lock
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor releases the flock

    def append(self, record: dict[str, Any]) -> None:
        """Append a finished point's record. When records.jsonl cannot take it (full disk, read-only
        file system) the record is kept in a side file (:meth:`unsaved_dirs`) that the next sweep on
        the store merges, and a StoreError says where it is."""
        line = to_json_line(record)
        try:
            append_line(self.records_path, line)
        except OSError as exc:
            what = f"{self.records_path}: cannot append {record.get('point_id', 'a')}'s record ({exc.strerror or exc})"
            kept, why = self._keep_unsaved(record)
            if kept is None:
                raise StoreError(f"{what}; nor could it be kept in a side file ({why}): it is lost") from None
            raise StoreError(f"{what}; it is kept in {kept}, and the next `moebench run --resume` "
                             "on this store merges it once the disk takes writes again") from None

    def run_id(self) -> str | None:
        """The store's identity (meta.json's ``run_id``; None when meta.json cannot say)."""
        try:
            run_id = self.read_meta().get("run_id")
        except StoreError:
            return None
        return run_id if isinstance(run_id, str) and POINT_ID.fullmatch(run_id) else None

    # ------------------------------------------------------------------ reading
    def read_meta(self) -> dict[str, Any]:
        try:
            meta = reader.read_json(self.meta_path)
        except FileNotFoundError:
            raise StoreError(f"{self.path}: not a results store (no {META_FILE})") from None
        if not isinstance(meta, dict):
            raise StoreError(f"{self.meta_path}: expected a JSON object, got {type(meta).__name__}")
        version = meta.get("schema_version")
        if version != STORE_SCHEMA_VERSION:
            raise StoreError(
                f"{self.meta_path}: store schema_version {version!r} is not supported "
                f"(this moebench reads {STORE_SCHEMA_VERSION})"
            )
        for name, (kind, json_name) in META_TYPES.items():
            value = meta.get(name)
            if value is not None and not isinstance(value, kind):
                raise StoreError(f"{self.meta_path}: field {name!r} must be a JSON {json_name}, got {repr(value)[:60]}")
        return meta

    def read_records(self, strict: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
        """All readable records in file order, and a warning per unreadable line.

        With ``strict`` the first unreadable line raises a StoreError naming file and line.
        A records.jsonl that cannot be read at all (a FIFO, a device, a link loop, too big) raises
        with ``strict`` and is one warning without. A record newer than this moebench raises
        :class:`NewerRecord` naming file and line, ``strict`` or not: skipping it would misreport the store.
        """
        records: list[dict[str, Any]] = []
        warnings: list[str] = []
        try:
            for lineno, raw in reader.lines(self.records_path):
                if raw is not None and not raw.strip():
                    continue
                try:
                    record, problem = parse_store_line(raw) if raw is not None else (None, None)
                except NewerRecord as exc:
                    raise NewerRecord(f"{self.records_path}:{lineno}: {exc}") from None
                if raw is None or problem:
                    message = reader.too_long(self.records_path, lineno) if raw is None else \
                        f"{self.records_path}:{lineno}: {problem}"
                    if strict:
                        raise StoreError(message)
                    warnings.append(message)
                    continue
                records.append(record)
        except FileNotFoundError:
            pass  # no point finished yet
        except StoreError as exc:
            if strict or isinstance(exc, NewerRecord):
                raise
            warnings.append(f"{exc} (no records read from it)")
        return records, warnings

    def latest_by_key(self) -> dict[str, dict[str, Any]]:
        """The last record of each point key, whichever repeat it ran (a rerun supersedes the earlier
        attempt), as :func:`settle_records` reads them."""
        records, _ = settle_records(self.read_records(strict=False)[0], self.path)
        return {r["key"]: r for r in records}

    def newest_records(self) -> tuple[list[dict[str, Any]], str | None]:
        """The last record of each point key with the records waiting in side files merged in (as
        :func:`moebench.results.load.load_results` reads a store), and the warning about those, if any."""
        records = self.latest_by_key()
        unsaved = self.unsaved_records()
        records.update({r["key"]: r for _, r in unsaved})
        return list(records.values()), (unsaved_warning(self.path, unsaved) if unsaved else None)

    def latest_by_run(self) -> dict[tuple[str, int], dict[str, Any]]:
        """The last record of each run, ``(point key, repeat)`` (:func:`run_key`), as
        :func:`settle_records` reads them."""
        records, _ = settle_records(self.read_records(strict=False)[0], self.path)
        return {run_key(r): r for r in records}
