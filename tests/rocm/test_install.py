"""`pip install ds4jax[rocm]` resolves to one matching jax / jaxlib / ROCm plugin / PJRT set (pip's resolver, dry run).

The extra's requirements are read from pyproject.toml and resolved without building the project. Needs the package
index: skipped, saying so, only when pip cannot reach it.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).parents[2]
OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                     r"Network is unreachable|Failed to establish a new connection|ConnectTimeout|ReadTimeout")


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["rocm"]]


def _base(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.slow
def test_rocm_extra_resolves_to_one_matching_set(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), *_requirements()], capture_output=True, text=True, timeout=600)
    if proc.returncode and OFFLINE.search(proc.stdout + proc.stderr):
        pytest.skip(f"the package index is unreachable: {OFFLINE.search(proc.stdout + proc.stderr).group(0)}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {_base(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    for name in ("jax", "jaxlib", "jax-rocm7-plugin", "jax-rocm7-pjrt"):
        assert name in got, f"{name} missing from the resolved set {sorted(got)}"
    release = lambda v: tuple(v.split(".")[:3])  # noqa: E731  (0.10.2, 0.10.2.post1 -> 0.10.2)
    assert release(got["jaxlib"]) == release(got["jax"]) == release(got["jax-rocm7-plugin"]) == release(
        got["jax-rocm7-pjrt"]), got
    assert "jax-cuda13-plugin" not in got and "jax-cuda12-plugin" not in got, got
