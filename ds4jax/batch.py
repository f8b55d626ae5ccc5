"""``ds4jax batch INPUT.jsonl OUTPUT.jsonl``: resumable batch generation through one `Engine`.

Input: one JSON object per line with ``id`` and ``prompt`` (text, or a list of token ids), optionally
``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_ids``, ``stop_strings`` and
``speculative`` (0 = plain decoding for this request). Output: one JSON object per line with ``id``, ``line``,
``text``, ``tokens``, ``finish_reason``, ``error``, ``message``, ``timings``.

* every result is appended and flushed the moment it finishes, so a crash, a kill or Ctrl-C loses nothing
  finished; a rerun skips the ids already done. It runs again the rows that failed for reasons outside the
  request (``internal``, ``cancelled``, ``non_finite``) and those whose input line was edited since; with
  ``--retry-failed`` every failed row. A retried row is first removed from the output (an atomic rewrite, see
  `ds4jax.batch_files`), so each id's final result appears exactly once;
* a line that is not UTF-8, not JSON, has no id, repeats an id or has a bad field becomes an error result naming
  its line number while the other lines run; a request the engine rejects becomes an error result with its
  `ErrorCode`. Bad flags and paths (a directory, ``/dev/zero``, no permission, a binary file) fail before any row;
* a tqdm progress bar counts finished requests and shows generated tokens/s; a summary line ends the run;
* in a job of several processes (``ds4jax launch ... -- ds4jax batch ... --mesh ...``) every process runs the
  engine and process 0 alone rewrites and appends to the output (and decides, for all, which ids a rerun skips).
"""

from __future__ import annotations

import json
import sys
import time

_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids", "stop_strings", "speculative"}


def add_parser(sub) -> None:
    from ds4jax.commands.engine_options import add_engine_options
    from ds4jax.commands.options import integer, non_negative_float, non_negative_int, positive_int, probability

    p = sub.add_parser("batch", help="generate for every line of a JSONL file (resumable)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("input", metavar="INPUT.jsonl", help="one JSON object per line: id, prompt, optional fields")
    p.add_argument("output", metavar="OUTPUT.jsonl", help="results, appended; ids already done there are skipped")
    add_engine_options(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="default per request")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="default per request (0 = greedy)")
    p.add_argument("--top-p", type=probability, default=1.0, metavar="P", help="default per request")
    p.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="default per request (0 = off)")
    p.add_argument("--seed", type=integer, default=0, metavar="S", help="default per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--retry-failed", action="store_true",
                   help="also run again the rows that failed because of the request (invalid_request, "
                        "prompt_too_long, ...); a rerun always retries internal, cancelled and non_finite failures")


