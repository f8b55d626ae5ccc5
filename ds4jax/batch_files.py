"""The files of ``ds4jax batch``: the input, read line by line; the existing output, scanned for what is finished and
rewritten without the rows to retry; the appender that writes each result as it finishes.

Every problem with a path (missing, a directory, a device such as ``/dev/zero``, a FIFO, no permission, a binary
or UTF-16 input, an output that is not a batch result file, a full disk) raises `UsageError` naming
``INPUT.jsonl`` or ``OUTPUT.jsonl`` (the CLI exits 2), never an internal error. Reads are bounded: only regular
files (links followed), one line at most `MAX_LINE_BYTES`, streamed (memory holds the keys, not the file).

How a rerun replaces a row (`read_output`, then `remove_retried`): the output is read once; the rows to retry are
decided then, and if there are any (or a torn last line from a kill, or a duplicate key), the output is rewritten
*without* them into a temporary file beside it, fsynced and renamed over it (`os.replace`, atomic), before any
request runs. So the file never holds two results for one key, and a kill at any moment loses nothing finished:
before the rename the old file is intact (its failed rows are retried again next time), after it the retried keys
are simply absent until they finish and are appended.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import BinaryIO, Callable, Iterator, NamedTuple

from ds4jax.bounded_read import regular_file
from ds4jax.errors import UsageError

MAX_LINE_BYTES = 64 << 20  # one JSON line, in or out (a 1M-token prompt as ids is ~8 MB)
_SNIFF = 8192  # bytes of the input looked at for a binary or UTF-16/32 file
INPUT, OUTPUT = "INPUT.jsonl", "OUTPUT.jsonl"


class Line(NamedTuple):
    number: int  # 1-based line number in the input
    text: str | None  # the decoded line, or None when `problem` says why it could not be read
    problem: str | None
    digest: str  # of the line's bytes: a result records it, so a rerun sees that its line was edited since


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw.strip()).hexdigest()[:16]


def _raw_lines(f: BinaryIO) -> Iterator[bytes | None]:
    """Lines with their newline; None for a line longer than `MAX_LINE_BYTES` (skipped without holding it)."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
            yield None
            continue
        yield raw


def _open(path: str, name: str, mode: str = "rb"):
    try:
        return open(path, mode)
    except OSError as e:
        raise UsageError(f"cannot be {'read' if 'r' in mode else 'written'} ({e.strerror})", name=name,
                         value=path) from None


def check_input(path: str) -> None:
    """`UsageError` unless `path` is a readable regular file that looks like UTF-8 text."""
    regular_file(path, UsageError, name=INPUT)
    with _open(path, INPUT) as f:
        head = f.read(_SNIFF)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UsageError("is UTF-16 or UTF-32 text (a byte order mark); batch input must be UTF-8 JSON lines",
                         name=INPUT, value=path)
    if b"\0" in head:
        raise UsageError(f"looks binary (a NUL byte at offset {head.index(0)}); batch input must be UTF-8 JSON "
                         "lines", name=INPUT, value=path)


def read_input(path: str) -> Iterator[Line]:
    """The non-blank lines of the input; a line that is not UTF-8 (or too long) comes back with its problem."""
    with _open(path, INPUT) as f:
        for number, raw in enumerate(_raw_lines(f), 1):
            if raw is None:
                yield Line(number, None, f"line {number}: longer than {MAX_LINE_BYTES:,} bytes", "too long")
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors)
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Line(number, None, f"line {number}: not valid UTF-8 (byte {e.start})", _digest(raw))
                continue
            if text.strip():
                yield Line(number, text, None, _digest(raw))


def check_output(path: str) -> None:
    """`UsageError` unless results can be written to `path` (an existing regular file we may append to, or a new
    file in a directory we may create files in); nothing is left behind."""
    if os.path.lexists(path):
        regular_file(path, UsageError, name=OUTPUT)
        _open(path, OUTPUT, "ab").close()
        directory = os.path.dirname(os.path.realpath(path))
    else:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise UsageError(f"cannot be created: {directory} is not a directory", name=OUTPUT, value=path)
    try:  # a retry rewrites the output through a temporary file beside it, which needs the directory too
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise UsageError(f"cannot be written: no file can be created in {directory} ({e.strerror})", name=OUTPUT,
                         value=path) from None


