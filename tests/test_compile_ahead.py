"""generation/compile_ahead.py: a non-streaming `generate()` compiles its decode program on a background thread
while the prefill compiles, exactly once, with the same tokens; streaming calls do not (unless
DS4JAX_COMPILE_AHEAD=always); a second call of the same shape compiles nothing. `executable_cache.fresh_compiles`
holds for the thread inside it only."""

from __future__ import annotations

import threading

import jax
import pytest

import ds4jax
from ds4jax.generation import compile_ahead
from ds4jax.generation.compiles import compile_count
from ds4jax.generation.generate import SamplingParams, generate
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.model.handle import Model
from ds4jax.runtime import executable_cache, precompile


def _model(vocab: int) -> Model:
    """A config no other test uses (its vocabulary), so its programs are not compiled in this process yet."""
    cfg = ds4jax.tiny(num_layers=1, attention_types=(AttentionType.SLIDING,), mlp_types=(MlpType.HASH,),
                      vocab_size=vocab)
    return Model(cfg, jax.jit(P.init, static_argnums=0)(cfg, jax.random.key(1)))


@pytest.fixture(scope="module")
def compiled():
    """A model whose programs are compiled already: with the executable cache off a capture still hands the pool a
    (cached, instant) compile job, so whether one started shows the setting without compiling anything."""
    model = _model(vocab=281)
    generate(model, [3, 1, 4], SamplingParams(max_new_tokens=6), on_token=lambda row, token: None)
    return model


@pytest.fixture
def ahead_calls(monkeypatch):
    """The threads and job names of every `precompile.compile_all` call."""
    seen = []
    real = precompile.compile_all

    def spy(jobs):
        seen.append((threading.current_thread().name, [j.name for j in jobs if j.compile is not None]))
        return real(jobs)

    monkeypatch.setattr(precompile, "compile_all", spy)
    monkeypatch.setattr(compile_ahead.precompile, "compile_all", spy)
    return seen


def test_a_whole_call_compiles_its_decode_program_ahead_once(ahead_calls, monkeypatch):
    monkeypatch.delenv("DS4JAX_COMPILE_AHEAD", raising=False)
    model = _model(vocab=263)
    params = SamplingParams(max_new_tokens=12)
    whole = generate(model, [5, 9, 2, 7], params)
    [(thread, names)] = ahead_calls
    assert thread.startswith("ds4jax-compile-ahead") and any(n.endswith("decode_loop") for n in names), names
    before = compile_count()
    assert generate(model, [5, 9, 2, 7], params) == whole
    assert compile_count() == before  # compiled already: the ahead job (if any) finds JAX's cache
    streamed = generate(model, [5, 9, 2, 7], params, on_token=lambda row, token: None)
    assert streamed == whole  # greedy: the same tokens either way


@pytest.mark.parametrize("setting, stream, ahead", [("on", True, False), ("always", True, True), ("on", False, True),
                                                   ("off", False, False)])
def test_the_setting_decides_which_calls_compile_ahead(compiled, ahead_calls, monkeypatch, setting, stream, ahead):
    monkeypatch.setenv("DS4JAX_COMPILE_AHEAD", setting)
    generate(compiled, [3, 1, 4], SamplingParams(max_new_tokens=6),
             on_token=(lambda row, token: None) if stream else None)
    assert any(t.startswith("ds4jax-compile-ahead") for t, _ in ahead_calls) == ahead


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILE_AHEAD", "sometimes")
    with pytest.raises(ValueError, match="DS4JAX_COMPILE_AHEAD"):
        compile_ahead.setting()


def test_fresh_compiles_hold_for_their_own_thread_only():
    """Inside `fresh_compiles` this thread's compiles skip JAX's persistent cache; a compile on another thread
    meanwhile (a warm-up's small programs beside the pool's jobs) reads the usual setting, and nothing stays set."""
    from jax._src import config

    setting = config.persistent_cache_min_compile_time_secs
    before = setting.value
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def hold():
        with executable_cache.fresh_compiles():
            seen["inside"] = setting.value
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    seen["beside"] = setting.value
    leave.set()
    t.join(10)
    assert seen == {"inside": float("inf"), "beside": before} and setting.value == before
