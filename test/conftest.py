import os

# Tests never touch a model hub; keep torch to a predictable thread count on the 2-core CI box.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The CPU linears' batch bounds stay the defaults in every test (never a measurement of this
# machine cached from an earlier run): the parity tests must not depend on the box they run on.
os.environ.setdefault("RADIXSERVE_CPU_KERNEL_TUNING", "off")

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET once, when it is first imported, and a test module's imports may
# import it at collection (peft does): without a GPU every Triton kernel test runs in the CPU
# interpreter, so the whole session says so before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def _made_once(
    tmp_path_factory: pytest.TempPathFactory, make: Callable[[str, Path], object], prefix: str
) -> Callable[[str], str]:
    """Factory over `make(kind, folder)`: each kind's checkpoint is written once per session."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = str(make(kind, tmp_path_factory.mktemp(f"{prefix}{kind}")))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_dir('llama') -> folder with a random tiny checkpoint (made once)."""
    from radixserve.testing.tiny_models import make_tiny_model

    return _made_once(tmp_path_factory, make_tiny_model, "tiny_")


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def builtin_model_path() -> str:
    """The built-in SmolLM2-135M folder; the test is skipped, saying why, where it is missing."""
    from radixserve.model_loader.default_model import ensure_default_model

    try:
        return str(ensure_default_model(show_progress=False))
    except Exception as exc:  # `make setup` converts it; say why when it is missing
        pytest.skip(f"built-in model unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_embedding_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_embedding_dir('bert') -> a tiny embedding/classifier/reranker checkpoint."""
    from radixserve.testing.tiny_embedding_models import make_tiny_embedding_model

    return _made_once(tmp_path_factory, make_tiny_embedding_model, "tiny_emb_")
