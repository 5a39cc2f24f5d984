"""The results store: one folder per sweep run, append-only, safe to kill at any moment.

Layout (see docs/results-store.md)::

    results/<suite>/<run-id>/
      meta.json          run metadata (schema-versioned; written atomically by rename)
      records.jsonl      one JSON line per finished point
      logs/<point>.log   full log of each point
      unsaved/           records that could not be appended (full disk), merged by the next sweep
      .lock              held (flock) by the sweep writing this store

A store is made whole or not at all: its files are written into a temporary folder that is
then renamed into place. Each line is written with one ``os.write`` on an ``O_APPEND``
descriptor and then fsync'd, so a SIGKILL leaves either the whole line or nothing; a write
that fails (full disk) is cut back off and the record kept in a side file. A line cut short
by a crash anyway (power loss) is terminated before the next append, and the loader names
it instead of silently gluing two records together. Every OSError of a write is a
StoreError naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, overload

from moebench.errors import StoreError
from moebench.record import divergence, to_json_line
from moebench.results import reader

STORE_SCHEMA_VERSION = 1
META_FILE = "meta.json"
RECORDS_FILE = "records.jsonl"
LOGS_DIR = "logs"
LOCK_FILE = ".lock"
# ``moebench claim``'s verdicts on this store, one per claim name (the report shows them in its Claims section)
CLAIMS_FILE = "claims.json"
UNSAVED_DIR = "unsaved"
# The field a side file's record carries: the run id of the store that kept it (removed on merging).
UNSAVED_FROM = "unsaved_by_run"
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
# Record fields that readers flatten or index into, and their JSON type (null is allowed for each).
RECORD_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "config": (dict, "object"), "point": (dict, "object"), "layout": (dict, "object"),
    "comm_bytes_per_step": (dict, "object"), "memory_parts_bytes": (dict, "object"),
    "point_id": (str, "string"), "nproc": (int, "integer"),
}
# A point id names files (logs/<id>.log, pending/<id>-...json): a name, never a path.
POINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,127}")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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


def _terminate_partial_line(path: Path) -> None:
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


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the store folder ({exc.strerror}: {exc.filename})") from None


def _write_synced(path: Path, text: str) -> None:
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
        _write_synced(tmp, text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_failed(path, exc) from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _build(folder: Path, texts: dict[str, str]) -> None:
    """A new store's folder: ``logs/`` and the files, each fsync'd, then the folder itself."""
    (folder / LOGS_DIR).mkdir(parents=True)
    for name, text in texts.items():
        _write_synced(folder / name, text)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store:
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
            _make_dir(parent)
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
        _make_dir(self.path)
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
            _terminate_partial_line(self.records_path)
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

    def unsaved_dirs(self) -> list[Path]:
        """Where records that records.jsonl could not take are kept: the store's ``unsaved/``, else
        (that disk being full too) a folder for this store under the user's cache directory, named
        by its run id: a later store made at the same path is another store and never finds it."""
        own = self.path / UNSAVED_DIR
        run_id = self.run_id()
        try:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        except RuntimeError:  # no home directory to speak of: the store's own folder only
            return [own]
        return [own] if run_id is None else [own, cache / "moebench" / UNSAVED_DIR / run_id]

    def _keep_unsaved(self, record: dict[str, Any]) -> tuple[Path | None, str]:
        # named by time, so merging in name order keeps the order the records were made in
        name = f"{time.time_ns()}-{os.getpid()}.json"
        line = to_json_line({**record, UNSAVED_FROM: self.run_id()})
        reasons = []
        for folder in self.unsaved_dirs():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                write_text_atomic(folder / name, line + "\n")
            except (OSError, StoreError) as exc:
                reasons.append(str(exc))
                continue
            return folder / name, ""
        return None, "; ".join(reasons)

    def _side_files(self) -> list[tuple[Path, dict[str, Any] | None, str | None]]:
        """Every side file, oldest first: (file, its record, None), or (file, None, what is wrong)
        for one that cannot be read and (file, record, why) for a record another store kept."""
        own = self.run_id()
        out: list[tuple[Path, dict[str, Any] | None, str | None]] = []
        files = [f for folder in self.unsaved_dirs() if folder.is_dir() for f in folder.glob("*.json")]
        for path in sorted(files, key=lambda f: f.name):  # named by time, whichever folder took them
            try:
                record, problem = parse_store_line(reader.read_bytes(path))
            except FileNotFoundError:
                continue  # merged meanwhile
            except StoreError as exc:
                record, problem = None, str(exc)
            if record is not None:
                origin = record.pop(UNSAVED_FROM, own)  # a file without the field: kept before it existed
                if origin != own:
                    problem = f"a record kept by store run {origin!r}, not by this one ({own!r}): never merged here"
            out.append((path, record, problem if problem is None or problem.startswith(str(path))
                        else f"{path}: {problem}"))
        return out

    def unsaved_records(self, problems: list[str] | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """Records waiting in side files, oldest first, with their files (read-only); a side file
        that cannot be read or that another store kept is left out, with a line in ``problems``."""
        found = []
        for path, record, problem in self._side_files():
            if problem is None and record is not None:
                found.append((path, record))
            elif problems is not None:
                problems.append(problem or f"{path}: unreadable")
        return found

    def merge_unsaved(self, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """Append the records kept in side files to records.jsonl, each once, and remove the files
        (caller holds the lock). A record already in records.jsonl (merged before the file could
        be removed) is not appended again; a side file that is no record stays, with a line to ``warn``."""
        merged = []
        unsaved = []
        for path, record, problem in self._side_files():
            if problem is None and record is not None:
                unsaved.append((path, record))
            elif record is not None:  # another store's: set aside, so no later merge takes it either
                aside = path.parent / "ignored" / path.name
                with contextlib.suppress(OSError):
                    aside.parent.mkdir(exist_ok=True)
                    os.replace(path, aside)
                if warn is not None:
                    warn(f"{problem}; moved to {aside}")
            elif warn is not None:
                warn(f"{problem} (left where it is, not merged)")
        present = {to_json_line(r) for r in self.read_records(strict=False)[0]} if unsaved else set()
        for path, record in unsaved:
            line = to_json_line(record)
            if line not in present:
                try:
                    append_line(self.records_path, line)
                except OSError as exc:
                    raise StoreError(f"{self.records_path}: cannot merge the record kept in {path} "
                                     f"({exc.strerror or exc}); it stays there") from None
                present.add(line)
                merged.append(record)
            try:
                path.unlink()
            except OSError as exc:
                raise write_failed(path, exc, "remove this merged side file") from None
        return merged

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
        with ``strict`` and is one warning without.
        """
        records: list[dict[str, Any]] = []
        warnings: list[str] = []
        try:
            for lineno, raw in reader.lines(self.records_path):
                if raw is not None and not raw.strip():
                    continue
                record, problem = parse_store_line(raw) if raw is not None else (None, None)
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
            if strict:
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
        :func:`moebench.report.build.load_results` reads a store), and the warning about those, if any."""
        records = self.latest_by_key()
        unsaved = self.unsaved_records()
        records.update({r["key"]: r for _, r in unsaved})
        return list(records.values()), (unsaved_warning(self.path, unsaved) if unsaved else None)

    def latest_by_run(self) -> dict[tuple[str, int], dict[str, Any]]:
        """The last record of each run, ``(point key, repeat)`` (:func:`run_key`), as
        :func:`settle_records` reads them."""
        records, _ = settle_records(self.read_records(strict=False)[0], self.path)
        return {run_key(r): r for r in records}


def run_key(record: dict[str, Any]) -> tuple[str, int]:
    """Which run of which point a record is: its point key and repeat (0 in a store written before
    repeats, whose records have no ``repeat``)."""
    return record["key"], int(record.get("repeat") or 0)


def parse_store_line(raw: bytes) -> tuple[Any, str | None]:
    """One line of records.jsonl: (record, None), or (None, what is wrong with it)."""
    body = raw.rstrip(b"\n")
    if body and not body.strip(b"\x00"):  # a file extended by a crash or a full disk, never written
        return None, f"zero-filled line ({len(body)} NUL bytes where no record was written)"
    try:
        record = reader.parse_json(raw)
    except reader.TooDeep as exc:
        return None, f"corrupt line ({exc})"
    except ValueError as exc:
        return None, f"{'truncated' if _cut_short(raw) else 'corrupt'} line ({exc})"
    if not isinstance(record, dict) or "key" not in record or "status" not in record:
        return None, "line is not a point record (needs 'key' and 'status')"
    for name in ("key", "status"):
        if not isinstance(record[name], str) or not record[name]:
            return None, f"field {name!r} must be a non-empty string, got {repr(record[name])[:60]}"
    for name, (kind, json_name) in RECORD_TYPES.items():
        value = record.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return None, f"field {name!r} must be a JSON {json_name}, got {repr(value)[:60]}"
    point_id = record.get("point_id")
    if point_id is not None and (not POINT_ID.fullmatch(point_id) or ".." in point_id):
        return None, f"field 'point_id' must be a name (letters, digits, . _ + = -), got {point_id[:60]!r}"
    return record, None


# Text that finishes whatever token a cut line stops in: a string (plain, after a backslash, inside
# a \uXXXX escape), a number (after "-", "." or "e") or a literal (true, false, null).
_LITERAL_TAILS = dict.fromkeys(word[i:] for word in ("true", "false", "null") for i in range(1, len(word)))
_COMPLETIONS = ("", '"', 'n"', '0000"', "0", *_LITERAL_TAILS)


def _cut_short(raw: bytes) -> bool:
    """Whether a line that does not parse is the beginning of one that would.

    A line without its newline was cut (``append_line`` writes line and newline at once). One
    with it may have been cut too: the writer that resumes a store ends a partial line. It was
    cut when the parser only fails for lack of text: some completion carries it past the end.
    """
    if not raw.endswith(b"\n"):
        return True
    try:
        text = raw.decode().rstrip()
    except UnicodeDecodeError:
        return False  # records are ASCII (to_json_line escapes the rest): a cut cannot make this
    for completion in _COMPLETIONS:
        try:
            json.loads(text + completion)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text):
                return True
        except RecursionError:  # nested past what the parser takes: refused for that, cut or not
            return False
        else:
            return True
    return False


def unsaved_warning(path: Path, unsaved: list[tuple[Path, dict[str, Any]]]) -> str:
    """What readers of a store say about records that wait in side files (:meth:`Store.unsaved_records`)."""
    folders = ", ".join(sorted({str(f.parent) for f, _ in unsaved}))
    return (f"{path}: {len(unsaved)} record(s) kept in side files after a failed write ({folders}); "
            "the next `moebench run --resume` on the store merges them into records.jsonl")


# ---------------------------------------------------------------------- loader
def settle_records(records: list[dict[str, Any]], path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records as every reader takes them, and a warning for each that the file does not say as
    it is read: an ok record with a NaN loss (read as diverged), an ok point recorded not ok later."""
    warnings: list[str] = []
    settled = [_settle(r, path, warnings) for r in records]
    return settled, warnings + _superseded_ok(settled, path)


