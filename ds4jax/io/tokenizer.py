"""Tokenizers for the command line: a checkpoint's own ``tokenizer.json`` or a byte-level fallback.

`encode` never adds special tokens by itself; callers ask for a leading BOS with ``add_bos=True``, so the
same rule holds whatever post-processor a ``tokenizer.json`` declares.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol, Sequence

from ds4jax.bounded_read import TOKENIZER_CAP, regular_file
from ds4jax.errors import TokenizerError  # noqa: F401 (re-exported: importable from here too)


def unencodable_at(text: str) -> int | None:
    """Where `text` stops being encodable as UTF-8 (a lone surrogate: what a JSON ``"\\ud800"`` escape decodes to,
    or an argv byte that was not UTF-8), or None. No tokenizer can take such a text: the byte-level one raised
    UnicodeEncodeError, and a server answered it with a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    note: str  # one line saying which tokenizer this is and why

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...  # one token's own bytes (part of a character, maybe)


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids: BOS 0, EOS 1, PAD 2, byte b -> b + 3 (vocabulary 259).

    BOS/EOS match `Config`'s default ``bos_token_id``/``eos_token_id``."""

    BOS, EOS, PAD = 0, 1, 2
    OFFSET = 3
    VOCAB_SIZE = OFFSET + 256

    def __init__(self, note: str = "byte-level tokenizer"):
        self.bos_id, self.eos_id, self.pad_id = self.BOS, self.EOS, self.PAD
        self.note = note

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.BOS] if add_bos else []) + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Special and out-of-range ids are dropped; invalid UTF-8 (a random model emits plenty) becomes U+FFFD."""
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The byte of a byte id; b"" for the special ids."""
        return bytes([token - self.OFFSET]) if self.OFFSET <= token < self.VOCAB_SIZE else b""


class HFTokenizer:
    """A ``tokenizer.json`` read by the `tokenizers` package."""

    def __init__(self, path: str, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer as _Tokenizer

        regular_file(path, TokenizerError, TOKENIZER_CAP)  # from_file would read a link to /dev/zero forever
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise TokenizerError(f"cannot read {path}: {e}") from None
        self.bos_id, self.eos_id = bos_id, eos_id
        self.note = f"tokenizer from {path}"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """A byte-level BPE token's bytes (its characters mapped back through the byte-to-character table); a
        special or non-byte-level token's UTF-8 text."""
        piece = self._tok.id_to_token(int(token))
        if piece is None:
            return b""
        table = _byte_level_table()
        if type(self._tok.decoder).__name__ == "ByteLevel" and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's character -> byte map (GPT-2's): printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _read_json(path: str) -> dict[str, Any]:
    """An optional JSON object file ({} when absent); anything else in it raises `TokenizerError` naming it."""
    if not os.path.exists(path):
        return {}
    from ds4jax.model.config import read_json

    d = read_json(path, TokenizerError)
    if not isinstance(d, dict):
        raise TokenizerError("must be a JSON object", source=path, value=type(d).__name__)
    return d


def _special_id(tok: HFTokenizer, tok_cfg: dict, model_cfg: dict, which: str, vocab_size: int | None,
                directory: str) -> int | None:
    """``<which>_token`` of tokenizer_config.json (a string or {"content": ...}), else config.json's id."""
    token = tok_cfg.get(f"{which}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tok._tok.token_to_id(token) is not None:
        return tok._tok.token_to_id(token)
    value = model_cfg.get(f"{which}_token_id")
    if isinstance(value, (list, tuple)):  # HF allows several eos ids; the first one stops generation here
        value = value[0] if value else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (vocab_size and value >= vocab_size):
        raise TokenizerError(f"must be a token id in [0, {vocab_size or 'vocab'})",
                             source=os.path.join(directory, "config.json"), name=f"{which}_token_id", value=value)
    return value


def load_tokenizer(checkpoint_dir: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
    """The checkpoint's ``tokenizer.json`` if it ships one, else `ByteTokenizer` (which needs vocab_size >= 259).

    BOS/EOS come from ``tokenizer_config.json`` (``bos_token``/``eos_token``), else ``config.json`` ids."""
    directory = os.fspath(checkpoint_dir)
    path = os.path.join(directory, "tokenizer.json")
    if os.path.exists(path):
        tok = HFTokenizer(path, None, None)
        tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(directory, "config.json"))
        tok.bos_id = _special_id(tok, tok_cfg, model_cfg, "bos", vocab_size, directory)
        tok.eos_id = _special_id(tok, tok_cfg, model_cfg, "eos", vocab_size, directory)
        return tok
    if vocab_size is not None and vocab_size < ByteTokenizer.VOCAB_SIZE:
        raise TokenizerError(f"{directory} has no tokenizer.json and its vocabulary ({vocab_size}) is too small "
                             f"for the byte-level fallback (needs {ByteTokenizer.VOCAB_SIZE})")
    return ByteTokenizer(note=f"{directory} has no tokenizer.json; using the byte-level tokenizer")
