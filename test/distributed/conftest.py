"""Fixtures shared by the multi-rank and data-parallel tests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def builtin_model_path() -> str:
    """The built-in model's folder (converted once by `make setup`); skip when it is missing."""
    from radixserve.model_loader.default_model import ensure_default_model

    try:
        return str(ensure_default_model(show_progress=False))
    except Exception as exc:
        pytest.skip(f"built-in model unavailable: {exc}")
