"""`ds4jax.compilation_cache.ensure_compilation_cache`: the policy every entry point applies (in this process;
nothing here compiles while a directory is set, so JAX's cache is never opened). `test_compilation_cache.py`
runs the entry points in fresh processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import jax
import pytest

import run_cache
from ds4jax import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not decided yet (the test run's own cache, tests/run_cache.py, set aside); JAX's settings
    restored afterwards."""
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setattr(compilation_cache, "_ours", None)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    yield monkeypatch
    for name, value in before.items():
        jax.config.update(name, value)


def test_a_directory_from_the_environment(fresh, tmp_path):
    where = tmp_path / "cache"
    fresh.setenv("DS4JAX_COMPILATION_CACHE", str(where))
    assert compilation_cache.ensure_compilation_cache() == str(where)
    assert jax.config.jax_compilation_cache_dir == str(where)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert stat.S_IMODE(where.stat().st_mode) == 0o700  # entries are native code: private to this user
    fresh.setenv("DS4JAX_COMPILATION_CACHE", str(tmp_path / "elsewhere"))
    assert compilation_cache.ensure_compilation_cache() == str(where)  # decided once per process


def test_the_default_directory(fresh, tmp_path):
    fresh.delenv("DS4JAX_COMPILATION_CACHE", raising=False)
    fresh.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.ensure_compilation_cache() == str(tmp_path / "ds4jax" / "jax")


@pytest.mark.parametrize("setting", ["on", None, "off"])
def test_the_executable_cache_is_opt_in_for_the_api(fresh, tmp_path, setting):
    """DS4JAX_EXECUTABLE_CACHE=on adds ours under JAX's directory for every entry point; unset or off, the API keeps
    to JAX's cache (the CLI turns ours on itself unless off: `cli.enable_compilation_cache`)."""
    from ds4jax.runtime import executable_cache

    fresh.setenv("DS4JAX_COMPILATION_CACHE", str(tmp_path / "cache"))
    if setting is None:
        fresh.delenv("DS4JAX_EXECUTABLE_CACHE", raising=False)
    else:
        fresh.setenv("DS4JAX_EXECUTABLE_CACHE", setting)
    try:
        where = compilation_cache.ensure_compilation_cache()
        assert executable_cache.enabled() == (setting == "on")
        assert compilation_cache.enable_executable_cache(where) == (setting != "off")  # the CLI's call
    finally:
        executable_cache.enable(None)


def test_off(fresh):
    fresh.setenv("DS4JAX_COMPILATION_CACHE", "off")
    assert compilation_cache.ensure_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


def test_the_users_own_cache_wins(fresh, tmp_path):
    fresh.setenv("DS4JAX_COMPILATION_CACHE", str(tmp_path / "ours"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.5)
    assert compilation_cache.ensure_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5
    assert not (tmp_path / "ours").exists()


def test_an_unwritable_directory_runs_uncached(fresh, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    fresh.setenv("DS4JAX_COMPILATION_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="compilation cache disabled"):
        assert compilation_cache.ensure_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


def test_importing_ds4jax_changes_no_jax_setting(tmp_path):
    probe = ("import ds4jax, jax; ds4jax.generate; ds4jax.Engine; ds4jax.forward_logits; "
             "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    env = {**run_cache.without(os.environ), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / ".cache")}
    env.pop("DS4JAX_COMPILATION_CACHE", None)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "1.0"]
    assert not any(tmp_path.rglob("*"))
