"""The ``ds4jax`` command (also ``python -m ds4jax``): argument parsing, error reporting, subcommand registry.

Exit status (docs/errors.md):
    0  success
    1  a comparison failed (``compare`` above ``--tol``)
    2  bad usage or bad input: arguments, files, checkpoints, configs, tokenizers (any `InputError`)
    3  runtime failure: out of memory (with the sizes involved), NaN/Inf logits, an internal error
  130  interrupted (Ctrl-C)
Every failure is one line on stderr, ``ds4jax: error: ...``; ``--debug`` shows the traceback instead.

A subcommand is a module with ``add_parser(subparsers)`` and ``run(args) -> int``, registered by one line in
`SUBCOMMANDS`. This module imports only the standard library at the top, so ``--help`` and ``--version`` are fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

OK, COMPARISON_FAILED, BAD_INPUT, RUNTIME_FAILURE, INTERRUPTED = 0, 1, 2, 3, 130

# One line per subcommand, in help order.
SUBCOMMANDS = (
    "ds4jax.commands.generate",
    "ds4jax.commands.compare",
    "ds4jax.commands.info",
    "ds4jax.io.convert",
    "ds4jax.batch",
    "ds4jax.commands.warmup",
    "ds4jax.commands.serve",
    "ds4jax.commands.launch",
)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("ds4jax")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _common_options(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the Python traceback of an error instead of one line")
    parser.add_argument("--quiet", "-q", action="store_true", default=default,
                        help="no progress lines on stderr (errors are still reported)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds4jax", description="DeepSeek-V4 inference in JAX.",
        epilog="Exit status: 0 ok, 1 comparison failed, 2 bad usage or input, 3 runtime failure (docs/errors.md).")
    parser.add_argument("--version", action="version", version=f"ds4jax {version()}")
    _common_options(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(name)
        before = set(sub.choices)
        added = module.add_parser(sub)
        for command in set(sub.choices) - before:
            p = sub.choices[command]
            _common_options(p, argparse.SUPPRESS)  # after the subcommand too; SUPPRESS keeps a value given before
            p.set_defaults(run=module.run)
        del added
    return parser


# ---- compatibility for callers of the older module-level helpers ---------------------------------------------------

def _load(args):
    """(model, tokenizer) that `args` (--checkpoint, --dtype) names."""
    from ds4jax.commands.generate import _config_and_tokenizer, load_model

    return load_model(args), _config_and_tokenizer(args)[1]


def printable(text: str) -> str:
    from ds4jax.commands.generate import printable as _printable

    return _printable(text)


def describe(cfg, name: str) -> str:
    from ds4jax.commands.info import describe as _describe

    return _describe(cfg, name)


def enable_compilation_cache() -> None:
    """Persist compiled programs across runs (the first ``generate`` compiles for about a minute on CPU): JAX's
    cache, as for every entry point (`ds4jax.compilation_cache`: ``DS4JAX_COMPILATION_CACHE`` overrides
    the directory, ``off`` disables, a JAX setting of the user's wins), plus, for the CLI only, our executable
    cache under it, which also skips tracing and lowering (``DS4JAX_EXECUTABLE_CACHE=off`` keeps JAX's only; so does a
    multi-process job)."""
    from ds4jax import compilation_cache

    where = compilation_cache.ensure_compilation_cache()
    # a multi-process job keeps to JAX's cache: its executables span processes, which ours does not serialize
    if where is not None:
        compilation_cache.enable_executable_cache(where)


# Commands that start, run a bounded job and exit: they skip JAX's preallocation of 75 % of the GPU's memory, which
# a new process pays for before its first transfer completes (an H100 host: backend start 2.00 -> 0.38 s, the
# default model's first load 0.88 -> 0.06 s; the cached ``generate``'s first token 2.26 -> 1.90 s;
# docs/benchmarks/startup_timeline_h100_prealloc/). A server keeps it (its memory stays reserved, unfragmented,
# for its lifetime). A value the user set wins.
NO_PREALLOCATION = ("generate", "compare", "info", "convert", "batch", "warmup")


def skip_preallocation(command: str) -> None:
    """Before any backend starts: grow GPU memory on demand for `command` (see NO_PREALLOCATION)."""
    if command in NO_PREALLOCATION:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


# ---- errors --------------------------------------------------------------------------------------------------------

def as_runtime_failure(e: BaseException, sizes: str = ""):
    """A `RuntimeFailure` for an exception that is not ours: device / host out of memory (with `sizes`, what the
    command had allocated), or an internal error."""
    from ds4jax.errors import DeviceMemoryError, RuntimeFailure

    text = str(e)
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
        held = f" ({sizes})" if sizes else ""
        # the weights and the KV pools are checked against the free memory before they are allocated (naming
        # their fields: `ds4jax.runtime.memory`), so what failed here is a step's working memory or a compilation
        return DeviceMemoryError(f"out of memory: {first[:300]}{held}; the weights and KV pools are checked "
                                 "against the free memory before they are allocated, so this was most likely a "
                                 "step's working memory: a smaller --prefill-chunk (or --max-slots) takes less")
    where = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]
    return RuntimeFailure(f"internal error ({where}); rerun with --debug for the traceback")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed usage and the message (status 2), or --help / --version (0)
        return int(e.code or 0)
    skip_preallocation(args.command)
    if args.command in ("generate", "compare", "batch"):
        enable_compilation_cache()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("ds4jax: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `ds4jax generate ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception as e:
        if args.debug:
            raise
        from ds4jax.errors import Ds4jaxError

        error = e if isinstance(e, Ds4jaxError) else as_runtime_failure(e, getattr(args, "sizes", ""))
        print(f"ds4jax: error: {error}", file=sys.stderr)
        return error.exit_status


if __name__ == "__main__":
    sys.exit(main())
