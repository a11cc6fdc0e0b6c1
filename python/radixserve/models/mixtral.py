"""Mixtral: Llama attention with every MLP a MoE of `num_local_experts` experts of
`intermediate_size`; the top-k weights are always renormalised. Checkpoints name the block
`block_sparse_moe` and the projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.model_loader.errors import ModelLoadError
from radixserve.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM, MoeSpec


class MixtralDecoderLayer(MoeDecoderLayer):
    @staticmethod
    def moe_spec(config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
        )

    @staticmethod
    def is_sparse(config: Any, layer: int) -> bool:
        return True


class MixtralForCausalLM(MoeForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    renamed_modules = ((".block_sparse_moe.", ".mlp."),)

    def __init__(
        self, config: Any, max_position: int | None = None, parallel: ModelParallelism | None = None
    ) -> None:
        window = getattr(config, "sliding_window", None)
        if window is not None and window < config.max_position_embeddings:
            # Attention here is always full; a window shorter than the context would change outputs.
            raise ModelLoadError(
                f"Mixtral with sliding_window={window} is not supported (full attention only)"
            )
        super().__init__(config, max_position, parallel)