def _superseded_ok(records: list[dict[str, Any]], path: Path) -> list[str]:
    """A run (point and repeat) that was ok and has a later record that is not: no sweep reruns an
    ok run, so the store was edited or merged by hand; the later record is shown, and this says so."""
    ok: set[tuple[str, int]] = set()
    out = []
    for r in records:
        run = run_key(r)
        if r["status"] == "ok":
            ok.add(run)
        elif run in ok:
            repeat = f" (repeat {run[1]})" if run[1] else ""
            out.append(f"{path}: {r.get('point_id', r['key'])}{repeat} has a {r['status']} record after an ok one "
                       "(no sweep reruns an ok run): the later one is shown")
            ok.discard(run)
    return out


def _settle(record: dict[str, Any], path: Path, warnings: list[str]) -> dict[str, Any]:
    """An ``ok`` record whose loss is NaN, infinite or missing (written before such runs were
    ``diverged``, or edited) is read as ``diverged``, with a warning, so no reader counts it ok."""
    why = divergence(record) if record["status"] == "ok" else None
    if why is None:
        return record
    warnings.append(f"{path}: {record.get('point_id', record['key'])} is recorded ok but its {why}: read as diverged")
    return {**record, "status": "diverged", "error": why}


def find_stores(path: str | os.PathLike[str]) -> list[Path]:
    """A store folder, a records.jsonl file, or a folder of stores (e.g. ``results/smoke``)."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"{p}: no such results store (the path does not exist)")
    if p.is_file() and p.name == RECORDS_FILE:
        return [p.parent]
    if reader.exists(p / META_FILE) or reader.exists(p / RECORDS_FILE):
        return [p]  # a damaged meta.json (a link to nothing, say) is named by whoever reads it
    if p.is_dir():
        # one entry per real store: a ``latest`` symlink and its target are the same store
        found: dict[Path, Path] = {}
        for meta in sorted(_metas_under(p), key=lambda m: (m.parent.is_symlink(), str(m))):
            found.setdefault(meta.parent.resolve(), meta.parent)
        if found:
            return sorted(found.values())
    raise StoreError(f"{p}: no results store here (expected {META_FILE} and {RECORDS_FILE})")


def _metas_under(folder: Path) -> list[Path]:
    """Every store's meta.json below ``folder``, symlinked folders not followed. A folder that vanishes
    or cannot be listed while walking (``/proc`` under ``report /``) is passed over, as are stores
    still being made (or a crashed creator's leftovers)."""
    metas = []
    for root, dirs, files in os.walk(folder):  # os.walk skips what it cannot list
        dirs[:] = [d for d in dirs if not d.startswith(CREATING_PREFIX)]
        if META_FILE in files:
            metas.append(Path(root) / META_FILE)
    return metas


def write_claims(path: Path, verdicts: list[dict[str, Any]]) -> None:
    """Record claim verdicts in a store's claims.json (atomically), replacing earlier ones of the same claim."""
    kept = [v for v in read_claims(path) if v.get("name") not in {x.get("name") for x in verdicts}]
    write_json_atomic(path / CLAIMS_FILE, {"schema_version": STORE_SCHEMA_VERSION, "claims": [*kept, *verdicts]})


def read_claims(path: Path) -> list[dict[str, Any]]:
    """The claim verdicts recorded in a store (none when it has no claims.json); a StoreError naming the file
    when it cannot be read."""
    try:
        data = reader.read_json(path / CLAIMS_FILE)
    except FileNotFoundError:
        return []
    claims = data.get("claims") if isinstance(data, dict) else None
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise StoreError(f"{path / CLAIMS_FILE}: expected {{\"claims\": [verdict objects]}}")
    return claims


PathArg = str | os.PathLike  # a store folder, a records.jsonl, or a folder of stores
Meta = dict[str, Any] | list[dict[str, Any]]


@overload
def load_results(
    paths: PathArg | Sequence[PathArg], strict: Literal[True] = ..., latest_only: bool = ...
) -> tuple[Any, Meta]: ...


@overload
def load_results(
    paths: PathArg | Sequence[PathArg], strict: Literal[False], latest_only: bool = ...
) -> tuple[Any, Meta, list[str]]: ...


def load_results(paths: PathArg | Sequence[PathArg], strict: bool = True, latest_only: bool = True):
    """Read one or more stores into a pandas DataFrame, one row per run (point and repeat).

    Returns ``(df, meta)`` with ``strict=True`` (an unreadable line raises StoreError naming
    file and line); ``(df, meta, warnings)`` with ``strict=False`` (unreadable lines are
    skipped and described in ``warnings``). ``meta`` is a dict for a single store and a list
    of dicts when several stores are read. Nested fields are flattened with dots
    (``config.moe.num_experts``, ``layout.strategy``, ``point.moe.num_experts``,
    ``comm_bytes_per_step.ep``); list fields (``step_times_s``, ``losses``) stay lists.
    Columns ``store`` and ``run_id`` say where each row came from; rows are in point order
    within each store, then repeat order (``repeat``: 0 in stores written before repeats). With
    ``latest_only`` a run (point and repeat) that was rerun appears once, with its last record.
    """
    import pandas as pd

    single = isinstance(paths, (str, os.PathLike))
    stores = [s for p in ([paths] if single else paths) for s in find_stores(p)]
    metas: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    for path in stores:
        store = Store(path)
        meta = store.read_meta()
        metas.append(meta)
        records, bad = store.read_records(strict=strict)
        warnings.extend(bad)
        unreadable: list[str] = []
        unsaved = store.unsaved_records(unreadable)
        warnings += unreadable  # even with strict: a side file is not yet the store's (status, report alike)
        if unsaved:
            # finished points whose append failed: theirs are the newest records of the store
            records += [r for _, r in unsaved]
            warnings.append(unsaved_warning(path, unsaved))
        records, settled = settle_records(records, path)
        warnings += settled
        if latest_only:
            records = list({run_key(r): r for r in records}.values())
        for r in records:
            rows.append({**r, "repeat": run_key(r)[1], "store": str(path), "run_id": meta.get("run_id")})
    if rows:
        # point order, not completion order (invalid points are recorded first, Slurm tasks end in any order)
        df = pd.json_normalize(rows, max_level=None)
        if "point_id" in df:
            df = df.sort_values(["store", "point_id", "repeat"], kind="stable",
                                na_position="last").reset_index(drop=True)
    else:
        df = pd.DataFrame(columns=["point_id", "key", "status"])
    df.attrs["warnings"] = warnings
    meta_out: Meta = metas[0] if single and len(metas) == 1 else metas
    if strict:
        return df, meta_out
    return df, meta_out, warnings
