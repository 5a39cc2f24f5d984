"""Reading a store's files as if anyone could have put anything there.

A store folder is shared (NFS home folders, a results tree others copy into), so what a reader
finds under a name may not be what a sweep wrote: a link to ``/dev/zero``, a FIFO, a symlink
loop, a 200 MB file, binary garbage, JSON nested 100k deep. Every store file is read here:

- the file type is checked before it is opened (``os.stat`` + ``S_ISREG``), and the descriptor
  again after (``O_NONBLOCK``: a FIFO swapped in between cannot block the open), so a device or
  a FIFO is never read; a symlink loop or a link to nothing is named, never taken for "absent";
- a file is read up to :data:`MAX_FILE_BYTES`, a line up to :data:`MAX_LINE_BYTES` (the rest of
  a longer line is skipped without holding it);
- JSON is parsed without unbounded recursion (Python's parser recurses: its RecursionError is
  caught) and refused deeper than :data:`MAX_JSON_DEPTH` (pandas recurses through what we keep);
  ``NaN`` and ``Infinity``, which JSON lacks and our writer never writes, are read as null.

Each problem is one :class:`~moebench.errors.StoreError` line naming the file: strict commands
exit 2 with it, lenient ones print it as a warning and go on without that file or line.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moebench.errors import StoreError

# A store of 10k records with their raw samples is a few tens of MB: these bounds only stop files
# that no sweep wrote (tests lower them).
MAX_FILE_BYTES = 256 * 2**20
MAX_LINE_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64  # a record nests 4 deep
_CHUNK = 2**20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def regular_file(path: Path) -> os.stat_result | None:
    """The stat of ``path`` if it is a regular file (through links); None when nothing is there.

    Anything else present under the name is a StoreError naming it: a directory, a FIFO, a
    device, a socket, a symlink loop, a link to nothing, a path that cannot be looked at.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise StoreError(f"{path}: a symbolic link to nothing ({os.readlink(path)!r} does not exist)") from None
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path}: a symbolic link loop") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise StoreError(f"{str(path)[:120]}...: path too long ({exc.strerror})") from None
        raise StoreError(f"{path}: cannot look at it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise StoreError(f"{path}: {kind}, not a regular file; not read")
    return st


def appendable(path: Path) -> None:
    """Refuse to append to ``path`` unless it is absent or a regular file a reader can read back:
    appending to a FIFO blocks, to a device loses the line, to an oversized file hides it."""
    st = regular_file(path)
    if st is not None and st.st_size > MAX_FILE_BYTES:
        raise StoreError(f"{path}: {_mib(st.st_size)}, over the {_mib(MAX_FILE_BYTES)} a store file may hold; "
                         "not adding to it")


def exists(path: Path) -> bool:
    """Whether anything is under ``path``, a broken link included (``Path.exists`` says no to
    those, and a reader would take a damaged store file for one not written yet)."""
    return os.path.lexists(path)


def _open(path: Path):
    if regular_file(path) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped for something else between the stat and the open
        os.close(fd)
        raise StoreError(f"{path}: not a regular file; not read")
    if st.st_size > MAX_FILE_BYTES:
        os.close(fd)
        raise StoreError(f"{path}: {_mib(st.st_size)}, over the {_mib(MAX_FILE_BYTES)} a store file may hold; not read")
    return os.fdopen(fd, "rb")


def read_bytes(path: Path) -> bytes:
    """The whole file (FileNotFoundError when nothing is there, StoreError for anything wrong)."""
    with _open(path) as f:
        try:
            data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:  # grew after the stat
        raise StoreError(f"{path}: over the {_mib(MAX_FILE_BYTES)} a store file may hold; not read")
    return data


def lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line with its newline) of a text file, or (line number, None) for a line
    over :data:`MAX_LINE_BYTES`, which is skipped without being kept. FileNotFoundError when
    nothing is there, StoreError when the file itself cannot be read."""
    with _open(path) as f:
        lineno = 0
        try:
            while True:
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                lineno += 1
                if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
                    yield lineno, (line if len(line) <= MAX_LINE_BYTES else None)
                    continue
                while line and not line.endswith(b"\n"):  # the rest of the long line, a chunk at a time
                    line = f.readline(_CHUNK)
                yield lineno, None
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None


def too_long(path: Path | str, lineno: int) -> str:
    return f"{path}:{lineno}: line longer than {_mib(MAX_LINE_BYTES)}; skipped"


def _non_finite(_constant: str) -> None:
    return None


class TooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`: whole, but not ours."""


def parse_json(data: bytes) -> Any:
    """Parse JSON bytes; ValueError with a short reason (not UTF-8, the parser's message, or
    :class:`TooDeep`)."""
    try:
        # decoded here: json.loads guesses the encoding of bytes, and NULs make it guess UTF-32
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None
    try:
        value = json.loads(text.removeprefix("\ufeff"), parse_constant=_non_finite)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise TooDeep(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise TooDeep(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """How deep ``value`` nests, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json(path: Path) -> Any:
    """A whole JSON file: FileNotFoundError when nothing is there, else its value or a StoreError
    naming the file and the problem."""
    data = read_bytes(path)
    try:
        return parse_json(data)
    except TooDeep as exc:
        raise StoreError(f"{path}: {exc}") from None
    except ValueError as exc:
        raise StoreError(f"{path}: corrupt JSON ({exc})") from None
