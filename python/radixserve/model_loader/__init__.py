"""Model files: HF config/safetensors loading, dummy weights, and the built-in GGUF-converted model.

Import the entry points from their modules (`loader.load_model`, `weights.iterate_weights`,
`default_model.resolve_model_path`); this package stays import-light because
`radixserve.models` imports `errors` from it.
"""

from radixserve.model_loader.errors import ModelLoadError, check_shape

__all__ = ["ModelLoadError", "check_shape"]
