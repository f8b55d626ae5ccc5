"""``ds4jax warmup``: compile an `Engine`'s programs ahead of a batch job and print them with their compile seconds.

The engine flags are ``ds4jax batch``'s (`engine_options`), so ``ds4jax warmup --max-slots 16`` compiles exactly
the programs ``ds4jax batch ... --max-slots 16`` runs; with the on-disk compilation cache on (the default;
``DS4JAX_COMPILATION_CACHE`` moves it, ``off`` disables it) the batch job then loads them instead of compiling.
"""

from __future__ import annotations

import argparse

from ds4jax.commands.options import HelpFormatter, Progress

NAME = "warmup"


def add_parser(sub) -> argparse.ArgumentParser:
    from ds4jax.commands.engine_options import add_engine_options, add_logprobs_option

    p = sub.add_parser(NAME, help="compile an engine's programs (fills the compilation cache) and list them",
                       description="Build the Engine that `ds4jax batch` builds from the same flags, compile every "
                                   "program it can run, and print each program's shape and compile seconds. With "
                                   "the compilation cache on, later runs with these flags load the programs.",
                       formatter_class=HelpFormatter)
    add_engine_options(p)
    add_logprobs_option(p, 0)  # --max-logprobs 20 (and --steps-per-call 4) compiles what `ds4jax serve` runs
    return p


def _cache_note() -> str:
    import jax

    where = jax.config.jax_compilation_cache_dir
    return f"compilation cache: {where}" if where else "compilation cache: off (programs live in this process only)"


def run(args) -> int:
    from ds4jax.cli import _load, enable_compilation_cache
    from ds4jax.commands.engine_options import build_engine

    progress = Progress(args.quiet)
    enable_compilation_cache()
    progress(_cache_note())
    progress(f"loading {'the default model' if args.checkpoint is None else args.checkpoint}")
    model, tokenizer = _load(args)
    engine = build_engine(model, args, tokenizer)
    b = engine.buckets
    progress(f"compiling: prefill {list(b.prefill)} (rows, tokens per row), decode rows {list(b.rows)} x "
             f"{engine.steps_per_call} steps" + (f", speculative k={engine.k}" if engine.k else "")
             + (f", lookup drafting of >= {engine.lookup} tokens" if engine.lookup else ""))
    report = engine.warmup()
    print(report.table(), flush=True)
    progress(f"{len(report.programs)} programs, {report.compiles} compilations ({report.disk_hits} from the cache) "
             f"in {report.seconds:.1f} s")
    return 0
