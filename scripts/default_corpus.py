"""Corpus and tokenizer of the default model: the Python 3.11 standard library's sources (PSF License).

Every machine with CPython 3.11 has these files (python.org builds, Debian's ``libpython3.11-stdlib``, pyenv);
nothing is downloaded. Files are split by a hash of their relative path into train and held-out (the held-out
files are never trained on, nor used to train the tokenizer). Writes into --out:

    manifest.json        Python version, license, every file with its sha256, byte count and split
    tokenizer.json       byte-level BPE (tokenizers library) with <|bos|> 0, <|eos|> 1, <|pad|> 2
    tokenizer_config.json
    train.npy, heldout.npy   uint16 token streams: per file <|bos|> + tokens + <|eos|>
    token_bytes.npy      UTF-8 bytes each token id decodes to (0 for special tokens): bits per byte

    python scripts/default_corpus.py --out build/corpus [--stdlib DIR] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig

import numpy as np

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2: Config's default bos/eos ids
HELDOUT_EVERY = 40  # a file is held out when sha256(relative path) % 40 == 0 (about 2.5 % of the files)
SKIP_DIRS = {"site-packages", "lib-dynload", "__pycache__"}


def stdlib_files(root: str) -> list[str]:
    """Relative paths of the UTF-8 ``*.py`` files under `root`, sorted (deterministic)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def read_corpus(root: str) -> tuple[list[dict], dict[str, list[str]]]:
    """(manifest entries, {"train": texts, "heldout": texts}); files that are not valid UTF-8 are skipped."""
    entries, texts = [], {"train": [], "heldout": []}
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test files are deliberately mis-encoded
        split = "heldout" if is_heldout(rel) else "train"
        entries.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "split": split})
        texts[split].append(text)
    return entries, texts


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def byte_level_inverse() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode) inverted: printable char -> byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_byte_lengths(tok) -> np.ndarray:
    inv = byte_level_inverse()
    out = np.zeros(tok.get_vocab_size(), np.int32)
    for token, i in tok.get_vocab().items():
        if token not in SPECIALS:
            out[i] = len(bytes(inv[c] for c in token))
    return out


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.append(np.asarray([bos] + enc.ids + [eos], np.uint16))
    return np.concatenate(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    entries, texts = read_corpus(args.stdlib)
    tok = train_tokenizer(texts["train"], args.vocab)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    np.save(os.path.join(args.out, "token_bytes.npy"), token_byte_lengths(tok))
    summary = {}
    for split in ("train", "heldout"):
        ids = encode_stream(tok, texts[split])
        np.save(os.path.join(args.out, f"{split}.npy"), ids)
        n_bytes = sum(e["bytes"] for e in entries if e["split"] == split)
        summary[split] = {"files": sum(e["split"] == split for e in entries), "bytes": n_bytes, "tokens": int(ids.size)}
        print(f"{split}: {summary[split]}, {n_bytes / ids.size:.2f} bytes/token", flush=True)
    manifest = {
        "corpus": f"Python {platform.python_version()} standard library sources (*.py)",
        "license": "PSF License Agreement (Python Software Foundation License Version 2), see LICENSE.txt",
        "license_sha256": _sha256(os.path.join(args.stdlib, "LICENSE.txt")),
        "root": args.stdlib, "python": sys.version.split()[0], "heldout_rule": f"sha256(path) % {HELDOUT_EVERY} == 0",
        "vocab_size": tok.get_vocab_size(), "summary": summary, "files": entries,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return 0


def _sha256(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


if __name__ == "__main__":
    sys.exit(main())
