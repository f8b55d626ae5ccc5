"""The notebooks in notebooks/: keep them output-free in git, execute them top to bottom, extract their plots.

    python scripts/notebook_tools.py check [NOTEBOOK ...]   # exit 1 if any notebook has committed outputs
    python scripts/notebook_tools.py strip [NOTEBOOK ...]   # remove outputs and execution counts in place
    python scripts/notebook_tools.py run [NOTEBOOK ...]     # execute; exit 1 on the first failing cell

Without arguments every ``notebooks/*.ipynb`` is meant. Notebooks run in a fresh kernel with the repository root
first on ``PYTHONPATH`` (so they import this checkout's ``ds4jax``, not whatever else is installed), XLA's cheap
compile settings added to ``XLA_FLAGS`` (`COMPILE_FLAGS`) and the notebooks/ folder as working directory. The test
suite (`tests/test_notebooks.py`) uses the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time
from typing import Sequence

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
# Per-cell limit: far above the notebooks' own budget (a minute each on a laptop) so a slow or shared CI machine
# reports a failing assertion rather than a timeout, while a hung kernel still fails.
CELL_TIMEOUT_S = 900
# The notebooks are compile-bound on CPU (a few large programs, each run briefly): XLA:CPU's backend and LLVM
# optimisations cost far more than they save (notebook 03's warmup: 108 s of CPU time by default, 74 s at level 0,
# 55 s with both; the fusion-emitter switch, on jaxlib < 0.11 only, 25 % less again). Flags already in XLA_FLAGS
# win. One list with the test suite's processes (tests/cheap_compile.py), so that the notebook kernels' programs
# meet theirs in the run's compilation cache (the flags are part of its key).
sys.path.insert(0, str(ROOT / "tests"))
from cheap_compile import FLAGS as COMPILE_FLAGS  # noqa: E402


def notebooks() -> list[pathlib.Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def committed_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """What a stripped notebook must not hold: one line per code cell with outputs or an execution count."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i}: {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i}: execution_count {cell.execution_count}")
    return problems


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def with_compile_flags(xla_flags: str) -> str:
    """`xla_flags` plus every `COMPILE_FLAGS` entry it does not set itself."""
    present = {f.split("=")[0] for f in xla_flags.split()}
    return " ".join([xla_flags] + [f for f in COMPILE_FLAGS if f.split("=")[0] not in present]).strip()


@contextlib.contextmanager
def kernel_environment():
    """PYTHONPATH and XLA_FLAGS for the kernels started inside (they inherit the environment), then restored."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "XLA_FLAGS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    os.environ["XLA_FLAGS"] = with_compile_flags(saved["XLA_FLAGS"] or "")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def execute(path: str | os.PathLike, timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel; returns it with outputs.

    Raises `nbclient.exceptions.CellExecutionError` (naming the cell and the traceback) when a cell raises,
    a failed assertion included."""
    from nbclient import NotebookClient

    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    with kernel_environment():
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("check", "strip", "run"))
    ap.add_argument("paths", nargs="*", type=pathlib.Path)
    args = ap.parse_args(argv)
    paths = args.paths or notebooks()
    status = 0
    for path in paths:
        if args.action == "check":
            problems = committed_outputs(nbformat.read(path, as_version=4))
            for p in problems:
                print(f"{path}: {p}", file=sys.stderr)
            status |= bool(problems)
        elif args.action == "strip":
            nbformat.write(strip(nbformat.read(path, as_version=4)), path)
        else:
            start = time.perf_counter()
            execute(path)
            print(f"{path}: ok in {time.perf_counter() - start:.1f} s")
    if status:
        print(f"strip them with: python {pathlib.Path(__file__).relative_to(ROOT)} strip", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
