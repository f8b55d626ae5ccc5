"""``ds4jax generate``: print the continuation of a prompt as it is produced.

Input must be UTF-8: a ``--prompt`` or ``--prompt-file`` that is not valid UTF-8 is an error (exit 2) naming the
byte offset. Output: bytes the model emits that are not valid UTF-8 print as U+FFFD, control characters are
escaped (``\\x1b``), so the terminal cannot be driven by generated text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import unicodedata

from ds4jax.commands.engine_options import add_kv_dtype_option, add_lookup_option, add_numerics_option
from ds4jax.commands.mesh_options import add_mesh_option
from ds4jax.commands.options import HelpFormatter, Progress, integer, non_negative_float, positive_int, probability

NAME = "generate"
STREAM_STEPS = 1  # one token per host call: each token prints as soon as it is sampled (docs/serving.md measures it)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="generate a continuation of a prompt",
                       description="Generate text, printing tokens as they are produced. Without --checkpoint, "
                                   "runs the default model (checkpoints/default: a small DeepSeek-V4 trained on the "
                                   "Python standard library).",
                       formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (UTF-8)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file; - reads stdin")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: checkpoints/default)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="tokens to generate at most")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0, metavar="P", help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=integer, default=0, metavar="S", help="sampling seed (the output depends on it only)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="C",
                   help="prefill the prompt in chunks of C tokens (default: one chunk)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (default: bfloat16 for a checkpoint, float32 for the default model)")
    p.add_argument("--speculative", type=positive_int, default=None, metavar="K",
                   help="speculative decoding: the checkpoint's MTP block drafts K tokens per round (greedy output "
                        "is identical to plain decoding in float32; in bfloat16 it can part on near-ties); "
                        "acceptance stats on stderr")
    add_lookup_option(p)
    add_kv_dtype_option(p)
    add_numerics_option(p)
    p.add_argument("--steps-per-call", type=positive_int, default=STREAM_STEPS, metavar="M",
                   help="decode steps (speculative rounds) per host round trip: tokens print as each call returns, "
                        "so 1 prints every token as it is sampled; larger M trades smoothness for throughput")
    p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="skip the NaN/Inf checks of the checkpoint's weights (at load) and of the logits (each step)")
    add_mesh_option(p)
    return p


# ---- input ---------------------------------------------------------------------------------------------------------

def read_prompt(args) -> str:
    from ds4jax.errors import UsageError

    if args.prompt is not None:
        from ds4jax.io.tokenizer import unencodable_at

        at = unencodable_at(args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
        if at is not None:
            raise UsageError(f"is not valid UTF-8 (character {at})", name="--prompt")
        return args.prompt
    path = args.prompt_file
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise UsageError(f"cannot be read ({e.strerror})", name="--prompt-file", value=path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"is not valid UTF-8 (byte {e.start})", name="--prompt-file",
                         value="<stdin>" if path == "-" else path) from None


def _config_and_tokenizer(args):
    from ds4jax.io import default_model as _default
    from ds4jax.io.tokenizer import load_tokenizer
    from ds4jax.model.config import load_config

    if args.checkpoint is None:
        return _default.default_config(), _default.default_tokenizer()
    path = require_checkpoint(args.checkpoint)
    cfg = load_config(path)
    return cfg, load_tokenizer(path, cfg.vocab_size)


def require_checkpoint(path: str) -> str:
    from ds4jax.errors import UsageError

    if not os.path.isdir(path):
        raise UsageError("does not exist" if not os.path.exists(path) else "is not a directory",
                         name="--checkpoint", value=path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise UsageError("has no config.json; is it a checkpoint directory?", name="--checkpoint", value=path)
    return path


def load_model(args):
    """The model `args` names (the checkpoint's weights checked for NaN/Inf unless --no-check-finite), placed on
    --mesh when given (a multi-process job is joined, and its processes checked to agree, before any weight is
    read)."""
    import jax.numpy as jnp

    from ds4jax.commands.mesh_options import check_agreement, mesh_layout
    from ds4jax.io import checkpoint
    from ds4jax.io.default_model import default_model
    from ds4jax.model.config import load_config

    cfg = None if args.checkpoint is None else load_config(require_checkpoint(args.checkpoint))
    layout = mesh_layout(args, cfg)  # joins a multi-process job first; None: one device
    check_agreement(args, args.checkpoint)
    # only a non-default choice is passed on (a Namespace built by hand may not carry it; stand-in loaders need not)
    numerics = {} if getattr(args, "numerics", "reference") == "reference" else {"numerics": args.numerics}
    if args.checkpoint is None:
        model = default_model(jnp.dtype(args.dtype or "float32"), **numerics)
        if layout is None:
            return model
        from ds4jax.runtime.mesh import place_model

        return place_model(model, layout)
    return checkpoint.load(require_checkpoint(args.checkpoint), dtype=jnp.dtype(args.dtype or "bfloat16"),
                           check_finite=getattr(args, "check_finite", True), mesh=layout, **numerics)


def prefetch_programs(args, prompt_tokens: int) -> int:
    """Start loading the compiled programs that the last run with these arguments and this prompt length asked for
    first (`executable_cache.prefetch`; nothing when that cache is off): they deserialize on threads while the
    weights load and the pools are allocated, where they took ~1.2 s of a cached run's 2-core CPU start-up in
    series (docs/benchmarks/cli_startup.md). Returns how many loads started."""
    from ds4jax.runtime import executable_cache

    if not executable_cache.enabled():
        return 0
    skip = ("prompt", "prompt_file", "quiet", "debug", "sizes")  # what cannot change a program
    settings = sorted((k, v) for k, v in vars(args).items() if k not in skip and not callable(v))
    where = os.environ.get("DS4JAX_DEFAULT_CHECKPOINT")
    return executable_cache.prefetch(repr((NAME, prompt_tokens, where, settings)))


def _check_speculative(cfg, k: int, prompt_len: int, max_new: int) -> None:
    """Size the pools now (from the config alone), so an impossible K fails before the weights load."""
    from ds4jax.generation.generate import default_page_size
    from ds4jax.runtime.pool_spec import PoolSpec
    from ds4jax.runtime.roles import Role

    from ds4jax.errors import PoolSpecError, UsageError

    context = prompt_len + max_new + k + 1
    try:
        for role in (Role.TARGET, Role.DRAFT):
            PoolSpec.for_role(cfg, role=role, max_slots=1, max_context=context, draft_tokens=k + 1,
                              page_size=default_page_size(cfg), dtype="float32")
    except PoolSpecError as e:
        raise UsageError(f"too many drafts for this model ({e})", name="--speculative", value=k) from None


# ---- output --------------------------------------------------------------------------------------------------------

def printable(text: str) -> str:
    """Escape control characters (a random model emits ESC and friends) so they cannot drive the terminal."""
    keep = "\n\t"
    return "".join(c if c in keep or unicodedata.category(c)[0] != "C" else c.encode("unicode_escape").decode()
                   for c in text)


class StreamPrinter:
    """Prints the decoded text as tokens arrive. A trailing U+FFFD may be half a UTF-8 character, so it waits
    for the next token; stop ids are not printed."""

    def __init__(self, tokenizer, stop_ids, out=None):
        self.tok, self.stop, self.out = tokenizer, set(stop_ids), out or sys.stdout
        self.ids: list[int] = []
        self.seen = 0  # tokens added, stop ids included
        self.shown = 0
        self.first_token_at: float | None = None

    def add(self, token: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.seen += 1
        if token in self.stop:
            return
        self.ids.append(token)
        self._emit(self.tok.decode(self.ids).rstrip("\ufffd"))

    def finish(self, tokens=()) -> None:
        """Print the rest; `tokens` is the whole output, for generators that did not stream all of it."""
        for t in list(tokens)[self.seen:]:
            self.add(t)
        self._emit(self.tok.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _emit(self, text: str) -> None:
        if len(text) > self.shown:
            self.out.write(printable(text[self.shown:]))
            self.out.flush()
            self.shown = len(text)


def _sizes(model, context: int) -> str:
    """What an out-of-memory report should say: the weights held and the context asked for."""
    try:
        import jax

        weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    except Exception:  # a model without arrays (tests) has no size to report
        return f"context {context} tokens"
    return f"model weights {weights / 2**30:.2f} GiB, context {context} tokens"


# ---- the command ---------------------------------------------------------------------------------------------------

def start_backend() -> None:
    """Start JAX's backend on a thread while the prompt is read and tokenized and our modules import (an H200 host's
    CUDA backend takes ~0.5 s to start, most of it outside the GIL); not in a multi-process job, which must join
    before any backend starts (`init_distributed`)."""
    from ds4jax.runtime.distributed import launched

    if not launched():
        import threading

        import jax

        def devices():
            try:
                jax.devices()
            except Exception:  # noqa: BLE001 (the main thread meets it again, and reports it as one line)
                pass

        threading.Thread(target=devices, name="ds4jax-backend", daemon=True).start()


def run(args) -> int:
    from ds4jax.errors import TokenizerError, UsageError

    start_backend()
    progress = Progress(args.quiet)
    text = read_prompt(args)
    cfg, tok = _config_and_tokenizer(args)
    progress(tok.note)
    ids = tok.encode(text, add_bos=True)
    if not ids:
        raise UsageError("encodes to no tokens (and the tokenizer has no BOS)", name="prompt")
    if max(ids) >= cfg.vocab_size:
        raise TokenizerError(f"produced id {max(ids)}, outside the model's vocabulary ({cfg.vocab_size})",
                             source=tok.note)
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UsageError(f"the prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})", name="--max-new-tokens",
                         value=args.max_new_tokens)
    if args.speculative:
        _check_speculative(cfg, args.speculative, len(ids), args.max_new_tokens)
    if args.lookup and not args.speculative:  # (None: the default)
        raise UsageError("drafts inside speculative rounds: give --speculative K too", name="--lookup",
                         value=args.lookup)
    from ds4jax.generation.lookup import MAX_N

    if (args.lookup or 0) > MAX_N:
        raise UsageError(f"the shortest suffix that may match, at most {MAX_N}", name="--lookup", value=args.lookup)
    prefetch_programs(args, len(ids))
    progress(f"loading {'the default model' if args.checkpoint is None else args.checkpoint}")
    model = load_model(args)
    args.sizes = _sizes(model, len(ids) + args.max_new_tokens)
    if args.speculative and not model.has_mtp:
        raise UsageError("needs the MTP block, and this checkpoint has no mtp.* tensors", name="--speculative",
                         value=args.speculative)

    from ds4jax.generation.generate import SamplingParams, generate

    stop = () if tok.eos_id is None else (tok.eos_id,)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, stop_ids=stop)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a non-UTF-8 terminal gets '?' rather than an exception
    from ds4jax.runtime.distributed import process_index

    # every process of a multi-process job generates the same tokens (SPMD); process 0 prints them
    printer = StreamPrinter(tok, stop, out=None if process_index() == 0 else open(os.devnull, "w"))
    progress(f"generating up to {args.max_new_tokens} tokens after {len(ids)} prompt tokens "
             "(the first run compiles; later runs load the compiled programs)")
    start = time.perf_counter()
    if args.speculative:
        from ds4jax.generation.speculative import speculative_generate

        result = speculative_generate(model, ids, sampling, k=args.speculative, prefill_chunk=args.prefill_chunk,
                                      check_finite=args.check_finite, on_token=lambda _row, token: printer.add(token),
                                      steps_per_call=args.steps_per_call, kv_dtype=args.kv_dtype,
                                      lookup=args.lookup)
        new = result.tokens[0]
        progress(f"speculative k={args.speculative}: {result.rounds[0]} rounds, mean accepted "
                 f"{result.mean_accepted[0]:.2f} of {args.speculative} drafts per round")
    else:
        new = generate(model, ids, sampling, prefill_chunk=args.prefill_chunk, check_finite=args.check_finite,
                       on_token=lambda _row, token: printer.add(token), steps_per_call=args.steps_per_call,
                       kv_dtype=args.kv_dtype)[0]
    printer.finish(new)
    seconds = time.perf_counter() - start
    first = "" if printer.first_token_at is None else f"; first token after {printer.first_token_at - start:.2f} s"
    progress(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / max(seconds, 1e-9):.1f} tokens/s{first})")
    return 0
