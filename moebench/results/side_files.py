"""Side files: records that records.jsonl could not take (a full disk, a read-only file system), kept
one per file in the store's ``unsaved/`` (or, that disk being full too, the user's cache) until the
next sweep on the store merges them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.record import to_json_line
from moebench.results.durable import append_line, write_failed, write_text_atomic
from moebench.results.lines import read_record_file

UNSAVED_DIR = "unsaved"
# The field a side file's record carries: the run id of the store that kept it (removed on merging).
UNSAVED_FROM = "unsaved_by_run"


class SideFiles:
    """The side files of a store (a mixin of :class:`~moebench.results.store.Store`, which gives it
    ``path``, ``records_path``, ``run_id`` and ``read_records``): where a record waits when
    records.jsonl cannot take it, and its merge back."""

    path: Path

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
            read = read_record_file(path)
            if read is None:
                continue  # merged meanwhile
            record, problem = read
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


def unsaved_warning(path: Path, unsaved: list[tuple[Path, dict[str, Any]]]) -> str:
    """What readers of a store say about records that wait in side files (:meth:`Store.unsaved_records`)."""
    folders = ", ".join(sorted({str(f.parent) for f, _ in unsaved}))
    return (f"{path}: {len(unsaved)} record(s) kept in side files after a failed write ({folders}); "
            "the next `moebench run --resume` on the store merges them into records.jsonl")

