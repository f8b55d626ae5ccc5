"""Every notebook in notebooks/ is committed without outputs and runs top to bottom (its final assertions included).

The same two checks are also shown to fail: on a notebook whose assertion fails and on one with outputs.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from nbclient.exceptions import CellExecutionError  # noqa: E402
from nbformat.v4 import new_code_cell, new_notebook, new_output  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import notebook_tools  # noqa: E402

NOTEBOOKS = notebook_tools.notebooks()


def assert_stripped(path: pathlib.Path) -> None:
    problems = notebook_tools.committed_outputs(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name} has committed outputs ({'; '.join(problems)}); " \
                         "run python scripts/notebook_tools.py strip"


def assert_runs(path: pathlib.Path) -> None:
    notebook_tools.execute(path)  # raises CellExecutionError on the first failing cell


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 1, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stripped(path):
    assert_stripped(path)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    assert_runs(path)


# ---- the checks themselves ----------------------------------------------------------------------------------

def _write(tmp_path, name: str, *sources: str, with_output: bool = False) -> pathlib.Path:
    cells = [new_code_cell(s) for s in sources]
    if with_output:
        cells[0].outputs = [new_output("stream", name="stdout", text="4\n")]
        cells[0].execution_count = 1
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(new_notebook(cells=cells), path)
    return path


def test_checks_fail_on_a_failing_assertion_and_on_committed_outputs(tmp_path):
    good = _write(tmp_path, "good", "x = 2 + 2", "assert x == 4")
    failing = _write(tmp_path, "failing", "x = 2 + 2", "assert x == 5, 'arithmetic broke'")
    with_outputs = _write(tmp_path, "outputs", "print(2 + 2)", with_output=True)

    assert_stripped(good)
    assert_runs(good)
    with pytest.raises(CellExecutionError, match="arithmetic broke"):
        assert_runs(failing)
    assert_stripped(failing)
    with pytest.raises(AssertionError, match="committed outputs"):
        assert_stripped(with_outputs)
    notebook_tools.strip(nb := nbformat.read(with_outputs, as_version=4))
    assert notebook_tools.committed_outputs(nb) == []


def test_kernels_get_the_cheap_compile_flags_unless_set():
    flags = notebook_tools.with_compile_flags("--xla_force_host_platform_device_count=4 "
                                              "--xla_backend_optimization_level=2")
    assert "--xla_backend_optimization_level=2" in flags and "--xla_backend_optimization_level=0" not in flags
    assert "--xla_llvm_disable_expensive_passes=true" in flags and "device_count=4" in flags
    assert notebook_tools.with_compile_flags("") == " ".join(notebook_tools.COMPILE_FLAGS)