class Existing(NamedTuple):
    done: set[str]  # keys whose result stays in the output
    retried: dict[str, int]  # error code -> rows removed to run again


class Row(NamedTuple):
    """What a rerun needs of one output line: its key, error code and recorded input digest (None when the line
    is torn, i.e. to be dropped)."""

    number: int
    key: str | None
    error: str | None
    input_sha256: str | None


def read_output(path: str) -> list[Row]:
    """The rows of an existing output (none when there is no file), read without changing it; `UsageError` when a
    line is not a batch result: the wrong file (the input given as the output?) is left alone."""
    if not os.path.lexists(path):
        return []
    regular_file(path, UsageError, name=OUTPUT)
    rows = []
    with _open(path, OUTPUT) as f:
        for number, raw in enumerate(_raw_lines(f), 1):
            if raw is not None and not raw.endswith(b"\n"):  # torn by a kill (or a full disk) mid-write
                rows.append(Row(number, None, None, None))
                continue
            row = _result_row(raw)
            if row is None:
                raise UsageError(f"line {number} is not a ds4jax batch result (a JSON object with a \"key\"); is it "
                                 "the right file? (nothing was changed)", name=OUTPUT, value=path)
            rows.append(Row(number, row["key"], row.get("error"), row.get("input_sha256")))
    return rows


def remove_retried(path: str, rows: list[Row], retry: Callable[[Row], bool]) -> Existing:
    """The keys that stay done; the rows for which `retry(row)` holds (and a torn last line, and any repeat of a
    key) are removed from the file first, atomically (the module docstring says how)."""
    done: set[str] = set()
    retried: dict[str, int] = {}
    drop: set[int] = set()
    for row in rows:
        if row.key is None or row.key in done:
            drop.add(row.number)
        elif retry(row):
            drop.add(row.number)
            retried[str(row.error)] = retried.get(str(row.error), 0) + 1
        else:
            done.add(row.key)
    if drop:
        _rewrite_without(path, drop)
    return Existing(done, retried)


def scan_output(path: str, retry: Callable[[Row], bool]) -> Existing:
    """`read_output` then `remove_retried`."""
    return remove_retried(path, read_output(path), retry)


def _result_row(raw: bytes | None) -> dict | None:
    try:
        row = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return row if isinstance(row, dict) and isinstance(row.get("key"), str) else None


def _rewrite_without(path: str, drop: set[int]) -> None:
    """Replace the file behind `path` by a copy without the lines numbered in `drop` (temporary file, fsync,
    rename, fsync of the directory)."""
    real = os.path.realpath(path)  # a link keeps pointing at the rewritten file
    directory = os.path.dirname(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".rewrite", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, _open(real, OUTPUT) as f:
            for number, raw in enumerate(_raw_lines(f), 1):
                if number not in drop:
                    out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, os.stat(real).st_mode & 0o7777)
        os.replace(tmp, real)
    except OSError as e:
        raise UsageError(f"cannot be rewritten without the rows to retry ({e.strerror}); it is unchanged",
                         name=OUTPUT, value=path) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Appender:
    """Appends one JSON line per result, flushed and fsynced, so a kill loses nothing finished. A write that fails
    (a full disk) is kept in `failed` rather than raised inside the engine's callback; the caller stops."""

    def __init__(self, path: str):
        self.path = path
        self.failed: UsageError | None = None
        self._f = _open(path, OUTPUT, "ab")

    def write(self, row: dict) -> None:
        if self.failed is not None:
            return
        try:
            self._f.write(json.dumps(row).encode("utf-8") + b"\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            self.failed = UsageError(f"cannot be written ({e.strerror}); a rerun resumes after the last whole "
                                     "line", name=OUTPUT, value=self.path)

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as e:  # the last flush on a full disk
            self.failed = self.failed or UsageError(f"cannot be written ({e.strerror})", name=OUTPUT, value=self.path)
