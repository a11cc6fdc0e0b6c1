"""Fixtures of the disaggregation tests: the tiny model folder (made once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_model_dir) -> str:
    return tiny_model_dir("llama")
