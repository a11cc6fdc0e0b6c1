"""Fixtures of the real-model server and Engine tests: model folders and shared Engines.

The Engines are session-scoped so that test_engine_real.py and test_server_real.py (which
compares the HTTP server against the Engine) share one start-up per model.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import BUILTIN_POOL_TOKENS, TINY_POOL_TOKENS  # noqa: E402


@pytest.fixture(scope="session")
def builtin_model_path() -> str:
    from radixserve.model_loader.default_model import ensure_default_model

    try:
        return str(ensure_default_model(show_progress=False))
    except Exception as exc:  # `make setup` converts it; say why when it is missing
        pytest.skip(f"built-in model unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_path: str):
    from radixserve import Engine

    with Engine(model_path=tiny_llama_path, max_total_tokens=TINY_POOL_TOKENS) as engine:
        yield engine


@pytest.fixture(scope="session")
def builtin_engine(builtin_model_path: str):
    from radixserve import Engine

    with Engine(model_path=builtin_model_path, max_total_tokens=BUILTIN_POOL_TOKENS) as engine:
        yield engine


@pytest.fixture(scope="session")
def builtin_tokenizer(builtin_model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)
