"""Random PEFT LoRA adapters for the tiny test models, written with peft itself."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> (rank, lora_alpha, target modules): different ranks, different projections.
TINY_ADAPTERS: dict[str, tuple[int, int, list[str]]] = {
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp4": (4, 4, ["gate_proj", "up_proj", "down_proj"]),
    "all16": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_tiny_adapter(base_path: str | Path, name: str, path: str | Path, seed: int = 0) -> Path:
    """Write adapter `name` of TINY_ADAPTERS for the model at `base_path` to `path`. Both A and B
    are random (PEFT's default B is zero, which would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rank, alpha, modules = TINY_ADAPTERS[name]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    path = Path(path)
    model.save_pretrained(path)
    return path
