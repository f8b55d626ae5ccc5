"""A module imported on first attribute access: for heavy imports that a cached run never reaches.

``pallas_kernels = LazyModule("pallas_kernels")`` at the top of a module reads like the import it replaces
(``pallas_kernels.sinkhorn(...)``), but the package (~60 ms: it imports every kernel and Pallas itself) is imported
only when a program is traced; a ``ds4jax generate`` whose programs come from the executable cache traces none
(tests/test_startup_imports.py). Attribute writes go to the real module, so ``monkeypatch.setattr`` on either works.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _module(self) -> ModuleType:
        return importlib.import_module(object.__getattribute__(self, "_name"))

    def __getattr__(self, attr: str):
        return getattr(self._module(), attr)

    def __setattr__(self, attr: str, value) -> None:
        setattr(self._module(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._module(), attr)

    def __repr__(self) -> str:
        return f"<LazyModule {object.__getattribute__(self, '_name')!r}>"
