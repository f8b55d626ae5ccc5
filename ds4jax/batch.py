"""``ds4jax batch INPUT.jsonl OUTPUT.jsonl``: resumable batch generation through one `Engine`.

Input: one JSON object per line with ``id`` and ``prompt`` (text, or a list of token ids), optionally
``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_ids``, ``stop_strings`` and
``speculative`` (0 = plain decoding for this request). Output: one JSON object per line with ``id``, ``line``,
``text``, ``tokens``, ``finish_reason``, ``error``, ``message``, ``timings``.

* every result is appended and flushed the moment it finishes, so a crash, a kill or Ctrl-C loses nothing
  finished; a rerun skips the ids already in the output (a torn last line from a kill is dropped first);
* an invalid line (bad JSON, no id, a duplicate id, a bad field) becomes an error result naming its line number,
  never a crash; a request the engine rejects becomes an error result with its `ErrorCode`;
* a tqdm progress bar counts finished requests and shows generated tokens/s;
* in a job of several processes (``ds4jax launch ... -- ds4jax batch ... --mesh ...``) every process runs the
  engine and process 0 alone writes the output (and decides, for all, which ids a rerun skips).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids", "stop_strings", "speculative"}


def add_parser(sub) -> None:
    from ds4jax.commands.engine_options import add_engine_options

    p = sub.add_parser("batch", help="generate for every line of a JSONL file (resumable)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("input", metavar="INPUT.jsonl", help="one JSON object per line: id, prompt, optional fields")
    p.add_argument("output", metavar="OUTPUT.jsonl", help="results, appended; ids already there are skipped")
    add_engine_options(p)
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="default per request")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default per request (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="default per request")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="default per request (0 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="default per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _done_keys(path: str) -> set[str]:
    """Keys of the results already in `path`; a torn last line (a kill mid-write) is cut off first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)
            data = data[:cut]
    keys = set()
    for raw in data.decode("utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "key" in obj:
            keys.add(obj["key"])
    return keys


def _parse(lineno: int, raw: str, defaults: dict, seen: set):
    """-> (key, id, kwargs for Request) or (key, id, error message)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"line:{lineno}", None, f"line {lineno}: invalid JSON ({e.msg})"
    if not isinstance(obj, dict) or "id" not in obj:
        return f"line:{lineno}", None, f"line {lineno}: expected an object with 'id' and 'prompt'"
    rid = obj["id"]
    key = f"id:{json.dumps(rid)}"
    if key in seen:
        return f"line:{lineno}", rid, f"line {lineno}: duplicate id {rid!r}"
    seen.add(key)
    if "prompt" not in obj or not isinstance(obj["prompt"], (str, list)):
        return key, rid, f"line {lineno}: 'prompt' must be text or a list of token ids"
    unknown = set(obj) - _FIELDS - {"id", "prompt"}
    if unknown:
        return key, rid, f"line {lineno}: unknown fields {sorted(unknown)}"
    kw = dict(defaults)
    kw.update({k: obj[k] for k in _FIELDS if k in obj})
    for name in ("stop_ids", "stop_strings"):
        if not isinstance(kw.get(name, ()), (list, tuple)):
            return key, rid, f"line {lineno}: '{name}' must be a list"
        kw[name] = tuple(kw.get(name, ()))
    for name in ("max_new_tokens", "top_k", "seed"):
        if not isinstance(kw.get(name, 0), int) or isinstance(kw.get(name), bool):
            return key, rid, f"line {lineno}: '{name}' must be an integer"
    for name in ("temperature", "top_p"):
        if not isinstance(kw.get(name, 0.0), (int, float)):
            return key, rid, f"line {lineno}: '{name}' must be a number"
    return key, rid, dict(kw, prompt=obj["prompt"])


def run(args, model=None, tokenizer=None) -> int:
    from tqdm import tqdm

    from ds4jax.commands.engine_options import build_engine
    from ds4jax.generation.requests import ErrorCode, GenerateResult, Request

    if model is None:
        from ds4jax.cli import _load, enable_compilation_cache

        enable_compilation_cache()
        model, tokenizer = _load(args)
    if not os.path.exists(args.input):
        from ds4jax.errors import UsageError

        raise UsageError(f"input file {args.input!r} does not exist")
    from ds4jax.runtime import distributed

    # a multi-process job (`ds4jax launch`): every process runs the same engine on the same requests (SPMD) and
    # process 0 alone reads, trims and appends to the output; the others take its list of ids already done
    writer = distributed.process_index() == 0
    done = set(distributed.broadcast("batch ids done", sorted(_done_keys(args.output)) if writer else None))
    defaults = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    if model.config.eos_token_id is not None:
        defaults["stop_ids"] = (model.config.eos_token_id,)
    todo, seen = [], set()
    with open(args.input, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            key, rid, parsed = _parse(lineno, raw, defaults, seen)
            if key not in done:
                todo.append((key, rid, lineno, parsed))
    out = open(args.output, "a", encoding="utf-8") if writer else None

    def write(key, rid, lineno, result: GenerateResult) -> None:
        if out is None:
            return
        row = {"key": key, "id": rid, "line": lineno, **result.to_json()}
        out.write(json.dumps(row) + "\n")
        out.flush()
        os.fsync(out.fileno())

    bar = tqdm(total=len(todo), unit="req", disable=args.no_progress or not writer, file=sys.stderr,
               desc=f"{len(done)} done before" if done else None)
    tokens, start = [0], time.perf_counter()
    try:
        valid = []
        for key, rid, lineno, parsed in todo:
            if isinstance(parsed, str):
                write(key, rid, lineno, GenerateResult(error=ErrorCode.INVALID_REQUEST, message=parsed))
                bar.update(1)
                continue
            try:
                valid.append((key, rid, lineno, Request(**parsed)))
            except TypeError as e:
                write(key, rid, lineno, GenerateResult(error=ErrorCode.INVALID_REQUEST, message=f"line {lineno}: {e}"))
                bar.update(1)
        if valid:
            engine = build_engine(model, args, tokenizer)  # the engine `ds4jax warmup` with these flags compiles

            def finished(i: int, result: GenerateResult) -> None:
                key, rid, lineno, _ = valid[i]
                if result.error is not None and result.message:
                    result.message = f"line {lineno}: {result.message}"
                write(key, rid, lineno, result)
                tokens[0] += len(result.tokens)
                bar.update(1)
                bar.set_postfix(tok_s=f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.1f}")

            engine.generate([q for *_, q in valid], on_result=finished)
    finally:
        bar.close()
        if out is not None:
            out.close()
    return 0


def main(argv=None) -> int:
    from ds4jax import cli

    return cli.main(["batch", *(sys.argv[1:] if argv is None else argv)])
