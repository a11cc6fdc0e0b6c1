"""radixserve: an LLM serving engine with a radix prefix cache, paged KV pools and an overlap scheduler."""

__version__ = "0.1.0"

from typing import Any

from radixserve.utils import log_safety
from radixserve.utils.cpus import set_omp_spin_wait

# Before torch loads its OpenMP runtime: spinning workers collapse beside busy neighbours (utils/cpus).
set_omp_spin_wait()
# Every process imports the package first: no log line of ours can carry a raw newline from a request.
log_safety.install()

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    """Import lazily: `import radixserve` stays cheap, and subprocesses import only what they use."""
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixserve.sampling.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
