"""LoRA adapters: PEFT loading, the compute pool, the batched delta and the admission gate (docs/lora.md)."""
