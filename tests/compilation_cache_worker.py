"""One fresh process of `test_compilation_cache.py`: a tiny ``ds4jax.generate`` through the public API, reporting
what JAX's persistent compilation cache did for each program it compiled.

    python tests/compilation_cache_worker.py random|other-config generate|init [--other-jaxlib]

`init` builds the commands' random default model and stops (its programs: random init, casts); `generate` runs
one-layer models (`small_config`; `other-config`: a larger vocabulary); `--other-jaxlib` changes the jaxlib
version that JAX hashes into every cache key, as a process of another jax / jaxlib release would see it.

The cache directory comes from the environment (``DS4JAX_COMPILATION_CACHE``), as for any user. Prints one JSON
line: the tokens, the directory JAX used, and per program (jit name) the outcome of each compile request: "hit"
(loaded from the disk cache), "written" (compiled and stored) or "compiled" (compiled, not stored)."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

HIT, WRITE = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"  # a miss is counted on write
COMPILE = "/jax/core/compile/backend_compile_duration"  # after every compile request, hit or not, with its name

pending: list[str] = []  # cache events of the compile request in progress (requests run one at a time)
programs: dict[str, list[str]] = {}


def on_event(event: str, **kwargs) -> None:
    if event in (HIT, WRITE):
        pending.append("hit" if event == HIT else "written")


def on_duration(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE:
        programs.setdefault(kwargs.get("fun_name", "?"), []).append(pending[-1] if pending else "compiled")
        pending.clear()


def small_config():
    """The random default model's config cut to one sliding-window layer: `generate` compiles the same kinds of
    programs (init, prefill, decode) as on the three-layer model, in a fraction of the time."""
    from ds4jax.io.default_model import random_config
    from ds4jax.model.config import AttentionType, MlpType

    return dataclasses.replace(random_config(), num_layers=1, attention_types=(AttentionType.SLIDING,),
                               mlp_types=(MlpType.HASH,))


def model(variant: str, what: str):
    from ds4jax.compilation_cache import ensure_compilation_cache
    from ds4jax.io import default_model
    from ds4jax.model import params
    from ds4jax.model.handle import Model

    if variant == "other-config":  # another checkpoint: the same architecture with a larger vocabulary
        cfg = dataclasses.replace(small_config(), vocab_size=small_config().vocab_size + 64)
        init = jax.jit(params.init, static_argnums=(0, 2))  # one program, before any entry point enabled the cache
        return Model(config=cfg, params=init(cfg, jax.random.key(0), jax.numpy.float32))
    if what == "init":
        return default_model.random_model()  # the loader of the commands' default model enables the cache itself
    ensure_compilation_cache()  # as `random_model` does before drawing its weights
    cfg = small_config()
    return Model(config=cfg, params=default_model._init(jax.random.key(default_model.SEED), cfg=cfg))


def main(variant: str, what: str, other_jaxlib: bool) -> None:
    if other_jaxlib:
        from jax._src import cache_key

        cache_key.jaxlib_version_str = cache_key.jaxlib_version_str + ".other"
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    import ds4jax

    built = model(variant, what)
    tokens = ds4jax.generate(built, [1, 5, 9, 2], ds4jax.SamplingParams(max_new_tokens=3)) if what == "generate" else []
    print(json.dumps({"tokens": tokens, "directory": jax.config.jax_compilation_cache_dir, "programs": programs}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--other-jaxlib" in sys.argv[3:])
