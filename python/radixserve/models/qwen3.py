"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from radixserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
