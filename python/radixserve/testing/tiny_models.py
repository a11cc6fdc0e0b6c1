"""Tiny random HF checkpoints for tests and benchmarks: written to a folder, loadable by both
radixserve and HF transformers, so outputs can be compared token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 384

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Wide weights make logits peaky, so greedy parity is not decided by last-bit rounding.
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "rope_theta": 500000.0,
    },
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
    # Multi-query attention (one KV head: replicated on every tensor-parallel rank) and a vocabulary
    # that no tp_size > 1 divides (the vocab-parallel embedding and head pad it).
    "llama_kv1": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "num_key_value_heads": 1,
        "vocab_size": TINY_VOCAB + 3,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "head_dim": 32,
    },
    # Mixture-of-experts, between them: top-k 1, 2 and 8, with and without renormalisation, a
    # shared expert with its gate, a dense layer among sparse ones (mlp_only_layers).
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "tie_word_embeddings": False,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "tie_word_embeddings": False,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "tie_word_embeddings": False,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 1,
        "intermediate_size": 48,
        "norm_topk_prob": False,
        "clip_qkv": 2.0,
    },
}
MOE_KINDS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. One, two, three, four, five.",
    "Héllo 日本語 😀 STOP here. def f(x): return x * 2",
]


def write_tiny_tokenizer(
    path: str | Path,
    vocab_size: int = TINY_VOCAB,
    corpus: list[str] | None = None,
    eos_token: str = "<|im_end|>",
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    chat_template: str = CHATML_TEMPLATE,
) -> None:
    """A small byte-level BPE tokenizer, saved as HF files. Its special tokens take the first ids
    in order (by default ChatML's: 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((corpus or _CORPUS) * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token="<|endoftext|>")
    hf.chat_template = chat_template
    hf.save_pretrained(str(path))


def make_tiny_model(
    kind: str, path: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a random `kind` (a TINY_CONFIGS key: 'llama', 'qwen3', 'qwen2_moe', ...) checkpoint to
    `path`, its config updated with `overrides`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**_COMMON, **TINY_CONFIGS[kind], **(overrides or {})}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # non-trivial norms catch a missing or misplaced norm
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding with full recomputation: tokens and their log_softmax logprobs."""
    ids = list(prompt)
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def hf_greedy_cached(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """hf_greedy through HF's own KV cache: each step runs only the new token. The same reference
    for a model the size of the built-in one, where recomputing the whole sequence every step
    costs ~30 s of CPU; test/unit/test_hf_reference.py checks that the two agree."""
    ids = list(prompt)
    logprobs: list[float] = []
    step, past = torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(step, cache=past, use_cache=True)
            past = out.cache
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
            step = torch.tensor([[token]])
    return ids[len(prompt) :], logprobs


TINY_DRAFT_VOCAB = 96  # EAGLE3's reduced draft vocabulary in the tiny heads


def make_tiny_eagle_head(
    kind: str,
    path: str | Path,
    seed: int = 0,
    aux_layer_ids: list[int] | None = None,
    with_embedding: bool = True,
) -> Path:
    """A random EAGLE ('eagle') or EAGLE3 ('eagle3') head for the tiny 'llama' target, in the HF
    format SGLang loads: config.json + model.safetensors with the real checkpoints' key names.
    EAGLE: fc (2h -> h, bias), layers.0.* without input_layernorm (and an embed_tokens the engine
    ignores, as real checkpoints carry one). EAGLE3: fc (3h -> h), midlayer.* (q/k/v over 2h,
    hidden_norm), norm, lm_head over TINY_DRAFT_VOCAB tokens, d2t / t2d. `aux_layer_ids` goes to
    eagle_config.eagle_aux_hidden_state_layer_ids (the tiny target has too few layers for SGLang's
    default choice)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target = {**_COMMON, **TINY_CONFIGS["llama"]}
    target.pop("model_type")
    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.25) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return torch.rand(h, generator=gen) + 0.5

    attn_in = h if kind == "eagle" else 2 * h
    layer = {
        "self_attn.q_proj.weight": rand(heads * d, attn_in),
        "self_attn.k_proj.weight": rand(kv_heads * d, attn_in),
        "self_attn.v_proj.weight": rand(kv_heads * d, attn_in),
        "self_attn.o_proj.weight": rand(h, heads * d),
        "mlp.gate_proj.weight": rand(inter, h),
        "mlp.up_proj.weight": rand(inter, h),
        "mlp.down_proj.weight": rand(h, inter),
        "post_attention_layernorm.weight": norm_weight(),
    }
    config: dict[str, Any] = {**target, "num_hidden_layers": 1, "torch_dtype": "float32"}
    if kind == "eagle":
        config["architectures"] = ["LlamaForCausalLMEagle"]
        tensors = {f"layers.0.{k}": v for k, v in layer.items()}
        tensors["fc.weight"] = rand(h, 2 * h, std=0.125)
        tensors["fc.bias"] = rand(h, std=0.1)
        if with_embedding:
            tensors["embed_tokens.weight"] = rand(TINY_VOCAB, h)
    elif kind == "eagle3":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
        config["draft_vocab_size"] = TINY_DRAFT_VOCAB
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        layer["input_layernorm.weight"] = norm_weight()
        layer["hidden_norm.weight"] = norm_weight()
        tensors = {f"midlayer.{k}": v for k, v in layer.items()}
        tensors["fc.weight"] = rand(h, 3 * h, std=0.1)
        tensors["norm.weight"] = norm_weight()
        tensors["lm_head.weight"] = rand(TINY_DRAFT_VOCAB, h)
        hot = torch.randperm(TINY_VOCAB - 3, generator=gen)[:TINY_DRAFT_VOCAB].sort().values + 3
        tensors["d2t"] = hot - torch.arange(TINY_DRAFT_VOCAB)
        t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
        if with_embedding:
            tensors["embed_tokens.weight"] = rand(TINY_VOCAB, h)
    else:
        raise ValueError(f"unknown EAGLE head kind {kind!r} (eagle, eagle3)")
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