def _parse(lineno: int, raw: str, defaults: dict, seen: set):
    """-> (key, id, kwargs for Request) or (key, id, error message)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"line:{lineno}", None, f"line {lineno}: invalid JSON ({e.msg})"
    except RecursionError:  # nested deeper than Python's parser recurses: this line's problem, not the run's
        return f"line:{lineno}", None, f"line {lineno}: invalid JSON (arrays or objects nested too deeply)"
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


# Failures that say nothing about the request (the engine or the run failed): a rerun tries them again by default.
RETRIED_BY_DEFAULT = frozenset({"internal", "cancelled", "non_finite"})


def _retry(row, *, retry_failed: bool, digests: dict[str, str]) -> bool:
    """Whether a rerun removes this output row (a `batch_files.Row`) and runs its request again (docs/errors.md,
    batch reruns)."""
    key, error = row.key, row.error
    if error is None:
        return False  # a finished result is final
    recorded, current = row.input_sha256, digests.get(key)
    if key.startswith("line:"):  # a line that could not be read or parsed: no id, so only the line speaks for it
        return retry_failed or (recorded is not None and recorded != current)
    if current is None:
        return False  # the id is no longer in the input: its result stays as it is
    return retry_failed or error in RETRIED_BY_DEFAULT or (recorded is not None and recorded != current)


def _sampling_defaults(args) -> dict:
    """The flag-level sampling defaults, checked as one `Request` is (`generation.request_checks`), so a bad value
    fails up front naming its flag instead of failing every row."""
    from ds4jax.errors import ArgumentError, UsageError
    from ds4jax.generation.request_checks import check_request
    from ds4jax.generation.requests import Request

    defaults = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    try:
        check_request(Request(prompt=[0], **defaults), where="")
    except ArgumentError as e:
        field = (e.name or "").lstrip(".")
        raise UsageError(e.message, name="--" + field.replace("_", "-"), value=e.value) from None
    if args.max_new_tokens >= args.max_context:
        raise UsageError(f"leaves no room for a prompt in --max-context {args.max_context}", name="--max-new-tokens",
                         value=args.max_new_tokens)
    return defaults


def run(args, model=None, tokenizer=None) -> int:
    from tqdm import tqdm

    from ds4jax import batch_files as files
    from ds4jax.commands.engine_options import build_engine, check_engine_values
    from ds4jax.generation.requests import ErrorCode, GenerateResult, Request
    from ds4jax.runtime import distributed

    # every check that needs no model comes first: a bad flag or path fails in a second, before any row
    check_engine_values(args)
    defaults = _sampling_defaults(args)
    files.check_input(args.input)
    files.check_output(args.output)
    previous = files.read_output(args.output)
    if model is None:
        from ds4jax.cli import _load, enable_compilation_cache

        enable_compilation_cache()
        model, tokenizer = _load(args)
    if model.config.eos_token_id is not None:
        defaults["stop_ids"] = (model.config.eos_token_id,)
    engine = build_engine(model, args, tokenizer)  # the engine `ds4jax warmup` with these flags compiles

    rows, seen, digests = [], set(), {}
    for line in files.read_input(args.input):
        digests[f"line:{line.number}"] = line.digest
        if line.text is None:
            key, rid, parsed = f"line:{line.number}", None, line.problem
        else:
            key, rid, parsed = _parse(line.number, line.text, defaults, seen)
        digests.setdefault(key, line.digest)
        rows.append((key, rid, line.number, line.digest, parsed))
    retry_failed = getattr(args, "retry_failed", False)
    # a multi-process job (`ds4jax launch`): every process runs the same engine on the same requests (SPMD) and
    # process 0 alone rewrites and appends to the output; the others take its list of ids already done
    writer = distributed.process_index() == 0
    existing = files.remove_retried(args.output, previous,
                                    lambda row: _retry(row, retry_failed=retry_failed, digests=digests)) \
        if writer else None
    done = set(distributed.broadcast("batch ids done", sorted(existing.done) if writer else None))
    todo = [r for r in rows if r[0] not in done]
    out = files.Appender(args.output) if writer else None
    written: dict[str, int] = {}

    def write(key, rid, lineno, digest, result: GenerateResult) -> None:
        if out is None:
            return
        out.write({"key": key, "id": rid, "line": lineno, "input_sha256": digest, **result.to_json()})
        code = result.error.value if result.error else "ok"
        written[code] = written.get(code, 0) + 1

    before = f"{len(done)} done before" if done else None
    bar = tqdm(total=len(todo), unit="req", disable=args.no_progress or not writer, file=sys.stderr, desc=before)
    tokens, start = [0], time.perf_counter()
    try:
        valid = []
        for key, rid, lineno, digest, parsed in todo:
            if isinstance(parsed, str):
                write(key, rid, lineno, digest, GenerateResult(error=ErrorCode.INVALID_REQUEST, message=parsed))
                bar.update(1)
                continue
            try:
                valid.append((key, rid, lineno, digest, Request(**parsed)))
            except TypeError as e:
                write(key, rid, lineno, digest,
                      GenerateResult(error=ErrorCode.INVALID_REQUEST, message=f"line {lineno}: {e}"))
                bar.update(1)
        if valid and (out is None or out.failed is None):
            def finished(i: int, result: GenerateResult) -> None:
                key, rid, lineno, digest, _ = valid[i]
                if result.error is not None and result.message:
                    result.message = f"line {lineno}: {result.message}"
                write(key, rid, lineno, digest, result)
                tokens[0] += len(result.tokens)
                bar.update(1)
                bar.set_postfix(tok_s=f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.1f}")

            for _ in engine.stream([q for *_, q in valid], on_result=finished):
                if out is not None and out.failed is not None:
                    break  # the output cannot take more (a full disk): leaving the stream cancels the rest
    finally:
        bar.close()
        if out is not None:
            out.close()
    if out is None:
        return 0
    if out.failed is not None:
        raise out.failed
    if not getattr(args, "quiet", False):
        print(f"ds4jax: batch: {_summary(written, existing, retry_failed)}", file=sys.stderr)
    return 0


def _summary(written: dict[str, int], existing, retry_failed: bool) -> str:
    counts = lambda d: ", ".join(f"{n} {code}" for code, n in sorted(d.items())) or "none"
    text = f"wrote {sum(written.values())} results ({counts(written)})"
    if existing.done:
        text += f"; {len(existing.done)} were done before"
    if existing.retried:
        text += f"; retried {counts(existing.retried)}"
    failed = sum(n for code, n in written.items() if code != "ok" and code not in RETRIED_BY_DEFAULT)
    if failed and not retry_failed:
        text += f"; {failed} failed because of their request (--retry-failed runs them again)"
    return text


def main(argv=None) -> int:
    from ds4jax import cli

    return cli.main(["batch", *(sys.argv[1:] if argv is None else argv)])
