"""The Python API uses JAX's persistent compilation cache by default, across processes, and never loads a program
compiled for something else: a new process of the same `ds4jax.generate` loads every program from the disk; another
config and another jaxlib miss; ``off`` writes nothing. Each run is a fresh process (`compilation_cache_worker.py`)
that counts JAX's own cache events per program; no timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import run_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "compilation_cache_worker.py")
pytestmark = pytest.mark.slow  # fresh processes that compile the tiny model: about 100 s of CPU in all


def model_programs(report: dict) -> list[str]:
    """The engine's programs that run the model (prefill, decode), by jit name."""
    names = [name for name in report["programs"] if "prefill" in name or "decode" in name]
    assert names, report["programs"]
    return names


def run(cache: str, *args: str, home: str | None = None) -> dict:
    """The worker's report, with DS4JAX_COMPILATION_CACHE=`cache` (a directory or "off")."""
    env = {**run_cache.without(os.environ), "DS4JAX_COMPILATION_CACHE": cache,  # ds4jax's policy, not the run's
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if home is not None:  # where the default directory would be
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
    out = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def outcomes(report: dict) -> set[str]:
    return {o for os_ in report["programs"].values() for o in os_}


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache directory after one process ran a tiny `ds4jax.generate`, and that process' report."""
    cache = str(tmp_path_factory.mktemp("jax-cache"))
    return cache, run(cache, "random", "generate")


def entries(cache: str) -> set[str]:
    return {name for name in os.listdir(cache) if name.endswith("-cache")}


def test_the_api_writes_every_program(filled):
    cache, first = filled
    assert first["directory"] == cache
    assert outcomes(first) == {"written"}, first["programs"]  # small programs too: no minimum time or size
    model_programs(first)
    assert len(entries(cache)) == sum(len(o) for o in first["programs"].values())


def test_a_new_process_loads_every_program_from_the_cache(filled):
    cache, first = filled
    before = entries(cache)
    second = run(cache, "random", "generate")
    assert second["programs"].keys() == first["programs"].keys()
    assert outcomes(second) == {"hit"}, second["programs"]
    assert second["tokens"] == first["tokens"]
    assert entries(cache) == before


def test_another_config_misses(filled):
    cache, first = filled
    other = run(cache, "other-config", "generate")
    for name in model_programs(first):
        assert set(other["programs"][name]) == {"written"}, other["programs"]
    assert other["programs"]["jit(init)"] == ["compiled"]  # ran before any entry point enabled the cache


def test_another_jaxlib_misses(filled):
    """The very run that filled the cache (every program a hit in a new process of the same jaxlib,
    test_a_new_process_loads_every_program_from_the_cache), as another jaxlib: every program misses."""
    cache, first = filled
    other = run(cache, "random", "generate", "--other-jaxlib")
    assert other["programs"].keys() == first["programs"].keys()
    assert "hit" not in outcomes(other), other["programs"]


def test_off_writes_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    report = run("off", "random", "init", home=str(home))
    assert report["directory"] is None
    assert outcomes(report) == {"compiled"}
    assert not any(home.rglob("*")), list(home.rglob("*"))


def test_the_default_directory_is_under_the_user_cache(tmp_path):
    home = tmp_path / "home"
    report = run("", "random", "init", home=str(home))
    assert report["directory"] == str(home / ".cache" / "ds4jax" / "jax")
    assert outcomes(report) == {"written"} and entries(report["directory"])
