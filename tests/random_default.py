"""An autouse fixture for CLI-level tests: the commands' default model is the seeded random tiny model (fast to
compile) and the on-disk compilation cache stays off. Import it into a test module to apply it there."""

import pytest

from ds4jax.io import default_model as default_module
from ds4jax.io.default_model import random_config, random_model, random_tokenizer


@pytest.fixture(autouse=True)
def random_default(monkeypatch):
    monkeypatch.setattr(default_module, "default_model", random_model)
    monkeypatch.setattr(default_module, "default_tokenizer", random_tokenizer)
    monkeypatch.setattr(default_module, "default_config", random_config)
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")  # `main` would turn the on-disk cache on
