"""Reading small files with a bound: only a regular file under a size cap is read.

A checkpoint's metadata (``config.json``, the index, ``tokenizer.json``, ``tokenizer_config.json``, Orbax's
``_METADATA``), and the batch command's files, could otherwise be a link to ``/dev/zero``, a FIFO or a 20 GB
file, and a plain ``read()`` fills memory before any check runs. Symbolic links are followed (Hugging Face caches
link every file into a blob store), but what a link points to must itself be a regular file within the cap. Every
failure raises the caller's error class (`ConfigError`, `CheckpointError`, `TokenizerError`, `UsageError`)
naming the file, so the CLI exits 2. Standard library only and nothing of ours: every floor may call it (the
config reader in `model/` as much as the batch command).
"""

from __future__ import annotations

import os
import stat

JSON_CAP = 64 << 20  # config.json, index and tokenizer_config.json files; the largest published index is ~10 MB
TOKENIZER_CAP = 512 << 20  # tokenizer.json (DeepSeek-V4's is ~8 MB; large multilingual vocabularies stay far below)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str, error: type[Exception], cap: int | None = None, *, name: str | None = None) -> int:
    """The size of `path`, a regular file (after following links) of at most `cap` bytes; else `error`.

    `name` (a command-line argument such as ``OUTPUT.jsonl``) is given to the error with the path as its value;
    without it the path is the error's source."""
    where = dict(name=name, value=path) if name else dict(source=path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error("does not exist" + (" (a broken link)" if os.path.islink(path) else ""), **where) from None
    except OSError as e:
        raise error(f"cannot be read ({e.strerror})", **where) from None
    if not stat.S_ISREG(st.st_mode):
        link = f"a link to {os.path.realpath(path)}, " if os.path.islink(path) else ""
        raise error(f"is {link}{_kind(st.st_mode)}, not a regular file", **where)
    if cap is not None and st.st_size > cap:
        raise error(f"is {st.st_size:,} bytes, more than the {cap:,} this file may have", **where)
    return st.st_size


def read_bytes(path: str, error: type[Exception], cap: int = JSON_CAP) -> bytes:
    """The content of `path`, checked by `regular_file`; a file that grows past `cap` while read fails too."""
    regular_file(path, error, cap)
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as e:
        raise error(f"cannot be read ({e.strerror})", source=path) from None
    if len(data) > cap:
        raise error(f"grew past the {cap:,} bytes this file may have while it was read", source=path)
    return data


def regular_files(directory: str, names, error: type[Exception], cap: int = JSON_CAP) -> None:
    """`regular_file` for each of `names` present in `directory` (a broken link counts as present): metadata a
    library such as Orbax will read whole."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            regular_file(path, error, cap)
