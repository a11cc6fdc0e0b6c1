"""The text-only decoder architectures radixserve serves, named once.

model_config's supported list and hf_config_cache's cacheable set are both these; it is its own
module because model_config imports hf_config_cache, so neither can name it for the other.
"""

# HF `architectures` names of the text decoders radixserve/models implements: their configs are
# flat attributes (no text sub-config, no int-keyed label maps).
TEXT_DECODER_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)
